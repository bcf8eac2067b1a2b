"""Data sets: their records, where their files come from, and loading one.

Each data set is one `Corpus` record (§5.1 names the paper's; ours are Multi30k, IWSLT14
and the copy task). `load_dataset` locates the files (a local mirror, the data folder,
or a download), reads them carefully, builds the vocabulary with the notebook's `Vocab`
or `Subwords` (cached), and numbers every split. Downloading and reading a file are in
`datafiles.py`, IWSLT14's preparation from its raw archive in `iwslt.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tarfile
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from .datafiles import DataError, download, file_problem, read_parallel
from .iwslt import prepare_iwslt14
from .parts import notebook
from .runfiles import read_verified, write_with_digest

if TYPE_CHECKING:
    from the_annotated_transformer import Subwords, Vocab

    from .config import Config


@dataclass(frozen=True)
class Corpus:
    """One data set, as every part of the program needs it (our addition; §5.1 names the
    paper's)."""

    name: str
    src: str = "de"  # source language
    tgt: str = "en"  # target language
    files: MappingProxyType = field(
        default_factory=lambda: MappingProxyType({})
    )  # split → (source file, target file) in the data set's folder
    # where the files are published (a folder), or the one archive that holds them
    url: str = ""
    sha256: MappingProxyType = field(
        default_factory=lambda: MappingProxyType({})
    )  # file → pinned SHA-256 of the download; others unchecked
    # "": the files are downloaded as they are; "fairseq-iwslt14": an archive to prepare
    prepare: str = ""
    # a split that stands in for "train" when only it is there (a training sample)
    sample: str = ""
    # the validation pairs were held out of the training talks (may train; see Config)
    valid_from_train: bool = False
    extra_tests: MappingProxyType = field(
        default_factory=lambda: MappingProxyType({})
    )  # further test splits, looked for only when asked
    # word-level tokenizer: "spacy" (its rules, for raw text) or "whitespace"
    words: str = "whitespace"
    # words back to text: "moses" (sacremoses, for raw text) or "join" (with spaces)
    detokenize: str = "join"
    # sacreBLEU's tokenizer: "13a" for raw, cased text; "none" for tokenized text
    bleu_tokenize: str = "none"
    synthetic: bool = False  # generated (the copy task), no files

    @property
    def bleu_kind(self) -> str:
        """How its BLEU is described in logs and results, from how it is tokenized for
        scoring."""
        return "tokenized" if self.bleu_tokenize == "none" else "detokenized cased"


# The three records. Multi30k's files are published one by one and pinned; IWSLT14 is
# published as the raw TED archive, which `prepare_iwslt14` (`iwslt.py`) turns into the
# standard layout, and a folder holding only its training sample still trains (Part 4).
# IWSLT14's validation pairs are every 23rd line of the training talks
# (`valid_from_train`).

CORPORA = MappingProxyType(
    {
        c.name: c
        for c in (
            Corpus("copy", synthetic=True),
            Corpus(
                "multi30k",  # raw, cased image captions; test = test2016 (flickr)
                files=MappingProxyType(
                    {
                        "train": ("train.de.gz", "train.en.gz"),
                        "valid": ("val.de.gz", "val.en.gz"),
                        "test": ("test_2016_flickr.de.gz", "test_2016_flickr.en.gz"),
                    }
                ),
                url="https://raw.githubusercontent.com/multi30k/dataset/master/"
                "data/task1/raw/",
                sha256=MappingProxyType(
                    {
                        "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f"
                        "80fae06ffc5d28b6ace5faa883de28a6",
                        "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a"
                        "882c3a8a961923c25a898c90f8bbd56f",
                        "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3"
                        "ad3f51657ad873405082ff6863a5e75a",
                        "val.en.gz": "14f7d25ddd868909a9213e361768460e"
                        "dcacdd6ab9d1e77b92560dc10c10dc28",
                        "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15"
                        "005fc42a07a6e55ca6c52b6ababb8cc8",
                        "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf"
                        "5c4413c5befc793cc629934359d532d9",
                    }
                ),
                extra_tests=MappingProxyType(
                    {  # the 2017 and 2018 shared tasks' test sets; no checksum known
                        "test_2017_flickr": (
                            "test_2017_flickr.de.gz",
                            "test_2017_flickr.en.gz",
                        ),
                        "test_2018_flickr": (
                            "test_2018_flickr.de.gz",
                            "test_2018_flickr.en.gz",
                        ),
                    }
                ),
                words="spacy",
                detokenize="moses",
                bleu_tokenize="13a",
            ),
            Corpus(
                # TED talks, fairseq's layout: Moses-tokenized, lowercased (see
                # REPRODUCTION_NOTES.md)
                "iwslt14",
                files=MappingProxyType(
                    {
                        "train": ("train.de", "train.en"),
                        "valid": ("valid.de", "valid.en"),
                        "test": ("test.de", "test.en"),
                        "train-sample": ("train-sample.de", "train-sample.en"),
                    }
                ),
                # the archive: not pinned
                url="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
                prepare="fairseq-iwslt14",
                sample="train-sample",
                valid_from_train=True,
            ),
        )
    }
)


# Building a vocabulary means tokenizing the whole training split, so the result is
# cached under a key made from the training files' bytes and the settings that shape it.


def _files_digest(paths: Iterable[Path], extra: str) -> str:
    """SHA-256 over the files' bytes and ``extra``: the key of a vocabulary cache."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def build_vocabs(
    train_tokens: tuple[list, list],
    cfg: Config,
    cache_key: Optional[str] = None,
    cache_dir: Optional[Path] = None,
) -> tuple[Vocab, Vocab]:
    """(source vocab, target vocab) from the training tokens; one shared object if
    ``cfg.shared_vocab``.

    With ``cache_key`` and ``cache_dir`` the result is read from / written to
    ``cache_dir/vocab-<key>.json``.
    """
    nb = notebook()
    path = (
        Path(cache_dir) / f"vocab-{cache_key}.json" if cache_key and cache_dir else None
    )
    if path is not None and path.is_file():
        try:
            saved = json.loads(read_verified(path).decode("utf-8"))
            src = nb.Vocab(saved["src"])
            nb.Vocab(saved["tgt"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"the cached vocabulary {path} is damaged ({e}); delete it and rerun"
            ) from None
        return (src, src) if cfg.shared_vocab else (src, nb.Vocab(saved["tgt"]))
    src_sents, tgt_sents = train_tokens
    if cfg.shared_vocab:
        src = tgt = nb.Vocab.build(list(src_sents) + list(tgt_sents), cfg.min_freq)
    else:
        src, tgt = (
            nb.Vocab.build(src_sents, cfg.min_freq),
            nb.Vocab.build(tgt_sents, cfg.min_freq),
        )
    if path is not None:
        text = json.dumps({"src": src.itos, "tgt": tgt.itos}, ensure_ascii=False)
        write_with_digest(path, (text + "\n").encode("utf-8"))
    return src, tgt


def build_subwords(
    train_pairs: Sequence[tuple[str, str]],
    cfg: Config,
    cache_key: Optional[str] = None,
    cache_dir: Optional[Path] = None,
) -> Subwords:
    """The joint BPE model of the training pairs (both sides), read from / written to
    ``cache_dir/bpe-<key>.model``."""
    nb = notebook()
    path = (
        Path(cache_dir) / f"bpe-{cache_key}.model" if cache_key and cache_dir else None
    )
    if path is not None and path.is_file():
        try:
            return nb.Subwords(read_verified(path))
        except (RuntimeError, ValueError) as e:  # sentencepiece: "INTERNAL: …"
            raise DataError(
                f"the cached BPE model {path} is damaged "
                f"({str(e).strip().splitlines()[0] if str(e).strip() else e!r}); "
                "delete it and rerun"
            ) from None
    subwords = nb.Subwords.train(
        [s for pair in train_pairs for s in pair], cfg.bpe_size
    )
    if path is not None:
        write_with_digest(path, subwords.model_proto)
    return subwords


# ## Where the data comes from
#
# Each data set is a folder of parallel files. The loader looks, in order, in a local
# **mirror** folder (`Config.data_mirror`, or the environment variable `DATA_MIRROR`),
# then in its own data folder (`Config.data_dir`, or `ANNOTATED_TRANSFORMER_DATA`, or
# `./data`), and finally downloads what is missing. Downloads (`download`, in
# `datafiles.py`) are checked against a pinned SHA-256 where one is known and are
# written atomically (to a temporary file that is renamed only when complete). For
# IWSLT14 the download is the raw TED archive, which `prepare_iwslt14` (`iwslt.py`)
# turns into the standard layout.

# Where the files are published and which checksums are pinned is in each data set's
# record (Part 2, `CORPORA`). Downloads and caches go to the data folder:


def default_data_dir() -> Path:
    """``$ANNOTATED_TRANSFORMER_DATA`` or ``./data``: where downloads and caches go."""
    return Path(os.environ.get("ANNOTATED_TRANSFORMER_DATA", "data"))


# Finding a data set yields a `DataSource`: its files, and a sentence saying where they
# came from, which the run log repeats.


@dataclass(frozen=True)
class DataSource:
    """Where a data set's files are: ``files`` maps split → (source path, target
    path)."""

    name: str
    files: dict
    # a sentence for the user: "mirror $DATA_MIRROR/multi30k", "downloaded to …"
    origin: str


# Downloading, as the record says: files as published (Multi30k's six, checked against
# the pinned sums), or an archive to prepare (IWSLT14's, through `prepare_iwslt14`). A
# corrupt archive is removed so that the next attempt downloads it again.


def fetch_dataset(name: str, data_dir: Path, url_base: Optional[str] = None) -> Path:
    """Download data set ``name`` into ``data_dir/name`` as its record says
    (``url_base`` replaces its url)."""
    corpus, folder = CORPORA[name], Path(data_dir) / name
    if (
        not corpus.prepare
    ):  # the files as published, each checked against its pinned sum
        for pair in corpus.files.values():
            for f in pair:
                if not (folder / f).is_file():
                    download(
                        (url_base or corpus.url) + f, folder / f, corpus.sha256.get(f)
                    )
        return folder
    archive = Path(data_dir) / "downloads" / f"{name}-{Path(corpus.url).name}"
    if not archive.is_file():
        download(
            url_base or corpus.url, archive, corpus.sha256.get(Path(corpus.url).name)
        )
    try:
        {"fairseq-iwslt14": prepare_iwslt14}[corpus.prepare](
            archive, folder, corpus.src, corpus.tgt
        )
    except (tarfile.TarError, EOFError) as e:
        archive.unlink(missing_ok=True)  # a corrupt download must not stick
        raise DataError(
            f"{archive} is not a readable archive ({e}); removed, try again"
        ) from e
    return folder


# `locate_dataset` tries the mirror, then the data folder, then downloading, and says
# which one it used. Offline, with no mirror and nothing downloaded before, it fails
# once, with a message that names both ways to get the data.


def locate_dataset(
    name: str, cfg: Config, url_base: Optional[str] = None
) -> DataSource:
    """Find (or fetch) data set ``name`` — mirror first, then the data folder, then
    download.

    ``url_base`` replaces the download location (tests pass ``file://`` URLs).
    """
    if name not in CORPORA or CORPORA[name].synthetic:
        raise DataError(
            f"unknown data set {name!r} "
            f"(known: {', '.join(n for n, c in CORPORA.items() if c.files)})"
        )
    corpus = CORPORA[name]
    layout = corpus.files
    mirror = cfg.data_mirror or os.environ.get("DATA_MIRROR", "")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()

    def complete_split(folder: Path, split: str) -> bool:
        return bool(split) and all((folder / f).is_file() for f in layout[split])

    def complete(folder: Path) -> Optional[dict]:
        files = {}
        for split, (s, t) in layout.items():
            if (folder / s).is_file() and (folder / t).is_file():
                files[split] = (folder / s, folder / t)
        if corpus.sample and "train" not in files and corpus.sample in files:
            files["train"] = files.pop(corpus.sample)
            files["train-is-sample"] = True
        files.pop(corpus.sample, None)
        return files if all(k in files for k in ("train", "valid", "test")) else None

    shown = (
        Path(cfg.data_mirror or "$DATA_MIRROR") / name
    )  # name the setting, not this machine's path
    candidates = [(Path(mirror) / name, f"mirror {shown}")] if mirror else []
    candidates.append((data_dir / name, f"data folder {data_dir / name}"))
    # a folder with only the IWSLT14 training sample, used if no full one exists
    sample = None
    for folder, origin in candidates:
        files = complete(folder)
        if files and files.pop("train-is-sample", False):
            sample = sample or DataSource(
                name,
                files,
                origin
                + f" (the training *sample* {'/'.join(corpus.files[corpus.sample])}: "
                f"the full {'/'.join(corpus.files['train'])} are not there)",
            )
        elif files:
            return DataSource(name, files, origin)
    if sample is not None:
        return sample

    problems = []  # the files of a folder that is there but incomplete, named
    for folder, origin in candidates:
        if folder.is_dir():
            wanted = [
                f
                for split in ("train", "valid", "test")
                for f in layout[split]
                if split != "train" or not complete_split(folder, corpus.sample)
            ]
            named = [f"{f} {why}" for f in wanted if (why := file_problem(folder / f))]
            if named:
                problems.append(f"{origin}: {'; '.join(named)}")
    found = f" {'; '.join(problems)}." if problems else ""
    how = (
        f"Either point DATA_MIRROR (or --data_mirror) at a folder that holds {name}/ "
        f"with {', '.join(f for pair in layout.values() for f in pair)}, "
        f"or go online so that it can be downloaded into {data_dir / name}."
    )
    if not cfg.download:
        raise DataError(
            f"{name} not found "
            f"(looked in: {', '.join(o for _, o in candidates)}).{found} {how}"
        )
    folder = data_dir / name
    try:
        fetch_dataset(name, data_dir, url_base)
    except (OSError, urllib.error.URLError) as e:
        raise DataError(f"could not download {name} ({e}).{found} {how}") from e
    files = complete(folder)
    if not files:
        raise DataError(f"{name}: download finished but files are missing in {folder}")
    files.pop("train-is-sample", None)
    return DataSource(name, files, f"downloaded to {folder}")


# Multi30k has two more test sets of Flickr captions, from the 2017 and 2018 shared
# tasks, in the same `raw/` folder (its record's `extra_tests`). Training never needs
# them; `evaluate --split test_2017_flickr` (or `test_2018_flickr`) scores a model on
# them. They are looked for in the same places and downloaded the same way, but
# **without** a checksum: we know no authoritative SHA-256 for them, so they are not
# pinned.


def locate_test_split(
    name: str, split: str, cfg: Config, url_base: Optional[str] = None
) -> tuple[Path, Path]:
    """(source file, target file) of a test split of data set ``name``: mirror, then
    data folder, then download.

    ``split`` is ``"test"`` (the one training scores), ``"valid"`` (the one it validates
    on) or one of the record's ``extra_tests``.
    """
    corpus = CORPORA[name]
    if split in ("test", "valid"):
        return locate_dataset(name, cfg, url_base=url_base).files[split]
    if split not in corpus.extra_tests:
        raise DataError(
            f"{name} has no split {split!r} here "
            f"(known: {', '.join(['test', 'valid', *corpus.extra_tests])}); "
            "give --src and --ref"
        )
    names = corpus.extra_tests[split]
    mirror = cfg.data_mirror or os.environ.get("DATA_MIRROR", "")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    folders = ([Path(mirror) / name] if mirror else []) + [data_dir / name]
    for folder in folders:
        if all((folder / f).is_file() for f in names):
            return folder / names[0], folder / names[1]
    hint = (
        f"point DATA_MIRROR (or --data_mirror) at a folder that holds "
        f"{name}/{names[0]} and {name}/{names[1]}"
    )
    if not cfg.download:
        raise DataError(
            f"{split} not found in {', '.join(map(str, folders))}, and downloading is "
            f"off; {hint}"
        )
    try:
        return tuple(
            download((url_base or corpus.url) + f, data_dir / name / f) for f in names
        )
    except (OSError, urllib.error.URLError) as e:
        raise DataError(f"could not download {name} {split} ({e}); {hint}") from e


# ### Words
#
# Reading the files (`read_parallel`, in `datafiles.py`) gives sentence pairs; for word
# vocabularies they are split into words as the record says: spaCy's rules for raw text
# (Multi30k), spaces for text that comes tokenized (IWSLT14). BPE splits them itself.


def make_tokenizer(dataset: str, lang: str) -> Callable[[list[str]], list[list[str]]]:
    """A batch word tokenizer as ``dataset``'s record says: spaCy's rules for ``lang``,
    or whitespace.

    ``spacy.blank(lang)`` carries the same tokenizer rules as spaCy's trained pipelines,
    without their weights.
    """
    if CORPORA[dataset].words == "spacy":
        import spacy

        nlp = spacy.blank(lang)

        def spacy_tokenize(lines: list[str]) -> list[list[str]]:
            return [
                [t.text for t in doc if not t.is_space]
                for doc in nlp.tokenizer.pipe(lines, batch_size=2000)
            ]

        return spacy_tokenize
    return lambda lines: [line.split() for line in lines]


# ### Putting a data set together
#
# A `Dataset` is everything training needs: the vocabularies, the id sequences of each
# split (each with `<s>` … `</s>` around it), the raw test references for BLEU, and the
# counts of what was skipped or filtered. The copy task of Part 4 is generated straight
# into one.


@dataclass
class Dataset:
    """Splits as lists of (source ids, target ids), vocabularies, and what was
    dropped."""

    name: str
    src_vocab: Vocab
    tgt_vocab: Vocab
    splits: dict  # split → list of (src ids, tgt ids)
    test_refs: list  # reference strings for BLEU, aligned with splits["test"]
    origin: str = ""
    stats: dict = field(default_factory=dict)
    subwords: Optional[Subwords] = None  # the BPE model when cfg.vocab == "bpe"


def make_copy_data(
    cfg: Config, vocab_size: int = 11, length: int = 10, sizes: tuple = (1600, 160, 100)
) -> Dataset:
    """The synthetic copy task: random sequences of symbols that the target repeats.

    Symbols are the strings "1" … str(vocab_size - 1); with the four specials that is a
    vocabulary of vocab_size + 3. Deterministic for a given ``cfg.seed``.
    """
    nb = notebook()
    rng = random.Random(cfg.seed)
    vocab = nb.Vocab(list(nb.SPECIALS) + [str(i) for i in range(1, vocab_size)])
    splits = {  # the notebook's copy_task (Part 2), one split after the other
        split: nb.copy_task(n, rng, vocab_size - 1, length)
        for split, n in zip(("train", "valid", "test"), sizes)
    }
    refs = [" ".join(vocab.lookup_tokens(src[1:-1])) for src, _ in splits["test"]]
    return Dataset("copy", vocab, vocab, splits, refs, origin="generated", stats={})


# `load_dataset` is the one entry point: locate, read, build the vocabulary (words or
# BPE), filter over-long training pairs, turn every split into ids, and report what it
# dropped.


def load_dataset(
    cfg: Config, log: Callable = print, url_base: Optional[str] = None
) -> Dataset:
    """Locate, read, tokenize and number the data set ``cfg.dataset``; report what was
    dropped."""
    data = _load_dataset(cfg, log, url_base)
    longest = (
        max(
            (len(ids), split)
            for split, pairs in data.splits.items()
            for pair in pairs
            for ids in pair
        )
        if any(data.splits.values())
        else (0, "")
    )
    if longest[0] > cfg.max_len:
        raise DataError(
            f"--max_len {cfg.max_len} is shorter than the data: its {longest[1]} split "
            f"holds a sequence of {longest[0]} positions (<s> and </s> included); "
            f"give --max_len {longest[0]} or more (or a smaller --max_tokens)"
        )
    return data


def _load_dataset(
    cfg: Config, log: Callable = print, url_base: Optional[str] = None
) -> Dataset:
    nb = notebook()
    corpus = CORPORA[cfg.dataset]
    if corpus.synthetic:
        return make_copy_data(cfg)
    source = locate_dataset(cfg.dataset, cfg, url_base=url_base)
    raw, stats = {}, {}
    for split in ("train", "valid", "test"):
        raw[split], stats[f"{split}_empty_skipped"] = read_parallel(
            *source.files[split]
        )
        if not raw[split]:  # nothing to train on, validate or score
            src_file, tgt_file = source.files[split]
            raise DataError(
                f"{src_file} and {tgt_file} hold no sentence pairs "
                f"({stats[f'{split}_empty_skipped']:,} empty line(s) skipped); give "
                "files with one sentence per line"
            )
        stats[f"{split}_pairs"] = len(raw[split])
    vocab_files, held = source.files["train"], ""
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    subwords = None
    if cfg.vocab == "bpe":
        key = _files_digest(vocab_files, f"bpe|{cfg.dataset}|{cfg.bpe_size}{held}")
        subwords = build_subwords(raw["train"], cfg, key, data_dir / "cache")
        tok_src = tok_tgt = subwords.encode
    else:
        tok_src, tok_tgt = (
            make_tokenizer(cfg.dataset, corpus.src),
            make_tokenizer(cfg.dataset, corpus.tgt),
        )
    tokens = {
        split: (tok_src([p[0] for p in pairs]), tok_tgt([p[1] for p in pairs]))
        for split, pairs in raw.items()
    }
    src_t, tgt_t = tokens["train"]
    keep = [
        i
        for i in range(len(src_t))
        if len(src_t[i]) <= cfg.max_tokens and len(tgt_t[i]) <= cfg.max_tokens
    ]
    stats["train_too_long_filtered"] = len(src_t) - len(keep)
    tokens["train"] = ([src_t[i] for i in keep], [tgt_t[i] for i in keep])
    stats["train_pairs"] = len(keep)
    if subwords is not None:
        src_vocab = tgt_vocab = subwords.vocab
    else:
        key = _files_digest(
            vocab_files,
            f"{cfg.dataset}|{cfg.min_freq}|{cfg.shared_vocab}|{cfg.max_tokens}{held}",
        )
        src_vocab, tgt_vocab = build_vocabs(
            tokens["train"], cfg, key, data_dir / "cache"
        )
    splits = {
        split: [
            ([nb.BOS] + src_vocab(s) + [nb.EOS], [nb.BOS] + tgt_vocab(t) + [nb.EOS])
            for s, t in zip(*tokens[split])
        ]
        for split in ("train", "valid", "test")
    }
    unk = sum(ids.count(nb.UNK) for pair in splits["test"] for ids in pair)
    stats["test_unk_share"] = round(
        unk / max(sum(len(ids) - 2 for pair in splits["test"] for ids in pair), 1), 4
    )
    log(
        f"data: {cfg.dataset} from {source.origin}; "
        + ", ".join(f"{k}={v:,}" for k, v in stats.items())
        + f"; {'BPE' if subwords else 'word'} vocab {len(src_vocab):,}"
        + ("" if src_vocab is tgt_vocab else f"/{len(tgt_vocab):,}")
    )
    return Dataset(
        cfg.dataset,
        src_vocab,
        tgt_vocab,
        splits,
        [p[1] for p in raw["test"]],
        source.origin,
        stats,
        subwords,
    )

"""§5.1 byte-pair encoding: a joint subword vocabulary, built from the training split only,
cached, and carried by checkpoints so that a checkpoint alone can translate."""

import dataclasses
import gzip
import os
from pathlib import Path

import pytest
import torch

import machinery
import the_annotated_transformer as tat
from the_annotated_transformer import BOS, EOS, SPECIALS, UNK
from conftest import quiet  # noqa: E402


def write_gz(path: Path, lines):
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8")))


ANIMALS = ["Hund", "Katze", "Pferd", "Vogel", "Fisch", "Maus"]
ENGLISH = {
    "Hund": "dog",
    "Katze": "cat",
    "Pferd": "horse",
    "Vogel": "bird",
    "Fisch": "fish",
    "Maus": "mouse",
}


def small_mirror(root: Path, test_extra: str = "") -> Path:
    """A Multi30k-shaped mirror of short made-up captions; ``test_extra`` is appended to the first test source."""
    folder = root / "multi30k"
    folder.mkdir(parents=True)
    train = [
        (f"Ein {a} sieht einen {b}.", f"A {ENGLISH[a]} sees a {ENGLISH[b]}.")
        for a in ANIMALS
        for b in ANIMALS
    ] * 3
    valid = train[:5]
    test = [
        (f"Ein Hund sieht eine Katze{test_extra}.", "A dog sees a cat."),
        ("Ein Vogel.", "A bird."),
    ]
    for split, pairs in (("train", train), ("valid", valid), ("test", test)):
        de, en = machinery.CORPORA["multi30k"].files[split]
        write_gz(folder / de, [p[0] for p in pairs])
        write_gz(folder / en, [p[1] for p in pairs])
    return root


def bpe_cfg(mirror: Path, tmp_path: Path, **kw) -> machinery.Config:
    settings = dict(
        dataset="multi30k",
        vocab="bpe",
        bpe_size=60,
        data_mirror=str(mirror),
        data_dir=str(tmp_path / "data"),
        device="cpu",
        precision="fp32",
    )
    settings.update(kw)
    return machinery.get_config("tiny", **settings)


@pytest.fixture(scope="module")
def multi30k_bpe(tmp_path_factory, mirror):
    """The multi30k-small preset's BPE data set, from the real mirror (skipped without it)."""
    if not (mirror / "multi30k").is_dir():
        pytest.skip(f"no Multi30k in the data mirror at {mirror}")
    cfg = machinery.get_config(
        "multi30k-small",
        data_mirror=str(mirror),
        data_dir=str(tmp_path_factory.mktemp("data")),
    )
    return cfg, machinery.load_dataset(cfg, log=quiet), mirror


def test_presets_use_one_joint_bpe_vocabulary_with_three_way_tying():
    for name in ("base", "big", "multi30k-small", "iwslt14-small"):
        cfg = machinery.PRESETS[name]
        assert cfg.vocab == "bpe" and cfg.shared_vocab and cfg.tie_weights, name
    assert machinery.PRESETS["iwslt14-small"].bpe_size == 10_000
    assert machinery.PRESETS["base"].bpe_size == 37_000


def test_pieces_decode_back_to_the_sentence(multi30k_bpe):
    cfg, data, mirror = multi30k_bpe
    for name in ("test_2016_flickr.de.gz", "test_2016_flickr.en.gz"):
        lines = [
            line.strip() for line in machinery.read_lines(mirror / "multi30k" / name)
        ]
        pieces = data.subwords.encode(lines)
        assert data.subwords.decode(pieces) == lines
        assert sum(map(len, pieces)) > sum(
            len(line.split()) for line in lines
        )  # rare words are split


def test_no_unk_on_the_training_text_and_one_shared_vocabulary(multi30k_bpe):
    cfg, data, _ = multi30k_bpe
    assert data.src_vocab is data.tgt_vocab and len(data.src_vocab) == cfg.bpe_size
    assert data.src_vocab.itos[:4] == list(SPECIALS)
    assert not any(UNK in ids for pair in data.splits["train"] for ids in pair)
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    assert (
        model.src_embed[0].lut.weight
        is model.tgt_embed[0].lut.weight
        is model.generator.proj.weight
    )


def test_sentencepiece_is_deterministic_the_same_text_gives_the_same_model(mirror):
    # the notebook: sentencepiece "is fast, deterministic"
    if not (mirror / "multi30k").is_dir():
        pytest.skip(f"no Multi30k in the data mirror at {mirror}")
    text = [
        line.strip()
        for name in ("val.de.gz", "val.en.gz")
        for line in machinery.read_lines(mirror / "multi30k" / name)
    ]
    first, again = (tat.Subwords.train(text, 1000) for _ in range(2))
    assert first.model_proto == again.model_proto
    assert first.encode(text[:50]) == again.encode(text[:50])
    other = tat.Subwords.train(text[1:], 1000)  # other text: another model
    assert other.model_proto != first.model_proto


def test_a_rare_compound_is_spelled_with_known_pieces(multi30k_bpe):
    _, data, _ = multi30k_bpe
    word = "Eisenbahnbrückengeländer"
    pieces = data.subwords.encode([word])[0]
    assert len(pieces) > 1 and "".join(pieces).lstrip("▁") == word
    assert UNK not in data.src_vocab(pieces)


def test_the_bpe_model_is_built_from_the_training_split_only(tmp_path):
    mirror = small_mirror(
        tmp_path / "m", test_extra=" Ω"
    )  # Ω occurs only in the test set
    data = machinery.load_dataset(bpe_cfg(mirror, tmp_path), log=quiet)
    assert not any("Ω" in piece for piece in data.src_vocab.itos)
    first_test_source = data.splits["test"][0][0]
    assert first_test_source[0] == BOS and first_test_source[-1] == EOS
    assert UNK in first_test_source  # the unseen character becomes <unk> …
    assert data.stats["test_unk_share"] > 0
    assert not any(
        UNK in ids for pair in data.splits["train"] for ids in pair
    )  # … and never in training
    # retraining on the training lines alone gives the very same model
    files = machinery.locate_dataset("multi30k", bpe_cfg(mirror, tmp_path)).files[
        "train"
    ]
    train_pairs, _ = machinery.read_parallel(*files)
    assert tat.Subwords.train([s for p in train_pairs for s in p], 60) == data.subwords


def test_the_bpe_model_is_cached_and_keyed_on_its_settings_and_data(tmp_path):
    mirror = small_mirror(tmp_path / "m")
    cfg = bpe_cfg(mirror, tmp_path)
    first = machinery.load_dataset(cfg, log=quiet)
    cache = tmp_path / "data" / "cache"
    models = sorted(cache.glob("bpe-*.model"))
    assert len(models) == 1 and models[0].read_bytes() == first.subwords.model_proto
    stamp = models[0].stat().st_mtime_ns
    assert machinery.load_dataset(cfg, log=quiet).subwords == first.subwords
    assert models[0].stat().st_mtime_ns == stamp  # read, not rewritten
    machinery.load_dataset(dataclasses.replace(cfg, bpe_size=50), log=quiet)
    assert len(list(cache.glob("bpe-*.model"))) == 2
    # and on the training files' contents: two one-word edits whose files have the same
    # size and time stamp (a key of size and time would take the second for the first)
    de = mirror / "multi30k" / machinery.CORPORA["multi30k"].files["train"][0]
    text = gzip.decompress(de.read_bytes()).decode()
    one = gzip.compress(text.replace("Hund", "Maus", 1).encode(), mtime=0)
    another = next(
        edited
        for word in ("Hunf", "hund", "Hunde", "Kuh", "Huhn")
        for edited in [gzip.compress(text.replace("Hund", word, 1).encode(), mtime=0)]
        if len(edited) == len(one)
    )
    for kept, contents in ((3, one), (4, another)):
        de.write_bytes(contents)
        os.utime(de, ns=(10**18, 10**18))
        machinery.load_dataset(cfg, log=quiet)
        assert len(list(cache.glob("bpe-*.model"))) == kept


@pytest.fixture
def bpe_run(tmp_path):
    mirror = small_mirror(tmp_path / "m")
    cfg = bpe_cfg(
        mirror,
        tmp_path,
        N=1,
        run_dir=str(tmp_path / "run"),
        max_steps=2,
        batch_tokens=200,
    )
    data = machinery.load_dataset(cfg, log=quiet)
    machinery.train(cfg, data=data, log=quiet, progress=False, evaluate=False)
    return cfg, data, machinery.checkpoint_paths(tmp_path / "run")[-1]


def test_the_checkpoint_carries_the_bpe_model_and_translates_alone(bpe_run):
    cfg, data, path = bpe_run
    state = machinery.load_checkpoint(path)
    subwords = machinery.checkpoint_subwords(state)
    assert subwords == data.subwords
    # everything needed to translate comes from the checkpoint file: model settings, weights, pieces
    saved = machinery.config_from_dict(state["config"])
    model = tat.make_model(len(subwords.vocab), len(subwords.vocab), saved)
    model.load_state_dict(state["model"])
    ids = (
        [BOS]
        + subwords.vocab(subwords.encode(["Ein Hund sieht eine Katze."])[0])
        + [EOS]
    )
    out = machinery.translate(model, [ids], subwords.vocab, saved, torch.device("cpu"))
    assert isinstance(
        tat.detokenize(out, machinery.CORPORA["multi30k"], subwords)[0], str
    )


def test_a_checkpoint_with_another_bpe_model_is_refused(bpe_run, tmp_path):
    cfg, data, path = bpe_run
    other = tat.Subwords.train(
        ["ganz andere Sätze", "other sentences entirely"] * 20, 40
    )
    with pytest.raises(machinery.CheckpointError, match="another BPE model"):
        machinery.load_checkpoint(path, subwords=other)
    # resuming the run on data whose BPE model differs is refused the same way
    changed = dataclasses.replace(data, subwords=other)
    with pytest.raises(machinery.CheckpointError, match="another BPE model"):
        machinery.train(
            dataclasses.replace(cfg, max_steps=3),
            data=changed,
            log=quiet,
            progress=False,
            evaluate=False,
        )


def test_word_vocabularies_remain_an_option(tmp_path):
    mirror = small_mirror(tmp_path / "m")
    data = machinery.load_dataset(
        bpe_cfg(mirror, tmp_path, vocab="words", min_freq=1), log=quiet
    )
    assert data.subwords is None
    assert "Hund" in data.src_vocab.stoi and "dog" in data.tgt_vocab.stoi
    with pytest.raises(ValueError, match="bpe or words"):
        machinery.Config(vocab="chars")

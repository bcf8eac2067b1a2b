"""Part 2 data pipeline: downloads and reading (machinery/datafiles.py), IWSLT14
preparation (machinery/iwslt.py), locating (machinery/data.py), and the notebook's
vocabularies and batching.

Everything here runs offline: downloads use ``file://`` URLs to files the tests create
under ``tmp_path``, and the real data is read (never written) from the local mirror.
"""

import dataclasses
import gzip
import hashlib
import io
import json
import random
import sys
import tarfile
from collections import Counter
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

import machinery
import the_annotated_transformer as tat
from machinery import DataError
from the_annotated_transformer import BOS, EOS, PAD, SPECIALS, UNK
from conftest import quiet  # noqa: E402


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def part_files(folder: Path) -> list:
    return [p for p in Path(folder).rglob("*") if p.name.endswith(".part")]


def add_corpus(monkeypatch, record) -> None:
    """``record`` in CORPORA for this test, as if written into machinery/data.py's
    table: every module that holds the table (the package's modules and the notebook)
    sees the one with the record."""
    table = machinery.data.CORPORA
    new = MappingProxyType({**table, record.name: record})
    for module in list(sys.modules.values()):
        if module is not None and vars(module).get("CORPORA") is table:
            monkeypatch.setattr(module, "CORPORA", new)
    assert machinery.data.CORPORA is new


@pytest.fixture
def offline(monkeypatch):
    """No mirror from the environment: only the config decides."""
    monkeypatch.delenv("DATA_MIRROR", raising=False)


# --------------------------------------------------------------------------------------
# A tiny fake raw IWSLT14 archive (the layout of fairseq's de-en.tgz)
# --------------------------------------------------------------------------------------

TEST_SETS = (
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
)


def _talk(talkid, title, description, sentences, lang):
    meta = [
        f"<url>http://www.ted.com/talks/talk_{talkid}.html</url>",
        "<keywords>talks, science, metadata</keywords>",
        "<speaker>Jane Metaspeaker</speaker>",
        f"<talkid>{talkid}</talkid>",
        f"<title>{title}</title>",
        f"<description>{description}</description>",
        '<reviewer href="http://example.org/r">Rita Metareviewer</reviewer>',
        '<translator href="http://example.org/t">Tom Metatranslator</translator>',
    ]
    return meta + sentences


def fake_iwslt_archive(path: Path, de_extra=(), en_extra=()):
    """Write a raw-IWSLT14-like archive; return the expected prepared (de, en) splits.

    ``de_extra`` / ``en_extra`` are raw lines appended to the end of the training talks.
    """
    sent_de = [f"Das ist Satz Nummer {i} hier." for i in range(50)]
    sent_en = [f"It's sentence number {i} here." for i in range(50)]
    exp_sent = [
        (f"das ist satz nummer {i} hier .", f"it &apos;s sentence number {i} here .")
        for i in range(50)
    ]
    # Two pairs whose length ratio exceeds 1.5, one in each direction: both must be
    # dropped.
    bad_de = [
        "Ja.",
        "Nein, das ist eine sehr viel längere Antwort als die englische hier.",
    ]
    bad_en = ["Yes, this is a much longer answer than the German one here.", "No."]

    de = (
        _talk(
            1,
            "Titel Eins",
            "Eine Beschreibung.",
            sent_de[:10] + bad_de + sent_de[10:25],
            "de",
        )
        + _talk(2, "Titel Zwei", "Noch eine Beschreibung.", sent_de[25:], "de")
        + list(de_extra)
    )
    en = (
        _talk(
            1,
            "Title One",
            "A description.",
            sent_en[:10] + bad_en + sent_en[10:25],
            "en",
        )
        + _talk(2, "Title Two", "Another description.", sent_en[25:], "en")
        + list(en_extra)
    )
    kept = (
        [("titel eins", "title one"), ("eine beschreibung .", "a description .")]
        + exp_sent[:25]
        + [
            ("titel zwei", "title two"),
            ("noch eine beschreibung .", "another description ."),
        ]
        + exp_sent[25:]
    )

    xml = {}
    expected_test = []
    for k, name in enumerate(TEST_SETS):
        segs_de = [f"Test {k} Satz {j} hier." for j in (1, 2)] + [
            f"Es ist Test {k} jetzt."
        ]
        segs_en = [f"Test {k} sentence {j} here." for j in (1, 2)] + [
            f"It\u2019s test {k} now."
        ]
        expected_test += [
            (f"test {k} satz {j} hier .", f"test {k} sentence {j} here .")
            for j in (1, 2)
        ]
        expected_test += [(f"es ist test {k} jetzt .", f"it &apos;s test {k} now .")]
        for lang, segs in (("de", segs_de), ("en", segs_en)):
            body = "\n".join(
                f'<seg id="{j}"> {s} </seg>' for j, s in enumerate(segs, start=1)
            )
            xml[f"{name}.de-en.{lang}.xml"] = (
                '<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n'
                f'<srcset setid="{name}" srclang="german">\n'
                f'<doc docid="{k}" genre="lectures">\n'
                f"<url>http://www.ted.com/talks/test_{k}.html</url>\n"
                "<description>Xml metadescription</description>\n"
                f"<talkid>{900 + k}</talkid>\n<title>Xml metatitle</title>\n"
                f"{body}\n</doc>\n</srcset>\n</mteval>\n"
            )

    members = {
        "train.tags.de-en.de": "\n".join(de) + "\n",
        "train.tags.de-en.en": "\n".join(en) + "\n",
    }
    members.update(
        reversed(list(xml.items()))
    )  # archive order must not decide the test order
    with tarfile.open(path, "w:gz") as tar:
        d = tarfile.TarInfo("de-en")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"de-en/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    valid = [p for i, p in enumerate(kept, start=1) if i % 23 == 0]
    train = [p for i, p in enumerate(kept, start=1) if i % 23 != 0]
    return {"train": train, "valid": valid, "test": expected_test}


def read_split(folder: Path, split: str):
    de = (folder / f"{split}.de").read_text(encoding="utf-8").split("\n")[:-1]
    en = (folder / f"{split}.en").read_text(encoding="utf-8").split("\n")[:-1]
    return de, en


# --------------------------------------------------------------------------------------
# 1. download()
# --------------------------------------------------------------------------------------


def test_download_with_matching_sha256_writes_the_same_bytes(tmp_path):
    src = tmp_path / "src" / "blob.bin"
    src.parent.mkdir()
    src.write_bytes(random.Random(0).randbytes(2_500_000))  # more than one 1 MiB chunk
    dest = tmp_path / "out" / "blob.bin"
    result = machinery.download(src.as_uri(), dest, sha256_of(src))
    assert Path(result) == dest
    assert dest.read_bytes() == src.read_bytes()
    assert part_files(tmp_path / "out") == []


def test_download_with_wrong_sha256_leaves_nothing_behind(tmp_path):
    src = tmp_path / "src" / "blob.bin"
    src.parent.mkdir()
    src.write_bytes(b"the real bytes\n" * 1000)
    out = tmp_path / "out"
    with pytest.raises(DataError, match="checksum"):
        machinery.download(src.as_uri(), out / "blob.bin", "0" * 64)
    assert not (out / "blob.bin").exists()
    assert list(out.iterdir()) == []  # no dest, no leftover ".part" temporary


def test_download_failure_keeps_an_existing_file_untouched(tmp_path):
    src = tmp_path / "new.bin"
    src.write_bytes(b"new, corrupt content")
    dest = tmp_path / "out" / "data.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"old complete content")
    with pytest.raises(DataError):
        machinery.download(src.as_uri(), dest, "f" * 64)
    assert dest.read_bytes() == b"old complete content"
    assert part_files(dest.parent) == []


# --------------------------------------------------------------------------------------
# 2. prepare_iwslt14()
# --------------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path):
    archive = tmp_path / "de-en.tgz"
    expected = fake_iwslt_archive(archive)
    out = tmp_path / "prepared"
    counts = machinery.prepare_iwslt14(archive, out)
    return out, counts, expected


def test_prepare_iwslt14_writes_aligned_files_for_every_split(prepared):
    out, counts, expected = prepared
    for split in ("train", "valid", "test"):
        assert (out / f"{split}.de").is_file() and (out / f"{split}.en").is_file()
        de, en = read_split(out, split)
        assert len(de) == len(en) == counts[split] == len(expected[split])
    assert counts["valid"] >= 2
    assert part_files(out) == []


def test_prepare_iwslt14_train_and_valid_follow_the_fairseq_recipe(prepared):
    """Metadata dropped, titles kept, Moses tokens with &apos;, lowercased, ratio
    filter, every 23rd → valid."""
    out, _, expected = prepared
    for split in ("train", "valid"):
        de, en = read_split(out, split)
        assert list(zip(de, en)) == expected[split]


def test_prepare_iwslt14_drops_metadata_and_the_ratio_filtered_pairs(prepared):
    out, _, _ = prepared
    text = "\n".join(
        "\n".join(read_split(out, s)[0] + read_split(out, s)[1])
        for s in ("train", "valid", "test")
    )
    for gone in (
        "<",
        ">",
        "http",
        "metaspeaker",
        "metareviewer",
        "metatranslator",
        "metadata",
        "metatitle",
        "metadescription",
        "ja .",
        "yes ,",
        "nein ,",
        "no .",
    ):
        assert gone not in text, gone
    assert text == text.lower()
    assert "it &apos;s sentence number 0 here ." in text
    assert "titel eins" in text and "title two" in text


def test_prepare_iwslt14_test_set_is_the_five_xml_sets_in_order(prepared):
    out, _, expected = prepared
    de, en = read_split(out, "test")
    assert (
        list(zip(de, en)) == expected["test"]
    )  # dev2010, dev2012, tst2010, tst2011, tst2012


def test_prepare_iwslt14_keeps_pairs_aligned_across_unicode_line_separators(tmp_path):
    """Lines are split on "\\n" only, as the fairseq recipe (grep/sed) and read_lines
    do.

    A U+2028 inside one side's sentence is whitespace to Moses, not a new line;
    splitting on it (str.splitlines) shifts or breaks the alignment of the two
    languages.
    """
    archive = tmp_path / "de-en.tgz"
    expected = fake_iwslt_archive(
        archive,
        de_extra=["Erste Zeile\u2028zweiter Teil."],
        en_extra=["First line second part."],
    )
    out = tmp_path / "prepared"
    machinery.prepare_iwslt14(archive, out)
    de, en = read_split(out, "train")
    pairs = list(zip(de, en))
    assert pairs[: len(expected["train"])] == expected["train"]
    assert pairs[len(expected["train"]) :] == [
        ("erste zeile zweiter teil .", "first line second part .")
    ]


# --------------------------------------------------------------------------------------
# 3. locate_dataset() through the download path
# --------------------------------------------------------------------------------------


def test_locate_iwslt14_downloads_and_prepares_the_archive(tmp_path, offline):
    archive = tmp_path / "raw" / "de-en.tgz"
    archive.parent.mkdir()
    expected = fake_iwslt_archive(archive)
    data_dir = tmp_path / "data"
    cfg = machinery.get_config(
        "tiny", dataset="iwslt14", data_mirror="", data_dir=str(data_dir)
    )
    source = machinery.locate_dataset("iwslt14", cfg, url_base=archive.as_uri())
    assert set(source.files) == {"train", "valid", "test"}
    for split, (s, t) in source.files.items():
        assert (
            s == data_dir / "iwslt14" / f"{split}.de"
            and t == data_dir / "iwslt14" / f"{split}.en"
        )
        assert (
            len(machinery.read_lines(s))
            == len(machinery.read_lines(t))
            == len(expected[split])
        )
    assert "downloaded" in source.origin
    assert (
        data_dir / "downloads" / "iwslt14-de-en.tgz"
    ).read_bytes() == archive.read_bytes()


def _fake_multi30k_source(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for split, (de, en) in machinery.CORPORA["multi30k"].files.items():
        for name, lang in ((de, "de"), (en, "en")):
            lines = [f"{split} {lang} satz {i}." for i in range(3)]
            (folder / name).write_bytes(
                gzip.compress(("\n".join(lines) + "\n").encode())
            )
    return {
        name: sha256_of(folder / name)
        for pair in machinery.CORPORA["multi30k"].files.values()
        for name in pair
    }


def test_locate_multi30k_downloads_the_six_files(tmp_path, offline, monkeypatch):
    src = tmp_path / "remote"
    sums = MappingProxyType(
        _fake_multi30k_source(src)
    )  # the record's pins, for these stand-in files
    record = dataclasses.replace(machinery.CORPORA["multi30k"], sha256=sums)
    add_corpus(monkeypatch, record)
    data_dir = tmp_path / "data"
    cfg = machinery.get_config(
        "tiny", dataset="multi30k", data_mirror="", data_dir=str(data_dir)
    )
    source = machinery.locate_dataset("multi30k", cfg, url_base=src.as_uri() + "/")
    assert set(source.files) == {"train", "valid", "test"}
    assert "downloaded" in source.origin
    for split, (de, en) in machinery.CORPORA["multi30k"].files.items():
        assert source.files[split] == (
            data_dir / "multi30k" / de,
            data_dir / "multi30k" / en,
        )
        for name in (de, en):
            assert (data_dir / "multi30k" / name).read_bytes() == (
                src / name
            ).read_bytes()
    # Once downloaded, the files are found in the data folder without going online
    # again.
    again = machinery.locate_dataset(
        "multi30k", cfg, url_base=(tmp_path / "nowhere").as_uri() + "/"
    )
    assert again.files == source.files and "data folder" in again.origin


def test_locate_multi30k_rejects_files_that_do_not_match_the_pinned_sha256(
    tmp_path, offline
):
    src = tmp_path / "remote"
    _fake_multi30k_source(
        src
    )  # not the real files: the pinned checksums must refuse them
    data_dir = tmp_path / "data"
    cfg = machinery.get_config(
        "tiny", dataset="multi30k", data_mirror="", data_dir=str(data_dir)
    )
    with pytest.raises(DataError, match="checksum"):
        machinery.locate_dataset("multi30k", cfg, url_base=src.as_uri() + "/")
    assert [p for p in data_dir.rglob("*") if p.is_file()] == []


# --------------------------------------------------------------------------------------
# 4. Offline, no mirror, no download: one error naming both ways
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["multi30k", "iwslt14"])
@pytest.mark.parametrize("how", ["download-disabled", "unreachable"])
def test_missing_data_fails_once_naming_mirror_and_download(
    tmp_path, offline, name, how
):
    data_dir = tmp_path / "data"
    cfg = machinery.get_config(
        "tiny",
        dataset=name,
        data_mirror="",
        data_dir=str(data_dir),
        download=(how != "download-disabled"),
    )
    nowhere = (tmp_path / "no-such-server").as_uri() + (
        "/" if name == "multi30k" else "/de-en.tgz"
    )
    with pytest.raises(DataError) as err:
        machinery.locate_dataset(name, cfg, url_base=nowhere)
    msg = str(err.value)
    assert "DATA_MIRROR" in msg
    assert "online" in msg and "download" in msg
    assert str(data_dir / name) in msg
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_unknown_dataset_name_is_a_data_error(tmp_path, offline):
    cfg = machinery.get_config("tiny", data_mirror="", data_dir=str(tmp_path))
    with pytest.raises(DataError, match="unknown data set"):
        machinery.locate_dataset("wmt14", cfg)


# --------------------------------------------------------------------------------------
# 5. The real mirror
# --------------------------------------------------------------------------------------


def mirror_cfg(mirror, tmp_path, dataset="iwslt14", **kw):
    return machinery.get_config(
        "tiny", dataset=dataset, data_mirror=str(mirror), data_dir=str(tmp_path), **kw
    )


def test_mirror_iwslt14_uses_the_training_sample_and_says_so(mirror, tmp_path):
    source = machinery.locate_dataset("iwslt14", mirror_cfg(mirror, tmp_path))
    folder = mirror / "iwslt14"
    assert source.files["train"] == (
        folder / "train-sample.de",
        folder / "train-sample.en",
    )
    assert source.files["valid"] == (folder / "valid.de", folder / "valid.en")
    assert source.files["test"] == (folder / "test.de", folder / "test.en")
    assert "sample" in source.origin and str(folder) in source.origin


def test_mirror_multi30k_is_found(mirror, tmp_path):
    source = machinery.locate_dataset(
        "multi30k", mirror_cfg(mirror, tmp_path, "multi30k")
    )
    for split, (de, en) in machinery.CORPORA["multi30k"].files.items():
        assert source.files[split] == (
            mirror / "multi30k" / de,
            mirror / "multi30k" / en,
        )
    assert "mirror" in source.origin
    assert list(tmp_path.iterdir()) == []  # nothing downloaded


@pytest.mark.parametrize(
    "dataset, words, count",
    [("multi30k", "29,000 training pairs", 29_000), ("iwslt14", "8,746-pair", 8_746)],
)
def test_the_training_sets_are_the_size_the_notebook_says(
    dataset, words, count, mirror
):
    assert words in Path(tat.__file__).read_text()
    folder, stem = (
        ("multi30k", "train.{}.gz")
        if dataset == "multi30k"
        else ("iwslt14", "train-sample.{}")
    )  # the mirror's training files (for IWSLT14 its sample)
    files = (mirror / folder / stem.format(lang) for lang in ("de", "en"))
    pairs, skipped = machinery.read_parallel(*files)
    assert (len(pairs), skipped) == (count, 0)


def test_mirror_iwslt14_vocab_is_built_from_train_only(mirror, tmp_path):
    cfg = mirror_cfg(mirror, tmp_path)
    data = machinery.load_dataset(cfg, log=quiet)
    folder = mirror / "iwslt14"
    train_counts = Counter(
        tok
        for f in ("train-sample.de", "train-sample.en")
        for line in machinery.read_lines(folder / f)
        for tok in line.split()
    )
    vocab = data.src_vocab
    assert all(train_counts[tok] >= cfg.min_freq for tok in vocab.itos[len(SPECIALS) :])
    # The most frequent German test token that never occurs in training must be <unk>.
    test_de = [line.split() for line in machinery.read_lines(folder / "test.de")]
    test_only = Counter(t for sent in test_de for t in sent if t not in train_counts)
    token, n = test_only.most_common(1)[0]
    assert (
        n >= cfg.min_freq
    )  # frequent enough that a vocab built with the test set would keep it
    assert token not in vocab.stoi
    assert vocab([token]) == [UNK]
    i = next(i for i, sent in enumerate(test_de) if token in sent and sent)
    src_ids = data.splits["test"][i][0]
    assert src_ids[1 + test_de[i].index(token)] == UNK


def test_mirror_iwslt14_specials_and_sentence_boundaries(mirror, tmp_path):
    data = machinery.load_dataset(mirror_cfg(mirror, tmp_path), log=quiet)
    assert (BOS, EOS, PAD, UNK) == (0, 1, 2, 3)
    assert SPECIALS == ("<s>", "</s>", "<blank>", "<unk>")
    for vocab in (data.src_vocab, data.tgt_vocab):
        assert vocab.itos[:4] == ["<s>", "</s>", "<blank>", "<unk>"]
        assert [vocab.stoi[s] for s in SPECIALS] == [BOS, EOS, PAD, UNK]
    assert len(data.test_refs) == len(data.splits["test"]) == 6750
    for split, pairs in data.splits.items():
        assert pairs, split
        for src, tgt in pairs:
            for seq in (src, tgt):
                assert seq[0] == BOS and seq[-1] == EOS
                assert BOS not in seq[1:] and EOS not in seq[:-1] and PAD not in seq


def test_mirror_iwslt14_shared_and_separate_vocabularies(mirror, tmp_path):
    shared = machinery.load_dataset(
        mirror_cfg(mirror, tmp_path, shared_vocab=True), log=quiet
    )
    assert shared.src_vocab is shared.tgt_vocab
    separate = machinery.load_dataset(
        mirror_cfg(mirror, tmp_path, shared_vocab=False), log=quiet
    )
    assert separate.src_vocab is not separate.tgt_vocab
    assert separate.src_vocab != separate.tgt_vocab
    de_tokens = {
        t
        for line in machinery.read_lines(mirror / "iwslt14" / "train-sample.de")
        for t in line.split()
    }
    en_tokens = {
        t
        for line in machinery.read_lines(mirror / "iwslt14" / "train-sample.en")
        for t in line.split()
    }
    assert set(separate.src_vocab.itos[4:]) <= de_tokens
    assert set(separate.tgt_vocab.itos[4:]) <= en_tokens
    # Counting both sides together only raises counts: the shared vocabulary holds both.
    assert set(shared.src_vocab.itos) >= set(separate.src_vocab.itos) | set(
        separate.tgt_vocab.itos
    )


def test_mirror_iwslt14_vocab_cache_is_reused_and_keyed_on_settings(mirror, tmp_path):
    cfg = mirror_cfg(mirror, tmp_path)
    cache = tmp_path / "cache"
    first = machinery.load_dataset(cfg, log=quiet)
    files = sorted(cache.glob("vocab-*.json"))
    assert len(files) == 1 and sorted(cache.iterdir()) == [
        files[0],
        files[0].with_name(files[0].name + ".sha256"),  # its digest beside it
    ]
    stamp = files[0].stat().st_mtime_ns

    second = machinery.load_dataset(cfg, log=quiet)
    assert sorted(cache.glob("vocab-*.json")) == files
    assert files[0].stat().st_mtime_ns == stamp
    assert second.src_vocab == first.src_vocab

    # The cached file really is what a repeated load uses (written whole, with its
    # digest); changed behind the digest's back, it is refused as damaged.
    saved = json.loads(files[0].read_text(encoding="utf-8"))
    saved["src"] = saved["src"][:10]
    files[0].write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(DataError, match="damaged"):
        machinery.load_dataset(cfg, log=quiet)
    machinery.runfiles.write_with_digest(files[0], json.dumps(saved).encode())
    assert (
        machinery.load_dataset(cfg, log=quiet).src_vocab.itos
        == first.src_vocab.itos[:10]
    )

    other = machinery.load_dataset(
        dataclasses.replace(cfg, min_freq=cfg.min_freq + 1), log=quiet
    )
    assert len(list(cache.glob("vocab-*.json"))) == 2
    assert other.src_vocab != first.src_vocab


# --------------------------------------------------------------------------------------
# 6. Bad data
# --------------------------------------------------------------------------------------


def test_misaligned_parallel_files_name_both_files_and_counts(tmp_path):
    a, b = tmp_path / "x.de", tmp_path / "x.en"
    a.write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    b.write_text("one\ntwo\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        machinery.read_parallel(a, b)
    msg = str(err.value)
    assert str(a) in msg and str(b) in msg
    assert "3 lines" in msg and "2 lines" in msg


@pytest.mark.parametrize("gz", [False, True])
def test_invalid_utf8_names_file_and_line(tmp_path, gz):
    raw = "eins\nzwei\n".encode() + b"dr\xffei\n" + "vier\n".encode()
    path = tmp_path / ("bad.de.gz" if gz else "bad.de")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(DataError) as err:
        machinery.read_lines(path)
    assert str(path) in str(err.value) and "line 3" in str(err.value)


def test_empty_lines_are_skipped_and_counted(tmp_path):
    a, b = tmp_path / "x.de", tmp_path / "x.en"
    a.write_text("a\n\nc\nd\ne\n", encoding="utf-8")
    b.write_text("v\nw\n  \nx\ny\n", encoding="utf-8")
    pairs, skipped = machinery.read_parallel(a, b)
    assert pairs == [("a", "v"), ("d", "x"), ("e", "y")]
    assert skipped == 2


def _write_gz(path: Path, lines):
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8")))


def test_overlong_training_pairs_are_filtered_and_counted_but_test_is_kept(tmp_path):
    folder = tmp_path / "mirror" / "multi30k"
    folder.mkdir(parents=True)
    train = [
        ("Ein Hund läuft.", "A dog runs."),
        ("Eine Katze schläft.", "A cat sleeps."),
        (
            "Ein sehr großer brauner Hund läuft schnell über die grüne Wiese.",
            "A dog runs.",
        ),
        ("Ein Mann singt.", "A man with a red hat sings a very long song in the park."),
        ("", ""),
        ("Ein Kind lacht.", "A child laughs."),
    ]
    valid = [("Ein Hund.", "A dog."), ("Eine Katze.", "A cat.")]
    test = [
        ("Ein Hund läuft.", "A dog runs."),
        (
            "Ein sehr großer brauner Hund läuft schnell über die grüne Wiese.",
            "A very big brown dog runs fast across the green meadow.",
        ),
        ("Ein Kind.", "A child."),
    ]
    for split, pairs in (("train", train), ("valid", valid), ("test", test)):
        de, en = machinery.CORPORA["multi30k"].files[split]
        _write_gz(folder / de, [p[0] for p in pairs])
        _write_gz(folder / en, [p[1] for p in pairs])
    cfg = machinery.get_config(
        "tiny",
        dataset="multi30k",
        data_mirror=str(tmp_path / "mirror"),
        data_dir=str(tmp_path / "data"),
        max_tokens=5,
        min_freq=1,
    )
    data = machinery.load_dataset(cfg, log=quiet)
    assert data.stats["train_empty_skipped"] == 1
    assert data.stats["train_too_long_filtered"] == 2
    assert data.stats["train_pairs"] == len(data.splits["train"]) == 3
    assert all(
        len(s) <= cfg.max_tokens + 2 and len(t) <= cfg.max_tokens + 2
        for s, t in data.splits["train"]
    )
    assert len(data.splits["test"]) == 3 and data.test_refs == [p[1] for p in test]
    assert max(len(s) for s, _ in data.splits["test"]) > cfg.max_tokens + 2
    assert len(data.splits["valid"]) == 2


# --------------------------------------------------------------------------------------
# 7. Vocab
# --------------------------------------------------------------------------------------


def test_vocab_respects_min_freq_and_orders_by_frequency():
    sents = [["a", "b", "a", "c"], ["b", "a", "d", "<unk>"], ["e", "e", "c"]]
    v = tat.Vocab.build(sents, min_freq=2)
    assert v.itos == list(SPECIALS) + [
        "a",
        "b",
        "c",
        "e",
    ]  # a:3, then ties alphabetical
    assert "d" not in v.stoi
    assert tat.Vocab.build(sents, min_freq=1).itos[-1] == "d"
    assert len(tat.Vocab.build(sents, min_freq=4)) == len(SPECIALS)


def test_vocab_stoi_itos_are_inverse_and_unknowns_map_to_unk():
    v = tat.Vocab.build([["der", "hund", "läuft", "der"]], min_freq=1)
    assert all(v.stoi[tok] == i for i, tok in enumerate(v.itos))
    assert len(v.stoi) == len(v.itos) == len(v)
    assert v(["der", "katze", "läuft"]) == [v.stoi["der"], UNK, v.stoi["läuft"]]
    assert v.lookup_tokens(v(["hund", "der"])) == ["hund", "der"]
    assert v([]) == []


def test_vocab_must_start_with_the_specials():
    with pytest.raises(ValueError):
        tat.Vocab(["a", "<s>", "</s>", "<blank>", "<unk>"])
    with pytest.raises(ValueError):
        tat.Vocab(list(SPECIALS) + ["a", "a"])


# --------------------------------------------------------------------------------------
# 8. length_batches
# --------------------------------------------------------------------------------------


@pytest.fixture
def lengths():
    rng = random.Random(0)
    return [(rng.randint(1, 60), rng.randint(1, 60)) for _ in range(500)] + [
        (300, 5),
        (4, 400),
    ]


def test_length_batches_cover_every_index_once_within_the_token_budget(lengths):
    bt = 256
    batches = tat.length_batches(lengths, bt, seed=1, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert b
        if len(b) > 1:
            assert max(lengths[i][0] for i in b) * len(b) <= bt
            assert max(lengths[i][1] for i in b) * len(b) <= bt
    for big in (500, 501):  # longer than the budget on its own: alone in its batch
        assert [b for b in batches if big in b] == [[big]]
    assert len(batches) < len(lengths) / 3  # pairs really are grouped


def test_length_batches_are_reproducible_per_seed_and_epoch(lengths):
    a = tat.length_batches(lengths, 256, seed=3, epoch=1)
    assert tat.length_batches(lengths, 256, seed=3, epoch=1) == a
    assert tat.length_batches(lengths, 256, seed=3, epoch=2) != a
    assert tat.length_batches(lengths, 256, seed=4, epoch=1) != a


@pytest.mark.parametrize(
    "n", [502, 501]
)  # an even and an odd number of batches overall
def test_length_batches_split_disjointly_between_ranks(lengths, n):
    # the one place that deals an epoch's batches out among processes
    from machinery.runfiles import epoch_updates

    lengths = lengths[:n]
    full = tat.length_batches(lengths, 256, seed=5, epoch=0)
    r0, r1 = (
        [b for update in epoch_updates(full, 0, rank, 2, 1)[0] for b in update]
        for rank in (0, 1)
    )
    assert len(r0) == len(r1) > 0  # every rank takes the same number of steps
    assert not {i for b in r0 for i in b} & {i for b in r1 for i in b}
    assert all(b in full for b in r0 + r1)
    assert len(full) - (len(r0) + len(r1)) < 2


# --------------------------------------------------------------------------------------
# 9. Batch
# --------------------------------------------------------------------------------------


def test_batch_masks_offsets_and_token_count():
    pairs = [
        ([BOS, 5, 6, 7, EOS], [BOS, 8, 9, EOS]),
        ([BOS, 5, EOS], [BOS, 8, 9, 10, 11, EOS]),
        ([BOS, 6, 7, EOS], [BOS, 9, EOS]),
    ]
    b = tat.make_batch(pairs, [0, 1, 2])
    src_len = [len(p[0]) for p in pairs]
    tgt_full = [len(p[1]) for p in pairs]
    B, S, L = 3, max(src_len), max(tgt_full) - 1

    assert b.src.shape == (B, S)
    assert b.src_mask.shape == (B, 1, S) and b.src_mask.dtype == torch.bool
    for i in range(B):
        assert b.src_mask[i, 0].tolist() == [j < src_len[i] for j in range(S)]
        assert all(b.src[i, j] == PAD for j in range(src_len[i], S))

    full = tat.pad_sequences([p[1] for p in pairs])
    assert torch.equal(b.tgt, full[:, :-1]) and torch.equal(b.tgt_y, full[:, 1:])
    assert torch.equal(b.tgt[:, 1:], b.tgt_y[:, :-1])

    assert b.tgt_mask.shape == (B, L, L)
    for i in range(B):
        for q in range(L):
            for k in range(L):
                assert bool(b.tgt_mask[i, q, k]) == (k <= q and k < tgt_full[i]), (
                    i,
                    q,
                    k,
                )
    assert b.ntokens == sum(n - 1 for n in tgt_full) == int((b.tgt_y != PAD).sum())


# --------------------------------------------------------------------------------------
# 10. Tokenizers
# --------------------------------------------------------------------------------------


def test_multi30k_tokenizer_splits_punctuation():
    de = machinery.make_tokenizer("multi30k", "de")
    [tokens] = de(["Ein Hund, der läuft."])
    assert tokens == ["Ein", "Hund", ",", "der", "läuft", "."]
    en = machinery.make_tokenizer("multi30k", "en")
    assert en(["A dog runs.", "Two  cats!"]) == [
        ["A", "dog", "runs", "."],
        ["Two", "cats", "!"],
    ]


def test_iwslt14_tokenizer_splits_on_whitespace_only():
    tok = machinery.make_tokenizer("iwslt14", "de")
    assert tok(["ein hund , der läuft .", "it &apos;s  don't"]) == [
        ["ein", "hund", ",", "der", "läuft", "."],
        ["it", "&apos;s", "don't"],
    ]


def test_multi30k_extra_test_sets_are_found_or_downloaded_without_a_pin(
    tmp_path, offline
):
    remote, mirror = tmp_path / "remote", tmp_path / "mirror" / "multi30k"
    remote.mkdir()
    mirror.mkdir(parents=True)
    for split, names in machinery.CORPORA["multi30k"].extra_tests.items():
        for name in names:
            (remote / name).write_bytes(
                gzip.compress(f"{split} {name} remote\n".encode())
            )
    data_dir = tmp_path / "data"
    cfg = machinery.get_config(
        "tiny", dataset="multi30k", data_mirror="", data_dir=str(data_dir)
    )
    de, en = machinery.locate_test_split(
        "multi30k", "test_2017_flickr", cfg, url_base=remote.as_uri() + "/"
    )
    assert (de, en) == (
        data_dir / "multi30k" / "test_2017_flickr.de.gz",
        data_dir / "multi30k" / "test_2017_flickr.en.gz",
    )
    assert machinery.read_lines(en) == [
        "test_2017_flickr test_2017_flickr.en.gz remote"
    ]
    # a mirror holding the files wins over the data folder and the network
    for name in machinery.CORPORA["multi30k"].extra_tests["test_2018_flickr"]:
        (mirror / name).write_bytes(gzip.compress(b"mirror\n"))
    cfg_m = dataclasses.replace(cfg, data_mirror=str(tmp_path / "mirror"))
    de, en = machinery.locate_test_split(
        "multi30k",
        "test_2018_flickr",
        cfg_m,
        url_base=(tmp_path / "nowhere").as_uri() + "/",
    )
    assert de.parent == mirror and machinery.read_lines(de) == ["mirror"]
    with pytest.raises(
        DataError,
        match="has no split 'test_2099' here \\(known: test, valid, test_2017",
    ):
        machinery.locate_test_split("multi30k", "test_2099", cfg)
    with pytest.raises(DataError, match="downloading is off"):
        machinery.locate_test_split(
            "multi30k", "test_2018_flickr", dataclasses.replace(cfg, download=False)
        )
    with pytest.raises(DataError, match="could not download"):
        machinery.locate_test_split(
            "multi30k",
            "test_2018_flickr",
            cfg,
            url_base=(tmp_path / "nowhere").as_uri() + "/",
        )


def test_evaluate_finds_the_validation_split_where_training_does(mirror, tmp_path):
    for name in ("multi30k", "iwslt14"):
        cfg = machinery.get_config(
            "tiny",
            dataset=name,
            data_mirror=str(mirror),
            data_dir=str(tmp_path),
            download=False,
        )
        assert (
            machinery.locate_test_split(name, "valid", cfg)
            == machinery.locate_dataset(name, cfg).files["valid"]
        )
        assert (
            machinery.locate_test_split(name, "valid", cfg)[0].parent == mirror / name
        )


# --------------------------------------------------------------------------------------
# A data set is one record: a new one needs nothing but its entry in CORPORA
# --------------------------------------------------------------------------------------


def test_a_new_data_set_is_one_record(tmp_path, offline, monkeypatch):
    remote, mirror = tmp_path / "remote", tmp_path / "mirror" / "toy-fr-en"
    mirror.mkdir(parents=True)
    remote.mkdir()
    sentences = {
        "fr": ["Le chat dort.", "Un homme lit un livre.", "Les enfants jouent dehors."],
        "en": ["The cat sleeps.", "A man reads a book.", "The children play outside."],
    }
    files = {
        "train": ("train.fr", "train.en"),
        "valid": ("dev.fr", "dev.en"),
        "test": ("test.fr", "test.en"),
    }
    for split, (fr, en) in files.items():
        (mirror / fr).write_text("\n".join(sentences["fr"]) + "\n", encoding="utf-8")
        (mirror / en).write_text("\n".join(sentences["en"]) + "\n", encoding="utf-8")
    (remote / "test_2020.fr").write_text("Le chien court.\n", encoding="utf-8")
    (remote / "test_2020.en").write_text("The dog runs.\n", encoding="utf-8")
    record = machinery.Corpus(
        "toy-fr-en",
        src="fr",
        tgt="en",
        files=MappingProxyType(files),
        url=remote.as_uri() + "/",
        extra_tests=MappingProxyType({"test_2020": ("test_2020.fr", "test_2020.en")}),
        words="spacy",
        detokenize="moses",
        bleu_tokenize="13a",
    )
    add_corpus(monkeypatch, record)
    cfg = machinery.get_config(
        "tiny",
        dataset="toy-fr-en",
        vocab="words",
        min_freq=1,
        data_mirror=str(mirror.parent),
        data_dir=str(tmp_path / "data"),
    )
    data = machinery.load_dataset(cfg, log=lambda *a: None)
    assert data.name == "toy-fr-en" and data.test_refs == sentences["en"]
    assert (
        "chat" in data.src_vocab.stoi and "." in data.src_vocab.stoi
    )  # spaCy's French rules split the period
    # the way back and the score follow the record: Moses detokenization, then
    # sacreBLEU's 13a, cased
    words = [data.tgt_vocab.lookup_tokens(t[1:-1]) for _, t in data.splits["test"]]
    toy = machinery.CORPORA["toy-fr-en"]
    assert tat.detokenize(words, toy) == sentences["en"]
    assert (
        tat.bleu(sentences["en"], sentences["en"], toy).signature.count("tok:13a") == 1
    )
    assert (
        tat.bleu([s.lower() for s in sentences["en"]], sentences["en"], toy).score < 100
    )
    # an extra test split: looked for in the mirror and the data folder, then downloaded
    # from the record's url
    fr, en = machinery.locate_test_split("toy-fr-en", "test_2020", cfg)
    assert (
        machinery.read_lines(en) == ["The dog runs."]
        and fr.parent == tmp_path / "data" / "toy-fr-en"
    )


# --- issue 38: damaged caches and mirrors, unbounded input ----------------------------


def test_a_truncated_cached_bpe_model_names_the_file_and_says_delete_it(tmp_path):
    cfg = machinery.get_config("copy")
    cache = tmp_path / "cache"
    write_to = cache / "bpe-k.model"
    write_to.parent.mkdir()
    write_to.write_bytes(b"\x0a\x05trunc")  # a protobuf cut short
    with pytest.raises(DataError) as e:
        machinery.build_subwords([("a b", "c d")], cfg, "k", cache)
    assert str(write_to) in str(e.value) and "delete it and rerun" in str(e.value)
    assert write_to.read_bytes() == b"\x0a\x05trunc"  # left for the user to look at


def test_a_truncated_gz_names_the_file(tmp_path):
    path = tmp_path / "test.de.gz"
    path.write_bytes(gzip.compress(b"ein satz\n" * 1000)[:-30])
    with pytest.raises(DataError) as e:
        machinery.read_lines(path)
    assert str(path) in str(e.value) and "truncated or damaged" in str(e.value)


def test_lines_are_read_with_a_bound(tmp_path):
    ok = b"a\n" * 10 + b"b" * 1000 + b"\n"
    assert machinery.read_bounded(io.BytesIO(ok), "x", limit=1000) == ok
    for data, line in (
        (b"a\n" * 10 + b"b" * 1001 + b"\n", 11),  # over by one, then a line end
        (b"c" * 5000, 1),  # no line end at all
        (b"a\n" + b"b" * 3 * 2**20, 2),  # spans chunks
    ):
        with pytest.raises(DataError) as e:
            machinery.read_bounded(io.BytesIO(data), "x", limit=1000)
        assert f"x, line {line}:" in str(e.value), (line, str(e.value))

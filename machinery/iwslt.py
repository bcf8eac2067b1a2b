"""IWSLT14 German→English from its raw TED archive, prepared by the widely used fairseq
recipe (not in the paper, whose §5.1 data is WMT 2014; IWSLT14 is one of our smaller
stand-ins).

`prepare_iwslt14` turns ``de-en.tgz`` into ``{train,valid,test}.{de,en}``;
`fetch_dataset` (`data.py`) calls it after downloading the archive.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from .datafiles import DataError
from .runfiles import write_atomic


# IWSLT14 is published as the raw TED archive; we follow the widely used fairseq recipe:
# drop the metadata lines of the training talks (URL, talk id, keywords, speaker, …) and
# keep the text of titles and descriptions; take the `<seg>` lines of the evaluation XML
# files; Moses-tokenize (sacremoses) with `&apos;`/`&quot;` escaping; drop pairs with an
# empty or over-175-token side or a length ratio above 1.5; lowercase; hold out every
# 23rd training pair as the validation set; the test set is dev2010 + dev2012 + tst2010
# + tst2011 + tst2012. First, the two kinds of file in the archive: a training file's
# text lines, and an XML file's segments.

_IWSLT_META = re.compile(
    r"^\s*<(url|talkid|keywords|speaker|reviewer|translator|doc|/doc)\b"
)
_IWSLT_TEST_SETS = (
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
)


def _iwslt_train_lines(text: str) -> list[str]:
    """Text lines of a ``train.tags.*`` file: metadata dropped, title/description tags
    removed."""
    lines = []
    for line in text.split("\n"):
        if _IWSLT_META.match(line):
            continue
        line = re.sub(r"</?(title|description)>", "", line).strip()
        lines.append(line)
    return lines


def _iwslt_xml_segments(text: str) -> list[str]:
    """The ``<seg id="N">…</seg>`` contents of an IWSLT evaluation XML file."""
    return [
        m.group(1).strip().replace("\u2019", "'")
        for m in re.finditer(r"<seg id=\"?\d+\"?>(.*?)</seg>", text)
    ]


# Then the recipe, `prepare_iwslt14`: read the archive's members, tokenize, filter, hold
# out every 23rd training pair for validation, and write the three splits.


def prepare_iwslt14(
    archive: Path, out_dir: Path, src: str = "de", tgt: str = "en"
) -> dict:
    """Turn the raw IWSLT14 TED archive (``de-en.tgz``) into
    ``{train,valid,test}.{de,en}``.

    Returns the number of pairs written per split. Output files are written atomically.
    """
    from sacremoses import MosesTokenizer

    tok = {lang: MosesTokenizer(lang=lang) for lang in (src, tgt)}

    def prep(lang: str, s: str) -> str:
        return tok[lang].tokenize(s, escape=True, return_str=True).lower()

    members: dict[str, str] = {}
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if m.isfile():
                members[Path(m.name).name] = tar.extractfile(m).read().decode("utf-8")
    pair = f"{src}-{tgt}"
    try:
        raw_src = _iwslt_train_lines(members[f"train.tags.{pair}.{src}"])
        raw_tgt = _iwslt_train_lines(members[f"train.tags.{pair}.{tgt}"])
    except KeyError as e:
        raise DataError(
            f"{archive} has no {e.args[0]}: is it the IWSLT14 {pair} archive?"
        ) from None
    if len(raw_src) != len(raw_tgt):
        raise DataError(
            f"{archive}: training talks misaligned "
            f"({len(raw_src)} vs {len(raw_tgt)} lines)"
        )
    train, valid = [], []
    for s, t in zip(raw_src, raw_tgt):
        s, t = (
            tok[src].tokenize(s, escape=True, return_str=True),
            tok[tgt].tokenize(t, escape=True, return_str=True),
        )
        ls, lt = len(s.split()), len(t.split())
        if not (1 <= ls <= 175 and 1 <= lt <= 175) or ls / lt > 1.5 or lt / ls > 1.5:
            continue
        train.append((s.lower(), t.lower()))
    kept = []
    for i, p in enumerate(train, start=1):
        (valid if i % 23 == 0 else kept).append(p)
    test = []
    for name in _IWSLT_TEST_SETS:
        fs, ft = f"{name}.{pair}.{src}.xml", f"{name}.{pair}.{tgt}.xml"
        if fs not in members or ft not in members:
            raise DataError(f"{archive} has no {fs} / {ft}")
        segs_s, segs_t = (
            _iwslt_xml_segments(members[fs]),
            _iwslt_xml_segments(members[ft]),
        )
        if len(segs_s) != len(segs_t):
            raise DataError(
                f"{archive}: {fs} has {len(segs_s)} segments but {ft} has {len(segs_t)}"
            )
        test += [(prep(src, s), prep(tgt, t)) for s, t in zip(segs_s, segs_t)]
    counts = {}
    for split, pairs in (("train", kept), ("valid", valid), ("test", test)):
        write_atomic(out_dir / f"{split}.{src}", (p[0] for p in pairs))
        write_atomic(out_dir / f"{split}.{tgt}", (p[1] for p in pairs))
        counts[split] = len(pairs)
    return counts

"""Data files: downloading one (atomically, checked against a pinned SHA-256) and
reading parallel text carefully, one sentence a line (§5.1's sentence pairs).

`DataError`, which these and the rest of the data code raise, is defined here, below
the data sets' records in `data.py`.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import urllib.request
import zlib
from pathlib import Path
from typing import Optional

from .devices import progress_bar
from .runfiles import atomic_file


class DataError(RuntimeError):
    """A data set is missing, malformed or cannot be fetched."""


def file_problem(path: Path) -> Optional[str]:
    """Why ``path`` cannot be read as a data file, in words ("is missing", "is a
    directory, not a file", "is a symbolic link loop", …); None if it can (our
    addition)."""
    path = Path(path)
    try:
        if path.is_file():
            return None if os.access(path, os.R_OK) else "cannot be read (permission)"
        if path.is_symlink():
            try:
                os.stat(path)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    return "is a symbolic link loop"
                return "is a broken symbolic link"
        if path.is_dir():
            return "is a directory, not a file"
        return "is not a regular file" if path.exists() else "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"


# `download` writes through `atomic_file` (Part 2), and checks the checksum before the
# rename.


def download(
    url: str, dest: Path, sha256: Optional[str] = None, desc: Optional[str] = None
) -> Path:
    """Fetch ``url`` to ``dest`` atomically, checking ``sha256`` when given.

    Any URL scheme ``urllib`` knows works, ``file://`` included. A corrupt or
    interrupted download never leaves a file at ``dest``.
    """
    digest = hashlib.sha256()
    with atomic_file(dest) as out, urllib.request.urlopen(url, timeout=60) as resp:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with progress_bar(
            total=total,
            unit="B",
            unit_scale=True,
            desc=desc or Path(dest).name,
            leave=False,
        ) as bar:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DataError(
                f"checksum mismatch for {url}: expected sha256 {sha256}, "
                f"got {digest.hexdigest()}"
            )
    return Path(dest)


# ### Reading parallel text, carefully
#
# Bad data fails loudly and precisely: files of different lengths name both files and
# both line counts; invalid UTF-8 names the file and line; empty lines are skipped and
# counted. Only `\n` and `\r\n` end a line — not the form feed, a lone carriage return,
# U+0085 or U+2028 that Python's `str.splitlines` also splits at — so line $i$ of a file
# is line $i$ of its translation; a leading byte-order mark is dropped. Standard input
# is read the same way. Over-long pairs are filtered out of the *training* data with a
# count (never truncated); the test set is always scored in full.


def split_lines(raw: bytes, name: str) -> list[str]:
    """Lines of UTF-8 bytes (our addition): only ``\n`` and ``\r\n`` end one, a leading
    BOM is dropped,
    bad bytes name the line."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            out.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{name}, line {i}: invalid UTF-8 ({e.reason} at byte {e.start})"
            ) from None
    return out


MAX_LINE_BYTES = 10 * 2**20  # a longer line is refused before it fills the memory


def read_bounded(f, name: str, limit: int = MAX_LINE_BYTES) -> bytes:
    """All bytes of the binary stream ``f``, read in chunks — our addition: a line
    longer than ``limit`` bytes (``/dev/zero``, a stream with no newline) is refused
    as soon as it is seen, not read into memory whole."""
    chunks, pending, newlines = [], 0, 0
    size = min(2**20, limit + 1)  # a line inside one chunk is within the limit
    while chunk := f.read(size):
        first = chunk.find(b"\n")
        if first >= 0 and pending + first <= limit:
            pending = len(chunk) - chunk.rfind(b"\n") - 1
        else:
            pending += len(chunk) if first < 0 else first
        if pending > limit:
            raise DataError(
                f"{name}, line {newlines + 1:,}: longer than {limit // 2**20} MB "
                "(no line end); give one sentence per line"
            )
        newlines += chunk.count(b"\n")
        chunks.append(chunk)
    return b"".join(chunks)


def read_stream(f, name: str) -> list[str]:
    """Lines of the binary stream ``f`` (standard input), read with a bound."""
    return split_lines(read_bounded(f, name), name)


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` allowed), as :func:`split_lines` reads them;
    names what is wrong."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = read_bounded(f, str(path))
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(
            f"{path} is truncated or damaged ({e}); replace it, or delete it and "
            "rerun to fetch it again"
        ) from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    return split_lines(raw, str(path))


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[tuple[str, str]], int]:
    """Aligned (source, target) sentence pairs and the number of pairs skipped as
    empty."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"misaligned parallel files: {src_path} has {len(src)} lines, "
            f"{tgt_path} has {len(tgt)} lines"
        )
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt)]
    kept = [p for p in pairs if p[0] and p[1]]
    return kept, len(pairs) - len(kept)

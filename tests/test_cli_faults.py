"""The command line under abuse: every bad input or fault is one clear line and a
non-zero status, and loses nothing.

Each row of a table is a bad input or a fault: the command, the exit status and words
the message must hold, and what must be left intact. The rows run against the real
``main``, in this process; signals and locks use a second process.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional, Sequence

import pytest
import torch

import machinery
from conftest import quiet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "the_annotated_transformer.py"
# the test model's positional encoding: short, so that over-long lines are cheap to make
MAX_LEN = 40
TRAIN = [
    "train",
    "--config",
    "copy",
    "--max_len",
    str(MAX_LEN),
    "--max_eval_sentences",
    "4",
    "--device",
    "cpu",
    "--precision",
    "fp32",
]
NORMAL = ["1 2 3 4 5", "7 7 8", "9 10 1 2", "3"]


def given_once(base: Sequence[str], more: Sequence[str]) -> list:
    """``base`` then ``more``, without those of ``base``'s options (and their values)
    that ``more`` gives again: an option is given once (a repeated one is refused)."""
    given = {o for o in more if o.startswith("--")}
    out, skip = [], False
    for arg in base:
        if skip:
            skip = False
        elif arg in given:
            skip = True
        else:
            out.append(arg)
    return [*out, *more]


def train_with(*opt: str) -> list:
    """TRAIN with the options in ``opt`` given instead of TRAIN's own."""
    return given_once(TRAIN, opt)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A copy-task model with max_len=40 (one checkpoint), one of another size, and its
    translations of NORMAL."""
    tmp = tmp_path_factory.mktemp("model")
    for name, extra in (("run", {}), ("small", {"d_model": 32, "d_ff": 64})):
        cfg = machinery.get_config(
            "copy",
            max_len=MAX_LEN,
            max_steps=16,
            device="cpu",
            precision="fp32",
            run_dir=str(tmp / name),
            **extra,
        )
        machinery.train(cfg, log=quiet, progress=False, evaluate=False)
    ck = machinery.checkpoint_paths(tmp / "run")[-1]
    alone = {}
    for line in (
        NORMAL
    ):  # each normal line translated on its own: what it must still give among bad ones
        out = io.StringIO()
        sys_stdout, sys.stdout = sys.stdout, out
        try:
            assert (
                machinery.main(
                    ["translate", "--checkpoint", str(ck), "--beam", "1", line]
                )
                == 0
            )
        finally:
            sys.stdout = sys_stdout
        alone[line] = out.getvalue().rstrip("\n")
    return SimpleNamespace(
        ck=ck,
        run=tmp / "run",
        small=machinery.checkpoint_paths(tmp / "small")[-1],
        alone=alone,
    )


class Case(NamedTuple):
    """One row: the command (built from the context), the exit status, words of stderr,
    and what must hold after."""

    name: str
    argv: Callable
    status: int
    words: tuple = ()
    stdin: Optional[bytes] = None
    setup: Optional[Callable] = None
    check: Optional[Callable] = None
    env: Optional[dict] = None  # environment variables set for the row
    streams: str = ""  # "no stdin", "no stdout" (closed), "failing stdout"


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def translate(ctx, *more):
    """translate with the test model, greedy unless ``more`` gives --beam."""
    beam = [] if "--beam" in more else ["--beam", "1"]
    return ["translate", "--checkpoint", str(ctx.ck), *beam, *more]


def evaluate(ctx, src, ref, *more):
    """evaluate the test model on files ``src`` and ``ref``, greedy unless ``more``
    gives --beam."""
    beam = [] if "--beam" in more else ["--beam", "1"]
    return [
        "evaluate",
        "--checkpoint",
        str(ctx.ck),
        *beam,
        "--src",
        str(ctx.tmp / src),
        "--ref",
        str(ctx.tmp / ref),
        *more,
    ]


def lines_of(text: str) -> list:
    return text.split("\n")[:-1] if text else []


# --- options, checked before any work ------------------------------------------------

OPTIONS = [
    Case(
        "beam 0",
        lambda c: translate(c, "--beam", "0", "1 2"),
        2,
        ("--beam", "at least 1"),
    ),
    Case(
        "beam -2",
        lambda c: translate(c, "--beam", "-2", "1 2"),
        2,
        ("--beam", "at least 1"),
    ),
    Case(
        "beam not a number",
        lambda c: translate(c, "--beam", "four", "1 2"),
        2,
        ("--beam", "whole number"),
    ),
    Case(
        "alpha -1",
        lambda c: translate(c, "--alpha", "-1", "1 2"),
        2,
        ("--alpha", "0 or more"),
    ),
    Case(
        "alpha nan",
        lambda c: translate(c, "--alpha", "nan", "1 2"),
        2,
        ("--alpha", "finite"),
    ),
    Case(
        "alpha inf",
        lambda c: translate(c, "--alpha", "inf", "1 2"),
        2,
        ("--alpha", "finite"),
    ),
    Case(
        "average_last 0",
        lambda c: ["translate", "--run_dir", str(c.run), "--average_last", "0", "1"],
        2,
        ("--average_last", "at least 1"),
    ),
    Case(
        "device absent (translate)",
        lambda c: translate(c, "--device", "cuda:99", "1 2"),
        2,
        ("cuda:99",),
    ),
    Case(
        "device not a name",
        lambda c: translate(c, "--device", "gpu0", "1 2"),
        2,
        ("not a device name",),
    ),
    Case(
        "evaluate beam 0",
        lambda c: evaluate(c, "s", "r", "--beam", "0"),
        2,
        ("--beam",),
    ),
    *[
        Case(
            f"train {' '.join(opt)}",
            lambda c, opt=opt: [*train_with(*opt), "--run_dir", str(c.tmp / "run")],
            2,
            words,
            check=lambda c, r: not (c.tmp / "run").exists(),
        )
        for opt, words in [
            (["--beam_size", "0"], ("beam_size", "from 1 (greedy) to 1000", "not 0")),
            (["--beam_size", "1001"], ("beam_size", "to 1000", "not 1001")),
            (["--epochs", "-1"], ("epochs", "at least 1")),
            (["--epochs", "0"], ("epochs", "at least 1")),
            (["--warmup", "0"], ("warmup", "at least 1")),
            (["--accum_steps", "0"], ("accum_steps",)),
            (["--P_drop", "2"], ("P_drop", "[0, 1)")),
            (["--d_model", "100", "--h", "3"], ("must divide d_model=100",)),
            (["--d_model", "33", "--h", "3"], ("d_model", "even")),
            (
                ["--length_penalty_alpha", "nan"],
                ("length_penalty_alpha", "from 0 to 10", "not nan"),
            ),
            (["--keep_checkpoints", "0"], ("keep_checkpoints",)),
            (["--lr_factor", "-1"], ("lr_factor",)),
            (["--batch_tokens", "0"], ("batch_tokens",)),
            (["--max_steps", "ten"], ("--max_steps", "whole number")),
            (["--betas", "0.9"], ("betas",)),
            (["--device", "cuda:99"], ("cuda:99",)),
            (["--dataset", "wmt"], ("dataset",)),
            (["--no_such_field", "1"], ("unrecognized",)),
            (
                ["--bf16", "false"],
                ("unrecognized", "--bf16"),
            ),  # removed options: refused like unknown ones
            (["--fused_loss", "true"], ("unrecognized", "--fused_loss")),
        ]
    ],
    Case(
        "unknown preset",
        lambda c: ["train", "--config", "huge"],
        2,
        ("--config", "huge"),
    ),
    Case(
        "unknown command",
        lambda c: ["fly"],
        2,
        ("unknown command", "'fly'", "train, translate, evaluate"),
    ),
]
if not torch.cuda.is_available():
    OPTIONS.append(
        Case(
            "train --device cuda on a CPU-only machine",
            lambda c: [
                *train_with("--device", "cuda"),
                "--run_dir",
                str(c.tmp / "run"),
            ],
            2,
            ("no CUDA",),
        )
    )
    OPTIONS.append(
        Case(
            "translate --device cuda on a CPU-only machine",
            lambda c: translate(c, "--device", "cuda", "1"),
            2,
            ("no CUDA",),
        )
    )

# --- files and checkpoints -----------------------------------------------------------


def renamed(source: Path, path: Path, step: int) -> Path:
    """A copy of checkpoint ``source`` at ``path`` that records ``step`` (as its name
    must)."""
    state = torch.load(source, weights_only=True)
    state["step"] = step
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def two_sizes(c):
    for i, ck in enumerate((c.ck, c.small), start=1):
        renamed(ck, c.tmp / "mixed" / f"checkpoint-{i:08d}.pt", i)


def half(c, name="half.pt"):
    data = c.ck.read_bytes()
    write(c.tmp / name, data[: len(data) // 2])


FILES = [
    Case(
        "missing --input",
        lambda c: translate(c, "--input", str(c.tmp / "nope.txt")),
        2,
        ("cannot read", "nope.txt", "No such file"),
    ),
    Case(
        "--input a directory",
        lambda c: translate(c, "--input", str(c.tmp)),
        2,
        ("cannot read", "directory"),
    ),
    Case(
        "--input not UTF-8",
        lambda c: translate(c, "--input", str(c.tmp / "in.txt")),
        2,
        ("in.txt, line 2", "invalid UTF-8"),
        setup=lambda c: write(c.tmp / "in.txt", b"1 2\n3 \xff 4\n5\n"),
    ),
    Case(
        "stdin not UTF-8",
        lambda c: translate(c),
        2,
        ("standard input, line 2", "invalid UTF-8"),
        stdin=b"1 2\n3 \xc3\x28 4\n5\n",
    ),
    Case(
        "binary file on stdin",
        lambda c: translate(c),
        2,
        ("standard input, line 2", "invalid UTF-8"),
        stdin=bytes(range(256)) * 3,
    ),  # line 1: bytes 0-9; line 2 holds the first byte that is not UTF-8
    Case(
        "evaluate missing --src",
        lambda c: evaluate(c, "nope.txt", "ref.txt"),
        2,
        ("cannot read", "nope.txt"),
        setup=lambda c: write(c.tmp / "ref.txt", "1\n"),
    ),
    Case(
        "evaluate --src a directory",
        lambda c: evaluate(c, ".", "ref.txt"),
        2,
        ("cannot read",),
        setup=lambda c: write(c.tmp / "ref.txt", "1\n"),
    ),
    Case(
        "evaluate two empty files",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        2,
        ("nothing to score",),
        setup=lambda c: (write(c.tmp / "s.txt", ""), write(c.tmp / "r.txt", "")),
    ),
    Case(
        "evaluate misaligned",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        2,
        ("misaligned",),
        setup=lambda c: (
            write(c.tmp / "s.txt", "1\n2\n"),
            write(c.tmp / "r.txt", "1\n"),
        ),
    ),
    Case(
        "evaluate reference not UTF-8",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        2,
        ("r.txt, line 1", "UTF-8"),
        setup=lambda c: (
            write(c.tmp / "s.txt", "1\n"),
            write(c.tmp / "r.txt", b"\xfe\n"),
        ),
    ),
    Case(
        "missing checkpoint",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "no.pt"), "1"],
        2,
        ("does not exist",),
    ),
    Case(
        "checkpoint a directory",
        lambda c: ["translate", "--checkpoint", str(c.tmp), "1"],
        2,
        ("is a directory", "--run_dir"),
    ),
    Case(
        "checkpoint truncated at half its size",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "half.pt"), "1"],
        2,
        ("truncated",),
        setup=half,
    ),
    Case(
        "checkpoint a text file",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "x.pt"), "1"],
        2,
        ("not a checkpoint",),
        setup=lambda c: write(c.tmp / "x.pt", "hello\n"),
    ),
    Case(
        "checkpoint without config",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "x.pt"), "1"],
        2,
        ("lacks config",),
        setup=lambda c: torch.save(
            {"format": 1, "model": {}, "vocab": {}}, c.tmp / "x.pt"
        ),
    ),
    Case(
        "checkpoint of another program",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "x.pt"), "1"],
        2,
        ("not a checkpoint written by this program",),
        setup=lambda c: torch.save({"w": torch.ones(2)}, c.tmp / "x.pt"),
    ),
    Case(
        "missing run directory",
        lambda c: ["translate", "--run_dir", str(c.tmp / "none"), "1"],
        2,
        ("no checkpoint", "not a directory"),
    ),
    Case(
        "run directory is a file",
        lambda c: ["evaluate", "--run_dir", str(c.ck)],
        2,
        ("no checkpoint",),
    ),
    Case(
        "only a hand-made checkpoint-best.pt",
        lambda c: ["translate", "--run_dir", str(c.tmp / "best"), "1"],
        2,
        ("no checkpoint",),
        setup=lambda c: write(c.tmp / "best" / "checkpoint-best.pt", c.ck.read_bytes()),
    ),
    Case(
        "run directory with two model sizes",
        lambda c: ["translate", "--run_dir", str(c.tmp / "mixed"), "1"],
        2,
        ("different model", "--average_last 1"),
        setup=two_sizes,
    ),
    Case(
        "newest checkpoint truncated (translate)",
        lambda c: ["translate", "--run_dir", str(c.tmp / "r"), "1"],
        2,
        ("truncated",),
        setup=lambda c: (
            write(c.tmp / "r" / "checkpoint-00000016.pt", c.ck.read_bytes()),
            half(c, "r/checkpoint-00000032.pt"),
        ),
    ),
]


# --- input lines: one output line per input line -------------------------------------


def same_as_alone(positions):
    """The normal lines at ``positions`` (output line → NORMAL index) translate as they
    do on their own."""

    def check(c, r):
        out = lines_of(r.out)
        return all(out[i] == c.alone[NORMAL[j]] for i, j in positions.items())

    return check


LONG = " ".join(["5"] * 1000)  # 1,000 words: more than MAX_LEN positions
FITS = " ".join(["5"] * 30)  # fits the encoder, but n + 50 is beyond MAX_LEN

LINES = [
    Case(
        "line separators inside lines",
        lambda c: translate(c),
        0,
        stdin=(
            f"{NORMAL[0]}\n1 2\u20283 4\n5\x856\n7\x0c8\n9\r10\n{NORMAL[1]}\n"
        ).encode(),
        check=lambda c, r: len(lines_of(r.out)) == 6
        and same_as_alone({0: 0, 5: 1})(c, r),
    ),
    Case(
        "CRLF line ends",
        lambda c: translate(c),
        0,
        stdin=("\r\n".join(NORMAL) + "\r\n").encode(),
        check=same_as_alone({i: i for i in range(4)}),
    ),
    Case(
        "a BOM before the first line",
        lambda c: translate(c),
        0,
        stdin=("\ufeff" + "\n".join(NORMAL)).encode(),
        check=lambda c, r: len(lines_of(r.out)) == 4
        and same_as_alone({i: i for i in range(4)})(c, r),
    ),
    Case(
        "empty and whitespace-only lines",
        lambda c: translate(c),
        0,
        stdin=f"{NORMAL[0]}\n\n \t \u3000\n{NORMAL[2]}\n".encode(),
        check=lambda c, r: lines_of(r.out)[1:3] == ["", ""]
        and same_as_alone({0: 0, 3: 2})(c, r),
    ),
    Case(
        "an empty file",
        lambda c: translate(c, "--input", str(write(c.tmp / "e.txt", b""))),
        0,
        check=lambda c, r: r.out == "",
    ),
    Case(
        "only empty lines",
        lambda c: translate(c),
        0,
        stdin=b"\n\n  \n\n",
        check=lambda c, r: r.out == "\n\n\n\n",
    ),
    Case(
        "control characters, valid UTF-8, 6 newlines",
        lambda c: translate(c),
        0,
        stdin=b"\x00\x01 2\n\x7f\n3\x1b[0m\n\x08\n\x00\n4\x00 5\n",
        check=lambda c, r: len(lines_of(r.out)) == 6,
    ),
    Case(
        "a 1,000-word line among normal lines",
        lambda c: translate(c, "--input", str(c.tmp / "in.txt")),
        1,
        ("line 3 (1,000 tokens)", "max_len=40", "empty output line"),
        setup=lambda c: write(
            c.tmp / "in.txt", "\n".join([*NORMAL[:2], LONG, *NORMAL[2:]]) + "\n"
        ),
        check=lambda c, r: lines_of(r.out)[2] == ""
        and same_as_alone({0: 0, 1: 1, 3: 2, 4: 3})(c, r),
    ),
    Case(
        "a 1,000-word line, beam search",
        lambda c: translate(c, LONG, NORMAL[0], "--beam", "2"),
        1,
        ("line 1",),
        check=lambda c, r: len(lines_of(r.out)) == 2 and lines_of(r.out)[0] == "",
    ),
    Case(
        "a line within max_len whose n + 50 is not",
        lambda c: translate(c, FITS, NORMAL[0]),
        0,
        check=lambda c, r: len(lines_of(r.out)[0].split()) <= MAX_LEN - 1
        and same_as_alone({1: 0})(c, r),
    ),
    Case(
        "the same line, beam search",
        lambda c: translate(c, FITS, "--beam", "2"),
        0,
        check=lambda c, r: len(lines_of(r.out)) == 1
        and len(r.out.split()) <= MAX_LEN - 1,
    ),
    Case(
        "evaluate: BOM in the reference",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        0,
        setup=lambda c: (
            write(c.tmp / "s.txt", "\n".join(NORMAL) + "\n"),
            write(
                c.tmp / "r.txt", "\ufeff" + "\n".join(c.alone[s] for s in NORMAL) + "\n"
            ),
        ),
        check=lambda c, r: r.out.startswith("BLEU = 100.00"),
    ),
    Case(
        "evaluate: a 1,000-word source line",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        1,
        ("line 2",),
        setup=lambda c: (
            write(c.tmp / "s.txt", f"{NORMAL[0]}\n{LONG}\n"),
            write(c.tmp / "r.txt", "1\n5\n"),
        ),
        check=lambda c, r: r.out.startswith("BLEU = "),
    ),
]


# --- round three: the 33 cases of issue 38 that ran into the command line ------------


def edited(c, name: str, edit: Callable) -> Path:
    """A copy of the test checkpoint at ``c.tmp / name``, its state changed by
    ``edit``."""
    state = torch.load(c.ck, weights_only=True)
    edit(state)
    path = c.tmp / name
    torch.save(state, path)
    return path


def non_finite(c, value=float("nan"), everywhere=True):
    """A checkpoint whose weights are all ``value``, or one tensor (``c.key``) with one
    ``value``."""

    def edit(state):
        floats = [k for k, v in state["model"].items() if v.is_floating_point()]
        c.key = floats[0] if everywhere else floats[len(floats) // 2]  # named first
        for k in floats if everywhere else [c.key]:
            state["model"][k].view(-1)[0] = value
            if everywhere:
                state["model"][k].fill_(value)

    edited(c, "bad.pt", edit)


def as_multi30k(c):
    """The test checkpoint relabelled as a Multi30k model, offline, with an empty data
    folder."""

    def edit(state):
        state["config"].update(
            dataset="multi30k", download=False, data_dir=str(c.tmp / "data")
        )

    edited(c, "m30k.pt", edit)


def truncated_gz_mirror(c):
    import gzip

    as_multi30k(c)
    folder = c.tmp / "mirror" / "multi30k"
    for lang in ("de", "en"):
        write(folder / f"test_2017_flickr.{lang}.gz", gzip.compress(b"1 2\n" * 500))
    damaged = folder / "test_2017_flickr.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-20])


def copied_to_larger_step(c):
    write(c.tmp / "r" / "checkpoint-00000016.pt", c.ck.read_bytes())
    write(c.tmp / "r" / "checkpoint-99999999.pt", c.ck.read_bytes())


def fifo(c):
    os.mkfifo(c.tmp / "pipe.pt")


def damaged_bpe(c):
    def edit(state):
        blob = bytearray(b"\x0a\x05hello")  # a protobuf cut short
        state["subwords"] = torch.frombuffer(blob, dtype=torch.uint8)

    edited(c, "bpe.pt", edit)


M30K = lambda c, *more: [  # noqa: E731
    "evaluate",
    "--checkpoint",
    str(c.tmp / "m30k.pt"),
    "--beam",
    "1",
    *more,
]
NO_NEWLINE = b"5 " * (6 * 2**20)  # 12 MB and no line end

ROUND_THREE = [
    Case(
        "translate --alpha 1000 (overflows beam search)",
        lambda c: translate(c, "--alpha", "1000", "1 2"),
        2,
        ("--alpha", "at most 10"),
    ),
    Case(
        "translate --beam 99999999999",
        lambda c: translate(c, "--beam", "99999999999", "1 2"),
        2,
        ("--beam", "from 1 to 1,000"),
    ),
    Case(
        "evaluate --beam 99999999999",
        lambda c: evaluate(c, "s", "r", "--beam", "99999999999"),
        2,
        ("--beam", "1,000"),
    ),
    *[
        Case(
            f"train {' '.join(opt)}",
            lambda c, opt=opt: [*train_with(*opt), "--run_dir", str(c.tmp / "run")],
            2,
            words,
            check=lambda c, r: not (c.tmp / "run").exists(),
        )
        for opt, words in [
            (["--max_len", "1000000000"], ("max_len", "from 3 to 100000")),
            (["--length_penalty_alpha", "1e308"], ("length_penalty_alpha", "to 10")),
            (["--beam_size", "99999999999"], ("beam_size", "to 1000")),
        ]
    ],
    Case(
        "train --max_len 3, shorter than the data",
        lambda c: [*train_with("--max_len", "3"), "--run_dir", str(c.tmp / "run")],
        2,
        ("--max_len 3", "12 positions", "--max_len 12"),
        check=lambda c, r: not machinery.checkpoint_paths(c.tmp / "run")
        if (c.tmp / "run").exists()
        else True,
    ),
    Case(
        "WORLD_SIZE=abc",
        lambda c: [*TRAIN, "--run_dir", str(c.tmp / "run")],
        2,
        ("WORLD_SIZE", "'abc'", "whole number"),
        env={"WORLD_SIZE": "abc"},
        check=lambda c, r: not (c.tmp / "run").exists(),
    ),
    Case(
        "LOCAL_RANK=abc",
        lambda c: translate(c, "1 2"),
        2,
        ("LOCAL_RANK", "'abc'"),
        env={"LOCAL_RANK": "abc"},
    ),
    Case(
        "translate --input and sentences",
        lambda c: translate(c, "--input", str(write(c.tmp / "in.txt", "1\n")), "1 2"),
        2,
        ("--input", "not both", "in.txt"),
        check=lambda c, r: r.out == "",
    ),
    Case(
        "translate --run_dir, --input and a sentence",
        lambda c: [
            "translate",
            "--run_dir",
            str(c.run),
            "--input",
            str(write(c.tmp / "in.txt", "1\n")),
            "a sentence",
        ],
        2,
        ("not both",),
    ),
    Case(
        "evaluate --split next to --src/--ref",
        lambda c: evaluate(c, "s.txt", "r.txt") + ["--split", "valid"],
        2,
        ("--split", "--src/--ref", "not both"),
        setup=lambda c: (write(c.tmp / "s.txt", "1\n"), write(c.tmp / "r.txt", "1\n")),
        check=lambda c, r: r.out == "",
    ),
    Case(
        "--input - is standard input",
        lambda c: translate(c, "--input", "-"),
        0,
        stdin=("\n".join(NORMAL) + "\n").encode(),
        check=same_as_alone({i: i for i in range(4)}),
    ),
    Case(
        "--input /dev/zero (no line end, endless)",
        lambda c: translate(c, "--input", "/dev/zero"),
        2,
        ("/dev/zero, line 1", "longer than 10 MB"),
    ),
    Case(
        "12 MB with no line end on standard input",
        lambda c: translate(c),
        2,
        ("standard input, line 1", "longer than 10 MB"),
        stdin=NO_NEWLINE,
    ),
    Case(
        "a 12 MB line after normal ones in a file",
        lambda c: translate(c, "--input", str(c.tmp / "in.txt")),
        2,
        ("line 3", "longer than 10 MB"),
        setup=lambda c: write(c.tmp / "in.txt", b"1 2\n3\n" + NO_NEWLINE + b"\n4\n"),
    ),
    Case(
        "standard input closed",
        lambda c: translate(c),
        2,
        ("standard input is closed", "--input"),
        streams="no stdin",
    ),
    Case(
        "standard output closed (translate)",
        lambda c: translate(c, "1 2"),
        2,
        ("standard output is closed",),
        streams="no stdout",
    ),
    Case(
        "standard output closed (evaluate)",
        lambda c: evaluate(c, "s.txt", "r.txt"),
        2,
        ("standard output is closed",),
        setup=lambda c: (write(c.tmp / "s.txt", "1\n"), write(c.tmp / "r.txt", "1\n")),
        streams="no stdout",
    ),
    Case(
        "standard output fails on writing",
        lambda c: translate(c, "1 2"),
        2,
        ("cannot write to standard output", "Bad file descriptor"),
        streams="failing stdout",
    ),
    Case(
        "--checkpoint /dev/zero",
        lambda c: ["translate", "--checkpoint", "/dev/zero", "1"],
        2,
        ("/dev/zero", "not a regular file"),
    ),
    Case(
        "--checkpoint a FIFO",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "pipe.pt"), "1"],
        2,
        ("pipe.pt", "not a regular file"),
        setup=fifo,
    ),
    Case(
        "checkpoint with NaN weights (translate)",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "bad.pt"), "1 2"],
        2,
        ("bad.pt", "NaN or infinite", "earlier checkpoint"),
        setup=non_finite,
        check=lambda c, r: c.key in r.err and r.out == "",
    ),
    Case(
        "checkpoint with one inf in one tensor (evaluate)",
        lambda c: [
            "evaluate",
            "--checkpoint",
            str(c.tmp / "bad.pt"),
            "--src",
            str(write(c.tmp / "s.txt", "1 2\n")),
            "--ref",
            str(write(c.tmp / "r.txt", "1 2\n")),
        ],
        2,
        ("NaN or infinite",),
        setup=lambda c: non_finite(c, float("inf"), everywhere=False),
        check=lambda c, r: c.key in r.err and "BLEU" not in r.out,
    ),
    Case(
        "a run directory holding only checkpoint-30.pt",
        lambda c: ["translate", "--run_dir", str(c.tmp / "r"), "1"],
        2,
        ("checkpoint-30.pt", "8 or more digits", "checkpoint-00000030.pt"),
        setup=lambda c: write(c.tmp / "r" / "checkpoint-30.pt", c.ck.read_bytes()),
    ),
    Case(
        "a checkpoint copied to a larger step (averaged)",
        lambda c: ["translate", "--run_dir", str(c.tmp / "r"), "1"],
        2,
        ("checkpoint-99999999.pt", "records step 16", "copied or renamed"),
        setup=copied_to_larger_step,
    ),
    Case(
        "a damaged BPE model inside a checkpoint",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "bpe.pt"), "1"],
        2,
        ("BPE model", "bpe.pt", "the checkpoint is damaged"),
        setup=damaged_bpe,
    ),
    Case(
        "offline evaluate --split test_2017_flickr: the mirror is named",
        lambda c: M30K(c, "--split", "test_2017_flickr"),
        2,
        ("test_2017_flickr", "downloading is off", "DATA_MIRROR", "--data_mirror"),
        setup=as_multi30k,
        env={"DATA_MIRROR": ""},
    ),
    Case(
        "a truncated .gz in the mirror",
        lambda c: M30K(
            c, "--split", "test_2017_flickr", "--data_mirror", str(c.tmp / "mirror")
        ),
        2,
        ("test_2017_flickr.de.gz", "truncated or damaged"),
        setup=truncated_gz_mirror,
    ),
    Case(
        "top-level --help lists the three commands",
        lambda c: ["--help"],
        0,
        check=lambda c, r: all(w in r.out for w in ("train", "translate", "evaluate")),
    ),
]


# --- round five: repeated options, options the copy task ignores, symbolic links -----


def planted_lock(c):
    """A run directory whose run.lock is a symbolic link to a file of results."""
    (c.tmp / "run").mkdir()
    write(c.tmp / "results.json", '{"bleu": 27.3}\n')
    (c.tmp / "run" / "run.lock").symlink_to(c.tmp / "results.json")


def dangling_run_dir(c):
    (c.tmp / "run").symlink_to(c.tmp / "nowhere")


ROUND_FIVE = [
    *[
        Case(
            f"train {' '.join(opt)}",
            lambda c, opt=opt: [*train_with(*opt), "--run_dir", str(c.tmp / "run")],
            2,
            words,
            check=lambda c, r: not (c.tmp / "run").exists()
            and not (c.tmp / "A").exists(),
        )
        for opt, words in [
            (["--adam_eps", "1e300"], ("adam_eps", "at most 1", "cannot learn")),
            (["--adam_eps", "1e20"], ("adam_eps", "at most 1")),
            (["--epochs", "2", "--epochs", "1"], ("--epochs", "twice", "'2'", "'1'")),
            (["--run_dir", str(Path("A"))], ("--run_dir", "twice")),
            (["--run-dir", "A"], ("--run_dir", "twice")),
            (
                ["--vocab", "words", "--min_freq", "1000000"],
                ("--vocab", "--min_freq", "copy task"),
            ),
            (["--max_tokens", "1"], ("--max_tokens", "copy task", "no effect")),
        ]
    ],
    Case(
        "translate --beam 1 --beam 5",
        lambda c: ["translate", "--checkpoint", str(c.ck), "--beam", "1"]
        + ["--beam", "5", "1 2"],
        2,
        ("--beam", "twice", "'1'", "'5'"),
    ),
    Case(
        "train --run_dir ''",
        lambda c: [*TRAIN, "--run_dir", ""],
        2,
        ("--run_dir", "empty"),
    ),
    Case(
        "train into a run directory whose run.lock is a symbolic link",
        lambda c: [*TRAIN, "--max_steps", "1", "--run_dir", str(c.tmp / "run")],
        2,
        ("run.lock", "symbolic link", "results.json"),
        setup=planted_lock,
        check=lambda c, r: (c.tmp / "results.json").read_text() == '{"bleu": 27.3}\n',
    ),
    Case(
        "train into a dangling symbolic link",
        lambda c: [*TRAIN, "--max_steps", "1", "--run_dir", str(c.tmp / "run")],
        2,
        ("symbolic link", "nowhere", "does not exist"),
        setup=dangling_run_dir,
        check=lambda c, r: not (c.tmp / "nowhere").exists(),
    ),
]


class FailingStdout(io.TextIOWrapper):
    """Standard output whose file descriptor went away (EBADF on writing)."""

    def __init__(self):
        super().__init__(io.BytesIO(), encoding="utf-8")

    def write(self, text):
        raise OSError(9, "Bad file descriptor")


def run_main(argv, stdin, monkeypatch, capsys, env=None, streams=""):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    if streams == "no stdin":
        monkeypatch.setattr(sys, "stdin", None)
    if streams in ("no stdout", "failing stdout"):
        monkeypatch.setattr(
            sys, "stdout", None if streams == "no stdout" else FailingStdout()
        )
    try:
        status = machinery.main(argv)
    except SystemExit as e:  # argparse's exit
        status = e.code
    out, err = capsys.readouterr()
    return SimpleNamespace(status=status, out=out, err=err)


@pytest.mark.parametrize(
    "case", OPTIONS + FILES + LINES + ROUND_THREE + ROUND_FIVE, ids=lambda c: c.name
)
def test_bad_input_is_one_clear_line_and_loses_nothing(
    case, model, tmp_path, monkeypatch, capsys
):
    ctx = SimpleNamespace(**vars(model), tmp=tmp_path)
    if case.setup:
        case.setup(ctx)
    capsys.readouterr()
    r = run_main(
        case.argv(ctx), case.stdin, monkeypatch, capsys, case.env, case.streams
    )
    assert r.status == case.status, r.err
    assert "Traceback" not in r.err
    if case.status:
        assert len(r.err.strip().splitlines()) == 1, r.err  # one line
        assert all(w in r.err for w in case.words), r.err
    if case.check:
        assert case.check(ctx, r), (r.out, r.err)


def test_debug_shows_the_traceback(model, monkeypatch, capsys):
    with pytest.raises(machinery.CheckpointError):
        machinery.main(
            ["translate", "--checkpoint", str(model.run / "nothing.pt"), "--debug", "1"]
        )


# --- training under faults -----------------------------------------------------------


def train(run_dir: Path, *more: str) -> list:
    return given_once([*TRAIN, "--run_dir", str(run_dir)], more)


def metrics(run_dir: Path) -> list:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def no_step_twice(run_dir: Path) -> bool:
    for kind in ("train_loss", "valid_loss"):
        steps = [r["step"] for r in metrics(run_dir) if kind in r]
        if steps != sorted(set(steps)):
            return False
    return True


def names(run_dir: Path) -> list:
    return sorted(p.name for p in run_dir.iterdir())


def full_disk_on_second_save(c, monkeypatch):
    real, calls = torch.save, []

    def save(
        obj, f, *a, **k
    ):  # the first checkpoint is written; the second finds the disk full half-way
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
                "failed writing file data/3: file write failed"
            )
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)


def torn_metrics_no_checkpoint(c, monkeypatch):
    write(
        c.run / "metrics.jsonl",
        '{"step": 16, "epoch": 1, "valid_loss": 2.0}\n{"step": 50, "epo',
    )


def torn_metrics_after_checkpoint(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "16"))
    with open(c.run / "metrics.jsonl", "a") as f:
        f.write('{"step": 20, "epoch": 2, "train_lo')


def simulated_sigkill_during_save(c, monkeypatch):
    """Two checkpoints; then a kill while writing a third after a power loss took half
    of the newest."""
    c.main(train(c.run, "--max_steps", "32"))
    older, newest = machinery.checkpoint_paths(c.run)[-2:]
    c.older, c.newest = older, newest
    write(c.run / ".checkpoint-00000040.pt.k1ll3d.part", newest.read_bytes()[:1000])
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with open(c.run / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "epoch": 3, "trai')


def hand_made_best(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "32"))
    c.best = write(
        c.run / "checkpoint-best.pt", machinery.checkpoint_paths(c.run)[0].read_bytes()
    ).read_bytes()


def all_unreadable(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "16"))
    for p in machinery.checkpoint_paths(c.run):
        p.write_bytes(p.read_bytes()[:100])


def other_model(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "16"))
    c.before = names(c.run)


def other_vocabulary(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "16"))
    path = machinery.checkpoint_paths(c.run)[-1]
    state = torch.load(path, weights_only=True)
    state["vocab"]["src"] = [*state["vocab"]["src"][:-1], "11"]  # one symbol renamed
    state["digests"] = machinery.runfiles.carried_digests(state)  # written so: whole
    torch.save(state, path)
    c.before = names(c.run)


def resumed_from(c, r, path) -> bool:
    return f"resumed from {path}" in r.out


TRAINING = [
    Case(
        "run directory is a file",
        lambda c: train(c.run),
        2,
        ("is a file",),
        setup=lambda c, m: write(c.run, "notes\n"),
        check=lambda c, r: c.run.read_text() == "notes\n",
    ),
    Case(
        "run directory under a file",
        lambda c: train(c.run / "sub"),
        2,
        ("cannot write in run directory",),
        setup=lambda c, m: write(c.run, "notes\n"),
        check=lambda c, r: c.run.read_text() == "notes\n",
    ),
    Case(
        "full disk on saving a checkpoint",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("cannot write checkpoint", "checkpoint-00000032.pt", "MiB free", "intact"),
        setup=full_disk_on_second_save,
        check=lambda c, r: names(c.run)
        == ["checkpoint-00000016.pt", "metrics.jsonl", "run.lock"]
        and machinery.load_checkpoint(c.run / "checkpoint-00000016.pt")["step"] == 16,
    ),
    Case(
        "torn metrics line, no checkpoint yet",
        lambda c: train(c.run, "--max_steps", "16"),
        0,
        setup=torn_metrics_no_checkpoint,
        check=lambda c, r: "dropped 1 unreadable line" in r.err
        and no_step_twice(c.run)
        and (c.run / "results.json").is_file()
        and (c.run / "curve.png").is_file(),
    ),
    Case(
        "torn metrics line after a checkpoint",
        lambda c: train(c.run, "--max_steps", "32"),
        0,
        setup=torn_metrics_after_checkpoint,
        check=lambda c, r: "dropped 1 unreadable line" in r.err
        and no_step_twice(c.run)
        and resumed_from(c, r, c.run / "checkpoint-00000016.pt")
        and json.loads((c.run / "results.json").read_text())["steps"] == 32,
    ),
    Case(
        "SIGKILL during a checkpoint write (partial temporary file, newest truncated)",
        lambda c: train(c.run, "--max_steps", "32"),
        0,
        setup=simulated_sigkill_during_save,
        check=lambda c, r: resumed_from(c, r, c.older)
        and "falling back" in r.err
        and no_step_twice(c.run)
        and not list(c.run.glob(".*.part"))
        and (c.run / (c.newest.name + ".unreadable")).is_file()
        and machinery.load_checkpoint(c.newest)["step"] == 32
        and json.loads((c.run / "results.json").read_text())["steps"] == 32,
    ),
    Case(
        "a hand-made checkpoint-best.pt",
        lambda c: train(c.run, "--max_steps", "48"),
        0,
        setup=hand_made_best,
        check=lambda c, r: resumed_from(c, r, c.run / "checkpoint-00000032.pt")
        and (c.run / "checkpoint-best.pt").read_bytes() == c.best,
    ),
    Case(
        "every checkpoint unreadable",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("none of the 1 checkpoint",),
        setup=all_unreadable,
        check=lambda c, r: len(machinery.checkpoint_paths(c.run)) == 1,
    ),
    Case(
        "a checkpoint of another model size",
        lambda c: train(c.run, "--max_steps", "32", "--d_model", "32"),
        2,
        ("another model config", "d_model"),
        setup=other_model,
        check=lambda c, r: names(c.run) == c.before,
    ),
    Case(
        "a checkpoint of another vocabulary",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("another src vocabulary",),
        setup=other_vocabulary,
        check=lambda c, r: names(c.run) == c.before,
    ),
]


def full_disk_on_metrics(c, monkeypatch):
    """A finished run of 16 steps; then every write of the metrics log finds the disk
    full, after the temporary file got part of its bytes."""
    c.main(train(c.run, "--max_steps", "16"))
    c.before = (c.run / "metrics.jsonl").read_bytes()
    real = os.fsync

    def fsync(fd):
        if ".metrics.jsonl." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def full_disk_on_curve(c, monkeypatch):
    """A finished run of 16 steps with its curve.png; then the next one finds the disk
    full when the figure's bytes go to the disk (fsync of its temporary file)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell the figure's file from the others")
    c.main(train(c.run, "--max_steps", "16"))
    c.curve = (c.run / "curve.png").read_bytes()
    real = os.fsync

    def fsync(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(".curve.png."):
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def copied_checkpoint(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "16"))
    write(
        c.run / "checkpoint-99999999.pt",
        (c.run / "checkpoint-00000016.pt").read_bytes(),
    )
    c.before = names(c.run)


def earlier_results_only(c, monkeypatch):
    write(c.run / "metrics.jsonl", '{"step": 16, "epoch": 1, "valid_loss": 2.0}\n')
    write(c.run / "results.json", '{"bleu": 12.5}\n')


TRAINING += [
    Case(
        "a checkpoint-30.pt in the run directory",
        lambda c: train(c.run, "--max_steps", "16"),
        2,
        ("checkpoint-30.pt", "8 or more digits", "rename it"),
        setup=lambda c, m: write(c.run / "checkpoint-30.pt", b"x"),
        check=lambda c, r: names(c.run) == ["checkpoint-30.pt"],
    ),
    Case(
        "a checkpoint copied to a larger step (cp …16.pt …99999999.pt)",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("checkpoint-99999999.pt", "records step 16", "move it out"),
        setup=copied_checkpoint,
        check=lambda c, r: names(c.run) == c.before,
    ),
    Case(
        "only metrics.jsonl and results.json of an earlier run",
        lambda c: train(c.run, "--max_steps", "16"),
        2,
        ("metrics.jsonl and results.json", "another --run_dir", "move them"),
        setup=earlier_results_only,
        check=lambda c, r: (c.run / "results.json").read_text() == '{"bleu": 12.5}\n'
        and len(metrics(c.run)) == 1,
    ),
    Case(
        "full disk while appending metrics",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("metrics.jsonl", "No space left", "intact"),
        setup=full_disk_on_metrics,
        check=lambda c, r: (c.run / "metrics.jsonl").read_bytes() == c.before
        and not list(c.run.glob(".*.part")),
    ),
    Case(
        "full disk while writing curve.png",
        lambda c: train(c.run, "--max_steps", "32"),
        2,
        ("curve.png", "No space left"),
        setup=full_disk_on_curve,
        check=lambda c, r: (c.run / "curve.png").read_bytes() == c.curve
        and (c.run / "checkpoint-00000032.pt").is_file()
        and not list(c.run.glob(".curve*")),
    ),
    Case(
        "results.json is a directory",
        lambda c: train(c.run, "--max_steps", "16"),
        2,
        ("results.json", "Is a directory"),
        setup=lambda c, m: (c.run / "results.json").mkdir(parents=True),
        check=lambda c, r: ".part" not in r.err
        and (c.run / "checkpoint-00000016.pt").is_file(),
    ),
]
if os.geteuid() != 0:  # root writes into read-only directories
    TRAINING.append(
        Case(
            "read-only run directory",
            lambda c: train(c.run),
            2,
            ("Permission denied",),
            setup=lambda c, m: (c.run.mkdir(), c.run.chmod(0o555)),
        )
    )


@pytest.mark.parametrize("case", TRAINING, ids=lambda c: c.name)
def test_training_fault_is_one_clear_line_and_loses_nothing(
    case, tmp_path, monkeypatch, capsys
):
    ctx = SimpleNamespace(run=tmp_path / "run", main=machinery.main)
    if case.setup:
        case.setup(ctx, monkeypatch)
    capsys.readouterr()
    r = run_main(case.argv(ctx), None, monkeypatch, capsys, case.env)
    assert r.status == case.status, r.err
    assert "Traceback" not in r.err
    if case.status:
        last = r.err.strip().splitlines()[
            -1
        ]  # after the progress bars: the one line that explains
        assert last.startswith("error:") and all(w in last for w in case.words), r.err
    if case.check:
        assert case.check(ctx, r), (r.out, r.err)


def test_a_second_run_in_a_run_directory_is_refused_while_the_first_lives(
    tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, str(SCRIPT), *train(run_dir, "--epochs", "1000")],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lock = run_dir / "run.lock"
        deadline = time.time() + 120
        while (
            not (lock.is_file() and lock.read_text().strip()) and time.time() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None
        r = run_main(train(run_dir, "--max_steps", "16"), None, monkeypatch, capsys)
        assert r.status == 2 and "Traceback" not in r.err
        last = r.err.strip().splitlines()[-1]
        assert f"in use by process {first.pid}" in last and "another --run_dir" in last
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # the lock went with the process: the same command now resumes whatever the first
    # one saved
    r = run_main(train(run_dir, "--max_steps", "16"), None, monkeypatch, capsys)
    assert r.status == 0, r.err
    assert no_step_twice(run_dir) and (run_dir / "results.json").is_file()


# --- the script itself: closed streams, an ASCII terminal, Ctrl-C -------------------


def script(*argv, env=None, close=(), timeout=300):
    """Run the_annotated_transformer.py with file descriptors ``close`` closed."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=not close,
        stdout=subprocess.PIPE if close and 1 not in close else None,
        stderr=subprocess.PIPE if close else None,
        stdin=subprocess.DEVNULL if 0 not in close else None,
        preexec_fn=(lambda: [os.close(fd) for fd in close]) if close else None,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "close, command, words",
    [
        ((1,), "translate", "standard output is closed"),
        ((1,), "evaluate", "standard output is closed"),
        ((0,), "translate", "standard input is closed"),
    ],
)
def test_a_closed_stream_is_one_line(model, close, command, words):
    more = [] if command == "translate" and 0 in close else ["1 2"]
    if command == "evaluate":
        more = ["--split", "test"]
    ck = str(model.ck)
    r = script(command, "--checkpoint", ck, "--beam", "1", *more, close=close)
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_ascii_terminal_gets_help_and_training(tmp_path):
    env = {"PYTHONIOENCODING": "ascii"}
    r = script("train", "--help", env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    r = script(*train(tmp_path / "run", "--max_steps", "16"), env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "run" / "results.json").is_file()


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    time.sleep(0.4)  # inside the imports (torch takes seconds)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.decode().strip() == "interrupted", err


def test_a_second_ctrl_c_exits_quietly_with_the_same_status(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), *train(run_dir, "--epochs", "1000")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 240
        while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "interrupted" in err


# --- round four: settings that cannot make a meaningful run, sizes, streams ----------


def tiny_mirror(c, damage: Optional[Callable] = None) -> Path:
    """An IWSLT14-layout mirror of a few made-up tokenized sentences at ``c.tmp``; then
    ``damage(folder)``."""
    folder = c.tmp / "mirror" / "iwslt14"
    words = [f"w{i}" for i in range(30)]
    for split, n in (("train", 60), ("valid", 10), ("test", 10)):
        lines = [" ".join(words[(i * 7 + k) % 30] for k in range(6)) for i in range(n)]
        for lang in ("de", "en"):
            write(folder / f"{split}.{lang}", "\n".join(lines) + "\n")
    if damage:
        damage(folder)
    return folder


def mirror_train(c, *more) -> list:
    """Train the tiny preset on the mirror of :func:`tiny_mirror`, offline."""
    base = [
        "train",
        "--config",
        "tiny",
        "--dataset",
        "iwslt14",
        "--min_freq",
        "1",
        "--data_mirror",
        str(c.tmp / "mirror"),
        "--data_dir",
        str(c.tmp / "data"),
        "--download",
        "false",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--max_eval_sentences",
        "2",
        "--run_dir",
        str(c.tmp / "run"),
    ]
    return given_once(base, more)


def replaced_by(what: str) -> Callable:
    """A damage for :func:`tiny_mirror`: ``valid.en`` replaced by ``what``."""

    def damage(folder: Path) -> None:
        target = folder / "valid.en"
        target.unlink()
        if what == "a directory":
            target.mkdir()
        elif what == "a symbolic link loop":
            target.symlink_to(folder / "loop.en")
            (folder / "loop.en").symlink_to(target)

    return damage


def emptied(folder: Path) -> None:
    for lang in ("de", "en"):
        write(folder / f"train.{lang}", b"")


def cut_cached_bpe(c) -> None:
    """The tiny mirror's cached BPE model, cut in half after it was built."""
    tiny_mirror(c)
    cfg = machinery.get_config(
        "tiny",
        dataset="iwslt14",
        vocab="bpe",
        bpe_size=40,
        data_mirror=str(c.tmp / "mirror"),
        data_dir=str(c.tmp / "data"),
        download=False,
    )
    machinery.load_dataset(cfg, log=lambda *a, **k: None)
    (model,) = (c.tmp / "data" / "cache").glob("bpe-*.model")
    model.write_bytes(model.read_bytes()[: len(model.read_bytes()) // 2])


def bpe_cut_in_half(c, digests: bool = True) -> None:
    """The test checkpoint carrying a real BPE model (and its vocabulary), then the model
    cut in half; with or without the digests written with it."""
    nb = machinery.parts.notebook()
    text = [f"ein satz mit {w} und {v}" for w in "abcdefgh" for v in "ijklmnop"]
    full = nb.Subwords.train(text, 60)

    def edit(state):
        state["subwords"] = torch.frombuffer(
            bytearray(full.model_proto), dtype=torch.uint8
        )
        state["vocab"] = {"src": full.vocab.itos, "tgt": full.vocab.itos}
        state["digests"] = machinery.runfiles.carried_digests(state)
        if not digests:
            del state["digests"]
        half = full.model_proto[: len(full.model_proto) // 2]
        state["subwords"] = torch.frombuffer(bytearray(half), dtype=torch.uint8)

    edited(c, "bpe.pt", edit)


class Payload:
    """A pickle that would create a file if it were ever unpickled by plain pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def malicious_pickle(c) -> None:
    import pickle

    c.marker = c.tmp / "pwned"
    write(c.tmp / "evil.pt", pickle.dumps({"model": Payload(c.marker)}))


def no_run(c, r) -> bool:
    return not (c.tmp / "run").exists()


ROUND_FOUR = [
    *[
        Case(
            f"train {' '.join(opt)}",
            lambda c, opt=opt: [*train_with(*opt), "--run_dir", str(c.tmp / "run")],
            2,
            words,
            check=no_run,
        )
        for opt, words in [
            (["--N", "99999999999999999999"], ("N", "at most 2,147,483,647")),
            (["--seed", "99999999999999999999"], ("seed", "from 0 to 4,294,967,295")),
            (["--bpe_size", "100000000000000000000"], ("bpe_size", "to 1000000")),
            (
                ["--keep_checkpoints", "2", "--average_last", "5"],
                ("average_last", "keep_checkpoints=2", "--keep_checkpoints"),
            ),
            (["--N", "100000"], ("cannot fit", "GiB", "available", "--N")),
            (["--N_dec", "2147483647"], ("cannot fit", "GiB")),
            (["--d_model", "1000000"], ("cannot fit", "--d_model")),
            (["--d_ff", "1000000000"], ("cannot fit", "--d_ff")),
            (["--d_k", "2147483647"], ("cannot fit",)),
            (
                ["--tie_weights", "true", "--shared_vocab", "false"],
                ("tie_weights", "--shared_vocab true", "--tie_weights false"),
            ),
            (
                ["--batch_tokens", "5"],
                ("batch_tokens=5", "below one sentence", "--batch_tokens 12"),
            ),
        ]
    ],
    Case(
        "train --config <100,000 characters>: the value is cut",
        lambda c: ["train", "--config", "x" * 100_000],
        2,
        ("--config", "100,002 characters"),
        check=lambda c, r: len(r.err) < 1000,
    ),
    Case(
        "train --max_tokens 1 keeps no training pair",
        lambda c: mirror_train(c, "--max_tokens", "1"),
        2,
        ("no training pairs left", "max_tokens=1", "--max_tokens"),
        setup=tiny_mirror,
        check=no_run,
    ),
    Case(
        "train --vocab words --min_freq 1000000: only the specials",
        lambda c: mirror_train(c, "--min_freq", "1000000"),
        2,
        ("vocabulary holds only 4 symbols", "--min_freq"),
        setup=tiny_mirror,
        check=no_run,
    ),
    Case(
        "empty training files (0 bytes, both sides)",
        lambda c: mirror_train(c),
        2,
        ("train.de", "train.en", "no sentence pairs"),
        setup=lambda c: tiny_mirror(c, emptied),
        check=no_run,
    ),
    Case(
        "one file of the mirror missing",
        lambda c: mirror_train(c),
        2,
        ("valid.en is missing", "mirror"),
        setup=lambda c: tiny_mirror(c, lambda f: (f / "valid.en").unlink()),
        check=no_run,
    ),
    *[
        Case(
            f"a mirror file that is {what}",
            lambda c: mirror_train(c),
            2,
            (f"valid.en is {what}",),
            setup=lambda c, what=what: tiny_mirror(c, replaced_by(what)),
            check=no_run,
        )
        for what in ("a directory", "a symbolic link loop")
    ],
    Case(
        "the cached BPE model cut in half",
        lambda c: mirror_train(c, "--vocab", "bpe", "--bpe_size", "40"),
        2,
        ("cached BPE model", "damaged", "SHA-256"),
        setup=cut_cached_bpe,
        check=no_run,
    ),
    Case(
        "a checkpoint whose BPE model was cut in half",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "bpe.pt"), "1"],
        2,
        ("bpe.pt", "damaged", "BPE model", "SHA-256"),
        setup=bpe_cut_in_half,
        check=lambda c, r: r.out == "",
    ),
    Case(
        "the same, in a checkpoint written before digests",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "bpe.pt"), "1"],
        2,
        ("bpe.pt", "damaged", "BPE model"),
        setup=lambda c: bpe_cut_in_half(c, digests=False),
        check=lambda c, r: r.out == "",
    ),
    Case(
        "translate --checkpoint FILE --average_last 3",
        lambda c: translate(c, "--average_last", "3", "1 2"),
        2,
        ("--average_last", "--run_dir", "cannot apply"),
        check=lambda c, r: r.out == "",
    ),
    Case(
        "translate --average_last 99999999999999999999: what is there, said",
        lambda c: [
            "translate",
            "--run_dir",
            str(c.run),
            "--beam",
            "1",
            "--average_last",
            "99999999999999999999",
            NORMAL[0],
        ],
        0,
        check=lambda c, r: "averaging those 1" in r.err
        and r.out == c.alone[NORMAL[0]] + "\n",
    ),
    Case(
        "a plain-pickle malicious checkpoint: refused with no warning first",
        lambda c: ["translate", "--checkpoint", str(c.tmp / "evil.pt"), "1"],
        2,
        ("evil.pt", "not a checkpoint"),
        setup=malicious_pickle,
        check=lambda c, r: "Warning" not in r.err and not c.marker.exists(),
    ),
    Case(
        "standard output closed (train)",
        lambda c: [*TRAIN, "--run_dir", str(c.tmp / "run")],
        2,
        ("standard output is closed",),
        streams="no stdout",
        check=no_run,
    ),
    *[
        Case(
            f"{' '.join(f'{k}={v}' for k, v in env.items())}",
            lambda c: [*TRAIN, "--run_dir", str(c.tmp / "run")],
            2,
            words,
            env=env,
            check=no_run,
        )
        for env, words in [
            ({"WORLD_SIZE": "2", "RANK": "5"}, ("RANK=5", "WORLD_SIZE=2")),
            ({"WORLD_SIZE": "0"}, ("WORLD_SIZE=0", "at least 1")),
            (
                {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "garbage"},
                ("MASTER_PORT", "'garbage'", "port number"),
            ),
        ]
    ],
]


@pytest.mark.parametrize("case", ROUND_FOUR, ids=lambda c: c.name)
def test_round_four_is_one_clear_line_and_loses_nothing(
    case, model, tmp_path, monkeypatch, capsys
):
    test_bad_input_is_one_clear_line_and_loses_nothing(
        case, model, tmp_path, monkeypatch, capsys
    )


def exploding(c, monkeypatch):
    c.before = None


def finished(c, monkeypatch):
    c.main(train(c.run, "--max_steps", "32"))
    c.results = (c.run / "results.json").read_bytes()
    c.before = names(c.run)


def damaged_newest(where: str) -> Callable:
    """Two checkpoints; then one +inf in the newest one's weights or Adam moments."""

    def setup(c, monkeypatch):
        c.main(train(c.run, "--max_steps", "32", "--keep_checkpoints", "5"))
        older, c.newest = machinery.checkpoint_paths(c.run)[-2:]
        c.older = older
        state = torch.load(c.newest, weights_only=True)
        if where == "weights":
            c.tensor = next(k for k, v in state["model"].items() if v.dim() > 1)
            state["model"][c.tensor].view(-1)[0] = float("inf")
        else:
            state["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[0] = float("inf")
            c.tensor = "exp_avg_sq"
        torch.save(state, c.newest)

    return setup


def set_aside(c, r) -> bool:
    return (
        resumed_from(c, r, c.older)
        and c.tensor in r.err
        and "falling back" in r.err
        and (c.run / (c.newest.name + ".unreadable")).is_file()
        and json.loads((c.run / "results.json").read_text())["steps"] == 48
    )


TRAINING_ROUND_FOUR = [
    Case(
        "train --lr_factor 1e6: a finite loss that explodes",
        lambda c: train(c.run, "--lr_factor", "1e6", "--max_steps", "48"),
        2,
        ("loss exploded", "ln 14", "--lr_factor", "--warmup"),
        check=lambda c, r: not (c.run / "results.json").exists(),
    ),
    Case(
        "re-running a finished run with other settings",
        lambda c: train(
            c.run, "--max_steps", "32", "--epochs", "1", "--max_eval_sentences", "2"
        ),
        2,
        ("finished run", "epochs=16", "--run_dir"),
        setup=finished,
        check=lambda c, r: (c.run / "results.json").read_bytes() == c.results
        and names(c.run) == c.before,
    ),
    Case(
        "resuming with another --seed",
        lambda c: train(c.run, "--max_steps", "48", "--seed", "7"),
        2,
        ("seed=1", "--seed 1", "--run_dir"),
        setup=finished,
        check=lambda c, r: (c.run / "results.json").read_bytes() == c.results
        and names(c.run) == c.before,
    ),
    Case(
        "resuming with another --lr_factor: said in one line",
        lambda c: train(c.run, "--max_steps", "48", "--lr_factor", "2"),
        0,
        setup=finished,
        check=lambda c, r: "settings changed since the checkpoint (lr_factor 1.0 → 2.0)"
        in r.out
        and json.loads((c.run / "results.json").read_text())["steps"] == 48,
    ),
    Case(
        "+inf in the newest checkpoint's weights: set aside, the one before resumed",
        lambda c: train(c.run, "--max_steps", "48", "--keep_checkpoints", "5"),
        0,
        setup=damaged_newest("weights"),
        check=set_aside,
    ),
    Case(
        "+inf in the newest checkpoint's Adam moments: set aside too",
        lambda c: train(c.run, "--max_steps", "48", "--keep_checkpoints", "5"),
        0,
        setup=damaged_newest("optimizer"),
        check=set_aside,
    ),
    Case(
        "run.lock is a directory",
        lambda c: train(c.run, "--max_steps", "16"),
        2,
        ("run.lock", "Is a directory"),
        setup=lambda c, m: (c.run / "run.lock").mkdir(parents=True),
        check=lambda c, r: names(c.run) == ["run.lock"],
    ),
]


@pytest.mark.parametrize("case", TRAINING_ROUND_FOUR, ids=lambda c: c.name)
def test_training_round_four_is_one_clear_line_and_loses_nothing(
    case, tmp_path, monkeypatch, capsys
):
    test_training_fault_is_one_clear_line_and_loses_nothing(
        case, tmp_path, monkeypatch, capsys
    )


# The script itself, round four: full and closed streams, a closed pipe, the C locale,
# SIGHUP, a partner process that never comes, and a memory limit.


def full_stdout(*argv, timeout=300):
    """Run the script with standard output on /dev/full."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, str(SCRIPT), *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=timeout,
        )


@pytest.mark.parametrize(
    "argv", [["--help"], ["train", "--help"], ["translate", "--help"]]
)
def test_help_to_a_full_disk_is_one_line_and_not_0(argv):
    r = full_stdout(*argv)
    err = r.stderr.decode()
    assert r.returncode == 2 and "standard output" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_help_to_a_closed_stdout_is_one_line_and_not_0():
    r = script("--help", close=(1,))
    err = r.stderr.decode()
    assert r.returncode == 2 and "standard output is closed" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_training_to_a_full_disk_names_standard_output(tmp_path):
    r = full_stdout(*train(tmp_path / "run", "--max_steps", "16"))
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot write to standard output"), err[-2000:]
    assert "No space left" in last, last


def test_translate_into_a_closed_pipe_ends_quietly(model):
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), "translate", "--checkpoint", str(model.ck)]
        + ["--beam", "1", "--input", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    p.stdout.close()  # `| head -0`: the reader is gone before the first line
    _, err = p.communicate(("\n".join(NORMAL * 50) + "\n").encode(), timeout=300)
    assert err.decode() == "" and p.returncode == 141, err.decode()


def test_a_sentence_argument_under_the_c_locale_is_read_as_utf8(model):
    sentence = "1 2 ä 3"
    common = ["translate", "--checkpoint", str(model.ck), "--beam", "1"]
    env = {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0"}
    as_argument = script(*common, sentence, env=env)
    from_stdin = subprocess.run(
        [sys.executable, str(SCRIPT), *common],
        input=(sentence + "\n").encode(),
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=300,
    )
    assert as_argument.returncode == 0, as_argument.stderr.decode()
    assert as_argument.stdout == from_stdin.stdout
    assert as_argument.stdout.count(b"\n") == 1


def test_sighup_saves_a_checkpoint_like_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), *train(run_dir, "--epochs", "1000")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 240
        while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGHUP)
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130 and "checkpoint saved" in err, err[-2000:]
    assert machinery.checkpoint_paths(run_dir), err[-2000:]


def test_a_process_whose_partners_never_come_says_so_and_gives_up(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "ANNOTATED_TRANSFORMER_START_TIMEOUT": "6",
    }
    r = script(*train(tmp_path / "run"), env=env, timeout=240)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert "waiting for the other 1 process(es)" in err, err
    last = err.strip().splitlines()[-1]
    assert "did not start within 6 s" in last and "MASTER_PORT" in last, err
    assert not (tmp_path / "run").exists()


def test_a_model_too_large_is_refused_under_a_memory_limit(tmp_path):
    """--N 100000 under a 2 GiB address-space limit: refused by the estimate, with what
    it needs and what is left, long before the allocator would fail, the process
    having used a few hundred MB (torch itself and the data) at its peak."""
    import resource

    def limit():  # inherited by the program, which the reporter below starts
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    report = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(r.returncode)"
    )
    r = subprocess.run(
        [sys.executable, "-c", report, sys.executable, str(SCRIPT),
         *train(tmp_path / "run", "--N", "100000")],
        capture_output=True,
        preexec_fn=limit,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "cannot fit" in last and "address-space limit" in last, err
    assert "MemoryError" not in err and not (tmp_path / "run").exists()
    peak_mib = int(r.stdout.split()[-1]) / 1024  # ru_maxrss: KiB on Linux
    assert peak_mib < 500, f"{peak_mib:.0f} MiB before the refusal"


def test_dot_dot_after_a_link_means_one_folder_for_every_file(tmp_path, capsys):
    """--run_dir X/link/../run: ".." is taken as the operating system takes it (the
    link's target's parent), for the lock and every other file alike."""
    (tmp_path / "elsewhere" / "a").mkdir(parents=True)
    (tmp_path / "X").mkdir()
    (tmp_path / "X" / "link").symlink_to(tmp_path / "elsewhere" / "a")
    run = str(tmp_path / "X" / "link" / ".." / "run")
    status = machinery.main([*TRAIN, "--max_steps", "2", "--run_dir", run])
    assert status == 0, capsys.readouterr().err
    assert (tmp_path / "elsewhere" / "run" / "run.lock").is_file()
    assert machinery.checkpoint_paths(tmp_path / "elsewhere" / "run")
    assert sorted(p.name for p in (tmp_path / "X").iterdir()) == ["link"]


def test_the_training_log_names_its_threads_and_their_waiting(tmp_path, capsys):
    from machinery.devices import usable_cores

    status = machinery.main([*TRAIN, "--max_steps", "1", "--run_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0
    first = out.splitlines()[0]
    assert first.startswith("threads: ") and "OMP_WAIT_POLICY" in first
    threads = int(first.split()[1])
    assert 1 <= threads <= usable_cores() or "OMP_NUM_THREADS=" in first


def test_a_deleted_working_directory_is_one_line(tmp_path):
    # torch would die loading its native libraries from a folder that no longer exists
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(
        ["bash", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" "$1" train',
         sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "working directory was deleted" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

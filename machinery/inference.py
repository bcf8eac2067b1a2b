"""The ``translate`` and ``evaluate`` commands: a trained model rebuilt from its
checkpoints and decoded with §6.1's beam search.

`load_for_inference` rebuilds the model from one checkpoint or the average of the last
few (§6.1 averages the last 5); `translate_lines` encodes raw sentences as training did
and decodes them with `translate`; `run_inference_command` reads the input, prints the
translations or sacreBLEU's score, and names the lines it had to skip. `main`
(`cli.py`) dispatches to it, and shares its one-line parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from .config import Config, device_problem, shorten
from .data import CORPORA, locate_test_split, make_copy_data, make_tokenizer
from .datafiles import DataError, read_lines, read_parallel, read_stream
from .devices import resolve_attention, resolve_device
from .parts import notebook
from .runfiles import (
    CheckpointError,
    average_checkpoints,
    checkpoint_paths,
    checkpoint_subwords,
    first_line,
    load_checkpoint,
    misnamed_checkpoints,
    misnamed_message,
)
from .export import META, SHIPPED, load_model, sha256_of
from .translation import translate

if TYPE_CHECKING:
    from the_annotated_transformer import EncoderDecoder, Subwords, Vocab


# ### Translating and scoring with a trained model
#
# A checkpoint carries its config, its vocabularies and (with `vocab="bpe"`) its BPE
# model, so a trained model can be rebuilt from it alone: `load_for_inference` reads one
# checkpoint file, or the last $K$ of a run directory averaged as §6.1 does.
# `encode_sources` tokenizes raw sentences the way training did: into BPE pieces with
# the checkpoint's own model, or, for word vocabularies, with spaCy (Multi30k) or at
# spaces (IWSLT14, the copy task). IWSLT14 input is expected in its prepared form
# (tokenized, lowercased) either way. The notebook's `detokenize` turns the output back
# into text.


def config_from_dict(values: dict) -> Config:
    """A :class:`Config` from a checkpoint's saved fields (unknown to it: defaults) —
    for §6.1 inference."""
    names = {f.name for f in dataclasses.fields(Config)} - {
        "device"
    }  # trained elsewhere: decode anywhere
    kept = {
        k: (tuple(v) if isinstance(v, list) else v)
        for k, v in values.items()
        if k in names
    }
    return Config(**kept)


def load_for_inference(
    checkpoint: Optional[Path] = None,
    run_dir: Optional[Path] = None,
    average_last: int = 1,
    device="cpu",
) -> tuple[EncoderDecoder, Config, Vocab, Vocab, Optional[Subwords]]:
    """(model in eval mode, config, source vocab, target vocab, BPE model or None) from
    a checkpoint file, or the average of the last ``average_last`` checkpoints of
    ``run_dir`` (§6.1 averages the last 5)."""
    nb = notebook()
    if checkpoint is not None:
        paths = [Path(checkpoint)]
    else:
        paths = checkpoint_paths(Path(run_dir))[-max(average_last, 1) :]
        if not paths and Path(run_dir).is_dir() and misnamed_checkpoints(run_dir):
            raise CheckpointError(misnamed_message(misnamed_checkpoints(run_dir)))
        if not paths:
            raise CheckpointError(
                f"no checkpoint-*.pt in {run_dir}"
                + ("" if Path(run_dir).is_dir() else " (it is not a directory)")
            )
    state = load_checkpoint(paths[-1])
    subwords = checkpoint_subwords(state, paths[-1])  # checked before the model
    try:
        cfg = config_from_dict(state["config"])
        src_vocab, tgt_vocab = (
            nb.Vocab(state["vocab"]["src"]),
            nb.Vocab(state["vocab"]["tgt"]),
        )
        # the path for the device decoding runs on (the weights are the same for both)
        attention = resolve_attention("auto", torch.device(device))[0]
        model = nb.make_model(len(src_vocab), len(tgt_vocab), cfg, attention=attention)
        weights = average_checkpoints(paths) if len(paths) > 1 else state["model"]
        model.load_state_dict(weights)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"{paths[-1]} does not hold a model this program can build "
            f"({first_line(e)})"
        ) from e
    for name, tensor in weights.items():  # checked once, here: decoding trusts them
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            where = paths[-1] if len(paths) == 1 else f"the average of {len(paths)} "
            raise CheckpointError(
                f"{where}{'' if len(paths) == 1 else 'checkpoints'}: weight {name} "
                "holds NaN or infinite values (training diverged, or the file is "
                "damaged); use an earlier checkpoint"
            )
    return (model.to(device).eval(), cfg, src_vocab, tgt_vocab, subwords)


def encode_sources(
    lines: Sequence[str],
    dataset: str,
    src_vocab: Vocab,
    subwords: Optional[Subwords] = None,
) -> list[list[int]]:
    """Raw source sentences → ``<s> ids </s>``, tokenized as in training (§5.1: BPE
    pieces, or words)."""
    nb = notebook()
    tokenize = (
        subwords.encode
        if subwords is not None
        else make_tokenizer(dataset, CORPORA[dataset].src)
    )
    return [[nb.BOS] + src_vocab(toks) + [nb.EOS] for toks in tokenize(list(lines))]


# What `evaluate` scores: two aligned files given on the command line, or the test or
# validation split of the checkpoint's data set — the copy task's are regenerated from
# its seed; for Multi30k it can also be the 2017 or 2018 test set.


def evaluation_pairs(args, cfg: Config) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) for ``evaluate`` (§6.1): ``--src``/``--ref``, or
    a split; the first ``--first``."""
    src, ref = _all_evaluation_pairs(args, cfg)
    return (src[: args.first], ref[: args.first]) if args.first else (src, ref)


def _all_evaluation_pairs(args, cfg: Config) -> tuple[list[str], list[str]]:
    """Every (source line, reference line) that ``evaluate`` was pointed at."""
    if (args.src is None) != (args.ref is None):
        raise DataError(
            "give both --src and --ref, or neither (to score the test split)"
        )
    if args.src is not None:
        src, ref = read_lines(args.src), read_lines(args.ref)
        if len(src) != len(ref):
            raise DataError(
                f"misaligned files: {args.src} has {len(src)} lines, "
                f"{args.ref} has {len(ref)}"
            )
        if not src:
            raise DataError(
                f"nothing to score: {args.src} and {args.ref} hold no lines"
            )
        return src, ref
    args.split = args.split or "test"
    if CORPORA[cfg.dataset].synthetic:
        if args.split not in ("test", "valid"):
            raise DataError(
                f"the {cfg.dataset} task has no split {args.split!r} "
                "(known: test, valid)"
            )
        data = make_copy_data(cfg)
        pairs = data.splits[args.split]
        return (
            [" ".join(data.src_vocab.lookup_tokens(s[1:-1])) for s, _ in pairs],
            [" ".join(data.tgt_vocab.lookup_tokens(t[1:-1])) for _, t in pairs],
        )
    if args.data_mirror is not None:
        cfg = dataclasses.replace(cfg, data_mirror=args.data_mirror)
    pairs, _ = read_parallel(*locate_test_split(cfg.dataset, args.split, cfg))
    return [s for s, _ in pairs], [t for _, t in pairs]


# The two commands. `translate` reads sentences from its arguments, from a file
# (`--input`), or from standard input, and prints one translation per line; `evaluate`
# scores a pair of parallel files (`--src`, `--ref`; by default the data set's test
# split, `--split valid` its validation split, `--first N` only the first N pairs) and
# prints sacreBLEU's score and signature line. Both decode with beam size 4 and $\alpha
# = 0.6$ (§6.1) unless told otherwise (`--beam 1` is greedy). Their options are checked
# as they are parsed: a beam of at least 1, a finite $\alpha \ge 0$ (beam search's early
# stop needs it), at least one checkpoint to average, a device this machine has.


# Their parser, like `train`'s (`cli.py`), prints every mistake as one line.


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2 — our
    addition."""

    def _print_message(self, message, file=None):
        """Write ``message`` (help, usage) to ``file``; a failure is one line, not
        ignored as argparse ignores it (our addition)."""
        file = file or sys.stderr
        if not message or file is None:  # nothing to say, or nowhere (closed)
            return
        try:
            file.write(message)
            file.flush()
        except OSError as e:
            if file is sys.stdout:
                _quiet_stdout()
            name = "standard output" if file is sys.stdout else "standard error"
            raise OutputError(f"cannot write to {name} ({e.strerror or e})") from None

    def error(self, message: str):
        """Print ``message`` as one line and exit with status 2 (argparse prints the
        usage too)."""
        message = re.sub(r"\S{200,}", lambda m: shorten(m.group(0)), message)
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _whole_number(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low`` (and at most ``high``)
    (our addition)."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(
                f"must be from {low} to {high:,}, got {value:,}"
            )
        return value

    return check


def _alpha(text: str) -> float:
    """An argparse type: the length penalty α of §6.1, a finite number from 0 to 10
    (the bound of the config's length_penalty_alpha: more overflows)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= 10):
        raise argparse.ArgumentTypeError(
            f"must be a finite number, 0 or more and at most 10, got {text!r}"
        )
    return value


def _device(text: str) -> str:
    """An argparse type: a device this machine has (see :func:`device_problem`)."""
    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def inference_parser(command: str) -> argparse.ArgumentParser:
    """Options of the ``translate`` and ``evaluate`` commands (§6.1 decoding)."""
    parser = OneLineParser(prog=f"the_annotated_transformer.py {command}")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--run_dir",
        "--run-dir",
        type=Path,
        help="a run directory: average its last checkpoints",
    )
    where.add_argument("--checkpoint", type=Path, help="one checkpoint file")
    where.add_argument(
        "--model",
        type=Path,
        help="a model folder written by export (the default, where no run is named: "
        "the shipped models/multi30k-small)",
    )
    parser.add_argument(
        "--average_last",
        "--average-last",
        type=_whole_number(1),
        default=None,
        help="checkpoints of --run_dir to average (default 5, fewer if fewer exist)",
    )
    parser.add_argument(
        "--beam",
        type=_whole_number(1, 1000),
        default=4,
        help="beam size (1 = greedy; default 4, §6.1; at most 1000)",
    )
    parser.add_argument(
        "--alpha", type=_alpha, default=0.6, help="length penalty α (default 0.6, §6.1)"
    )
    parser.add_argument("--device", type=_device, default="auto")
    if command == "translate":
        parser.add_argument(
            "sentences",
            nargs="*",
            help="sentences to translate (else --input or stdin)",
        )
        parser.add_argument(
            "--input",
            type=Path,
            help="a file with one sentence per line (- for standard input)",
        )
    else:
        parser.add_argument(
            "--src",
            type=Path,
            help="source sentences, one per line (default: test split)",
        )
        parser.add_argument("--ref", type=Path, help="references, aligned with --src")
        parser.add_argument(
            "--split",
            default=None,
            help="without --src/--ref: test (the default), valid, or for Multi30k "
            "test_2017_flickr / test_2018_flickr",
        )
        parser.add_argument(
            "--first",
            type=_whole_number(1),
            default=0,
            help="score only the first N pairs (default: all)",
        )
        parser.add_argument(
            "--data_mirror",
            "--data-mirror",
            default=None,
            help="folder holding the data sets",
        )
        parser.add_argument(
            "--hypotheses",
            type=Path,
            default=None,
            help="write the decoded sentences (detokenized, as scored) to this file, "
            "one a line, and print their SHA-256",
        )
    return parser


# Output line $i$ is the translation of input line $i$, whatever the input holds. A
# blank line gives a blank line without decoding (the model would otherwise invent a
# sentence for `<s> </s>`). A line longer than the model's positional encoding covers
# (`max_len` positions, `<s>` and `</s>` included) cannot be encoded; rather than
# failing every other line with it, the commands translate the rest, print an empty line
# in its place, name it on standard error and exit with status 1.


def translate_lines(
    lines: Sequence[str],
    model: EncoderDecoder,
    cfg: Config,
    src_vocab: Vocab,
    tgt_vocab: Vocab,
    subwords: Optional[Subwords],
    device,
    beam_size: int,
    alpha: float,
) -> tuple[list[str], list]:
    """One translation per line (§6.1 decoding); blank and over-long lines give "";
    returns (outputs, skipped).

    ``skipped`` lists (line number from 1, tokens) of the lines longer than
    ``cfg.max_len`` positions.
    """
    nb = notebook()
    wanted = [i for i, line in enumerate(lines) if line.strip()]
    sources = encode_sources(
        [lines[i] for i in wanted], cfg.dataset, src_vocab, subwords
    )
    skipped = [
        (i + 1, len(ids) - 2)
        for i, ids in zip(wanted, sources)
        if len(ids) > cfg.max_len
    ]
    todo = [(i, ids) for i, ids in zip(wanted, sources) if len(ids) <= cfg.max_len]
    out = [""] * len(lines)
    if todo:
        tokens = translate(
            model,
            [ids for _, ids in todo],
            tgt_vocab,
            cfg,
            device,
            beam_size=beam_size,
            alpha=alpha,
        )
        texts = nb.detokenize(tokens, CORPORA[cfg.dataset], subwords)
        for (i, _), text in zip(todo, texts):
            out[i] = " ".join(
                text.splitlines()
            )  # one output line per input line, always
    return out, skipped


def hypotheses_text(hyps: Sequence[str]) -> bytes:
    """The decoded sentences as ``evaluate --hypotheses`` writes them: UTF-8, one a
    line, each line ended (our addition)."""
    return "".join(f"{h}\n" for h in hyps).encode("utf-8")


def write_hypotheses(path: Path, hyps: Sequence[str]) -> str:
    """Write the decoded sentences to ``path`` (one a line; to a temporary name, then
    renamed) and return their SHA-256 (our addition: a score can be checked against
    the very sentences it scored)."""
    from .runfiles import write_atomic

    data = hypotheses_text(hyps)
    try:
        write_atomic(Path(path), data)
    except OSError as e:
        raise DataError(
            f"cannot write the hypotheses to {path} ({e.strerror or e})"
        ) from None
    return sha256_of(data)


def skipped_message(skipped: Sequence[tuple[int, int]], max_len: int) -> str:
    """One line naming the input lines too long for the model (our addition)."""
    named = ", ".join(f"line {n} ({k:,} tokens)" for n, k in skipped[:10])
    more = f" and {len(skipped) - 10:,} more" if len(skipped) > 10 else ""
    return (
        f"error: skipped {named}{more}: longer than the model's max_len={max_len:,} "
        "positions (<s> and </s> included); each gave an empty output line"
    )


# When standard output fails (closed, or a full disk behind it), the commands say so in
# one line, and `_quiet_stdout` keeps the interpreter from saying it again at exit
# (`script` in `cli.py` uses it too).


class OutputError(RuntimeError):
    """Standard output cannot be written (closed, a full disk, a closed pipe) — our
    addition."""


def _quiet_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's own flush at
    exit does not print a second error (our addition)."""
    if sys.stdout is not sys.__stdout__:  # replaced (a test's capture): not ours
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def argument_text(text: str, number: int) -> str:
    """A sentence given as an argument, decoded from the bytes it came as like standard
    input is — UTF-8 whatever the locale says (our addition: under ``LANG=C`` Python
    hands non-ASCII bytes over as surrogate escapes, which no tokenizer accepts)."""
    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"sentence argument {number}: invalid UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def run_inference_command(command: str, argv: Sequence[str]) -> int:
    """``translate`` or ``evaluate``: load, decode (beam search, §6.1), print; 1 if
    lines were skipped."""
    nb = notebook()
    args = inference_parser(command).parse_args(argv)
    refs = None
    if sys.stdout is None:  # closed (>&-): the output would vanish without a word
        raise DataError(
            "standard output is closed: nowhere to write; redirect it to a file"
        )
    if command == "evaluate" and args.split is not None and args.src is not None:
        raise DataError(
            "give --split or --src/--ref, not both (--split picks a split of the data "
            "set, --src/--ref score those files)"
        )
    if command == "translate":  # read first: a bad input fails before the model loads
        if args.sentences and args.input:
            raise DataError(
                "give sentences as arguments or --input, not both "
                f"({args.input} would be ignored)"
            )
        if args.sentences:
            lines = [argument_text(a, i) for i, a in enumerate(args.sentences, 1)]
        elif args.input and str(args.input) != "-":
            lines = read_lines(args.input)
        elif sys.stdin is None:  # closed (<&-)
            raise DataError(
                "standard input is closed: give sentences as arguments, --input FILE, "
                "or pipe them in"
            )
        else:
            lines = read_stream(sys.stdin.buffer, "standard input")
    if args.checkpoint is not None and args.average_last is not None:
        raise DataError(
            "--average_last averages the last checkpoints of --run_dir; --checkpoint "
            "names one file, so it cannot apply: give --run_dir, or leave "
            "--average_last out"
        )
    if args.run_dir is None and args.checkpoint is None:  # a model folder
        if args.average_last is not None:
            raise DataError(
                "--average_last averages the last checkpoints of --run_dir; a model "
                "folder holds weights averaged already: give --run_dir, or leave "
                "--average_last out"
            )
        if args.model is None:  # no run named: the shipped model
            if not (SHIPPED / META).is_file():
                raise DataError(
                    f"no model named and none shipped at {SHIPPED}: give --model "
                    "DIR, --run_dir DIR or --checkpoint FILE"
                )
            args.model = SHIPPED
    present = len(checkpoint_paths(args.run_dir)) if args.run_dir else 0
    if args.average_last and 0 < present < args.average_last:  # asked for more
        print(
            f"note: --average_last {args.average_last:,}, but {args.run_dir} holds "
            f"{present} checkpoint(s): averaging those {present}",
            file=sys.stderr,
        )
    device = resolve_device(args.device)
    if args.model is not None:
        model, cfg, src_vocab, tgt_vocab, subwords, _ = load_model(args.model, device)
    else:
        model, cfg, src_vocab, tgt_vocab, subwords = load_for_inference(
            args.checkpoint, args.run_dir, args.average_last or 5, device
        )
    if command == "evaluate":
        lines, refs = evaluation_pairs(args, cfg)
        if args.first > len(
            lines
        ):  # asked for more than there is: say so, rather than score fewer unannounced
            print(
                f"note: --first {args.first:,}, but there are only {len(lines):,} "
                "pairs: scoring all of them",
                file=sys.stderr,
            )
    hyps, skipped = translate_lines(
        lines, model, cfg, src_vocab, tgt_vocab, subwords, device, args.beam, args.alpha
    )
    try:
        if refs is None:
            for h in hyps:
                print(h)
        else:
            result = nb.bleu(hyps, refs, CORPORA[cfg.dataset])
            print(f"{result.text}\n{result.signature}")
            if args.hypotheses is not None:
                digest = write_hypotheses(args.hypotheses, hyps)
                print(f"hypotheses: {args.hypotheses} sha256 {digest}")
        sys.stdout.flush()
    except OSError as e:  # standard output closed, or a full disk behind it
        _quiet_stdout()
        if e.errno == errno.EPIPE:  # `| head -1` read enough: stop quietly, as Unix
            return 141  # tools do (128 + SIGPIPE)
        raise DataError(
            f"cannot write to standard output ({e.strerror or e}); nothing was printed "
            "whole: rerun with it redirected to a file with room"
        ) from None
    if skipped:
        print(skipped_message(skipped, cfg.max_len), file=sys.stderr)
        return 1
    return 0

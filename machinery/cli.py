"""The command line: ``train``, ``translate``, ``evaluate`` and ``export``.

``python the_annotated_transformer.py train --config NAME [--field value ...]`` trains a
preset with any config field overridden; ``translate`` and ``evaluate`` use a trained
model (their options and decoding: `inference.py`); ``export`` writes one as a model
folder (`export.py`). Every mistake is one line on standard error and a non-zero exit
status, never a traceback (``--debug`` shows one).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import signal
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

import torch.distributed as dist

from .config import PRESETS, Config, default_preset, get_config, run_dir_for, shorten
from .datafiles import DataError
from .devices import use_usable_cores
from .inference import OneLineParser, OutputError, _quiet_stdout, run_inference_command
from .runfiles import (
    CheckpointError,
    RunDirectoryError,
    TrainingInterrupted,
    first_line,
)
from .planning import PlanError
from .training import TrainingDiverged, train


def _parse_value(text: str, like, name: str = ""):
    """Turn a command-line string into the type of the config field ``name`` whose
    default is ``like``."""
    if isinstance(like, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(
            f"expected true/false, got {shorten(repr(text))}"
        )
    try:
        if isinstance(like, tuple):
            return tuple(float(x) for x in text.split(","))
        return type(like)(text)
    except ValueError:
        kind = {
            int: "a whole number",
            float: "a number",
            tuple: "numbers separated by commas",
        }
        raise argparse.ArgumentTypeError(
            f"expected {kind.get(type(like)) or 'text'}, got {shorten(repr(text))}"
        ) from None


# The fields of the data step (reading, vocabulary, filtering) that the copy task, whose
# data is generated, never uses.
COPY_UNUSED = ("vocab", "bpe_size", "min_freq", "max_tokens", "data_dir", "data_mirror")


def repeated_option(argv: Sequence[str]) -> Optional[str]:
    """A line naming an option given more than once (``--beam 1 --beam 5``: which one
    was meant?), or None (our addition). ``--run-dir`` and ``--run_dir`` are one
    option; nothing after ``--`` is an option."""
    seen: dict = {}
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if not arg.startswith("--") or len(arg) == 2:
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if "=" in arg:
            value = arg.split("=", 1)[1]
        else:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if name in seen:
            return (
                f"--{name} is given twice ({shorten(repr(seen[name]))} and "
                f"{shorten(repr(value))}): give it once"
            )
        seen[name] = value
    return None


def config_from_args(argv: Sequence[str]) -> tuple[str, Config]:
    """(command, Config) from ``train --config NAME --field value ...``."""
    parser = OneLineParser(
        prog="the_annotated_transformer.py",
        description="Train and evaluate the Transformer of Vaswani et al. (2017).",
    )
    parser.add_argument(
        "command", choices=["train"]
    )  # translate and evaluate: run_inference_command
    parser.add_argument(
        "--config",
        default=None,
        choices=list(PRESETS),
        help="a preset (default: iwslt14-small where CUDA is available, "
        "else iwslt14-sample)",
    )
    defaults = Config()
    for f in dataclasses.fields(Config):
        like = getattr(defaults, f.name)
        names = sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        parser.add_argument(
            *names,
            dest=f.name,
            default=None,
            type=lambda text, like=like, name=f.name: _parse_value(text, like, name),
            help="(default from preset)",
        )
    args = parser.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(Config)
        if getattr(args, f.name) is not None
    }
    if overrides.get("run_dir") is not None and not overrides["run_dir"].strip():
        parser.error("--run_dir must name a folder, not an empty string")
    preset = args.config or default_preset()
    try:  # the preset with the overrides: Config.__post_init__ checks every field
        cfg = get_config(preset, **overrides)
    except ValueError as e:
        parser.error(str(e))
    if cfg.dataset == "copy" and (unused := [n for n in COPY_UNUSED if n in overrides]):
        parser.error(
            f"{', '.join('--' + n for n in unused)}: the copy task makes its data "
            "rather than reading it, so these have no effect on it; leave them out"
        )
    if not cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=str(run_dir_for(cfg, preset)))
    if ".." in Path(cfg.run_dir).parts:  # one meaning of ".." for every file: the OS's
        cfg = dataclasses.replace(cfg, run_dir=os.path.realpath(cfg.run_dir))
    return args.command, cfg


# `main` runs a command and turns every failure into one line: the program's own errors
# (bad data, a checkpoint that does not fit, a run directory in use) and the operating
# system's (a missing file, a full disk) with status 2, an interruption with 130,
# anything unforeseen with 1 — and `--debug` anywhere on the line shows the traceback
# instead. In a run of several processes, the first one speaks for all of an
# interruption.


COMMANDS = {
    "train": "train a preset: --config NAME, any config field as --field value",
    "translate": "translate sentences with a trained model (--run_dir or --checkpoint)",
    "evaluate": "BLEU of a trained model on its test split, or on --src and --ref",
    "export": "write a run's averaged weights as a model folder (safetensors, JSON)",
}


def usage() -> str:
    """The top-level help: the commands, one line each (our addition)."""
    lines = [
        "usage: the_annotated_transformer.py {train,translate,evaluate,export} "
        "[options]",
        "",
        "Train and evaluate the Transformer of Vaswani et al. (2017).",
        "",
        "commands:",
        *(f"  {name:<10} {what}" for name, what in COMMANDS.items()),
        "",
        "the_annotated_transformer.py COMMAND --help lists a command's options.",
    ]
    return "\n".join(lines)


# torchrun's variables, read as whole numbers wherever processes are counted
PROCESS_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def environment_problem(environ=os.environ) -> Optional[str]:
    """A line naming a process variable that is not a whole number, or that does not
    fit the others (a rank at or above the world size, a world of 0 processes, a port
    that is not one), or None (our addition)."""
    numbers = {}
    for name in PROCESS_VARIABLES:
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and value.isascii()):
            return (
                f"environment variable {name}={shorten(repr(value))} is not a whole "
                "number (torchrun sets it); unset it or set it right"
            )
        if value is not None:
            numbers[name] = int(value)
    for size, rank in (("WORLD_SIZE", "RANK"), ("LOCAL_WORLD_SIZE", "LOCAL_RANK")):
        if numbers.get(size) == 0:
            return (
                f"environment variable {size}=0: a run needs at least 1 process; "
                "unset it or set it right"
            )
        if size in numbers and numbers.get(rank, 0) >= numbers[size]:
            return (
                f"environment variable {rank}={numbers[rank]} is not below "
                f"{size}={numbers[size]} (ranks count from 0); set them as torchrun "
                "does"
            )
    if numbers.get("WORLD_SIZE", 1) > 1 and "RANK" not in numbers:
        return (
            f"environment variable WORLD_SIZE={numbers['WORLD_SIZE']} without RANK: "
            "start the processes with torchrun, or set RANK for each"
        )
    port = environ.get("MASTER_PORT")
    if port is not None and not (
        port.strip().isdigit() and port.isascii() and 0 < int(port) < 65536
    ):
        return (
            f"environment variable MASTER_PORT={shorten(repr(port))} is not a port "
            "number (1 to 65535); unset it or set it right"
        )
    return None


def _say(*args, **kwargs) -> None:
    """``print`` for the training log, whose failure names standard output (our
    addition)."""
    try:
        print(*args, **kwargs)
    except OSError as e:
        raise OutputError(
            f"cannot write to standard output ({e.strerror or e}); the run stopped: "
            "rerun with it redirected to a file with room (the same command resumes)"
        ) from None


def main(argv: Sequence[str]) -> int:
    """Entry point of the command line: ``train``, ``translate`` or ``evaluate``;
    returns the exit status."""
    for stream in (sys.stdout, sys.stderr):  # § or × on an ASCII terminal: no crash
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if problem := environment_problem():
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if sys.stdout is None:  # closed (>&-): whatever it says would vanish
        print(
            "error: standard output is closed: nowhere to write; redirect it to a file "
            "(or /dev/null)",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):  # no command: the three, and how
        try:
            print(usage(), file=sys.stdout if argv else sys.stderr, flush=True)
        except OSError as e:  # --help > /dev/full
            _quiet_stdout()
            print(
                f"error: cannot write to standard output ({e.strerror or e})",
                file=sys.stderr,
            )
            return 2
        return 0 if argv else 2
    if problem := repeated_option(argv):
        print(f"the_annotated_transformer.py: error: {problem}", file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        print(
            f"the_annotated_transformer.py: error: unknown command {argv[0]!r} "
            f"(choose from {', '.join(COMMANDS)}; --help lists them)",
            file=sys.stderr,
        )
        return 2
    threads = use_usable_cores()  # the cores this process may use (devices.py)
    try:
        if argv and argv[0] == "export":
            from .export import run_export_command

            return run_export_command(argv[1:])
        if argv and argv[0] in ("translate", "evaluate"):
            return run_inference_command(argv[0], argv[1:])
        command, cfg = config_from_args(argv)
        if command == "train":
            _say(threads)
            summary = train(cfg, log=_say)
            if summary.get("bleu") is not None:
                _say(
                    f"done in {summary['total_minutes']:.1f} min: "
                    f"BLEU {summary['bleu']:.2f}; "
                    f"results in {summary['run_dir']}/results.json"
                )
    except TrainingInterrupted as e:
        if (
            not dist.is_initialized() or dist.get_rank() == 0
        ):  # one message, not one per process
            print(f"interrupted: {e}", file=sys.stderr)
        return 130
    except (
        DataError,
        CheckpointError,
        TrainingDiverged,
        RunDirectoryError,
        PlanError,
        OutputError,
        OSError,
    ) as e:
        if debug:
            raise
        message = (
            f"{e.strerror}: {e.filename}"
            if isinstance(e, OSError) and e.filename and e.strerror
            else first_line(e)
        )
        message = re.sub(r"\S{1000,}", lambda m: shorten(m.group(0)), message)
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # unforeseen: still one line, with the way to see more
        if debug:
            raise
        print(
            f"error: {type(e).__name__}: {first_line(e)} "
            "(run again with --debug to see where)",
            file=sys.stderr,
        )
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def script(argv: Sequence[str]) -> NoReturn:
    """``python the_annotated_transformer.py …``: :func:`main`, with Ctrl-C handled at
    both ends — our addition. Ctrl-C is Python's again while it runs (the module's
    start-up handler printed one line and left); once it has returned, another Ctrl-C
    (a second press, ~50 ms after the first) ends the process at once, quietly, with
    the same status, rather than tracing back out of an exit handler. It does not
    return: the process ends with the status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except SystemExit as e:  # argparse: --help (0) or a mistake, already said (2)
        status = e.code if isinstance(e.code, int) else 2
        if status == 0 and sys.stdout is None:  # --help >&-
            print("error: standard output is closed: nowhere to write", file=sys.stderr)
            status = 2
    signal.signal(signal.SIGINT, lambda *_: os._exit(status))
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except OSError as e:  # a full disk, a closed pipe: said once, never 0
            _quiet_stdout()
            if e.errno != errno.EPIPE:
                print(
                    f"error: cannot write to standard output ({e.strerror or e})",
                    file=sys.stderr,
                )
            status = status or (141 if e.errno == errno.EPIPE else 2)
    if sys.stderr is not None:
        sys.stderr.flush()
    # Leave now: interpreter shutdown puts SIGINT's default action back, so a Ctrl-C
    # arriving then would end the process by the signal instead of with ``status``.
    os._exit(status)

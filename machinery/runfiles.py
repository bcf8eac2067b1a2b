"""Run files: atomic writes, the metrics log, checkpoints, and the run directory's lock.

Every file a run owns is written to a temporary name and renamed over the old one, so a
crash or a full disk leaves the previous version whole. Checkpoints are read with
``weights_only=True`` (no code from the file runs) and checked against the run's model,
vocabulary and BPE model before use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from .config import weight_fields
from .devices import rng_state, unwrap
from .parts import notebook

if TYPE_CHECKING:
    from the_annotated_transformer import Subwords, Vocab

    from .config import Config
    from .data import Dataset
    from .training import Trainer


@contextmanager
def atomic_file(path: Path, mode: str = "wb"):
    """Open a temporary file beside ``path`` that replaces ``path`` only if the block
    completes.

    Downloads, prepared data, caches, checkpoints and logs all go through this one
    helper, so an interrupted write never leaves a file that looks finished.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        try:
            with os.fdopen(
                fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})
            ) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk while writing: name the file asked for
            if e.filename or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, str(path)) from None
        try:
            os.replace(tmp, path)
        except OSError as e:  # name the file asked for, not the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(folder: Path) -> None:
    """Force ``folder``'s entries (a rename, a new file) to the disk — our addition; a
    no-op where unsupported."""
    try:
        fd = os.open(
            folder, os.O_RDONLY
        )  # Windows cannot open a directory: OSError, nothing to do
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_atomic(path: Path, data) -> None:
    """Write ``data`` (bytes, or an iterable of text lines) to ``path`` atomically."""
    if isinstance(data, (bytes, bytearray)):
        with atomic_file(path, "wb") as f:
            f.write(data)
    else:
        with atomic_file(path, "w") as f:
            for line in data:
                f.write(line + "\n")


# Caches (a BPE model, a vocabulary) are written with their SHA-256 beside them, in
# ``<name>.sha256``, and checked when read (our addition): a cache damaged in a way that
# still parses would otherwise be used without a word.


def write_with_digest(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and its SHA-256 to ``path.sha256``, atomically."""
    write_atomic(path, data)
    write_atomic(Path(f"{path}.sha256"), [sha256_hex(data)])


def read_verified(path: Path) -> bytes:
    """The bytes of ``path``, checked against ``path.sha256`` when that exists; a
    mismatch raises ValueError."""
    data = Path(path).read_bytes()
    digest = Path(f"{path}.sha256")
    if digest.is_file() and digest.read_text(encoding="ascii").strip() != sha256_hex(
        data
    ):
        raise ValueError(f"its bytes do not match the SHA-256 in {digest.name}")
    return data


# Three small helpers for the checkpoint files below and for a training job: reading
# back a metrics log that a crash may have torn, and the short forms of an error and
# of the free disk space that their messages quote.


def metrics_lines_upto(raw: bytes, step: int) -> tuple[list[str], int, int]:
    """(records of step ≤ ``step``, lines that are not whole records, records after
    ``step``) — our addition."""
    kept, torn, later = [], 0, 0
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            record_step = json.loads(line)["step"]
            if not isinstance(record_step, int):
                raise TypeError(record_step)
        except (ValueError, KeyError, TypeError):
            torn += 1
            continue
        if record_step > step:
            later += 1
        else:
            kept.append(line)
    return kept, torn, later


def finished_run_problem(run_dir: Path, cfg: Config) -> Optional[str]:
    """Why re-running the finished run in ``run_dir`` with ``cfg`` would lose its
    result, or None (our addition): its ``results.json`` was made with other settings,
    and the run has nothing left to train, so the new result would only replace it."""
    try:
        saved = json.loads((Path(run_dir) / "results.json").read_text("utf-8"))
        saved = saved["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = dataclasses.asdict(cfg)

    def same(a, b) -> bool:
        return (list(a) if isinstance(a, tuple) else a) == (
            list(b) if isinstance(b, tuple) else b
        )

    diff = [
        f"{k}={saved[k]!r} (now {now[k]!r})"
        for k in now
        if k in saved and k not in RESULT_NEUTRAL and not same(saved[k], now[k])
    ]
    if not diff:
        return None
    return (
        f"run directory {run_dir} holds a finished run whose results.json was made "
        f"with {', '.join(diff[:3])}{' …' if len(diff) > 3 else ''}; re-running it "
        "with other settings would replace that result: give another --run_dir (or "
        "the run's own settings)"
    )


def changed_settings(saved: dict, cfg: Config) -> str:
    """A line naming the training settings a resumed run changes from its checkpoint's
    (dropout, smoothing, the schedule, Adam's settings, clipping, the length filter);
    "" when none (our addition: the run goes on, but it is no longer the run that was
    stopped)."""
    now = dataclasses.asdict(cfg)
    diff = [
        f"{k} {saved[k]!r} → {now[k]!r}"
        for k in RESUME_SAID
        if k in saved
        and (list(saved[k]) if isinstance(saved[k], tuple) else saved[k])
        != (list(now[k]) if isinstance(now[k], tuple) else now[k])
    ]
    return (
        f"settings changed since the checkpoint ({', '.join(diff)}): the rest of the "
        "run differs from the run that was stopped"
        if diff
        else ""
    )


RESUME_SAID = (
    "P_drop",
    "ffn_dropout",
    "attn_dropout",
    "eps_ls",
    "lr_factor",
    "warmup",
    "betas",
    "adam_eps",
    "weight_decay",
    "clip_grad",
    "max_tokens",
)


# settings that do not change a run's result (where it runs, how its files are kept)
RESULT_NEUTRAL = (
    "run_dir",
    "device",
    "precision",
    "attention",
    "compile",
    "data_dir",
    "data_mirror",
    "download",
    "eval_batch_size",
    "checkpoint_minutes",
    "keep_checkpoints",
    "examples_to_show",
)


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (torch's can run to many lines) — our
    addition, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def free_space(folder: Path) -> str:
    """How much room the disk of ``folder`` has left, in words — our addition, for error
    messages."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


# ## Checkpoint files
#
# A checkpoint holds the model, optimizer, scheduler and gradient-scaler states, the
# step and the position in the epoch, every process's random-number states, the config
# and the vocabulary. It is written to a temporary file and renamed, so a crash never
# leaves a half-written checkpoint; the last `keep_checkpoints` are kept, for averaging
# (§6.1 averages the last 5). Loading uses `torch.load(weights_only=True)`, which never
# runs code from the file. Resuming restores everything, so that N steps, a stop and N
# more steps give exactly the parameters of 2N steps in one go (a test checks it).
#
# A checkpoint is written at the end of every epoch and, inside long epochs, every
# `checkpoint_minutes` (10 by default — the interval at which §6.1 says the paper wrote
# its checkpoints). Ctrl-C (SIGINT) or SIGTERM does not kill training mid-update: the
# current update finishes, a checkpoint is saved, and the run stops with a message
# saying that the same command continues it (a second Ctrl-C stops at once). On
# resuming, the records the metrics log received after the checkpoint are dropped, so no
# step is logged twice.
#
# The file is a plain dictionary of tensors and numbers, written with `torch.save`
# through `atomic_file` (Part 2) and checked on loading against the config, the
# vocabularies and the BPE model it must match.


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: unreadable, truncated, or from another config or
    vocabulary."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file is missing, truncated or not one this program wrote (resuming
    falls back past it)."""


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used: not writable, or in use by another run (our
    addition)."""


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped training after the current update; a checkpoint was
    saved first."""


@dataclass
class Position:
    """Where training stands: updates taken, the epoch (from 0), global batches of the
    epoch consumed."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = (
        0  # batches of the epoch's global order consumed, by all processes together
    )


def save_checkpoint(
    path: Path,
    trainer: Trainer,
    data: Dataset,
    pos: Position,
    rng: Optional[list] = None,
) -> Path:
    """Write a complete training checkpoint of ``trainer`` at ``pos`` to ``path``
    atomically (our addition).

    With the model, optimizer, schedule and gradient-scaler states, the config, and
    ``data``'s vocabularies and BPE model (if any). ``pos.batch_in_epoch`` counts global
    batches, and the checkpoint records for which processes and batch settings; ``rng``
    holds each process's random-number state, in rank order (default: this process's
    alone).
    """
    cfg = trainer.cfg
    rng = rng or [rng_state(trainer.device)]
    state = {
        "format": 1,
        "model": unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "step": pos.step,
        "epoch": pos.epoch,
        "batch_in_epoch": pos.batch_in_epoch,
        "layout": {
            "world_size": len(rng),
            "accum_steps": cfg.accum_steps,
            "batch_tokens": cfg.batch_tokens,
        },
        "rng": {
            **rng[0],
            "ranks": rng,
        },  # the first process's streams at the top, as older checkpoints had them
        "config": dataclasses.asdict(cfg),
        # how precision and attention were decided (the log's lines, with what `auto`
        # measured), so that a resumed run still reports it
        "decided": dict(getattr(trainer, "decided", None) or {}),
        "vocab": {"src": data.src_vocab.itos, "tgt": data.tgt_vocab.itos},
        # the BPE model's bytes, as a tensor so that weights_only loading accepts it
        "subwords": torch.frombuffer(
            bytearray(data.subwords.model_proto), dtype=torch.uint8
        )
        if data.subwords
        else None,
    }
    state["digests"] = carried_digests(state)
    with atomic_file(path) as f:
        torch.save(state, f)
    return Path(path)


# `load_checkpoint` never runs code from the file, and refuses a checkpoint that does
# not fit: another model, vocabulary or BPE model.


def load_checkpoint(
    path: Path,
    cfg: Optional[Config] = None,
    src_vocab: Optional[Vocab] = None,
    tgt_vocab: Optional[Vocab] = None,
    subwords: Optional[Subwords] = None,
) -> dict:
    """Read a checkpoint safely (``weights_only=True``) and check it fits ``cfg``, the
    vocabularies and BPE model."""
    if not Path(path).is_file():
        where = (
            "is a directory (give a run directory as --run_dir)"
            if Path(path).is_dir()
            else "is not a regular file (a device or a pipe); give a checkpoint file"
            if Path(path).exists()
            else "does not exist"
        )
        raise UnreadableCheckpoint(f"checkpoint {path} {where}")
    try:
        with warnings.catch_warnings():  # a foreign pickle: refused below, in one line
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise UnreadableCheckpoint(
            f"cannot read checkpoint {path}: it is truncated or not a checkpoint "
            f"({first_line(e).split('. ')[0]})"
        ) from e
    if not isinstance(state, dict) or state.get("format") != 1:
        raise UnreadableCheckpoint(
            f"{path} is not a checkpoint written by this program"
        )
    missing = [
        k for k in ("model", "config", "vocab") if not isinstance(state.get(k), dict)
    ]
    if missing:
        raise UnreadableCheckpoint(
            f"{path} is damaged or hand-made: it lacks {', '.join(missing)}"
        )
    if problem := digest_problem(state):
        raise UnreadableCheckpoint(
            f"{path}: {problem}: the checkpoint is damaged; use another one"
        )
    if cfg is not None and (tensor := non_finite_tensor(state)):  # training resumes
        raise UnreadableCheckpoint(
            f"{path} holds NaN or infinite values in {tensor} (training diverged, or "
            "the file is damaged)"
        )
    return check_fits(state, path, cfg, src_vocab, tgt_vocab, subwords)


def check_fits(
    state: dict,
    path: Path,
    cfg: Optional[Config] = None,
    src_vocab: Optional[Vocab] = None,
    tgt_vocab: Optional[Vocab] = None,
    subwords: Optional[Subwords] = None,
) -> dict:
    """``state``, the checkpoint read from ``path`` (here or by another process), once
    it is checked against its name's step, ``cfg``, the vocabularies and BPE model;
    :class:`CheckpointError` where it does not fit (our addition)."""
    named = re.fullmatch(CHECKPOINT_NAME, Path(path).name)
    if named and state.get("step") != int(named.group(1)):
        raise CheckpointError(
            f"{path} records step {state.get('step')}, not the step its name says: it "
            "was copied or renamed; move it out of the run directory"
        )
    if cfg is not None:
        model_fields = dataclasses.fields(notebook().ModelConfig)
        saved = {f.name: f.default for f in model_fields} | state[
            "config"
        ]  # older: defaults
        now = {k: getattr(cfg, k) for k in weight_fields()}
        saved["N_dec"], now["N_dec"] = (
            saved["N_dec"] or saved["N"],
            cfg.decoder_layers,
        )  # 0 and N: one depth
        diff = [
            f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}"
            for k in weight_fields()
            if saved[k] != now[k]
        ]
        if diff:
            raise CheckpointError(
                f"{path} was written for another model config ({'; '.join(diff)})"
            )
        if state["config"].get("seed", cfg.seed) != cfg.seed:
            raise CheckpointError(
                f"{path} was trained with seed={state['config']['seed']}, and the seed "
                "decides the order of the batches still to come: resume with --seed "
                f"{state['config']['seed']}, or give another --run_dir to start over"
            )
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        if vocab is not None and state["vocab"][side] != vocab.itos:
            raise CheckpointError(
                f"{path} was written with another {side} vocabulary "
                f"({len(state['vocab'][side]):,} tokens vs {len(vocab):,} now)"
            )
    if subwords is not None and checkpoint_subwords(state, path) != subwords:
        raise CheckpointError(
            f"{path} was written with another BPE model than the one in use now "
            "(the training data or bpe_size differ); use the data and settings it was "
            "trained with"
        )
    return state


def checkpoint_subwords(state: dict, path="the checkpoint") -> Optional[Subwords]:
    """The BPE model a checkpoint carries (None for word vocabularies)."""
    blob = state.get("subwords")
    if blob is None:
        return None
    try:
        subwords = notebook().Subwords(tensor_bytes(blob))
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"the BPE model inside {path} cannot be read ({first_line(e)}): the "
            "checkpoint is damaged; use another one"
        ) from None
    vocab = state.get("vocab", {}).get("src")
    if vocab is not None and subwords.vocab.itos != vocab:
        raise CheckpointError(
            f"the BPE model inside {path} has {len(subwords.vocab):,} pieces but the "
            f"checkpoint's vocabulary {len(vocab):,}: the checkpoint is damaged; use "
            "another one"
        )
    return subwords


# What a checkpoint carries is checked when it is read (our addition): the SHA-256 of
# its BPE model and of its vocabularies, written beside them, catch a file damaged in a
# way that still parses (a BPE model cut in half reads as a smaller model); and a run
# that resumes checks that every weight and every optimizer moment is finite (one +inf
# in Adam's second moment freezes its weight for the rest of the run).


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data``, in hex (our addition)."""
    return hashlib.sha256(data).hexdigest()


def tensor_bytes(blob: torch.Tensor) -> bytes:
    """The bytes a uint8 tensor holds (a checkpoint's BPE model), read without numpy,
    which a bare GPU image may lack (our addition)."""
    return bytes(blob.tolist())


def carried_digests(state: dict) -> dict:
    """SHA-256 of a checkpoint's vocabularies and BPE model (our addition)."""
    vocab = json.dumps(state["vocab"], ensure_ascii=False, sort_keys=True)
    blob = state.get("subwords")
    return {
        "vocab": sha256_hex(vocab.encode()),
        "subwords": None if blob is None else sha256_hex(tensor_bytes(blob)),
    }


def digest_problem(state: dict) -> Optional[str]:
    """What of a checkpoint's vocabularies and BPE model does not match the digest
    written with it; None when all match or it has none (older checkpoints)."""
    saved = state.get("digests")
    if not isinstance(saved, dict):
        return None
    try:
        now = carried_digests(state)
    except (AttributeError, TypeError, ValueError):
        return "its vocabulary or BPE model cannot be read"
    names = {"vocab": "its vocabulary", "subwords": "its BPE model"}
    for key, what in names.items():
        if key in saved and saved[key] != now[key]:
            return f"{what} does not match the SHA-256 written with it"
    return None


def non_finite_tensor(state: dict) -> Optional[str]:
    """The name of the first weight or optimizer state of a checkpoint that holds NaN
    or infinite values; None when all are finite (our addition)."""
    for name, tensor in state["model"].items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return f"weight {name}"
    optimizer = state.get("optimizer") or {}
    for index, moments in (optimizer.get("state") or {}).items():
        for key, tensor in moments.items():
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.is_floating_point()
                and not torch.isfinite(tensor).all()
            ):
                return f"optimizer state {key} of parameter {index}"
    return None


# Listing and averaging checkpoints (§6.1 averages the last 5 for base models, the last
# 20 for big ones), and the small helpers that reach the plain model or the BPE model
# inside.


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """The checkpoints this program wrote in ``run_dir`` (``checkpoint-<step>.pt``),
    oldest first.

    Other files that merely look similar (a hand-made ``checkpoint-best.pt``) are not
    counted,
    so they are never resumed from, averaged or deleted by the rotation.
    """
    found = [
        (int(m.group(1)), p)
        for p in Path(run_dir).glob("checkpoint-*.pt")
        if (m := re.fullmatch(CHECKPOINT_NAME, p.name))
    ]
    return [p for _, p in sorted(found)]


CHECKPOINT_NAME = r"checkpoint-(\d{8,})\.pt"  # the names this program writes


def misnamed_checkpoints(run_dir: Path) -> list[Path]:
    """Files of ``run_dir`` named like a checkpoint with a step of fewer than 8 digits
    (``checkpoint-30.pt``) — our addition: never taken for checkpoints, never ignored
    in silence."""
    return sorted(
        p
        for p in Path(run_dir).glob("checkpoint-*.pt")
        if re.fullmatch(r"checkpoint-\d+\.pt", p.name)
        and not re.fullmatch(CHECKPOINT_NAME, p.name)
    )


def misnamed_message(paths: Sequence[Path]) -> str:
    """Why ``paths`` are not checkpoints, and what to do (our addition)."""
    return (
        f"{paths[0]}{f' (and {len(paths) - 1} more)' if len(paths) > 1 else ''} is "
        "not a checkpoint name this program writes: checkpoints are "
        "checkpoint-<step of 8 or more digits>.pt, e.g. checkpoint-00000030.pt; "
        "rename it so, or move it away"
    )


def average_checkpoints(paths: Sequence[Path]) -> dict:
    """The model averaged over the checkpoints at ``paths`` (§6.1 averages the last 5):
    each is loaded and checked to hold the same model and vocabulary, then the
    notebook's ``average_weights`` takes the mean."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = load_checkpoint(paths[0])

    def checked():
        for p in paths:
            state = first if p == paths[0] else load_checkpoint(p)
            model_state, avg = state["model"], first["model"]
            if (
                model_state.keys() != avg.keys()
                or any(v.shape != avg[k].shape for k, v in model_state.items())
                or state["vocab"] != first["vocab"]
            ):
                raise CheckpointError(
                    f"{p} holds a different model or vocabulary than {paths[0]}, so "
                    "the two cannot be averaged; use one checkpoint (--checkpoint, or "
                    "--average_last 1)"
                )
            yield model_state

    return notebook().average_weights(checked())


# ### Checkpoint and metrics bookkeeping; resuming
#
# `RunFiles` is the run directory: it writes checkpoints (keeping the last
# `keep_checkpoints`) and appends records to the metrics log; only the main process
# writes. `Position` is where training stands — updates taken (the paper's $step\_num$),
# the epoch, and how many batches of the epoch's *global* order (the order of one
# process, `length_batches` without `rank`) all processes together have consumed.
# Counted that way, the position means the same whatever the number of processes or
# `accum_steps`, so a run stopped on 4 GPUs continues on 1 with exactly the batches not
# yet seen (and the other way round); the checkpoint also records the layout it was
# computed with. `epoch_updates` deals out the rest of an epoch: the batches not
# consumed yet, cut to a multiple of the number of processes, process $r$ of $W$ taking
# every $W$-th from the $r$-th on, grouped `accum_steps` at a time.
#
# Faults are expected, not exceptional (our addition; the paper says nothing of them).
# The run directory is locked (an operating-system lock, gone when the process dies) so
# that a second run there stops at once instead of writing every record twice. Metrics
# records are flushed to the disk as they are written. On resuming, a torn last record
# (a full disk, a killed process) is dropped with a warning, and an unreadable newest
# checkpoint (a power loss) is set aside with a warning in favour of the newest readable
# one; the metrics log is then cut back to that checkpoint, so no step is logged twice.


def epoch_updates(
    batches: Sequence, start: int, rank: int, world: int, accum: int
) -> tuple[list, list, int]:
    """This process's updates for the global ``batches`` from ``start`` on (our
    addition).

    Returns (updates, consumed after each update, where the epoch ends): process
    ``rank`` takes global batches ``start + rank``, ``start + rank + world``, …, and
    update k of every process together takes ``[start + k·accum·world, …)``; the tail
    that does not divide among the processes is left out, as a distributed epoch
    leaves it out.
    """
    rest = batches[start:]
    usable = len(rest) - len(rest) % world
    mine = list(rest[:usable])[rank::world]
    updates = [mine[i : i + accum] for i in range(0, len(mine), accum)]
    consumed = [
        start + min((k + 1) * accum * world, usable) for k in range(len(updates))
    ]
    return updates, consumed, start + usable


def resume_position(state: dict, cfg: Config, path) -> tuple[Position, dict]:
    """A checkpoint's position in global batches and the layout it was computed with
    (our addition).

    Refuses, in one line, a position inside an epoch whose batches were cut for another
    ``batch_tokens`` (the batches not yet seen are not defined then); at an epoch
    boundary any setting may change.
    """
    pos = Position(state["step"], state["epoch"], state["batch_in_epoch"])
    layout = state.get("layout")
    if (
        layout is None
    ):  # older checkpoints counted one process's updates and did not record the layout
        saved = state["config"]
        layout = {
            "world_size": 1,
            "accum_steps": saved.get("accum_steps", 1),
            "batch_tokens": saved.get("batch_tokens"),
        }
        pos.batch_in_epoch *= layout["accum_steps"]
    if pos.batch_in_epoch and layout["batch_tokens"] != cfg.batch_tokens:
        raise CheckpointError(
            f"{path} stopped inside epoch {pos.epoch + 1}, whose batches were cut for "
            f"batch_tokens={layout['batch_tokens']}; resume with --batch_tokens "
            f"{layout['batch_tokens']} (it may change once an epoch is complete)"
        )
    return pos, layout


# The lock `RunFiles` takes on its directory: `flock`, which the operating system
# releases when the process ends, however it ends — so a killed run never leaves a stale
# lock behind.


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on ``run_dir/run.lock`` — our addition: one run per run
    directory.

    Returns the open lock file (the lock lasts while it is open; the operating system
    drops it when the process ends, however it ends), or None where there is no
    ``flock`` or when this same process already holds it. Raises
    :class:`RunDirectoryError` naming the process that holds it.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this system: runs are not locked
        return None
    path = Path(run_dir) / "run.lock"
    try:  # never through a symbolic link: the lock's text would overwrite its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if path.is_symlink():
            raise RunDirectoryError(
                f"{path} is a symbolic link (to {os.readlink(path)}); a run writes its "
                "lock only into a file of its own: remove the link, or give another "
                "--run_dir"
            ) from None
        raise OSError(e.errno, e.strerror, str(path)) from None
    f = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid, _, command = f.read().strip().partition(" ")
        f.close()
        if pid == str(os.getpid()):
            return None  # an earlier run of this process, not yet collected
        raise RunDirectoryError(
            f"run directory {run_dir} is in use by process {pid or '(unknown)'}"
            + (f" ({command})" if command else "")
            + "; two runs in one directory would mix their checkpoints and metrics. "
            "Wait for it to end, or give another --run_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}\n")
    f.flush()
    return f


def open_run_dir(run_dir: Path):
    """Create and lock ``run_dir`` (:func:`lock_run_dir`); remove temporary files a
    killed run left — our addition."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunDirectoryError(
            f"run directory {run_dir} is a symbolic link to {os.readlink(run_dir)}, "
            "which does not exist (or is a loop): create its target, or give another "
            "--run_dir"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirectoryError(f"run directory {run_dir} is a file, not a directory")
    if run_dir.is_dir():
        if misnamed := misnamed_checkpoints(run_dir):
            raise RunDirectoryError(misnamed_message(misnamed))
        earlier = [run_dir / n for n in ("metrics.jsonl", "results.json")]
        if (run_dir / "results.json").is_file() and not checkpoint_paths(run_dir):
            raise RunDirectoryError(
                f"run directory {run_dir} holds "
                + " and ".join(p.name for p in earlier if p.exists())
                + " of an earlier run but no checkpoint to resume from; training would "
                "replace them: give another --run_dir, or move them away"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)
    except OSError as e:
        where = f" ({Path(e.filename).name})" if e.filename else ""
        raise RunDirectoryError(
            f"cannot write in run directory {run_dir}{where}: {e.strerror or e}"
        ) from None
    for tmp in [
        *run_dir.glob(".checkpoint-*.part"),
        *run_dir.glob(".metrics.jsonl.*.part"),
    ]:
        tmp.unlink(
            missing_ok=True
        )  # the lock says that no running process is writing them
    return lock


# The run directory. A checkpoint is written by the first process alone, but every
# process takes part in `save`: each hands over its random-number state, so that a
# resume on as many processes restores each process's own streams.


class RunFiles:
    """A run directory's checkpoints (the last ``keep`` kept) and JSONL metrics log;
    writes only if ``write``."""

    def __init__(self, run_dir: Path, keep: int, write: bool):
        self.dir, self.keep, self.write = Path(run_dir), keep, write
        self.metrics = self.dir / "metrics.jsonl"
        self.saved_at = (
            time.time()
        )  # when a checkpoint was last written (for checkpoint_minutes)
        self.lock = (
            open_run_dir(self.dir) if write else None
        )  # open while this process holds the directory

    def log(self, record: dict) -> None:
        """Append one record to the metrics log, on the disk before it returns."""
        if self.write:  # the log so far and the record, renamed over the old log
            try:
                old = self.metrics.read_bytes() if self.metrics.exists() else b""
                write_atomic(self.metrics, old + (json.dumps(record) + "\n").encode())
            except OSError as e:
                raise RunDirectoryError(
                    f"cannot write {self.metrics} ({e.strerror or e}; "
                    f"{free_space(self.dir)}); the log written so far is intact"
                ) from None

    def save(
        self, trainer: Trainer, data: Dataset, pos: Position, rank: int = 0
    ) -> Optional[Path]:
        """Write a checkpoint of ``trainer`` at ``pos``; once it is on the disk, delete
        the oldest beyond ``keep``.

        Every process calls it: each hands its random-number state to the first, which
        writes.
        """
        self.saved_at = time.time()
        rng = [rng_state(trainer.device)]
        if trainer.world > 1:
            gathered = [None] * trainer.world if rank == 0 else None
            dist.gather_object(rng[0], gathered, dst=0)
            rng = gathered
        if not self.write:
            return None
        path = self.dir / f"checkpoint-{pos.step:08d}.pt"
        try:
            save_checkpoint(path, trainer, data, pos, rng)
        except (
            OSError,
            RuntimeError,
        ) as e:  # torch reports a full disk as a RuntimeError
            raise CheckpointError(
                f"cannot write checkpoint {path} ({first_line(e)}; "
                f"{free_space(self.dir)}); "
                "the checkpoints already in the run directory are intact"
            ) from e
        for old in checkpoint_paths(self.dir)[: -self.keep]:
            old.unlink()
        return path

    def repair_metrics(self, step: int) -> None:
        """Make the metrics log agree with a run resumed at ``step`` — our addition:
        lines that are not whole records (torn by a crash or a full disk) are dropped
        with a warning, and records after ``step``."""
        if not (self.write and self.metrics.is_file()):
            return
        raw = self.metrics.read_bytes()
        kept, torn, later = metrics_lines_upto(raw, step)
        if torn:
            print(
                f"warning: {self.metrics}: dropped {torn} unreadable line(s), cut "
                "short by a crash or a full disk",
                file=sys.stderr,
            )
        if torn or later or not raw.endswith(b"\n"):
            write_atomic(self.metrics, kept)

"""Resuming a run: the newest checkpoint any process holds, read, checked and restored.

Every process reports the newest checkpoint in its own run directory; the holder of the
newest hands it to the others, so machines without a shared disk resume together. The
position, weights, optimizer, schedule, scaler and random streams come back exactly, so
an interrupted run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch.distributed as dist

from .devices import restore_rng, seed_process
from .runfiles import (
    CheckpointError,
    Position,
    UnreadableCheckpoint,
    changed_settings,
    check_fits,
    checkpoint_paths,
    load_checkpoint,
    resume_position,
)

if TYPE_CHECKING:
    from the_annotated_transformer import Subwords, Vocab

    from .config import Config
    from .data import Dataset
    from .runfiles import RunFiles
    from .training import Run


# Resuming: the newest checkpoint that can be read, with everything it recorded.


def newest_readable_checkpoint(
    run_dir: Path,
    cfg: Config,
    src_vocab: Vocab,
    tgt_vocab: Vocab,
    subwords: Optional[Subwords],
    tidy: bool,
) -> Optional[tuple[Path, dict]]:
    """(path, state) of the newest checkpoint of ``run_dir`` that can be read; None if
    there is none — our addition.

    Newer ones that cannot be read (truncated by a power loss) are skipped with a
    warning and, if ``tidy`` (the process that writes), renamed to ``*.unreadable`` so
    that the rotation never keeps them in place of good ones. A checkpoint that reads
    but does not fit ``cfg`` or the vocabularies is an error, as is a directory where
    none can be read.
    """
    paths = checkpoint_paths(run_dir)
    bad = []
    for path in reversed(paths):
        try:
            state = load_checkpoint(path, cfg, src_vocab, tgt_vocab, subwords)
        except UnreadableCheckpoint as e:
            bad.append(path)
            if tidy:
                print(
                    f"warning: {e}; falling back to the checkpoint before it",
                    file=sys.stderr,
                )
            continue
        if tidy:
            for b in bad:
                os.replace(b, b.with_name(b.name + ".unreadable"))
        return path, state
    if bad:
        raise CheckpointError(
            f"none of the {len(bad)} checkpoint(s) in {run_dir} can be read; move them "
            "away to start the run over"
        )
    return None


# Resuming on several machines: each may hold checkpoints on its own disk, and which
# machine is process 0 is not fixed (torchrun's c10d rendezvous ignores --node_rank).
# So every process reports the newest checkpoint in its own run directory (one
# `all_gather`), and the lowest-ranked process holding the newest reads it. If it reads,
# the holder hands it to the others (a broadcast — after DDP's own first broadcast of
# the weights, which saw only the fresh model), and each of them checks it as it would
# check a file of its own (config, vocabularies, BPE model). If it cannot be read, the
# holder sets it aside and every process reports again: the newest *readable*
# checkpoint any machine holds wins, wherever it is. Once one is found, each machine
# renames its own unreadable files to `*.unreadable`, so the next start does not try
# them again; if none anywhere can be read, every process stops with one line and the
# files stay as they are. The position is checked against the settings now in force
# (`resume_position`, above): another number of processes or `accum_steps` continues
# the same global order of batches; another `batch_tokens` inside an epoch cannot, and
# is refused in one line.


def _digest(path: Path) -> Optional[str]:
    """SHA-256 of the file ``path`` (None if it cannot be read): whether two processes'
    files of one name are the same bytes."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _newest_step(run_dir: Path, skipped: Sequence[Path] = ()) -> int:
    """The step of the newest checkpoint in ``run_dir`` by its name, not counting those
    ``skipped``; -1 if none."""
    paths = [p for p in checkpoint_paths(run_dir) if p not in skipped]
    return int(paths[-1].stem.split("-")[-1]) if paths else -1


def find_checkpoint(
    files: RunFiles,
    cfg: Config,
    data: Dataset,
    rank: int,
    world: int,
    log: Callable = print,
) -> Optional[tuple[Path, dict]]:
    """(path, state) of the newest readable checkpoint any process holds, in every
    process; None when no process holds one (our addition).

    A holder whose newest file cannot be read sets it aside, and the choice is made
    again; unreadable files are renamed on whichever machine holds them once a readable
    one is found. A checkpoint that reads but does not fit ``cfg`` or the data, or a
    run whose checkpoints all fail to read, stops every process with one line.
    """
    vocabs = (data.src_vocab, data.tgt_vocab, data.subwords)
    bad: list[Path] = []  # this process's unreadable checkpoints
    set_aside = 0  # checkpoints found unreadable, all processes together
    while True:
        steps = [_newest_step(files.dir, bad)]
        if world > 1:
            steps = [None] * world
            dist.all_gather_object(steps, _newest_step(files.dir, bad))
        newest = max(steps)
        if newest < 0:
            break
        holder = steps.index(newest)
        found, error, unreadable = None, None, None
        if rank == holder:
            path = [p for p in checkpoint_paths(files.dir) if p not in bad][-1]
            try:
                found = (path, load_checkpoint(path, cfg, *vocabs))
            except UnreadableCheckpoint as e:
                bad.append(path)
                unreadable = (f"{e}; falling back to the newest readable one", path)
                print(f"warning: {unreadable[0]}", file=sys.stderr)
            except CheckpointError as e:
                error = str(e)
        if world > 1:
            sent = unreadable and (unreadable[0], unreadable[1].name, _digest(path))
            box = [found, error, sent]
            dist.broadcast_object_list(box, src=holder)
            found, error, unreadable = box
            if unreadable and rank != holder:  # the same file (a shared disk) or a copy
                mine = files.dir / unreadable[1]
                if mine not in bad and _digest(mine) == unreadable[2]:
                    bad.append(mine)
            if found and not error and rank != holder:
                try:  # checked as a checkpoint of this machine's own would be
                    check_fits(found[1], found[0], cfg, *vocabs)
                except CheckpointError as e:
                    error = str(e)
            errors = [None] * world
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise CheckpointError(error)
        if unreadable:
            set_aside += 1
            if rank != holder:
                log(f"process {holder}: {unreadable[0]}")
            continue
        for b in bad:  # on a shared disk another process may have renamed it first
            with contextlib.suppress(FileNotFoundError):
                os.replace(b, b.with_name(b.name + ".unreadable"))
        if world > 1:
            behind = {r: s for r, s in enumerate(steps) if s < newest}
            if behind:
                held = [f"step {s}" if s >= 0 else "none" for s in behind.values()]
                log(
                    f"resuming from the checkpoint of step {newest} that process "
                    f"{holder} holds; process(es) {', '.join(map(str, behind))} held "
                    + ", ".join(held)
                )
        return found
    if set_aside:
        where = files.dir if world == 1 else "any process's run directory"
        raise CheckpointError(
            f"none of the {set_aside} checkpoint(s) in {where} can be read; move them "
            "away to start the run over"
        )
    return None


def resume(run: Run) -> Position:
    """Restore the checkpoint ``setup`` found (the newest any process holds): model,
    optimizer, schedule, scaler, RNGs; nothing if there is none.

    Metrics logged after that checkpoint are dropped, so the resumed run logs no step
    twice.
    """
    found = run.found.pop() if run.found else None
    if found is None:
        run.files.repair_metrics(0)
        return Position()
    path, state = found
    pos, layout = resume_position(state, run.cfg, path)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    now = {
        "world_size": run.world,
        "accum_steps": run.cfg.accum_steps,
        "batch_tokens": run.cfg.batch_tokens,
    }
    ranks = state["rng"].get("ranks")
    if ranks is not None and len(ranks) == run.world:
        restore_rng(ranks[run.rank], run.device)
    elif ranks is None and run.world == 1:
        # an older checkpoint: one process's streams
        restore_rng(state["rng"], run.device)
    else:
        seed_process(run.cfg.seed, run.rank, pos.step)
        run.log(
            f"the checkpoint holds the random streams of {len(ranks or [0])} "
            "process(es); "
            f"{run.world} continue with fresh streams of their own"
        )
    run.log(
        f"resumed from {path} at step {pos.step} (epoch {pos.epoch + 1}, "
        f"{pos.batch_in_epoch} of its batches done)"
        + ("" if layout == now else f"; written with {layout}, continuing with {now}")
    )
    if changed := changed_settings(state["config"], run.cfg):
        run.log(f"note: {changed}")
    run.files.repair_metrics(pos.step)
    return pos

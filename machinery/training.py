"""The production training loop: accumulation, precision, several processes, batches
built ahead of the device, epochs and checkpoints, and `train`, which runs them all.

Around it, by topic: resuming in `resuming.py`, the validation loss and the test score
in `evaluation.py`, the plan and estimate in `planning.py`.

It builds on the notebook's Part 2: the same batches (`length_batches`, `make_batch`),
the same loss (`batch_loss`, `loss_sum`), the same optimizer and schedule
(`make_optimizer`). `update` is the notebook's `train_step` extended in one place: the
gradients of several micro-batches and processes are summed before the one step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import random
import signal
import threading
import time
import warnings
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from .config import Config, run_dir_for
from .data import Dataset, load_dataset
from .devices import (
    StopRequest,
    _barrier,
    _distributed,
    allocator_note,
    LENGTH_MULTIPLE,
    allow_tf32,
    any_process,
    compilations,
    compile_model,
    computing,
    measured_ratio,
    precision_candidates,
    progress_bar,
    resolve_attention,
    resolve_device,
    resolve_precision,
    seed_process,
    time_calls,
)
from .evaluation import evaluate_loss, evaluate_test
from .figures import plot_curves
from .parts import notebook
from .planning import LossWatch, UpdateClock, agreed_plan, plan_run
from .resuming import find_checkpoint, newest_readable_checkpoint, resume  # noqa: F401
from .runs import machine_name
from .runfiles import (
    Position,
    RunDirectoryError,
    RunFiles,
    TrainingInterrupted,
    checkpoint_paths,
    epoch_updates,
    finished_run_problem,
    write_atomic,
)

if TYPE_CHECKING:
    from the_annotated_transformer import Batch, EncoderDecoder


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass(frozen=True)
class Trainer:
    """What an update needs — §5.3: the model, the optimizer and its schedule, and how
    to compute (precision, processes)."""

    cfg: Config
    model: EncoderDecoder  # the plain model (its parameters, its generator)
    train_model: nn.Module  # computes the forward pass: the model, compiled or in DDP
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    device: torch.device
    computing: Callable  # the forward pass's context: autocast, SDPA's kernels
    scaler: torch.amp.GradScaler  # scales the fp16 loss; disabled otherwise
    world: int  # processes training together (DistributedDataParallel)


# One update of a real run may accumulate the gradients of several batches
# (`accum_steps`): that is how one machine reaches the paper's ~25,000 tokens per batch.
# Each batch's summed loss is divided by the number of target tokens in the *whole*
# update — counted over every micro-batch and, in a distributed run, every process (the
# `all_reduce`) — and multiplied by the number of processes, because DDP *averages*
# gradients over processes. So the gradient is the one of the mean loss per target token
# of the whole update, however it is split (a test checks it). The token counts come
# from the host, where each batch counted its own when it was made (`Batch.ntokens`);
# the loss stays on the device until one transfer at the end of the update, and in a
# distributed run the loss and counts are summed over the processes first, so a NaN in
# any of them stops all of them together, before the step. Every op the update
# dispatches costs host time that a GPU waits through, so nothing is computed per update
# that the host already knows (`benchmarks/dispatch.py` counts the ops).


def update(trainer: Trainer, micro: Sequence[Batch]) -> tuple[float, int, float]:
    """One optimizer update over the micro-batches ``micro`` — §5.3, the notebook's
    ``train_step`` for several batches, processes and precisions.

    Returns (summed label-smoothed loss, real target tokens, learning rate applied) over
    the whole update, all processes together. A non-finite loss in any process raises
    :class:`TrainingDiverged` in every process, before the step. One host
    synchronisation per update.
    """
    nb = notebook()
    ntokens = float(sum(b.ntokens for b in micro))  # counted when the batches were made
    if trainer.world > 1:  # every process's: on the device, one collective
        counted = torch.tensor(ntokens, device=trainer.device)
        dist.all_reduce(counted)
        ntokens = counted
    losses = []
    for j, b in enumerate(micro):
        last = j == len(micro) - 1
        several = trainer.world > 1 and not last
        no_sync = trainer.train_model.no_sync() if several else nullcontext()
        with no_sync, trainer.computing():
            loss = nb.batch_loss(
                trainer.model, b, trainer.cfg.eps_ls, trainer.train_model
            )
        # DDP averages over processes: times `world` (dividing last, as the notebook)
        share = loss * trainer.world / ntokens if trainer.world > 1 else loss / ntokens
        trainer.scaler.scale(share).backward()
        losses.append(loss.detach())
    one = len(losses) == 1 and trainer.world == 1
    total = losses[0] if one else torch.stack(losses).sum()
    if trainer.world > 1:
        dist.all_reduce(total)  # a NaN anywhere makes the sum NaN everywhere
        total, tokens = torch.stack([total, ntokens]).tolist()  # the one host sync
    else:
        total, tokens = total.item(), ntokens  # the one host sync
    if not math.isfinite(total):
        raise TrainingDiverged(f"loss is {total}")
    if trainer.cfg.clip_grad:
        trainer.scaler.unscale_(trainer.optimizer)  # clip the true gradients
        nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.clip_grad)
    lr = trainer.optimizer.param_groups[0]["lr"]  # set by the scheduler for this update
    trainer.scaler.step(trainer.optimizer)  # fp16: skipped when a gradient overflowed
    trainer.scaler.update()
    # after a skipped fp16 step torch warns of a schedule stepped first; by design
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "Detected call of `lr_scheduler.step", UserWarning
        )
        trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return total, round(tokens), lr


# ## Running a training job
#
# `update` is the core. Around it a run needs: epochs of length-batched updates,
# optional gradient clipping, the precision `devices.py` picks, `torch.compile` (an
# option; compiling is slow on a CPU, so the tests leave it out), several processes
# through `torchrun` with `DistributedDataParallel` (NCCL on GPUs, Gloo on CPUs),
# `tqdm` progress bars with loss, learning rate and tokens per second, a validation
# loss every epoch, a JSONL metrics log, a training-curve figure, checkpoints
# (`runfiles.py`), resuming, and at the end the test set translated and scored with
# Part 3's decoding.

# A run is a `Trainer` (what `update` needs, Part 2) together with what the machinery
# around it needs: the data, this process's rank, the run directory and the log.


@dataclass(frozen=True)
class Run(Trainer):
    """The objects of one training run, handed explicitly from step to step (our
    addition)."""

    data: Dataset
    rank: int  # this process's place among the `world` (0 writes the files)
    files: RunFiles
    log: Callable
    # the checkpoint to resume from, (path, state), until `resume` takes it
    found: list = field(default_factory=list)
    # how precision and attention were decided: lines for the log and results.json
    decided: dict = field(default_factory=dict)


# ### Batches ahead of the device
#
# On a GPU an update is a few milliseconds of kernels; building its batches and copying
# them there must not wait for it. So a GPU run builds the batches of the next updates
# in a background thread (`prefetched`), pinned and copied with `non_blocking`
# (`to_device`), while the device computes the current one. On a CPU there is nothing to
# overlap (the update computes on the same cores), and the batches are built in turn.

PREFETCH = {"cuda": 2}  # updates built ahead, by the device's kind (none elsewhere)


def prefetched(make: Callable[[int], object], count: int, depth: int):
    """``make(0)``, …, ``make(count - 1)`` in order; with ``depth`` > 0 built in a
    background thread up to ``depth`` ahead (our addition). Its errors are raised here;
    closing the generator stops the thread."""
    if depth <= 0:
        yield from (make(k) for k in range(count))
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> None:
        while not stop.is_set():
            try:
                return ready.put(item, timeout=0.05)
            except queue.Full:
                continue

    def work() -> None:
        try:
            for k in range(count):
                if stop.is_set():
                    return
                put((make(k), None))
        except BaseException as e:  # handed to the consumer
            put((None, e))

    worker = threading.Thread(target=work, name="batches", daemon=True)
    worker.start()
    try:
        for _ in range(count):
            item, error = ready.get()
            if error is not None:
                raise error
            yield item
    finally:
        stop.set()
        worker.join()


# A compiled step sees as few batch shapes as it can: each batch's source and target
# lengths rounded up to a multiple of `LENGTH_MULTIPLE` with padding, which the masks
# and the loss ignore like any other (our addition).


def round_lengths(batch: Batch, multiple: int) -> Batch:
    """``batch`` with its source and target lengths padded up to multiples of
    ``multiple`` (our addition)."""
    nb = notebook()
    # (batch, tgt_len + 1): the whole target, decoder input and prediction together
    whole = torch.cat([batch.tgt[:, :1], batch.tgt_y], dim=1)
    src = F.pad(batch.src, (0, -batch.src.size(1) % multiple), value=nb.PAD)
    whole = F.pad(whole, (0, -(whole.size(1) - 1) % multiple), value=nb.PAD)
    return nb.Batch(src, whole, nb.PAD)


def update_batches(run: Run, pairs: Sequence, indices: Sequence) -> list[Batch]:
    """The batches of one update (``indices``: one list of pair indices per batch) on
    the run's device; lengths rounded for a compiled step."""
    nb = notebook()
    made = [nb.make_batch(pairs, idx) for idx in indices]
    if run.cfg.compile:
        made = [round_lengths(b, LENGTH_MULTIPLE) for b in made]
    return [to_device(b, run.device) for b in made]


def to_device(batch: Batch, device) -> Batch:
    """``batch`` on ``device``; to a GPU through pinned memory, so that the copy of a
    batch built ahead overlaps computation (from pageable memory it would be
    synchronous; our addition)."""
    if torch.device(device).type != "cuda":
        return batch.to(device)
    for name, t in list(vars(batch).items()):
        if torch.is_tensor(t):  # slices made contiguous: one block each
            t = t.contiguous().pin_memory()
            setattr(batch, name, t.to(device, non_blocking=True))
    return batch


# ### One epoch
#
# The batches of an epoch are a function of (seed, epoch), so `train_epoch` can start at
# any update of it. After each update: the progress bar, a metrics record every 50
# updates, and the two ways training stops early — `max_steps`, or a signal (save, then
# stop with a message) — and the checkpoint every `checkpoint_minutes` (not at the last
# update of an epoch, whose own checkpoint follows at once). It returns whether training
# is finished.


def train_epoch(
    run: Run,
    pos: Position,
    stop: StopRequest,
    progress: bool,
    t_start: float,
    clock: Optional[UpdateClock] = None,
) -> bool:
    """The updates of epoch ``pos.epoch`` from ``pos.batch_in_epoch`` on, advancing
    ``pos``; True once ``max_steps`` is reached."""
    nb = notebook()
    cfg, pairs = run.cfg, run.data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    # the epoch's global order
    batches = nb.length_batches(lengths, cfg.batch_tokens, cfg.seed, pos.epoch)
    updates, consumed, end = epoch_updates(
        batches, pos.batch_in_epoch, run.rank, run.world, cfg.accum_steps
    )
    per_epoch = len(epoch_updates(batches, 0, 0, run.world, cfg.accum_steps)[0])
    bar = progress_bar(
        total=per_epoch,
        initial=max(per_epoch - len(updates), 0),
        desc=f"epoch {pos.epoch + 1}/{cfg.epochs}",
        disable=not (progress and run.rank == 0),
        dynamic_ncols=True,
    )
    run.train_model.train()
    seen, t0, loss_acc, tok_acc = 0, time.time(), 0.0, 0
    watch = LossWatch(len(run.data.tgt_vocab))  # a finite loss that explodes
    finished = False
    ahead = prefetched(
        lambda u: update_batches(run, pairs, updates[u]),
        len(updates),
        PREFETCH.get(run.device.type, 0),
    )
    with bar, closing(ahead):
        for u, micro in enumerate(ahead):
            try:
                loss, tokens, lr = update(run, micro)
                if exploded := watch.problem(loss / max(tokens, 1)):
                    raise TrainingDiverged(exploded)
            except TrainingDiverged as e:
                last = checkpoint_paths(run.files.dir)
                raise TrainingDiverged(
                    f"{e} at step {pos.step + 1}; stopped. Last good checkpoint: "
                    f"{last[-1] if last else 'none (no checkpoint written yet)'}"
                ) from None
            pos.step, pos.batch_in_epoch = pos.step + 1, consumed[u]
            if clock is not None:
                clock.tick()
            # all processes
            seen, loss_acc, tok_acc = (seen + tokens, loss_acc + loss, tok_acc + tokens)
            tps = seen / max(time.time() - t0, 1e-9)
            bar.set_postfix(
                loss=f"{loss / max(tokens, 1):.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}"
            )
            bar.update(1)
            if pos.step % 50 == 0:
                run.files.log(
                    {
                        "step": pos.step,
                        "epoch": pos.epoch + 1,
                        "train_loss": loss_acc / max(tok_acc, 1),
                        "lr": lr,
                        "tokens_per_s": tps,
                        "elapsed_s": time.time() - t_start,
                    }
                )
                loss_acc, tok_acc = 0.0, 0
            if cfg.max_steps and pos.step >= cfg.max_steps:
                finished = True
                break
            due = bool(
                cfg.checkpoint_minutes
                and u < len(updates) - 1
                and time.time() - run.files.saved_at >= cfg.checkpoint_minutes * 60
            )
            stop_now, save_now = any_process(
                [stop.signum is not None, due], run.world, run.device
            )
            if stop_now:
                path = run.files.save(run, run.data, pos, run.rank)
                name = (
                    signal.Signals(stop.signum).name
                    if stop.signum
                    else "a signal in another process"
                )
                raise TrainingInterrupted(
                    f"stopped by {name} after update {pos.step}; checkpoint saved to "
                    f"{path or 'the run directory of the first process'}. "
                    "Run the same command again to continue from there."
                )
            if save_now:
                run.files.save(run, run.data, pos, run.rank)
    # the epoch is complete (also when max_steps ended it there)
    if pos.batch_in_epoch == end:
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
    return finished


# ### Setting up, and `train`
#
# `setup` builds a run's objects: the run directory and the checkpoint to resume from,
# the precision and attention path (kept from that checkpoint, or asked for, or
# measured: `devices.py`), the model (the same initial weights in every process), the
# optimizer and its schedule, DDP when several processes train, and `torch.compile`
# last — PyTorch's documented order, compiling the DDP module so that its gradient
# communication overlaps the backward pass.


def probe_batch(pairs: Sequence, tokens: int) -> Batch:
    """Real training pairs around the median target length, at most ``tokens`` padded
    tokens a side: what `auto` times (our addition)."""
    nb = notebook()
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), i))
    n = len(order)
    while True:  # fewer pairs until the longest of them fits
        start = max(0, min(len(order) // 2 - n // 2, len(order) - n))
        chosen = order[start : start + n]
        longest = max(max(len(pairs[i][0]), len(pairs[i][1])) for i in chosen)
        if longest * n <= tokens or n == 1:
            return nb.make_batch(pairs, chosen)
        n = max(1, min(n - 1, tokens // longest))


def measure_compute(
    cfg: Config,
    data: Dataset,
    device: torch.device,
    precisions: Sequence[str],
    paths: Sequence[str],
    timer: Optional[Callable] = None,
) -> dict:
    """Seconds per forward and backward pass of the run's model, for each (precision,
    attention path), on a real batch of the run's own size on ``device`` (our
    addition; `devices.py`: a smaller batch can rank the precisions the other way).

    Inside ``fork_rng``: the run's random streams are as they were. ``timer`` is
    :func:`time_calls` unless given (tests give fake times).
    """
    nb = notebook()
    timer = timer or time_calls
    batch = probe_batch(data.splits["train"], cfg.batch_tokens)
    batch = batch.to(device)
    gpus = [device] if device.type == "cuda" else []
    python_state = random.getstate()
    with torch.random.fork_rng(devices=gpus, device_type=device.type):
        models = {
            a: nb.make_model(
                len(data.src_vocab), len(data.tgt_vocab), cfg, attention=a
            ).to(device)
            for a in paths
        }

        def one_pass(precision: str, path: str) -> Callable:
            model, cast = models[path], computing(device, precision)  # as a run's

            def run_pass():
                with cast():
                    loss = nb.batch_loss(model, batch, cfg.eps_ls)
                loss.backward()
                model.zero_grad(set_to_none=True)

            return run_pass

        calls = {(p, a): one_pass(p, a) for p in precisions for a in paths}
        times = timer(calls, device)
    random.setstate(python_state)
    models.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def kept_line(carried: Optional[str], plain: str) -> str:
    """The line a checkpoint carried for an `auto` decision, marked as kept from it, so
    that what was measured stays said; ``plain`` where it carried none (our
    addition)."""
    if not carried or "(auto: " not in carried or not carried.endswith(")"):
        return plain
    if carried.endswith("; kept from the checkpoint)"):
        return carried
    return carried[:-1] + "; kept from the checkpoint)"


def decide_compute(
    cfg: Config,
    data: Dataset,
    device: torch.device,
    saved: Optional[dict],
    world: int,
    carried: Optional[dict] = None,
) -> tuple[str, str, dict]:
    """(precision, attention path, {"precision": line, "attention": line}) of a run:
    what its checkpoint recorded (``saved``, its config, and ``carried``, its decision
    lines), else what was asked for, else measured here (our addition; `devices.py`).
    In a distributed run process 0's measurement decides for all."""
    precisions, attention_paths = [cfg.precision], [cfg.attention]
    lines: dict = {}
    carried = carried or {}
    if saved and cfg.precision == "auto" and saved.get("precision", "auto") != "auto":
        precisions = [saved["precision"]]
        plain = resolve_precision(saved["precision"], device)[1].replace(
            "(asked for", "(auto: kept from the checkpoint"
        )
        lines["precision"] = kept_line(carried.get("precision"), plain)
    if saved and cfg.attention == "auto" and saved.get("attention", "auto") != "auto":
        attention_paths = [saved["attention"]]
        plain = f"attention: {saved['attention']} path (auto: kept from the checkpoint)"
        lines["attention"] = kept_line(carried.get("attention"), plain)
    if precisions == ["auto"]:
        precisions = precision_candidates(device)[0]
    if attention_paths == ["auto"]:
        attention_paths = ["readable", "fast"]
    times = None
    if len(precisions) * len(attention_paths) > 1:
        times = measure_compute(cfg, data, device, precisions, attention_paths)
    best = None  # each precision's time at its better attention path
    if times:
        best = {p: min(t for (q, _), t in times.items() if q == p) for p in precisions}
    if "precision" in lines:
        precision = precisions[0]
    else:
        precision, lines["precision"] = resolve_precision(cfg.precision, device, best)
    if "attention" in lines:
        attention = attention_paths[0]
    else:
        at = {a: times[(precision, a)] for a in attention_paths} if times else None
        attention, lines["attention"] = resolve_attention(cfg.attention, device, at)
        if at and len(at) > 1 and precision != "fp32":
            lines["attention"] = lines["attention"][:-1] + f", in {precision})"
    if world > 1:  # every process follows process 0's decision
        box = [precision, attention, lines]
        dist.broadcast_object_list(box, src=0)
        precision, attention, lines = box
    return precision, attention, lines


def setup(
    cfg: Config,
    data: Dataset,
    device: torch.device,
    rank: int,
    world: int,
    log: Callable,
) -> Run:
    """The run directory, checkpoint to resume, model, optimizer, schedule and precision
    of a training run.

    The model is initialised from ``cfg.seed`` in every process (the same weights); then
    each process switches to its own random stream, for dropout. The run's ``cfg`` holds
    the precision and attention path decided (so its checkpoints record them).
    """
    nb = notebook()
    files = RunFiles(run_dir_for(cfg), cfg.keep_checkpoints, write=rank == 0)
    found = find_checkpoint(files, cfg, data, rank, world, log)
    saved = found[1]["config"] if found else None
    carried = found[1].get("decided") if found else None
    tf32 = allow_tf32(device)  # before measuring: float32 runs use it
    precision, attention, decided = decide_compute(
        cfg, data, device, saved, world, carried
    )
    cfg = dataclasses.replace(cfg, precision=precision, attention=attention)
    model = nb.make_model(
        len(data.src_vocab), len(data.tgt_vocab), cfg, attention=attention
    ).to(device)
    optimizer, scheduler = nb.make_optimizer(model, cfg)
    train_model = model
    if world > 1:
        # no buffer changes while training (the positional encodings are constant): none
        # to broadcast
        train_model = nn.parallel.DistributedDataParallel(
            train_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
        )
        seed_process(cfg.seed, rank)
    if cfg.compile:  # after DDP, as PyTorch documents
        train_model = compile_model(train_model, device, log)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    log(
        f"device: {device}"
        + (f" × {world} processes" if world > 1 else "")
        + f"; run directory: {files.dir}"
    )
    log(decided["precision"])
    log(decided["attention"])
    for note in (tf32, allocator_note(device)):
        if note:
            log(note)
    return Run(
        cfg=cfg,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        scheduler=scheduler,
        device=device,
        computing=computing(device, precision),
        scaler=scaler,
        world=world,
        data=data,
        rank=rank,
        files=files,
        log=log,
        found=[found] if found else [],
        decided=decided,
    )


# `train` is the function the command line, `make train` and Part 4 all call: set up,
# resume if the run directory holds a checkpoint, then epochs until `epochs` or
# `max_steps`, each followed by validation and a checkpoint; last the curve and the test
# score.


def train(
    cfg: Config,
    data: Optional[Dataset] = None,
    log: Callable = print,
    progress: bool = True,
    evaluate: bool = True,
) -> dict:
    """Train ``cfg`` (resuming from its run directory when that holds a checkpoint),
    then score the test set.

    Returns a summary: steps, minutes, BLEU, example translations and where the run's
    files are.
    """
    nb = notebook()
    device, local_rank = (
        resolve_device(cfg.device),
        int(os.environ.get("LOCAL_RANK", "0")),
    )
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
    rank, world = _distributed(device)
    log = log if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t_start = time.time()
    if (
        data is None
        # one process per machine downloads and builds the caches; the others then read
        # them
    ):
        if world > 1 and local_rank != 0:
            _barrier(device)
        data = load_dataset(cfg, log=log)
        if world > 1 and local_rank == 0:
            _barrier(device)
    for line in agreed_plan(cfg, data, device, world):  # refuses before any work
        log(line)
    compiled = compilations() if cfg.compile else 0
    run = setup(cfg, data, device, rank, world, log)
    pos = resume(run)
    log(
        f"model: {nb.count_parameters(run.model) / 1e6:.2f}M parameters "
        f"(N={cfg.N}{f', N_dec={cfg.N_dec}' if cfg.decoder_layers != cfg.N else ''}, "
        f"d_model={cfg.d_model}, d_ff={cfg.d_ff}, "
        f"h={cfg.h}, P_drop={cfg.P_drop})"
    )
    remaining, plan = plan_run(cfg, data, world, pos.step, run.model)
    if not remaining and evaluate and rank == 0:  # nothing to train: a result to keep
        if problem := finished_run_problem(run.files.dir, cfg):
            raise RunDirectoryError(problem)
    for line in plan:
        log(line)
    clock = UpdateClock(remaining, device, log)
    with StopRequest() as stop:
        finished = bool(cfg.max_steps and pos.step >= cfg.max_steps)
        while pos.epoch < cfg.epochs and not finished:
            # the epoch these updates belong to, counting from 1
            epoch_number = pos.epoch + 1
            finished = train_epoch(run, pos, stop, progress, t_start, clock)
            valid = data.splits["valid"][: cfg.max_valid_sentences or None]
            valid_loss = (
                evaluate_loss(run.model, valid, cfg, device)
                if rank == 0
                else float("nan")
            )
            ppl = math.exp(min(valid_loss, 50))
            run.files.log(
                {
                    "step": pos.step,
                    "epoch": epoch_number,
                    "valid_loss": valid_loss,
                    "valid_ppl": ppl,
                    "elapsed_s": time.time() - t_start,
                }
            )
            log(
                f"step {pos.step}: validation loss {valid_loss:.3f} (perplexity "
                f"{ppl:.2f})"
            )
            path = run.files.save(run, run.data, pos, run.rank)
            if world > 1:
                _barrier(device)
            if (
                stop.requested(world, device)
                and pos.epoch < cfg.epochs
                and not finished
            ):
                raise TrainingInterrupted(
                    f"stopped after update {pos.step} (end of epoch {pos.epoch}); "
                    "checkpoint "
                    f"saved to {path or 'the run directory of the first process'}. "
                    "Run the same command again to continue from there."
                )
    summary = {
        "config": dataclasses.asdict(cfg),
        "steps": pos.step,
        "train_minutes": (time.time() - t_start) / 60,
        "device": str(device),
        "machine": machine_name(device),
        # a CPU's float sums are split over its threads: another count rounds otherwise
        # (a resumed run: its last stretch's count, as train_minutes is that stretch's)
        **({"threads": torch.get_num_threads()} if device.type == "cpu" else {}),
        "world_size": world,
        "precision": run.cfg.precision,
        "attention": run.cfg.attention,
        "auto": {k: measured_ratio(v) for k, v in run.decided.items()},
        "data": data.origin,
        **({"compilations": compilations() - compiled} if cfg.compile else {}),
        "run_dir": str(run.files.dir),
    }
    if rank == 0 and run.files.metrics.is_file():
        try:
            summary["curve"] = str(
                plot_curves(run.files.metrics, run.files.dir / "curve.png")
            )
        except ModuleNotFoundError as e:  # matplotlib absent: the run stands
            log(f"no curve.png ({e})")
    if evaluate and rank == 0:
        summary.update(
            evaluate_test(
                run.model, data, cfg, device, run.files.dir, log=log, progress=progress
            )
        )
        summary["total_minutes"] = (time.time() - t_start) / 60
        write_atomic(run.files.dir / "results.json", [json.dumps(summary, indent=2)])
    return summary

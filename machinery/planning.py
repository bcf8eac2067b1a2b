"""A run's plan and estimate: how many updates it takes, whether its model suits its
data, and how long the rest will take on this machine (§5.2 gives the paper's steps and
hours).

`train` (`training.py`) logs the plan before the first update and ticks `UpdateClock`
after every one; the estimate comes from a few of the first updates, timed here, and
again from the first minute of them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from .config import Config
from .data import Dataset
from .devices import any_process, cgroup_dirs
from .parts import notebook


# ### How long, and is the run sized for this data?
#
# Before long work a run says what it will do: how many updates, and — after its first
# few updates, timed on this machine — roughly how many minutes of training that is. A
# preset is sized for a data set and a device (`iwslt14-small` for the full IWSLT14 set
# on a GPU), so a run also says, in one line, when its model is far larger than its
# training data, or when it will take hours on this device, and then goes on: the choice
# stays the user's. Updates beside other work are slower than on a quiet machine, and
# the load can change, so the estimate is made again after the first minute, and every
# estimate says over which updates it was measured and how busy the machine was.

# parameters per training target token above which a model is "sized for more data"
OVERSIZED = 50
LONG_MINUTES = 120  # an estimate above this on a CPU is said out loud


RE_ESTIMATE_S = 60  # the estimate is made again from the first minute of updates


def load_average() -> str:
    """How busy the machine was while updates were timed, as " (load average L)"; ""
    where the system does not say (our addition)."""
    try:
        return f" (load average {os.getloadavg()[0]:.1f})"
    except (AttributeError, OSError):
        return ""


@dataclass
class UpdateClock:
    """Times this process's updates from ``skip+1`` on, logs an estimate for the rest
    after ``count`` of them, and again after the first minute of timed updates (our
    addition): each line says what it measured, over which updates, and how busy the
    machine was."""

    remaining: int  # updates this run will take from where it starts
    device: torch.device
    log: Callable
    skip: int = 3  # the first updates are slower (allocation, caches)
    count: int = 10
    seen: int = 0
    t0: float = 0.0
    minutes: Optional[float] = None  # the latest estimate, once made
    estimates: int = 0  # lines logged: 1 after ``count`` updates, 2 after a minute

    def tick(self) -> None:
        """Call after every update."""
        self.seen += 1
        now = time.time()
        if self.seen == self.skip:
            self.t0 = now
        elif self.seen == self.skip + self.count:
            self.estimate(now, "estimate:")
        elif self.estimates == 1 and now - self.t0 >= RE_ESTIMATE_S:
            self.estimate(now, f"estimate after {now - self.t0:.0f} s of updates:")

    def estimate(self, now: float, head: str) -> None:
        """Log the time per update since update ``skip`` and what the rest takes."""
        timed = self.seen - self.skip
        per_update = (now - self.t0) / timed
        self.minutes = per_update * (self.remaining - self.seen) / 60
        self.estimates += 1
        self.log(
            f"{head} {per_update:.2f} s per update measured here over updates "
            f"{self.skip + 1}–{self.seen}{load_average()} → about "
            f"{self.minutes:.0f} min for the remaining {self.remaining - self.seen:,} "
            "updates (validation and test decoding come on top)"
            + ("; estimated again after a minute" if self.estimates == 1 else "")
        )
        if self.device.type == "cpu" and self.minutes > LONG_MINUTES:
            self.log(
                f"note: about {self.minutes / 60:.1f} h on this CPU at the speed "
                "measured; --epochs or --max_steps shortens it, or see the CPU "
                "presets in the README"
            )


def planned_updates(cfg: Config, data: Dataset, world: int) -> tuple[int, int, list]:
    """The run's length, for the plan (our addition): (updates of the whole run, updates
    per epoch, (source, target) lengths of the first epoch's pairs)."""
    nb = notebook()
    lengths = [(len(s), len(t)) for s, t in data.splits["train"]]
    # each process's share of the epoch's batches (as runfiles.epoch_updates deals them)
    batches = len(nb.length_batches(lengths, cfg.batch_tokens, cfg.seed, 0)) // world
    per_epoch = math.ceil(batches / cfg.accum_steps)
    total = (
        per_epoch * cfg.epochs
        if not cfg.max_steps
        else min(per_epoch * cfg.epochs, cfg.max_steps)
    )
    return total, per_epoch, lengths


def plan_run(
    cfg: Config, data: Dataset, world: int, step: int, model: nn.Module
) -> tuple[int, list[str]]:
    """(updates left to take, lines for the log): the run's length and whether the model
    suits the data."""
    nb = notebook()
    total, per_epoch, lengths = planned_updates(cfg, data, world)
    tokens = sum(t - 1 for _, t in lengths)  # target tokens predicted per epoch
    lines = [
        f"plan: {cfg.epochs} epochs × {per_epoch:,} updates"
        + (f", at most {cfg.max_steps:,} updates" if cfg.max_steps else "")
        + f" = {total:,} updates ({max(total - step, 0):,} to go) on {len(lengths):,} "
        "training pairs "
        f"({tokens:,} target tokens per epoch)"
    ]
    ratio = nb.count_parameters(model) / max(tokens, 1)
    if ratio > OVERSIZED:
        lines.append(
            f"note: the model has {ratio:.0f} parameters per training target token — "
            "it is sized for far "
            "more data than this and will overfit it; a smaller preset suits this "
            "data (see the README)"
        )
    return max(total - step, 0), lines


# ### A plan that cannot work is refused before any work
#
# Settings that are each valid can still make a run that means nothing: a `max_tokens`
# that filters out every training pair, a vocabulary of little more than the four
# specials (BLEU over it means nothing), a batch budget below one sentence (every batch
# one pair: tens of thousands of updates an epoch), three-way weight tying (§3.4)
# without one vocabulary, or a model that cannot fit the machine's memory. `check_plan`
# looks at all of them once the config is complete and the data is read, before the
# model is built, and refuses in one line naming the option to change (our addition).

VOCAB_FLOOR = 10  # symbols, specials included, below which a vocabulary is refused


class PlanError(RuntimeError):
    """A run whose settings cannot make a meaningful run on this data or machine; raised
    before the model is built (our addition)."""


def parameter_count(cfg: Config, src_vocab: int, tgt_vocab: int) -> int:
    r"""The number of distinct parameters ``make_model`` builds for ``cfg`` — §3's
    arithmetic (the notebook counts them the same way), without building anything."""
    d, f, hk = cfg.d_model, cfg.d_ff, cfg.h * cfg.head_size
    attention = 2 * (d * hk + hk) + 2 * (d * d + d)  # W^Q, W^K; W^V, W^O with biases
    ffn = d * f + f + f * d + d
    encoder = cfg.N * (attention + ffn + 2 * 2 * d)  # two sub-layers' LayerNorms
    decoder = cfg.decoder_layers * (2 * attention + ffn + 3 * 2 * d)
    stacks = (2 * 2 * d) if cfg.norm_first else 0  # each stack's final LayerNorm
    embeddings = src_vocab * d + tgt_vocab * d
    if cfg.positional == "learned":
        embeddings += 2 * cfg.max_len * d
    generator = d * tgt_vocab + tgt_vocab
    if cfg.tie_weights:
        generator -= d * tgt_vocab  # the target embedding's matrix (§3.4)
        if cfg.shared_vocab and src_vocab == tgt_vocab:
            embeddings -= src_vocab * d
    return encoder + decoder + stacks + embeddings + generator


def memory_estimate(
    cfg: Config, src_vocab: int, tgt_vocab: int, longest: int
) -> tuple[int, int, int]:
    """(bytes in all, bytes of parameters with their gradients and Adam's two moments,
    bytes of activations) of training ``cfg`` — an estimate (our addition).

    Activations are those of a batch of ``batch_tokens`` tokens a side, its sequences
    ``longest`` positions long: per layer the projections, the h attention maps, the
    feed-forward's inner layer and the residual stream, and the output layer's logits
    over the target vocabulary; all counted in float32.
    """
    params = parameter_count(cfg, src_vocab, tgt_vocab)
    d, f, hk, length = cfg.d_model, cfg.d_ff, cfg.h * cfg.head_size, longest
    attention = 2 * hk + 2 * d + 2 * cfg.h * length + d  # per token
    encoder = attention + 2 * f + d + 4 * d
    decoder = 2 * attention + 2 * f + d + 6 * d
    per_token = cfg.N * encoder + cfg.decoder_layers * decoder + 2 * d + 3 * tgt_vocab
    activations = 4 * cfg.batch_tokens * per_token + 4 * 2 * cfg.max_len * d
    weights = 4 * 4 * params  # weights, gradients, Adam's m and v (§5.3)
    return weights + activations, weights, activations


# A container's or a scheduler's memory limit (Docker `--memory`, SLURM `--mem`,
# Kubernetes limits) is a cgroup's: `memory.max` under cgroup v2,
# `memory.limit_in_bytes` under v1. Neither `/proc/meminfo` nor the address-space limit
# sees it, and the kernel ends a process that passes it; so the plan reads it, with the
# cgroup's usage (less the page cache the kernel can drop), and psutil gives the
# machine's available memory on every system. The limits of the process's own cgroup
# and of every one above it count.

UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def _read_number(path: str) -> Optional[int]:
    """The whole number in file ``path``; None where absent, "max" or unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return int(text)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _reclaimable(stat_path: str, key: str) -> int:
    """Bytes of page cache the kernel can drop (``key`` of a cgroup's memory.stat)."""
    try:
        with open(stat_path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return 0


def cgroup_memory_left(
    root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup"
) -> Optional[int]:
    """Bytes this process may still use under its cgroups' memory limits — cgroup v2's
    ``memory.max`` or v1's ``memory.limit_in_bytes``, less what the cgroup uses beyond
    droppable page cache — the least over the cgroup and those above it; None where
    no limit is set (our addition)."""
    left = []
    for here in cgroup_dirs("memory", root, cgroup_file):
        for limit_name, usage_name, cache in (
            ("memory.max", "memory.current", "inactive_file"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
        ):
            limit = _read_number(os.path.join(here, limit_name))
            if limit is None or limit >= UNLIMITED:
                continue
            used = _read_number(os.path.join(here, usage_name)) or 0
            used -= _reclaimable(os.path.join(here, "memory.stat"), cache)
            left.append(max(limit - max(used, 0), 0))
    return min(left) if left else None


def available_memory(
    device: torch.device,
    cgroup_root: str = "/sys/fs/cgroup",
    cgroup_file: str = "/proc/self/cgroup",
) -> tuple[int, str]:
    """(bytes, where) this process can still allocate on ``device`` (our addition): the
    GPU's free memory, or the least of the machine's available memory (psutil), what
    its cgroup's memory limit leaves (a container's or a scheduler's; the note above),
    and the address-space limit (``ulimit -v``); (-1, "") where none is known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    found = []
    try:
        import psutil

        found.append((int(psutil.virtual_memory().available), "available in RAM"))
    except (ImportError, OSError, RuntimeError):
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found.append((pages, "available in RAM"))
        except (OSError, ValueError, AttributeError):
            pass
    left = cgroup_memory_left(cgroup_root, cgroup_file)
    if left is not None:
        found.append((left, "left under the container's (cgroup's) memory limit"))
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            import psutil

            used = psutil.Process().memory_info().vms
            found.append((max(limit - used, 0), "left under the address-space limit"))
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else (-1, "")


def gib(n: int) -> str:
    """Bytes in GiB (MiB below one), for messages (our addition)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def check_plan(
    cfg: Config, data: Dataset, device: torch.device, world: int
) -> list[str]:
    """Refuse, with :class:`PlanError` naming the option to change, a run that cannot
    be meaningful or cannot fit; else lines for the log (our addition)."""
    pairs = data.splits["train"]
    if not pairs:
        dropped = data.stats.get("train_too_long_filtered", 0)
        raise PlanError(
            f"no training pairs left: all {dropped:,} have a side longer than "
            f"max_tokens={cfg.max_tokens} tokens; raise --max_tokens"
            if dropped
            else "the training split holds no pairs"
        )
    for side, vocab in (("source", data.src_vocab), ("target", data.tgt_vocab)):
        if len(vocab) < VOCAB_FLOOR:
            raise PlanError(
                f"the {side} vocabulary holds only {len(vocab)} symbols, the 4 "
                f"specials included (fewer than {VOCAB_FLOOR}): a score over it means "
                "nothing; "
                + (
                    f"lower --min_freq (now {cfg.min_freq}: rarer words are dropped)"
                    if cfg.vocab == "words"
                    else "raise --bpe_size, or train on more data"
                )
            )
    if cfg.tie_weights and not cfg.shared_vocab:
        raise PlanError(
            "tie_weights=true shares one matrix between both embeddings and the output "
            "layer (§3.4), which needs one vocabulary for both languages: give "
            "--shared_vocab true, or --tie_weights false"
        )
    longest = max(max(len(s), len(t)) for s, t in pairs)
    if cfg.batch_tokens < longest:
        raise PlanError(
            f"batch_tokens={cfg.batch_tokens} is below one sentence: the longest "
            f"training pair takes {longest} positions (<s> and </s> included), so "
            f"batches would hold one pair each; give --batch_tokens {longest} or more "
            "(or a smaller --max_tokens)"
        )
    total, per_epoch, _ = planned_updates(cfg, data, world)
    if per_epoch == 0:
        raise PlanError(
            f"the {len(pairs):,} training pairs make fewer batches than the {world} "
            "processes, so an epoch takes no update: lower --batch_tokens, or run "
            "fewer processes"
        )
    need, weights, activations = memory_estimate(
        cfg, len(data.src_vocab), len(data.tgt_vocab), longest
    )
    have, where = available_memory(device)
    estimate = (
        f"about {gib(need)} ({weights / 16e6:,.1f}M "
        f"parameters with their gradients and Adam's moments: {gib(weights)}; "
        f"activations of a batch of {cfg.batch_tokens:,} tokens: {gib(activations)})"
    )
    if 0 <= have < need:
        raise PlanError(
            f"the model cannot fit: it needs {estimate}, and {gib(have)} is {where}; "
            "lower --N, --d_model, --d_ff or --batch_tokens (--accum_steps keeps the "
            "tokens per update)"
        )
    return [f"memory: {estimate}" + (f"; {gib(have)} {where}" if have >= 0 else "")]


def agreed_plan(
    cfg: Config, data: Dataset, device: torch.device, world: int
) -> list[str]:
    """:func:`check_plan` in every process; when one refuses, all stop (our addition:
    the others would wait for it forever)."""
    try:
        lines, problem = check_plan(cfg, data, device, world), None
    except PlanError as e:
        lines, problem = [], e
    if world > 1 and any_process([problem is not None], world, device)[0]:
        problem = problem or PlanError(
            "another process refused the run's plan (its message says why)"
        )
    if problem is not None:
        raise problem
    return lines


# ### A loss that explodes
#
# A run whose learning rate is far too high does not always produce a NaN: its loss can
# grow to thousands and stay finite. A model that guesses uniformly over the target
# vocabulary V has a loss of ln |V| per token; a freshly initialised one starts just
# above it (by 1–2% for thousands of entries, by about 40% for the copy task's 14); a
# loss several times that, update after update, means the run diverged.
# `LossWatch` stops such a run (our addition).


@dataclass
class LossWatch:
    """Counts consecutive updates whose loss per token is above ``factor`` × ln |V|;
    :meth:`problem` says, after ``patience`` of them, that the run diverged."""

    vocab: int
    factor: float = 3.0
    patience: int = 5
    above: int = 0

    def problem(self, loss_per_token: float) -> Optional[str]:
        """None while the loss is plausible; a line naming the cause once it is not."""
        limit = self.factor * math.log(max(self.vocab, 2))
        self.above = self.above + 1 if loss_per_token > limit else 0
        if self.above < self.patience:
            return None
        return (
            f"loss exploded ({loss_per_token:,.1f} per token, above {limit:.1f} = "
            f"{self.factor:g} × ln {self.vocab:,}, the loss of a uniform guess, for "
            f"{self.patience} updates in a row; lower --lr_factor or lengthen --warmup)"
        )

"""A run's plan and estimate: how many updates it takes, whether its model suits its
data, and how long the rest will take on this machine (§5.2 gives the paper's steps and
hours).

`train` (`training.py`) logs the plan before the first update and ticks `UpdateClock`
after every one; the estimate comes from a few of the first updates, timed here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from .config import Config
from .data import Dataset
from .parts import notebook


# ### How long, and is the run sized for this data?
#
# Before long work a run says what it will do: how many updates, and — after its first
# few updates, timed on this machine — roughly how many minutes of training that is. A
# preset is sized for a data set and a device (`iwslt14-small` for the full IWSLT14 set
# on a GPU), so a run also says, in one line, when its model is far larger than its
# training data, or when it will take hours on this device, and then goes on: the choice
# stays the user's.

# parameters per training target token above which a model is "sized for more data"
OVERSIZED = 50
LONG_MINUTES = 120  # an estimate above this on a CPU is said out loud


@dataclass
class UpdateClock:
    """Times updates ``skip+1 … skip+count`` of this process's run and logs one estimate
    for the rest."""

    remaining: int  # updates this run will take from where it starts
    device: torch.device
    log: Callable
    skip: int = 3  # the first updates are slower (allocation, caches)
    count: int = 10
    seen: int = 0
    t0: float = 0.0
    minutes: Optional[float] = None  # the estimate, once made

    def tick(self) -> None:
        """Call after every update."""
        self.seen += 1
        if self.seen == self.skip:
            self.t0 = time.time()
        elif self.seen == self.skip + self.count:
            per_update = (time.time() - self.t0) / self.count
            self.minutes = per_update * (self.remaining - self.seen) / 60
            self.log(
                f"estimate: {per_update:.2f} s per update measured here → about "
                f"{self.minutes:.0f} min for the "
                f"remaining {self.remaining - self.seen:,} updates (validation and "
                "test decoding come on top)"
            )
            if self.device.type == "cpu" and self.minutes > LONG_MINUTES:
                self.log(
                    f"note: about {self.minutes / 60:.1f} h on this CPU — this preset "
                    "is sized for a GPU; "
                    "--epochs or --max_steps shortens it, or see the CPU presets in "
                    "the README"
                )


def planned_updates(cfg: Config, data: Dataset, world: int) -> tuple[int, int, list]:
    """The run's length, for the plan (our addition): (updates of the whole run, updates
    per epoch, (source, target) lengths of the first epoch's pairs)."""
    nb = notebook()
    lengths = [(len(s), len(t)) for s, t in data.splits["train"]]
    batches = len(
        nb.length_batches(
            lengths, cfg.batch_tokens, cfg.seed, 0, rank=0, world_size=world
        )
    )
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

"""Reading a `torch.profiler` window: ops dispatched, kernels launched, and the time a
GPU was busy; and FLOPs counted by `FlopCounterMode` (our addition; `gpu_check.py`,
`dispatch.py` and `bench.py` use it).

Needs only torch, and reads only attributes every torch 2.x profiler event has
(``name``, ``device_type``, ``time_range``, ``cpu_parent``).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Iterable, Sequence

import torch

CUDA = torch.autograd.DeviceType.CUDA
COPIES = ("Memcpy", "Memset")  # device rows that move or fill memory, not compute


def merged_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: overlapping kernels (several
    streams) count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def window_counts(events: list) -> dict:
    """What a profiled window of updates dispatched and ran.

    ``ops``: the ATen ops the host dispatched (``aten::`` rows not inside another
    ``aten::`` row); ``kernels``: device rows that compute; ``copies``: device rows
    that copy or fill memory; ``busy_us``: the union of the kernel rows' time spans;
    ``span_us``: from the window's first row to its last (host and device together).
    """
    host = [e for e in events if e.device_type != CUDA]
    device = [e for e in events if e.device_type == CUDA]
    kernels = [e for e in device if not e.name.startswith(COPIES)]

    def top_level(e) -> bool:
        """Whether no ATen op encloses ``e`` (its own dispatch, not a callee's)."""
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    ops = [e for e in host if e.name.startswith("aten::") and top_level(e)]
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    return {
        "ops": len(ops),
        "kernels": len(kernels),
        "copies": len(device) - len(kernels),
        "busy_us": merged_us((e.time_range.start, e.time_range.end) for e in kernels),
        "span_us": (max(s[1] for s in spans) - min(s[0] for s in spans))
        if spans
        else 0.0,
    }


# FLOPs are counted, not derived from a formula: `torch.utils.flop_counter`'s
# FlopCounterMode adds up the matrix products (and attention kernels) that a pass
# dispatches, whatever the shapes — Table 3's rows with h·d_k ≠ d_model included. The
# passes run on the `meta` device, where tensors have shapes and no data: counting costs
# no arithmetic and no memory.


def counted_flops(fn: Callable[[], object]) -> int:
    """The FLOPs (2 per multiply-add) of the matrix products and attention that ``fn``
    dispatches, counted by ``FlopCounterMode`` while it runs once."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def meta_batch(src_shape: Sequence[int], tgt_shape: Sequence[int]) -> SimpleNamespace:
    """A training batch's tensors on the ``meta`` device (shapes, no data): ``src``
    (sentences, source length), ``tgt`` and ``tgt_y`` (sentences, target length) and
    their masks, as ``Batch`` makes them."""
    (b, s), (_, t) = src_shape, tgt_shape
    tokens = {"dtype": torch.long, "device": "meta"}
    return SimpleNamespace(
        src=torch.empty(b, s, **tokens),
        tgt=torch.empty(b, t, **tokens),
        tgt_y=torch.empty(b, t, **tokens),
        src_mask=torch.empty(b, 1, s, dtype=torch.bool, device="meta"),
        tgt_mask=torch.empty(b, t, t, dtype=torch.bool, device="meta"),
    )


@contextmanager
def native_stderr_quiet(quiet: bool = True):
    """Within the block, the C++ side's standard error goes nowhere when ``quiet``:
    the profiler's own start and stop lines ("USDT: … profiler_start"), which no
    environment variable turns off on a CPU (our addition). Python's own messages are
    flushed first."""
    if not quiet:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

"""Reading a `torch.profiler` window: ops dispatched, kernels launched, and the time a
GPU was busy (our addition; `gpu_check.py` and `dispatch.py` use it).

Needs only torch, and reads only attributes every torch 2.x profiler event has
(``name``, ``device_type``, ``time_range``, ``cpu_parent``).
"""

from __future__ import annotations

from typing import Iterable

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

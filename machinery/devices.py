"""Devices, precision, processes and signals: where and how a run computes.

The device and precision are decided once per run and written in its log; several
processes train together through ``torch.distributed``; Ctrl-C ends a run cleanly after
the update in progress.
"""

from __future__ import annotations

import math
import os
import platform
import random
import signal
import statistics
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from types import MappingProxyType
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


def resolve_attention(
    setting: str, device: Optional[torch.device] = None, times: Optional[dict] = None
) -> tuple[str, str]:
    """Decide ``ModelConfig.attention`` ("auto" | "readable" | "fast") for ``device``:
    (path, a line for the log).

    ``auto`` with ``times`` (seconds per training pass of each path, measured on the
    device — what a training run does): the fast path when it is at least ``CLEAR_WIN``
    times the readable one's speed. Without them (decoding): the fused path on CUDA,
    where SDPA has fused kernels; the readable one elsewhere (on a CPU it is as fast or
    faster at our sentence lengths — measured in the aside).
    """
    if setting not in ("auto", "readable", "fast"):
        raise ValueError(f"attention must be auto, readable or fast, not {setting!r}")
    if setting != "auto":
        return setting, f"attention: {setting} path (asked for)"
    if times is not None:
        path, speed = pick_faster(times, "readable", ["fast"])
        return path, f"attention: {path} path (auto: {_measured('readable', speed)})"
    # make_model builds on the CPU
    kind = "cpu" if device is None else torch.device(device).type
    path = "fast" if kind == "cuda" else "readable"
    why = (
        "SDPA's fused kernels on CUDA"
        if path == "fast"
        else f"on {kind} the readable path is as fast or faster at our sentence lengths"
    )
    return path, f"attention: {path} path (auto: {why})"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers (our
    addition)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def on_device(model: nn.Module, device) -> nn.Module:
    """``model`` on ``device``: moved there (in place) when its parameters are elsewhere
    (our addition)."""
    device = torch.device(device)
    param = next(model.parameters(), None)
    if param is not None and (param.device.type, param.device.index) != (
        device.type,
        device.index,
    ):
        # "cuda" means the current GPU
        if not (device.index is None and param.device.type == device.type):
            model.to(device)
    return model


# Progress bars come from tqdm where it is installed; a bare GPU image may lack it, and
# a run there trains the same, without bars.


class SilentBar:
    """What the machinery uses of a tqdm bar, doing nothing: the stand-in where tqdm is
    not installed (our addition)."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self) -> "SilentBar":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int = 1) -> None:
        """Nothing to advance."""

    def set_postfix(self, **values) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def progress_bar(iterable=None, **options):
    """A ``tqdm.auto`` progress bar over ``iterable`` with ``options`` (its text bar
    where ipywidgets, which its notebook bar needs, is not installed: no warning in a
    notebook's output), or a :class:`SilentBar` where tqdm is not installed (our
    addition)."""
    import importlib.util

    try:
        if importlib.util.find_spec("ipywidgets") is None:
            from tqdm.std import tqdm
        else:
            from tqdm.auto import tqdm
    except ModuleNotFoundError:
        return SilentBar(iterable)
    return tqdm(iterable, **options)


def cpu_name() -> str:
    """The CPU as every result of this project names it (our addition; the one reader):
    the model name in /proc/cpuinfo with its family and model number, since one name
    covers several chips — "<model name> (cpu family F, model M)" — else the
    platform's word for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n")[0]
    except (OSError, UnicodeDecodeError):
        return platform.processor() or platform.machine() or "unknown CPU"
    info = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in first.splitlines())
    )
    name = info.get("model name") or platform.processor() or "unknown CPU"
    detail = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if info.get(k))
    return f"{name} ({detail})" if detail else name


# ## Devices, precision, processes and signals
#
# Small pieces a run needs from its surroundings: which device, which precision pays off
# there, whether several processes train together (`torchrun` sets `WORLD_SIZE`), and a
# way to turn Ctrl-C into "save and stop after this update".


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# **A precision the hardware computes fast.** bf16 autocast can double the matrix
# throughput of a CPU with native bf16 instructions (AVX-512 BF16 or AMX) and of GPUs
# from compute capability 8.0 (A100, H100, RTX 30xx and later); where bf16 is only
# *emulated* — most AVX2 CPUs, and the T4 and V100 — it runs many times slower than
# float32. Those GPUs have fast fp16 instead, whose narrow range needs a **gradient
# scaler**: the loss is multiplied by a large factor before the backward pass so that
# small gradients do not round to zero, the gradients are divided by it before the step,
# and an update whose gradients overflowed is skipped while the factor shrinks. So
# `precision="auto"` (the default) considers bf16 where it is native, fp16 with the
# scaler on older GPUs with fast fp16, and float32 — and then *measures* (below); the
# run log says which and why; `fp32`, `bf16` and `fp16` override it. The loss is summed
# in float32 under either autocast, and masked attention scores are $-\infty$, which
# fp16 represents, so masks stay exact.


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes in bf16 natively (not emulated), with the reason in
    words (our addition).

    A CUDA device does from compute capability 8.0 (Ampere) on.
    ``torch.cuda.is_bf16_supported()`` is not the test: by default it also counts
    emulation (T4, V100), and it asks about the current device rather than the run's.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 0):
            return (
                True,
                f"the GPU (compute capability {major}.{minor}) computes bf16 natively",
            )
        return (
            False,
            f"the GPU (compute capability {major}.{minor}) would only emulate bf16",
        )
    if device.type == "cpu":
        # the vector kernels torch runs: "AVX512", "AVX2", …
        kernels = torch.backends.cpu.get_cpu_capability()
        unit = (
            "AMX"
            if torch.cpu._is_amx_tile_supported()
            else "AVX-512 BF16"
            if torch.cpu._is_avx512_bf16_supported()
            else None
        )
        if unit and kernels.startswith("AVX512"):
            return True, f"the CPU has native bf16 ({unit})"
        return False, (
            f"the CPU has no native bf16 (kernels: {kernels}), so bf16 would be "
            "emulated "
            "and much slower than float32"
        )
    return False, f"bf16 autocast is not used on {device.type}"


def fast_fp16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` is a GPU where fp16 autocast pays (our addition): tensor cores
    (capability ≥ 7.0), or 6.0."""
    if device.type != "cuda":
        return False, f"fp16 autocast is not chosen on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (7, 0) or (major, minor) == (6, 0):
        return True, f"the GPU (compute capability {major}.{minor}) computes fp16 fast"
    return False, f"the GPU (compute capability {major}.{minor}) computes fp16 slowly"


def precision_candidates(device: torch.device) -> tuple[list[str], str]:
    """The precisions ``auto`` times on ``device``, float32 first, and why the others
    are left out (our addition).

    bf16 where the device has it natively, else fp16 (with its scaler) on GPUs where it
    is fast; where neither is, float32 is the answer and nothing is measured.
    """
    bf16, why_bf16 = native_bf16(device)
    if bf16:
        return ["fp32", "bf16"], why_bf16
    fp16, why_fp16 = fast_fp16(device)
    if fp16:
        return ["fp32", "fp16"], f"{why_bf16}; {why_fp16}"
    return ["fp32"], why_bf16


# **`auto` is measured, not assumed.** Whether bf16 pays on a CPU is not written in its
# flags: an AMD EPYC with AVX-512 BF16 trains 2.4× faster in bf16, an Intel Xeon with
# the same flag but no AMX 1.56× *slower*. So `auto` times a few forward and backward
# passes of the run's own model on a batch of the run's own size, in each candidate
# precision and attention path, on the run's device (`time_calls`: about 1.6 s, or a
# warm-up and `MIN_ROUNDS` timed rounds where a pass is slower), and leaves float32
# and the readable path only for a clear win — at least `CLEAR_WIN` times their speed
# — so that near-ties give the same answer run after run. The batch's size matters:
# on a 2-core EPYC of family 25 (`benchmarks/auto_batch.py`), bf16 measured 0.91–0.96×
# float32's speed on a 256-token batch and 1.38–1.40× on `multi30k-small`'s 2,500
# tokens. The times are taken inside `torch.random.fork_rng`: the run's random
# streams, and so its numbers, do not change.

CLEAR_WIN = 1.10  # leave float32 / the readable path only for ≥ 10% more speed
MIN_ROUNDS = 3  # timed rounds a measurement always gets, past its budget if need be
NAMES = {
    "fp32": "float32",
    "bf16": "bf16",
    "fp16": "fp16",
    "readable": "readable",
    "fast": "fast",
}


def time_calls(
    calls: dict, device: torch.device, budget_s: float = 1.6, rounds: int = 7
) -> dict:
    """Median seconds per call of each of ``calls`` (name → function), timed in at
    most ``rounds`` interleaved rounds after one round of warm-up, within about
    ``budget_s`` but never fewer than ``MIN_ROUNDS`` timed rounds (``rounds`` where
    fewer are asked for) (our addition)."""
    if rounds < 1:
        raise ValueError(f"time_calls needs at least one timed round, not {rounds}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict = {name: [] for name in calls}
    start = time.perf_counter()
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in calls.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                samples[name].append(time.perf_counter() - t0)
        spent = time.perf_counter() - start
        if r >= MIN_ROUNDS and spent * (r + 2) / (r + 1) > budget_s:
            break  # the next round would not fit
    return {name: statistics.median(v) for name, v in samples.items()}


def pick_faster(times: dict, default: str, others: Sequence[str]) -> tuple[str, dict]:
    """(the choice, each candidate's speed relative to ``default``): the fastest of
    ``others`` when at least ``CLEAR_WIN`` times ``default``'s speed, else ``default``
    (our addition)."""
    speed = {k: times[default] / times[k] for k in others}
    best = max(others, key=lambda k: speed[k], default=None)
    return (best if best and speed[best] >= CLEAR_WIN else default), speed


def _measured(default: str, speed: dict) -> str:
    return "; ".join(
        f"{NAMES[k]} measured {v:.2f}× {NAMES[default]}'s speed here"
        for k, v in speed.items()
    )


def resolve_precision(
    setting: str, device: torch.device, times: Optional[dict] = None
) -> tuple[str, str]:
    """Decide ``Config.precision`` for ``device`` (our addition): ("fp32" | "bf16" |
    "fp16", a line for the log).

    ``auto``: float32 where it is the only candidate (`precision_candidates`), else the
    candidate ``times`` (seconds per pass, measured on ``device``) show at least
    ``CLEAR_WIN`` times float32's speed, else float32. Anything else is obeyed, with a
    note when slow.
    """
    if setting == "auto":
        candidates, why = precision_candidates(device)
        if len(candidates) == 1:
            return "fp32", f"precision: float32 (auto: {why})"
        if times is None:
            raise ValueError("precision auto on this device needs measured times")
        choice, speed = pick_faster(times, "fp32", candidates[1:])
        said = {
            "fp32": "float32",
            "bf16": "bf16 autocast",
            "fp16": "fp16 autocast with a gradient scaler",
        }[choice]
        return choice, f"precision: {said} (auto: {_measured('fp32', speed)})"
    if setting == "bf16":
        on, why = native_bf16(device)
        return "bf16", "precision: bf16 autocast (asked for" + (
            "" if on else f"; note: {why}"
        ) + ")"
    if setting == "fp16":
        return "fp16", "precision: fp16 autocast with a gradient scaler (asked for)"
    return "fp32", "precision: float32 (asked for)"


def measured_ratio(line: str) -> str:
    """Why a decision's line says what it says — "asked for", or the "auto: …" part
    without its prefix — for results.json (our addition)."""
    why = line[line.index("(") + 1 : -1] if line.endswith(")") else ""
    return why.removeprefix("auto: ")


# **TF32.** On CUDA GPUs from Ampere on, float32 matrix products can run on the tensor
# cores in TF32 (a 10-bit mantissa, float32's range), several times faster; PyTorch
# leaves it off by default. A float32 run turns it on, and says so in its log.


def allow_tf32(device: torch.device) -> str:
    """Let float32 matrix products on CUDA use TF32 (our addition); a line for the log,
    "" off CUDA."""
    if device.type != "cuda":
        return ""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    major, minor = torch.cuda.get_device_capability(device)
    where = "tensor cores" if (major, minor) >= (8, 0) else "no effect before Ampere"
    return f"float32 matrix products: TF32 allowed ({where})"


# **cuDNN's attention kernel is left out.** On an NVIDIA H200 (torch 2.11), PyTorch's
# `scaled_dot_product_attention` in bf16 or fp16 chose cuDNN's kernel, which builds a
# plan for every new shape of its inputs; length-made batches nearly always have a new
# shape. Each new shape cost about half a second, and an `iwslt14-small` bf16 update
# 421 ms with cuDNN's kernel against 61 ms with the memory-efficient one PyTorch picks
# next (`benchmarks/sdpa_backends.py`; `results/gpu/`). So while a run computes,
# cuDNN's kernel is switched off (and restored after; the other kernels as they were):
# in its updates and in `auto`'s measurements alike. float32 never had it.


@contextmanager
def attention_kernels(device: torch.device):
    """A context in which SDPA does not choose cuDNN's kernel on CUDA (our addition; the
    note above); nothing changes elsewhere."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def computing(device: torch.device, precision: str) -> Callable:
    """A factory of the context a forward pass runs in (our addition): ``precision``'s
    autocast ("bf16", "fp16"; none for "fp32") and :func:`attention_kernels`."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    @contextmanager
    def context():
        """Autocast (where asked) and SDPA's kernels, for the ``with`` block."""
        cast = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
        with attention_kernels(device), cast:
            yield

    return context


# **A compiled step.** Eagerly, every op of an update is dispatched by the host one at a
# time: about 1,800 ops in float32 for `iwslt14-small` (`benchmarks/dispatch.py`),
# which on a GPU can take longer than the arithmetic they launch. `compile=True` hands
# the model's forward pass, and with it the backward, to `torch.compile`, which fuses
# them into a few generated kernels; on CUDA with CUDA graphs (`reduce-overhead`), which
# replay a recorded shape's kernels in one launch. Each new batch shape costs a
# compilation (or a recording), so a compiled run rounds its batches' lengths up to a
# multiple of `LENGTH_MULTIPLE` (padding, masked like any other). Where compiling
# cannot work — no C compiler for the generated code, no Triton on CUDA — the run says
# so in one line and trains eagerly.

LENGTH_MULTIPLE = 8


def compile_problem(device: torch.device) -> str:
    """Why ``torch.compile`` cannot compile a training step on ``device`` here; "" when
    it can (our addition)."""
    import shutil

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {platform.python_version()}"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton, which compiles CUDA kernels, is not installed"
        names = (os.environ.get("CC"), "cc", "gcc", "clang")
        what = "C compiler, which Triton's launcher needs"
    else:
        names = (os.environ.get("CXX"), "c++", "g++", "clang++")
        what = "C++ compiler, which the generated CPU code needs"
    if not any(name and shutil.which(name) for name in names):
        return f"no {what}"
    return ""


def compile_model(model: nn.Module, device: torch.device, log) -> nn.Module:
    """``model`` compiled by ``torch.compile`` — with CUDA graphs on CUDA — or, where
    :func:`compile_problem` finds it cannot be, ``model`` itself, said in one line of
    ``log`` (our addition)."""
    if problem := compile_problem(device):
        log(f"compile: not here ({problem}); training eagerly")
        return model
    mode = "reduce-overhead" if device.type == "cuda" else None
    log(
        "compile: torch.compile"
        + (f" (mode {mode}: CUDA graphs)" if mode else "")
        + f"; batch lengths rounded up to multiples of {LENGTH_MULTIPLE}"
    )
    return torch.compile(model, mode=mode)


def compilations() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (our addition)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# **Memory that is freed and asked for again.** On a CPU, PyTorch takes each tensor's
# memory from the C library's `malloc` and gives it back when the tensor dies. glibc
# (the C library of most Linux systems) serves a block of more than 32 MB (and, until it
# adapts, of more than 128 KB) with a fresh mapping from the operating system and unmaps
# it when it is freed, so a training step that makes the same large tensors every time
# (the (tokens × vocabulary) logits and their gradient: 77 MB in float32 for a
# `multi30k-small` batch) pays every time for the system to hand over and zero fresh
# pages. A whole `multi30k-small` step ran 1.22× faster in bf16 and 1.10× in float32
# with the memory reused (`benchmarks/profile_step.py`, run with and without the
# settings below). Two of glibc's settings, read from the environment when a process
# starts, make it keep freed memory for reuse: `MALLOC_MMAP_MAX_=0` (no separate
# mappings) and a large `MALLOC_TRIM_THRESHOLD_` (do not give the top of the heap back).
# The `Makefile` sets both for everything it runs, and `benchmarks/table3.py` for the
# rows it trains; a CPU run started another way says in its log when they are not set.
# A process then keeps its largest footprint until it ends, which is what a training run
# does anyway. Other C libraries (macOS, musl) ignore the variables.

GLIBC_MALLOC_SETTINGS = MappingProxyType(
    {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**34)}
)


def allocator_note(device: torch.device, environ=None) -> str:
    """A line for the log on how freed CPU memory is reused (our addition); "" off the
    CPU or off glibc."""
    environ = os.environ if environ is None else environ
    if (
        device.type != "cpu"
        or not sys.platform.startswith("linux")
        or platform.libc_ver()[0] != "glibc"
    ):
        return ""
    settings = " ".join(f"{k}={v}" for k, v in GLIBC_MALLOC_SETTINGS.items())
    if all(environ.get(k) == v for k, v in GLIBC_MALLOC_SETTINGS.items()):
        return f"memory: glibc keeps freed memory for reuse ({settings})"
    return (
        f"memory: not {settings} (what `make` sets), so with glibc's defaults large "
        "tensors get fresh "
        "pages every step; setting them made CPU training steps faster (the "
        "Makefile's comment on them says why)"
    )


# **Threads beside other work.** A laptop or a shared machine always runs something
# else. PyTorch's CPU kernels split their work over OpenMP threads, and by default an
# idle OpenMP thread spins for a while before it sleeps; with another busy process on
# the same cores, the spinning threads take turns with it and an update slows several
# times (issue figures: 2.9× on a 2-core AMD EPYC with the default, 1.5× with passive
# waiting). So training, evaluation, translation and the benchmarks wait passively
# (`OMP_WAIT_POLICY=PASSIVE`), unless the user set `OMP_WAIT_POLICY`. The runtime reads
# it once, when it starts — when torch is imported — so it is set in the Makefile's
# exported environment, in the environment of every process the machinery starts, and
# before torch is imported at the program's start. And threads default to the cores
# this process may use — its CPU affinity (`taskset`, a scheduler's allocation) and a
# container's CPU quota (cgroup `cpu.max`, `docker --cpus`) — rather than every core of
# the machine, unless `OMP_NUM_THREADS` says otherwise. Passive waiting costs some speed
# on a quiet machine (`make bench`'s last section measures it beside spin counts and one
# thread: `results/README.md`). Threads are never chosen from the load of the moment: a
# run's numbers depend on its thread count, and a run must give back the same bits.

WAIT_POLICY = "PASSIVE"


def cgroup_dirs(
    controller: str,
    root: str = "/sys/fs/cgroup",
    cgroup_file: str = "/proc/self/cgroup",
) -> list[str]:
    """The folders under ``root`` of this process's cgroup — cgroup v2's one tree, or
    v1's ``controller`` tree — and of every cgroup above it, innermost first (our
    addition; ``cgroup_file`` is /proc/self/cgroup)."""
    v1 = os.path.join(root, controller)
    places = [(root, "/"), (v1, "/")]
    try:
        with open(cgroup_file, encoding="utf-8") as f:
            for line in f:
                _, controllers, path = (line.rstrip("\n").split(":", 2) + ["", ""])[:3]
                if controllers == "":
                    places.insert(0, (root, path))
                elif controller in controllers.split(","):
                    places.insert(0, (v1, path))
    except OSError:
        pass
    dirs: list[str] = []
    for base, path in places:
        base = os.path.normpath(base)
        here = os.path.normpath(os.path.join(base, path.lstrip("/")))
        if here != base and not here.startswith(base + os.sep):
            continue
        while True:
            if os.path.isdir(here) and here not in dirs:
                dirs.append(here)
            if here == base:
                break
            here = os.path.dirname(here)
    return dirs


def _words(path: str) -> list[str]:
    """The words of a small text file; [] where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().split()
    except (OSError, UnicodeDecodeError):
        return []


def cpu_quota(
    root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup"
) -> Optional[float]:
    """Cores' worth of CPU time this process's cgroups allow — v2's ``cpu.max``, v1's
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, the least over the cgroup and
    those above it — or None where no quota is set (our addition)."""
    quotas = []
    for here in cgroup_dirs("cpu", root, cgroup_file):
        v2 = _words(os.path.join(here, "cpu.max"))
        v1 = _words(os.path.join(here, "cpu.cfs_quota_us")) + _words(
            os.path.join(here, "cpu.cfs_period_us")
        )
        for pair in (v2, v1):
            try:
                quota, period = int(pair[0]), int(pair[1])
            except (IndexError, ValueError):  # "max", -1 or nothing: no quota
                continue
            if quota > 0 and period > 0:
                quotas.append(quota / period)
    return min(quotas) if quotas else None


def usable_cores(
    root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup"
) -> int:
    """How many cores this process can keep busy (our addition): those its CPU
    affinity allows (``os.sched_getaffinity``; ``os.cpu_count()`` where the system has
    none), fewer where a container's CPU quota allows less time (rounded up); at
    least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota(root, cgroup_file)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(cores, 1)


def quiet_environment(environ=None) -> dict:
    """``environ`` (default: this process's) for a process the machinery starts, with
    passive OpenMP waiting and a thread count of :func:`usable_cores`, each unless
    already set (our addition; the note above)."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    env.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    return env


def use_usable_cores(environ=None) -> str:
    """Lower torch's CPU threads to :func:`usable_cores` where there are more, unless
    ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) sets them; a line for the log saying
    how many, why, and how idle threads wait (our addition)."""
    environ = os.environ if environ is None else environ
    policy = environ.get("OMP_WAIT_POLICY", "")
    waiting = (
        f"OMP_WAIT_POLICY={policy}"
        if policy
        else "idle threads spin before they sleep (OMP_WAIT_POLICY not set)"
    )
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if environ.get(name):
            return (
                f"threads: {torch.get_num_threads()} ({name}={environ[name]}); "
                f"{waiting}"
            )
    cores = usable_cores()
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
    return (
        f"threads: {torch.get_num_threads()} ({cores} cores usable by this "
        f"process); {waiting}"
    )


# Several processes. The backend follows the device the run trains on — not whether CUDA
# exists: `--device cpu` on a GPU machine is a Gloo run — and every tensor handed to a
# collective lives on that device (NCCL takes CUDA tensors only). Each process keeps its
# own random streams: the first process continues the stream of `seed`, the others start
# their own (`seed_process`), so dropout differs between GPUs; a checkpoint stores each
# process's state and a resume with as many processes restores each its own.


def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a run on ``device`` (our addition): NCCL
    for CUDA, Gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _distributed(device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(rank, world size); starts the process group, for a run on ``device``, when
    launched by ``torchrun``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        with start_watch(world):
            dist.init_process_group(backend=process_group_backend(device))
    return dist.get_rank(), world


# Starting several processes waits until all of them are there. A process whose partners
# never come (rank 0 not started, a wrong MASTER_ADDR) would wait in silence for
# torch's half hour; `start_watch` says after a few seconds what it waits for, and ends
# the process with one line after `START_TIMEOUT_S` (our addition).

START_TIMEOUT_S = 600  # ANNOTATED_TRANSFORMER_START_TIMEOUT (seconds) replaces it
START_NOTE_S = 10  # no partner after this long: say what is awaited


@contextmanager
def start_watch(world: int, environ=None):
    """Within the block, say after ``START_NOTE_S`` seconds which processes are awaited,
    and end the process (status 2) after the start timeout (our addition)."""
    environ = os.environ if environ is None else environ
    try:
        limit = float(environ.get("ANNOTATED_TRANSFORMER_START_TIMEOUT", ""))
    except ValueError:
        limit = START_TIMEOUT_S
    if not 0 < limit <= 10**6:  # nan, inf, 0 or less: the default
        limit = START_TIMEOUT_S
    where = (
        f"rank {environ.get('RANK', '?')} of {world}, at "
        f"{environ.get('MASTER_ADDR', '?')}:{environ.get('MASTER_PORT', '?')}"
    )

    def note() -> None:
        print(
            f"waiting for the other {world - 1} process(es) to start ({where}); "
            f"giving up after {limit:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def give_up() -> None:
        print(
            f"error: the other {world - 1} process(es) did not start within "
            f"{limit:.0f} s ({where}): start all {world} (torchrun --nproc_per_node, "
            "--nnodes), or check MASTER_ADDR and MASTER_PORT",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    timers = [
        threading.Timer(min(START_NOTE_S, limit / 2), note),
        threading.Timer(limit, give_up),
    ]
    for t in timers:
        t.daemon = True
        t.start()
    try:
        yield
    finally:
        for t in timers:
            t.cancel()


def _barrier(device: torch.device) -> None:
    """Wait for every process (our addition; NCCL is told this process's GPU)."""
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def any_process(flags: Sequence[bool], world: int, device: torch.device) -> list[bool]:
    """Each flag, true if it is true in any process (our addition: one collective, on
    the training device)."""
    if world == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [v > 0 for v in t.tolist()]


def seed_process(seed: int, rank: int, step: int = 0) -> None:
    """Seed this process's torch and Python streams (our addition): ``seed`` for process
    0 at step 0, else distinct."""
    value = seed + 1_000_003 * rank + 7_919 * step
    torch.manual_seed(value)
    random.seed(value)


def rng_state(device: torch.device) -> dict:
    """This process's random-number state (our addition): torch's CPU stream, Python's,
    its own GPU's (if any)."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng(state: dict, device: torch.device) -> None:
    """Put back a state of :func:`rng_state` (our addition); older checkpoints list
    every visible GPU's: by index."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if device.type == "cuda" and cuda is not None:
        if isinstance(cuda, (list, tuple)):
            index = (
                device.index
                if device.index is not None
                else torch.cuda.current_device()
            )
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


# Ctrl-C during training should not throw away the update in progress, nor leave without
# a checkpoint. `StopRequest` turns SIGINT and SIGTERM into a flag that the loop reads
# after each update.


class StopRequest:
    """Turns SIGINT/SIGTERM/SIGHUP into a request to stop after the current update.

    A context manager: inside it the first signal only sets ``signum``; the training
    loop checks :meth:`requested` after each update, saves and stops. A second signal
    stops at once (``KeyboardInterrupt``). Handlers are installed only in the main
    thread, and the previous ones are put back on exit.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            # SIGHUP: a closed terminal or a dropped ssh session, like SIGTERM
            hangup = [signal.SIGHUP] if hasattr(signal, "SIGHUP") else []
            for sig in (signal.SIGINT, signal.SIGTERM, *hangup):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(
        self, world: int = 1, device: torch.device = torch.device("cpu")
    ) -> bool:
        """True once a signal arrived (in any process of a distributed run on
        ``device``: all stop together)."""
        return any_process([self.signum is not None], world, device)[0]

"""The ten-minute GPU check (`make gpu-check`): does the GPU path work, and is the GPU
kept busy?

Run from the repository root on a machine with one CUDA GPU, with its own Python and
torch (nothing else is required, nothing is fetched)::

    python3 benchmarks/gpu_check.py --data DIR [--out DIR] [--wheels DIR]

``--data`` is a folder holding the data mirror's ``iwslt14/`` files (or those files
themselves); without it the check refuses, unless ``--synthetic`` asks for random
sentences instead. ``--wheels`` is a folder of wheels for optional packages this Python
lacks, installed offline (``pip --no-index --find-links``) into the work folder. Each
optional package degrades only what needs it: without tqdm no progress bars, without
matplotlib (or numpy, which it needs) no curve, without sentencepiece no IWSLT (BPE)
steps; the cause is written where the step would be.

The JSON (``--out``, default ``build/gpu-check/``, outside the tracked results) is
rewritten after every step. It holds first the environment — torch, CUDA, cuDNN, the
card and its capability, the optional packages present, the host cost of one eager op,
whether a C compiler exists, ``nvidia-smi``'s view — then, each within its own time
budget:

1. an IWSLT14-sized stand-in: the data's training sample repeated to ~160,000 pairs
   (plus its valid and test splits), so that an update costs what the real recipe's
   does;
2. the copy task with ``auto`` precision and attention: what it picks, and the ratios
   it measured;
3. fp16 with its gradient scaler, stopped by SIGINT and resumed, against the same run
   uninterrupted (weights and scaler state equal);
4. ``iwslt14-small`` in bf16, fp16 and float32 (TF32): ms per update, tokens/s and MFU
   (against each precision's own dense peak: TF32's for float32) over a timed window;
   then, after it, a profiled window of a few updates: ops and kernels per update, and
   GPU busy — the union of the kernel rows' spans over the window — cross-checked by
   sampling ``nvidia-smi`` during the timed window;
5. batched beam-search decoding: sentences and tokens per second;
6. last, ``--compile`` (CUDA graphs on CUDA, batch lengths rounded up to multiples of
   8): compilations and the first update's time; where compiling cannot work (no C
   compiler for Triton's launcher, say) the run trains eagerly and the JSON says why,
   and a failure is recorded, not fatal.

Without CUDA (or with ``--smoke``) the same steps run tiny, in seconds, on the CPU:
``tests/test_gpu_check.py`` runs that, with the optional packages blocked too. A step
that fails is recorded with its error and the others still run; the exit status is 1
if any failed (skipped steps do not count).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from profiling import (  # noqa: E402
    counted_flops,
    meta_batch,
    native_stderr_quiet,
    window_counts,
)

# Optional packages: what each one's absence costs.
OPTIONAL = MappingProxyType(
    {
        "numpy": "matplotlib, which needs it (the notebook and training do not)",
        "tqdm": "progress bars",
        "matplotlib": "the training curve",
        "sentencepiece": "IWSLT14's BPE: the IWSLT steps",
    }
)

# Dense (no sparsity) tensor-core peaks in TFLOP/s from the vendors' datasheets: bf16,
# fp16, and float32 as it runs here (TF32 from Ampere on, plain float32 before). The
# first name found in the card's name counts.
PEAK_TFLOPS = (
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 417.5}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6}),
    ("T4", {"bf16": None, "fp16": 65.0, "fp32": 8.1}),
    ("V100", {"bf16": None, "fp16": 125.0, "fp32": 15.7}),
)

# Updates of a training step: warm-up, the timed window, then the profiled window.
FULL = dict(
    pairs=160_000,
    warm=30,
    timed=300,
    profiled=10,
    compile_updates=150,
    decode_sentences=1000,
    copy=(1600, 160, 100),
)
SMOKE = dict(
    pairs=600,
    warm=1,
    timed=2,
    profiled=1,
    compile_updates=1,
    decode_sentences=4,
    copy=(200, 40, 20),
)
TINY = dict(N=1, d_model=32, d_ff=64, h=4, bpe_size=300, batch_tokens=256, warmup=10)

# Seconds each step may take (a ten-minute command in all); the smoke mode's are
# generous, for a loaded CPU.
BUDGET_S = MappingProxyType(
    {
        "stand_in": 90,  # sentencepiece learns the BPE model of 160,000 pairs
        "copy_auto": 40,
        "fp16_interrupted_and_resumed": 40,
        "iwslt14_small_bf16": 70,
        "iwslt14_small_fp16": 70,
        "iwslt14_small_fp32": 70,
        "beam_decoding": 35,
        "iwslt14_small_compile": 120,
    }
)
SMOKE_BUDGET_S = 240


class OverBudget(Exception):
    """A step ran past its time budget."""


def slug(name: str) -> str:
    """``name`` in lower case with runs of other characters as one hyphen."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_name() -> str:
    """The CPU's name: a copy of ``machinery.devices.cpu_name`` (this script runs
    without the package; tests/test_gpu_check.py keeps the two equal)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().split("\n\n")[0].splitlines()
    except (OSError, UnicodeDecodeError):
        return platform.processor() or platform.machine() or "unknown CPU"
    info = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    name = info.get("model name") or platform.processor() or "unknown CPU"
    detail = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if info.get(k))
    return f"{name} ({detail})" if detail else name


def write_json(path: Path, report: dict) -> None:
    """Replace ``path`` with ``report`` in one step (a timeout never leaves half): a
    short copy of ``machinery.runfiles.write_atomic``, since this script runs without
    the package."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ## The environment


def optional_packages() -> dict:
    """Each optional package: its version where it imports, else why not."""
    out = {}
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure to import is "absent"
            out[name] = {"present": False, "why": f"{type(e).__name__}: {e}"}
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        out[name] = {"present": True, "version": version}
    return out


def install_wheels(folder: Path, names: list, target: Path) -> dict:
    """pip-install ``names`` from the wheels in ``folder`` only (never the network),
    into ``target``, which then leads ``sys.path``."""
    norm = {n: re.sub(r"[-_.]+", "_", n).lower() for n in names}
    have = {p.name.split("-")[0].lower() for p in folder.glob("*.whl")}
    wanted = [n for n in names if norm[n] in have]
    out: dict = {"folder": str(folder), "wanted": names, "wheels_for": wanted}
    if not wanted:
        return out
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(folder),
        "--target",
        str(target),
        "--quiet",
        *wanted,
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
        out["returncode"] = proc.returncode
        out["output"] = (proc.stdout + proc.stderr)[-2000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        out["returncode"], out["output"] = None, f"{type(e).__name__}: {e}"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return out


def eager_op_us(device: torch.device, count: int = 2000) -> float:
    """Host microseconds to issue one small eager op on ``device`` (the dispatch and
    launch cost every unfused op pays)."""
    x = torch.zeros(8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(100):
        x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    host = time.perf_counter() - t0
    sync()
    return 1e6 * host / count


def c_compiler() -> Optional[str]:
    """The C compiler Triton's launcher and inductor's CPU code would use, or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def nvidia_smi() -> Optional[str]:
    """``nvidia-smi``'s summary, or None where there is none."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return (proc.stdout + proc.stderr)[-4000:]


def environment(device: torch.device) -> dict:
    """What this machine is, recorded before any step runs."""
    cuda = device.type == "cuda"
    card = torch.cuda.get_device_name(device) if cuda else f"CPU: {cpu_name()}"
    capability = list(torch.cuda.get_device_capability(device)) if cuda else None
    cudnn = (
        torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    )
    return {
        "card": card,
        "capability": capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "host_cpu": cpu_name(),
        "optional_packages": optional_packages(),
        "eager_op_host_us": eager_op_us(device),
        "c_compiler": c_compiler(),
        "nvidia_smi": nvidia_smi(),
    }


# ## Data


def iwslt_folder(data: Optional[Path]) -> Optional[Path]:
    """The folder of IWSLT14 files under ``data`` (``data/iwslt14`` or ``data``), or
    None when it holds none."""
    if data is None:
        return None
    for folder in (data / "iwslt14", data):
        train = [folder / f"{n}.de" for n in ("train", "train-sample")]
        if any(p.is_file() for p in train) and (folder / "valid.de").is_file():
            return folder
    return None


def emptied_folder(work: Path, data: Path) -> Optional[Path]:
    """The folder under ``work`` that the check empties (the stand-in data, the runs,
    the caches) and that holds ``data`` or lies inside it, or None."""
    data = data.resolve()
    for name in ("mirror", "runs", "data"):
        folder = (work / name).resolve()
        if folder == data or folder in data.parents:
            return work / name
    return None


def build_standin(src: Optional[Path], folder: Path, pairs: int) -> dict:
    """An ``iwslt14/`` folder under ``folder``: ``src``'s training pairs repeated to
    ``pairs`` pairs, its valid and test splits (shortened in the smoke mode); random
    sentences where ``src`` is None (``--synthetic``)."""
    out = folder / "iwslt14"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    keep = None if pairs >= 10_000 else max(pairs // 4, 8)
    if src is not None:
        train = "train" if (src / "train.de").is_file() else "train-sample"
        origin = f"{src}: {train} repeated"
        for side in ("de", "en"):
            lines = (src / f"{train}.{side}").read_text(encoding="utf-8").splitlines()
            (out / f"train.{side}").write_text(
                "\n".join((lines * (pairs // len(lines) + 1))[:pairs]) + "\n",
                encoding="utf-8",
            )
            for split in ("valid", "test"):
                text = (src / f"{split}.{side}").read_text(encoding="utf-8")
                (out / f"{split}.{side}").write_text(
                    "\n".join(text.splitlines()[:keep]) + "\n", encoding="utf-8"
                )
    else:
        origin = "synthetic: random sentences of 2,000 words (--synthetic)"
        rng = random.Random(0)
        words = [f"w{i}" for i in range(2000)]
        counts = {"train": pairs, "valid": keep or 7283, "test": keep or 6750}
        for split, n in counts.items():
            lines = [
                " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
                for _ in range(n)
            ]
            for side in ("de", "en"):
                (out / f"{split}.{side}").write_text("\n".join(lines) + "\n")
    return {"folder": str(out), "train_pairs": pairs, "origin": origin}


# ## Measuring training


class FlopCount:
    """FLOPs of one forward and backward pass of a run's model on padded batches of
    given shapes, counted by ``FlopCounterMode`` (``profiling.counted_flops``) on a
    copy of the model on the ``meta`` device — Table 3's h·d_k ≠ d_model included —
    once per shape."""

    def __init__(self, cfg, src_vocab: int, tgt_vocab: int):
        import machinery

        self.tat, self.cfg, self.known = machinery.notebook(), cfg, {}
        with torch.device("meta"):
            self.model = self.tat.make_model(
                src_vocab, tgt_vocab, cfg, attention="readable"
            )

    def __call__(self, src: tuple, tgt: tuple) -> int:
        """FLOPs of a pass over a batch of ``src`` and ``tgt`` (sentences, length)."""
        if (src, tgt) not in self.known:
            batch = meta_batch(src, tgt)
            self.known[src, tgt] = counted_flops(
                lambda: self.tat.batch_loss(
                    self.model, batch, self.cfg.eps_ls
                ).backward()
            )
        return self.known[src, tgt]


class SmiSampler:
    """``nvidia-smi``'s GPU utilisation, sampled every 100 ms while open (nothing where
    there is no nvidia-smi)."""

    def __init__(self, device: torch.device):
        self.samples: list = []
        self.proc = None
        if device.type != "cuda" or not shutil.which("nvidia-smi"):
            return
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        ident = f"GPU-{uuid}" if uuid is not None else str(device.index or 0)
        query = ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", *query, f"--id={ident}", "--loop-ms=100"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        """Collect nvidia-smi's lines until it ends (a thread of its own)."""
        for line in self.proc.stdout:
            try:
                self.samples.append(float(line.strip()))
            except ValueError:
                continue

    def close(self) -> Optional[dict]:
        """Stop sampling: the samples' count and mean, as a fraction (None if none)."""
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait(timeout=5)
        self.thread.join(timeout=2)
        if not self.samples:
            return None
        mean = sum(self.samples) / len(self.samples) / 100
        return {"samples": len(self.samples), "mean_busy": mean}


class Recorder:
    """Wraps ``machinery.training.update``: the end of every update; nvidia-smi sampled
    over the timed window (updates ``warm`` + 1 … ``warm`` + ``timed``); then a
    profiled window of ``profiled`` updates, after the timed one."""

    def __init__(
        self, training, device, warm: int = 0, timed: int = 0, profiled: int = 0
    ):
        self.training, self.device = training, device
        self.warm, self.timed, self.profiled = warm, timed, profiled
        self.ends, self.tokens, self.shapes = [], [], []
        self.count: Optional[FlopCount] = None
        self.real = training.update
        self.prof, self.smi, self.smi_result, self.window = None, None, None, None
        self.hook: Optional[Callable] = None  # called with the update's number

    def sync(self) -> None:
        """Wait for the GPU's queued work (nothing on a CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, run, micro):
        n = len(self.ends) + 1  # this update's number
        if self.profiled and n == self.warm + self.timed + 1:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            with native_stderr_quiet(self.device.type != "cuda"):
                self.prof.start()
        out = self.real(run, micro)  # ends in the update's one host sync
        self.ends.append(time.perf_counter())
        self.tokens.append(out[1])
        if self.count is None:  # counted after the timed window, on the meta device
            self.count = FlopCount(
                run.cfg, len(run.data.src_vocab), len(run.data.tgt_vocab)
            )
        shapes = [(tuple(b.src.shape), tuple(b.tgt.shape)) for b in micro]
        self.shapes.append((shapes, run.world))
        if self.timed and n == self.warm:
            self.smi = SmiSampler(self.device)
        if self.smi is not None and n == self.warm + self.timed:
            self.smi_result, self.smi = self.smi.close(), None
        if self.prof is not None and n == self.warm + self.timed + self.profiled:
            self.sync()
            with native_stderr_quiet(self.device.type != "cuda"):
                self.prof.stop()
            counts = window_counts(list(self.prof.events()))
            self.prof = None
            self.window = {
                "updates": self.profiled,
                "ops_per_update": counts["ops"] / self.profiled,
                "kernels_per_update": counts["kernels"] / self.profiled,
                "copies_per_update": counts["copies"] / self.profiled,
            }
            if counts["kernels"] and counts["span_us"]:
                self.window["gpu_busy"] = counts["busy_us"] / counts["span_us"]
        if self.hook:
            self.hook(n)
        return out

    def __enter__(self):
        self.training.update = self
        return self

    def __exit__(self, *exc):
        self.training.update = self.real
        if self.prof is not None:
            with native_stderr_quiet(self.device.type != "cuda"):
                self.prof.stop()
        if self.smi is not None:
            self.smi.close()

    def measured(self, peak: Optional[float]) -> dict:
        """The timed window's figures (as far as it got) and the profiled window's."""
        first = self.warm  # the timed window starts at the end of update `warm`
        last = min(len(self.ends), self.warm + self.timed)
        out: dict = {"updates": len(self.ends), "timed_updates": max(last - first, 0)}
        if last > first >= 1:
            span = self.ends[last - 1] - self.ends[first - 1]
            tokens = sum(self.tokens[first:last])
            flops = sum(
                world * sum(self.count(src, tgt) for src, tgt in shapes)
                for shapes, world in self.shapes[first:last]
            )
            out["ms_per_update"] = 1e3 * span / (last - first)
            out["target_tokens_per_s"] = tokens / span
            out["tflops_per_s"] = flops / span / 1e12
            if peak:
                out["mfu"] = out["tflops_per_s"] / peak
                out["peak_tflops"] = peak
        if self.smi_result:
            out["nvidia_smi"] = self.smi_result
        if self.window:
            out["profiled_window"] = self.window
        if self.device.type == "cuda":
            peak_bytes = torch.cuda.max_memory_allocated(self.device)
            out["peak_memory_gib"] = peak_bytes / 2**30
        return out


# ## Steps


def step(report: dict, name: str, fn, budget_s: float, needs: Callable) -> None:
    """Run one step within ``budget_s`` seconds, unless ``needs()`` names a cause to
    skip it; its result, error or cause, and its seconds go into ``report``."""
    t0 = time.perf_counter()
    print(f"[gpu-check] {name} …", flush=True)
    cause = needs()
    if cause:
        report["steps"][name] = {"ok": None, "skipped": cause}
    else:
        previous = signal.signal(signal.SIGALRM, lambda *_: _over(budget_s))
        signal.setitimer(signal.ITIMER_REAL, budget_s)
        try:
            result = fn()
            report["steps"][name] = {"ok": True, **(result or {})}
        except Exception as e:  # recorded; the other steps still run
            report["steps"][name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    report["steps"][name]["seconds"] = time.perf_counter() - t0
    report["steps"][name]["budget_s"] = budget_s
    print(f"[gpu-check] {name}: {json.dumps(report['steps'][name])[:400]}", flush=True)


def _over(budget_s: float):
    """The alarm's handler: the step in progress ran past ``budget_s``."""
    raise OverBudget(f"past its budget of {budget_s:g} s")


def parse_args(argv):
    """The command line's options (the module docstring says what each is for)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="iwslt14 files")
    parser.add_argument(
        "--synthetic", action="store_true", help="random sentences, without --data"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--wheels", type=Path, default=None, help="offline wheels")
    parser.add_argument("--smoke", action="store_true", help="tiny, on any device")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run the check: refuse without data, record the environment, then each step in
    turn; 1 if any step failed."""
    args = parse_args(argv)
    source = iwslt_folder(args.data)
    if source is None and not args.synthetic:
        where = f"in {args.data}" if args.data else "(no --data)"
        print(
            f"gpu_check: no IWSLT14 files {where}; give --data FOLDER holding "
            "iwslt14/{train-sample,valid,test}.{de,en}, or --synthetic for random "
            "sentences",
            file=sys.stderr,
        )
        return 2
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    sizes = SMOKE if smoke else FULL
    if not cuda:  # the smoke mode measures nothing; one thread stays out of the way
        torch.set_num_threads(1)
    work = args.work or args.out / ("work-smoke" if smoke else "work")
    if source is not None and (clash := emptied_folder(work, source)):
        print(
            f"gpu_check: --data {args.data} lies in {clash}, which the check empties "
            "and refills under --work; it never deletes what it reads: give a --work "
            "outside the data",
            file=sys.stderr,
        )
        return 2
    for folder, option in ((args.out, "--out"), (work, "--work")):
        if folder.exists() and not folder.is_dir():
            print(
                f"gpu_check: {option} {folder} is a file, not a folder", file=sys.stderr
            )
            return 2
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".gpu-check-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            print(
                f"gpu_check: cannot write in {option} {folder}: "
                f"{e.strerror or e}{' (' + e.filename + ')' if e.filename else ''}",
                file=sys.stderr,
            )
            return 2
    report: dict = {
        "smoke": smoke,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "data": str(source) if source else "synthetic (--synthetic)",
    }
    if args.wheels:
        missing = [n for n, v in optional_packages().items() if not v["present"]]
        report["wheels"] = install_wheels(args.wheels, missing, work / "site-packages")
    report["environment"] = env = environment(device)
    report["steps"] = {}
    card, capability = env["card"], env["capability"]
    name = ("smoke-" if smoke else "") + slug(card)[:40]
    out = args.out / f"gpu-check-{name}.json"
    write_json(out, report)
    print(
        f"[gpu-check] {card}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"capability {capability}; {'smoke mode' if smoke else 'full'}; writing {out}",
        flush=True,
    )
    peaks = next((p for k, p in PEAK_TFLOPS if cuda and k in card), {})
    absent = {n for n, v in env["optional_packages"].items() if not v["present"]}
    try:
        import machinery
        import machinery.training

        machinery.notebook()
        problem = ""
    except Exception as e:  # recorded: no step can train
        problem = f"the notebook does not import here ({type(e).__name__}: {e})"
    report["notebook"] = problem or "imports"
    tiny = TINY if smoke else {}
    log = (lambda *a, **k: None) if smoke else print
    state: dict = {}

    def base(preset: str, name: str, **over):
        """``preset``'s config for a step's run ``name`` under the work folder, with
        ``over`` (and the smoke mode's tiny sizes); its run directory emptied."""
        cfg = machinery.get_config(
            preset,
            device=device.type,
            run_dir=str(work / "runs" / name),
            data_mirror=str(work / "mirror"),
            data_dir=str(work / "data"),
            keep_checkpoints=2,
            average_last=1,  # nothing is scored here
            checkpoint_minutes=0,
            **{**tiny, **over},
        )
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        return cfg

    def standin():
        """Step 1: the IWSLT14-sized stand-in, loaded as training loads it."""
        info = build_standin(source, work / "mirror", sizes["pairs"])
        cfg = base("iwslt14-small", "data", max_valid_sentences=1000)
        t0 = time.perf_counter()
        state["iwslt"] = machinery.load_dataset(cfg, log=log)
        info["load_seconds"] = time.perf_counter() - t0
        info["train_pairs_kept"] = len(state["iwslt"].splits["train"])
        return info

    def copy_auto():
        """Step 2: the copy task under ``auto``: what it picked and measured."""
        over = dict(N=1, d_model=32, d_ff=64, h=4) if smoke else {}
        cfg = base("copy", "copy-auto", max_steps=20 if not smoke else 2, **over)
        data = machinery.make_copy_data(cfg, sizes=sizes["copy"])
        s = machinery.train(cfg, data=data, log=log, progress=False, evaluate=False)
        return {
            "precision": s["precision"],
            "attention": s["attention"],
            "auto": s["auto"],
        }

    def fp16_resume():
        """Step 3: fp16 stopped by SIGINT and resumed, against an uninterrupted run."""
        over = dict(N=1, d_model=32, d_ff=64, h=4) if smoke else {}
        stop_at, total = (2, 4) if smoke else (15, 30)
        common = dict(precision="fp16", attention="readable", P_drop=0.1, **over)
        a = base("copy", "fp16-a", max_steps=total, **common)
        b = dataclasses.replace(a, run_dir=str(work / "runs" / "fp16-b"))
        shutil.rmtree(b.run_dir, ignore_errors=True)
        data = machinery.make_copy_data(a, sizes=sizes["copy"])
        with Recorder(machinery.training, device) as rec:
            rec.hook = lambda n: n == stop_at and os.kill(os.getpid(), signal.SIGINT)
            try:
                machinery.train(a, data=data, log=log, progress=False, evaluate=False)
                interrupted = False
            except machinery.TrainingInterrupted:
                interrupted = True
        machinery.train(a, data=data, log=log, progress=False, evaluate=False)
        machinery.train(b, data=data, log=log, progress=False, evaluate=False)
        sa = machinery.load_checkpoint(machinery.checkpoint_paths(Path(a.run_dir))[-1])
        sb = machinery.load_checkpoint(machinery.checkpoint_paths(Path(b.run_dir))[-1])
        diff = max(
            float((sa["model"][k].float() - sb["model"][k].float()).abs().max())
            for k in sa["model"]
        )
        return {
            "interrupted_at": stop_at if interrupted else None,
            "steps": [sa["step"], sb["step"]],
            "weights_equal": diff == 0.0,
            "max_weight_difference": diff,
            "scaler_equal": sa["scaler"] == sb["scaler"],
            "scaler_scale": sa["scaler"].get("scale"),
        }

    def iwslt(precision: str, compiled: bool = False):
        """Step 4 (or 6, ``compiled``): ``iwslt14-small`` in ``precision``, measured."""

        def run():
            """Train, record, and return the measurements."""
            if precision == "bf16" and cuda and tuple(capability) < (8, 0):
                return {"skipped": f"capability {capability}: no native bf16"}
            name = f"iwslt-{precision}" + ("-compile" if compiled else "")
            warm, timed, profiled = sizes["warm"], sizes["timed"], sizes["profiled"]
            if compiled:
                timed, profiled = sizes["compile_updates"], 0
            cfg = base(
                "iwslt14-small",
                name,
                precision=precision,
                max_steps=warm + timed + profiled,
                max_valid_sentences=1000,
                compile=compiled,
            )
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            from torch._dynamo.utils import counters

            counters.clear()
            t0 = time.perf_counter()
            out: dict = {}
            rec = Recorder(machinery.training, device, warm, timed, profiled)
            try:
                with rec:
                    s = machinery.train(
                        cfg,
                        data=state["iwslt"],
                        log=log,
                        progress=False,
                        evaluate=False,
                    )
                out.update(precision=s["precision"], attention=s["attention"])
                out.update(auto=s["auto"])
            except OverBudget as e:  # what finished is still measured
                out["stopped"] = str(e)
            out.update(rec.measured(peaks.get(precision)))
            out["seconds_in_train"] = time.perf_counter() - t0
            if compiled:
                out["compilations"] = counters["stats"]["unique_graphs"]
                problem = machinery.devices.compile_problem(device)
                out["compile_problem"] = problem or None  # then it trained eagerly
                out["first_update_s"] = rec.ends[0] - t0 if rec.ends else None
                torch._dynamo.reset()
            elif machinery.checkpoint_paths(Path(cfg.run_dir)):  # decoding needs one
                state.setdefault("runs", {})[precision] = cfg.run_dir
            return out

        return run

    def decode():
        """Step 5: batched beam search with an IWSLT run's model."""
        runs = state["runs"]
        run_dir = runs.get("bf16") or next(iter(runs.values()))
        model, cfg, _, tgt_vocab, _ = machinery.load_for_inference(
            run_dir=Path(run_dir), device=device
        )
        test = state["iwslt"].splits["test"][: sizes["decode_sentences"]]
        sources = [s for s, _ in test]
        # an undertrained model says little worth waiting for
        extra = 5 if smoke else 50
        cfg = dataclasses.replace(
            cfg, max_decode_extra=min(cfg.max_decode_extra, extra)
        )
        # the run's precision (on a GPU) and attention kernels, as its updates had
        computing = machinery.devices.computing(
            device, cfg.precision if cuda else "fp32"
        )
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with computing():
            out = machinery.translate(
                model,
                sources,
                tgt_vocab,
                cfg,
                device,
                beam_size=cfg.beam_size,
                alpha=cfg.length_penalty_alpha,
            )
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, out))
        return {
            "sentences": len(sources),
            "beam_size": cfg.beam_size,
            "decode_seconds": seconds,
            "sentences_per_s": len(sources) / seconds,
            "output_tokens_per_s": tokens / seconds,
            "precision": cfg.precision,
        }

    def needs(*packages: str, after: str = "") -> Callable:
        """A step's precondition: the notebook imports, ``packages`` are present, and
        the step ``after`` finished."""

        def cause() -> str:
            """The first unmet precondition, in words; "" when all are met."""
            if problem:
                return problem
            lacking = [p for p in packages if p in absent]
            if lacking:
                return f"needs {', '.join(lacking)}, which this Python lacks"
            if after and not report["steps"].get(after, {}).get("ok"):
                return f"needs the step {after}, which did not finish"
            return ""

        return cause

    def run_step(name: str, fn, need: Callable) -> None:
        """One step within its budget, then the JSON rewritten."""
        budget = SMOKE_BUDGET_S if smoke else BUDGET_S[name]
        step(report, name, fn, budget, need)
        write_json(out, report)

    bpe = needs("sentencepiece", after="stand_in")
    run_step("stand_in", standin, needs("sentencepiece"))
    run_step("copy_auto", copy_auto, needs())
    run_step("fp16_interrupted_and_resumed", fp16_resume, needs())
    for precision in ("bf16", "fp16", "fp32"):
        run_step(f"iwslt14_small_{precision}", iwslt(precision), bpe)

    def trained() -> str:
        """Why decoding cannot run (no IWSLT run left a checkpoint), or ""."""
        ran = [p for p in ("bf16", "fp16", "fp32") if p in state.get("runs", {})]
        none = "needs an IWSLT run's checkpoint, and no run left one"
        return bpe() or ("" if ran else none)

    run_step("beam_decoding", decode, trained)
    compiled = "bf16" if not cuda or tuple(capability) >= (8, 0) else "fp16"
    if smoke and not cuda:  # inductor's C++ build takes minutes on a CPU: dynamo + AOT
        real = torch.compile
        torch.compile = lambda m, **kw: real(m, **{**kw, "backend": "aot_eager"})
    run_step("iwslt14_small_compile", iwslt(compiled, compiled=True), bpe)

    steps = report["steps"]
    ratios = {}
    for p in ("fp16", "fp32"):
        a, b = steps.get("iwslt14_small_bf16", {}), steps.get(f"iwslt14_small_{p}", {})
        if a.get("ms_per_update") and b.get("ms_per_update"):
            ratios[f"{p}_ms_over_bf16"] = b["ms_per_update"] / a["ms_per_update"]
    report["ratios"] = ratios
    report["failed"] = [k for k, v in steps.items() if v.get("ok") is False]
    report["skipped"] = {k: v["skipped"] for k, v in steps.items() if "skipped" in v}
    write_json(out, report)
    print(f"[gpu-check] wrote {out}; failed steps: {report['failed'] or 'none'}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

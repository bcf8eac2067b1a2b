"""The ten-minute GPU check (`make gpu-check`): does the GPU path work, and is the GPU
kept busy?

Run from the repository root on a machine with one CUDA GPU::

    python benchmarks/gpu_check.py [--mirror DIR] [--out results/gpu-check-<card>.json]

It uses the machine's own torch, and needs the data mirror's ``iwslt14/`` files
(``$DATA_MIRROR``, ``--mirror``, or ``../shared/data`` beside the repository; without
them a synthetic stand-in is used and the JSON says so). In order, each step recorded
in one JSON file under ``results/`` that names the card:

1. torch, CUDA and the card's compute capability;
2. an IWSLT14-sized stand-in: the mirror's training sample repeated to ~160,000 pairs
   (plus its valid and test splits), so that an update costs what the real recipe's
   does;
3. the copy task with ``auto`` precision and attention (expected on capability ≥ 8.0:
   bf16 and the fast path);
4. fp16 with its gradient scaler, stopped by SIGINT and resumed, against the same run
   uninterrupted (weights and scaler state equal);
5. ``iwslt14-small`` for ~400 updates in bf16: tokens/s, ms per update, GPU busy %
   (``torch.profiler``: kernel time over wall time), peak memory, MFU against the
   card's dense bf16 peak; the same in fp16 and in float32 (TF32), for the ratios;
6. ``--compile`` for ~150 updates: compilations and the time they took;
7. batched beam-search decoding: sentences and tokens per second.

Without CUDA (or with ``--smoke``) the same steps run tiny, in seconds, on the CPU:
``tests/test_gpu_check.py`` runs that. A step that fails is recorded with its error and
the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import machinery  # noqa: E402
import machinery.training  # noqa: E402
from batch_cost import cpu_name  # noqa: E402

# Dense bf16 (fp16 where the card has no bf16) tensor-core peaks, TFLOP/s, from the
# vendors' datasheets; the first name found in the card's name counts.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("T4", 65.0),
    ("V100", 125.0),
)

FULL = dict(
    pairs=160_000,
    updates=400,
    compile_updates=150,
    decode_sentences=1000,
    copy=(1600, 160, 100),
)
SMOKE = dict(
    pairs=600, updates=3, compile_updates=1, decode_sentences=4, copy=(200, 40, 20)
)
TINY = dict(N=1, d_model=32, d_ff=64, h=4, bpe_size=300, batch_tokens=256, warmup=10)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_mirror() -> Path:
    return Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")


def build_standin(mirror: Path, folder: Path, pairs: int) -> dict:
    """An ``iwslt14/`` folder under ``folder``: the mirror's training sample repeated to
    ``pairs`` pairs, its valid and test splits (shortened in the smoke mode); synthetic
    sentences where the mirror has no iwslt14."""
    src = mirror / "iwslt14"
    out = folder / "iwslt14"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    keep = None if pairs >= 10_000 else max(pairs // 4, 8)
    if (src / "train-sample.de").is_file():
        origin = f"{src}: train-sample repeated"
        for side in ("de", "en"):
            sample = (src / f"train-sample.{side}").read_text(encoding="utf-8")
            lines = sample.splitlines()
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
        import random

        origin = "synthetic (no iwslt14 in the mirror)"
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


def train_flops(cfg, vocab: int, src: tuple, tgt: tuple) -> float:
    """FLOPs of one forward and backward pass (3× the forward's) on padded batches of
    shapes ``src`` and ``tgt`` (sentences, length)."""
    d, ff = cfg.d_model, cfg.d_ff
    (b, ls), (_, lt) = src, tgt
    enc = cfg.N * (b * ls * (4 * d * d + 2 * d * ff) + b * 2 * ls * ls * d)
    dec = cfg.decoder_layers * (
        b * lt * (4 * d * d + 2 * d * d + 2 * d * ff)  # self q,k,v,o; cross q,o; FFN
        + b * ls * 2 * d * d  # cross-attention keys and values
        + b * 2 * (lt * lt + lt * ls) * d
    )
    return 3 * 2 * (enc + dec + b * lt * d * vocab)


class Recorder:
    """Wraps ``machinery.training.update``: times every update and, once, profiles a
    window of updates on CUDA."""

    def __init__(self, device, profile_from: int = 0, profile_count: int = 20):
        self.device, self.times, self.tokens, self.flops = device, [], [], []
        self.profile_from, self.profile_count = profile_from, profile_count
        self.kernel_us, self.profiled_s, self.prof, self.t_prof = None, None, None, 0.0
        self.real = machinery.training.update
        self.hook = None  # called with the update's number after it

    def __call__(self, run, micro):
        n = len(self.times) + 1
        if self.device.type == "cuda" and self.profile_from and n == self.profile_from:
            acts = [torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
            self.t_prof = time.perf_counter()
        out = self.real(run, micro)  # ends in the update's one host sync
        self.times.append(time.perf_counter())
        self.tokens.append(out[1])
        vocab = len(run.data.tgt_vocab)
        self.flops.append(
            sum(
                train_flops(run.cfg, vocab, tuple(b.src.shape), tuple(b.tgt.shape))
                for b in micro
            )
            * run.world
        )
        if self.prof is not None and n == self.profile_from + self.profile_count - 1:
            self.profiled_s = time.perf_counter() - self.t_prof
            self.prof.stop()
            self.kernel_us = sum(
                e.self_device_time_total for e in self.prof.key_averages()
            )
            self.prof = None
        if self.hook:
            self.hook(n)
        return out

    def __enter__(self):
        machinery.training.update = self
        return self

    def __exit__(self, *exc):
        machinery.training.update = self.real
        if self.prof is not None:
            self.prof.stop()


def measured(rec: Recorder, skip: int, peak_tflops) -> dict:
    """Steady-state figures of a recorded run: updates after the first ``skip``."""
    n = len(rec.times)
    skip = min(skip, max(n - 2, 0))
    span = rec.times[-1] - rec.times[skip] if n > skip + 1 else float("nan")
    updates = n - skip - 1
    tokens = sum(rec.tokens[skip + 1 :])
    flops = sum(rec.flops[skip + 1 :])
    out = {
        "updates": n,
        "timed_updates": updates,
        "ms_per_update": 1e3 * span / max(updates, 1),
        "target_tokens_per_s": tokens / span if span > 0 else None,
        "tflops_per_s": flops / span / 1e12 if span > 0 else None,
    }
    if peak_tflops and out["tflops_per_s"]:
        out["mfu"] = out["tflops_per_s"] / peak_tflops
    if rec.kernel_us is not None and rec.profiled_s:
        out["gpu_busy"] = rec.kernel_us / 1e6 / rec.profiled_s
    if rec.device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(rec.device) / 2**30
    return out


def step(report: dict, name: str, fn) -> None:
    """Run one step; its result (or error) and seconds go into ``report``."""
    t0 = time.perf_counter()
    print(f"[gpu-check] {name} …", flush=True)
    try:
        result = fn()
        report["steps"][name] = {"ok": True, **(result or {})}
    except Exception as e:  # recorded; the other steps still run
        report["steps"][name] = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    report["steps"][name]["seconds"] = time.perf_counter() - t0
    print(f"[gpu-check] {name}: {json.dumps(report['steps'][name])[:400]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny, on any device")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    sizes = SMOKE if smoke else FULL
    if not cuda:
        torch.set_num_threads(
            1
        )  # the smoke mode measures nothing; one thread stays out of the way
    tiny = TINY if smoke else {}
    log = (lambda *a, **k: None) if smoke else print
    card = torch.cuda.get_device_name(device) if cuda else f"CPU: {cpu_name()}"
    capability = torch.cuda.get_device_capability(device) if cuda else None
    peak = next((p for k, p in PEAK_TFLOPS if cuda and k in card), None)
    report = {
        "card": card,
        "smoke": smoke,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capability": list(capability) if capability else None,
        "peak_tflops_bf16_dense": peak,
        "host": {"cpu": cpu_name(), "python": platform.python_version()},
        "steps": {},
    }
    print(
        f"[gpu-check] {card}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"capability {capability}; {'smoke mode' if smoke else 'full'}",
        flush=True,
    )
    work = args.work / ("smoke" if smoke else "full")
    work.mkdir(parents=True, exist_ok=True)
    mirror = args.mirror or default_mirror()
    state: dict = {}

    def base(preset: str, name: str, **over):
        cfg = machinery.get_config(
            preset,
            device=device.type,
            run_dir=str(work / "runs" / name),
            data_mirror=str(work / "mirror"),
            data_dir=str(work / "data"),
            keep_checkpoints=2,
            checkpoint_minutes=0,
            **{**tiny, **over},
        )
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        return cfg

    def standin():
        info = build_standin(mirror, work / "mirror", sizes["pairs"])
        cfg = base("iwslt14-small", "data", max_valid_sentences=1000)
        t0 = time.perf_counter()
        state["iwslt"] = machinery.load_dataset(cfg, log=log)
        info["load_seconds"] = time.perf_counter() - t0
        info["train_pairs_kept"] = len(state["iwslt"].splits["train"])
        return info

    def copy_auto():
        over = dict(N=1, d_model=32, d_ff=64, h=4) if smoke else {}
        cfg = base("copy", "copy-auto", max_steps=20 if not smoke else 2, **over)
        data = machinery.make_copy_data(cfg, sizes=sizes["copy"])
        s = machinery.train(cfg, data=data, log=log, progress=False, evaluate=False)
        out = {
            "precision": s["precision"],
            "attention": s["attention"],
            "auto": s["auto"],
        }
        if capability and capability >= (8, 0):
            out["expected"] = "bf16 + fast"
            out["as_expected"] = (s["precision"], s["attention"]) == ("bf16", "fast")
        return out

    def fp16_resume():
        over = dict(N=1, d_model=32, d_ff=64, h=4) if smoke else {}
        stop_at, total = (2, 4) if smoke else (15, 30)
        common = dict(precision="fp16", attention="readable", P_drop=0.1, **over)
        a = base("copy", "fp16-a", max_steps=total, **common)
        b = dataclasses.replace(a, run_dir=str(work / "runs" / "fp16-b"))
        shutil.rmtree(b.run_dir, ignore_errors=True)
        data = machinery.make_copy_data(a, sizes=sizes["copy"])
        with Recorder(device) as rec:
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

    def iwslt(precision: str, updates: int, **over):
        def run():
            if precision == "bf16" and cuda and capability < (8, 0):
                return {"skipped": f"capability {capability}: no native bf16"}
            name = f"iwslt-{precision}" + ("-compile" if over.get("compile") else "")
            cfg = base(
                "iwslt14-small",
                name,
                precision=precision,
                max_steps=updates,
                max_valid_sentences=1000,
                **over,
            )
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            from torch._dynamo.utils import counters

            counters.clear()
            t0 = time.perf_counter()
            with Recorder(device, profile_from=0 if smoke else 100) as rec:
                s = machinery.train(
                    cfg, data=state["iwslt"], log=log, progress=False, evaluate=False
                )
            out = measured(rec, skip=min(20, updates // 4), peak_tflops=peak)
            out.update(
                precision=s["precision"],
                attention=s["attention"],
                auto=s["auto"],
                seconds_in_train=time.perf_counter() - t0,
            )
            if over.get("compile"):
                out["compilations"] = counters["stats"]["unique_graphs"]
                out["first_update_s"] = rec.times[0] - t0 if rec.times else None
                torch._dynamo.reset()
            state.setdefault("runs", {})[precision] = cfg.run_dir
            return out

        return run

    def decode():
        run_dir = state.get("runs", {}).get("bf16") or next(
            iter(state["runs"].values())
        )
        model, cfg, _, tgt_vocab, _ = machinery.load_for_inference(
            run_dir=Path(run_dir), device=device
        )
        sources = [
            s for s, _ in state["iwslt"].splits["test"][: sizes["decode_sentences"]]
        ]
        extra = (
            5 if smoke else 50
        )  # an undertrained model says little worth waiting for
        cfg = dataclasses.replace(
            cfg, max_decode_extra=min(cfg.max_decode_extra, extra)
        )
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        cast = torch.autocast(device.type, dtype=dtype) if dtype and cuda else None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with cast or torch.autocast(device.type, enabled=False):
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
            "seconds": seconds,
            "sentences_per_s": len(sources) / seconds,
            "output_tokens_per_s": tokens / seconds,
            "precision": cfg.precision,
        }

    step(report, "stand_in", standin)
    step(report, "copy_auto", copy_auto)
    step(report, "fp16_interrupted_and_resumed", fp16_resume)
    for precision in ("bf16", "fp16", "fp32"):
        step(report, f"iwslt14_small_{precision}", iwslt(precision, sizes["updates"]))
    compiled = "bf16" if not cuda or capability >= (8, 0) else "fp16"
    if smoke and not cuda:  # inductor's C++ build takes minutes on a CPU: dynamo + AOT
        real = torch.compile
        torch.compile = lambda m, **kw: real(m, backend="aot_eager", **kw)
    step(
        report,
        "iwslt14_small_compile",
        iwslt(compiled, sizes["compile_updates"], compile=True),
    )
    step(report, "beam_decoding", decode)

    steps = report["steps"]
    ratios = {}
    for p in ("fp16", "fp32"):
        a, b = steps.get("iwslt14_small_bf16", {}), steps.get(f"iwslt14_small_{p}", {})
        if a.get("ms_per_update") and b.get("ms_per_update"):
            ratios[f"{p}_ms_over_bf16"] = b["ms_per_update"] / a["ms_per_update"]
    report["ratios"] = ratios
    report["failed"] = [k for k, v in steps.items() if not v.get("ok")]
    name = "smoke-" + slug(card)[:40] if smoke else slug(card)
    out = args.out or (ROOT / "results" / f"gpu-check-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"[gpu-check] wrote {out}; failed steps: {report['failed'] or 'none'}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

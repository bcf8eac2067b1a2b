"""Which fused attention kernel a GPU's half-precision training gets, and what each
costs when every batch has its own shape.

Run: ``python3 benchmarks/sdpa_backends.py --data DIR [--out DIR]``.

On a GPU, PyTorch's ``scaled_dot_product_attention`` chooses among several kernels
(cuDNN's, FlashAttention, memory-efficient, the plain "math" one). cuDNN's builds a
plan for every new shape of its inputs; length-batched training gives almost every
batch a new shape. This measures, in bf16:

1. ``scaled_dot_product_attention`` forward and backward alone, with the padding
   masks and sizes of ``iwslt14-small`` (h=4, d_k=128), over batches of new shapes and
   then the same shapes again: with PyTorch's own choice of kernel, and with cuDNN's
   left out;
2. ``iwslt14-small``'s production training (the data's training sample repeated to an
   IWSLT14-sized set, as ``gpu_check.py`` builds it): ms per update in float32, in
   bf16 with cuDNN's kernel left out (what a run does), in bf16 with the readable
   attention (no fused kernel at all), and in bf16 with PyTorch's own choice;
3. beam-search decoding in bf16 with and without cuDNN's kernel.

Each part has a time budget and writes what it finished into the JSON (``--out``). On
a CPU (or with ``--smoke``) everything runs tiny, to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_check  # noqa: E402


@contextmanager
def cudnn_sdp(enabled: bool):
    """cuDNN's attention kernel allowed (PyTorch's default) or left out, restored
    after. Allowed, a run's own leaving out (``machinery.devices.attention_kernels``)
    is suspended too, so that PyTorch chooses as it would by itself."""
    import machinery.devices

    before = torch.backends.cuda.cudnn_sdp_enabled()
    ours = machinery.devices.attention_kernels
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    if enabled:
        machinery.devices.attention_kernels = lambda device: nullcontext()
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        machinery.devices.attention_kernels = ours


def kernel_names(fn) -> list:
    """The attention ops and kernels one call of ``fn`` ran (from the profiler)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    keys = ("attention", "cudnn", "fmha", "flash", "sdpa")
    return sorted(n for n in names if any(k in n.lower() for k in keys))[:20]


def sdpa_alone(device, shapes: list, h: int, d_k: int) -> dict:
    """Part 1: forward and backward of SDPA in bf16 over ``shapes`` (batch, length),
    each new, then all again; seconds for each pass, both kernel choices."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def one(b: int, n: int):
        """One forward and backward pass on a new (batch, length)."""
        q, k, v = (
            torch.randn(b, h, n, d_k, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )  # (batch, h, len, d_k)
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
        mask[: b // 2, ..., n // 2 :] = False  # (batch, 1, 1, len): half padded
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)
        out.sum().backward()

    def sync():
        """Wait for the GPU's queued work (nothing on a CPU)."""
        if device.type == "cuda":
            torch.cuda.synchronize()

    result = {}
    for name, allowed in (("default", True), ("without_cudnn", False)):
        with cudnn_sdp(allowed):
            passes = []
            for _ in range(2):  # new shapes, then the same shapes again
                sync()
                t0 = time.perf_counter()
                for b, n in shapes:
                    one(b, n)
                sync()
                passes.append(time.perf_counter() - t0)
            b, n = shapes[0]
            result[name] = {
                "first_pass_s": passes[0],
                "second_pass_s": passes[1],
                "kernels": kernel_names(lambda: one(b, n + 1)),
            }
    result["shapes"] = len(shapes)
    return result


def main(argv=None) -> int:
    """Run the three parts, each within its budget; the JSON after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="iwslt14 files")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "sdpa-backends")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny, on any device")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "sdpa-backends.json"
    card = torch.cuda.get_device_name() if cuda else gpu_check.cpu_name()
    report: dict = {
        "smoke": smoke,
        "card": card,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "steps": {},
    }
    print(f"[sdpa] {card}; torch {torch.__version__}", flush=True)

    def run_step(name, fn, budget):
        """One part within its budget (gpu_check's), then the JSON rewritten."""
        gpu_check.step(report, name, fn, 60 if smoke else budget, lambda: "")
        gpu_check.write_json(out, report)

    rng = random.Random(0)
    count = 4 if smoke else 20
    shapes = [(rng.randint(20, 120), rng.randint(8, 60)) for _ in range(count)]
    if smoke:
        shapes = [(2, n) for _, n in shapes]
    h, d_k = (2, 8) if smoke else (4, 128)
    run_step("sdpa_alone", lambda: sdpa_alone(device, shapes, h, d_k), 60)

    import machinery
    import machinery.training

    machinery.notebook()
    state: dict = {}

    def standin():
        """The IWSLT14-sized stand-in, loaded as training loads it."""
        pairs = 600 if smoke else 160_000
        source = gpu_check.iwslt_folder(args.data)
        info = gpu_check.build_standin(source, work / "mirror", pairs)
        state["data"] = machinery.load_dataset(config("data", "fp32"), log=print)
        return info

    def config(name, precision, **over):
        """``iwslt14-small``'s config for the run ``name`` under the work folder."""
        tiny = gpu_check.TINY if smoke else {}
        return machinery.get_config(
            "iwslt14-small",
            device=device.type,
            run_dir=str(work / "runs" / name),
            data_mirror=str(work / "mirror"),
            data_dir=str(work / "data"),
            keep_checkpoints=1,
            average_last=1,
            checkpoint_minutes=0,
            max_valid_sentences=200,
            precision=precision,
            **{**tiny, **over},
        )

    run_step("stand_in", standin, 60)
    warm, timed = (1, 2) if smoke else (10, 30)

    def train(name, precision, attention, cudnn):
        """Part 2's run ``name``: a few updates, the last ones timed."""

        def run():
            """Train and return the measurements."""
            cfg = config(name, precision, attention=attention, max_steps=warm + timed)
            shutil.rmtree(cfg.run_dir, ignore_errors=True)
            rec = gpu_check.Recorder(machinery.training, device, warm, timed, 0)
            result: dict = {"attention": attention, "cudnn_sdp": cudnn}
            try:
                with cudnn_sdp(cudnn), rec:
                    machinery.train(
                        cfg,
                        data=state["data"],
                        log=print,
                        progress=False,
                        evaluate=False,
                    )
            except gpu_check.OverBudget as e:
                result["stopped"] = str(e)
            result.update(rec.measured(None))
            state.setdefault("dirs", {})[name] = cfg.run_dir
            return result

        return run

    runs = (
        ("fp32", "fp32", "fast", True),
        ("bf16_without_cudnn", "bf16", "fast", False),
        ("bf16_readable", "bf16", "readable", True),
        ("bf16_default", "bf16", "fast", True),
    )
    for name, precision, attention, cudnn in runs:
        run_step(f"train_{name}", train(name, precision, attention, cudnn), 45)

    def decode(cudnn):
        """Part 3: beam search in bf16, cuDNN's kernel allowed or not."""

        def run():
            """Decode and return the time."""
            run_dir = Path(state["dirs"]["bf16_without_cudnn"])
            model, cfg, _, tgt_vocab, _ = machinery.load_for_inference(
                run_dir=run_dir, device=device
            )
            test = state["data"].splits["test"][: 8 if smoke else 300]
            cfg = dataclasses.replace(cfg, max_decode_extra=20)
            with (
                cudnn_sdp(cudnn),
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda),
            ):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = machinery.translate(
                    model,
                    [s for s, _ in test],
                    tgt_vocab,
                    cfg,
                    device,
                    beam_size=4,
                    alpha=0.6,
                )
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            return {
                "cudnn_sdp": cudnn,
                "sentences": len(outs),
                "seconds": seconds,
                "sentences_per_s": len(outs) / seconds,
            }

        return run

    run_step("beam_without_cudnn", decode(False), 40)
    run_step("beam_default", decode(True), 40)
    print(json.dumps(report, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one training update dispatches: ops per update and host ms per update at
``iwslt14-small``'s shapes and a tiny width, where the arithmetic is negligible and
what is left is the host's cost of issuing the work (our addition).

Run from the repository root::

    python benchmarks/dispatch.py                 # eager: fp32 and bf16, fast path
    python benchmarks/dispatch.py --compile       # and the compiled step (minutes)

The model has ``iwslt14-small``'s structure (N = 6 encoder and 6 decoder layers, h = 4,
AdamW with weight decay, no clipping) at d_model = 16, d_ff = 32 and a 64-token
vocabulary; the batches are length-bucketed to 4,096 tokens from the IWSLT14 sample's
sentence lengths (``$DATA_MIRROR``; random lengths without it). Each row takes a few
updates to warm up, times ``--updates`` of them (host ms per update: on a CPU the whole
update), then profiles ``--profiled`` more: ATen ops dispatched per update (the
load-independent figure), and on CUDA kernels per update. The compiled row also counts
its compilations. Timings depend on the machine's load; the CPU is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import machinery  # noqa: E402
import machinery.training  # noqa: E402
from machinery.devices import cpu_name  # noqa: E402
from machinery.runfiles import write_atomic  # noqa: E402
from profiling import window_counts  # noqa: E402

WIDTH = dict(d_model=16, d_ff=32, h=4)
VOCAB = 64


def sentence_lengths(count: int, seed: int = 0) -> list:
    """(source, target) lengths in words of the IWSLT14 sample's pairs, each + 2 for
    BOS and EOS; random ones in the same range where the data is absent."""
    mirror = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
    folder = mirror / "iwslt14"
    rng = random.Random(seed)
    if (folder / "train-sample.de").is_file():
        sides = [
            (folder / f"train-sample.{s}").read_text(encoding="utf-8").splitlines()
            for s in ("de", "en")
        ]
        pairs = [(len(a.split()), len(b.split())) for a, b in zip(*sides)]
        pairs = [(a, b) for a, b in pairs if 0 < a <= 100 and 0 < b <= 100]
        return [(a + 2, b + 2) for a, b in rng.sample(pairs, min(count, len(pairs)))]
    return [(rng.randint(3, 60), rng.randint(3, 60)) for _ in range(count)]


def dataset(cfg, lengths: list) -> machinery.Dataset:
    """A data set of random ids with ``lengths`` and a ``VOCAB``-token vocabulary."""
    nb = machinery.notebook()
    base = machinery.make_copy_data(cfg, vocab_size=VOCAB - 3, sizes=(8, 8, 8))
    rng = random.Random(cfg.seed)
    n = len(base.src_vocab)

    def sentence(k: int) -> list:
        """Random ids of length ``k`` between BOS and EOS."""
        return [nb.BOS] + [rng.randrange(4, n) for _ in range(k - 2)] + [nb.EOS]

    train = [(sentence(a), sentence(b)) for a, b in lengths]
    return dataclasses.replace(base, splits={**base.splits, "train": train})


def measure(precision: str, compiled: bool, args, lengths: list) -> dict:
    """One row: warm-up, timed and profiled updates of one configuration."""
    nb = machinery.notebook()
    cfg = machinery.get_config(
        "iwslt14-small",
        **WIDTH,
        device="cpu",
        precision=precision,
        attention=args.attention,
        compile=compiled,
        run_dir=str(Path(args.work) / f"{precision}-{compiled}"),
        keep_checkpoints=5,
        warmup=100,
    )
    data = dataset(cfg, lengths)
    pairs = data.splits["train"]
    device = torch.device("cpu")
    from torch._dynamo.utils import counters

    counters.clear()
    run = machinery.training.setup(cfg, data, device, 0, 1, lambda *a, **k: None)
    batches = nb.length_batches(
        [(len(s), len(t)) for s, t in pairs], cfg.batch_tokens, cfg.seed, 0
    )
    # what train_epoch does to make an update's batches, where this version has it
    make = getattr(machinery.training, "update_batches", None)
    total = args.warm + args.updates + args.profiled
    if make:
        updates = [make(run, pairs, [idx]) for idx in batches[:total]]
    else:
        updates = [[nb.make_batch(pairs, idx).to(device)] for idx in batches[:total]]
    update = machinery.training.update
    run.train_model.train()
    for micro in updates[: args.warm]:
        update(run, micro)
    t0 = time.perf_counter()
    for micro in updates[args.warm : args.warm + args.updates]:
        update(run, micro)
    host_ms = 1e3 * (time.perf_counter() - t0) / args.updates
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for micro in updates[args.warm + args.updates :]:
            update(run, micro)
    counts = window_counts(list(p.events()))
    row = {
        "precision": precision,
        "attention": run.cfg.attention,
        "compiled": compiled,
        "ops_per_update": counts["ops"] / args.profiled,
        "host_ms_per_update": host_ms,
        "shapes": len(
            {tuple(b.src.shape) + tuple(b.tgt.shape) for u in updates for b in u}
        ),
    }
    if compiled:
        row["compilations"] = counters["stats"]["unique_graphs"]
    return row


def main(argv=None) -> int:
    """Measure each configuration asked for and print one JSON line per row."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--attention", default="fast")
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also the compiled step")
    parser.add_argument("--work", default=str(ROOT / "build" / "dispatch"))
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lengths = sentence_lengths(4000)
    print(
        f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; iwslt14-small's structure at {WIDTH}, vocabulary {VOCAB}",
        flush=True,
    )
    configurations = [(p, False) for p in args.precisions.split(",")]
    if args.compile:
        configurations.append((args.precisions.split(",")[0], True))
    rows = []
    for precision, compiled in configurations:
        rows.append(measure(precision, compiled, args, lengths))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_atomic(Path(args.json), (json.dumps(rows, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a trained model read its source? Validation loss with each sentence's own
source, and with another sentence's.

Run from the repository root::

    python benchmarks/source_use.py runs/table3/base runs/table3/D-drop0.2
    python benchmarks/source_use.py --every runs/table3/D-ls0.2   # every checkpoint

A translation model's loss on a target sentence should rise sharply when it is given
the wrong source: the base of Table 3 (§6.2) goes from a validation loss of about 1.7
nats per token to about 6. A model whose decoder has become a language model of the
target side, one that barely attends to the encoder, loses little: its "gap" is small.
For each checkpoint (the newest of each run directory, or every kept one with
``--every``) this computes the validation split's mean cross-entropy per target token
(no label smoothing, as the training log's ``valid_loss``) twice: with the true
sources, and with each source replaced by the source of the pair half the split away
(a real sentence of the same corpus, never its own). Where the run logged a validation
loss at that step (every epoch's end), the first number must equal it, which checks
that the data and vocabulary are the ones the run used; a checkpoint written between
two epochs is not checked, and its record says so (``logged_valid_loss`` null). Each
result is merged into ``--out`` (default ``results/table3-source.json``), keyed by run
and step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from machinery.data import load_dataset  # noqa: E402
from machinery.evaluation import evaluate_loss  # noqa: E402
from machinery.inference import load_for_inference  # noqa: E402
from machinery.runfiles import checkpoint_paths, write_atomic  # noqa: E402
from machinery.runs import machine_name  # noqa: E402

WHAT = (
    "validation loss (mean cross-entropy per target token, no label smoothing) of a "
    "checkpoint with each pair's own source and with the source of the pair half the "
    "split away; gap = the second minus the first, in nats"
)
# how far the logged validation loss may lie from ours (both float32 sums, same order)
AGREE = 1e-4


def other_sources(pairs: list) -> list:
    """Each (source, target) pair with the source of the pair half the split away: a
    real sentence of the same split, never the pair's own (for two or more pairs)."""
    n = len(pairs)
    shift = max(n // 2, 1)
    return [(pairs[(i + shift) % n][0], tgt) for i, (_, tgt) in enumerate(pairs)]


def logged_valid_loss(run_dir: Path, step: int):
    """The validation loss the run logged at ``step`` (metrics.jsonl), or None."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") == step and "valid_loss" in rec:
            return rec["valid_loss"]
    return None


def measure(checkpoint: Path, data_mirror: str, datasets: dict) -> dict:
    """Validation loss of one checkpoint with its own sources and with others'."""
    model, cfg, *_ = load_for_inference(checkpoint=checkpoint)
    cfg = dataclasses.replace(cfg, data_mirror=data_mirror or cfg.data_mirror)
    key = (cfg.dataset, cfg.vocab, cfg.bpe_size, cfg.min_freq, cfg.max_tokens)
    if key not in datasets:  # one corpus and vocabulary for every row of a table
        datasets[key] = load_dataset(cfg, log=lambda *a, **k: None)
    pairs = list(datasets[key].splits["valid"])
    step = int(checkpoint.stem.split("-")[1])
    own = evaluate_loss(model, pairs, cfg, "cpu")
    other = evaluate_loss(model, other_sources(pairs), cfg, "cpu")
    logged = logged_valid_loss(checkpoint.parent, step)
    if logged is not None and abs(logged - own) > AGREE:
        raise SystemExit(
            f"error: {checkpoint}: validation loss {own:.5f} here, {logged:.5f} in the "
            "run's log: not the data or vocabulary it trained on"
        )
    return {
        "run": checkpoint.parent.name,
        "step": step,
        "checkpoint": str(checkpoint),
        "valid_loss": own,
        "valid_ppl": math.exp(own),
        "valid_loss_other_source": other,
        "gap": other - own,
        "logged_valid_loss": logged,
        "valid_pairs": len(pairs),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, help="training run directories")
    p.add_argument("--every", action="store_true", help="every kept checkpoint")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "table3-source.json")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--data_mirror", default=os.environ.get("DATA_MIRROR", ""))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data["what"] = WHAT
    records = {(r["run"], r["step"]): r for r in data.get("records", [])}
    datasets: dict = {}
    for run_dir in args.run_dirs:
        paths = checkpoint_paths(run_dir)
        if not paths:
            print(f"error: no checkpoint in {run_dir}", file=sys.stderr)
            return 2
        for checkpoint in paths if args.every else paths[-1:]:
            t0 = time.time()
            rec = measure(checkpoint, args.data_mirror, datasets)
            rec |= {
                "machine": machine_name("cpu"),
                "threads": args.threads,
                "seconds": round(time.time() - t0, 1),
            }
            records[(rec["run"], rec["step"])] = rec
            print(
                f"{rec['run']} step {rec['step']:,}: valid loss {rec['valid_loss']:.3f}"
                f" with its sources, {rec['valid_loss_other_source']:.3f} with others'"
                f" (gap {rec['gap']:.2f} nats)"
                + (
                    ""
                    if rec["logged_valid_loss"] is not None
                    else "; no logged loss at this step to check it against"
                ),
                flush=True,
            )
    data["records"] = sorted(records.values(), key=lambda r: (r["run"], r["step"]))
    write_atomic(args.out, [json.dumps(data, indent=2)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

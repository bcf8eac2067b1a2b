"""What `auto` measures at other batch sizes: the speed of each precision and attention
path relative to float32 on the readable path, and what `auto` would choose, for a
preset's model timed on batches of several sizes (our addition).

Run from the repository root, on a quiet machine (it times)::

    DATA_MIRROR=../shared/data python benchmarks/auto_batch.py
    python benchmarks/auto_batch.py --config multi30k-small --tokens 256,1000,2500

`auto` times passes on a batch of the run's own size (`machinery/devices.py`): on a CPU
a smaller batch can rank the precisions the other way. Each size is measured twice,
as a run measures it (`time_calls` with its defaults), so the spread between two
measurements shows beside the difference between sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import machinery  # noqa: E402
from machinery.devices import (  # noqa: E402
    CLEAR_WIN,
    cpu_name,
    pick_faster,
    use_usable_cores,
)
from machinery.training import measure_compute  # noqa: E402


def main(argv=None) -> int:
    """Print, per batch size and repeat, each path's speed and `auto`'s choice."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="multi30k-small", help="the preset")
    parser.add_argument(
        "--tokens", default="256,0", help="batch sizes in tokens (0: the preset's)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="measurements per size")
    args = parser.parse_args(argv)
    threads = use_usable_cores()  # as a run sets its threads before it measures
    cfg = machinery.get_config(args.config)
    data = machinery.load_dataset(cfg, log=lambda *a: None)
    device = torch.device("cpu")
    precisions = machinery.precision_candidates(device)[0]
    paths = ["readable", "fast"]
    print(f"{args.config} on {cpu_name()}; {threads}")
    for tokens in [int(t) or cfg.batch_tokens for t in args.tokens.split(",")]:
        sized = dataclasses.replace(cfg, batch_tokens=tokens)
        for repeat in range(args.repeats):
            times = measure_compute(sized, data, device, precisions, paths)
            reference = times[("fp32", "readable")]
            speeds = ", ".join(
                f"{q}/{a} {reference / t:.2f}×" for (q, a), t in times.items()
            )
            best = {
                q: min(t for (r, _), t in times.items() if r == q) for q in precisions
            }  # each precision at its faster path, as auto compares them
            choice, _ = pick_faster(best, "fp32", precisions[1:])
            at = {a: times[(choice, a)] for a in paths}
            path, _ = pick_faster(at, "readable", ["fast"])
            print(
                f"{tokens:>6} tokens, measurement {repeat + 1}: {speeds}; auto: "
                f"{choice}, {path} attention (a clear win is {CLEAR_WIN:.2f}×)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What building one training batch costs on the host: ``make_batch`` for batches of
about 4,096 tokens a side (``iwslt14-small``'s ``batch_tokens``).

Run from the repository root::

    python benchmarks/batch_cost.py [--batch_tokens 4096] [--repeats 200]

On a GPU an update of ``iwslt14-small`` is a few milliseconds of kernels, so the
batches must cost well under a millisecond to build (issue 37's target: ≤ 0.5 ms on
the machines we have), and a GPU run builds them in a background thread besides
(``machinery.training.prefetched``). The pairs are IWSLT14-like: lengths drawn from
5 to 60 tokens, cut into batches by ``length_batches`` as training cuts them. Prints
the CPU's name, the median milliseconds per batch (one thread, as the background
thread has), and the same for the pairs' padding alone (``pad_sequences``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import the_annotated_transformer as tat  # noqa: E402
from machinery.devices import cpu_name  # noqa: E402


def iwslt_like_pairs(n: int = 20_000, seed: int = 0) -> list:
    """``n`` (source, target) id lists with <s>/</s>, lengths 5–60, ids below 10,000."""
    rng = random.Random(seed)

    def sentence(length):
        return [tat.BOS] + [rng.randrange(4, 10_000) for _ in range(length)] + [tat.EOS]

    return [
        (sentence(rng.randint(5, 60)), sentence(rng.randint(5, 60))) for _ in range(n)
    ]


def median_ms(fn, items, repeats: int) -> float:
    """Median milliseconds of ``fn(item)`` over ``repeats`` items (cycled)."""
    for item in items[:5]:
        fn(item)  # warm-up
    times = []
    for k in range(repeats):
        item = items[k % len(items)]
        t0 = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs = iwslt_like_pairs()
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = tat.length_batches(lengths, args.batch_tokens, seed=1)
    tokens = statistics.median(
        max(max(lengths[i]) for i in idx) * len(idx) for idx in batches
    )
    result = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "batch_tokens": args.batch_tokens,
        "median_padded_tokens_a_side": tokens,
        "make_batch_ms": median_ms(
            lambda idx: tat.make_batch(pairs, idx), batches, args.repeats
        ),
        "pad_sequences_ms": median_ms(
            lambda idx: tat.pad_sequences([pairs[i][1] for i in idx]),
            batches,
            args.repeats,
        ),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"CPU: {result['cpu']}; torch {result['torch']}; one thread")
        print(
            f"make_batch, {args.batch_tokens}-token batches "
            f"(median {tokens:.0f} padded tokens a side): "
            f"{result['make_batch_ms']:.3f} ms per batch"
        )
        print(f"pad_sequences, one side: {result['pad_sequences_ms']:.3f} ms")
    return result


if __name__ == "__main__":
    main()

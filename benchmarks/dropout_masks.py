"""How long one dropout mask takes to draw on the CPU, each way the module can draw it (§5.4's dropout).

Run from the repository root::

    python benchmarks/dropout_masks.py                 # a multi30k-small mask: 120 × 20 × 256, P_drop 0.1
    python benchmarks/dropout_masks.py --shape 64,50,512 --dtype bfloat16

Times, on one tensor of ``--shape``, the median of ``--repeats`` calls of: ``nn.Dropout``'s own mask
(``bernoulli_`` and the division by q), the ``random_`` replay (``tat._replayed_scaled_mask``), the
compiled kernel (``tat._kernel_scaled_mask``, where ``build/dropout_mask.so`` is built: ``make kernel``)
and ``FastDropout``'s whole forward (its mask is other masks). The first three give the same mask;
the script checks that before it times them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402

import bench  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


def ways(q: float, dtype: torch.dtype) -> dict:
    """name → a function of the shape that draws one scaled mask (or, for FastDropout, applies it to ones)."""
    out = {"nn.Dropout (bernoulli_, / q)": lambda shape: torch.empty(shape, dtype=dtype).bernoulli_(q).div_(q),
           "random_ replay": lambda shape: tat._replayed_scaled_mask(shape, q, dtype)}
    lib = tat.load_dropout_kernel()
    if lib is not None:
        out["compiled kernel"] = lambda shape: tat._kernel_scaled_mask(lib, shape, q, dtype)
    fast = tat.FastDropout(1 - q).train()
    out["FastDropout (whole forward, other masks)"] = lambda shape: fast(torch.ones(shape, dtype=dtype))
    return out


def main(argv) -> int:
    """Check that the ways agree, then print one Markdown row of milliseconds per way."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="120,20,256")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    shape, q, dtype = torch.Size(int(n) for n in args.shape.split(",")), 1 - args.p, getattr(torch, args.dtype)
    drawn = ways(q, dtype)
    masks = []
    for name, draw in drawn.items():
        if not name.startswith("FastDropout"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                masks.append(draw(shape))
    if not all(torch.equal(m, masks[0]) for m in masks):
        print("the ways do not draw the same mask here (bernoulli_ is not PyTorch's default kernel?)", file=sys.stderr)
        return 1
    print(f"| {args.dtype} mask of {tuple(shape)}, P_drop {args.p} | ms (median of {args.repeats}) |\n|---|---|")
    for name, draw in drawn.items():
        ms = bench.median_time(lambda: draw(shape), warmup=3, repeats=args.repeats) * 1e3
        print(f"| {name} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

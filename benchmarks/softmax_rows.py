"""PyTorch's CPU softmax on short rows: its own kernel against the formula written out,
forward and backward.

Run from the repository root::

    python benchmarks/softmax_rows.py

Attention scores of a ``multi30k-small`` batch are (sentences, h, len_q, len_k) with
len_k the longest sentence of the batch, often under 16 tokens. For each row length the
script times ``torch.softmax`` over the last dimension and
``torch._softmax_backward_data`` (what autograd calls for it) against the same
computation written out — max, subtract, exp, sum, divide; and y·(g − Σ g·y) — on
float32 tensors of about the same number of elements, and prints the milliseconds and
the largest difference. The written-out version is not used by the model: it rounds
differently, so runs would no longer repeat the reported ones bit for bit (README,
Performance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench  # noqa: E402


def written_out(x: torch.Tensor) -> torch.Tensor:
    r"""Eq. 1's softmax (§3.2.1) over the last dimension, $e^{x - \max x} / \sum e^{x -
    \max x}$, written out in five tensor operations (max, subtract, exp, sum,
    divide)."""
    y = (x - x.amax(-1, keepdim=True)).exp_()
    return y.div_(y.sum(-1, keepdim=True))


def written_out_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""The backward of Eq. 1's softmax (§3.2.1), $y \odot (g - \sum g \odot y)$ over
    the last dimension."""
    gy = grad * y
    return gy.sub_(y * gy.sum(-1, keepdim=True))


def millis(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, after five warm-up calls
    (``bench.median_time``)."""
    return bench.median_time(fn, 5, repeats) * 1e3


def main(argv) -> int:
    """Print one Markdown row per row length."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8,12,15,16,18,24,32")
    parser.add_argument(
        "--elements", type=int, default=2**18, help="about this many numbers per tensor"
    )
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
        "(rows, h=8, n, n) tensors"
    )
    print(
        "| n | shape | softmax ms | written out ms | backward ms | written out ms | "
        "largest difference |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (int(v) for v in args.lengths.split(",")):
        rows = max(1, args.elements // (8 * n * n))
        x = torch.randn(rows, 8, n, n) * 3  # (rows, h, n, n) scores
        g = torch.randn_like(x)
        y = torch.softmax(x, -1)
        fwd = millis(lambda: torch.softmax(x, -1), args.repeats)
        fwd_w = millis(lambda: written_out(x), args.repeats)
        bwd = millis(
            lambda: torch._softmax_backward_data(g, y, -1, x.dtype), args.repeats
        )
        bwd_w = millis(lambda: written_out_backward(g, y), args.repeats)
        diff = max(
            (written_out(x) - y).abs().max().item(),
            (
                written_out_backward(g, y)
                - torch._softmax_backward_data(g, y, -1, x.dtype)
            )
            .abs()
            .max()
            .item(),
        )
        print(
            f"| {n} | {tuple(x.shape)} | {fwd:.3f} | {fwd_w:.3f} | {bwd:.3f} | "
            f"{bwd_w:.3f} | {diff:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

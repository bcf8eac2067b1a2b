"""Variants of the preset's training step, tried for speed, timed side by side.

Run from the repository root (needs the Multi30k data; set ``DATA_MIRROR`` when
offline)::

    python benchmarks/attention_variants.py   # float32, and bf16 where the CPU has it
    python benchmarks/attention_variants.py --rounds 5 --batches 20
    python benchmarks/attention_variants.py --rows readable,readable/short-softmax \\
        --batches 8 --rounds 7

Every row trains ``multi30k-small`` with full steps (``bench.train_step``: forward, the
loss the presets train with, backward, clipping, fused Adam) on the same first
``--batches`` length-bucketed batches; the rounds alternate between the rows and the
median is printed, with the ratio to the preset's path and to nn.Transformer, and the
median (quartiles) of the rounds' ratios to the preset's path ("pass by pass": each
round's passes ran one after the other). These rows are not ``make bench``'s: other
batches, so compare ratios within one run of this script, not its numbers with the
bench's.

* ``readable`` — the preset's model on this machine (readable Eq. 1).
* ``readable/short-softmax`` — the same, with Eq. 1's softmax written out
  (``softmax_rows.written_out``) where the rows are shorter than 16 keys, where
  PyTorch's CPU kernel is slow; it rounds differently.
* ``fused-projections`` — ``FastMultiHeadedAttention``'s fused projections in front of
  the readable Eq. 1 (with the written-out softmax), no SDPA.
* ``fast`` (fused projections and SDPA) and ``torch`` (nn.Transformer) as in ``make
  bench``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402

import bench  # noqa: E402
import machinery  # noqa: E402
import softmax_rows  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

# rows shorter than this take PyTorch's slow CPU softmax (benchmarks/softmax_rows.py)
SHORT = 16


class _WrittenOutSoftmax(torch.autograd.Function):
    r"""softmax over the last dimension (Eq. 1, §3.2.1), forward and backward written
    out in tensor operations."""

    @staticmethod
    def forward(ctx, x):
        """softmax(x) over the last dimension; keeps the result for the backward."""
        y = softmax_rows.written_out(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        """y·(g − Σ g·y) over the last dimension."""
        (y,) = ctx.saved_tensors
        return softmax_rows.written_out_backward(grad, y)


def short_row_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Eq. 1's softmax: written out for short rows on the CPU. Like PyTorch's kernel it
    computes in float32 and returns the scores' dtype (bf16 under CPU autocast)."""
    if scores.device.type == "cpu" and scores.size(-1) < SHORT:
        return _WrittenOutSoftmax.apply(scores.float()).to(scores.dtype)
    return scores.softmax(dim=-1)


def attention_short_softmax(query, key, value, mask=None, dropout=None):
    r"""Scaled dot-product attention — §3.2.1, Eq. 1, as ``tat.attention`` with
    ``short_row_softmax``."""
    scores = (
        query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    )  # (..., len_q, len_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p_attn = short_row_softmax(scores)
    if mask is not None:
        p_attn = p_attn.masked_fill(
            ~mask, 0.0
        )  # fully masked rows: zero weight, as tat.attention
    if dropout is not None:
        p_attn = dropout(p_attn)
    return p_attn @ value


class ShortSoftmaxAttention(tat.MultiHeadedAttention):
    """Multi-head attention — §3.2.2, the readable class with ``short_row_softmax`` in
    Eq. 1."""

    def attend(self, q, k, v, mask=None):
        """Eq. 1 on every head: (batch, h, len_q, d_k) → (batch, h, len_q, d_k)."""
        return attention_short_softmax(q, k, v, mask, self.dropout)


class FusedProjectionsAttention(tat.FastMultiHeadedAttention):
    """Multi-head attention — §3.2.2, the fused projections of the fast path in front of
    the readable Eq. 1."""

    def attend(self, q, k, v, mask=None):
        """Eq. 1 on every head: (batch, h, len_q, d_k) → (batch, h, len_q, d_k)."""
        return attention_short_softmax(q, k, v, mask, self.dropout)


VARIANTS = {
    "readable/short-softmax": ("readable", ShortSoftmaxAttention),
    "fused-projections": ("fast", FusedProjectionsAttention),
}
ROWS = (
    *VARIANTS,
    "readable",
    "fast",
    "torch",
)  # the variants, and ``bench.build_model``'s models


def build(
    kind: str, src_vocab: int, tgt_vocab: int, cfg: machinery.Config
) -> torch.nn.Module:
    """A row's model with random weights: ``bench.build_model``'s, with the attention
    class swapped for a variant."""
    if kind not in ROWS:
        raise ValueError(f"unknown row {kind!r}: one of {', '.join(ROWS)}")
    base, cls = VARIANTS.get(kind, (kind, None))
    model = bench.build_model(base, src_vocab, tgt_vocab, cfg)
    if cls is not None:
        for module in model.modules():
            if isinstance(module, tat.MultiHeadedAttention):
                module.__class__ = cls  # same parameters, another forward
    return model


def main(argv) -> int:
    """Time every row in alternating rounds and print a Markdown table per precision."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", default="readable,readable/short-softmax,fused-projections,fast,torch"
    )
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    cfg = machinery.get_config("multi30k-small")
    data = machinery.load_dataset(cfg, log=lambda *a: None)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = [
        tat.make_batch(pairs, idx)
        for idx in tat.length_batches(lengths, cfg.batch_tokens, seed=cfg.seed)[
            : args.batches
        ]
    ]
    tokens = sum(b.ntokens for b in batches)
    native, _ = machinery.native_bf16(torch.device("cpu"))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(batches)} "
        "batches, "
        f"{tokens:,} target tokens, {args.rounds} rounds"
    )
    for bf16 in [False, True] if native else [False]:
        models = {}
        for kind in rows:
            torch.manual_seed(1)
            model = build(kind, len(data.src_vocab), len(data.tgt_vocab), cfg).train()
            models[kind] = (model, bench.make_adam(model, cfg))
        speeds = {kind: [] for kind in rows}
        for _ in range(args.rounds):
            for kind in rows:
                model, opt = models[kind]
                for b in batches[:2]:  # warm-up
                    bench.train_step(model, opt, b, cfg, bf16)
                t0 = time.perf_counter()
                for b in batches:
                    bench.train_step(model, opt, b, cfg, bf16)
                speeds[kind].append(tokens / (time.perf_counter() - t0))
        median = {kind: statistics.median(v) for kind, v in speeds.items()}
        print(
            f"\n{'bf16' if bf16 else 'float32'}\n\n| row | target tokens/s (median) | "
            "vs readable | "
            "vs readable, pass by pass | vs nn.Transformer |"
        )
        print("|---|---|---|---|---|")
        for kind in rows:
            vs_torch = (
                f"{median[kind] / median['torch']:.3f}×" if "torch" in median else "—"
            )
            vs_readable = (
                f"{median[kind] / median['readable']:.3f}×"
                if "readable" in median
                else "—"
            )
            paired = "—"
            if "readable" in speeds:
                p = bench.paired(
                    speeds[kind], speeds["readable"]
                )  # speeds, not times: this row's over readable's
                paired = f"{p['median']:.3f}× ({p['q1']:.3f}–{p['q3']:.3f})"
            print(
                f"| {kind} | {median[kind]:,.0f} | {vs_readable} | {paired} | "
                f"{vs_torch} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

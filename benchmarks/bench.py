"""Side-by-side performance numbers measured in one run on this machine.

Run from the repository root::

    python benchmarks/bench.py            # a few minutes on 2 CPU cores
    python benchmarks/bench.py --quick    # seconds: fewer batches, sentences, repeats
    python benchmarks/bench.py --smoke    # a tiny model, for the test suite

Sections (each is a key of the JSON written to ``--out``):

1. ``training``: target tokens/s of a full training step (forward, label-smoothed loss,
   backward, gradient clipping as configured, Adam step) for our fast attention path,
   our readable path and ``torch.nn.Transformer`` at the same sizes, on the same
   length-bucketed Multi30k batches; float32, and bf16 autocast where the CPU computes
   bf16 natively.
2. ``flops``: matmul FLOPs per training step counted by ``FlopCounterMode``, divided
   by the step time, as a share of the matmul peak measured in the same run.
3. ``padding``: share of padding tokens in our length-bucketed batches vs padding every
   sentence to a fixed 72 tokens.
4. ``decoding``: greedy decoding of the test set one sentence at a time with full
   recomputation (as the 2018/2022 Annotated Transformer notebooks do) vs batched, and
   with a key/value cache and beam search when the module provides them.
5. ``scaling``: time of one update (forward and backward) of one self-attention
   sub-layer and one feed-forward sub-layer as the sentence length grows (§4, Table 1).
6. ``beside``: ms per training update quiet and beside one busy process, for each
   OpenMP wait policy (the default, spinning, passive, a short spin), each in a process
   of its own, side by side in one run; the goals are at most 1.5× beside one busy
   process and, quiet, within 5% of the best policy.

Writes ``bench.json`` and ``bench.png`` to ``--out`` (default ``runs/bench``) and prints
a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# before torch starts OpenMP: wait passively unless told (measuring processes are)
if __name__ == "__main__" and "--beside-worker" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # devices.WAIT_POLICY
# what OpenMP starts with when torch is imported below (later changes do not count)
OPENMP_ENVIRONMENT = MappingProxyType(
    {
        k: os.environ.get(k)
        for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    }
)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import machinery  # noqa: E402
from machinery.devices import (  # noqa: E402
    WAIT_POLICY,
    cpu_name,
    quiet_environment,
    usable_cores,
)
from machinery.runfiles import atomic_file, write_atomic  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402
from profiling import counted_flops, meta_batch  # noqa: E402

FIXED_PAD_LENGTH = 72  # the fixed-length padding that length bucketing is compared with


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much of each measurement to run (three sizes: full, quick, smoke)."""

    mode: str
    # (field, value) pairs applied to the multi30k-small preset
    model_overrides: tuple = ()
    train_batches: int = 4  # batches per timed pass
    train_warmup_passes: int = (
        1  # untimed passes over every batch per model before timing
    )
    train_repeats: int = 7  # timed passes per model (the median is reported)
    batch_tokens: int = 0  # 0 = the preset's batch_tokens
    peak_size: int = 2048  # n of the n×n×n matmul used to measure the peak
    peak_repeats: int = 9  # the peak is the fastest of these
    decode_sentences: int = 1000  # test sentences decoded by the batched methods
    single_sentences: int = 50  # of those, decoded one at a time (evenly spaced)
    beam_full_sentences: int = 24  # sentences for the cached-vs-full beam search check
    compiled: bool = (
        True  # also time torch.compile'd models (compile time reported separately)
    )
    decode_extra: int = 50  # decoding stops at input length + this (§6.1)
    decode_batch: int = 128
    scaling_lengths: tuple = (16, 32, 64, 128, 256)
    scaling_d_models: tuple = (256, 512)
    scaling_batch: int = 16  # sentences per update in the scaling measurement
    scaling_warmup: int = 2
    scaling_repeats: int = 5
    beside_warmup: int = 3  # untimed updates in each measuring process
    beside_updates: int = 20  # timed updates in each (the median is reported)
    beside_repeats: int = 3  # rounds over every policy, quiet and beside


MODES = MappingProxyType(
    {
        "full": Settings("full"),
        "quick": Settings(
            "quick",
            compiled=False,
            train_batches=1,
            train_warmup_passes=1,
            train_repeats=2,
            batch_tokens=1000,
            peak_size=1024,
            peak_repeats=3,
            decode_sentences=16,
            single_sentences=4,
            beam_full_sentences=4,
            decode_extra=20,
            scaling_lengths=(16, 64, 256),
            scaling_d_models=(256,),
            scaling_repeats=3,
            scaling_warmup=1,
            beside_warmup=1,
            beside_updates=5,
            beside_repeats=1,
        ),
        "smoke": Settings(
            "smoke",
            compiled=False,
            model_overrides=(("N", 1), ("d_model", 32), ("d_ff", 64), ("h", 4)),
            train_batches=2,
            train_warmup_passes=1,
            train_repeats=2,
            batch_tokens=300,
            peak_size=256,
            peak_repeats=2,
            decode_sentences=12,
            single_sentences=6,
            beam_full_sentences=4,
            decode_extra=5,
            decode_batch=4,
            scaling_lengths=(16, 32),
            scaling_d_models=(32,),
            scaling_batch=4,
            scaling_repeats=2,
            scaling_warmup=1,
            beside_warmup=1,
            beside_updates=2,
            beside_repeats=1,
        ),
    }
)


def call_times(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Wall-clock seconds of each of ``repeats`` calls of ``fn()``, after ``warmup``
    untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup``
    untimed calls."""
    return statistics.median(call_times(fn, warmup, repeats))


# --------------------------------------------------------------------------- machine


def machine_info() -> dict:
    """What the numbers were measured on: CPU, cores, threads, torch, bf16 support,
    load."""
    bf16, why = machinery.native_bf16(torch.device("cpu"))
    return {
        "cpu": cpu_name(),
        "cores": usable_cores(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(not set)"),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": bf16,
        "bf16_reason": why,
        "allocator": machinery.allocator_note(torch.device("cpu")) or "not glibc",
        "load_average_start": list(os.getloadavg())
        if hasattr(os, "getloadavg")
        else None,
    }


# --------------------------------------------------------------------------- models


class TorchTransformer(nn.Module):
    """``torch.nn.Transformer`` with our embeddings, positional encoding and generator
    around it.

    Same sizes, dropouts and weight tying as :func:`tat.make_model`: residual dropout
    ``P_drop``, attention-weight dropout ``attn_dropout`` and FFN dropout
    ``ffn_dropout``; post-norm stacks without a final norm (pre-norm with one), as in
    our model. Masks follow PyTorch's convention (True = blocked), built from the
    padding inside :meth:`forward`.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, cfg: machinery.Config):
        super().__init__()
        d = cfg.d_model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested-tensor notes about layer options
            enc_layer = nn.TransformerEncoderLayer(
                d,
                cfg.h,
                cfg.d_ff,
                cfg.P_drop,
                batch_first=True,
                norm_first=cfg.norm_first,
            )
            dec_layer = nn.TransformerDecoderLayer(
                d,
                cfg.h,
                cfg.d_ff,
                cfg.P_drop,
                batch_first=True,
                norm_first=cfg.norm_first,
            )
            for layer in (enc_layer, dec_layer):
                layer.dropout.p = cfg.ffn_dropout  # the dropout inside the FFN
                for name in ("self_attn", "multihead_attn"):
                    if hasattr(layer, name):
                        getattr(layer, name).dropout = cfg.attn_dropout
            encoder = nn.TransformerEncoder(
                enc_layer,
                cfg.N,
                norm=nn.LayerNorm(d) if cfg.norm_first else None,
                enable_nested_tensor=False,
            )
            decoder = nn.TransformerDecoder(
                dec_layer,
                cfg.decoder_layers,
                norm=nn.LayerNorm(d) if cfg.norm_first else None,
            )
            self.transformer = nn.Transformer(
                d,
                cfg.h,
                cfg.N,
                cfg.decoder_layers,
                cfg.d_ff,
                cfg.P_drop,
                batch_first=True,
                norm_first=cfg.norm_first,
                custom_encoder=encoder,
                custom_decoder=decoder,
            )
        self.src_embed = nn.Sequential(
            tat.Embeddings(d, src_vocab),
            tat.PositionalEncoding(d, cfg.P_drop, cfg.max_len),
        )
        self.tgt_embed = nn.Sequential(
            tat.Embeddings(d, tgt_vocab),
            tat.PositionalEncoding(d, cfg.P_drop, cfg.max_len),
        )
        self.generator = tat.Generator(d, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if cfg.tie_weights:
            self.generator.proj.weight = self.tgt_embed[0].lut.weight
            if cfg.shared_vocab and src_vocab == tgt_vocab:
                self.src_embed[0].lut.weight = self.tgt_embed[0].lut.weight

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        """Decoder output (batch, tgt_len, d_model); padding is read from the ids
        (``tat.PAD``)."""
        src_pad, tgt_pad = src == tat.PAD, tgt == tat.PAD
        causal = ~tat.subsequent_mask(tgt.size(1), device=tgt.device)[
            0
        ]  # (tgt_len, tgt_len), True = blocked
        return self.transformer(
            self.src_embed(src),
            self.tgt_embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )


def build_model(
    kind: str, src_vocab: int, tgt_vocab: int, cfg: machinery.Config
) -> nn.Module:
    """``"fast"`` / ``"readable"`` (our model as ``tat.make_model`` builds it with that
    attention path) or ``"torch"`` (nn.Transformer), random weights."""
    if kind == "torch":
        return TorchTransformer(src_vocab, tgt_vocab, cfg)
    if kind not in ("fast", "readable"):
        raise ValueError(f"unknown model {kind!r}: fast, readable or torch")
    return tat.make_model(src_vocab, tgt_vocab, cfg, attention=kind)


MODEL_NAMES = MappingProxyType(
    {
        "fast": "ours, fast path",
        "readable": "ours, readable path",
        "torch": "torch.nn.Transformer",
        "fast+compile": "ours, fast path, compiled",
        "readable+compile": "ours, readable path, compiled",
    }
)
# the rows ``attention`` chooses among (the preset's choices); nn.Transformer is the
# baseline
PATH_KINDS = ("fast", "readable", "fast+compile", "readable+compile")


def make_adam(
    model: nn.Module, cfg: machinery.Config, fused: bool = True
) -> torch.optim.Optimizer:
    """The optimizer every row uses: Adam with the preset's betas and eps, fused as in
    ``tat.make_optimizer``; ``fused=False``: one parameter at a time (neither the fused
    kernel nor the foreach one), as training was before."""
    return torch.optim.Adam(
        model.parameters(),
        lr=1e-4,
        betas=tuple(cfg.betas),
        eps=cfg.adam_eps,
        fused=fused,
        foreach=None if fused else False,
    )


# --------------------------------------------------------------------------- 1. trainin


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tat.Batch,
    cfg: machinery.Config,
    bf16: bool,
    forward: Optional[nn.Module] = None,
) -> None:
    """One full training update, as ``machinery.update`` does it: forward, the
    label-smoothed loss (``tat.batch_loss``), backward, clipping, Adam step.
    ``forward``: a compiled wrapper of ``model`` that runs the forward pass (the
    generator is the model's own)."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    with ctx:
        value = tat.batch_loss(model, batch, cfg.eps_ls, forward)
    (value / batch.ntokens).backward()
    if cfg.clip_grad:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_flops(
    cfg: machinery.Config, shapes: Sequence[tuple], src_vocab: int, tgt_vocab: int
) -> int:
    """FLOPs (2 per multiply-add) of one forward and backward pass over batches of
    ``shapes`` ((source shape, target shape) each), counted by ``FlopCounterMode``
    (``profiling.counted_flops``) on our model with ``cfg``'s sizes on the ``meta``
    device: the matrix products and attention that are computed, padding included,
    whatever h·d_k is."""
    with torch.device("meta"):
        model = tat.make_model(src_vocab, tgt_vocab, cfg, attention="readable")

    def one_pass(src: tuple, tgt: tuple) -> None:
        tat.batch_loss(model, meta_batch(src, tgt), cfg.eps_ls).backward()

    return sum(counted_flops(lambda s=s, t=t: one_pass(s, t)) for s, t in shapes)


def bench_training(
    data: machinery.Dataset,
    cfg: machinery.Config,
    st: Settings,
    bf16_native: bool,
    log: Callable,
) -> dict:
    """Target tokens/s of full training steps for each model and precision, on the same
    batches.

    Each repeat is one pass of every model over the same batches, interleaved step by
    step: every model takes its step on a batch before any moves on to the next, so the
    steps that are compared ran seconds apart and a slow phase of the machine hits all
    of them alike; the order of the models rotates by one place at every step
    (``rotated``). A pass's time is the sum of its steps; the median pass is kept.
    """
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    all_batches = tat.length_batches(
        lengths, st.batch_tokens or cfg.batch_tokens, seed=cfg.seed, epoch=0
    )
    batches = [tat.make_batch(pairs, idx) for idx in all_batches[: st.train_batches]]
    tokens = sum(b.ntokens for b in batches)
    flops = training_flops(
        cfg,
        [(tuple(b.src.shape), tuple(b.tgt.shape)) for b in batches],
        len(data.src_vocab),
        len(data.tgt_vocab),
    )
    precisions = ["float32"] + (["bf16"] if bf16_native else [])
    kinds = [k for k in MODEL_NAMES if st.compiled or not k.endswith("+compile")]
    runs, compile_s = {}, {}
    for kind in kinds:
        for prec in precisions:
            torch.manual_seed(cfg.seed)
            model = build_model(
                kind.split("+")[0], len(data.src_vocab), len(data.tgt_vocab), cfg
            ).train()
            optimizer = make_adam(model, cfg)
            forward = None
            if kind.endswith("+compile"):
                # the first pass over the batches compiles (once per new shape); its
                # time is the price
                t0 = time.perf_counter()
                forward = torch.compile(model)
                for b in batches:
                    train_step(model, optimizer, b, cfg, prec == "bf16", forward)
                compile_s[(kind, prec)] = time.perf_counter() - t0
            for _ in range(
                st.train_warmup_passes
            ):  # every batch once: each shape's first step allocates
                for b in batches:
                    train_step(model, optimizer, b, cfg, prec == "bf16", forward)
            runs[(kind, prec)] = (model, forward, optimizer, [])
    rows = list(runs.items())
    for r in range(st.train_repeats):
        log(f"training: repeat {r + 1}/{st.train_repeats}")
        for *_, times in runs.values():
            times.append(0.0)
        for i, b in enumerate(
            batches
        ):  # every row takes its step on this batch before any row moves on
            for (kind, prec), (model, forward, optimizer, times) in rotated(
                rows, r * len(batches) + i
            ):
                t0 = time.perf_counter()
                train_step(model, optimizer, b, cfg, prec == "bf16", forward)
                times[-1] += (
                    time.perf_counter() - t0
                )  # a pass: this row's steps of this repeat, summed
    preset_path = machinery.resolve_attention(cfg.attention, torch.device("cpu"))[0]
    results = []
    for (kind, prec), (*_, times) in runs.items():
        t = statistics.median(times)
        results.append(
            {
                "model": kind,
                "name": MODEL_NAMES[kind],
                "precision": prec,
                "tokens_per_s": tokens / t,
                "best_tokens_per_s": tokens / min(times),
                "step_s": t / len(batches),
                "flops_per_s": flops / t,
                "best_flops_per_s": flops / min(times),
                "pass_times_s": times,
                "compile_s": compile_s.get((kind, prec)),
                "preset_choice": kind == preset_path,
            }
        )
    by = {(r["model"], r["precision"]): r for r in results}
    ratios = {
        prec: {
            f"{kind}_vs_torch{suffix}": by[(kind, prec)][key] / by[("torch", prec)][key]
            for kind in kinds
            if kind != "torch"
            for suffix, key in (("", "tokens_per_s"), ("_best", "best_tokens_per_s"))
        }
        for prec in precisions
    }
    for prec in precisions:
        for kind in kinds:
            if kind != "torch":
                ratios[prec][f"{kind}_vs_torch_paired"] = paired(
                    runs[("torch", prec)][-1], runs[(kind, prec)][-1]
                )
    fastest, fastest_path, preset_vs = {}, {}, {}
    for prec in precisions:
        rows = [r for r in results if r["precision"] == prec]
        fastest[prec] = max(rows, key=lambda r: r["tokens_per_s"])["model"]
        fastest_path[prec] = max(
            (r for r in rows if r["model"] in PATH_KINDS),
            key=lambda r: r["tokens_per_s"],
        )["model"]
        preset_vs[prec] = {
            name: paired(runs[(kind, prec)][-1], runs[(preset_path, prec)][-1])
            for name, kind in (
                ("fastest", fastest[prec]),
                ("fastest_path", fastest_path[prec]),
            )
        }
    return {
        "preset_path": preset_path,
        "fastest": fastest,
        "fastest_path": fastest_path,
        "preset_vs_fastest": preset_vs,
        "batches": len(batches),
        "target_tokens_per_pass": tokens,
        "sentences_per_pass": sum(b.src.size(0) for b in batches),
        "batch_tokens": st.batch_tokens or cfg.batch_tokens,
        "matmul_flops_per_pass": flops,
        "warmup_passes": st.train_warmup_passes,
        "repeats": st.train_repeats,
        "precisions": precisions,
        "results": results,
        "ratios": ratios,
    }


def rotated(items: Sequence, k: int) -> list:
    """``items`` starting at position ``k`` (mod its length) and wrapping round: the
    order the rows take their steps in at step ``k`` of the bench, so that over the
    steps every row runs first, second, … alike (the cyclic order stays: each row still
    follows the same one)."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def paired(reference_times: Sequence[float], times: Sequence[float]) -> dict:
    """Throughput of one row over a reference row, pass by pass: the steps of two passes
    of one repeat ran interleaved, seconds apart, so a slow phase of the machine hits
    both. Returns the first quartile, median and third quartile of the ratios (the
    smallest and largest below four passes, where quartiles would only interpolate)."""
    ratios = [ref / t for ref, t in zip(reference_times, times)]
    if len(ratios) < 4:
        q1, median, q3 = min(ratios), statistics.median(ratios), max(ratios)
    else:
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"q1": q1, "median": median, "q3": q3, "passes": len(ratios)}


# --------------------------------------------------------------------------- 2. FLOP ra


def matmul_peak(n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an n×n by n×n ``torch.matmul`` in ``dtype``: the fastest of ``repeats``
    after one warm-up (other work on the machine only slows a product down, so a peak is
    its best time, not its median)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    return (
        2
        * n**3
        / min(call_times(lambda: torch.matmul(a, b), warmup=1, repeats=repeats))
    )


def bench_flops(training: dict, st: Settings, bf16_native: bool) -> dict:
    """Measured matmul peaks and each training run's achieved matmul FLOP rate as a
    share of its peak."""
    peaks = {"float32": matmul_peak(st.peak_size, torch.float32, st.peak_repeats)}
    if bf16_native:
        peaks["bf16"] = matmul_peak(st.peak_size, torch.bfloat16, st.peak_repeats)
    shares = [
        {
            "model": r["model"],
            "precision": r["precision"],
            "flops_per_s": r["flops_per_s"],
            "share_of_peak": r["flops_per_s"] / peaks[r["precision"]],
            "best_share_of_peak": r["best_flops_per_s"] / peaks[r["precision"]],
        }
        for r in training["results"]
    ]
    return {
        "peak_matmul_size": st.peak_size,
        "peak_flops_per_s": peaks,
        "results": shares,
    }


# --------------------------------------------------------------------------- 3. padding


def bench_padding(
    data: machinery.Dataset, cfg: machinery.Config, batch_tokens: int
) -> dict:
    """Share of padding in the source and target tensors of one epoch of
    ``length_batches``, and the same share if every sentence were padded to
    ``FIXED_PAD_LENGTH`` tokens."""
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    real = sum(s + t for s, t in lengths)
    batches = tat.length_batches(lengths, batch_tokens, seed=cfg.seed, epoch=0)
    padded = sum(
        len(idx) * (max(lengths[i][0] for i in idx) + max(lengths[i][1] for i in idx))
        for idx in batches
    )
    fixed = sum(max(s, FIXED_PAD_LENGTH) + max(t, FIXED_PAD_LENGTH) for s, t in lengths)
    longer = sum(1 for s, t in lengths if max(s, t) > FIXED_PAD_LENGTH)
    return {
        "sentences": len(lengths),
        "batches": len(batches),
        "batch_tokens": batch_tokens,
        "real_tokens": real,
        "bucketed_share": 1 - real / padded,
        "fixed_length": FIXED_PAD_LENGTH,
        "fixed_share": 1 - real / fixed,
        "sentences_longer_than_fixed": longer,
    }


# --------------------------------------------------------------------------- 4. decodin


def cut(row: Sequence[int], limit: int) -> list[int]:
    """A decoded id list without a leading <s>, cut at </s> and after ``limit``
    tokens."""
    row = list(row)
    if row and row[0] == tat.BOS:
        row = row[1:]
    out = []
    for t in row[:limit]:
        if t == tat.EOS:
            break
        out.append(t)
    return out


def decode_batches(
    model: nn.Module,
    sources: Sequence[list[int]],
    batch_size: int,
    extra: int,
    method: Callable,
) -> list[list[int]]:
    """Decode ``sources`` in length-sorted batches with ``method(model, src, src_mask,
    max_len)``; returns each sentence's ids (cut at </s> and at §6.1's limit, n +
    ``extra`` tokens for n source words)."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list = [None] * len(sources)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        src = tat.pad_sequences([sources[i] for i in idx])
        src_mask = (src != tat.PAD).unsqueeze(-2)
        rows = method(model, src, src_mask, src.size(1) + extra)
        rows = rows.tolist() if torch.is_tensor(rows) else rows
        for i, row in zip(idx, rows):
            out[i] = cut(row, len(sources[i]) - 2 + extra)  # sources hold <s> … </s>
    return out


def greedy_full(model, src, src_mask, max_len):
    """Greedy decoding recomputing the whole prefix at every step
    (``tat.greedy_decode``)."""
    return tat.greedy_decode(model, src, src_mask, max_len, tat.BOS, tat.EOS, tat.PAD)


def greedy_cached(model, src, src_mask, max_len):
    """Greedy decoding with the module's key/value cache
    (``tat.IncrementalDecoder``)."""
    return tat.greedy_decode(
        model, src, src_mask, max_len, tat.BOS, tat.EOS, tat.PAD, tat.IncrementalDecoder
    )


def beam(cached: bool) -> Callable:
    """Beam search of width 4 (α = 0.6) from the module, with or without its cache.

    Each sentence may generate up to n + extra tokens (``tat.max_output_tokens``), the
    same limit the greedy outputs are cut at; <blank> is never generated.
    """

    def run(model, src, src_mask, max_len):
        extra = max_len - src.size(1)
        limits = tat.max_output_tokens(src, extra)  # (batch,)
        with torch.no_grad():
            return tat.beam_search(
                model,
                src,
                src_mask,
                limits,
                tat.BOS,
                tat.EOS,
                beam_size=4,
                alpha=0.6,
                banned=[tat.PAD],
                cached=cached,
            )

    return run


def timed(fn: Callable[[], list]) -> tuple[list, float]:
    """(``fn()``, wall-clock seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def agreement(a: Sequence[list[int]], b: Sequence[list[int]]) -> dict:
    """How many of two aligned lists of outputs are identical."""
    same = sum(1 for x, y in zip(a, b) if x == y)
    return {"same": same, "of": len(a), "all_same": same == len(a)}


def bench_decoding(
    data: machinery.Dataset, cfg: machinery.Config, st: Settings, log: Callable
) -> dict:
    """Sentences/s of greedy decoding one sentence at a time (full recompute) vs batched
    (full recompute, and cached when available) and of cached beam search; checks the
    outputs agree.

    The model has random weights (fast attention path, eval mode), so it rarely emits
    </s> and most sentences run to the length limit: fine for timing, not for
    translation.
    """
    torch.manual_seed(cfg.seed)
    model = tat.make_model(
        len(data.src_vocab), len(data.tgt_vocab), cfg, attention="fast"
    ).eval()
    test = [s for s, _ in data.splits["test"]][: st.decode_sentences]
    step = max(1, len(test) // max(1, st.single_sentences))
    single_idx = list(range(0, len(test), step))[: st.single_sentences]
    rows = []

    def row(
        name: str, n: int, seconds: float, note: str = "", available: bool = True
    ) -> dict:
        r = {
            "method": name,
            "available": available,
            "sentences": n,
            "seconds": seconds,
            "sentences_per_s": (n / seconds) if available and seconds > 0 else None,
            "note": note,
        }
        rows.append(r)
        return r

    with torch.no_grad():
        log(f"decoding: one sentence at a time, {len(single_idx)} sentences")
        single, t = timed(
            lambda: decode_batches(
                model, [test[i] for i in single_idx], 1, st.decode_extra, greedy_full
            )
        )
        row(
            "greedy, one sentence, full recompute",
            len(single_idx),
            t,
            f"1 in {step} test sentences, evenly spaced" if step > 1 else "",
        )
        log(f"decoding: batched full recompute, {len(test)} sentences")
        batched, t = timed(
            lambda: decode_batches(
                model, test, st.decode_batch, st.decode_extra, greedy_full
            )
        )
        row(f"greedy, batches of {st.decode_batch}, full recompute", len(test), t)
        checks = {
            "batched_full_vs_single": agreement(
                [batched[i] for i in single_idx], single
            )
        }
        if hasattr(tat, "IncrementalDecoder"):
            log(f"decoding: batched cached greedy, {len(test)} sentences")
            cached, t = timed(
                lambda: decode_batches(
                    model, test, st.decode_batch, st.decode_extra, greedy_cached
                )
            )
            row(f"greedy, batches of {st.decode_batch}, cached", len(test), t)
            checks["batched_cached_vs_batched_full"] = agreement(cached, batched)
        else:
            row(
                f"greedy, batches of {st.decode_batch}, cached",
                0,
                0.0,
                "not available (no tat.IncrementalDecoder)",
                available=False,
            )
        if hasattr(tat, "beam_search"):
            log(f"decoding: batched cached beam 4, {len(test)} sentences")
            beams, t = timed(
                lambda: decode_batches(
                    model, test, st.decode_batch, st.decode_extra, beam(True)
                )
            )
            row(f"beam 4, batches of {st.decode_batch}, cached", len(test), t)
            sub = list(
                range(0, len(test), max(1, len(test) // max(1, st.beam_full_sentences)))
            )
            sub = sub[: st.beam_full_sentences]
            log(f"decoding: beam 4 full recompute check, {len(sub)} sentences")
            full_beams = decode_batches(
                model,
                [test[i] for i in sub],
                st.decode_batch,
                st.decode_extra,
                beam(False),
            )
            checks["beam_cached_vs_full"] = agreement(
                [beams[i] for i in sub], full_beams
            )
        else:
            row(
                f"beam 4, batches of {st.decode_batch}, cached",
                0,
                0.0,
                "not available (no tat.beam_search)",
                available=False,
            )
    base = rows[0]["sentences_per_s"]
    for r in rows:
        r["speedup_vs_single"] = (
            r["sentences_per_s"] / base if r["sentences_per_s"] else None
        )
    lengths = [len(o) for o in batched]
    limits = [len(s) + st.decode_extra - 1 for s in test]
    return {
        "model": "random weights (untrained), fast attention path",
        "max_len": f"input length + {st.decode_extra}",
        "test_sentences": len(test),
        "hit_length_limit": sum(1 for n, m in zip(lengths, limits) if n >= m),
        "mean_output_tokens": statistics.mean(lengths),
        "results": rows,
        "checks": checks,
    }


# --------------------------------------------------------------------------- 5. scaling


class FeedForwardSublayer(nn.Module):
    """One feed-forward sub-layer: LayerNorm(x + FFN(x)), §3.1 and §3.3 (d_ff =
    4·d_model)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.ff = tat.PositionwiseFeedForward(d_model, 4 * d_model)
        self.sub = tat.SublayerConnection(d_model, 0.0)

    def forward(self, x):
        """(batch, n, d_model) → same shape."""
        return self.sub(x, self.ff)


class AttentionSublayer(nn.Module):
    """One self-attention sub-layer: LayerNorm(x + MultiHead(x, x, x)), §3.1 and §3.2 (h
    = 8, fast path)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.attn = tat.FastMultiHeadedAttention(8, d_model, 0.0)
        self.sub = tat.SublayerConnection(d_model, 0.0)

    def forward(self, x):
        """(batch, n, d_model) → same shape."""
        return self.sub(x, lambda y: self.attn(y, y, y))


def bench_scaling(st: Settings, log: Callable) -> dict:
    """Milliseconds of one forward+backward of each sub-layer, per sentence length and
    d_model."""
    results = []
    for d in st.scaling_d_models:
        torch.manual_seed(0)
        layers = {
            "self-attention": AttentionSublayer(d),
            "feed-forward": FeedForwardSublayer(d),
        }
        for n in st.scaling_lengths:
            x = torch.randn(st.scaling_batch, n, d, requires_grad=True)
            for name, layer in layers.items():

                def update():
                    layer(x).sum().backward()

                t = median_time(update, st.scaling_warmup, st.scaling_repeats)
                meta = copy.deepcopy(layer).to("meta")
                shape = (st.scaling_batch, n, d)
                x_meta = torch.empty(shape, device="meta", requires_grad=True)
                flops = counted_flops(lambda: meta(x_meta).sum().backward())
                results.append(
                    {
                        "sublayer": name,
                        "d_model": d,
                        "length": n,
                        "ms": 1e3 * t,
                        "matmul_flops": flops,
                    }
                )
        log(f"scaling: d_model={d} done")
    return {
        "batch": st.scaling_batch,
        "lengths": list(st.scaling_lengths),
        "d_models": list(st.scaling_d_models),
        "h": 8,
        "d_ff": "4 × d_model",
        "results": results,
    }


# --------------------------------------------------------------------------- 6. beside


# How OpenMP's idle threads wait decides how an update fares beside other work: a
# spinning thread keeps its core while it waits, so beside a busy process the two take
# turns and every parallel region waits for the thread that lost its turn. Each policy
# is measured in its own process (the runtime reads it once, at start), quiet and then
# beside one busy process (a pure-Python loop), policy after policy in rotating order,
# so that the machine's slow phases hit all of them alike.

# Between libgomp's default (a long spin before sleeping) and passive waiting (none), a
# spin count sets how long an idle thread spins: the count measured is the search for
# one that is as fast as spinning quiet and as steady as passive waiting beside a busy
# process. The last row is the other way out, threads chosen from the load: one thread
# beside a process that keeps a core busy (the default waiting; with one thread nothing
# waits). (`ACTIVE`, spinning without end, measured as the default does on the EPYC of
# `results/README.md`, is left out.)
ONE_THREAD = "one thread (as the load would choose)"
BESIDE_POLICIES = MappingProxyType(
    {
        "default (unset)": {},
        "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
        "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
        "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
        ONE_THREAD: {"OMP_NUM_THREADS": "1"},
    }
)
# The busy process: a pure-Python loop that looks up, every million turns, whether the
# process that started it (its pid, the loop's argument: read from the loop itself, it
# could already be another's) is still its parent, and ends when it is not (a bench
# stopped by a signal leaves no loop spinning behind). Started by `busy_process`.
BUSY_LOOP = (
    "import os, sys\n"
    "while os.getppid() == int(sys.argv[1]):\n"
    "    for _ in range(1_000_000):\n"
    "        pass\n"
)


def busy_process(env: Optional[dict] = None) -> subprocess.Popen:
    """One process keeping a core busy (:data:`BUSY_LOOP`) until it is killed or this
    process is gone."""
    return subprocess.Popen(
        [sys.executable, "-c", BUSY_LOOP, str(os.getpid())],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def policy_environment(policy: dict, environ=None) -> dict:
    """The environment of a measuring process: ``environ`` (default: this process's)
    without any wait policy or spin count, threads as the machinery sets them for the
    processes it starts (``quiet_environment``), and ``policy``'s variables."""
    base = {
        k: v
        for k, v in (os.environ if environ is None else environ).items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    env = quiet_environment(base)
    env.pop("OMP_WAIT_POLICY")
    return {**env, **policy}


def beside_worker(spec: dict) -> dict:
    """In a measuring process: ``spec["updates"]`` timed training updates (after
    ``spec["warmup"]``) of the benchmark's model on one random batch of the shape
    given; milliseconds per update (the median) and the environment it ran in."""
    st = MODES[spec["mode"]]
    cfg = machinery.get_config(
        "multi30k-small", dataset=spec["dataset"], **dict(st.model_overrides)
    )
    torch.manual_seed(cfg.seed)
    model = build_model(spec["path"], spec["src_vocab"], spec["tgt_vocab"], cfg)
    optimizer = make_adam(model.train(), cfg)
    (b, s), (_, t) = spec["src"], spec["tgt"]
    batch = tat.Batch(
        torch.randint(4, spec["src_vocab"], (b, s)),
        torch.randint(4, spec["tgt_vocab"], (b, t + 1)),
    )
    times = call_times(
        lambda: train_step(model, optimizer, batch, cfg, False),
        spec["warmup"],
        spec["updates"],
    )
    return {
        "ms_per_update": 1e3 * statistics.median(times),
        "threads": torch.get_num_threads(),
        "environment": dict(OPENMP_ENVIRONMENT),
    }


def measure_in_process(spec: dict, env: dict) -> dict:
    """:func:`beside_worker` in a process of its own, started with ``env``."""
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--beside-worker"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["(no message)"]
        raise RuntimeError(f"a measuring process failed: {lines[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_beside(
    data: machinery.Dataset, cfg: machinery.Config, st: Settings, log: Callable
) -> dict:
    """Milliseconds per training update of the preset's attention path in float32,
    quiet and beside one busy process, for each OpenMP wait policy, side by side."""
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    first = tat.length_batches(
        lengths, st.batch_tokens or cfg.batch_tokens, seed=cfg.seed, epoch=0
    )[0]
    batch = tat.make_batch(pairs, first)
    spec = {
        "mode": st.mode,
        "dataset": cfg.dataset,
        "path": machinery.resolve_attention(cfg.attention, torch.device("cpu"))[0],
        "src_vocab": len(data.src_vocab),
        "tgt_vocab": len(data.tgt_vocab),
        "src": list(batch.src.shape),
        "tgt": list(batch.tgt.shape),
        "warmup": st.beside_warmup,
        "updates": st.beside_updates,
    }
    names = list(BESIDE_POLICIES)
    runs: dict = {name: {"quiet": [], "beside one busy process": []} for name in names}
    seen: dict = {}
    for r in range(st.beside_repeats):
        for name in rotated(names, r):
            env = policy_environment(BESIDE_POLICIES[name])
            for condition in ("quiet", "beside one busy process"):
                busy = None
                if condition != "quiet":
                    busy = busy_process(env)
                try:
                    out = measure_in_process(spec, env)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                runs[name][condition].append(out["ms_per_update"])
                seen[name] = {"threads": out["threads"], **out["environment"]}
            log(f"beside other work: {name}, round {r + 1} done")
    rows = []
    for name in names:
        quiet = statistics.median(runs[name]["quiet"])
        busy = statistics.median(runs[name]["beside one busy process"])
        rows.append(
            {
                "policy": name,
                "machinery_default": BESIDE_POLICIES[name].get("OMP_WAIT_POLICY")
                == WAIT_POLICY,
                "quiet_ms": quiet,
                "busy_ms": busy,
                "slowdown": busy / quiet,
                "runs_ms": runs[name],
                "environment": seen[name],
            }
        )
    best = min(r["quiet_ms"] for r in rows)
    for row in rows:
        row["quiet_vs_best"] = row["quiet_ms"] / best
    return {"batch": {"src": spec["src"], "tgt": spec["tgt"]}, **spec, "rows": rows}


def beside_lines(beside: dict) -> list[str]:
    """The table's rows for the beside-other-work section, with the goals: beside one
    busy process at most 1.5× quiet, and quiet within 5% of the best policy."""
    lines = [
        "",
        f"Beside other work: ms per update ({beside['path']} path, float32, one "
        f"batch of {beside['src'][0]} pairs, {beside['src'][1]}/{beside['tgt'][1]} "
        "positions), each policy in a process of its own, quiet and beside one busy "
        "process",
        "",
        "| OpenMP waiting | quiet | beside one busy process | slowdown (goal ≤ 1.5×) "
        "| quiet vs the best (goal ≤ 1.05×) |",
        "|---|---|---|---|---|",
    ]
    for r in beside["rows"]:
        mark = " (the machinery's default)" if r["machinery_default"] else ""
        lines.append(
            f"| {r['policy']}{mark} | {r['quiet_ms']:,.1f} ms | {r['busy_ms']:,.1f} ms "
            f"| {r['slowdown']:.2f}× | {r['quiet_vs_best']:.2f}× |"
        )
    return lines


# --------------------------------------------------------------------------- output


def plot(report: dict, path: Path) -> Path:
    """Training throughput, decoding speed and the scaling curves, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d_models = report["scaling"]["d_models"]
    res = report["training"]["results"]
    fig, axes = plt.subplots(
        1,
        2 + len(d_models),
        figsize=(5 * (2 + len(d_models)) + 3, max(4.2, 0.36 * len(res))),
        gridspec_kw={"width_ratios": [1.6] + [1] * (1 + len(d_models))},
    )
    ax = axes[0]
    labels = [textwrap.fill(f"{r['name']}, {r['precision']}", 52) for r in res]
    ax.barh(
        range(len(res)),
        [r["tokens_per_s"] for r in res],
        color=[
            {
                "fast": "tab:blue",
                "readable": "tab:cyan",
                "torch": "tab:orange",
                "fast+compile": "tab:purple",
                "readable+compile": "tab:pink",
            }[r["model"]]
            for r in res
        ],
    )
    ax.set_yticks(range(len(res)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("target tokens/s (training step)")
    ax.set_title("training throughput")
    ax = axes[1]
    dec = [r for r in report["decoding"]["results"] if r["available"]]
    ax.barh(range(len(dec)), [r["sentences_per_s"] for r in dec], color="tab:green")
    ax.set_yticks(
        range(len(dec)), [r["method"].replace(", ", "\n", 1) for r in dec], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xscale("log")
    values = [r["sentences_per_s"] for r in dec]
    ax.set_xlim(min(values) / 3, max(values) * 3)
    for i, r in enumerate(dec):
        ax.text(
            r["sentences_per_s"],
            i,
            f" {r['sentences_per_s']:.3g}/s ({r['speedup_vs_single']:.1f}×)",
            va="center",
            fontsize=7,
        )
    ax.set_xlabel("sentences/s (log scale)")
    ax.set_title("decoding the test set, random-weight model")
    for ax, d in zip(axes[2:], d_models):
        for name, style in (("self-attention", "o-"), ("feed-forward", "s-")):
            pts = [
                r
                for r in report["scaling"]["results"]
                if r["sublayer"] == name and r["d_model"] == d
            ]
            ax.plot(
                [r["length"] for r in pts], [r["ms"] for r in pts], style, label=name
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sentence length n")
        ax.set_ylabel("ms per forward+backward")
        ax.set_title(f"one sub-layer, d_model={d}, batch {report['scaling']['batch']}")
        ax.legend()
    fig.suptitle(
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, torch "
        f"{report['machine']['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


def fmt(x: Optional[float], spec: str = ",.0f") -> str:
    """A number for the table ("n/a" for None)."""
    return "n/a" if x is None else format(x, spec)


def quartiles(p: dict) -> str:
    """A paired ratio as "median× (q1–q3)"."""
    return f"{p['median']:.2f}× ({p['q1']:.2f}–{p['q3']:.2f})"


def table(report: dict) -> str:
    """The Markdown table printed at the end of a run."""
    m, tr, fl, pad, dec = (
        report[k] for k in ("machine", "training", "flops", "padding", "decoding")
    )
    load = [
        format(m[k][0], ".1f") if m.get(k) else "n/a"
        for k in ("load_average_start", "load_average_end")
    ]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch "
        f"threads), torch {m['torch']}, "
        f"bf16 native: {'yes' if m['bf16_native'] else 'no'} ({m['bf16_reason']})",
        f"Command: {report['command']}",
        f"Model: {report['model']}; load average at start/end: {load[0]} / {load[1]}",
        "",
        f"Training batches: the first {tr['batches']} length-bucketed "
        f"{report['dataset']} training batches "
        f"(≤ {tr['batch_tokens']} tokens per side, {tr['target_tokens_per_pass']:,} "
        "target tokens); "
        f"{tr['warmup_passes']} warm-up pass{'' if tr['warmup_passes'] == 1 else 'es'} "
        f"over them, median of {tr['repeats']} passes; "
        "pass-by-pass ratios are median (first–third quartile) of the ratios of passes "
        "of the same repeat.",
        "",
        "| measurement | value | goal |",
        "|---|---|---|",
    ]
    for r in tr["results"]:
        mark = " (the preset's choice)" if r.get("preset_choice") else ""
        compiled = (
            f"; compiling took {r['compile_s']:.0f} s"
            if r.get("compile_s") is not None
            else ""
        )
        lines.append(
            f"| training, {r['name']}{mark}, {r['precision']} | "
            f"{fmt(r['tokens_per_s'])} target tokens/s "
            f"({r['step_s'] * 1e3:,.0f} ms/step; best pass "
            f"{fmt(r['best_tokens_per_s'])}{compiled}) | |"
        )
    ratio_goals = {"float32": "≥ 1.1×", "bf16": "≥ 1.5×"}
    for prec, ratio in tr["ratios"].items():
        for key in ratio:
            if key.endswith(("_best", "_paired")):
                continue
            kind = key[: -len("_vs_torch")]
            goal = ratio_goals[prec] if kind == tr["preset_path"] else ""
            lines.append(
                f"| training, {MODEL_NAMES[kind]} / nn.Transformer, {prec} | "
                f"{ratio[key]:.2f}× "
                f"(pass by pass: {quartiles(ratio[key + '_paired'])}; best passes: "
                f"{ratio[key + '_best']:.2f}×) | {goal} |"
            )
    for prec in tr["precisions"]:
        for which, label in (
            (
                "fastest_path",
                "fastest attention-path row (the rows `attention` and `compile` "
                "choose among; by median pass)",
            ),
            ("fastest", "fastest training row (by median pass)"),
        ):
            kind = tr[which][prec]
            vs = tr["preset_vs_fastest"][prec][which]
            preset = MODEL_NAMES[tr["preset_path"]]
            where = (
                "the preset's choice itself"
                if kind == tr["preset_path"]
                else f"the preset's choice ({preset}) runs at {quartiles(vs)} of its "
                "throughput"
                + (", within the noise" if vs["q1"] <= 1 <= vs["q3"] else "")
            )
            lines.append(
                f"| {label}, {prec} | {MODEL_NAMES[kind]}: {where} | the preset's "
                "choice |"
            )
    for prec, peak in fl["peak_flops_per_s"].items():
        lines.append(
            f"| matmul peak, {prec} ({fl['peak_matmul_size']}³ torch.matmul, fastest "
            f"of {report['settings']['peak_repeats']}) | {peak / 1e9:,.1f} GFLOP/s | |"
        )
    for r in fl["results"]:
        goal = (
            "≥ 40%"
            if r["model"] == tr["preset_path"] and r["precision"] == "bf16"
            else ""
        )
        lines.append(
            f"| training matmul FLOP rate, {MODEL_NAMES[r['model']]}, {r['precision']} "
            "| "
            f"{r['flops_per_s'] / 1e9:,.1f} GFLOP/s = {100 * r['share_of_peak']:.2f}% "
            "of peak "
            f"(best pass {100 * r['best_share_of_peak']:.2f}%) | {goal} |"
        )
    lines.append(
        f"| padding, length-bucketed batches ({pad['batch_tokens']} tokens) | "
        f"{100 * pad['bucketed_share']:.1f}% | ≤ 10% |"
    )
    lines.append(
        f"| padding, every sentence padded to {pad['fixed_length']} | "
        f"{100 * pad['fixed_share']:.1f}% | |"
    )
    for r in dec["results"]:
        if not r["available"]:
            lines.append(
                f"| decoding, {r['method']} | {r['note']} | "
                f"{'≥ 20×' if 'greedy' in r['method'] else ''} |"
            )
            continue
        goal = "≥ 20×" if "cached" in r["method"] and "greedy" in r["method"] else ""
        note = f"; {r['note']}" if r["note"] else ""
        lines.append(
            f"| decoding, {r['method']} | {fmt(r['sentences_per_s'], ',.1f')} "
            "sentences/s "
            f"({r['sentences']} sentences{note}), {r['speedup_vs_single']:.1f}× "
            f"one-sentence | {goal} |"
        )
    for name, c in dec["checks"].items():
        lines.append(
            f"| decoding check: {name.replace('_', ' ')} | {c['same']}/{c['of']} "
            "identical | all |"
        )
    sc = report["scaling"]
    for d in sc["d_models"]:
        for name in ("self-attention", "feed-forward"):
            pts = [
                r for r in sc["results"] if r["sublayer"] == name and r["d_model"] == d
            ]
            lines.append(
                f"| one {name} sub-layer, d_model={d}, fwd+bwd ms at n = "
                f"{', '.join(str(r['length']) for r in pts)} | "
                f"{', '.join(format(r['ms'], '.2f') for r in pts)} | |"
            )
    lines.append("")
    spread = max(max(r["pass_times_s"]) / min(r["pass_times_s"]) for r in tr["results"])
    if spread > 1.5:
        lines.append(
            f"Warning: the same training pass took up to {spread:.1f}× longer in one "
            "repeat than in "
            "another; other work on the machine is distorting these timings."
        )
    lines.append(
        f"Decoding used a model with {dec['model']}; {dec['hit_length_limit']} of "
        f"{dec['test_sentences']} "
        f"batched greedy outputs ran to the length limit ({dec['max_len']}) without "
        "emitting </s>."
    )
    if "beside" in report:
        lines += beside_lines(report["beside"])
    return "\n".join(lines)


def display_command(argv: Sequence[str]) -> str:
    """The command line as typed from the repository root (no machine paths)."""
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        script = Path(script.name)
    return " ".join(["python", str(script), *argv[1:]])


def main(argv: Sequence[str]) -> int:
    """Run every measurement, print the table, write JSON and PNG; returns the exit
    status."""
    if list(argv[1:]) == ["--beside-worker"]:  # a measuring process of section 6
        print(json.dumps(beside_worker(json.loads(sys.stdin.read()))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="fewer batches, sentences and repeats (seconds)",
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, a handful of everything (for tests)",
    )
    parser.add_argument(
        "--out",
        default="runs/bench",
        help="output folder for bench.json and bench.png (beside.json with --only)",
    )
    parser.add_argument(
        "--dataset",
        default="multi30k",
        choices=("multi30k", "copy"),
        help="training/test data (copy: the synthetic task, needs no download)",
    )
    parser.add_argument(
        "--decode-sentences",
        type=int,
        default=0,
        help="test sentences for the batched decoders (default: 1000; --quick 16)",
    )
    parser.add_argument(
        "--single-sentences",
        type=int,
        default=0,
        help="of those, how many to decode one at a time (default: 50; --quick 4)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (default: torch's default, all cores)",
    )
    parser.add_argument(
        "--compile",
        choices=("on", "off"),
        default=None,
        help="also time torch.compile'd models (default: on for the full run, "
        "off otherwise)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines, only the table"
    )
    parser.add_argument(
        "--only",
        choices=("beside",),
        default=None,
        help="beside: only section 6, the wait policies quiet and beside one busy "
        "process (written to beside.json)",
    )
    args = parser.parse_args(list(argv[1:]))
    st = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.decode_sentences:
        st = dataclasses.replace(st, decode_sentences=args.decode_sentences)
    if args.single_sentences:
        st = dataclasses.replace(st, single_sentences=args.single_sentences)
    if args.compile:
        st = dataclasses.replace(st, compiled=args.compile == "on")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    cfg = machinery.get_config(
        "multi30k-small", dataset=args.dataset, **dict(st.model_overrides)
    )
    if args.dataset == "copy":
        cfg = dataclasses.replace(cfg, shared_vocab=True)
    machine = machine_info()
    log(
        f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}; "
        f"{machine['bf16_reason']}"
    )
    log(machine["allocator"])
    t_start = time.time()
    data = machinery.load_dataset(cfg, log=log)
    report = {
        "command": display_command(argv),
        "mode": st.mode,
        "dataset": args.dataset,
        "model": f"N={cfg.N}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, h={cfg.h}, "
        f"P_drop={cfg.P_drop}, attn_dropout={cfg.attn_dropout}, "
        f"ffn_dropout={cfg.ffn_dropout}, "
        f"clip_grad={cfg.clip_grad}",
        "settings": dataclasses.asdict(st),
        "machine": machine,
    }
    if args.only == "beside":
        report["beside"] = bench_beside(data, cfg, st, log)
        machine["load_average_end"] = (
            list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        )
        report["seconds"] = time.time() - t_start
        path = out / "beside.json"
        write_atomic(path, (json.dumps(report, indent=2) + "\n").encode())
        print("\n".join(beside_lines(report["beside"])).strip())
        print(f"\nwrote {path} ({report['seconds']:.0f} s)")
        return 0
    log("1/6 training throughput")
    report["training"] = bench_training(data, cfg, st, machine["bf16_native"], log)
    log("2/6 matmul peak")
    report["flops"] = bench_flops(report["training"], st, machine["bf16_native"])
    log("3/6 padding")
    report["padding"] = bench_padding(data, cfg, st.batch_tokens or cfg.batch_tokens)
    log("4/6 decoding")
    report["decoding"] = bench_decoding(data, cfg, st, log)
    log("5/6 scaling")
    report["scaling"] = bench_scaling(st, log)
    log("6/6 beside other work")
    report["beside"] = bench_beside(data, cfg, st, log)
    machine["load_average_end"] = (
        list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    )
    report["seconds"] = time.time() - t_start
    write_atomic(out / "bench.json", (json.dumps(report, indent=2) + "\n").encode())
    plot(report, out / "bench.png")
    print(table(report))
    print(
        f"\nwrote {out / 'bench.json'} and {out / 'bench.png'} "
        f"({report['seconds']:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

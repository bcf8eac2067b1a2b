"""Where a training step's time goes: torch.profiler by operator, per attention path and
precision.

Run from the repository root (needs the Multi30k data; set ``DATA_MIRROR`` when
offline)::

    python benchmarks/profile_step.py   # multi30k-small, both paths, float32 and bf16
    python benchmarks/profile_step.py --steps 4 --top 12
    # Adam as training stepped it before
    python benchmarks/profile_step.py --paths fast --adam per-tensor
    # ours against nn.Transformer, by kind of work
    python benchmarks/profile_step.py --paths readable,torch --categories

For each (attention path, precision) it times ``--steps`` full training steps (forward,
label-smoothed loss, backward, clipping, fused Adam) on the same length-bucketed
Multi30k batches after two warm-up steps, prints the target tokens/s, then profiles the
same steps and prints the operators with the most self CPU time. A path is one of
``bench.build_model``'s kinds (``fast``, ``readable``); ``--adam per-tensor`` steps Adam
one parameter at a time (``torch.optim.Adam``'s default on a CPU, what training used
before the fused kernel) instead of the fused kernel training uses. bf16 rows appear
only where the CPU computes bf16 natively (see ``native_bf16`` in
``machinery/devices.py``). ``torch`` profiles ``torch.nn.Transformer`` (the bench's
baseline). ``--categories`` also sorts every operator's self time into a few kinds of
work (``category``; the ``nn.Dropout`` modules' forward operators are told apart by a
labelled range around each, ``label_dropouts``) and prints one table of milliseconds per
step with a column per profiled row, then the FLOP rate of the matrix products while
they ran (``matmul_rate``; compare it with ``bench.py``'s matmul peak).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import bench  # noqa: E402
import machinery  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


CATEGORIES = (
    "matrix products (projections, FFN, output layer)",
    "attention core (QKᵀ, mask, softmax, AV)",
    "dropout (masks and scaling, forward)",
    "loss and log-softmax",
    "clipping and Adam",
    "layer norm",
    "everything else",
)


DROPOUT_LABEL = "dropout module"


def label_dropouts(model: nn.Module) -> list:
    """Mark the forward of every dropout module of ``model`` (``nn.Dropout`` and any
    subclass) in the profile as a ``DROPOUT_LABEL`` range, so its operators can be told
    apart; returns the hook handles."""
    handles = []
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            ranges = []

            def enter(m, args, ranges=ranges) -> None:
                ranges.append(record_function(DROPOUT_LABEL).__enter__())

            def leave(
                m, args, out, ranges=ranges
            ) -> None:  # returns None: the module's output stays as it is
                ranges.pop().__exit__(None, None, None)

            handles += [
                module.register_forward_pre_hook(enter),
                module.register_forward_hook(leave),
            ]
    return handles


def category(name: str, parents: list) -> str:
    """The kind of work of one profiled operator, from its name and the names of the
    operators, autograd nodes and labelled ranges it ran inside (``parents``, innermost
    first)."""
    inside = " ".join(parents)
    if name in ("aten::mm", "aten::addmm"):
        return CATEGORIES[0]
    if "flash_attention" in name or name in (
        "aten::bmm",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::masked_fill_",
    ):
        return CATEGORIES[1]
    if name in ("aten::bernoulli_", "aten::random_") or DROPOUT_LABEL in parents:
        return CATEGORIES[2]
    if (
        "log_softmax" in name or "gather" in name
    ):  # the generator's log-softmax; loss_sum's pick of the targets
        return CATEGORIES[3]
    if "Optimizer" in inside or "foreach" in name:
        return CATEGORIES[4]
    if "layer_norm" in name:
        return CATEGORIES[5]
    return CATEGORIES[6]


def by_category(events, steps: int) -> dict:
    """Self CPU milliseconds per step of every ``aten::`` operator in ``events``, summed
    by ``category``."""
    total = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parents, p = [], e.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        total[category(e.name, parents)] += e.self_cpu_time_total / 1e3 / steps
    return total


def matmul_rate(events) -> float:
    """GFLOP/s of the matrix products (``aten::mm``, ``aten::addmm``) while they ran:
    2·m·k·n FLOPs each, from the recorded input shapes, over their self CPU time (0.0
    when none was recorded)."""
    flops = seconds = 0.0
    for e in events:
        if e.name in ("aten::mm", "aten::addmm") and e.input_shapes:
            (m, k), (_, n) = (
                e.input_shapes[-2:] if e.name == "aten::mm" else e.input_shapes[1:3]
            )
            flops += 2 * m * k * n
            seconds += e.self_cpu_time_total / 1e6
    return flops / seconds / 1e9 if seconds else 0.0


def main(argv) -> int:
    """Profile training steps of ``--config`` for each attention path and precision."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="multi30k-small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--paths", default="fast,readable")
    parser.add_argument(
        "--by-shape",
        action="store_true",
        help="also group the operators by their input shapes",
    )
    parser.add_argument("--adam", choices=("fused", "per-tensor"), default="fused")
    parser.add_argument(
        "--categories",
        action="store_true",
        help="also print milliseconds per step by kind of work, one column per row "
        "profiled",
    )
    args = parser.parse_args(argv)
    cfg = machinery.get_config(args.config)
    data = machinery.load_dataset(cfg, log=lambda *a: None)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = [
        tat.make_batch(pairs, idx)
        for idx in tat.length_batches(lengths, cfg.batch_tokens, seed=1)[: args.steps]
    ]
    tokens = sum(b.ntokens for b in batches)
    native, _ = machinery.native_bf16(torch.device("cpu"))
    columns = {}
    for path in args.paths.split(","):
        for bf16 in [False, True] if native else [False]:
            torch.manual_seed(1)
            model = bench.build_model(
                path, len(data.src_vocab), len(data.tgt_vocab), cfg
            ).train()
            opt = bench.make_adam(model, cfg, fused=args.adam == "fused")
            for b in batches[:2]:
                bench.train_step(model, opt, b, cfg, bf16)
            t0 = time.perf_counter()
            for b in batches:
                bench.train_step(model, opt, b, cfg, bf16)
            dt = time.perf_counter() - t0
            handles = label_dropouts(model) if args.categories else []
            with profile(
                activities=[ProfilerActivity.CPU],
                record_shapes=args.by_shape or args.categories,
            ) as prof:
                for b in batches:
                    bench.train_step(model, opt, b, cfg, bf16)
            for handle in handles:
                handle.remove()
            title = (
                f"{'nn.Transformer' if path == 'torch' else path + ' path'}, "
                f"{'bf16' if bf16 else 'float32'}, "
                f"{args.adam} Adam"
            )
            print(f"\n### {title}: {tokens / dt:,.0f} target tokens/s")
            if args.categories:
                columns[title] = (
                    by_category(prof.events(), len(batches)),
                    matmul_rate(prof.events()),
                )
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.top
                )
            )
            if args.by_shape:
                print(
                    prof.key_averages(group_by_input_shape=True).table(
                        sort_by="self_cpu_time_total",
                        row_limit=4 * args.top,
                        max_name_column_width=40,
                        max_shapes_column_width=80,
                    )
                )
    if columns:
        print(
            f"\n### self CPU ms per step by kind of work ({len(batches)} profiled "
            "steps)\n"
        )
        print("| kind of work | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
        for kind in CATEGORIES:
            print(
                f"| {kind} | "
                + " | ".join(f"{c[kind]:.1f}" for c, _ in columns.values())
                + " |"
            )
        print(
            "| all | "
            + " | ".join(f"{sum(c.values()):.1f}" for c, _ in columns.values())
            + " |"
        )
        print(
            "\nmatrix products while they ran, GFLOP/s (2·m·k·n from the shapes over "
            "their time): "
            + ", ".join(f"{title}: {rate:.1f}" for title, (_, rate) in columns.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

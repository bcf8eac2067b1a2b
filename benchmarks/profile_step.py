"""Where a training step's time goes: torch.profiler by operator, per attention path and precision.

Run from the repository root (needs the Multi30k data; set ``DATA_MIRROR`` when offline)::

    python benchmarks/profile_step.py                 # multi30k-small, both paths, float32 and bf16
    python benchmarks/profile_step.py --steps 4 --top 12
    python benchmarks/profile_step.py --paths readable --loss autograd,one-pass,fused   # the three losses
    python benchmarks/profile_step.py --paths fast/nn.Dropout --loss autograd --adam per-tensor   # the preset before

For each (attention path, precision) it times ``--steps`` full training steps (forward,
label-smoothed loss, backward, clipping, fused Adam) on the same length-bucketed Multi30k batches
after two warm-up steps, prints the target tokens/s, then profiles the same steps and prints
the operators with the most self CPU time. A path is one of ``bench.build_model``'s kinds
(``fast``, ``readable``, with ``/nn.Dropout`` or ``/FastDropout`` after it for those dropouts);
``--adam per-tensor`` steps Adam one parameter at a time (``torch.optim.Adam``'s default on a
CPU, what training used before the fused kernel) instead of the fused kernel training uses. bf16 rows appear only where the CPU computes
bf16 natively (see ``native_bf16`` in the module).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


def main(argv) -> int:
    """Profile training steps of ``--config`` for each attention path and precision."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="multi30k-small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--paths", default="fast,readable")
    parser.add_argument("--by-shape", action="store_true", help="also group the operators by their input shapes")
    parser.add_argument("--loss", default="one-pass",
                        help="one-pass (loss_sum_one_pass, what the presets train with), autograd (loss_sum, the "
                             "same numbers with autograd's backward), fused (Config.fused_loss); several: a,b")
    parser.add_argument("--adam", choices=("fused", "per-tensor"), default="fused")
    args = parser.parse_args(argv)
    unknown = set(args.loss.split(",")) - {"one-pass", "autograd", "fused"}
    if unknown:
        parser.error(f"--loss: unknown {', '.join(sorted(unknown))} (one-pass, autograd, fused)")
    cfg = tat.get_config(args.config)
    data = tat.load_dataset(cfg, log=lambda *a: None)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = [tat.make_batch(pairs, idx) for idx in tat.length_batches(lengths, cfg.batch_tokens, seed=1)[: args.steps]]
    tokens = sum(b.ntokens for b in batches)
    native, _ = tat.native_bf16(torch.device("cpu"))
    for path in args.paths.split(","):
        for bf16 in ([False, True] if native else [False]):
            for loss in args.loss.split(","):
                torch.manual_seed(1)
                model = bench.build_model(path, len(data.src_vocab), len(data.tgt_vocab), cfg).train()
                opt = bench.make_adam(model, cfg, fused=args.adam == "fused")
                for b in batches[:2]:
                    bench.train_step(model, opt, b, cfg, bf16, loss=loss)
                t0 = time.perf_counter()
                for b in batches:
                    bench.train_step(model, opt, b, cfg, bf16, loss=loss)
                dt = time.perf_counter() - t0
                with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
                    for b in batches:
                        bench.train_step(model, opt, b, cfg, bf16, loss=loss)
                print(f"\n### {path} path, {'bf16' if bf16 else 'float32'}, {loss} loss, {args.adam} Adam: "
                      f"{tokens / dt:,.0f} target tokens/s")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
                if args.by_shape:
                    print(prof.key_averages(group_by_input_shape=True).table(
                        sort_by="self_cpu_time_total", row_limit=4 * args.top, max_name_column_width=40,
                        max_shapes_column_width=80))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

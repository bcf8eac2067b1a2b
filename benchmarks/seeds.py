"""The headline's spread (our addition): `multi30k-small` trained as `make train` trains
it, with other seeds, and the test BLEU of every seed beside the recorded run's.

The README's headline, 41.8 BLEU, is one run (seed 1, `results/multi30k-small.json`).
What a user should expect on their own machine is that figure's spread over seeds, and
which precision and attention path `auto` took in each run (a run on another CPU may
take another, and its numbers differ with it). Each seed trains in a run directory of
its own, resuming from its checkpoints when stopped; a seed whose run has finished is
read, not trained again. The file records each seed's scores, the precision and
attention path its run took (and its CPU threads, where its run records them), the CPU,
the commit its run started from (and those it was resumed from), any other setting than
the first row's, and mean, sample standard deviation and range over all seeds, the
recorded run included::

    make seeds                      # seeds 2 and 3, each as long as a make train
    make seeds ARGS="--seeds 2,3,4"

A seed is started or resumed only from a commit (the runner refuses a tree with
uncommitted changes, as Table 3's does). Its folders and file are named after the
preset (``runs/seeds/CONFIG/seed-S``, ``results/CONFIG-seeds.json``)."""

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from table3 import commit  # noqa: E402
from table3_work import write_json  # noqa: E402

from machinery.devices import quiet_environment  # noqa: E402
from machinery.runfiles import RESULT_NEUTRAL  # noqa: E402

# What each seed's row keeps of its run's results.json.
KEPT = (
    "bleu",
    "bleu_greedy",
    "precision",
    "attention",
    "threads",  # a CPU run's: float sums split over threads round otherwise
    "auto",
    "machine",
    "steps",
    "train_minutes",
)  # and ``other_settings``: what its run ran with other than the first row's


def seed_row(summary: dict, seed: int, started: Optional[str]) -> dict:
    """One seed's row: its seed, the commit its run started from, and the ``KEPT``
    values of its run's summary (an earlier summary names its machine ``cpu``)."""
    kept = {k: summary.get(k) for k in KEPT}
    kept["machine"] = kept["machine"] or summary.get("cpu")
    return {"seed": seed, "commit": started, **kept}


def differences(config: dict, reference: dict) -> dict:
    """The settings of ``config`` other than ``reference``'s, the seed and the
    settings that do not change a result apart (``RESULT_NEUTRAL``: the precision and
    attention path a run took are in its row): {field: (this, reference's)}."""
    return {
        k: (config.get(k), reference.get(k))
        for k in sorted(set(config) | set(reference))
        if k != "seed" and k not in RESULT_NEUTRAL and config.get(k) != reference.get(k)
    }


def spread(rows: Sequence[dict], key: str = "bleu") -> dict:
    """Mean, sample standard deviation (n − 1), lowest and highest of ``key`` over
    ``rows``; the deviation is None for fewer than two."""
    values = [
        r[key]
        for r in rows
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "sd": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values, default=None),
        "max": max(values, default=None),
    }


def commits_of(run_dir: Path) -> list[str]:
    """The commits a seed's run was started and resumed from (``started.json``; [] for
    a run trained by hand)."""
    try:
        return list(json.loads((run_dir / "started.json").read_text("utf-8")))
    except (OSError, ValueError, TypeError):
        return []


def train_seed(
    python: str, config: str, seed: int, run_dir: Path, extra, head: str
) -> int:
    """Train (or resume) seed ``seed`` of preset ``config`` in ``run_dir``, as `make
    train` does, noting the commit ``head`` it starts or resumes from; the program's
    exit status."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(run_dir.glob("checkpoint-*.pt"))  # nothing to resume: start over
    write_json(
        run_dir / "started.json", [*([] if fresh else commits_of(run_dir)), head]
    )
    program = [python, str(ROOT / "the_annotated_transformer.py"), "train"]
    options = ["--config", config, "--seed", str(seed), "--run_dir", str(run_dir)]
    command = [*program, *options, *extra]
    return subprocess.run(command, env=quiet_environment()).returncode


def main(argv: Sequence[str]) -> int:
    """Train the seeds not yet finished, then write the file; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="2,3", help="comma-separated seeds")
    parser.add_argument("--config", default="multi30k-small", help="the preset")
    parser.add_argument(
        "--recorded",
        default=None,
        help="the recorded run's summary, read as one more seed (default: "
        "results/CONFIG.json)",
    )
    parser.add_argument(
        "--runs", default="runs/seeds", help="the seeds' run folders (in CONFIG/)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the file written (default: results/CONFIG-seeds.json)",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter that trains"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="for the tests: a tree with uncommitted changes is allowed",
    )
    args, extra = parser.parse_known_args(list(argv))
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give whole numbers, e.g. 2,3")
    out = Path(args.out or f"results/{args.config}-seeds.json")
    runs = Path(args.runs) / args.config
    rows, configs = [], []
    recorded = Path(args.recorded or f"results/{args.config}.json")
    if recorded.is_file():
        summary = json.loads(recorded.read_text("utf-8"))
        seed = (summary.get("config") or {}).get("seed")
        if seed in seeds:
            print(
                f"seeds.py: error: seed {seed} is the recorded run's "
                f"({recorded}): give other seeds",
                file=sys.stderr,
            )
            return 2
        rows.append({**seed_row(summary, seed, None), "recorded": str(recorded)})
        configs.append(summary.get("config") or {})
    for seed in seeds:
        run_dir = runs / f"seed-{seed}"
        if not (run_dir / "results.json").is_file():
            head = commit((out,), None, ROOT)  # before each seed: runs take hours
            if not args.smoke and head.endswith("+changes"):
                print(
                    f"seeds.py: error: seed {seed} not started: the working tree has "
                    "uncommitted changes (commit or stash them, then run again)",
                    file=sys.stderr,
                )
                return 2
            print(f"[seeds] seed {seed}: training in {run_dir}", file=sys.stderr)
            code = train_seed(args.python, args.config, seed, run_dir, extra, head)
            if code != 0:
                print(
                    f"[seeds] seed {seed}: training ended with {code}", file=sys.stderr
                )
                return code
        summary = json.loads((run_dir / "results.json").read_text("utf-8"))
        if (summary.get("config") or {}).get("seed") != seed:
            print(
                f"seeds.py: error: {run_dir} holds a run of another seed: move it "
                "away, then run again",
                file=sys.stderr,
            )
            return 2
        commits = commits_of(run_dir)
        row = seed_row(summary, seed, commits[0] if commits else None)
        rows.append({**row, "resumed_from": commits[1:]})
        configs.append(summary.get("config") or {})
    for row, config in zip(rows, configs):  # a seed is the only difference meant
        row["other_settings"] = differences(config, configs[0])
    data = {
        "config": args.config,
        "rows": rows,
        "bleu": spread(rows, "bleu"),
        "bleu_greedy": spread(rows, "bleu_greedy"),
    }
    write_json(out, data)
    s = data["bleu"]
    if s["n"]:
        sd = "" if s["sd"] is None else f" ± {s['sd']:.2f}"
        print(
            f"test BLEU over {s['n']} seed(s): {s['mean']:.2f}{sd} "
            f"({s['min']:.2f}–{s['max']:.2f}); wrote {out}"
        )
    return 0 if s["n"] == len(rows) else 1  # every seed scored


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

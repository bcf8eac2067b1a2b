"""Table 3 (§6.2, "Model Variations") at our scale: training runs per row, seeds apart.

§6.2 varies the base model one setting at a time — (A) heads, (B) the key size d_k,
(C) depth and width, (D) dropout and label smoothing, (E) learned positions — and
reports each row's perplexity, BLEU and parameter count on the development set
(Table 3). This script does the same around the ``multi30k-small`` preset (N=3,
d_model=256, d_ff=1024, h=8, d_k=32, P_drop=0.1, eps_ls=0.1): every row is that preset
with a few fields changed and trained on the preset's whole schedule (15 epochs, 3,225
updates, warm-up 1,000), so the base row is the headline run's model and schedule.
Each variation runs with seeds 1 and 2, the base with 1–3, and a third seed where
either measure's test lies within 20% of its threshold (``table3_stats.py`` holds the
test). Two more rows (C-d128-lr, C-d512-lr) hold Eq. 3's d_model^-0.5 apart from the
width. Every row is trained through the command line with the same explicit precision
and attention path, on one thread (two for a row wider than the base)::

    OMP_NUM_THREADS=1 python the_annotated_transformer.py train --config \
        multi30k-small --run_dir runs/table3/<row> --precision fp32 ... --<field> <v>

then scored on the validation set (``evaluate --split valid``, beam 4, last
checkpoint: no averaging, as §6.2), its translations kept, and checked for whether its
model reads its source (``benchmarks/source_use.py``: the validation loss with each
pair's own source and with another's; below a 1-nat gap the run failed to train). It
trains and scores rows only through those command lines and the files a run writes;
the package's readers give it the validation references for the paired
sentence-level test of each run against its seed's base.

Run from the repository root::

    python benchmarks/table3.py                   # every row, on this machine's cores
    python benchmarks/table3.py --rows base,A     # some rows (names or groups)
    python benchmarks/table3.py --engine ray --address HOST:PORT   # a Ray cluster
    python benchmarks/table3.py --engine slurm --partition P       # SLURM (submitit)
    python benchmarks/table3.py --smoke           # copy preset, a few updates (<60 s)
    python benchmarks/table3.py --refresh         # summary and figures again, no run
    python benchmarks/table3.py --status          # how far each row has got

This process is the one writer of ``results/table3.json`` (atomically, after every
run), ``results/table3.png``, ``results/table3-curves.png`` and the kept translations
``results/table3-hypotheses/<row>.txt`` (validation) and ``.../test/<row>.txt`` (test,
as its test BLEU scored them); each row's run directory keeps its
``valid_bleu.json`` and ``source_use.json``. A run already in the file is not made
again; an interrupted one continues from the checkpoints in its run directory. The
file records one budget (updates, warm-up, lr_factor, batch size, precision,
attention, threads) and refuses a row trained with another, or on another thread
count than its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import table3_stats as stats  # noqa: E402
from table3_engines import (  # noqa: E402
    EngineError,
    make_engine,
    probe_token,
    usable_cores,
)
from table3_figures import draw, draw_curves  # noqa: E402
from table3_work import (  # noqa: E402
    RowJob,
    command,
    newest_checkpoint,
    program_options,
    relative,
    sha256_of,
    valid_curve,
    write_json,
)

# The base of each table: the preset's values of the fields Table 3 varies (§6.2).
BASE = {
    "N": 3,
    "d_model": 256,
    "d_ff": 1024,
    "h": 8,
    "d_k": 32,
    "P_drop": 0.1,
    "eps_ls": 0.1,
}
SMOKE_BASE = {
    "N": 2,
    "d_model": 64,
    "d_ff": 128,
    "h": 4,
    "d_k": 16,
    "P_drop": 0.0,
    "eps_ls": 0.1,
}  # the `copy` preset's values

# The paper's Table 3 (§6.2): (PPL dev, BLEU dev, params ×10^6; None where the cell is
# blank, i.e. the base model's), English→German, newstest2013, no checkpoint averaging.
PAPER = {
    "base": (4.92, 25.8, 65),
    "(A) h=1, d_k=d_v=512": (5.29, 24.9, None),
    "(A) h=4, d_k=d_v=128": (5.00, 25.5, None),
    "(A) h=16, d_k=d_v=32": (4.91, 25.8, None),
    "(A) h=32, d_k=d_v=16": (5.01, 25.4, None),
    "(B) d_k=16": (5.16, 25.1, 58),
    "(B) d_k=32": (5.01, 25.4, 60),
    "(C) N=2": (6.11, 23.7, 36),
    "(C) N=4": (5.19, 25.3, 50),
    "(C) N=8": (4.88, 25.5, 80),
    "(C) d_model=256, d_k=d_v=32": (5.75, 24.5, 28),
    "(C) d_model=1024, d_k=d_v=128": (4.66, 26.0, 168),
    "(C) d_ff=1024": (5.12, 25.4, 53),
    "(C) d_ff=4096": (4.75, 26.2, 90),
    "(D) P_drop=0.0": (5.77, 24.6, None),
    "(D) P_drop=0.2": (4.95, 25.5, None),
    "(D) eps_ls=0.0": (4.67, 25.3, None),
    "(D) eps_ls=0.2": (5.47, 25.7, None),
    "(E) positional embedding instead of sinusoids": (4.92, 25.7, None),
}
PAPER_NOTE = (
    "the paper's Table 3 (§6.2): English→German, newstest2013 (dev), "
    "perplexity per word-piece, beam search, no checkpoint averaging; "
    "params_million null where the paper leaves the cell blank (the base's)"
)


# The budget every row shares, passed on every command line so that a change of the
# preset cannot change a row silently: multi30k-small's own schedule (a test keeps these
# equal to the preset), fp32 and the fast attention path on every chip (no timing-based
# choice), one thread per row, and the last checkpoint scored (§6.2: no averaging).
# A row wider than the base (d_model doubled: about 2.6 times the base's parameters, and
# so its compute) trains on ``wide_threads``, alone on a two-core machine, to shorten
# its wall time; which rows those are is fixed here, and the file refuses a row that
# ran with another count than its own.
BUDGET = {
    "preset": "multi30k-small",
    "epochs": 15,
    "warmup": 1000,
    "lr_factor": 0.7,
    "batch_tokens": 2500,
    "precision": "fp32",
    "attention": "fast",
    "threads": 1,
    "wide_threads": 2,
    "average_last": 0,
}
SMOKE_BUDGET = {
    "preset": "copy",
    "epochs": 1,
    "warmup": 200,
    "lr_factor": 1.0,
    "batch_tokens": 1280,
    "precision": "fp32",
    "attention": "fast",
    "threads": 1,
    "wide_threads": 2,
    "average_last": 0,
    "max_steps": 5,
    "max_eval_sentences": 20,
}
# What a row must have run with for the file to hold it (besides its own fields).
# The seeds every variation runs; a third only where the test asks for it
# (`decide`), a learning-rate control's second never by the rule.
SEEDS = {"base": (1, 2, 3), "variation": (1, 2), "control": (1,)}


def variations(base: dict, lr_factor: float) -> list[tuple]:
    """The variations of §6.2, Table 3 as (name, group, fields, paper row), seed aside.

    (A) h ∈ {1, 4, 16, 32} with d_k = d_model/h (constant compute); (D) P_drop and
    eps_ls ∈ {0.0, 0.2}; (B) d_k ∈ {d_k/4, d_k/2} at the base's h, d_v unchanged (as
    the paper's counts show); (E) learned positions; (C) N ± 1, d_model halved and
    doubled (d_k = d_model/h), d_ff halved and doubled, and the two widths again with
    ``lr_factor`` scaled by √(d_model/base) so that Eq. 3's peak stays the base's. Each
    row names the paper's row with the same ratio to the paper's base (N=6,
    d_model=512, d_ff=2048, d_k=64).
    """
    N, d, ff, h, dk = (base[k] for k in ("N", "d_model", "d_ff", "h", "d_k"))
    out = [("base", "base", {}, "base")]
    for heads in (1, 4, 16, 32):
        out.append(
            (
                f"A-h{heads}",
                "A",
                {"h": heads, "d_k": d // heads},
                f"(A) h={heads}, d_k=d_v={512 // heads}",
            )
        )
    for k, paper in ((dk // 4, "(B) d_k=16"), (dk // 2, "(B) d_k=32")):
        out.append((f"B-dk{k}", "B", {"d_k": k}, paper))
    for p in (0.0, 0.2):
        out.append((f"D-drop{p}", "D", {"P_drop": p}, f"(D) P_drop={p}"))
    for e in (0.0, 0.2):
        out.append((f"D-ls{e}", "D", {"eps_ls": e}, f"(D) eps_ls={e}"))
    out.append(
        (
            "E-learned",
            "E",
            {"positional": "learned"},
            "(E) positional embedding instead of sinusoids",
        )
    )
    small, large = d // 2, d * 2
    out += [
        (f"C-N{N - 1}", "C", {"N": N - 1}, "(C) N=4"),
        (f"C-N{N + 1}", "C", {"N": N + 1}, "(C) N=8"),
        (f"C-d{small}", "C", {"d_model": small, "d_k": small // h},
         "(C) d_model=256, d_k=d_v=32"),
        (f"C-d{large}", "C", {"d_model": large, "d_k": large // h},
         "(C) d_model=1024, d_k=d_v=128"),
        (f"C-ff{ff // 2}", "C", {"d_ff": ff // 2}, "(C) d_ff=1024"),
        (f"C-ff{ff * 2}", "C", {"d_ff": ff * 2}, "(C) d_ff=4096"),
    ]  # fmt: skip
    for width in (small, large):  # Eq. 3's peak held at the base's
        scaled = round(lr_factor * math.sqrt(width / d), 6)
        out.append(
            (
                f"C-d{width}-lr",
                "C",
                {"d_model": width, "d_k": width // h, "lr_factor": scaled},
                "(C) d_model=256, d_k=d_v=32"
                if width < d
                else "(C) d_model=1024, d_k=d_v=128",
            )
        )
    return out


def row_threads(row: dict, base: dict, budget: dict) -> int:
    """The thread count one row of Table 3 (§6.2) trains and is scored with: the
    budget's ``threads``, or its ``wide_threads`` for a row wider than the base."""
    wider = row.get("fields", {}).get("d_model", base["d_model"]) > base["d_model"]
    return budget.get("wide_threads", budget["threads"]) if wider else budget["threads"]


def table3_rows(base: dict, lr_factor: float = BUDGET["lr_factor"]) -> list[dict]:
    """The training runs of §6.2, Table 3 as field overrides of ``base``, in the order
    they run: the base's three seeds; every variation of the paper with seeds 1 and 2
    ((A), (B), (D), (E), then the (C) sizes); then the runs made only where they are
    needed (``if_needed``): a third seed of a variation whose test lies near its
    threshold, and a learning-rate control's second seed (``control``: it answers
    what Eq. 3's rate does, and is tested against no paper row). ``variation`` names
    the row its seeds average into."""
    plain = variations(base, lr_factor)
    ordered = [plain[0]] + [v for v in plain[1:] if v[1] != "C"]
    ordered += [v for v in plain if v[1] == "C"]
    runs = []
    for seed in SEEDS["base"]:
        runs.append((*plain[0], seed, False))
    for seed in (1, 2, 3):
        for name, group, fields, paper in ordered[1:]:
            control = is_control(name)
            if control and seed == 3:
                continue
            if_needed = seed == 3 or (control and seed == 2)
            runs.append((name, group, fields, paper, seed, if_needed))
    return [
        {
            "name": n if seed == 1 else f"{n}-seed{seed}",
            "variation": n,
            "group": g,
            "seed": seed,
            "fields": f | ({"seed": seed} if seed != 1 else {}),
            "paper_row": p,
            "control": is_control(n),
            "if_needed": if_needed,
        }
        for n, g, f, p, seed, if_needed in runs
    ]


def is_control(variation: str) -> bool:
    """Whether a variation is a learning-rate control (C-d128-lr, C-d512-lr): Eq. 3's
    d_model^-0.5 held apart from the width, a row the paper does not have."""
    return variation.endswith("-lr")


def paper_values(label: str) -> dict:
    """The paper's Table 3 (§6.2) numbers for row ``label``, marked as the paper's."""
    ppl, bleu, params = PAPER[label]
    return {
        "row": label,
        "ppl_dev": ppl,
        "bleu_dev": bleu,
        "params_million": params,
        "source": "paper, Table 3 (§6.2), newstest2013 EN→DE",
    }


def row_overrides(row: dict, base: dict, options: set[str]) -> tuple[dict, str]:
    """(fields to pass, note) for a Table 3 (§6.2) row on this version of the program.

    A ``d_k`` equal to d_model/h is what a program without a ``d_k`` field computes
    (§3.2.2), so it is left off the command line there; any other value is passed,
    and the program accepts or rejects it.
    """
    fields, note = dict(row["fields"]), ""
    settings = {**base, **fields}
    implied = settings["d_model"] // settings["h"]
    if "d_k" in fields and "d_k" not in options and fields["d_k"] == implied:
        del fields["d_k"]
        note = (
            "d_k not passed: this version has no d_k field and uses "
            f"d_model/h = {implied}"
        )
    return fields, note


def commit(outputs: tuple = (), kept: Optional[Path] = None, root: Path = ROOT) -> str:
    """The commit the program was at when a row started (``+changes`` when the tree
    had uncommitted changes to tracked files other than the driver's own
    ``outputs``, the results file and its figures, and the files in its folder of
    kept translations ``kept``), for a Table 3 (§6.2) row's provenance."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout
    except OSError:
        return "unknown"
    inside = [Path(o).absolute() for o in outputs]  # outside the tree: untracked
    ours = {str(o.relative_to(root)) for o in inside if o.is_relative_to(root)}
    changed = [line[3:].strip() for line in status.splitlines() if line.strip()]
    if kept is not None and kept.absolute().is_relative_to(root):
        folder = kept.absolute().relative_to(root)
        ours |= {c.split(" -> ")[-1] for c in changed if Path(c).parent == folder}
    dirty = [c for c in changed if c.split(" -> ")[-1] not in ours]
    return (head or "unknown") + ("+changes" if dirty else "")


# The test, stated once (the notebook, the page and the audit quote it from the JSON;
# benchmarks/table3_stats.py holds its arithmetic).
RULE = (
    "Every run that trained is one observation of a two-way model, y = variation + "
    "seed + noise, fitted by least squares over all rows (rows of one seed see the "
    "same batches, so seeds are compared with seeds); y is validation BLEU, or the "
    "log of validation perplexity. A variation's difference from the base is tested "
    "with t on the model's residual degrees of freedom, its standard error set by the "
    "seeds both rows have; Holm's correction holds the family-wise error rate of the "
    "paper's variations at 5% for each measure. The model assumes every "
    "variation's seeds spread alike; Grubbs's test on the differences between each "
    "variation's first two seeds (at 1%, repeated while it rejects) sets apart one "
    "whose seeds lie further apart than that allows: it leaves the estimate of the "
    "noise, and a comparison with it is a paired t-test on the seeds both rows have "
    "(one degree of freedom with two seeds). A difference the test finds agrees "
    "with the paper when it has the sign of the paper's own difference (its dev "
    "score minus the base's; within one step of the paper's rounding, 0.1 BLEU or "
    "0.01 perplexity, the paper saw no change) and disagrees otherwise; a difference "
    "it does not find is reported as no difference detected, with the smallest true "
    "difference the test would detect with probability 0.8. A variation with a run "
    "still learning when its schedule ended enters no test and no estimate of the "
    "noise (its seeds measure how far each got), and one with a seed that failed to "
    "train is not counted as agreeing. The learning-rate controls are compared with "
    "the same width at Eq. 3's own rate and get no verdict against the paper. A "
    "third seed runs where a test's difference lies within 20% of its threshold, "
    "or where a variation's seeds are set apart. A "
    "run whose validation loss rises by less than 1 nat per target token when each "
    "pair is given another pair's source has not learnt to read its source: it "
    "failed to train, is shown apart, and enters no test."
)
# Below this gap (nats per target token) a run's decoder is a language model of the
# target side, not a translation model (benchmarks/source_use.py measures it).
SOURCE_GAP_MIN = 1.0


def trained(row: dict) -> bool:
    """Whether a finished run of Table 3 (§6.2) learnt to read its source (a record
    without the measurement counts as trained)."""
    gap = row.get("source_gap")
    return gap is None or gap >= SOURCE_GAP_MIN


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value), min and max."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": n}


def seeds_by_variation(data: dict) -> dict[str, list[dict]]:
    """The finished rows of a Table 3 (§6.2) file, grouped by the variation whose seeds
    they are; a row whose epoch-1 check found another perplexity than its record is
    left out until it is trained again."""
    by: dict[str, list[dict]] = {}
    for r in data["rows"]:
        if finished(r) and not check_failed(r):
            by.setdefault(r.get("variation", r["name"]), []).append(r)
    return by


def controlled(variation: str) -> str:
    """The variation a learning-rate control holds Eq. 3's rate apart from."""
    from machinery.table3view import controlled_name

    return controlled_name(variation)


def unsettled(data: dict) -> set[str]:
    """The variations (the base aside) with a trained run still learning when its
    schedule ended: their seeds measure how far each got, not where the variation
    ends, and they may differ by far more than the seeds of finished runs do (C-d128:
    15.56 and 40.81 validation BLEU), so they enter no test and no estimate of the
    noise."""
    from machinery.table3view import still_learning

    return {
        v
        for v, rs in seeds_by_variation(data).items()
        if v != "base"
        and any(trained(r) and still_learning(r.get("curve") or []) for r in rs)
    }


def tests_of(data: dict) -> dict[str, dict]:
    """Both measures' tests (table3_stats.test_table) over the file's trained runs,
    the unsettled variations apart: {"bleu": {variation: test}, "ppl": {...}}."""
    left_out = unsettled(data)
    runs = {
        v: [(r.get("seed", 1), r) for r in rs if trained(r)]
        for v, rs in seeds_by_variation(data).items()
        if v not in left_out
    }
    runs = {v: rs for v, rs in runs.items() if rs}
    paper = {
        v: rs[0][1]["paper"]
        for v, rs in runs.items()
        if v != "base" and not is_control(v)
    }
    controls = {v: controlled(v) for v in runs if is_control(v)}
    return {m: stats.test_table(runs, paper, controls, m) for m in stats.MEASURES}


def qualifiers(rows: list[dict]) -> list[str]:
    """What a reader must know beside a variation's verdict: one seed, a seed still
    learning when its schedule ended, a seed that failed to train."""
    from machinery.table3view import still_learning

    out = []
    ok = [r for r in rows if trained(r)]
    if len(ok) == 1:
        out.append("one seed")
    if any(still_learning(r.get("curve") or []) for r in ok):
        out.append("still learning at the end of its schedule")
    if len(ok) < len(rows):
        out.append("a seed failed to train")
    return out


def spread_words(variation: str) -> str:
    """The qualifier of a test paired on its seeds because ``variation``'s seeds lie
    further apart than the other variations' allow (table3_stats.spread_apart)."""
    whose = "the base's" if variation == "base" else "its"
    return f"{whose} seeds lie far apart: compared seed by seed"


def verdict_words(test: dict, quals: list[str], measure: str) -> tuple[str, str]:
    """(the words a reader sees, the category counted): "agrees", "disagrees" or
    "no difference detected (the test would see ≥ X)", with the qualifiers; a
    variation with a failed seed is counted as "not counted" where it would agree
    (one still learning is never tested: see `unsettled`). A test paired on its
    seeds because the check of σ set a row apart says which."""
    word = test["word"]
    quals = quals + [
        spread_words(step["variation"]) for step in test.get("spread_check", [])
    ]
    if (
        word == "no difference detected"
        and measure == "bleu"
        and (test["detectable"] > 100)
    ):  # more than BLEU's whole scale
        word = "no difference detected (the test would see only one above 100 BLEU)"
    elif word == "no difference detected":
        x = (
            f"{test['detectable']:.2f} BLEU"
            if measure == "bleu"
            else f"{test['detectable_pct']:.1f}% perplexity"
        )
        word = f"no difference detected (the test would see ≥ {x})"
    said = word + (f" ({'; '.join(quals)})" if quals else "")
    counted = test["word"]
    blocking = {"still learning at the end of its schedule", "a seed failed to train"}
    if counted == "agrees" and blocking & set(quals):
        counted = "not counted"
    return said, counted


def summarise(data: dict) -> list[dict]:
    """Per variation of Table 3 (§6.2): its seeds' mean and spread of validation
    perplexity and BLEU and of test BLEU (over the seeds that trained), the seeds
    that failed to train, and, for both measures, the test against the base (Δ, 95%
    interval, p, Holm's level, the detectable difference) with its verdict against
    the paper's row, or for a learning-rate control its difference from the same
    width at Eq. 3's rate."""
    by = seeds_by_variation(data)
    tests, left_out = tests_of(data), unsettled(data)
    out = []
    for name, rs in by.items():
        first, ok = rs[0], [r for r in rs if trained(r)]
        counted = ok or rs  # the seeds that trained; all, where none did
        gaps = [r["source_gap"] for r in rs if r.get("source_gap") is not None]
        entry = {
            "variation": name,
            "group": first["group"],
            "control": is_control(name),
            "seeds": sorted(r.get("seed", 1) for r in rs),
            "failed_seeds": sorted(r.get("seed", 1) for r in rs if not trained(r)),
            "params": first["params"],
            "valid_ppl": spread([r["valid_ppl"] for r in counted]),
            "valid_bleu": spread([r["valid_bleu"] for r in counted]),
            "test_bleu": spread([r["bleu"] for r in counted]),
            "source_gap": spread(gaps) if gaps else None,
            "paper": first["paper"],
            "paper_row": first["paper"]["row"],
        }
        paired = [
            {"seed": r.get("seed", 1)} | {k: r["paired"][k] for k in ("delta", "p")}
            for r in rs
            if r.get("paired")
        ]
        if paired:
            entry["paired"] = paired  # the sentence-level test, seed by seed
        if name != "base":
            quals = qualifiers(rs)
            entry["qualifiers"] = quals
            entry["tests"] = {m: tests[m][name] for m in tests if name in tests[m]}
            if not ok:
                entry["verdict"] = {m: "fails to train" for m in stats.MEASURES}
                entry["counted"] = {m: "not counted" for m in stats.MEASURES}
            elif not any(trained(r) for r in by.get("base", [])):
                entry["verdict"] = {m: "base fails to train" for m in stats.MEASURES}
            elif entry["control"]:
                entry["verdict"] = {m: "control" for m in stats.MEASURES}
            elif name in left_out:
                said = "not tested (" + "; ".join(quals) + ")"
                entry["verdict"] = {m: said for m in stats.MEASURES}
                entry["counted"] = {m: "not counted" for m in stats.MEASURES}
            elif any(tests.values()):  # the test ran: a variation it left out says so
                from machinery.table3view import UNCOMPARED as uncompared

                words = {
                    m: verdict_words(entry["tests"][m], quals, m)
                    if m in entry["tests"]
                    else (uncompared, "not counted")
                    for m in stats.MEASURES
                }
                entry["verdict"] = {m: w[0] for m, w in words.items()}
                entry["counted"] = {m: w[1] for m, w in words.items()}
        out.append(entry)
    return out


def required_done(data: dict, base: dict, budget: dict) -> bool:
    """Whether every run the plan always makes has finished: the third seeds wait for
    this, since Holm's levels depend on every variation's test."""
    done = {r["name"] for r in data["rows"] if finished(r)}
    rows = table3_rows(base, budget["lr_factor"])
    return all(r["name"] in done for r in rows if not r["if_needed"])


def decide(row: dict, data: dict, base: dict, budget: dict) -> tuple[str, str]:
    """Whether a run of the plan is to be made now: ("run", ""), ("skip", why) or
    ("wait", why). A run the plan always makes runs; a learning-rate control's second
    seed is never needed; a third seed waits for every other run, then runs where
    either measure's test lies within 20% of its threshold, or where the check of σ
    set the variation's own seeds apart (a third seed gives its paired test a second
    degree of freedom)."""
    if not row["if_needed"]:
        return "run", ""
    if row["control"]:
        return "skip", (
            "a learning-rate control: one seed shows what the rate does, and it is "
            "tested against no paper row"
        )
    if not required_done(data, base, budget):
        return "wait", "a third seed is decided once every other run has finished"
    entry = next(
        (s for s in summarise(data) if s["variation"] == row["variation"]), None
    )
    if entry is not None and not entry.get("tests"):
        said = sorted(set((entry.get("verdict") or {}).values())) or ["no test"]
        return "skip", f"no test to decide: {'; '.join(said)}"
    near = [
        f"{m} |Δ| {abs(t['delta']):.3g} against a threshold of {t['threshold']:.3g}"
        for m, t in (entry or {}).get("tests", {}).items()
        if t.get("near_threshold")
    ]
    apart = [
        m
        for m, t in (entry or {}).get("tests", {}).items()
        if any(c["variation"] == row["variation"] for c in t.get("spread_check", []))
    ]
    if near or apart:
        return "run", ""
    return "skip", (
        "both tests lie beyond 20% of their thresholds and its seeds lie together"
    )


def finished(row: dict) -> bool:
    """Whether a record of Table 3 (§6.2) is a finished row the table can use."""
    return row.get("status") == "done"


def select(rows: list[dict], wanted: Optional[str]) -> list[dict]:
    """The Table 3 (§6.2) rows named by ``--rows`` (names, variations or groups), in
    run order."""
    if not wanted:
        return rows
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    known = {r[k] for r in rows for k in ("name", "group", "variation")}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"error: unknown row(s) {', '.join(unknown)}; rows: "
            f"{', '.join(r['name'] for r in rows)} (or a group: base, A–E)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return [r for r in rows if {r["name"], r["group"], r["variation"]} & set(names)]


def budget_record(budget: dict) -> dict:
    """What one Table 3 (§6.2) file's rows share, as the file records it."""
    return dict(budget) | {
        "note": (
            "every row: the preset's whole schedule (rows of one seed see the same "
            "batches), the last checkpoint scored (§6.2: no checkpoint averaging); "
            "the precision, attention path and thread count given explicitly, never "
            "measured"
        )
    }


def same_budget(a: dict, b: dict) -> bool:
    """Whether two Table 3 (§6.2) budgets agree (their notes and the update count,
    which the first finished row records, aside)."""
    keep = lambda d: {k: v for k, v in d.items() if k not in ("note", "updates")}  # noqa: E731
    return keep(a) == keep(b)


def plan_of(base: dict, budget: dict) -> list[dict]:
    """Every variation of Table 3 (§6.2) the file will hold, in run order, with its
    changed fields, the seeds it always runs (``seeds``), those it runs only where the
    test asks (``seeds_if_needed``) and the paper's row: what the table shows before
    its rows have finished."""
    plan: dict[str, dict] = {}
    for r in table3_rows(base, budget["lr_factor"]):
        entry = plan.setdefault(
            r["variation"],
            {
                "variation": r["variation"],
                "group": r["group"],
                "control": r["control"],
                "fields": {k: v for k, v in r["fields"].items() if k != "seed"},
                "seeds": [],
                "seeds_if_needed": [],
                "paper": paper_values(r["paper_row"]),
            },
        )
        entry["seeds_if_needed" if r["if_needed"] else "seeds"].append(r["seed"])
    return list(plan.values())


def fresh_table(base: dict, budget: dict, smoke: bool) -> dict:
    """An empty Table 3 (§6.2) file for ``budget``."""
    return {
        "table": "Table 3 (§6.2, model variations) at our scale",
        "preset": budget["preset"],
        "dataset_valid": "copy task"
        if smoke
        else "Multi30k val (1,014 pairs), detokenized cased sacreBLEU",
        "dataset": "copy task"
        if smoke
        else "Multi30k test2016, detokenized cased sacreBLEU",
        "base": base,
        "budget": budget_record(budget),
        "rule": RULE,
        "paper_note": PAPER_NOTE,
        "plan": plan_of(base, budget),
        "rows": [],
        "summary": [],
    }


class TableError(Exception):
    """A results file or an option the driver cannot use, said in one line."""


NUMBERS = ("valid_bleu", "valid_ppl", "bleu", "source_gap", "bleu_greedy", "params")


def number(value) -> bool:
    """Whether ``value`` is a finite number (a bool is not one)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def table_problem(data, groups: set[str]) -> Optional[str]:
    """Why ``data`` is not a Table 3 (§6.2) file this driver can use, or None: it
    must be an object whose ``rows`` is a list of records, each named, of a known
    group, and a finished one with a finite number for every score it has."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    if not isinstance(data.get("budget", {}), dict):
        return '"budget" is not an object'
    rows = data.get("rows", [])
    if not isinstance(rows, list):
        return '"rows" is not a list'
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            return f"row {i + 1} is not a record with a name"
        if r.get("group") not in groups:
            return f"row {r['name']} has an unknown group {r.get('group')!r}"
        if r.get("status") != "done":
            continue
        for key in NUMBERS:
            if (key in r or key in ("valid_bleu", "valid_ppl")) and not (
                key == "source_gap" and r.get(key) is None
            ):
                if not number(r.get(key)):
                    return f"row {r['name']}: {key} is {r.get(key)!r}, not a number"
        if not isinstance(r.get("provenance"), dict):
            return f"row {r['name']} has no provenance"
    return None


def checked_out(path: Path) -> Path:
    """``--out`` as the system resolves it (a symlink followed, then ``..``), refused
    in one line where no file can be written there."""
    resolved = Path(os.path.realpath(path))
    if resolved.is_dir():
        raise TableError(f"--out {path} is a directory; give a .json file's path")
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise TableError(f"--out {path}: {parent} is a file, not a folder")
    return resolved


def read_table(out: Path, base: dict, budget: dict, smoke: bool) -> dict:
    """The Table 3 (§6.2) file at ``out`` (a fresh one if there is none); TableError
    where it cannot be read, is not a Table 3 file, or holds rows trained with
    another budget (a file without finished rows takes the budget asked for)."""
    if not out.exists():
        return fresh_table(base, budget, smoke)
    try:
        data = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not JSON"
        raise TableError(
            f"{out} cannot be read as a Table 3 file ({why}); it is left as it is: "
            "give another --out, or restore it"
        ) from None
    groups = {"base", *GROUPS}
    if problem := table_problem(data, groups):
        raise TableError(
            f"{out} is not a Table 3 file this driver can use: {problem}; it is left "
            "as it is"
        )
    if not any(finished(r) for r in data.get("rows", [])):
        data["budget"] = budget_record(budget)  # nothing trained: the budget asked
    if not same_budget(data.get("budget", {}), budget_record(budget)):
        was, now = (
            {k: v for k, v in b.items() if k != "note"}
            for b in (data.get("budget", {}), budget)
        )
        raise TableError(
            f"{out} holds rows trained with budget {was}, not {now}; one file holds "
            "one budget: give another --out or the same budget"
        )
    data["budget"]["note"] = budget_record(budget)["note"]  # its wording, kept current
    return fresh_table(base, budget, smoke) | data


GROUPS = "ABCDE"


def merge(data: dict, record: dict, base: dict, budget: dict, order) -> Optional[str]:
    """Add one row's record to the table ``data`` (in place), refusing a finished row
    whose recorded budget differs from the file's; returns the refusal, or None."""
    if finished(record):
        problem = budget_problem(data, record, row_threads(record, base, budget))
        if problem:
            return problem
        data["budget"].setdefault("updates", record["provenance"]["updates"])
    data["rows"] = sorted(
        [o for o in data["rows"] if o["name"] != record["name"]] + [record],
        key=lambda r: order.index(r["name"]) if r["name"] in order else 10**6,
    )
    return None


def write_table(out: Path, data: dict) -> None:
    """Write a Table 3 (§6.2) file and redraw its two figures beside it."""
    write_json(out, data)
    draw(data, out.with_suffix(".png"))
    draw_curves(data, out.with_name(out.stem + "-curves.png"))


def hypotheses_folder(out: Path) -> Path:
    """Where the rows' translations are kept beside the table file:
    ``results/table3-hypotheses/<row>.txt`` for ``results/table3.json`` (validation),
    its ``test/<row>.txt`` (test)."""
    return out.with_name(out.stem + "-hypotheses")


def base_of(record: dict) -> str:
    """The name of the base run of ``record``'s seed (the run it is paired with)."""
    seed = record.get("seed", 1)
    return "base" if seed == 1 else f"base-seed{seed}"


def kept_hypotheses(record: dict, folder: Path, split: str = "valid") -> Optional[Path]:
    """The file of ``record``'s validation (or test) translations beside the table,
    ``<row>.txt`` (``test/<row>.txt``), copied there from its run directory the first
    time; None where neither holds the translations the record's SHA-256 names."""
    key = "hypotheses" if split == "valid" else f"{split}_hypotheses"
    sha = (record.get("provenance") or {}).get(f"{key}_sha256")
    if not finished(record) or not sha:
        return None
    kept = (folder if split == "valid" else folder / split) / f"{record['name']}.txt"
    if kept.is_file() and sha256_of(kept) == sha:
        return kept
    source = ROOT / record["provenance"].get(key, "")
    if not source.is_file() or sha256_of(source) != sha:
        return None
    from machinery.runfiles import write_atomic

    kept.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(kept, source.read_bytes())
    return kept


def valid_references(
    budget: dict, seed: int, split: str = "valid"
) -> tuple[list[str], str]:
    """The references of ``split`` (validation by default) a row of ``seed`` was
    scored against (read as ``evaluate --split`` reads them) and the data set's BLEU
    tokenizer."""
    from types import SimpleNamespace

    import machinery
    from machinery.inference import evaluation_pairs

    cfg = machinery.get_config(budget["preset"], seed=seed)
    first = budget.get("max_eval_sentences")
    args = SimpleNamespace(
        src=None, ref=None, split=split, first=first, data_mirror=None
    )
    _, refs = evaluation_pairs(args, cfg)
    return refs, machinery.CORPORA[cfg.dataset].bleu_tokenize


def pair_with_base(data: dict, out: Path, budget: dict) -> list[str]:
    """Each finished run's validation and test translations kept beside the table,
    and, where its seed's base run's are kept too, the paired sentence-level test of
    the run against that base (table3_stats.paired_bleu_test) recorded in its
    ``paired`` (computed again only when either file changes). Returns what could not
    be done, one line each."""
    folder, said = hypotheses_folder(out), []
    kept = {r["name"]: kept_hypotheses(r, folder) for r in data["rows"]}
    for r in data["rows"]:  # the test translations, kept for a reader to score
        kept_hypotheses(r, folder, "test")
    sha = {
        r["name"]: (r.get("provenance") or {}).get("hypotheses_sha256")
        for r in data["rows"]
    }  # the digests kept_hypotheses checked the files against
    references: dict[int, tuple] = {}
    for record in data["rows"]:
        name, against = record["name"], base_of(record)
        if record.get("group") == "base" or against not in kept:
            continue
        mine, theirs = kept[name], kept[against]
        if mine is None or theirs is None:
            record.pop("paired", None)
            continue
        shas = {"sha256": sha[name], "base_sha256": sha[against]}
        if all((record.get("paired") or {}).get(k) == v for k, v in shas.items()):
            continue
        seed = record.get("seed", 1)
        try:
            if seed not in references:
                references[seed] = valid_references(budget, seed)
        except Exception as e:  # noqa: BLE001 - no data here: said in one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            said.append(f"no paired test of {name}: references unreadable ({first})")
            continue
        refs, tokenize = references[seed]
        # one sentence a line, each ended by "\n" (evaluate --hypotheses)
        read = lambda p: p.read_bytes().decode().split("\n")[:-1]  # noqa: E731
        try:
            test = stats.paired_bleu_test(read(theirs), read(mine), refs, tokenize)
        except ValueError as e:
            said.append(f"no paired test of {name}: {e}")
            continue
        record["paired"] = {"against": against, **shas, **test}
    return said


def refreshed(data: dict, base: dict, budget: dict) -> dict:
    """A Table 3 (§6.2) file's rows with everything derived from them rewritten by
    this version of the driver: the summary (both measures' tests), the plan and the
    rule."""
    out = data | {
        "summary": summarise(data),
        "plan": plan_of(base, budget),
        "rule": RULE,
    }
    out.pop("noise", None)  # the earlier rule's yardstick
    return out


def budget_problem(data: dict, record: dict, threads: int) -> Optional[str]:
    """Why a finished row cannot join this Table 3 (§6.2) file, or None: it ran other
    settings than asked, another number of updates than the file's rows, or another
    thread count than ``threads``, its own."""
    if record.get("settings_differ"):
        what = "; ".join(
            f"{k} asked {v['asked']}, ran {v['ran']}"
            for k, v in record["settings_differ"].items()
        )
        return f"row {record['name']} ran other settings than its budget ({what})"
    updates = data["budget"].get("updates")
    ran = record["provenance"]["updates"]
    if updates is not None and ran != updates:
        return (
            f"row {record['name']} trained {ran} updates, the file's rows "
            f"{updates}: not the same budget"
        )
    ran = record["provenance"].get("threads")
    if ran != threads:
        return (
            f"row {record['name']} ran on {ran} thread(s), its budget {threads}: "
            "not the same budget"
        )
    return None


def last_update(run_dir: Path) -> int:
    """The newest update a row's run directory has logged or checkpointed (0 if none):
    how far an unfinished row has got."""
    steps = [0]
    if (ckpt := newest_checkpoint(run_dir)) is not None:
        steps.append(int(ckpt.stem.split("-")[1]))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines()[-20:]:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                steps.append(int(json.loads(line)["step"]))
    return max(steps)


def needs_check(record: dict, at: Optional[str] = None) -> bool:
    """Whether a finished row was recorded from a tree with uncommitted changes and
    has no epoch-1 check yet (or, given the commit ``at``, its latest check passed
    at another commit): it is trained again for one epoch at this commit, and its
    epoch-1 validation perplexity compared with the record, digit for digit. A row
    whose check failed, or a base run that trains again to keep its translations, is
    not checked again: it is trained again."""
    provenance = record.get("provenance") or {}
    check = provenance.get("epoch1_check")
    again = (
        at is not None
        and check is not None
        and check.get("match") is True
        and check.get("commit") != at
        and not untranslated_base(record)
    )
    return (
        finished(record)
        and str(provenance.get("commit", "")).endswith("+changes")
        and (check is None or again)
        and bool(record.get("curve"))
    )


def check_failed(record: dict) -> bool:
    """Whether a row's epoch-1 check found another perplexity than its record: the
    row is trained again."""
    check = (record.get("provenance") or {}).get("epoch1_check") or {}
    return check.get("match") is False


def progress(data: dict, rows: list[dict], runs: Path, base, budget) -> list[str]:
    """One line per run of Table 3 (§6.2) in run order — done (with its scores and
    its epoch-1 check), how far it has got, not needed, waiting, or to run — then the
    counts. Read from the file and the run directories only."""
    done = {r["name"]: r for r in data["rows"] if finished(r)}
    updates = (data.get("budget") or {}).get("updates")
    counts = {"done": 0, "started": 0, "not needed": 0, "waiting": 0, "to run": 0}
    lines = []
    for row in rows:
        name = row["name"]
        again = trained_again(done.get(name))
        if name in done and not again:
            state, r = "done", done[name]
            stretch = " (its last stretch)" if r.get("resumed") else ""
            what = (
                f"valid BLEU {r['valid_bleu']:.2f}, valid ppl {r['valid_ppl']:.2f}, "
                f"{r.get('train_minutes') or 0:.0f} min{stretch}"
            )
            if needs_check(r):
                what += "; epoch-1 check to run"
            elif (check := r["provenance"].get("epoch1_check") or {}).get("match"):
                what += f"; epoch-1 check passed at {str(check.get('commit'))[:7]}"
        elif (step := last_update(runs / name)) and not (
            name in done
            and check_failed(done[name])
            and recorded_run(runs / name, done[name])
        ):  # a failed check's own run, kept until the row trains again, is not it
            state = "started"
            what = f"update {step:,}" + (f" of {updates:,}" if updates else "")
            what += f"; {again}" if again else ""
        else:
            verb, what = decide(row, data, base, budget)
            state = {"run": "to run", "skip": "not needed", "wait": "waiting"}[verb]
            what = again if again and verb == "run" else what
        counts[state] += 1
        lines.append(f"{name:<16} {state:<10} {what}".rstrip())
    lines.append(
        f"{len(rows)} runs: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    )
    if hours := cpu_hours(data):
        cores = usable_cores()
        lines.append(
            f"about {hours:.0f} CPU-hours for the whole table (from the rows trained "
            f"in one stretch); on {cores} usable core(s) here about "
            f"{hours / cores:.1f} h"
        )
    return lines


def trained_again(record: Optional[dict]) -> Optional[str]:
    """Why a finished record's run trains again, or None: its epoch-1 check failed, or
    it is a base run recorded without its validation translations."""
    if record is None:
        return None
    if check_failed(record):
        return "trained again: its epoch-1 check failed"
    if untranslated_base(record):
        return "trained again: its validation translations were not kept"
    return None


def cpu_hours(data: dict) -> Optional[float]:
    """The whole table's training in CPU-hours, estimated from the file: the mean
    CPU-minutes (training minutes × threads) of the rows trained in one stretch, per
    variation (else over all such rows), times the runs the plan always makes."""
    whole = [r for r in data["rows"] if finished(r) and not r.get("resumed")]
    if not whole:
        return None
    per: dict[str, list[float]] = {}
    for r in whole:
        minutes = r.get("train_minutes") or 0
        per.setdefault(r["variation"], []).append(minutes * r["provenance"]["threads"])
    overall = sum(sum(v) for v in per.values()) / sum(len(v) for v in per.values())
    total = 0.0
    for entry in data.get("plan") or []:
        seen = per.get(entry["variation"])
        each = sum(seen) / len(seen) if seen else overall
        total += each * len(entry["seeds"])
    return total / 60


def log(message: str) -> None:
    """One line of the driver's own progress, timestamped, to stdout."""
    print(f"[table3 {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of the Table 3 (§6.2) driver."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        default=None,
        help="comma-separated row names, variations or groups (base, A–E); default all",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray", "slurm"),
        default="local",
        help="where rows train: local (a pool of this machine's usable cores; the "
        "default), ray (Ray tasks; --address joins a cluster) or slurm (SLURM jobs "
        "through submitit)",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="local: the pool's CPUs (default: this process's usable cores); ray "
        "without --address: the CPUs of the Ray started here",
    )
    p.add_argument(
        "--address",
        default=None,
        help="ray: the cluster to join (the head's host:port, or 'auto')",
    )
    p.add_argument("--partition", default=None, help="slurm: the partition")
    p.add_argument(
        "--time_limit",
        type=int,
        default=240,
        help="slurm: minutes a job may run before it saves and is requeued "
        "(default 240)",
    )
    p.add_argument(
        "--submitit_cluster",
        choices=("local", "debug"),
        default=None,
        help=argparse.SUPPRESS,  # slurm through submitit's own local executor: tests
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a few rows of the tiny copy preset, a few updates each, in a "
        "temporary folder (for the tests; under a minute)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default results/table3.json; the figures are "
        "written next to it as .png and -curves.png)",
    )
    p.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="folder of the rows' run directories (default runs/table3; "
        "--smoke: next to --out); with ray or slurm, on storage every node sees",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter that runs the program (default this one)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="epochs per row (default: the preset's own schedule; a file holds "
        "one budget)",
    )
    p.add_argument(
        "--no_checks",
        action="store_true",
        help="skip the epoch-1 checks of rows recorded from a tree with "
        "uncommitted changes",
    )
    p.add_argument(
        "--checks_only",
        action="store_true",
        help="run the epoch-1 checks and no new row",
    )
    p.add_argument(
        "--recheck",
        action="store_true",
        help="run the epoch-1 checks again where the last one ran at another commit, "
        "so that every check holds at this one",
    )
    p.add_argument(
        "--refresh",
        action="store_true",
        help="rewrite the file's summary, tests and figures from its rows with this "
        "version of the driver, and train nothing",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="print how far every row has got (from the file and the run "
        "directories, not the engine) and train nothing",
    )
    args = p.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.cpus is not None and args.cpus < 1:
        p.error("--cpus must be at least 1")
    if args.time_limit < 1:
        p.error("--time_limit must be at least 1 minute")
    if args.address and args.engine != "ray":
        p.error("--address is for --engine ray")
    if args.checks_only and args.no_checks:
        p.error("--checks_only and --no_checks exclude each other")
    if args.recheck and args.no_checks:
        p.error("--recheck and --no_checks exclude each other")
    return args


SMOKE_ROWS = ("base", "base-seed2", "A-h1", "B-dk4", "E-learned")


def main(argv: list[str]) -> int:
    """Train the selected rows of Table 3 (§6.2) and record them."""
    args = parse_args(argv)
    try:
        if args.smoke:
            with tempfile.TemporaryDirectory(prefix="table3-smoke-") as tmp:
                out = checked_out(args.out or Path(tmp) / "table3.json")
                runs = args.runs or out.parent / "table3-runs"
                code = drive(args, SMOKE_BASE, SMOKE_BUDGET, out, runs, smoke=True)
                if args.out is None:
                    for r in json.loads(out.read_text())["rows"]:
                        log(f"smoke row {r['name']}: {r['status']}")
                return code
        out = checked_out(args.out or ROOT / "results" / "table3.json")
        runs = args.runs or ROOT / "runs" / "table3"
        return drive(args, BASE, BUDGET, out, runs, smoke=False)
    except (TableError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def job_for(row: dict, base: dict, budget: dict, args, runs: Path, options, head):
    """The `RowJob` that trains ``row`` in its run directory."""
    run_dir = (runs / row["name"]).absolute()
    overrides, note = row_overrides(row, base, options)
    passed = {
        k: v
        for k, v in budget.items()
        if k not in ("preset", "threads", "wide_threads")
    } | overrides
    threads = row_threads(row, base, budget)
    train = command(args.python, budget["preset"], relative(run_dir), passed)
    record = {
        "name": row["name"],
        "variation": row["variation"],
        "group": row["group"],
        "seed": row["seed"],
        "fields": row["fields"],
        "passed": passed,
        "run_dir": str(relative(run_dir)),
        "command": f"OMP_NUM_THREADS={threads} " + " ".join(["python", *train[1:]]),
        "paper": paper_values(row["paper_row"]),
    } | ({"note": note} if note else {})
    return RowJob(
        kind="row",
        record=record,
        run_dir=str(run_dir),
        train=train,
        threads=threads,
        python=args.python,
        budget=budget,
        started={**row, "base": base, "commit": head},
        overrides=overrides,
    )


def check_job(record: dict, budget: dict, args, runs: Path, head: str) -> RowJob:
    """The `RowJob` that trains a recorded row's first epoch again, as the row was
    trained (its own options, threads and seed), into a run directory of its own at
    the commit ``head`` (a check at another commit starts afresh)."""
    run_dir = (runs / "epoch1-checks" / head[:12] / record["name"]).absolute()
    per_epoch = record["curve"][0]["step"]
    passed = dict(record["passed"]) | {"max_steps": per_epoch, "max_eval_sentences": 1}
    return RowJob(
        kind="check",
        record={"name": record["name"], "passed": passed},
        run_dir=str(run_dir),
        train=command(args.python, budget["preset"], relative(run_dir), passed),
        threads=record["provenance"]["threads"],
        python=args.python,
        budget=budget,
        started={},
        overrides={},
    )


def drive(args, base: dict, budget: dict, out: Path, runs: Path, smoke: bool) -> int:
    """The driver: decide the runs, hand them to the engine, merge each record into
    ``out`` (the one process that writes it) as it arrives, then decide the runs that
    wait on others, until none is left. Returns 0, 1 if a run failed, 130 if
    stopped by a signal."""
    if args.epochs is not None:
        budget = budget | {"epochs": args.epochs}
    rows = table3_rows(base, budget["lr_factor"])
    order = [r["name"] for r in rows]
    if smoke and not args.rows:
        rows = [r for r in rows if r["name"] in SMOKE_ROWS]
    rows = select(rows, args.rows)
    data = read_table(out, base, budget, smoke)
    if args.status:
        print("\n".join(progress(data, rows, runs, base, budget)))
        return 0
    if args.refresh:
        for line in pair_with_base(data, out, budget):
            log(line)
        write_table(out, refreshed(data, base, budget))
        log(f"{out}: summary, tests and figures rewritten from its rows")
        return 0
    head = commit(
        (out, out.with_suffix(".png"), out.with_name(out.stem + "-curves.png")),
        hypotheses_folder(out),
    )
    if not smoke and head.endswith("+changes"):
        raise TableError(
            "the working tree has uncommitted changes: a Table 3 row is recorded "
            "only from a commit (commit or stash them, then run again)"
        )
    options = program_options(args.python, "train")
    engine = make_engine(args, runs)
    stopped: list[int] = []

    def stop(signum, frame):
        if not stopped:
            log(
                f"{signal.Signals(signum).name}: stopping the rows (each saves a "
                "checkpoint); run the same command again to continue"
            )
        stopped.append(signum)
        engine.stop(signum)

    try:
        if problem := shared_storage_problem(engine, runs):
            raise TableError(problem)
        write_table(out, refreshed(data, base, budget))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)
        loop = Loop(args, engine, data, base, budget, out, runs, order, options, head)
        return loop.run(rows, stopped)
    finally:
        engine.close()


def shared_storage_problem(engine, runs: Path) -> Optional[str]:
    """Why the engine's tasks cannot see the run folder (a probe file the driver
    writes there, read back by a task on each node), or None."""
    runs.mkdir(parents=True, exist_ok=True)
    probe = runs / f".driver-probe-{os.getpid()}"
    token = probe_token()
    probe.write_text(token)
    try:
        return engine.storage_problem(probe, token)
    finally:
        probe.unlink(missing_ok=True)


class Loop:
    """The driver's loop over one table (see `drive`): what it hands the engine,
    what comes back, and the file it writes."""

    def __init__(self, args, engine, data, base, budget, out, runs, order, options,
                 head):  # fmt: skip
        self.args, self.engine, self.data = args, engine, data
        self.base, self.budget, self.out, self.runs = base, budget, out, runs
        self.order, self.options, self.head = order, options, head
        self.submitted: dict = {}
        self.pending: list[dict] = []
        self.rows: list[dict] = []

    def write(self) -> None:
        for line in pair_with_base(self.data, self.out, self.budget):
            log(line)
        write_table(self.out, refreshed(self.data, self.base, self.budget))

    def submit(self, job: RowJob) -> None:
        self.submitted[self.engine.submit(job)] = job

    def run(self, rows: list[dict], stopped: list[int]) -> int:
        """Hand out the runs, merge what comes back; the exit status."""
        self.rows = rows
        done_names = finished_names(self.data)
        self.pending = [r for r in rows if r["name"] not in done_names]
        if self.args.checks_only:
            self.pending = []
        names = {r["name"] for r in rows}
        checks = []
        if not (self.args.no_checks or smoke_budget(self.budget)):
            at = self.head if self.args.recheck else None
            checks = [
                r
                for r in self.data["rows"]
                if needs_check(r, at) and r["name"] in names
            ]
        log(
            f"{len(rows) - len(self.pending)} of {len(rows)} run(s) already in "
            f"{self.out}; {len(checks)} epoch-1 check(s) and up to "
            f"{len(self.pending)} run(s) to make on the {self.engine.name} engine"
        )
        failed, said = 0, set()
        for record in checks:
            self.submit(check_job(record, self.budget, self.args, self.runs, self.head))
        while not stopped:
            for row in list(self.pending):
                verb, why = decide(row, self.data, self.base, self.budget)
                if verb == "skip":
                    log(f"run {row['name']}: not needed: {why}")
                    self.pending.remove(row)
                elif verb == "run":
                    record = record_of(self.data, row["name"]) or {}
                    if check_failed(record):
                        set_aside(self.runs / row["name"], record)
                    job = job_for(row, self.base, self.budget, self.args, self.runs,
                                  self.options, self.head)  # fmt: skip
                    log(
                        f"run {row['name']}: handed to the {self.engine.name} engine "
                        f"({job.threads} CPU(s))"
                    )
                    self.submit(job)
                    self.pending.remove(row)
                elif row["name"] not in said:
                    said.add(row["name"])
                    log(f"run {row['name']}: waits: {why}")
            if not self.submitted:
                break
            done, _ = concurrent.futures.wait(
                list(self.submitted), return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                failed += self.arrived(self.submitted.pop(future), future)
        for future in concurrent.futures.as_completed(list(self.submitted)):
            failed += self.arrived(self.submitted.pop(future), future)  # after a stop
        if stopped:
            return 130
        log(f"results in {self.out}")
        return 1 if failed else 0

    def arrived(self, job: RowJob, future) -> int:
        """Merge what one run returned into the file (written at once); 1 where it
        failed, else 0."""
        try:
            record = future.result()
        except Exception as e:  # noqa: BLE001 - an engine's failure, in one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            log(f"run {job.name}: the engine gave up on it: {first[:300]}")
            return 1
        if record is None:  # stopped before it started
            return 0
        if record.get("status") == "interrupted":
            what = "epoch-1 check of" if job.kind == "check" else "run"
            log(
                f"{what} {job.name}: stopped by {record.get('signal')}; its "
                "checkpoints are kept: run the same command again to continue it"
            )
            return 0 if record.get("signal") in ("SIGINT", "SIGTERM", "SIGHUP") else 1
        if job.kind == "check":
            return self.checked(job, record)
        earlier = record_of(self.data, job.name)
        if earlier and untranslated_base(earlier) and finished(record):
            record["provenance"]["retrained"] = retrained(earlier, record)
        refusal = merge(self.data, record, self.base, self.budget, self.order)
        if refusal:
            log(f"run {job.name} not added: {refusal}")
            return 1
        self.write()
        if finished(record):
            log(
                f"run {job.name} done in {record['row_wall_minutes']:.1f} min on "
                f"{record['ran_on'].get('host')}: valid BLEU "
                f"{record['valid_bleu']:.2f}, valid ppl {record['valid_ppl']:.2f}, "
                f"test BLEU {record['bleu']:.2f}"
            )
            return 0
        log(f"run {job.name}: {record['status']}: {record.get('error')}")
        return int(record["status"] == "failed")

    def checked(self, job: RowJob, result: dict) -> int:
        """Record an epoch-1 check in its row's provenance; a row it does not match
        is queued to train again."""
        if result.get("status") != "checked":
            log(
                f"epoch-1 check of {job.name}: {result.get('status')}: "
                f"{result.get('error')}"
            )
            return 1
        record = record_of(self.data, job.name)
        recorded = record["curve"][0]["valid_ppl"]
        match = result["epoch1_ppl"] == recorded
        before = record["provenance"].get("epoch1_check")
        earlier = (
            []
            if before is None
            else [
                {k: v for k, v in before.items() if k != "earlier"},
                *before.get("earlier", []),
            ]
        )  # the checks at other commits, newest first
        record["provenance"]["epoch1_check"] = {
            "commit": self.head,
            "recorded": recorded,
            "measured": result["epoch1_ppl"],
            "match": match,
            "updates": job.record["passed"]["max_steps"],
            "threads": job.threads,
            "ran_on": result.get("ran_on"),
            "minutes": result.get("row_wall_minutes"),
            **({"earlier": earlier} if earlier else {}),
        }
        self.write()
        verdict = "the same" if match else "DIFFERENT: the row trains again"
        log(
            f"epoch-1 check of {job.name}: {result['epoch1_ppl']!r} against the "
            f"recorded {recorded!r}: {verdict}"
        )
        if not match and not self.args.checks_only:
            row = next((r for r in self.rows if r["name"] == job.name), None)
            if row is not None and row not in self.pending:
                self.pending.append(row)
        return 0


def smoke_budget(budget: dict) -> bool:
    """Whether ``budget`` is the smoke table's (no epoch-1 checks there)."""
    return budget["preset"] == SMOKE_BUDGET["preset"]


def finished_names(data: dict) -> set[str]:
    """The runs the file holds as finished, less those whose epoch-1 check failed and
    the base runs whose validation translations were not kept (trained again: every
    variation's paired sentence-level test needs its seed's base)."""
    return {
        r["name"]
        for r in data["rows"]
        if finished(r) and not check_failed(r) and not untranslated_base(r)
    }


def untranslated_base(record: dict) -> bool:
    """Whether ``record`` is a finished base run recorded without its validation
    translations (before they were kept)."""
    from machinery.table3view import untranslated_base as untranslated

    return untranslated(record)


def retrained(earlier: dict, record: dict) -> dict:
    """What a run trained again records of its earlier record: the earlier scores and
    commit, and whether this run gave them back to the last digit."""
    keys = ("valid_ppl", "valid_bleu", "bleu")
    return {
        "why": "its validation translations were not kept",
        "commit": (earlier.get("provenance") or {}).get("commit"),
        **{k: earlier.get(k) for k in keys},
        "same": all(earlier.get(k) == record.get(k) for k in keys),
    }


def record_of(data: dict, name: str) -> Optional[dict]:
    """The file's record of run ``name``, or None."""
    return next((r for r in data["rows"] if r["name"] == name), None)


def set_aside(run_dir: Path, record: dict) -> None:
    """Move the run ``record`` came from, whose epoch-1 check failed, out of the way, so
    that the row trains again from its start. It is told by its first validation
    perplexity, the recorded one; a directory with another (the check's, as the row's
    new training gives it again) or none yet holds that new training, stopped before
    it was recorded: it is left to resume or to be scored."""
    if recorded_run(run_dir, record):
        stamp = int(time.time())
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.failed-check-{stamp}"))


def recorded_run(run_dir: Path, record: dict) -> bool:
    """Whether ``run_dir`` holds the run ``record`` was made from, told by its first
    validation perplexity (a run trained again has another, or none yet)."""
    metrics = run_dir / "metrics.jsonl"
    curve = valid_curve(metrics) if metrics.is_file() else []
    recorded = (record.get("curve") or [{}])[0].get("valid_ppl")
    return bool(curve) and curve[0]["valid_ppl"] == recorded


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

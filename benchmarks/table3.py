"""Table 3 (§6.2, "Model Variations") at our scale: training runs per row, seeds apart.

§6.2 varies the base model one setting at a time — (A) heads, (B) the key size d_k,
(C) depth and width, (D) dropout and label smoothing, (E) learned positions — and
reports each row's perplexity, BLEU and parameter count on the development set
(Table 3). This script does the same around the ``multi30k-small`` preset (N=3,
d_model=256, d_ff=1024, h=8, d_k=32, P_drop=0.1, eps_ls=0.1): every row is that preset
with a few fields changed and trained on the preset's whole schedule (15 epochs, 3,225
updates, warm-up 1,000), so the base row is the headline run's model and schedule.
Each variation runs with seeds 1 and 2, the base with 1–3; a (C) variation (the
costlier sizes, run last) skips seed 2 where seed 1 already lies beyond the noise
rule's 2·s of the base.
Two more rows (C-d128-lr, C-d512-lr) hold Eq. 3's d_model^-0.5 apart from the width.
Every row is trained through the command line with the same explicit precision and
attention path, on one thread (two for a row wider than the base, trained alone)::

    OMP_NUM_THREADS=1 python the_annotated_transformer.py train --config \
        multi30k-small --run_dir runs/table3/<row> --precision fp32 ... --<field> <v>

then scored on the validation set (``evaluate --split valid``, beam 4, last
checkpoint: no averaging, as §6.2), and checked for whether its model reads its source
(``benchmarks/source_use.py``: the validation loss with each pair's own source and with
another's; below a 1-nat gap the run failed to train). It talks to the program only
through those two command lines and the files a run writes; it never imports it.

Run from the repository root::

    python benchmarks/table3.py --jobs 2          # every row, two at a time (days)
    python benchmarks/table3.py --rows base,A     # some rows (names or groups)
    python benchmarks/table3.py --smoke           # copy preset, a few updates (<60 s)
    python benchmarks/table3.py --refresh         # summary and figures again, no run
    python benchmarks/table3.py --status          # how far each row has got

Writes ``results/table3.json`` (atomically, under a lock, after every row) and
``results/table3.png``; each row's run directory keeps its ``valid_bleu.json`` and
``source_use.json``. A row already in the JSON is skipped; a row that was
interrupted continues from the checkpoints in its run directory; a row another worker
holds (its lock file) is left to it; a row wider than the base starts only while no
other row trains, and no other row starts while it does (``--jobs N`` trains the wide
rows its workers left for later at its end). The file records one budget
(updates, warm-up, lr_factor, batch size, precision, attention, threads) and refuses a
row trained with another, or on another thread count than its own.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from table3_figures import draw, draw_curves  # noqa: E402
PROGRAM = ROOT / "the_annotated_transformer.py"
SOURCE_CHECK = ROOT / "benchmarks" / "source_use.py"
UNSUPPORTED = "not supported by this version"

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
BUDGET_CHECKED = ("epochs", "warmup", "lr_factor", "batch_tokens", "precision")
SEEDS = {"base": (1, 2, 3), "A": (1, 2), "B": (1, 2), "D": (1, 2), "E": (1, 2)}
SEEDS_C = (1, 2)  # (C) runs last; its seed 2 only where seed 1 is not `settled`


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
    they run: the base's seeds; (A), (B), (D) and (E) with seed 1, then seed 2; (C)
    (the costlier sizes) with seed 1, then seed 2. ``variation`` names the row its
    seeds average into."""
    plain = variations(base, lr_factor)
    first = [v for v in plain if v[1] not in "C"]
    sized = [v for v in plain if v[1] == "C"]
    runs = []
    for name, group, fields, paper in plain[:1]:
        for seed in SEEDS["base"]:
            runs.append((name, group, fields, paper, seed))
    for block, seeds in ((first[1:], (1, 2)), (sized, SEEDS_C)):
        for seed in seeds:
            runs += [(n, g, f, p, seed) for n, g, f, p in block]
    return [
        {
            "name": n if seed == 1 else f"{n}-seed{seed}",
            "variation": n,
            "group": g,
            "seed": seed,
            "fields": f | ({"seed": seed} if seed != 1 else {}),
            "paper_row": p,
        }
        for n, g, f, p, seed in runs
    ]


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


def program_options(python: str, program: Path) -> set[str]:
    """The field names ``train --help`` accepts (§6.2, Table 3's rows change them)."""
    done = subprocess.run(
        [python, str(program), "train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(
            f"error: `{program.name} train --help` failed (exit {done.returncode}): "
            f"{last_line(done.stderr)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    out = done.stdout
    return {m.replace("-", "_") for m in re.findall(r"--([A-Za-z_][\w-]*)", out)}


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


def relative(path: Path) -> Path:
    """``path`` relative to the repository root where it lies inside it (the runs of
    Table 3, §6.2, are started there), so that the results name no machine's folders."""
    path = path.absolute()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def command(python: str, preset: str, run_dir: Path, overrides: dict) -> list[str]:
    """The ``train`` command line of one Table 3 (§6.2) row."""
    args = [
        python,
        PROGRAM.name,
        "train",
        "--config",
        preset,
        "--run_dir",
        str(run_dir),
    ]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    return args


def saved_settings(run_dir: Path) -> Optional[dict]:
    """The config a run directory was trained with (results.json, else the newest
    checkpoint's ``config``), or None if it holds neither — to resume a Table 3
    (§6.2) row only with its own settings."""
    results = run_dir / "results.json"
    if results.is_file():
        return json.loads(results.read_text())["config"]
    checkpoints = newest_checkpoint(run_dir)
    if checkpoints is None:
        return None
    import torch

    return torch.load(checkpoints, map_location="cpu", weights_only=True)["config"]


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest ``checkpoint-<step>.pt`` of a run directory (the program's names)."""
    found = [
        (int(m.group(1)), p)
        for p in run_dir.glob("checkpoint-*.pt")
        if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", p.name))
    ]
    return max(found)[1] if found else None


def count_parameters(checkpoint: Path) -> int:
    """Parameters of a row (Table 3's last column, §6.2): the sum of numel over the
    checkpoint's model state dict, a tensor shared by several names (§3.4's tied
    embeddings and pre-softmax weights) counted once."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    seen = {}
    for tensor in state.values():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
        )
        seen[key] = tensor.numel()
    return sum(seen.values())


def valid_curve(metrics: Path) -> list[dict]:
    """Validation perplexity after every epoch, from a run's metrics.jsonl (records
    with ``valid_loss``, nats per target token, no smoothing): Table 3's PPL column
    (§6.2) as it moved, so that "learns faster" and "ends better" can be told apart."""
    curve = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "valid_loss" in record:
            curve = [c for c in curve if c["epoch"] != record.get("epoch")]
            curve.append(
                {
                    "epoch": record.get("epoch"),
                    "step": record.get("step"),
                    "valid_ppl": math.exp(min(record["valid_loss"], 50)),
                }
            )
    return curve


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, with its family, model and stepping
    (one name can cover several chips), for the record of a Table 3 (§6.2) run."""
    try:
        info = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
    except OSError:
        info = {}
    info = {k.strip(): v.strip() for k, v in info.items()}
    if "model name" in info:
        detail = ", ".join(
            f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info
        )
        return info["model name"] + (f" ({detail})" if detail else "")
    import platform

    return platform.processor() or "unknown CPU"


def device_name(device: str) -> str:
    """The name of the chip a row trained on: the GPU's, else the CPU's."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else 0
        return torch.cuda.get_device_name(index)
    return cpu_name()


def commit() -> str:
    """The commit the program was at when a row started (``+changes`` when the tree
    had uncommitted changes), for the provenance of a Table 3 (§6.2) row."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


def head_size(settings: dict) -> int:
    """d_k as the program uses it: ``d_k``, or d_model/h where it is 0 (§3.2.2)."""
    return settings.get("d_k") or settings["d_model"] // settings["h"]


def differences(expected: dict, config: dict) -> dict:
    """The settings a run's config does not share with what was asked of it (d_k 0
    and d_model/h are one value): a row of Table 3 (§6.2) the file must not hold."""
    out = {}
    for key, value in expected.items():
        if key not in config:
            continue
        ran = config[key]
        if key == "d_k":
            value, ran = head_size(expected | {"d_k": value}), head_size(config)
        if ran != value:
            out[key] = {"asked": value, "ran": ran}
    return out


def valid_bleu(python: str, run_dir: Path, budget: dict, child: "Child") -> dict:
    """BLEU (beam 4, §6.1) of a row's last checkpoint on the validation split — the
    development-set column of Table 3 (§6.2) — through ``evaluate``; kept in the run
    directory so that collecting the row again does not decode again."""
    kept = run_dir / "valid_bleu.json"
    checkpoint = newest_checkpoint(run_dir)
    if kept.is_file():
        found = json.loads(kept.read_text())
        if found.get("checkpoint") == checkpoint.name:
            return found
    args = [python, PROGRAM.name, "evaluate", "--checkpoint", str(relative(checkpoint))]
    args += ["--split", "valid", "--beam", "4"]
    if budget.get("max_eval_sentences"):
        args += ["--first", str(budget["max_eval_sentences"])]
    code, out, err = child.capture(args, budget["threads"])
    match = re.search(r"BLEU\S*\s*=\s*([\d.]+)", out)
    if code != 0 or not match:
        raise RuntimeError(f"evaluate --split valid failed: {last_line(err or out)}")
    found = {
        "checkpoint": checkpoint.name,
        "valid_bleu": float(match.group(1)),
        "signature": out.strip().splitlines()[-1],
        "command": " ".join(["python", *args[1:]]),
    }
    write_json(kept, found)
    return found


def source_check(python: str, run_dir: Path, budget: dict, child: "Child") -> dict:
    """Whether a row's last checkpoint reads its source: its validation loss with each
    pair's own source and with another pair's (``benchmarks/source_use.py``), kept in
    the run directory so that collecting the row again does not measure again."""
    kept = run_dir / "source_use.json"
    checkpoint = newest_checkpoint(run_dir)

    def record() -> Optional[dict]:
        if not kept.is_file():
            return None
        records = json.loads(kept.read_text())["records"]
        return next(
            (r for r in records if Path(r["checkpoint"]).name == checkpoint.name), None
        )

    if record() is None:
        args = [python, str(relative(SOURCE_CHECK)), str(relative(run_dir))]
        args += ["--out", str(relative(kept)), "--threads", str(budget["threads"])]
        code, out, err = child.capture(args, budget["threads"])
        if code != 0:
            raise RuntimeError(f"the source check failed: {last_line(err or out)}")
    found = record()
    if found is None:
        raise RuntimeError(f"the source check did not measure {checkpoint}")
    return {"source_gap": found["gap"]}


def collect(row: dict, run_dir: Path, budget: dict, python: str, child) -> dict:
    """One finished row of Table 3 (§6.2) from the files its run wrote: validation
    perplexity (and its curve) and BLEU, test BLEU (beam 4 and greedy), parameters,
    time, and what it ran with (the provenance the file's budget is checked on)."""
    results = json.loads((run_dir / "results.json").read_text())
    curve = valid_curve(run_dir / "metrics.jsonl")
    checkpoint = newest_checkpoint(run_dir)
    config = results.get("config", {})
    asked = {k: budget[k] for k in BUDGET_CHECKED if k in budget}
    differ = differences({**asked, **row["base"], **row["fields"]}, config)
    scored = valid_bleu(python, run_dir, budget, child)
    reads = source_check(python, run_dir, budget, child)
    return {
        "status": "done",
        "params": count_parameters(checkpoint) if checkpoint else None,
        "valid_ppl": curve[-1]["valid_ppl"] if curve else None,
        "valid_bleu": scored["valid_bleu"],
        **reads,
        "bleu": results.get("bleu"),
        "bleu_greedy": results.get("bleu_greedy"),
        "bleu_kind": results.get("bleu_kind"),
        "test_sentences": results.get("test_sentences"),
        "train_minutes": results.get("train_minutes"),
        "total_minutes": results.get("total_minutes"),
        "provenance": {
            "updates": results.get("steps"),
            "warmup": config.get("warmup"),
            "lr_factor": config.get("lr_factor"),
            "batch_tokens": config.get("batch_tokens"),
            "epochs": config.get("epochs"),
            "seed": config.get("seed"),
            "precision": results.get("precision"),
            "attention": results.get("attention"),
            "threads": budget["threads"],
            "device": results.get("device"),
            # the run names its chip (older runs do not: read it here)
            "device_name": results.get("machine")
            or device_name(str(results.get("device", "cpu"))),
            "commit": row.get("commit"),
            "valid_bleu_command": scored["command"],
        },
        "curve": curve,
        **({"settings_differ": differ} if differ else {}),
    }


def write_json(path: Path, data: dict) -> None:
    """Write the Table 3 (§6.2) results atomically: a temporary file, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# The noise rule, stated once (the notebook and the audit quote it from the JSON).
RULE = (
    "A variation's mean validation BLEU differs from the base's when the difference "
    "is larger than twice the pooled standard deviation of validation BLEU over the "
    "seeds of every row that has two or more; it then agrees with the paper when it "
    "has the sign of the paper's own difference (its dev BLEU minus the base's 25.8) "
    "and disagrees otherwise. Within twice that deviation it can't tell. A paper's "
    "difference of at most 0.1 (one step of its table's rounding) is read as no "
    "change: a variation within twice that deviation then agrees, one beyond it "
    "disagrees. A (C) variation (the costlier "
    "sizes) runs its second seed only where its first lies within twice that deviation "
    "of the base's mean. A run whose validation loss rises by less than 1 nat per "
    "target token when each pair is given another pair's source has not learnt to "
    "read its source: it failed to train, is shown apart, and enters neither its "
    "row's mean nor the pooled deviation; a row none of whose seeds trained shows "
    'their scores and reads "fails to train", and while no seed of the base has '
    'trained every row reads "base fails to train".'
)
# The paper's Table 3 gives BLEU to 0.1: a difference of one step of that rounding
# (E's 25.7, "nearly identical results", against the base's 25.8) is no change.
PAPER_NO_CHANGE = 0.1
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


def pooled_sd(groups: list[list[float]]) -> Optional[float]:
    """The pooled sample standard deviation of several rows' seeds (rows with one seed
    add nothing); None when no row has two."""
    dof = sum(len(g) - 1 for g in groups if len(g) > 1)
    if dof == 0:
        return None
    squares = sum(
        sum((v - sum(g) / len(g)) ** 2 for v in g) for g in groups if len(g) > 1
    )
    return math.sqrt(squares / dof)


def verdict(ours: float, noise: Optional[float], paper: float) -> str:
    """The noise rule (RULE): "agrees", "disagrees" or "can't tell" for a variation
    whose mean differs from the base's by ``ours``, given the pooled seed deviation
    ``noise`` and the paper's own difference ``paper`` (dev BLEU, Table 3), read as no
    change where it is at most ``PAPER_NO_CHANGE``."""
    if noise is None:
        return "can't tell"
    none = round(abs(paper), 6) <= PAPER_NO_CHANGE  # 25.7 - 25.8 is -0.100000000001
    if abs(ours) <= 2 * noise:
        return "agrees" if none else "can't tell"
    if none:
        return "disagrees"
    return "agrees" if (ours > 0) == (paper > 0) else "disagrees"


def settled(entry: dict, noise: Optional[float]) -> bool:
    """Whether a variation of Table 3 (§6.2) has the seeds the design asks of it: the
    base three, an (A), (B), (D) or (E) variation two (trained or failed), a (C)
    variation two, or one that trained and whose difference from the base's mean is
    already beyond the rule's 2·s (one that failed says nothing of the size)."""
    if len(entry["seeds"]) >= len(SEEDS.get(entry["group"], SEEDS_C)):
        return True
    diff = entry.get("diff_valid_bleu")
    if entry["group"] != "C" or len(entry["failed_seeds"]) == len(entry["seeds"]):
        return False  # a seed that failed to train says nothing of the setting's size
    return None not in (noise, diff) and abs(diff) > 2 * noise


def needless(row: dict, data: dict) -> Optional[str]:
    """Why a (C) row's second seed need not run, from the file's finished rows: its
    first seed already lies beyond 2·s of the base (the rule's noise); else None."""
    if row["group"] != "C" or row["seed"] == SEEDS_C[0]:
        return None
    entry = next(
        (s for s in summarise(data) if s["variation"] == row["variation"]), None
    )
    if entry is None or not entry["settled"]:  # seed 1 not run, or inside 2·s
        return None
    return (
        f"{row['variation']}'s seed {entry['seeds'][0]} lies "
        f"{entry['diff_valid_bleu']:+.2f} BLEU from the base's mean, beyond 2·s = "
        f"{2 * noise_of(data)['sd']:.2f}: one seed settles it"
    )


def seeds_by_variation(data: dict) -> dict[str, list[dict]]:
    """The finished rows of a Table 3 (§6.2) file, grouped by the variation whose seeds
    they are."""
    by: dict[str, list[dict]] = {}
    for r in data["rows"]:
        if r["status"] == "done":
            by.setdefault(r.get("variation", r["name"]), []).append(r)
    return by


def noise_of(data: dict) -> dict:
    """The noise rule's yardstick for a Table 3 (§6.2) file: the pooled seed standard
    deviation of validation BLEU and how many rows (with ≥ 2 seeds) it pools."""
    groups = trained_bleu(seeds_by_variation(data))
    return {"sd": pooled_sd(groups), "rows": sum(len(g) > 1 for g in groups)}


def trained_bleu(by: dict[str, list[dict]]) -> list[list[float]]:
    """Per variation, the validation BLEU of its seeds that trained: what the noise
    rule pools."""
    return [[r["valid_bleu"] for r in rs if trained(r)] for rs in by.values()]


def summarise(data: dict) -> list[dict]:
    """Per variation of Table 3 (§6.2): its seeds' mean and spread of validation
    perplexity and BLEU and of test BLEU (over the seeds that trained), the seeds that
    failed to train, its difference from the base, and the noise rule's verdict
    against the paper's row."""
    by = seeds_by_variation(data)
    noise = noise_of(data)["sd"]
    base_ok = [r for r in by.get("base", []) if trained(r)]
    base = base_ok or by.get("base")  # its failed seeds: the differences are shown
    base_bleu = spread([r["valid_bleu"] for r in base])["mean"] if base else None
    out = []
    for name, rs in by.items():
        first, ok = rs[0], [r for r in rs if trained(r)]
        counted = ok or rs  # the seeds that trained; all, where none did
        gaps = [r["source_gap"] for r in rs if r.get("source_gap") is not None]
        entry = {
            "variation": name,
            "group": first["group"],
            "seeds": sorted(r.get("seed", 1) for r in rs),
            "failed_seeds": sorted(r.get("seed", 1) for r in rs if not trained(r)),
            "params": first["params"],
            "valid_ppl": spread([r["valid_ppl"] for r in counted]),
            "valid_bleu": spread([r["valid_bleu"] for r in counted]),
            "test_bleu": spread([r["bleu"] for r in counted]),
            "source_gap": spread(gaps) if gaps else None,
            "paper": first["paper"],
        }
        if name != "base" and base_bleu is not None:
            ours = entry["valid_bleu"]["mean"] - base_bleu
            theirs = round(first["paper"]["bleu_dev"] - PAPER["base"][1], 2)
            if not ok:
                said = "fails to train"
            elif not base_ok:
                said = "base fails to train"
            else:
                said = verdict(ours, noise, theirs)
            entry |= {
                "diff_valid_bleu": ours,
                "paper_diff_bleu": theirs,
                "verdict": said,
            }
        entry["settled"] = settled(entry, noise)
        out.append(entry)
    return out


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


def child_env(threads: int) -> dict:
    """The environment of a row's processes: ``threads`` threads for PyTorch's CPU
    kernels, the same for every row of Table 3 (§6.2), and glibc's settings for
    reusing freed memory (those `make` sets) where the caller set none of its own."""
    from machinery.devices import GLIBC_MALLOC_SETTINGS

    env = {**GLIBC_MALLOC_SETTINGS, **os.environ}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    return env


def rows_held(runs: Path) -> list[str]:
    """The rows whose lock in ``runs`` is held now (this process's own included),
    whichever runner trains them: a held lock is one `locked` cannot take within its
    grace."""
    held = []
    for path in sorted(runs.glob("*.lock")):
        with locked(path, wait=False) as free:
            if not free:
                held.append(path.stem)
    return held


def rows_training(runs: Path) -> int:
    """How many rows train in ``runs`` now (this process's own included)."""
    return len(rows_held(runs))


def alone_problem(name: str, held: list[str], wide: set[str]) -> Optional[str]:
    """Why row ``name`` cannot start while the rows ``held`` train, or None: a row of
    ``wide`` (wider than the base, on more threads) takes the machine's cores alone,
    so it waits for every other row, and every other row waits for it."""
    others = [n for n in held if n != name]
    if name in wide and others:
        verb = "is" if len(others) == 1 else "are"
        return (
            f"it trains alone on its threads, and {', '.join(others)} {verb} training"
        )
    if busy := [n for n in others if n in wide]:
        return f"{busy[0]} is training alone on its threads"
    return None


class LoadWatch:
    """While a row trains, look every ``every`` seconds at how many rows train at once
    (`rows_training`) and at the 1-minute load average: the load its minutes were
    measured under, which another runner or any other work adds to."""

    def __init__(self, runs: Path, every: float = 30.0):
        self.runs, self.every = runs, every
        self.rows, self.loads = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while True:
            self.rows.append(rows_training(self.runs))
            self.loads.append(os.getloadavg()[0])
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        """``concurrent_rows``: the most rows seen training at once (at least this
        one); ``load_average``: the mean of the load averages seen."""
        return {
            "concurrent_rows": max([1, *self.rows]),
            "load_average": round(sum(self.loads) / len(self.loads), 2),
        }


class Child:
    """The one training process of a Table 3 (§6.2) row; SIGINT/SIGTERM/SIGHUP sent to
    this script are handed on to it once (it saves a checkpoint and stops)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.stopped: Optional[int] = None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._forward)

    def _forward(self, signum, frame) -> None:
        self.stopped = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def run(self, args: list[str], threads: int) -> tuple[int, str]:
        """Run ``args`` to its end, output passed on: (exit status, stderr tail)."""
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=child_env(threads),
        )
        tail = b""
        while chunk := os.read(self.proc.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-8192:]
        code = self.proc.wait()
        self.proc = None
        return code, tail.decode("utf-8", "replace")

    def capture(self, args: list[str], threads: int) -> tuple[int, str, str]:
        """Run ``args`` to its end: (exit status, stdout, stderr)."""
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=child_env(threads),
            text=True,
        )
        out, err = self.proc.communicate()
        code, self.proc = self.proc.returncode, None
        return code, out, err


def rejected(stderr: str, fields: dict) -> Optional[str]:
    """The program's one-line refusal of one of ``fields`` (an unknown option or a
    setting it rules out), or None — a Table 3 (§6.2) row this version cannot run."""
    for line in reversed(stderr.replace("\r", "\n").splitlines()):
        if ": error:" in line:
            if any(re.search(rf"(--)?\b{re.escape(k)}\b", line) for k in fields):
                return line.strip()
            return None
    return None


def last_line(stderr: str) -> str:
    """The last non-empty line a failed run printed (its one-line error)."""
    lines = [s.strip() for s in stderr.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1] if lines else "(no message)"


def log(message: str) -> None:
    """One line of this script's own progress, timestamped, to stdout."""
    print(f"[table3 {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of the Table 3 (§6.2) runner."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        default=None,
        help="comma-separated row names, variations or groups (base, A–E); default all",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="rows trained at once, each in its own worker with one thread "
        "(default 1; 2 on two cores); a row wider than the base trains alone, on "
        "two threads: a worker leaves it for later while another row trains, and "
        "the job trains the rows so left at its end, one after another",
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
        "--smoke: next to --out)",
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
        "--refresh",
        action="store_true",
        help="rewrite the file's summary, noise rule and figures from its rows "
        "with this version of the runner, and train nothing",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="print how far every row has got (done, its update, to run) and train "
        "nothing",
    )
    args = p.parse_args(argv)
    args.argv = list(argv)  # what a --jobs worker is started with
    if args.epochs is not None and args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


SMOKE_ROWS = ("base", "base-seed2", "A-h1", "B-dk4", "E-learned")


def main(argv: list[str]) -> int:
    """Train the selected rows of Table 3 (§6.2) and record them."""
    args = parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="table3-smoke-") as tmp:
            out = args.out or Path(tmp) / "table3.json"
            runs = args.runs or out.parent / "table3-runs"
            code = run_table(args, SMOKE_BASE, SMOKE_BUDGET, out, runs, smoke=True)
            if args.out is None:
                for r in json.loads(out.read_text())["rows"]:
                    log(f"smoke row {r['name']}: {r['status']}")
            return code
    out = args.out or ROOT / "results" / "table3.json"
    runs = args.runs or ROOT / "runs" / "table3"
    return run_table(args, BASE, BUDGET, out, runs, smoke=False)


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


@contextlib.contextmanager
def locked(path: Path, wait: bool = True, grace: float = 0.5):
    """Hold an exclusive lock on ``path`` (made if missing): yields whether it was got.
    Without ``wait``, False when another process holds it for longer than ``grace``
    seconds: a row's lock is held for the hours it trains, while a runner that looks
    which rows train (`rows_held`) holds each lock for an instant, which must not make
    a runner that asks for that row in the same instant pass it by."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        give_up = time.monotonic() + grace
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    yield False
                    return
                time.sleep(0.02)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def plan_of(base: dict, budget: dict) -> list[dict]:
    """Every variation of Table 3 (§6.2) the file will hold, in run order, with its
    changed fields, its seeds and the paper's row: what the table shows before its
    rows have finished."""
    plan: dict[str, dict] = {}
    for r in table3_rows(base, budget["lr_factor"]):
        entry = plan.setdefault(
            r["variation"],
            {
                "variation": r["variation"],
                "group": r["group"],
                "fields": {k: v for k, v in r["fields"].items() if k != "seed"},
                "seeds": [],
                "paper": paper_values(r["paper_row"]),
            },
        )
        entry["seeds"].append(r["seed"])
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


def read_table(out: Path, base: dict, budget: dict, smoke: bool) -> dict:
    """The Table 3 (§6.2) file at ``out`` (a fresh one if there is none); SystemExit(2)
    if it holds another budget."""
    if not out.is_file():
        return fresh_table(base, budget, smoke)
    data = json.loads(out.read_text())
    if not same_budget(data.get("budget", {}), budget_record(budget)):
        was, now = (
            {k: v for k, v in b.items() if k != "note"}
            for b in (data.get("budget", {}), budget)
        )
        print(
            f"error: {out} holds rows trained with budget {was}, not {now}; one "
            "file holds one budget: give another --out or the same budget",
            file=sys.stderr,
        )
        raise SystemExit(2)
    data["budget"]["note"] = budget_record(budget)["note"]  # its wording, kept current
    return data


def merge(out: Path, record: dict, base: dict, budget: dict, smoke: bool, order):
    """Add one row to the Table 3 (§6.2) file under its lock, refusing a row whose
    recorded budget differs from the file's; returns the refusal, or None."""
    with locked(out.with_name(out.name + ".lock")):
        data = read_table(out, base, budget, smoke)
        if finished(record):
            problem = budget_problem(data, record, row_threads(record, base, budget))
            if problem:
                return problem
            data["budget"].setdefault("updates", record["provenance"]["updates"])
        data["rows"] = sorted(
            [o for o in data["rows"] if o["name"] != record["name"]] + [record],
            key=lambda r: order.index(r["name"]) if r["name"] in order else 10**6,
        )
        write_table(out, refreshed(data, base, budget))
    return None


def write_table(out: Path, data: dict) -> None:
    """Write a Table 3 (§6.2) file and redraw its two figures beside it."""
    write_json(out, data)
    draw(data, out.with_suffix(".png"))
    draw_curves(data, out.with_name(out.stem + "-curves.png"))


def refreshed(data: dict, base: dict, budget: dict) -> dict:
    """A Table 3 (§6.2) file's rows with everything derived from them rewritten by
    this version of the runner: the summary, the noise, the plan and the rule."""
    return data | {
        "summary": summarise(data),
        "noise": noise_of(data),
        "plan": plan_of(base, budget),
        "rule": RULE,
    }


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


def run_row(
    row: dict,
    base: dict,
    budget: dict,
    python: str,
    runs: Path,
    options: set[str],
    child: Child,
) -> Optional[dict]:
    """Train one row of Table 3 (§6.2) through the command line (or collect the run
    its directory already holds) and return its record; None if interrupted."""
    run_dir = (runs / row["name"]).absolute()
    overrides, note = row_overrides(row, base, options)
    passed = {
        k: v
        for k, v in budget.items()
        if k not in ("preset", "threads", "wide_threads")
    } | overrides
    budget = budget | {"threads": row_threads(row, base, budget)}  # this row's own
    args = command(python, budget["preset"], relative(run_dir), passed)
    record = {
        "name": row["name"],
        "variation": row["variation"],
        "group": row["group"],
        "seed": row["seed"],
        "fields": row["fields"],
        "passed": passed,
        "run_dir": str(relative(run_dir)),
        "command": f"OMP_NUM_THREADS={budget['threads']} "
        + " ".join(["python", *args[1:]]),
        "paper": paper_values(row["paper_row"]),
    }
    if note:
        record["note"] = note
    saved = saved_settings(run_dir) if run_dir.is_dir() else None
    differ = differences(passed, saved) if saved is not None else {}
    if differ:
        what = "; ".join(f"{k}: {v['ran']!r} there, {v['asked']!r} now" for k, v in
                         differ.items())  # fmt: skip
        return record | {
            "status": "failed",
            "error": f"{run_dir} holds a run with other settings ({what}); move it "
            "away to train this row",
        }
    started = {**row, "base": base, "commit": commit()}
    if saved is not None and (run_dir / "results.json").is_file():
        log(f"row {row['name']}: already trained in {run_dir}; collecting it")
        return record | collect(started, run_dir, budget, python, child)
    if run_dir.is_dir() and newest_checkpoint(run_dir) is not None:
        record["resumed"] = (
            "continued from the checkpoints in its run directory: "
            "train_minutes counts the last stretch only"
        )
    code, stderr = child.run(args, budget["threads"])
    if child.stopped is not None or code == 130:  # stopped here, or the run itself
        child.stopped = child.stopped or signal.SIGTERM
        log(
            f"interrupted by signal {child.stopped} during row {row['name']} "
            f"(exit {code}); run the same command again to continue it"
        )
        return None
    refusal = rejected(stderr, overrides) if code == 2 else None
    if refusal:
        return record | {"status": UNSUPPORTED, "error": refusal}
    if code != 0 or not (run_dir / "results.json").is_file():
        return record | {
            "status": "failed",
            "exit_status": code,
            "error": last_line(stderr),
        }
    return record | collect(started, run_dir, budget, python, child)


def run_table(args, base: dict, budget: dict, out: Path, runs: Path, smoke: bool):
    """Run the rows of Table 3 (§6.2) not yet in ``out``, ``--jobs`` at a time, each
    row in the one worker that holds its lock; merge each into ``out`` (and redraw
    its figures) as it ends. Returns the exit status (0 unless a row failed)."""
    if args.epochs is not None:
        budget = budget | {"epochs": args.epochs}
    rows = table3_rows(base, budget["lr_factor"])
    order = [r["name"] for r in rows]
    wide = {r["name"] for r in rows if row_threads(r, base, budget) > budget["threads"]}
    if smoke and not args.rows:
        rows = [r for r in rows if r["name"] in SMOKE_ROWS]
    rows = select(rows, args.rows)
    with locked(out.with_name(out.name + ".lock")):
        data = read_table(out, base, budget, smoke)  # refuses another budget first
        if args.status:
            print("\n".join(progress(data, rows, runs, wide)))
            return 0
        if not args.refresh and not out.is_file():
            write_json(out, data)
    if args.refresh:  # the source checks take minutes: measured outside the lock
        measured = measure_sources(data, runs, budget, args.python)
        with locked(out.with_name(out.name + ".lock")):
            data = read_table(out, base, budget, smoke)  # rows may have joined
            for r in data["rows"]:
                r |= measured.get(r["name"], {})
            write_table(out, refreshed(data, base, budget))
        log(f"{out}: summary, noise and figures rewritten from its rows")
        return 0
    if args.jobs > 1:

        def untried_wide() -> list[str]:
            with locked(out.with_name(out.name + ".lock")):
                return wide_left(read_table(out, base, budget, smoke), rows, wide)

        return run_workers(args, out, runs, untried_wide)
    options = program_options(args.python, PROGRAM)
    child, failed, later = Child(), 0, []
    held = {r["name"] for r in data["rows"] if finished(r)}
    todo = [r for r in rows if r["name"] not in held]
    log(
        f"{len(rows) - len(todo)} of {len(rows)} row(s) already in {out}; "
        f"{len(todo)} to run, {budget['epochs']} epoch(s) each"
    )
    for row in todo:
        lock = runs / f"{row['name']}.lock"
        with locked(lock, wait=False) as mine:
            if not mine:
                log(f"row {row['name']}: another worker holds it")
                continue
            data = read_table(out, base, budget, smoke)
            if any(o["name"] == row["name"] and finished(o) for o in data["rows"]):
                continue
            why = needless(row, data)
            if why:
                log(f"row {row['name']}: not run: {why}")
                continue
            why = alone_problem(row["name"], rows_held(runs), wide)
            if why:
                log(f"row {row['name']}: not started: {why}")
                later.append(row["name"])
                continue
            log(f"row {row['name']}: training")
            t0 = time.time()
            with LoadWatch(runs) as load:
                record = run_row(row, base, budget, args.python, runs, options, child)
            if record is None:
                return 130
            record["row_wall_minutes"] = (time.time() - t0) / 60
            record |= load.record()
            refusal = merge(out, record, base, budget, smoke, order)
        if refusal:
            failed += 1
            log(f"row {row['name']} not added: {refusal}")
        elif finished(record):
            log(
                f"row {row['name']} done in {record['row_wall_minutes']:.1f} min: "
                f"valid BLEU {record['valid_bleu']:.2f}, valid ppl "
                f"{record['valid_ppl']:.2f}, test BLEU {record['bleu']:.2f}"
            )
        else:
            failed += record["status"] == "failed"
            log(f"row {row['name']}: {record['status']}: {record['error']}")
    if later:
        log(
            f"left for later: {', '.join(later)}; a row wider than the base trains "
            f"alone: `--rows {','.join(later)}` once no other row trains"
        )
    log(f"results in {out}")
    return 1 if failed else 0


def measure_sources(data: dict, runs: Path, budget: dict, python: str) -> dict:
    """The source check of each finished row recorded before it, by row name, where
    the row's run directory still holds its last checkpoint (``--refresh``); a row
    that cannot be checked is named (it counts as trained)."""
    child, measured = Child(), {}
    for r in data["rows"]:
        run_dir = runs / r["name"]
        if not finished(r) or "source_gap" in r:
            continue
        if newest_checkpoint(run_dir) is None:
            log(f"row {r['name']}: no checkpoint in {run_dir}: no source check")
            continue
        measured[r["name"]] = source_check(python, run_dir, budget, child)
        log(f"row {r['name']}: source gap {measured[r['name']]['source_gap']:.2f} nats")
    return measured


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


def progress(data: dict, rows: list[dict], runs: Path, wide=frozenset()) -> list[str]:
    """One line per row of Table 3 (§6.2) in run order — done (with its scores), how
    far it has got, not needed (one seed settles it) or to run (alone, if ``wide``
    names it) — then the counts."""
    done = {r["name"]: r for r in data["rows"] if finished(r)}
    updates = (data.get("budget") or {}).get("updates")
    counts = {"done": 0, "started": 0, "not needed": 0, "to run": 0}
    lines = []
    for row in rows:
        name = row["name"]
        if name in done:
            state = "done"
            r = done[name]
            stretch = " (its last stretch)" if r.get("resumed") else ""
            what = (
                f"valid BLEU {r['valid_bleu']:.2f}, valid ppl {r['valid_ppl']:.2f}, "
                f"{r['train_minutes']:.0f} min{stretch}"
            )
        elif step := last_update(runs / name):
            state = "started"
            what = f"update {step:,}" + (f" of {updates:,}" if updates else "")
        elif why := needless(row, data):
            state, what = "not needed", why
        else:
            state = "to run"
            what = (
                "alone, on more threads (wider than the base)" if name in wide else ""
            )
        counts[state] += 1
        lines.append(f"{name:<16} {state:<10} {what}".rstrip())
    lines.append(
        f"{len(rows)} runs: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    )
    return lines


def wide_left(data: dict, rows: list[dict], wide: set[str]) -> list[str]:
    """The rows of ``rows`` wider than the base (``wide``) that Table 3's file ``data``
    (§6.2) holds no record of, finished or failed, and that still need a run."""
    tried = {r["name"] for r in data["rows"]}
    return [
        r["name"]
        for r in rows
        if r["name"] in wide and r["name"] not in tried and not needless(r, data)
    ]


def run_workers(args, out: Path, runs: Path, untried_wide) -> int:
    """``--jobs N``: N copies of this script, each taking the next row no other holds
    (one thread each); then, unless stopped by a signal, one more copy for the rows
    wider than the base that every worker left for later (``untried_wide()`` names
    them), which it trains alone, one after another. Signals are handed on; the worst
    exit status is returned."""
    base_args = [sys.executable, str(Path(__file__).resolve()), *strip_jobs(args.argv)]
    base_args += ["--out", str(out), "--runs", str(runs)]
    procs, stopped = [], []
    for _ in range(args.jobs):
        procs.append(subprocess.Popen(base_args, cwd=ROOT))
        time.sleep(2)  # the first takes the first row's lock before the next looks

    def forward(signum, frame):
        stopped.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]
    if not stopped and (left := untried_wide()):
        log(f"the rows wider than the base, alone now: {', '.join(left)}")
        procs.append(subprocess.Popen(base_args + ["--rows", ",".join(left)], cwd=ROOT))
        codes.append(procs[-1].wait())
    return max(codes)


def strip_jobs(argv: list[str]) -> list[str]:
    """``argv`` without ``--jobs N``/``--out``/``--runs`` (a worker gets its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--jobs", "--out", "--runs"):
            skip = True
            continue
        if a.startswith(("--jobs=", "--out=", "--runs=")):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

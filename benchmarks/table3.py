"""Table 3 (§6.2, "Model Variations") at our scale: one training run per row.

§6.2 varies the base model one setting at a time — (A) heads, (B) the key size d_k,
(C) depth and width, (D) dropout and label smoothing, (E) learned positions — and
reports each row's perplexity, BLEU and parameter count (Table 3). This script does
the same around the ``multi30k-small`` preset (N=3, d_model=256, d_ff=1024, h=8,
d_k=32, P_drop=0.1, eps_ls=0.1): every row is that preset with a few fields changed,
trained ONE AT A TIME through the command line::

    python the_annotated_transformer.py train --config multi30k-small \\
        --run_dir runs/table3/<row> --<field> <value> ...

It talks to the program only through that command line and the files a run writes
(``results.json``, ``metrics.jsonl``, ``checkpoint-*.pt``); it never imports it.

Run from the repository root::

    python benchmarks/table3.py                   # every row, 4 epochs each (hours)
    python benchmarks/table3.py --rows base,A     # some rows (names or groups)
    python benchmarks/table3.py --smoke           # copy preset, a few updates (<60 s)

Writes ``results/table3.json`` (atomically, after every row) and ``results/table3.png``.
A row already in the JSON with the same budget is skipped; a row that was interrupted
continues from the checkpoints in its run directory (``train`` resumes from them when
run again with the same settings). Rows whose fields this version of the program does
not know (``--d_k`` for rows (B)) are recorded as "not supported by this version".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "the_annotated_transformer.py"
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
SMOKE_ROWS = ("base", "A-h1", "B-dk4", "E-learned")

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


def table3_rows(base: dict) -> list[dict]:
    """The rows of §6.2, Table 3 as field overrides of ``base``, in the order they run.

    Base with seeds 1–3; (A) h ∈ {1, 4, 16, 32} with d_k = d_model/h (constant
    compute); (D) P_drop and eps_ls ∈ {0.0, 0.2}; (B) d_k ∈ {d_k/4, d_k/2} at the
    base's h, d_v unchanged (as the paper's counts show); (C) N ± 1, d_model halved
    and doubled (d_k = d_model/h), d_ff halved and doubled; (E) learned positions.
    Each row names the paper's row with the same ratio to the paper's base (N=6,
    d_model=512, d_ff=2048, d_k=64).
    """
    N, d, ff, h, dk = (base[k] for k in ("N", "d_model", "d_ff", "h", "d_k"))
    rows = [
        ("base", "base", {}, "base"),
        ("base-seed2", "base", {"seed": 2}, "base"),
        ("base-seed3", "base", {"seed": 3}, "base"),
    ]
    for heads in (1, 4, 16, 32):
        rows.append(
            (
                f"A-h{heads}",
                "A",
                {"h": heads, "d_k": d // heads},
                f"(A) h={heads}, d_k=d_v={512 // heads}",
            )
        )
    for p in (0.0, 0.2):
        rows.append((f"D-drop{p}", "D", {"P_drop": p}, f"(D) P_drop={p}"))
    for e in (0.0, 0.2):
        rows.append((f"D-ls{e}", "D", {"eps_ls": e}, f"(D) eps_ls={e}"))
    for k, paper in ((dk // 4, "(B) d_k=16"), (dk // 2, "(B) d_k=32")):
        rows.append((f"B-dk{k}", "B", {"d_k": k}, paper))
    rows += [
        (f"C-N{N - 1}", "C", {"N": N - 1}, "(C) N=4"),
        (f"C-N{N + 1}", "C", {"N": N + 1}, "(C) N=8"),
        (
            f"C-d{d // 2}",
            "C",
            {"d_model": d // 2, "d_k": d // 2 // h},
            "(C) d_model=256, d_k=d_v=32",
        ),
        (
            f"C-d{d * 2}",
            "C",
            {"d_model": d * 2, "d_k": d * 2 // h},
            "(C) d_model=1024, d_k=d_v=128",
        ),
        (f"C-ff{ff // 2}", "C", {"d_ff": ff // 2}, "(C) d_ff=1024"),
        (f"C-ff{ff * 2}", "C", {"d_ff": ff * 2}, "(C) d_ff=4096"),
        (
            "E-learned",
            "E",
            {"positional": "learned"},
            "(E) positional embedding instead of sinusoids",
        ),
    ]
    return [{"name": n, "group": g, "fields": f, "paper_row": p} for n, g, f, p in rows]


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


def last_valid_ppl(metrics: Path) -> tuple[Optional[float], Optional[float]]:
    """(exp of the last validation loss, that loss) from a run's metrics.jsonl, whose
    validation records carry ``valid_loss`` (nats per target token, no smoothing);
    Table 3's PPL column (§6.2)."""
    loss = None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "valid_loss" in record:
            loss = record["valid_loss"]
    return (math.exp(loss) if loss is not None else None), loss


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


def collect(row: dict, run_dir: Path) -> dict:
    """One finished row of Table 3 (§6.2) from the files its run wrote: BLEU (beam 4
    and greedy, test set), validation perplexity, parameters, time and chip."""
    results = json.loads((run_dir / "results.json").read_text())
    ppl, loss = last_valid_ppl(run_dir / "metrics.jsonl")
    checkpoint = newest_checkpoint(run_dir)
    config = results.get("config", {})
    expected = {**row["base"], **row["fields"]}
    differ = {
        k: {"asked": v, "ran": config[k]}
        for k, v in expected.items()
        if k in config and config[k] != v
    }
    out = {
        "status": "done",
        "params": count_parameters(checkpoint) if checkpoint else None,
        "valid_ppl": ppl,
        "valid_loss": loss,
        "bleu": results.get("bleu"),
        "bleu_greedy": results.get("bleu_greedy"),
        "bleu_kind": results.get("bleu_kind"),
        "test_sentences": results.get("test_sentences"),
        "train_minutes": results.get("train_minutes"),
        "total_minutes": results.get("total_minutes"),
        "steps": results.get("steps"),
        "precision": results.get("precision"),
        "device": results.get("device"),
        "device_name": device_name(str(results.get("device", "cpu"))),
        "curve": results.get("curve"),
    }
    if differ:
        out["settings_differ"] = differ
    return out


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


def draw(data: dict, out: Path) -> Path:
    """The figure of Table 3 (§6.2) at our scale: test BLEU per row, grouped A–E, with
    the base seeds' spread as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    seeds = [r["bleu"] for r in rows if r["group"] == "base" and r["status"] == "done"]
    variations = sorted(
        (r for r in rows if r["group"] != "base"),
        key=lambda r: ("ABCDE".index(r["group"]), data_order(data, r)),
    )
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(variations) + 2.5), 4.2))
    if seeds:
        low, high, mean = min(seeds), max(seeds), sum(seeds) / len(seeds)
        ax.axhspan(
            low,
            high,
            color="0.85",
            zorder=0,
            label=f"base, {len(seeds)} seed(s): {low:.1f}–{high:.1f}",
        )
        ax.axhline(mean, color="0.4", lw=1, zorder=1, label=f"base mean {mean:.2f}")
    colours = dict(zip("ABCDE", ("C0", "C1", "C2", "C3", "C4")))
    for i, r in enumerate(variations):
        if r["status"] != "done":  # not supported by this version, or failed
            ax.text(
                i,
                0.02,
                "not run" if r["status"] == "failed" else "n/s",
                ha="center",
                color="0.5",
                transform=ax.get_xaxis_transform(),
            )
            continue
        ax.plot(i, r["bleu"], "o", color=colours[r["group"]], zorder=3)
        if r.get("bleu_greedy") is not None:
            ax.plot(
                i,
                r["bleu_greedy"],
                "o",
                mfc="none",
                color=colours[r["group"]],
                zorder=3,
            )
    for g in "ABCDE":
        at = [i for i, r in enumerate(variations) if r["group"] == g]
        if at:
            ax.axvspan(at[0] - 0.45, at[-1] + 0.45, color=colours[g], alpha=0.06, lw=0)
            ax.text(
                (at[0] + at[-1]) / 2,
                1.01,
                f"({g})",
                ha="center",
                transform=ax.get_xaxis_transform(),
                color=colours[g],
            )
    ax.plot([], [], "o", color="0.3", label="beam 4")
    ax.plot([], [], "o", mfc="none", color="0.3", label="greedy")
    ax.set_xticks(
        range(len(variations)), [r["name"] for r in variations], rotation=60, ha="right"
    )
    ax.set_xlim(-0.7, max(len(variations), 1) - 0.3)
    ax.set_xlabel(
        f"Table 3 row (one setting changed from the base); BLEU: {data['dataset']}"
    )
    ax.set_ylabel("test BLEU")
    budget = data["budget"]
    ax.set_title(
        f"Table 3 (§6.2) at {data['preset']} scale: "
        f"{budget['epochs']} epoch{'s' * (budget['epochs'] != 1)} per row, "
        "last checkpoint",
        pad=18,
    )
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def data_order(data: dict, row: dict) -> int:
    """Where ``row`` stands in the run order of Table 3 (§6.2) (for the figure)."""
    return [r["name"] for r in data["rows"]].index(row["name"])


def select(rows: list[dict], wanted: Optional[str]) -> list[dict]:
    """The Table 3 (§6.2) rows named by ``--rows`` (names or groups), in run order."""
    if not wanted:
        return rows
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    known = {r["name"] for r in rows} | {r["group"] for r in rows}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(
            f"error: unknown row(s) {', '.join(unknown)}; rows: "
            f"{', '.join(r['name'] for r in rows)} (or a group: base, A–E)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return [r for r in rows if r["name"] in names or r["group"] in names]


class Child:
    """The one training process of a Table 3 (§6.2) row; SIGINT/SIGTERM sent to this
    script are handed on to it once (it saves a checkpoint and stops)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.stopped: Optional[int] = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._forward)

    def _forward(self, signum, frame) -> None:
        self.stopped = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def run(self, args: list[str]) -> tuple[int, str]:
        """Run ``args`` to its end, output passed on: (exit status, stderr tail)."""
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stderr=subprocess.PIPE, start_new_session=True
        )
        tail = b""
        while chunk := os.read(self.proc.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-8192:]
        code = self.proc.wait()
        self.proc = None
        return code, tail.decode("utf-8", "replace")


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
        "--epochs",
        type=int,
        default=None,
        help="epochs per row, every row the same (default 4; --smoke: 1)",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="comma-separated row names or groups (base, A–E); default all",
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
        help="results JSON (default results/table3.json; the figure is "
        "written next to it as .png)",
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
    args = p.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
        p.error("--epochs must be at least 1")
    return args


def main(argv: list[str]) -> int:
    """Train the selected rows of Table 3 (§6.2) one at a time and record them."""
    args = parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="table3-smoke-") as tmp:
            out = args.out or Path(tmp) / "table3.json"
            runs = args.runs or out.parent / "table3-runs"
            code = run_table(args, "copy", SMOKE_BASE, out, runs, smoke=True)
            if args.out is None:
                data = json.loads(out.read_text())
                for r in data["rows"]:
                    log(
                        f"smoke row {r['name']}: {r['status']}"
                        + (
                            f", BLEU {r['bleu']:.2f}, {r['params']:,} parameters"
                            if r["status"] == "done"
                            else ""
                        )
                    )
            return code
    out = args.out or ROOT / "results" / "table3.json"
    runs = args.runs or ROOT / "runs" / "table3"
    return run_table(args, "multi30k-small", BASE, out, runs, smoke=False)


def budget_for(preset: str, epochs: int, smoke: bool) -> dict:
    """The training budget every row of one Table 3 (§6.2) file shares: the preset,
    the epochs and the checkpoint scored (``note`` says why; not compared)."""
    budget = {"preset": preset, "epochs": epochs, "average_last": 0}
    if smoke:
        budget |= {"max_steps": 5, "max_eval_sentences": 20}
    budget["note"] = (
        "average_last 0 scores the last checkpoint only: §6.2 uses no "
        "checkpoint averaging, and with one checkpoint per epoch the "
        "last 5 would include the first epochs' barely trained models"
    )
    return budget


def same_budget(a: dict, b: dict) -> bool:
    """Whether two Table 3 (§6.2) budgets agree (their notes aside)."""
    return {k: v for k, v in a.items() if k != "note"} == {
        k: v for k, v in b.items() if k != "note"
    }


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
    passed = overrides | {
        k: v for k, v in budget.items() if k not in ("preset", "note")
    }
    args = command(python, budget["preset"], relative(run_dir), passed)
    record = {
        "name": row["name"],
        "group": row["group"],
        "fields": row["fields"],
        "passed": passed,
        "run_dir": str(relative(run_dir)),
        "command": " ".join(["python", *args[1:]]),
        "paper": paper_values(row["paper_row"]),
    }
    if note:
        record["note"] = note
    saved = saved_settings(run_dir) if run_dir.is_dir() else None
    differ = [
        f"{k}: {saved[k]!r} there, {v!r} now"
        for k, v in passed.items()
        if saved is not None and k in saved and saved[k] != v
    ]
    if differ:
        why = f"{run_dir} holds a run with other settings ({'; '.join(differ)})"
        return record | {
            "status": "failed",
            "error": f"{why}; move it away to train this row",
        }
    if saved is not None and (run_dir / "results.json").is_file():
        log(f"row {row['name']}: already trained in {run_dir}; collecting it")
        return record | collect({**row, "base": base}, run_dir)
    if run_dir.is_dir() and newest_checkpoint(run_dir) is not None:
        record["resumed"] = (
            "continued from the checkpoints in its run directory: "
            "train_minutes counts the last session only"
        )
    code, stderr = child.run(args)
    if child.stopped is not None:
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
    return record | collect({**row, "base": base}, run_dir)


def run_table(args, preset: str, base: dict, out: Path, runs: Path, smoke: bool) -> int:
    """Run the rows of Table 3 (§6.2) not yet in ``out``, one at a time; write ``out``
    and its figure after every row. Returns the exit status (0 unless a row failed)."""
    budget = budget_for(preset, args.epochs or (1 if smoke else 4), smoke)
    rows = table3_rows(base)
    order = [r["name"] for r in rows]
    if smoke and not args.rows:
        rows = [r for r in rows if r["name"] in SMOKE_ROWS]
    rows = select(rows, args.rows)
    data = {
        "table": "Table 3 (§6.2, model variations) at our scale",
        "preset": preset,
        "dataset": "copy task"
        if smoke
        else "Multi30k test2016, detokenized cased sacreBLEU",
        "base": base,
        "budget": budget,
        "paper_note": PAPER_NOTE,
        "rows": [],
    }
    if out.is_file():
        old = json.loads(out.read_text())
        if not same_budget(old["budget"], budget):
            was, now = (
                {k: v for k, v in b.items() if k != "note"}
                for b in (old["budget"], budget)
            )
            print(
                f"error: {out} holds rows trained with budget {was}, not {now}; one "
                "file holds one budget: give another --out or the same --epochs",
                file=sys.stderr,
            )
            return 2
        data["rows"] = old["rows"]
    options = program_options(args.python, PROGRAM)
    child, failed, spent = Child(), 0, []
    todo = [
        r
        for r in rows
        if not any(
            o["name"] == r["name"] and o["status"] == "done" for o in data["rows"]
        )
    ]
    log(
        f"{len(rows) - len(todo)} of {len(rows)} row(s) already in {out}; "
        f"{len(todo)} to run, {budget['epochs']} epoch(s) each"
    )
    for i, row in enumerate(todo, 1):
        left = (
            f"; about {sum(spent) / len(spent) * (len(todo) - i + 1):.0f} min left"
            if spent
            else ""
        )
        log(f"row {row['name']} ({i}/{len(todo)}){left}")
        t0 = time.time()
        record = run_row(row, base, budget, args.python, runs, options, child)
        if record is None:
            return 130
        record["row_wall_minutes"] = (time.time() - t0) / 60
        if record["status"] == "done":
            spent.append(record["row_wall_minutes"])
            log(
                f"row {row['name']} done in {record['row_wall_minutes']:.1f} min: "
                f"BLEU {record['bleu']:.2f} (greedy {record['bleu_greedy']:.2f}), "
                f"valid ppl {record['valid_ppl']:.2f}, {record['params']:,} parameters"
            )
        else:
            failed += record["status"] == "failed"
            log(f"row {row['name']}: {record['status']}: {record['error']}")
        data["rows"] = sorted(
            [o for o in data["rows"] if o["name"] != row["name"]] + [record],
            key=lambda r: order.index(r["name"]),
        )
        write_json(out, data)
        draw(data, out.with_suffix(".png"))
    if not todo and data["rows"]:
        draw(data, out.with_suffix(".png"))
    log(f"results in {out} and {out.with_suffix('.png')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Table 3 (§6.2) at our scale, as Part 4 shows it: read from ``results/table3.json``
(written by ``benchmarks/table3.py``), never trained here (our addition).

`read_table3` gives the table as Markdown (our rows beside the paper's), its figures,
and one paragraph per row group with the noise rule's verdicts and the variations "not
yet measured at the full budget" — all the group says where none has finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GROUPS = "ABCDE"
# A seed whose last validation perplexity lies more than 5% above its lowest has
# over-fitted (the base's seeds end within 1.3% of theirs).
OVERFIT = 1.05
# A seed whose validation perplexity fell by more than 10% over its last three epochs
# was still learning when its schedule ended (the base's seeds fell by 1.7-5.0%).
STILL_LEARNING = 0.90
FIGURES = (
    (
        "table3-curves.png",
        "Validation perplexity after each epoch for every finished Table 3 row, one "
        "panel per row group: a colour per variation, its first seed solid and its "
        "second dashed, with the base's seeds in grey.",
    ),
    (
        "table3.png",
        "Validation BLEU of each Table 3 variation, one dot per seed and a bar at the "
        "mean of the seeds that trained (a cross: one that failed to train), beside "
        "the band of the base's seeds.",
    ),
)


def still_learning(curve: list[dict]) -> bool:
    """Whether a run's validation perplexity fell below ``STILL_LEARNING`` times its
    value three epochs before the end: its schedule ended while it still learned
    (False where the curve is too short to say)."""
    if len(curve) < 4:
        return False
    return curve[-1]["valid_ppl"] < STILL_LEARNING * curve[-4]["valid_ppl"]


def _spread(stat: dict, digits: int = 2) -> str:
    """ "mean ± sd" of a summary statistic, or the one value where there is one seed."""
    if stat["sd"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}"


def _changed(fields: dict) -> str:
    """A row's changed settings as the paper names them (seed aside)."""
    names = {"P_drop": "P_drop", "eps_ls": "ε_ls", "lr_factor": "lr_factor"}
    return (
        ", ".join(f"{names.get(k, k)}={v}" for k, v in fields.items() if k != "seed")
        or "—"
    )


@dataclass(frozen=True)
class Table3:
    """The contents of a Table 3 results file (§6.2), for display."""

    data: dict
    folder: Path

    @property
    def summary(self) -> list[dict]:
        return self.data.get("summary", [])

    @property
    def budget_line(self) -> str:
        """One line: the budget every row shares, how many runs have finished, how
        many second seeds the rule made unneeded, and how many are left to run."""
        b = self.data["budget"]
        if b is None:
            return f"no {self.data['missing']} here: `make table3` writes it"
        done = [r for r in self.data["rows"] if r.get("status") == "done"]
        planned = {p["variation"]: len(p["seeds"]) for p in self.data.get("plan") or []}
        skipped = sum(  # a settled variation with fewer seeds than planned
            max(planned.get(s["variation"], 0) - len(s["seeds"]), 0)
            for s in self.summary
            if s.get("settled")
        )
        left = sum(planned.values()) - len(done) - skipped
        runs = f"{len(done)} run(s) finished" + (
            f", {skipped} second seed(s) not needed by the rule" if skipped else ""
        )
        updates = f"{b['updates']:,} updates" if b.get("updates") else "updates"
        wide = b.get("wide_threads", b["threads"])
        wider = (
            f" ({wide} for a row wider than the base)" if wide != b["threads"] else ""
        )
        return (
            f"every row: {b['epochs']} epochs of {b['preset']} ({updates}, warm-up "
            f"{b['warmup']:,}), {b['precision']}, {b['attention']} attention, "
            f"{b['threads']} thread(s){wider}, the last checkpoint scored; "
            f"{runs}" + (f", {left} still to run" if left > 0 else "")
        )

    def _fields(self, variation: str) -> dict:
        for r in self.data["rows"]:
            if r.get("variation", r["name"]) == variation:
                return r.get("fields", {})
        return {}

    def markdown(self) -> str:
        """The table: every variation the file plans, our columns (validation
        perplexity and BLEU, test BLEU, parameters, seeds, the verdict) beside the
        paper's (PPL, BLEU, parameters); a variation not finished yet shows its
        paper's columns and "not yet run"."""
        head = (
            "| row | changed | seeds | params | valid PPL | valid BLEU | test BLEU "
            "| Δ valid BLEU | verdict | paper PPL | paper BLEU | paper params |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        done = {s["variation"]: s for s in self.summary}
        plan = self.data.get("plan") or list(done.values())
        lines = []
        for entry in plan:
            p, name = entry["paper"], entry["variation"]
            paper = (
                f"| {p['ppl_dev']} | {p['bleu_dev']} | {p['params_million'] or ''} |"
            )
            fields = entry.get("fields") or self._fields(name)
            s = done.get(name)
            if s is None:
                lines.append(
                    f"| {name} | {_changed(fields)} | 0 of {len(entry['seeds'])} "
                    f"| | | not yet run | | | {paper}"
                )
                continue
            delta = s.get("diff_valid_bleu")
            delta = "" if delta is None else f"{delta:+.2f}"
            seeds, verdict = len(s["seeds"]), s.get("verdict", "")
            if not s.get("settled", False):  # more seeds to come: no verdict yet
                seeds, verdict = f"{seeds} of {len(entry['seeds'])}", ""
            if failed := s.get("failed_seeds"):
                seeds = f"{seeds} ({len(failed)} failed to train)"
            lines.append(
                f"| {name} | {_changed(fields)} | {seeds} "
                f"| {s['params'] / 1e6:.2f}M | {_spread(s['valid_ppl'])} "
                f"| {_spread(s['valid_bleu'])} | {_spread(s['test_bleu'])} "
                f"| {delta} | {verdict} " + paper
            )
        note = f"\n\nRule: {self.data['rule']}" if self.data.get("rule") else ""
        if not lines:
            return "No Table 3 file here yet." + note
        return head + "\n".join(lines) + note

    def figures(self) -> list[tuple[str, str]]:
        """(path, alt text) of the figures drawn from the file, where they exist."""
        return [
            (str(self.folder / name), alt)
            for name, alt in FIGURES
            if (self.folder / name).is_file()
        ]

    def noise(self) -> tuple[float | None, int]:
        """(pooled seed standard deviation of validation BLEU, rows it pools): the
        rule's yardstick, as the runner recorded it."""
        noise = self.data.get("noise") or {}
        return noise.get("sd"), noise.get("rows", 0)

    def _seeds(self, s: dict) -> str:
        """How many seeds a variation's numbers rest on, and each seed that failed to
        train with its source gap beside the base's (the rule's test)."""
        n = len(s["seeds"]) - len(s.get("failed_seeds", []))
        text = f"{n} seed{'s' * (n != 1)}"
        if n == 0:  # the numbers are the failed seeds' own
            n = len(s["seeds"])
            text = f"{n} seed{'s' * (n != 1)}, none trained"
        base = next((b for b in self.summary if b["variation"] == "base"), {})
        for r in self.data["rows"]:
            if r.get("variation", r["name"]) == s["variation"] and r.get(
                "seed", 1
            ) in s.get("failed_seeds", []):
                text += (
                    f"; seed {r.get('seed', 1)} failed to train: its validation loss "
                    f"rose {r['source_gap']:.2f} nats per token with other pairs' "
                    "sources"
                )
                if base.get("source_gap") and s is not base:
                    text += f", the base's {_spread(base['source_gap'])}"
        return text

    def _curves(self, variation: str) -> list[tuple[int, list]]:
        """(seed, validation curve) of each seed of ``variation`` that has a curve."""
        return [
            (r.get("seed", 1), r["curve"])
            for r in self.data["rows"]
            if r.get("variation", r["name"]) == variation and r.get("curve")
        ]

    def _overfits(self, variation: str) -> str:
        """Each seed of ``variation`` whose validation perplexity ended more than
        ``OVERFIT`` above its lowest (its curve rose again: over-fitting), with the
        epoch of the lowest; "" where none did."""
        notes = []
        for seed, curve in self._curves(variation):
            low = min(curve, key=lambda c: c["valid_ppl"])
            if curve[-1]["valid_ppl"] > OVERFIT * low["valid_ppl"]:
                notes.append(
                    f"seed {seed}'s validation perplexity was lowest after "
                    f"epoch {low['epoch']} ({low['valid_ppl']:.2f}) and rose to "
                    f"{curve[-1]['valid_ppl']:.2f} by epoch {curve[-1]['epoch']}: it "
                    "over-fits"
                )
        return "".join(f"; {n}" for n in notes)

    def _still_learning(self, variation: str) -> str:
        """Each seed of ``variation`` whose validation perplexity fell below
        ``STILL_LEARNING`` times its value three epochs before the end: the schedule
        ended while it still learned, so its score is that of an unfinished run; ""
        where none did (or its curve is too short to say)."""
        notes = []
        for seed, curve in self._curves(variation):
            if still_learning(curve):
                before, end = curve[-4], curve[-1]
                fell = 1 - end["valid_ppl"] / before["valid_ppl"]
                notes.append(
                    f"seed {seed}'s validation perplexity still fell "
                    f"{fell:.0%} over its last three epochs ({before['valid_ppl']:.2f} "
                    f"after epoch {before['epoch']}, {end['valid_ppl']:.2f} after "
                    f"{end['epoch']}): it was still learning when its schedule ended"
                )
        return "".join(f"; {n}" for n in notes)

    def _rate_control(self, s: dict) -> str:
        """For a learning-rate control (a row that also sets ``lr_factor``): its
        validation BLEU against the same variation at Eq. 3's own rate, and whether
        that gap lies beyond the rule's 2·s; "" for any other row."""
        fields = self._fields(s["variation"])
        if "lr_factor" not in fields:
            return ""
        width = {k: v for k, v in fields.items() if k != "lr_factor"}
        plain = next(
            (
                o
                for o in self.summary
                if o is not s and self._fields(o["variation"]) == width
            ),
            None,
        )
        if plain is None:
            return ""
        gap = s["valid_bleu"]["mean"] - plain["valid_bleu"]["mean"]
        sd, _ = self.noise()
        beyond = (
            "" if sd is None else f", {'beyond' if abs(gap) > 2 * sd else 'within'} 2·s"
        )
        return (
            f"; at Eq. 3's own rate ({plain['variation']}) the same model scored "
            f"{_spread(plain['valid_bleu'])} ({self._seeds(plain)}): the base's peak "
            f"learning rate moves it by {gap:+.2f}{beyond}"
        )

    def findings(self) -> str:
        """One paragraph per row group: each finished variation's validation BLEU
        against the base's, and the rule's verdict against the paper's difference once
        the variation has its seeds ("seeds to come" before), a seed that over-fits
        or was still learning at the end, and a learning-rate control's gap to the
        same width at Eq. 3's rate; then the group's planned variations with no
        finished run, named as not yet measured; a group with no finished row states
        no finding."""
        base = next((s for s in self.summary if s["variation"] == "base"), None)
        sd, pooled = self.noise()
        out = [
            f"The rule's yardstick: 2·s = {2 * sd:.2f} BLEU, s pooled over the seeds "
            f"of {pooled} row(s)."
            if sd is not None
            else "No row has two seeds yet, so the rule can tell nothing yet."
        ]
        for g in GROUPS:
            rows = [s for s in self.summary if s["group"] == g]
            if not rows or base is None:
                out.append(f"**({g})** Not yet measured at the full budget.")
                continue
            parts = [
                f"{_changed(self._fields(s['variation']))}: {_spread(s['valid_bleu'])} "
                f"({self._seeds(s)}), "
                f"{s['diff_valid_bleu']:+.2f} against the paper's "
                f"{s['paper_diff_bleu']:+.1f}: "
                + (f"**{s['verdict']}**" if s.get("settled") else "seeds to come")
                + self._overfits(s["variation"])
                + self._still_learning(s["variation"])
                + self._rate_control(s)
                for s in rows
            ]
            done = {s["variation"] for s in rows}
            pending = [
                f"{_changed(e.get('fields') or {})} ({e['variation']})"
                for e in self.data.get("plan") or []
                if e.get("group") == g and e["variation"] not in done
            ]
            later = (
                f" Not yet measured at the full budget: {'; '.join(pending)}."
                if pending
                else ""
            )
            out.append(
                f"**({g})** Validation BLEU against the base's "
                f"{_spread(base['valid_bleu'])} ({self._seeds(base)}): "
                + "; ".join(parts)
                + "."
                + later
            )
        return "\n\n".join(out)


def read_table3(path: str | Path) -> Table3:
    """The Table 3 results file at ``path`` (§6.2), for Part 4's cells; where there is
    none (the notebook run outside the repository), a table with no rows that says
    so."""
    path = Path(path)
    if not path.is_file():
        empty = {"budget": None, "rows": [], "summary": [], "missing": str(path)}
        return Table3(empty, path.parent)
    return Table3(json.loads(path.read_text(encoding="utf-8")), path.parent)

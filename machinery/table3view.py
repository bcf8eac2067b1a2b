"""Table 3 (§6.2) at our scale, as Part 4 shows it: read from ``results/table3.json``
(written by ``benchmarks/table3.py``), never trained here (our addition).

`read_table3` gives the table as Markdown (our rows beside the paper's), its figures,
and one paragraph per row group with the noise rule's verdicts and the variations "not
yet measured at the full budget" — all the group says where none has finished.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .runs import path_taken

GROUPS = "ABCDE"
# A seed whose last validation perplexity lies more than 5% above its lowest has
# over-fitted (the base's seeds end within 1.3% of theirs).
OVERFIT = 1.05
# A seed whose validation perplexity fell by more than 10% over its last three epochs
# was still learning when its schedule ended (the base's seeds fell by 1.7-5.0%).
STILL_LEARNING = 0.90
# A BLEU difference found with the paper's sign but ten times its size (or more) agrees
# in sign only, and the paragraph says so (the two tables are on different data, so
# only a gap of this order is worth a word).
SIZE_APART = 10


def untranslated_base(record: dict) -> bool:
    """Whether ``record`` is a finished base run recorded without its validation
    translations (before they were kept): it trains again, as every variation's
    paired sentence-level test needs its seed's base."""
    return (
        record.get("group") == "base"
        and record.get("status") == "done"
        and not (record.get("provenance") or {}).get("hypotheses_sha256")
    )


def controlled_name(control: str) -> str:
    """The variation a learning-rate control holds Eq. 3's rate apart from."""
    return control.removesuffix("-lr")


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


def _p(p: float) -> str:
    """A p-value as a table shows it."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _at_most(p: float) -> str:
    """An upper bound on a p-value (Grubbs's), as the text shows it."""
    return "< 0.001" if p < 0.001 else f"≤ {p:.3f}"


# A variation the base cannot be compared with for a measure: the check set one of
# them apart and they share fewer than two seeds (table3_stats.test_table).
UNCOMPARED = (
    "not tested (a row's seeds lie far apart and it shares fewer than two seeds with "
    "the other: no paired test)"
)


# The table marks a verdict's qualifiers; its legend spells them out.
MARKS = {
    "one seed": "¹",
    "still learning at the end of its schedule": "²",
    "a seed failed to train": "³",
    "its seeds lie far apart: compared seed by seed": "⁴",
    "the base's seeds lie far apart: compared seed by seed": "⁵",
}


def _short(verdict: str) -> str:
    """A verdict as the table's cell shows it: "no difference detected (the test
    would see ≥ X)" as "none (≥ X)", and each qualifier as its mark."""
    marks = "".join(mark for words, mark in MARKS.items() if words in verdict)
    for words in MARKS:
        verdict = verdict.replace(words, "")
    verdict = re.sub(r"\s*\((;\s*)*\)$", "", verdict).strip()  # emptied qualifiers
    verdict = re.sub(
        r"no difference detected \(the test would see ≥ ([\d.]+%?)[^)]*\)",
        r"none (≥ \1)",
        verdict,
    )
    verdict = verdict.replace(
        "no difference detected (the test would see only one above 100 BLEU)",
        "none (> 100)",
    )
    return verdict + marks


def _paired(s: dict) -> str:
    """A variation's paired sentence-level tests, seed by seed ("s1 -0.42, p 0.120");
    "—" where none was possible."""
    tests = s.get("paired") or []
    said = [f"s{t['seed']} {t['delta']:+.2f}, p {_p(t['p'])}" for t in tests]
    return "; ".join(said) or "—"


def _paper_row(label: str) -> str:
    """The paper's row as the table names it, briefly."""
    return label.replace("d_k=d_v=", "d_k=").replace(
        "positional embedding instead of sinusoids", "learned positions"
    )


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
        """One line: the budget every row shares, how many runs have finished, and
        how many of those the plan always makes are still to run (a third seed is
        decided by the test once every other run has finished)."""
        b = self.data["budget"]
        if b is None:
            return f"no {self.data['missing']} here: `make table3` writes it"
        done = [
            r
            for r in self.data["rows"]
            if r.get("status") == "done"
            and ((r.get("provenance") or {}).get("epoch1_check") or {}).get("match")
            is not False  # a row whose epoch-1 check failed trains again
        ]
        names = {r.get("variation", r["name"]): set() for r in done}
        for r in done:
            names[r.get("variation", r["name"])].add(r.get("seed", 1))
        plan = self.data.get("plan") or []
        left = sum(
            len(set(p["seeds"]) - names.get(p["variation"], set())) for p in plan
        )
        runs = f"{len(done)} run{'s' * (len(done) != 1)} finished" + (
            f", {left} still to run" if left > 0 else ""
        )
        if again := sum(map(untranslated_base, done)):
            runs += (
                f", {again} base run{'s' * (again != 1)} to train again to keep their "
                "translations "
                "(the sentence-level test's other half)"
            )
        updates = f"{b['updates']:,} updates" if b.get("updates") else "updates"
        wide = b.get("wide_threads", b["threads"])
        wider = (
            f" ({wide} for a row wider than the base)" if wide != b["threads"] else ""
        )
        return (
            f"every row: {b['epochs']} epochs of {b['preset']} ({updates}, warm-up "
            f"{b['warmup']:,}), {path_taken(b)}{wider}, the last checkpoint scored; "
            f"{runs}"
        )

    def _fields(self, variation: str) -> dict:
        for r in self.data["rows"]:
            if r.get("variation", r["name"]) == variation:
                return r.get("fields", {})
        return {}

    def markdown(self) -> str:
        """Two tables. The first: every variation the file plans, the paper's row it
        is read against, its seeds, and for each measure the test's difference from
        the base (95% interval) and verdict, beside the paper's own differences. The
        second: the scores themselves (validation perplexity and BLEU, test BLEU)
        and each test's p. A variation not finished yet shows the paper's numbers and
        "not yet run"."""
        head = (
            "| row | paper row | seeds | Δ BLEU (95% CI) | BLEU verdict "
            "| Δ PPL (95% CI) | PPL verdict | paper Δ BLEU, PPL |\n"
            "|---|---|---|---|---|---|---|---|\n"
        )
        scores = (
            "| row | valid PPL | valid BLEU | test BLEU | p, BLEU | p, PPL "
            "| sentence test |\n|---|---|---|---|---|---|---|\n"
        )
        done = {s["variation"]: s for s in self.summary}
        plan = self.data.get("plan") or list(done.values())
        lines, numbers = [], []
        for entry in plan:
            name, p = entry["variation"], entry["paper"]
            theirs = (
                ""
                if name == "base"
                else f"{p['bleu_dev'] - 25.8:+.1f}, {p['ppl_dev'] - 4.92:+.2f}"
            )
            row = "—" if entry.get("control") else _paper_row(p["row"])
            s = done.get(name)
            if s is None:
                lines.append(
                    f"| {name} | {row} | 0 of {len(entry['seeds'])} | not yet run "
                    f"| | | | {theirs} |"
                )
                continue
            runs, planned = len(s["seeds"]), len(entry["seeds"])
            seeds = f"{runs}" if runs >= planned else f"{runs} of {planned}"
            if failed := s.get("failed_seeds"):
                seeds += f" ({len(failed)} failed)"
            cells = [self._test_cells(s, m) for m in ("bleu", "ppl")]
            lines.append(
                f"| {name} | {row} | {seeds} | {' | '.join(c[0] for c in cells)} "
                f"| {theirs} |"
            )
            numbers.append(
                f"| {name} | {_spread(s['valid_ppl'])} | {_spread(s['valid_bleu'])} "
                f"| {_spread(s['test_bleu'])} | {cells[0][1]} | {cells[1][1]} "
                f"| {_paired(s)} |"
            )
        legend = "; ".join(f"{m} {w}" for w, m in MARKS.items())
        froms = [
            f"{s['variation']} from {t['against']}"
            for s in self.summary
            if s.get("control") and (t := (s.get("tests") or {}).get("bleu"))
        ]
        note = (
            f"\n\nMarks: {legend}. A control's Δ is from the same width at Eq. 3's "
            "own rate, or from the base where that width is not tested"
            + (f" ({', '.join(froms)})." if froms else ".")
        )
        if not lines:
            rule = f"\n\nThe test: {self.data['rule']}" if self.data.get("rule") else ""
            return "No Table 3 file here yet." + rule
        out = head + "\n".join(lines) + note
        if numbers:
            out += "\n\nThe scores (mean ± sd over the seeds that trained), each "
            out += "test's p, and the paired sentence-level test of each seed against "
            out += "its seed's base (Δ valid BLEU, p; where both runs' translations "
            out += "are kept):\n\n" + scores + "\n".join(numbers)
        if self.data.get("rule"):
            out += f"\n\nThe test: {self.data['rule']}"
        return out

    def _test_cells(self, s: dict, measure: str) -> tuple[str, str]:
        """One measure's test as two cells, "Δ (95% interval) | verdict" (a
        control's Δ is from the same width at Eq. 3's rate), and its p."""
        t = (s.get("tests") or {}).get(measure)
        if t is None:
            verdict = _short((s.get("verdict") or {}).get(measure, ""))
            return f" | {verdict}", ""
        pct = measure == "ppl"
        delta = t["delta_pct"] if pct else t["delta"]
        low, high = t["interval_pct"] if pct else t["interval"]
        unit = "%" if pct else ""
        cell = f"{delta:+.{1 if pct else 2}f}{unit} ({low:+.1f}, {high:+.1f})"
        verdict = _short((s.get("verdict") or {}).get(measure, ""))
        return f"{cell} | {verdict}", _p(t["p"])

    def figures(self) -> list[tuple[str, str]]:
        """(path, alt text) of the figures drawn from the file, where they exist."""
        return [
            (str(self.folder / name), alt)
            for name, alt in FIGURES
            if (self.folder / name).is_file()
        ]

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

    def _measure(self, s: dict, measure: str) -> str:
        """One measure's result for a variation in words: Δ with its interval and
        p, then the verdict in bold and the paper's own difference."""
        t = (s.get("tests") or {}).get(measure)
        verdict = (s.get("verdict") or {}).get(measure)
        if t is None:
            return f"**{verdict}**" if verdict else "no test yet"
        if measure == "bleu":
            said = (
                f"BLEU {t['delta']:+.2f} ({t['interval'][0]:+.2f} to "
                f"{t['interval'][1]:+.2f}), p {_p(t['p'])}"
            )
            theirs = f"the paper's {t['paper_delta']:+.1f}"
            times = abs(t["delta"]) / max(abs(t["paper_delta"]), 0.1)
            if t["word"] == "agrees" and times >= SIZE_APART:
                theirs += (
                    f"; ours is {times:.0f}× its size: the sign agrees, not the size"
                )
        else:
            low, high = t["interval_pct"]
            said = (
                f"perplexity {t['delta_pct']:+.1f}% ({low:+.1f}% to {high:+.1f}%), "
                f"p {_p(t['p'])}"
            )
            theirs = f"the paper's {t['paper_delta']:+.2f}"
        return f"{said}: **{verdict}** ({theirs})"

    def _variation(self, s: dict) -> str:
        """A variation's sentence: what changed and the paper row it is read
        against, its seeds, both measures' results (and a word where they part),
        then its seeds that over-fit or were still learning."""
        name = s["variation"]
        head = (
            f"{_changed(self._fields(name))} ({name}, against the paper's "
            f'"{s["paper_row"]}"; {self._seeds(s)}): '
        )
        verdict = s.get("verdict") or {}
        if not s.get("tests") and len(set(verdict.values())) == 1:  # one word for both
            said = f"**{verdict['bleu']}** for either measure"
        else:
            said = "; ".join(self._measure(s, m) for m in ("bleu", "ppl"))
        counted = s.get("counted") or {}
        if (
            counted.get("bleu") != counted.get("ppl")
            and "not counted" not in counted.values()
        ):
            said += "; the two measures part here"
        return (
            head
            + said
            + self._apart(s)
            + self._overfits(name)
            + self._still_learning(name)
        )

    def _apart(self, s: dict) -> str:
        """Where the check of σ set this variation's own seeds apart: by how much,
        for which measures, and what its test became; "" where it did not."""
        said = []
        for m, what in (("bleu", "BLEU"), ("ppl", "log perplexity")):
            t = (s.get("tests") or {}).get(m) or {}
            for c in t.get("spread_check", []):
                if c["variation"] == s["variation"]:
                    said.append(
                        f"its seed 2 lies {c['difference']:+.3g} {what} from its seed "
                        f"1, where over the {c['k']} rows with both seeds the "
                        f"average is {c['mean']:+.3g} (Grubbs's G {c['G']:.2f} "
                        f"against {c['critical']:.2f}, p {_at_most(c['p'])})"
                    )
        if not said:
            return ""
        dof = next(t["dof"] for t in s["tests"].values() if t.get("spread_check"))
        return (
            "; " + " and ".join(said) + ": its seeds lie further apart than one σ "
            "plausibly allows, so it leaves the estimate of the noise and is compared "
            "seed by seed on the seeds both rows share, without the common σ (paired "
            f"t, {dof} degree{'s' * (dof != 1)} of freedom)"
        )

    def _control(self, s: dict) -> str:
        """A learning-rate control's sentence: what Eq. 3's rate does at its width
        (against the same width at Eq. 3's own rate) and where it lies from the
        base, or, where that width is not tested, from the base alone, saying so; no
        verdict against the paper."""
        parts = []
        for m, unit in (("bleu", ""), ("ppl", "%")):
            t = (s.get("tests") or {}).get(m)
            if t is None:
                continue
            key = "delta_pct" if m == "ppl" else "delta"
            base, what = t.get("vs_base"), "BLEU" if m == "bleu" else "perplexity"
            if base is None:  # the base set apart, and too few seeds shared with it
                parts.append(
                    f"{what} {t[key]:+.2f}{unit} against {t['against']} (p "
                    f"{_p(t['p'])}; no comparison with the base)"
                )
                continue
            if t["against"] == "base":  # its width at Eq. 3's rate is not tested
                parts.append(
                    f"{what} {base[key]:+.2f}{unit} against the base (p "
                    f"{_p(base['p'])}; {controlled_name(s['variation'])}, not tested, "
                    "gives no comparison at its own width)"
                )
                continue
            parts.append(
                f"{what} {t[key]:+.2f}{unit} against {t['against']} (p {_p(t['p'])}) "
                f"and {base[key]:+.2f}{unit} against the base (p {_p(base['p'])})"
            )
        return (
            f"{_changed(self._fields(s['variation']))} ({s['variation']}, "
            f"{self._seeds(s)}): " + "; ".join(parts) + self._apart(s)
        )

    def counts(self, measure: str) -> dict[str, int]:
        """How many of the paper's variations each word counts, for one measure:
        agrees, disagrees, no difference detected, not counted."""
        out = {"agrees": 0, "disagrees": 0, "no difference detected": 0}
        out["not counted"] = 0
        for s in self.summary:
            word = (s.get("counted") or {}).get(measure)
            if word in out:
                out[word] += 1
        return out

    def findings(self) -> str:
        """The test in one sentence with its counts for both measures, then one
        paragraph per row group: each variation's result for both measures against
        the paper's row, the learning-rate controls apart (what the rate does, no
        verdict), and "bigger models are better" read against them; a group with no
        finished row states no finding."""
        base = next((s for s in self.summary if s["variation"] == "base"), None)
        if base is None:
            return "The base has not finished yet: no variation can be read."
        out = []
        for m, what in (("bleu", "validation BLEU"), ("ppl", "validation perplexity")):
            c = self.counts(m)
            total = sum(c.values())
            if total:
                out.append(
                    f"By {what}, of {total} variations of the paper: "
                    f"{c['agrees']} agree, {c['disagrees']} disagree, "
                    f"{c['no difference detected']} show no difference the test can "
                    f"detect, and {c['not counted']} are not counted (a seed still "
                    "learning at the end of its schedule: not tested; or one that "
                    f"failed to train{self._uncompared(m)})."
                )
        for g in GROUPS:
            rows = [s for s in self.summary if s["group"] == g]
            plain = [s for s in rows if not s.get("control")]
            controls = [s for s in rows if s.get("control")]
            if not rows:
                out.append(f"**({g})** Not yet measured at the full budget.")
                continue
            text = f"**({g})** " + "; ".join(self._variation(s) for s in plain) + "."
            if controls:
                text += (
                    " Learning-rate controls (Eq. 3's peak held at the base's; no "
                    "verdict against the paper): "
                    + "; ".join(self._control(s) for s in controls)
                    + ". "
                    + self._bigger(controls)
                )
            done = {s["variation"] for s in rows}
            pending = [
                f"{_changed(e.get('fields') or {})} ({e['variation']})"
                for e in self.data.get("plan") or []
                if e.get("group") == g and e["variation"] not in done
            ]
            if pending:
                text += f" Not yet measured at the full budget: {'; '.join(pending)}."
            out.append(text)
        return "\n\n".join(out)

    def _uncompared(self, measure: str) -> str:
        """The third reason a variation is not counted, where one has it: the check
        of σ set it or the base apart and they share too few seeds for a paired
        test."""
        said = [(s.get("verdict") or {}).get(measure, "") for s in self.summary]
        if UNCOMPARED in said:
            return "; or, a row's seeds set apart, too few seeds for a paired test"
        return ""

    def _bigger(self, controls: list[dict]) -> str:
        """ "Bigger models are better" (§6.2) read against the controls: with the
        peak rate held, does BLEU rise with d_model (p < 0.05, not corrected: the
        controls are outside the family)?"""
        said = []
        for s in sorted(
            controls, key=lambda s: self._fields(s["variation"])["d_model"]
        ):
            t = (s.get("tests") or {}).get("bleu")
            if t is None or t.get("vs_base") is None:
                continue
            width = self._fields(s["variation"])["d_model"]
            d, p = t["vs_base"]["delta"], t["vs_base"]["p"]
            seen = "a difference" if p < 0.05 else "no difference"
            said.append(
                f"d_model={width} is {d:+.2f} BLEU from the base ({seen} at 5%)"
            )
        if not said:
            return ""
        smaller, larger = said[0], said[-1]
        return (
            f"Read at the base's peak rate, {smaller}"
            + (f" and {larger}" if larger is not smaller else "")
            + ': this is what "bigger models are better" meets at our scale.'
        )


def read_table3(path: str | Path) -> Table3:
    """The Table 3 results file at ``path`` (§6.2), for Part 4's cells; where there is
    none (the notebook run outside the repository), a table with no rows that says
    so."""
    path = Path(path)
    if not path.is_file():
        empty = {"budget": None, "rows": [], "summary": [], "missing": str(path)}
        return Table3(empty, path.parent)
    return Table3(json.loads(path.read_text(encoding="utf-8")), path.parent)

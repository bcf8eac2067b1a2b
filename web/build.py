"""The notebook as one offline web page: ``make html`` → site/index.html (our addition).

The page is the committed notebook with its stored outputs, converted by nbconvert with
our template (web/article/). Formulas are typeset here, at build time, by KaTeX (npm,
pinned in web/package.json, fetched into the git-ignored web/node_modules), so the page
needs no script for them; KaTeX's fonts, the figures, the styles, the script
(web/page.js) and a search index are embedded. The page loads nothing.

What the build reads from the notebook's structure (never from its exact words):

* ``# Part N — …`` headings are the Parts (ids ``part-N``; each Part ends with a link to
  the next); ``## §x.y …`` headings are the paper's sections (ids ``sx-y``); other
  headings get the id of the section above them plus a few words
  (``s5-4-label-smoothing``). A mention of "§x.y", "Part N", "Table N" or "Figure N" in
  prose links to the heading that carries it (that starts with it, else has it in
  parentheses) or, for "Figure N", to the image whose alt text starts with it; "Eq. N"
  links to the quotation whose "— §…" line names it. A mention of something the page
  does not have stays plain text.
* A heading that contains "Aside", or starts with "Appendix", opens a section a first
  reading may skip: it is collapsed (a ``<details>``, opened for printing, by a link
  into it, and by the browser's find-in-page).
* Plumbing folds to one line (a closed ``<details>`` that says what it is), found by
  its content: a cell that sets up a hosted notebook (``hosted_setup(`` or ``git
  clone``), that prints a table (an output of :func:`is_tabular`), or is all
  plumbing; else each top-level ``if`` on ``IN_NOTEBOOK``, ``if __name__ …`` that
  installs a signal handler, and ``@example`` demonstration. Any other cell of more than
  ``FOLD_OVER`` lines shows its first ``FOLD_SHOW`` or so (signature and docstring) and
  folds the rest, "… N more lines". Every code block has a copy button (page.js) that
  copies its code alone, folded lines included.
* Code cells get ids (``code-`` and the first name they define) and search entries (the
  names ``def`` and ``class`` define, the comments); the search also reads headings and
  prose, and lands on the paragraph or cell that matches.
* ``text/html`` and ``text/markdown`` outputs are shown as HTML (a Markdown table is a
  ``<table>``), sanitised: nothing runs and nothing is loaded (:func:`sanitize_html`).
* Under the title, a box of what this reproduction found, read from ``results/`` at
  build time (:func:`findings`; ``--readme`` writes the same lines into README.md). The
  repository and Colab links come from CITATION.cff's ``repository-code``
  (machinery/project.py) and are left out while it is unset; "Cite this reproduction"
  is BibTeX made from CITATION.cff; the footer names the build's date and commit.
* A block quote is the paper's wording; the ``— §…`` line under it is its source.
* A code cell that is only ``if __name__ == "__main__": …`` is left out of the page.
* Headings "Results", "Conclusion", "Citation"/"How to cite" and "Credits", where the
  notebook has them, end the page; the build adds whichever of a results pointer, the
  paper's BibTeX and the credits the notebook lacks.

Conventions a notebook cell can use for the page:

* **Alt text** of an image output, the first found of: a line ``<!-- alt: … -->`` in the
  Markdown cell before the code cell (one line per image, in the order the cell shows
  them); the output's ``metadata["image/png"]["alt"]`` (``display(..., metadata=...)``);
  the cell's ``metadata["alt"]``; the figure's titles and axis labels in the cell's code
  (``set_title("…")``, ``suptitle``, ``set_xlabel``, ``set_ylabel``, ``ax.set(...)``);
  the first sentence of the paragraph before. SentencePiece markers (``▁``) are joined
  into words, and every alt text is made one sentence a screen reader can say
  (:func:`sentence`: no TeX, one line, a full stop).
* **Resolution**: an image is shown at its real size, from the dots per inch its PNG
  stores (the ``pHYs`` chunk, which matplotlib writes: a figure of 7 inches is 672 CSS
  px wide at any dpi), else at the width its output metadata gives
  (``metadata["image/png"]["width"]``), else at its pixel width; never wider than the
  column, and never scrolled sideways. A PNG may carry a second drawing of itself laid
  out for a phone's column (machinery/figures.py: ``NARROW_CHUNK``): the page shows
  that one wherever the column is narrower than the first needs for its smallest text
  (the size its ``SMALLEST_TEXT_KEY`` records, else 10 pt) to read at ``LEGIBLE_PX``
  CSS px (a CSS container query on the figure). Where an image is larger than shown,
  a button (click, Enter or Space) opens it fitted to the screen, where a reader can
  pinch it larger; Escape closes.
* **Attention maps** to explore: a ``display_data`` output whose data has the key
  ``application/vnd.attention-maps+json`` (IPython:
  ``display({"application/vnd.attention-maps+json": blob, "text/plain": "…"},
  raw=True)``) becomes an interactive figure (attention kind, layer, head; hover or
  arrow keys read a weight; a colour scale; a preset button for the sharpest head of
  each kind) with a static SVG of one head for print and no-script. It stands right
  under what the cell printed (the sentence), and of the cell's pictures only the first
  (an overview) is kept: the others are single heads the presets show. The blob::

      {"sentence": {"src": ["▁Ein", "▁Hund", ...], "tgt": ["<s>", "▁A", "▁dog", ...],
                    "tgt_out": ["▁A", "▁dog", ..., "</s>"]},  # optional
       "maps": {"encoder": [layer][head][query][key],   # src × src
                "decoder": [layer][head][query][key],   # tgt × tgt (masked)
                "cross":   [layer][head][query][key]},  # tgt × src (encoder-decoder)
       "title": "optional caption"}

  weights rounded to 3 decimals; rows are queries, columns keys. "tgt" is what the
  decoder reads, one token per position: the columns of "decoder", and its rows and the
  rows of "cross" unless "tgt_out" (the token each position predicts) labels them. A
  kind may be left out; "decoder_self" and "decoder_src" (the notebook's names) are
  read as "decoder" and "cross". Token labels are shown without ``▁``. From the
  notebook: ``{k: torch.round(w, decimals=3).tolist() for k, w in maps.items()}``.
* Text outputs are shown detokenized: Moses' escapes (``&apos;``, ``&quot;``,
  ``&amp;`` …) become the characters they stand for.
"""

from __future__ import annotations

import argparse
import base64
import copy
import html as htmllib
import io
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tokenize
import unicodedata
from pathlib import Path
from urllib.parse import quote as url_quote
from urllib.parse import unquote

WEB = Path(__file__).resolve().parent
ROOT = WEB.parent
KATEX = WEB / "node_modules" / "katex"
SLOT = re.compile(r'<span data-math-slot="(\d+)"></span>')
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

NOTEBOOK_FILE = "annotated_transformer.ipynb"
PAPER = "https://arxiv.org/abs/1706.03762"
ATTENTION_MIME = "application/vnd.attention-maps+json"
FOLD_OVER = 45  # lines: a longer code cell shows its first FOLD_SHOW, the rest folded
FOLD_SHOW = 24
CSS_DPI = 96  # CSS pixels per inch
# The least size, in CSS px, a figure's smallest text is shown at; a figure that records
# no smallest text (SMALLEST_TEXT_KEY) is held to matplotlib's default 10-pt labels.
LEGIBLE_PX = 11
LABEL_PT = 10
SMALLEST_TEXT_KEY = "Smallest text (pt)"  # machinery/figures.py writes it
NARROW_CHUNK = b"nrLY"  # a PNG chunk holding the figure's phone layout (the same)
# The page's icon, inline (a data: address) so that the browser asks for no
# /favicon.ico: a small attention map, one bright cell per row.
FAVICON = (
    "<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'>"
    "<rect width='16' height='16' rx='3' fill='#08306b'/>"
    "<rect x='3' y='3' width='3' height='3' fill='#f7fbff'/>"
    "<rect x='9' y='6.5' width='3' height='3' fill='#c6dbef'/>"
    "<rect x='6' y='10' width='3' height='3' fill='#6baed6'/></svg>"
)
BIBTEX = r"""@inproceedings{vaswani2017attention,
  title     = {Attention Is All You Need},
  author    = {Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and
               Uszkoreit, Jakob and Jones, Llion and Gomez, Aidan N. and
               Kaiser, {\L}ukasz and Polosukhin, Illia},
  booktitle = {Advances in Neural Information Processing Systems 30},
  pages     = {5998--6008},
  year      = {2017},
  url       = {https://arxiv.org/abs/1706.03762}
}"""
MOSES = {
    "&amp;": "&",
    "&apos;": "'",
    "&quot;": '"',
    "&lt;": "<",
    "&gt;": ">",
    "&#91;": "[",
    "&#93;": "]",
    "&#124;": "|",
}
ALT_LINE = re.compile(r"<!--\s*alt:\s*(.*?)\s*-->", re.S)
MAIN_GUARD = re.compile(r"""\s*if\s+__name__\s*==\s*["']__main__["']""")
SKIPPABLE = re.compile(r"\bAside\b|^Appendix\b", re.I)
MENTION = re.compile(r"§\s?\d+(?:\.\d+)*|\bEq\.\s?\d+|\b(?:Figure|Table|Part)\s\d+")
ENDINGS = {
    "results": re.compile(r"^(Results|Conclusions?|Summary)\b", re.I),
    "cite": re.compile(r"^(Citation|How to cite|Citing)\b", re.I),
    "credits": re.compile(r"^(Credits|Acknowledg)", re.I),
}


class MissingTool(Exception):
    """A program the build needs is missing or could not be fetched."""


class BadInput(Exception):
    """Something the build reads (the notebook, an output, a results file) is not as
    it should be: said in one line."""


def project():
    """machinery/project.py (the project's address, from CITATION.cff), loaded from
    its file so that the build does not import the package (and torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "machinery_project", ROOT / "machinery" / "project.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def citation(path: Path = ROOT / "CITATION.cff") -> dict:
    """CITATION.cff read as YAML, as a dict ({} when it is absent or unreadable).
    Its ``repository-code`` is used only as an https:// address
    (:func:`https_address`)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def bibtex_of(cff: dict, url: str) -> str:
    """This reproduction's BibTeX entry, from CITATION.cff's title, authors, version,
    date and the project's address (left out while unset)."""

    def person(a: dict) -> str:
        if a.get("family-names"):
            return ", ".join(
                x for x in (a["family-names"], a.get("given-names", "")) if x
            )
        return "{" + str(a.get("name", "")) + "}"  # an organisation, kept whole

    fields = [("title", "{" + str(cff.get("title", "")) + "}")]
    authors = " and ".join(person(a) for a in cff.get("authors") or [] if a)
    if authors:
        fields.append(("author", authors))
    if cff.get("version"):
        fields.append(("version", str(cff["version"])))
    date = str(cff.get("date-released") or "")
    if date[:4].isdigit():
        fields.append(("year", date[:4]))
    if url:
        fields.append(("url", url))
    if cff.get("message"):
        fields.append(("note", str(cff["message"]).strip()))
    width = max(len(k) for k, _ in fields)
    body = ",\n".join(f"  {k:<{width}} = {{{v}}}" for k, v in fields)
    return f"@software{{annotated_transformer_reproduced,\n{body}\n}}"


def build_stamp() -> str:
    """ "Built on DATE from commit HASH" (UTC; SOURCE_DATE_EPOCH when set, for a
    reproducible build; the commit left out outside a git checkout)."""
    import datetime
    import os

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
        if epoch and epoch.isdigit()
        else datetime.datetime.now(datetime.timezone.utc)
    )
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    stamp = f"Built on {when:%Y-%m-%d} (UTC)"
    return stamp + (f" from commit {commit}." if commit else ".")


# --- What this reproduction found (the box under the title, and the README's top) ---

HEADLINE = "multi30k-small.json"  # the Multi30k preset's headline run (Results)
SAMPLE = "iwslt14-sample.json"  # the IWSLT14 sample's run
TABLE3 = "table3.json"
SEEDS = "multi30k-small-seeds.json"  # the headline preset's other seeds (make seeds)
# IWSLT14 de→en: the training pairs of the full data and of the mirror's sample
# (machinery/data.py reads both), and the tokenized test BLEU published for 6-layer
# models trained on the full data (REPRODUCTION_NOTES.md: fairseq's recipe, 34.5–35.6).
IWSLT14_PAIRS = 160_239
IWSLT14_SAMPLE = 8_746
IWSLT14_PUBLISHED = 34.5
FINDINGS_START = "<!-- findings: web/build.py --readme writes these lines -->"
FINDINGS_END = "<!-- /findings -->"


def read_json(path: Path) -> dict:
    """A results file as a dict ({} when it is absent, unreadable or not a dict; a
    NaN in it is read, and :func:`number` refuses it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def number(value) -> float | None:
    """``value`` as a finite number, or None (text, NaN, a missing field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def words(value, limit: int = 80) -> str:
    """Text from a results file or CITATION.cff, safe inside Markdown and HTML: one
    line, cut at ``limit`` characters, every character Markdown or HTML would read
    as markup backslash-escaped (so it shows as itself and links nothing)."""
    text = re.sub(r"\s+", " ", str(value if value is not None else "")).strip()
    text = text[:limit]
    return re.sub(r"([\\`*_{}\[\]<>&|~])", r"\\\1", text)


def where_trained(run: dict) -> str:
    """ "on a 2-core AMD EPYC (no GPU)", "on a CPU (no GPU)" or "on 2 GPUs", from a
    run's summary (its ``machine`` line, or the ``cpu`` line of older summaries)."""
    device = str(run.get("device", ""))
    n = int(number(run.get("world_size")) or 1)
    if device.startswith("cuda"):
        return f"on {n} GPU{'s' if n > 1 else ''}"
    if device != "cpu":
        return f"on {words(device, 30) or '?'}"
    cpu = str(run.get("machine") or run.get("cpu") or "")
    name = words(cpu.split(" (")[0].split(",")[0], 60)
    cores = re.search(r"(\d+) cores?\b", cpu)
    if name and cores:
        return f"on a {cores.group(1)}-core {name} (no GPU)"
    name = name or "CPU"
    return f"on {'an' if name[0] in 'AEIOU' else 'a'} {name} (no GPU)"


def table3_state(data: dict) -> dict:
    """Table 3's row groups (A–E) finished over the full budget, from the file's
    per-variation ``summary`` and ``plan``: a group is finished when the base has its
    three seeds and each of the group's planned variations has the seeds the plan
    always runs; with, per measure, the category each of its paper variations is
    counted in (the controls apart)."""
    summary = [s for s in listed(data.get("summary")) if isinstance(s, dict)]
    plan = [p for p in listed(data.get("plan")) if isinstance(p, dict)]
    by = {s.get("variation"): s for s in summary}
    base = by.get("base")
    seeded = base is not None and len(listed(base.get("seeds"))) >= 3
    finished, counted, seeds = [], {"bleu": [], "ppl": []}, []
    for group in "ABCDE":
        planned = [p for p in plan if p.get("group") == group] or [
            {"variation": s.get("variation"), "seeds": [1, 2]}
            for s in summary
            if s.get("group") == group
        ]
        rows = [by.get(p.get("variation")) for p in planned]
        if not (seeded and rows) or any(
            r is None or len(listed(r.get("seeds"))) < len(listed(p.get("seeds")))
            for r, p in zip(rows, planned)
        ):
            continue
        finished.append(group)
        for r in rows:
            if r.get("control"):
                continue
            words = r.get("counted") if isinstance(r.get("counted"), dict) else {}
            for m in counted:
                counted[m].append(str(words.get(m, "no test")))
            seeds.append(  # the seeds each verdict rests on: those that trained
                len(listed(r.get("seeds"))) - len(listed(r.get("failed_seeds")))
            )
    return {
        "epochs": (
            data.get("budget") if isinstance(data.get("budget"), dict) else {}
        ).get("epochs"),
        "finished": finished,
        "counted": counted,
        "seeds": seeds,
    }


def missing(name: str, run: dict, fields: tuple) -> str:
    """The sentence a finding becomes when its results file lacks what it says:
    which file, and which of its fields are absent or not numbers."""
    if not run:
        return f"`results/{name}` is missing or unreadable: its finding is not shown."
    gone = [f"`{f}`" for f in fields if number(run.get(f)) is None]
    return (
        f"`results/{name}` has no number for {', '.join(gone)}: its finding is not "
        "shown."
    )


def listed(value) -> list:
    """``value`` when it is a list, else [] (a results file's list that is not)."""
    return value if isinstance(value, list) else []


def counted(n: int, one: str, many: str) -> str:
    """``n`` with the word that agrees with it: "1 disagrees", "2 disagree"."""
    return f"{n} {one if n == 1 else many}"


PRECISION_NAMES = {"fp32": "float32"}  # as the training log names them


def path_taken(row: dict) -> str:
    """ "float32, fast attention, 2 threads": the precision and attention path a seed's
    run took and, where its row records them, its CPU threads, from its row in `make
    seeds`'s file, safe as text."""
    precision = row.get("precision")
    precision = PRECISION_NAMES.get(precision, precision)
    said = f"{words(precision, 8)}, {words(row.get('attention'), 12)} attention"
    threads = number(row.get("threads"))
    if threads is not None and threads >= 1 and threads == int(threads):
        said += f", {threads:.0f} thread{'' if threads == 1 else 's'}"
    return said


def spread(seeds: dict) -> str | None:
    """The headline's spread, from `make seeds`'s file: each other seed's test BLEU
    with the precision and attention path its run took (and its CPU threads, where its
    row records them), the recorded run's path, then
    mean ± sample sd and range over every seed; None where it holds fewer than two
    scored seeds."""
    rows = [r for r in seeds.get("rows") or [] if isinstance(r, dict)]
    if seeds.get("config") != Path(HEADLINE).stem or any(
        r.get("other_settings") for r in rows
    ):  # another preset's seeds, or a seed trained with other settings
        return None
    others = [
        r for r in rows if number(r.get("bleu")) is not None and not r.get("recorded")
    ]
    recorded = next((r for r in rows if r.get("recorded")), None)
    stats = seeds.get("bleu") if isinstance(seeds.get("bleu"), dict) else {}
    n, mean, sd, low, high = (
        number(stats.get(k)) for k in ("n", "mean", "sd", "min", "max")
    )
    if not others or None in (n, mean, sd, low, high) or n < 2:
        return None
    each = ", ".join(
        f"{number(r['bleu']):.1f} (seed {words(r.get('seed'), 6)}: {path_taken(r)})"
        for r in others
    )
    first = ""
    if recorded is not None:
        first = f"; seed {words(recorded.get('seed'), 6)} ran {path_taken(recorded)}"
    return (
        f"Other seeds as `make train` ran them: {each}{first}. Over {n:.0f} seeds, "
        f"{mean:.1f} ± {sd:.1f} (mean ± sample sd, {low:.1f}–{high:.1f})."
    )


def findings(results: Path, links: dict) -> list[str]:
    """What this reproduction found, as Markdown sentences with numbers read from
    ``results``; ``links`` gives the address of "results" and "table3"."""
    out = []
    run = read_json(results / HEADLINE)
    bleu, minutes = number(run.get("bleu")), number(run.get("train_minutes"))
    steps = number(run.get("steps"))
    if bleu is not None and minutes is not None and steps is not None:
        cfg = run.get("config") if isinstance(run.get("config"), dict) else {}
        size = ", ".join(
            f"{k} = {words(cfg[k], 12)}" for k in ("N", "d_model", "h") if k in cfg
        )
        preset = re.sub(r"[^\w.-]", "", Path(str(run.get("run_dir", ""))).name)
        out.append(
            f"The paper's model at a small scale (`{preset or 'multi30k-small'}`: "
            f"{size}) trains on Multi30k German→English {where_trained(run)}, in "
            f"{minutes:.1f} minutes ({steps:,.0f} updates), and scores {bleu:.1f} "
            f"BLEU on its test set (beam {words(run.get('beam_size', '?'), 4)}, "
            f"{words(run.get('bleu_kind', ''), 30)}; [Results]({links['results']}))."
        )
        if said := spread(read_json(results / SEEDS)):
            out[-1] += " " + said
    else:
        out.append(missing(HEADLINE, run, ("bleu", "train_minutes", "steps")))
    sample = read_json(results / SAMPLE)
    bleu, steps = number(sample.get("bleu")), number(sample.get("steps"))
    if bleu is not None and steps is not None:
        out.append(
            f"On a {IWSLT14_SAMPLE / IWSLT14_PAIRS:.0%} sample of IWSLT14's "
            f"German→English training data ({IWSLT14_SAMPLE:,} of {IWSLT14_PAIRS:,} "
            f"pairs), trained {where_trained(sample)} for {steps:,.0f} updates, it "
            f"reaches {bleu:.1f} BLEU ({words(sample.get('bleu_kind', ''), 30)}), "
            f"against {IWSLT14_PUBLISHED} published for 6-layer models trained on "
            f"the full data on a GPU ([Results]({links['results']}))."
        )
    else:
        out.append(missing(SAMPLE, sample, ("bleu", "steps")))
    table3 = read_json(results / TABLE3)
    if not table3:
        return out + [missing(TABLE3, table3, ())]
    state = table3_state(table3)
    table = f"[Table 3]({links['table3']})"
    epochs = number(state["epochs"])
    budget = f"{epochs:g} epochs" if epochs else "the full schedule"
    if not state["finished"]:
        out.append(
            f"{table} at our scale, every variation over {budget} with two seeds "
            "each (the base three; a (C) size one where its first is beyond the "
            "noise), is being measured."
        )
    else:
        groups = ", ".join(f"({g})" for g in state["finished"])
        rest = [g for g in "ABCDE" if g not in state["finished"]]
        bleu, ppl = (state["counted"][m] for m in ("bleu", "ppl"))
        kinds = ("agrees", "disagrees", "no difference detected", "not counted")
        n = [bleu.count(w) for w in kinds]
        said = (
            f"of {len(bleu)} variations of the paper, by validation BLEU "
            f"{n[0]} {'agrees' if n[0] == 1 else 'agree'}, "
            f"{counted(n[1], 'disagrees', 'disagree')}, "
            f"{counted(n[2], 'shows', 'show')} no difference the test can detect and "
            f"{counted(n[3], 'is', 'are')} not counted; by validation perplexity "
            + ", ".join(str(ppl.count(w)) for w in kinds[:3])
            + f" and {ppl.count(kinds[3])} (not counted: a seed still learning or "
            "failed)"
        )
        lo, hi = min(state["seeds"]), max(state["seeds"])
        trained = (
            f"{lo}–{hi} trained seeds"
            if lo != hi
            else counted(lo, "trained seed", "trained seeds")
        )
        tail = (
            f"; {'rows' if len(rest) > 1 else 'row'} "
            f"{', '.join(f'({g})' for g in rest)} "
            f"{'are' if len(rest) > 1 else 'is'} being measured"
            if rest
            else ""
        )
        out.append(
            f"{table} at our scale ({budget}, {trained} a variation), rows "
            f"{groups}, by a seed-paired t-test with Holm's correction: "
            f"{said}{tail}."
        )
    return out


def pinned_katex_version() -> str:
    """The KaTeX version web/package.json pins."""
    return json.loads((WEB / "package.json").read_text())["dependencies"]["katex"]


def ensure_katex() -> None:
    """Install the pinned KaTeX in web/node_modules (``npm ci``) unless it is there."""
    if shutil.which("node") is None:
        raise MissingTool(
            "make html needs Node.js (node and npm) to typeset the formulas "
            "with KaTeX; install it (e.g. apt-get install nodejs npm) and run "
            "make html again"
        )
    package = KATEX / "package.json"
    if (
        package.is_file()
        and json.loads(package.read_text())["version"] == pinned_katex_version()
    ):
        return
    if shutil.which("npm") is None:
        raise MissingTool(
            "make html needs npm to fetch the KaTeX math renderer once; "
            "install it (e.g. apt-get install npm) and run make html again"
        )
    fetched = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WEB
    )
    if fetched.returncode != 0:
        raise MissingTool(
            f"make html could not fetch KaTeX {pinned_katex_version()} with "
            "npm ci in web/ (is the npm registry reachable?)"
        )


def typeset(formulas: list[dict]) -> list[str]:
    """KaTeX's HTML for each ``{"tex", "display"}``, in one run of render_math.js."""
    result = subprocess.run(
        ["node", str(WEB / "render_math.js")],
        input=json.dumps(formulas),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"KaTeX could not typeset a formula: {result.stderr.strip()}")
    return json.loads(result.stdout)


def katex_css() -> str:
    """KaTeX's style sheet with its WOFF2 fonts embedded as data URIs (no others)."""
    css = (KATEX / "dist" / "katex.min.css").read_text()

    def embed(match: re.Match) -> str:
        font = (KATEX / "dist" / "fonts" / f"{match.group(1)}.woff2").read_bytes()
        font = base64.b64encode(font).decode()
        return f'src:url(data:font/woff2;base64,{font}) format("woff2")'

    css = re.sub(r"src:url\(fonts/([\w-]+)\.woff2\)[^;}]*", embed, css)
    if "url(fonts/" in css:
        raise SystemExit("KaTeX's style sheet refers to a font that was not embedded")
    return css


def tidy_stream(text: str) -> str:
    r"""Printed text as a terminal leaves it: no colours, each line after its ``\r``."""
    lines = []
    for line in ANSI.sub("", text).split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append(parts[-1] if parts else "")
    return "\n".join(lines)


def unescape_moses(text: str) -> str:
    """Moses' escaped characters (``&apos;`` …) as the characters, in one pass."""
    return re.sub("|".join(map(re.escape, MOSES)), lambda m: MOSES[m.group()], text)


def plain(markdown: str) -> str:
    """Markdown as plain words for alt text: no code ticks, dollars or emphasis."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", markdown)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"[`$*_>#]|\\(?=[a-zA-Z])", "", text)
    return re.sub(r"\s+", " ", text).strip()


def join_pieces(text: str) -> str:
    """SentencePiece pieces in running text as words: "▁A ▁t err ier ." → "A terrier."

    A run starts at a piece with "▁" and ends at a word ending in ";"; inside it a piece
    without "▁" continues the word before. <s> and </s> are dropped.
    """
    if "▁" not in text:
        return text
    text = re.sub(r"\s*</?s>", "", text)
    words: list[str] = []
    in_run = False
    for token in text.split(" "):
        if token.startswith("▁"):
            in_run = True
            words.append(token[1:])
        elif in_run and words and token:
            words[-1] += token
        else:
            words.append(token)
        if token.endswith(";"):
            in_run = False
    text = re.sub(r"\s+", " ", " ".join(words)).strip()
    # the same tokens twice: "rows are the tokens X; columns are the tokens X"
    text = re.sub(r"rows are (.+); columns are \1$", r"rows and columns are \1", text)
    return re.sub(r"\.(?=;)", "", text)  # "… Zaun.; columns" → "… Zaun; columns"


def drawn_text(code: str, call: str) -> list[str]:
    """The literal strings a figure's code passes as ``call`` ("set_title", …), also as
    a keyword of ``ax.set(...)`` ("title", "xlabel", "ylabel")."""
    keyword = {"set_title": "title", "set_xlabel": "xlabel", "set_ylabel": "ylabel"}
    found = re.findall(call + r'\(\s*"([^"{}]+)"', code)
    if call in keyword:
        found += re.findall(rf'\.set\([^)]*\b{keyword[call]}\s*=\s*"([^"{{}}]+)"', code)
    return [t.replace("\\n", " ") for t in found]  # a line break in the string


def sentence(text: str, limit: int = 200) -> str:
    """Text as one sentence a screen reader can say: no TeX, one line, a capital at
    the start and a full stop at the end; a long text cut at a sentence's end."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)|<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"\$+([^$]*)\$+", lambda m: tex_words(m.group(1)), text)
    text = re.sub(r"[`*]|(?<!\w)_+|_+(?!\w)|^[>#]+", "", text, flags=re.M)
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) > limit:  # to the first full stop that ends a sentence
        stops = r"(?<!\bEq)(?<!\bFig)(?<!\be\.g)(?<!\bi\.e)\.(?=\s)"
        ends = [m.end() for m in re.finditer(stops, text[:limit]) if m.end() > 20]
        text = text[: ends[0]] if ends else text[:limit].rsplit(" ", 1)[0]
    text = text.rstrip(" .;:,")
    return (text[:1].upper() + text[1:] + ".") if text else ""


def tex_words(tex: str) -> str:
    """A formula as words, roughly: ``step\\_num \\ge 1`` → "step_num ≥ 1"."""
    symbols = {"ge": "≥", "le": "≤", "times": "×", "cdot": "·", "to": "→"}
    tex = re.sub(r"\\(ge|le|times|cdot|to)\b", lambda m: symbols[m.group(1)], tex)
    tex = re.sub(r"\\([_%&$#])", r"\1", tex)
    tex = re.sub(r"\\[a-zA-Z]+\s*", "", tex)
    return re.sub(r"[{}^]", "", tex)


def figure_alt(code: str, prose: str) -> str:
    """Alt text for a figure a cell drew, as a sentence: its title and axis labels
    ("Plot of T: y against x."), else the first sentence of the prose before."""
    titles = drawn_text(code, "suptitle") + drawn_text(code, "set_title")
    xs, ys = drawn_text(code, "set_xlabel"), drawn_text(code, "set_ylabel")
    if titles:
        axes = f": {ys[0]} against {xs[0]}" if xs and ys else ""
        axes = axes or (f", against {xs[0]}" if xs else f": {ys[0]}" if ys else "")
        return sentence(f"Plot of {titles[0]}{axes}")
    if xs or ys:
        return sentence(
            f"Plot of {ys[0]} against {xs[0]}"
            if xs and ys
            else f"Plot against {(xs or ys)[0]}"
        )
    paragraphs = [p for p in prose.split("\n\n") if plain(p)]
    return sentence(
        "Figure: " + (paragraphs[-1] if paragraphs else "output of the code above")
    )


def png_image(data: str):
    """A base64 PNG opened by Pillow (only its header is read), or None when it is
    not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(base64.b64decode(data)))
    except (ValueError, TypeError, OSError, UnidentifiedImageError):
        return None
    return image if image.format == "PNG" else None


def png_size(data: str) -> tuple[int, int] | None:
    """(width, height) of a base64 PNG, or None if it is not one."""
    image = png_image(data)
    return image.size if image else None


def png_dpi(data: str) -> float | None:
    """The dots per inch a base64 PNG stores (its ``pHYs`` chunk, which Pillow reads
    as ``info["dpi"]``), or None when it has none."""
    image = png_image(data)
    dpi = image.info.get("dpi") if image else None
    try:
        x = float(dpi[0]) if dpi else 0.0
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def smallest_text_pt(data: str) -> float:
    """The size, in points, of the smallest text a base64 PNG records drawing
    (``SMALLEST_TEXT_KEY``), else ``LABEL_PT``."""
    image = png_image(data)
    value = image.info.get(SMALLEST_TEXT_KEY) if image else None  # before its pixels
    try:
        pt = float(value) if value else LABEL_PT
    except ValueError:
        pt = LABEL_PT
    return pt if math.isfinite(pt) and pt > 0 else LABEL_PT


def narrow_layout(data: str) -> str | None:
    """The phone layout a base64 PNG carries in its ``NARROW_CHUNK`` (itself a PNG),
    base64, or None where it carries none."""
    import struct

    try:
        png = base64.b64decode(data)
    except (ValueError, TypeError):
        return None
    at = 8 if png[:8] == b"\x89PNG\r\n\x1a\n" else len(png)
    while at + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[at : at + 8])
        if kind == NARROW_CHUNK:
            chunk = png[at + 8 : at + 8 + length]
            ok = chunk[:8] == b"\x89PNG\r\n\x1a\n" and png_size(
                base64.b64encode(chunk).decode()
            )
            return base64.b64encode(chunk).decode() if ok else None
        at += 12 + length
    return None


def display_size(output, mime: str) -> tuple[int, int, int] | None:
    """(width, height, least width) in CSS px an image output is shown at: its real
    size from its stored dpi, else its metadata's width, else its pixels; the least
    width at which its smallest text reads at ``LEGIBLE_PX`` (:func:`smallest_text_pt`),
    0 when its dpi is not known."""
    meta = output.get("metadata", {}).get(mime, {})
    data = output["data"][mime]
    size = png_size(data) if mime == "image/png" else None
    dpi = png_dpi(data) if size else None
    if size and dpi:
        scale = CSS_DPI / dpi
        points = size[0] * 72 / dpi  # the figure's width in points
        least = math.ceil(round(points * LEGIBLE_PX / smallest_text_pt(data), 1))
        return round(size[0] * scale), round(size[1] * scale), least
    if meta.get("width"):
        width = css_length(meta["width"], "width")
        height = (
            css_length(meta["height"], "height")
            if meta.get("height")
            else (size and round(size[1] * width / size[0])) or 0
        )
        return (width, height, 0) if height else None
    return (*size, 0) if size else None


def css_length(value, name: str) -> int:
    """An image's ``width`` or ``height`` from its output's metadata, in whole CSS
    px; a value that is not a positive finite number is a :class:`BadInput`."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise BadInput(
            f"an image output's {name} in its metadata is not a number of "
            f"pixels: {str(value)[:40]!r}"
        )
    return round(number)


def is_main_guard(cell) -> bool:
    """A code cell that only runs the command line: ``if __name__ == "__main__": …``."""
    return cell.cell_type == "code" and MAIN_GUARD.match(cell.source) is not None


def prepare(nb):
    """A copy of ``nb`` as the page shows it: images with alt text and display sizes,
    text outputs detokenized, attention maps as an interactive figure, the command
    line's cell and empty cells left out."""
    nb = copy.deepcopy(nb)
    nb.cells = [
        c
        for c in nb.cells
        if not is_main_guard(c)
        and not (
            c.cell_type == "code" and not c.source.strip() and not c.get("outputs")
        )
    ]
    prose, alts, plots = "", [], 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            prose, alts = cell.source, ALT_LINE.findall(cell.source)
            continue
        if cell.cell_type != "code":
            continue
        if any(is_tabular(o) for o in cell.get("outputs", [])):
            cell.metadata["page_tabular"] = True  # its code only prints the table
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = unescape_moses(output.get("text", ""))
            data = output.get("data", {})
            if "text/plain" in data:
                data["text/plain"] = unescape_moses(data["text/plain"])
            if "text/html" in data:
                html = data["text/html"]
                data["text/html"] = sanitize_html(
                    "".join(html) if isinstance(html, list) else html
                )
            if ATTENTION_MIME in data:
                blob = data[ATTENTION_MIME]
                output["data"] = {"text/html": attention_explorer(blob)}
                output["metadata"] = {"explorer": True}
                continue
            for mime in ("image/png", "image/jpeg", "image/svg+xml"):
                if mime not in data:
                    continue
                meta = output.setdefault("metadata", {}).setdefault(mime, {})
                alt = (
                    (alts.pop(0) if alts else None)
                    or meta.get("alt")
                    or cell.metadata.get("alt")
                    or figure_alt(cell.source, prose)
                )
                meta["alt"] = sentence(join_pieces(alt), limit=400)
                size = display_size(output, mime)
                if size:
                    meta["width"], meta["height"], meta["least_width"] = size
                legible = mime == "image/png" and size and size[2] > 0
                narrow = narrow_layout(data[mime]) if legible else None
                if narrow:
                    shown = display_size({"data": {mime: narrow}}, mime)
                    meta["narrow"] = narrow
                    meta["narrow_width"], meta["narrow_height"] = shown[:2]
                    plots += 1
                    meta["plot_id"] = f"plot-{plots}"
        explorers = [o for o in cell.outputs if o.get("metadata", {}).get("explorer")]
        if explorers:
            cell.outputs = explorer_first(cell.outputs, explorers)
    return nb


IMAGES = ("image/png", "image/jpeg", "image/svg+xml")


def explorer_first(outputs: list, explorers: list) -> list:
    """A cell's outputs with the attention explorer right under what it printed (the
    sentence), then the first picture only (an overview): the others are single heads,
    which the explorer shows with its presets."""
    pictures = [o for o in outputs if any(m in o.get("data", {}) for m in IMAGES)]
    rest = [o for o in outputs if all(o is not x for x in pictures + explorers)]
    return rest + explorers + pictures[:1]


def with_alt_text(nb):
    """A copy of ``nb`` in which every image carries alt text (see :func:`prepare`)."""
    return prepare(nb)


# --- The interactive attention figure -------------------------------------------------

KIND_NAMES = {
    "encoder": "Encoder self-attention",
    "decoder": "Decoder self-attention (masked)",
    "cross": "Decoder–encoder attention",
}
BLUES = (
    (0.0, (247, 251, 255)),
    (0.25, (198, 219, 239)),
    (0.5, (107, 174, 214)),
    (0.75, (33, 113, 181)),
    (1.0, (8, 48, 107)),
)  # as web/page.js's BLUES


def blue(w: float) -> str:
    """The colour of weight ``w`` in [0, 1] on a white-to-dark-blue scale."""
    w = min(1.0, max(0.0, w))
    for (a, ca), (b, cb) in zip(BLUES, BLUES[1:]):
        if w <= b:
            t = (w - a) / (b - a)
            return "#" + "".join(
                f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb)
            )
    return "#08306b"


def token_label(token: str) -> str:
    """A token as a label: without SentencePiece's "▁"; a lone "▁" as "␣"."""
    return token.replace("▁", "") or "␣"


def axes_of(kind: str, sentence: dict) -> tuple[list[str], list[str]]:
    """(row labels, column labels) of a kind of attention map."""
    src, tgt = sentence.get("src", []), sentence.get("tgt", [])
    out = sentence.get("tgt_out") or tgt  # the token each decoder position predicts
    return {"encoder": (src, src), "decoder": (out, tgt), "cross": (out, src)}[kind]


def attention_svg(weights: list, rows: list[str], cols: list[str]) -> str:
    """One head as an SVG heat map with its token labels (as page.js draws it)."""
    nq, nk = len(weights), len(weights[0]) if weights else 0
    rows = [token_label(t) for t in rows[:nq]] + [""] * max(0, nq - len(rows))
    cols = [token_label(t) for t in cols[:nk]] + [""] * max(0, nk - len(cols))
    cell = max(10, min(26, 560 // max(nk, 1)))
    left = 12 + 7 * max((len(t) for t in rows), default=1)
    top = 12 + 7 * max((len(t) for t in cols), default=1)
    width, height = left + cell * nk + 4, top + cell * nq + 4
    esc = htmllib.escape
    parts = [
        f'<svg class="ae-svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="attention weights heat map">'
    ]
    for i, t in enumerate(rows):
        parts.append(
            f'<text x="{left - 6}" y="{top + cell * i + cell / 2 + 4}" '
            f'text-anchor="end" data-row="{i}">{esc(t)}</text>'
        )
    for j, t in enumerate(cols):
        x, y = left + cell * j + cell / 2 + 4, top - 6
        parts.append(
            f'<text x="{x}" y="{y}" transform="rotate(-90 {x} {y})" '
            f'data-col="{j}">{esc(t)}</text>'
        )
    for i, row in enumerate(weights):
        for j, w in enumerate(row):
            parts.append(
                f'<rect x="{left + cell * j}" y="{top + cell * i}" width="{cell}" '
                f'height="{cell}" fill="{blue(w)}" data-q="{i}" data-k="{j}"/>'
            )
    parts.append("</svg>")
    return "".join(parts)


def sharpest(heads: list) -> int:
    """The head of one layer whose rows are most concentrated (lowest mean entropy)."""

    def entropy(head):
        return sum(-sum(w * math.log(w) for w in row if w > 0) for row in head) / max(
            len(head), 1
        )

    return min(range(len(heads)), key=lambda h: entropy(heads[h]))


def sharpest_anywhere(layers: list) -> tuple[int, int]:
    """(layer, head) of the head whose rows are most concentrated, over all layers."""

    def entropy(head):
        return sum(-sum(w * math.log(w) for w in row if w > 0) for row in head) / max(
            len(head), 1
        )

    return min(
        ((i, j) for i, heads in enumerate(layers) for j in range(len(heads))),
        key=lambda lh: entropy(layers[lh[0]][lh[1]]),
    )


PRESET_NAMES = {
    "encoder": "Sharpest encoder head",
    "decoder": "Sharpest decoder head",
    "cross": "Sharpest encoder–decoder head",
}


def colour_scale() -> str:
    """The explorer's legend: weight 0 to 1 on the heat map's colours."""
    stops = "".join(
        f'<stop offset="{w:g}" stop-color="{blue(w)}"/>'
        for w in (0, 0.25, 0.5, 0.75, 1)
    )
    ticks = "".join(
        f'<text x="{10 + 180 * w:g}" y="30" text-anchor="middle">{w:g}</text>'
        for w in (0, 0.25, 0.5, 0.75, 1)
    )
    return (
        '<div class="ae-scale"><span class="ae-scale-name">Weight</span>'
        '<svg viewBox="0 0 200 34" width="200" height="34" role="img" '
        'aria-label="Colour scale: weight 0 is white, 1 is dark blue">'
        '<defs><linearGradient id="ae-gradient">'
        f"{stops}</linearGradient></defs>"
        '<rect x="10" y="2" width="180" height="14" fill="url(#ae-gradient)" '
        f'stroke="#8a9099" stroke-width=".5"/>{ticks}</svg></div>'
    )


def script_json(data) -> str:
    """``data`` as JSON to embed in a ``<script type="application/json">``: ``<``,
    ``>`` and ``&`` written as ``\\u003c`` …, so that no ``<!--``, ``<script`` or
    ``</script`` in a string can end or confuse the element (JSON.parse reads them
    back as the characters)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def checked_maps(blob) -> dict:
    """An attention-maps blob as the explorer reads it, or a :class:`BadInput`: a
    dict whose ``maps`` are lists [layer][head][query][key] of numbers in [0, 1] and
    whose ``sentence`` holds lists of tokens (strings)."""
    if isinstance(blob, str):
        try:
            blob = json.loads(blob)
        except ValueError:
            raise BadInput("an attention-maps output is not JSON") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("maps", {}), dict):
        raise BadInput("an attention-maps output is not an object with its maps")
    for kind, layers in blob.get("maps", {}).items():
        ok = (
            isinstance(layers, list)
            and all(
                isinstance(head, list)
                and all(
                    isinstance(row, list)
                    and all(
                        isinstance(w, (int, float))
                        and not isinstance(w, bool)
                        and 0 <= w <= 1
                        for w in row
                    )
                    for row in head
                )
                for heads in layers
                if isinstance(heads, list)
                for head in heads
            )
            and all(isinstance(heads, list) for heads in layers)
        )
        if not ok:
            raise BadInput(
                f"the attention maps' {str(kind)[:20]!r} are not "
                "[layer][head][query][key] weights in [0, 1]"
            )
    sentence = blob.get("sentence", {})
    if not isinstance(sentence, dict) or not all(
        isinstance(v, list) and all(isinstance(t, str) for t in v)
        for v in sentence.values()
    ):
        raise BadInput("an attention-maps output's sentence is not lists of tokens")
    if not isinstance(blob.get("title", ""), str):
        raise BadInput("an attention-maps output's title is not text")
    return blob


def attention_explorer(blob: dict) -> str:
    """The HTML of the interactive attention figure for one attention-maps blob."""
    blob = checked_maps(blob)
    aliases = {
        "decoder_self": "decoder",
        "decoder_src": "cross",
    }  # the notebook's names
    given = {aliases.get(k, k): v for k, v in blob.get("maps", {}).items()}
    maps = {k: given[k] for k in KIND_NAMES if given.get(k)}
    if not maps:
        return ""
    kind = "cross" if "cross" in maps else next(iter(maps))
    layer = len(maps[kind]) - 1
    head = sharpest(maps[kind][layer])
    rows, cols = axes_of(kind, blob.get("sentence", {}))
    presets = []
    for k in maps:
        at_layer, at_head = sharpest_anywhere(maps[k])
        presets.append(
            {"label": PRESET_NAMES[k], "kind": k, "layer": at_layer, "head": at_head}
        )
    data = {
        "sentence": blob.get("sentence", {}),
        "maps": maps,
        "start": {"kind": kind, "layer": layer, "head": head},
        "presets": presets,
    }
    payload = script_json(data)
    caption = blob.get("title") or (
        "What the trained model attends to, for one test sentence: "
        "every kind of attention, layer and head."
    )
    shown = f"{KIND_NAMES[kind]}, layer {layer + 1}, head {head + 1}"
    svg = attention_svg(maps[kind][layer][head], rows, cols)
    return (
        '<figure class="attention-explorer">'
        '<div class="ae-controls" hidden>'
        '<label>Attention <select data-role="kind"></select></label> '
        '<label>Layer <select data-role="layer"></select></label> '
        '<label>Head <select data-role="head"></select></label>'
        '<div class="ae-presets" role="group" aria-label="Heads to look at"></div>'
        "</div>"
        f'<p class="ae-shown">{htmllib.escape(shown)}</p>{colour_scale()}'
        '<div class="ae-map" tabindex="0" aria-label="Attention map: arrow keys move '
        f'from cell to cell and read each weight">{svg}</div>'
        '<p class="ae-readout" aria-live="polite">Rows: the token attending (query); '
        "columns: "
        "the token attended to (key); darker is more weight.</p>"
        f"<figcaption>{htmllib.escape(caption)}</figcaption>"
        f'<script type="application/json" class="ae-data">{payload}</script></figure>'
    )


# --- Code -----------------------------------------------------------------------------


def fold_line(source: str) -> int | None:
    """Where a long cell's folded part starts (a line index), or None to show it whole.

    At or soon after ``FOLD_SHOW`` lines, after a blank line if one is near, and never
    inside a string that spans lines (so both parts highlight as they would together).
    """
    lines = source.split("\n")
    if len(lines) <= FOLD_OVER:
        return None
    inside = set()  # 0-based lines that begin inside a token spanning lines
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0], tok.end[0]))
    except (tokenize.TokenError, SyntaxError):
        return None
    safe = [n for n in range(FOLD_SHOW, len(lines) - 12) if n not in inside]
    near = [n for n in safe if n < FOLD_SHOW + 8 and not lines[n - 1].strip()]
    return (near or safe or [None])[0]


# Plumbing a reader can skip: folded on the page, with what it is (module notes).
WHY = {
    "table": "The code that prints this table",
    "notebook": "Runs in the notebook only",
    "example": "The demonstration's code",
    "signal": "Ctrl-C handling for the command line",
    "hosted": "Hosted notebooks only (Colab, Kaggle): fetching the package",
}


def mentions(node, name: str) -> bool:
    """Whether the expression ``node`` reads the variable ``name``."""
    import ast

    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def plumbing_of(node) -> str | None:
    """Which plumbing (a key of WHY) a top-level statement is, or None: an ``if`` on
    IN_NOTEBOOK, an ``if __name__ …`` that installs a signal handler, an ``@example``
    demonstration."""
    import ast

    if isinstance(node, ast.If):
        calls = [
            ast.unparse(n.func)
            for n in ast.walk(node)
            if isinstance(n, ast.Call) and not isinstance(n.func, ast.Lambda)
        ]
        if mentions(node.test, "__name__") and "signal.signal" in calls:
            return "signal"
        if mentions(node.test, "IN_NOTEBOOK"):
            return "notebook"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        isinstance(d, ast.Name) and d.id == "example" for d in node.decorator_list
    ):
        return "example"
    return None


def code_folds(source: str, tabular: bool = False) -> list[tuple[int, int, str]]:
    """The line ranges of a code cell folded on the page, as (start, end, why):
    the whole cell when it only prints a table (``tabular``), sets up a hosted notebook
    or is all plumbing (:func:`plumbing_of`); else each plumbing statement, with the
    comment lines just above it and the blank lines after it."""
    import ast

    lines = source.split("\n")
    if tabular:
        return [(0, len(lines), "table")]
    if "hosted_setup(" in source or "git clone" in source:
        return [(0, len(lines), "hosted")]
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    folds = []
    for node in tree.body:
        why = plumbing_of(node)
        if why is None:
            continue
        start = min(
            [node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]
        )
        start -= 1
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        while start > 0 and not lines[start - 1].strip():
            start -= 1  # the blank lines above too: shown code ends with code
        if folds:  # never back into the fold before (its blank lines are its own)
            start = max(start, folds[-1][1])
        end = node.end_lineno
        while end < len(lines) and not lines[end].strip():
            end += 1
        folds.append((start, end, why))
    shown = set(range(len(lines)))
    for start, end, _ in folds:
        shown -= set(range(start, end))
    if folds and not any(lines[n].strip() for n in shown):
        return [(0, len(lines), folds[0][2])]
    return folds


def code_html(source: str, tabular: bool = False) -> str:
    """A code cell's highlighted source: its plumbing (:func:`code_folds`) in closed
    ``<details>``; else a long cell with its tail in one. The ``<pre>`` blocks hold the
    source's lines in order, all of them (the page's copy button joins them)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    def lit(text: str) -> str:  # each <pre> holds its lines and one "\n" more
        return highlight(
            text + "\n",
            PythonLexer(stripnl=False, ensurenl=False),
            HtmlFormatter(cssclass="highlight"),
        )

    lines = source.split("\n")
    folds = code_folds(source, tabular)
    if not folds:
        n = fold_line(source)
        if n is None:
            return lit(source)
        head, tail = "\n".join(lines[:n]), "\n".join(lines[n:])
        more = len(lines) - n
        return (
            f'{lit(head)}<details class="code-rest"><summary><span>{more} more lines '
            f"(lines {n + 1}–{len(lines)})</span></summary>{lit(tail)}</details>"
        )
    parts, at = [], 0
    for start, end, why in folds + [(len(lines), len(lines), "")]:
        if start > at:
            parts.append(lit("\n".join(lines[at:start])))
        if end > start:
            n = end - start
            label = f"{WHY[why]} ({n} line{'s' if n > 1 else ''})"
            parts.append(
                f'<details class="code-fold" data-why="{why}"><summary><span>'
                f"{htmllib.escape(label)}</span></summary>"
                f"{lit(chr(10).join(lines[start:end]))}</details>"
            )
        at = max(at, end)
    return "".join(parts)


# --- Outputs that are HTML ------------------------------------------------------------

# What a cell's HTML output may hold on the page: an allow-list for nh3 (the ammonia
# sanitiser, which parses as browsers do). Tables, text formatting, lists, links to
# "#…" and https://, pictures inline as data: addresses; nothing else.
ALLOWED_TAGS = {
    "a", "abbr", "b", "blockquote", "br", "caption", "code", "col", "colgroup", "dd",
    "del", "details", "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2",
    "h3", "h4", "h5", "h6", "hr", "i", "img", "ins", "kbd", "li", "mark", "ol", "p",
    "pre", "q", "s", "samp", "small", "span", "strong", "sub", "summary", "sup",
    "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var",
}  # fmt: skip
ALLOWED_ATTRIBUTES = {
    "*": {"title", "lang", "dir"},
    "a": {"href"},
    "img": {"src", "alt", "width", "height"},
    "td": {"colspan", "rowspan", "style"},
    "th": {"colspan", "rowspan", "scope", "style"},
    "col": {"span"},
    "colgroup": {"span"},
    "ol": {"start"},
}
INLINE_PICTURE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*")


def allowed_address(tag: str, attribute: str, value: str) -> str | None:
    """nh3's filter of each kept attribute: a link only to "#…" or an https://
    address, a picture only inline (``data:image/png|jpeg|gif|webp``); other values
    as they are."""
    if attribute == "href":
        return value if value.startswith("#") or https_address(value) else None
    if attribute == "src":
        return value if INLINE_PICTURE.fullmatch(value) else None
    return value


def https_address(value: str) -> str:
    """``value`` when it is an absolute https:// address with a host (nothing that
    a browser would read otherwise: no spaces, quotes or angle brackets), else ""."""
    from urllib.parse import urlsplit

    if not isinstance(value, str) or re.search(r"[\s\x00-\x1f\x7f\"'<>\\`]", value):
        return ""
    try:
        parts = urlsplit(value)
    except ValueError:
        return ""
    return value if parts.scheme == "https" and parts.hostname else ""


def sanitize_html(markup: str) -> str:
    """HTML from a cell's output, safe on the page, by nh3's allow-list (above):
    whatever is not allowed is removed (a script, a style sheet and their contents,
    with them), comments too, a picture that is not inline, and a link gets
    ``rel="noopener noreferrer"``. Of inline
    styles only the alignment of text (what Markdown tables set) is kept."""
    import nh3

    clean = nh3.clean(
        markup,
        tags=ALLOWED_TAGS,
        clean_content_tags={"script", "style", "template", "noscript", "title"},
        attributes=ALLOWED_ATTRIBUTES,
        attribute_filter=allowed_address,
        filter_style_properties={"text-align"},
        url_schemes={"https", "data"},
        strip_comments=True,
        link_rel="noopener noreferrer",
    )
    if "<img" not in clean:
        return clean
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(clean, "html.parser")
    for img in soup.find_all("img", src=False):  # a picture from elsewhere: gone
        img.decompose()
    return str(soup)


TABLE_MARKDOWN = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$", re.M)


def is_tabular(output) -> bool:
    """Whether a display output is a table: HTML with a ``<table>``, or Markdown with
    a table's rule line (``|---|---|``)."""
    data = output.get("data", {})
    html = data.get("text/html", "")
    html = "".join(html) if isinstance(html, list) else html
    markdown = data.get("text/markdown", "")
    markdown = "".join(markdown) if isinstance(markdown, list) else markdown
    return "<table" in html.lower() or bool(TABLE_MARKDOWN.search(markdown))


# --- nbconvert ------------------------------------------------------------------------


def make_exporter(formulas: list[dict]):
    """nbconvert's HTML exporter with our template (a slot per formula)."""
    from jinja2 import pass_context
    from nbconvert import HTMLExporter
    from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

    class MathSlots(IPythonRenderer):
        """Markdown renderer that records each formula's TeX and leaves a slot."""

        def _slot(self, tex: str, display: bool) -> str:
            formulas.append({"tex": tex, "display": display})
            return f'<span data-math-slot="{len(formulas) - 1}"></span>'

        def block_math(self, body: str) -> str:
            return self._slot(body, True)

        def inline_math(self, body: str) -> str:
            return self._slot(body, False)

        def latex_environment(self, name: str, body: str) -> str:
            return self._slot(f"\\begin{{{name}}}{body}\\end{{{name}}}", True)

    class ArticleExporter(HTMLExporter):
        """The notebook as an article: web/article/index.html.j2 and its filters."""

        @pass_context
        def markdown2html(self, context, source):
            cell = context.get("cell", {})
            path = context.get("resources", {}).get("metadata", {}).get("path", "")
            renderer = MathSlots(
                escape=False,
                attachments=cell.get("attachments", {}),
                embed_images=True,
                path=path,
                anchor_link_text="¶",
            )
            return MarkdownWithMath(renderer=renderer).render(source)

        def default_filters(self):
            yield from super().default_filters()
            yield ("markdown2html", self.markdown2html)
            yield ("tidy_stream", tidy_stream)
            yield ("code_html", code_html)
            yield ("sanitize_html", sanitize_html)
            yield (
                "svg_data_uri",
                lambda svg: "data:image/svg+xml;base64,"
                + base64.b64encode(svg.encode()).decode(),
            )

    return ArticleExporter(extra_template_basedirs=[str(WEB)], template_name="article")


# --- The article's structure ----------------------------------------------------------


def heading_text(tag) -> str:
    """A heading's words without its ¶ anchor link."""
    return "".join(
        t for t in tag.find_all(string=True) if not t.find_parent(class_="anchor-link")
    ).strip()


STOPWORDS = {
    "a",
    "an",
    "and",
    "at",
    "the",
    "of",
    "on",
    "in",
    "to",
    "for",
    "with",
    "our",
    "its",
}


def slug(text: str, words: int = 3) -> str:
    """A few ASCII words of ``text``: "The label smoothing (ε)" → "label-smoothing"."""
    text = re.sub(r"[^\w]+", " ", re.sub(r"\(.*?\)", " ", text))  # not "(§3.5, …)"
    text = (
        unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    )
    found = re.findall(r"[a-z0-9]+", text)
    return (
        "-".join([w for w in found if w not in STOPWORDS][:words] or found[:words])
        or "section"
    )


def section_number(text: str) -> str | None:
    """ "3.2.1" for a heading that starts with "§3.2.1"."""
    match = re.match(r"§\s?(\d+(?:\.\d+)*)", text)
    return match.group(1) if match else None


def heading_ids(headings) -> dict:
    """Short ASCII ids: ``part-3``, ``s3-2-1``; another heading gets the id of the Part
    or paper section it is in plus a few of its words (``s5-4-label-smoothing``)."""
    ids, seen, above = {}, set(), {}  # above: level → root id of the last heading there
    for n, h in enumerate(headings):
        text, level = heading_text(h), int(h.name[1])
        part = re.match(r"Part\s+(\d+)\b", text)
        number = section_number(text)
        root = None
        if n == 0:
            base = "title"
        elif part and level == 1:
            base = root = f"part-{part.group(1)}"
        elif number:
            base = root = "s" + number.replace(".", "-")
        elif level == 2 and any(p.match(text) for p in ENDINGS.values()):
            base = slug(text, 2)
        else:
            roots = [above[k] for k in sorted(above) if k < level and above[k]]
            words = slug(re.split(r"\s[—–-]\s", text)[0] if level == 1 else text)
            base = f"{roots[-1]}-{words}" if roots else words
            root = None if roots else base
        new, k = base, 1
        while new in seen:
            k += 1
            new = f"{base}-{k}"
        seen.add(new)
        ids[id(h)] = new
        above = {k: v for k, v in above.items() if k < level}
        above[level] = root
    return ids


def group_quotes(soup, main) -> None:
    """The paper's words: block quotes and the "— §…" line after them, one figure."""
    for quote in main.find_all("blockquote"):
        if quote.find_parent("figure") is not None:
            continue
        group = [quote]
        nxt = quote.find_next_sibling()
        while nxt is not None and nxt.name == "blockquote":
            group.append(nxt)
            nxt = nxt.find_next_sibling()
        figure = soup.new_tag("figure", attrs={"class": "paper-quote"})
        quote.insert_before(figure)
        for q in group:
            figure.append(q.extract())
        if nxt is not None and nxt.name == "p" and nxt.get_text().startswith("— "):
            caption = soup.new_tag("figcaption")
            for child in list(nxt.contents):
                caption.append(child.extract())
            nxt.decompose()
            figure.append(caption)


def into_sections(soup, main, headings) -> None:
    """Nest the article's flat run of blocks into one ``<section>`` per heading."""
    blocks = list(main.children)
    for b in blocks:
        b.extract()
    stack = [(0, main)]
    for block in blocks:
        level = (
            int(block.name[1])
            if getattr(block, "name", None) in ("h1", "h2", "h3")
            else 0
        )
        if level:
            while stack[-1][0] >= level:
                stack.pop()
            section = soup.new_tag("section", attrs={"class": f"level-{level}"})
            section["aria-labelledby"] = block["id"]
            stack[-1][1].append(section)
            stack.append((level, section))
        stack[-1][1].append(block)


def collapse_skippable(soup, main) -> None:
    """Sections a first reading may skip (module notes) become closed ``<details>``."""
    for section in main.find_all("section"):
        h = section.find(["h1", "h2", "h3"], recursive=False)
        if h is None or not SKIPPABLE.search(heading_text(h)):
            continue
        details = soup.new_tag("details", attrs={"class": "skippable"})
        summary = soup.new_tag("summary")
        note = soup.new_tag("span", attrs={"class": "skip-note"})
        note.string = "May be skipped on a first reading"
        for child in list(section.contents):
            details.append(child.extract())
        summary.append(h.extract())
        summary.append(note)
        details.insert(0, summary)
        section.append(details)
        section["class"] = section.get("class", []) + ["aside"]


def mention_targets(main, headings) -> dict:
    """The id each mention ("§3.2", "Part 4", "Table 3", "Eq. 1" …) links to."""
    best: dict = {}  # mention → (rank, id); the lowest rank wins, then the first

    def offer(key: str, rank: int, target: str) -> None:
        if key not in best or rank < best[key][0]:
            best[key] = (rank, target)

    for h in headings[1:]:
        text = heading_text(h)
        part = re.match(r"Part\s+(\d+)\b", text)
        if part and h.name == "h1":
            offer(f"Part {part.group(1)}", 0, h["id"])
        for m in MENTION.finditer(text):
            key = normal_mention(m.group())
            if key.startswith("Part"):
                continue
            offer(key, 0 if m.start() == 0 else 1, h["id"])
    for fig in main.find_all("figure", class_="paper-quote"):
        caption = fig.find("figcaption")
        for n in re.findall(r"Eqs?\.\s?(\d+)", caption.get_text() if caption else ""):
            fig["id"] = fig.get("id") or f"eq-{n}"
            offer(f"Eq. {n}", 0, fig["id"])
    for img in main.find_all("img", class_=lambda c: c != "narrow"):
        m = re.match(r"Figure\s(\d+)\b", img.get("alt", ""))
        if m:
            img["id"] = img.get("id") or f"figure-{m.group(1)}"
            offer(f"Figure {m.group(1)}", 0, img["id"])
    return {k: v[1] for k, v in best.items()}


def normal_mention(text: str) -> str:
    """A mention in one spelling: "§ 3.2" → "§3.2", "Eq.1" → "Eq. 1"."""
    return re.sub(r"^Eq\.\s?", "Eq. ", re.sub(r"^§\s", "§", text))


NO_LINKS = {
    "a",
    "code",
    "pre",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "figcaption",
    "script",
    "style",
    "summary",
    "svg",
    "button",
    "select",
    "label",
    "title",
}


def link_mentions(soup, main, targets: dict) -> int:
    """Turn every mention in prose into a link to its target; returns how many."""
    count = 0
    for text in list(main.find_all(string=MENTION)):
        if any(
            p.name in NO_LINKS
            or "katex" in (p.get("class") or [])
            or "output" in (p.get("class") or [])
            or "highlight" in (p.get("class") or [])
            for p in text.parents
            if p is not main and p.name
        ):
            continue
        pieces, last, s = [], 0, str(text)
        for m in MENTION.finditer(s):
            target = targets.get(normal_mention(m.group()))
            if target is None:
                continue
            pieces.append(s[last : m.start()])
            link = soup.new_tag("a", href="#" + target, attrs={"class": "xref"})
            link.string = m.group().replace(" ", "\u00a0")  # "Eq. 3" on one line
            pieces.append(link)
            last = m.end()
            count += 1
        if not pieces:
            continue
        pieces.append(s[last:])
        for piece in pieces:
            text.insert_before(piece)
        text.extract()
    return count


SKIP_TO = re.compile(r"\b(skip(?: it| them)? to (?:the )?)([^.,;:()\n]+)", re.I)


def link_skip_to(soup, main, headings) -> int:
    """ "skip to <a heading's name>" links the name to that heading (a mention such as
    "skip to Part 4" is linked already); returns how many."""
    names = {heading_text(h).lower(): h["id"] for h in headings[1:]}
    count = 0
    for text in list(main.find_all(string=SKIP_TO)):
        if any(p.name in NO_LINKS for p in text.parents if p is not main and p.name):
            continue
        m = SKIP_TO.search(str(text))
        phrase = m.group(2).strip()
        target = next(
            (i for name, i in names.items() if name.startswith(phrase.lower())), None
        )
        if target is None or not phrase:
            continue
        s, end = str(text), m.start(2) + len(phrase)
        link = soup.new_tag("a", href="#" + target, attrs={"class": "xref"})
        link.string = phrase
        for piece in (s[: m.start(2)], link, s[end:]):
            text.insert_before(piece)
        text.extract()
        count += 1
    return count


def add_next_links(soup, main) -> None:
    """Each Part ends with a link to the next Part (a skippable one passed over); the
    last Part, to the page's end."""
    parts = [s for s in main.find_all("section", class_="level-1")]
    readable = [s for s in parts if "aside" not in s.get("class", [])]
    end = main.find("footer", class_="page-end")
    for section in parts:
        following = [s for s in readable if parts.index(s) > parts.index(section)]
        if following:
            h = following[0].find("h1")
        elif end is not None and end.find("h2"):
            h = end.find("h2")
        else:
            continue
        nav = soup.new_tag("p", attrs={"class": "next-part"})
        link = soup.new_tag("a", href="#" + h["id"])
        link.string = f"Next: {heading_text(h)} →"
        nav.append(link)
        (section.find("details", recursive=False) or section).append(nav)


def add_title_block(soup, main, title, about: dict) -> None:
    """The title, the paragraph under it, the findings box, and links: the paper, the
    repository and Colab (while the project has an address), and the citation."""
    header = soup.new_tag("header", attrs={"class": "title-block"})
    subtitle = title.find_next_sibling("p")
    main.insert(0, header)
    header.append(title.extract())
    if subtitle is not None:
        header.append(subtitle.extract())
    if about.get("findings"):
        from nbconvert.filters.markdown_mistune import markdown2html_mistune

        box = soup.new_tag(
            "aside", attrs={"class": "findings", "aria-labelledby": "findings-title"}
        )
        head = soup.new_tag(
            "p", attrs={"class": "findings-title", "id": "findings-title"}
        )
        head.string = "What this reproduction found"
        box.append(head)
        ul = soup.new_tag("ul")
        for sentence in about["findings"]:
            li = soup.new_tag("li")
            item = fragment(soup, markdown2html_mistune(sentence))
            paragraph = item.find("p")
            for child in list((paragraph or item).contents):
                li.append(child.extract())
            ul.append(li)
        box.append(ul)
        header.append(box)
    links = soup.new_tag("p", attrs={"class": "title-links"})
    url = about.get("url", "")
    for text, href in (
        ("The paper (arXiv:1706.03762)", PAPER),
        ("Repository", url),
        ("Open in Colab", about.get("colab", "")),
        ("How to cite", "#how-to-cite"),
    ):
        if not href:  # no address yet: no link that leads nowhere
            continue
        a = soup.new_tag("a", href=href)
        a.string = text
        if href.startswith("http"):
            a["rel"] = "noopener"
        links.append(a)
    header.append(links)


def add_ending(soup, main, headings, about: dict) -> None:
    """The page's end: the notebook's Results, Conclusion, Citation and Credits
    sections, moved out of the last Part, and a results pointer, the paper's BibTeX and
    the credits for whichever of them the notebook lacks."""
    has = {
        k: any(p.match(heading_text(h)) for h in headings) for k, p in ENDINGS.items()
    }
    footer = soup.new_tag("footer", attrs={"class": "page-end"})
    for h in headings[1:]:
        if h.name == "h2" and any(p.match(heading_text(h)) for p in ENDINGS.values()):
            section = h.find_parent("section")
            section["class"] = section.get("class", []) + ["ending"]
            footer.append(section.extract())
    has["credits"] = has["credits"] or any(
        p.get_text().startswith("Credits") for p in footer.find_all("p")
    )
    if not has["results"]:
        parts = main.find_all("section", class_="level-1")
        section = soup.new_tag("section", attrs={"class": "ending"})
        section.append(fragment(soup, '<h2 id="results">Results</h2>'))
        if parts:  # a pointer to the last Part and its sections, where the runs are
            last = parts[-1].find("h1")
            p = soup.new_tag("p")
            p.append("The runs and what they measured are in ")
            a = soup.new_tag("a", href="#" + last["id"])
            a.string = heading_text(last)
            p.append(a)
            p.append(":")
            section.append(p)
            ul = soup.new_tag("ul")
            for h in parts[-1].find_all(["h2", "h3"]):
                li = soup.new_tag("li")
                a = soup.new_tag("a", href="#" + h["id"])
                a.string = heading_text(h)
                li.append(a)
                ul.append(li)
            section.append(ul)
        footer.append(section)
    if has["cite"]:  # the title block's "How to cite" leads to the notebook's own
        heading = next(h for h in headings if ENDINGS["cite"].match(heading_text(h)))
        for a in main.find_all("a", href="#how-to-cite"):
            a["href"] = "#" + heading["id"]
        cite = heading.find_parent("section")
    else:
        cite = fragment(
            soup,
            f"""<section class="ending">
<h2 id="how-to-cite">How to cite</h2>
<p>The paper:</p>
<pre class="bibtex">{htmllib.escape(BIBTEX)}</pre>
</section>""",
        ).find("section")
        footer.append(cite)
    if about.get("bibtex"):  # this reproduction, beside the paper
        ours = fragment(
            soup,
            '<div class="cite-ours"><h3 id="cite-this-reproduction">Cite this '
            "reproduction</h3><p>As <code>CITATION.cff</code> in the repository says "
            "(and cite the paper too):</p>"
            f'<pre class="bibtex">{htmllib.escape(about["bibtex"])}</pre></div>',
        )
        first = cite.find("pre", class_="bibtex") or cite.find("pre")
        if first is not None:
            (first.find_parent("div", class_="highlight") or first).insert_after(ours)
        else:
            cite.append(ours)
    if not has["credits"]:
        footer.append(
            fragment(
                soup,
                f"""<section class="ending">
<h2 id="credits">Credits</h2>
<p>The paper and its words quoted here: Ashish Vaswani, Noam Shazeer, Niki Parmar, Jakob
Uszkoreit, Llion Jones, Aidan N. Gomez, Łukasz Kaiser and Illia Polosukhin,
<a href="{PAPER}"><cite>Attention Is All You Need</cite></a> (NeurIPS 2017). The idea of
annotating it line by line with running code: <cite>The Annotated Transformer</cite> by
Alexander Rush (Harvard NLP, 2018). Formulas typeset by KaTeX; the page was built from
the notebook and its stored outputs by <code>make html</code>.</p>
</section>""",
            )
        )
    if about.get("stamp"):
        stamp = soup.new_tag("p", attrs={"class": "build-stamp"})
        stamp.string = about["stamp"]
        footer.append(stamp)
    main.append(footer)


def fragment(soup, markup: str):
    """Parsed HTML to insert into ``soup``."""
    from bs4 import BeautifulSoup

    return BeautifulSoup(markup, "html.parser")


def contents_nav(soup, headings) -> None:
    """The contents: Parts (h1), sections (h2), the paper's subsections (h3 with §)."""
    nav = soup.find("nav", class_="toc")
    top = soup.new_tag("ol", attrs={"class": "toc-list"})
    lists = {0: top}  # heading level → the list that holds the entries below it
    for h in headings[1:]:
        level = int(h.name[1])
        if (
            level == 3
            and section_number(heading_text(h)) is None
            or h.find_parent("footer")
        ):
            continue
        parent = lists[max(k for k in lists if k < level)]
        li = soup.new_tag(
            "li", attrs={"class": "toc-part" if level == 1 else f"toc-{level}"}
        )
        link = soup.new_tag("a", href="#" + h["id"])
        link.string = heading_text(h)
        li.append(link)
        parent.append(li)
        sub = soup.new_tag("ol")
        li.append(sub)
        lists = {k: v for k, v in lists.items() if k < level}
        lists[level] = sub
    for end in soup.find("footer", class_="page-end").find_all("h2"):
        li = soup.new_tag("li", attrs={"class": "toc-2"})
        link = soup.new_tag("a", href="#" + end["id"])
        link.string = heading_text(end)
        li.append(link)
        top.append(li)
    for empty in top.find_all("ol"):
        if not empty.contents:
            empty.decompose()
    nav.append(top)


def search_index(main) -> list:
    """Each section's heading and prose (no code or formulas): [id, title, text]."""
    from bs4 import NavigableString

    skip_tags = {"pre", "script", "style", "svg", "h1", "h2", "h3", "summary"}
    skip_classes = {"katex", "highlight", "output", "anchor-link"}
    entries = []
    for h in main.find_all(["h1", "h2", "h3"]):
        if not h.get("id"):
            continue
        words = []
        holder = h.find_parent("section")
        for el in holder.descendants if holder else []:
            if getattr(el, "name", None) == "section" and el is not holder:
                break  # a subsection: its own entry
            if type(el) is not NavigableString:  # not a tag, comment or doctype
                continue
            if not any(
                p.name in skip_tags or skip_classes & set(p.get("class") or [])
                for p in el.parents
                if p is not holder
            ):
                words.append(str(el))  # with its spaces and line breaks
        text = re.sub(r"\s+", " ", "".join(words)).strip()
        entries.append([h["id"], heading_text(h), text])
    return entries


def code_words(source: str) -> tuple[list[str], list[str]]:
    """(the names a cell's ``def`` and ``class`` statements define, its comments)."""
    names = re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", source, re.M)
    comments = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                if text and not text.startswith(("noqa", "fmt:", "type:")):
                    comments.append(text)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return [n for n in names if n != "_"], comments


def index_code(main) -> list:
    """Each code cell an id (``code-`` and the first name it defines, else its number)
    and a search entry: [id, "Code: names", "names and comments", "code"]."""
    entries, seen = [], set()
    for n, cell in enumerate(main.select("div.cell.code"), 1):
        source = "\n".join(
            pre.get_text().removesuffix("\n") for pre in cell.select(".source pre")
        )
        names, comments = code_words(source)
        base = "code-" + (names[0].lower().replace("_", "-") if names else str(n))
        cid, k = base, 1
        while cid in seen:
            k += 1
            cid = f"{base}-{k}"
        seen.add(cid)
        cell["id"] = cid
        if not names and not comments:
            continue
        title = "Code: " + (", ".join(names) if names else "comments")
        entries.append([cid, title, " ".join(names + comments), "code"])
    return entries


def arrange(html: str, about: dict | None = None) -> str:
    """The article's structure: title, sections, ids, links, contents, ending, index.
    ``about``: the findings, the project's address and Colab link, this reproduction's
    BibTeX and the build's stamp (each left out when absent)."""
    about = about or {}
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    main = soup.find("main")
    for cell in main.find_all("div", class_="prose", recursive=False):
        cell.unwrap()  # one flat run: headings, paragraphs, quotations, code cells
    group_quotes(soup, main)
    headings = main.find_all(["h1", "h2", "h3"])
    ids = heading_ids(headings)
    renamed = {}
    for h in headings:
        renamed[unquote(h.get("id") or "")] = ids[id(h)]
        h["id"] = ids[id(h)]
        for a in h.find_all("a", class_="anchor-link"):
            a["href"] = "#" + h["id"]
            a["aria-label"] = f"Link to this section: {heading_text(h)}"
    heading_set = set(ids.values())
    for anchor in main.find_all(
        id=True
    ):  # the notebook's own <a id="part-4"></a> anchors
        if anchor.name not in ("h1", "h2", "h3") and anchor["id"] in heading_set:
            holder = anchor.parent
            anchor.decompose()
            if (
                holder.name == "p"
                and not holder.get_text(strip=True)
                and not holder.find(True)
            ):
                holder.decompose()
    for a in main.find_all("a", href=re.compile("^#")):
        old = unquote(a["href"][1:])
        if old in renamed and old not in heading_set:
            a["href"] = "#" + renamed[old]
    add_title_block(soup, main, headings[0], about)
    into_sections(soup, main, headings)
    collapse_skippable(soup, main)
    targets = mention_targets(main, headings)
    link_mentions(soup, main, targets)
    link_skip_to(soup, main, headings)
    add_ending(soup, main, headings, about)
    results = next(
        (h["id"] for h in headings if ENDINGS["results"].match(heading_text(h))),
        "results",
    )
    for a in main.select("aside.findings a[href]"):  # the findings' own two places
        where = {"#results": results, "#table-3": targets.get("Table 3", "")}
        if a["href"] in where:
            if where[a["href"]]:
                a["href"] = "#" + where[a["href"]]
            else:
                a.unwrap()
    add_next_links(soup, main)
    label_table_cells(main)
    contents_nav(soup, headings)
    entries = search_index(main) + index_code(main)
    index = script_json(entries)
    script = soup.new_tag(
        "script", attrs={"type": "application/json", "id": "search-index"}
    )
    script.string = index
    soup.body.find("script", recursive=False).insert_before(script)
    policy = soup.new_tag(
        "meta",
        attrs={
            "http-equiv": "Content-Security-Policy",
            "content": content_security_policy(soup),
        },
    )
    soup.head.find("meta", charset=True).insert_after(policy)
    return str(soup)


MANY_COLUMNS = 5  # a table of more columns is a card per row on a phone
# A cell of a wide table stays on one line unless it is words longer than WRAP_OVER
# characters (a number with its ± never breaks)
WRAP_OVER = 12
NUMERIC = re.compile(r"[-+−–]?[\d.,]+\s?[%MkKB]?(\s?±\s?[\d.,]+)?\s?[%MkKB]?")


def label_table_cells(main) -> int:
    """Each body cell of an output's table gets ``data-label``, its column's header
    (so that on a phone page.css can show a row as a card of "label: value" lines),
    and the class ``wrap`` where it is long words (:data:`WRAP_OVER`); a table of
    ``MANY_COLUMNS`` or more columns gets the class ``many-columns``.
    Returns how many tables were labelled."""
    count = 0
    for table in main.select(".output table"):
        rows = table.find_all("tr")
        head = next((r for r in rows if r.find("th") and not r.find("td")), None)
        if head is None:
            continue
        labels = [
            re.sub(r"\s+", " ", c.get_text()).strip()
            for c in head.find_all(["th", "td"])
        ]
        for row in rows:
            if row is head:
                continue
            for label, cell in zip(labels, row.find_all(["td", "th"])):
                if label:
                    cell["data-label"] = label
                text = cell.get_text().strip()
                if len(text) > WRAP_OVER and not NUMERIC.fullmatch(text):
                    cell["class"] = cell.get("class", []) + ["wrap"]
        if len(labels) >= MANY_COLUMNS:
            table["class"] = table.get("class", []) + ["many-columns"]
        count += 1
    return count


def code_css() -> str:
    """Code colours: each Pygments token class to one of a few colours (page.css sets
    them, light and dark, each at least 4.5:1 on the code background)."""
    from pygments.token import (
        STANDARD_TYPES,
        Comment,
        Keyword,
        Name,
        Number,
        Operator,
        String,
    )

    roles = [
        (Comment, "comment"),
        (String, "string"),
        (Number, "number"),
        (Keyword, "keyword"),
        (Operator.Word, "keyword"),
        (Name.Function, "function"),
        (Name.Class, "function"),
        (Name.Decorator, "decorator"),
        (Name.Builtin, "builtin"),
        (Name.Exception, "builtin"),
    ]
    rules = {}
    for token, short in STANDARD_TYPES.items():
        for kind, role in roles:
            if short and token in kind:
                rules.setdefault(role, []).append(f".highlight .{short}")
                break
    css = [
        f"{', '.join(sel)} {{ color: var(--code-{role}); }}"
        for role, sel in rules.items()
    ]
    css.append(
        ".highlight .c, .highlight .c1, .highlight .cm, .highlight .ch, "
        ".highlight .cs, "
        ".highlight .sd { font-style: italic; }"
    )
    return "\n".join(css)


README_LINKS = {"results": "#results", "table3": "results/table3.json"}


def readme_findings(results: Path = ROOT / "results") -> str:
    """The findings as README.md's lines (between its two markers)."""
    lines = [FINDINGS_START, "**What this reproduction found**"]  # a list follows
    for sentence in findings(results, README_LINKS):
        lines += textwrap.wrap(
            sentence,
            width=90,
            initial_indent="* ",
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines + [FINDINGS_END])


def with_findings(readme: str, results: Path = ROOT / "results") -> str:
    """``readme`` with its findings block (after the first paragraph when it has
    none yet) replaced by the findings read from ``results``."""
    block = readme_findings(results)
    if FINDINGS_START in readme and FINDINGS_END in readme:
        head, rest = readme.split(FINDINGS_START, 1)
        return head + block + rest.split(FINDINGS_END, 1)[1]
    title, sep, rest = readme.partition("\n\n")
    first, sep2, after = rest.partition("\n\n")
    return title + sep + first + "\n\n" + block + "\n\n" + after


def about_page(results: Path, cff_file: Path = ROOT / "CITATION.cff") -> dict:
    """What the page says about the project: the findings (from ``results``), its
    address and Colab link (from CITATION.cff, "" while unset), this reproduction's
    BibTeX and the build's stamp."""
    cff = citation(cff_file)
    url = https_address(cff.get("repository-code", ""))
    return {
        "findings": findings(results, {"results": "#results", "table3": "#table-3"}),
        "url": url,
        "colab": https_address(project().colab_url(url)) if url else "",
        "bibtex": bibtex_of(cff, url) if cff else "",
        "stamp": build_stamp(),
    }


def build(
    notebook: Path,
    out: Path,
    results: Path = ROOT / "results",
    cff_file: Path = ROOT / "CITATION.cff",
) -> dict:
    """Write the page for ``notebook`` to ``out`` (the findings read from
    ``results``, the project's address and citation from ``cff_file``): its size,
    formulas, build time."""
    start = time.perf_counter()
    nb = prepare(read_notebook(notebook))
    ensure_katex()
    formulas: list[dict] = []
    exporter = make_exporter(formulas)
    title = next(
        (
            line[2:].strip()
            for c in nb.cells
            if c.cell_type == "markdown"
            for line in c.source.splitlines()
            if line.startswith("# ")
        ),
        notebook.stem,
    )
    css = "\n".join([(WEB / "page.css").read_text(), code_css(), katex_css()])
    resources = {
        "metadata": {"path": str(notebook.parent), "name": notebook.stem},
        "page_title": title,
        "page_css": css,
        "page_js": (WEB / "page.js").read_text(),
        "favicon": url_quote(FAVICON, safe=" ='/:"),
    }
    html, _ = exporter.from_notebook_node(nb, resources=resources)
    typeset_html = typeset(formulas)
    html = SLOT.sub(lambda m: typeset_html[int(m.group(1))], html)
    html = arrange(html, about_page(results, cff_file))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(html, encoding="utf-8")
    except OSError as err:
        raise BadInput(f"cannot write {out}: {err.strerror or err}") from None
    return {
        "bytes": out.stat().st_size,
        "formulas": len(formulas),
        "seconds": time.perf_counter() - start,
    }


def read_notebook(path: Path):
    """The notebook at ``path`` (nbformat 4), or a :class:`BadInput` saying why not:
    missing, unreadable, torn (not JSON) or not a notebook."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise BadInput(f"no notebook at {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"cannot read the notebook {path}: {err}") from None
    except Exception as err:  # nbformat's NotJSONError, a validation error, …
        first = str(err).strip().splitlines()[0][:100] if str(err).strip() else ""
        raise BadInput(
            f"{path} is not a readable notebook ({type(err).__name__}: {first})"
        ) from None


def content_security_policy(soup) -> str:
    """The page's Content-Security-Policy: nothing from anywhere (``default-src
    'none'``); pictures and fonts only inline (``data:``); styles inline; scripts
    only the page's own inline ones (the template's, in ``<head>`` and at the end of
    ``<body>``, never one inside the article), each by the SHA-256 of its text."""
    import hashlib

    own = soup.head.find_all("script", recursive=False) + soup.body.find_all(
        "script", recursive=False
    )
    hashes = sorted(
        {
            "'sha256-"
            + base64.b64encode(
                hashlib.sha256((s.string or "").encode("utf-8")).digest()
            ).decode()
            + "'"
            for s in own
            if s.get("type", "text/javascript").lower() == "text/javascript"
        }
    )
    return "; ".join(
        [
            "default-src 'none'",
            "img-src data:",
            "font-src data:",
            "style-src 'unsafe-inline'",
            "script-src " + (" ".join(hashes) or "'none'"),
            "base-uri 'none'",
            "form-action 'none'",
        ]
    )


def main(argv=None) -> int:
    """Command line of ``make html``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=ROOT / NOTEBOOK_FILE)
    parser.add_argument("--out", type=Path, default=ROOT / "site" / "index.html")
    parser.add_argument(
        "--readme",
        action="store_true",
        help="write the findings (from results/) into README.md's top and stop",
    )
    args = parser.parse_args(argv)
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(with_findings(readme.read_text(encoding="utf-8")))
        print("README.md: findings written from results/")
        return 0
    try:
        stats = build(args.notebook, args.out)
    except MissingTool as err:
        print(err, file=sys.stderr)
        return 2
    except BadInput as err:
        print(f"make html: {err}", file=sys.stderr)
        return 1
    where = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    print(
        f"wrote {where}: {stats['bytes'] / 1e6:.1f} MB ({stats['bytes']:,} bytes), "
        f"{stats['formulas']} formulas, {stats['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The figures of Table 3 (§6.2) at our scale, drawn from ``results/table3.json``:
validation BLEU per variation (``draw``) and validation perplexity per epoch
(``draw_curves``). `benchmarks/table3.py` redraws both whenever the file changes.

Each is drawn twice: for a page's column (at most ``WIDE`` inches: its 10-pt text reads
at 11 CSS px or more in a column of 870 px), and for a phone's
(``machinery.figures.NARROW_WIDTH``: variations down the page, panels stacked); the
PNG carries the second (machinery/figures.py), which the web page shows on a narrow
screen. No text is smaller than ``TEXT_PT``."""

from __future__ import annotations

import textwrap
from pathlib import Path

from machinery.figures import NARROW_WIDTH, save_figure

# Below this gap (nats per target token) a run failed to train (table3.SOURCE_GAP_MIN).
SOURCE_GAP_MIN = 1.0
TEXT_PT = 10  # the smallest text of either figure, in points
WIDE = 9.5  # inches: 9.5 × 72 pt × 1.1 px per pt = 752 CSS px, within 870
DPI = 110


def finished(row: dict) -> bool:
    """Whether a record of Table 3 (§6.2) is a finished row (one whose epoch-1 check
    found another perplexity than its record is not, until trained again)."""
    check = (row.get("provenance") or {}).get("epoch1_check") or {}
    return row.get("status") == "done" and check.get("match") is not False


def trained(row: dict) -> bool:
    """Whether a finished run learnt to read its source (no measurement: trained)."""
    gap = row.get("source_gap")
    return gap is None or gap >= SOURCE_GAP_MIN


GROUP_COLOURS = dict(zip("ABCDE", ("C0", "C1", "C2", "C3", "C4")))


def draw(data: dict, out: Path) -> Path:
    """The figure of Table 3 (§6.2) at our scale: validation BLEU per variation (each
    seed a dot, the mean a bar), grouped A–E, with the base's seeds as a band; its
    phone layout lists the variations down the page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide, narrow = bleu_figure(data, narrow=False), bleu_figure(data, narrow=True)
    save_figure(wide, out, dpi=DPI, narrow=narrow)
    plt.close(wide)
    plt.close(narrow)
    return out


def bleu_figure(data: dict, narrow: bool):
    """The figure :func:`draw` writes: variations across (``narrow``: down), BLEU up
    (across)."""
    import matplotlib.pyplot as plt

    summary = data.get("summary", [])
    base = next((s for s in summary if s["variation"] == "base"), None)
    rows = [s for s in summary if s["variation"] != "base"]
    rows.sort(key=lambda s: ("ABCDE".index(s["group"]), order_of(data, s)))
    seeds = {}
    for r in data["rows"]:
        if finished(r):
            seeds.setdefault(r.get("variation", r["name"]), []).append(r)
    size = (NARROW_WIDTH, 0.3 * len(rows) + 3.2) if narrow else (WIDE, 4.8)
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    # at: a variation's place (x, or y read downwards); value: a BLEU (y, or x)
    band, line = (ax.axvspan, ax.axvline) if narrow else (ax.axhspan, ax.axhline)
    group_band = ax.axhspan if narrow else ax.axvspan

    def point(at, value):
        return (value, at) if narrow else (at, value)

    failed: list[tuple[int, float, str]] = []
    if base:
        b = base["valid_bleu"]
        label = f"base, {b['n']} seed(s): {b['min']:.1f}–{b['max']:.1f}"
        band(b["min"], b["max"], color="0.85", zorder=0, label=label)
        line(b["mean"], color="0.4", lw=1, zorder=1, label="base mean")
    for i, s in enumerate(rows):
        colour = GROUP_COLOURS[s["group"]]
        mean = s["valid_bleu"]["mean"]
        ax.plot(*zip(point(i - 0.25, mean), point(i + 0.25, mean)), color=colour)
        for r in seeds.get(s["variation"], []):
            if trained(r):
                ax.plot(*point(i, r["valid_bleu"]), "o", color=colour, ms=4, zorder=3)
            else:  # failed to train: ×, at the foot of the axis with its score
                failed.append((i, r["valid_bleu"], colour))
    for g in "ABCDE":
        at = [i for i, s in enumerate(rows) if s["group"] == g]
        if at:
            group_band(at[0] - 0.45, at[-1] + 0.45, color=GROUP_COLOURS[g], alpha=0.06)
            middle = (at[0] + at[-1]) / 2
            where = (
                (1.01, middle, ax.get_yaxis_transform())
                if narrow
                else (middle, 1.01, ax.get_xaxis_transform())
            )
            ax.text(where[0], where[1], f"({g})", transform=where[2],
                    ha="left" if narrow else "center",
                    va="center" if narrow else "bottom",
                    color=GROUP_COLOURS[g], fontsize=TEXT_PT)  # fmt: skip
    # the axis spans the seeds that trained (a failed seed would flatten the rest)
    shown = [r["valid_bleu"] for rs in seeds.values() for r in rs if trained(r)]
    limits = ax.set_xlim if narrow else ax.set_ylim
    if shown:
        limits(min(shown) - 1.5, max(shown) + 1.0)
    low = (ax.get_xlim() if narrow else ax.get_ylim())[0]
    for i, bleu, colour in failed:
        value = bleu if bleu > low else low + 0.4
        ax.plot(*point(i, value), "x", color=colour, ms=6, zorder=3)
        if bleu <= low:
            ax.annotate(f"{bleu:.1f}", point(i, value), xytext=(5, -3),
                        fontsize=TEXT_PT, textcoords="offset points",
                        color=colour)  # fmt: skip
    names = [s["variation"] for s in rows]
    if narrow:
        ax.set_yticks(range(len(rows)), names)
        ax.set_ylim(max(len(rows), 1) - 0.3, -0.7)  # the first variation on top
        ax.set_xlabel("validation BLEU\ndots: seeds (×: failed to train)")
    else:
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right")
        ax.set_xlim(-0.7, max(len(rows), 1) - 0.3)
        ax.set_xlabel(
            "Table 3 row (one setting changed from the base); dots: seeds "
            "(×: failed to train)"
        )
        ax.set_ylabel("validation BLEU")
    ax.tick_params(labelsize=TEXT_PT)
    budget = data["budget"]
    title = (
        f"Table 3 (§6.2) at {budget['preset']} scale: {budget['epochs']} epoch(s), "
        f"last checkpoint; {data['dataset_valid']}"
    )
    ax.set_title(wrapped(title, 40 if narrow else 80), fontsize=11,
                 pad=6 if narrow else 18)  # fmt: skip
    if base and narrow:
        fig.legend(loc="outside lower center", fontsize=TEXT_PT, frameon=False)
    elif base:
        ax.legend(fontsize=TEXT_PT, loc="best")
    return fig


def wrapped(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` characters."""
    return "\n".join(textwrap.wrap(text, width))


def draw_curves(data: dict, out: Path) -> Path:
    """Validation perplexity per epoch of every finished row of Table 3 (§6.2), one
    panel per row group (the base's seeds in grey in each; a colour per variation,
    its seeds told apart by the line's dashes), so that a variation that learns
    faster can be told from one that ends better; three panels across (its phone
    layout: one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide, narrow = curves_figure(data, across=3), curves_figure(data, across=1)
    save_figure(wide, out, dpi=DPI, narrow=narrow)
    plt.close(wide)
    plt.close(narrow)
    return out


def curves_figure(data: dict, across: int):
    """The figure :func:`draw_curves` writes, ``across`` panels a row."""
    import matplotlib.pyplot as plt

    # tab10 without its grey (index 7), which is the base's
    colours = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]
    dashes = {1: "-", 2: "--"}
    done = [r for r in data["rows"] if finished(r) and r.get("curve")]
    down = -(-5 // across)
    width = WIDE if across > 1 else NARROW_WIDTH
    fig = plt.figure(figsize=(width, 3.3 * down + 0.6), layout="constrained")
    axes = fig.subplots(down, across, squeeze=False).ravel()
    for ax in axes[5:]:
        ax.set_visible(False)
    for ax, g in zip(axes, "ABCDE"):
        variations: list[str] = []
        for r in done:
            xs = [c["epoch"] for c in r["curve"]]
            ys = [c["valid_ppl"] for c in r["curve"]]
            if r["group"] == "base":
                ax.plot(xs, ys, color="0.6", lw=1)
                continue
            if r["group"] != g:
                continue
            v = r.get("variation", r["name"])
            first = v not in variations  # one legend entry per variation
            if first:
                variations.append(v)
            ax.plot(
                xs,
                ys,
                lw=1.2,
                color=colours[variations.index(v) % len(colours)],
                linestyle=dashes.get(r.get("seed", 1), ":"),
                label=v if first else None,
            )
        ax.set_title(f"({g})", fontsize=11)
        ax.set_xlabel("epoch", fontsize=TEXT_PT)
        ax.set_yscale("log")
        ax.tick_params(which="both", labelsize=TEXT_PT)
        if variations:  # under the panel, so that it hides no curve
            ax.legend(fontsize=TEXT_PT, ncols=2, loc="upper center",
                      bbox_to_anchor=(0.5, -0.2), frameon=False)  # fmt: skip
        else:
            ax.text(0.5, 0.5, "not yet run", ha="center", transform=ax.transAxes,
                    fontsize=TEXT_PT)  # fmt: skip
        ax.set_ylabel("validation perplexity", fontsize=TEXT_PT)
    note = (
        "Validation perplexity per epoch: a colour per variation, seed 1 solid, "
        "seed 2 dashed; the base's seeds in grey"
    )
    fig.suptitle(wrapped(note, 80 if across > 1 else 42), fontsize=11)
    return fig


def order_of(data: dict, summary: dict) -> int:
    """Where a variation's first row stands in the file's run order (for the figure)."""
    names = [r.get("variation", r["name"]) for r in data["rows"]]
    return names.index(summary["variation"])

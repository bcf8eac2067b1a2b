"""The figures of Table 3 (§6.2) at our scale, drawn from ``results/table3.json``:
validation BLEU per variation (``draw``) and validation perplexity per epoch
(``draw_curves``). `benchmarks/table3.py` redraws both whenever the file changes."""

from __future__ import annotations

from pathlib import Path

# Below this gap (nats per target token) a run failed to train (table3.SOURCE_GAP_MIN).
SOURCE_GAP_MIN = 1.0


def finished(row: dict) -> bool:
    """Whether a record of Table 3 (§6.2) is a finished row."""
    return row.get("status") == "done"


def trained(row: dict) -> bool:
    """Whether a finished run learnt to read its source (no measurement: trained)."""
    gap = row.get("source_gap")
    return gap is None or gap >= SOURCE_GAP_MIN


GROUP_COLOURS = dict(zip("ABCDE", ("C0", "C1", "C2", "C3", "C4")))


def draw(data: dict, out: Path) -> Path:
    """The figure of Table 3 (§6.2) at our scale: validation BLEU per variation (each
    seed a dot, the mean a bar), grouped A–E, with the base's seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data.get("summary", [])
    base = next((s for s in summary if s["variation"] == "base"), None)
    rows = [s for s in summary if s["variation"] != "base"]
    rows.sort(key=lambda s: ("ABCDE".index(s["group"]), order_of(data, s)))
    seeds = {}
    for r in data["rows"]:
        if finished(r):
            seeds.setdefault(r.get("variation", r["name"]), []).append(r)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2.5), 4.2))
    failed: list[tuple[int, float, str]] = []
    if base:
        b = base["valid_bleu"]
        ax.axhspan(
            b["min"],
            b["max"],
            color="0.85",
            zorder=0,
            label=f"base, {b['n']} seed(s): {b['min']:.1f}–{b['max']:.1f}",
        )
        ax.axhline(b["mean"], color="0.4", lw=1, zorder=1, label="base mean")
    for i, s in enumerate(rows):
        colour = GROUP_COLOURS[s["group"]]
        ax.plot([i - 0.25, i + 0.25], [s["valid_bleu"]["mean"]] * 2, color=colour)
        for r in seeds.get(s["variation"], []):
            if trained(r):
                ax.plot([i], [r["valid_bleu"]], "o", color=colour, ms=4, zorder=3)
            else:  # failed to train: ×, at the foot of the axis with its score
                failed.append((i, r["valid_bleu"], colour))
    for g in "ABCDE":
        at = [i for i, s in enumerate(rows) if s["group"] == g]
        if at:
            ax.axvspan(at[0] - 0.45, at[-1] + 0.45, color=GROUP_COLOURS[g], alpha=0.06)
            ax.text(
                (at[0] + at[-1]) / 2,
                1.01,
                f"({g})",
                ha="center",
                transform=ax.get_xaxis_transform(),
                color=GROUP_COLOURS[g],
            )
    # the axis spans the seeds that trained (a failed seed would flatten the rest)
    shown = [r["valid_bleu"] for rs in seeds.values() for r in rs if trained(r)]
    if shown:
        ax.set_ylim(min(shown) - 1.5, max(shown) + 1.0)
    low = ax.get_ylim()[0]
    for i, bleu, colour in failed:
        y = bleu if bleu > low else low + 0.4
        ax.plot([i], [y], "x", color=colour, ms=6, zorder=3)
        if bleu <= low:
            ax.annotate(f"{bleu:.1f}", (i, y), xytext=(5, -3), fontsize=8,
                        textcoords="offset points", color=colour)  # fmt: skip
    ax.set_xticks(
        range(len(rows)), [s["variation"] for s in rows], rotation=60, ha="right"
    )
    ax.set_xlim(-0.7, max(len(rows), 1) - 0.3)
    ax.set_xlabel(
        "Table 3 row (one setting changed from the base); dots: seeds "
        "(×: failed to train)"
    )
    ax.set_ylabel(f"validation BLEU\n{data['dataset_valid']}", fontsize=8)
    budget = data["budget"]
    ax.set_title(
        f"Table 3 (§6.2) at {budget['preset']} scale: {budget['epochs']} epoch(s), "
        "last checkpoint",
        pad=18,
    )
    ax.legend(fontsize=9, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw_curves(data: dict, out: Path) -> Path:
    """Validation perplexity per epoch of every finished row of Table 3 (§6.2), one
    panel per row group (the base's seeds in grey in each; a colour per variation,
    its seeds told apart by the line's dashes), so that a variation that learns
    faster can be told from one that ends better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # tab10 without its grey (index 7), which is the base's
    colours = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]
    dashes = {1: "-", 2: "--"}
    done = [r for r in data["rows"] if finished(r) and r.get("curve")]
    fig, axes = plt.subplots(1, 5, figsize=(15, 3.8), sharey=True)
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
        ax.set_title(f"({g})")
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        if variations:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not yet run", ha="center", transform=ax.transAxes)
    axes[0].set_ylabel("validation perplexity (grey: base)")
    fig.suptitle("a colour per variation: seed 1 solid, seed 2 dashed", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def order_of(data: dict, summary: dict) -> int:
    """Where a variation's first row stands in the file's run order (for the figure)."""
    names = [r.get("variation", r["name"]) for r in data["rows"]]
    return names.index(summary["variation"])

"""Figures: the training curve of a run and the attention maps of Part 4.

Figures are built as ``matplotlib.figure.Figure`` objects, not through pyplot, so that
drawing them leaves no global state behind; files are written to a temporary name and
renamed, so a full disk never leaves a half-written image in place of the old one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Sequence

import torch


def save_figure(fig, out: Path, dpi: int = 100) -> Path:
    """Write ``fig`` to ``out`` (PNG) through a temporary file renamed over it."""
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, out)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(out)) from e
        raise
    return out


def plot_curves(metrics_path: Path, out: Path, title: str = "") -> Path:
    """Training and validation loss against step, from the metrics log, saved as a
    PNG."""
    from matplotlib.figure import Figure

    records = [
        json.loads(line)
        for line in Path(metrics_path).read_text().splitlines()
        if line.strip()
    ]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    tr = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    va = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="training loss (label-smoothed)")
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss")
    ax.set_xlabel("update")
    ax.set_ylabel("nats per token")
    ax.set_title(title or "Training and validation loss")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, out, dpi=200)


# Twenty-four maps per kind of attention (3 layers × 8 heads of `multi30k-small`) cannot
# all carry readable token labels at the width of a page. So there are two views: an
# overview of every layer and head, small and unlabelled, to see their shapes at a
# glance; and, for each kind, one head drawn large with its source and target tokens.
# Which head? We show the one whose rows are most concentrated — lowest mean entropy
# $-\sum_j a_{ij} \ln a_{ij}$ over its query rows $i$ — since a sharp head is the
# easiest to read; that choice is ours. The figures are built as
# `matplotlib.figure.Figure` objects, not through pyplot, so drawing them leaves no
# global state behind, and a test draws them for a tiny random model and checks that
# every token label is there and legible.

ATTENTION_TITLES = MappingProxyType(
    {
        "encoder": "encoder self-attention",
        "decoder_self": "masked decoder self-attention",
        "decoder_src": "encoder-decoder attention",
    }
)


def sharpest_head(weights: torch.Tensor) -> tuple[int, int]:
    r"""The (layer, head) of ``weights`` (N, h, len_q, len_k) with the lowest mean row
    entropy (our choice).

    A row's entropy is $-\sum_j a_{ij} \ln a_{ij}$ (0 for a row that puts all weight on
    one key).
    """
    entropy = (
        torch.special.entr(weights).sum(dim=-1).mean(dim=-1)
    )  # (N, h): mean over query rows
    layer, head = divmod(int(entropy.argmin()), entropy.size(1))
    return layer, head


def draw_attention_overview(maps: dict, width: float = 7.2):
    """Every layer (rows) and head (columns) of each kind of attention of §3.2.3, small
    and unlabelled (our addition).

    ``maps`` as :func:`attention_maps` returns; ``width`` in inches at 100 dpi. Returns
    the figure.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 2.4 * len(maps)), dpi=100, layout="constrained")
    for sub, kind in zip(fig.subfigures(len(maps), 1, squeeze=False)[:, 0], maps):
        w = maps[kind]
        axes = sub.subplots(w.size(0), w.size(1), squeeze=False)
        for layer in range(w.size(0)):
            for head in range(w.size(1)):
                ax = axes[layer][head]
                ax.imshow(
                    w[layer, head].numpy(),
                    cmap="Blues",
                    vmin=0.0,
                    vmax=1.0,
                    aspect="auto",
                )
                ax.set_xticks([])
                ax.set_yticks([])
                if layer == 0:
                    ax.set_title(f"head {head + 1}", fontsize=8)
                if head == 0:
                    ax.set_ylabel(f"layer {layer + 1}", fontsize=8)
        sub.suptitle(ATTENTION_TITLES.get(kind, kind), fontsize=10)
    return fig


# The large view gives each token a square cell of at most 0.34 inch and its label three
# quarters of a cell; with many keys the cells shrink so that the figure stays about as
# wide as a page, where a wider image would be scaled down, labels and all.


def draw_attention_head(
    weights: torch.Tensor,
    rows: Sequence[str],
    cols: Sequence[str],
    title: str,
    width: float = 7.2,
):
    """One head's attention map (§3.2.3) with every query token (rows) and key token
    (columns) labelled (our addition).

    ``weights`` (len_q, len_k); the figure is about ``width`` inches wide at 100 dpi.
    Returns the figure.
    """
    from matplotlib.figure import Figure

    n_q, n_k = weights.shape
    cell = min(
        0.34, (width - 2.2) / n_k
    )  # inches per token; 2.2 in for row labels and the colour bar
    fontsize = min(11.0, 0.75 * 72 * cell)  # points: three quarters of a cell
    fig = Figure(
        figsize=(2.2 + cell * n_k, 1.6 + cell * n_q), dpi=100, layout="constrained"
    )
    ax = fig.subplots()
    image = ax.imshow(weights.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n_k), list(cols), rotation=90, fontsize=fontsize)
    ax.set_yticks(range(n_q), list(rows), fontsize=fontsize)
    ax.set_xlabel("key (attended to)", fontsize=10)
    ax.set_ylabel("query (attending)", fontsize=10)
    ax.set_title(title, fontsize=11)
    fig.colorbar(image, ax=ax, shrink=0.6).set_label("weight", fontsize=9)
    return fig

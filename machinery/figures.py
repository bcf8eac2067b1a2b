"""Figures: the training curve of a run and the attention maps of Part 4.

Figures are built as ``matplotlib.figure.Figure`` objects, not through pyplot, so that
drawing them leaves no global state behind; files go through the project's atomic
writer (:func:`machinery.runfiles.write_atomic`), so a full disk never leaves a
half-written image in place of the old one.

Every PNG drawn here records the size of its smallest text in points (a text chunk,
``SMALLEST_TEXT_KEY``), and a figure too wide for a phone carries a second drawing of
itself laid out for a narrow column (a private PNG chunk, ``NARROW_CHUNK``, that
viewers ignore): the web page shows that one where the column is too narrow for the
first one's text to read at 11 CSS px (web/build.py), and its tests read both.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import Sequence

import torch

from .parts import notebook
from .runfiles import write_atomic

# The PNG text chunk that records a figure's smallest font size, in points.
SMALLEST_TEXT_KEY = "Smallest text (pt)"
# The private PNG chunk that carries a figure's narrow layout (a whole PNG): ancillary
# (lower case), private (lower case), reserved bit clear (upper case), unsafe to copy
# (upper case: it belongs to this picture only).
NARROW_CHUNK = b"nrLY"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The width, in inches, of a narrow layout: a phone's column (about 323 CSS px at 390)
# shows it at 1.1 CSS px per point or more, so its 10-pt text reads at 11 px.
NARROW_WIDTH = 4.0


def smallest_text_pt(fig) -> float | None:
    """The smallest font size, in points, of the visible text drawn on ``fig`` (titles,
    labels, tick labels, legends, notes), or None where it draws none."""
    from matplotlib.text import Text

    hidden = {  # the tick labels of axes turned off are never drawn
        id(t)
        for ax in fig.axes
        if not ax.axison
        for axis in (ax.xaxis, ax.yaxis)
        for t in axis.findobj(Text)
    }
    sizes = [
        t.get_fontsize()
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in hidden
    ]
    return min(sizes) if sizes else None


def png_bytes(fig, dpi: int, tight: bool = False) -> bytes:
    """``fig`` as PNG bytes at ``dpi``, recording its smallest text
    (``SMALLEST_TEXT_KEY``); ``tight``: cropped to what it draws."""
    smallest = smallest_text_pt(fig)
    metadata = {SMALLEST_TEXT_KEY: f"{smallest:g}"} if smallest else {}
    out = io.BytesIO()
    fig.savefig(
        out,
        format="png",
        dpi=dpi,
        metadata=metadata,
        facecolor="white",
        **({"bbox_inches": "tight"} if tight else {}),
    )
    return out.getvalue()


def png_chunks(png: bytes):
    """The (type, data) chunks of a PNG, in order; not a PNG is a ValueError."""
    if png[:8] != PNG_SIGNATURE:
        raise ValueError("not a PNG")
    at = 8
    while at + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[at : at + 8])
        yield kind, png[at + 8 : at + 8 + length]
        at += 12 + length


def with_narrow_layout(png: bytes, narrow: bytes) -> bytes:
    """``png`` carrying ``narrow`` (the same figure laid out for a phone's column) in
    its ``NARROW_CHUNK``, just before the closing IEND chunk."""
    iend = len(png) - 12  # the IEND chunk, last: its length, type and CRC
    if png[:8] != PNG_SIGNATURE or png[-8:-4] != b"IEND" or narrow[:8] != PNG_SIGNATURE:
        raise ValueError("not a PNG")
    crc = zlib.crc32(NARROW_CHUNK + narrow) & 0xFFFFFFFF
    chunk = struct.pack(">I", len(narrow)) + NARROW_CHUNK + narrow
    return png[:iend] + chunk + struct.pack(">I", crc) + png[iend:]


def narrow_layout(png: bytes) -> bytes | None:
    """The narrow layout a PNG carries (:func:`with_narrow_layout`), or None."""
    try:
        return next((d for k, d in png_chunks(png) if k == NARROW_CHUNK), None)
    except ValueError:
        return None


def recorded_smallest_text_pt(png: bytes) -> float | None:
    """The smallest text size, in points, that a PNG records (``SMALLEST_TEXT_KEY``),
    or None where it records none."""
    from PIL import Image

    value = Image.open(io.BytesIO(png)).text.get(SMALLEST_TEXT_KEY)
    return float(value) if value else None


def figure_png(fig, dpi: int, narrow=None, tight: bool = False) -> bytes:
    """``fig`` as PNG bytes (``tight``: cropped to what it draws), carrying ``narrow``
    (a figure, its phone layout, kept at the width it was drawn for) when given; both
    record their smallest text."""
    png = png_bytes(fig, dpi, tight)
    return with_narrow_layout(png, png_bytes(narrow, dpi)) if narrow else png


def save_figure(fig, out: Path, dpi: int = 100, narrow=None) -> Path:
    """Write ``fig`` to ``out`` (PNG, with ``narrow``, its phone layout, when given),
    atomically."""
    out = Path(out)
    write_atomic(out, figure_png(fig, dpi, narrow))
    return out


def plot_curves(metrics_path: Path, out: Path, title: str = "") -> Path:
    """Training and validation loss against step, from the metrics log, saved as a
    PNG that carries its phone layout (narrower, its legend under the plot)."""
    records = [
        json.loads(line)
        for line in Path(metrics_path).read_text().splitlines()
        if line.strip()
    ]
    title = title or "Training and validation loss"
    wide = draw_curves(records, title, (6, 3.5))
    narrow = draw_curves(records, title, (NARROW_WIDTH, 3.6), legend_below=True)
    return save_figure(wide, out, dpi=200, narrow=narrow)


def draw_curves(records: list, title: str, size: tuple, legend_below=False):
    """The figure of :func:`plot_curves` at ``size`` (inches), its text 10 pt or
    more."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    tr = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    va = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="training loss (label-smoothed)")
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss")
    ax.set_xlabel("update")
    ax.set_ylabel("nats per token")
    ax.set_title(title)
    if tr or va:
        if legend_below:
            fig.legend(loc="outside lower center", fontsize=10, frameon=False)
        else:
            ax.legend(fontsize=10)
    return fig


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


def draw_attention_overview(maps: dict, width: float = 7.2, narrow: bool = False):
    """Every layer (rows) and head (columns) of each kind of attention of §3.2.3, small
    and unlabelled (our addition); ``narrow``: the heads numbered only, for a phone's
    column.

    ``maps`` as :func:`attention_maps` returns; ``width`` in inches at 100 dpi. Returns
    the figure; its text is 10 pt or more.
    """
    from matplotlib.figure import Figure

    layers, heads = next(iter(maps.values())).shape[:2]
    per_kind = 0.6 + layers * (width - 0.5) / heads * (1.0 if narrow else 0.6)
    fig = Figure(figsize=(width, per_kind * len(maps)), dpi=100, layout="constrained")
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
                    name = f"{head + 1}" if narrow else f"head {head + 1}"
                    ax.set_title(name, fontsize=10)
                if head == 0 and narrow:
                    ax.set_ylabel(f"{layer + 1}", fontsize=10, rotation=0, va="center")
                elif head == 0:
                    ax.set_ylabel(f"layer {layer + 1}", fontsize=10)
        title = ATTENTION_TITLES.get(kind, kind)
        if narrow:
            title += f"\nlayers 1–{w.size(0)} down, heads 1–{w.size(1)} across"
        sub.suptitle(title, fontsize=11)
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


# What a trained model attends to (Part 4): the weights of every layer and head for the
# three uses of attention of §3.2.3, for one sentence pair. Forward pre-hooks note the
# inputs each attention module receives during one forward pass (and are removed right
# after); the weights are then recomputed with the notebook's readable `attention()`
# from the module's own projections, so this works for the fused class too, which never
# materialises them, and nothing is stored on the modules.

ATTENTION_KINDS = ("encoder", "decoder_self", "decoder_src")


@torch.no_grad()
def attention_maps(model, src, tgt) -> dict:
    r"""Attention weights of every layer and head, for the three uses of §3.2.3.

    ``src`` (src_len,) source ids; ``tgt`` (tgt_len,) decoder input ids (from <s>).
    Returns ``{"encoder": (N, h, src_len, src_len), "decoder_self": (N_dec, h, tgt_len,
    tgt_len), "decoder_src": (N_dec, h, tgt_len, src_len)}``; each row sums to 1.
    """
    nb = notebook()
    was_training = model.training
    model.eval()
    src, tgt = src.view(1, -1), tgt.view(1, -1)  # (1, src_len), (1, tgt_len)
    modules = {("encoder", i): x.self_attn for i, x in enumerate(model.encoder.layers)}
    for i, layer in enumerate(model.decoder.layers):
        modules[("decoder_self", i)] = layer.self_attn
        modules[("decoder_src", i)] = layer.src_attn
    inputs: dict = {}
    handles = [
        m.register_forward_pre_hook(
            lambda _m, args, key=key: inputs.__setitem__(key, args)
        )
        for key, m in modules.items()
    ]
    try:
        causal = nb.subsequent_mask(tgt.size(1), device=tgt.device)
        model(src, tgt, nb.padding_mask(src, nb.PAD), causal)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    maps = {}
    for kind in ATTENTION_KINDS:
        stack = model.encoder if kind == "encoder" else model.decoder
        layers = []
        for i in range(len(stack.layers)):
            a, (query, key, _value, mask) = modules[(kind, i)], inputs[(kind, i)]
            q, (k, v) = a.project_q(query), a.project_kv(key, key)  # (1, h, len, d_k)
            weights = nb.attention(q, k, v, nb.per_head(mask))[1]  # (1, h, q, k)
            layers.append(weights[0])
        maps[kind] = torch.stack(layers)  # (layers of its stack, h, len_q, len_k)
    return maps


def attention_maps_json(
    maps: dict, src: Sequence[str], out: Sequence[str], read: Sequence[str]
) -> dict:
    """The maps as the web page's interactive figure reads them (weights to 3 decimals):
    ``{"sentence": {"src", "tgt", "tgt_out"}, "maps": {"encoder", "decoder",
    "cross"}}``, each map [layer][head][query][key]; ``tgt`` is what each decoder
    position reads, ``tgt_out`` what it predicts (web/build.py reads this)."""
    names = {"encoder": "encoder", "decoder_self": "decoder", "decoder_src": "cross"}
    return {
        "sentence": {"src": list(src), "tgt": list(read), "tgt_out": list(out)},
        "maps": {names[k]: maps[k].round(decimals=3).tolist() for k in ATTENTION_KINDS},
    }


def show_attention(
    maps: dict,
    src: Sequence[str],
    out: Sequence[str],
    read: Sequence[str],
    *,
    source: str = "",
    reference: str = "",
    output: str = "",
) -> None:
    """Display the maps of :func:`attention_maps` in a notebook: the sentence's
    ``source``, ``reference`` and model ``output`` (a line each, those given), every
    layer and head small, then the sharpest head of each kind large with its tokens
    (``src`` the source tokens, ``out`` what each decoder position predicts, ``read``
    what it reads), then the maps as data for the web page's explorer."""
    from IPython.display import display

    for name, text in (
        ("source", source),
        ("reference", reference),
        ("output", output),
    ):
        if text:
            print(f"{name + ':':11s}{text}")
    labels = {"encoder": (src, src), "decoder_self": (out, read),
              "decoder_src": (out, src)}  # fmt: skip
    overview = (
        "Small heat maps of every layer and head for the three kinds of attention."
    )
    show_figure(
        draw_attention_overview(maps),
        overview,
        narrow=draw_attention_overview(maps, NARROW_WIDTH, narrow=True),
    )
    for kind in ATTENTION_KINDS:
        layer, head = sharpest_head(maps[kind])
        title = f"{ATTENTION_TITLES[kind]}, layer {layer + 1}, head {head + 1}"
        rows, cols = labels[kind]
        figure = draw_attention_head(maps[kind][layer, head], rows, cols, title)
        show_figure(figure, f"Heat map of the {title}.")
    blob = attention_maps_json(maps, src, out, read)
    note = "attention maps (explore them on the web page)"
    display({"application/vnd.attention-maps+json": blob, "text/plain": note}, raw=True)


def show_figure(fig, alt: str, narrow=None) -> None:
    """Display ``fig`` in a notebook as a PNG at twice its size, carrying ``alt`` text
    and ``narrow`` (the figure laid out for a phone) when given (the web page reads
    both)."""
    from IPython.display import Image, display

    png = figure_png(fig, dpi=200, narrow=narrow, tight=True)
    display(Image(data=png), metadata={"image/png": {"alt": alt}})


def show_image(path: str, alt: str) -> None:
    """Display the PNG at ``path`` (relative paths: from here, else from the
    repository) as a cell output carrying ``alt`` text: stored in the notebook, so
    hosted notebooks show it too (they cannot show relative Markdown image paths)."""
    from IPython.display import Image, display

    path = Path(path)
    if not path.is_absolute() and not path.is_file():  # run from another folder
        path = Path(__file__).resolve().parents[1] / path  # the repository's own
    display(Image(filename=str(path)), metadata={"image/png": {"alt": alt}})

"""Draw our own versions of Figures 1 and 2 of "Attention Is All You Need".

Figure 1 is the Transformer architecture (post-norm, as in the paper); Figure 2 shows
scaled dot-product attention and multi-head attention. Boxes carry the paper's terms
and, in grey monospace, the names of the classes and functions in
``the_annotated_transformer.py`` that implement them.

Re-run from the repository root with

    .venv/bin/python figures/draw_figures.py

which (re)writes ``figures/figure1_transformer.png`` and
``figures/figure2_attention.png`` and prints their paths. Each PNG records the size of
its smallest text in points and carries its phone layout (machinery/figures.py):
Figure 1 in one column, the encoder below the decoder; Figure 2 with its two panels
stacked. The web page so shows every text at 11 CSS px or more: Figure 1 at its real
size (8.4 inches, 806 CSS px, 1.33 px per point) from 8.5 pt, Figure 2 in a 928-px
column from 10 pt, and both phone layouts in a 323-px column (1.1 px per point) from
10 pt.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch  # noqa: E402
from matplotlib.path import Path as MplPath  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(OUT_DIR.parent))
from machinery.figures import (  # noqa: E402
    SMALLEST_TEXT_KEY,
    recorded_smallest_text_pt,
    save_figure,
    smallest_text_pt,
)

DPI = 110
# Figure 1's smallest text (its code names and notes), in points: 8.5 pt at its real
# size reads at 11.3 CSS px.
FIG1_SMALL_PT = 8.5
# Figure 2's smallest text (its notes and code names), in points: the web page shows a
# figure at no less than 1.1 CSS px per point (a phone), so 10 pt reads at 11 px.
FIG2_SMALL_PT = 10
# Figure 2's phone layout: its panels stacked, each drawn this many real inches to a
# drawing inch, so that a 5.1-inch panel is 4.0 inches wide.
FIG2_NARROW_SCALE = 0.78
__all__ = ["SMALLEST_TEXT_KEY", "recorded_smallest_text_pt", "smallest_text_pt"]

# Fill colours per kind of block; the edge is always a darker grey.
COLORS = {
    "attention": "#fbd9b0",
    "norm": "#f4f0b0",
    "ffn": "#c6e3f5",
    "embed": "#f7c9d4",
    "linear": "#dcd2f2",
    "softmax": "#cdeac3",
    "matmul": "#e6d2f0",
    "scale": "#f4f0b0",
    "mask": "#e3e3e3",
    "stack": "#f2f2f2",
}
EDGE = "#444444"
LINE = "#222222"
CODE = "#808080"


@dataclass
class Box:
    """A drawn box, kept for attaching arrows to its edges."""

    x: float  # centre
    y: float  # centre
    w: float
    h: float

    @property
    def top(self) -> float:
        return self.y + self.h / 2

    @property
    def bottom(self) -> float:
        return self.y - self.h / 2

    @property
    def left(self) -> float:
        return self.x - self.w / 2

    @property
    def right(self) -> float:
        return self.x + self.w / 2


def new_axes(width: float, height: float):
    """A figure whose data coordinates are inches, with the axes hidden."""
    fig = plt.figure(figsize=(width, height), facecolor="white")
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def save(fig, path: Path, narrow=None) -> None:
    """Write ``fig`` as a PNG at ``DPI`` (carrying ``narrow``, its phone layout, when
    given), recording its smallest text size (our addition), and close both."""
    save_figure(fig, path, dpi=DPI, narrow=narrow)
    plt.close(fig)
    if narrow is not None:
        plt.close(narrow)


def code_text(ax, x, y, s, size=FIG1_SMALL_PT, **kw):
    """Small grey monospace text naming our code."""
    kw.setdefault("ha", "center")
    kw.setdefault("va", "center")
    ax.text(x, y, s, fontsize=size, color=CODE, family="monospace", **kw)


def note(ax, x, y, s, size=FIG1_SMALL_PT, **kw):
    """Dark-grey annotation in the paper's notation (mathtext allowed)."""
    kw.setdefault("ha", "center")
    kw.setdefault("va", "center")
    ax.text(x, y, s, fontsize=size, color="#333333", **kw)


def box(
    ax, x, y, w, h, label, kind, code=None, size=10, stack=0, zorder=3, code_size=None
) -> Box:
    """A rounded box centred at (x, y); ``stack`` > 0 draws that many copies behind
    it; ``code`` (grey, ``code_size`` points) under its label."""
    for i in range(stack, -1, -1):
        dx = dy = 0.07 * i
        ax.add_patch(
            FancyBboxPatch(
                (x - w / 2 + dx, y - h / 2 + dy),
                w,
                h,
                boxstyle="round,pad=0,rounding_size=0.07",
                facecolor=COLORS[kind],
                edgecolor=EDGE,
                linewidth=1.1,
                zorder=zorder - 0.1 * i,
            )
        )
    if code:
        ax.text(
            x,
            y + 0.075,
            label,
            ha="center",
            va="center",
            fontsize=size,
            zorder=zorder + 1,
        )
        code_text(
            ax, x, y - 0.135, code, size=code_size or FIG1_SMALL_PT, zorder=zorder + 1
        )
    else:
        ax.text(x, y, label, ha="center", va="center", fontsize=size, zorder=zorder + 1)
    return Box(x, y, w, h)


def arrow(ax, *points, head=True, color=LINE, lw=1.3):
    """A polyline through ``points``, with an arrow head at the last point if
    ``head``."""
    codes = [MplPath.MOVETO] + [MplPath.LINETO] * (len(points) - 1)
    ax.add_patch(
        FancyArrowPatch(
            path=MplPath(points, codes),
            arrowstyle="-|>" if head else "-",
            mutation_scale=11,
            color=color,
            linewidth=lw,
            shrinkA=0,
            shrinkB=0,
            joinstyle="miter",
            capstyle="butt",
            zorder=2,
        )
    )


def adder(ax, x, y, r=0.13):
    """The ⊕ that adds the positional encoding to the embeddings."""
    ax.add_patch(
        Circle((x, y), r, facecolor="white", edgecolor=LINE, linewidth=1.3, zorder=3)
    )
    ax.plot([x - r * 0.65, x + r * 0.65], [y, y], color=LINE, lw=1.3, zorder=4)
    ax.plot([x, x], [y - r * 0.65, y + r * 0.65], color=LINE, lw=1.3, zorder=4)
    return Box(x, y, 2 * r, 2 * r)


def sine_icon(ax, x, y, r=0.19):
    """A circle with a sine wave: the sinusoidal positional encoding."""
    ax.add_patch(
        Circle((x, y), r, facecolor="white", edgecolor=LINE, linewidth=1.2, zorder=3)
    )
    t = np.linspace(-0.75, 0.75, 60)
    ax.plot(
        x + t * r,
        y + 0.5 * r * np.sin(t * 2 * np.pi / 0.75),
        color=LINE,
        lw=1.0,
        zorder=4,
    )
    return Box(x, y, 2 * r, 2 * r)


def fan_in(ax, y_split, y_top, xs, x_from):
    """From the main line at ``x_from``, split at ``y_split`` into arrows up to each
    of ``xs``."""
    lo, hi = min(xs + [x_from]), max(xs + [x_from])
    arrow(ax, (lo, y_split), (hi, y_split), head=False)
    for x in xs:
        arrow(ax, (x, y_split), (x, y_top))


# --------------------------------------------------------------------------------------
# Figure 1: the Transformer
# --------------------------------------------------------------------------------------

BOX_W, BOX_H = 2.0, 0.5
RES_GAP = 0.22  # residual line's distance from the box edges
FRAME_PAD = 0.42  # layer frame's distance from the box edges
SPLIT = 0.2  # how far below a sub-layer the main line branches


def sublayer_rows(start: float, kinds: list[str]) -> list[float]:
    """Centres of the sub-layer boxes: Add & Norm sits close above its sub-layer."""
    ys, y = [], start
    for kind in kinds:
        ys.append(y)
        y += 0.7 if kind != "norm" else 0.85
    return ys


def residual(ax, col_x, side, y_from, norm: Box):
    """Residual connection: from the main line at ``y_from`` around the side into
    ``norm``."""
    x_out = col_x + side * (BOX_W / 2 + RES_GAP)
    edge = norm.left if side < 0 else norm.right
    arrow(ax, (col_x, y_from), (x_out, y_from), (x_out, norm.y), (edge, norm.y))


def layer_stack(ax, col_x, side, rows, blocks):
    """Draw one encoder or decoder layer and its residual connections.

    ``blocks`` lists (label, kind, code, inputs) per sub-layer followed by its Add &
    Norm; ``inputs`` is "qkv" (self-attention), "q" (cross-attention: only the query
    comes from below) or "x" (feed-forward). Returns the boxes drawn.
    """
    drawn = []
    prev_top = split_y = None  # split_y: where the last sub-layer's input branched
    for (label, kind, code, inputs), y in zip(blocks, rows):
        size = 9 if len(label) > 22 else 10  # keep the longest label inside its box
        b = box(ax, col_x, y, BOX_W, BOX_H, label, kind, code=code, size=size)
        if kind == "norm":
            arrow(ax, (col_x, drawn[-1].top), (col_x, b.bottom))
            residual(ax, col_x, side, split_y, b)
        else:
            split_y = b.bottom - SPLIT if inputs != "q" else prev_top + 0.13
            if prev_top is not None:
                arrow(ax, (col_x, prev_top), (col_x, split_y), head=False)
            if inputs == "qkv":
                fan_in(ax, split_y, b.bottom, [col_x - 0.6, col_x, col_x + 0.6], col_x)
            elif inputs == "q":
                fan_in(ax, split_y, b.bottom, [col_x + 0.6], col_x)
            else:
                arrow(ax, (col_x, split_y), (col_x, b.bottom))
        drawn.append(b)
        prev_top = b.top
    return drawn


def frame(ax, col_x, bottom, top, side, n_label_code):
    """The grey rounded frame around one layer, with the "N×" label outside it."""
    half = BOX_W / 2 + FRAME_PAD
    ax.add_patch(
        FancyBboxPatch(
            (col_x - half, bottom),
            2 * half,
            top - bottom,
            boxstyle="round,pad=0,rounding_size=0.15",
            facecolor=COLORS["stack"],
            edgecolor=EDGE,
            linewidth=1.1,
            zorder=1,
        )
    )
    x_label = col_x + side * (half + 0.5)
    y_mid = (bottom + top) / 2
    ax.text(x_label, y_mid + 0.12, "N×", ha="center", va="center", fontsize=16)
    code_text(ax, x_label, y_mid - 0.25, n_label_code)
    return half


def embedding_block(ax, col_x, side, y_label, label_text, emb_label, emb_code):
    """Input label → embedding box → ⊕ with the positional-encoding icon beside it."""
    ax.text(col_x, y_label, label_text, ha="center", va="center", fontsize=11)
    emb = box(ax, col_x, 1.3, BOX_W, BOX_H, emb_label, "embed", code=emb_code)
    arrow(ax, (col_x, y_label + 0.17), (col_x, emb.bottom))
    plus = adder(ax, col_x, 2.05)
    arrow(ax, (col_x, emb.top), (col_x, plus.bottom))
    icon = sine_icon(ax, col_x + side * 0.75, plus.y)
    arrow(ax, (icon.x - side * icon.w / 2, icon.y), (col_x + side * plus.w / 2, plus.y))
    text_x = icon.x + side * 0.3
    ha = "right" if side < 0 else "left"
    ax.text(
        text_x,
        plus.y + 0.1,
        "Positional\nEncoding",
        ha=ha,
        va="center",
        fontsize=9.5,
        linespacing=1.0,
    )
    code_text(ax, text_x, plus.y - 0.25, "PositionalEncoding", ha=ha)
    return plus


def draw_figure1(path: Path) -> None:
    """Figure 1 of the paper (§3, the Transformer), written to ``path``."""
    fig, ax = new_axes(8.4, 10)
    ax.set_xlim(-0.25, 8.15)  # room at both sides for the 8.5-pt code names
    enc_x, dec_x = 2.35, 5.65

    # Encoder (left): self-attention, then feed-forward, each with Add & Norm.
    enc_blocks = [
        ("Multi-Head Attention", "attention", "MultiHeadedAttention", "qkv"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Feed Forward", "ffn", "PositionwiseFeedForward", "x"),
        ("Add & Norm", "norm", "SublayerConnection", None),
    ]
    dec_blocks = [
        ("Masked Multi-Head Attention", "attention", "MultiHeadedAttention", "qkv"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Multi-Head Attention", "attention", "MultiHeadedAttention", "q"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Feed Forward", "ffn", "PositionwiseFeedForward", "x"),
        ("Add & Norm", "norm", "SublayerConnection", None),
    ]
    dec_rows = sublayer_rows(3.15, [b[1] for b in dec_blocks])
    dec_rows[2:] = [y + 0.2 for y in dec_rows[2:]]  # room for the encoder output line
    enc_rows = dec_rows[:2] + dec_rows[2:4]

    frame_bottom = 2.5
    enc_top = enc_rows[-1] + BOX_H / 2 + 0.22
    dec_top = dec_rows[-1] + BOX_H / 2 + 0.22
    enc_half = frame(
        ax, enc_x, frame_bottom, enc_top, -1, "N=6 ×\nEncoderLayer\n(Encoder)"
    )
    dec_half = frame(
        ax, dec_x, frame_bottom, dec_top, +1, "N=6 ×\nDecoderLayer\n(Decoder)"
    )

    enc_plus = embedding_block(
        ax, enc_x, -1, 0.45, "Inputs", "Input Embedding", "Embeddings"
    )
    dec_plus = embedding_block(
        ax,
        dec_x,
        +1,
        0.45,
        "Outputs\n(shifted right)",
        "Output Embedding",
        "Embeddings",
    )
    arrow(
        ax, (enc_x, enc_plus.top), (enc_x, enc_rows[0] - BOX_H / 2 - SPLIT), head=False
    )
    arrow(
        ax, (dec_x, dec_plus.top), (dec_x, dec_rows[0] - BOX_H / 2 - SPLIT), head=False
    )

    enc = layer_stack(ax, enc_x, -1, enc_rows, enc_blocks)
    dec = layer_stack(ax, dec_x, +1, dec_rows, dec_blocks)

    # Encoder output ("memory") → keys and values of the decoder's cross-attention.
    cross = dec[2]
    x_mid = (enc_x + enc_half + dec_x - dec_half) / 2
    y_up = enc_top + 0.3
    y_kv = cross.bottom - 0.16
    arrow(
        ax,
        (enc_x, enc[-1].top),
        (enc_x, y_up),
        (x_mid, y_up),
        (x_mid, y_kv),
        (dec_x, y_kv),
        head=False,
    )
    for x in (dec_x - 0.6, dec_x):
        arrow(ax, (x, y_kv), (x, cross.bottom))
    note(
        ax,
        (enc_x + x_mid) / 2,
        y_up + 0.08,
        "encoder output (memory)\n→ keys $K$ and values $V$",
        size=FIG1_SMALL_PT,
        va="bottom",
    )
    code_text(
        ax,
        dec_x - 0.12,
        frame_bottom - 0.13,
        "tgt_mask = subsequent_mask",
        size=FIG1_SMALL_PT,
        ha="right",
    )

    # Output head: Linear → Softmax → probabilities (our Generator, log-softmax).
    lin = box(ax, dec_x, dec_top + 0.5, BOX_W, 0.42, "Linear", "linear")
    soft = box(ax, dec_x, lin.top + 0.42, BOX_W, 0.42, "Softmax", "softmax")
    arrow(ax, (dec_x, dec[-1].top), (dec_x, lin.bottom))
    arrow(ax, (dec_x, lin.top), (dec_x, soft.bottom))
    arrow(ax, (dec_x, soft.top), (dec_x, soft.top + 0.3))
    ax.text(
        dec_x,
        soft.top + 0.37,
        "Output\nProbabilities",
        ha="center",
        va="bottom",
        fontsize=11,
    )
    code_text(
        ax,
        dec_x + BOX_W / 2 + 0.12,
        (lin.y + soft.y) / 2,
        "Generator\n(log-softmax)",
        size=FIG1_SMALL_PT,
        ha="left",
    )

    # Dimensions.
    note(
        ax,
        x_mid,
        1.3,
        "every sub-layer\noutput:\n$d_{\\mathrm{model}} = 512$",
        size=FIG1_SMALL_PT,
    )
    ax.text(
        enc_x,
        9.6,
        "Transformer (post-norm)",
        ha="center",
        va="center",
        fontsize=13,
        weight="bold",
    )
    code_text(ax, enc_x, 9.25, "EncoderDecoder / make_model()", size=FIG1_SMALL_PT)
    note(
        ax,
        enc_x,
        8.6,
        "Add & Norm:  $\\mathrm{LayerNorm}(x + \\mathrm{Sublayer}(x))$\n"
        "$h = 8$ heads,  $d_k = d_v = d_{\\mathrm{model}}/h = 64$\n"
        "$d_{\\mathrm{model}} = 512$,  $d_{ff} = 2048$,  $N = 6$",
        size=9,
        linespacing=1.5,
    )

    save(fig, path, narrow=figure1_stacked())


# Figure 1 for a phone (our addition): one column, the encoder below the decoder, its
# output (the memory) climbing the right-hand side into the decoder's keys and values;
# every text 10 pt in 4 inches, so that it reads at 11 CSS px in a phone's column.
PHONE_W, PHONE_BOX_W, PHONE_PT = 4.0, 2.5, 10


def phone_stack(ax, cx, y0, blocks, memory_x=None):
    """One layer of the phone's Figure 1 from ``y0`` up: each sub-layer and its Add &
    Norm, residual lines on the left; a cross-attention takes its query from below
    (left) and its keys and values from the memory line at ``memory_x``. Returns the
    boxes and the frame's bottom and top."""
    rows = sublayer_rows(y0 + 0.65, [b[1] for b in blocks])
    if memory_x is not None:
        rows[2:] = [y + 0.2 for y in rows[2:]]  # room for the memory line
    bottom, top = y0, rows[-1] + BOX_H / 2 + 0.22
    half = PHONE_BOX_W / 2 + FRAME_PAD
    ax.add_patch(
        FancyBboxPatch(
            (cx - half, bottom),
            2 * half,
            top - bottom,
            boxstyle="round,pad=0,rounding_size=0.15",
            facecolor=COLORS["stack"],
            edgecolor=EDGE,
            linewidth=1.1,
            zorder=1,
        )
    )
    drawn, prev_top, split_y = [], y0 - 0.35, None
    x_res = cx - PHONE_BOX_W / 2 - RES_GAP
    for (label, kind, code, inputs), y in zip(blocks, rows):
        b = box(ax, cx, y, PHONE_BOX_W, BOX_H, label, kind, code=code,
                size=PHONE_PT, code_size=PHONE_PT)  # fmt: skip
        if kind == "norm":
            arrow(ax, (cx, drawn[-1].top), (cx, b.bottom))
            arrow(ax, (cx, split_y), (x_res, split_y), (x_res, b.y), (b.left, b.y))
        else:
            split_y = b.bottom - SPLIT if inputs != "q" else prev_top + 0.13
            arrow(ax, (cx, prev_top), (cx, split_y), head=False)
            if inputs == "qkv":
                fan_in(ax, split_y, b.bottom, [cx - 0.6, cx, cx + 0.6], cx)
            elif inputs == "q":
                fan_in(ax, split_y, b.bottom, [cx - 0.6], cx)
                y_kv = b.bottom - 0.16
                arrow(ax, (memory_x, y_kv), (cx, y_kv), head=False)
                for x in (cx, cx + 0.6):
                    arrow(ax, (x, y_kv), (x, b.bottom))
            else:
                arrow(ax, (cx, split_y), (cx, b.bottom))
        drawn.append(b)
        prev_top = b.top
    return drawn, bottom, top


def phone_embedding(ax, cx, y0, label_text, emb_label, y_label=None):
    """Input label (unless ``y_label`` is None) → embedding → ⊕ with the positional
    encoding's icon on the right, from ``y0`` up; returns the ⊕."""
    emb = box(ax, cx, y0 + 0.85, PHONE_BOX_W, BOX_H, emb_label, "embed",
              code="Embeddings", size=PHONE_PT, code_size=PHONE_PT)  # fmt: skip
    if y_label is not None:
        ax.text(cx, y_label, label_text, ha="center", va="center", fontsize=11)
        arrow(ax, (cx, y_label + 0.17), (cx, emb.bottom))
    plus = adder(ax, cx, emb.top + 0.62)
    arrow(ax, (cx, emb.top), (cx, plus.bottom))
    icon = sine_icon(ax, cx + 0.65, plus.y)
    arrow(ax, (icon.x - icon.w / 2, icon.y), (cx + plus.w / 2, plus.y))
    ax.text(icon.x + 0.26, plus.y, "Positional\nEncoding", ha="left", va="center",
            fontsize=PHONE_PT, linespacing=1.0)  # fmt: skip
    code_text(ax, cx + 0.12, emb.top + 0.2, "PositionalEncoding", ha="left",
              size=PHONE_PT)  # fmt: skip
    return plus, emb


def figure1_stacked():
    """Figure 1 of the paper (§3) for a phone's column: the encoder's layer, then the
    decoder's above it, then the output head; the paper's dimensions at the top."""
    enc_blocks = [
        ("Multi-Head Attention", "attention", "MultiHeadedAttention", "qkv"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Feed Forward", "ffn", "PositionwiseFeedForward", "x"),
        ("Add & Norm", "norm", "SublayerConnection", None),
    ]
    dec_blocks = [
        ("Masked Multi-Head Attention", "attention", "MultiHeadedAttention", "qkv"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Multi-Head Attention", "attention", "MultiHeadedAttention", "q"),
        ("Add & Norm", "norm", "SublayerConnection", None),
        ("Feed Forward", "ffn", "PositionwiseFeedForward", "x"),
        ("Add & Norm", "norm", "SublayerConnection", None),
    ]
    fig, ax = new_axes(PHONE_W, 18)
    cx, memory_x = 1.95, PHONE_W - 0.32

    enc_plus, _ = phone_embedding(ax, cx, 0.2, "Inputs", "Input Embedding", 0.2)
    enc, enc_bottom, enc_top = phone_stack(ax, cx, enc_plus.top + 0.45, enc_blocks)
    arrow(ax, (cx, enc_plus.top), (cx, enc_bottom - 0.35), head=False)
    layer_label(ax, enc_bottom, enc_top, "N = 6 × EncoderLayer (Encoder)")

    dec_y0 = enc_top + 0.55
    ax.text(0.25, dec_y0 + 0.02, "Outputs (shifted right)", ha="left", va="center",
            fontsize=11)  # fmt: skip
    dec_plus, dec_emb = phone_embedding(ax, cx, dec_y0 - 0.05, "", "Output Embedding")
    arrow(ax, (0.95, dec_y0 + 0.17), (0.95, dec_emb.bottom))
    dec, dec_bottom, dec_top = phone_stack(
        ax, cx, dec_plus.top + 0.45, dec_blocks, memory_x=memory_x
    )
    arrow(ax, (cx, dec_plus.top), (cx, dec_bottom - 0.35), head=False)
    layer_label(ax, dec_bottom, dec_top, "N = 6 × DecoderLayer (Decoder)")

    # The memory: from the encoder's last Add & Norm up the right-hand side.
    y_out = enc_top + 0.22
    y_kv = dec[2].bottom - 0.16
    arrow(ax, (cx, enc[-1].top), (cx, y_out), (memory_x, y_out), (memory_x, y_kv),
          head=False)  # fmt: skip
    note(ax, memory_x + 0.15, (y_out + y_kv) / 2,
         "encoder output (memory): keys $K$, values $V$", rotation=90,
         size=PHONE_PT)  # fmt: skip

    lin = box(ax, cx, dec_top + 0.6, PHONE_BOX_W, BOX_H, "Linear", "linear",
              code="Generator", size=PHONE_PT, code_size=PHONE_PT)  # fmt: skip
    soft = box(ax, cx, lin.top + 0.5, PHONE_BOX_W, BOX_H, "Softmax", "softmax",
               code="(log-softmax)", size=PHONE_PT, code_size=PHONE_PT)  # fmt: skip
    arrow(ax, (cx, dec[-1].top), (cx, lin.bottom))
    arrow(ax, (cx, lin.top), (cx, soft.bottom))
    arrow(ax, (cx, soft.top), (cx, soft.top + 0.3))
    ax.text(cx, soft.top + 0.37, "Output Probabilities", ha="center", va="bottom",
            fontsize=11)  # fmt: skip

    top = soft.top + 2.85  # above "Output Probabilities", the title and the notes
    fig.set_size_inches(PHONE_W, top + 0.3)
    ax.set_ylim(0, top + 0.3)
    ax.text(PHONE_W / 2, top, "Transformer (post-norm)", ha="center", va="center",
            fontsize=13, weight="bold")  # fmt: skip
    code_text(ax, PHONE_W / 2, top - 0.3, "EncoderDecoder / make_model()",
              size=PHONE_PT)  # fmt: skip
    note(
        ax,
        PHONE_W / 2,
        top - 1.05,
        "Add & Norm: $\\mathrm{LayerNorm}(x + \\mathrm{Sublayer}(x))$\n"
        "$h = 8$ heads, $d_k = d_v = d_{\\mathrm{model}}/h = 64$\n"
        "$d_{\\mathrm{model}} = 512$ (every sub-layer's output),\n"
        "$d_{ff} = 2048$, $N = 6$",
        size=PHONE_PT,
        linespacing=1.5,
    )
    code_text(ax, PHONE_W / 2, top - 1.85, "decoder: tgt_mask = subsequent_mask",
              size=PHONE_PT)  # fmt: skip
    return fig


def layer_label(ax, bottom, top, code):
    """ "N×" and what repeats, along the left of a layer's frame (the phone's
    Figure 1)."""
    ax.text(0.1, top - 0.3, "N×", rotation=90, ha="center", va="top", fontsize=12)
    code_text(ax, 0.1, top - 0.75, code, rotation=90, va="top", size=PHONE_PT)


# --------------------------------------------------------------------------------------
# Figure 2: scaled dot-product attention and multi-head attention
# --------------------------------------------------------------------------------------


def draw_scaled_dot_product(ax, top: float) -> None:
    """Left panel: Q, K → MatMul → Scale → Mask (opt.) → SoftMax → MatMul with V;
    its title at ``top``."""
    small = FIG2_SMALL_PT
    cx, w, h = 2.2, 1.3, 0.42
    x_q, x_k, x_v = cx - 0.35, cx + 0.35, 3.7
    y_in = 0.35
    mm1 = box(ax, cx, 1.05, w, h, "MatMul", "matmul", size=11)
    scale = box(ax, cx, 1.7, w, h, "Scale", "scale", size=11)
    mask = box(ax, cx, 2.35, w, h, "Mask (opt.)", "mask", size=11)
    soft = box(ax, cx, 3.0, w, h, "SoftMax", "softmax", size=11)
    mm2 = box(
        ax, (cx + x_v) / 2 + 0.05, 3.75, x_v - cx + 0.8, h, "MatMul", "matmul", size=11
    )
    for name, x in (("Q", x_q), ("K", x_k), ("V", x_v)):
        ax.text(x, y_in, name, ha="center", va="center", fontsize=13)
    arrow(ax, (x_q, y_in + 0.15), (x_q, mm1.bottom))
    arrow(ax, (x_k, y_in + 0.15), (x_k, mm1.bottom))
    arrow(ax, (x_v, y_in + 0.15), (x_v, mm2.bottom))
    for lower, upper in ((mm1, scale), (scale, mask), (mask, soft)):
        arrow(ax, (cx, lower.top), (cx, upper.bottom))
    arrow(ax, (cx, soft.top), (cx, mm2.bottom))
    arrow(ax, (mm2.x, mm2.top), (mm2.x, mm2.top + 0.45))

    notes = [
        (mm1, "$QK^T$"),
        (scale, "$\\div\\sqrt{d_k}$"),
        (mask, "masked $\\to -\\infty$"),
        (soft, "over keys"),
    ]
    for b, text in notes:
        note(ax, b.left - 0.12, b.y, text, ha="right", size=small)
    note(
        ax,
        mm2.x + 0.1,
        mm2.top + 0.27,
        "$\\mathrm{softmax}(QK^T/\\sqrt{d_k})\\,V$",
        size=small,
        ha="left",
    )
    ax.text(
        2.45,
        top,
        "Scaled Dot-Product Attention",
        ha="center",
        va="center",
        fontsize=13,
        weight="bold",
    )
    code_text(ax, 2.45, top - 0.33, "attention(query, key, value, mask)", size=small)


def draw_multi_head(ax, x0: float, top: float) -> None:
    """Right panel: V, K, Q → h Linear projections → h × attention → Concat → Linear;
    its title at ``top``."""
    small = FIG2_SMALL_PT
    xs = [x0 + 0.7, x0 + 1.95, x0 + 3.2]
    cx = xs[1]
    y_in = 0.35
    heads = 2  # copies drawn behind each stacked box
    lins = []
    for name, x in zip("VKQ", xs):
        ax.text(x, y_in, name, ha="center", va="center", fontsize=13)
        lin = box(ax, x, 1.2, 0.95, 0.42, "Linear", "linear", stack=heads, size=11)
        arrow(ax, (x, y_in + 0.15), (x, lin.bottom))
        lins.append(lin)
    sdpa = box(
        ax,
        cx,
        2.65,
        3.35,
        0.6,
        "Scaled Dot-Product\nAttention",
        "attention",
        stack=heads,
        size=11,
    )
    for lin in lins:
        arrow(ax, (lin.x, lin.top + 0.07 * heads), (lin.x, sdpa.bottom))
    concat = box(ax, cx, 3.6, 1.4, 0.42, "Concat", "norm", size=11)
    out = box(ax, cx, 4.25, 1.4, 0.42, "Linear", "linear", size=11)
    arrow(ax, (cx, sdpa.top), (cx, concat.bottom))
    arrow(ax, (cx, concat.top), (cx, out.bottom))
    arrow(ax, (cx, out.top), (cx, out.top + 0.3))

    top_right = sdpa.right + 0.07 * heads
    ax.text(
        top_right + 0.12,
        sdpa.y + 0.2,
        "h",
        ha="left",
        va="center",
        fontsize=14,
        style="italic",
    )
    code_text(
        ax, top_right + 0.12, sdpa.y - 0.22, "h = 8\nheads", ha="left", size=small
    )
    ax.text(
        lins[-1].right + 0.25,
        lins[-1].y,
        "h",
        ha="left",
        va="center",
        fontsize=14,
        style="italic",
    )
    y_proj = (lins[0].top + 0.07 * heads + sdpa.bottom) / 2
    note(
        ax,
        (xs[0] + xs[1]) / 2,
        y_proj,
        "$W_i^V, W_i^K, W_i^Q$\n$d_{\\mathrm{model}} \\to d_k$",
        size=small,
        linespacing=1.3,
    )
    code_text(ax, xs[2] + 0.1, y_proj, "w_v, w_k, w_q", ha="left", size=small)
    note(
        ax,
        out.right + 0.12,
        out.y + 0.08,
        "$W^O$: $hd_v \\to d_{\\mathrm{model}}$",
        ha="left",
        size=small,
    )
    code_text(ax, out.right + 0.12, out.y - 0.17, "w_o", ha="left", size=small)
    note(
        ax, concat.right + 0.12, concat.y, "$h \\cdot d_v = 512$", ha="left", size=small
    )
    ax.text(
        cx,
        top,
        "Multi-Head Attention",
        ha="center",
        va="center",
        fontsize=13,
        weight="bold",
    )
    code_text(ax, cx, top - 0.33, "MultiHeadedAttention(h, d_model)", size=small)


def draw_figure2(path: Path) -> None:
    """Figure 2 of the paper (§3.2: scaled dot-product attention, left; multi-head
    attention, right), written to ``path`` with its phone layout (the panels stacked,
    :func:`figure2_stacked`); no text smaller than ``FIG2_SMALL_PT``."""
    width, height = 10, 5.6
    fig, ax = new_axes(width, height)
    top = height - 0.28
    draw_scaled_dot_product(ax, top)
    ax.plot([5.1, 5.1], [0.3, top - 0.55], color="#cccccc", lw=1)
    draw_multi_head(ax, 5.55, top)
    save(fig, path, narrow=figure2_stacked(height, top))


def figure2_stacked(height: float, top: float):
    """Figure 2 for a phone (our addition): scaled dot-product attention above
    multi-head attention, each panel drawn at ``FIG2_NARROW_SCALE`` so that the same
    text is larger beside its boxes."""
    panels = ((-0.05, 5.05), (5.3, 10.4))  # the drawing's x range of each panel
    span = max(b - a for a, b in panels)
    scale = FIG2_NARROW_SCALE
    fig = plt.figure(figsize=(span * scale, 2 * height * scale), facecolor="white")
    for i, (x0, _) in enumerate(panels):
        ax = fig.add_axes([0, 0.5 - 0.5 * i, 1, 0.5])  # the first panel on top
        ax.set_xlim(x0, x0 + span)
        ax.set_ylim(0, height)
        ax.set_aspect("equal")
        ax.axis("off")
        if i == 0:
            draw_scaled_dot_product(ax, top)
        else:
            draw_multi_head(ax, 5.55, top)
    return fig


def main() -> None:
    """Draw both figures into this folder and print their paths."""
    fig1 = OUT_DIR / "figure1_transformer.png"
    fig2 = OUT_DIR / "figure2_attention.png"
    draw_figure1(fig1)
    draw_figure2(fig2)
    print(fig1)
    print(fig2)


if __name__ == "__main__":
    main()

"""The attention figures of Part 4: an overview that fits a page, and one head per kind a reader can read."""

import io

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

import machinery
import the_annotated_transformer as tat

PAGE_COLUMN_PX = (
    736  # the web page's text column (46rem) on a wide screen; the notebook's is wider
)
LEGIBLE_PX = 9.0  # smallest token label height we call legible, in CSS pixels as shown


def saved_size(fig) -> tuple[int, int]:
    """Width and height in pixels of ``fig`` saved as the notebook saves it (PNG, tight bounding box)."""
    from PIL import Image

    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")
    return Image.open(io.BytesIO(png.getvalue())).size


def random_maps(src_len: int, tgt_len: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = tat.make_model(50, 50, tat.MODEL_PRESETS["tiny"]).eval()
    src = torch.randint(4, 50, (src_len,))
    tgt = torch.randint(4, 50, (tgt_len,))
    return machinery.attention_maps(model, src, tgt)


def words(n: int, stem: str) -> list[str]:
    return [f"▁{stem}{i}" if i % 3 else f"{stem}lang{i}" for i in range(n)]


def test_sharpest_head_is_the_one_whose_rows_are_most_concentrated():
    weights = torch.full((3, 4, 5, 6), 1 / 6)  # every head uniform: the highest entropy
    weights[2, 1] = torch.eye(5, 6)  # one head puts all weight on one key per row
    weights[0, 3] = torch.softmax(
        torch.randn(5, 6) * 3, dim=-1
    )  # sharper than uniform, not one-hot
    assert machinery.sharpest_head(weights) == (2, 1)


@pytest.mark.parametrize("src_len, tgt_len", [(8, 10), (30, 34)])
def test_one_head_shows_every_token_legibly_at_page_width(src_len, tgt_len):
    maps = random_maps(src_len, tgt_len)
    src, out = words(src_len, "quelle"), words(tgt_len, "ziel")
    labels = {
        "encoder": (src, src),
        "decoder_self": (out, out),
        "decoder_src": (out, src),
    }
    for kind in machinery.ATTENTION_KINDS:
        layer, head = machinery.sharpest_head(maps[kind])
        rows, cols = labels[kind]
        fig = machinery.draw_attention_head(
            maps[kind][layer, head], rows, cols, f"{kind}, layer {layer + 1}"
        )
        width, _ = saved_size(fig)
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == rows
        assert [t.get_text() for t in ax.get_xticklabels()] == cols
        shown = min(
            1.0, PAGE_COLUMN_PX / width
        )  # the page scales a wider image down to its column
        for label in ax.get_yticklabels() + ax.get_xticklabels():
            assert label.get_fontsize() * fig.dpi / 72 * shown >= LEGIBLE_PX, (
                kind,
                width,
                label.get_fontsize(),
            )
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        y_boxes = [t.get_window_extent(renderer) for t in ax.get_yticklabels()]
        x_boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
        assert all(not a.overlaps(b) for a, b in zip(y_boxes, y_boxes[1:])), (
            "row labels overlap"
        )
        assert all(not a.overlaps(b) for a, b in zip(x_boxes, x_boxes[1:])), (
            "column labels overlap"
        )


def test_overview_shows_every_layer_and_head_and_fits_the_page_unscaled():
    maps = random_maps(7, 9)
    fig = machinery.draw_attention_overview(maps)
    width, _ = saved_size(fig)
    assert width <= PAGE_COLUMN_PX
    images = [ax for ax in fig.axes if ax.images]
    assert len(images) == sum(w.size(0) * w.size(1) for w in maps.values())
    assert all(not ax.get_xticklabels() and not ax.get_yticklabels() for ax in images)

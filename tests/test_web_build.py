"""The parts of the web page's build (web/build.py) that need no browser."""

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


build = load_script(ROOT / "web" / "build.py", "web_page_build")
paper_figures = load_script(ROOT / "figures" / "draw_figures.py", "paper_figures")


@pytest.mark.parametrize("missing", ["node", "npm"])
def test_a_missing_tool_is_named_in_one_line(monkeypatch, tmp_path, missing):
    monkeypatch.setattr(
        shutil, "which", lambda name: None if name == missing else f"/usr/bin/{name}"
    )
    monkeypatch.setattr(build, "KATEX", tmp_path / "katex")  # not installed yet
    with pytest.raises(build.MissingTool) as err:
        build.ensure_katex()
    message = str(err.value)
    assert "\n" not in message and missing in message and "make html" in message


def test_printed_text_is_shown_as_a_terminal_leaves_it():
    bar = "epoch 1:  10%|#         | 1/10\r" + "epoch 1: 100%|##########| 10/10\r\n"
    assert build.tidy_stream("\x1b[32mgreen\x1b[0m\n" + bar + "done\n") == (
        "green\nepoch 1: 100%|##########| 10/10\ndone\n"
    )


def test_figure_alt_text_comes_from_titles_and_labels_else_the_prose_before():
    code = (
        'ax.set_title("Eq. 3")\nax.set_xlabel("the\\nstep")\nax.set_title(f"head {h}")'
    )
    assert build.figure_alt(code, "anything") == "Plot of Eq. 3, against the step."
    both = 'ax.set(xlabel="step", ylabel="learning rate", title="Eq. 3")'
    assert build.figure_alt(both, "") == "Plot of Eq. 3: learning rate against step."
    assert build.figure_alt(
        "display(img)", "First.\n\nThe training `curve` of $N$ steps:"
    ) == ("Figure: The training curve of N steps.")
    prose = (
        "rate is Eq. 3, defined for $step\\_num \\ge 1$. torch.optim.Adam does "
        + "the rest, " * 30
    )
    alt = build.figure_alt("plt.show()", prose)
    assert alt == "Figure: rate is Eq. 3, defined for step_num ≥ 1."
    assert not re.search(r"[\\${}^]", alt)


def test_every_image_output_gets_alt_text_and_its_own_is_kept():
    import nbformat

    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("A plot of the schedule:"),
            nbformat.v4.new_code_cell(
                "plt.show()",
                outputs=[
                    nbformat.v4.new_output("display_data", data={"image/png": "iVBOR"}),
                    nbformat.v4.new_output(
                        "display_data",
                        data={"image/png": "iVBOR"},
                        metadata={"image/png": {"alt": "its own words"}},
                    ),
                ],
            ),
        ]
    )
    outputs = build.with_alt_text(nb).cells[1].outputs
    assert outputs[0].metadata["image/png"]["alt"] == "Figure: A plot of the schedule."
    assert outputs[1].metadata["image/png"]["alt"] == "Its own words."
    assert (
        "metadata" not in nb.cells[1].outputs[0] or not nb.cells[1].outputs[0].metadata
    )  # input untouched


def test_prompts_warnings_and_progress_bars_stay_out_of_the_page():
    import nbformat

    formulas = []
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("Training, with $x^2$:"),
            nbformat.v4.new_code_cell(
                "train()",
                execution_count=7,
                outputs=[
                    nbformat.v4.new_output(
                        "stream", name="stderr", text="UserWarning: something\n"
                    ),
                    nbformat.v4.new_output(
                        "display_data",
                        data={
                            "application/vnd.jupyter.widget-view+json": {
                                "model_id": "abc",
                                "version_major": 2,
                                "version_minor": 0,
                            },
                            "text/plain": "epoch 1:  40%|####      | 4/10",
                        },
                    ),
                    nbformat.v4.new_output(
                        "stream", name="stdout", text="loss 2.5\r\nloss 1.9\n"
                    ),
                    nbformat.v4.new_output(
                        "execute_result", data={"text/plain": "42"}, execution_count=7
                    ),
                ],
            ),
        ]
    )
    html, _ = build.make_exporter(formulas).from_notebook_node(
        nb, resources={"page_css": "", "page_js": ""}
    )
    assert (
        "loss 2.5" in html and "loss 1.9" in html and "42" in html
    )  # printed output and results stay
    for debris in ("Warning", "40%|", "In [7]", "In&nbsp;[7]", "Out[7]", "$x^2$"):
        assert debris not in html, debris
    assert formulas == [{"tex": "x^2", "display": False}]


def headings_of(markdown: str):
    """The h1–h3 headings of Markdown rendered as nbconvert renders it."""
    from bs4 import BeautifulSoup
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    soup = BeautifulSoup(markdown2html_mistune(markdown), "html.parser")
    return soup, soup.find_all(["h1", "h2", "h3"])


def test_heading_ids_are_short_ascii_from_the_notebooks_structure():
    _, headings = headings_of(
        "# The title\n\n## Prelude\n\n# Part 3 — Decoding (§6.1)\n\n"
        "## A first run: greedy decoding\n\n### Incremental decoding with a cache\n\n"
        "# Part 2 — Training\n\n## §5.4 Regularization\n\n### Label smoothing\n\n"
        "### §3.2.1 Scaled Dot-Product Attention\n\n## IWSLT14 German→English: Über\n\n"
        "## Results\n\n## Label smoothing\n\n## Label smoothing"
    )
    ids = build.heading_ids(headings)
    assert [ids[id(h)] for h in headings] == [
        "title", "prelude", "part-3", "part-3-first-run-greedy",
        "part-3-incremental-decoding-cache", "part-2", "s5-4", "s5-4-label-smoothing",
        "s3-2-1", "part-2-iwslt14-german-english", "results", "part-2-label-smoothing",
        "part-2-label-smoothing-2",
    ]  # fmt: skip


def test_mentions_link_to_what_carries_them_and_nothing_else():
    soup, headings = headings_of(
        "# T\n\n# Part 1 — The model (§3)\n\n## §3.2 Attention\n\n"
        "## Table 3 at our scale (§6.2)\n\n"
        "## Learned positions (§3.5, Table 3 row (E))\n\n"
        "Part 1 and §3.2, §6.2, Table 3; but §3.5's heading, §9 and Table 1 are not "
        "here, "
        "and `§3.2` in code stays code."
    )
    ids = build.heading_ids(headings)
    for h in headings:
        h["id"] = ids[id(h)]
    targets = build.mention_targets(soup, headings)
    assert targets == {
        "Part 1": "part-1", "§3": "part-1", "§3.2": "s3-2",
        "Table 3": "part-1-table-3-scale", "§6.2": "part-1-table-3-scale",
        "§3.5": "part-1-learned-positions",
    }  # fmt: skip
    assert build.link_mentions(soup, soup, targets) == 5
    linked = [a.get_text() for a in soup.find_all("a", class_="xref")]
    assert linked == ["Part\u00a01", "§3.2", "§6.2", "Table\u00a03", "§3.5"]
    assert soup.find("code").get_text() == "§3.2"


def test_sentencepiece_markers_in_alt_text_are_joined_into_words():
    alt = (
        "Heat map: rows are the tokens <s> ▁Ein ▁Bo st on ▁T err ier . </s>; "
        "columns are the tokens <s> ▁Ein ▁Bo st on ▁T err ier . </s>"
    )
    assert build.join_pieces(alt) == (
        "Heat map: rows and columns are the tokens Ein Boston Terrier."
    )
    assert build.join_pieces("no pieces here") == "no pieces here"


def test_alt_text_from_a_comment_in_the_markdown_before_wins():
    import nbformat

    def image(**meta):
        return nbformat.v4.new_output(
            "display_data", data={"image/png": "iVBOR"}, metadata={"image/png": meta}
        )

    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell(
                "Two figures.\n<!-- alt: the first -->\n<!-- alt: two -->"
            ),
            nbformat.v4.new_code_cell(
                "ax.set_title('ignored')",
                outputs=[image(alt="its own"), image(), image(alt="its own")],
            ),
        ]
    )
    outputs = build.prepare(nb).cells[1].outputs
    assert [o.metadata["image/png"]["alt"] for o in outputs] == [
        "The first.",
        "Two.",
        "Its own.",
    ]


def png(width: int, height: int, dpi: float | None = None) -> str:
    """A PNG's first bytes, base64, enough for its size (and dpi) to be read."""
    import base64
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    head = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">II", width, height) + b"\x08\x06\x00\x00\x00"
    )
    head += chunk(b"tEXt", b"Software\x00matplotlib")
    if dpi:
        ppm = round(dpi / 0.0254)
        head += chunk(b"pHYs", struct.pack(">IIB", ppm, ppm, 1))
    return base64.b64encode(head + chunk(b"IDAT", b"")).decode()


def test_a_figure_is_shown_at_its_real_size_from_its_stored_dpi():
    def shown(width, height, dpi=None, meta=None):
        output = {
            "data": {"image/png": png(width, height, dpi)},
            "metadata": meta or {},
        }
        return build.display_size(output, "image/png")

    # 10 × 5 inches at 110 or 200 dpi: 960 × 480 CSS px (96 per inch) either way;
    # a 10-pt label is legible (11 px) from 10 in × 72 pt × 1.1 = 792 px on
    assert shown(1100, 550, 110) == (960, 480, 792)
    assert shown(2000, 1000, 200) == (960, 480, 792)
    assert shown(1440, 800, None, {"image/png": {"width": 480}}) == (480, 267, 0)
    assert shown(700, 300) == (700, 300, 0)  # nothing known: a pixel is a CSS pixel
    assert build.png_dpi(png(10, 10, 110)) == pytest.approx(110, abs=0.01)
    assert build.png_dpi(png(10, 10)) is None


def test_a_drawn_figure_records_the_size_of_its_smallest_text(tmp_path):
    fig, ax = paper_figures.new_axes(2, 1)
    ax.text(0.5, 0.5, "label", fontsize=10)
    ax.text(1.5, 0.5, "note", fontsize=6.5)
    ax.text(1.0, 0.8, "", fontsize=4)  # draws nothing
    path = tmp_path / "figure.png"
    paper_figures.save(fig, path)
    assert paper_figures.recorded_smallest_text_pt(path.read_bytes()) == 6.5
    plain = tmp_path / "plain.png"
    fig, _ = paper_figures.new_axes(1, 1)
    fig.savefig(plain)
    assert paper_figures.recorded_smallest_text_pt(plain.read_bytes()) is None


# The columns a figure is shown in (CSS px): at 1280 px beside the contents, and on a
# phone of 390 px (measured in Chromium; tests/test_html.py measures the page itself).
COLUMNS = {1280: 928, 390: 322}
# Every figure the project draws and commits; the page shows each from a notebook cell.
COMMITTED_FIGURES = [
    ROOT / "figures" / "figure1_transformer.png",
    ROOT / "figures" / "figure2_attention.png",
    ROOT / "results" / "table3.png",
    ROOT / "results" / "table3-curves.png",
]


def text_px(png: bytes, column: int) -> float:
    """The CSS px the smallest text of ``png`` is shown at in a ``column`` (shown at
    its real size, never wider than the column), by the build's own reading."""
    data = base64.b64encode(png).decode()
    width, _, _ = build.display_size({"data": {"image/png": data}}, "image/png")
    points = build.png_size(data)[0] * 72 / build.png_dpi(data)
    return build.smallest_text_pt(data) * min(width, column) / points


def test_figure_2s_panels_drawn_again_stacked_read_at_11_px_on_a_phone(tmp_path):
    drawn = tmp_path / "figure2.png"
    paper_figures.draw_figure2(drawn)
    png = drawn.read_bytes()
    narrow = build.narrow_layout(base64.b64encode(png).decode())
    assert narrow, "Figure 2 carries no phone layout"
    narrow = base64.b64decode(narrow)
    assert text_px(png, COLUMNS[1280]) >= build.LEGIBLE_PX
    assert text_px(narrow, COLUMNS[390]) >= build.LEGIBLE_PX
    wide_size, narrow_size = (
        build.png_size(base64.b64encode(png).decode()),
        (build.png_size(base64.b64encode(narrow).decode())),
    )
    assert narrow_size[0] < wide_size[0] / 2 and narrow_size[1] > wide_size[1]
    committed = ROOT / "figures" / "figure2_attention.png"
    assert paper_figures.recorded_smallest_text_pt(
        committed.read_bytes()
    ) == paper_figures.recorded_smallest_text_pt(png)


@pytest.mark.parametrize("path", COMMITTED_FIGURES, ids=lambda p: p.name)
def test_a_committed_figures_smallest_text_reads_at_11_px_where_the_page_shows_it(path):
    png = path.read_bytes()
    data = base64.b64encode(png).decode()
    assert paper_figures.recorded_smallest_text_pt(png), f"{path.name} records none"
    narrow = build.narrow_layout(data)
    on_phone = base64.b64decode(narrow) if narrow else png
    print(
        f"\n{path.name}: {text_px(png, COLUMNS[1280]):.1f} px at 1280, "
        f"{text_px(on_phone, COLUMNS[390]):.1f} px at 390"
        f"{' (its phone layout)' if narrow else ''}"
    )
    assert text_px(png, COLUMNS[1280]) >= build.LEGIBLE_PX
    assert text_px(on_phone, COLUMNS[390]) >= build.LEGIBLE_PX


def test_the_figures_the_notebook_draws_through_the_package_read_at_11_px(tmp_path):
    import json

    import torch
    from machinery import figures

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps({"step": s, "train_loss": 5 - s / 100, "valid_loss": 5 - s / 90})
            for s in range(10, 300, 10)
        )
    )
    curve = figures.plot_curves(metrics, tmp_path / "curve.png").read_bytes()
    torch.manual_seed(0)
    maps = {k: torch.rand(3, 8, 9, 9).softmax(-1) for k in figures.ATTENTION_KINDS}
    overview = figures.figure_png(  # as show_attention displays it
        figures.draw_attention_overview(maps),
        dpi=200,
        narrow=figures.draw_attention_overview(maps, figures.NARROW_WIDTH, True),
        tight=True,
    )
    for png in (curve, overview):
        narrow = figures.narrow_layout(png)
        assert narrow and figures.recorded_smallest_text_pt(narrow) >= 10
        assert text_px(png, COLUMNS[1280]) >= build.LEGIBLE_PX
        assert text_px(narrow, COLUMNS[390]) >= build.LEGIBLE_PX


def test_a_phone_layout_travels_in_its_png_and_the_page_shows_it_on_a_narrow_column():
    import io

    import nbformat
    from machinery import figures
    from PIL import Image

    def drawn(width: float, label_pt: float) -> bytes:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, 2))
        fig.add_subplot().set_title("a title", fontsize=label_pt)
        return figures.png_bytes(fig, dpi=100)

    wide, narrow = drawn(9, 12), drawn(4, 10)
    png = figures.with_narrow_layout(wide, narrow)
    assert Image.open(io.BytesIO(png)).size == (900, 200)  # still the wide picture
    assert figures.narrow_layout(png) == narrow and figures.narrow_layout(wide) is None
    data = base64.b64encode(png).decode()
    assert base64.b64decode(build.narrow_layout(data)) == narrow
    assert build.smallest_text_pt(data) == 12
    torn = png[: len(wide) - 12 + 30] + png[-12:]  # the chunk cut short
    assert build.narrow_layout(base64.b64encode(torn).decode()) is None
    assert build.narrow_layout("not base64!") is None
    cell = nbformat.v4.new_code_cell(
        "plot()",
        outputs=[nbformat.v4.new_output("display_data", data={"image/png": data})],
    )
    nb = build.prepare(nbformat.v4.new_notebook(cells=[cell]))
    meta = nb.cells[0].outputs[0].metadata["image/png"]
    # 9 in × 72 pt at 11 px for 12-pt text: the wide layout needs a 594-px column
    assert meta["least_width"] == 594 and meta["plot_id"] == "plot-1"
    assert (meta["narrow_width"], meta["narrow_height"]) == (384, 192)
    html, _ = build.make_exporter([]).from_notebook_node(nb, resources={})
    figure = html[html.index('<figure class="plot') : html.index("</figure>")]
    # both layouts, the phone's hidden until the figure is narrower than 594 px
    assert (
        "@container (max-width: 593.98px)" in figure
        and "figure.plot.plot-1 img.wide" in figure
    )
    assert figure.count("<img") == 2 and 'class="narrow"' in figure
    assert base64.b64encode(narrow).decode() in figure


def test_text_outputs_lose_moses_escapes():
    assert build.unescape_moses(
        "we &apos;re &quot;here&quot; &amp; &#91;there&#93;"
    ) == ('we \'re "here" & [there]')


def test_a_long_code_cell_folds_after_its_first_lines_and_never_inside_a_string():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    source = 'def f():\n    """Doc\n' + "\n" * 25 + '    end of doc."""\n' + body
    n = build.fold_line(source)
    lines = source.split("\n")
    assert n == 28  # the first line after the docstring (lines 1–27)
    assert build.fold_line("x = 1\n" * 30) is None  # short cells stay whole
    html = build.code_html(source)
    assert html.count('class="highlight"') == 2 and "<details" in html
    assert f"{len(lines) - n} more lines" in html


def test_the_command_line_cell_and_empty_cells_are_left_out():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(""),
        nbformat.v4.new_code_cell(
            'if __name__ == "__main__" and not IN_NOTEBOOK:\n    main()'),
    ])  # fmt: skip
    assert [c.source for c in build.prepare(nb).cells] == ["x = 1"]


def test_attention_maps_become_an_explorer_with_a_static_image():
    import json
    import re

    blob = {
        "sentence": {"src": ["▁Ein", "▁Hund", "</s>"], "tgt": ["<s>", "▁A", "▁dog"]},
        "maps": {
            "cross": [[[[0.2, 0.7, 0.1], [0.9, 0.05, 0.05], [0.3, 0.3, 0.4]]] * 2]
        },
    }
    html = build.attention_explorer(blob)
    data = json.loads(re.search(r'class="ae-data">(.*?)</script>', html).group(1))
    assert data["maps"] == blob["maps"] and data["start"]["kind"] == "cross"
    labels = re.findall(r"<text[^>]*data-(?:row|col)[^>]*>([^<]*)</text>", html)
    assert sorted(labels) == sorted(
        ["Ein", "Hund", "&lt;/s&gt;", "&lt;s&gt;", "A", "dog"]
    )
    assert html.count("data-q=") == 9
    assert build.attention_explorer({"maps": {}}) == ""
    renamed = {
        "sentence": blob["sentence"],
        "maps": {"decoder_src": blob["maps"]["cross"]},
    }
    assert build.attention_explorer(renamed) == html  # the notebook's own names


def css_colours(scheme: str) -> dict:
    """page.css's colour variables for a scheme."""
    import re

    css = (ROOT / "web" / "page.css").read_text()
    light = re.search(r":root \{(.*?)\}", css, re.S).group(1)
    dark = re.search(
        r"prefers-color-scheme: dark\) \{\s*:root \{(.*?)\}", css, re.S
    ).group(1)
    found = dict(re.findall(r"--([\w-]+):\s*(#[0-9a-f]{6})", light))
    if scheme == "dark":
        found.update(re.findall(r"--([\w-]+):\s*(#[0-9a-f]{6})", dark))
    return found


def contrast(a: str, b: str) -> float:
    def lum(colour):
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        rgb = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_code_colour_is_at_least_4_5_to_1_on_the_code_background(scheme):
    colours = css_colours(scheme)
    roles = [k for k in colours if k.startswith("code-") and k != "code-bg"]
    assert len(roles) >= 8
    low = {r: round(contrast(colours[r], colours["code-bg"]), 2) for r in roles}
    assert {r: c for r, c in low.items() if c < 4.5} == {}
    for role in ("function", "comment", "number", "string", "keyword"):
        assert f"var(--code-{role})" in build.code_css()


def test_the_repository_and_colab_links_come_from_citation_cff_or_are_absent(tmp_path):
    where = build.project()
    about = build.about_page(ROOT / "results")
    assert about["url"] == where.project_url()  # CITATION.cff's repository-code
    assert about["colab"] == (where.colab_url(about["url"]) if about["url"] else "")
    cff = tmp_path / "CITATION.cff"
    cff.write_text("cff-version: 1.2.0\nrepository-code: https://github.com/o/n\n")
    assert where.colab_url(where.project_url(cff)) == (
        "https://colab.research.google.com/github/o/n/blob/main/"
        "annotated_transformer.ipynb"
    )


def test_this_reproductions_bibtex_comes_from_citation_cff():
    cff = build.citation()
    assert cff.get("title")
    entry = build.bibtex_of(cff, "")
    assert entry.startswith("@software{") and entry.endswith("}")
    assert "{" + cff["title"] + "}" in entry and "url" not in entry
    assert "url    = {https://example.org/x}" in build.bibtex_of(
        {"title": "T", "authors": [{"family-names": "Doe", "given-names": "J."}]},
        "https://example.org/x",
    )
    assert entry.count("{") == entry.count("}")


def test_the_build_stamp_names_the_date_and_the_commit(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    stamp = build.build_stamp()
    assert stamp.startswith("Built on 2023-11-14 (UTC)")
    if (ROOT / ".git").exists():
        assert re.search(r"from commit [0-9a-f]{7,}\.$", stamp)


def test_the_readme_opens_with_the_findings_read_from_results():
    readme = (ROOT / "README.md").read_text()
    block = readme.split(build.FINDINGS_START)[1].split(build.FINDINGS_END)[0]
    assert build.FINDINGS_START + block + build.FINDINGS_END == build.readme_findings()
    assert readme.index(build.FINDINGS_START) < readme.index("## ")  # at the top
    text = " ".join(block.split())
    run = json.loads((ROOT / "results" / build.HEADLINE).read_text())
    sample = json.loads((ROOT / "results" / build.SAMPLE).read_text())
    for number in (
        f"{run['bleu']:.1f} BLEU",
        f"{run['train_minutes']:.1f} minutes",
        f"{run['steps']:,} updates",
        f"{sample['bleu']:.1f} BLEU",
        f"{sample['steps']:,} updates",
    ):
        assert number in text, number
    state = build.table3_state(build.read_json(ROOT / "results" / build.TABLE3))
    assert ("being measured" in text) == (state["finished"] != list("ABCDE"))


def summary_row(variation, group, seeds, bleu=None, ppl=None):
    """A summary entry as the driver writes it: its seeds and, per measure, the
    category its verdict is counted in."""
    row = {"variation": variation, "group": group, "seeds": seeds}
    return row | ({"counted": {"bleu": bleu, "ppl": ppl or bleu}} if bleu else {})


def test_the_table_3_finding_counts_finished_row_groups_only(tmp_path):
    table = tmp_path / build.TABLE3
    links = {"results": "#r", "table3": "#t"}
    table.write_text("{not json")  # torn: the finding says so
    assert "results/table3.json` is missing" in build.findings(tmp_path, links)[-1]
    table.write_text('{"budget": {"epochs": 15}, "summary": []}')  # nothing yet
    assert "is being measured" in build.findings(tmp_path, links)[-1]
    plan = [{"variation": v, "group": v[0], "seeds": [1, 2]} for v in
            ("A-h1", "A-h4", "B-dk8", "C-N2")]  # fmt: skip
    data = {
        "budget": {"epochs": 15},
        "rows": [],
        "plan": [{"variation": "base", "group": "base", "seeds": [1, 2, 3]}] + plan,
        "summary": [
            summary_row("base", "base", [1, 2, 3]),
            summary_row("A-h1", "A", [1, 2], "agrees", "disagrees"),
            summary_row("A-h4", "A", [1, 2], "no difference detected"),
            summary_row("B-dk8", "B", [1], "agrees"),  # one seed of two: not finished
        ],
    }
    table.write_text(json.dumps(data))
    assert build.table3_state(data)["finished"] == ["A"]
    last = build.findings(tmp_path, links)[-1]
    assert last.startswith(
        "[Table 3](#t) at our scale (15 epochs, 2 trained seeds a variation), rows "
        "(A), by a seed-paired t-test with Holm's correction"
    )
    assert (
        "of 2 variations of the paper, by validation BLEU 1 agrees, 0 disagree, 1 "
        "shows no difference the test can detect and 0 are not counted; by "
        "validation perplexity 0, 1, 1 and 0 (not counted: a seed still learning"
        in last
    )
    assert "rows (B), (C), (D), (E) are being measured" in last
    data["summary"] += [
        summary_row("C-N2", "C", [1, 2], "not counted") | {"failed_seeds": [1]},
        summary_row("C-d128-lr", "C", [1]) | {"control": True},  # not planned here
    ]
    assert build.table3_state(data)["finished"] == ["A", "C"]
    table.write_text(json.dumps(data))
    last = build.findings(tmp_path, links)[-1]
    assert "(15 epochs, 1–2 trained seeds a variation)" in last  # C-N2's failed
    assert "and 1 is not counted; by validation perplexity" in last
    assert "of 3 variations of the paper" in last  # the control is not counted
    data["summary"][0] |= {"seeds": [1, 2]}  # the base needs three
    table.write_text(json.dumps(data))
    assert build.table3_state(data)["finished"] == []
    assert "is being measured" in build.findings(tmp_path, links)[-1]


def test_the_pages_own_files_fit_88_columns():
    files = [
        "page.js",
        "page.css",
        "render_math.js",
        "article/index.html.j2",
        "package.json",
    ]
    long = [
        f"{name}:{n}"
        for name in files
        for n, line in enumerate((ROOT / "web" / name).read_text().splitlines(), 1)
        if len(line) > 88
    ]
    assert long == []


def test_skip_to_a_sections_name_links_it():
    soup, headings = headings_of(
        "# T\n\n# Part 1 — The model\n\n## Results at a glance\n\n"
        "On a first reading, skip to the results at a glance. Or skip to nowhere."
    )
    ids = build.heading_ids(headings)
    for h in headings:
        h["id"] = ids[id(h)]
    assert build.link_skip_to(soup, soup, headings) == 1
    link = soup.find("a", class_="xref")
    assert (
        link.get_text() == "results at a glance" and link["href"] == "#results-glance"
    )


def test_plumbing_folds_by_what_it_is_and_the_papers_code_stays():
    source = (
        "import sys\n\n"
        'if __name__ == "__main__" and "ipykernel" not in sys.modules:\n'
        "    import signal\n\n"
        "    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))\n\n"
        "def f(x):\n    return x\n\n"
        "# a picture of f\n@example\ndef _():\n    plot(f)\n"
    )
    lines = source.split("\n")
    folds = build.code_folds(source)
    first = [next(x for x in lines[a:] if x.strip()) for a, _, _ in folds]
    assert [(why, line) for (_, _, why), line in zip(folds, first)] == [
        ("signal", lines[2]),
        ("example", "# a picture of f"),
    ]
    shown = [x for a, b, _ in folds for x in lines[a:b]]
    assert shown[0] == "" and "def f(x):" not in shown  # blank lines go with a fold
    assert build.code_folds("if IN_NOTEBOOK:\n    run()\n") == [(0, 3, "notebook")]
    assert build.code_folds("x = 1\nprint(x)", tabular=True) == [(0, 2, "table")]
    assert build.code_folds("def f():\n    pass") == []
    html = build.code_html(source)
    assert html.count('class="code-fold"') == 2
    pres = re.findall(r"<pre>(.*?)</pre>", html, re.S)
    text = "".join(re.sub(r"<[^>]+>", "", p) for p in pres)
    import html as htmllib

    assert htmllib.unescape(text).replace("\n", "") == source.replace("\n", "")


def test_html_and_markdown_outputs_are_sanitised_and_tables_recognised():
    dirty = (
        '<table onclick="x()"><tr><td style="text-align: right; background: '
        'url(http://x/y.png)">1</td></tr></table><script>alert(1)</script>'
        '<a href="javascript:alert(1)">a</a><img src="http://x/y.png">'
        '<iframe src="https://x"></iframe><style>p{}</style>'
    )
    clean = build.sanitize_html(dirty)
    for gone in (
        "onclick",
        "<script",
        "javascript:",
        "http:",
        "<iframe",
        "<img",
        "<style",
    ):
        assert gone not in clean, gone
    assert '<td style="text-align:right">1</td>' in clean  # the alignment alone
    table = {"data": {"text/markdown": "| a | b |\n|---|--:|\n| 1 | 2 |"}}
    assert build.is_tabular(table)
    assert build.is_tabular({"data": {"text/html": "<TABLE></TABLE>"}})
    assert not build.is_tabular({"data": {"text/markdown": "a --- b"}})


def test_the_readmes_results_table_is_the_recorded_runs():
    """Each row of the README's Results table gives its run's summary in ``results/``:
    BLEU beam and greedy to two places, training minutes to one, its precision, and
    the machine the summary names (or, for a summary from before runs named it, the
    machine ``results/README.md``'s row of that run names)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Results\n")[1].split("\n## ")[0]
    for preset, name in (
        ("multi30k-small", build.HEADLINE),
        ("iwslt14-sample", build.SAMPLE),
    ):
        run = json.loads((ROOT / "results" / name).read_text())
        row = next(r for r in section.splitlines() if f"| `{preset}` |" in r)
        assert f"{run['bleu']:.2f} / {run['bleu_greedy']:.2f}" in row, row
        assert row.rstrip().endswith(f"| {run['train_minutes']:.1f} |"), row
        assert f", {run['precision']} |" in row, row
        if machine := run.get("machine") or run.get("cpu"):  # "AMD EPYC (cpu …"
            assert machine.split(" (")[0] in row, row
        else:  # a summary from before runs named their CPU: the history's row names it
            history = (ROOT / "results" / "README.md").read_text().splitlines()
            past = [
                r
                for r in history
                if f"`{preset}`" in r and f"{run['train_minutes']:.1f} training" in r
            ]
            assert len(past) == 1, f"{preset}: {len(past)} history rows of this run"
            machine = row.split(" | ")[2].split(",")[0].removeprefix("2-core ")
            assert machine in past[0].split(" | ")[1], (row, past[0])


def test_the_readme_says_how_the_reported_runs_chose_precision_and_attention():
    """The README's Presets: `multi30k-small` under Results was given bf16 and the
    readable path; `iwslt14-sample`'s run measured both choices, and the README gives
    the ratios its summary records (its history row says so too)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "as `multi30k-small` under Results was (bf16, readable)" in readme
    headline = json.loads((ROOT / "results" / build.HEADLINE).read_text())
    assert headline["auto"] == {"precision": "asked for", "attention": "asked for"}
    assert (headline["precision"], headline["config"]["attention"]) == (
        "bf16",
        "readable",
    )
    sample = json.loads((ROOT / "results" / build.SAMPLE).read_text())
    said = readme.split("`iwslt14-sample`'s run measured ")[1]
    ratios = [c.split(" measured ")[1].split("×")[0] for c in sample["auto"].values()]
    assert said.startswith(
        f"bf16 at {ratios[0]}× and the fused path at {ratios[1]}×, so took "
        f"{sample['precision']} and the {sample['attention']} path."
    )
    history = (ROOT / "results" / "README.md").read_text().splitlines()
    (row,) = [r for r in history if f"{sample['train_minutes']:.1f} training" in r]
    assert "`iwslt14-sample`" in row and f"bf16 (auto: {ratios[0]}×" in row


def test_every_file_a_result_names_is_in_the_repository():
    """A run summary in ``results/`` that names its curve names a file that exists."""
    named = {
        f.name: json.loads(f.read_text()).get("curve")
        for f in (ROOT / "results").glob("*.json")
    }
    named = {k: v for k, v in named.items() if isinstance(v, str)}
    assert named, "no summary names its curve"
    missing = {  # under results/: a run directory is not in a clone
        k: v
        for k, v in named.items()
        if not (v.startswith("results/") and (ROOT / v).is_file())
    }
    assert not missing, missing


@pytest.mark.parametrize(
    "notebook, said",
    [
        (None, "no notebook at"),
        ('{"cells": [{"cell_type": "markdown", "sour', "not a readable notebook"),
        ('{"cells": 3}', "not a readable notebook"),
    ],
)
def test_a_missing_or_torn_notebook_is_one_line(tmp_path, capsys, notebook, said):
    path = tmp_path / "torn.ipynb"
    if notebook is not None:
        path.write_text(notebook)
    assert build.main(["--notebook", str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("width", ["wide", "nan", -3, True, None])
def test_an_image_width_that_is_not_a_number_is_one_line(width):
    output = {
        "output_type": "display_data",
        "data": {"image/png": png(40, 20)},
        "metadata": {"image/png": {"width": width}},
    }
    if width is None:  # no width: the picture's own size
        assert build.display_size(output, "image/png")[:2] == (40, 20)
        return
    with pytest.raises(build.BadInput, match="width") as err:
        build.display_size(output, "image/png")
    assert "\n" not in str(err.value)


def test_the_headline_states_its_spread_once_other_seeds_are_in(tmp_path):
    shutil.copy(ROOT / "results" / build.HEADLINE, tmp_path / build.HEADLINE)
    headline = build.findings(tmp_path, build.README_LINKS)[0]
    rows = [
        {
            "seed": 1,
            "bleu": 41.79,
            "recorded": "results/multi30k-small.json",
            "precision": "bf16",
            "attention": "readable",
        },  # fmt: skip
        {"seed": 2, "bleu": 40.9, "precision": "bf16", "attention": "fast"},
        {
            "seed": 3,
            "bleu": 41.3,
            "precision": "fp32",
            "attention": "readable",
            "threads": 1,
        },
    ]  # a row recorded before threads were kept (seed 2's) names none
    stats = {"n": 3, "mean": 41.33, "sd": 0.445, "min": 40.9, "max": 41.79}
    seeds = tmp_path / build.SEEDS
    one = {"config": "multi30k-small", "rows": rows[:1], "bleu": {**stats, "n": 1}}
    seeds.write_text(json.dumps(one))
    assert build.findings(tmp_path, build.README_LINKS)[0] == headline  # one seed
    seeds.write_text(
        json.dumps({"config": "multi30k-small", "rows": rows, "bleu": stats})
    )
    said = build.findings(tmp_path, build.README_LINKS)[0]
    assert said.startswith(headline) and said != headline
    assert said.endswith(
        "Other seeds as `make train` ran them: 40.9 (seed 2: bf16, fast attention), "
        "41.3 (seed 3: float32, readable attention, 1 thread); seed 1 ran bf16, "
        "readable attention. Over 3 seeds, 41.3 ± 0.4 (mean ± sample sd, 40.9–41.8)."
    )
    two = {"n": 2, "mean": 41.35, "sd": 0.629, "min": 40.9, "max": 41.79}
    seeds.write_text(  # one other seed so far
        json.dumps({"config": "multi30k-small", "rows": rows[:2], "bleu": two})
    )
    said = build.findings(tmp_path, build.README_LINKS)[0]
    assert said.endswith(
        "Other seeds as `make train` ran them: 40.9 (seed 2: bf16, fast attention); "
        "seed 1 ran bf16, readable attention. Over 2 seeds, 41.4 ± 0.6 (mean ± "
        "sample sd, 40.9–41.8)."
    )
    for torn in ({"bleu": {**stats, "sd": None}}, {"config": "copy"}):
        seeds.write_text(json.dumps({"config": "multi30k-small", "rows": rows, **torn}))
        assert build.findings(tmp_path, build.README_LINKS)[0] == headline
    rows[2]["other_settings"] = {"batch_tokens": [2000, 2500]}  # not a seed apart
    seeds.write_text(
        json.dumps({"config": "multi30k-small", "rows": rows, "bleu": stats})
    )
    assert build.findings(tmp_path, build.README_LINKS)[0] == headline
    rows[2] = {**rows[2], "other_settings": {}, "precision": "<b>x</b>"}
    seeds.write_text(
        json.dumps({"config": "multi30k-small", "rows": rows, "bleu": stats})
    )
    assert (
        "(seed 3: \\<b\\>x\\</b\\>, readable attention, 1 thread)"
        in build.findings(tmp_path, build.README_LINKS)[0]
    )
    for odd in ("<b>2</b>", 2.5, 0, True):  # not a count of threads: not shown
        rows[2] = {**rows[2], "precision": "fp32", "threads": odd}
        seeds.write_text(
            json.dumps({"config": "multi30k-small", "rows": rows, "bleu": stats})
        )
        said = build.findings(tmp_path, build.README_LINKS)[0]
        assert "(seed 3: float32, readable attention)" in said, odd


def test_findings_from_torn_or_nan_results_say_what_is_missing(tmp_path):
    (tmp_path / build.HEADLINE).write_text('{"bleu": NaN, "steps": "many"}')
    (tmp_path / build.SAMPLE).write_text('{"bleu": 9.1, "train_minu')
    said = build.findings(tmp_path, build.README_LINKS)
    assert len(said) == 3
    assert "`bleu`" in said[0] and "`steps`" in said[0] and build.HEADLINE in said[0]
    assert build.SAMPLE in said[1] and build.TABLE3 in said[2]
    assert not any("nan" in s.lower() for s in said)


def test_text_from_results_is_shown_as_text_and_links_nothing(tmp_path):
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    run = json.loads((ROOT / "results" / build.HEADLINE).read_text())
    run["cpu"] = "[AMD](javascript:alert(1)) <b>EPYC</b> `x` *y* 2 cores"
    run["bleu_kind"] = "<img src=x onerror=alert(1)>"
    (tmp_path / build.HEADLINE).write_text(json.dumps(run))
    sentence = build.findings(tmp_path, build.README_LINKS)[0]
    html = markdown2html_mistune(sentence)
    assert "javascript" not in re.findall(r'href="([^"]*)"', html)[0:1][0]
    assert html.count("<a ") == 1  # Results alone
    assert "<b>" not in html and "<img" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "[AMD](javascript:alert(1))" in html  # the text, as it was


@pytest.mark.parametrize(
    "value, url",
    [
        ("https://github.com/o/n", "https://github.com/o/n"),
        ('"javascript:alert(1)//https://x"', ""),
        ("data:text/html,x", ""),
        ("http://github.com/o/n", ""),
        ("not a url at all", ""),
        ('"https://github.com/o/n\\"onmouseover=x"', ""),
        ("https://", ""),
        ("[https://x]", ""),
    ],
)
def test_the_repository_address_is_used_only_as_https(tmp_path, value, url):
    cff = tmp_path / "CITATION.cff"
    cff.write_text(f"cff-version: 1.2.0\ntitle: T\nrepository-code: {value}\n")
    about = build.about_page(ROOT / "results", cff)
    assert about["url"] == url
    assert (about["colab"] != "") == (url != "")
    assert (url in about["bibtex"]) if url else ("url" not in about["bibtex"])


def test_json_in_a_script_element_cannot_end_or_confuse_it():
    data = {"t": ["<!--<script>", "</script><b>", "a&b", "\u2028"]}
    text = build.script_json(data)
    assert not re.search(r"<|>|&|\u2028", text)
    assert json.loads(text) == data


def test_two_folds_in_a_row_share_no_line():
    source = (
        "x = 1\n\nif IN_NOTEBOOK:\n    show()\n\n\n@example\ndef _():\n    pass\n\n"
        "y = 2"
    )
    folds = build.code_folds(source)
    assert [why for *_, why in folds] == ["notebook", "example"]
    assert all(a[1] <= b[0] for a, b in zip(folds, folds[1:]))
    from bs4 import BeautifulSoup

    pres = BeautifulSoup(build.code_html(source), "html.parser")("pre")
    # each <pre> holds its lines and one "\n" more (page.js's copy joins them so)
    assert "\n".join(p.get_text().removesuffix("\n") for p in pres) == source

"""The parts of the web page's build (web/build.py) that need no browser."""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_build():
    """web/build.py as a module (under a name no installed package uses)."""
    spec = importlib.util.spec_from_file_location("web_page_build", ROOT / "web" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()


@pytest.mark.parametrize("missing", ["node", "npm"])
def test_a_missing_tool_is_named_in_one_line(monkeypatch, tmp_path, missing):
    monkeypatch.setattr(shutil, "which", lambda name: None if name == missing else f"/usr/bin/{name}")
    monkeypatch.setattr(build, "KATEX", tmp_path / "katex")  # not installed yet
    with pytest.raises(build.MissingTool) as err:
        build.ensure_katex()
    message = str(err.value)
    assert "\n" not in message and missing in message and "make html" in message


def test_printed_text_is_shown_as_a_terminal_leaves_it():
    bar = "epoch 1:  10%|#         | 1/10\r" + "epoch 1: 100%|##########| 10/10\r\n"
    assert build.tidy_stream("\x1b[32mgreen\x1b[0m\n" + bar + "done\n") == (
        "green\nepoch 1: 100%|##########| 10/10\ndone\n")


def test_figure_alt_text_comes_from_titles_and_labels_else_the_prose_before():
    code = 'ax.set_title("Eq. 3")\nax.set_xlabel("the\\nstep")\nax.set_title(f"head {h}")'
    assert build.figure_alt(code, "anything") == "Plot: Eq. 3; x axis: the step"
    assert build.figure_alt("display(img)", "First.\n\nThe training `curve` of $N$ steps:") == (
        "Figure: The training curve of N steps:")


def test_every_image_output_gets_alt_text_and_its_own_is_kept():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("A plot of the schedule:"),
        nbformat.v4.new_code_cell("plt.show()", outputs=[
            nbformat.v4.new_output("display_data", data={"image/png": "iVBOR"}),
            nbformat.v4.new_output("display_data", data={"image/png": "iVBOR"},
                                   metadata={"image/png": {"alt": "its own words"}})])])
    outputs = build.with_alt_text(nb).cells[1].outputs
    assert outputs[0].metadata["image/png"]["alt"] == "Figure: A plot of the schedule:"
    assert outputs[1].metadata["image/png"]["alt"] == "its own words"
    assert "metadata" not in nb.cells[1].outputs[0] or not nb.cells[1].outputs[0].metadata  # input untouched


def test_prompts_warnings_and_progress_bars_stay_out_of_the_page():
    import nbformat

    formulas = []
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Training, with $x^2$:"),
        nbformat.v4.new_code_cell("train()", execution_count=7, outputs=[
            nbformat.v4.new_output("stream", name="stderr", text="UserWarning: something\n"),
            nbformat.v4.new_output("display_data", data={
                "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0},
                "text/plain": "epoch 1:  40%|####      | 4/10"}),
            nbformat.v4.new_output("stream", name="stdout", text="loss 2.5\r\nloss 1.9\n"),
            nbformat.v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=7)])])
    html, _ = build.make_exporter(formulas).from_notebook_node(nb, resources={"page_css": "", "page_js": ""})
    assert "loss 2.5" in html and "loss 1.9" in html and "42" in html  # printed output and results stay
    for debris in ("Warning", "40%|", "In [7]", "In&nbsp;[7]", "Out[7]", "$x^2$"):
        assert debris not in html, debris
    assert formulas == [{"tex": "x^2", "display": False}]

"""The notebook and the module: in sync, read top to bottom, quoting the paper exactly, quiet on import, executable."""

import ast
import json
import os
import re
import subprocess
import symtable
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from conftest import GAP, PAPER, inline_quotes, not_the_papers, squash

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / "the_annotated_transformer.py"
NB = ROOT / "annotated_transformer.ipynb"


def cells(path):
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


def test_notebook_and_module_have_the_same_cells():
    assert cells(PY) == cells(NB), "run `make sync`"


def test_no_code_cell_is_longer_than_60_lines_and_each_follows_prose():
    nb = jupytext.read(PY)
    long = [
        (i, len(c.source.splitlines()))
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and len(c.source.splitlines()) > 60
    ]
    assert not long, f"code cells over 60 lines (index, lines): {long}"
    bare = [
        i
        for i, (a, b) in enumerate(zip(nb.cells, nb.cells[1:]), start=1)
        if a.cell_type == "code" and b.cell_type == "code"
    ]
    assert not bare, f"code cells with no prose before them: {bare}"


def globals_read_and_bound(source: str) -> tuple[set, set]:
    """(module-level names a cell reads — in its own code or inside its functions and classes —,
    module-level names it binds)."""
    top = symtable.symtable(source, "cell", "exec")
    bound = {
        s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
    }
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    tables = list(top.get_children())
    while tables:
        t = tables.pop()
        read |= {
            s.get_name() for s in t.get_symbols() if s.is_global() and s.is_referenced()
        }
        tables += t.get_children()
    return read, bound


def later_names(sources: list[str]) -> list[tuple[int, str, int]]:
    """(cell, name, cell that first binds it) for every name a cell reads before any cell has bound it."""
    first = {}
    scanned = [globals_read_and_bound(src) for src in sources]
    for i, (_, bound) in enumerate(scanned):
        for name in bound:
            first.setdefault(name, i)
    return sorted(
        (i, name, first[name])
        for i, (read, _) in enumerate(scanned)
        for name in read
        if first.get(name, -1) > i
    )


def test_the_forward_reference_check_catches_a_name_used_before_its_cell():
    cells_ = [
        "def f():\n    return helper(1)\n",
        "def helper(x):\n    return x\n",
        "y = f()\n",
    ]
    assert later_names(cells_) == [(0, "helper", 1)]
    # locals, parameters and names of the same cell are not forward references
    assert later_names(["def g(helper):\n    return helper\n", "helper = 1\n"]) == []
    assert later_names(["class A:\n    b: 'B' = None\n\nclass B(A):\n    pass\n"]) == []


def test_every_cell_uses_only_names_defined_in_it_or_above():
    sources = [c.source for c in jupytext.read(PY).cells if c.cell_type == "code"]
    late = later_names(sources)
    assert not late, (
        "names used before the cell that defines them (cell, name, defined in cell): "
        + str(late)
    )


def test_jupytext_pairs_the_two_files():
    meta = jupytext.read(PY).metadata["jupytext"]
    assert meta["formats"] == "ipynb,the_/py:percent"


def quote_pieces(markdown: str):
    """Runs of quoted text: paragraphs and bullets of '>' blocks, split at the elision mark […]."""
    pieces, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith(">"):
            body = line[1:].strip()
            if body.startswith("* ") or not body:
                if current:
                    pieces.append(" ".join(current))
                current = [body[2:]] if body.startswith("* ") else []
            else:
                current.append(body)
        elif current:
            pieces.append(" ".join(current))
            current = []
    return [p.strip() for piece in pieces for p in piece.split("[…]") if p.strip()]


def quote_blocks(markdown: str) -> list[list[str]]:
    """Each block quote of a Markdown cell (a run of '>' lines; a line without '>'
    ends it) as its text pieces in order: paragraphs and bullets, with the elision
    mark ``[…]`` kept as a piece of its own."""
    blocks, block, current = [], [], []

    def close_paragraph():
        if current:
            text = " ".join(current)
            parts = [t.strip() for t in re.split(r"(\[…\])", text)]
            block.extend(t for t in parts if t)
            current.clear()

    for line in markdown.splitlines() + [""]:
        if line.startswith(">"):
            body = line[1:].strip()
            if body.startswith("* ") or not body:
                close_paragraph()
                if body:
                    current.append(body[2:])
            else:
                current.append(body)
        else:
            close_paragraph()
            if block:
                blocks.append(list(block))
                block.clear()
    return blocks


def paper_edges(paper: str) -> tuple[str, set, set]:
    """(the paper's text without whitespace, where its paragraphs and bullets start,
    where they end), positions in that text."""
    squashed, starts, ends = "", set(), set()
    for line in paper.splitlines():
        body = squash(line)
        if not body:
            continue
        starts.add(len(squashed))
        if body.startswith("*"):
            starts.add(len(squashed) + 1)
        squashed += body
        ends.add(len(squashed))
    return squashed, starts, ends


def silent_gaps(block: list[str], paper: str) -> list[str]:
    """What a block quote leaves out without saying so: a piece that is not the
    paper's text, or that starts or ends inside a paragraph of the paper without a
    ``[…]`` there and without the next piece following on directly."""
    text, starts, ends = paper_edges(paper)
    problems, at = [], 0
    pieces = [p for p in block if p != GAP]
    for i, piece in enumerate(block):
        if piece == GAP:
            continue
        found = text.find(squash(piece), at)
        if found < 0:
            found = text.find(squash(piece))
        if found < 0:
            problems.append(f"not the paper's words: {piece[:70]}")
            continue
        end = found + len(squash(piece))
        gap_before = i > 0 and block[i - 1] == GAP
        gap_after = i + 1 < len(block) and block[i + 1] == GAP
        follows = i > 0 and not gap_before and found == at
        if not (gap_before or follows or found in starts):
            problems.append(f"starts inside a paragraph, no {GAP}: {piece[:70]}")
        nxt = pieces.index(piece) + 1 if piece in pieces else len(pieces)
        leads_on = nxt < len(pieces) and text.find(squash(pieces[nxt]), end) == end
        if not (gap_after or leads_on or end in ends):
            problems.append(f"stops inside a paragraph, no {GAP}: …{piece[-70:]}")
        at = end
    return problems


def test_the_gap_check_catches_a_silent_omission():
    paper = "One two three. Four five six.\n\nSeven eight.\n"
    assert silent_gaps(["One two three. Four five six."], paper) == []
    assert silent_gaps(["One two three.", GAP], paper) == []
    assert silent_gaps(["One two three.", GAP, "Seven eight."], paper) == []
    assert silent_gaps(["One two three. Four five six.", "Seven eight."], paper) == []
    # a sentence dropped at the end, in the middle, or at the start, unmarked
    assert silent_gaps(["One two three."], paper)
    assert silent_gaps(["One two three.", "Seven eight."], paper)
    assert silent_gaps(["Four five six."], paper)
    assert silent_gaps(["Eight nine."], paper)  # not the paper's words
    md = "> One two three.\n> Four five six.\n>\n> Seven eight.\n\n— §1"
    assert quote_blocks(md) == [["One two three. Four five six.", "Seven eight."]]


@pytest.mark.skipif(
    not PAPER.is_file(), reason="paper excerpts not beside the repository"
)
def test_every_block_quote_marks_each_omission():
    paper = PAPER.read_text(encoding="utf-8")
    md = [c for t, c in cells(PY) if t == "markdown"]
    problems = [
        g for cell in md for b in quote_blocks(cell) for g in silent_gaps(b, paper)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(
    not PAPER.is_file(), reason="paper excerpts not beside the repository"
)
def test_every_quote_is_the_papers_exact_wording():
    paper = squash(PAPER.read_text(encoding="utf-8"))
    md = [c for t, c in cells(PY) if t == "markdown"]
    pieces = [p for cell in md for p in quote_pieces(cell)]
    assert len(pieces) > 30
    wrong = [p for p in pieces if squash(p) not in paper]
    assert not wrong, "not in the paper word for word:\n" + "\n---\n".join(wrong)


@pytest.mark.skipif(
    not PAPER.is_file(), reason="paper excerpts not beside the repository"
)
def test_every_inline_quote_is_the_papers_exact_wording():
    md = "\n".join(c for t, c in cells(PY) if t == "markdown")
    quotes = inline_quotes(md)
    assert len(quotes) >= 5
    wrong = not_the_papers(quotes, PAPER.read_text(encoding="utf-8"))
    assert not wrong, "not in the paper word for word:\n" + "\n".join(wrong)


def test_part_1_quotes_every_section_of_3_and_every_code_cell_follows_a_citation():
    all_cells = cells(PY)
    start = next(i for i, (t, c) in enumerate(all_cells) if c.startswith("# Part 1"))
    end = next(i for i, (t, c) in enumerate(all_cells) if c.startswith("# Part 2"))
    part1 = all_cells[start:end]
    cited = set(
        re.findall(
            r"^— (§[\d.]+)", "\n".join(c for t, c in part1 if t == "markdown"), re.M
        )
    )
    for section in (
        "§3",
        "§3.1",
        "§3.2",
        "§3.2.1",
        "§3.2.2",
        "§3.2.3",
        "§3.3",
        "§3.4",
        "§3.5",
    ):
        assert section in cited, f"no quote cited as {section}"
    headings = [c for t, c in part1 if t == "markdown" and c.startswith("## §")]
    assert any(h.startswith("## §4 ") for h in headings), "§4 has no section of its own"
    text_since_code = ""
    for kind, source in part1:
        if kind == "markdown":
            text_since_code += source
        else:
            assert "§" in text_since_code, (
                f"code cell without a § reference before it:\n{source[:200]}"
            )
            text_since_code = ""


# Importing with every network connection refused: a download would fail loudly.
NO_NETWORK = """
import socket, sys
tried = []
def refuse(*args, **kwargs):
    tried.append(args[1:] or kwargs)
    raise OSError("the import tried to open a network connection")
socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse
import the_annotated_transformer
sys.exit(f"connections tried: {tried}" if tried else 0)
"""


def test_importing_the_module_prints_downloads_and_writes_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", NO_NETWORK],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_part_4_shows_the_multi30k_run_the_readme_reports():
    run = json.loads((ROOT / "results" / "multi30k-small.json").read_text())
    nb = nbformat.read(NB, as_version=4)
    cell = next(
        c
        for c in nb.cells
        if c.cell_type == "code" and "run_or_load(m30k_cfg" in c.source
    )
    text = "".join(o.get("text", "") for o in cell.get("outputs", []))
    assert f"beam {run['bleu']:.2f}, greedy {run['bleu_greedy']:.2f}" in text, text


def test_part_4_shows_table_3_as_results_holds_it_now():
    """The stored table, figures and paragraphs of Table 3 are what
    results/table3.json renders today: a row merged since the notebook last ran
    fails here until Part 4 is run again."""
    import base64

    from machinery.table3view import read_table3

    table3 = read_table3(ROOT / "results" / "table3.json")
    nb = nbformat.read(NB, as_version=4)

    def outputs(call):
        cell = next(c for c in nb.cells if c.cell_type == "code" and call in c.source)
        return cell.get("outputs", [])

    shown = outputs("table3.markdown()")
    assert "".join(o.get("text", "") for o in shown) == table3.budget_line + "\n"
    markdown = [o["data"]["text/markdown"] for o in shown if "data" in o]
    assert markdown == [table3.markdown()]
    images = [o["data"]["image/png"] for o in outputs("table3.figures()")]
    drawn = [Path(figure).read_bytes() for figure, _ in table3.figures()]
    assert [base64.b64decode(i) for i in images] == drawn
    findings = [o["data"]["text/markdown"] for o in outputs("table3.findings()")]
    assert findings == [table3.findings()]


def test_part_4_states_the_thresholds_its_table_3_paragraphs_apply():
    from machinery.table3view import OVERFIT, STILL_LEARNING

    prose = next(
        text
        for c in jupytext.read(PY).cells
        if c.cell_type == "markdown"
        and "(it over-fits)" in (text := " ".join(c.source.split()))
    )
    assert f"ends more than {OVERFIT - 1:.0%} above its lowest" in prose
    assert f"by more than {1 - STILL_LEARNING:.0%} over its last three epochs" in prose


def test_committed_notebook_carries_outputs_of_a_full_run():
    nb = nbformat.read(NB, as_version=4)
    outputs = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    ]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs)
    assert len(images) >= 5, "figures missing: run `make notebook`"
    assert "profile: full" in text
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_committed_notebook_draws_attention_maps_from_the_scored_model():
    """The attention section's maps come from the weights Part 4 scored: the shipped
    model on a clone (or a run's checkpoint where one is)."""
    nb = nbformat.read(NB, as_version=4)
    cell = next(
        c
        for c in nb.cells
        if c.cell_type == "code" and "machinery.attention_maps(" in c.source
    )
    outputs = cell.get("outputs", [])
    text = "".join(o.get("text", "") for o in outputs)
    assert re.search(
        r"^maps from (the model models/multi30k-small|checkpoint-\d+\.pt in runs/)",
        text,
        re.M,
    ), text[:200]
    kinds = [k for o in outputs for k in o.get("data", {})]
    assert kinds.count("image/png") >= 4
    assert "application/vnd.attention-maps+json" in kinds


MACHINE_PATH = re.compile(
    r"""(?:^|[\s'"(=:])(/[\w.@+-]+/[\w.@+-]+|[A-Za-z]:\\)|shared/""", re.M
)


def test_machine_path_pattern_catches_what_it_should():
    for text in (
        "run folders under /tmp/annotated-transformer-x1",
        "from mirror ../shared/data/multi30k",
        "  /root/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: Warning",
        'path="/home/me/x"',
        "C:\\Users\\me",
    ):
        assert MACHINE_PATH.search(text), text
    for text in (
        "2,500 tok/s",
        "runs/notebook/copy",
        "mirror $DATA_MIRROR/multi30k",
        "d_model/h = 64",
        "1/2",
    ):
        assert not MACHINE_PATH.search(text), text


def test_stored_outputs_name_no_path_of_the_machine_that_ran_them():
    nb = nbformat.read(NB, as_version=4)
    found = []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            texts = [o.get("text", "")] + [
                v for k, v in o.get("data", {}).items() if k.startswith("text/")
            ]
            for t in texts:
                t = "".join(t) if isinstance(t, list) else t
                found += [(i, m.group(0)) for m in MACHINE_PATH.finditer(t)]
    assert not found, (
        f"absolute paths or shared/ in stored outputs (cell, match): {found}"
    )


def test_the_notebook_executes_top_to_bottom(tmp_path, mirror):
    from nbclient import NotebookClient

    nb = jupytext.read(PY)
    # after Part 4's names exist, an early demonstration still runs (no name it needs,
    # `example` among them, was rebound on the way)
    early = next(c for c in nb.cells if c.source.startswith("@example"))
    nb.cells.append(nbformat.v4.new_code_cell(early.source))
    env = {
        "NOTEBOOK_PROFILE": "smoke",
        "NOTEBOOK_RUNS": str(tmp_path / "runs"),
        "DATA_MIRROR": str(mirror),
        "ANNOTATED_TRANSFORMER_DATA": str(tmp_path / "data"),
        "MPLBACKEND": "Agg",
        # run elsewhere, the notebook still finds the package beside it
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            nb,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "profile: smoke" in text
    assert "copy task:" in text and "test BLEU" in text


def part_4_first_cell() -> str:
    """The first code cell of Part 4 (its set-up)."""
    all_cells = jupytext.read(PY).cells
    start = next(
        i for i, c in enumerate(all_cells) if "\n# Part 4 — " in f"\n{c.source}"
    )
    return next(c.source for c in all_cells[start:] if c.cell_type == "code")


def test_part_4s_first_cell_deletes_nothing_a_reader_made(tmp_path, monkeypatch):
    import machinery

    runs = tmp_path / "runs"
    monkeypatch.setenv("NOTEBOOK_RUNS", str(runs))
    source = part_4_first_cell()
    assert "NOTEBOOK_RUNS" in source  # the cell that sets up Part 4's run folders
    scope = {"IN_NOTEBOOK": True, "PROFILE": "smoke", "os": os, "Path": Path}
    scope["machinery"] = machinery
    exec(source, dict(scope))
    mine = runs / "iwslt14" / "checkpoint-00000100.pt"  # a reader's own run
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"weights")
    exec(source, dict(scope))  # run again, as a reader re-running the cell
    assert mine.read_bytes() == b"weights"


def module_scope(tree: ast.AST):
    """The nodes of ``tree`` in its module's own scope: not inside a class or function
    body (decorators and defaults, evaluated in the module, included)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for part in [*node.decorator_list, *getattr(node, "bases", [])]:
                yield from ast.walk(part)
            continue
        yield from module_scope(node)


def test_no_cell_rebinds_a_name_an_earlier_cell_defined_as_a_function():
    sources = [c.source for c in jupytext.read(PY).cells if c.cell_type == "code"]
    defined, clashes = {}, []
    for i, src in enumerate(sources):
        tree = ast.parse(src)
        for node in module_scope(tree):  # a class's field `attention` binds no global
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                if node.id in defined and defined[node.id] < i:
                    clashes.append((i, node.id))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name != "_":
                defined.setdefault(node.name, i)
    assert not clashes, (
        f"(cell, name) rebinding a function of an earlier cell: {clashes}"
    )


def test_committed_notebook_carries_no_execution_timestamps():
    nb = nbformat.read(NB, as_version=4)
    stamped = [i for i, c in enumerate(nb.cells) if "execution" in c.metadata]
    assert not stamped, (
        f"cells with execution timestamps: {stamped[:10]}… (make notebook stores none)"
    )


def test_the_notebook_keeps_its_length_budgets():
    # the reader's path: the whole module within 2,300 lines, Part 4 before line 2,000
    lines = PY.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 2300, len(lines)
    part_4 = next(i for i, line in enumerate(lines, 1) if line.startswith("# # Part 4"))
    assert part_4 < 2000, part_4


def test_the_results_tables_parameter_counts_are_the_models():
    # the stored Results table (full profile) against sum(p.numel()) of each preset's
    # model, at its joint BPE vocabulary (the vocabulary is the BPE model's size)
    import machinery
    import the_annotated_transformer as tat

    nb = nbformat.read(NB, as_version=4)
    tables = [
        "".join(o["data"]["text/markdown"])
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "text/markdown" in o.get("data", {})
        and "| run | data | parameters |" in "".join(o["data"]["text/markdown"])
    ]
    assert len(tables) == 1, "the Results table is not in the stored outputs"
    counts = dict(
        re.findall(r"^\| `([\w-]+)` \| [^|]+ \| ([\d,]+) \|", tables[0], re.M)
    )
    assert set(counts) == {"multi30k-small", "iwslt14-sample"}, counts
    for preset, shown in counts.items():
        cfg = machinery.get_config(preset)
        model = tat.make_model(cfg.bpe_size, cfg.bpe_size, cfg)
        assert int(shown.replace(",", "")) == sum(p.numel() for p in model.parameters())


def top_level_names(source: str) -> set[str]:
    """The classes, functions and constants a module's source defines at top level."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:  # `BOS, EOS, PAD, UNK = range(4)` defines four
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_the_package_never_repeats_a_definition_of_the_notebook():
    # "builds on the definitions below and never repeats them": no module of machinery/
    # defines at top level a name the notebook defines (a second `attention`, say)
    ours = top_level_names(PY.read_text())
    assert {"attention", "make_model", "beam_search", "PAD"} <= ours
    repeated = {
        str(path.relative_to(ROOT)): sorted(top_level_names(path.read_text()) & ours)
        for path in sorted((ROOT / "machinery").rglob("*.py"))
    }
    assert not {k: v for k, v in repeated.items() if v}, repeated
    assert top_level_names("def attention(): ...\nPAD: int = 2\n") & ours == {
        "attention",
        "PAD",
    }


def test_an_example_runs_only_as_the_notebook_and_leaves_no_name(monkeypatch):
    # "`example` runs a cell's demonstration only when this file runs as the notebook,
    # never on import, and leaves none of its names behind"
    import the_annotated_transformer as tat

    for in_notebook, runs in ((False, []), (True, ["ran"])):
        monkeypatch.setattr(tat, "IN_NOTEBOOK", in_notebook)
        ran = []

        @tat.example
        def demo():
            ran.append("ran")

        assert demo is None and ran == runs


def test_an_examples_random_numbers_come_from_its_own_seeded_stream():
    # a stored output is what a rerun prints: no example calls torch's sampling
    # functions without a generator of its own (the global stream's state hangs on
    # every cell run before it)
    draws = {"rand", "randn", "randint", "randperm", "normal", "bernoulli"}
    draws |= {"rand_like", "randn_like", "randint_like", "multinomial", "poisson"}
    unseeded = []
    for node in ast.walk(ast.parse(PY.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.FunctionDef) or not any(
            isinstance(d, ast.Name) and d.id == "example" for d in node.decorator_list
        ):
            continue
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in draws
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "torch"
                and not any(k.arg == "generator" for k in call.keywords)
            ):
                unseeded.append((call.lineno, call.func.attr))
    assert not unseeded, f"(line, draw) without a generator: {unseeded}"


def test_the_preset_paragraph_and_the_readme_say_what_the_presets_set():
    # Part 4's paragraph on `multi30k-small`, the README's "Not faithful: … Eq. 3 scaled
    # and warmed up sooner, clipped gradients, more dropout for IWSLT14", the Conclusion
    import machinery

    cells = jupytext.read(PY).cells
    (text,) = [c.source for c in cells if "The `multi30k-small` preset:" in c.source]
    text = squash(text.replace("#", ""))
    cfg = machinery.get_config("multi30k-small")
    for said in (
        f"$N={cfg.N}$",
        f"$d_{{ff}}={cfg.d_ff}$",
        f"$h={cfg.h}$",
        f"$P_{{drop}}={cfg.P_drop}$",
        f"$\\epsilon_{{ls}}={cfg.eps_ls}$",
        f"about {cfg.batch_tokens:,} tokens a batch",
        f"Eq. 3 scaled by {cfg.lr_factor} (`lr_factor`) with {cfg.warmup:,} warm-up",
        f"clipped at norm {cfg.clip_grad:g}",
        f"{cfg.bpe_size:,} joint BPE pieces",
        f"{cfg.epochs} epochs",
    ):
        assert squash(said) in text, said
    readme = squash((ROOT / "README.md").read_text())
    said = (
        "Eq. 3 scaled and warmed up sooner, clipped gradients, more dropout for IWSLT14; "
        "for IWSLT14 also AdamW's weight decay (`iwslt14-small`), label smoothing 0.2 "
        "and a two-layer decoder (`iwslt14-sample`)."
    )
    assert squash(said) in readme
    # and that list is whole: every recipe field a preset sets apart from the paper's
    # base is one it names, for the presets it names it for
    paper = machinery.get_config("base")
    named = {
        "multi30k-small": {"lr_factor", "warmup", "clip_grad"},
        "iwslt14-sample": {"lr_factor", "warmup", "clip_grad", "ffn_dropout"}
        | {"attn_dropout", "eps_ls", "N_dec"},
        "iwslt14-small": {"lr_factor", "P_drop", "weight_decay"},
    }
    recipe = ("lr_factor", "warmup", "clip_grad", "P_drop", "ffn_dropout")
    recipe += ("attn_dropout", "weight_decay", "eps_ls", "N_dec", "betas", "adam_eps")
    for name, fields in named.items():
        c = machinery.get_config(name)
        apart = {f for f in recipe if getattr(c, f) != getattr(paper, f)}
        assert apart == fields, (name, apart ^ fields)
    sample = machinery.get_config("iwslt14-sample")
    assert sample.eps_ls == 0.2 and sample.N_dec == 2
    (end,) = [c.source for c in cells if "## Conclusion" in c.source]
    said = "Eq. 3's schedule (scaled and warmed up sooner, with clipped gradients"
    assert squash(said) in squash(end.replace("#", ""))  # the Conclusion names them too
    small = [machinery.get_config(n) for n in ("multi30k-small", "iwslt14-sample")]
    assert all(c.lr_factor < 1 and c.warmup < 4000 and c.clip_grad > 0 for c in small)
    for name in ("iwslt14-sample", "iwslt14-small"):
        c = machinery.get_config(name)
        assert c.P_drop > 0.1 or c.attn_dropout > 0 or c.ffn_dropout > 0, name


def test_the_readmes_presets_table_is_what_the_presets_set():
    """Each `key=value` the README's Presets table gives for a preset (and its
    "(decoder k)", "BPE n") is that preset's setting."""
    import machinery

    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Presets\n")[1].split("\n## ")[0]
    checked = 0
    for row in section.splitlines():
        names = re.findall(r"`([\w-]+)`", row.split(" | ")[0])
        if not row.startswith("| `") or not names:
            continue
        for name in names:
            cfg = machinery.get_config(name)
            for key, value in re.findall(r"(\w+)=(\d+)", row):
                assert getattr(cfg, key) == int(value), (name, key)
                checked += 1
            if m := re.search(r"\(decoder (\d+)\)", row):
                assert cfg.decoder_layers == int(m[1]) != cfg.N, name
            if m := re.search(r"BPE ([\d,]+)", row):
                assert cfg.bpe_size == int(m[1].replace(",", "")), name
    assert checked >= 12


def before_part_4() -> list:
    """The notebook's cells before Part 4 (the Prelude and Parts 1–3)."""
    all_cells = jupytext.read(PY).cells
    part_4 = next(
        i for i, c in enumerate(all_cells) if "\n# Part 4 — " in f"\n{c.source}"
    )
    return all_cells[:part_4]


def package_names_used(sources: list[str], package_names: set[str]) -> list[str]:
    """``machinery.<name>`` anywhere in ``sources`` (prose too), and every name of the
    package (``package_names``) that a code cell reads or imports."""
    found = [m.group(0) for s in sources for m in re.finditer(r"machinery\.\w+", s)]
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a markdown cell
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in package_names:
                found.append(node.id)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] + [getattr(node, "module", "")]
                found += [m for m in modules if m and m.split(".")[0] == "machinery"]
    return found


def bound_names(sources: list[str]) -> set[str]:
    """Every name the code ``sources`` bind anywhere: assigned, defined, an argument."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def test_parts_1_to_3_use_nothing_of_the_package():
    # Parts 1–3 are the paper, readable without the package: no `machinery.` name and
    # no name the package exports (that the notebook does not define itself) before
    # Part 4, in code or prose; a path such as machinery/data.py may be named
    import machinery

    ours = top_level_names(PY.read_text())
    package = {n for n in dir(machinery) if not n.startswith("_")} - ours
    package -= {"annotations", "notebook"}  # `from __future__ import annotations`
    sources = [c.source for c in before_part_4()]
    code = [c.source for c in before_part_4() if c.cell_type == "code"]
    package -= bound_names(code)  # its own arguments and helpers (`config`, say)
    assert not package_names_used(sources, package)
    # the check finds each kind of use
    assert package_names_used(["x = machinery.CORPORA"], package) == [
        "machinery.CORPORA"
    ]
    assert package_names_used(["run_or_load(cfg)"], package) == ["run_or_load"]
    assert package_names_used(["import machinery"], package) == ["machinery"]
    assert package_names_used(["See `machinery/data.py`."], package) == []


TEST_CLAIM = re.compile(r"\btests? (?:checks?|shows?|fits?|compares?)\b", re.I)


def unshown_claims(cells) -> list[str]:
    """Sentences of markdown cells that say a test checks something where the next
    code cell shows nothing: it must run a demonstration that prints (``@example``)."""
    missing = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        prose = " ".join(
            line.lstrip("#> ").strip() for line in cell.source.splitlines()
        )
        claims = [s for s in re.split(r"(?<=[.:])\s+", prose) if TEST_CLAIM.search(s)]
        nxt = next((c for c in cells[i + 1 :] if c.cell_type == "code"), None)
        shown = nxt is not None and "@example" in nxt.source and "print(" in nxt.source
        missing += [] if shown else claims
    return missing


def test_every_sentence_saying_a_test_checks_is_followed_by_a_cell_that_shows_it():
    # Prelude and Parts 1–3: the claim is shown, not told (the cell's stored output is
    # the measured difference once the notebook is re-run)
    assert not unshown_claims(before_part_4())
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    told = [md("A test checks that the two agree."), code("x = 1")]
    assert unshown_claims(told) == ["A test checks that the two agree."]
    shown = code("@example\ndef _():\n    print(1)")
    assert unshown_claims([told[0], shown]) == []


def section_lines(lines: list[str], heading: str, until: str) -> list[str]:
    """The module's lines from the one starting with ``heading`` to the line before the
    next one starting with ``until``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    end = next(
        i for i, line in enumerate(lines[start:], start) if line.startswith(until)
    )
    return lines[start:end]


def test_the_prelude_is_at_most_40_lines():
    # the Prelude is the imports and `example`; the set-up before it is an aside the
    # page folds
    lines = PY.read_text(encoding="utf-8").splitlines()
    prelude = section_lines(lines, "# ## Prelude", "# # Part 1")
    assert len(prelude) <= 40, len(prelude)
    assert sum(line.startswith("# %%") for line in prelude) == 2  # its text, one cell


# A line that names our own options, checks or departures (not the paper's material).
OURS = re.compile(
    r"norm_first|ffn_dropout|attn_dropout|N_dec|our addition|our helper|departure"
    r"|weight_decay|copy_|copy task|Harvard|pre-norm|PROFILE"
)


def paper_share(part: list[str]) -> float:
    """The share of ``part``'s lines that are the paper's material: all but the lines
    of an Aside section and those that name our own options, checks or departures."""
    ours, aside = 0, False
    for line in part:
        if line.startswith("# #"):
            aside = "Aside" in line
        ours += aside or bool(OURS.search(line))
    return 1 - ours / len(part)


def test_parts_1_to_3_are_the_papers_material_as_their_closing_note_says():
    lines = PY.read_text(encoding="utf-8").splitlines()
    parts = section_lines(lines, "# # Part 1", "# # Part 4")
    said = re.search(r"over (\d+)% of Parts 1–3 is", " ".join(parts))
    assert said, "Part 3's closing note states the share"
    assert paper_share(parts) > int(said[1]) / 100 >= 0.8, paper_share(parts)
    # the count sees asides and our own lines
    assert paper_share(["# ## Aside: x", "x = 1", "# ## §3", "y = 2"]) == 0.5
    assert (
        paper_share(["# ## §3", "norm_first = True", "d_model = 512", "h = 8"]) == 0.75
    )

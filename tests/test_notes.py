"""REPRODUCTION_NOTES.md is an audit: its tables parse, every status is one of four, every
row says what we chose, and every test it names as pinning a choice exists."""

import ast
import re
from pathlib import Path

import pytest
from conftest import PAPER, inline_quotes, not_the_papers

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "REPRODUCTION_NOTES.md"
TESTS = ROOT / "tests"
COLUMNS = ["topic", "paper", "status", "our choice", "alternatives", "pinned by"]
STATUSES = {"SPECIFIED", "PARTIAL", "UNSPECIFIED", "DEPARTURE"}
REFERENCE = re.compile(r"tests/([A-Za-z0-9_]+\.py)::([A-Za-z_][A-Za-z0-9_]*)")


def split_row(line: str) -> list[str]:
    """Cells of a Markdown table row; ``\\|`` is a literal bar inside a cell."""
    body = line.strip()
    assert body.startswith("|") and body.endswith("|"), line
    cells = re.split(r"(?<!\\)\|", body[1:-1])
    return [c.strip().replace("\\|", "|") for c in cells]


def audit_rows(text: str) -> list[dict]:
    """Every row of every table whose header has a ``status`` column, as {column: cell}."""
    rows, header, lineno = [], None, 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip().startswith("|"):
            header = None
            continue
        cells = split_row(line)
        if header is None:
            header = cells if "status" in cells else []
            continue
        if not header or all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        assert len(cells) == len(header), (
            f"line {lineno}: {len(cells)} cells, header has {len(header)}"
        )
        rows.append({"line": lineno, "header": header, **dict(zip(header, cells))})
    return rows


def defined_tests(path: Path) -> set[str]:
    """Names of the ``test_…`` functions in a test file, at module level or inside classes."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    }


def unknown_references(rows: list[dict], tests_dir: Path = TESTS) -> list[str]:
    """``tests/file.py::name`` references in ``pinned by`` that name no existing test function."""
    cache: dict[str, set[str]] = {}
    bad = []
    for row in rows:
        for file, name in REFERENCE.findall(row["pinned by"]):
            if file not in cache:
                path = tests_dir / file
                cache[file] = defined_tests(path) if path.is_file() else set()
            if name not in cache[file]:
                bad.append(f"line {row['line']}: tests/{file}::{name}")
    return bad


@pytest.fixture(scope="module")
def rows():
    return audit_rows(NOTES.read_text(encoding="utf-8"))


def test_the_audit_has_at_least_30_rows_with_the_six_columns(rows):
    assert len(rows) >= 30, len(rows)
    for row in rows:
        assert row["header"] == COLUMNS, (row["line"], row["header"])


def test_every_status_is_one_of_the_four(rows):
    bad = [
        (row["line"], row["status"]) for row in rows if row["status"] not in STATUSES
    ]
    assert not bad, bad


def test_every_row_has_a_topic_and_an_our_choice(rows):
    assert all(row["topic"] for row in rows)
    empty = [
        row["line"] for row in rows if not row["our choice"] or row["our choice"] == "—"
    ]
    assert not empty, empty


def test_every_row_says_what_pins_it(rows):
    assert all(row["pinned by"] for row in rows)
    # most rows name at least one test
    with_tests = sum(bool(REFERENCE.search(row["pinned by"])) for row in rows)
    assert with_tests >= 0.8 * len(rows), (with_tests, len(rows))


def test_every_named_test_exists(rows):
    assert not unknown_references(rows)


def test_a_misspelt_or_missing_test_is_caught(rows, tmp_path):
    row = {
        "line": 1,
        "pinned by": "tests/test_model.py::test_embeddings_are_scaled_by_sqrt_d_model",
    }
    assert unknown_references([row]) == []
    misspelt = dict(
        row,
        **{
            "pinned by": "tests/test_model.py::test_embeddings_are_scaled_by_sqrt_dmodel"
        },
    )
    assert unknown_references([misspelt]) == [
        "line 1: tests/test_model.py::test_embeddings_are_scaled_by_sqrt_dmodel"
    ]
    no_file = dict(row, **{"pinned by": "tests/test_nowhere.py::test_anything"})
    assert len(unknown_references([no_file])) == 1
    # methods of test classes count; helpers that are not test_… do not
    (tmp_path / "test_x.py").write_text(
        "class TestA:\n    def test_inside(self):\n        pass\n"
        "def helper():\n    pass\n"
    )
    refs = [
        {
            "line": 2,
            "pinned by": "tests/test_x.py::test_inside, tests/test_x.py::helper",
        }
    ]
    assert unknown_references(refs, tmp_path) == ["line 2: tests/test_x.py::helper"]


def test_the_table_parser_handles_escaped_bars_and_rejects_bad_statuses():
    text = (
        "| topic | paper | status | our choice | alternatives | pinned by |\n"
        "|---|---|---|---|---|---|\n"
        "| lp | ((5+\\|Y\\|)/6)^α | PARTIAL | GNMT | — | — |\n"
        "| x | y | MAYBE | z | — | — |\n"
        "\n| other | table |\n|---|---|\n| not | audited |\n"
    )
    parsed = audit_rows(text)
    assert [r["topic"] for r in parsed] == ["lp", "x"]
    assert parsed[0]["paper"] == "((5+|Y|)/6)^α"
    assert [r["status"] in STATUSES for r in parsed] == [True, False]


@pytest.mark.skipif(
    not PAPER.is_file(), reason="paper excerpts not beside the repository"
)
def test_text_in_double_quotes_with_a_section_is_the_papers_exact_wording():
    quotes = inline_quotes(NOTES.read_text(encoding="utf-8"))
    assert len(quotes) >= 20
    wrong = not_the_papers(quotes, PAPER.read_text(encoding="utf-8"))
    assert not wrong, "not in the paper word for word:\n" + "\n".join(wrong)


def test_an_inline_quote_is_checked_piece_by_piece_in_the_section_it_cites():
    paper = (
        "# Excerpts\n## Abstract\nA summary.\n## §5 Training\n### §5.4 Regularization"
        "\n#### Label Smoothing\nWe used a rate of\n0.1 here. Beam search was used.\n"
    )
    text = (
        'We chose "a rate of\n0.1" (§5.4), “a rate of […] here” (§5), '
        '"Beam search was used" (§6.1), "A summary." (§5) and "made up" (§5.4).'
    )
    quotes = inline_quotes(text)
    assert [s for _, s in quotes] == ["§5.4", "§5", "§6.1", "§5", "§5.4"]
    assert not_the_papers(quotes, paper) == [
        "Beam search was used (§6.1)",  # in the paper, not in the section cited
        "A summary. (§5)",
        "made up (§5.4)",
    ]


def test_the_readme_begins_with_its_commands_under_the_findings():
    # a newcomer reads the commands first: Quick start within the first 25 lines,
    # right after the findings, naming the four commands, the data mirror and time
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Quick start")
    assert start < 25 and lines[start - 2] == "<!-- /findings -->", start
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    quick = "\n".join(lines[start:end])
    for command in ("make install", "make lab", "make test", "make train CONFIG="):
        assert command in quick, command
    assert "DATA_MIRROR" in quick and "skip" in quick
    assert re.search(r"\d+(\.\d+)? min", quick)  # how long the headline run takes
    assert "64 MiB" not in "\n".join(lines)  # the GPU carry list is benchmarks' own

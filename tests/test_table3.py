"""The Table 3 (§6.2) runner, `benchmarks/table3.py` (`make table3`).

Its rows are the paper's variations written as field overrides of the base; in its smoke
mode (the copy preset, five updates a row) it trains each row once, skips the rows its
file already holds, continues an interrupted row from its checkpoint, and keeps one
training budget per file. No score is asserted beyond what five updates can show.
"""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "table3.py"


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``table3.py --smoke --out OUT ARGS`` with one thread, data kept beside OUT."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ANNOTATED_TRANSFORMER_DATA": str(out.parent / "data"),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def rows_of(out: Path) -> dict:
    """The rows of a Table 3 results file, by name."""
    return {r["name"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke table: rows base, A-h1, B-dk4 and E-learned, trained once."""
    out = tmp_path_factory.mktemp("table3") / "table3.json"
    result = run(out)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_every_row_is_one_of_the_papers_variations_of_the_base():
    runner = load_script(SCRIPT, "table3_runner")
    base = runner.BASE
    rows = runner.table3_rows(base)
    # 3 seeds of the base; (A) 4 head counts, (B) 2 key sizes, (C) 6 sizes, (D) 4, (E) 1
    assert Counter(r["group"] for r in rows) == {
        "base": 3,
        "A": 4,
        "B": 2,
        "C": 6,
        "D": 4,
        "E": 1,
    }
    assert len({r["name"] for r in rows}) == len(rows)
    for r in rows:
        assert r["paper_row"] in runner.PAPER, r["name"]
        fields = r["fields"]
        if r["group"] == "A":  # constant compute: h · d_k stays d_model
            assert set(fields) == {"h", "d_k"}
            assert fields["h"] * fields["d_k"] == base["d_model"]
        if r["group"] == "B":  # smaller keys alone, at the base's heads
            assert set(fields) == {"d_k"} and fields["d_k"] < base["d_k"]
        if r["group"] == "C" and "d_model" in fields:  # d_k follows d_model / h
            assert fields["d_k"] == fields["d_model"] // base["h"]
        if r["group"] in "CD":
            assert len(set(fields) - {"d_k"}) == 1  # one setting changed
    assert {r["name"]: r["fields"] for r in rows}["E-learned"] == {
        "positional": "learned"
    }


def test_a_smoke_table_trains_each_row_and_draws_the_figure(smoke):
    rows = rows_of(smoke)
    assert list(rows) == ["base", "A-h1", "B-dk4", "E-learned"]
    for r in rows.values():
        assert r["status"] == "done", r
        assert r["steps"] == 5 and r["valid_ppl"] > 1
        assert 0 <= r["bleu_greedy"] <= 100 and r["device_name"]
    base = rows["base"]["params"]
    assert rows["A-h1"]["params"] == base  # (A): the same computation, regrouped
    assert rows["B-dk4"]["params"] < base  # (B): smaller query and key projections
    assert rows["E-learned"]["params"] > base  # (E): a table of positions per stack
    assert smoke.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_already_in_the_file_are_not_trained_again(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    result = run(out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "4 of 4 row(s) already in" in result.stdout
    assert "device:" not in result.stdout + result.stderr  # no training run started
    assert out.read_bytes() == before


def test_an_interrupted_row_continues_from_its_checkpoint(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    shutil.copytree(
        smoke.parent / "table3-runs" / "base", tmp_path / "table3-runs/base"
    )
    # as if stopped after its last checkpoint: no results, no row in the file
    (tmp_path / "table3-runs/base/results.json").unlink()
    data = json.loads(out.read_text())
    data["rows"] = [r for r in data["rows"] if r["name"] != "base"]
    out.write_text(json.dumps(data))
    result = run(out, "--rows", "base")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout + result.stderr
    again, first = rows_of(out)["base"], rows_of(smoke)["base"]
    assert "continued from the checkpoints" in again["resumed"]
    assert again["steps"] == first["steps"]
    assert again["bleu"] == first["bleu"]  # the same model, scored the same


def test_one_file_holds_one_training_budget(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    result = run(out, "--epochs", "2")
    assert result.returncode == 2
    assert "one file holds one budget" in result.stderr
    assert out.read_bytes() == before

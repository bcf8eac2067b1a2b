"""The headline's spread, `benchmarks/seeds.py` (`make seeds`): other seeds of a preset,
each in its own run directory, read beside the recorded run. Its smoke run trains the
copy task for two updates a seed; no score is asserted beyond what it recorded."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "seeds.py"


def run(tmp_path, *extra):
    """seeds.py on the copy preset, two updates a seed, into ``tmp_path``."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--config", "copy"]
        + ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "seeds.json")]
        + ["--max_steps", "2", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Seeds 2 and 3 trained once, beside a recorded run made for the purpose (seed 5,
    another batch size)."""
    tmp = tmp_path_factory.mktemp("seeds")
    first = run(tmp, "--seeds", "5", "--recorded", str(tmp / "none.json"))
    assert first.returncode == 0, first.stderr
    recorded = tmp / "recorded.json"
    summary = json.loads((tmp / "runs" / "seed-5" / "results.json").read_text())
    summary["config"]["batch_tokens"] += 1  # as if trained with another setting
    recorded.write_text(json.dumps(summary))
    result = run(tmp, "--seeds", "2,3", "--recorded", str(recorded))
    assert result.returncode == 0, result.stderr
    return tmp, json.loads((tmp / "seeds.json").read_text()), result


def test_each_seed_records_its_scores_and_what_its_run_took(seeds):
    tmp, data, _ = seeds
    assert [r["seed"] for r in data["rows"]] == [5, 2, 3]
    assert data["rows"][0]["recorded"].endswith("recorded.json")
    for row in data["rows"][1:]:
        summary = json.loads(
            (tmp / "runs" / f"seed-{row['seed']}" / "results.json").read_text()
        )
        assert summary["config"]["seed"] == row["seed"]
        assert row["bleu"] == summary["bleu"] and row["steps"] == 2
        assert row["precision"] and row["attention"] and row["machine"]
        assert set(row["auto"]) == {"precision", "attention"}  # why each was taken
        assert row["commit"]  # the commit its run started from


def test_the_spread_is_over_every_seed_the_recorded_one_included(seeds):
    _, data, result = seeds
    values = [r["bleu"] for r in data["rows"]]
    assert data["bleu"]["n"] == 3
    assert data["bleu"]["mean"] == pytest.approx(sum(values) / 3)
    assert data["bleu"]["min"] == min(values) and data["bleu"]["max"] == max(values)
    assert "over 3 seed(s)" in result.stdout


def test_a_setting_other_than_the_seed_is_named(seeds):
    _, data, _ = seeds
    first, *others = data["rows"]
    assert first["other_settings"] == {}
    for row in others:
        (field,) = row["other_settings"]
        assert field == "batch_tokens"


def test_a_finished_seed_is_read_not_trained_again(seeds):
    tmp, data, _ = seeds
    again = run(tmp, "--seeds", "2,3", "--recorded", str(tmp / "recorded.json"))
    assert again.returncode == 0 and "training in" not in again.stderr
    assert json.loads((tmp / "seeds.json").read_text()) == data


def test_the_spread_of_fewer_than_two_has_no_deviation():
    seeds = load_script(SCRIPT, "seeds_runner")
    assert seeds.spread([{"bleu": 41.8}]) == {
        "n": 1, "mean": 41.8, "sd": None, "min": 41.8, "max": 41.8
    }  # fmt: skip
    assert seeds.spread([{"bleu": 40.0}, {"bleu": 42.0}])["sd"] == pytest.approx(2**0.5)

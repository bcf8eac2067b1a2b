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
    summary = json.loads(
        (tmp / "runs" / "copy" / "seed-5" / "results.json").read_text()
    )
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
            (tmp / "runs" / "copy" / f"seed-{row['seed']}" / "results.json").read_text()
        )
        assert summary["config"]["seed"] == row["seed"]
        assert row["bleu"] == summary["bleu"] and row["steps"] == 2
        assert row["precision"] and row["attention"] and row["machine"]
        assert set(row["auto"]) == {"precision", "attention"}  # why each was taken
        assert row["commit"] and row["resumed_from"] == []  # where its run started


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
    for row in others:  # the precision and attention path taken are not "settings"
        assert list(row["other_settings"]) == ["batch_tokens"]


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


def test_a_seed_starts_only_from_a_commit_and_never_twice(
    tmp_path, monkeypatch, capsys
):
    seeds = load_script(SCRIPT, "seeds_runner")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(seeds, "commit", lambda *a, **k: "0123abc+changes")
    assert seeds.main(["--config", "copy", "--runs", "runs"]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing started
    monkeypatch.setattr(seeds, "commit", lambda *a, **k: "0123abc")
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps({"config": {"seed": 1}, "bleu": 41.8}))
    argv = ["--config", "copy", "--runs", "runs", "--recorded", str(recorded)]
    assert seeds.main([*argv, "--seeds", "1,2"]) == 2
    assert "seed 1 is the recorded run's" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_resumed_seed_keeps_every_commit_it_ran_from(tmp_path, monkeypatch):
    seeds = load_script(SCRIPT, "seeds_runner")
    monkeypatch.setattr(seeds.subprocess, "run", lambda *a, **k: finished_process())
    run_dir = tmp_path / "seed-2"
    seeds.train_seed("python", "copy", 2, run_dir, [], "aaa")
    seeds.train_seed("python", "copy", 2, run_dir, [], "bbb")  # no checkpoint: anew
    assert seeds.commits_of(run_dir) == ["bbb"]
    (run_dir / "checkpoint-00000050.pt").write_bytes(b"")
    seeds.train_seed("python", "copy", 2, run_dir, [], "ccc")  # resumed
    assert seeds.commits_of(run_dir) == ["bbb", "ccc"]
    assert seeds.commits_of(tmp_path / "by-hand") == []


def finished_process():
    """A finished process, as subprocess.run returns it."""
    return subprocess.CompletedProcess([], 0)

"""Part 4's runs in plain sight (`machinery.run_or_load`) and its Results table: a run is
loaded when its recipe is the one asked for, resumed from its checkpoints, or trained,
each said in one line, and nothing a reader made is deleted."""

import json

import pytest

import machinery
from machinery.runfiles import RunDirectoryError
from conftest import tiny_cfg


def lines_of(cfg, **kwargs):
    said = []
    summary = machinery.run_or_load(cfg, log=said.append, **kwargs)
    return said, summary


def test_a_run_is_trained_then_loaded_and_never_deleted(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    said, first = lines_of(cfg)
    assert said[0] == f"training here, into {cfg.run_dir}" and first["steps"] == 2
    mine = tmp_path / "run" / "notes.txt"  # something a reader put there
    mine.write_text("mine")
    said, again = lines_of(cfg)
    assert len(said) == 1 and said[0].startswith(
        f"loaded the finished run in {cfg.run_dir}"
    )
    assert again["bleu"] == first["bleu"] and mine.read_text() == "mine"


def test_a_finished_run_of_another_recipe_is_not_taken_for_this_one(tmp_path):
    other = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2, seed=7)
    lines_of(other)
    for checkpoint in machinery.checkpoint_paths(tmp_path / "run"):
        checkpoint.unlink()  # only the other recipe's summary is left
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    assert machinery.recipe_differences(
        json.loads((tmp_path / "run" / "results.json").read_text())["config"], cfg
    ) == ["seed: 7 → 1"]
    said = []  # not loaded: training here would replace it, which is refused
    with pytest.raises(RunDirectoryError, match="of an earlier run"):
        machinery.run_or_load(cfg, log=said.append)
    assert said == [f"training here, into {cfg.run_dir}"]


def test_a_recorded_summary_stands_in_only_where_no_run_is_here(tmp_path):
    recorded = tmp_path / "results" / "copy.json"
    recorded.parent.mkdir()
    summary = {"steps": 5, "train_minutes": 1.0, "bleu": 12.5, "config": {}}
    summary["cpu"] = "AMD EPYC (cpu family 25), 2 cores"
    recorded.write_text(json.dumps(summary))
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    said, got = lines_of(cfg, recorded=str(recorded))
    assert said[0].startswith(f"loaded the recorded summary {recorded}")
    assert "trained in 1 min on AMD EPYC (cpu family 25), 2 cores)" in said[0]
    assert got["bleu"] == 12.5 and got["curve"].endswith("copy-curve.png")


def test_a_run_with_checkpoints_is_resumed(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    lines_of(cfg)
    (tmp_path / "run" / "results.json").unlink()  # as if stopped after a checkpoint
    said, _ = lines_of(cfg, recorded=str(tmp_path / "absent.json"))
    assert said[0].startswith(f"resuming the run in {cfg.run_dir} from checkpoint-")


def test_the_results_table_counts_what_it_is_given():
    run = {"train_minutes": 33.4, "bleu": 41.79, "machine": "a CPU"}
    table = machinery.results_table([("multi30k-small", "Multi30k", 7585600, run)])
    rows = table.splitlines()
    assert rows[0].startswith("| run |") and len(rows) == 2 + 2 + 1
    assert (
        rows[-1]
        == "| `multi30k-small` | Multi30k | 7,585,600 | a CPU | 33 min | 41.8 |"
    )

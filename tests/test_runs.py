"""Part 4's runs in plain sight (`machinery.run_or_load`) and its Results table: a run is
loaded when its recipe is the one asked for, resumed from its checkpoints, or trained,
each said in one line, and nothing a reader made is deleted."""

import dataclasses
import json

import pytest
import torch

import machinery
from machinery.export import run_export_command
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


def test_a_runs_line_names_what_its_digits_hang_on_besides_its_recipe(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    said, summary = lines_of(cfg)
    assert summary["threads"] == torch.get_num_threads(), "a CPU run records them"
    threads = f"{summary['threads']} thread{'' if summary['threads'] == 1 else 's'}"
    precision = {"fp32": "float32"}.get(summary["precision"], summary["precision"])
    taken = f"{precision}, {summary['attention']} attention, {threads}"
    assert said[1].startswith("trained 2 updates in ") and said[1].endswith(
        f" on {summary['machine']}, {taken}"
    ), said
    said, _ = lines_of(cfg)
    assert said[0].endswith(f" on {summary['machine']}, {taken}"), "loaded: the same"


def test_the_path_taken_names_only_what_a_summary_records():
    assert machinery.runs.path_taken({}) == ""
    older = {"precision": "bf16", "attention": "readable"}  # before threads were kept
    assert machinery.runs.path_taken(older) == "bf16, readable attention"
    assert machinery.runs.path_taken(older | {"threads": 1}).endswith(", 1 thread")
    assert machinery.runs.path_taken({"threads": 16}) == "16 threads"
    assert machinery.runs.path_taken({"precision": "fp32"}) == "float32", "as logged"


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
    results = tmp_path / "run" / "results.json"
    assert said == [
        f"set aside {results}: another recipe (seed: 7 → 1)",
        f"training here, into {cfg.run_dir}",
    ]


def summary_of(cfg, **changes) -> dict:
    """A made-up summary of a finished run of ``cfg`` (20 test sentences)."""
    summary = {"config": dataclasses.asdict(cfg), "steps": 5, "train_minutes": 1.0}
    summary |= {"bleu": 12.5, "bleu_greedy": 12.0, "test_sentences": 20}
    summary["cpu"] = "AMD EPYC (cpu family 25), 2 cores"
    return summary | changes


def test_a_recorded_summary_stands_in_only_where_no_run_is_here(tmp_path):
    recorded = tmp_path / "results" / "copy.json"
    recorded.parent.mkdir()
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=20)
    recorded.write_text(json.dumps(summary_of(cfg)))
    said, got = lines_of(cfg, recorded=str(recorded))
    assert said[0].startswith(f"loaded the recorded summary {recorded}")
    assert "trained in 1 min on AMD EPYC (cpu family 25), 2 cores)" in said[0]
    assert got["bleu"] == 12.5 and got["curve"].endswith("copy-curve.png")


def hostile(cfg):
    """What a hostile checkout puts in a run directory's results.json: (the text, the
    words of the one line that sets it aside)."""
    torn = json.dumps(summary_of(cfg))[:-20]
    no_steps = summary_of(cfg)
    del no_steps["steps"]
    return [
        (json.dumps(summary_of(cfg, config={})), "it has no config"),
        (json.dumps(summary_of(cfg, test_sentences=2)), "scored on 2 test sentences"),
        (
            json.dumps(summary_of(cfg, bleu=float("nan"))),
            "its bleu is nan, not a score from 0 to 100",
        ),
        (json.dumps(no_steps), "its steps are None"),
        (torn, "it cannot be read"),
        (json.dumps(summary_of(cfg, steps="5")), "its steps are '5'"),
        (
            json.dumps(
                summary_of(
                    cfg, config=dataclasses.asdict(cfg) | {"max_eval_sentences": 2}
                )
            ),
            "scored otherwise (max_eval_sentences: 2 → 20)",
        ),
        ("[1, 2]", "it is not a run summary"),
    ]


def test_a_summary_that_does_not_match_is_set_aside_in_one_line(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=20)
    recorded = tmp_path / "copy.json"
    recorded.write_text(json.dumps(summary_of(cfg, bleu=30.0)))
    (tmp_path / "run").mkdir()
    for text, words in hostile(cfg):
        (tmp_path / "run" / "results.json").write_text(text)
        said, got = lines_of(cfg, recorded=str(recorded))
        results = tmp_path / "run" / "results.json"
        assert said[0].startswith(f"set aside {results}: ") and words in said[0]
        assert said[1].startswith(f"loaded the recorded summary {recorded}")
        assert len(said) == 2 and got["bleu"] == 30.0  # the next source


def test_a_recorded_summary_of_another_preset_is_not_loaded_for_this_one(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    recorded = tmp_path / "multi30k-small.json"
    recorded.write_text(json.dumps(summary_of(machinery.get_config("multi30k-small"))))
    said, got = lines_of(cfg, recorded=str(recorded))
    assert said[0].startswith(
        f"set aside the recorded summary {recorded}: another recipe (N: 3 → 1"
    )
    assert said[1] == f"training here, into {cfg.run_dir}" and got["steps"] == 2


def test_another_seeds_finished_run_is_set_aside_not_resumed(tmp_path):
    other = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2, seed=7)
    lines_of(other)  # its results.json and checkpoints
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    recorded = tmp_path / "copy.json"
    recorded.write_text(json.dumps(summary_of(cfg, test_sentences=2)))
    said, got = lines_of(cfg, recorded=str(recorded))
    newest = machinery.checkpoint_paths(tmp_path / "run")[-1].name
    assert said == [
        f"set aside {tmp_path / 'run' / 'results.json'}: another recipe (seed: 7 → 1)",
        f"set aside the checkpoints in {cfg.run_dir}: {newest} is of another recipe "
        "(seed: 7 → 1)",
        said[2],
    ]
    assert said[2].startswith(f"loaded the recorded summary {recorded}")
    recorded.unlink()  # nothing else stands in: refused, not resumed
    said = []
    with pytest.raises(RunDirectoryError, match="checkpoints of another run"):
        machinery.run_or_load(cfg, log=said.append)
    assert not [line for line in said if line.startswith("resuming")]


def test_the_shipped_model_stands_in_before_the_recorded_summary(tmp_path, capsys):
    made = tiny_cfg(tmp_path / "made", max_steps=2, max_eval_sentences=2)
    lines_of(made)
    folder = tmp_path / "models" / "tiny"
    run_export_command(["--run_dir", str(tmp_path / "made"), "--out", str(folder)])
    finished = json.loads((tmp_path / "made" / "results.json").read_text())
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    recorded = tmp_path / "copy.json"
    recorded.write_text(json.dumps(summary_of(cfg, test_sentences=2, bleu=3.0)))
    said, got = lines_of(cfg, recorded=str(recorded), shipped=folder)
    assert len(said) == 1 and said[0].startswith(f"loaded the model {folder} (2 upd")
    assert got["model"] == str(folder) and got["bleu"] == finished["bleu"]
    assert got["curve"].endswith("copy-curve.png")  # the recorded run's curve
    damaged = folder / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    said, got = lines_of(cfg, recorded=str(recorded), shipped=folder)
    assert said[0] == (
        f"set aside the model {folder}: {damaged} does not match its SHA-256 in "
        "model.json: the file is damaged or from another model"
    )
    assert said[1].startswith("loaded the recorded summary") and got["bleu"] == 3.0
    lines_of(cfg)  # a finished run here comes first
    said, got = lines_of(cfg, recorded=str(recorded), shipped=folder)
    assert said[0].startswith(f"loaded the finished run in {cfg.run_dir}")


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


def test_part_4_decodes_with_the_weights_its_summary_was_scored_with(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, max_eval_sentences=2)
    _, finished = lines_of(cfg)
    trained = machinery.runs.trained_model(finished)
    paths = machinery.checkpoint_paths(tmp_path / "run")[-cfg.average_last :]
    assert trained.where == f"{', '.join(p.name for p in paths)} in {cfg.run_dir}"
    data = machinery.make_copy_data(cfg)
    text = machinery.runs.live_examples(trained, data, finished["examples"], n=2)
    lines = text.splitlines()
    assert len(lines) == 2 * 4 and lines[1].endswith("(beam 4)")
    assert lines[2].endswith("(greedy)") and lines[3] == f"  ({data.test_refs[0]})"
    folder = tmp_path / "model"
    run_export_command(["--run_dir", cfg.run_dir, "--out", str(folder)])
    shipped = machinery.runs.trained_model({"model": str(folder)})
    assert shipped.where == f"the model {folder}"
    assert machinery.runs.live_examples(shipped, data, n=2) == text  # same weights
    recorded = {"run_dir": str(tmp_path / "none"), "config": finished["config"]}
    assert machinery.runs.trained_model(recorded) is None
    assert machinery.runs.live_examples(None, data, finished["examples"], n=1) == (
        "  {source}\n→ {output}\n  ({reference})".format(**finished["examples"][0])
    )


@pytest.mark.parametrize("name", ["multi30k-small", "iwslt14-sample"])
def test_a_reported_run_names_its_machine_and_only_settings_the_code_has(name):
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "results"
    summary = json.loads((results / f"{name}.json").read_text())
    assert "EPYC" in machinery.runs.machine_of(summary)  # the CPU it ran on, named
    fields = {f.name for f in dataclasses.fields(machinery.Config)}
    assert set(summary["config"]) <= fields, set(summary["config"]) - fields
    assert summary["config"]["dataset"] and summary["steps"] > 0

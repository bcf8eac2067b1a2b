"""The Table 3 (§6.2) runner, `benchmarks/table3.py` (`make table3`).

Its rows are the paper's variations written as field overrides of the base, each with
its seeds, on the headline preset's own schedule; in its smoke mode (the copy preset,
five updates a row) it trains each row once, records what each row ran with, skips the
rows its file already holds, continues an interrupted row from its checkpoint, and
keeps one training budget per file. Its noise rule is checked on made-up numbers. No
score is asserted beyond what five updates can show.
"""

import json
import math
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
    seed_one = [r for r in rows if r["seed"] == 1]
    # (A) 4 head counts, (B) 2 key sizes, (C) 6 sizes and 2 learning-rate controls,
    # (D) 4, (E) 1
    assert Counter(r["group"] for r in seed_one) == {
        "base": 1,
        "A": 4,
        "B": 2,
        "C": 8,
        "D": 4,
        "E": 1,
    }
    assert len({r["name"] for r in rows}) == len(rows)
    for r in seed_one:
        assert r["paper_row"] in runner.PAPER, r["name"]
        fields = r["fields"]
        if r["group"] == "A":  # constant compute: h · d_k stays d_model
            assert set(fields) == {"h", "d_k"}
            assert fields["h"] * fields["d_k"] == base["d_model"]
        if r["group"] == "B":  # smaller keys alone, at the base's heads
            assert set(fields) == {"d_k"} and fields["d_k"] < base["d_k"]
        if r["group"] == "C" and "d_model" in fields:  # d_k follows d_model / h
            assert fields["d_k"] == fields["d_model"] // base["h"]
        if r["group"] in "CD" and not r["name"].endswith("-lr"):
            assert len(set(fields) - {"d_k"}) == 1  # one setting changed
    assert {r["name"]: r["fields"] for r in rows}["E-learned"] == {
        "positional": "learned"
    }


def test_the_base_runs_three_seeds_every_variation_two_and_a_third_if_needed():
    runner = load_script(SCRIPT, "table3_runner")
    rows = runner.table3_rows(runner.BASE)
    always, if_needed = {}, {}
    for r in rows:
        (if_needed if r["if_needed"] else always).setdefault(r["variation"], []).append(
            r["seed"]
        )
        assert r["fields"].get("seed", 1) == r["seed"]
    assert always.pop("base") == [1, 2, 3] and "base" not in if_needed
    controls = {v for v in always if v.endswith("-lr")}
    assert controls == {"C-d128-lr", "C-d512-lr"}
    for v, seeds in always.items():
        assert seeds == ([1] if v in controls else [1, 2]), v
        assert if_needed[v] == ([2] if v in controls else [3]), v
    # every run the plan always makes comes before any it makes only where needed
    flags = [r["if_needed"] for r in rows]
    assert flags == sorted(flags)


def test_the_budget_is_the_headline_preset_unchanged():
    from machinery import PRESETS

    runner = load_script(SCRIPT, "table3_runner")
    preset = PRESETS[runner.BUDGET["preset"]]
    for field in ("epochs", "warmup", "lr_factor", "batch_tokens"):
        assert runner.BUDGET[field] == getattr(preset, field), field
    for field in ("N", "d_model", "d_ff", "h", "P_drop", "eps_ls"):
        assert runner.BASE[field] == getattr(preset, field), field
    assert runner.BASE["d_k"] == preset.head_size
    # explicit choices, never a timing: the same path and precision on every chip
    assert runner.BUDGET["precision"] != "auto"
    assert runner.BUDGET["attention"] != "auto"
    assert runner.BUDGET["average_last"] == 0  # §6.2: no checkpoint averaging


def test_only_the_rows_wider_than_the_base_train_on_more_threads():
    runner = load_script(SCRIPT, "table3_runner")
    base, budget = runner.BASE, runner.BUDGET
    threads = {
        r["name"]: runner.row_threads(r, base, budget) for r in runner.table3_rows(base)
    }
    wide = {n for n, t in threads.items() if t != budget["threads"]}
    assert wide == {
        "C-d512", "C-d512-seed2", "C-d512-seed3", "C-d512-lr", "C-d512-lr-seed2"
    }  # fmt: skip
    assert {threads[n] for n in wide} == {budget["wide_threads"]} != {budget["threads"]}
    assert threads["C-d128"] == threads["base"] == budget["threads"] == 1


def test_every_row_reuses_freed_memory_as_make_sets_it_however_the_runner_started(
    monkeypatch,
):
    from machinery import GLIBC_MALLOC_SETTINGS

    runner = load_script(ROOT / "benchmarks" / "table3_work.py", "table3_work")
    settings = dict(GLIBC_MALLOC_SETTINGS)
    for name in settings:
        monkeypatch.delenv(name, raising=False)
    env = runner.child_env(2)
    assert {k: env[k] for k in settings} == settings  # started without `make`
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "7")
    assert runner.child_env(1)["MALLOC_MMAP_MAX_"] == "7"  # the caller's own is kept


def test_the_learning_rate_controls_peak_where_the_base_does():
    runner = load_script(SCRIPT, "table3_runner")
    base, lr = runner.BASE, runner.BUDGET["lr_factor"]
    rows = {r["name"]: r for r in runner.table3_rows(base, lr)}

    def peak(d_model: int, factor: float) -> float:  # Eq. 3 at step = warmup
        return factor * d_model**-0.5 * runner.BUDGET["warmup"] ** -0.5

    for name in ("C-d128-lr", "C-d512-lr"):
        fields = rows[name]["fields"]
        assert peak(fields["d_model"], fields["lr_factor"]) == pytest.approx(
            peak(base["d_model"], lr), rel=1e-5
        )
        plain = rows[name.removesuffix("-lr")]["fields"]
        assert peak(plain["d_model"], lr) != pytest.approx(peak(base["d_model"], lr))


def test_a_smoke_table_trains_each_row_and_draws_the_figure(smoke):
    rows = rows_of(smoke)
    assert list(rows) == ["base", "base-seed2", "A-h1", "B-dk4", "E-learned"]
    for r in rows.values():
        assert r["status"] == "done", r
        assert r["provenance"]["updates"] == 5 and r["valid_ppl"] > 1
        assert 0 <= r["bleu_greedy"] <= 100 and 0 <= r["valid_bleu"] <= 100
        assert [c["epoch"] for c in r["curve"]] == [1]  # one epoch, one point
    base = rows["base"]["params"]
    assert rows["A-h1"]["params"] == base  # (A): the same computation, regrouped
    assert rows["B-dk4"]["params"] < base  # (B): smaller query and key projections
    assert rows["E-learned"]["params"] > base  # (E): a table of positions per stack
    png = b"\x89PNG\r\n\x1a\n"
    assert smoke.with_suffix(".png").read_bytes()[:8] == png
    assert smoke.with_name("table3-curves.png").read_bytes()[:8] == png


def test_every_row_records_what_it_ran_with(smoke):
    runner = load_script(SCRIPT, "table3_runner")
    data = json.loads(smoke.read_text())
    budget = runner.SMOKE_BUDGET
    assert data["budget"]["updates"] == 5
    assert data["rule"] == runner.RULE
    for r in data["rows"]:
        seen = r["provenance"]
        assert seen["threads"] == budget["threads"] == 1
        assert seen["precision"] == budget["precision"]
        assert seen["attention"] == budget["attention"]
        assert (seen["warmup"], seen["batch_tokens"]) == (200, 1280)
        assert seen["lr_factor"] == r["fields"].get("lr_factor", budget["lr_factor"])
        assert seen["seed"] == r["seed"] and seen["device_name"]
        assert len(seen["commit"].split("+")[0]) == 40
        assert "settings_differ" not in r  # d_k 0 and d_model/h are one value
        assert r["command"].startswith("OMP_NUM_THREADS=1 ")
        # the source check ran on its last checkpoint, and was kept beside it
        kept = json.loads((ROOT / r["run_dir"] / "source_use.json").read_text())
        assert kept["records"][-1]["gap"] == r["source_gap"]


def test_a_row_with_another_budget_is_not_merged(smoke, tmp_path):
    runner = load_script(SCRIPT, "table3_runner")
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    data = json.loads(before)
    stray = dict(data["rows"][0], name="A-h4")
    stray["provenance"] = dict(stray["provenance"], updates=6)
    order = [r["name"] for r in runner.table3_rows(runner.SMOKE_BASE)]
    args = (runner.SMOKE_BASE, runner.SMOKE_BUDGET, order)
    refusal = runner.merge(data, stray, *args)
    assert "6 updates" in refusal and "5" in refusal
    stray = dict(data["rows"][0], name="A-h4", settings_differ={
        "warmup": {"asked": 200, "ran": 400}})  # fmt: skip
    assert "warmup asked 200, ran 400" in runner.merge(data, stray, *args)
    stray = dict(data["rows"][0], name="A-h4")
    stray["provenance"] = dict(stray["provenance"], threads=2)  # its own count is 1
    assert "ran on 2 thread(s), its budget 1" in runner.merge(data, stray, *args)
    wide = dict(stray, name="C-d128", fields={"d_model": 128, "d_k": 32})
    wide["provenance"] = dict(stray["provenance"], threads=1)  # a wide row's is 2
    assert "ran on 1 thread(s), its budget 2" in runner.merge(data, wide, *args)
    assert data == json.loads(before)  # nothing merged
    assert out.read_bytes() == before


def test_rows_already_in_the_file_are_not_trained_again(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    result = run(out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "5 of 5 run(s) already in" in result.stdout
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
    assert again["provenance"]["updates"] == first["provenance"]["updates"]
    assert again["bleu"] == first["bleu"]  # the same model, scored the same


def test_one_file_holds_one_training_budget(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    result = run(out, "--epochs", "2")
    assert result.returncode == 2
    assert "one file holds one budget" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == before
    # a file without finished rows holds no budget yet: it takes the one asked for
    runner = load_script(SCRIPT, "table3_runner")
    empty = json.loads(before) | {"rows": []}
    out.write_text(json.dumps(empty))
    budget = runner.SMOKE_BUDGET | {"epochs": 2}
    data = runner.read_table(out, runner.SMOKE_BASE, budget, True)
    assert data["budget"]["epochs"] == 2


def test_a_refresh_rewrites_what_derives_from_the_rows_and_trains_nothing(
    smoke, tmp_path
):
    out = tmp_path / "table3.json"
    data = json.loads(smoke.read_text())
    kept = data["rows"]
    out.write_text(json.dumps(data | {"summary": [], "noise": {}, "rule": "old"}))
    result = run(out, "--refresh")
    assert result.returncode == 0, result.stderr[-2000:]
    again = json.loads(out.read_text())
    assert again["rows"] == kept and again["summary"] == data["summary"]
    assert "noise" not in again and again["rule"] != "old"  # the old yardstick goes
    assert not (tmp_path / "table3-runs").exists()  # no row trained
    assert out.with_suffix(".png").is_file()


def test_the_recorded_table_is_read_unchanged_and_its_summary_is_current():
    runner = load_script(SCRIPT, "table3_runner")
    path = ROOT / "results" / "table3.json"
    data = json.loads(path.read_text())
    again = runner.refreshed(
        runner.read_table(path, runner.BASE, runner.BUDGET, False),
        runner.BASE,
        runner.BUDGET,
    )
    assert again["rows"] == data["rows"]  # every row as it was recorded
    # what derives from the rows is what this version of the driver derives
    assert json.loads(json.dumps(again["summary"])) == data["summary"]
    assert again["rule"] == data["rule"] and again["plan"] == data["plan"]


def test_the_status_says_how_far_each_row_has_got_and_writes_nothing(smoke, tmp_path):
    out = tmp_path / "table3.json"
    data = json.loads(smoke.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    del rows["base-seed2"]["provenance"]["hypotheses_sha256"]  # recorded before kept
    for name in ("A-h1", "B-dk4"):
        rows[name]["provenance"]["epoch1_check"] = {"match": False}
    rows["B-dk4"]["curve"][0]["valid_ppl"] = math.exp(1.5)
    out.write_text(json.dumps(data))
    before = out.read_bytes()
    metrics = {
        "A-h1-seed2": [{"step": 2}, {"step": 4}],
        "A-h1": [{"step": 3}],  # the failed check's row, training again
        "B-dk4": [{"step": 5, "epoch": 1, "valid_loss": 1.5}],  # its recorded run
    }
    for name, lines in metrics.items():
        started = tmp_path / "table3-runs" / name
        started.mkdir(parents=True)
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (started / "metrics.jsonl").write_text(text)
    result = run(out, "--status", "--rows", "base,A,B,C,D,E")  # every planned row
    assert result.returncode == 0, result.stderr[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert lines["base"][:3] == ["done", "valid", "BLEU"]
    assert lines["A-h1-seed2"] == ["started", "update", "4", "of", "5"]
    # runs that train again say so, started or not
    assert " ".join(lines["A-h1"]) == (
        "started update 3 of 5; trained again: its epoch-1 check failed"
    )
    assert " ".join(lines["base-seed2"]) == (
        "to run trained again: its validation translations were not kept"
    )
    assert " ".join(lines["B-dk4"]) == "to run trained again: its epoch-1 check failed"
    assert lines["B-dk4-seed2"] == ["to", "run"]
    assert lines["C-d128-lr-seed2"][:2] == ["not", "needed"]  # a control's second
    assert " ".join(lines["A-h1-seed3"]).startswith("waiting a third seed is decided")
    runner = load_script(SCRIPT, "table3_runner")
    plan = runner.table3_rows(runner.SMOKE_BASE)
    third = sum(r["if_needed"] and not r["control"] for r in plan)
    counts = [x for x in result.stdout.splitlines() if x.endswith("to run")][-1]
    assert counts == (
        f"{len(plan)} runs: 2 done, 2 started, 2 not needed, {third} waiting, "
        f"{len(plan) - 6 - third} to run"
    )
    assert out.read_bytes() == before  # a look, not a run
    assert not (tmp_path / "table3-runs" / "B-dk4-seed2").exists()
    assert (tmp_path / "table3-runs" / "B-dk4" / "metrics.jsonl").is_file()  # kept


def test_part_4_shows_the_file_as_a_table_and_claims_nothing_unmeasured(smoke):
    from machinery import read_table3

    table = read_table3(smoke)
    lines = table.markdown().split("\n\n")[0].splitlines()  # the first table
    header = [h.strip() for h in lines[0].split("|")]
    for column in ("paper row", "Δ BLEU (95% CI)", "BLEU verdict", "PPL verdict"):
        assert column in header
    body = {
        line.split("|")[1].strip(): line for line in lines[2:] if line.startswith("| ")
    }
    runner = load_script(SCRIPT, "table3_runner")
    planned = [r["variation"] for r in runner.table3_rows(runner.SMOKE_BASE)]
    assert list(body) == list(dict.fromkeys(planned))  # every variation, in run order
    assert all(len(line.split("|")) == len(header) for line in body.values())
    for name in ("base", "A-h1", "B-dk4", "E-learned"):  # trained: our numbers
        assert "not yet run" not in body[name]
    assert "not yet run" in body["C-N3"]  # the paper's columns only
    cell = lambda name, column: body[name].split("|")[header.index(column)].strip()  # noqa: E731
    assert cell("A-h1", "paper row") == "(A) h=1, d_k=512"  # the row it is read by
    assert cell("C-d128-lr", "paper row") == "—"  # a control: no paper row
    assert "float32, fast attention, 1 thread (2 for a row wider than the base)" in (
        table.budget_line
    )
    findings = table.findings()
    # groups (C) and (D) have no finished row: no finding, only that fact
    for g in "CD":
        assert f"**({g})** Not yet measured at the full budget." in findings
    assert [p for p, _ in table.figures()] == [
        str(smoke.with_name("table3-curves.png")),
        str(smoke.with_name("table3.png")),
    ]
    # more to run; five updates are too few to learn to read the source
    assert cell("base", "seeds") == "2 of 3 (2 failed)"
    assert cell("A-h1", "seeds") == "1 of 2 (1 failed)"
    # no seed of the base trained: no verdict is read against it, and none counted
    assert cell("B-dk4", "BLEU verdict") in ("fails to train", "base fails to train")
    counts = table.counts("bleu")
    assert counts["agrees"] == counts["disagrees"] == 0
    assert counts["no difference detected"] == 0
    group_a = findings.split("**(A)**")[1].split("**(B)**")[0]
    # a measured group names each of its variations that has no finished run yet
    unmeasured = group_a.split("Not yet measured at the full budget: ")[1]
    for name in planned:
        if name.startswith("A-"):
            assert (f"({name})" in unmeasured) == ("not yet run" in body[name]), name


SOURCE_USE = ROOT / "benchmarks" / "source_use.py"


def source_use(out: Path, *run_dirs: Path) -> subprocess.CompletedProcess:
    """``source_use.py --out OUT RUN_DIRS`` with one thread."""
    return subprocess.run(
        [sys.executable, str(SOURCE_USE), "--out", str(out), *map(str, run_dirs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def test_another_source_is_always_another_pairs():
    check = load_script(SOURCE_USE, "source_use_check")
    for n in (2, 3, 10, 1014):
        pairs = [(f"src{i}", f"tgt{i}") for i in range(n)]
        mixed = check.other_sources(pairs)
        assert [t for _, t in mixed] == [t for _, t in pairs]  # the targets stay
        assert all(s != f"src{i}" for i, (s, _) in enumerate(mixed))
        assert sorted(s for s, _ in mixed) == sorted(s for s, _ in pairs)  # each once


def test_the_source_check_reproduces_the_runs_own_validation_loss(smoke, tmp_path):
    run_dir = smoke.parent / "table3-runs" / "base"
    out = tmp_path / "source.json"
    assert source_use(out, run_dir).returncode == 0
    (rec,) = json.loads(out.read_text())["records"]
    logged = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in logged if "valid_loss" in r][-1]
    assert rec["step"] == last["step"]
    assert abs(rec["valid_loss"] - last["valid_loss"]) <= 1e-4
    assert rec["logged_valid_loss"] == last["valid_loss"]  # what it was checked on
    assert rec["threads"] == 1 and rec["machine"]
    assert source_use(out, run_dir).returncode == 0  # again: replaced, not added
    assert len(json.loads(out.read_text())["records"]) == 1


def test_the_source_check_refuses_data_the_run_did_not_train_on(smoke, tmp_path):
    run_dir = tmp_path / "base"
    shutil.copytree(smoke.parent / "table3-runs" / "base", run_dir)
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in lines:
        if "valid_loss" in r:
            r["valid_loss"] += 0.5  # as if the run had seen other validation data
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = source_use(tmp_path / "source.json", run_dir)
    assert result.returncode != 0
    assert "not the data or vocabulary it trained on" in result.stderr
    assert not (tmp_path / "source.json").exists()


def made_up_row(runner, name: str, bleu: float, ppl: float = 5.0, gap=4.4, curve=None):
    """A finished Table 3 record with made-up scores, for the plan's run ``name``."""
    plan = {r["name"]: r for r in runner.table3_rows(runner.BASE)}
    r = plan[name]
    curve = curve or [{"epoch": e, "valid_ppl": ppl * (1 + 0.01 / e)} for e in (1, 2)]
    return {"name": name, "variation": r["variation"], "group": r["group"],
            "seed": r["seed"], "status": "done", "valid_bleu": bleu,
            "valid_ppl": ppl, "bleu": bleu, "params": 10, "source_gap": gap,
            "paper": runner.paper_values(r["paper_row"]), "curve": curve,
            "provenance": {"threads": 1, "updates": 9}}  # fmt: skip


def test_a_run_that_does_not_read_its_source_failed_to_train():
    runner = load_script(SCRIPT, "table3_runner")

    def row(name, bleu, gap):
        return made_up_row(runner, name, bleu, gap=gap)

    # the gap: how much the validation loss rises with other pairs' sources
    data = {"rows": [row("base", 40.0, 4.4), row("base-seed2", 41.0, 4.4),
                     row("base-seed3", 42.0, 4.3),
                     row("A-h1", 5.0, 0.5), row("A-h1-seed2", 37.0, 4.0),
                     row("A-h4", 40.5, 4.0), row("A-h4-seed2", 41.4, 4.0),
                     row("D-drop0.2", 5.5, 0.48), row("D-drop0.2-seed2", 6.0, 0.3)]}  # fmt: skip
    assert not runner.trained(data["rows"][3]) and runner.trained(data["rows"][4])
    assert runner.trained({"valid_bleu": 40.0})  # not measured: counted as trained
    summary = {s["variation"]: s for s in runner.summarise(data)}
    h1 = summary["A-h1"]
    assert h1["seeds"] == [1, 2] and h1["failed_seeds"] == [1]
    assert h1["valid_bleu"]["mean"] == 37.0 and h1["valid_bleu"]["n"] == 1
    assert "a seed failed to train" in h1["qualifiers"]
    # a failed seed enters no test: A-h1's difference is its trained seed 2 against
    # the base's seed 2 (41.0), less the seed effect the other rows show
    assert h1["tests"]["bleu"]["delta"] == pytest.approx(37.0 - 41.0, abs=0.6)
    assert h1["counted"]["bleu"] != "agrees"  # a failed seed: never counted as such
    drop = summary["D-drop0.2"]
    assert (
        drop["failed_seeds"] == [1, 2] and drop["verdict"]["bleu"] == "fails to train"
    )
    assert drop["valid_bleu"]["n"] == 2  # the table still shows what they scored
    assert "bleu" not in drop["tests"]

    from machinery.table3view import Table3

    data |= {"summary": list(summary.values()), "plan": runner.plan_of(
        runner.BASE, runner.BUDGET)}  # fmt: skip
    table = Table3(data, Path("."))
    lines = table.markdown().split("\n\n")[0].splitlines()  # the first table
    body = {line.split("|")[1].strip(): line for line in lines if line.startswith("|")}
    assert "| 2 (1 failed) |" in body["A-h1"]
    assert "fails to train" in body["D-drop0.2"]
    group_d = table.findings().split("**(D)**")[1]
    assert "2 seeds, none trained" in group_d and "**fails to train**" in group_d
    assert "seed 1 failed to train: its validation loss rose 0.48 nats" in group_d
    # no seed of the base trained: no verdict is read against it
    for r in data["rows"][:3]:
        r["source_gap"] = 0.1
    summary = {s["variation"]: s for s in runner.summarise(data)}
    assert summary["A-h4"]["verdict"]["bleu"] == "base fails to train"
    assert summary["D-drop0.2"]["verdict"]["bleu"] == "fails to train"


def test_part_4_says_which_seed_over_fits_from_its_curve():
    from machinery.table3view import Table3

    def row(name, variation, seed, ppls):
        curve = [{"epoch": e + 1, "valid_ppl": p} for e, p in enumerate(ppls)]
        return {"name": name, "variation": variation, "seed": seed, "curve": curve}

    table = Table3(
        {"rows": [row("D-drop0.0", "D-drop0.0", 1, [9.0, 6.2, 6.5, 7.7]),
                  row("D-drop0.0-seed2", "D-drop0.0", 2, [9.0, 6.0, 6.1, 6.2]),
                  row("base", "base", 1, [9.0, 5.5, 5.4, 5.45])]},
        Path("."),
    )  # fmt: skip
    note = table._overfits("D-drop0.0")
    assert note == (
        "; seed 1's validation perplexity was lowest after epoch 2 (6.20) and rose "
        "to 7.70 by epoch 4: it over-fits"
    )  # seed 2 ends 3% above its lowest: within the 5%
    assert table._overfits("base") == ""  # 1% above its lowest


def test_part_4_says_which_seed_was_still_learning_when_its_schedule_ended():
    from machinery.table3view import Table3

    def row(name, variation, seed, ppls):
        curve = [{"epoch": e + 1, "valid_ppl": p} for e, p in enumerate(ppls)]
        return {"name": name, "variation": variation, "seed": seed, "curve": curve}

    table = Table3(
        {"rows": [row("C-N4", "C-N4", 1, [40.0, 20.0, 13.0, 12.5, 12.0, 11.5]),
                  row("C-N4-seed2", "C-N4", 2, [40.0, 20.0, 6.0, 5.8, 5.7, 5.5]),
                  row("base", "base", 1, [9.0, 5.7, 5.6, 5.5, 5.45, 5.42]),
                  row("A-h1", "A-h1", 1, [30.0, 20.0, 12.0])]},
        Path("."),
    )  # fmt: skip
    assert table._still_learning("C-N4") == (
        "; seed 1's validation perplexity still fell 12% over its last three epochs "
        "(13.00 after epoch 3, 11.50 after 6): it was still learning when its "
        "schedule ended"
    )  # seed 2 fell 8%: within the 10%
    assert table._still_learning("base") == ""  # 5% over its last three epochs
    assert table._still_learning("A-h1") == ""  # too short a curve to say
    assert "it was still learning" not in table._overfits("C-N4")


def test_the_curves_give_each_variation_its_own_colour_never_the_bases_grey(
    tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    runner = load_script(SCRIPT, "table3_runner")
    names = ["N2", "N4", "d128", "d512", "ff512", "ff2048", "d128-lr", "d512-lr"]

    def row(name, group, seed):
        curve = [{"epoch": e, "valid_ppl": 10.0 / e} for e in (1, 2, 3)]
        return {"name": name if seed == 1 else f"{name}-seed{seed}", "seed": seed,
                "variation": name, "group": group, "status": "done",
                "valid_bleu": 40.0, "curve": curve}  # fmt: skip

    rows = [row("base", "base", s) for s in (1, 2, 3)]
    rows += [row(f"C-{n}", "C", s) for n in names for s in (1, 2)]
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure to look at
    runner.draw_curves({"rows": rows}, tmp_path / "curves.png")
    panel = drawn[0].axes[2]
    assert panel.get_title() == "(C)"
    legend = [t.get_text() for t in panel.get_legend().get_texts()]
    assert legend == [f"C-{n}" for n in names]  # one entry a variation, seeds apart
    lines = panel.get_lines()
    base, ours = lines[:3], lines[3:]
    assert all(to_rgb(line.get_color()) == to_rgb("0.6") for line in base)
    colours = [to_rgb(line.get_color()) for line in ours]
    greys = {to_rgb("0.6"), to_rgb(plt.get_cmap("tab10").colors[7])}
    assert not greys & set(colours)
    assert len(set(colours)) == len(names)  # eight variations, eight colours
    for first, second in zip(ours[::2], ours[1::2]):  # seed 1, then its seed 2
        assert first.get_color() == second.get_color()
        assert (first.get_linestyle(), second.get_linestyle()) == ("-", "--")
    monkeypatch.undo()
    plt.close(drawn[0])


STATS = ROOT / "benchmarks" / "table3_stats.py"


def stats_module():
    return load_script(STATS, "table3_stats")


def test_the_test_rejects_five_percent_of_true_nulls_and_holm_holds_the_family():
    stats = stats_module()
    design = {"base": 3} | {f"v{i}": 2 for i in range(17)}  # Table 3's shape
    rates = stats.simulate_false_positives(1000, design)  # read as the file is
    assert 0.04 <= rates["single"] <= 0.06  # each test: 5% when nothing differs
    assert rates["family"] <= 0.06  # Holm: any false "differs" in ≤ 5% of tables
    assert rates["apart"] <= 0.015  # one σ for all: a row set apart in ≤ 1% of tables
    mixed = {"base": 3} | {f"v{i}": 1 + i % 2 for i in range(17)}  # one or two
    assert 0.04 <= stats.simulate_false_positives(1000, mixed)["single"] <= 0.06


def test_more_seeds_never_lower_the_tests_power():
    stats = stats_module()
    rest = {"base": 3} | {f"v{i}": 2 for i in range(16)}
    for delta in (0.5, 1.0, 1.6):
        power = [stats.design_power(delta, n, 0.54, rest) for n in (1, 2, 3, 4)]
        assert all(b >= a - 1e-12 for a, b in zip(power, power[1:])), (delta, power)
        assert power[1] > power[0]  # a second seed helps
    more_base = [
        stats.design_power(1.0, 2, 0.54, rest | {"base": b}) for b in (2, 3, 4)
    ]
    assert all(b >= a - 1e-12 for a, b in zip(more_base, more_base[1:]))


def made_up_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` made-up reference sentences of 8–14 words from a small vocabulary."""
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)]
    return [" ".join(rng.choices(words, k=rng.randint(8, 14))) for _ in range(n)]


def damaged(sentence: str) -> str:
    """A worse translation of ``sentence``: its second half's words reversed."""
    words = sentence.split()
    half = len(words) // 2
    return " ".join(words[:half] + words[half:][::-1])


def test_the_sentence_level_test_tells_a_better_system_from_an_equal_one():
    stats = stats_module()
    refs = made_up_sentences(200)
    worse = [damaged(r) for r in refs]
    clear = stats.paired_bleu_test(worse, refs, refs, trials=2000)
    assert clear["delta"] > 20 and clear["p"] == 1 / 2001  # no trial reached it
    assert abs(clear["variation"] - 100) < 1e-9 and clear["sentences"] == 200
    # each system right on a different half of the sentences: equally good
    a = [r if i % 2 else damaged(r) for i, r in enumerate(refs)]
    b = [damaged(r) if i % 2 else r for i, r in enumerate(refs)]
    even = stats.paired_bleu_test(a, b, refs, trials=2000)
    assert abs(even["delta"]) < 2 and even["p"] > 0.2
    assert stats.paired_bleu_test(a, b, refs, trials=2000) == even  # seeded
    same = stats.paired_bleu_test(a, list(a), refs, trials=2000)
    assert (same["delta"], same["p"]) == (0, 1.0)  # no difference at all
    with pytest.raises(ValueError, match="as many translations as references"):
        stats.paired_bleu_test(a[:-1], b, refs)


def test_each_run_is_paired_with_its_seeds_base_sentence_by_sentence(
    smoke, monkeypatch
):
    import sacrebleu

    runner = load_script(SCRIPT, "table3_runner")
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DATA", str(smoke.parent / "data"))
    rows = rows_of(smoke)
    folder = smoke.with_name("table3-hypotheses")
    import hashlib

    for r in rows.values():  # every run's translations kept beside the table
        kept = (folder / f"{r['name']}.txt").read_bytes()
        assert hashlib.sha256(kept).hexdigest() == r["provenance"]["hypotheses_sha256"]
        assert len(kept.decode().split("\n")) == 20 + 1  # --first 20, each ended
        # and the test set's, the very sentences its test BLEU scored
        test = (folder / "test" / f"{r['name']}.txt").read_bytes()
        sha = r["provenance"]["test_hypotheses_sha256"]
        assert hashlib.sha256(test).hexdigest() == sha
        lines = test.decode().split("\n")[:-1]
        assert len(lines) == r["test_sentences"]
        refs, tokenize = runner.valid_references(runner.SMOKE_BUDGET, r["seed"], "test")
        score = sacrebleu.BLEU(tokenize=tokenize).corpus_score(
            lines, [refs[: len(lines)]]
        )
        assert abs(score.score - r["bleu"]) < 1e-9
    base = rows["base"]
    for name in ("A-h1", "B-dk4", "E-learned"):
        paired = rows[name]["paired"]
        assert paired["against"] == "base"
        assert paired["base_sha256"] == base["provenance"]["hypotheses_sha256"]
        # the kept translations and the references give the recorded scores back
        assert abs(paired["base"] - base["valid_bleu"]) < 0.006
        assert abs(paired["variation"] - rows[name]["valid_bleu"]) < 0.006
        assert 0 < paired["p"] <= 1 and paired["sentences"] == 20
    assert "paired" not in base and "paired" not in rows["base-seed2"]
    summary = {e["variation"]: e for e in json.loads(smoke.read_text())["summary"]}
    assert summary["A-h1"]["paired"] == [
        {"seed": 1, "delta": rows["A-h1"]["paired"]["delta"],
         "p": rows["A-h1"]["paired"]["p"]}
    ]  # fmt: skip


def test_holm_stops_at_the_first_p_value_above_its_level():
    stats = stats_module()
    got = stats.holm_levels({"a": 0.001, "b": 0.02, "c": 0.011, "d": 0.5})
    assert {k: v["level"] for k, v in got.items()} == pytest.approx(
        {"a": 0.05 / 4, "c": 0.05 / 3, "b": 0.05 / 2, "d": 0.05}
    )
    assert {k for k, v in got.items() if v["rejected"]} == {"a", "b", "c"}
    # c's 0.04 is within its 0.05, but b's 0.03 above its 0.025 stops the step-down
    got = stats.holm_levels({"a": 0.001, "b": 0.03, "c": 0.04})
    assert [got[k]["rejected"] for k in "abc"] == [True, False, False]


def test_seeds_are_compared_with_seeds():
    stats = stats_module()
    # seed 2 lifts every row by 3 BLEU; the variation is 1 below the base at each
    runs = [("base", 1, 40.0), ("base", 2, 43.0), ("base", 3, 40.5),
            ("v", 1, 39.0), ("v", 2, 42.0), ("w", 1, 40.2), ("w", 2, 43.1)]  # fmt: skip
    model = stats.fit(runs)
    c = stats.contrast(model, "v")
    assert c["delta"] == pytest.approx(-1.0 - 0.5 / 3 + 0.5 / 3 - 0.5 / 3, abs=0.35)
    # ignoring the seeds would spread the base's 40, 43, 40.5 into the noise
    pooled = stats.fit([(v, 1, y) for v, _, y in runs])
    assert model["sigma"] < pooled["sigma"] / 3


def test_the_words_say_what_the_runs_show():
    runner = load_script(SCRIPT, "table3_runner")
    found = {"word": "agrees", "detectable": 2.0, "detectable_pct": 5.0}
    assert runner.verdict_words(found, [], "bleu") == ("agrees", "agrees")
    late = ["still learning at the end of its schedule"]
    said, counted = runner.verdict_words(found, ["one seed", *late], "bleu")
    assert said == "agrees (one seed; still learning at the end of its schedule)"
    assert counted == "not counted"  # agreeing in sign only is not agreement
    assert runner.verdict_words(found, ["one seed"], "bleu")[1] == "agrees"
    missed = {"word": "no difference detected", "detectable": 1.93}
    assert runner.verdict_words(missed, [], "bleu") == (
        "no difference detected (the test would see ≥ 1.93 BLEU)",
        "no difference detected",
    )  # never called agreement, even where the paper saw no change
    stats = stats_module()
    assert stats.sign_word(-2.0, -0.9, "bleu") == "agrees"
    assert stats.sign_word(+2.0, -0.9, "bleu") == "disagrees"
    assert stats.sign_word(-2.0, 25.7 - 25.8, "bleu") == "disagrees"  # paper: none
    assert stats.sign_word(-2.0, 25.6 - 25.8, "bleu") == "agrees"  # two steps


def test_a_variation_still_learning_enters_no_test_and_leaves_the_noise_alone():
    runner = load_script(SCRIPT, "table3_runner")
    late = [{"epoch": e, "valid_ppl": 30.0 - 2 * e} for e in range(1, 9)]  # falling

    def row(name, bleu, curve=None):
        return made_up_row(runner, name, bleu, curve=curve)

    steady = [row("base", 40.0), row("base-seed2", 40.9), row("base-seed3", 40.2),
              row("A-h4", 39.9), row("A-h4-seed2", 40.6),
              row("A-h1", 37.0), row("A-h1-seed2", 37.8)]  # fmt: skip
    # C-d128's pattern: one seed as good as the base, the other still learning far
    # below it
    split = [row("C-d128", 15.6, late), row("C-d128-seed2", 40.8)]
    alone = runner.summarise({"rows": steady})
    both = runner.summarise({"rows": steady + split})
    test = {s["variation"]: s["tests"]["bleu"] for s in both if s.get("tests")}
    assert runner.unsettled({"rows": steady + split}) == {"C-d128"}
    assert "C-d128" not in test  # no test, and
    for s in alone:  # every other test is as it was without it
        if s.get("tests"):
            assert test[s["variation"]]["se"] == s["tests"]["bleu"]["se"]
    d128 = next(s for s in both if s["variation"] == "C-d128")
    assert d128["verdict"]["bleu"] == (
        "not tested (still learning at the end of its schedule)"
    )
    assert d128["counted"] == {"bleu": "not counted", "ppl": "not counted"}
    # a learning-rate control of an untested width is read against the base
    control = runner.summarise({"rows": steady + split + [row("C-d128-lr", 40.0)]})
    lr = next(s for s in control if s["variation"] == "C-d128-lr")
    assert lr["tests"]["bleu"]["against"] == "base"


def test_the_check_of_sigma_sets_a_row_apart_in_1pct_of_tables_and_finds_a_noisy_one():
    stats = stats_module()
    rng = __import__("numpy").random.default_rng(7)
    apart = {"equal": 0, "noisy": 0}
    for _ in range(2000):
        d = {f"v{i}": rng.normal(0.9, 0.8) for i in range(17)}  # 17 rows' seed 2 − 1
        values = {v: {1: 40.0, 2: 40.0 + x} for v, x in d.items()}
        apart["equal"] += any(s["apart"] for s in stats.spread_apart(values))
        values["v0"][2] = 40.0 + rng.normal(0.9, 0.8 * 8)  # one row 8× as noisy
        steps = stats.spread_apart(values)
        apart["noisy"] += any(s["apart"] and s["variation"] == "v0" for s in steps)
    assert 0.004 <= apart["equal"] / 2000 <= 0.015  # the check's stated 1%, at most
    assert apart["noisy"] / 2000 > 0.5  # a row 8× noisier than the rest: mostly found
    assert stats.grubbs_p(stats.grubbs_critical(17), 17) == pytest.approx(0.01)


def test_a_variation_whose_seeds_lie_far_apart_is_paired_and_leaves_the_noise_alone():
    runner = load_script(SCRIPT, "table3_runner")

    def row(name, bleu, ppl=5.0):
        return made_up_row(runner, name, bleu, ppl=ppl)

    # seed 2 lies 0.4–1.2 above seed 1 in every row but C-N4's, 4 below
    steady = [row("base", 40.0), row("base-seed2", 40.9), row("base-seed3", 40.2),
              row("A-h4", 39.9), row("A-h4-seed2", 40.6),
              row("A-h1", 37.0), row("A-h1-seed2", 37.8),
              row("A-h16", 39.0), row("A-h16-seed2", 40.2),
              row("A-h32", 38.0), row("A-h32-seed2", 38.4),
              row("B-dk8", 38.5), row("B-dk8-seed2", 39.5)]  # fmt: skip
    apart = [row("C-N4", 19.0), row("C-N4-seed2", 15.0)]
    alone = runner.summarise({"rows": steady})
    both = runner.summarise({"rows": steady + apart})
    test = {s["variation"]: s["tests"]["bleu"] for s in both if s.get("tests")}
    for s in alone:  # every other test is as it was without it
        if s.get("tests"):
            assert test[s["variation"]]["se"] == pytest.approx(s["tests"]["bleu"]["se"])
    n4 = test["C-N4"]
    assert n4["apart"] and n4["paired_seeds"] == [1, 2] and n4["dof"] == 1
    assert n4["delta"] == pytest.approx(((19.0 - 40.0) + (15.0 - 40.9)) / 2)
    assert n4["spread_check"][0]["variation"] == "C-N4"
    verdict = next(s for s in both if s["variation"] == "C-N4")["verdict"]["bleu"]
    assert verdict.endswith("(its seeds lie far apart: compared seed by seed)")
    # without the check the pooled σ takes C-N4's spread: every other test loses power
    stats = stats_module()
    values = {
        s["variation"]: {r["seed"]: r["valid_bleu"] for r in steady + apart
                         if r["variation"] == s["variation"]}
        for s in both
    }  # fmt: skip
    pooled = stats.fit([(v, k, y) for v, ys in values.items() for k, y in ys.items()])
    assert stats.contrast(pooled, "A-h1")["se"] > 2 * test["A-h1"]["se"]


def test_the_checks_critical_values_are_grubbss_and_power_is_read_exactly():
    stats = stats_module()
    # Grubbs's published two-sided critical values
    assert stats.grubbs_critical(10, 0.05) == pytest.approx(2.290, abs=5e-4)
    assert stats.grubbs_critical(17, 0.05) == pytest.approx(2.620, abs=5e-4)
    assert stats.grubbs_critical(17, 0.01) == pytest.approx(2.894, abs=5e-4)
    for dof in (1, 2, 15):  # the detectable difference is detected 80% of the time
        x = stats.detectable(0.7, 0.005, dof)
        assert stats.power_at(x, 0.7, 0.005, dof) == pytest.approx(0.8, abs=1e-6)
    assert stats.t_test(0.0, 0.0, 3)[1] == 1.0  # no spread and no difference
    assert stats.t_test(0.5, 0.0, 3)[1] == 0.0


def test_a_row_set_apart_with_too_few_shared_seeds_is_said_not_dropped():
    runner = load_script(SCRIPT, "table3_runner")
    from machinery.table3view import UNCOMPARED, Table3

    def row(name, bleu):
        return made_up_row(runner, name, bleu)

    two = {"A-h4": 39.9, "A-h1": 37.0, "A-h16": 39.0, "A-h32": 38.0, "B-dk8": 38.5,
           "B-dk16": 39.4, "D-ls0.0": 39.1, "D-ls0.2": 40.1, "C-d512": 39.6}  # fmt: skip
    rows = [row("base", 40.0), row("base-seed2", 46.0), row("base-seed3", 40.2)]
    for i, (v, bleu) in enumerate(two.items()):  # seed 2 lies 0.4–1.2 above seed 1
        rows += [row(v, bleu), row(f"{v}-seed2", bleu + 0.4 + 0.1 * i)]
    rows += [row("E-learned", 39.0), row("C-d512-lr", 38.0)]  # one seed each
    plan = {r["name"]: r for r in runner.table3_rows(runner.BASE)}
    for r in rows:  # what the view names a row by
        r["fields"] = plan[r["name"]]["fields"]
    data = {"rows": rows}
    summary = {s["variation"]: s for s in runner.summarise(data)}
    assert summary["A-h1"]["tests"]["bleu"]["spread_check"][0]["variation"] == "base"
    # one seed against a base set apart: no paired test, said and not counted
    assert summary["E-learned"]["verdict"]["bleu"] == UNCOMPARED
    assert summary["E-learned"]["counted"]["bleu"] == "not counted"
    assert "bleu" not in summary["E-learned"]["tests"]
    assert "apart" not in summary["E-learned"]["tests"]["ppl"]  # one σ fits its ppl
    lr = summary["C-d512-lr"]["tests"]["bleu"]
    assert lr["against"] == "C-d512" and "vs_base" not in lr
    table = Table3(data | {"summary": list(summary.values()), "budget": None}, ROOT)
    said = table.findings()
    assert "no comparison with the base" in said
    assert "or, a row's seeds set apart, too few seeds for a paired test)" in said
    # a width set apart, and its one-seed control: read against the base instead
    rows[:3] = [row("base", 40.0), row("base-seed2", 40.6), row("base-seed3", 40.2)]
    rows[-3] = row("C-d512-seed2", 33.0)
    summary = {s["variation"]: s for s in runner.summarise({"rows": rows})}
    assert summary["C-d512"]["tests"]["bleu"]["apart"]
    assert summary["C-d512-lr"]["tests"]["bleu"]["against"] == "base"


def full_table(runner, bleu_of) -> dict:
    """Made-up records for every run the plan always makes; ``bleu_of(variation,
    seed)`` gives each its validation BLEU."""
    rows = [r for r in runner.table3_rows(runner.BASE) if not r["if_needed"]]
    records = [
        made_up_row(runner, r["name"], bleu_of(r["variation"], r["seed"])) for r in rows
    ]
    return {"rows": records}


def test_a_third_seed_runs_only_where_a_test_lies_near_its_threshold():
    runner = load_script(SCRIPT, "table3_runner")
    plan = {r["name"]: r for r in runner.table3_rows(runner.BASE)}
    noise = {1: 0.0, 2: 0.3, 3: -0.2}
    shift = {"A-h1": -6.0}

    def bleu(v, seed):  # seed effects and a residual spread, the same every run
        spread = 0.25 * ((sum(map(ord, v)) + 7 * seed) % 5 - 2)
        return 40.0 + shift.get(v, 0.0) + noise[seed] + spread

    args = (runner.BASE, runner.BUDGET)
    data = full_table(runner, bleu)
    assert runner.decide(plan["A-h1-seed3"], data, *args)[0] == "skip"  # far beyond
    assert runner.decide(plan["C-d128-lr-seed2"], data, *args)[0] == "skip"
    for r in data["rows"]:  # a variation still learning enters no test: no third seed
        if r["name"] == "C-d128":
            r["curve"] = [{"epoch": e, "valid_ppl": 30.0 - 2 * e} for e in range(1, 9)]
    verb, why = runner.decide(plan["C-d128-seed3"], data, *args)
    assert (verb, why) == (
        "skip",
        "no test to decide: not tested (still learning at the end of its schedule)",
    )
    seen = set()
    for step in range(80):  # move A-h4 away from the base until its test is near
        shift["A-h4"] = -0.05 * step
        data = full_table(runner, bleu)
        test = next(s for s in runner.summarise(data) if s["variation"] == "A-h4")
        near = any(t["near_threshold"] for t in test["tests"].values())
        verb = runner.decide(plan["A-h4-seed3"], data, *args)[0]
        assert verb == ("run" if near else "skip"), (shift["A-h4"], test["tests"])
        seen.add(verb)
    assert seen == {"run", "skip"}  # both were met on the way
    shift["A-h4"] = 0.0
    data = full_table(runner, bleu)
    assert runner.decide(plan["C-N4-seed3"], data, *args)[0] == "skip"
    for r in data["rows"]:  # C-N4's seeds lie far apart: a third seed runs
        if r["name"] == "C-N4-seed2":
            r["valid_bleu"] -= 6.0
    test = next(s for s in runner.summarise(data) if s["variation"] == "C-N4")
    assert test["tests"]["bleu"]["apart"]
    assert runner.decide(plan["C-N4-seed3"], data, *args)[0] == "run"
    data["rows"] = data["rows"][1:]  # a run the plan always makes is missing
    assert runner.decide(plan["A-h4-seed3"], data, *args)[0] == "wait"


def test_a_row_whose_process_is_killed_names_the_signal_and_is_left_to_resume(tmp_path):
    work = load_script(ROOT / "benchmarks" / "table3_work.py", "table3_work")
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    job = work.RowJob(
        kind="row", record={"name": "A-h1", "passed": {}}, run_dir=str(tmp_path),
        train=[sys.executable, "-c", suicide], threads=1, python=sys.executable,
        budget={}, started={}, overrides={},
    )  # fmt: skip
    record = job()
    assert record["status"] == "interrupted" and record["signal"] == "SIGKILL"
    assert record["ran_on"]["host"] and record["ran_on"]["engine"] == "local"


def test_a_failed_checks_run_is_set_aside_but_the_rows_new_training_is_kept(tmp_path):
    runner = load_script(SCRIPT, "table3_runner")
    record = {"curve": [{"epoch": 1, "valid_ppl": math.exp(5.17)}]}

    def run_dir(valid_loss, finished):
        folder = tmp_path / "C-N4"
        folder.mkdir()
        lines = [{"step": 50, "epoch": 1, "train_loss": 8.6}]
        if valid_loss is not None:
            lines.append({"step": 215, "epoch": 1, "valid_loss": valid_loss})
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (folder / "metrics.jsonl").write_text(text)
        if finished:
            (folder / "results.json").write_text("{}")
        return folder

    runner.set_aside(run_dir(5.17, True), record)  # the run the record came from
    assert not (tmp_path / "C-N4").exists()
    assert [p.name.split(".")[1][:12] for p in tmp_path.iterdir()] == ["failed-check"]
    for valid_loss, finished in ((None, False), (5.1668, False), (5.1668, True)):
        kept = run_dir(valid_loss, finished)  # new training: stopped early, mid-way,
        runner.set_aside(kept, record)  # or trained but not yet scored
        assert (kept / "metrics.jsonl").is_file()
        shutil.rmtree(kept)


def test_a_base_run_recorded_without_its_translations_trains_again():
    # every variation's paired test needs its seed's base run's translations
    runner = load_script(SCRIPT, "table3_runner")
    scores = {"valid_ppl": 11.2, "valid_bleu": 40.58, "bleu": 41.0}
    old = {"name": "base", "group": "base", "status": "done", **scores,
           "provenance": {"commit": "a" * 40}}  # fmt: skip
    kept = {"hypotheses_sha256": "f" * 64}
    variation = {"name": "A-h1", "group": "A", "status": "done", "provenance": {}}
    seed2 = {**old, "name": "base-seed2", "provenance": kept}
    data = {"rows": [old, seed2, variation]}
    assert runner.untranslated_base(old) and not runner.untranslated_base(seed2)
    assert not runner.untranslated_base(variation)  # variations are not retrained
    assert runner.finished_names(data) == {"base-seed2", "A-h1"}
    # trained again: the earlier scores and commit kept, and whether they came back
    again = {**old, "provenance": {"commit": "b" * 40, **kept}}
    assert runner.retrained(old, again) == {
        "why": "its validation translations were not kept",
        "commit": "a" * 40, **scores, "same": True,
    }  # fmt: skip
    assert runner.retrained(old, {**again, "valid_bleu": 40.57})["same"] is False
    assert runner.finished_names({"rows": [again]}) == {"base"}


def test_a_row_is_recorded_only_from_a_commit(tmp_path, monkeypatch):
    runner = load_script(SCRIPT, "table3_runner")
    monkeypatch.setattr(
        runner, "commit", lambda outputs=(), kept=None: "0" * 40 + "+changes"
    )
    args = runner.parse_args(["--out", str(tmp_path / "t.json")])
    with pytest.raises(runner.TableError, match="uncommitted changes"):
        runner.drive(args, runner.BASE, runner.BUDGET, tmp_path / "t.json",
                     tmp_path / "runs", smoke=False)  # fmt: skip
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "runs").exists()


BAD_FILES = {
    "cut short": lambda good: good[: len(good) // 2],
    "random bytes": lambda good: os.urandom(2048),
    "rows not a list": lambda good: json.dumps({"rows": {"a": 1}}).encode(),
    "a word for a score": lambda good: json.dumps(
        json.loads(good) | {"rows": [json.loads(good)["rows"][0] | {"bleu": "high"}]}
    ).encode(),
    "an unknown group": lambda good: json.dumps(
        json.loads(good) | {"rows": [json.loads(good)["rows"][0] | {"group": "F"}]}
    ).encode(),
    "a NaN score": lambda good: json.dumps(
        json.loads(good)
        | {"rows": [json.loads(good)["rows"][0] | {"valid_bleu": float("nan")}]}
    ).encode(),
    "a NaN source gap": lambda good: json.dumps(
        json.loads(good)
        | {"rows": [json.loads(good)["rows"][0] | {"source_gap": float("nan")}]}
    ).encode(),
}


@pytest.mark.parametrize("damage", list(BAD_FILES))
def test_a_damaged_results_file_is_one_line_and_left_as_it_is(smoke, tmp_path, damage):
    out = tmp_path / "table3.json"
    out.write_bytes(BAD_FILES[damage](smoke.read_bytes()))
    before = out.read_bytes()
    for extra in ((), ("--refresh",), ("--status",)):
        result = run(out, *extra)
        assert result.returncode == 2, (damage, extra, result.stderr[-500:])
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert out.read_bytes() == before
    assert not (tmp_path / "table3-runs").exists()


def test_an_out_path_that_cannot_be_a_file_is_one_line(smoke, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain.txt").write_text("not a folder")
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.txt")
    for out, words in (
        (tmp_path / "folder", "is a directory"),
        (tmp_path / "plain.txt" / "table3.json", "is a file, not a folder"),
        (tmp_path / "link.json", "cannot be read as a Table 3 file"),
    ):
        result = run(out, "--refresh")
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    # through a symlink and "..": the file the system resolves it to, and only it
    (tmp_path / "elsewhere" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere" / "inner")
    shutil.copy(smoke, tmp_path / "elsewhere" / "table3.json")
    result = run(tmp_path / "link" / ".." / "table3.json", "--refresh")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "elsewhere" / "table3.png").is_file()
    assert not (tmp_path / "table3.json").exists()


def test_the_readmes_wall_time_for_a_cluster_is_read_from_the_recorded_minutes():
    import re

    runner = load_script(SCRIPT, "table3_runner")
    hours = runner.cpu_hours(json.loads((ROOT / "results" / "table3.json").read_text()))
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(
        r"about (\d+) CPU-hours .*?so about ([\d.]+) hours on (\d+) cores", readme
    )
    assert said, "the README states the table's CPU-hours and a cluster's wall time"
    assert int(said.group(1)) == round(hours)
    assert float(said.group(2)) == round(hours / int(said.group(3)), 1)


def test_the_drivers_own_results_file_does_not_count_as_a_change(tmp_path):
    runner = load_script(SCRIPT, "table3_runner")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)  # fmt: skip

    (tmp_path / "results" / "table3-hypotheses").mkdir(parents=True)
    out = tmp_path / "results" / "table3.json"
    out.write_text("{}")
    kept = tmp_path / "results" / "table3-hypotheses"
    (kept / "base.txt").write_text("a\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    head = runner.commit(root=tmp_path)
    assert len(head) == 40
    out.write_text('{"rows": []}')  # as the driver leaves it between two rows
    (kept / "base.txt").write_text("b\n")  # a run's translations, kept again
    assert runner.commit((out,), kept, root=tmp_path) == head  # its own output
    assert runner.commit((out,), root=tmp_path) == head + "+changes"
    assert runner.commit(root=tmp_path) == head + "+changes"
    (tmp_path / "code.py").write_text("x = 2\n")  # a change to the code is one
    assert runner.commit((out,), root=tmp_path) == head + "+changes"


def test_the_tables_verdicts_mark_their_qualifiers_and_the_legend_names_them():
    from machinery.table3view import MARKS, _short

    said = "agrees (one seed; still learning at the end of its schedule)"
    assert _short(said) == "agrees¹²"
    missed = "no difference detected (the test would see ≥ 2.75 BLEU) (one seed)"
    assert _short(missed) == "none (≥ 2.75)¹"
    assert _short("no difference detected (the test would see ≥ 6.9% perplexity)") == (
        "none (≥ 6.9%)"
    )
    from machinery import read_table3

    table = read_table3(ROOT / "results" / "table3.json").markdown()
    legend = table.split("Marks: ")[1].splitlines()[0]
    for words, mark in MARKS.items():
        assert f"{mark} {words}" in legend
        assert words not in table.split("Marks: ")[0]  # in the cells, only the mark


def test_a_check_at_another_commit_runs_again_only_when_asked_and_keeps_the_last(
    smoke, tmp_path
):
    runner = load_script(SCRIPT, "table3_runner")
    data = json.loads(smoke.read_text())
    record = data["rows"][0]
    record["provenance"]["commit"] = "a" * 40 + "+changes"
    assert runner.needs_check(record)  # from a changed tree, never checked
    old = {"commit": "b" * 40, "match": True, "measured": 1.0, "recorded": 1.0}
    record["provenance"]["epoch1_check"] = old
    assert not runner.needs_check(record)  # checked once: enough by default
    assert not runner.needs_check(record, "b" * 40)  # checked at this very commit
    assert runner.needs_check(record, "c" * 40)  # --recheck at another commit
    failed = old | {"match": False}  # a failed check: the row trains again instead
    record["provenance"]["epoch1_check"] = failed
    assert not runner.needs_check(record, "c" * 40)
    untranslated = {k: v for k, v in record["provenance"].items()
                    if k != "hypotheses_sha256"} | {"epoch1_check": old}  # fmt: skip
    base = record | {"group": "base", "provenance": untranslated}
    assert not runner.needs_check(base, "c" * 40)  # trains again for translations
    kept = record["provenance"] | {"epoch1_check": old}  # its translations kept
    assert runner.needs_check(base | {"provenance": kept}, "c" * 40)
    record["provenance"]["epoch1_check"] = old
    record["provenance"]["commit"] = "a" * 40  # a clean commit needs no check
    assert not runner.needs_check(record, "c" * 40)
    record["provenance"]["commit"] = "a" * 40 + "+changes"
    # each commit's check trains in a directory of its own: none resumes another's
    args = runner.parse_args(["--out", str(tmp_path / "t.json"), "--recheck"])
    dirs = {
        runner.check_job(record, runner.BUDGET, args, tmp_path, h).run_dir
        for h in ("b" * 40, "c" * 40)
    }
    assert len(dirs) == 2
    # the new check replaces the old in the record, which keeps the old beneath it
    out = tmp_path / "t.json"
    out.write_text(json.dumps(data))
    loop = runner.Loop(args, None, data, runner.SMOKE_BASE, runner.SMOKE_BUDGET, out,
                       tmp_path, [], {}, "c" * 40)  # fmt: skip
    job = runner.check_job(record, runner.BUDGET, args, tmp_path, "c" * 40)
    measured = record["curve"][0]["valid_ppl"]
    assert loop.checked(job, {"status": "checked", "epoch1_ppl": measured}) == 0
    check = record["provenance"]["epoch1_check"]
    assert check["commit"] == "c" * 40 and check["match"] and check["earlier"] == [old]
    loop.head = "d" * 40  # once more: every earlier check in one list, newest first
    job = runner.check_job(record, runner.BUDGET, args, tmp_path, "d" * 40)
    assert loop.checked(job, {"status": "checked", "epoch1_ppl": measured}) == 0
    later = record["provenance"]["epoch1_check"]
    assert [c["commit"] for c in later["earlier"]] == ["c" * 40, "b" * 40]
    assert all("earlier" not in c for c in later["earlier"])
    with pytest.raises(SystemExit):
        runner.parse_args(["--recheck", "--no_checks"])


def test_every_recorded_row_is_from_a_clean_commit_or_passed_its_epoch1_check():
    data = json.loads((ROOT / "results" / "table3.json").read_text())
    for r in data["rows"]:
        provenance = r.get("provenance") or {}
        if str(provenance.get("commit", "")).endswith("+changes"):
            check = provenance.get("epoch1_check") or {}
            assert check.get("match") is True, r["name"]
            assert check["measured"] == r["curve"][0]["valid_ppl"], r["name"]
            assert not check["commit"].endswith("+changes"), r["name"]


def test_a_paragraph_says_when_only_the_sign_agrees_and_names_a_missing_comparison():
    from machinery.table3view import SIZE_APART, Table3

    data = json.loads((ROOT / "results" / "table3.json").read_text())
    table = Table3(data, ROOT / "results")
    test = {"delta": -3.0, "interval": [-4.0, -2.0], "p": 1e-4, "word": "agrees"}
    entry = {"tests": {"bleu": test | {"paper_delta": -0.3}}, "verdict": {
        "bleu": "agrees"}}  # fmt: skip
    assert f"ours is {SIZE_APART}× its size" in table._measure(entry, "bleu")
    entry["tests"]["bleu"]["paper_delta"] = -0.4  # 7.5×: the same order of size
    assert "its size" not in table._measure(entry, "bleu")
    entry["tests"]["bleu"]["word"] = "disagrees"  # a wrong sign says so itself
    entry["tests"]["bleu"]["paper_delta"] = 0.1
    assert "its size" not in table._measure(entry, "bleu")
    # a control whose own width at Eq. 3's rate has no test is read against the base
    # once, with why, not twice against the base under two names
    vs = {"delta": -0.7, "p": 0.2, "delta_pct": 8.8}
    control = {"variation": "C-d128-lr", "seeds": [1, 2], "tests": {
        m: vs | {"against": "base", "vs_base": vs} for m in ("bleu", "ppl")}}  # fmt: skip
    said = table._control(control)
    assert said.count("against the base") == 2  # BLEU once, perplexity once
    assert "C-d128, not tested" in said and "against base" not in said
    # the base runs that train again to keep their translations are named as such
    for r in data["rows"]:
        if r["group"] == "base":
            r["provenance"].pop("hypotheses_sha256", None)
    again = sum(r["group"] == "base" and r["status"] == "done" for r in data["rows"])
    assert again == 3 and "3 base runs to train again" in Table3(data, ROOT).budget_line
    for r in data["rows"]:
        r["provenance"]["hypotheses_sha256"] = "f" * 64
    assert "to train again" not in Table3(data, ROOT).budget_line

"""The Table 3 (§6.2) runner, `benchmarks/table3.py` (`make table3`).

Its rows are the paper's variations written as field overrides of the base, each with
its seeds, on the headline preset's own schedule; in its smoke mode (the copy preset,
five updates a row) it trains each row once, records what each row ran with, skips the
rows its file already holds, continues an interrupted row from its checkpoint, and
keeps one training budget per file. Its noise rule is checked on made-up numbers. No
score is asserted beyond what five updates can show.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
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


def test_the_base_runs_three_seeds_and_every_variation_two():
    runner = load_script(SCRIPT, "table3_runner")
    rows = runner.table3_rows(runner.BASE)
    seeds = {}
    for r in rows:
        seeds.setdefault(r["variation"], []).append(r["seed"])
        assert r["fields"].get("seed", 1) == r["seed"]
    assert seeds.pop("base") == [1, 2, 3]
    assert all(s == [1, 2] for s in seeds.values()), seeds
    # (A), (B), (D) and (E) at both seeds come before any (C) row (the costlier sizes)
    groups = [r["group"] for r in rows]
    assert max(i for i, g in enumerate(groups) if g in "ABDE") < groups.index("C")


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
    assert wide == {"C-d512", "C-d512-seed2", "C-d512-lr", "C-d512-lr-seed2"}
    assert {threads[n] for n in wide} == {budget["wide_threads"]} != {budget["threads"]}
    assert threads["C-d128"] == threads["base"] == budget["threads"] == 1


def test_every_row_reuses_freed_memory_as_make_sets_it_however_the_runner_started(
    monkeypatch,
):
    from machinery import GLIBC_MALLOC_SETTINGS

    runner = load_script(SCRIPT, "table3_runner")
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


def test_the_noise_rule_on_made_up_numbers():
    runner = load_script(SCRIPT, "table3_runner")
    # seeds 30, 31, 32 and 28, 29: pooled sd = sqrt((2 + 0.5) / 3) ≈ 0.913
    noise = runner.pooled_sd([[30.0, 31.0, 32.0], [28.0, 29.0], [27.0]])
    assert noise == pytest.approx((2.5 / 3) ** 0.5)
    assert runner.pooled_sd([[30.0], [28.0]]) is None  # one seed each: no noise yet
    assert runner.verdict(-2.5, noise, -0.9) == "agrees"  # worse, as the paper's
    assert runner.verdict(+2.5, noise, -0.9) == "disagrees"
    assert runner.verdict(-1.5, noise, -0.9) == "can't tell"  # inside 2·sd
    assert runner.verdict(-1.5, noise, 0.0) == "agrees"  # no difference, as the paper
    assert runner.verdict(+2.5, noise, 0.0) == "disagrees"
    # a paper difference of one rounding step (E: 25.7 against 25.8) is no change
    assert runner.verdict(-2.5, noise, 25.7 - 25.8) == "disagrees"
    assert runner.verdict(+0.5, noise, 25.7 - 25.8) == "agrees"
    assert runner.verdict(-2.5, noise, 25.6 - 25.8) == "agrees"  # two steps: a change
    assert runner.verdict(+0.5, noise, 25.6 - 25.8) == "can't tell"
    assert runner.verdict(-9.0, None, -0.9) == "can't tell"  # no seed spread known


def test_the_summary_applies_the_rule_to_every_variation():
    runner = load_script(SCRIPT, "table3_runner")

    def row(name, variation, seed, bleu, ppl=5.0):
        paper = runner.paper_values(
            {"base": "base", "A-h1": "(A) h=1, d_k=d_v=512"}[variation]
        )
        return {"name": name, "variation": variation, "group": variation[0]
                if variation != "base" else "base", "seed": seed, "status": "done",
                "valid_bleu": bleu, "valid_ppl": ppl, "bleu": bleu - 1,
                "params": 10, "paper": paper}  # fmt: skip

    data = {
        "rows": [
            row("base", "base", 1, 40.0),
            row("base-seed2", "base", 2, 41.0),
            row("base-seed3", "base", 3, 42.0),
            row("A-h1", "A-h1", 1, 36.0),
            row("A-h1-seed2", "A-h1", 2, 37.0),
        ]
    }
    summary = {s["variation"]: s for s in runner.summarise(data)}
    assert summary["base"]["valid_bleu"]["n"] == 3
    assert summary["base"]["valid_bleu"]["mean"] == pytest.approx(41.0)
    h1 = summary["A-h1"]
    assert h1["seeds"] == [1, 2] and h1["diff_valid_bleu"] == pytest.approx(-4.5)
    assert h1["paper_diff_bleu"] == pytest.approx(-0.9)
    assert h1["verdict"] == "agrees"  # pooled sd ≈ 0.91: −4.5 is beyond 2·sd
    noise = runner.noise_of(data)  # the yardstick the file records for Part 4
    assert noise["rows"] == 2 and noise["sd"] == pytest.approx((2.5 / 3) ** 0.5)


def test_a_sized_row_runs_its_second_seed_only_where_its_first_cannot_tell():
    runner = load_script(SCRIPT, "table3_runner")
    plan = {r["name"]: r for r in runner.table3_rows(runner.BASE)}

    def row(name, bleu):
        r = plan[name]
        paper = runner.paper_values(r["paper_row"])
        return {"name": name, "variation": r["variation"], "group": r["group"],
                "seed": r["seed"], "status": "done", "valid_bleu": bleu,
                "valid_ppl": 5.0, "bleu": bleu, "params": 10, "paper": paper}  # fmt: skip

    # the base's seeds 40, 41, 42 and A-h1's 36, 37: 2·s ≈ 1.83 BLEU
    data = {"rows": [row("base", 40.0), row("base-seed2", 41.0),
                     row("base-seed3", 42.0), row("A-h1", 36.0),
                     row("A-h1-seed2", 37.0), row("A-h4", 30.0),
                     row("C-d128", 35.0), row("C-N4", 41.5)]}  # fmt: skip
    summary = {s["variation"]: s for s in runner.summarise(data)}
    assert summary["base"]["settled"] and summary["A-h1"]["settled"]
    assert not summary["A-h4"]["settled"]  # (A): two seeds, however far the first
    assert summary["C-d128"]["settled"]  # −6.0, beyond 2·s: one seed settles it
    assert not summary["C-N4"]["settled"]  # +0.5, inside 2·s: seed 2 must run
    assert "beyond 2·s = 1.83" in runner.needless(plan["C-d128-seed2"], data)
    assert runner.needless(plan["C-N4-seed2"], data) is None
    assert runner.needless(plan["A-h4-seed2"], data) is None
    assert runner.needless(plan["C-d512-seed2"], data) is None  # seed 1 not run yet
    data["rows"] = data["rows"][:3] + data["rows"][5:]  # the base's seeds alone:
    assert runner.needless(plan["C-d128-seed2"], data)  # its spread is the noise
    data["rows"] = [data["rows"][0]] + data["rows"][3:]  # one seed: no noise known
    assert runner.needless(plan["C-d128-seed2"], data) is None
    assert not {s["variation"]: s for s in runner.summarise(data)}["base"]["settled"]


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
    args = (runner.SMOKE_BASE, runner.SMOKE_BUDGET, True, order)
    refusal = runner.merge(out, stray, *args)
    assert "6 updates" in refusal and "5" in refusal
    stray = dict(data["rows"][0], name="A-h4", settings_differ={
        "warmup": {"asked": 200, "ran": 400}})  # fmt: skip
    assert "warmup asked 200, ran 400" in runner.merge(out, stray, *args)
    stray = dict(data["rows"][0], name="A-h4")
    stray["provenance"] = dict(stray["provenance"], threads=2)  # its own count is 1
    assert "ran on 2 thread(s), its budget 1" in runner.merge(out, stray, *args)
    wide = dict(stray, name="C-d128", fields={"d_model": 128, "d_k": 32})
    wide["provenance"] = dict(stray["provenance"], threads=1)  # a wide row's is 2
    assert "ran on 1 thread(s), its budget 2" in runner.merge(out, wide, *args)
    assert out.read_bytes() == before


def test_rows_already_in_the_file_are_not_trained_again(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    result = run(out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "5 of 5 row(s) already in" in result.stdout
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
    assert out.read_bytes() == before


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
    assert again["noise"] == data["noise"] and again["rule"] != "old"
    assert not (tmp_path / "table3-runs").exists()  # no row trained
    assert out.with_suffix(".png").is_file()
    # rows finished before the source check get it where their checkpoints are
    out.write_text(json.dumps(data | {"rows": [
        {k: v for k, v in r.items() if k != "source_gap"}
        for r in kept]}))  # fmt: skip
    result = run(out, "--refresh")  # no run directories here: named, not measured
    assert "base: no checkpoint in" in result.stdout
    assert all("source_gap" not in r for r in json.loads(out.read_text())["rows"])
    result = run(out, "--refresh", "--runs", str(smoke.parent / "table3-runs"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["rows"] == kept


def test_the_status_says_how_far_each_row_has_got_and_writes_nothing(smoke, tmp_path):
    out = tmp_path / "table3.json"
    shutil.copy(smoke, out)
    before = out.read_bytes()
    started = tmp_path / "table3-runs" / "A-h1-seed2"
    started.mkdir(parents=True)
    (started / "metrics.jsonl").write_text('{"step": 2}\n{"step": 4}\n')
    result = run(out, "--status", "--rows", "base,A,B,C,D,E")  # every planned row
    assert result.returncode == 0, result.stderr[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert lines["base"][:3] == ["done", "valid", "BLEU"]
    assert lines["A-h1-seed2"] == ["started", "update", "4", "of", "5"]
    assert lines["B-dk4-seed2"] == ["to", "run"]
    assert " ".join(lines["C-d128"]).startswith("to run alone, on more threads")
    runner = load_script(SCRIPT, "table3_runner")
    planned = len(runner.table3_rows(runner.SMOKE_BASE))
    assert result.stdout.splitlines()[-1] == (
        f"{planned} runs: 5 done, 1 started, 0 not needed, {planned - 6} to run"
    )
    assert out.read_bytes() == before  # a look, not a run
    assert not (tmp_path / "table3-runs" / "B-dk4").exists()


def test_part_4_shows_the_file_as_a_table_and_claims_nothing_unmeasured(smoke):
    from machinery import read_table3

    table = read_table3(smoke)
    lines = table.markdown().splitlines()
    header = lines[0].split("|")
    assert "valid BLEU" in lines[0] and "paper BLEU" in lines[0]
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
    assert "1 thread(s) (2 for a row wider than the base)" in table.budget_line
    findings = table.findings()
    # groups (C) and (D) have no finished row: no finding, only that fact
    for g in "CD":
        assert f"**({g})** Not yet measured at the full budget." in findings
    assert "**(A)** Validation BLEU against the base's" in findings
    assert [p for p, _ in table.figures()] == [
        str(smoke.with_name("table3-curves.png")),
        str(smoke.with_name("table3.png")),
    ]
    seeds = {name: line.split("|")[3].strip() for name, line in body.items()}
    # more to run; five updates are too few to learn to read the source
    assert seeds["base"] == "2 of 3 (2 failed to train)"
    assert seeds["A-h1"] == "1 of 2 (1 failed to train)"
    # a verdict stands on the seeds the design asks for: none yet for A-h1
    assert body["A-h1"].split("|")[9].strip() == ""
    group_a = findings.split("**(A)**")[1].split("**(B)**")[0]
    assert "seeds to come" in group_a and "**" not in group_a
    # a measured group names each of its variations that has no finished run yet
    unmeasured = group_a.split("Not yet measured at the full budget: ")[1]
    for name in planned:
        if name.startswith("A-"):
            assert (f"({name})" in unmeasured) == ("not yet run" in body[name]), name


def test_the_budget_line_counts_runs_finished_unneeded_and_still_to_run(tmp_path):
    from machinery.table3view import Table3

    budget = {"epochs": 15, "preset": "p", "updates": 9, "warmup": 3}
    budget |= {"precision": "fp32", "attention": "fast", "threads": 1}
    seeds = {"base": [1, 2, 3], "C-x": [1, 2], "C-y": [1, 2]}
    plan = [{"variation": v, "seeds": s} for v, s in seeds.items()]
    rows = [{"status": "done"}] * 5  # the base's 3, C-x's seed 1, C-y's seed 1
    summary = [
        {"variation": "base", "seeds": [1, 2, 3], "settled": True},
        {"variation": "C-x", "seeds": [1], "settled": True},  # beyond 2·s on one seed
        {"variation": "C-y", "seeds": [1], "settled": False},  # within: seed 2 runs
    ]
    data = {"budget": budget, "plan": plan, "rows": rows, "summary": summary}
    line = Table3(data, tmp_path).budget_line
    assert line.endswith(
        "; 5 run(s) finished, 1 second seed(s) not needed by the rule, 1 still to run"
    )
    summary[2] = {"variation": "C-y", "seeds": [1, 2], "settled": True}
    data["rows"] = rows + [{"status": "done"}]
    line = Table3(data, tmp_path).budget_line
    assert line.endswith("; 6 run(s) finished, 1 second seed(s) not needed by the rule")


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


def test_a_run_that_does_not_read_its_source_failed_to_train():
    runner = load_script(SCRIPT, "table3_runner")
    plan = {r["name"]: r for r in runner.table3_rows(runner.BASE)}

    def row(name, bleu, gap):
        r = plan[name]
        paper = runner.paper_values(r["paper_row"])
        return {"name": name, "variation": r["variation"], "group": r["group"],
                "seed": r["seed"], "status": "done", "valid_bleu": bleu,
                "valid_ppl": 5.0, "bleu": bleu, "params": 10, "paper": paper,
                "source_gap": gap}  # fmt: skip

    # the gap: how much the validation loss rises with other pairs' sources
    data = {"rows": [row("base", 40.0, 4.4), row("base-seed2", 41.0, 4.4),
                     row("base-seed3", 42.0, 4.3),
                     row("A-h1", 5.0, 0.5), row("A-h1-seed2", 37.0, 4.0),
                     row("D-drop0.2", 5.5, 0.48), row("D-drop0.2-seed2", 6.0, 0.3),
                     row("C-N2", 4.0, 0.2)]}  # fmt: skip
    assert not runner.trained(data["rows"][3]) and runner.trained(data["rows"][4])
    assert runner.trained({"valid_bleu": 40.0})  # not measured: counted as trained
    summary = {s["variation"]: s for s in runner.summarise(data)}
    h1 = summary["A-h1"]
    assert h1["seeds"] == [1, 2] and h1["failed_seeds"] == [1] and h1["settled"]
    assert h1["valid_bleu"]["mean"] == 37.0 and h1["valid_bleu"]["n"] == 1
    assert h1["verdict"] == "agrees"  # −4.0 from the base's mean, beyond 2·s ≈ 2
    # the failed seed is not seed noise: s pools the base's seeds alone (sd 1.0)
    assert runner.noise_of(data) == {"sd": pytest.approx(1.0), "rows": 1}
    drop = summary["D-drop0.2"]
    assert drop["failed_seeds"] == [1, 2] and drop["verdict"] == "fails to train"
    assert drop["valid_bleu"]["n"] == 2  # the table still shows what they scored
    # a (C) size whose one seed failed says nothing of the size: seed 2 runs
    assert not summary["C-N2"]["settled"]
    assert runner.needless(plan["C-N2-seed2"], data) is None

    from machinery.table3view import Table3

    data |= {"summary": list(summary.values()), "plan": runner.plan_of(
        runner.BASE, runner.BUDGET), "noise": runner.noise_of(data)}  # fmt: skip
    table = Table3(data, Path("."))
    body = {line.split("|")[1].strip(): line for line in table.markdown().splitlines()}
    assert "| 2 (1 failed to train) |" in body["A-h1"]
    assert "fails to train" in body["D-drop0.2"]
    group_d = table.findings().split("**(D)**")[1]
    assert "2 seeds, none trained" in group_d and "**fails to train**" in group_d
    assert "seed 1 failed to train: its validation loss rose 0.48 nats" in group_d
    # no seed of the base trained: no verdict is read against it
    for r in data["rows"][:3]:
        r["source_gap"] = 0.1
    summary = {s["variation"]: s for s in runner.summarise(data)}
    assert summary["A-h1"]["verdict"] == "base fails to train"
    assert summary["D-drop0.2"]["verdict"] == "fails to train"


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


def test_a_learning_rate_control_is_read_against_its_width_at_eq_3s_rate():
    from machinery.table3view import Table3

    def summary(variation, bleu, seeds):
        stat = {"mean": bleu, "sd": None if len(seeds) == 1 else 0.3}
        return {"variation": variation, "group": "C", "seeds": seeds,
                "valid_bleu": stat}  # fmt: skip

    rows = [
        {"name": "C-d128", "fields": {"d_model": 128, "d_k": 16}},
        {"name": "C-d128-lr", "fields": {"d_model": 128, "d_k": 16, "lr_factor": 0.5}},
        {"name": "C-N2", "fields": {"N": 2}},
    ]
    plain, control = summary("C-d128", 15.5, [1]), summary("C-d128-lr", 40.0, [1, 2])
    data = {"rows": rows, "summary": [plain, control, summary("C-N2", 39.0, [1])],
            "noise": {"sd": 0.5, "rows": 4}}  # fmt: skip
    table = Table3(data, Path("."))
    assert table._rate_control(control) == (
        "; at Eq. 3's own rate (C-d128) the same model scored 15.50 (1 seed): the "
        "base's peak learning rate moves it by +24.50, beyond 2·s"
    )
    plain["valid_bleu"]["mean"] = 39.5  # 0.5 apart: inside 2·s = 1.0
    assert table._rate_control(control).endswith("moves it by +0.50, within 2·s")
    # a row that does not set lr_factor, or a control without its width: nothing
    assert table._rate_control(plain) == ""
    data["summary"].remove(plain)
    assert table._rate_control(control) == ""


def test_a_lock_held_for_an_instant_is_not_a_row_another_runner_trains(tmp_path):
    runner = load_script(SCRIPT, "table3_runner")
    path = tmp_path / "A-h1.lock"
    other = subprocess.Popen(  # another runner looking at the row: it lets go
        [sys.executable, "-c", "import fcntl, sys\n"
         f"f = open({str(path)!r}, 'a+')\n"
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
         "sys.stdin.readline(); fcntl.flock(f, fcntl.LOCK_UN); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout.readline() == "held\n"
        with runner.locked(path, wait=False, grace=0) as mine:
            assert not mine  # held now, and no grace

        def release():
            other.stdin.write("\n")
            other.stdin.flush()

        let_go = threading.Timer(0.2, release)
        let_go.start()
        with runner.locked(path, wait=False, grace=30) as mine:
            assert mine  # held for an instant only: the row is got, not passed by
        let_go.join()
    finally:
        other.kill()
        other.wait()


def test_a_row_records_the_rows_that_trained_beside_it_whichever_runner_ran_them(
    tmp_path,
):
    runner = load_script(SCRIPT, "table3_runner")
    (tmp_path / "free.lock").touch()  # a row no one trains
    with runner.locked(tmp_path / "A-h1.lock"):
        assert runner.rows_training(tmp_path) == 1
        other = subprocess.Popen(  # another runner's row, in its own process
            [sys.executable, "-c", "import fcntl, sys, time\n"
             f"f = open({str(tmp_path / 'B-dk8.lock')!r}, 'a+')\n"
             "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
             "time.sleep(60)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert other.stdout.readline() == "held\n"
            with runner.LoadWatch(tmp_path, every=0.01) as load:
                time.sleep(0.1)
            assert runner.rows_training(tmp_path) == 2
        finally:
            other.kill()
            other.wait()
    record = load.record()
    assert record["concurrent_rows"] == 2 and record["load_average"] >= 0
    assert runner.rows_training(tmp_path) == 0  # probing took no lock for good
    with runner.LoadWatch(tmp_path, every=60) as alone:  # looked at once, at the start
        pass
    assert alone.record()["concurrent_rows"] == 1  # at least the row itself


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


def test_a_row_wider_than_the_base_trains_alone():
    runner = load_script(SCRIPT, "table3_runner")
    wide = {"C-d512", "C-d512-lr"}
    assert runner.alone_problem("C-d512", ["C-d512"], wide) is None  # itself only
    assert "A-h1 is training" in runner.alone_problem(
        "C-d512", ["A-h1", "C-d512"], wide
    )
    assert "C-d512-lr is training alone" in runner.alone_problem(
        "A-h1", ["A-h1", "C-d512-lr"], wide
    )
    assert runner.alone_problem("A-h1", ["A-h1", "B-dk8"], wide) is None  # two narrow


def test_a_job_trains_the_wide_rows_its_workers_left_at_its_end(monkeypatch):
    runner = load_script(SCRIPT, "table3_runner")
    plan = runner.table3_rows(runner.BASE)
    wide = {
        r["name"] for r in plan if runner.row_threads(r, runner.BASE, runner.BUDGET) > 1
    }
    base = [{"name": n, "variation": "base", "group": "base", "seed": s,
             "status": "done", "valid_bleu": b, "valid_ppl": 5.0, "bleu": b,
             "params": 10, "paper": runner.paper_values(plan[0]["paper_row"])}
            for n, s, b in (("base", 1, 40.0), ("base-seed2", 2, 41.0))]  # fmt: skip
    data = {"rows": base + [{"name": "C-d512-lr", "status": "failed"}]}
    # a failed row is not tried again unasked; a second seed is left with its first
    want = ["C-d512", "C-d512-seed2", "C-d512-lr-seed2"]
    assert runner.wide_left(data, plan, wide) == want
    c_d512 = dict(base[0], name="C-d512", variation="C-d512", group="C")
    data["rows"].append(c_d512 | {"valid_bleu": 30.0, "bleu": 30.0})
    assert runner.wide_left(data, plan, wide) == ["C-d512-lr-seed2"]  # −10.5: settled
    assert runner.wide_left(data, plan[:5], wide) == []  # none of these is wide

    started = []

    class Worker:
        def __init__(self, args, cwd):
            started.append(args)

        def wait(self):
            return 0

    monkeypatch.setattr(runner.subprocess, "Popen", Worker)
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    monkeypatch.setattr(runner.signal, "signal", lambda *a: None)  # pytest's kept
    args = runner.parse_args(["--jobs", "2", "--rows", "C"])
    out, runs = Path("t.json"), Path("runs")
    assert runner.run_workers(args, out, runs, lambda: ["C-d512", "C-d512-lr"]) == 0
    assert len(started) == 3  # two workers, then one for the rows they left
    assert started[0] == started[1] and "--jobs" not in started[0]
    assert started[2] == started[0] + ["--rows", "C-d512,C-d512-lr"]
    started.clear()
    assert runner.run_workers(args, out, runs, lambda: []) == 0
    assert len(started) == 2  # nothing left: no third


def test_the_runner_leaves_a_row_for_later_while_a_wide_row_trains(tmp_path):
    out = tmp_path / "table3.json"
    runs = tmp_path / "table3-runs"  # --smoke's rows, next to --out
    runs.mkdir()
    with load_script(SCRIPT, "table3_runner").locked(runs / "C-d128.lock"):
        result = run(out, "--rows", "A-h1")  # C-d128 is wider than the smoke base
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert "row A-h1: not started: C-d128 is training alone on its threads" in said
    assert "left for later: A-h1" in said
    assert "device:" not in said  # no training run started
    assert not (runs / "A-h1").exists()

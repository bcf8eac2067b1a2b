"""`make gpu-check` (benchmarks/gpu_check.py) in its CPU smoke mode, as on a bare GPU
image: only torch is required; each optional package (numpy, tqdm, matplotlib,
sentencepiece) made unimportable costs only the steps that need it; without data the
check refuses, unless random sentences are asked for. The JSON holds the environment
block and every step that finished."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
STEPS = [
    "stand_in",
    "copy_auto",
    "fp16_interrupted_and_resumed",
    "iwslt14_small_bf16",
    "iwslt14_small_fp16",
    "iwslt14_small_fp32",
    "beam_decoding",
    "iwslt14_small_compile",
]
# the steps each package's absence skips (none needs numpy, but without it matplotlib
# does not import)
NEEDS = {
    "numpy": set(),
    "tqdm": set(),
    "matplotlib": set(),
    "sentencepiece": set(STEPS) - {"copy_auto", "fp16_interrupted_and_resumed"},
}


def run_check(tmp_path, *args, blocked=()):
    """The check as a bare image runs it: the packages ``blocked`` raise
    ModuleNotFoundError on import (a path entry ahead of site-packages)."""
    block = tmp_path / "blocked"
    for name in blocked:
        (block / name).mkdir(parents=True)
        (block / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name}'!r}, name={name!r})\n"
        )
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(block),
    }
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args]
    command += ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def the_report(tmp_path) -> dict:
    (path,) = (tmp_path / "out").glob("gpu-check-*.json")
    return json.loads(path.read_text())


def test_without_a_data_folder_the_check_refuses_in_one_line(tmp_path):
    for args in ([], ["--data", str(tmp_path / "absent")]):
        proc = run_check(tmp_path, *args)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--data" in proc.stderr and "--synthetic" in proc.stderr
        assert not list((tmp_path / "out").glob("*.json"))


def test_with_every_optional_package_blocked_and_synthetic_data_the_run_survives(
    tmp_path,
):
    proc = run_check(tmp_path, "--synthetic", blocked=list(NEEDS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = the_report(tmp_path)
    env = report["environment"]
    assert {"torch", "cuda", "cudnn", "card", "capability", "c_compiler"} <= set(env)
    assert env["eager_op_host_us"] > 0 and "nvidia_smi" in env
    assert not any(p["present"] for p in env["optional_packages"].values())
    assert report["data"].startswith("synthetic")
    assert list(report["steps"]) == STEPS and report["failed"] == []
    for name, result in report["steps"].items():  # skipped, with the cause named
        assert result["ok"] or any(p in result["skipped"] for p in NEEDS), result
    # the profiler's own start and stop lines stay out of a CPU run's output
    assert "profiler_start" not in proc.stderr and "USDT" not in proc.stderr


@pytest.mark.parametrize("package", list(NEEDS))
def test_one_optional_package_blocked_costs_only_its_steps(tmp_path, package):
    if not (MIRROR / "iwslt14" / "train-sample.de").is_file():
        pytest.skip(f"no iwslt14 data in {MIRROR}")
    proc = run_check(tmp_path, "--data", str(MIRROR), blocked=[package])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = the_report(tmp_path)
    present = report["environment"]["optional_packages"]
    absent = {k for k, v in present.items() if not v["present"]}
    assert absent == {package} | ({"matplotlib"} if package == "numpy" else set())
    steps = report["steps"]
    assert list(steps) == STEPS and report["failed"] == []
    assert report["data"] == str(MIRROR / "iwslt14")
    for name, result in steps.items():
        if result["ok"]:
            continue
        assert name in NEEDS[package] and package in result["skipped"], result
    ran = {name for name, result in steps.items() if result["ok"]}
    assert ran == set(STEPS) - NEEDS[package]
    curve = tmp_path / "work" / "runs" / "copy-auto" / "curve.png"
    assert curve.is_file() == ("matplotlib" not in absent)
    if ran == set(STEPS):
        resumed = steps["fp16_interrupted_and_resumed"]
        assert resumed["interrupted_at"] == 2 and resumed["steps"] == [4, 4]
        assert resumed["weights_equal"] and resumed["scaler_equal"], resumed
        for p in ("bf16", "fp16", "fp32"):
            run = steps[f"iwslt14_small_{p}"]
            assert run["precision"] == p and run["updates"] == 4, run
            assert run["timed_updates"] == 2 and run["ms_per_update"] > 0
            assert run["target_tokens_per_s"] > 0 and run["tflops_per_s"] > 0
            assert run["profiled_window"]["ops_per_update"] > 0
        assert steps["iwslt14_small_compile"]["compilations"] >= 1
        assert steps["beam_decoding"]["sentences"] == 4
        assert set(report["ratios"]) == {"fp16_ms_over_bf16", "fp32_ms_over_bf16"}


@pytest.fixture(scope="module")
def check():
    from conftest import load_script

    return load_script(ROOT / "benchmarks" / "gpu_check.py", "gpu_check_under_test")


def test_a_step_past_its_budget_is_stopped_and_recorded_and_the_next_one_runs(check):
    report = {"steps": {}}

    def endless():
        while True:
            sum(range(1000))

    check.step(report, "endless", endless, 0.3, lambda: "")
    check.step(report, "quick", lambda: {"value": 1}, 5, lambda: "")
    check.step(report, "skipped", lambda: {"value": 2}, 5, lambda: "needs nothing here")
    endless_result, quick, skipped = report["steps"].values()
    assert (
        endless_result["ok"] is False
        and "past its budget of 0.3 s" in (endless_result["error"])
    )
    assert quick["ok"] is True and quick["value"] == 1
    assert skipped == {"ok": None, "skipped": "needs nothing here", **skipped}
    assert "value" not in skipped


def test_busy_time_counts_overlapping_kernels_once():
    from conftest import load_script

    profiling = load_script(
        ROOT / "benchmarks" / "profiling.py", "profiling_under_test"
    )
    # two streams: (0, 10) and (5, 12) overlap by 5; (20, 25) stands alone
    assert profiling.merged_us([(5, 12), (0, 10), (20, 25), (21, 22)]) == 17
    assert profiling.merged_us([]) == 0


@pytest.mark.skipif(not (MIRROR / "iwslt14").is_dir(), reason="needs the data mirror")
def test_the_attention_kernel_probe_runs_tiny_on_a_cpu_and_finishes_every_part(
    tmp_path,
):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "sdpa_backends.py")]
    command += ["--data", str(MIRROR), "--out", str(tmp_path / "out")]
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "sdpa-backends.json").read_text())
    steps = report["steps"]
    assert report["smoke"] and all(v["ok"] for v in steps.values()), steps
    trained = [k for k in steps if k.startswith("train_")]
    assert len(trained) == 4
    assert all(steps[k]["timed_updates"] == 2 for k in trained)
    assert steps["beam_default"]["sentences"] == 8


def test_the_checks_cpu_name_is_the_machinerys_copied():
    """gpu_check.py carries a copy of the one CPU-name reader (it runs without the
    package): both name this CPU alike, as runs do."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    from machinery.devices import cpu_name
    from machinery.runs import machine_name

    assert gpu_check.cpu_name() == cpu_name() == machine_name("cpu") != ""


def check_with(tmp_path, *args) -> subprocess.CompletedProcess:
    """gpu_check.py with exactly ``args``, on the CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def one_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_the_check_never_deletes_the_data_it_was_given(tmp_path):
    """--data W/mirror --work W: the stand-in would be built where the data is;
    refused, and every data file is left as it was."""
    data = tmp_path / "W" / "mirror" / "iwslt14"
    data.mkdir(parents=True)
    files = {
        f"{split}.{side}": f"{split} {side} sentence\n"
        for split in ("train-sample", "valid", "test")
        for side in ("de", "en")
    }
    for name, text in files.items():
        (data / name).write_text(text)
    proc = check_with(
        tmp_path,
        *("--data", str(tmp_path / "W" / "mirror"), "--work", str(tmp_path / "W")),
        *("--out", str(tmp_path / "out")),
    )
    assert "--work" in one_line(proc) and "never deletes" in proc.stderr
    assert {p.name: p.read_text() for p in data.iterdir()} == files


def test_an_out_folder_that_cannot_be_one_is_one_line(tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("kept\n")
    for out, words in (
        (regular, ("--out", "is a file")),
        (Path("/proc/gpu-check-out"), ("cannot write in --out", "/proc")),
    ):
        proc = check_with(tmp_path, "--synthetic", "--out", str(out))
        assert all(w in one_line(proc) for w in words), proc.stderr
    assert regular.read_text() == "kept\n"

"""`make gpu-check` (benchmarks/gpu_check.py) in its CPU smoke mode: every step of the
ten-minute GPU check runs, tiny, and the JSON it writes holds what the GPU run would
report."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_step_in_its_cpu_smoke_mode(tmp_path):
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--smoke",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert (
        report["smoke"] is True
        and report["card"].startswith("CPU: ")
        and report["failed"] == []
    )
    steps = report["steps"]
    assert list(steps) == [
        "stand_in",
        "copy_auto",
        "fp16_interrupted_and_resumed",
        "iwslt14_small_bf16",
        "iwslt14_small_fp16",
        "iwslt14_small_fp32",
        "iwslt14_small_compile",
        "beam_decoding",
    ]
    assert all(s["ok"] for s in steps.values()), steps
    assert steps["stand_in"]["train_pairs"] == 600
    assert steps["copy_auto"]["precision"] in ("fp32", "bf16") and steps["copy_auto"][
        "attention"
    ] in ("readable", "fast")
    resumed = steps["fp16_interrupted_and_resumed"]
    assert resumed["interrupted_at"] == 2 and resumed["steps"] == [4, 4]
    assert resumed["weights_equal"] and resumed["scaler_equal"], resumed
    for p in ("bf16", "fp16", "fp32"):
        run = steps[f"iwslt14_small_{p}"]
        assert (
            run["precision"] == p and run["updates"] == 3 and run["ms_per_update"] > 0
        )
        assert run["target_tokens_per_s"] > 0 and run["tflops_per_s"] > 0
    assert steps["iwslt14_small_compile"]["compilations"] >= 1
    assert (
        steps["beam_decoding"]["sentences"] == 4
        and steps["beam_decoding"]["sentences_per_s"] > 0
    )
    assert set(report["ratios"]) == {"fp16_ms_over_bf16", "fp32_ms_over_bf16"}

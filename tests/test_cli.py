"""The command line: trains a preset end to end, and fails with one clear message without data."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "the_annotated_transformer.py"


def run(args, tmp_path, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_train_command_trains_checkpoints_and_scores(tmp_path):
    result = run(["train", "--config", "copy", "--max_steps", "4", "--run_dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "device: cpu" in result.stdout
    assert "test BLEU" in result.stdout
    assert list((tmp_path / "run").glob("checkpoint-*.pt"))
    assert (tmp_path / "run" / "results.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_missing_data_offline_is_one_clear_error(tmp_path):
    env = {"DATA_MIRROR": "", "ANNOTATED_TRANSFORMER_DATA": str(tmp_path / "data")}
    result = run(["train", "--config", "multi30k-small", "--download", "false"], tmp_path, **env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "DATA_MIRROR" in result.stderr and "download" in result.stderr


def test_iwslt_preset_trains_on_the_mirror_sample_and_says_so(tmp_path, mirror):
    result = run(["train", "--config", "iwslt14-small", "--N", "1", "--d_model", "64", "--d_ff", "64",
                  "--max_steps", "2", "--max_eval_sentences", "8", "--max_decode_extra", "5",
                  "--run_dir", str(tmp_path / "run")], tmp_path,
                 DATA_MIRROR=str(mirror), ANNOTATED_TRANSFORMER_DATA=str(tmp_path / "data"))
    assert result.returncode == 0, result.stderr
    assert "train-sample" in result.stdout or "sample" in result.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["bleu_kind"] == "tokenized"
    assert list((tmp_path / "run").glob("checkpoint-*.pt"))


def test_ctrl_c_saves_and_the_same_command_continues(tmp_path):
    args = ["train", "--config", "copy", "--device", "cpu", "--bf16", "false", "--run_dir", str(tmp_path / "run")]
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (metrics.is_file() and metrics.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)  # the first record: end of epoch 1 (16 of 256 updates)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Run the same command again" in err
    stopped = int(re.search(r"after update (\d+)", err).group(1))
    assert 16 <= stopped < 256
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt"))[-1] == f"checkpoint-{stopped:08d}.pt"

    result = run([*args, "--max_steps", str(stopped + 2)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and f"checkpoint-{stopped:08d}.pt" in result.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == stopped + 2

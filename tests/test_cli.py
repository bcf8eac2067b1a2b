"""The command line (machinery/cli.py, machinery/inference.py): trains a preset end to
end, translates and scores with it, fails with one clear message, and parses its
options into a configuration."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import sacrebleu
import torch

import machinery

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "the_annotated_transformer.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def run(args, tmp_path, **env):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_train_command_trains_checkpoints_and_scores(tmp_path):
    result = run(
        [
            "train",
            "--config",
            "copy",
            "--max_steps",
            "4",
            "--run_dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "device: cpu" in result.stdout
    assert "test BLEU" in result.stdout
    assert list((tmp_path / "run").glob("checkpoint-*.pt"))
    assert (tmp_path / "run" / "results.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_missing_data_offline_is_one_clear_error(tmp_path):
    env = {"DATA_MIRROR": "", "ANNOTATED_TRANSFORMER_DATA": str(tmp_path / "data")}
    result = run(
        ["train", "--config", "multi30k-small", "--download", "false"], tmp_path, **env
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "DATA_MIRROR" in result.stderr and "download" in result.stderr


def test_iwslt_preset_trains_on_the_mirror_sample_and_says_so(tmp_path, mirror):
    result = run(
        [
            "train",
            "--config",
            "iwslt14-small",
            "--N",
            "1",
            "--d_model",
            "64",
            "--d_ff",
            "64",
            "--max_steps",
            "2",
            "--max_eval_sentences",
            "8",
            "--max_valid_sentences",  # the validation loss on 100 of 7,283 pairs
            "100",
            "--max_decode_extra",
            "5",
            "--run_dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
        DATA_MIRROR=str(mirror),
        ANNOTATED_TRANSFORMER_DATA=str(tmp_path / "data"),
    )
    assert result.returncode == 0, result.stderr
    assert "train-sample" in result.stdout or "sample" in result.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["bleu_kind"] == "tokenized"
    assert list((tmp_path / "run").glob("checkpoint-*.pt"))


def test_ctrl_c_saves_and_the_same_command_continues(tmp_path):
    args = [
        "train",
        "--config",
        "copy",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--run_dir",
        str(tmp_path / "run"),
    ]
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 120
    while (
        not (metrics.is_file() and metrics.read_text())
        and time.time() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.05)  # the first record: end of epoch 1 (16 of 256 updates)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Run the same command again" in err
    stopped = int(re.search(r"after update (\d+)", err).group(1))
    assert 16 <= stopped < 256
    assert (
        sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt"))[-1]
        == f"checkpoint-{stopped:08d}.pt"
    )

    result = run([*args, "--max_steps", str(stopped + 2)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "resumed from" in result.stdout
        and f"checkpoint-{stopped:08d}.pt" in result.stdout
    )
    assert (
        json.loads((tmp_path / "run" / "results.json").read_text())["steps"]
        == stopped + 2
    )


# --- translate and evaluate (§6.1 decoding with a trained model) ---------------------


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    """A tiny copy-task run with two epoch checkpoints."""
    tmp = tmp_path_factory.mktemp("copy")
    result = run(
        [
            "train",
            "--config",
            "copy",
            "--epochs",
            "2",
            "--max_eval_sentences",
            "10",
            "--run_dir",
            str(tmp / "run"),
        ],
        tmp,
    )
    assert result.returncode == 0, result.stderr
    assert len(list((tmp / "run").glob("checkpoint-*.pt"))) == 2
    return tmp / "run"


def test_translate_reads_arguments_a_file_or_stdin_and_prints_one_line_each(
    copy_run, tmp_path
):
    sentences = ["1 2 3 4 5", "7 7 8", "9"]
    from_args = run(["translate", "--run_dir", str(copy_run), *sentences], tmp_path)
    assert from_args.returncode == 0, from_args.stderr
    lines = from_args.stdout.splitlines()
    assert len(lines) == 3
    for sentence, line in zip(
        sentences, lines
    ):  # §6.1 limit: at most input length + 50 words
        assert len(line.split()) <= len(sentence.split()) + 50
        assert set(line.split()) <= {str(i) for i in range(1, 11)} | {"<unk>"}
    (tmp_path / "in.txt").write_text("\n".join(sentences) + "\n")
    from_file = run(
        ["translate", "--run_dir", str(copy_run), "--input", str(tmp_path / "in.txt")],
        tmp_path,
    )
    assert from_file.returncode == 0 and from_file.stdout == from_args.stdout
    from_stdin = subprocess.run(
        [sys.executable, str(SCRIPT), "translate", "--run_dir", str(copy_run)],
        input="\n".join(sentences),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert from_stdin.returncode == 0 and from_stdin.stdout == from_args.stdout


def test_translate_one_checkpoint_or_the_average_of_the_last(copy_run, tmp_path):
    last = sorted(copy_run.glob("checkpoint-*.pt"))[-1]
    sentences = ["1 2 3 4 5 6 7 8 9 10", "3 3 2"]
    one = run(
        ["translate", "--checkpoint", str(last), "--beam", "1", *sentences], tmp_path
    )
    last_only = run(
        [
            "translate",
            "--run_dir",
            str(copy_run),
            "--average_last",
            "1",
            "--beam",
            "1",
            *sentences,
        ],
        tmp_path,
    )
    assert one.returncode == 0, one.stderr
    assert one.stdout == last_only.stdout
    averaged, *_ = machinery.load_for_inference(run_dir=copy_run, average_last=2)
    states = [
        machinery.load_checkpoint(p)["model"]
        for p in sorted(copy_run.glob("checkpoint-*.pt"))
    ]
    for name, value in averaged.state_dict().items():
        torch.testing.assert_close(value, (states[0][name] + states[1][name]) / 2)


def test_evaluate_scores_files_and_prints_the_sacrebleu_signature(copy_run, tmp_path):
    # Copy-task sentences and their true targets: a copy task's reference is its
    # source. Nothing here comes from the model; its hypotheses come from `translate`
    # with the same decoding options as `evaluate`.
    src = ["1 2 3 4", "5 6 7 8 9", "10 1", "3 3 2 7 9 1", "4 8 2 6 10 5 7 1 9 3"]
    refs = list(src)
    translated = run(
        [
            "translate",
            "--run_dir",
            str(copy_run),
            "--beam",
            "2",
            "--alpha",
            "0.6",
            *src,
        ],
        tmp_path,
    )
    assert translated.returncode == 0, translated.stderr
    hyps = translated.stdout.split("\n")[:-1]
    assert len(hyps) == len(src)
    (tmp_path / "src.txt").write_text("\n".join(src) + "\n")
    # The same references misaligned by one line: real target sentences, but of other
    # sources.
    shifted = refs[1:] + refs[:1]
    assert hyps != shifted
    printed = {}
    for name, references in (("ref.txt", refs), ("shifted.txt", shifted)):
        (tmp_path / name).write_text("\n".join(references) + "\n")
        result = run(
            [
                "evaluate",
                "--run_dir",
                str(copy_run),
                "--beam",
                "2",
                "--alpha",
                "0.6",
                "--src",
                str(tmp_path / "src.txt"),
                "--ref",
                str(tmp_path / name),
            ],
            tmp_path,
        )
        assert result.returncode == 0, result.stderr
        score_line, signature_line = result.stdout.splitlines()
        # sacreBLEU itself, on the same hypotheses and references, scored on the copy
        # task's tokenized text
        metric = sacrebleu.BLEU(tokenize="none", force=True)
        expected = metric.corpus_score(hyps, [references])
        assert score_line == str(expected), (name, hyps)
        assert f"ref_len = {sum(len(r.split()) for r in references)}" in score_line
        assert signature_line == str(metric.get_signature())
        assert "nrefs:1|case:mixed|eff:no|tok:none" in signature_line
        score = float(re.match(r"BLEU = (\d+\.\d\d) ", score_line).group(1))
        assert score == pytest.approx(expected.score, abs=0.005)
        assert (score == 100.0) == (hyps == references), (
            name,
            score,
            hyps,
        )  # 100 only for exact copies
        printed[name] = score_line
    assert printed["shifted.txt"] != printed["ref.txt"], (
        "the score does not depend on which reference is whose"
    )


def test_evaluate_defaults_to_the_test_split_and_fails_clearly(copy_run, tmp_path):
    result = run(["evaluate", "--run_dir", str(copy_run), "--beam", "1"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "ref_len = 1000" in result.stdout
    )  # the copy task's 100 test sentences of 10 symbols
    missing = run(["evaluate", "--run_dir", str(tmp_path / "nothing")], tmp_path)
    assert (
        missing.returncode == 2
        and "no checkpoint" in missing.stderr
        and "Traceback" not in missing.stderr
    )
    (tmp_path / "a.txt").write_text("1 2\n3 4\n")
    (tmp_path / "b.txt").write_text("1 2\n")
    bad = run(
        [
            "evaluate",
            "--run_dir",
            str(copy_run),
            "--src",
            str(tmp_path / "a.txt"),
            "--ref",
            str(tmp_path / "b.txt"),
        ],
        tmp_path,
    )
    assert bad.returncode == 2 and "misaligned" in bad.stderr


def test_evaluate_scores_the_validation_split_too(copy_run, tmp_path):
    valid = run(
        ["evaluate", "--run_dir", str(copy_run), "--beam", "1", "--split", "valid"],
        tmp_path,
    )
    assert valid.returncode == 0, valid.stderr
    assert (
        "ref_len = 1600" in valid.stdout
    )  # the copy task's 160 validation sentences of 10 symbols, not its 100 test ones
    first = run(
        [
            "evaluate",
            "--run_dir",
            str(copy_run),
            "--beam",
            "1",
            "--split",
            "valid",
            "--first",
            "3",
        ],
        tmp_path,
    )
    assert "ref_len = 30" in first.stdout
    other = run(
        ["evaluate", "--run_dir", str(copy_run), "--split", "test_2017_flickr"],
        tmp_path,
    )
    assert (
        other.returncode == 2
        and "no split 'test_2017_flickr' (known: test, valid)" in other.stderr
    )


def test_evaluate_first_scores_only_the_first_pairs(copy_run, tmp_path):
    src = ["1 2 3 4", "5 6 7 8 9", "10 1", "3 3 2 7 9 1"]
    (tmp_path / "src.txt").write_text("\n".join(src) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(src) + "\n")
    files = ["--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt")]
    first = run(
        ["evaluate", "--run_dir", str(copy_run), "--beam", "1", "--first", "2", *files],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr
    assert (
        "ref_len = 9" in first.stdout
    )  # 4 + 5 words: the first two references, not all four (17)
    (tmp_path / "two.txt").write_text("\n".join(src[:2]) + "\n")
    same = run(
        [
            "evaluate",
            "--run_dir",
            str(copy_run),
            "--beam",
            "1",
            "--src",
            str(tmp_path / "two.txt"),
            "--ref",
            str(tmp_path / "two.txt"),
        ],
        tmp_path,
    )
    assert same.stdout == first.stdout  # the same as scoring a file of those two pairs
    assert "note" not in first.stderr
    more = run(
        ["evaluate", "--run_dir", str(copy_run), "--beam", "1", "--first", "9", *files],
        tmp_path,
    )
    assert (
        more.returncode == 0 and "ref_len = 17" in more.stdout
    )  # all four pairs, and it says so
    assert "--first 9, but there are only 4 pairs: scoring all of them" in more.stderr
    zero = run(
        ["evaluate", "--run_dir", str(copy_run), "--first", "0", *files], tmp_path
    )
    assert (
        zero.returncode == 2
        and "--first" in zero.stderr
        and "Traceback" not in zero.stderr
    )


def test_training_reports_greedy_and_beam_bleu(copy_run):
    results = json.loads((copy_run / "results.json").read_text())
    assert results["beam_size"] == 4 and results["length_penalty_alpha"] == 0.6
    assert 0 <= results["bleu"] <= 100 and 0 <= results["bleu_greedy"] <= 100
    assert results["bleu_kind"] == "tokenized"


# --- parsing the command line, in this process (precision, device: test_devices.py) ---


def test_command_line_overrides_the_preset():
    command, cfg = machinery.config_from_args(
        [
            "train",
            "--config",
            "copy",
            "--max_steps",
            "7",
            "--P_drop",
            "0.2",
            "--precision",
            "bf16",
        ]
    )
    assert command == "train"
    assert cfg.max_steps == 7 and isinstance(cfg.max_steps, int)
    assert cfg.P_drop == 0.2 and cfg.precision == "bf16"
    assert cfg.run_dir == "runs/copy"
    assert cfg == machinery.get_config(
        "copy", max_steps=7, P_drop=0.2, precision="bf16", run_dir="runs/copy"
    )


def test_the_decoders_depth_is_an_option_in_both_spellings():
    for flag in ("--N_dec", "--N-dec"):
        assert (
            machinery.config_from_args(["train", "--config", "tiny", flag, "1"])[
                1
            ].N_dec
            == 1
        )
    assert (
        machinery.config_from_args(["train", "--config", "tiny"])[1].N_dec == 0
    )  # §3.1: as many as N


def test_command_line_spellings_and_types():
    _, cfg = machinery.config_from_args(
        [
            "train",
            "--config",
            "tiny",
            "--max-steps",
            "3",
            "--betas",
            "0.8,0.9",
            "--run_dir",
            "somewhere",
            "--precision",
            "fp32",
            "--download",
            "off",
        ]
    )
    assert (cfg.max_steps, cfg.betas, cfg.run_dir, cfg.precision) == (
        3,
        (0.8, 0.9),
        "somewhere",
        "fp32",
    )
    assert cfg.download is False


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "no-such-preset"],
        ["train", "--config", "copy", "--precision", "maybe"],
        ["train", "--config", "copy", "--download", "maybe"],
        ["train", "--config", "copy", "--no_such_field", "1"],
        ["evaluate", "--config", "copy"],
    ],
)
def test_command_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as err:
        machinery.config_from_args(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


def test_without_a_command_the_help_lists_the_three_and_the_status_is_2(tmp_path):
    result = run([], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    shown = result.stdout + result.stderr
    assert shown.startswith("usage: the_annotated_transformer.py")
    for command in ("train", "translate", "evaluate"):
        assert f"\n  {command} " in shown, command  # one line each, with what it does
    assert not list(tmp_path.iterdir())  # nothing was run


def test_help_lists_the_three_commands_and_succeeds(capsys):
    assert machinery.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(
        f"\n  {command} " in out for command in ("train", "translate", "evaluate")
    )


def test_an_unknown_command_is_one_line_naming_all_three(capsys):
    assert machinery.main(["fly", "--config", "copy"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'fly'" in err
    assert "train, translate, evaluate" in err


@pytest.mark.parametrize(
    "removed",
    [
        ["--bf16", "true"],
        ["--fused_loss", "true"],
        ["--cooldown", "0.5"],
        ["--bpe_dropout", "0.1"],
        ["--word_dropout", "0.1"],
        ["--fast_dropout", "true"],
        ["--train_on_valid_rest", "true"],
        ["--fused-loss", "true"],
    ],
)
def test_a_removed_option_is_refused_in_one_line(removed, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        machinery.main(
            ["train", "--config", "copy", *removed, "--run_dir", str(run_dir)]
        )
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert len(message.strip().splitlines()) == 1, message
    assert "error: unrecognized arguments" in message and removed[0] in message
    assert not run_dir.exists()  # refused before any work


def test_unknown_preset_error_lists_presets():
    with pytest.raises(KeyError, match="copy"):
        machinery.get_config("no-such-preset")


def test_main_reports_an_unusable_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint-00000001.pt").write_bytes(b"not a checkpoint")
    assert (
        machinery.main(
            ["train", "--config", "copy", "--device", "cpu", "--run_dir", str(tmp_path)]
        )
        == 2
    )
    assert "truncated" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_both_commands_average_5_and_decode_with_beam_4_and_alpha_0_6_by_default(
    command, tmp_path, monkeypatch
):
    # the README's and §6.1's defaults, as the commands pass them on when not told
    import machinery.inference as inference

    told = {}

    def load(checkpoint, run_dir, average_last, device):
        told["average_last"] = average_last
        return None, types.SimpleNamespace(dataset="copy"), None, None, None

    def decode(lines, *args):
        told["beam"], told["alpha"] = args[-2:]
        return list(lines), []

    monkeypatch.setattr(inference, "load_for_inference", load)
    monkeypatch.setattr(inference, "translate_lines", decode)
    monkeypatch.setattr(inference, "evaluation_pairs", lambda a, c: (["1 2"], ["1 2"]))
    extra = ["1 2"] if command == "translate" else []
    argv = ["--run_dir", str(tmp_path), *extra]
    assert inference.run_inference_command(command, argv) == 0
    assert told == {"average_last": 5, "beam": 4, "alpha": 0.6}
    told.clear()
    argv += ["--average_last", "2", "--beam", "1", "--alpha", "0"]
    assert inference.run_inference_command(command, argv) == 0
    assert told == {"average_last": 2, "beam": 1, "alpha": 0.0}

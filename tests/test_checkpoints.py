"""Checkpoints and resuming: a resumed run is exactly the uninterrupted one (also after a signal mid-epoch),
metrics written after the last checkpoint are dropped, checkpoints every few minutes, the last K kept, loading,
refusing and averaging them, and a non-finite loss that stops training and keeps the last good checkpoint.

Everything runs on the CPU with tiny models and shrunken copy data, in pytest's tmp_path.
"""

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
import machinery.training  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402
from the_annotated_transformer import PAD  # noqa: E402
from conftest import last_state, run, tiny_cfg, tiny_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# 1. Resuming is exact
# --------------------------------------------------------------------------------------------


def test_resume_gives_exactly_the_uninterrupted_run(tmp_path):
    # 10 updates per epoch; stop at 7 (mid-epoch), then go on to 14 (across an epoch boundary)
    cfg = tiny_cfg(tmp_path / "a", P_drop=0.1, epochs=2, max_steps=7)
    data = tiny_data(cfg)
    assert (
        len(tat.length_batches([(12, 12)] * 200, cfg.batch_tokens, cfg.seed, 0)) == 10
    )

    run(cfg, data)
    stopped = last_state(tmp_path / "a")
    assert (stopped["step"], stopped["epoch"], stopped["batch_in_epoch"]) == (7, 0, 7)
    logs = []
    machinery.train(
        dataclasses.replace(cfg, max_steps=14),
        data=data,
        log=logs.append,
        progress=False,
        evaluate=False,
    )
    assert any(
        "resumed from" in str(line) and "checkpoint-00000007.pt" in str(line)
        for line in logs
    ), logs
    run(dataclasses.replace(cfg, max_steps=14, run_dir=str(tmp_path / "b")), data)

    a, b = last_state(tmp_path / "a"), last_state(tmp_path / "b")
    assert a["step"] == b["step"] == 14
    assert (
        (a["epoch"], a["batch_in_epoch"]) == (b["epoch"], b["batch_in_epoch"]) == (1, 4)
    )
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for i in opt_a:
        assert float(opt_a[i]["step"]) == float(opt_b[i]["step"]) == 14
        assert torch.equal(opt_a[i]["exp_avg"], opt_b[i]["exp_avg"])
        assert torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"])
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 14
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


def signal_at_update(monkeypatch, k: int, signum=signal.SIGINT):
    """Make the process send itself ``signum`` while update ``k`` (counting from 1) is being applied."""
    original = tat.make_optimizer

    def patched(model, cfg):
        optimizer, scheduler = original(model, cfg)
        calls = []

        def hook(opt, args, kwargs):
            calls.append(1)
            if len(calls) == k:
                os.kill(os.getpid(), signum)

        optimizer.register_step_pre_hook(hook)
        return optimizer, scheduler

    monkeypatch.setattr(tat, "make_optimizer", patched)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_epoch_saves_and_resuming_gives_the_uninterrupted_run(
    tmp_path, monkeypatch, signum
):
    # 10 updates per epoch, two epochs; the signal arrives during update 5
    cfg = tiny_cfg(tmp_path / "a", P_drop=0.1, epochs=2, checkpoint_minutes=0)
    data = tiny_data(cfg)
    found = signal.getsignal(
        signal.SIGINT
    )  # Python's own, or ignored in a background job
    with monkeypatch.context() as m:
        signal_at_update(m, 5, signum)
        with pytest.raises(
            machinery.TrainingInterrupted,
            match="after update 5.*Run the same command again",
        ):
            run(cfg, data)
    assert signal.getsignal(signal.SIGINT) is found, "the handler must be put back"
    stopped = last_state(tmp_path / "a")
    assert (stopped["step"], stopped["epoch"], stopped["batch_in_epoch"]) == (5, 0, 5)
    run(cfg, data)  # the same command again: continues from update 6
    run(
        dataclasses.replace(cfg, run_dir=str(tmp_path / "b")), data
    )  # never interrupted

    a, b = last_state(tmp_path / "a"), last_state(tmp_path / "b")
    assert a["step"] == b["step"] == 20
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i in a["optimizer"]["state"]:
        assert torch.equal(
            a["optimizer"]["state"][i]["exp_avg_sq"],
            b["optimizer"]["state"][i]["exp_avg_sq"],
        )
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    # the metrics log reads as one run: no step logged twice
    records = [
        json.loads(line)
        for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    ]
    valid_steps = [r["step"] for r in records if "valid_loss" in r]
    assert valid_steps == [10, 20]
    want = [
        json.loads(line)
        for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], sorted(r)) for r in records] == [
        (r["step"], sorted(r)) for r in want
    ]


def test_resume_drops_metrics_written_after_the_checkpoint(tmp_path):
    cfg = tiny_cfg(
        tmp_path / "run", epochs=6, warmup=40
    )  # 60 updates: records at 10, 20, …, 50 (train), 60
    data = tiny_data(cfg)
    run(dataclasses.replace(cfg, max_steps=30), data)
    metrics = tmp_path / "run" / "metrics.jsonl"
    # as if the run had gone on past its last checkpoint (step 30) and then died
    with open(metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 35, "valid_loss": 1.0}) + "\n")
    run(cfg, data)
    steps = [
        (r["step"], "valid_loss" in r)
        for r in map(json.loads, metrics.read_text().splitlines())
    ]
    assert (35, True) not in steps
    assert len(steps) == len(set(steps))


def test_checkpoints_every_few_minutes_inside_an_epoch(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(machinery.training.time, "time", lambda: clock[0])
    original = tat.make_optimizer

    def ticking(model, cfg):  # every update takes "one minute"
        optimizer, scheduler = original(model, cfg)
        optimizer.register_step_post_hook(
            lambda *a: clock.__setitem__(0, clock[0] + 60.0)
        )
        return optimizer, scheduler

    monkeypatch.setattr(tat, "make_optimizer", ticking)
    cfg = tiny_cfg(
        tmp_path / "run", checkpoint_minutes=3, keep_checkpoints=100
    )  # 10 updates
    run(cfg, tiny_data(cfg))
    steps = [
        int(p.stem.split("-")[1]) for p in machinery.checkpoint_paths(tmp_path / "run")
    ]
    assert steps == [3, 6, 9, 10]  # every 3 minutes, and the end of the epoch
    assert (
        last_state(tmp_path / "run")["batch_in_epoch"] == 0
    )  # the epoch's own checkpoint is the last


# --------------------------------------------------------------------------------------------
# 2. Checkpoints: the last few kept, loaded, refused, averaged
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """Four epochs of two updates each, keeping the last three checkpoints."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    cfg = tiny_cfg(run_dir, epochs=4, batch_tokens=1280, keep_checkpoints=3)
    data = tiny_data(cfg)
    summary = run(cfg, data)
    return cfg, data, run_dir, summary


def test_only_the_last_checkpoints_are_kept(short_run):
    cfg, _, run_dir, summary = short_run
    assert summary["steps"] == 8
    assert [p.name for p in machinery.checkpoint_paths(run_dir)] == [
        "checkpoint-00000004.pt",
        "checkpoint-00000006.pt",
        "checkpoint-00000008.pt",
    ]
    assert not list(run_dir.glob("*.part")), "temporary checkpoint files left behind"
    assert [
        machinery.load_checkpoint(p)["step"]
        for p in machinery.checkpoint_paths(run_dir)
    ] == [4, 6, 8]


def test_checkpoint_loads_with_its_own_config_and_vocabulary(short_run):
    cfg, data, run_dir, _ = short_run
    state = machinery.load_checkpoint(
        machinery.checkpoint_paths(run_dir)[-1], cfg, data.src_vocab, data.tgt_vocab
    )
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    model.load_state_dict(state["model"])  # strict: every tensor present, none extra
    assert state["config"] == dataclasses.asdict(cfg)
    assert state["vocab"]["src"] == data.src_vocab.itos


def test_checkpoints_are_plain_data(short_run):
    """torch.load(weights_only=True) accepts them: no pickled objects that could run code."""
    _, _, run_dir, _ = short_run
    state = torch.load(
        machinery.checkpoint_paths(run_dir)[-1], map_location="cpu", weights_only=True
    )
    assert {
        "model",
        "optimizer",
        "scheduler",
        "step",
        "epoch",
        "batch_in_epoch",
        "rng",
        "config",
        "vocab",
    } <= state.keys()


def test_truncated_checkpoint_is_reported(short_run, tmp_path):
    _, _, run_dir, _ = short_run
    blob = machinery.checkpoint_paths(run_dir)[-1].read_bytes()
    bad = tmp_path / "checkpoint-00000001.pt"
    bad.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(machinery.CheckpointError, match="truncated"):
        machinery.load_checkpoint(bad)


def test_checkpoint_for_another_d_model_is_refused(short_run):
    cfg, _, run_dir, _ = short_run
    with pytest.raises(machinery.CheckpointError, match="d_model"):
        machinery.load_checkpoint(
            machinery.checkpoint_paths(run_dir)[-1],
            dataclasses.replace(cfg, d_model=64),
        )


def test_the_decoders_depth_is_checked_however_it_was_written(short_run):
    cfg, _, run_dir, _ = short_run
    last = machinery.checkpoint_paths(run_dir)[-1]
    assert cfg.N_dec == 0
    machinery.load_checkpoint(
        last, dataclasses.replace(cfg, N_dec=cfg.N)
    )  # N_dec = N is the same model as 0
    with pytest.raises(
        machinery.CheckpointError, match=f"N: checkpoint {cfg.N} vs now {cfg.N + 1}"
    ) as refused:
        machinery.load_checkpoint(
            last, dataclasses.replace(cfg, N=cfg.N + 1, N_dec=cfg.N)
        )  # only the encoder differs
    assert "N_dec" not in str(refused.value)
    with pytest.raises(
        machinery.CheckpointError, match=f"N_dec: checkpoint {cfg.N} vs now {cfg.N + 1}"
    ):
        machinery.load_checkpoint(last, dataclasses.replace(cfg, N_dec=cfg.N + 1))


def test_checkpoint_for_another_vocabulary_is_refused(short_run):
    cfg, _, run_dir, _ = short_run
    other = machinery.make_copy_data(cfg, vocab_size=12, sizes=(1, 1, 1)).src_vocab
    with pytest.raises(machinery.CheckpointError, match="vocabulary"):
        machinery.load_checkpoint(
            machinery.checkpoint_paths(run_dir)[-1], cfg, other, other
        )


def test_training_refuses_to_resume_a_different_model(short_run, tmp_path):
    cfg, data, run_dir, _ = short_run
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    last = machinery.checkpoint_paths(run_dir)[-1]
    (resume_dir / last.name).write_bytes(last.read_bytes())
    with pytest.raises(machinery.CheckpointError, match="d_model"):
        run(
            dataclasses.replace(
                cfg, d_model=64, d_ff=64, run_dir=str(resume_dir), epochs=5
            ),
            data,
        )


def test_average_checkpoints_is_the_elementwise_mean(short_run):
    _, _, run_dir, _ = short_run
    paths = machinery.checkpoint_paths(run_dir)[-2:]
    s1, s2 = (machinery.load_checkpoint(p)["model"] for p in paths)
    avg = machinery.average_checkpoints(paths)
    assert avg.keys() == s1.keys()
    changed = 0
    for k in avg:
        torch.testing.assert_close(
            avg[k],
            ((s1[k].double() + s2[k].double()) / 2).to(s1[k].dtype),
            rtol=0,
            atol=1e-7,
        )
        changed += not torch.equal(s1[k], s2[k])
    assert changed > 0, "the two checkpoints are identical, so the test proves nothing"
    with pytest.raises(machinery.CheckpointError):
        machinery.average_checkpoints([])


# --------------------------------------------------------------------------------------------
# 3. A diverging loss stops training and keeps the last good checkpoint
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_raises_and_keeps_last_good_checkpoint(
    tmp_path, monkeypatch, bad
):
    cfg = tiny_cfg(tmp_path / "run", epochs=3, batch_tokens=1280)  # 2 updates per epoch
    data = tiny_data(cfg)
    real = tat.loss_sum  # the training loss, as the notebook's batch_loss computes it

    def poisoned(log_probs, target, eps_ls, pad=PAD):
        """The real loss until the first epoch's checkpoint exists, then a non-finite one."""
        loss = real(log_probs, target, eps_ls, pad)
        if torch.is_grad_enabled() and machinery.checkpoint_paths(cfg.run_dir):
            return loss * bad
        return loss

    monkeypatch.setattr(tat, "loss_sum", poisoned)
    with pytest.raises(machinery.TrainingDiverged) as err:
        run(cfg, data)
    message = str(err.value)
    assert (
        str(bad) in message
        and "step 3" in message
        and "checkpoint-00000002.pt" in message
    ), message
    paths = machinery.checkpoint_paths(cfg.run_dir)
    assert [p.name for p in paths] == ["checkpoint-00000002.pt"]
    state = machinery.load_checkpoint(paths[0], cfg, data.src_vocab, data.tgt_vocab)
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (2, 1, 0)
    assert all(
        torch.isfinite(v).all()
        for v in state["model"].values()
        if v.is_floating_point()
    )


def test_non_finite_loss_before_any_checkpoint_says_so(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path / "run")
    monkeypatch.setattr(
        tat, "loss_sum", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True)
    )
    with pytest.raises(machinery.TrainingDiverged, match="no checkpoint"):
        run(cfg, tiny_data(cfg))


def test_checkpoint_records_the_positional_encoding(tmp_path):
    cfg = tiny_cfg(tmp_path / "learned", positional="learned", max_len=64)
    data = machinery.make_copy_data(cfg)
    run(cfg, data)
    path = machinery.checkpoint_paths(tmp_path / "learned")[-1]
    state = machinery.load_checkpoint(path, cfg, data.src_vocab, data.tgt_vocab)
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    model.load_state_dict(state["model"])  # strict: both learned tables are in the file
    with pytest.raises(
        machinery.CheckpointError,
        match="positional: checkpoint 'learned' vs now 'sinusoid'",
    ):
        machinery.load_checkpoint(path, dataclasses.replace(cfg, positional="sinusoid"))
    # A checkpoint written before the setting existed holds a sinusoidal model.
    state["config"].pop("positional")
    older = tmp_path / "older.pt"
    torch.save(state, older)
    with pytest.raises(
        machinery.CheckpointError,
        match="positional: checkpoint 'sinusoid' vs now 'learned'",
    ):
        machinery.load_checkpoint(older, cfg)
    assert (
        machinery.load_checkpoint(
            older, dataclasses.replace(cfg, positional="sinusoid")
        )["step"]
        == state["step"]
    )

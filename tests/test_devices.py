"""Devices and precision, proven on a CPU: the precision each machine gets, fp16 with a gradient
scaler, tensors made on the device of the inputs (the `meta` device stands in for a GPU), one
host synchronisation per update, and models moved to the device decoding is asked for.
"""

import dataclasses
import hashlib
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
import machinery.devices  # noqa: E402
import machinery.evaluation  # noqa: E402
import machinery.training  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402
from the_annotated_transformer import PAD  # noqa: E402
from conftest import last_state, quiet, run, tiny_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch):
    """`auto` precision and attention decided without timing: every candidate ties, so float32 and the readable
    path (runs repeat exactly; tests of the measurement give their own timer)."""
    monkeypatch.setattr(
        machinery.training,
        "time_calls",
        lambda calls, device: dict.fromkeys(calls, 1.0),
    )


CPU, CUDA, META = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")


def tiny_data(cfg) -> machinery.Dataset:
    return machinery.make_copy_data(cfg, sizes=(200, 40, 20))


# --------------------------------------------------------------------------------------------
# 1. Which precision `auto` picks, and why
# --------------------------------------------------------------------------------------------


@pytest.fixture
def machine(monkeypatch):
    """Set what torch reports about the hardware.

    ``capability`` is the CUDA compute capability; ``is_bf16_supported`` behaves as torch's does:
    with emulation counted (its default) every CUDA GPU says yes, without it only 8.0 and up.
    """

    def set_(kernels="AVX512", avx512_bf16=False, amx=False, capability=(8, 0)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda device=None: capability
        )
        monkeypatch.setattr(
            torch.cuda,
            "is_bf16_supported",
            lambda including_emulation=True: including_emulation
            or capability >= (8, 0),
        )

    return set_


@pytest.mark.parametrize(
    "hardware, device, candidates, reason",
    [
        (
            dict(kernels="AVX2"),
            CPU,
            ["fp32"],
            "no native bf16",
        ),  # the common AVX2 CPU: nothing to measure
        (
            dict(kernels="AVX512", avx512_bf16=False),
            CPU,
            ["fp32"],
            "no native bf16",
        ),  # AVX-512 without BF16
        (
            dict(kernels="AVX2", avx512_bf16=True),
            CPU,
            ["fp32"],
            "kernels: AVX2",
        ),  # ATEN_CPU_CAPABILITY=avx2
        (
            dict(kernels="AVX512", avx512_bf16=True),
            CPU,
            ["fp32", "bf16"],
            "AVX-512 BF16",
        ),
        (
            dict(kernels="AVX512", amx=True, avx512_bf16=True),
            CPU,
            ["fp32", "bf16"],
            "AMX",
        ),
        (
            dict(capability=(6, 0)),
            CUDA,
            ["fp32", "fp16"],
            "6.0",
        ),  # P100: fast fp16, no bf16
        (
            dict(capability=(6, 1)),
            CUDA,
            ["fp32"],
            "6.1",
        ),  # consumer Pascal: fp16 at a fraction of fp32
        (dict(capability=(7, 0)), CUDA, ["fp32", "fp16"], "7.0"),  # V100
        (
            dict(capability=(7, 5)),
            CUDA,
            ["fp32", "fp16"],
            "7.5",
        ),  # T4, the free hosted-notebook GPU
        (dict(capability=(8, 0)), CUDA, ["fp32", "bf16"], "8.0"),  # A100
        (dict(capability=(9, 0)), CUDA, ["fp32", "bf16"], "9.0"),  # H100
    ],
)
def test_auto_measures_only_the_precisions_the_hardware_has(
    machine, hardware, device, candidates, reason
):
    machine(**hardware)
    got, why = machinery.precision_candidates(device)
    assert got == candidates and reason in why
    if candidates == ["fp32"]:  # no measurement: the answer cannot change
        assert machinery.resolve_precision("auto", device) == (
            "fp32",
            f"precision: float32 (auto: {why})",
        )
    else:
        with pytest.raises(ValueError, match="needs measured times"):
            machinery.resolve_precision("auto", device)


# the measurements of issue 37: seconds for 40 updates of multi30k-small, and the AMD EPYC's 2.4×
@pytest.mark.parametrize(
    "hardware, device, times, want, line",
    [
        (
            dict(kernels="AVX512", avx512_bf16=True),
            CPU,
            {"fp32": 25.0, "bf16": 38.3},
            "fp32",
            "precision: float32 (auto: bf16 measured 0.65× float32's speed here)",
        ),  # the Intel Xeon, no AMX
        (
            dict(kernels="AVX512", avx512_bf16=True),
            CPU,
            {"fp32": 24.0, "bf16": 10.0},
            "bf16",
            "precision: bf16 autocast (auto: bf16 measured 2.40× float32's speed here)",
        ),  # the AMD EPYC
        (
            dict(kernels="AVX512", avx512_bf16=True),
            CPU,
            {"fp32": 1.0, "bf16": 0.95},
            "fp32",
            "precision: float32 (auto: bf16 measured 1.05× float32's speed here)",
        ),  # a near-tie keeps float32
        (
            dict(kernels="AVX512", avx512_bf16=True),
            CPU,
            {"fp32": 1.1, "bf16": 1.0},
            "bf16",
            "precision: bf16 autocast (auto: bf16 measured 1.10× float32's speed here)",
        ),  # a clear win: 10%
        (
            dict(capability=(7, 5)),
            CUDA,
            {"fp32": 3.0, "fp16": 1.0},
            "fp16",
            "precision: fp16 autocast with a gradient scaler (auto: fp16 measured 3.00× float32's speed here)",
        ),
        (
            dict(capability=(9, 0)),
            CUDA,
            {"fp32": 2.0, "bf16": 1.0},
            "bf16",
            "precision: bf16 autocast (auto: bf16 measured 2.00× float32's speed here)",
        ),
    ],
)
def test_auto_precision_is_the_measured_faster_one_by_a_clear_margin(
    machine, hardware, device, times, want, line
):
    machine(**hardware)
    assert machinery.resolve_precision("auto", device, times) == (want, line)


@pytest.mark.parametrize(
    "times, want",
    [
        (
            {"readable": 24.4, "fast": 24.5},
            "readable",
        ),  # the Intel Xeon in float32: a tie
        ({"readable": 1.0, "fast": 0.95}, "readable"),  # 5% is not a clear win
        ({"readable": 1.0, "fast": 0.5}, "fast"),
    ],
)
def test_auto_attention_is_the_measured_faster_path_by_a_clear_margin(times, want):
    path, line = machinery.resolve_attention("auto", CPU, times)
    ratio = times["readable"] / times["fast"]
    assert (
        path == want
        and line
        == f"attention: {want} path (auto: fast measured {ratio:.2f}× readable's speed here)"
    )


def test_emulated_bf16_is_not_taken_for_native(machine):
    # torch.cuda.is_bf16_supported() says yes on a T4 (it counts emulation): that must not make bf16 a candidate
    machine(capability=(7, 5))
    assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(
        including_emulation=False
    )
    assert machinery.native_bf16(CUDA)[0] is False
    assert machinery.precision_candidates(CUDA)[0] == ["fp32", "fp16"]


def test_asked_for_precisions_are_obeyed_and_said(machine):
    machine(kernels="AVX2", capability=(7, 5))
    precision, line = machinery.resolve_precision("bf16", CPU)
    assert precision == "bf16" and "asked for" in line and "emulated" in line
    assert machinery.resolve_precision("bf16", CUDA)[0] == "bf16"
    assert machinery.resolve_precision("fp16", CPU) == (
        "fp16",
        "precision: fp16 autocast with a gradient scaler (asked for)",
    )
    machine(kernels="AVX512", avx512_bf16=True)
    assert machinery.resolve_precision("fp32", CPU) == (
        "fp32",
        "precision: float32 (asked for)",
    )


def test_time_calls_interleaves_warms_up_and_keeps_to_its_budget():
    order = []

    def call(name, seconds):
        return lambda: order.append(name) or __import__("time").sleep(seconds)

    t0 = __import__("time").perf_counter()
    times = machinery.time_calls(
        {"a": call("a", 0.02), "b": call("b", 0.06)}, CPU, budget_s=0.5
    )
    spent = __import__("time").perf_counter() - t0
    assert spent < 0.75, spent
    assert order[:4] == ["a", "b", "a", "b"], (
        "interleaved rounds, so a slow spell hits every candidate"
    )
    rounds = len(order) // 2
    assert (
        2 <= rounds <= 8 and order == ["a", "b"] * rounds
    )  # one warm-up round, then timed ones
    assert 0.015 < times["a"] < 0.05 and 0.05 < times["b"] < 0.1, times
    # the README's "within about 1.6 s" is the budget a run's measurement is given
    params = inspect.signature(machinery.time_calls).parameters
    budget, most = params["budget_s"].default, params["rounds"].default
    least = machinery.devices.MIN_ROUNDS
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    said = f"(their median, at least {least}, at most {most}) within about {budget} s"
    assert said in readme


def test_time_calls_times_a_few_rounds_even_of_passes_slower_than_its_budget():
    # one sample each would let a single slow spell decide a run's precision
    order = []
    calls = {n: (lambda n=n: order.append(n)) for n in "ab"}
    machinery.time_calls(calls, CPU, budget_s=-1.0)  # every round over budget
    least = machinery.devices.MIN_ROUNDS
    assert order == ["a", "b"] * (1 + least)  # the warm-up, then MIN_ROUNDS timed
    order.clear()
    machinery.time_calls(calls, CPU, budget_s=-1.0, rounds=1)
    assert order == ["a", "b"] * 2  # never more than asked for
    with pytest.raises(ValueError, match="at least one timed round"):
        machinery.time_calls(calls, CPU, rounds=0)


class FakeTimer:
    """Stands in for `time_calls`: seconds per pass for each (precision, attention path); notes what it was asked."""

    def __init__(self, **seconds):
        self.seconds, self.asked = seconds, []

    def __call__(self, calls, device):
        self.asked.append(sorted(calls))
        return {
            (p, a): self.seconds.get(f"{p}_{a}", self.seconds.get(p, 1.0))
            for p, a in calls
        }


def auto_run(tmp_path, monkeypatch, timer, name="run", **overrides):
    """Train the tiny config (auto precision and attention unless overridden); (log lines, summary)."""
    monkeypatch.setattr(machinery.training, "time_calls", timer)
    settings = dict(max_steps=2, precision="auto", attention="auto", P_drop=0.1)
    cfg = tiny_cfg(tmp_path / name, **{**settings, **overrides})
    logs = []
    summary = machinery.train(
        cfg, data=tiny_data(cfg), log=logs.append, progress=False, evaluate=False
    )
    return [str(line) for line in logs], summary


def test_training_log_and_summary_say_what_auto_measured(
    tmp_path, monkeypatch, machine
):
    machine(
        kernels="AVX512", avx512_bf16=True
    )  # bf16 is a candidate: it is measured, and slower here
    timer = FakeTimer(fp32=25.0, bf16=38.3, fp32_fast=26.0)
    logs, summary = auto_run(tmp_path, monkeypatch, timer)
    assert timer.asked == [
        [("bf16", "fast"), ("bf16", "readable"), ("fp32", "fast"), ("fp32", "readable")]
    ]
    assert (
        "precision: float32 (auto: bf16 measured 0.65× float32's speed here)" in logs
    ), logs
    assert (
        "attention: readable path (auto: fast measured 0.96× readable's speed here)"
        in logs
    ), logs
    assert (summary["precision"], summary["attention"]) == ("fp32", "readable")
    assert summary["auto"] == {
        "precision": "bf16 measured 0.65× float32's speed here",
        "attention": "fast measured 0.96× readable's speed here",
    }
    assert summary["config"]["precision"] == "auto", (
        "the setting as given; what it became beside it"
    )
    state = last_state(tmp_path / "run")
    assert (state["config"]["precision"], state["config"]["attention"]) == (
        "fp32",
        "readable",
    )

    machine(
        kernels="AVX2"
    )  # no native bf16: float32 without measuring it; the attention paths still are
    timer = FakeTimer(fp32=1.0, fp32_fast=0.5)
    logs, summary = auto_run(tmp_path, monkeypatch, timer, name="avx2")
    assert timer.asked == [[("fp32", "fast"), ("fp32", "readable")]]
    assert any(
        line.startswith("precision: float32 (auto: the CPU has no native bf16")
        for line in logs
    ), logs
    assert (
        "attention: fast path (auto: fast measured 2.00× readable's speed here)" in logs
    )
    assert summary["attention"] == "fast"


def test_bf16_wins_where_it_measures_faster_and_the_attention_is_timed_in_it(
    tmp_path, monkeypatch, machine
):
    machine(kernels="AVX512", avx512_bf16=True)
    timer = FakeTimer(fp32=2.4, bf16=1.0, bf16_fast=1.3, fp32_fast=0.5)
    logs, summary = auto_run(tmp_path, monkeypatch, timer)
    # float32 with the fast path would be faster still; precision compares each at its better path: 0.5 vs 1.0
    assert summary["precision"] == "fp32" and summary["attention"] == "fast", logs
    timer = FakeTimer(fp32=2.4, bf16=1.0, bf16_fast=1.3, fp32_fast=2.0)
    logs, summary = auto_run(tmp_path, monkeypatch, timer, name="bf16")
    assert (summary["precision"], summary["attention"]) == ("bf16", "readable"), logs
    assert (
        "attention: readable path (auto: fast measured 0.77× readable's speed here, in bf16)"
        in logs
    )


def test_asked_for_settings_and_a_resumed_run_measure_nothing(
    tmp_path, monkeypatch, machine
):
    machine(kernels="AVX512", avx512_bf16=True)

    def no_timing(calls, device):
        raise AssertionError(f"measured {sorted(calls)}")

    logs, summary = auto_run(
        tmp_path, monkeypatch, no_timing, precision="bf16", attention="fast"
    )
    assert (summary["precision"], summary["attention"]) == ("bf16", "fast")
    assert "attention: fast path (asked for)" in logs
    # a run measured once keeps its choice when resumed, whatever a new measurement
    # would say, and still says what was measured
    first_logs, first = auto_run(
        tmp_path,
        monkeypatch,
        FakeTimer(fp32=2.0, bf16=1.0, bf16_fast=0.5),
        name="resumed",
    )
    assert "bf16 measured" in first["auto"]["precision"], first["auto"]
    logs, summary = auto_run(
        tmp_path, monkeypatch, no_timing, name="resumed", max_steps=4
    )
    assert (summary["steps"], summary["precision"], summary["attention"]) == (
        4,
        "bf16",
        "fast",
    )
    kept = "; kept from the checkpoint"
    for what in ("precision", "attention"):
        line = next(x for x in first_logs if x.startswith(f"{what}: "))
        assert line[:-1] + kept + ")" in logs, logs
        assert summary["auto"][what] == first["auto"][what] + kept
    # resumed again: the measurement is still the first run's, said once
    logs, again = auto_run(
        tmp_path, monkeypatch, no_timing, name="resumed", max_steps=6
    )
    assert again["auto"] == summary["auto"]


def test_auto_times_a_batch_of_the_runs_own_size(tmp_path, monkeypatch):
    # a smaller batch can rank the precisions the other way (devices.py)
    cfg = tiny_cfg(tmp_path / "run", batch_tokens=400)  # more than 256
    asked, probe = [], machinery.training.probe_batch

    def spy(pairs, tokens):
        asked.append(tokens)
        return probe(pairs, tokens)

    monkeypatch.setattr(machinery.training, "probe_batch", spy)
    machinery.training.measure_compute(
        cfg, tiny_data(cfg), CPU, ["fp32"], ["readable", "fast"],
        timer=lambda calls, device: dict.fromkeys(calls, 1.0),
    )  # fmt: skip
    assert asked == [400]


def test_measuring_leaves_the_runs_random_streams_and_numbers_as_they_were(
    tmp_path, monkeypatch, machine
):
    # with dropout: a measurement that drew from the streams would change every update after it
    machine(kernels="AVX512", avx512_bf16=True)
    measured = []

    def real_timer(
        calls, device
    ):  # really runs the passes (they use dropout), then says bf16 + readable
        measured.append(machinery.time_calls(calls, device, budget_s=0.2))
        return {
            (p, a): 1.0 if p == "bf16" and a == "readable" else 3.0 for p, a in calls
        }

    _, auto = auto_run(tmp_path, monkeypatch, real_timer, name="auto", max_steps=4)
    _, asked = auto_run(
        tmp_path,
        monkeypatch,
        real_timer,
        name="asked",
        max_steps=4,
        precision="bf16",
        attention="readable",
    )
    assert len(measured) == 1 and len(measured[0]) == 4, (
        "the auto run measured four ways, the other none"
    )
    assert (auto["precision"], auto["attention"]) == ("bf16", "readable")
    a, b = last_state(tmp_path / "auto"), last_state(tmp_path / "asked")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert (
        torch.equal(a["rng"]["torch"], b["rng"]["torch"])
        and a["rng"]["python"] == b["rng"]["python"]
    )


def test_precision_setting():
    assert machinery.Config().precision == "auto"
    assert all(cfg.precision == "auto" for cfg in machinery.PRESETS.values()), (
        "presets must not hard-code precision"
    )
    with pytest.raises(ValueError, match="auto, fp32, bf16, fp16"):
        machinery.Config(precision="fp8")
    for precision in ("fp32", "bf16", "fp16"):
        _, cfg = machinery.config_from_args(
            ["train", "--config", "copy", "--precision", precision]
        )
        assert cfg.precision == precision


# --------------------------------------------------------------------------------------------
# 2. Autocast runs on the CPU: bf16, and fp16 with a gradient scaler that resumes exactly
# --------------------------------------------------------------------------------------------


def spy_on_loss(monkeypatch) -> list:
    """Record (autocast on, its dtype, loss) for every training loss computed."""
    real, seen = (
        tat.loss_sum,
        [],
    )  # the training loss, as the notebook's batch_loss computes it

    def spy(log_probs, target, eps_ls, pad=PAD):
        loss = real(log_probs, target, eps_ls, pad)
        if torch.is_grad_enabled():
            seen.append(
                (
                    torch.is_autocast_enabled("cpu"),
                    torch.get_autocast_dtype("cpu"),
                    float(loss.detach()),
                )
            )
        return loss

    monkeypatch.setattr(tat, "loss_sum", spy)
    return seen


def test_bf16_autocast_trains_on_cpu(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path / "bf16", precision="bf16", max_steps=3)
    seen = spy_on_loss(monkeypatch)
    assert run(cfg, tiny_data(cfg))["steps"] == 3 and len(seen) == 3
    assert all(
        enabled and dtype == torch.bfloat16 and math.isfinite(loss)
        for enabled, dtype, loss in seen
    ), seen
    assert all(
        torch.isfinite(v).all() for v in last_state(cfg.run_dir)["model"].values()
    )


@pytest.fixture
def large_initial_scale(monkeypatch):
    """A gradient scaler starting at 2**40, so that the first fp16 updates overflow and are skipped."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(
        torch.amp,
        "GradScaler",
        lambda device, enabled=True: real(device, init_scale=2.0**40, enabled=enabled),
    )


def test_fp16_with_a_gradient_scaler_trains_and_resumes_exactly(
    tmp_path, monkeypatch, large_initial_scale
):
    # three epochs of 10 updates; stopped at 13 and resumed, against one go
    cfg = tiny_cfg(
        tmp_path / "a", precision="fp16", P_drop=0.1, epochs=3, warmup=10, max_steps=13
    )
    data = tiny_data(cfg)
    seen = spy_on_loss(monkeypatch)
    run(cfg, data)
    assert seen and all(
        enabled and dtype == torch.float16 for enabled, dtype, _ in seen
    )
    stopped = last_state(cfg.run_dir)
    assert stopped["scaler"]["scale"] < 2.0**40, (
        "the first updates overflowed: the scale must have backed off"
    )
    run(dataclasses.replace(cfg, max_steps=0), data)
    run(dataclasses.replace(cfg, max_steps=0, run_dir=str(tmp_path / "b")), data)

    a, b = last_state(tmp_path / "a"), last_state(tmp_path / "b")
    assert a["step"] == b["step"] == 30
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 0
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # it trains: the validation loss falls from the first epoch to the last
    valid = [
        json.loads(line)["valid_loss"]
        for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
        if "valid_loss" in line
    ]
    assert len(valid) == 3 and valid[-1] < valid[0], valid


def test_fp16_masks_give_masked_keys_zero_weight_and_no_nan():
    torch.manual_seed(0)
    q = (
        torch.randn(2, 4, 6, 8) * 30
    ).half()  # large scores: anything but -inf could overflow or leak
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False  # padding keys
    mask[1] = torch.tril(torch.ones(6, 6, dtype=torch.bool))  # causal
    out, p = tat.attention(q, q, q, mask)
    assert (
        out.dtype == torch.float16
        and torch.isfinite(out).all()
        and torch.isfinite(p).all()
    )
    assert (p.masked_select(~mask.expand_as(p)) == 0).all()
    torch.testing.assert_close(
        p.float().sum(-1), torch.ones(2, 4, 6), atol=2e-3, rtol=0
    )


# --------------------------------------------------------------------------------------------
# 3. Device discipline: tensors are made where the inputs are
# --------------------------------------------------------------------------------------------


def test_forward_loss_and_backward_run_on_the_meta_device():
    # a tensor made on the CPU inside the model, the masks or the loss would meet meta tensors and fail
    cfg = machinery.get_config("tiny", N=1, d_model=32, d_ff=64, h=4)
    with torch.device("meta"):
        model = tat.make_model(14, 14, cfg)
    pairs = [([1, 5, 6, 2], [1, 7, 2]), ([1, 5, 2], [1, 7, 8, 9, 2])]
    batch = tat.make_batch(pairs, [0, 1]).to(META)
    assert batch.tgt_mask.device == META
    out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    loss = tat.loss_sum(model.generator(out), batch.tgt_y, 0.1)
    loss.backward()
    assert loss.device == META and all(
        p.grad is not None and p.grad.device == META for p in model.parameters()
    )
    model.zero_grad(set_to_none=True)
    trained = tat.batch_loss(
        model, batch, 0.1
    )  # what training calls, the notebook's and the package's
    trained.backward()
    assert trained.device == META and all(
        p.grad is not None and p.grad.device == META for p in model.parameters()
    )


def test_batches_go_to_a_gpu_through_pinned_memory(monkeypatch):
    pinned, moves = [], []
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self
    )
    monkeypatch.setattr(
        torch.Tensor,
        "to",
        lambda self, device, non_blocking=False: moves.append(
            (torch.device(device).type, non_blocking)
        )
        or self,
    )
    batch = tat.make_batch([([1, 5, 2], [1, 6, 2])], [0])
    machinery.training.to_device(batch, "cuda")
    assert (
        len(pinned) == 5 and moves[:5] == [("cuda", True)] * 5
    )  # src, src_mask, tgt, tgt_y, tgt_mask
    pinned.clear(), moves.clear()
    machinery.training.to_device(batch, "cpu")
    assert not pinned and moves == [("cpu", False)] * 5


def host_syncs(monkeypatch) -> list:
    """Count conversions of tensors to Python values made by the notebook's or the package's own code (each one
    a host sync on a GPU)."""
    ours = {
        tat.__name__,
        *(name for name in sys.modules if name.split(".")[0] == "machinery"),
    }
    calls = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") in ours:
                calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


def test_an_update_synchronises_with_the_host_once_however_many_batches(
    tmp_path, monkeypatch
):
    cfg = tiny_cfg(tmp_path / "run", accum_steps=3)
    data = tiny_data(cfg)
    r = machinery.setup(cfg, data, CPU, 0, 1, quiet)
    pairs = data.splits["train"]
    micro = [tat.make_batch(pairs, list(range(i, i + 4))) for i in (0, 4, 8)]
    calls = host_syncs(monkeypatch)
    loss, tokens, _ = machinery.update(r, micro)
    assert len(calls) == 1, calls  # the loss, read once (the token counts: the host's)
    assert tokens == sum(b.ntokens for b in micro) and math.isfinite(loss)


def test_decoding_moves_a_model_that_is_elsewhere(monkeypatch):
    model = tat.make_model(
        14, 14, machinery.get_config("tiny", N=1, d_model=32, d_ff=64, h=4)
    )
    assert (
        machinery.on_device(model, CPU) is model
        and next(model.parameters()).device == CPU
    )
    machinery.on_device(model, META)
    assert all(p.device == META for p in model.parameters())
    # evaluate_test hands its model to on_device with the device it was asked for, and translate moves it there
    asked, moved = [], []
    monkeypatch.setattr(
        machinery.evaluation,
        "on_device",
        lambda m, device: asked.append(torch.device(device)) or m,
    )
    real_to = torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module,
        "to",
        lambda self, *args, **kwargs: moved.append(
            (type(self).__name__, torch.device(*args))
        )
        or real_to(self, *args, **kwargs),
    )
    cpu_model = tat.make_model(
        14, 14, machinery.get_config("tiny", N=1, d_model=32, d_ff=64, h=4)
    )
    cfg = machinery.get_config(
        "copy", N=1, d_model=32, d_ff=64, h=4, max_eval_sentences=2, examples_to_show=0
    )
    data = machinery.make_copy_data(cfg, sizes=(4, 2, 2))
    machinery.evaluate_test(cpu_model, data, cfg, "cpu", log=quiet, progress=False)
    assert asked and set(asked) == {CPU}
    assert moved == [("EncoderDecoder", CPU)] * 2  # greedy, then beam search


def test_decoding_takes_the_attention_path_of_the_device_it_runs_on(
    tmp_path, monkeypatch
):
    # the checkpoint records the path its training used (readable, on a CPU); decoding on CUDA takes the fused one
    cfg = tiny_cfg(tmp_path / "run", max_steps=1, attention="readable")
    run(cfg, tiny_data(cfg))
    assert last_state(tmp_path / "run")["config"]["attention"] == "readable"
    asked, real = [], tat.make_model

    class Built(Exception):
        """Stops load_for_inference once the model is built (there is no GPU to move it to)."""

    def spy(*args, attention=None, **kwargs):
        asked.append(attention)
        if len(asked) > 1:
            raise Built
        return real(*args, attention=attention, **kwargs)

    monkeypatch.setattr(tat, "make_model", spy)
    machinery.load_for_inference(run_dir=tmp_path / "run", device="cpu")
    with pytest.raises(Built):
        machinery.load_for_inference(run_dir=tmp_path / "run", device="cuda")
    assert asked == ["readable", "fast"]


# --------------------------------------------------------------------------------------------
# 4. Random-number states in checkpoints
# --------------------------------------------------------------------------------------------


def test_a_checkpoint_holding_four_gpus_rng_states_resumes_where_one_exists(
    monkeypatch,
):
    # the older format: rank 0's list of every visible GPU's state; now one GPU is visible
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]
    old = {
        "torch": torch.get_rng_state(),
        "python": __import__("random").getstate(),
        "cuda": states,
    }
    restored = []
    monkeypatch.setattr(
        torch.cuda,
        "set_rng_state",
        lambda state, device="cuda": restored.append((state, device)),
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    machinery.restore_rng(old, CUDA)
    assert (
        len(restored) == 1
        and torch.equal(restored[0][0], states[0])
        and restored[0][1] == CUDA
    )
    restored.clear()
    machinery.restore_rng(
        old, torch.device("cuda", 5)
    )  # a GPU the checkpoint knew nothing of: left as seeded
    assert restored == []


def test_each_process_seeds_its_own_stream():
    digests = []
    for rank in range(3):
        machinery.seed_process(7, rank)
        digests.append(
            hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        )
    assert len(set(digests)) == 3
    machinery.seed_process(7, 0)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state()), (
        "process 0 keeps the plain seed"
    )


# --------------------------------------------------------------------------------------------
# 5. The IWSLT preset is fairseq's transformer_iwslt_de_en recipe (departures: REPRODUCTION_NOTES.md)
# --------------------------------------------------------------------------------------------


def test_the_iwslt_preset_is_fairseqs_recipe():
    cfg = machinery.get_config("iwslt14-small")
    assert (cfg.N, cfg.d_model, cfg.d_ff, cfg.h, cfg.P_drop, cfg.eps_ls) == (
        6,
        512,
        1024,
        4,
        0.3,
        0.1,
    )
    assert (cfg.batch_tokens, cfg.warmup, cfg.clip_grad, cfg.norm_first) == (
        4096,
        4000,
        0.0,
        False,
    )
    peak = max(
        tat.rate(s, cfg.d_model, cfg.lr_factor, cfg.warmup)
        for s in range(1, 3 * cfg.warmup)
    )
    assert peak == pytest.approx(5e-4, rel=1e-6)
    assert (
        tat.rate(cfg.warmup, cfg.d_model, cfg.lr_factor, cfg.warmup) == peak
    )  # the peak is at the warm-up's end
    assert tat.rate(
        4 * cfg.warmup, cfg.d_model, cfg.lr_factor, cfg.warmup
    ) == pytest.approx(peak / 2)
    optimizer, _ = tat.make_optimizer(torch.nn.Linear(3, 3), cfg)
    assert (
        isinstance(optimizer, torch.optim.AdamW)
        and optimizer.param_groups[0]["weight_decay"] == 1e-4
    )
    assert cfg.average_last == 5
    plain, _ = tat.make_optimizer(torch.nn.Linear(3, 3), machinery.get_config("base"))
    assert type(plain) is torch.optim.Adam, "the paper's presets keep plain Adam"


def test_allocator_note_says_whether_glibc_keeps_freed_memory(monkeypatch):
    cpu, settings = torch.device("cpu"), dict(machinery.GLIBC_MALLOC_SETTINGS)
    monkeypatch.setattr(machinery.devices.sys, "platform", "linux")
    monkeypatch.setattr(
        machinery.devices.platform, "libc_ver", lambda: ("glibc", "2.36")
    )
    assert machinery.allocator_note(cpu, settings).startswith(
        "memory: glibc keeps freed memory for reuse"
    )
    missing = machinery.allocator_note(cpu, {"MALLOC_MMAP_MAX_": "0"})
    assert (
        missing.startswith("memory: not ")
        and "MALLOC_TRIM_THRESHOLD_=17179869184" in missing
    )
    assert (
        machinery.allocator_note(torch.device("meta"), {}) == ""
    )  # off the CPU (CUDA has its own allocator)
    monkeypatch.setattr(
        machinery.devices.platform, "libc_ver", lambda: ("", "")
    )  # musl, or not known
    assert machinery.allocator_note(cpu, {}) == ""
    monkeypatch.setattr(machinery.devices.sys, "platform", "darwin")
    assert machinery.allocator_note(cpu, {}) == ""


def test_a_batch_bound_for_a_gpu_pins_contiguous_tensors_and_copies_without_waiting(
    monkeypatch,
):
    # the decoder input and targets are slices of one tensor: pinning a slice would
    # leave the copy to an unpinned temporary. CUDA is faked: pinning and the copy are
    # recorded, not done.
    pinned, copies = [], []

    def pin_memory(self):
        pinned.append(self.is_contiguous())
        return self

    def to(self, device, non_blocking=False):
        copies.append((str(device), non_blocking))
        return self

    batch = tat.make_batch([([4, 5, 6, 7], [1, 4, 5, 2]), ([4, 5], [1, 4, 2])], [0, 1])
    assert not batch.tgt.is_contiguous() and not batch.tgt_y.is_contiguous()
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    machinery.training.to_device(batch, "cuda")
    assert pinned == [True] * 5, pinned
    assert copies == [("cuda", True)] * 5


def sdpa_flags() -> dict:
    """Which of SDPA's CUDA kernels may be chosen now."""
    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def test_cudnn_attention_is_left_out_on_cuda_only_while_a_pass_computes(monkeypatch):
    before = sdpa_flags()
    assert before["cudnn"], "PyTorch's default allows cuDNN's kernel"
    with machinery.devices.computing(torch.device("cuda"), "fp32")():
        assert sdpa_flags() == {**before, "cudnn": False}
    assert sdpa_flags() == before, "restored after the pass"
    for precision in ("fp32", "bf16"):
        with machinery.devices.computing(torch.device("cpu"), precision)():
            assert sdpa_flags() == before, "nothing changes off CUDA"
            assert torch.is_autocast_enabled("cpu") == (precision == "bf16")
        assert not torch.is_autocast_enabled("cpu")
    # a kernel the user switched off stays off; only cuDNN's is touched
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    flash = []
    monkeypatch.setattr(torch.backends.cuda, "enable_flash_sdp", flash.append)
    with machinery.devices.attention_kernels(torch.device("cuda")):
        assert flash == [] and not torch.backends.cuda.cudnn_sdp_enabled()


def test_every_update_and_every_measured_pass_runs_in_the_kernel_context(
    tmp_path, monkeypatch
):
    # the context a CUDA run would enter, entered on the CPU: each forward pass sees
    # cuDNN's kernel switched off
    real = machinery.devices.attention_kernels
    monkeypatch.setattr(
        machinery.devices,
        "attention_kernels",
        lambda device: real(torch.device("cuda")),
    )
    seen = []
    loss_sum = tat.loss_sum

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return loss_sum(*args, **kwargs)

    monkeypatch.setattr(tat, "loss_sum", spy)
    cfg = tiny_cfg(tmp_path / "k", precision="bf16", max_steps=3)
    assert run(cfg, tiny_data(cfg))["steps"] == 3
    assert seen[:3] == [False] * 3, "every update's forward pass in the context"
    assert torch.backends.cuda.cudnn_sdp_enabled(), "restored after"
    seen.clear()
    times = machinery.training.measure_compute(
        cfg,
        tiny_data(cfg),
        torch.device("cpu"),
        ["fp32", "bf16"],
        ["readable"],
        timer=lambda calls, device: {k: (f(), 1.0)[1] for k, f in calls.items()},
    )
    assert len(times) == 2 and seen == [False] * 2


# TF32's switches are process-wide (and torch refuses to read them once its old and
# new APIs have both set them), so the check runs in a process of its own, with the
# capability faked.
TF32_CHECK = """
import torch
from machinery.devices import allow_tf32

assert allow_tf32(torch.device("cpu")) == ""
assert not torch.backends.cuda.matmul.allow_tf32
for capability, where in (((7, 0), "no effect before Ampere"), ((8, 0), "tensor cores")):
    torch.cuda.get_device_capability = lambda device=None: capability
    line = allow_tf32(torch.device("cuda"))
    assert "TF32 allowed" in line and where in line, line
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
"""


def test_float32_matrix_products_on_cuda_may_use_tf32():
    # the README: "On CUDA, float32 matrix products use TF32"; off CUDA nothing changes
    done = subprocess.run(
        [sys.executable, "-c", TF32_CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def cpu_cgroup(tmp_path, files: dict, own: str = "0::/job\n"):
    """A fake cgroup tree with ``files`` (relative path → text), and the
    /proc/self/cgroup that places this process in it."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "own").write_text(own)
    return str(root), str(tmp_path / "own")


def test_threads_default_to_the_cores_affinity_and_a_cpu_quota_allow(tmp_path):
    from machinery.devices import cpu_quota, usable_cores

    allowed = len(__import__("os").sched_getaffinity(0))
    none = cpu_cgroup(tmp_path / "a", {"job/cpu.max": "max 100000\n"})
    assert cpu_quota(*none) is None and usable_cores(*none) == allowed
    half = cpu_cgroup(tmp_path / "b", {"job/cpu.max": "50000 100000\n"})
    assert cpu_quota(*half) == 0.5 and usable_cores(*half) == 1  # at least one
    above = cpu_cgroup(  # the parent's quota is the tighter one
        tmp_path / "c", {"cpu.max": "100000 100000\n", "job/cpu.max": "900000 100000\n"}
    )
    assert cpu_quota(*above) == 1.0 and usable_cores(*above) == 1
    v1 = cpu_cgroup(
        tmp_path / "d",
        {"cpu/k8s/cpu.cfs_quota_us": "150000\n", "cpu/k8s/cpu.cfs_period_us": "100000"},
        own="3:cpu,cpuacct:/k8s\n",
    )
    assert cpu_quota(*v1) == 1.5 and usable_cores(*v1) == min(allowed, 2)
    unlimited_v1 = cpu_cgroup(
        tmp_path / "e", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "1"}
    )
    assert cpu_quota(*unlimited_v1) is None


def test_processes_the_machinery_starts_wait_passively_unless_told_otherwise():
    from machinery.devices import WAIT_POLICY, quiet_environment, usable_cores

    env = quiet_environment({"PATH": "/bin"})
    assert env["OMP_WAIT_POLICY"] == WAIT_POLICY == "PASSIVE"
    assert env["OMP_NUM_THREADS"] == str(usable_cores()) and env["PATH"] == "/bin"
    own = quiet_environment({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "7"})
    assert own["OMP_WAIT_POLICY"] == "ACTIVE" and own["OMP_NUM_THREADS"] == "7"


def test_torch_threads_are_lowered_to_the_usable_cores_unless_set(monkeypatch):
    from machinery.devices import usable_cores, use_usable_cores

    before, cores = torch.get_num_threads(), usable_cores()
    try:
        torch.set_num_threads(cores + 3)
        line = use_usable_cores({"OMP_NUM_THREADS": str(cores + 3)})
        assert torch.get_num_threads() == cores + 3  # the user's number stays
        assert f"OMP_NUM_THREADS={cores + 3}" in line
        assert "OMP_WAIT_POLICY not set" in line
        line = use_usable_cores({"OMP_WAIT_POLICY": "PASSIVE"})
        assert torch.get_num_threads() == cores
        assert line.startswith(f"threads: {cores} ") and "PASSIVE" in line
        torch.set_num_threads(1)  # fewer than the cores (a caller's choice): kept
        use_usable_cores({})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

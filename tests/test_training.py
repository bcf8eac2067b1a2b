"""Part 2 (training) as invariants: the Eq. 3 schedule and Adam, label smoothing and the loss, the
production update (`machinery.update`) as the notebook's `train_step`, Part 4's runs using the notebook's
definitions as a reader has edited them, gradient accumulation, the copy preset learning to copy, the run
plan and its clock, the default preset.

Everything runs on the CPU with tiny models and shrunken copy data; every run writes into
pytest's tmp_path, never into the repository. Resuming and checkpoints: test_checkpoints.py;
decoding: test_decoding.py; the command line: test_cli.py.
"""

import contextlib
import copy
import dataclasses
import json
import math
import random
import re
import sys
import time
import types
from pathlib import Path

import jupytext
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
import machinery.devices  # noqa: E402
import machinery.parts  # noqa: E402
import machinery.planning  # noqa: E402
import machinery.training  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402
from the_annotated_transformer import BOS, EOS, PAD  # noqa: E402
from conftest import last_state, quiet, run, tiny_cfg, tiny_data  # noqa: E402

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


def varlen_data(cfg, n: int = 120, seed: int = 0) -> machinery.Dataset:
    """Copy pairs of 1–10 symbols, so that batches hold different token counts and padding."""
    base = tiny_data(cfg)
    rng = random.Random(seed)
    n_symbols = len(base.src_vocab)

    def pairs(k):
        out = []
        for _ in range(k):
            ids = (
                [BOS]
                + [rng.randrange(4, n_symbols) for _ in range(rng.randint(1, 10))]
                + [EOS]
            )
            out.append((ids, list(ids)))
        return out

    return dataclasses.replace(
        base, splits={"train": pairs(n), "valid": pairs(10), "test": pairs(10)}
    )


# --------------------------------------------------------------------------------------------
# 1. The learning-rate schedule (§5.3, Eq. 3) and Adam's settings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, d_model, factor, warmup",
    [
        (1, 512, 1.0, 4000),
        (100, 512, 1.0, 4000),
        (4000, 512, 1.0, 4000),
        (4001, 512, 1.0, 4000),
        (100_000, 512, 1.0, 4000),
        (37, 64, 2.0, 200),
        (500, 64, 0.5, 200),
    ],
)
def test_rate_is_equation_3(step, d_model, factor, warmup):
    assert tat.rate(step, d_model, factor, warmup) == pytest.approx(
        eq3(step, d_model, factor, warmup), rel=1e-12
    )


def eq3(step, d_model, factor, warmup):
    """Eq. 3 written piecewise, as the paper's prose describes it (not as the module computes it):
    linear from 0 to the peak d_model^-0.5 · warmup^-0.5 at step = warmup, then ∝ step^-0.5."""
    peak = 1.0 / math.sqrt(d_model * warmup)
    return factor * (
        peak * step / warmup if step <= warmup else peak * math.sqrt(warmup / step)
    )


def test_rate_known_values():
    # At the peak, step = warmup: d_model^-0.5 * warmup^-0.5 = 1 / sqrt(512 * 4000).
    assert tat.rate(4000, 512, 1.0, 4000) == pytest.approx(
        6.987712429686843e-04, rel=1e-12
    )
    # Linear warm-up: step 1 is 1/4000 of the peak.
    assert tat.rate(1, 512, 1.0, 4000) == pytest.approx(
        6.987712429686843e-04 / 4000, rel=1e-12
    )
    # Eq. 3 counts steps from 1; step 0 is not a step.
    with pytest.raises(ValueError, match="from 1"):
        tat.rate(0, 512, 1.0, 4000)


@pytest.mark.parametrize("warmup", [10, 200, 4000])
def test_rate_rises_linearly_then_decays_peaking_at_warmup(warmup):
    steps = range(1, 3 * warmup + 1)
    rates = [tat.rate(s, 512, 1.0, warmup) for s in steps]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == warmup
    before, after = rates[:warmup], rates[warmup - 1 :]
    assert all(a < b for a, b in zip(before, before[1:])), (
        "not increasing during warm-up"
    )
    assert all(a > b for a, b in zip(after, after[1:])), "not decreasing after warm-up"
    # proportional to the step number during warm-up, to step^-0.5 after it
    assert rates[warmup // 2 - 1] / rates[warmup - 1] == pytest.approx(
        (warmup // 2) / warmup, rel=1e-12
    )
    assert rates[3 * warmup - 1] / rates[warmup - 1] == pytest.approx(
        3**-0.5, rel=1e-12
    )


def test_adam_uses_the_papers_betas_and_eps():
    optimizer, _ = tat.make_optimizer(nn.Linear(3, 3), machinery.get_config("base"))
    assert isinstance(optimizer, torch.optim.Adam)
    group = optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.9, 0.98)
    assert group["eps"] == 1e-9


def test_fused_adam_takes_the_same_steps_as_the_per_tensor_loop():
    # float64 and no dropout; after three steps the fused kernel agrees with the loop
    # to 5e-8 (to 1e-9 or better where we measured it), where the loop with another ε
    # (1e-8 for §5.3's 1e-9) is about 3e-7 away
    def three_steps(optimizer):
        torch.manual_seed(0)
        model = tat.make_model(11, 11, machinery.PRESETS["tiny"]).double().eval()
        opt = optimizer(model)
        opt.param_groups[0]["lr"] = 1e-3
        src = torch.randint(4, 11, (3, 7))
        for _ in range(3):
            out = model(src, src, (src != PAD).unsqueeze(-2), tat.subsequent_mask(7))
            model.generator(out).sum().backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters())

    def loop(eps):
        return lambda m: torch.optim.Adam(
            m.parameters(), lr=1.0, betas=(0.9, 0.98), eps=eps, foreach=False
        )

    def fused(model):
        opt, _ = tat.make_optimizer(model, machinery.get_config("tiny"))
        assert opt.defaults["fused"]  # the CPU has Adam's fused kernel
        return opt

    ours, same, other = (three_steps(o) for o in (fused, loop(1e-9), loop(1e-8)))

    def close(a, b):
        return all(torch.allclose(x, y, rtol=0, atol=5e-8) for x, y in zip(a, b))

    assert close(ours, same) and not close(ours, other)


def test_update_k_applies_equation_3_at_step_k():
    cfg = machinery.get_config("tiny", warmup=10, lr_factor=2.0)
    model = nn.Linear(4, 2)
    optimizer, scheduler = tat.make_optimizer(model, cfg)
    applied = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"])
    )
    x = torch.randn(5, 4)
    for _ in range(30):
        model(x).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert len(applied) == 30
    for k, lr in enumerate(applied, start=1):
        assert lr == pytest.approx(eq3(k, cfg.d_model, 2.0, 10), rel=1e-12), k
    assert applied[0] < applied[1], "updates 1 and 2 must not share a rate"
    assert max(range(30), key=applied.__getitem__) + 1 == cfg.warmup


def test_logged_lr_is_the_one_each_update_applied(tmp_path):
    cfg = tiny_cfg(
        tmp_path / "lr", epochs=6, warmup=40
    )  # 60 updates; a training record every 50
    run(cfg, tiny_data(cfg))
    records = [
        json.loads(line)
        for line in (tmp_path / "lr" / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in records if "lr" in r]
    assert [r["step"] for r in logged] == [50]
    assert logged[0]["lr"] == pytest.approx(
        eq3(50, cfg.d_model, cfg.lr_factor, cfg.warmup), rel=1e-12
    )


# --------------------------------------------------------------------------------------------
# 2. Label smoothing (§5.4)
# --------------------------------------------------------------------------------------------


def smoothed_entropy(K: int, eps: float) -> float:
    """H(q) for q = (1 - eps) onehot + eps / K, in float64, with 0 log 0 = 0."""
    probs = [1 - eps + eps / K] + [eps / K] * (K - 1)
    return -sum(p * math.log(p) for p in probs if p > 0)


def random_scores(n: int, K: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, K, generator=g, dtype=dtype)
    target = torch.randint(0, K, (n,), generator=g)
    target[::4] = PAD  # some padding positions
    return logits, target


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("K", [5, 11])
def test_loss_sum_is_the_librarys_smoothed_cross_entropy(K, eps):
    logits, target = random_scores(17, K, seed=K)
    assert 0 < int((target != PAD).sum()) < len(target)
    got = tat.loss_sum(F.log_softmax(logits, dim=-1), target, eps)
    ce = F.cross_entropy(
        logits, target, ignore_index=PAD, label_smoothing=eps, reduction="sum"
    )
    assert float(got) == pytest.approx(float(ce), rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.2])
def test_the_smoothed_target_is_the_papers_q(eps):
    K = 9
    for y in (0, 4, 8):
        q = tat.smoothed_target(K, y, eps)
        assert q.shape == (K,)
        assert float(q.sum()) == pytest.approx(1.0)
        assert float(q[y]) == pytest.approx(1 - eps + eps / K)
        others = torch.cat([q[:y], q[y + 1 :]])
        torch.testing.assert_close(others, torch.full((K - 1,), eps / K))


@pytest.mark.parametrize(
    "preset, V, most", [("copy", 14, 3.0), ("multi30k-small", 8000, 1.05)]
)
def test_a_fresh_model_starts_above_an_even_spreads_loss(preset, V, most):
    """The notebook's and LossWatch's premise: an untrained model's loss per token
    starts above ln |V| (an even spread over the target vocabulary), and below the
    ``most`` × ln |V| they name (LossWatch's factor 3 on the copy task; just above
    ln |V| for a real vocabulary)."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = tat.make_model(V, V, machinery.get_config(preset), attention="readable")
        rng = random.Random(seed)
        pairs = [
            ([BOS] + [rng.randrange(4, V) for _ in range(10)] + [EOS],) * 2
            for _ in range(16)
        ]
        batch = tat.make_batch(pairs, range(16))
        with torch.no_grad():
            loss = tat.batch_loss(model.eval(), batch, 0.1).item() / batch.ntokens
        assert math.log(V) < loss < most * math.log(V)
    assert most <= machinery.planning.LossWatch.factor


def test_loss_sum_is_least_at_q_where_it_equals_the_entropy_of_q():
    K, eps = 6, 0.2
    q = tat.smoothed_target(K, 4, eps).double()
    floor = float(tat.loss_sum(q.log().unsqueeze(0), torch.tensor([4]), eps))
    assert floor == pytest.approx(smoothed_entropy(K, eps), rel=1e-6)  # H(q, q) = H(q)
    for seed in range(5):
        logits, _ = random_scores(1, K, seed=seed)
        other = float(tat.loss_sum(F.log_softmax(logits, -1), torch.tensor([4]), eps))
        assert other > floor


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_sum_is_the_cross_entropy_it_wraps(eps):
    K = 7
    logits, target = random_scores(24, K, seed=3, dtype=torch.float32)
    log_probs, target = (
        F.log_softmax(logits, -1).reshape(2, 12, K),
        target.reshape(2, 12),
    )
    got = tat.loss_sum(log_probs, target, eps)
    # written out: each non-pad position costs −(1−ε)·log p(y) − (ε/K)·Σ_k log p(k)
    want = sum(
        -(1 - eps) * log_probs[b, t, target[b, t]] - eps / K * log_probs[b, t].sum()
        for b in range(2)
        for t in range(12)
        if target[b, t] != PAD
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with eps = 0 it is the negative log-likelihood of the non-pad targets
    nll = (
        -log_probs.reshape(-1, K)[target.reshape(-1) != PAD]
        .gather(1, target.reshape(-1)[target.reshape(-1) != PAD].unsqueeze(1))
        .sum()
    )
    if eps == 0.0:
        torch.testing.assert_close(got, nll)
    # padding positions contribute nothing, whatever the model predicts there
    noisy = log_probs.clone()
    noisy[target == PAD] = F.log_softmax(torch.randn(int((target == PAD).sum()), K), -1)
    torch.testing.assert_close(tat.loss_sum(noisy, target, eps), got)
    # and it is what F.cross_entropy computes from the logits, value and gradient
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = tat.loss_sum(F.log_softmax(a, -1), target.reshape(-1), eps)
    library = F.cross_entropy(
        b, target.reshape(-1), ignore_index=PAD, label_smoothing=eps, reduction="sum"
    )
    torch.testing.assert_close(ours, library)
    ours.backward()
    library.backward()
    torch.testing.assert_close(a.grad, b.grad)


# --------------------------------------------------------------------------------------------
# 2a. The production update is the notebook's train_step
# --------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor: equal bits, not merely equal values (+0 and -0 differ)."""
    return t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def one_update_trainer(cfg, model) -> machinery.Trainer:
    """What ``machinery.update`` needs for ``model``: one process, float32, no wrapper."""
    optimizer, scheduler = tat.make_optimizer(model, cfg)
    return machinery.Trainer(
        cfg=cfg,
        model=model,
        train_model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        device=torch.device("cpu"),
        computing=contextlib.nullcontext,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        world=1,
    )


def test_the_production_update_is_the_notebooks_train_step_bit_for_bit(tmp_path):
    # one batch an update, one process, float32, dropout on: the same weights to the bit
    cfg = tiny_cfg(tmp_path / "unused", P_drop=0.1, eps_ls=0.1, batch_tokens=60)
    data = varlen_data(cfg)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = tat.length_batches(lengths, cfg.batch_tokens, cfg.seed, 0)[:4]
    torch.manual_seed(0)
    notebook_model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    production_model = copy.deepcopy(notebook_model)
    initial = copy.deepcopy(notebook_model.state_dict())
    optimizer, scheduler = tat.make_optimizer(notebook_model, cfg)
    trainer = one_update_trainer(cfg, production_model)
    notebook_model.train(), production_model.train()
    for k, idx in enumerate(batches):
        torch.manual_seed(100 + k)  # the same dropout masks on both sides
        loss, lr = tat.train_step(
            notebook_model, tat.make_batch(pairs, idx), optimizer, scheduler, cfg.eps_ls
        )
        torch.manual_seed(100 + k)
        total, tokens, lr_production = machinery.update(
            trainer, [tat.make_batch(pairs, idx)]
        )
        assert tokens == tat.make_batch(pairs, idx).ntokens
        assert (total / tokens, lr_production) == (loss, lr)
    a, b = notebook_model.state_dict(), production_model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), name
    assert any(not torch.equal(initial[k], b[k]) for k in b), (
        "nothing trained: the comparison proves nothing"
    )


def test_a_production_run_ends_at_the_weights_of_the_notebooks_train_loop(tmp_path):
    # one epoch of `train` (set-up, batches, updates, validation, checkpoint) against Part 2's loop
    cfg = tiny_cfg(tmp_path / "run", P_drop=0.1, eps_ls=0.1)
    data = tiny_data(cfg)
    summary = run(cfg, data)
    assert summary["steps"] == 10
    torch.manual_seed(cfg.seed)  # as `train` seeds before it builds the model
    model = tat.make_model(
        len(data.src_vocab), len(data.tgt_vocab), cfg, attention="readable"
    )
    tat.train_loop(model, data.splits["train"], cfg)
    produced = last_state(tmp_path / "run")["model"]
    assert produced.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(bits(tensor), bits(produced[name])), name


# --------------------------------------------------------------------------------------------
# 2b. Part 4's runs use the notebook's own definitions, as a reader has (re)defined them
# --------------------------------------------------------------------------------------------


def test_a_change_to_a_notebook_cell_takes_effect_in_part_4s_runs(
    tmp_path, monkeypatch
):
    # a reader who redefines `batch_loss` in its cell replaces the name in the notebook's namespace
    calls = []
    original = tat.batch_loss

    def edited(model, batch, eps_ls, forward=None):
        calls.append(batch.ntokens)
        return original(model, batch, eps_ls, forward)

    monkeypatch.setattr(tat, "batch_loss", edited)
    cfg = tiny_cfg(tmp_path / "counted", batch_tokens=60, accum_steps=2, max_steps=3)
    data = varlen_data(cfg)
    lengths = [(len(s), len(t)) for s, t in data.splits["train"]]
    first = tat.length_batches(lengths, cfg.batch_tokens, cfg.seed, 0)[:6]
    assert (
        machinery.train(cfg, data=data, log=quiet, progress=False, evaluate=False)[
            "steps"
        ]
        == 3
    )
    assert calls == [
        tat.make_batch(data.splits["train"], idx).ntokens for idx in first
    ]  # every micro-batch

    # and a change to what the cell computes changes the run: without label smoothing, the
    # run is exactly the one with eps_ls = 0
    monkeypatch.setattr(
        tat,
        "batch_loss",
        lambda model, batch, eps_ls, forward=None: original(model, batch, 0.0, forward),
    )
    cfg = tiny_cfg(tmp_path / "edited", eps_ls=0.1, max_steps=2)
    run(cfg, tiny_data(cfg))
    monkeypatch.setattr(tat, "batch_loss", original)
    for eps_ls in (0.0, 0.1):
        run(
            dataclasses.replace(
                cfg, eps_ls=eps_ls, run_dir=str(tmp_path / f"eps-{eps_ls}")
            ),
            tiny_data(cfg),
        )
    edited, unsmoothed, smoothed = (
        last_state(tmp_path / name)["model"]
        for name in ("edited", "eps-0.0", "eps-0.1")
    )
    for k in edited:
        assert torch.equal(edited[k], unsmoothed[k]), k
    assert any(not torch.equal(edited[k], smoothed[k]) for k in edited), (
        "the edit made no difference"
    )


# The definitions Part 4's opening paragraph names as shared with the production loop.
PART_4_SHARES = (
    "make_model",
    "length_batches",
    "make_batch",
    "batch_loss",
    "loss_sum",
    "make_optimizer",
    "rate",
    "greedy_decode",
    "beam_search",
)


def test_part_4_names_exactly_the_definitions_it_shares():
    cells = jupytext.read(ROOT / "the_annotated_transformer.py").cells
    (opening,) = [c.source for c in cells if "\n# Part 4 — " in f"\n{c.source}"]
    # the names between "builds on the definitions above" and "A cell among those"
    named = set(re.findall(r"`(\w+)`", opening.split("A cell among those")[0]))
    assert named == set(PART_4_SHARES), named


def _scaled(model):
    """``model`` with every parameter halved: other initial weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


# For each shared definition, an edit a reader could make to its cell: it calls the
# original (the notebook's name, as the run looks it up) and changes what it returns.
# On the copy task a decoder that returns its source translates perfectly.
PART_4_EDITS = {
    "make_model": lambda f: lambda *a, **k: _scaled(f(*a, **k)),
    "length_batches": lambda f: lambda *a, **k: f(*a, **k)[::-1],
    "make_batch": lambda f: lambda pairs, idx: f(
        pairs, list(idx)[: max(1, len(idx) - 1)]
    ),
    "batch_loss": lambda f: lambda model, batch, eps_ls, forward=None: f(
        model, batch, 0.3, forward
    ),
    "loss_sum": lambda f: lambda log_probs, target, eps_ls, *a: f(
        log_probs, target, 0.3, *a
    ),
    "make_optimizer": lambda f: lambda model, cfg: f(
        model, dataclasses.replace(cfg, lr_factor=3 * cfg.lr_factor)
    ),
    "rate": lambda f: lambda *a, **k: 3 * f(*a, **k),
    "greedy_decode": lambda f: lambda model, src, *a, **k: (
        f(model, src, *a, **k),
        src,
    )[1],
    "beam_search": lambda f: lambda model, src, *a, **k: (
        f(model, src, *a, **k),
        [row[1:] for row in src.tolist()],
    )[1],
}


def part_4_settings(run_dir):
    """The tiny run each of Part 4's edits is tried on: training, then decoding."""
    return tiny_cfg(run_dir, max_steps=2, max_eval_sentences=2, beam_size=2)


@pytest.fixture(scope="module")
def unedited(tmp_path_factory):
    """(summary, trained weights) of that run with no edit, trained once."""
    where = tmp_path_factory.mktemp("unedited") / "run"
    cfg = part_4_settings(where)
    return run(cfg, tiny_data(cfg), evaluate=True), last_state(where)["model"]


def test_every_shared_definition_has_an_edit_and_an_unedited_run_repeats(
    unedited, tmp_path
):
    # the control for the test below: without an edit, the run's weights repeat
    assert set(PART_4_EDITS) == set(PART_4_SHARES)
    cfg = part_4_settings(tmp_path / "again")
    run(cfg, tiny_data(cfg), evaluate=True)
    again, (_, before) = last_state(tmp_path / "again")["model"], unedited
    assert all(torch.equal(again[k], before[k]) for k in before)


@pytest.mark.parametrize("name", PART_4_SHARES)
def test_every_definition_part_4_names_is_the_one_its_runs_call(
    name, unedited, tmp_path, monkeypatch
):
    # a reader who redefines the cell replaces the name in the notebook's namespace;
    # the production run (training, then greedy and beam decoding) goes through it, and
    # what the edit changes, the run follows: other weights, or (for the decoders) a
    # perfect copy, where the same run unedited is not yet perfect
    plain, before = unedited
    calls = []
    original = getattr(tat, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return PART_4_EDITS[name](original)(*args, **kwargs)

    monkeypatch.setattr(tat, name, counted)
    cfg = part_4_settings(tmp_path / "edited")
    summary = run(cfg, tiny_data(cfg), evaluate=True)
    assert summary["steps"] == 2 and "bleu" in summary and "bleu_greedy" in summary
    assert calls, f"the run never called the notebook's {name}"
    if name in ("greedy_decode", "beam_search"):
        score = "bleu_greedy" if name == "greedy_decode" else "bleu"
        assert plain[score] < 100 and summary[score] == pytest.approx(100), score
        return
    edited = last_state(tmp_path / "edited")["model"]
    assert any(not torch.equal(edited[k], before[k]) for k in before), (
        f"editing {name} left the trained weights as they were"
    )


def test_the_package_finds_the_running_notebook_else_imports_the_module(monkeypatch):
    # run as a script or a notebook kernel, the notebook is __main__ and defines the marker
    notebook_main = types.ModuleType("__main__")
    notebook_main.ANNOTATED_TRANSFORMER_NOTEBOOK = True
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)
    assert machinery.notebook() is notebook_main
    assert machinery.parts.notebook() is notebook_main
    # any other __main__ (pytest, the command line, a script importing the package): the module
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert machinery.notebook() is tat
    unmarked = types.ModuleType("__main__")
    unmarked.ANNOTATED_TRANSFORMER_NOTEBOOK = False
    monkeypatch.setitem(sys.modules, "__main__", unmarked)
    assert machinery.notebook() is tat
    monkeypatch.delitem(sys.modules, "__main__")
    assert machinery.notebook() is tat


# --------------------------------------------------------------------------------------------
# 3. Gradient accumulation: an update computes the same gradient however it is split
# --------------------------------------------------------------------------------------------


@pytest.fixture
def recorded_grads(monkeypatch):
    """Patch make_optimizer so that every optimizer step records the gradient it applies."""
    grads = []
    original = tat.make_optimizer

    def recording(model, cfg):
        optimizer, scheduler = original(model, cfg)
        names = {id(p): n for n, p in model.named_parameters()}

        def hook(opt, args, kwargs):
            grads.append(
                {
                    names[id(p)]: p.grad.detach().clone()
                    for g in opt.param_groups
                    for p in g["params"]
                    if p.grad is not None
                }
            )

        optimizer.register_step_pre_hook(hook)
        return optimizer, scheduler

    monkeypatch.setattr(tat, "make_optimizer", recording)
    return grads


def assert_same_grads(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_accumulated_update_has_the_gradient_of_the_whole_batch(
    tmp_path, recorded_grads
):
    cfg = tiny_cfg(
        tmp_path / "split",
        P_drop=0.0,
        eps_ls=0.1,
        batch_tokens=60,
        accum_steps=2,
        max_steps=1,
    )
    data = varlen_data(cfg)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    b0, b1 = tat.length_batches(lengths, cfg.batch_tokens, cfg.seed, epoch=0)[:2]
    n0, n1 = tat.make_batch(pairs, b0).ntokens, tat.make_batch(pairs, b1).ntokens
    assert n0 != n1, (
        "pick data whose two micro-batches differ in size, or per-batch normalisation passes too"
    )

    run(cfg, data)  # one update over the micro-batches b0, b1
    # the same pairs as one batch, in one update without accumulation
    whole = dataclasses.replace(
        data, splits={**data.splits, "train": [pairs[i] for i in b0 + b1]}
    )
    run(
        dataclasses.replace(
            cfg, run_dir=str(tmp_path / "whole"), batch_tokens=10_000, accum_steps=1
        ),
        whole,
    )
    assert len(recorded_grads) == 2
    split_grads, whole_grads = recorded_grads
    assert_same_grads(split_grads, whole_grads)

    # and that gradient is the one of the mean loss per target token (of the initial model)
    torch.manual_seed(cfg.seed)
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    batch = tat.make_batch(pairs, b0 + b1)
    assert batch.ntokens == n0 + n1
    out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    (
        tat.loss_sum(model.generator(out), batch.tgt_y, cfg.eps_ls) / batch.ntokens
    ).backward()
    assert_same_grads(split_grads, {n: p.grad for n, p in model.named_parameters()})


# --------------------------------------------------------------------------------------------
# 4. The copy preset learns the copy task
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_copy_preset_learns_to_copy(tmp_path, seed):
    """Not one tuned seed: measured at BLEU 99.1–100 over seeds 1–8 in bf16, so 90 leaves a wide margin.

    bf16 as asked for: `auto` measures float32 faster for this small model on an AMD EPYC (bf16 0.76×), and in
    float32 seed 1 reaches only BLEU 69.8 after the preset's 16 epochs (seeds 2–8: 94.4–100) — noted for the
    preset, not hidden by picking seeds."""
    cfg = machinery.get_config(
        "copy",
        device="cpu",
        seed=seed,
        run_dir=str(tmp_path / "copy"),
        precision="bf16",
    )
    data = machinery.make_copy_data(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    summary = machinery.train(cfg, data=data, log=quiet, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"\ncopy preset, seed {seed}: test BLEU {summary['bleu']:.2f} after {summary['steps']} updates in {wall:.1f} s "
        f"wall, {cpu:.1f} s CPU ({torch.get_num_threads()} thread); {summary['precision']}, "
        f"{summary['attention']} attention ({summary['auto']})"
    )
    assert summary["bleu"] >= 90, f"copy preset reached only BLEU {summary['bleu']:.2f}"


# --------------------------------------------------------------------------------------------
# 5. The run says how long it will take and whether its model suits its data
# --------------------------------------------------------------------------------------------


def test_run_plan_counts_updates_and_flags_a_model_too_big_for_its_data():
    cfg = machinery.get_config("copy", epochs=3, accum_steps=2)
    data = machinery.make_copy_data(cfg)
    lengths = [(len(s), len(t)) for s, t in data.splits["train"]]
    per_epoch = -(-len(tat.length_batches(lengths, cfg.batch_tokens, cfg.seed, 0)) // 2)
    small = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    remaining, lines = machinery.plan_run(cfg, data, 1, 5, small)
    assert remaining == 3 * per_epoch - 5
    assert lines[0].startswith(
        f"plan: 3 epochs × {per_epoch} updates = {3 * per_epoch} updates"
    )
    assert not any("sized for" in line for line in lines)
    big = tat.make_model(
        len(data.src_vocab), len(data.tgt_vocab), machinery.MODEL_PRESETS["base"]
    )
    _, lines = machinery.plan_run(cfg, data, 1, 0, big)
    assert any("sized for far more data" in line for line in lines)
    assert (
        machinery.plan_run(dataclasses.replace(cfg, max_steps=4), data, 1, 1, small)[0]
        == 3
    )


def test_the_clock_estimates_from_timed_updates_and_again_after_a_minute(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(machinery.planning.time, "time", lambda: now[0])
    lines = []
    clock = machinery.UpdateClock(
        remaining=10_013, device=torch.device("cpu"), log=lines.append
    )
    for i in range(80):
        clock.tick()
        now[0] += 1.5 if i < 20 else 1.0  # 1.5 s per update, then 1 s
    first = [line for line in lines if line.startswith("estimate:")]
    assert len(first) == 1 and "1.50 s per update" in first[0]
    assert "over updates 4–13" in first[0] and "again after a minute" in first[0]
    again = [line for line in lines if line.startswith("estimate after")]
    # timing starts after update 3; a minute has passed after update 54: 18 updates
    # of 1.5 s and 33 of 1 s
    assert len(again) == 1 and "over updates 4–54" in again[0]
    assert clock.minutes == pytest.approx(60 / 51 * (10_013 - 54) / 60)
    notes = [line for line in lines if line.startswith("note:")]
    assert notes and all("this CPU" in n and "GPU" not in n for n in notes)


def test_training_log_says_the_plan_and_the_estimate(tmp_path):
    lines = []
    machinery.train(
        machinery.get_config("copy", run_dir=str(tmp_path), max_steps=16),
        log=lines.append,
        progress=False,
        evaluate=False,
    )
    assert any(line.startswith("plan: ") for line in lines)
    assert any(line.startswith("estimate: ") for line in lines)


@pytest.mark.parametrize(
    "cuda, preset", [(True, "iwslt14-small"), (False, "iwslt14-sample")]
)
def test_default_preset_follows_the_machine(monkeypatch, cuda, preset):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert machinery.default_preset() == preset
    assert machinery.config_from_args(["train"])[1] == dataclasses.replace(
        machinery.get_config(preset), run_dir=f"runs/{preset}"
    )


@pytest.mark.parametrize("limit, expected", [(0, 160), (7, 7)])
def test_validation_takes_the_first_max_valid_sentences_pairs(
    tmp_path, monkeypatch, limit, expected
):
    seen = []
    real = machinery.evaluate_loss

    def evaluate_loss(model, pairs, cfg, device):
        seen.append(list(pairs))
        return real(model, pairs, cfg, device)

    monkeypatch.setattr(
        machinery.training, "evaluate_loss", evaluate_loss
    )  # what `train` calls
    cfg = tiny_cfg(tmp_path, max_valid_sentences=limit)
    data = machinery.make_copy_data(cfg)
    run(cfg, data)
    assert seen and all(pairs == data.splits["valid"][:expected] for pairs in seen)
    with pytest.raises(ValueError, match="max_valid_sentences must be 0"):
        tiny_cfg(tmp_path, max_valid_sentences=-1)


# --------------------------------------------------------------------------------------------
# 6. Keeping a GPU busy, proven on the CPU: batches built ahead, and compiled training
# --------------------------------------------------------------------------------------------


def test_prefetched_yields_in_order_builds_ahead_and_hands_on_errors():
    built = []

    def make(k):
        built.append(k)
        return k * k

    assert list(machinery.prefetched(make, 6, depth=2)) == [0, 1, 4, 9, 16, 25]
    built.clear()
    ahead = machinery.prefetched(make, 50, depth=2)
    assert next(ahead) == 0
    time.sleep(0.2)
    assert 2 <= len(built) <= 4, (
        f"built {built}: up to depth ahead of the one handed out"
    )
    ahead.close()  # stopping early (max_steps, a signal) stops the thread
    time.sleep(0.1)
    assert len(built) <= 4

    def broken(k):
        if k == 3:
            raise ValueError("batch 3")
        return k

    with pytest.raises(ValueError, match="batch 3"):
        list(machinery.prefetched(broken, 6, depth=2))
    assert list(machinery.prefetched(make, 3, depth=0)) == [
        0,
        1,
        4,
    ]  # in turn, as a CPU run builds them


def test_a_run_with_batches_built_ahead_ends_exactly_where_one_building_them_in_turn_does(
    tmp_path, monkeypatch
):
    cfg = tiny_cfg(tmp_path / "in-turn", max_steps=7, epochs=2, P_drop=0.1)
    data = varlen_data(cfg)
    run(cfg, data)
    threads = []
    real = machinery.training.prefetched
    monkeypatch.setattr(machinery.training, "PREFETCH", {"cpu": 2})  # as on a GPU
    monkeypatch.setattr(
        machinery.training,
        "prefetched",
        lambda make, count, depth: threads.append(depth) or real(make, count, depth),
    )
    run(dataclasses.replace(cfg, run_dir=str(tmp_path / "ahead")), data)
    assert threads == [2, 2]  # one per epoch
    a, b = last_state(tmp_path / "in-turn"), last_state(tmp_path / "ahead")
    assert a["step"] == b["step"] == 7
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_probe_batch_is_real_pairs_of_median_length_within_its_tokens():
    cfg = tiny_cfg("unused")
    pairs = varlen_data(cfg).splits["train"]
    batch = machinery.probe_batch(pairs, 64)
    assert batch.src.numel() <= 64 and batch.tgt.size(0) == batch.src.size(0) >= 2
    median = sorted(len(t) for _, t in pairs)[len(pairs) // 2]
    assert (
        abs(batch.tgt.size(1) + 1 - median) <= 1
    )  # tgt is the target less its last token


def compile_count(monkeypatch, cfg, data, backend: str) -> tuple[dict, int, float]:
    """Train ``cfg`` compiled with ``backend``; (summary, graphs dynamo compiled, seconds)."""
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, **kw: real(model, backend=backend, **kw)
    )
    torch._dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    summary = run(cfg, data)
    seconds = time.perf_counter() - t0
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return summary, graphs, seconds


def test_compiled_training_on_bucketed_batches_compiles_at_most_three_times_and_trains_as_eager(
    tmp_path, monkeypatch
):
    # dynamo and AOT autograd as `--compile` runs them; "aot_eager" leaves out only inductor's C++ code generation
    # (the next test), which keeps this one to seconds. Batches of 1–10 symbols: shapes change every update.
    cfg = tiny_cfg(tmp_path / "compiled", max_steps=8, epochs=2, compile=True)
    data = varlen_data(cfg)
    shapes = {
        tuple(tat.make_batch(data.splits["train"], idx).src.shape)
        for idx in tat.length_batches(
            [(len(s), len(t)) for s, t in data.splits["train"]],
            cfg.batch_tokens,
            cfg.seed,
            0,
        )[:8]
    }
    summary, graphs, seconds = compile_count(monkeypatch, cfg, data, "aot_eager")
    print(
        f"\n--compile on {len(shapes)} batch shapes: {graphs} compilations, {seconds:.1f} s for 8 updates"
    )
    assert summary["steps"] == 8 and len(shapes) >= 5
    # measured: 3 — the first shape, then one recompilation as each dimension (sentences, length) turns dynamic
    assert graphs <= 3, (
        f"{graphs} compilations for {len(shapes)} shapes: one per batch shape, not dynamic"
    )
    run(dataclasses.replace(cfg, compile=False, run_dir=str(tmp_path / "eager")), data)
    a, b = last_state(tmp_path / "compiled"), last_state(tmp_path / "eager")
    # the same training up to rounding — but for the key projections' biases, whose true gradient is zero (softmax
    # ignores what they add to a query's every score): Adam scales their rounding noise to learning-rate steps
    for k in a["model"]:
        atol = 1e-2 if k.endswith("w_k.bias") else 1e-6
        torch.testing.assert_close(
            a["model"][k],
            b["model"][k],
            rtol=0,
            atol=atol,
            msg=lambda m, k=k: f"{k}: {m}",
        )
    valid = [
        [
            json.loads(line)["valid_loss"]
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if "valid_loss" in line
        ]
        for name in ("compiled", "eager")
    ]
    print(f"validation losses, compiled and eager: {valid}")
    assert len(valid[0]) == 2 and valid[0] == pytest.approx(valid[1], rel=1e-2)


def test_compiled_training_with_inductor_on_the_cpu(tmp_path, monkeypatch):
    import shutil

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip(
            "torch.compile's default backend (inductor) needs a C++ compiler on a CPU; none on PATH"
        )
    cfg = tiny_cfg(tmp_path / "run", max_steps=2, compile=True)
    summary, graphs, seconds = compile_count(
        monkeypatch, cfg, tiny_data(cfg), "inductor"
    )
    print(
        f"\n--compile with inductor: {graphs} compilation(s), {seconds:.1f} s for 2 updates of one shape"
    )
    assert summary["steps"] == 2 and graphs == 1
    assert all(
        torch.isfinite(v).all() for v in last_state(tmp_path / "run")["model"].values()
    )


def test_the_papers_presets_update_on_about_25000_tokens():
    # §5.1: "approximately 25000 source tokens and 25000 target tokens" per batch; our
    # budget counts padding, so a little above is the nearest
    for name in ("base", "big"):
        cfg = machinery.PRESETS[name]
        per_update = cfg.batch_tokens * cfg.accum_steps
        assert 24_000 <= per_update <= 26_000, (name, per_update)
    assert machinery.PRESETS["iwslt14-small"].accum_steps == 1  # fairseq's recipe

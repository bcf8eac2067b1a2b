"""The compiled training step: batches whose lengths are rounded up to a multiple of 8
train the same model as unrounded ones; a few updates through `torch.compile` on the
CPU (its default mode, inductor's C++ code) compile few graphs and land where eager
training does; where compiling cannot work, the run trains eagerly and says so in one
line."""

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
import machinery.devices  # noqa: E402
import machinery.training  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    N=1,
    d_model=16,
    d_ff=32,
    h=2,
    warmup=20,
    device="cpu",
    precision="fp32",
    attention="fast",
    batch_tokens=160,
    epochs=1,
    P_drop=0.0,
)


def varied_lengths(cfg) -> machinery.Dataset:
    """The copy task's vocabulary with sentences of 2 to 13 symbols: batches of many
    lengths."""
    data = machinery.make_copy_data(cfg, sizes=(8, 8, 8))
    rng = random.Random(1)

    def pair():
        ids = [rng.randrange(4, len(data.src_vocab)) for _ in range(rng.randint(2, 13))]
        return [tat.BOS, *ids, tat.EOS], [tat.BOS, *ids, tat.EOS]

    train = [pair() for _ in range(200)]
    return dataclasses.replace(data, splits={**data.splits, "train": train})


def test_rounded_lengths_are_multiples_of_8_and_leave_the_loss_unchanged():
    cfg = machinery.get_config("copy", **TINY)
    data = varied_lengths(cfg)
    pairs = data.splits["train"]
    torch.manual_seed(0)
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg)
    model.eval()
    batch = tat.make_batch(pairs, list(range(7)))
    rounded = machinery.training.round_lengths(batch, 8)
    assert rounded.src.size(1) % 8 == 0 and rounded.tgt.size(1) % 8 == 0
    assert rounded.src.size(1) > batch.src.size(1) or batch.src.size(1) % 8 == 0
    assert rounded.ntokens == batch.ntokens
    assert torch.equal(rounded.tgt_y[:, : batch.tgt_y.size(1)], batch.tgt_y)
    with torch.no_grad():
        plain = tat.batch_loss(model, batch, 0.1)
        padded = tat.batch_loss(model, rounded, 0.1)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_a_compiled_run_on_the_cpu_compiles_few_graphs_and_trains_as_eagerly(tmp_path):
    if machinery.devices.compile_problem(torch.device("cpu")):
        pytest.skip(machinery.devices.compile_problem(torch.device("cpu")))
    lines = []
    runs, losses = {}, {}
    for compiled in (True, False):
        cfg = machinery.get_config(
            "copy",
            **TINY,
            compile=compiled,
            max_steps=4,
            run_dir=str(tmp_path / f"compiled-{compiled}"),
        )
        data = varied_lengths(cfg)
        # both runs see the rounded batches: the comparison is of the compilation
        real = machinery.training.update_batches

        def rounded(run, pairs, indices, real=real):
            batches = real(run, pairs, indices)
            seen.update((tuple(b.src.shape), tuple(b.tgt.shape)) for b in batches)
            return [machinery.training.round_lengths(b, 8) for b in batches]

        real_update = machinery.training.update

        def update(run, micro, real_update=real_update, compiled=compiled):
            out = real_update(run, micro)
            losses.setdefault(compiled, []).append(out[0] / out[1])
            return out

        seen: set = set()
        machinery.training.update_batches = rounded
        machinery.training.update = update
        try:
            runs[compiled] = machinery.train(
                cfg, data=data, log=lines.append, progress=False, evaluate=False
            )
        finally:
            machinery.training.update_batches = real
            machinery.training.update = real_update
        if compiled:
            shapes = seen
    summary = runs[True]
    print(f"compilations: {summary['compilations']} for {len(shapes)} batch shapes")
    assert summary["steps"] == 4
    assert all(s[0][1] % 8 == 0 and s[1][1] % 8 == 0 for s in shapes), shapes
    assert len(shapes) >= 2, "the check needs batches of several shapes"
    assert 1 <= summary["compilations"] <= len(shapes)
    assert any(line.startswith("compile: torch.compile") for line in lines)
    # the same losses update by update (weights are not compared: Adam's first steps
    # turn a rounding-sized gradient, such as the keys' bias has, into a whole step)
    assert len(losses[True]) == len(losses[False]) == 4
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=0)


def test_where_compiling_cannot_work_the_run_trains_eagerly_and_says_so(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    problem = machinery.devices.compile_problem(torch.device("cpu"))
    assert problem == "no C++ compiler, which the generated CPU code needs"
    model, lines = torch.nn.Linear(2, 2), []
    assert machinery.devices.compile_model(
        model, torch.device("cpu"), lines.append
    ) is (model)
    assert len(lines) == 1 and "training eagerly" in lines[0] and "\n" not in lines[0]


@pytest.mark.parametrize("attention", ["fast", "readable"])
def test_the_compiled_forward_has_no_graph_breaks_and_one_graph_per_shape(attention):
    """What torch.compile traces of a training step (the model's forward; the backward
    follows its graph) — counted by dynamo's own counters with its tracing alone (the
    "eager" backend: no code is generated) — breaks nowhere, and compiles at most one
    graph per rounded batch shape."""
    from torch._dynamo.utils import counters

    cfg = machinery.get_config(
        "copy", **{**TINY, "P_drop": 0.1, "attention": attention}
    )
    data = varied_lengths(cfg)
    pairs = data.splits["train"]
    lengths = [(len(s), len(t)) for s, t in pairs]
    torch.manual_seed(0)
    model = tat.make_model(len(data.src_vocab), len(data.tgt_vocab), cfg).train()
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model, backend="eager")
    shapes = set()
    for idx in tat.length_batches(lengths, cfg.batch_tokens, seed=1)[:6]:
        batch = machinery.training.round_lengths(tat.make_batch(pairs, idx), 8)
        shapes.add((tuple(batch.src.shape), tuple(batch.tgt.shape)))
        tat.batch_loss(model, batch, cfg.eps_ls, forward).backward()
    assert len(shapes) >= 2, "the check needs batches of several shapes"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= len(shapes)
    torch._dynamo.reset()

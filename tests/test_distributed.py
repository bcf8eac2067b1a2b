"""Several processes, proven with Gloo on a CPU: the backend each run gets, collectives on the
training device, resuming on another number of processes (and without a shared disk), per-process
random streams, and one process per machine preparing the data.

The multi-process runs are small (a one-layer copy model, a few updates) and each is a fresh
`torchrun` of two processes; the generous time limits only guard against a hang.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
import machinery.devices  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402
from conftest import last_state, quiet  # noqa: E402

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


MODEL = dict(
    N=1,
    d_model=32,
    d_ff=64,
    h=4,
    warmup=50,
    device="cpu",
    precision="fp32",
    attention="readable",
)
SETTINGS = dict(
    batch_tokens=120, epochs=1, eps_ls=0.1
)  # 10 pairs a batch: 20 batches an epoch


def cfg_for(run_dir, **overrides) -> machinery.Config:
    return machinery.get_config(
        "copy", **MODEL, **{**SETTINGS, **overrides}, run_dir=str(run_dir)
    )


def data_for(cfg) -> machinery.Dataset:
    return machinery.make_copy_data(cfg, sizes=(200, 40, 20))


def global_batches(cfg) -> list:
    data = data_for(cfg)
    lengths = [(len(s), len(t)) for s, t in data.splits["train"]]
    return [
        tuple(b) for b in tat.length_batches(lengths, cfg.batch_tokens, cfg.seed, 0)
    ]


# --------------------------------------------------------------------------------------------
# 1. The backend follows the run's device
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda_available, device_setting, backend",
    [
        (False, "auto", "gloo"),  # a CPU-only machine
        (True, "auto", "nccl"),  # a GPU machine
        (
            True,
            "cpu",
            "gloo",
        ),  # --device cpu on a GPU machine: Gloo, or DDP and every collective fail
    ],
)
def test_the_backend_follows_the_device_the_run_uses(
    monkeypatch, cuda_available, device_setting, backend
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    device = machinery.resolve_device(device_setting)
    assert machinery.process_group_backend(device) == backend
    started = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(machinery.devices.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        machinery.devices.dist,
        "init_process_group",
        lambda backend=None, **kw: started.append(backend),
    )
    monkeypatch.setattr(machinery.devices.dist, "get_rank", lambda: 1)
    assert machinery._distributed(device) == (1, 2) and started == [backend]


class CollectiveCalled(Exception):
    """Raised by a stand-in collective once it has noted what it was given."""


def test_the_stop_flag_is_reduced_on_the_training_device(monkeypatch):
    # the meta device stands in for a GPU: a flag made on the CPU would show here
    seen = []

    def all_reduce(tensor, op=None):
        seen.append(tensor.device)
        raise CollectiveCalled

    monkeypatch.setattr(machinery.devices.dist, "all_reduce", all_reduce)
    with pytest.raises(CollectiveCalled):
        machinery.StopRequest().requested(2, torch.device("meta"))
    with pytest.raises(CollectiveCalled):
        machinery.any_process([True, False], 2, torch.device("meta"))
    assert seen == [torch.device("meta")] * 2


# --------------------------------------------------------------------------------------------
# 2. Multi-process runs
# --------------------------------------------------------------------------------------------

SCRIPT = """
import hashlib, json, os, sys, time
import torch
import torch.distributed as dist
import machinery
import machinery.training
import the_annotated_transformer as tat

torch.set_num_threads(1)
run_dir, out, settings, own_dirs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
rank = int(os.environ["RANK"])
if own_dirs == "1" and rank:  # machines without a shared disk: only the first holds the run directory
    run_dir = f"{run_dir}-rank{rank}"
if own_dirs == "2" and not rank:  # ... only the second holds it (process 0 is whichever machine sorts first)
    run_dir = f"{run_dir}-rank{rank}"
nan_in_rank = settings.pop("nan_in_rank", None)
times = settings.pop("times_by_rank", None)  # what `auto`'s measurement says in each process
if times:
    machinery.training.time_calls = lambda calls, device: {
        (p, a): times[rank].get(f"{p}_{a}", 1.0) for p, a in calls}
cfg = machinery.get_config("copy", run_dir=run_dir, **settings)
data = machinery.make_copy_data(cfg, sizes=(200, 40, 20))
record = {"collective_devices": [], "train_batches": [], "rng_at_first_update": None}

def checked(name):  # every tensor our code hands a collective, noted with its device
    real = getattr(dist, name)
    def wrapper(tensor, *args, **kwargs):
        record["collective_devices"].append(str(tensor.device))
        return real(tensor, *args, **kwargs)
    return wrapper

for name in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter"):
    setattr(dist, name, checked(name))

def load_dataset(cfg, log=print, url_base=None):  # notes the order in which processes prepare the data
    with open(out + "/load_order.txt", "a") as f:
        f.write(f"start {rank}\\n")
    if rank == 0:
        time.sleep(1.0)
    with open(out + "/load_order.txt", "a") as f:
        f.write(f"end {rank}\\n")
    return data

machinery.training.load_dataset = load_dataset  # the package's functions `train` calls
real_setup, real_update = machinery.training.setup, machinery.training.update
real_make_batch, real_batch_loss, runs = tat.make_batch, tat.batch_loss, []  # the notebook's parts

def make_batch(pairs, idx):
    if pairs is data.splits["train"]:
        record["train_batches"].append(list(idx))
    return real_make_batch(pairs, idx)

def setup(*args, **kwargs):
    runs.append(real_setup(*args, **kwargs))
    record["device"] = str(runs[0].device)
    record["broadcast_buffers"] = runs[0].train_model.broadcast_buffers
    record["attention"], record["precision"] = runs[0].cfg.attention, runs[0].cfg.precision
    return runs[0]

def update(run, micro):
    if record["rng_at_first_update"] is None:
        record["rng_at_first_update"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    return real_update(run, micro)

def batch_loss(*args, **kwargs):  # with nan_in_rank: that process's training loss turns NaN
    loss = real_batch_loss(*args, **kwargs)
    return loss * float("nan") if rank == nan_in_rank else loss

machinery.training.setup, machinery.training.update = setup, update
tat.make_batch, tat.batch_loss = make_batch, batch_loss
try:
    summary = machinery.train(cfg, log=lambda *a, **k: None, progress=False, evaluate=False)
    record["steps"], record["world_size"] = summary["steps"], summary["world_size"]
except machinery.TrainingDiverged as e:
    record["diverged"] = str(e)
record["params"] = [float(p.detach().double().sum()) for p in runs[0].model.parameters()]
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def torchrun(tmp_path, run_dir, settings: dict, own_dirs: str = "0") -> list[dict]:
    """Train ``copy`` with ``settings`` on two Gloo processes; what each process recorded."""
    script = tmp_path / "train_two.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = Path(str(run_dir) + "-records")
    shutil.rmtree(
        out, ignore_errors=True
    )  # a second run of the same directory records afresh
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(run_dir),
            str(out),
            json.dumps({**MODEL, **settings}),
            own_dirs,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    records[0]["load_order"] = (out / "load_order.txt").read_text().split("\n")
    return records


def assert_collectives_on_the_training_device(records):
    for r in records:
        assert r["collective_devices"], (
            "the run made no collective call of its own: the check saw nothing"
        )
        assert set(r["collective_devices"]) == {r["device"]}, r["collective_devices"]


def test_two_process_training_equals_one_process_accumulating(tmp_path):
    settings = dict(SETTINGS, P_drop=0.0, max_steps=3)
    records = torchrun(tmp_path, tmp_path / "ddp", settings)
    assert [(r["world_size"], r["steps"]) for r in records] == [(2, 3), (2, 3)]
    assert_collectives_on_the_training_device(records)
    assert all(r["broadcast_buffers"] is False for r in records), (
        "constant buffers need no broadcast per update"
    )
    order = records[0]["load_order"]
    assert order.index("end 0") < order.index("start 1"), (
        f"process 1 prepared data while 0 did: {order}"
    )

    # one process, the same global batches: update k accumulates (b_2k, b_2k+1)
    cfg = cfg_for(tmp_path / "single", accum_steps=2, **settings)
    machinery.train(cfg, data=data_for(cfg), log=quiet, progress=False, evaluate=False)
    ddp, single = last_state(tmp_path / "ddp"), last_state(tmp_path / "single")
    assert ddp["step"] == single["step"] == 3
    for k in single["model"]:
        torch.testing.assert_close(
            ddp["model"][k],
            single["model"][k],
            rtol=0,
            atol=1e-6,
            msg=lambda m, k=k: f"{k}: {m}",
        )
    # the comparison can fail: one process without accumulation ends elsewhere
    plain_cfg = dataclasses.replace(cfg, accum_steps=1, run_dir=str(tmp_path / "plain"))
    machinery.train(
        plain_cfg, data=data_for(cfg), log=quiet, progress=False, evaluate=False
    )
    plain = last_state(tmp_path / "plain")
    assert (
        max(
            float((plain["model"][k] - ddp["model"][k]).abs().max())
            for k in plain["model"]
        )
        > 1e-4
    )


def test_two_processes_stopped_and_resumed_give_exactly_the_uninterrupted_run(tmp_path):
    # with dropout on: each process must get its own random stream back, not the first one's
    settings = dict(SETTINGS, P_drop=0.1)
    torchrun(tmp_path, tmp_path / "a", dict(settings, max_steps=4))
    torchrun(
        tmp_path, tmp_path / "a", dict(settings, max_steps=7)
    )  # the same command, resumed
    torchrun(tmp_path, tmp_path / "b", dict(settings, max_steps=7))  # never stopped
    a, b = last_state(tmp_path / "a"), last_state(tmp_path / "b")
    assert a["step"] == b["step"] == 7
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for r in range(2):
        assert torch.equal(a["rng"]["ranks"][r]["torch"], b["rng"]["ranks"][r]["torch"])


def test_a_loss_that_diverges_in_one_process_stops_every_process(tmp_path):
    records = torchrun(
        tmp_path, tmp_path / "run", dict(SETTINGS, max_steps=3, nan_in_rank=1)
    )
    assert all("loss is nan at step 1" in r.get("diverged", "") for r in records), (
        records
    )


def batches_of_a_run(monkeypatch, cfg) -> tuple[list, list]:
    """Train ``cfg`` in this process; (the training batches it used, its log)."""
    data, used, logs = data_for(cfg), [], []
    real = tat.make_batch
    monkeypatch.setattr(
        tat,
        "make_batch",
        lambda pairs, idx: (
            used.append(tuple(idx)) if pairs is data.splits["train"] else None
        )
        or real(pairs, idx),
    )
    machinery.train(cfg, data=data, log=logs.append, progress=False, evaluate=False)
    monkeypatch.setattr(tat, "make_batch", real)
    return used, logs


def test_stopped_on_two_processes_the_epoch_ends_on_one_with_exactly_the_batches_not_seen(
    tmp_path, monkeypatch
):
    settings = dict(SETTINGS, P_drop=0.1, max_steps=3)
    records = torchrun(tmp_path, tmp_path / "run", settings)
    first = [tuple(b) for r in records for b in r["train_batches"]]
    assert len(first) == 6
    assert records[0]["rng_at_first_update"] != records[1]["rng_at_first_update"], (
        "dropout streams must differ"
    )
    stopped = last_state(tmp_path / "run")
    assert (stopped["batch_in_epoch"], stopped["layout"]["world_size"]) == (6, 2)
    ranks = stopped["rng"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"]), (
        "each process's own state"
    )

    cfg = cfg_for(
        tmp_path / "run", P_drop=0.1
    )  # the same run, now one process, to the end of the epoch
    second, logs = batches_of_a_run(monkeypatch, cfg)
    assert any("fresh streams" in str(line) for line in logs), logs
    everything = global_batches(cfg)
    assert sorted(first + second) == sorted(everything), (
        "every batch of the epoch exactly once"
    )
    assert second == everything[6:], "and the rest in the epoch's order"
    state = last_state(tmp_path / "run")
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (3 + 14, 1, 0)


def test_stopped_on_one_process_two_processes_without_a_shared_disk_continue_in_step(
    tmp_path, monkeypatch
):
    cfg = cfg_for(tmp_path / "run", P_drop=0.1, max_steps=5)
    first, _ = batches_of_a_run(monkeypatch, cfg)
    assert len(first) == 5
    # the second process has an empty run directory of its own: it must take the first one's checkpoint
    records = torchrun(
        tmp_path, tmp_path / "run", dict(SETTINGS, P_drop=0.1), own_dirs="1"
    )
    assert_collectives_on_the_training_device(records)
    assert [r["steps"] for r in records] == [5 + 7, 5 + 7]
    assert records[0]["params"] == records[1]["params"], (
        "both processes must hold the same resumed model"
    )
    mine = [[tuple(b) for b in r["train_batches"]] for r in records]
    everything = global_batches(cfg)
    # the 15 batches not seen, less the one that does not divide between two processes
    assert sorted(mine[0] + mine[1]) == sorted(everything[5:19]) and not set(
        mine[0]
    ) & set(mine[1])
    assert not set(first) & set(mine[0] + mine[1])
    state = last_state(tmp_path / "run")
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (12, 1, 0)
    assert not machinery.checkpoint_paths(Path(str(tmp_path / "run") + "-rank1")), (
        "only the first process writes"
    )


def test_machines_without_a_shared_disk_resume_from_the_newest_checkpoint_whichever_holds_it(
    tmp_path, monkeypatch
):
    # torchrun's c10d rendezvous makes any machine process 0: here the one that held no checkpoint. Before issue 37
    # only process 0 looked, found none, and both trained silently from step 0.
    cfg = cfg_for(tmp_path / "run", P_drop=0.1, max_steps=5)
    first, _ = batches_of_a_run(monkeypatch, cfg)
    records = torchrun(
        tmp_path, tmp_path / "run", dict(SETTINGS, P_drop=0.1), own_dirs="2"
    )
    assert [r["steps"] for r in records] == [5 + 7, 5 + 7], (
        "the run restarted from step 0"
    )
    assert records[0]["params"] == records[1]["params"]
    mine = [[tuple(b) for b in r["train_batches"]] for r in records]
    assert sorted(mine[0] + mine[1]) == sorted(global_batches(cfg)[5:19]) and not set(
        first
    ) & set(mine[0] + mine[1])
    # process 0 writes, into its own directory, the run continued
    state = last_state(Path(str(tmp_path / "run") + "-rank0"))
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (12, 1, 0)


def test_the_first_process_measures_for_all_and_every_process_follows_it(tmp_path):
    # process 1's measurement would pick the fast path; process 0's, which decides, keeps the readable one
    times = [
        {"fp32_readable": 1.0, "fp32_fast": 1.05},
        {"fp32_readable": 1.0, "fp32_fast": 0.5},
    ]
    records = torchrun(
        tmp_path,
        tmp_path / "run",
        dict(SETTINGS, max_steps=2, attention="auto", times_by_rank=times),
    )
    assert [(r["precision"], r["attention"]) for r in records] == [
        ("fp32", "readable")
    ] * 2
    times.reverse()
    records = torchrun(
        tmp_path,
        tmp_path / "other",
        dict(SETTINGS, max_steps=2, attention="auto", times_by_rank=times),
    )
    assert [(r["precision"], r["attention"]) for r in records] == [("fp32", "fast")] * 2


# --------------------------------------------------------------------------------------------
# 3. Resume positions, in one process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, accum", [(1, 1), (2, 1), (1, 3), (3, 2)])
def test_epoch_updates_deal_out_exactly_the_batches_not_consumed(world, accum):
    batches = list(range(23))
    for start in (0, 5, 12, 22, 23):
        per_rank = [
            machinery.epoch_updates(batches, start, r, world, accum)
            for r in range(world)
        ]
        updates, consumed, end = per_rank[0]
        assert all(
            len(u) == len(updates) and c == consumed and e == end
            for u, c, e in per_rank
        ), "every process takes as many updates and agrees where they end"
        for rank, (u, _, _) in enumerate(per_rank):  # process r: batches r, r+W, …
            mine = [b for micro in u for b in micro]
            assert mine == batches[start + rank : end : world], rank
        taken = sorted(b for u, _, _ in per_rank for micro in u for b in micro)
        assert (
            taken == batches[start:end]
            and end - start == len(batches[start:]) - len(batches[start:]) % world
        )
        if updates:
            assert consumed[-1] == end
        for k in range(
            len(updates)
        ):  # after update k every batch before consumed[k] was taken, none after
            upto = sorted(
                b for u, _, _ in per_rank for micro in u[: k + 1] for b in micro
            )
            assert upto == batches[start : consumed[k]]


def test_accumulation_changed_mid_epoch_continues_where_the_last_update_ended(
    tmp_path, monkeypatch
):
    # the loop this once was: accum 1 → 4 left no update to take, and the epoch never ended
    cfg = cfg_for(tmp_path / "run", max_steps=3)
    first, _ = batches_of_a_run(monkeypatch, cfg)
    second, _ = batches_of_a_run(
        monkeypatch, dataclasses.replace(cfg, accum_steps=4, max_steps=0)
    )
    assert first + second == global_batches(cfg)
    state = last_state(tmp_path / "run")
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (
        3 + 5,
        1,
        0,
    )  # 17 batches, 4 an update


def test_another_batch_size_mid_epoch_is_refused_in_one_line(tmp_path):
    cfg = cfg_for(tmp_path / "run", max_steps=3)
    machinery.train(cfg, data=data_for(cfg), log=quiet, progress=False, evaluate=False)
    with pytest.raises(
        machinery.CheckpointError,
        match=r"batch_tokens=120; resume with --batch_tokens 120",
    ) as err:
        machinery.train(
            dataclasses.replace(cfg, batch_tokens=240, max_steps=0),
            data=data_for(cfg),
            log=quiet,
            progress=False,
            evaluate=False,
        )
    assert "\n" not in str(err.value)


def test_an_older_checkpoint_position_counted_in_updates_is_read_in_batches():
    cfg = cfg_for("unused", accum_steps=2)
    old = {
        "step": 4,
        "epoch": 0,
        "batch_in_epoch": 4,
        "config": dataclasses.asdict(cfg),
    }
    pos, layout = machinery.resume_position(old, cfg, "old.pt")
    assert pos.batch_in_epoch == 8 and layout == {
        "world_size": 1,
        "accum_steps": 2,
        "batch_tokens": 120,
    }

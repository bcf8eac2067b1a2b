"""Resuming on machines without a shared disk, proven with two Gloo processes on a CPU,
each with a run directory of its own: the newest *readable* checkpoint any process
holds wins; a holder whose newest file cannot be read sets it aside and the choice is
made again; unreadable files are set aside on whichever machine holds them; the state
a process is sent is checked as its own file would be.

Only `find_checkpoint` runs in the two processes (no training), on checkpoints written
here by a one-process run of a one-layer copy model.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402
from conftest import quiet  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# the module under test (another version of it can be given, to compare)
RESUMING = Path(
    os.environ.get("RESUMING_UNDER_TEST") or ROOT / "machinery" / "resuming.py"
)
SETTINGS = dict(
    N=1,
    d_model=32,
    d_ff=64,
    h=4,
    warmup=50,
    device="cpu",
    precision="fp32",
    attention="readable",
    batch_tokens=120,
    epochs=1,
    keep_checkpoints=5,
)
SIZES = (200, 40, 20)

SCRIPT = """
import importlib.util, json, sys
from pathlib import Path

import torch.distributed as dist

import machinery

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
base, settings, module = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
vocab_sizes = settings.pop("vocab_size_by_rank")
folder = base if settings.pop("shared_disk") else f"{base}-rank{rank}"
spec = importlib.util.spec_from_file_location("machinery.resuming_under_test", module)
resuming = importlib.util.module_from_spec(spec)
spec.loader.exec_module(resuming)
cfg = machinery.get_config("copy", run_dir=folder, **settings)
data = machinery.make_copy_data(cfg, vocab_size=vocab_sizes[rank], sizes=(200, 40, 20))
files = machinery.RunFiles(Path(cfg.run_dir), cfg.keep_checkpoints, write=rank == 0)
record = {}
try:
    found = resuming.find_checkpoint(files, cfg, data, rank, world, log=print)
    record["found"] = found and [found[0].parent.name, found[1]["step"]]
except machinery.CheckpointError as e:
    record["error"] = str(e)
record["files"] = sorted(p.name for p in Path(cfg.run_dir).glob("checkpoint-*"))
Path(f"{base}-out{rank}.json").write_text(json.dumps(record))
dist.barrier()  # the files listed before any process leaves
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict:
    """Readable checkpoints of steps 2, 4, 5 and 6 of one run: step → file."""
    run = tmp_path_factory.mktemp("written") / "run"
    cfg = machinery.get_config("copy", run_dir=str(run), **SETTINGS)
    data = machinery.make_copy_data(cfg, sizes=SIZES)
    for steps in (2, 4, 5, 6):
        cfg = machinery.get_config(
            "copy", run_dir=str(run), max_steps=steps, **SETTINGS
        )
        machinery.train(cfg, data=data, log=quiet, progress=False, evaluate=False)
    return {
        machinery.load_checkpoint(p)["step"]: p for p in machinery.checkpoint_paths(run)
    }


def name(step: int) -> str:
    return f"checkpoint-{step:08d}.pt"


def lay_out(base: Path, good: dict, holdings: list) -> None:
    """Each process's run directory: ``{step: "good" | "corrupt"}`` (a corrupt file is a
    good one cut in half, as a power loss leaves it)."""
    for rank, held in enumerate(holdings):
        folder = Path(f"{base}-rank{rank}")
        folder.mkdir(parents=True)
        for step, kind in held.items():
            blob = good[step].read_bytes()
            (folder / name(step)).write_bytes(blob if kind == "good" else blob[:-4096])


def find_on_two(tmp_path, vocab_sizes=(11, 11), shared_disk=False) -> list[dict]:
    """`find_checkpoint` in two Gloo processes, each in its own run directory (laid out
    by `lay_out`); what each found (its directory and step, or the error) and its
    checkpoint files after."""
    base = tmp_path / "run"
    script = tmp_path / "find_two.py"
    script.write_text(textwrap.dedent(SCRIPT))
    settings = dict(
        SETTINGS, vocab_size_by_rank=list(vocab_sizes), shared_disk=shared_disk
    )
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
            str(base),
            json.dumps(settings),
            str(RESUMING),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(Path(f"{base}-out{r}.json").read_text()) for r in range(2)]


def test_a_tie_whose_first_holder_cannot_read_its_file_resumes_from_the_other(
    tmp_path, good
):
    # both hold step 4; process 0's copy is torn, process 1's reads
    lay_out(tmp_path / "run", good, [{2: "good", 4: "corrupt"}, {4: "good"}])
    records = find_on_two(tmp_path)
    assert [r.get("found") for r in records] == [["run-rank1", 4]] * 2, records
    assert records[0]["files"] == [name(2), name(4) + ".unreadable"]
    assert records[1]["files"] == [name(4)]


def test_a_tie_of_readable_files_is_taken_from_the_first_holder(tmp_path, good):
    lay_out(tmp_path / "run", good, [{4: "good"}, {2: "good", 4: "good"}])
    records = find_on_two(tmp_path)
    assert [r.get("found") for r in records] == [["run-rank0", 4]] * 2, records
    assert records[1]["files"] == [name(2), name(4)], "nothing is set aside"


def test_an_unreadable_newest_file_on_the_holder_gives_way_to_another_machines_newer(
    tmp_path, good
):
    # process 1 holds the newest name (6), torn; the newest readable is process 0's 4,
    # not process 1's own older 2
    lay_out(tmp_path / "run", good, [{2: "good", 4: "good"}, {2: "good", 6: "corrupt"}])
    records = find_on_two(tmp_path)
    assert [r.get("found") for r in records] == [["run-rank0", 4]] * 2, records
    assert records[1]["files"] == [name(2), name(6) + ".unreadable"], (
        "set aside on the machine that holds it, which is not process 0"
    )
    assert records[0]["files"] == [name(2), name(4)]


def test_when_none_of_the_holders_files_reads_another_machines_checkpoint_wins(
    tmp_path, good
):
    lay_out(tmp_path / "run", good, [{4: "good"}, {5: "corrupt", 6: "corrupt"}])
    records = find_on_two(tmp_path)
    assert [r.get("found") for r in records] == [["run-rank0", 4]] * 2, records
    assert records[1]["files"] == [name(5) + ".unreadable", name(6) + ".unreadable"]


def test_when_no_machine_holds_a_readable_checkpoint_every_process_stops_in_one_line(
    tmp_path, good
):
    lay_out(tmp_path / "run", good, [{4: "corrupt"}, {6: "corrupt"}])
    records = find_on_two(tmp_path)
    for r in records:
        assert "none of the 2 checkpoint(s)" in r["error"], r
        assert "\n" not in r["error"]
    assert [r["files"] for r in records] == [[name(4)], [name(6)]], "left in place"


def test_the_state_a_process_is_sent_is_checked_against_its_own_vocabulary(
    tmp_path, good
):
    # process 0 prepared other data (a 12-symbol vocabulary): the checkpoint process 1
    # holds does not fit it, as a file of its own would not
    lay_out(tmp_path / "run", good, [{}, {6: "good"}])
    records = find_on_two(tmp_path, vocab_sizes=(12, 11))
    for r in records:
        assert "another src vocabulary" in r.get("error", ""), r


def test_on_a_shared_disk_both_processes_pass_over_the_same_torn_file_and_it_is_renamed(
    tmp_path, good
):
    # one run directory for both processes (one machine): the torn newest file is the
    # same file for both, set aside once, and both resume from the one before it
    folder = tmp_path / "run"
    folder.mkdir()
    for step, kind in {2: "good", 4: "good", 6: "corrupt"}.items():
        blob = good[step].read_bytes()
        (folder / name(step)).write_bytes(blob if kind == "good" else blob[:-4096])
    records = find_on_two(tmp_path, shared_disk=True)
    assert [r.get("found") for r in records] == [["run", 4]] * 2, records
    assert records[0]["files"] == [name(2), name(4), name(6) + ".unreadable"]

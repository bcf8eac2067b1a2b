"""Table 3's engines (`benchmarks/table3_engines.py`) run for real: the local pool's
slots, Ray on a two-node cluster of this machine, SLURM's jobs through submitit's
local executor, a task that cannot see the run folder, and an engine not installed.

Ray and submitit are optional (`make install-cluster`); their tests skip without
them. The rows are the smoke table's (the copy preset, 5 updates a row). A row killed
in the middle is frozen first (SIGSTOP), once its progress bar shows an update done,
so that the kill lands mid-row however loaded the machine is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "table3.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from table3_engines import EngineError, LocalPool  # noqa: E402

HAS_RAY = importlib.util.find_spec("ray") is not None
HAS_SUBMITIT = importlib.util.find_spec("submitit") is not None
needs_ray = pytest.mark.skipif(
    not HAS_RAY, reason="ray is not installed (make install-cluster)"
)
needs_submitit = pytest.mark.skipif(
    not HAS_SUBMITIT, reason="submitit is not installed (make install-cluster)"
)
SMOKE_UPDATES = 5  # the smoke table's max_steps
ENV = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def driver_args(out: Path, *args: str) -> list[str]:
    """The driver's command line for the smoke table in ``out``'s folder."""
    return [sys.executable, str(DRIVER), "--smoke", "--out", str(out), *args]


def rows_of(out: Path) -> list[dict]:
    """The rows the driver wrote."""
    return json.loads(out.read_text())["rows"]


# ---------------------------------------------------------------------------------
# The local pool, with light stand-in rows


class StandIn:
    """A row for the pool that records when it starts and runs until released."""

    def __init__(self, name: str, threads: int, started: list):
        self.name, self.threads, self.started = name, threads, started
        self.release = threading.Event()
        self.stopped = None

    def __call__(self) -> dict:
        self.started.append(self.name)
        assert self.release.wait(60), f"{self.name} was never released"
        return {"name": self.name, "stopped": self.stopped}

    def stop(self, signum: int) -> None:
        self.stopped = signum
        self.release.set()


def wait_until(condition, timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until it holds (fail after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_local_pool_runs_two_one_thread_rows_at_once():
    started: list = []
    pool = LocalPool(cpus=2)
    a, b = StandIn("a", 1, started), StandIn("b", 1, started)
    futures = [pool.submit(a), pool.submit(b)]
    # neither is released before both have started: they hold a slot each at once
    wait_until(lambda: len(started) == 2, what="both rows to start")
    assert sorted(started) == ["a", "b"] and pool.busy() == 2
    a.release.set()
    b.release.set()
    assert [f.result(30)["name"] for f in futures] == ["a", "b"]
    assert pool.busy() == 0


def test_local_pool_gives_a_two_thread_row_two_slots():
    started: list = []
    pool = LocalPool(cpus=2)
    wide, narrow = StandIn("wide", 2, started), StandIn("narrow", 1, started)
    first, second = pool.submit(wide), pool.submit(narrow)
    wait_until(lambda: started == ["wide"], what="the wide row to start")
    time.sleep(0.3)  # room for the narrow row to start, were a slot free
    assert started == ["wide"] and pool.busy() == 2
    assert list(pool.waiting) == [narrow] and not second.done()
    wide.release.set()
    wait_until(lambda: started == ["wide", "narrow"], what="the narrow row")
    assert first.result(30)["name"] == "wide" and pool.busy() == 1
    narrow.release.set()
    assert second.result(30)["name"] == "narrow" and pool.busy() == 0


def test_local_pool_refuses_a_row_wider_than_itself_and_stops_its_rows():
    started: list = []
    pool = LocalPool(cpus=2)
    with pytest.raises(EngineError, match="--cpus 3"):
        pool.submit(StandIn("too-wide", 3, started))
    running, queued = StandIn("running", 2, started), StandIn("queued", 1, started)
    first, second = pool.submit(running), pool.submit(queued)
    wait_until(lambda: started == ["running"], what="the first row to start")
    pool.stop(signal.SIGTERM)
    # the running row is told the signal; the queued one never starts
    assert first.result(30) == {"name": "running", "stopped": signal.SIGTERM}
    assert second.result(30) is None and started == ["running"]


# ---------------------------------------------------------------------------------
# An engine that is not installed


@pytest.mark.parametrize(
    "package, engine",
    [("ray", ["--engine", "ray"]), ("submitit", ["--engine", "slurm"])],
)
def test_a_missing_engine_is_one_line_naming_the_install_command(
    tmp_path, package, engine
):
    hide = (
        "import runpy, sys\n"
        f"sys.modules[{package!r}] = None  # import {package} raises ImportError\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    out = tmp_path / "table3.json"
    args = [sys.executable, "-c", hide, *driver_args(out, "--rows", "A-h1")[1:]]
    done = subprocess.run(
        args + engine + ["--submitit_cluster", "local"] * (package == "submitit"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert package in lines[0] and "make install-cluster" in lines[0]
    assert not out.exists()  # refused before the file was written


# ---------------------------------------------------------------------------------
# Ray: a cluster of two one-CPU nodes on this machine


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes of one CPU each. A node gives its agent 15 s to start, which a
    loaded machine can exceed: the cluster leaves out what the tests do not use (the
    log monitor, the autoscaler's monitor, prestarted workers, the usage report),
    and a node that does not come up is started again, three times at most."""
    if not HAS_RAY:
        pytest.skip("ray is not installed (make install-cluster)")
    from ray.cluster_utils import Cluster

    quiet = {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_enable_worker_prestart": "0",
        "RAY_prestart_worker_first_driver": "0",
    }
    node = dict(num_cpus=1, include_dashboard=False, include_log_monitor=False)

    def started() -> "Cluster":
        cluster = Cluster()
        for attempt in range(3):
            try:
                if cluster.head_node is None:
                    cluster.add_node(**node, no_monitor=True)
                cluster.add_node(**node)
                cluster.wait_for_nodes()
                return cluster
            except Exception:  # noqa: BLE001 - a node's start timed out
                if attempt == 2:
                    cluster.shutdown()
                    raise
                if len(cluster.list_all_nodes()) > 1 or cluster.head_node is None:
                    cluster.shutdown()
                    cluster = Cluster()

    with pytest.MonkeyPatch.context() as env:
        for name, value in quiet.items():
            env.setenv(name, value)
        cluster = started()
        try:
            yield cluster
        finally:
            cluster.shutdown()


def node_ids(cluster) -> set[str]:
    """The hex ids of the cluster's nodes."""
    return {n.node_id for n in cluster.list_all_nodes()}


@needs_ray
def test_ray_rows_land_on_both_nodes_of_a_two_node_cluster(ray_cluster, tmp_path):
    out = tmp_path / "table3.json"
    args = ["--rows", "A-h1-seed2,B-dk4-seed2", "--engine", "ray"]
    done = subprocess.run(
        driver_args(out, *args, "--address", ray_cluster.address),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = rows_of(out)
    assert sorted(r["name"] for r in rows) == ["A-h1-seed2", "B-dk4-seed2"]
    assert all(r["status"] == "done" for r in rows), rows
    places = [r["ran_on"] for r in rows]
    assert {p["engine"] for p in places} == {"ray"}
    assert {p["host"] for p in places} == {socket.gethostname()}
    assert {p["node"] for p in places} == node_ids(ray_cluster)  # one row on each


def training_process(run_dir: Path, timeout: float = 240.0) -> psutil.Process:
    """The process that trains into ``run_dir`` (once it has started)."""
    found: list = []

    def started() -> bool:
        for proc in psutil.process_iter(["cmdline"]):
            line = proc.info["cmdline"] or []
            if "train" in line and str(run_dir) in " ".join(line):
                found.append(proc)
                return True
        return False

    wait_until(started, timeout, f"training into {run_dir}")
    return found[0]


def freeze_after_an_update(
    proc: psutil.Process, log: Path, after: str = "", timeout=240.0
) -> None:
    """Let ``proc`` train in short slices, frozen in between, until ``log`` shows an
    update of the row done (after the last occurrence of ``after``), and leave it
    frozen: mid-row however fast the machine."""
    give_up = time.monotonic() + timeout
    proc.send_signal(signal.SIGSTOP)
    while time.monotonic() < give_up:
        time.sleep(0.3)  # the runner copies what the program printed into its log
        text = log.read_text(errors="replace") if log.is_file() else ""
        text = text[text.rfind(after) :] if after else text
        if [n for n in re.findall(r"\| *(\d+)/\d+ \[", text) if 1 <= int(n)]:
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.02)
        proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGCONT)
    raise AssertionError(f"no training update in {log}")


def kill_mid_row(proc: psutil.Process, kill_parent) -> int:
    """Kill the process that runs a row (``kill_parent(parent)``) while its training
    process ``proc`` is frozen mid-row; the parent's pid."""
    parent = proc.parent()
    proc.send_signal(signal.SIGSTOP)
    try:
        kill_parent(parent)
    finally:
        proc.send_signal(signal.SIGCONT)
    return parent.pid


@needs_ray
def test_ray_row_whose_worker_is_killed_is_retried_and_resumes_slowest(
    ray_cluster, tmp_path
):
    out = tmp_path / "table3.json"
    run_dir = tmp_path / "table3-runs" / "E-learned-seed2"
    args = [
        "--rows",
        "E-learned-seed2",
        "--engine",
        "ray",
        "--address",
        ray_cluster.address,
    ]
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        driver_args(out, *args), cwd=ROOT, stdout=log, stderr=log, env=ENV
    )
    try:
        trainer = training_process(run_dir)
        worker = trainer.parent()
        logs = [Path(n.get_logs_dir_path()) for n in ray_cluster.list_all_nodes()]
        worker_log = next(p for d in logs for p in d.glob(f"worker-*-{worker.pid}.err"))
        freeze_after_an_update(trainer, worker_log, ":task_name:E-learned-seed2")

        def lose_worker(parent: psutil.Process) -> None:
            parent.kill()
            parent.wait(30)

        kill_mid_row(trainer, lose_worker)
        # the orphan got its parent's death as SIGTERM: it saves and ends
        trainer.wait(120)
        assert driver.wait(400) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    rows = rows_of(out)
    assert [r["name"] for r in rows] == ["E-learned-seed2"]  # exactly once
    row = rows[0]
    assert row["status"] == "done", row
    resumed = row["resumed_step"]
    assert 1 <= resumed < SMOKE_UPDATES and row["provenance"]["updates"] == 5
    assert row["ran_on"]["node"] in node_ids(ray_cluster)
    # the retry's program said where it took up the row
    said = [p.read_text(errors="replace") for d in logs for p in d.glob("worker-*")]
    assert any(f"at step {resumed} " in text for text in said)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").open()]
    assert steps == [SMOKE_UPDATES]  # one epoch record, its step logged once


@needs_ray
def test_ray_driver_refuses_a_run_folder_its_tasks_cannot_see(ray_cluster, tmp_path):
    out, runs = tmp_path / "table3.json", tmp_path / "runs"
    runs.mkdir()
    # /proc/self/fd/N is the run folder in the driver, which holds fd N open, and
    # another file or nothing in each Ray worker: a folder the tasks cannot see
    fd = os.open(runs, os.O_RDONLY)
    seen = os.dup2(fd, 987)
    os.close(fd)
    try:
        args = ["--rows", "A-h1", "--engine", "ray", "--address", ray_cluster.address]
        done = subprocess.run(
            driver_args(out, *args, "--runs", f"/proc/self/fd/{seen}"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
            pass_fds=(seen,),
        )
    finally:
        os.close(seen)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read" in lines[0], done.stderr
    assert "storage every node sees" in lines[0]
    assert not out.exists() and list(runs.iterdir()) == []  # no row started


# ---------------------------------------------------------------------------------
# SLURM's jobs, through submitit's local executor


@needs_submitit
def test_submitit_job_interrupted_mid_row_checkpoints_requeues_and_resumes(tmp_path):
    import submitit

    out = tmp_path / "table3.json"
    runs = tmp_path / "table3-runs"
    args = ["--rows", "B-dk4-seed2", "--engine", "slurm", "--submitit_cluster", "local"]
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        driver_args(out, *args), cwd=ROOT, stdout=log, stderr=log, env=ENV
    )
    try:
        trainer = training_process(runs / "B-dk4-seed2")
        job = trainer.parent().environ()["SUBMITIT_LOCAL_JOB_ID"]
        job_log = runs / "slurm-logs" / f"{job}_0_log.err"
        freeze_after_an_update(trainer, job_log)
        # what submitit's controller sends a job near its time limit, and SLURM on
        # preemption: the job calls RowJob.checkpoint and is queued again
        preempt = submitit.local.local.LocalJobEnvironment._usr_sig()
        kill_mid_row(trainer, lambda parent: parent.send_signal(preempt))
        trainer.wait(120)
        assert driver.wait(400) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    rows = rows_of(out)
    assert [r["name"] for r in rows] == ["B-dk4-seed2"]
    row = rows[0]
    assert row["status"] == "done", row
    assert 1 <= row["resumed_step"] < SMOKE_UPDATES
    assert row["provenance"]["updates"] == SMOKE_UPDATES
    assert row["ran_on"]["engine"] == "slurm" and row["ran_on"]["job"]
    # submitit called the row's checkpoint, requeued the job, and the program took
    # the row up at the step it saved
    said = "".join(
        p.read_text(errors="replace") for p in job_log.parent.glob(f"{job}_0_log.*")
    )
    assert "this job is preempted" in said and "Requeued job" in said
    assert f"at step {row['resumed_step']} " in said


# ---------------------------------------------------------------------------------
# A row's process outlives no worker


def test_a_rows_process_gets_sigterm_when_the_worker_that_started_it_dies(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
    sleeper += "; time.sleep(120)"
    worker = (
        "import signal, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from table3_work import Child\n"
        f"Child(signal.SIGTERM).run([sys.executable, '-c', {sleeper!r}], 1)\n"
    )
    started = subprocess.Popen([sys.executable, "-c", worker], cwd=ROOT, env=ENV)
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), 60, "sleeper")
        orphan = psutil.Process(int(pid_file.read_text()))
        assert orphan.ppid() == started.pid  # the launcher exec'd into the row
        started.kill()  # the worker dies without a word to its child
        started.wait(30)
        orphan.wait(30)  # ended by its parent's death, not after its 120 s
    finally:
        if started.poll() is None:
            started.kill()

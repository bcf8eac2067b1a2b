"""The engines that run Table 3's rows (§6.2) for its driver, `benchmarks/table3.py`
(our addition): one small interface, three ways to spread the work.

* ``local`` (standard library only): a pool of the machine's usable cores. A row asks
  for its threads as CPUs, so a row on two threads takes two slots; rows start in the
  order they were handed in, each as soon as its slots are free.
* ``ray``: Ray core. Each row is a task asking for its threads as ``num_cpus``; a task
  whose node is lost is retried wherever Ray places it, and resumes from the
  checkpoints in its run directory.
* ``slurm``: submitit. Each row is a job with ``cpus_per_task`` equal to its threads;
  at its time limit or on preemption the row's training process gets the signal it
  saves a checkpoint on, and the job is submitted again to resume.

Every engine returns a ``concurrent.futures.Future`` per row, whose result is the
row's record (`table3_work.RowJob`); only the driver writes the results file. Ray and
submitit are optional (``requirements-cluster.txt``, ``make install-cluster``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import shlex
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from table3_work import ROOT, RowJob

INSTALL = "make install-cluster (the exact pins of requirements-cluster.txt)"


class EngineError(Exception):
    """An engine that cannot run here, said in one line."""


def usable_cores() -> int:
    """The cores this process may keep busy: its affinity, less where a container's
    CPU quota allows less (`machinery.devices.usable_cores`), not the machine's
    count."""
    from machinery.devices import usable_cores as cores

    return cores()


def _import(name: str):
    """Import an optional engine's package, or say in one line how to install it."""
    try:
        return __import__(name)
    except ImportError:
        raise EngineError(
            f"--engine needs the package {name!r}, which is not installed: {INSTALL}"
        ) from None


def read_probe(path: str) -> Optional[str]:
    """The text of the driver's probe file as a task sees it (None where it cannot
    read it): the test that a task's node sees the driver's run folder."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


class LocalPool:
    """Rows on this machine: ``cpus`` slots (default: the usable cores); a row takes
    as many slots as it has threads, and rows start in the order handed in."""

    name = "local"

    def __init__(self, cpus: Optional[int] = None):
        self.cpus = cpus or usable_cores()
        self.free = self.cpus
        self.waiting: collections.deque = collections.deque()
        self.running: set = set()
        self.stopping: Optional[int] = None
        self.cond = threading.Condition()

    def submit(self, job: RowJob) -> concurrent.futures.Future:
        """Queue ``job``; it starts once the rows before it have and its threads'
        slots are free."""
        if job.threads > self.cpus:
            raise EngineError(
                f"row {job.name} trains on {job.threads} threads and the pool has "
                f"{self.cpus} CPU(s): give --cpus {job.threads} or more"
            )
        job.engine = self.name
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            self.waiting.append(job)
        threading.Thread(target=self._run, args=(job, future), daemon=True).start()
        return future

    def _run(self, job: RowJob, future: concurrent.futures.Future) -> None:
        with self.cond:
            self.cond.wait_for(
                lambda: self.stopping is not None
                or (self.waiting[0] is job and self.free >= job.threads)
            )
            self.waiting.remove(job)
            if self.stopping is not None:  # stopped before it started
                self.cond.notify_all()
                future.set_result(None)
                return
            self.free -= job.threads
            self.running.add(job)
            self.cond.notify_all()
        try:
            future.set_result(job())
        except BaseException as e:  # noqa: BLE001 - handed to the driver
            future.set_exception(e)
        finally:
            with self.cond:
                self.free += job.threads
                self.running.discard(job)
                self.cond.notify_all()

    def busy(self) -> int:
        """The slots that rows hold now."""
        with self.cond:
            return self.cpus - self.free

    def storage_problem(self, probe: Path, token: str) -> Optional[str]:
        """None: the pool's rows run on this machine, beside the driver."""
        return None

    def stop(self, signum: int) -> None:
        """Start no more rows and stop the running ones (each saves a checkpoint)."""
        with self.cond:
            self.stopping = signum
            running = list(self.running)
            self.cond.notify_all()
        for job in running:
            job.stop(signum)

    def close(self) -> None:
        pass


def _ray_row(job: RowJob) -> dict:
    """A row run as a Ray task."""
    return job()


def _ray_probe(path: str) -> Optional[str]:
    """The probe file read on one Ray node."""
    return read_probe(path)


class RayEngine:
    """Rows as Ray tasks (``num_cpus`` = the row's threads), on the cluster at
    ``address`` or, without one, on a Ray started here for this run."""

    name = "ray"

    def __init__(self, address: Optional[str] = None, cpus: Optional[int] = None):
        ray = self.ray = _import("ray")
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])}
        options = dict(
            runtime_env={"env_vars": env},
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=True,
        )
        if not address:
            options["num_cpus"] = cpus or usable_cores()
        try:
            ray.init(address=address or None, **options)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise EngineError(f"cannot join Ray at {address or 'a new local Ray'}: "
                              f"{first}") from None  # fmt: skip
        self.row = ray.remote(max_retries=3, retry_exceptions=False)(_ray_row)
        self.probe = ray.remote(num_cpus=0)(_ray_probe)
        self.refs: dict = {}

    def submit(self, job: RowJob) -> concurrent.futures.Future:
        job.engine = self.name
        ref = self.row.options(num_cpus=job.threads, name=job.name).remote(job)
        self.refs[ref] = job
        return ref.future()

    def nodes(self) -> list[str]:
        """The ids of the cluster's live nodes."""
        return [n["NodeID"] for n in self.ray.nodes() if n.get("Alive")]

    def storage_problem(self, probe: Path, token: str) -> Optional[str]:
        """Why some node cannot see the driver's run folder (a task on each live node
        reads the probe file the driver wrote), or None."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = {
            node: self.probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(str(probe))
            for node in self.nodes()
        }
        for node, ref in refs.items():
            if self.ray.get(ref, timeout=120) != token:
                return (
                    f"a Ray node ({node[:12]}) cannot read {probe}, which this "
                    "driver wrote: the run folder must be on storage every node "
                    "sees (give --runs a shared folder)"
                )
        return None

    def stop(self, signum: int) -> None:
        """Cancel every row: a running task's training saves a checkpoint."""
        for ref in list(self.refs):
            self.ray.cancel(ref)

    def close(self) -> None:
        self.ray.shutdown()


def _slurm_probe(path: str) -> Optional[str]:
    """The probe file read in a SLURM job."""
    return read_probe(path)


class SlurmEngine:
    """Rows as SLURM jobs through submitit (``cpus_per_task`` = the row's threads,
    ``--time_limit`` minutes each); ``cluster="local"`` runs the same jobs as local
    processes through submitit (what the tests use)."""

    name = "slurm"

    def __init__(
        self,
        folder: Path,
        partition: Optional[str] = None,
        time_limit: int = 240,
        cluster: Optional[str] = None,
    ):
        submitit = self.submitit = _import("submitit")
        if cluster is None and not _has_sbatch():
            raise EngineError(
                "--engine slurm: no `sbatch` on this machine's PATH; run the driver "
                "on a SLURM login node"
            )
        self.executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
        settings = dict(timeout_min=time_limit, tasks_per_node=1, nodes=1)
        # A job unpickles its row, so it imports this folder's modules as the
        # driver does (the repository on storage every node sees).
        path = shlex.quote(os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
        setup = [f"export PYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}}"]
        settings[f"{self.executor.cluster}_setup"] = setup
        if cluster in (None, "slurm"):
            settings["slurm_signal_delay_s"] = 120  # time to save a checkpoint
            if partition:
                settings["slurm_partition"] = partition
        self.executor.update_parameters(**settings)
        self.jobs: dict = {}

    def submit(self, job: RowJob) -> concurrent.futures.Future:
        job.engine = self.name
        self.executor.update_parameters(cpus_per_task=job.threads, name=job.name)
        submitted = self.executor.submit(job)
        self.jobs[submitted.job_id] = submitted
        return _wait_in_thread(submitted)

    def storage_problem(self, probe: Path, token: str) -> Optional[str]:
        """Why a job cannot see the driver's run folder (one job reads the probe
        file the driver wrote), or None."""
        self.executor.update_parameters(cpus_per_task=1, name="table3-probe")
        seen = self.executor.submit(_slurm_probe, str(probe)).result()
        if seen != token:
            return (
                f"a SLURM job cannot read {probe}, which this driver wrote: the run "
                "folder must be on storage every node sees (give --runs a shared "
                "folder)"
            )
        return None

    def stop(self, signum: int) -> None:
        """Cancel every job (SLURM sends it SIGTERM: its training saves)."""
        for submitted in self.jobs.values():
            submitted.cancel(check=False)

    def close(self) -> None:
        pass


def _has_sbatch() -> bool:
    import shutil

    return shutil.which("sbatch") is not None


def _wait_in_thread(submitted) -> concurrent.futures.Future:
    """A Future for a submitit job, set when the job ends (submitit polls its state)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def wait() -> None:
        try:
            future.set_result(submitted.result())
        except BaseException as e:  # noqa: BLE001 - handed to the driver
            future.set_exception(e)

    threading.Thread(target=wait, daemon=True).start()
    return future


def make_engine(args, runs: Path):
    """The engine ``--engine`` names, set up from the driver's options."""
    if args.engine == "local":
        return LocalPool(args.cpus)
    if args.engine == "ray":
        return RayEngine(args.address, args.cpus)
    return SlurmEngine(
        runs / "slurm-logs", args.partition, args.time_limit, args.submitit_cluster
    )


def probe_token() -> str:
    """A string no other run writes: what the shared-storage check reads back."""
    return f"table3 driver {os.getpid()} {time.time()} {uuid.uuid4()}"


__all__ = [
    "EngineError",
    "LocalPool",
    "RayEngine",
    "SlurmEngine",
    "make_engine",
    "probe_token",
    "usable_cores",
    "signal",
]

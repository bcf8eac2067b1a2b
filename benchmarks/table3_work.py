"""The work of one Table 3 (§6.2) row, wherever an engine runs it: train the row
through the command line, score its last checkpoint on the validation split, check
that its model reads its source, and return its record (our addition).

`benchmarks/table3.py` (the driver) builds a `RowJob` per row and hands it to an
engine (`benchmarks/table3_engines.py`); the job runs in a thread of the driver, in a
Ray task or in a SLURM job, always with the repository root as its working folder and
the run directory on storage the driver sees. It talks to the program only through
its command lines and the files a run writes, and never writes the results file: it
returns the record, and the driver merges it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "the_annotated_transformer.py"
SOURCE_CHECK = ROOT / "benchmarks" / "source_use.py"
UNSUPPORTED = "not supported by this version"
# What a row must have run with for the file to hold it (besides its own fields).
BUDGET_CHECKED = ("epochs", "warmup", "lr_factor", "batch_tokens", "precision")


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (a temporary file beside it, then a rename):
    the one writer of the files a row keeps in its run directory."""
    sys.path.insert(0, str(ROOT))
    from machinery.runfiles import atomic_file

    with atomic_file(Path(path), "w") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def program_options(python: str, command: str = "train") -> set[str]:
    """The option names ``<command> --help`` of the program accepts, or an empty set
    where the help cannot be read (a row then passes only what it must)."""
    done = subprocess.run(
        [python, str(PROGRAM), command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return set()
    found = re.findall(r"--([A-Za-z_][\w-]*)", done.stdout)
    return {m.replace("-", "_") for m in found}


def relative(path: Path) -> Path:
    """``path`` relative to the repository root where it lies inside it (the runs of
    Table 3, §6.2, are started there), so that the results name no machine's folders."""
    path = path.absolute()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def command(python: str, preset: str, run_dir: Path, overrides: dict) -> list[str]:
    """The ``train`` command line of one Table 3 (§6.2) row."""
    args = [
        python,
        PROGRAM.name,
        "train",
        "--config",
        preset,
        "--run_dir",
        str(run_dir),
    ]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    return args


def saved_settings(run_dir: Path) -> Optional[dict]:
    """The config a run directory was trained with (results.json, else the newest
    checkpoint's ``config``), or None if it holds neither — to resume a Table 3
    (§6.2) row only with its own settings."""
    results = run_dir / "results.json"
    if results.is_file():
        return json.loads(results.read_text())["config"]
    checkpoints = newest_checkpoint(run_dir)
    if checkpoints is None:
        return None
    import torch

    return torch.load(checkpoints, map_location="cpu", weights_only=True)["config"]


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest ``checkpoint-<step>.pt`` of a run directory (the program's names)."""
    found = [
        (int(m.group(1)), p)
        for p in run_dir.glob("checkpoint-*.pt")
        if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", p.name))
    ]
    return max(found)[1] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    """The update a ``checkpoint-<step>.pt`` was saved after (the program's names)."""
    return int(re.fullmatch(r"checkpoint-(\d+)\.pt", checkpoint.name).group(1))


def wait_for_run_dir(run_dir: Path, timeout: float = 300.0) -> None:
    """Wait while another process holds the program's lock on ``run_dir`` (at most
    ``timeout`` seconds; the program then says who holds it): a row retried after its
    worker died starts once the orphaned training process, stopped by its parent's
    death, has saved its checkpoint and let go of the run directory."""
    lock = run_dir / "run.lock"
    try:
        import fcntl
    except ImportError:  # no flock here: the program does not lock either
        return
    if not lock.is_file():
        return
    deadline = time.monotonic() + timeout
    with open(lock, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.5)
                continue
            except OSError:  # a file system without locks
                return
            fcntl.flock(f, fcntl.LOCK_UN)
            return


def count_parameters(checkpoint: Path) -> int:
    """Parameters of a row (Table 3's last column, §6.2): the sum of numel over the
    checkpoint's model state dict, a tensor shared by several names (§3.4's tied
    embeddings and pre-softmax weights) counted once."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    seen = {}
    for tensor in state.values():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
        )
        seen[key] = tensor.numel()
    return sum(seen.values())


def valid_curve(metrics: Path) -> list[dict]:
    """Validation perplexity after every epoch, from a run's metrics.jsonl (records
    with ``valid_loss``, nats per target token, no smoothing): Table 3's PPL column
    (§6.2) as it moved, so that "learns faster" and "ends better" can be told apart."""
    curve = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "valid_loss" in record:
            curve = [c for c in curve if c["epoch"] != record.get("epoch")]
            curve.append(
                {
                    "epoch": record.get("epoch"),
                    "step": record.get("step"),
                    "valid_ppl": math.exp(min(record["valid_loss"], 50)),
                }
            )
    return curve


def head_size(settings: dict) -> int:
    """d_k as the program uses it: ``d_k``, or d_model/h where it is 0 (§3.2.2)."""
    return settings.get("d_k") or settings["d_model"] // settings["h"]


def differences(expected: dict, config: dict) -> dict:
    """The settings a run's config does not share with what was asked of it (d_k 0
    and d_model/h are one value): a row of Table 3 (§6.2) the file must not hold."""
    out = {}
    for key, value in expected.items():
        if key not in config:
            continue
        ran = config[key]
        if key == "d_k":
            value, ran = head_size(expected | {"d_k": value}), head_size(config)
        if ran != value:
            out[key] = {"asked": value, "ran": ran}
    return out


def valid_bleu(python: str, run_dir: Path, budget: dict, child: "Child") -> dict:
    """BLEU (beam 4, §6.1) of a row's last checkpoint on the validation split — the
    development-set column of Table 3 (§6.2) — through ``evaluate``; kept in the run
    directory so that collecting the row again does not decode again."""
    kept = run_dir / "valid_bleu.json"
    checkpoint = newest_checkpoint(run_dir)
    if kept.is_file():
        found = json.loads(kept.read_text())
        if found.get("checkpoint") == checkpoint.name:
            return found
    args = [python, PROGRAM.name, "evaluate", "--checkpoint", str(relative(checkpoint))]
    args += ["--split", "valid", "--beam", "4"]
    if budget.get("max_eval_sentences"):
        args += ["--first", str(budget["max_eval_sentences"])]
    hypotheses = run_dir / "valid-hypotheses.txt"
    keeps = "hypotheses" in program_options(python, "evaluate")
    if keeps:  # the decoded sentences, for a paired test over sentences
        args += ["--hypotheses", str(relative(hypotheses))]
    code, out, err = child.capture(args, budget["threads"])
    match = re.search(r"BLEU\S*\s*=\s*([\d.]+)", out)
    if code != 0 or not match:
        raise RuntimeError(f"evaluate --split valid failed: {last_line(err or out)}")
    lines = out.strip().splitlines()
    found = {
        "checkpoint": checkpoint.name,
        "valid_bleu": float(match.group(1)),
        "signature": next((x for x in reversed(lines) if "nrefs" in x), lines[-1]),
        "command": " ".join(["python", *args[1:]]),
    }
    if keeps and hypotheses.is_file():
        found["hypotheses"] = str(relative(hypotheses))
        found["hypotheses_sha256"] = sha256_of(hypotheses)
    write_json(kept, found)
    return found


def source_check(python: str, run_dir: Path, budget: dict, child: "Child") -> dict:
    """Whether a row's last checkpoint reads its source: its validation loss with each
    pair's own source and with another pair's (``benchmarks/source_use.py``), kept in
    the run directory so that collecting the row again does not measure again."""
    kept = run_dir / "source_use.json"
    checkpoint = newest_checkpoint(run_dir)

    def record() -> Optional[dict]:
        if not kept.is_file():
            return None
        records = json.loads(kept.read_text())["records"]
        return next(
            (r for r in records if Path(r["checkpoint"]).name == checkpoint.name), None
        )

    if record() is None:
        args = [python, str(relative(SOURCE_CHECK)), str(relative(run_dir))]
        args += ["--out", str(relative(kept)), "--threads", str(budget["threads"])]
        code, out, err = child.capture(args, budget["threads"])
        if code != 0:
            raise RuntimeError(f"the source check failed: {last_line(err or out)}")
    found = record()
    if found is None:
        raise RuntimeError(f"the source check did not measure {checkpoint}")
    return {"source_gap": found["gap"]}


def test_hypotheses(results: dict, run_dir: Path) -> dict:
    """Where a row's test translations (beam 4, as its test BLEU scored them) lie and
    their SHA-256, from its results.json: {} for a run that did not keep them."""
    name, sha = results.get("hypotheses"), results.get("hypotheses_sha256")
    path = run_dir / name if name else None
    if path is None or not path.is_file() or sha256_of(path) != sha:
        return {}
    return {"test_hypotheses": str(relative(path)), "test_hypotheses_sha256": sha}


def collect(row: dict, run_dir: Path, budget: dict, python: str, child) -> dict:
    """One finished row of Table 3 (§6.2) from the files its run wrote: validation
    perplexity (and its curve) and BLEU, test BLEU (beam 4 and greedy), parameters,
    time, and what it ran with (the provenance the file's budget is checked on)."""
    results = json.loads((run_dir / "results.json").read_text())
    curve = valid_curve(run_dir / "metrics.jsonl")
    checkpoint = newest_checkpoint(run_dir)
    config = results.get("config", {})
    asked = {k: budget[k] for k in BUDGET_CHECKED if k in budget}
    differ = differences({**asked, **row["base"], **row["fields"]}, config)
    scored = valid_bleu(python, run_dir, budget, child)
    reads = source_check(python, run_dir, budget, child)
    return {
        "status": "done",
        "params": count_parameters(checkpoint) if checkpoint else None,
        "valid_ppl": curve[-1]["valid_ppl"] if curve else None,
        "valid_bleu": scored["valid_bleu"],
        **reads,
        "bleu": results.get("bleu"),
        "bleu_greedy": results.get("bleu_greedy"),
        "bleu_kind": results.get("bleu_kind"),
        "test_sentences": results.get("test_sentences"),
        "train_minutes": results.get("train_minutes"),
        "total_minutes": results.get("total_minutes"),
        "provenance": {
            "updates": results.get("steps"),
            "warmup": config.get("warmup"),
            "lr_factor": config.get("lr_factor"),
            "batch_tokens": config.get("batch_tokens"),
            "epochs": config.get("epochs"),
            "seed": config.get("seed"),
            "precision": results.get("precision"),
            "attention": results.get("attention"),
            "threads": budget["threads"],
            "device": results.get("device"),
            "device_name": results.get("machine") or "unknown",
            "commit": row.get("commit"),
            "valid_bleu_command": scored["command"],
            **{
                k: scored[k] for k in ("hypotheses", "hypotheses_sha256") if k in scored
            },
            **test_hypotheses(results, run_dir),
        },
        "curve": curve,
        **({"settings_differ": differ} if differ else {}),
    }


def child_env(threads: int) -> dict:
    """The environment of a row's processes: ``threads`` threads for PyTorch's CPU
    kernels, the same for every row of Table 3 (§6.2), and glibc's settings for
    reusing freed memory (those `make` sets) where the caller set none of its own."""
    from machinery.devices import GLIBC_MALLOC_SETTINGS

    env = {**GLIBC_MALLOC_SETTINGS, **os.environ}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    return env


# Started in front of a row's process where an engine runs the row in a process of
# its own (a Ray worker, a SLURM job): the kernel sends the process
# ``parent_death`` when the thread that started it ends (Linux's PR_SET_PDEATHSIG;
# it survives the exec), so a killed worker leaves no training running into the
# run directory that a retry of the row resumes from. It runs after the exec of a
# fresh interpreter, not between fork and exec, where a process with threads may
# not call into ctypes.
PARENT_DEATH = """\
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2]))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before the call
    os._exit(128 + int(sys.argv[2]))
os.execvp(sys.argv[3], sys.argv[3:])
"""


class Child:
    """The processes of one Table 3 (§6.2) row, one at a time. ``stop(signum)``
    hands a signal on to the one running (the program saves a checkpoint after the
    update in progress and exits) and marks the row stopped; the engine that runs the
    row calls it, from whichever thread or handler it has. With ``parent_death``
    (Linux), each process gets that signal when the thread that started it ends."""

    def __init__(self, parent_death: Optional[int] = None):
        self.proc: Optional[subprocess.Popen] = None
        self.stopped: Optional[int] = None
        self.parent_death = parent_death if sys.platform == "linux" else None
        self.read_at = 0  # how far the stderr file has been passed on

    def launch(self, args: list[str]) -> list[str]:
        """``args`` as started: behind the parent-death launcher where one is set."""
        if self.parent_death is None:
            return args
        death = [str(os.getpid()), str(int(self.parent_death))]
        return [args[0], "-c", PARENT_DEATH, *death, *args]

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Hand ``signum`` on to the running process (SIGHUP as SIGTERM) and mark
        the row stopped; later processes of the row are not started."""
        self.stopped = signum
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def wait_stopped(self, timeout: float = 120.0) -> None:
        """Wait for the stopped process to save its checkpoint and exit (SIGKILL
        after ``timeout`` seconds)."""
        proc = self.proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()

    def run(self, args: list[str], threads: int) -> tuple[int, str]:
        """Run ``args`` to its end, output passed on: (exit status, stderr tail).
        With ``parent_death`` its stderr goes to an unlinked file that this process
        follows, not to a pipe: a process whose parent died writes on (a pipe
        without a reader would end it before it saves its checkpoint)."""
        if self.stopped is not None:
            return -self.stopped, ""
        with tempfile.TemporaryFile() as log:
            self.proc = subprocess.Popen(
                self.launch(args),
                cwd=ROOT,
                stderr=subprocess.PIPE if self.parent_death is None else log,
                start_new_session=True,
                env=child_env(threads),
            )
            tail, self.read_at = b"", 0
            try:
                while chunk := self._read(log):
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()
                    tail = (tail + chunk)[-8192:]
            except KeyboardInterrupt:  # a Ray task cancelled, or Ctrl-C in a job
                self.stop(signal.SIGINT)
                self.wait_stopped()
            code = self.proc.wait()
        self.proc = None
        return code, tail.decode("utf-8", "replace")

    def _read(self, log) -> bytes:
        """The running process's next stderr output; empty once it has ended."""
        if self.parent_death is None:
            return os.read(self.proc.stderr.fileno(), 65536)
        while True:  # pread: the process moves the file's offset, not this reader
            ended = self.proc.poll() is not None
            if chunk := os.pread(log.fileno(), 65536, self.read_at):
                self.read_at += len(chunk)
                return chunk
            if ended:
                return b""
            time.sleep(0.2)

    def capture(self, args: list[str], threads: int) -> tuple[int, str, str]:
        """Run ``args`` to its end: (exit status, stdout, stderr)."""
        if self.stopped is not None:
            return -self.stopped, "", ""
        self.proc = subprocess.Popen(
            self.launch(args),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=child_env(threads),
            text=True,
        )
        out, err = self.proc.communicate()
        code, self.proc = self.proc.returncode, None
        return code, out, err


def rejected(stderr: str, fields: dict) -> Optional[str]:
    """The program's one-line refusal of one of ``fields`` (an unknown option or a
    setting it rules out), or None — a Table 3 (§6.2) row this version cannot run."""
    for line in reversed(stderr.replace("\r", "\n").splitlines()):
        if ": error:" in line:
            if any(re.search(rf"(--)?\b{re.escape(k)}\b", line) for k in fields):
                return line.strip()
            return None
    return None


def last_line(stderr: str) -> str:
    """The last non-empty line a failed run printed (its one-line error)."""
    lines = [s.strip() for s in stderr.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1] if lines else "(no message)"


def log(message: str) -> None:
    """One line of this script's own progress, timestamped, to stdout."""
    print(f"[table3 {time.strftime('%H:%M:%S')}] {message}", flush=True)


def signal_name(code: int) -> Optional[str]:
    """The signal that ended a process with exit status ``code`` (a negative status,
    or the shell's 128 + n for the program's own exit after SIGINT or SIGTERM), or
    None where it exited on its own."""
    number = -code if code < 0 else code - 128 if code in (130, 143) else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def where(engine: str) -> dict:
    """Where a row ran: the host's name, and the engine's own name for the place
    (Ray's node id, SLURM's job id, the local pool's process id)."""
    place = {"engine": engine, "host": socket.gethostname()}
    if engine == "ray":
        import ray

        place["node"] = ray.get_runtime_context().get_node_id()
    elif engine == "slurm":
        place["job"] = os.environ.get("SLURM_JOB_ID") or _submitit_job()
    else:
        place["process"] = os.getpid()
    return place


def _submitit_job() -> Optional[str]:
    """The job id submitit gives a job it runs (its local executor sets no SLURM
    variables)."""
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except Exception:  # not inside a submitit job
        return None


@dataclasses.dataclass(eq=False)
class RowJob:
    """One unit of Table 3 (§6.2) work for an engine: train row ``record["name"]``
    with ``train`` (the program's argument list) in ``run_dir`` on ``threads``
    threads and return its record (``kind`` "row"); or (``kind`` "check") train
    only its first epoch again, to compare the epoch-1 validation perplexity with
    the one recorded. Picklable: Ray and submitit send it to other machines."""

    kind: str
    record: dict
    run_dir: str
    train: list
    threads: int
    python: str
    budget: dict
    started: dict
    overrides: dict
    engine: str = "local"

    def __post_init__(self):
        self.child = Child()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "child"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.child = Child()

    @property
    def name(self) -> str:
        return self.record["name"]

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the row: its running process saves a checkpoint and exits."""
        self.child.stop(signum)

    def checkpoint(self, *args, **kwargs):
        """submitit's hook for a time limit or a preemption: the training process
        saves its checkpoint (the signal it already stops on), and the job is
        submitted again, to resume from it."""
        import submitit

        self.stop(signal.SIGTERM)
        self.child.wait_stopped()
        self.child = Child()
        return submitit.helpers.DelayedSubmission(self)

    def __call__(self) -> dict:
        """Run the row here and return its record, with where it ran."""
        os.chdir(ROOT)
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        if self.engine != "local":  # a process of its own, which may be killed
            self.child.parent_death = Child(signal.SIGTERM).parent_death
        t0 = time.time()
        with LoadWatch() as load:
            out = self._run()
        out["ran_on"] = where(self.engine)
        if out.get("status") == "done" or self.kind == "check":
            out["row_wall_minutes"] = (time.time() - t0) / 60
            out |= load.record()
        return out

    def _run(self) -> dict:
        run_dir = Path(self.run_dir)
        record = dict(self.record)
        saved = saved_settings(run_dir) if run_dir.is_dir() else None
        differ = differences(self.record["passed"], saved) if saved else {}
        if differ:
            what = "; ".join(
                f"{k}: {v['ran']!r} there, {v['asked']!r} now"
                for k, v in differ.items()
            )
            return record | {
                "status": "failed",
                "error": f"{run_dir} holds a run with other settings ({what}); "
                "move it away to train this row",
            }
        finished = saved is not None and (run_dir / "results.json").is_file()
        if not finished:
            wait_for_run_dir(run_dir)
            if (found := newest_checkpoint(run_dir)) is not None:
                record["resumed"] = (
                    "continued from the checkpoints in its run directory: "
                    "train_minutes counts the last stretch only"
                )
                record["resumed_step"] = checkpoint_step(found)
            code, stderr = self.child.run(self.train, self.threads)
            killed = signal_name(code)
            if self.child.stopped is not None or killed:
                by = signal_name(-self.child.stopped) if self.child.stopped else killed
                return record | {"status": "interrupted", "signal": by}
            refusal = rejected(stderr, self.overrides) if code == 2 else None
            if refusal:
                return record | {"status": UNSUPPORTED, "error": refusal}
            if code != 0 or not (run_dir / "results.json").is_file():
                return record | {
                    "status": "failed",
                    "exit_status": code,
                    "error": last_line(stderr),
                }
        if self.kind == "check":
            curve = valid_curve(run_dir / "metrics.jsonl")
            return record | {"status": "checked", "epoch1_ppl": curve[0]["valid_ppl"]}
        budget = self.budget | {"threads": self.threads}
        try:
            return record | collect(
                self.started, run_dir, budget, self.python, self.child
            )
        except RuntimeError as e:  # its scoring failed: the training is kept
            if self.child.stopped is not None:
                return record | {"status": "interrupted", "signal": "SIGTERM"}
            return record | {"status": "failed", "error": str(e)}


class LoadWatch:
    """While a row runs, the 1-minute load average every ``every`` seconds: the load
    its minutes were measured under, which other rows and any other work add to."""

    def __init__(self, every: float = 30.0):
        self.every, self.loads = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while True:
            self.loads.append(os.getloadavg()[0])
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "LoadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        """``load_average``: the mean of the load averages seen."""
        return {"load_average": round(sum(self.loads) / max(len(self.loads), 1), 2)}

"""Part 4's runs in plain sight: train here, resume, or load a finished run (our
addition).

`run_or_load` is what every training cell of Part 4 calls. It says in one line what it
did and where: it loaded a finished run in the run directory whose recipe is the one
asked for, loaded a run's recorded summary from ``results/`` where no run directory is
here, resumed a run from its checkpoints, or trained here. It never deletes anything.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from .config import Config, weight_fields
from .runfiles import checkpoint_paths

# What a run trains, beyond the model's shape: the data, the schedule and the
# regularization. Precision, attention path, device, checkpoints and decoding settings
# decide how it runs or is scored, not what it learns.
RECIPE_FIELDS = (
    "dataset",
    "vocab",
    "bpe_size",
    "min_freq",
    "max_tokens",
    "batch_tokens",
    "warmup",
    "lr_factor",
    "betas",
    "adam_eps",
    "weight_decay",
    "eps_ls",
    "accum_steps",
    "clip_grad",
    "epochs",
    "max_steps",
    "seed",
    "P_drop",
    "ffn_dropout",
    "attn_dropout",
)


def recipe_differences(saved: dict, cfg: Config) -> list[str]:
    """The fields of the recipe ``cfg`` asks for that a run's saved config (its
    ``results.json`` ``config``) does not share, as "name: saved → asked"."""
    asked = dataclasses.asdict(cfg)
    out = []
    for name in (*weight_fields(), *RECIPE_FIELDS):
        if name not in saved:
            continue
        was, now = saved[name], asked[name]
        if isinstance(now, tuple):
            was = tuple(was)
        if was != now:
            out.append(f"{name}: {was!r} → {now!r}")
    return out


def machine_name(device) -> str:
    """The chip a run trained on, as a reader would name it: the GPU's name, else the
    CPU's model name from /proc/cpuinfo (with its family and model number, since one
    name covers several chips), else the platform's word for it."""
    import platform

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU"
    info = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    detail = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if k in info)
    return f"{name} ({detail})" if detail else name


def machine_of(summary: dict) -> str:
    """The machine a run's summary names: ``machine``, or the ``cpu`` line older
    summaries carry; "" where it names none."""
    return summary.get("machine") or summary.get("cpu") or ""


def _on(summary: dict) -> str:
    """The " on <machine>" ending a log line, where the summary names its machine."""
    return f" on {machine_of(summary)}" if machine_of(summary) else ""


def _quiet(*args, **kwargs) -> None:
    """A log that keeps the training run's own lines out of the notebook's outputs."""


def run_or_load(
    cfg: Config,
    recorded: Optional[str] = None,
    log: Callable = print,
    train_log: Callable = _quiet,
) -> dict:
    """The summary of a run of ``cfg`` (as ``machinery.train`` returns it), made or
    found in plain sight:

    1. a finished run of the same recipe in ``cfg.run_dir`` is loaded;
    2. else, where ``cfg.run_dir`` holds no checkpoint and ``recorded`` (a
       ``results/*.json`` summary) exists, that summary is loaded;
    3. else the run is resumed from its checkpoints, or trained from the start.

    One line through ``log`` says which, and where. Nothing is deleted.
    """
    where = Path(cfg.run_dir)
    results = where / "results.json"
    summary = json.loads(results.read_text()) if results.is_file() else None
    if summary is not None and not recipe_differences(summary.get("config", {}), cfg):
        log(
            f"loaded the finished run in {where}: {summary['steps']:,} updates, "
            f"trained in {summary['train_minutes']:.0f} min{_on(summary)}"
        )
        summary |= {"run_dir": str(where), "curve": str(where / "curve.png")}
        return summary
    checkpoints = checkpoint_paths(Path(cfg.run_dir))
    if recorded is not None and not checkpoints and Path(recorded).is_file():
        summary = json.loads(Path(recorded).read_text())
        log(
            f"loaded the recorded summary {recorded} ({summary['steps']:,} updates, "
            f"trained in {summary['train_minutes']:.0f} min{_on(summary)}); no run "
            "directory here"
        )
        recorded = Path(recorded)
        summary["curve"] = str(recorded.with_name(f"{recorded.stem}-curve.png"))
        return summary
    if checkpoints:
        log(f"resuming the run in {cfg.run_dir} from {checkpoints[-1].name}")
    else:
        log(f"training here, into {cfg.run_dir}")
    from .training import train  # the production loop (it imports this package)

    summary = train(cfg, log=train_log, progress=False)
    log(
        f"trained {summary['steps']:,} updates in {summary['train_minutes']:.1f} min "
        f"on {machine_of(summary) or summary['device']}"
    )
    return summary


# The paper's rows of the Results table (Table 2 and §5.2): BLEU on newstest2014.
PAPER_RESULTS = (
    ("the paper, base", "WMT 2014 EN→DE newstest2014", "65M", "8 P100 GPUs", "12 h",
     "27.3"),
    ("the paper, big", "the same", "213M", "8 P100 GPUs", "3.5 days", "28.4"),
)  # fmt: skip


def results_table(ours: Sequence[tuple]) -> str:
    """The Results table as Markdown: the paper's base and big models, then ``ours``,
    rows of (preset, data, parameters, run summary with ``bleu``), each with the
    minutes and machine its summary recorded (our addition)."""
    lines = [
        "| run | data | parameters | hardware | training | BLEU |",
        "|---|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in PAPER_RESULTS),
    ]
    for name, data, params, run in ours:
        machine = machine_of(run) or f"{run.get('device', '?')} (machine not recorded)"
        lines.append(
            f"| `{name}` | {data} | {params:,} | {machine} "
            f"| {run['train_minutes']:.0f} min | {run['bleu']:.1f} |"
        )
    return "\n".join(lines)

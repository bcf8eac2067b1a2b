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
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

from .config import Config, weight_fields
from .devices import NAMES, cpu_name
from .runfiles import CheckpointError, RunDirectoryError, checkpoint_paths, first_line

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
    CPU's (:func:`machinery.devices.cpu_name`, the one reader of it)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def machine_of(summary: dict) -> str:
    """The machine a run's summary names: ``machine``, or the ``cpu`` line older
    summaries carry; "" where it names none."""
    return summary.get("machine") or summary.get("cpu") or ""


def path_taken(summary: dict) -> str:
    """What a run's last digits hang on besides its recipe, as its summary records it:
    the precision and attention path it trained with (``auto`` picks them by timing,
    run by run) and, on a CPU, its thread count (float sums split over threads round
    otherwise; a resumed run records its last stretch's), named as the training log
    names them; "" where the summary records none of them (our addition)."""
    precision = summary.get("precision") or ""
    parts = [NAMES.get(precision, precision)]
    if summary.get("attention"):
        parts.append(f"{summary['attention']} attention")
    if summary.get("threads"):
        count = summary["threads"]
        parts.append(f"{count} thread{'' if count == 1 else 's'}")
    return ", ".join(part for part in parts if part)


def _on(summary: dict) -> str:
    """The " on <machine>, <path taken>" ending a log line, as far as the summary
    names them (the machine: else its device, where it names one)."""
    machine = machine_of(summary) or summary.get("device") or ""
    on = f" on {machine}" if machine else ""
    taken = path_taken(summary)
    return f"{on}, {taken}" if taken else on


def _quiet(*args, **kwargs) -> None:
    """A log that keeps the training run's own lines out of the notebook's outputs."""


# What a summary must hold before it stands for a run of ``cfg``: the whole recipe (a
# missing field is not a matching one), the same scoring (the whole test split, the
# same beam, the same averaging), a positive number of updates and finite scores. A
# summary that fails is set aside with one line saying what differs.
SCORING_FIELDS = (
    "max_eval_sentences",
    "beam_size",
    "length_penalty_alpha",
    "average_last",
    "max_decode_extra",
)


def summary_problem(
    summary, cfg: Config, sentences: Optional[int] = None
) -> Optional[str]:
    """Why ``summary`` (a ``results.json`` or a recorded summary) does not stand for a
    finished run of ``cfg``, in a few words; None when it does. ``sentences``: the
    number of test sentences a run of ``cfg`` scores, where known (from another
    summary of the recipe)."""
    if not isinstance(summary, dict):
        return "it is not a run summary"
    saved = summary.get("config")
    if not isinstance(saved, dict) or not saved:
        return "it has no config"
    # a field a summary lacks was added since, and took its default then
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    lacks = [
        n
        for n in (*weight_fields(), *RECIPE_FIELDS)
        if n not in saved and getattr(cfg, n) != defaults.get(n)
    ]
    if lacks:
        return f"its config lacks {', '.join(lacks[:3])}{' …' * (len(lacks) > 3)}"
    if differ := recipe_differences(saved, cfg):
        return f"another recipe ({', '.join(differ[:3])}{' …' * (len(differ) > 3)})"
    asked = dataclasses.asdict(cfg)
    if differ := [n for n in SCORING_FIELDS if n in saved and saved[n] != asked[n]]:
        said = ", ".join(f"{n}: {saved[n]!r} → {asked[n]!r}" for n in differ[:3])
        return f"scored otherwise ({said})"
    steps, minutes = summary.get("steps"), summary.get("train_minutes")
    if not (isinstance(steps, int) and steps > 0):
        return f"its steps are {steps!r}, not a number of updates"
    if not (isinstance(minutes, (int, float)) and math.isfinite(minutes)):
        return f"its train_minutes are {minutes!r}"
    for key in ("bleu", "bleu_greedy"):
        value = summary.get(key)
        if not (isinstance(value, (int, float)) and 0 <= value <= 100):
            return f"its {key} is {value!r}, not a score from 0 to 100"
    n, limit = summary.get("test_sentences"), cfg.max_eval_sentences
    if not (isinstance(n, int) and n > 0):
        return f"its test_sentences are {n!r}"
    if (sentences and n != sentences) or (limit and n > limit):
        return f"scored on {n:,} test sentences, not {sentences or limit:,}"
    return None


def read_summary(path: Path) -> tuple[Optional[dict], str]:
    """(the JSON in ``path``, "") or (None, why it cannot be read)."""
    try:
        return json.loads(Path(path).read_text("utf-8")), ""
    except (OSError, ValueError) as e:
        return None, f"it cannot be read ({first_line(e)})"


def shown(path) -> str:
    """``path`` as a reader would type it: relative to the working directory where it
    lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def shipped_summary(folder: Path, cfg: Config, recorded=None) -> tuple[dict, str]:
    """(a summary of the shipped model in ``folder``, as run_or_load returns it, or
    {}, why it is set aside; "" when it is not of this recipe or not there)."""
    from .export import check_folder, read_meta, score_line

    if not (Path(folder) / "model.json").is_file():
        return {}, ""
    try:
        saved = read_meta(folder).get("config")
        if (
            not isinstance(saved, dict)
            or recipe_differences(saved, cfg)
            or any(n not in saved for n in (*weight_fields(), *RECIPE_FIELDS))
        ):
            return {}, ""  # a model of another recipe: not a stand-in for this one
        meta = check_folder(folder)  # the weights and BPE model too
    except CheckpointError as e:
        return {}, first_line(e)
    source, score = meta.get("source", {}), meta.get("score", {})
    summary = {**source, "config": saved, "model": shown(folder)}
    if score:  # the file's own score, as `evaluate` measures it
        summary |= {
            "bleu": score["bleu"],
            "bleu_greedy": score["greedy"]["bleu"],
            "bleu_kind": score["bleu_kind"],
            "test_sentences": score["sentences"],
        }
    if problem := summary_problem(summary, cfg):
        return {}, problem
    if recorded is not None:
        recorded = Path(recorded)
        summary["curve"] = str(recorded.with_name(f"{recorded.stem}-curve.png"))
    summary["said"] = score_line(meta)
    return summary, ""


def run_or_load(
    cfg: Config,
    recorded: Optional[str] = None,
    log: Callable = print,
    train_log: Callable = _quiet,
    shipped: Optional[Path] = None,
) -> dict:
    """The summary of a run of ``cfg`` (as ``machinery.train`` returns it), made or
    found in plain sight, from the first of:

    1. a finished run of the same recipe in ``cfg.run_dir``;
    2. where ``cfg.run_dir`` holds no checkpoint of this recipe: the model folder
       ``shipped`` (default: the repository's, ``models/multi30k-small``) where it was
       exported from a run of this recipe; its summary names it as ``model``;
    3. there too: ``recorded`` (a ``results/*.json`` summary) of this recipe;
    4. the run resumed from its checkpoints, or trained from the start.

    One line through ``log`` says which, and where; a source that does not match (a
    summary of another recipe or scored otherwise, a torn file, a damaged model, the
    checkpoints of another run) is set aside with one line saying what differs.
    Nothing is deleted.
    """
    from .export import SHIPPED

    where = Path(cfg.run_dir)
    recorded_summary, sentences = None, None
    if recorded is not None and Path(recorded).is_file():
        recorded_summary, why = read_summary(Path(recorded))
        why = why or summary_problem(recorded_summary, cfg)
        if why:
            log(f"set aside the recorded summary {recorded}: {why}")
            recorded_summary = None
        else:
            sentences = recorded_summary["test_sentences"]
    results = where / "results.json"
    if results.is_file():
        summary, why = read_summary(results)
        why = why or summary_problem(summary, cfg, sentences)
        if not why:
            log(
                f"loaded the finished run in {where}: {summary['steps']:,} updates, "
                f"trained in {summary['train_minutes']:.0f} min{_on(summary)}"
            )
            summary |= {"run_dir": str(where), "curve": str(where / "curve.png")}
            return summary
        log(f"set aside {results}: {why}")
    checkpoints = checkpoint_paths(where)
    if checkpoints and (why := checkpoint_problem(checkpoints[-1], cfg)):
        log(f"set aside the checkpoints in {where}: {why}")
        checkpoints = []
        foreign = True
    else:
        foreign = False
    if not checkpoints:
        folder = shown(shipped if shipped is not None else SHIPPED)
        summary, why = shipped_summary(folder, cfg, recorded)
        if why:
            log(f"set aside the model {folder}: {why}")
        elif summary:
            log(f"loaded the model {folder} ({summary.pop('said')}); no run here")
            return summary
        if recorded_summary is not None:
            log(
                f"loaded the recorded summary {recorded} "
                f"({recorded_summary['steps']:,} updates, trained in "
                f"{recorded_summary['train_minutes']:.0f} min{_on(recorded_summary)}); "
                "no run directory here"
            )
            recorded = Path(recorded)
            curve = recorded.with_name(f"{recorded.stem}-curve.png")
            return recorded_summary | {"curve": str(curve)}
    if foreign:
        raise RunDirectoryError(
            f"{where} holds the checkpoints of another run, and nothing else stands "
            "in for this one: give another run_dir"
        )
    if checkpoints:
        log(f"resuming the run in {cfg.run_dir} from {checkpoints[-1].name}")
    else:
        log(f"training here, into {cfg.run_dir}")
    from .training import train  # the production loop (it imports this package)

    summary = train(cfg, log=train_log, progress=False)
    log(
        f"trained {summary['steps']:,} updates in {summary['train_minutes']:.1f} min"
        + _on(summary)
    )
    return summary


def checkpoint_problem(path: Path, cfg: Config) -> Optional[str]:
    """Why the run whose newest checkpoint is ``path`` cannot be resumed as a run of
    ``cfg`` (it cannot be read, or it is of another recipe); None when it can."""
    from .runfiles import load_checkpoint

    try:
        saved = load_checkpoint(path)["config"]
    except CheckpointError as e:
        return first_line(e)
    if differ := recipe_differences(saved, cfg):
        return f"{path.name} is of another recipe ({', '.join(differ[:3])})"
    return None


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


# Part 4 decodes with the model a summary stands for: the run directory's last
# checkpoints averaged as the run averaged them, or the shipped model folder; a
# recorded summary has no weights.


@dataclasses.dataclass
class Trained:
    """A trained model ready to decode (§6.1) and where its weights came from."""

    model: object
    cfg: Config
    src_vocab: object
    tgt_vocab: object
    subwords: object
    where: str


def trained_model(summary: dict) -> Optional[Trained]:
    """The model ``summary`` (from :func:`run_or_load`) was scored with, or None where
    only a recorded summary is here."""
    from .export import load_model
    from .inference import load_for_inference

    if summary.get("model"):
        model, cfg, src, tgt, subwords, _ = load_model(Path(summary["model"]))
        return Trained(model, cfg, src, tgt, subwords, f"the model {summary['model']}")
    run_dir = Path(summary.get("run_dir") or "")
    average = max(int(summary["config"].get("average_last") or 1), 1)
    paths = checkpoint_paths(run_dir)[-average:] if summary.get("run_dir") else []
    if not paths:
        return None
    model, cfg, src, tgt, subwords = load_for_inference(
        run_dir=run_dir, average_last=average
    )
    names = ", ".join(p.name for p in paths)
    return Trained(model, cfg, src, tgt, subwords, f"{names} in {run_dir}")


def live_examples(
    trained: Optional[Trained], data, recorded: Sequence[dict] = (), n: int = 3
) -> str:
    """The first ``n`` test sentences of ``data`` translated now by ``trained``: the
    source, the beam search output (§6.1), the greedy one and the reference, as text;
    without a model, the ``recorded`` examples of its summary."""
    from .inference import translate_lines

    if trained is None:
        return "\n".join(
            f"  {e['source']}\n→ {e['output']}\n  ({e['reference']})"
            for e in recorded[:n]
        )
    pieces = [data.src_vocab.lookup_tokens(s[1:-1]) for s, _ in data.splits["test"]]
    sources = (
        data.subwords.decode(pieces[:n])
        if data.subwords
        else [" ".join(p) for p in pieces[:n]]
    )
    t = trained
    beam, greedy = (
        translate_lines(
            sources, t.model, t.cfg, t.src_vocab, t.tgt_vocab, t.subwords, "cpu", k, a
        )[0]
        for k, a in ((t.cfg.beam_size, t.cfg.length_penalty_alpha), (1, 0.0))
    )
    return "\n".join(
        f"  {s}\n→ {b} (beam {t.cfg.beam_size})\n→ {g} (greedy)\n  ({r})"
        for s, b, g, r in zip(sources, beam, greedy, data.test_refs)
    )

"""The inference file: a trained model as a folder a reader can download and decode
with, with no pickle in it (our addition; the paper publishes no model).

`export_model` writes a run's weights — the average of its last checkpoints, as
`evaluate` averages them (§6.1 averages the last 5) — as ``model.safetensors``, the BPE
model as ``bpe.model`` (sentencepiece's own format), and ``model.json``: the config and
the model's sizes, the vocabularies, the decoding defaults, the run's score, commit and
machine, and the size and SHA-256 of each file. `load_model` checks every size and
digest before it reads a byte of weights, checks the tensors against the config, and
rebuilds the model; a folder that is damaged or does not match is one line
(`CheckpointError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .config import Config
from .devices import resolve_attention
from .runfiles import CheckpointError, first_line, write_atomic

if TYPE_CHECKING:
    from the_annotated_transformer import EncoderDecoder, Subwords, Vocab

FORMAT = "annotated-transformer-model/1"
WEIGHTS, BPE, META = "model.safetensors", "bpe.model", "model.json"
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The model the repository ships: `multi30k-small`, exported from the run the README
# reports. `translate` and `evaluate` use it when no run is named.
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "multi30k-small"


def model_sizes(cfg, src_vocab, tgt_vocab) -> dict:
    """The sizes a model folder records and its loader checks: N, d_model, d_ff, h
    (§3) and both vocabularies."""
    return {
        "N": cfg.N,
        "d_model": cfg.d_model,
        "d_ff": cfg.d_ff,
        "h": cfg.h,
        "src_vocab": len(src_vocab),
        "tgt_vocab": len(tgt_vocab),
    }


def sha256_of(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex."""
    return hashlib.sha256(data).hexdigest()


def meta_digest(meta: dict) -> str:
    """The SHA-256 of ``model.json``'s content (everything but this digest), written
    canonically, so that a changed value, not only a changed file, is caught."""
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    return sha256_of(json.dumps(rest, sort_keys=True, ensure_ascii=False).encode())


def git_commit(folder: Path) -> str:
    """The commit checked out in ``folder`` (``-dirty`` when files differ from it);
    "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def stored_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """The tensors an inference file stores: each parameter once (§3.4's shared
    embedding and output matrix is one tensor under several names), in ``dtype``; the
    positional encodings are not stored, since `make_model` computes them again."""
    return {
        name: p.detach().to(dtype).contiguous()
        for name, p in model.named_parameters()  # a shared parameter: its first name
    }


def export_model(
    out_dir: Path,
    model: EncoderDecoder,
    cfg: Config,
    src_vocab: Vocab,
    tgt_vocab: Vocab,
    subwords: Optional[Subwords],
    source: dict,
    storage: str = "float32",
) -> dict:
    """Write the inference file of ``model`` into ``out_dir`` and return its
    ``model.json`` content.

    ``source`` says where the weights came from: ``checkpoints`` (the names averaged),
    and from the run's ``results.json`` its score, steps, minutes and machine.
    ``storage`` is "float32" (the weights as trained) or "bfloat16" (half the size;
    decoding casts them back to float32).
    """
    from safetensors.torch import save

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(model, STORAGE[storage])
    blobs = {WEIGHTS: save(tensors, metadata={"format": FORMAT})}
    if subwords is not None:
        blobs[BPE] = subwords.model_proto
    elif (out_dir / BPE).exists():  # a stale one from an earlier export
        (out_dir / BPE).unlink()
    vocab = {"src": src_vocab.itos, "tgt": tgt_vocab.itos}
    meta = {
        "format": FORMAT,
        "config": dataclasses.asdict(cfg),
        "sizes": model_sizes(cfg, src_vocab, tgt_vocab)
        | {"parameters": sum(t.numel() for t in tensors.values())},
        "storage": storage,
        "tied": {
            name: first
            for name, first in tied_names(model).items()
            if name not in tensors
        },
        "vocab": vocab,
        "decoding": {
            "beam_size": cfg.beam_size,
            "length_penalty_alpha": cfg.length_penalty_alpha,
            "max_decode_extra": cfg.max_decode_extra,
        },
        "source": source,
        "files": {
            name: {"bytes": len(data), "sha256": sha256_of(data)}
            for name, data in blobs.items()
        },
    }
    meta["vocab_sha256"] = sha256_of(
        json.dumps(vocab, ensure_ascii=False, sort_keys=True).encode()
    )
    for name, data in blobs.items():
        write_atomic(out_dir / name, data)
    write_meta(out_dir, meta)
    return meta


def write_meta(out_dir: Path, meta: dict) -> None:
    """Write ``model.json`` with its own digest (after a score was added to it, too)."""
    meta = {**meta, "sha256": meta_digest(meta)}
    text = json.dumps(meta, indent=1, ensure_ascii=False) + "\n"
    write_atomic(Path(out_dir) / META, text.encode())


def tied_names(model: torch.nn.Module) -> dict:
    """Every parameter name of ``model`` → the first name of the same parameter
    (§3.4's weight sharing makes several names one tensor)."""
    first: dict = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def read_meta(folder: Path) -> dict:
    """``model.json`` of an inference file, its own digest checked."""
    path = Path(folder) / META
    if not Path(folder).is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder} holds no {META}: not a model folder") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} cannot be read ({first_line(e)}): the file is damaged"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a model file written by this program")
    if meta.get("sha256") != meta_digest(meta):
        raise CheckpointError(
            f"{path} does not match the SHA-256 written in it: the file was changed "
            "or damaged"
        )
    return meta


def read_part(folder: Path, name: str, meta: dict) -> bytes:
    """The bytes of one file of an inference file, its size and SHA-256 checked."""
    want = meta["files"][name]
    path = Path(folder) / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(
            f"{path} cannot be read ({e.strerror or first_line(e)})"
        ) from None
    if len(data) != want["bytes"]:
        raise CheckpointError(
            f"{path} holds {len(data):,} bytes, {META} says {want['bytes']:,}: the "
            "file is damaged or from another model"
        )
    if sha256_of(data) != want["sha256"]:
        raise CheckpointError(
            f"{path} does not match its SHA-256 in {META}: the file is damaged or "
            "from another model"
        )
    return data


def check_folder(folder: Path) -> dict:
    """``model.json`` of an inference file whose every part has the size and SHA-256
    written in it (without building the model)."""
    meta = read_meta(folder)
    for name in meta["files"]:
        read_part(folder, name, meta)
    return meta


def load_model(
    folder: Path, device="cpu"
) -> tuple[EncoderDecoder, Config, Vocab, Vocab, Optional[Subwords], dict]:
    """(model in eval mode, config, source vocab, target vocab, BPE model or None,
    ``model.json``) from an inference file, every part checked first."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from .inference import config_from_dict
    from .parts import notebook

    nb = notebook()
    meta = read_meta(folder)
    try:
        cfg = config_from_dict(meta["config"])
        weights = load(read_part(folder, WEIGHTS, meta))
        src_vocab, tgt_vocab = (nb.Vocab(meta["vocab"][k]) for k in ("src", "tgt"))
        vocab = {"src": src_vocab.itos, "tgt": tgt_vocab.itos}
        if meta["vocab_sha256"] != sha256_of(
            json.dumps(vocab, ensure_ascii=False, sort_keys=True).encode()
        ):
            raise CheckpointError(f"the vocabulary in {folder}/{META} is damaged")
        subwords = None
        if BPE in meta["files"]:
            subwords = nb.Subwords(read_part(folder, BPE, meta))
            if subwords.vocab.itos != src_vocab.itos:
                raise CheckpointError(
                    f"{folder}/{BPE} has {len(subwords.vocab):,} pieces but the "
                    f"vocabulary {len(src_vocab):,}: they are of different models"
                )
        sizes = meta["sizes"]
        built = model_sizes(cfg, src_vocab, tgt_vocab)
        if differ := [k for k in built if sizes.get(k) != built[k]]:
            raise CheckpointError(
                f"{folder}/{META}: the sizes ({', '.join(differ)}) disagree with its "
                "config and vocabulary"
            )
        # the path for the device decoding runs on (the weights are the same for both)
        attention = resolve_attention("auto", torch.device(device))[0]
        model = nb.make_model(len(src_vocab), len(tgt_vocab), cfg, attention=attention)
        check_tensors(weights, model, folder)
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(
            f"{folder} does not hold a model this program can build "
            f"({type(e).__name__}: {first_line(e)})"
        ) from None
    return model.to(device).eval(), cfg, src_vocab, tgt_vocab, subwords, meta


def check_tensors(weights: dict, model: torch.nn.Module, folder) -> None:
    """Refuse, in one line, weights that are not exactly the model's parameters (each
    once, of the model's shape) or that hold NaN or infinite values."""
    want = stored_tensors(model, torch.float32)
    if missing := sorted(want.keys() - weights.keys()):
        raise CheckpointError(
            f"{folder}/{WEIGHTS} lacks {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + ": it is of another model"
        )
    if extra := sorted(weights.keys() - want.keys()):
        raise CheckpointError(
            f"{folder}/{WEIGHTS} holds {extra[0]}, which the model has not: it is of "
            "another model"
        )
    for name, tensor in weights.items():
        if tensor.shape != want[name].shape:
            raise CheckpointError(
                f"{folder}/{WEIGHTS}: {name} is {tuple(tensor.shape)}, the config's "
                f"model has {tuple(want[name].shape)}: it is of another model"
            )
        if tensor.dtype not in STORAGE.values():
            raise CheckpointError(f"{folder}/{WEIGHTS}: {name} is {tensor.dtype}")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(
                f"{folder}/{WEIGHTS}: weight {name} holds NaN or infinite values"
            )


def run_source(run_dir: Optional[Path], paths: list, commit: str) -> dict:
    """What ``model.json`` says of where the weights came from: the checkpoints
    averaged, the commit, and from the run's ``results.json`` (where there is one) its
    steps, minutes, machine and scores."""
    source: dict = {"checkpoints": [Path(p).name for p in paths], "commit": commit}
    summary = {}
    if run_dir is not None and (Path(run_dir) / "results.json").is_file():
        try:
            summary = json.loads((Path(run_dir) / "results.json").read_text("utf-8"))
        except (OSError, ValueError):
            summary = {}
    for key in (
        "steps",
        "train_minutes",
        "device",
        "machine",
        "cpu",
        "precision",
        "attention",
        "bleu",
        "bleu_greedy",
        "bleu_kind",
        "beam_size",
        "length_penalty_alpha",
        "test_sentences",
        "valid_losses",
        "examples",
    ):
        if key in summary:
            source[key] = summary[key]
    if "valid_losses" not in source and run_dir is not None:
        losses = valid_losses(Path(run_dir) / "metrics.jsonl")
        if losses:
            source["valid_losses"] = losses
    return source


def valid_losses(metrics: Path) -> list:
    """The validation loss after each epoch, from a run's ``metrics.jsonl``."""
    out = []
    try:
        lines = metrics.read_text("utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "valid_loss" in record:
            out.append(record["valid_loss"])
    return out


def folder_bytes(folder: Path) -> int:
    """The bytes an inference file takes: its files, as ``model.json`` lists them, and
    ``model.json``."""
    meta = read_meta(folder)
    return (Path(folder) / META).stat().st_size + sum(
        part["bytes"] for part in meta["files"].values()
    )


def score_line(meta: dict) -> str:
    """One line saying what an inference file is and how it scored."""
    source, score = meta.get("source", {}), meta.get("score", {})
    bleu = score.get("bleu", source.get("bleu"))
    said = f"{source.get('steps', '?'):,} updates" if "steps" in source else ""
    if isinstance(bleu, (int, float)) and math.isfinite(bleu):
        said += f"{', ' if said else ''}test BLEU {bleu:.2f}"
    machine = source.get("cpu") or source.get("machine")
    return said + (f", trained on {machine}" if machine else "")


def add_score(folder: Path, score: dict, log: Callable = print) -> dict:
    """Record ``score`` (what `evaluate` measured on the file as written) in
    ``model.json``; the digests of the other files are unchanged."""
    meta = read_meta(folder)
    meta["score"] = score
    write_meta(folder, meta)
    log(f"recorded in {Path(folder) / META}: {json.dumps(score)[:200]}")
    return read_meta(folder)


# The ``export`` command: a run directory (or one checkpoint) in, a model folder out.
# With ``--score`` it then decodes the test split with the file as written — beam search
# and greedy over the whole split, and beam search over its first ``--slice`` sentences
# (what the fast test decodes again) — and records the scores and the SHA-256 of the
# decoded sentences in ``model.json``.


def export_parser():
    """Options of the ``export`` command."""
    from .inference import OneLineParser, _whole_number

    parser = OneLineParser(prog="the_annotated_transformer.py export")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run_dir", "--run-dir", type=Path, help="a run directory")
    where.add_argument("--checkpoint", type=Path, help="one checkpoint file")
    parser.add_argument(
        "--average_last",
        "--average-last",
        type=_whole_number(1),
        default=None,
        help="checkpoints of --run_dir to average (default: as the run did, 5)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the model folder (default models/RUN)"
    )
    parser.add_argument(
        "--storage",
        choices=sorted(STORAGE),
        default="float32",
        help="the type the weights are stored in (default float32)",
    )
    parser.add_argument(
        "--score",
        action="store_true",
        help="decode the test split with the written file and record its BLEU",
    )
    parser.add_argument(
        "--slice",
        type=_whole_number(1),
        default=100,
        help="with --score: also score the first N test sentences (default 100)",
    )
    parser.add_argument("--data_mirror", "--data-mirror", default=None)
    parser.add_argument(
        "--commit",
        type=commit_name,
        default=None,
        help="the commit the run trained at (default: the one checked out now)",
    )
    return parser


def commit_name(text: str) -> str:
    """An argparse type: a git commit's hex name (7 to 40 digits), maybe ``-dirty``."""
    import argparse
    import re

    if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", text):
        raise argparse.ArgumentTypeError(
            f"expected a commit's hex name (7 to 40 digits), got {text[:50]!r}"
        )
    return text


def score_model(folder: Path, first: int, data_mirror=None, log=print) -> dict:
    """The test-split scores of the model folder ``folder`` as `evaluate` measures
    them: beam search (§6.1, the file's decoding defaults) and greedy over the whole
    split, and beam search over its first ``first`` sentences, each with the SHA-256 of
    the decoded sentences."""
    import argparse

    from .data import CORPORA
    from .inference import evaluation_pairs, hypotheses_text, translate_lines
    from .parts import notebook
    from .runs import machine_name

    nb = notebook()
    model, cfg, src_vocab, tgt_vocab, subwords, meta = load_model(folder)
    args = argparse.Namespace(
        src=None, ref=None, split="test", first=0, data_mirror=data_mirror
    )
    lines, refs = evaluation_pairs(args, cfg)
    record = CORPORA[cfg.dataset]
    beam, alpha = cfg.beam_size, cfg.length_penalty_alpha

    def scored(src, ref, beam_size) -> dict:
        hyps, _ = translate_lines(
            src, model, cfg, src_vocab, tgt_vocab, subwords, "cpu", beam_size, alpha
        )
        result = nb.bleu(hyps, ref, record)
        log(f"{len(src):,} sentences, beam {beam_size}: {result.text}")
        return {
            "sentences": len(src),
            "bleu": result.score,
            "text": result.text,
            "hypotheses_sha256": sha256_of(hypotheses_text(hyps)),
        }

    whole = scored(lines, refs, beam)
    return {
        "split": "test",
        "threads": torch.get_num_threads(),  # float sums may round otherwise with more
        "machine": machine_name("cpu"),
        "beam_size": beam,
        "length_penalty_alpha": alpha,
        "bleu_kind": record.bleu_kind,
        **whole,
        "signature": nb.bleu(["a"], ["a"], record).signature,
        "greedy": scored(lines, refs, 1),
        "slice": {"first": first, **scored(lines[:first], refs[:first], beam)},
    }


def run_export_command(argv) -> int:
    """``export``: write a run's averaged weights as a model folder (and, with
    ``--score``, record what the folder scores)."""
    from .inference import load_for_inference
    from .runfiles import checkpoint_paths

    args = export_parser().parse_args(argv)
    if args.checkpoint is not None and args.average_last is not None:
        raise CheckpointError(
            "--average_last averages the last checkpoints of --run_dir; --checkpoint "
            "names one file: give --run_dir, or leave --average_last out"
        )
    if args.run_dir is not None:
        average = args.average_last or saved_average(args.run_dir)
        paths = checkpoint_paths(args.run_dir)[-average:]
    else:
        average, paths = 1, [args.checkpoint]
    model, cfg, src_vocab, tgt_vocab, subwords = load_for_inference(
        args.checkpoint, args.run_dir, average, "cpu"
    )
    root = Path(__file__).resolve().parents[1]
    now = git_commit(root)
    source = run_source(args.run_dir, paths, args.commit or now)
    source["exported_at_commit"] = now
    out = args.out or root / "models" / (
        Path(args.run_dir).resolve().name if args.run_dir else args.checkpoint.stem
    )
    export_model(out, model, cfg, src_vocab, tgt_vocab, subwords, source, args.storage)
    print(
        f"wrote {out}: {len(paths)} checkpoint(s) averaged, {args.storage}, "
        f"{folder_bytes(out):,} bytes"
    )
    if args.score:
        add_score(out, score_model(out, args.slice, args.data_mirror))
    return 0


def saved_average(run_dir: Path) -> int:
    """How many checkpoints a run averages for its score (its config's
    ``average_last``; 5, §6.1, where its results.json does not say)."""
    try:
        saved = json.loads((Path(run_dir) / "results.json").read_text("utf-8"))
        return max(int(saved["config"]["average_last"]), 1)
    except (OSError, ValueError, KeyError, TypeError):
        return 5

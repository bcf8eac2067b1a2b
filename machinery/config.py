"""Configuration: the model's sizes, a training run's settings, their checks and
presets.

The notebook's `ModelConfig` (Part 1) holds the model's settings with the paper's
names (§3, Table 3); `Config` extends it with everything a training run needs. Both
are frozen dataclasses; the command line replaces fields with ``--field value``.
Every setting is checked when a `Config` is made, so a run that could not work stops
before it loads any data.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Optional

import torch

from .parts import notebook

# field metadata: changes the computation, not the weights
SAME_WEIGHTS = MappingProxyType({"same_weights": True})
POSITIONAL_KINDS = ("sinusoid", "learned")  # §3.5 and its alternative (Table 3, row E)
ATTENTION_PATHS = ("auto", "readable", "fast")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


# The model's settings and the paper's models are the notebook's (Part 1).
_nb = notebook()


def weight_fields() -> tuple:
    """The ModelConfig fields that decide the parameters (a checkpoint must agree)."""
    return tuple(
        f.name
        for f in dataclasses.fields(_nb.ModelConfig)
        if not f.metadata.get("same_weights")
    )


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _prob(x) -> bool:  # a dropout or smoothing probability
    return _finite(x) and 0 <= x < 1


def _config_rules(c: "Config") -> list:
    """(field, holds, what it must be) for every setting of a run, checked up front."""
    from .data import CORPORA  # the data sets' records (data.py builds on this module)

    d_k_rule = "must be 0 (d_model / h) or more (§3.2.2)"
    return [
        (
            "precision",
            c.precision in PRECISIONS,
            f"must be one of {', '.join(PRECISIONS)}",
        ),
        ("vocab", c.vocab in ("bpe", "words"), "must be bpe or words"),
        ("N", c.N >= 1, "must be at least 1"),
        ("N_dec", c.N_dec >= 0, "must be 0 (as many as N) or more"),
        (
            "d_model",
            c.d_model >= 2 and c.d_model % 2 == 0,
            "must be even and at least 2 (§3.5: sine/cosine pairs)",
        ),
        ("d_ff", c.d_ff >= 1, "must be at least 1"),
        ("h", c.h >= 1, "must be at least 1"),
        ("d_k", c.d_k >= 0, d_k_rule),
        (
            "h",
            c.h >= 1 and c.d_model % c.h == 0,
            f"must divide d_model={c.d_model} (§3.2.2: d_v = d_model/h)",
        ),
        ("P_drop", _prob(c.P_drop), "must be in [0, 1)"),
        ("ffn_dropout", _prob(c.ffn_dropout), "must be in [0, 1)"),
        ("attn_dropout", _prob(c.attn_dropout), "must be in [0, 1)"),
        ("max_len", 3 <= c.max_len <= 100_000, "must be from 3 to 100000"),
        ("attention", c.attention in ATTENTION_PATHS, "must be auto, readable or fast"),
        (
            "positional",
            c.positional in POSITIONAL_KINDS,
            f"must be one of {', '.join(POSITIONAL_KINDS)}",
        ),
        ("dataset", c.dataset in CORPORA, f"must be one of {', '.join(CORPORA)}"),
        (
            "bpe_size",
            8 <= c.bpe_size <= 1_000_000,
            "must be from 8 to 1000000 (sentencepiece's range)",
        ),
        ("min_freq", c.min_freq >= 1, "must be at least 1"),
        ("max_tokens", c.max_tokens >= 1, "must be at least 1"),
        ("batch_tokens", c.batch_tokens >= 1, "must be at least 1"),
        ("warmup", c.warmup >= 1, "must be at least 1"),
        (
            "lr_factor",
            _finite(c.lr_factor) and c.lr_factor > 0,
            "must be a finite number above 0",
        ),
        (
            "betas",
            len(c.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in c.betas),
            "must be two numbers in [0, 1), e.g. 0.9,0.98",
        ),
        (
            "adam_eps",
            _finite(c.adam_eps) and 0 < c.adam_eps <= 1,
            "must be above 0 and at most 1 (§5.3: 1e-9; a larger ε shrinks every "
            "update until the model cannot learn)",
        ),
        (
            "weight_decay",
            _finite(c.weight_decay) and c.weight_decay >= 0,
            "must be a finite number, 0 or more",
        ),
        ("eps_ls", _prob(c.eps_ls), "must be in [0, 1)"),
        ("accum_steps", c.accum_steps >= 1, "must be at least 1"),
        (
            "clip_grad",
            _finite(c.clip_grad) and c.clip_grad >= 0,
            "must be a finite number, 0 or more",
        ),
        ("epochs", c.epochs >= 1, "must be at least 1"),
        ("max_steps", c.max_steps >= 0, "must be 0 (no limit) or more"),
        ("keep_checkpoints", c.keep_checkpoints >= 1, "must be at least 1"),
        (
            "checkpoint_minutes",
            _finite(c.checkpoint_minutes) and c.checkpoint_minutes >= 0,
            "must be a finite number, 0 (off) or more",
        ),
        ("average_last", c.average_last >= 0, "must be 0 or more"),
        (
            "max_decode_extra",
            0 <= c.max_decode_extra <= 10_000,
            "must be from 0 to 10000",
        ),
        ("beam_size", 1 <= c.beam_size <= 1000, "must be from 1 (greedy) to 1000"),
        (
            "length_penalty_alpha",
            _finite(c.length_penalty_alpha) and 0 <= c.length_penalty_alpha <= 10,
            "must be a number from 0 to 10 (§6.1 uses 0.6)",
        ),
        (
            "eval_batch_size",
            1 <= c.eval_batch_size <= 100_000,
            "must be from 1 to 100000",
        ),
        ("max_eval_sentences", c.max_eval_sentences >= 0, "must be 0 (all) or more"),
        ("max_valid_sentences", c.max_valid_sentences >= 0, "must be 0 (all) or more"),
        ("examples_to_show", c.examples_to_show >= 0, "must be 0 or more"),
        ("seed", 0 <= c.seed <= SEED_LIMIT, f"must be from 0 to {SEED_LIMIT:,}"),
        (
            "average_last",
            c.average_last <= c.keep_checkpoints,
            f"must be at most keep_checkpoints={c.keep_checkpoints} (raise "
            "--keep_checkpoints: only that many checkpoints are kept to average)",
        ),
        *[
            (name, getattr(c, name) <= INT_LIMIT, f"must be at most {INT_LIMIT:,}")
            for name in _whole_number_fields()
        ],
    ]


# Every whole-number setting is bounded (our addition): sizes well past any machine's
# memory are refused by the plan's estimate (`planning.py`), but a number past what a
# tensor's shape or sentencepiece can hold would fail inside the library, and the seeds
# of every process (`seed_process`) must stay within what the generators accept.
INT_LIMIT = 2**31 - 1
SEED_LIMIT = 2**32 - 1


def _whole_number_fields() -> tuple:
    """The names of Config's whole-number fields (our addition)."""
    return tuple(
        f.name
        for f in dataclasses.fields(Config)
        if isinstance(f.default, int) and not isinstance(f.default, bool)
    )


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was — our
    addition: a value pasted by mistake is not echoed back whole."""
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}… ({len(text):,} characters)"


def device_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot be used as a device here (None if it can): checked first."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"device {name!r} is not a device name (auto, cpu, cuda, cuda:1, ...)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"device {name!r}: this machine (or this torch build) has no CUDA "
                "device; use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return f"device {name!r}: MPS is not available here; use --device cpu"
    elif device.type not in ("cpu", "cuda", "mps"):
        return f"device {name!r}: only cpu, cuda and mps are supported"
    return None


@dataclass(frozen=True)
class Config(_nb.ModelConfig):
    """A training run: the model (the notebook's ``ModelConfig``) plus data,
    optimisation and machinery settings. Each field is explained where the notebook or
    package uses it.
    """

    # --- data (§5.1) ---
    dataset: str = "multi30k"  # a name in CORPORA: "copy", "multi30k" or "iwslt14"
    vocab: str = "bpe"  # "bpe": joint byte-pair encoding (§5.1); "words": whole words
    bpe_size: int = 37000  # joint BPE vocabulary, specials included (§5.1: ~37000)
    min_freq: int = 2  # word vocabularies: keep words seen at least this often
    max_tokens: int = 100  # training pairs with a longer side are filtered out
    batch_tokens: int = 4096  # tokens (either side, padding included) per batch
    # --- optimisation (§5.3, §5.4) ---
    warmup: int = 4000
    lr_factor: float = 1.0  # multiplies Eq. 3
    betas: tuple = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = (
        0.0  # decoupled weight decay (AdamW) when > 0; not in the paper
    )
    eps_ls: float = 0.1  # label smoothing
    accum_steps: int = 1  # batches per optimizer update
    clip_grad: float = 0.0  # max grad norm; 0 = off
    epochs: int = 10
    max_steps: int = 0  # stop after this many updates; 0 = no limit
    seed: int = 1
    # --- machinery ---
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    precision: str = "auto"  # "auto" (measured), "fp32", "bf16" or "fp16"
    compile: bool = False  # torch.compile the model
    keep_checkpoints: int = 5  # last K kept (for averaging)
    checkpoint_minutes: float = 10.0  # also save every this many minutes; 0 = off
    average_last: int = 0  # evaluate the average of the last K checkpoints; 0 = last
    run_dir: str = ""  # checkpoints and logs; "" = runs/<preset> (see run_dir_for)
    data_dir: str = (
        ""  # downloads and caches; "" = $ANNOTATED_TRANSFORMER_DATA or ./data
    )
    data_mirror: str = ""  # a local folder holding the data sets; "" = $DATA_MIRROR
    download: bool = True  # fetch missing data when no mirror has it
    # --- decoding (§6.1, Part 3) ---
    max_decode_extra: int = 50  # at most input length + this many tokens (§6.1)
    beam_size: int = (
        4  # beam search at the end of training (§6.1); greedy is scored too
    )
    length_penalty_alpha: float = 0.6  # GNMT length penalty α (§6.1); 0 = none
    eval_batch_size: int = 128  # sentences per decoding batch
    max_eval_sentences: int = 0  # decode only the first N test sentences; 0 = all
    max_valid_sentences: int = 0  # validation loss on the first N pairs; 0 = all
    examples_to_show: int = 5

    def __post_init__(self):
        problems, named = [], set()
        for name, ok, words in _config_rules(self):
            if not ok and name not in named:  # the first rule a field breaks
                named.add(name)
                problems.append(
                    f"{name} {words}, not {shorten(repr(getattr(self, name)))}"
                )
        if problems:
            raise ValueError("; ".join(problems))
        problem = device_problem(self.device)
        if problem:
            raise ValueError(problem)


def _model(name: str) -> dict:
    """The fields of model preset ``name``, to build a training preset on."""
    return dataclasses.asdict(_nb.MODEL_PRESETS[name])


# fairseq's transformer_iwslt_de_en recipe: peak lr 5e-4 at update 4,000 (Eq. 3 times
# this factor peaks there), AdamW weight decay 1e-4, 4,096 tokens, dropout 0.3, ε_ls
# 0.1, no clipping; average the last 5.
_IWSLT_LR_FACTOR = 5e-4 * (512 * 4000) ** 0.5

PRESETS = MappingProxyType(
    {
        # §5.1's ~25,000 tokens per update: 6 batches of 4,096 (padding counted)
        "base": Config(
            **_model("base"),
            epochs=10**6,
            max_steps=100_000,
            accum_steps=6,
            average_last=5,
        ),
        "big": Config(
            **_model("big"),
            epochs=10**6,
            max_steps=300_000,
            accum_steps=6,
            keep_checkpoints=20,
            average_last=20,
        ),
        "tiny": Config(**_model("tiny"), vocab="words", bpe_size=1000),
        # fmt: skip
        "copy": Config(
            N=2,
            d_model=64,
            d_ff=128,
            h=4,
            P_drop=0.0,
            dataset="copy",
            batch_tokens=1280,
            warmup=200,
            epochs=16,
            min_freq=1,
        ),
        # fmt: skip
        "multi30k-small": Config(
            N=3,
            d_model=256,
            d_ff=1024,
            h=8,
            dataset="multi30k",
            bpe_size=8000,
            batch_tokens=2500,
            warmup=1000,
            lr_factor=0.7,
            epochs=15,
            clip_grad=1.0,
            average_last=5,
        ),
        # fmt: skip
        "iwslt14-small": Config(
            N=6,
            d_model=512,
            d_ff=1024,
            h=4,
            P_drop=0.3,
            dataset="iwslt14",
            bpe_size=10000,
            batch_tokens=4096,
            warmup=4000,
            lr_factor=_IWSLT_LR_FACTOR,
            weight_decay=1e-4,
            epochs=50,
            min_freq=3,
            clip_grad=0.0,
            average_last=5,
        ),
        # fmt: skip
        "iwslt14-sample": Config(
            N=3,
            N_dec=2,
            d_model=256,
            d_ff=1024,
            h=4,
            P_drop=0.1,
            attn_dropout=0.1,
            ffn_dropout=0.1,
            dataset="iwslt14",
            bpe_size=4000,
            batch_tokens=2048,
            warmup=1000,
            lr_factor=0.7,
            eps_ls=0.2,
            epochs=33,
            clip_grad=1.0,
            average_last=5,
            max_valid_sentences=1000,
        ),
    }
)


def get_config(name: str = "base", **overrides) -> Config:
    """The preset ``name`` with ``overrides`` applied (unknown names raise a clear
    error)."""
    if name not in PRESETS:
        raise KeyError(f"unknown config {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def default_preset() -> str:
    """The preset a run without ``--config`` trains: the GPU-sized IWSLT14 model where
    CUDA is available, else the one sized to train on a CPU in under an hour."""
    return "iwslt14-small" if torch.cuda.is_available() else "iwslt14-sample"


def run_dir_for(cfg: Config, preset: str = "") -> Path:
    """Where a run keeps its files: ``cfg.run_dir``, else ``runs/<preset>``, else
    ``runs/<dataset>``."""
    return Path(cfg.run_dir or f"runs/{preset or cfg.dataset}")

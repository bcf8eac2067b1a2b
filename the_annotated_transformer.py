# ---
# jupyter:
#   jupytext:
#     formats: ipynb,the_/py:percent
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Annotated Transformer, reproduced
#
# A literate, tested reproduction of *Attention Is All You Need* (Vaswani, Shazeer, Parmar,
# Uszkoreit, Jones, Gomez, Kaiser, Polosukhin, 2017, arXiv:1706.03762).
#
# **How to read this notebook.** Text in a block quote is the paper's own wording, quoted
# exactly and followed by its section (and equation) number; `[…]` marks words left out
# (mostly citation keys). Everything else — prose outside block quotes, code and comments —
# is our commentary. Each code cell follows the paragraph it implements.
#
# * **Part 1 — the model (§3, §4).** Every component, in the paper's order and with the
#   paper's names (`d_model`, `d_k`, `h`, `N`, `d_ff`, `P_drop`), ending in a model that
#   runs; then, as an aside, the fast version of attention.
# * **Part 2 — training (§5).** The data sets, vocabulary (byte-pair encoding), batching
#   by length, the optimizer and its schedule, regularization, and one update step.
# * **Part 3 — decoding and inference (§6.1).** Greedy decoding, a key/value cache, beam
#   search with a length penalty, and BLEU.
# * **Appendix — machinery.** Finding, downloading and preparing data; devices and
#   processes; checkpoint files; running a training job (epochs, resuming, validation,
#   scoring); the command line. Part 4 runs it, so it is defined before Part 4; skip it
#   on a first reading.
# * **Part 4 — real runs.** A synthetic copy task, then German→English translation on
#   Multi30k (with sinusoidal and with learned positions) and IWSLT14, and what the trained
#   model attends to.
#
# The same file is a Python module (`the_annotated_transformer.py`, jupytext percent
# format). Importing it defines everything and runs nothing: the example cells only run
# when this notebook runs, or when the file is run as a script without a sub-command.
# Where the paper is silent or we depart from it, `REPRODUCTION_NOTES.md` says so once,
# with the alternatives.
#
# > The dominant sequence transduction models are based on complex recurrent or
# > convolutional neural networks that include an encoder and a decoder. The best
# > performing models also connect the encoder and decoder through an attention mechanism.
# > We propose a new simple network architecture, the Transformer, based solely on
# > attention mechanisms, dispensing with recurrence and convolutions entirely.
#
# — Abstract

# %% [markdown]
# ## Prelude
#
# Only PyTorch, NumPy, sentencepiece (byte-pair encoding), spaCy (tokenizers only),
# sacreBLEU, sacremoses, tqdm, and matplotlib with seaborn for the figures. There is no
# torchtext here: its development stopped at release 0.18, which only loads against torch
# 2.3, and the dataset URLs it downloads from are dead. What we needed from it (reading
# parallel text, a vocabulary, batching by length) takes a few dozen lines below.
#
# `NOTEBOOK_PROFILE` sizes the examples when the notebook runs: `full` (the default, what the stored outputs come from)
# or `smoke` (every example at its smallest, which is how the tests execute the notebook).

# %%
from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import functools
import gzip
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm


def _examples_enabled() -> bool:
    """True when this file runs as the notebook, or as a script without a sub-command.

    Example cells are guarded by ``if EXAMPLES:`` so that ``import the_annotated_transformer``
    (tests, other programs) and ``python the_annotated_transformer.py train ...`` run none
    of them.
    """
    if __name__ != "__main__":
        return False
    return "ipykernel" in sys.modules or len(sys.argv) == 1


EXAMPLES = _examples_enabled()

if EXAMPLES:
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    PROFILE = os.environ.get("NOTEBOOK_PROFILE", "full")  # "smoke": the examples at their smallest (the tests)
    if PROFILE not in ("full", "smoke"):
        raise ValueError(f"NOTEBOOK_PROFILE must be 'full' or 'smoke', not {PROFILE!r}")

# %% [markdown]
# What the module offers to other programs, part by part:

# %%
__all__ = [
    # Part 1 — the model (§3), in the paper's order
    "EncoderDecoder", "Generator", "Encoder", "EncoderLayer", "SublayerConnection", "Decoder", "DecoderLayer",
    "subsequent_mask", "padding_mask", "attention", "MultiHeadedAttention", "PositionwiseFeedForward", "Embeddings",
    "PositionalEncoding", "LearnedPositionalEncoding", "FastMultiHeadedAttention", "FastDropout", "SameMaskDropout", "mask_drawer", "load_dropout_kernel", "use_dropout",
    "ModelConfig", "MODEL_PRESETS", "WordDropout",
    "make_model",
    # Part 2 — training (§5)
    "Corpus", "CORPORA", "Config", "PRESETS", "get_config", "Vocab", "Subwords", "Batch", "length_batches", "rate", "cooldown_factor",
    "make_optimizer", "LabelSmoothing", "loss_sum", "loss_sum_one_pass", "fused_loss_sum", "Trainer", "update",
    # Part 3 — decoding (§6.1)
    "greedy_decode", "IncrementalDecoder", "beam_search", "translate", "detokenize", "bleu",
    # Appendix — running it
    "load_dataset", "epoch_pairs", "Dataset", "GLIBC_MALLOC_SETTINGS", "allocator_note", "dropout_note", "save_checkpoint", "load_checkpoint", "average_checkpoints", "train", "evaluate_test",
    "load_for_inference", "main",
]

# %% [markdown]
# ### In a hosted notebook
#
# Opened in Colab or Kaggle straight from the repository, the notebook arrives alone: with
# the host's own packages (torch among them, built for its GPU) but not all of ours, and
# without the figures it shows. The next cell fills in what is missing — and does nothing
# anywhere else. It installs only the packages that cannot be imported, at the versions of
# `requirements.txt`, with the host's torch pinned as it is so that nothing replaces it, and
# fetches the figures from the repository (`ANNOTATED_TRANSFORMER_SOURCE`, the raw-file
# address of the repository, says from where). The data sets need nothing here: Part 4
# downloads them when it first needs them. `hosted_setup_plan` only decides; the tests check
# its decisions with the environment faked.

# %%
HOSTED_PACKAGES = MappingProxyType({  # import name → the requirement, as pinned in requirements.txt
    "sentencepiece": "sentencepiece==0.2.3", "sacrebleu": "sacrebleu==2.6.0", "sacremoses": "sacremoses==0.2.0",
    "spacy": "spacy==3.8.18", "seaborn": "seaborn==0.13.2", "matplotlib": "matplotlib==3.11.2",
    "tqdm": "tqdm==4.70.1"})
HOSTED_FILES = ("figures/figure1_transformer.png", "figures/figure2_attention.png")


def hosted_setup_plan(environ, modules, have_module: Callable[[str], bool], here: Path, source: str) -> dict:
    """What a hosted notebook lacks (our addition): ``{"hosted", "install": [requirements], "fetch": [(url, path)]}``.

    ``environ`` and ``modules`` are the environment and ``sys.modules``; ``have_module(name)``
    says whether a package imports; ``here`` is the notebook's folder. Outside a hosted
    notebook both lists are empty; torch is never installed.
    """
    hosted = "google.colab" in modules or "COLAB_RELEASE_TAG" in environ or "KAGGLE_KERNEL_RUN_TYPE" in environ
    if not hosted:
        return {"hosted": False, "install": [], "fetch": []}
    install = [req for name, req in HOSTED_PACKAGES.items() if not have_module(name)]
    fetch = [(f"{source.rstrip('/')}/{f}", Path(here) / f) for f in HOSTED_FILES if not (Path(here) / f).is_file()]
    return {"hosted": True, "install": install, "fetch": fetch if source else []}


def hosted_setup(plan: dict, log: Callable = print) -> None:
    """Carry out a :func:`hosted_setup_plan` (our addition): pip, the installed torch as a constraint; downloads."""
    import subprocess
    if plan["install"]:
        pins = Path(tempfile.mkdtemp()) / "keep-torch.txt"
        pins.write_text(f"torch=={torch.__version__}\n")
        log(f"installing {', '.join(plan['install'])} (torch {torch.__version__} kept)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-c", str(pins), *plan["install"]],
                       check=True)
    for url, path in plan["fetch"]:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, path)
        log(f"fetched {path}")


if EXAMPLES:
    import importlib.util
    hosted_setup(hosted_setup_plan(os.environ, sys.modules, lambda name: importlib.util.find_spec(name) is not None,
                                   Path.cwd(), os.environ.get("ANNOTATED_TRANSFORMER_SOURCE", "")))

# %% [markdown]
# # Part 1 — The model
#
# ## §3 Model Architecture
#
# > Most competitive neural sequence transduction models have an encoder-decoder structure
# > […]. Here, the encoder maps an input sequence of symbol representations […]
# > $(x_1, ..., x_n)$ to a sequence of continuous representations
# > $\mathbf{z} = (z_1, ..., z_n)$. Given $\mathbf{z}$, the decoder then generates an output
# > sequence $(y_1,...,y_m)$ of symbols one element at a time. At each step the model is
# > auto-regressive […], consuming the previously generated symbols as additional input when
# > generating the next.
#
# — §3
#
# The paper's Figure 1 draws the whole model. Here is our own drawing of it, with the names
# of the classes below in grey (`figures/draw_figures.py` draws it):
#
# ![Figure 1, redrawn: the Transformer, encoder on the left, decoder on the right](figures/figure1_transformer.png)
#
# `EncoderDecoder` is that structure with its parts left abstract: `encode` computes
# $\mathbf{z}$ once, `decode` is called with the target prefix, and `forward` does both for
# training (the whole target is known, so all positions are computed in parallel).

# %%
class EncoderDecoder(nn.Module):
    r"""The encoder-decoder structure of §3: $\mathbf{x} \to \mathbf{z} \to \mathbf{y}$.

    ``forward`` returns the decoder's output vectors (batch, tgt_len, d_model); the
    ``generator`` turns them into log-probabilities over the target vocabulary.
    """

    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src, tgt, src_mask, tgt_mask):
        """Encode ``src`` and decode ``tgt`` (teacher forcing)."""
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        r"""Map source token ids (batch, src_len) to $\mathbf{z}$ (batch, src_len, d_model)."""
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        """Decoder output (batch, tgt_len, d_model) for the target prefix ``tgt``."""
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


class Generator(nn.Module):
    r"""The pre-softmax linear transformation and softmax of §3.4 (as log-probabilities)."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        """(batch, len, d_model) → (batch, len, vocab) log-probabilities."""
        return F.log_softmax(self.proj(x), dim=-1)


# %% [markdown]
# ## §3.1 Encoder and Decoder Stacks
#
# ### Encoder
#
# > The encoder is composed of a stack of $N=6$ identical layers. Each layer has two
# > sub-layers. The first is a multi-head self-attention mechanism, and the second is a
# > simple, position-wise fully connected feed-forward network.
#
# — §3.1

# %%
def clones(module: nn.Module, N: int) -> nn.ModuleList:
    r"""$N$ identical, independently parameterised copies of ``module`` (the stacks of §3.1)."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


class Encoder(nn.Module):
    r"""The encoder stack of §3.1: $N$ identical layers applied in turn.

    With post-norm (the paper) every sub-layer already ends in a layer norm, so there is
    nothing to add on top. With pre-norm (``norm_first=True``) the stack ends with one more
    layer norm, because the last residual sum is otherwise never normalised.
    """

    def __init__(self, layer: nn.Module, N: int, norm_first: bool = False):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = nn.LayerNorm(layer.size) if norm_first else nn.Identity()

    def forward(self, x, mask):
        """Pass (batch, src_len, d_model) through each layer; ``mask`` is the source mask."""
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


# %% [markdown]
# > We employ a residual connection […] around each of the two sub-layers, followed by layer
# > normalization […]. That is, the output of each sub-layer is
# > $\mathrm{LayerNorm}(x + \mathrm{Sublayer}(x))$, where $\mathrm{Sublayer}(x)$ is the
# > function implemented by the sub-layer itself. To facilitate these residual connections,
# > all sub-layers in the model, as well as the embedding layers, produce outputs of
# > dimension $d_{\text{model}}=512$.
#
# — §3.1
#
# Layer normalization (Ba et al., 2016) normalises each position's vector over its
# $d_{\text{model}}$ features and then applies a learned gain $\gamma$ and bias $\beta$:
#
# $$\mathrm{LayerNorm}(x) = \gamma \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta,
# \qquad \mu = \frac{1}{d}\sum_j x_j,\quad \sigma^2 = \frac{1}{d}\sum_j (x_j - \mu)^2 .$$
#
# `layer_norm_formula` writes exactly this; the model uses `nn.LayerNorm`, and a test shows
# the two agree.
#
# Where does dropout go? §5.4 (quoted in Part 2) answers: "to the output of each sub-layer,
# before it is added to the sub-layer input and normalized". So the paper's sub-layer
# connection is $\mathrm{LayerNorm}(x + \mathrm{Dropout}(\mathrm{Sublayer}(x)))$ —
# **post-norm**. The widely copied Harvard notebook computes
# $x + \mathrm{Dropout}(\mathrm{Sublayer}(\mathrm{LayerNorm}(x)))$ instead (**pre-norm**),
# which trains more stably in deep stacks but is not what the paper describes. We implement
# the paper by default and keep pre-norm as the option `norm_first=True` (the name
# `torch.nn.Transformer` uses).

# %%
def layer_norm_formula(x, gamma, beta, eps: float = 1e-5):
    r"""Layer normalization (Ba et al., 2016) over the last dimension, written out.

    $\gamma \odot (x - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta$ with the biased variance.
    """
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)
    return gamma * (x - mu) / torch.sqrt(var + eps) + beta


class SublayerConnection(nn.Module):
    r"""Residual connection and layer norm around one sub-layer — §3.1, with §5.4's dropout.

    Post-norm (paper, default): $\mathrm{LayerNorm}(x + \mathrm{Dropout}(\mathrm{Sublayer}(x)))$.
    Pre-norm (``norm_first=True``): $x + \mathrm{Dropout}(\mathrm{Sublayer}(\mathrm{LayerNorm}(x)))$.
    """

    def __init__(self, size: int, dropout: float, norm_first: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x, sublayer: Callable):
        """Apply ``sublayer`` (a function of (batch, len, d_model)) with residual and norm."""
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """One encoder layer of §3.1: self-attention, then the feed-forward network."""

    def __init__(self, size: int, self_attn, feed_forward, dropout: float, norm_first: bool = False):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout, norm_first), 2)
        self.size = size

    def forward(self, x, mask):
        """(batch, src_len, d_model) → same shape."""
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


# %% [markdown]
# ### Decoder
#
# > The decoder is also composed of a stack of $N=6$ identical layers. In addition to the two
# > sub-layers in each encoder layer, the decoder inserts a third sub-layer, which performs
# > multi-head attention over the output of the encoder stack. Similar to the encoder, we
# > employ residual connections around each of the sub-layers, followed by layer
# > normalization.
#
# — §3.1

# %%
class Decoder(nn.Module):
    r"""The decoder stack of §3.1: $N$ identical layers (plus a final norm for pre-norm)."""

    def __init__(self, layer: nn.Module, N: int, norm_first: bool = False):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = nn.LayerNorm(layer.size) if norm_first else nn.Identity()

    def forward(self, x, memory, src_mask, tgt_mask):
        """(batch, tgt_len, d_model) attending to ``memory`` (batch, src_len, d_model)."""
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """One decoder layer of §3.1: masked self-attention, encoder-decoder attention, FFN."""

    def __init__(self, size: int, self_attn, src_attn, feed_forward, dropout: float,
                 norm_first: bool = False):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout, norm_first), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        """(batch, tgt_len, d_model) → same shape."""
        m = memory
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


# %% [markdown]
# > We also modify the self-attention sub-layer in the decoder stack to prevent positions
# > from attending to subsequent positions. This masking, combined with fact that the output
# > embeddings are offset by one position, ensures that the predictions for position $i$ can
# > depend only on the known outputs at positions less than $i$.
#
# — §3.1
#
# **The mask convention, once for the whole project.** A mask is a boolean tensor in which
# `True` means *may attend* and `False` means *must not*. It broadcasts against the
# attention scores, shape (batch, [h,] query_len, key_len): a source padding mask is
# (batch, 1, src_len), a target mask is (batch, tgt_len, tgt_len). This is the convention
# of `torch.nn.functional.scaled_dot_product_attention`; `torch.nn.Transformer` uses the
# opposite one (True = blocked), so comparisons with it pass `~mask`.

# %%
def subsequent_mask(size: int, device=None) -> torch.Tensor:
    """Causal mask (1, size, size): position i may attend to positions j ≤ i — §3.1, §3.2.3."""
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


def padding_mask(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Key mask (batch, 1, len) for token ids (batch, len): every real token may be attended to, padding not."""
    return (ids != pad).unsqueeze(-2)  # (batch, 1, len)


if EXAMPLES:
    fig, ax = plt.subplots(figsize=(3.5, 3.5))
    ax.imshow(subsequent_mask(20)[0], cmap="Greys")
    ax.set_xlabel("key position j (may attend: dark)")
    ax.set_ylabel("query position i")
    ax.set_title("subsequent_mask(20)")
    plt.show()
    del fig, ax  # examples leave no names behind, except what a later example uses

# %% [markdown]
# ## §3.2 Attention
#
# > An attention function can be described as mapping a query and a set of key-value pairs
# > to an output, where the query, keys, values, and output are all vectors. The output is
# > computed as a weighted sum of the values, where the weight assigned to each value is
# > computed by a compatibility function of the query with the corresponding key.
#
# — §3.2
#
# The paper's Figure 2 shows the two levels, redrawn here: scaled dot-product attention
# (left, `attention` below) and multi-head attention built from $h$ of them (right,
# `MultiHeadedAttention`).
#
# ![Figure 2, redrawn: scaled dot-product attention and multi-head attention](figures/figure2_attention.png)
#
# ### §3.2.1 Scaled Dot-Product Attention
#
# > We call our particular attention "Scaled Dot-Product Attention" […]. The input consists
# > of queries and keys of dimension $d_k$, and values of dimension $d_v$. We compute the dot
# > products of the query with all keys, divide each by $\sqrt{d_k}$, and apply a softmax
# > function to obtain the weights on the values.
#
# > In practice, we compute the attention function on a set of queries simultaneously,
# > packed together into a matrix $Q$. The keys and values are also packed together into
# > matrices $K$ and $V$. We compute the matrix of outputs as:
# >
# > $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}(\frac{QK^T}{\sqrt{d_k}})V$$
#
# — §3.2.1, Eq. 1
#
# Masked scores are set to $-\infty$ as §3.2.3 says, so they get exactly zero weight. A row
# in which *every* key is masked would be $0/0$ = NaN after the softmax; we return zero
# weights for such a row instead (the same choice PyTorch's fused attention makes), so no
# NaN ever enters the model.

# %%
def attention(query, key, value, mask=None, dropout: Optional[nn.Module] = None):
    r"""Scaled dot-product attention — §3.2.1, Eq. 1.

    $\mathrm{softmax}(QK^T/\sqrt{d_k})V$ for query (..., len_q, d_k), key (..., len_k, d_k)
    and value (..., len_k, d_v); ``mask`` is boolean, True = may attend, broadcastable to
    (..., len_q, len_k). Returns the output (..., len_q, d_v) and the weights
    (..., len_q, len_k).
    """
    d_k = query.size(-1)
    scores = query @ key.transpose(-2, -1) / math.sqrt(d_k)  # (..., len_q, len_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p_attn = scores.softmax(dim=-1)
    if mask is not None:
        # Fully masked rows are NaN here; give them zero weight (partial rows are unchanged).
        p_attn = p_attn.masked_fill(~mask, 0.0)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return p_attn @ value, p_attn


# %% [markdown]
# > While for small values of $d_k$ the two mechanisms perform similarly, additive attention
# > outperforms dot product attention without scaling for larger values of $d_k$ […]. We
# > suspect that for large values of $d_k$, the dot products grow large in magnitude,
# > pushing the softmax function into regions where it has extremely small gradients
#
# — §3.2.1, with its footnote: "To illustrate why the dot products get large, assume that
# the components of $q$ and $k$ are independent random variables with mean $0$ and variance
# $1$. Then their dot product, $q \cdot k = \sum_{i=1}^{d_k} q_ik_i$, has mean $0$ and
# variance $d_k$."
#
# A quick check of the footnote: the variance of $q\cdot k$ grows like $d_k$, and after
# dividing by $\sqrt{d_k}$ it stays near 1.

# %%
if EXAMPLES:
    for d_k in (4, 64, 512):
        q, k = torch.randn(10_000, d_k), torch.randn(10_000, d_k)
        dots = (q * k).sum(-1)
        print(f"d_k={d_k:4d}  var(q·k)={dots.var():8.1f}  var(q·k/√d_k)={(dots / math.sqrt(d_k)).var():.2f}")
    del d_k, q, k, dots

# %% [markdown]
# ### §3.2.2 Multi-Head Attention
#
# > Instead of performing a single attention function with $d_{\text{model}}$-dimensional
# > keys, values and queries, we found it beneficial to linearly project the queries, keys
# > and values $h$ times with different, learned linear projections to $d_k$, $d_k$ and $d_v$
# > dimensions, respectively. On each of these projected versions of queries, keys and values
# > we then perform the attention function in parallel, yielding $d_v$-dimensional output
# > values. These are concatenated and once again projected, resulting in the final values,
# > as depicted in […]
#
# > Multi-head attention allows the model to jointly attend to information from different
# > representation subspaces at different positions. With a single attention head, averaging
# > inhibits this.
# >
# > $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head_1}, ..., \mathrm{head_h})W^O
# > \\ \text{where}~\mathrm{head_i} = \mathrm{Attention}(QW^Q_i, KW^K_i, VW^V_i)$$
#
# > In this work we employ $h=8$ parallel attention layers, or heads. For each of these we
# > use $d_k=d_v=d_{\text{model}}/h=64$.
#
# — §3.2.2
#
# The $h$ matrices $W^Q_i \in \mathbb{R}^{d_{\text{model}} \times d_k}$ sit side by side in
# one $d_{\text{model}} \times h d_k$ linear layer (likewise $W^K$, $W^V$), so one matrix
# product computes every head's projection; a reshape then splits the heads.

# %%
class MultiHeadedAttention(nn.Module):
    r"""Multi-head attention — §3.2.2 (readable version).

    ``w_q``, ``w_k``, ``w_v`` hold $W^Q_i, W^K_i, W^V_i$ for all heads side by side; ``w_o``
    is $W^O$. The forward pass keeps no attention weights (nothing stays alive after it);
    :func:`attention_maps` recomputes them for plotting.
    """

    def __init__(self, h: int, d_model: int, dropout: float = 0.1):
        super().__init__()
        assert d_model % h == 0, "d_model must be divisible by h"
        self.d_k = d_model // h  # d_k = d_v = d_model / h
        self.h = h
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x):
        """(batch, len, d_model) → (batch, h, len, d_k)."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.h, self.d_k).transpose(1, 2)  # (batch, h, len, d_k)

    def merge_heads(self, x):
        """(batch, h, len, d_k) → (batch, len, h·d_k): Concat(head_1, …, head_h)."""
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.h * self.d_k)  # (batch, len, d_model)

    def project_q(self, query):
        r"""$QW^Q_i$ for every head: (batch, len_q, d_model) → (batch, h, len_q, d_k)."""
        return self.split_heads(self.w_q(query))

    def project_kv(self, key, value):
        r"""$KW^K_i$ and $VW^V_i$ for every head: (batch, len_k, d_model) → 2 × (batch, h, len_k, d_k)."""
        return self.split_heads(self.w_k(key)), self.split_heads(self.w_v(value))

    def attend(self, q, k, v, mask=None):
        """Eq. 1 on every head at once: q (batch, h, len_q, d_k), k/v (batch, h, len_k, d_k) → (batch, h, len_q, d_k)."""
        return attention(q, k, v, mask=mask, dropout=self.dropout)[0]

    def combine(self, q, k, v, mask=None):
        r"""$\mathrm{Concat}(\mathrm{head_1}, …, \mathrm{head_h})W^O$ from projected heads → (batch, len_q, d_model)."""
        return self.w_o(self.merge_heads(self.attend(q, k, v, per_head(mask))))

    def forward(self, query, key, value, mask=None):
        """query (batch, len_q, d_model), key/value (batch, len_k, d_model) → (batch, len_q, d_model)."""
        return self.combine(self.project_q(query), *self.project_kv(key, value), mask)


def per_head(mask):
    """A (batch, len_q|1, len_k) mask as (batch, 1, len_q|1, len_k): the same for every head (None stays None)."""
    return mask.unsqueeze(1) if mask is not None and mask.dim() == 3 else mask  # (batch, 1, len_q|1, len_k)


# %% [markdown]
# ### §3.2.3 Applications of Attention in our Model
#
# > The Transformer uses multi-head attention in three different ways:
# >
# > * In "encoder-decoder attention" layers, the queries come from the previous decoder
# >   layer, and the memory keys and values come from the output of the encoder. This allows
# >   every position in the decoder to attend over all positions in the input sequence.
# > * The encoder contains self-attention layers. In a self-attention layer all of the keys,
# >   values and queries come from the same place, in this case, the output of the previous
# >   layer in the encoder. Each position in the encoder can attend to all positions in the
# >   previous layer of the encoder.
# > * Similarly, self-attention layers in the decoder allow each position in the decoder to
# >   attend to all positions in the decoder up to and including that position. We need to
# >   prevent leftward information flow in the decoder to preserve the auto-regressive
# >   property. We implement this inside of scaled dot-product attention by masking out
# >   (setting to $-\infty$) all values in the input of the softmax which correspond to
# >   illegal connections.
#
# — §3.2.3
#
# In code the three uses differ only in their arguments: `EncoderLayer` calls
# `self_attn(x, x, x, src_mask)`; `DecoderLayer` calls `self_attn(y, y, y, tgt_mask)` with
# the causal mask and then `src_attn(y, memory, memory, src_mask)`.

# %% [markdown]
# ## §3.3 Position-wise Feed-Forward Networks
#
# > In addition to attention sub-layers, each of the layers in our encoder and decoder
# > contains a fully connected feed-forward network, which is applied to each position
# > separately and identically. This consists of two linear transformations with a ReLU
# > activation in between.
# >
# > $$\mathrm{FFN}(x)=\max(0, xW_1 + b_1) W_2 + b_2$$
# >
# > While the linear transformations are the same across different positions, they use
# > different parameters from layer to layer. Another way of describing this is as two
# > convolutions with kernel size 1. The dimensionality of input and output is
# > $d_{\text{model}}=512$, and the inner-layer has dimensionality $d_{ff}=2048$.
#
# — §3.3, Eq. 2
#
# The paper puts no dropout inside the FFN. The Harvard notebook (and `torch.nn.Transformer`)
# add one after the ReLU; we keep it as an option, `ffn_dropout`, off by default.

# %%
class PositionwiseFeedForward(nn.Module):
    r"""Position-wise feed-forward network — §3.3, Eq. 2: $\max(0, xW_1 + b_1)W_2 + b_2$."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        """(batch, len, d_model) → (batch, len, d_model)."""
        return self.w_2(self.dropout(self.w_1(x).relu()))


# %% [markdown]
# ## §3.4 Embeddings and Softmax
#
# > Similarly to other sequence transduction models, we use learned embeddings to convert
# > the input tokens and output tokens to vectors of dimension $d_{\text{model}}$. We also
# > use the usual learned linear transformation and softmax function to convert the decoder
# > output to predicted next-token probabilities. In our model, we share the same weight
# > matrix between the two embedding layers and the pre-softmax linear transformation,
# > similar to […]. In the embedding layers, we multiply those weights by
# > $\sqrt{d_{\text{model}}}$.
#
# — §3.4
#
# Sharing one matrix between *both* embeddings and the output projection needs one
# vocabulary for source and target; the paper had that (a shared BPE vocabulary, §5.1), and
# so do our data pipelines by default. With separate vocabularies only the target embedding
# and the output projection can share (two-way tying). `make_model` does whichever applies;
# `tie_weights=False` turns sharing off.

# %%
class Embeddings(nn.Module):
    r"""Learned token embeddings scaled by $\sqrt{d_{\text{model}}}$ — §3.4."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        """Token ids (batch, len) → (batch, len, d_model)."""
        return self.lut(x) * math.sqrt(self.d_model)


# %% [markdown]
# ## §3.5 Positional Encoding
#
# > Since our model contains no recurrence and no convolution, in order for the model to make
# > use of the order of the sequence, we must inject some information about the relative or
# > absolute position of the tokens in the sequence. To this end, we add "positional
# > encodings" to the input embeddings at the bottoms of the encoder and decoder stacks. The
# > positional encodings have the same dimension $d_{\text{model}}$ as the embeddings, so
# > that the two can be summed.
#
# > In this work, we use sine and cosine functions of different frequencies:
# > $$PE_{(pos,2i)} = sin(pos / 10000^{2i/d_{\text{model}}}) \\
# >   PE_{(pos,2i+1)} = cos(pos / 10000^{2i/d_{\text{model}}})$$
# > where $pos$ is the position and $i$ is the dimension. That is, each dimension of the
# > positional encoding corresponds to a sinusoid. The wavelengths form a geometric
# > progression from $2\pi$ to $10000 \cdot 2\pi$. We chose this function because we
# > hypothesized it would allow the model to easily learn to attend by relative positions,
# > since for any fixed offset $k$, $PE_{pos+k}$ can be represented as a linear function of
# > $PE_{pos}$.
#
# — §3.5
#
# The linear function is a rotation: for each frequency $\omega_i$ the pair
# $(\sin \omega_i pos, \cos \omega_i pos)$ is turned by the angle $\omega_i k$, whatever
# $pos$ is. A test fits that linear map on some positions and checks it on others. §5.4 adds
# dropout to the sum of embeddings and encodings, so it lives here.

# %%
class PositionalEncoding(nn.Module):
    r"""Sinusoidal positional encoding added to the embeddings, then dropout — §3.5, §5.4.

    $PE_{(pos,2i)} = \sin(pos/10000^{2i/d_{\text{model}}})$,
    $PE_{(pos,2i+1)} = \cos(pos/10000^{2i/d_{\text{model}}})$.
    """

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model/2,)
        angle = pos / 10000 ** (two_i / d_model)  # (max_len, d_model/2)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle)
        self.register_buffer("pe", pe.float().unsqueeze(0), persistent=False)  # (1, max_len, d_model)

    def forward(self, x, offset: int = 0):
        """(batch, len, d_model) → same shape, with PE of positions offset … offset+len−1 added, then dropout.

        ``offset`` is for incremental decoding, which feeds one position at a time.
        """
        end = offset + x.size(1)
        if end > self.pe.size(1):
            raise ValueError(f"sequence of length {end} exceeds max_len={self.pe.size(1)}")
        return self.dropout(x + self.pe[:, offset:end].to(x.dtype))


if EXAMPLES:
    pe = PositionalEncoding(d_model=20, dropout=0.0)
    y = pe(torch.zeros(1, 100, 20))
    fig, ax = plt.subplots(figsize=(8, 3))
    for dim in (4, 5, 6, 7):
        ax.plot(y[0, :, dim].numpy(), label=f"dim {dim}")
    ax.set_xlabel("position")
    ax.set_title("Positional encoding, a few dimensions (d_model = 20)")
    ax.legend()
    plt.show()
    del pe, y, fig, ax, dim

# %% [markdown]
# > We also experimented with using learned positional embeddings […] instead, and found
# > that the two versions produced nearly identical results (see Table […] row (E)). We
# > chose the sinusoidal version because it may allow the model to extrapolate to sequence
# > lengths longer than the ones encountered during training.
#
# — §3.5
#
# The learned alternative is one matrix of `max_len` rows, one trainable vector per position,
# added exactly where the sinusoid is added and with the same `offset` argument, so the rest
# of the model — the incremental decoder, beam search, checkpoints — does not know which of
# the two it holds. `ModelConfig.positional` chooses (`"sinusoid"`, the paper's choice, by
# default); Part 4 trains both on Multi30k to see whether "nearly identical" holds at our
# scale. Like every matrix of the model it starts from `make_model`'s Glorot/Xavier
# initialisation (the paper does not say how its learned positions started).

# %%
class LearnedPositionalEncoding(nn.Module):
    r"""Learned positional embeddings, the alternative of §3.5 (Table 3, row (E)), then §5.4's dropout.

    Position $pos$ gets a trained vector $P_{pos} \in \mathbb{R}^{d_{\text{model}}}$; the same
    interface as :class:`PositionalEncoding`.
    """

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))  # (max_len, d_model); make_model initialises it

    def forward(self, x, offset: int = 0):
        """(batch, len, d_model) → same shape, with the vectors of positions offset … offset+len−1 added."""
        end = offset + x.size(1)
        if end > self.weight.size(0):
            raise ValueError(f"sequence of length {end} exceeds max_len={self.weight.size(0)}")
        return self.dropout(x + self.weight[offset:end].to(x.dtype))  # (len, d_model) broadcast over the batch


POSITIONAL = MappingProxyType({"sinusoid": PositionalEncoding, "learned": LearnedPositionalEncoding})

# %% [markdown]
# ## Aside: the fast path
#
# The readable `MultiHeadedAttention` of §3.2.2 spells out every step. `FastMultiHeadedAttention` computes the
# same function with the same parameters (so checkpoints move freely between the two), but
# (1) when query, key and value are one tensor (self-attention) it does the three
# projections as one fused matrix product, and (2) it calls
# `torch.nn.functional.scaled_dot_product_attention`, which picks a fused kernel
# (FlashAttention or memory-efficient attention on a GPU) and never materialises the
# attention weights. A test shows both give the same numbers.
#
# "Fast" is a claim about a device, and on a CPU it does not hold at our sentence lengths.
# Profiled on a 2-core AMD EPYC with native bf16 (`benchmarks/profile_step.py`, training
# steps on `multi30k-small` batches): in float32 both paths spend about two thirds of a step
# in matrix products and train at the same speed (2,214 and 2,174 target tokens/s in
# `make bench`); in bf16, SDPA runs PyTorch's CPU flash-attention kernel, whose backward
# pass alone took 36% of the step (23 ms a call, about 200 ms a step, where the readable
# path's batched products and softmaxes of all layers took about 25 ms), so the readable
# path trains 1.6× faster (4,955 against 3,083). The fused projection (`torch.cat` of three
# weight matrices) costs little beside that.
# So `ModelConfig.attention` is `"auto"` by default, decided once per run by `resolve_attention`
# and written in the run log like the precision: the fused path on a GPU, the readable one on a
# CPU; `"readable"` and `"fast"` override it. In float32 neither path gets far ahead of `torch.nn.Transformer`
# by its attention: 65–75% of every model's step are the same matrix products, already near the CPU's measured
# matmul peak (183–190 against 194–196 GFLOP/s on the slower of two EPYCs), so what the readable path saves in
# the attention core came to about 1.05×; drawing the dropout masks with compiled code (below) took it to
# 1.12× (README, "What took float32 past 1.1×").

# %%
class FastMultiHeadedAttention(MultiHeadedAttention):
    r"""Multi-head attention — §3.2.2, fused projections and PyTorch's SDPA kernel.

    Same parameters and same function as :class:`MultiHeadedAttention`; the attention
    weights are never materialised.
    """

    def forward(self, query, key, value, mask=None):
        """query (batch, len_q, d_model), key/value (batch, len_k, d_model) → (batch, len_q, d_model)."""
        if query is key and key is value:  # self-attention: the three projections as one product
            weight = torch.cat([self.w_q.weight, self.w_k.weight, self.w_v.weight])  # (3·d_model, d_model)
            bias = torch.cat([self.w_q.bias, self.w_k.bias, self.w_v.bias])
            q, k, v = F.linear(query, weight, bias).chunk(3, dim=-1)  # 3 × (batch, len, d_model)
            return self.combine(self.split_heads(q), self.split_heads(k), self.split_heads(v), mask)
        return super().forward(query, key, value, mask)

    def project_kv(self, key, value):
        """Both projections as one product when key and value are one tensor (the encoder output)."""
        if key is not value:
            return super().project_kv(key, value)
        weight = torch.cat([self.w_k.weight, self.w_v.weight])  # (2·d_model, d_model)
        bias = torch.cat([self.w_k.bias, self.w_v.bias])
        k, v = F.linear(key, weight, bias).chunk(2, dim=-1)  # 2 × (batch, len_k, d_model)
        return self.split_heads(k), self.split_heads(v)  # (batch, h, len_k, d_k)

    def attend(self, q, k, v, mask=None):
        """Eq. 1 through PyTorch's fused kernel; same shapes as :meth:`MultiHeadedAttention.attend`."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout.p if self.training else 0.0
        )  # (batch, h, len_q, d_k)

def resolve_attention(setting: str, device: Optional[torch.device] = None) -> tuple[str, str]:
    """Decide ``ModelConfig.attention`` ("auto" | "readable" | "fast") for ``device``: (path, a line for the log).

    ``auto``: the fused path on CUDA, where SDPA has fused kernels; the readable one elsewhere
    (on a CPU it is as fast or faster at our sentence lengths — measured in the aside).
    """
    if setting not in ("auto", "readable", "fast"):
        raise ValueError(f"attention must be auto, readable or fast, not {setting!r}")
    if setting != "auto":
        return setting, f"attention: {setting} path (asked for)"
    kind = "cpu" if device is None else torch.device(device).type  # make_model builds on the CPU
    path = "fast" if kind == "cuda" else "readable"
    why = ("SDPA's fused kernels on CUDA" if path == "fast"
           else f"on {kind} the readable path is as fast or faster at our sentence lengths")
    return path, f"attention: {path} path (auto: {why})"


# %% [markdown]
# Dropout (§5.4) has a cost of its own on a CPU. `nn.Dropout` draws its mask with
# `bernoulli_`, one random number per element; in the same profile those draws were about 6% of a
# float32 step and 12% of a bf16 one (about 3 ms for each of the 17 dropouts of a
# `multi30k-small` step), more than all the attention products.
#
# `FastDropout` draws the same kind of mask from a quarter of the random numbers: each 64-bit
# draw gives four 15-bit uniform integers, and an element is kept when its integer is at least
# $\mathrm{round}(P_{drop} \cdot 2^{15})$. The dropout probability is therefore rounded to a
# multiple of $2^{-15}$ (0.1 becomes 0.100006) and kept elements are scaled by $1/(1-P_{drop})$
# of that rounded value, so the expected output is still exactly the input (in float32; in bf16
# the scale is rounded, as `nn.Dropout` rounds it).
#
# It is faster. Profiled the same way (`benchmarks/profile_step.py --paths
# readable,readable/FastDropout`), a mask cost 2.5 ms a call in `bernoulli_` and 0.38 ms in
# `FastDropout`'s `random_`; training steps of `multi30k-small` were 1.03× (float32) and 1.13×
# (bf16) faster with it than with `nn.Dropout` in `make bench`, those of `iwslt14-sample` (which
# also drops out attention weights and FFN activations) 1.17× and 1.4×. But its masks are other
# masks, so a run takes another path, and three seeded pairs of `multi30k-small` runs (test BLEU,
# beam 4) do not show whether it trains as well:
#
# | seed | `nn.Dropout`'s masks | `FastDropout` | difference |
# |---|---|---|---|
# | 1 (the headline run) | 41.79 | 40.62 | −1.18 |
# | 2 | 40.48 | 39.93 | −0.54 |
# | 3 | 40.85 | 41.68 | +0.83 |
#
# On IWSLT14 its run scored 6.3 against the preset's 7.4 then (with label smoothing 0.1), and its
# faster steps spent on 37 epochs of `iwslt14-sample` instead of 30 gave 7.7 greedy BLEU on the
# first 1,000 validation sentences against the preset's 8.0 then (3 decoder layers; README). So
# `ModelConfig.fast_dropout` is off by default, and the presets' reported runs repeat exactly: set
# it and `make_model` swaps `FastDropout` in for every `nn.Dropout` of the model. On a GPU it is
# `nn.Dropout` anyway (PyTorch's fused kernel is faster there). And since `nn.Dropout`'s own masks
# are drawn by compiled code (below), it is no faster on a CPU either: in `make bench` the
# preset ran at 0.99× its speed in float32 and 1.02× in bf16.

# %%
class FastDropout(nn.Dropout):
    r"""Dropout — §5.4, with a cheaper random mask on the CPU (four keep/drop decisions per 64-bit draw).

    Drops an element with probability $p' = \mathrm{round}(p \cdot 2^{15}) / 2^{15}$
    ($|p' - p| \le 2^{-16}$) and scales the kept ones by $1/(1-p')$. Off the CPU, and in eval
    mode, it is :class:`torch.nn.Dropout`.
    """

    def forward(self, x):
        threshold = round(self.p * 2**15)  # drop when a uniform 15-bit integer is below this
        if not self.training or threshold == 0 or threshold >= 2**15 or x.device.type != "cpu":
            return super().forward(x)
        words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device).random_()  # 63 random bits each
        bits = words.view(torch.int16)[: x.numel()].view(x.shape) & 0x7FFF  # (x.shape) uniform in [0, 2^15)
        return x * (bits >= threshold).to(x.dtype).mul_(2**15 / (2**15 - threshold))


# %% [markdown]
# `nn.Dropout`'s own mask (§5.4's dropout) can be drawn faster too, without changing a single number. Where
# PyTorch's CPU `bernoulli_(q)` runs its default kernel (everywhere but with Intel's MKL on
# Intel CPUs), it takes one 64-bit draw $x$ from the generator per element, in order, and keeps
# the element when $(x \bmod 2^{53}) \cdot 2^{-53} < q$. `random_(0, 2**53)` on an int64 tensor takes the
# same draws from the same generator and returns $x \bmod 2^{53}$, faster, and comparing them with
# $\lceil q \cdot 2^{53} \rceil$ gives the same mask; dividing it by $q$ is what `nn.Dropout` multiplies
# its input by. Profiled on the faster of two 2-core EPYCs, a mask took 1.5 ms instead of 2.4; training steps
# were 1.02× faster in bf16 for `multi30k-small` (`make bench`) and about 1.1× for `iwslt14-sample`,
# which has more dropout.

# %%
def _replayed_scaled_mask(shape: torch.Size, q: float, dtype: torch.dtype) -> torch.Tensor:
    """§5.4's dropout mask divided by ``q``, replayed (our addition): ``bernoulli_(q)``'s mask from the
    generator's next draws, taken with ``random_`` (see the cell above)."""
    draws = torch.empty(shape, dtype=torch.int64).random_(0, 2**53)  # (shape) the 64-bit draws mod 2^53
    return (draws < math.ceil(q * 2**53)).to(dtype).div_(q)  # nn.Dropout's mask / q


# %% [markdown]
# What is left of a dropout mask's time (§5.4) is the draws themselves: PyTorch's Mersenne Twister (MT19937) hands
# out one 32-bit word at a time, and a `multi30k-small` mask needs 1.2 million of them, about 2 ms
# on one core while the other waits. The generator's arithmetic is simple enough to do a block of
# 624 words at once, which a compiler turns into vector instructions. So `csrc/dropout_mask.c` (about a
# hundred lines of our C, built by `make` into `build/dropout_mask.so`) reads the generator's state from
# `torch.get_rng_state()`, draws the words a block at a time, writes the scaled mask directly and
# puts the advanced state back: the same generator and the same arithmetic, so the same masks.
# Timed alone on the slower of two 2-core EPYCs (`benchmarks/dropout_masks.py`), a float32
# `multi30k-small` mask took 0.35 ms with it, 2.70 ms with the replay above and 3.61 ms with
# `bernoulli_` and the division by $q$, and `make bench` there found training steps 1.06×
# faster in float32 and 1.11× in bf16 than with the replay. Where nothing is built (no C compiler, or
# the notebook opened without `make`) or the kernel does not reproduce `bernoulli_`, the replay draws
# the masks.

# %%
# `make` builds it from csrc/dropout_mask.c, next to this file (in the notebook: in the working directory)
DROPOUT_KERNEL = (Path(__file__).parent if "__file__" in globals() else Path()) / "build" / "dropout_mask.so"
DROPOUT_KERNEL_INTERFACE = 1  # the version of dropout_mask's arguments this module calls it with


def load_dropout_kernel(path: Optional[str] = None):
    """The compiled mask kernel, ``csrc/dropout_mask.c`` (our addition, for §5.4's dropout), as a ``ctypes`` library.

    ``path`` defaults to ``ANNOTATED_TRANSFORMER_KERNEL`` or :data:`DROPOUT_KERNEL`. None where
    nothing is built there, it does not load, or it was built for other arguments or another layout
    of the generator's state. It is called holding Python's lock (``PyDLL``), as ``bernoulli_`` draws
    holding the generator's, so that no other Python thread draws between reading and writing the state.
    """
    path = Path(path or os.environ.get("ANNOTATED_TRANSFORMER_KERNEL") or DROPOUT_KERNEL)
    if not path.is_file():
        return None
    try:
        lib = ctypes.PyDLL(str(path.resolve()))
        if (lib.dropout_mask_interface() != DROPOUT_KERNEL_INTERFACE
                or lib.dropout_mask_state_bytes() != torch.get_rng_state().numel()):
            return None
    except (OSError, AttributeError):  # not a library, or not this one
        return None
    lib.dropout_mask.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int]
    lib.dropout_mask.restype = ctypes.c_int
    return lib


def _kernel_scaled_mask(lib, shape: torch.Size, q: float, dtype: torch.dtype) -> torch.Tensor:
    """§5.4's dropout mask divided by ``q``, drawn by the compiled kernel ``lib`` from the default CPU
    generator, which it advances as ``bernoulli_`` would (our addition)."""
    state = torch.get_rng_state()  # a copy of the generator's state: the kernel advances it in place
    out = torch.empty(shape, dtype=dtype)
    kept = torch.ones(1, dtype=dtype).div_(q)  # what nn.Dropout's mask / q holds where it keeps: 1/q in dtype
    bits = int.from_bytes(bytes(kept.view(torch.uint8).tolist()), sys.byteorder)
    if lib.dropout_mask(state.data_ptr(), math.ceil(q * 2**53), bits, out.data_ptr(), out.numel(),
                        out.element_size()) != 0:
        raise RuntimeError("the dropout kernel does not recognise the generator's state")
    torch.set_rng_state(state)
    return out


# %% [markdown]
# `mask_drawer` decides how §5.4's masks are drawn, once per probability and dtype, by one draw made each way from the same
# generator state: the kernel where it is built and gives `bernoulli_`'s scaled mask and leaves the
# generator where `bernoulli_` does, else the replay where that holds, else nothing.
# `SameMaskDropout` draws with what it returns and is `nn.Dropout` everywhere else (another
# `bernoulli_` kernel, a GPU, evaluation, `torch.compile`). So it changes no computed number, only
# the time: `make_model` puts it in place of every `nn.Dropout` unless `fast_dropout` asks for
# `FastDropout`.

# %%
@functools.lru_cache(maxsize=None)
def mask_drawer(q: float, dtype: torch.dtype, kernel: bool = True) -> Optional[Callable]:
    """How to draw ``nn.Dropout``'s mask / ``q`` exactly on this machine (our addition, for §5.4's dropout).

    Returns ``draw(shape, q, dtype)``: the compiled kernel where it is built (and ``kernel``) and
    reproduces this PyTorch's CPU ``bernoulli_(q)`` on ``dtype`` (the same scaled mask and the
    generator left in the same state), else the ``random_`` replay where that does, else None (use
    ``nn.Dropout``). A way that fails in any manner is passed over. Checked once per (q, dtype,
    kernel) and remembered: the answer is a fact about the PyTorch build, the CPU and what is
    built, the module's one deliberate cache. The caller's random stream is left untouched.
    """
    n = 1 << 17  # past any grain at which a kernel could split the work
    lib = load_dropout_kernel() if kernel and dtype.itemsize in (2, 4) else None
    candidates = ([functools.partial(_kernel_scaled_mask, lib)] if lib is not None else []) + [_replayed_scaled_mask]
    with torch.random.fork_rng(devices=[]):
        start = torch.get_rng_state()
        want = torch.empty(n, dtype=dtype).bernoulli_(q).div_(q)  # nn.Dropout's mask / q
        after = torch.get_rng_state()
        for draw in candidates:
            torch.set_rng_state(start)
            try:
                if torch.equal(draw(torch.Size([n]), q, dtype), want) and torch.equal(after, torch.get_rng_state()):
                    return draw
            except (RuntimeError, ValueError):  # e.g. a generator state the kernel or PyTorch refuses
                continue
    return None


class SameMaskDropout(nn.Dropout):
    r"""Dropout — §5.4: exactly ``nn.Dropout`` (mask, scaling and random stream), its mask drawn faster on a CPU."""

    kernel = True  # draw with the compiled kernel where mask_drawer finds it exact

    def forward(self, x):
        q = 1 - self.p  # keep probability, as nn.Dropout computes it
        draw = (mask_drawer(q, x.dtype, self.kernel) if self.training and 0 < self.p < 1 and not self.inplace
                and x.device.type == "cpu" and x.is_contiguous() and not torch.compiler.is_compiling() else None)
        if draw is None:
            return super().forward(x)
        return x * draw(x.shape, q, x.dtype)  # nn.Dropout's own ops: mask, mask / q, x * that


def use_dropout(model: nn.Module, kind: type) -> nn.Module:
    """Replace every dropout module (§5.4) of ``model`` by a ``kind`` of the same probability."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Dropout) and type(child) is not kind:
                setattr(parent, name, kind(child.p, inplace=child.inplace))
    return model


# %% [markdown]
# ## The full model
#
# §3's Figure 1, assembled. The model's sizes are named as in the paper and collected in one
# frozen dataclass, `ModelConfig`; `base` and `big` are Table 3's two models and `tiny` is
# for tests and examples. (The settings of a training run — data, optimizer, schedule,
# checkpoints — extend it in Part 2 as `Config`.) Change a copy with `dataclasses.replace`.

# %%
SAME_WEIGHTS = MappingProxyType({"same_weights": True})  # field metadata: changes the computation, not the weights


@dataclass(frozen=True)
class ModelConfig:
    """The model's settings — §3 and Table 3 (base model by default); names as in the paper.

    Fields marked ``SAME_WEIGHTS`` can differ between a checkpoint and the model loading it.
    """

    N: int = 6  # layers per stack
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    P_drop: float = field(default=0.1, metadata=SAME_WEIGHTS)  # residual dropout, §5.4
    norm_first: bool = False  # False: post-norm as in §3.1; True: pre-norm (departure)
    ffn_dropout: float = field(default=0.0, metadata=SAME_WEIGHTS)  # dropout inside the FFN (not in the paper)
    attn_dropout: float = field(default=0.0, metadata=SAME_WEIGHTS)  # on attention weights (not in the paper)
    tie_weights: bool = True  # §3.4 weight sharing
    shared_vocab: bool = True  # one vocabulary for both languages: three-way sharing (§3.4, §5.1)
    attention: str = field(default="auto", metadata=SAME_WEIGHTS)  # "readable", "fast" (aside after §3.5) or "auto"
    max_len: int = 5000  # longest sequence the positional encoding covers
    positional: str = "sinusoid"  # "sinusoid" (§3.5) or "learned" (§3.5's alternative, Table 3 row (E))
    fast_dropout: bool = field(default=False, metadata=SAME_WEIGHTS)  # FastDropout on a CPU (aside after §3.5)
    # whole tokens' embeddings dropped in training (not in the paper; see WordDropout); a weight field because its
    # module sits between the embedding and a learned positional table, whose parameter names it shifts
    word_dropout: float = 0.0
    N_dec: int = 0  # decoder layers where they differ from N (not in the paper, §3.1 has N of each); 0: N

    @property
    def d_k(self) -> int:
        """d_k = d_v = d_model / h (§3.2.2)."""
        return self.d_model // self.h

    @property
    def decoder_layers(self) -> int:
        """The decoder's depth: N, as in §3.1, unless ``N_dec`` sets another."""
        return self.N_dec or self.N


MODEL_PRESETS = MappingProxyType({
    "base": ModelConfig(),
    "big": ModelConfig(d_model=1024, d_ff=4096, h=16, P_drop=0.3),
    "tiny": ModelConfig(N=2, d_model=32, d_ff=64, h=4, max_len=512),
})


def weight_fields() -> tuple:
    """The ModelConfig fields that decide the parameters (a checkpoint must agree on all of them)."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if not f.metadata.get("same_weights"))


# %% [markdown]
# *Word dropout (our addition, for small data; not in §5.4).* §5.4's dropout drops single
# numbers of a vector. Word dropout, which Sennrich & Zhang (2019) found useful for
# low-resource translation, drops whole tokens: in training, each source and target token's
# embedding is zeroed with probability `word_dropout` (the others scaled by $1/(1-p)$, as
# dropout does) before its position is added, so the model must guess it from the context.
# No preset uses it (`word_dropout=0.0`); `make_model` leaves it out then.

# %%
class WordDropout(nn.Module):
    r"""Drops whole token embeddings in training (our addition for small data; §5.4 drops elements)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, seq, d_model) embeddings; each position zeroed with probability ``p`` in training."""
        if not self.training or self.p == 0:
            return x
        keep = torch.rand(x.shape[:-1], device=x.device) >= self.p  # (batch, seq)
        return x * (keep.unsqueeze(-1).to(x.dtype) / (1 - self.p))  # (batch, seq, 1) broadcast over d_model


# %% [markdown]
# `make_model` assembles the stacks from the parts above: $N$ layers in each, as in §3.1 (`N_dec`, 0
# by default, gives the decoder another depth; `iwslt14-sample` uses 2 under an encoder of 3). Parameters are initialised with
# Glorot/Xavier uniform, a choice the paper does not state (see the reproduction notes).
# Weight sharing (§3.4) is done by making the modules hold *the same* `nn.Parameter`, so it is one
# tensor, updated once per step.

# %%
def make_model(src_vocab: int, tgt_vocab: int, config: Optional[ModelConfig] = None,
               **overrides) -> EncoderDecoder:
    r"""Build the Transformer of §3 (Figure 1) from a :class:`ModelConfig` (or a training :class:`Config`).

    ``overrides`` replace config fields (``make_model(11, 11, N=2)``). With
    ``tie_weights``, the target embedding and the pre-softmax projection share one matrix
    (§3.4); with ``shared_vocab`` too, the source embedding shares it as well (three-way).
    Every dropout is a :class:`SameMaskDropout` (``nn.Dropout``'s numbers), or a
    :class:`FastDropout` with ``fast_dropout``.
    """
    cfg = dataclasses.replace(config or MODEL_PRESETS["base"], **overrides)
    mha = FastMultiHeadedAttention if resolve_attention(cfg.attention)[0] == "fast" else MultiHeadedAttention
    attn = mha(cfg.h, cfg.d_model, cfg.attn_dropout)
    ff = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.ffn_dropout)
    position = POSITIONAL[cfg.positional]
    words = [WordDropout(cfg.word_dropout)] if cfg.word_dropout else []  # between embedding and position
    c = copy.deepcopy
    model = EncoderDecoder(
        Encoder(EncoderLayer(cfg.d_model, c(attn), c(ff), cfg.P_drop, cfg.norm_first), cfg.N, cfg.norm_first),
        Decoder(DecoderLayer(cfg.d_model, c(attn), c(attn), c(ff), cfg.P_drop, cfg.norm_first), cfg.decoder_layers,
                cfg.norm_first),
        nn.Sequential(Embeddings(cfg.d_model, src_vocab), *words, position(cfg.d_model, cfg.P_drop, cfg.max_len)),
        nn.Sequential(Embeddings(cfg.d_model, tgt_vocab), *c(words), position(cfg.d_model, cfg.P_drop, cfg.max_len)),
        Generator(cfg.d_model, tgt_vocab),
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    use_dropout(model, FastDropout if cfg.fast_dropout else SameMaskDropout)
    if cfg.tie_weights:
        model.generator.proj.weight = model.tgt_embed[0].lut.weight
        if cfg.shared_vocab:
            if src_vocab != tgt_vocab:
                raise ValueError("shared_vocab=True needs src_vocab == tgt_vocab")
            model.src_embed[0].lut.weight = model.tgt_embed[0].lut.weight
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (a shared tensor counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


if EXAMPLES and PROFILE == "full":  # two large models: skipped in the smoke profile
    for name in ("base", "big"):
        m = make_model(37000, 37000, MODEL_PRESETS[name])
        print(f"{name}: {count_parameters(m) / 1e6:.1f}M parameters with a shared 37,000-token vocabulary")
    del m, name

# %% [markdown]
# The paper's Table 3 lists 65M parameters for the base model and 213M for the big one.
# Our counts above are within 3% of those (63.1M and 214.3M); the paper does not give its
# exact vocabulary size or say which tensors it counted.
#
# ## §4 Why Self-Attention
#
# §4 compares a self-attention layer with recurrent and convolutional layers on three
# counts: the work per layer, how many steps must run one after another, and the longest
# path a signal travels between two positions. Its Table 1, for a sequence of length $n$,
# representation size $d$, kernel width $k$ and neighbourhood $r$:
#
# | layer type | complexity per layer | sequential operations | maximum path length |
# |---|---|---|---|
# | self-attention | $O(n^2 \cdot d)$ | $O(1)$ | $O(1)$ |
# | recurrent | $O(n \cdot d^2)$ | $O(n)$ | $O(n)$ |
# | convolutional | $O(k \cdot n \cdot d^2)$ | $O(1)$ | $O(\log_k(n))$ |
# | self-attention (restricted) | $O(r \cdot n \cdot d)$ | $O(1)$ | $O(n/r)$ |
#
# In our words: self-attention connects every pair of positions in a single step, so the
# path between any two words is one layer long and all positions are computed at once; an
# RNN must walk the sequence, one step per token. The price is the $n^2$ term: attention
# costs less than a recurrent layer only while $n < d$, which holds for sentences
# (tens of tokens) against $d_{\text{model}} = 512$. The small measurement below times one
# self-attention layer against one `nn.LSTM` layer of the same width. On a CPU, where both
# are limited by arithmetic rather than by parallelism, it mostly shows the $n^2$ term:
# attention's time grows faster with $n$ than the LSTM's. What Table 1 counts in
# attention's favour — $O(1)$ sequential operations instead of $O(n)$ — pays off on
# parallel hardware, which a 2-core CPU is not.

# %%
def time_layer(fn, *args, repeats: int = 3) -> float:
    """Best wall-clock time of ``fn(*args)`` in milliseconds over ``repeats`` runs."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


if EXAMPLES:
    d = 256
    self_attn, lstm = MultiHeadedAttention(8, d, 0.0).eval(), nn.LSTM(d, d, batch_first=True).eval()
    print(" n   self-attention (ms)   LSTM (ms)")
    for n in (16, 64, 256):
        x = torch.randn(8, n, d)
        print(f"{n:3d}   {time_layer(self_attn, x, x, x):10.2f}   {time_layer(lstm, x):14.2f}")
    del d, self_attn, lstm, n, x

# %% [markdown]
# # Part 2 — Training
#
# > This section describes the training regime for our models.
#
# — §5
#
# ## §5.1 Training Data and Batching
#
# > We trained on the standard WMT 2014 English-German dataset consisting of about 4.5
# > million sentence pairs. Sentences were encoded using byte-pair encoding […], which has a
# > shared source-target vocabulary of about 37000 tokens.
#
# > Sentence pairs were batched together by approximate sequence length. Each training batch
# > contained a set of sentence pairs containing approximately 25000 source tokens and 25000
# > target tokens.
#
# — §5.1
#
# WMT 2014 needs days of GPU time, so we train German→English on two smaller, standard
# sets instead (both are described in the reproduction notes; how the files are found or
# downloaded is in the Appendix):
#
# * **Multi30k** (image captions, 29,000 training pairs, raw cased text): encoded with a
#   joint BPE vocabulary (below); scored with detokenized, cased sacreBLEU.
# * **IWSLT14** (TED talks, 160,239 training pairs): the common fairseq-prepared layout —
#   Moses-tokenized, lowercased, one sentence per line. Published IWSLT14 numbers are
#   *tokenized* BLEU on this text, so that is how we score it too.
#
# ## §5.2 Hardware and Schedule
#
# > We trained our models on one machine with 8 NVIDIA P100 GPUs. For our base models using
# > the hyperparameters described throughout the paper, each training step took about 0.4
# > seconds. We trained the base models for a total of 100,000 steps or 12 hours.
#
# — §5.2
#
# We have two CPU cores, so our runs are far smaller: the `multi30k-small` preset trains a
# 3-layer, $d_{\text{model}}=256$ model for 15 epochs (about 3,200 updates of ~2,500 tokens)
# in about 18 minutes, and Part 4 scores that run. The code is the same on a GPU
# (`--device cuda`), where bf16 and several processes make the paper's batch sizes
# practical.

# %% [markdown]
# ### One record per data set
#
# Everything the program knows about a data set is in one `Corpus` record: its languages,
# its files, where they are published and the checksums pinned for them, how word-level
# text is tokenized, how output is turned back into the references' form, and how BLEU is
# scored. Finding, downloading, reading, decoding and scoring all consult the record, so a
# new data set in a known form (raw text, or text already tokenized) is one more record
# here. The copy task of Part 4 is a record too: generated, with no files.

# %%
@dataclass(frozen=True)
class Corpus:
    """One data set, as every part of the program needs it (our addition; §5.1 names the paper's)."""

    name: str
    src: str = "de"  # source language
    tgt: str = "en"  # target language
    files: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # split → (source file, target file) in the data set's folder
    url: str = ""  # where the files are published (a folder), or the one archive that holds them
    sha256: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # file → pinned SHA-256 of the download; others unchecked
    prepare: str = ""  # "": the files are downloaded as they are; "fairseq-iwslt14": an archive to prepare
    sample: str = ""  # a split that stands in for "train" when only it is there (a training sample)
    valid_from_train: bool = False  # the validation pairs were held out of the training talks (may train; see Config)
    extra_tests: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # further test splits, looked for only when asked
    words: str = "whitespace"  # word-level tokenizer: "spacy" (its rules, for raw text) or "whitespace"
    detokenize: str = "join"  # words back to text: "moses" (sacremoses, for raw text) or "join" (with spaces)
    bleu_tokenize: str = "none"  # sacreBLEU's tokenizer: "13a" for raw, cased text; "none" for tokenized text
    synthetic: bool = False  # generated (the copy task), no files

    @property
    def bleu_kind(self) -> str:
        """How its BLEU is described in logs and results, from how it is tokenized for scoring."""
        return "tokenized" if self.bleu_tokenize == "none" else "detokenized cased"


# %% [markdown]
# The three records. Multi30k's files are published one by one and pinned; IWSLT14 is
# published as the raw TED archive, which `prepare_iwslt14` (Appendix) turns into the
# standard layout, and a folder holding only its training sample still trains (Part 4).
# IWSLT14's validation pairs are every 23rd line of the training talks (`valid_from_train`),
# so a run may also train on all but the first `max_valid_sentences` of them
# (`Config.train_on_valid_rest`, off in every preset: tried on the sample, README).

# %%
CORPORA = MappingProxyType({c.name: c for c in (
    Corpus("copy", synthetic=True),
    Corpus("multi30k",  # raw, cased image captions; test = test2016 (flickr)
           files=MappingProxyType({"train": ("train.de.gz", "train.en.gz"), "valid": ("val.de.gz", "val.en.gz"),
                                   "test": ("test_2016_flickr.de.gz", "test_2016_flickr.en.gz")}),
           url="https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/",
           sha256=MappingProxyType({
               "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
               "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
               "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
               "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
               "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
               "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"}),
           extra_tests=MappingProxyType({  # the 2017 and 2018 shared tasks' test sets; no checksum known
               "test_2017_flickr": ("test_2017_flickr.de.gz", "test_2017_flickr.en.gz"),
               "test_2018_flickr": ("test_2018_flickr.de.gz", "test_2018_flickr.en.gz")}),
           words="spacy", detokenize="moses", bleu_tokenize="13a"),
    Corpus("iwslt14",  # TED talks, fairseq's layout: Moses-tokenized, lowercased (REPRODUCTION_NOTES.md)
           files=MappingProxyType({"train": ("train.de", "train.en"), "valid": ("valid.de", "valid.en"),
                                   "test": ("test.de", "test.en"),
                                   "train-sample": ("train-sample.de", "train-sample.en")}),
           url="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",  # the archive: not pinned
           prepare="fairseq-iwslt14", sample="train-sample", valid_from_train=True),
)})

# %% [markdown]
# ## Checking settings before any work
#
# A run that would fail — or silently do something else — because of a setting is stopped
# when its `Config` is made, with every wrong field named: a beam of 0, a warmup of 0, a
# dropout of 2, an `h` that does not divide `d_model` (§3.2.2 needs $d_k = d_{model}/h$),
# a CUDA device on a machine without one. The command line turns the message into one
# line and exit status 2 before it loads any data. The rules are one table.

# %%
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def _config_rules(c: "Config") -> list:
    """(field, holds, what it must be) for every numeric setting of a run — our addition: checked before any work."""
    def finite(x):
        return isinstance(x, (int, float)) and math.isfinite(x)

    def prob(x):  # a dropout or smoothing probability
        return finite(x) and 0 <= x < 1

    return [
        ("precision", c.precision in PRECISIONS, f"must be one of {', '.join(PRECISIONS)}"),
        ("vocab", c.vocab in ("bpe", "words"), "must be bpe or words"),
        ("N", c.N >= 1, "must be at least 1"), ("N_dec", c.N_dec >= 0, "must be 0 (as many as N) or more"),
        ("d_model", c.d_model >= 2 and c.d_model % 2 == 0, "must be even and at least 2 (§3.5: sine/cosine pairs)"),
        ("d_ff", c.d_ff >= 1, "must be at least 1"), ("h", c.h >= 1, "must be at least 1"),
        ("h", c.h >= 1 and c.d_model % c.h == 0, f"must divide d_model={c.d_model} (§3.2.2: d_k = d_model/h)"),
        ("P_drop", prob(c.P_drop), "must be in [0, 1)"), ("ffn_dropout", prob(c.ffn_dropout), "must be in [0, 1)"),
        ("attn_dropout", prob(c.attn_dropout), "must be in [0, 1)"), ("word_dropout", prob(c.word_dropout), "must be in [0, 1)"), ("max_len", c.max_len >= 3, "must be at least 3"),
        ("attention", c.attention in ("auto", "readable", "fast"), "must be auto, readable or fast"),
        ("positional", c.positional in POSITIONAL, f"must be one of {', '.join(POSITIONAL)}"),
        ("dataset", c.dataset in CORPORA, f"must be one of {', '.join(CORPORA)}"),
        ("bpe_size", c.bpe_size >= 8, "must be at least 8"), ("min_freq", c.min_freq >= 1, "must be at least 1"),
        ("bpe_dropout", prob(c.bpe_dropout) and (c.bpe_dropout == 0 or c.vocab == "bpe"),
         "must be in [0, 1), and 0 unless vocab is bpe"),
        ("max_tokens", c.max_tokens >= 1, "must be at least 1"),
        ("batch_tokens", c.batch_tokens >= 1, "must be at least 1"), ("warmup", c.warmup >= 1, "must be at least 1"),
        ("lr_factor", finite(c.lr_factor) and c.lr_factor > 0, "must be a finite number above 0"),
        ("cooldown", finite(c.cooldown) and 0 <= c.cooldown <= 1 and (c.cooldown == 0 or c.bpe_dropout == 0),
         "must be in [0, 1], and 0 with bpe_dropout (whose pieces, so the number of updates, change every epoch)"),
        ("betas", len(c.betas) == 2 and all(finite(b) and 0 <= b < 1 for b in c.betas),
         "must be two numbers in [0, 1), e.g. 0.9,0.98"),
        ("adam_eps", finite(c.adam_eps) and c.adam_eps > 0, "must be a finite number above 0"),
        ("weight_decay", finite(c.weight_decay) and c.weight_decay >= 0, "must be a finite number, 0 or more"),
        ("eps_ls", prob(c.eps_ls), "must be in [0, 1)"), ("accum_steps", c.accum_steps >= 1, "must be at least 1"),
        ("clip_grad", finite(c.clip_grad) and c.clip_grad >= 0, "must be a finite number, 0 or more"),
        ("epochs", c.epochs >= 1, "must be at least 1"),
        ("max_steps", c.max_steps >= 0, "must be 0 (no limit) or more"),
        ("keep_checkpoints", c.keep_checkpoints >= 1, "must be at least 1"),
        ("checkpoint_minutes", finite(c.checkpoint_minutes) and c.checkpoint_minutes >= 0,
         "must be a finite number, 0 (off) or more"),
        ("average_last", c.average_last >= 0, "must be 0 or more"),
        ("max_decode_extra", c.max_decode_extra >= 0, "must be 0 or more"),
        ("beam_size", c.beam_size >= 1, "must be at least 1 (1 = greedy)"),
        ("length_penalty_alpha", finite(c.length_penalty_alpha) and c.length_penalty_alpha >= 0,
         "must be a finite number, 0 or more"),
        ("eval_batch_size", c.eval_batch_size >= 1, "must be at least 1"),
        ("max_eval_sentences", c.max_eval_sentences >= 0, "must be 0 (all) or more"),
        ("max_valid_sentences", c.max_valid_sentences >= 0, "must be 0 (all) or more"),
        ("train_on_valid_rest", not c.train_on_valid_rest or (c.max_valid_sentences > 0 and c.dataset in CORPORA
                                                              and CORPORA[c.dataset].valid_from_train),
         "needs max_valid_sentences > 0 (the pairs kept for validation) and a data set whose validation "
         "pairs come from its training data (iwslt14)"),
        ("examples_to_show", c.examples_to_show >= 0, "must be 0 or more"),
    ]


# %% [markdown]
# `device_problem` is the device check, shared with `translate` and `evaluate`; the former
# `bf16` switch is read into `precision`, so that a run has one spelling of it.

# %%
def device_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot be used as a device here (None if it can) — our addition, checked before any work."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"device {name!r} is not a device name (auto, cpu, cuda, cuda:1, ...)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"device {name!r}: this machine (or this torch build) has no CUDA device; use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return f"device {name!r}: MPS is not available here; use --device cpu"
    elif device.type not in ("cpu", "cuda", "mps"):
        return f"device {name!r}: only cpu, cuda and mps are supported"
    return None


def precision_from_former_switch(bf16, precision: str) -> str:
    """The precision a run asks for, given the former ``bf16`` switch ("", auto, true, false) — our addition."""
    value = {True: "true", False: "false"}.get(bf16, str(bf16).lower())
    if value not in ("", "auto", "true", "false"):
        raise ValueError(f"bf16 must be auto, true or false, not {bf16!r} (the setting is now --precision)")
    if not value:
        return precision
    meant = {"auto": "auto", "true": "bf16", "false": "fp32"}[value]
    if precision not in ("auto", meant):
        raise ValueError(f"bf16={value} contradicts precision={precision}; use --precision alone")
    return meant


# %% [markdown]
# ## Training settings
#
# A training run needs more than the model's sizes: which data and vocabulary, the batch
# size, the schedule, how long to train, and where to keep checkpoints. `Config` extends
# `ModelConfig` with those fields (each explained where it is used below), so one frozen
# object describes a run, and a checkpoint records it whole. The presets: `base` and `big`
# (Table 3, averaging the last 5 and 20 checkpoints as §6.1 does), `tiny` (tests),
# `copy`, `multi30k-small` and `iwslt14-small` (the runs of Part 4). On the command line,
# `--field value` changes any field.

# %%
@dataclass(frozen=True)
class Config(ModelConfig):
    """A training run: the model (:class:`ModelConfig`) plus data, optimisation and machinery settings."""

    # --- data (§5.1) ---
    dataset: str = "multi30k"  # a name in CORPORA: "copy", "multi30k" or "iwslt14"
    vocab: str = "bpe"  # "bpe": joint byte-pair encoding (§5.1); "words": whole words, rare ones <unk>
    bpe_size: int = 37000  # size of the joint BPE vocabulary, specials included (§5.1: about 37000)
    bpe_dropout: float = 0.0  # BPE-dropout: training pairs re-segmented every epoch, each merge skipped with this probability; 0 = off
    min_freq: int = 2  # word vocabularies: keep words seen at least this often
    max_tokens: int = 100  # training pairs with a longer side are filtered out (and counted)
    batch_tokens: int = 4096  # tokens (source or target, padding included) per batch
    # --- optimisation (§5.3, §5.4) ---
    warmup: int = 4000
    lr_factor: float = 1.0  # multiplies Eq. 3
    cooldown: float = 0.0  # the last fraction of the run's updates, over which the rate falls linearly to zero; 0 = Eq. 3 throughout
    betas: tuple = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # decoupled weight decay (AdamW) when > 0; the paper uses none
    eps_ls: float = 0.1  # label smoothing
    fused_loss: bool = False  # the loss and log-softmax fused (fused_loss_sum); False: generator, then loss_sum (loss_sum_one_pass)
    accum_steps: int = 1  # batches per optimizer update
    clip_grad: float = 0.0  # max grad norm; 0 = off
    epochs: int = 10
    max_steps: int = 0  # stop after this many updates; 0 = no limit
    seed: int = 1
    # --- machinery (Appendix) ---
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    precision: str = "auto"  # "auto", "fp32", "bf16" or "fp16" (autocast + gradient scaler); see resolve_precision
    bf16: str = ""  # the former switch: "true" → precision bf16, "false" → fp32, "auto" → auto; "" = not given
    compile: bool = False  # torch.compile the model
    keep_checkpoints: int = 5  # last K kept (for averaging)
    checkpoint_minutes: float = 10.0  # also save every this many minutes (§6.1: every 10 minutes); 0 = off
    average_last: int = 0  # evaluate the average of the last K checkpoints; 0 = last only
    run_dir: str = ""  # where checkpoints and logs go; "" = runs/<preset> (see run_dir_for)
    data_dir: str = ""  # downloads and caches; "" = $ANNOTATED_TRANSFORMER_DATA or ./data
    data_mirror: str = ""  # a local folder holding the data sets; "" = $DATA_MIRROR
    download: bool = True  # fetch missing data when no mirror has it
    # --- decoding (§6.1, Part 3) ---
    max_decode_extra: int = 50  # at most input length + this tokens after <s>, </s> included (§6.1)
    beam_size: int = 4  # beam search at the end of training (§6.1); greedy is scored too
    length_penalty_alpha: float = 0.6  # GNMT length penalty α (§6.1); 0 = raw log-probability
    eval_batch_size: int = 128  # sentences per decoding batch
    max_eval_sentences: int = 0  # decode only the first N test sentences; 0 = all
    max_valid_sentences: int = 0  # the validation loss of each epoch on the first N validation pairs; 0 = all
    train_on_valid_rest: bool = False  # the validation pairs after the first max_valid_sentences train too
    examples_to_show: int = 5

    def __post_init__(self):  # bf16, the former switch, sets precision and is cleared: one spelling per run
        object.__setattr__(self, "precision", precision_from_former_switch(self.bf16, self.precision))
        object.__setattr__(self, "bf16", "")
        problems = [f"{name} {words}, not {getattr(self, name)!r}" for name, ok, words in _config_rules(self) if not ok]
        if problems:
            raise ValueError("; ".join(problems))
        problem = device_problem(self.device)
        if problem:
            raise ValueError(problem)



# %% [markdown]
# The presets. Each training preset starts from a model preset or sets the model's sizes
# itself; `get_config` returns one with fields replaced, and `run_dir_for` is the one rule
# for where a run's files go.

# %%
def _model(name: str) -> dict:
    """The fields of model preset ``name``, to build a training preset on."""
    return dataclasses.asdict(MODEL_PRESETS[name])


PRESETS = MappingProxyType({
    "base": Config(**_model("base"), epochs=10**6, max_steps=100_000, average_last=5),  # §5.2, §6.1
    "big": Config(**_model("big"), epochs=10**6, max_steps=300_000, keep_checkpoints=20, average_last=20),
    "tiny": Config(**_model("tiny"), vocab="words", bpe_size=1000),
    "copy": Config(N=2, d_model=64, d_ff=128, h=4, P_drop=0.0, dataset="copy", batch_tokens=1280,
                   warmup=200, epochs=16, min_freq=1),
    "multi30k-small": Config(N=3, d_model=256, d_ff=1024, h=8, dataset="multi30k", bpe_size=8000,
                             batch_tokens=2500, warmup=1000, lr_factor=0.7, epochs=15, clip_grad=1.0,
                             average_last=5),
    # fairseq's transformer_iwslt_de_en recipe: peak lr 5e-4 at update 4,000 (Eq. 3 times this factor peaks
    # there), AdamW weight decay 1e-4, 4,096 tokens, dropout 0.3, ε_ls 0.1, no clipping; average the last 5.
    "iwslt14-small": Config(N=6, d_model=512, d_ff=1024, h=4, P_drop=0.3, dataset="iwslt14", bpe_size=10000,
                            batch_tokens=4096, warmup=4000, lr_factor=5e-4 * (512 * 4000) ** 0.5,
                            weight_decay=1e-4, epochs=50, min_freq=3, clip_grad=0.0, average_last=5),
    "iwslt14-sample": Config(N=3, N_dec=2, d_model=256, d_ff=1024, h=4, P_drop=0.1, attn_dropout=0.1,
                             ffn_dropout=0.1, dataset="iwslt14", bpe_size=4000, batch_tokens=2048, warmup=1000,
                             lr_factor=0.7, eps_ls=0.2, epochs=33, clip_grad=1.0, average_last=5,
                             max_valid_sentences=1000),
})


def get_config(name: str = "base", **overrides) -> Config:
    """The preset ``name`` with ``overrides`` applied (unknown names raise a clear error)."""
    if name not in PRESETS:
        raise KeyError(f"unknown config {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def default_preset() -> str:
    """The preset a run without ``--config`` trains: the GPU-sized IWSLT14 model where CUDA is
    available, else the one sized to train on a CPU in under an hour."""
    return "iwslt14-small" if torch.cuda.is_available() else "iwslt14-sample"


def run_dir_for(cfg: Config, preset: str = "") -> Path:
    """Where a run keeps its files: ``cfg.run_dir``, else ``runs/<preset>``, else ``runs/<dataset>``."""
    return Path(cfg.run_dir or f"runs/{preset or cfg.dataset}")


# %% [markdown]
# ### Special tokens
#
# Four symbols every vocabulary starts with: `<s>` and `</s>` around every sentence (source
# and target), `<blank>` for padding, and `<unk>` for what the vocabulary cannot spell.

# %%
SPECIALS = ("<s>", "</s>", "<blank>", "<unk>")
BOS, EOS, PAD, UNK = range(4)  # ids of the specials in every Vocab


class DataError(RuntimeError):
    """A data set is missing, malformed or cannot be fetched."""


# %% [markdown]
# ### Vocabulary
#
# A vocabulary maps tokens to ids and back. `Vocab` keeps the two lists a torchtext user
# expects (`stoi`, `itos`), maps a token list with `vocab(tokens)`, and sends unknown tokens
# to `<unk>`. It is built from the **training split only** (counting tokens that occur at
# least `min_freq` times), shared between the two languages by default so that §3.4's
# three-way weight sharing applies, and cached on disk under a key made from the training
# files' contents and the settings.

# %%
class Vocab:
    """Token ↔ id mapping with the specials ``<s> </s> <blank> <unk>`` first (ids 0–3)."""

    def __init__(self, itos: Sequence[str]):
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a Vocab starts with {SPECIALS}")
        self.itos = list(itos)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("duplicate tokens in vocabulary")

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], min_freq: int = 1) -> "Vocab":
        """Tokens with count ≥ ``min_freq``, most frequent first (ties alphabetical)."""
        counts = Counter(tok for sent in sentences for tok in sent)
        for s in SPECIALS:
            counts.pop(s, None)
        kept = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        return cls(list(SPECIALS) + kept)

    def __len__(self) -> int:
        return len(self.itos)

    def __call__(self, tokens: Sequence[str]) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokens]

    def lookup_tokens(self, ids: Iterable[int]) -> list[str]:
        """Ids → tokens."""
        return [self.itos[i] for i in ids]

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.itos == other.itos


# %% [markdown]
# Every file this program writes — downloads, prepared data, vocabulary and BPE caches,
# checkpoints, logs — goes through one helper that writes to a temporary file beside the
# target and renames it only when the writing finished, so an interrupted run never leaves
# a file that looks complete. Before the rename the file's bytes are forced to the disk
# (`fsync`), and after it the directory's entry too, so that after a power loss the name
# holds either the old file or the whole new one — and a caller that then deletes older
# files (the checkpoint rotation) never deletes them before their successor is safe.
# `download` uses it and checks the checksum before the rename.

# %%
@contextmanager
def atomic_file(path: Path, mode: str = "wb"):
    """Open a temporary file beside ``path`` that replaces ``path`` only if the block completes.

    Downloads, prepared data, caches, checkpoints and logs all go through this one helper, so
    an interrupted write never leaves a file that looks finished.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(folder: Path) -> None:
    """Force ``folder``'s entries (a rename, a new file) to the disk — our addition; a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)  # Windows cannot open a directory: OSError, nothing to do
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_atomic(path: Path, data) -> None:
    """Write ``data`` (bytes, or an iterable of text lines) to ``path`` atomically."""
    if isinstance(data, (bytes, bytearray)):
        with atomic_file(path, "wb") as f:
            f.write(data)
    else:
        with atomic_file(path, "w") as f:
            for line in data:
                f.write(line + "\n")


# %% [markdown]
# Building a vocabulary means tokenizing the whole training split, so the result is cached
# under a key made from the training files' bytes and the settings that shape it.

# %%
def _files_digest(paths: Iterable[Path], extra: str) -> str:
    """SHA-256 over the files' bytes and ``extra``: the key of a vocabulary cache."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def build_vocabs(train_tokens: tuple[list, list], cfg: Config, cache_key: Optional[str] = None,
                 cache_dir: Optional[Path] = None) -> tuple[Vocab, Vocab]:
    """(source vocab, target vocab) from the training tokens; one shared object if ``cfg.shared_vocab``.

    With ``cache_key`` and ``cache_dir`` the result is read from / written to
    ``cache_dir/vocab-<key>.json``.
    """
    path = Path(cache_dir) / f"vocab-{cache_key}.json" if cache_key and cache_dir else None
    if path is not None and path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        src = Vocab(saved["src"])
        return (src, src) if cfg.shared_vocab else (src, Vocab(saved["tgt"]))
    src_sents, tgt_sents = train_tokens
    if cfg.shared_vocab:
        src = tgt = Vocab.build(list(src_sents) + list(tgt_sents), cfg.min_freq)
    else:
        src, tgt = Vocab.build(src_sents, cfg.min_freq), Vocab.build(tgt_sents, cfg.min_freq)
    if path is not None:
        write_atomic(path, [json.dumps({"src": src.itos, "tgt": tgt.itos}, ensure_ascii=False)])
    return src, tgt


# %% [markdown]
# ### Subwords: byte-pair encoding
#
# §5.1 (quoted above) encodes sentences with byte-pair encoding into "a shared source-target
# vocabulary". Byte-pair encoding (Sennrich et al., 2016) starts from single characters and
# repeatedly merges the most frequent adjacent pair into a new symbol, until the vocabulary
# has the size asked for. Frequent words end up as one piece; a rare word is spelled with
# several pieces, so nothing is ever out of vocabulary — every character of the training text
# is kept as a piece of its own. Trained on both languages at once, the pieces form one
# vocabulary, which is what lets §3.4 share one matrix between both embeddings and the
# output layer.
#
# We use **sentencepiece** (`model_type="bpe"`) rather than writing the merges out: it is
# fast (about half a second on Multi30k), deterministic, and its model is one small file of
# bytes that a checkpoint can carry, so a checkpoint alone is enough to translate. It works
# on raw text: a space becomes part of the next piece (`▁`), so decoding the pieces gives
# the sentence back exactly, with no detokenizer. Its ids are laid out to match `Vocab`: the
# four specials first, so `<blank>` is padding and `<unk>` (printed as `<unk>`) is used only
# for a character never seen in training. The model is trained on the **training split
# only** and cached beside the word vocabularies, under a key made from the training files
# and the settings. `Config.vocab = "words"` keeps the word-level vocabulary.
#
# *Our addition, for small data:* `sample` is **BPE-dropout** (Provilkov et al., 2020,
# "BPE-Dropout: Simple and Effective Subword Regularization"): while a word is encoded, each
# merge is skipped with a small probability, so the same word reaches the model in different
# pieces from epoch to epoch. On a small corpus that is a data augmentation the model cannot
# memorise; test sentences are still encoded the ordinary way. `Config.bpe_dropout` sets the
# probability (0, the default, leaves training as the paper has it), and `epoch_pairs` below
# re-segments the training pairs once an epoch. It did not pay within our half-hour IWSLT14
# budget: at 0.1 the pieces were 24% more and the model learnt far more slowly (README:
# Results), so no preset uses it.

# %%
class Subwords:
    r"""A joint byte-pair-encoding model (sentencepiece) — the shared BPE vocabulary of §5.1.

    ``encode`` turns sentences into lists of pieces, ``decode`` turns piece lists back into
    sentences; ``vocab`` is the matching :class:`Vocab` (piece ids = sentencepiece ids).
    """

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.vocab = Vocab([self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())])

    @classmethod
    def train(cls, sentences: Iterable[str], vocab_size: int) -> "Subwords":
        """Learn a BPE model of at most ``vocab_size`` pieces (specials included) from ``sentences``."""
        import io

        import sentencepiece as spm

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, model_type="bpe", vocab_size=vocab_size,
            hard_vocab_limit=False, character_coverage=1.0, normalization_rule_name="identity",
            bos_id=BOS, eos_id=EOS, pad_id=PAD, unk_id=UNK, bos_piece=SPECIALS[BOS], eos_piece=SPECIALS[EOS],
            pad_piece=SPECIALS[PAD], unk_piece=SPECIALS[UNK], unk_surface=SPECIALS[UNK],
            num_threads=1, minloglevel=2)  # minloglevel 2: errors only, no progress log
        return cls(model.getvalue())

    def encode(self, lines: Sequence[str]) -> list[list[str]]:
        """Sentences → lists of pieces."""
        return self.sp.encode(list(lines), out_type=str)

    def sample(self, lines: Sequence[str], dropout: float, seed: int) -> list[list[str]]:
        """Sentences → pieces with BPE-dropout (Provilkov et al., 2020; our addition), the same for the same
        ``seed``: sentencepiece's seed is per process, so it is set here, and one thread draws for every line."""
        import sentencepiece as spm

        spm.set_random_generator_seed(seed)
        return self.sp.encode(list(lines), out_type=str, enable_sampling=True, alpha=dropout, nbest_size=-1, num_threads=1)

    def decode(self, pieces: Sequence[Sequence[str]]) -> list[str]:
        """Lists of pieces → sentences."""
        return [self.sp.decode_pieces(list(p)) for p in pieces]

    def __eq__(self, other) -> bool:
        return isinstance(other, Subwords) and self.model_proto == other.model_proto


def build_subwords(train_pairs: Sequence[tuple[str, str]], cfg: Config, cache_key: Optional[str] = None,
                   cache_dir: Optional[Path] = None) -> Subwords:
    """The joint BPE model of the training pairs (both sides), read from / written to ``cache_dir/bpe-<key>.model``."""
    path = Path(cache_dir) / f"bpe-{cache_key}.model" if cache_key and cache_dir else None
    if path is not None and path.is_file():
        return Subwords(path.read_bytes())
    subwords = Subwords.train([s for pair in train_pairs for s in pair], cfg.bpe_size)
    if path is not None:
        write_atomic(path, subwords.model_proto)
    return subwords


# %% [markdown]
# ### Batches and masks
#
# `Batch` holds one batch of padded source and target ids with their masks (True = may
# attend). The decoder's input is the target without its last token and its prediction
# target is the target without its first: this is the "offset by one position" of §3.1.
# `ntokens` counts the real (non-pad) target tokens, by which the loss is normalised.

# %%
def pad_sequences(seqs: Sequence[Sequence[int]], pad: int = PAD) -> torch.Tensor:
    """List of id lists → (batch, longest) long tensor, right-padded with ``pad``."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


class Batch:
    """A training batch: ``src``, ``tgt`` (decoder input), ``tgt_y`` (what to predict), masks, ``ntokens``."""

    def __init__(self, src: torch.Tensor, tgt: Optional[torch.Tensor] = None, pad: int = PAD):
        self.src = src  # (batch, src_len)
        self.src_mask = padding_mask(src, pad)  # (batch, 1, src_len)
        if tgt is not None:
            self.tgt = tgt[:, :-1]  # (batch, tgt_len): decoder input
            self.tgt_y = tgt[:, 1:]  # (batch, tgt_len): next tokens
            self.tgt_mask = self.make_std_mask(self.tgt, pad)  # (batch, tgt_len, tgt_len)
            self.ntokens = int((self.tgt_y != pad).sum())

    @staticmethod
    def make_std_mask(tgt: torch.Tensor, pad: int) -> torch.Tensor:
        """Target mask: not padding, and not a subsequent position."""
        return padding_mask(tgt, pad) & subsequent_mask(tgt.size(-1), device=tgt.device)  # (batch, len, len)

    def to(self, device) -> "Batch":
        """The same batch on ``device``; to a GPU through pinned memory, so the copy overlaps computation."""
        device = torch.device(device)
        pin = device.type == "cuda"  # non_blocking copies from ordinary (pageable) memory are synchronous
        for name in ("src", "src_mask", "tgt", "tgt_y", "tgt_mask"):
            if hasattr(self, name):
                t = getattr(self, name)
                setattr(self, name, (t.pin_memory() if pin else t).to(device, non_blocking=pin))
        return self


# %% [markdown]
# Batching "by approximate sequence length" (§5.1): shuffle the pairs, sort them by length
# (a stable sort, so equal lengths stay shuffled), cut the sorted list into batches holding
# at most `batch_tokens` tokens on either side *including padding*, and shuffle the order of
# the batches. Everything random comes from a generator seeded with (seed, epoch), so the
# batches of an epoch can be recomputed exactly — that is what lets training resume in the
# middle of an epoch. In a distributed run, rank $r$ of $W$ takes batches $r, r+W, …$.

# %%
def length_batches(lengths: Sequence[tuple[int, int]], batch_tokens: int, seed: int = 0, epoch: int = 0,
                   shuffle: bool = True, rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Index batches of similar-length pairs with ≤ ``batch_tokens`` padded tokens per side."""
    rng = random.Random(f"{seed}-{epoch}")
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, *lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], max(lengths[i])
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    if world_size > 1:
        batches = batches[: len(batches) - len(batches) % world_size][rank::world_size]
    return batches


def make_batch(pairs: Sequence[tuple[list, list]], idx: Sequence[int]) -> Batch:
    """A :class:`Batch` of the pairs at ``idx``."""
    return Batch(pad_sequences([pairs[i][0] for i in idx]), pad_sequences([pairs[i][1] for i in idx]))


# %% [markdown]
# ## §5.3 Optimizer
#
# > We used the Adam optimizer […] with $\beta_1=0.9$, $\beta_2=0.98$ and $\epsilon=10^{-9}$.
# > We varied the learning rate over the course of training, according to the formula:
# > $$lrate = d_{\text{model}}^{-0.5} \cdot \min({step\_num}^{-0.5}, {step\_num} \cdot {warmup\_steps}^{-1.5})$$
# > This corresponds to increasing the learning rate linearly for the first $warmup\_steps$
# > training steps, and decreasing it thereafter proportionally to the inverse square root of
# > the step number. We used $warmup\_steps=4000$.
#
# — §5.3, Eq. 3
#
# `rate` is Eq. 3 (times an optional `factor`), defined for $step\_num \ge 1$.
# `torch.optim.Adam` does the rest, with `LambdaLR` setting the learning rate before each
# update. `LambdaLR` counts the updates already taken (0 before the first), so update $k$ —
# the paper's $step\_num = k$ — runs with `rate(k)` when the lambda is `rate(taken + 1)`.
#
# *Our addition:* Eq. 3 never reaches zero, so a run with a fixed number of updates stops at
# whatever rate it has come to. `Config.cooldown` (0 = off) multiplies Eq. 3 by
# `cooldown_factor`, which falls linearly to zero over the last fraction of the run's planned
# updates. No preset uses it: on `iwslt14-sample` (then with 3 decoder layers) it lowered the final
# validation perplexity (38.6 against 40.2) without raising the validation BLEU (README: Results).

# %%
def rate(step: int, d_model: int, factor: float = 1.0, warmup: int = 4000) -> float:
    r"""Learning rate of §5.3, Eq. 3: $d_{model}^{-0.5} \min(step^{-0.5}, step \cdot warmup^{-1.5})$, step ≥ 1."""
    if step < 1:
        raise ValueError(f"Eq. 3 counts steps from 1, got step={step}")
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def cooldown_factor(step: int, total: int, fraction: float) -> float:
    """Our addition to Eq. 3 (``Config.cooldown``): 1, then falling linearly over the last ``fraction``
    of ``total`` updates, so that update ``total`` runs at ``1/(fraction·total)`` of Eq. 3 and the next would at 0."""
    if fraction <= 0:
        return 1.0
    if total < 1:
        raise ValueError(f"a cooldown needs the run's number of updates (total_updates), got {total}")
    return min(1.0, max(0.0, (total + 1 - step) / (fraction * total)))


def make_optimizer(model: nn.Module, cfg: Config, total_updates: int = 0) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """Adam with §5.3's β1, β2, ε and the Eq. 3 schedule: update k (counting from 1) uses ``rate(k)``,
    times ``cooldown_factor(k, total_updates, cfg.cooldown)`` when ``cfg.cooldown`` is set.

    Adam's fused kernel (one pass over all parameters per step; the same arithmetic as the
    per-tensor loop, a test checks it) where the parameters' device has one. With
    ``cfg.weight_decay`` > 0 (our addition, for the IWSLT recipe) it is AdamW: the decay is
    decoupled from the gradient, as fairseq's Adam applies it.
    """
    params = list(model.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    if cfg.weight_decay:
        optimizer = torch.optim.AdamW(params, lr=1.0, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                      weight_decay=cfg.weight_decay, fused=fused)
    else:
        optimizer = torch.optim.Adam(params, lr=1.0, betas=tuple(cfg.betas), eps=cfg.adam_eps, fused=fused)
    scheduler = LambdaLR(optimizer, lambda taken: rate(taken + 1, cfg.d_model, cfg.lr_factor, cfg.warmup)
                         * cooldown_factor(taken + 1, total_updates, cfg.cooldown))
    return optimizer, scheduler


if EXAMPLES:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = range(1, 20000)
    for d_model, warmup in ((512, 4000), (512, 8000), (256, 4000)):
        ax.plot(steps, [rate(s, d_model, 1.0, warmup) for s in steps], label=f"d_model={d_model}, warmup={warmup}")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("Eq. 3")
    ax.legend()
    plt.show()
    del fig, ax, steps, d_model, warmup

# %% [markdown]
# ## §5.4 Regularization
#
# > We employ three types of regularization during training:
#
# > We apply dropout […] to the output of each sub-layer, before it is added to the sub-layer
# > input and normalized. In addition, we apply dropout to the sums of the embeddings and the
# > positional encodings in both the encoder and decoder stacks. For the base model, we use a
# > rate of $P_{drop}=0.1$.
#
# — §5.4, Residual Dropout
#
# Both places are already in the model: `SublayerConnection` drops the sub-layer's output
# before the residual sum, and `PositionalEncoding` drops the sum of embedding and
# encoding. A test checks that those are the only dropout layers active by default.
#
# > During training, we employed label smoothing of value $\epsilon_{ls}=0.1$ […]. This hurts
# > perplexity, as the model learns to be more unsure, but improves accuracy and BLEU score.
#
# — §5.4, Label Smoothing
#
# Label smoothing (Szegedy et al., 2016) trains against a smoothed target distribution
# instead of a one-hot vector: with $K$ classes and true class $y$,
# $q(k) = (1-\epsilon_{ls})\,\delta_{k,y} + \epsilon_{ls}/K$. `LabelSmoothing` writes out the
# Kullback–Leibler divergence $\mathrm{KL}(q \,\|\, p)$ summed over the non-padding positions.
# Since $\mathrm{KL}(q\|p) = H(q, p) - H(q)$ and $H(q)$ does not depend on the model, this is
# the smoothed cross-entropy that `F.cross_entropy(..., label_smoothing=ε)` computes, less a
# constant; a test checks exactly that relation. The training loss, `loss_sum`, is that
# cross-entropy written out from the generator's log-probabilities (a test checks it against
# the library call, value and gradient).

# %%
class LabelSmoothing(nn.Module):
    r"""Label-smoothed loss of §5.4: $\sum \mathrm{KL}(q\|p)$ with $q = (1-\epsilon)\,\mathrm{onehot} + \epsilon/K$.

    ``forward(log_probs (n, K), target (n,))``; positions whose target is ``padding_idx``
    contribute nothing.
    """

    def __init__(self, size: int, padding_idx: int, smoothing: float = 0.1):
        super().__init__()
        self.size = size
        self.padding_idx = padding_idx
        self.smoothing = smoothing

    def true_dist(self, target: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The smoothed target distribution q, (n, K); rows of padding positions are zero."""
        q = torch.full((target.size(0), self.size), self.smoothing / self.size, dtype=dtype, device=target.device)
        q.scatter_(1, target.unsqueeze(1), 1.0 - self.smoothing + self.smoothing / self.size)
        q[target == self.padding_idx] = 0.0
        return q

    def forward(self, log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q = self.true_dist(target, log_probs.dtype)
        return F.kl_div(log_probs, q, reduction="sum")


def loss_sum(log_probs: torch.Tensor, target: torch.Tensor, eps_ls: float, pad: int = PAD) -> torch.Tensor:
    r"""Label-smoothed cross-entropy summed over non-pad positions (the training loss) — §5.4.

    $\sum_i (1-\epsilon)\,(-\log p_i(y_i)) + \epsilon \cdot \tfrac{1}{K}\sum_k (-\log p_i(k))$, the
    quantity ``F.cross_entropy(logits, label_smoothing=ε)`` computes, taken directly from the
    generator's log-probabilities (``cross_entropy`` would apply a second log-softmax to them).
    """
    log_probs = log_probs.reshape(-1, log_probs.size(-1)).float()  # (tokens, K)
    target = target.reshape(-1)  # (tokens,)
    keep = target != pad
    nll = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)  # (tokens,)
    uniform = -log_probs.mean(dim=1)  # (tokens,)
    return (((1.0 - eps_ls) * nll + eps_ls * uniform) * keep).sum()


if EXAMPLES:
    ls = LabelSmoothing(size=5, padding_idx=PAD, smoothing=0.4)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.imshow(ls.true_dist(torch.tensor([1, 0, 3, 4, 2])), cmap="viridis")
    ax1.set_title("target distribution q (ε = 0.4)\nrows: positions; the row of <blank> is zero")
    ax1.set_xlabel("class")
    ls = LabelSmoothing(size=5, padding_idx=PAD, smoothing=0.1)
    xs = torch.arange(1, 100)
    losses = []
    for x in xs:  # the model puts x/(x+3) on the true class 1 and 1/(x+3) on three others
        p = torch.tensor([[1e-9, x / (x + 3), 1e-9, 1 / (x + 3), 1 / (x + 3)]])
        losses.append(float(ls((p / p.sum()).log(), torch.tensor([1]))))
    ax2.plot(xs, losses)
    ax2.set_xlabel("confidence x (probability of the true class = x / (x + 3))")
    ax2.set_ylabel("loss")
    ax2.set_title("label smoothing penalises over-confidence")
    plt.show()
    del ls, fig, ax1, ax2, xs, losses, x, p

# %% [markdown]
# *The same loss with its gradient written in one pass (our addition).* Autograd's backward
# of `loss_sum` builds its gradient from whole (tokens, vocabulary) matrices: a zero matrix
# with the target entries scattered in (the gather's backward), a second matrix of
# $\epsilon_{ls}/K$ shares (the mean's), their sum, and under bf16 autocast a cast of that
# sum to bf16 — four or five passes over 2,400 × 8,000 numbers in a `multi30k-small` batch.
# Yet the result has only two distinct values in each row: the smoothing share $b_i$
# everywhere and $b_i$ plus the target's share at the target. `loss_sum_one_pass` computes
# those per-row numbers with the same float32 operations in the same order as autograd does
# (so the same roundings, down to the sign of a zero) and writes the gradient once, in the
# log-probabilities' dtype. It is `loss_sum`, number for number — a test compares the bits
# of values and gradients, and of the weights after a few updates — so training uses it.
# The target entries are written by index, not with `scatter_`: on a bf16 CPU tensor of
# 2,400 × 8,000, `scatter_` of one entry per row took 7.5 ms against 0.01–0.02 ms in float32 or by
# index, and the bf16 training step of `multi30k-small` became 1.025× faster (paired passes of old and
# new code on a 2-core AMD EPYC with AVX-512 BF16).

# %%
class _LossSumOnePass(torch.autograd.Function):
    r"""``loss_sum`` (§5.4) with its backward written in one pass — our fast version, bit-identical."""

    @staticmethod
    def forward(ctx, log_probs, target, eps_ls: float, pad: int):
        ctx.save_for_backward(target, target != pad)  # (tokens,) each; the log-probabilities are not kept
        ctx.eps_ls, ctx.K, ctx.dtype = eps_ls, log_probs.size(1), log_probs.dtype
        return loss_sum(log_probs, target, eps_ls, pad)  # the value is loss_sum's own

    @staticmethod
    def backward(ctx, grad_loss):
        target, keep = ctx.saved_tensors
        eps = ctx.eps_ls
        w = grad_loss.expand(keep.shape) * keep  # (tokens,) what autograd passes back through "* keep"
        share = -(w * eps) / ctx.K  # (tokens,) the mean's backward: -ε·w, divided by K
        at_target = (0.0 + -(w * (1.0 - eps))) + share  # (tokens,) the gather's zero + its share, then the mean's
        grad = torch.empty((keep.size(0), ctx.K), dtype=ctx.dtype, device=keep.device)  # (tokens, K)
        grad.copy_((0.0 + share).to(ctx.dtype).unsqueeze(1).expand(-1, ctx.K))  # off the target: 0 + share
        rows = torch.arange(keep.size(0), device=keep.device)  # (tokens,)
        grad[rows, target] = at_target.to(ctx.dtype)  # (tokens,) entries, one per row
        return grad, None, None, None


def loss_sum_one_pass(log_probs: torch.Tensor, target: torch.Tensor, eps_ls: float, pad: int = PAD) -> torch.Tensor:
    r"""``loss_sum(log_probs, target, eps_ls, pad)`` — §5.4, the same numbers with a one-pass backward."""
    return _LossSumOnePass.apply(log_probs.reshape(-1, log_probs.size(-1)), target.reshape(-1), float(eps_ls), pad)


# %% [markdown]
# *The fused loss (our addition), which changes the numbers.* Both losses above take the
# generator's log-probabilities, so the log-softmax's backward is one more pass over the
# (tokens, vocabulary) matrix, and under bf16 autocast the log-probabilities are first
# computed in bf16 and then copied to float32. With the readable loss's backward those
# passes together took about a quarter of a bf16 step in a profile by input shape
# (`benchmarks/profile_step.py --by-shape`). Done by hand, the gradient with respect to the logits $z$ is one line,
# $\partial L / \partial z_{ik} = w_i\,(p_{ik} - q_{ik})$ with $p = \mathrm{softmax}(z_i)$,
# $q$ the smoothed target of §5.4 and $w_i$ zero at padding; `fused_loss_sum` computes the
# same value as `loss_sum(generator(x))` with that gradient written directly (the target
# column in float32, so no cancellation is lost to bf16). A test checks values and
# gradients against the readable pair. `Config.fused_loss` makes training use it; the
# presets keep the readable pair (with `loss_sum_one_pass`). The two are not bit-identical under bf16 autocast on a
# CPU, where autocast leaves the readable pair's log-softmax in bf16 and the fused loss
# computes it in float32, and a training run follows whichever rounding it gets: the
# seed-1 `multi30k-small` run scored 40.4 BLEU with the fused loss against 41.8 with the
# readable pair (another seed of the readable pair scored 40.5), so the presets keep the
# loss their reported runs were trained with, and those runs repeat exactly from a fresh
# clone.

# %%
class _FusedLossSum(torch.autograd.Function):
    r"""Label-smoothed cross-entropy from logits with its gradient written out — §5.4 (our fast version)."""

    @staticmethod
    def forward(ctx, logits, target, eps_ls: float, pad: int):
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (tokens, K) float32, as loss_sum
        keep = target != pad  # (tokens,)
        nll = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)  # (tokens,)
        uniform = -log_probs.mean(dim=1)  # (tokens,)
        ctx.save_for_backward(log_probs, target, keep)
        ctx.eps_ls, ctx.dtype = eps_ls, logits.dtype
        return (((1.0 - eps_ls) * nll + eps_ls * uniform) * keep).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        log_probs, target, keep = ctx.saved_tensors
        eps, K = ctx.eps_ls, log_probs.size(1)
        w = (keep * grad_loss).unsqueeze(1)  # (tokens, 1): the upstream gradient, 0 at padding
        p = log_probs.exp_()  # (tokens, K) softmax(z), in place of the saved log-probabilities
        at_target = (p.gather(1, target.unsqueeze(1)) - (1.0 - eps) - eps / K) * w  # (tokens, 1), float32
        grad = torch.empty_like(p, dtype=ctx.dtype)  # (tokens, K) in the logits' dtype, written once:
        torch.addcmul(-(eps / K) * w, p, w, out=grad)  # w·(p − ε/K) everywhere, computed in float32 ...
        rows = torch.arange(target.size(0), device=target.device)  # (tokens,)
        grad[rows, target] = at_target.squeeze(1).to(ctx.dtype)  # ... and w·(p − q) at the target
        return grad, None, None, None


def fused_loss_sum(logits: torch.Tensor, target: torch.Tensor, eps_ls: float, pad: int = PAD) -> torch.Tensor:
    r"""``loss_sum(F.log_softmax(logits, -1), target, eps_ls)`` with the log-softmax fused in — §5.4, fast version.

    ``logits`` (..., K) are the generator's pre-softmax scores (``generator.proj(x)``), any
    float dtype; the loss is computed in float32, as ``loss_sum`` does, and the gradient is
    returned in ``logits``' dtype.
    """
    return _FusedLossSum.apply(logits.reshape(-1, logits.size(-1)), target.reshape(-1), float(eps_ls), pad)


# %% [markdown]
# ### One update
#
# One update is one optimizer step, and it may accumulate the gradients of several batches
# (`accum_steps`): that is how one machine reaches the paper's ~25,000 tokens per batch.
# `update` takes the micro-batches of one update and the `Trainer` (the model, the
# optimizer and its schedule, the precision) and applies one optimizer step. Each
# batch's summed loss is divided by the number of target tokens in the *whole* update —
# counted over every micro-batch and, in a distributed run, every process (the
# `all_reduce`) — and multiplied by the number of processes, because DDP *averages*
# gradients over processes. So the gradient is the one of the mean loss per target token of
# the whole update, however it is split (a test checks it). The learning rate it reports is
# the one the step applied (Eq. 3 at this update's number). Loss and token counts stay on the
# device until one transfer at the end of the update — on a GPU every `float(tensor)` waits
# for all queued work — and in a distributed run the loss is summed over the processes
# first, so a NaN in any of them stops all of them together, before the step.

# %%
class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass(frozen=True)
class Trainer:
    """What an update needs — §5.3: the model, the optimizer and its schedule, and how to compute."""

    cfg: Config
    model: EncoderDecoder  # the plain model (its parameters, its generator)
    train_model: nn.Module  # what computes the forward pass: the model, compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    device: torch.device
    autocast: Callable  # a context manager factory: bf16 or fp16 autocast, or nothing
    scaler: torch.amp.GradScaler  # scales the fp16 loss so small gradients survive; disabled otherwise
    world: int  # processes training together (DistributedDataParallel)


def update(trainer: Trainer, micro: Sequence[Batch]) -> tuple[float, int, float]:
    """One optimizer update over the micro-batches ``micro`` — §5.3.

    Returns (summed label-smoothed loss, real target tokens, learning rate applied) over the
    whole update, all processes together. A non-finite loss in any process raises
    :class:`TrainingDiverged` in every process, before the step. The loss and token count stay
    on the device until one transfer at the end: one host synchronisation per update.
    """
    ntokens = torch.stack([(b.tgt_y != PAD).sum() for b in micro]).sum().float()  # counted where the batches are
    if trainer.world > 1:
        dist.all_reduce(ntokens)
    total = torch.zeros((), device=trainer.device)
    for j, b in enumerate(micro):
        last = j == len(micro) - 1
        no_sync = trainer.train_model.no_sync() if (trainer.world > 1 and not last) else nullcontext()
        with no_sync, trainer.autocast():
            out = trainer.train_model(b.src, b.tgt, b.src_mask, b.tgt_mask)
            if trainer.cfg.fused_loss:
                loss = fused_loss_sum(trainer.model.generator.proj(out), b.tgt_y, trainer.cfg.eps_ls)
            else:
                loss = loss_sum_one_pass(trainer.model.generator(out), b.tgt_y, trainer.cfg.eps_ls)
        trainer.scaler.scale(loss * trainer.world / ntokens).backward()
        total += loss.detach()
    if trainer.world > 1:
        dist.all_reduce(total)  # a NaN anywhere makes the sum NaN everywhere: all processes stop together
    total, tokens = torch.stack([total, ntokens]).tolist()  # the update's one host synchronisation
    if not math.isfinite(total):
        raise TrainingDiverged(f"loss is {total}")
    if trainer.cfg.clip_grad:
        trainer.scaler.unscale_(trainer.optimizer)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.clip_grad)
    lr = trainer.optimizer.param_groups[0]["lr"]  # set by the scheduler for this update
    trainer.scaler.step(trainer.optimizer)  # fp16: skipped when a gradient overflowed (the scale then shrinks)
    trainer.scaler.update()
    with warnings.catch_warnings():  # after a skipped fp16 step torch warns of a schedule stepped first; by design
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return total, round(tokens), lr


# %% [markdown]
# # Part 3 — Decoding and inference (§6.1)
#
# §6.1 reports its results with beam search over the average of the last checkpoints. In
# our words, from the paper's §6.1: beam size 4, length penalty $\alpha = 0.6$ (Wu et al.,
# 2016), a maximum output length of input length + 50, and stopping early when possible.
# This part builds that up: greedy decoding first (the readable version), a key/value cache
# that makes each step cost one position instead of the whole prefix, beam search on top of
# the same step function, and `translate`, which decodes a test set in batches. The
# parameters come from the end of training (Part 2) or from a checkpoint (Appendix).

# %% [markdown]
# ## A first run: greedy decoding with an untrained model
#
# Decoding is auto-regressive (§3): encode the source once, start the target with the
# start symbol, and repeatedly append the most probable next token. A *decoder state*
# feeds one token per sentence and returns the scores of the next one; the readable one,
# `FullRecomputeDecoder`, runs the decoder over the whole prefix each time. `greedy_search`
# is the loop around any such state: it takes the argmax for a whole batch at once and stops
# when every sentence has produced the end symbol or the length limit is reached (§6.1 uses
# input length + 50). The start symbol and the padding symbol are never chosen: their scores
# are set to $-\infty$ before the argmax (`ban_tokens`), since neither can occur inside a
# target sentence. An untrained model produces noise, but every piece above has now run end
# to end.

# %%
def ban_tokens(scores, tokens: Sequence[int]):
    """``scores`` (..., vocab) with the ids in ``tokens`` set to −∞, so decoding never picks them (§6.1)."""
    tokens = list(tokens)
    if not tokens:
        return scores
    scores = scores.clone()
    scores[..., tokens] = float("-inf")
    return scores


class FullRecomputeDecoder:
    """Auto-regressive decoding state (§3) that recomputes the whole prefix at every step — the readable decoder.

    ``step`` feeds one token per row and returns the next token's log-probabilities;
    ``reorder`` keeps some rows (beam search). Works with any model that has ``decode`` and
    ``generator``.
    """

    def __init__(self, model, memory, src_mask):
        self.model, self.memory, self.src_mask = model, memory, src_mask
        self.ys = None  # (batch, t): tokens fed so far

    def step(self, tokens):
        """tokens (batch,) → log-probabilities of the next token (batch, vocab)."""
        col = tokens.unsqueeze(1)  # (batch, 1)
        self.ys = col if self.ys is None else torch.cat([self.ys, col], dim=1)  # (batch, t + 1)
        out = self.model.decode(self.memory, self.src_mask, self.ys,
                                subsequent_mask(self.ys.size(1), device=self.ys.device))
        return self.model.generator(out[:, -1])

    def reorder(self, index):
        """Keep rows ``index`` (new_batch,) of the prefix."""
        self.ys = self.ys.index_select(0, index)


# %% [markdown]
# `greedy_decode` is that loop around the readable state; the cached state below plugs into
# the same loop.

# %%
@torch.no_grad()
def greedy_decode(model: EncoderDecoder, src, src_mask, max_len: int, start_symbol: int,
                  end_symbol: Optional[int] = None, pad: Optional[int] = None):
    """Batched greedy decoding (§3: auto-regressive generation), recomputing the whole prefix each step.

    ``src`` (batch, src_len) → token ids (batch, ≤ max_len) beginning with ``start_symbol``.
    A sentence that has produced ``end_symbol`` is padded with ``pad`` (default: the end
    symbol) afterwards, and decoding stops early once all have finished. ``start_symbol``
    and ``pad`` are never generated.
    """
    state = FullRecomputeDecoder(model, model.encode(src, src_mask), src_mask)
    return greedy_search(state, src.size(0), max_len, start_symbol, end_symbol, pad, src.device)


def greedy_search(state, batch: int, max_len: int, start_symbol: int,
                  end_symbol: Optional[int], pad: Optional[int], device):
    """The loop of greedy decoding (§3): feed each newest token to ``state`` and append the argmax, until all end.

    ``state.step(tokens (batch,))`` returns next-token scores (batch, vocab):
    :class:`FullRecomputeDecoder` or the cached :class:`IncrementalDecoder`.
    """
    ys = torch.full((batch, 1), start_symbol, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    fill = end_symbol if pad is None else pad
    banned = [start_symbol] + ([pad] if pad is not None else [])
    for _ in range(max_len - 1):
        next_word = ban_tokens(state.step(ys[:, -1]), banned).argmax(dim=-1)  # (batch,)
        if end_symbol is not None:
            next_word = torch.where(done, torch.full_like(next_word, fill), next_word)
            done |= next_word == end_symbol
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)  # (batch, len + 1)
        if end_symbol is not None and bool(done.all()):
            break
    return ys


if EXAMPLES:
    untrained = make_model(11, 11, MODEL_PRESETS["tiny"]).eval()
    print("untrained model's output:", greedy_decode(untrained, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]),
                                                    torch.ones(1, 1, 10, dtype=torch.bool), max_len=10,
                                                    start_symbol=0)[0].tolist())
    del untrained

# %% [markdown]
# ### Incremental decoding with a key/value cache
#
# `greedy_decode` above is the readable version: at step $t$ it runs the decoder over the
# whole prefix $y_1 … y_t$ again, although only the last position's output is new. The
# causal mask of §3.1 means that the outputs at positions $< t$ cannot change when a token
# is appended, so everything computed for them can be kept. What the next position needs
# from the past is, in each decoder layer, the keys and values of the masked
# self-attention (§3.2.3) — one (batch, $h$, $t$, $d_k$) pair per layer, growing by one row
# per step — and, for the encoder-decoder attention, the projections $\mathbf{z}W^K_i$ and
# $\mathbf{z}W^V_i$ of the encoder output, which never change and are computed once.
#
# `IncrementalDecoder` holds that state. Each `step` embeds one new token (its positional
# encoding is that of position $t$, hence the `offset` argument of `PositionalEncoding`),
# passes it through every layer's three sub-layers using the layer's own modules
# (`SublayerConnection`, so post-norm and pre-norm both work), and returns the log
# probabilities of the next token. Attention goes through the layer's `attend` method, so
# the readable class uses `attention()` and the fast class uses PyTorch's fused kernel.
# A step costs $O(t)$ instead of the $O(t^2)$ of recomputing the prefix. `reorder` picks
# rows of the cache, which beam search (§6.1, below) needs when hypotheses are replaced.

# %%
class IncrementalDecoder:
    r"""Key/value-cached decoding for :class:`EncoderDecoder` — §3 auto-regression, §3.2.3 masking.

    Holds each decoder layer's self-attention keys and values for the tokens fed so far,
    and the encoder-decoder keys and values of ``memory`` (computed once). ``step`` feeds
    one token per row and returns the next token's log-probabilities, equal (up to
    rounding) to ``model.generator(model.decode(...))[:, -1]`` on the whole prefix.
    """

    def __init__(self, model: EncoderDecoder, memory, src_mask):
        self.model = model
        self.src_mask = src_mask  # (batch, 1, src_len)
        self.cross = []  # per layer: (k, v), each (batch, h, src_len, d_k)
        for layer in model.decoder.layers:
            a = layer.src_attn
            self.cross.append(a.project_kv(memory, memory))
        self.self_kv: list = [None] * len(model.decoder.layers)  # per layer: (k, v), (batch, h, t, d_k)
        self.length = 0  # positions fed so far

    def step(self, tokens):
        """tokens (batch,) at position ``self.length`` → log-probabilities (batch, vocab)."""
        embed, *between, posenc = self.model.tgt_embed  # between: WordDropout when the model has one
        x = embed(tokens.unsqueeze(1))  # (batch, 1, d_model)
        for module in between:
            x = module(x)
        x = posenc(x, offset=self.length)  # (batch, 1, d_model)
        for i, layer in enumerate(self.model.decoder.layers):
            x = layer.sublayer[0](x, lambda y, i=i, a=layer.self_attn: self._self_attn(i, a, y))
            x = layer.sublayer[1](x, lambda y, i=i, a=layer.src_attn: self._src_attn(i, a, y))
            x = layer.sublayer[2](x, layer.feed_forward)
        self.length += 1
        return self.model.generator(self.model.decoder.norm(x)[:, 0])  # (batch, vocab)

    def _self_attn(self, i: int, a: MultiHeadedAttention, y):
        """Masked self-attention of the newest position over all positions so far (no mask needed)."""
        q, (k, v) = a.project_q(y), a.project_kv(y, y)  # (batch, h, 1, d_k) each
        if self.self_kv[i] is not None:
            k = torch.cat([self.self_kv[i][0], k], dim=2)  # (batch, h, t + 1, d_k)
            v = torch.cat([self.self_kv[i][1], v], dim=2)  # (batch, h, t + 1, d_k)
        self.self_kv[i] = (k, v)
        return a.combine(q, k, v)

    def _src_attn(self, i: int, a: MultiHeadedAttention, y):
        """Encoder-decoder attention of the newest position, with the cached projections of ``memory``."""
        k, v = self.cross[i]
        return a.combine(a.project_q(y), k, v, self.src_mask)

    def reorder(self, index):
        """Keep rows ``index`` (new_batch,) of the self-attention cache.

        The encoder-decoder keys and values are not moved: ``index`` must map every row to a
        row of the same sentence (as beam search does), whose source is the same.
        """
        self.self_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.self_kv]


# %% [markdown]
# Greedy decoding on top of it is the same loop, `greedy_search`, with one call to `step`
# per token instead of a full decoder pass (§3). Same arguments, same result: a test checks that
# both produce exactly the same tokens, in float64 and float32, with padded sources in the
# batch, for the readable and the fast attention class, post-norm and pre-norm.

# %%
@torch.no_grad()
def greedy_decode_cached(model: EncoderDecoder, src, src_mask, max_len: int, start_symbol: int,
                         end_symbol: Optional[int] = None, pad: Optional[int] = None):
    """Batched greedy decoding (§3) with :class:`IncrementalDecoder`; the tokens of :func:`greedy_decode`."""
    memory = model.encode(src, src_mask)
    state = IncrementalDecoder(model, memory, src_mask)
    return greedy_search(state, src.size(0), max_len, start_symbol, end_symbol,
                         pad, src.device)


# %% [markdown]
# What the cache saves grows with the output (§3's auto-regression): the full recompute
# does $1 + 2 + … + T$ position-steps of decoder work for $T$ tokens, the cache $T$. The
# table below times both on an untrained model with $d_{\text{model}}=256$ (no end symbol,
# so every sentence runs to the given length) and checks they produced the same tokens.

# %%
if EXAMPLES:
    torch.manual_seed(0)
    timing_model = make_model(1000, 1000, MODEL_PRESETS["tiny"], N=3, d_model=256, d_ff=1024, h=8).eval()
    timing_src = torch.randint(4, 1000, (32, 20))
    timing_mask = torch.ones(32, 1, 20, dtype=torch.bool)
    print("output length   full recompute (s)   cached (s)   speed-up   same tokens")
    for length in (10, 25, 50, 100) if PROFILE == "full" else (10,):
        t0 = time.perf_counter()
        full = greedy_decode(timing_model, timing_src, timing_mask, length + 1, start_symbol=0)
        t1 = time.perf_counter()
        fast = greedy_decode_cached(timing_model, timing_src, timing_mask, length + 1, start_symbol=0)
        t2 = time.perf_counter()
        print(f"{length:13d}   {t1 - t0:18.3f}   {t2 - t1:10.3f}   {(t1 - t0) / (t2 - t1):8.1f}×   "
              f"{torch.equal(full, fast)}")
    del timing_model, timing_src, timing_mask, length, t0, t1, t2, full, fast

# %% [markdown]
# ### Decoding and score
#
# §6.1 translates with beam search (beam size 4, length penalty $\alpha = 0.6$, citing Wu
# et al. 2016), sets the maximum output length to the input length + 50, and terminates
# early when possible (our summary of §6.1, not a quotation). The pieces, in order: the
# length limit, the length penalty, beam search, and `translate`, which decodes a whole set
# of sentences either greedily or with a beam.
#
# **The length limit, precisely.** For a source sentence with $n$ tokens (BPE pieces or
# words, whatever the vocabulary holds; not counting `<s>`, `</s>` and padding), at most
# $n + $ `max_decode_extra` tokens are generated after `<s>`, and a final `</s>` counts as
# one of them. So a translation that stops by itself has at most $n + 49$ tokens and
# `</s>`, and one cut by the limit has exactly $n + 50$ tokens, without `</s>`. The same
# rule holds for greedy, cached greedy and beam search, and tests check it exactly for all
# three. The paper's models never meet the other limit, ours: the positional encoding covers
# `max_len` positions, so the limit is min($n + 50$, `max_len` − 1), and the target `<s>`
# $y_1 \dots y_L$ always fits. A source of more than `max_len` tokens (with `<s>` and
# `</s>`) cannot be encoded at all; `translate` refuses it before decoding anything, naming
# it, and the command line skips such lines and translates the rest (Appendix).
#
# **Special tokens.** No decoder ever emits `<s>` or `<blank>` (their scores are set to
# $-\infty$). `<unk>` is an ordinary token to the decoder: the model may produce it, and
# it is printed as `<unk>`.

# %%
def max_output_tokens(src: torch.Tensor, extra: int, pad: int = PAD) -> torch.Tensor:
    """§6.1's limit for each sentence: n + ``extra`` tokens after <s> (counting </s>), n = source words.

    ``src`` (batch, src_len) holds ``<s> w_1 … w_n </s>`` and padding → (batch,) long.
    """
    return ((src != pad).sum(dim=1) - 2 + extra).clamp(min=0)


def length_penalty(length, alpha: float):
    r"""GNMT length penalty $lp(Y) = ((5 + |Y|)/6)^\alpha$ (Wu et al. 2016, §7), used in §6.1 with $\alpha=0.6$.

    A hypothesis is ranked by $\log P(Y|X) / lp(Y)$, $|Y|$ counting every generated token
    including </s>. $\alpha = 0$ gives $lp = 1$: the raw log-probability.
    """
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def _beam_init(model, src, src_mask, beam_size: int, cached: bool):
    """Encode once and build the decoder state for batch × beam rows (beam search, §6.1)."""
    memory = model.encode(src, src_mask).repeat_interleave(beam_size, dim=0)  # (batch·k, src_len, d_model)
    mask = src_mask.repeat_interleave(beam_size, dim=0)  # (batch·k, 1, src_len)
    return (IncrementalDecoder if cached else FullRecomputeDecoder)(model, memory, mask)


# %% [markdown]
# **Beam search**, batched over sentences. Each sentence keeps $k$ *live* hypotheses
# (prefixes without `</s>`) and, apart from them, the best *finished* one. At each step
# every live hypothesis is extended by every token; of the resulting $k \cdot |V|$
# candidates the $2k$ most probable are taken (so that $k$ live ones remain even if up to
# $k$ of them end). A candidate ending in `</s>` among the top $k$ is finished, scored by
# $\log P / lp$; at the length limit the top $k$ candidates are finished as they are. The
# best $k$ candidates that did not end become the new live hypotheses, and the cache is
# reordered to follow them.
#
# **Terminating early.** Log-probabilities only decrease as a hypothesis grows, and for
# $\alpha \ge 0$ the penalty grows with length, so no live hypothesis with log-probability
# $s$ can end with a score above $s / lp(\text{limit})$. A sentence is done as soon as its
# best finished score is at least that bound for its best live hypothesis (or it reached
# its limit); the batch stops when every sentence is done. With $k = 1$ and $\alpha = 0$
# this is exactly greedy decoding; with $\alpha > 0$ a beam of 1 may still continue its
# one live hypothesis after a shorter one has finished, and keep it if its normalised score
# is better.

# %%
@torch.no_grad()
def beam_search(model, src, src_mask, max_new_tokens, start_symbol: int, end_symbol: int, beam_size: int = 4,
                alpha: float = 0.6, banned: Sequence[int] = (), cached: bool = True) -> list[list[int]]:
    r"""Beam search with the GNMT length penalty and early termination — §6.1.

    ``src`` (batch, src_len); ``max_new_tokens`` an int or (batch,) tensor: tokens allowed
    after ``start_symbol``, counting ``end_symbol``. Returns each sentence's best hypothesis
    under $\log P / lp$ (see :func:`length_penalty`): the generated ids, ending with
    ``end_symbol`` unless cut by the limit. ``start_symbol`` and ``banned`` are never generated.
    """
    if alpha < 0:
        raise ValueError("early termination needs alpha >= 0")
    batch, k, device = src.size(0), beam_size, src.device
    limits = torch.as_tensor(max_new_tokens, device=device).expand(batch)  # (batch,)
    state = _beam_init(model, src, src_mask, k, cached)
    banned = [start_symbol, *banned]
    scores = torch.full((batch, k), float("-inf"), dtype=torch.float64, device=device)  # log P of live hypotheses
    scores[:, 0] = 0.0  # one live hypothesis, <s>, to begin with
    tokens = torch.full((batch, k, 1), start_symbol, dtype=torch.long, device=device)  # (batch, k, t + 1)
    best_score = torch.full((batch,), float("-inf"), dtype=torch.float64, device=device)
    best: list[list[int]] = [[] for _ in range(batch)]
    done = limits <= 0
    rank = torch.arange(2 * k, device=device)  # candidate rank, best first
    offset = (torch.arange(batch, device=device) * k).unsqueeze(1)  # (batch, 1): first row of each sentence
    t = 0
    while not bool(done.all()):
        last = tokens[:, :, -1].reshape(-1)  # (batch·k,): the newest token of every hypothesis
        log_probs = ban_tokens(state.step(last), banned)  # (batch·k, V)
        vocab = log_probs.size(-1)
        t += 1  # length of every candidate (tokens after <s>)
        scores = scores.masked_fill(done.unsqueeze(1), float("-inf"))  # (batch, k): finished sentences stop
        cand = scores.unsqueeze(-1) + log_probs.view(batch, k, vocab).double()  # (batch, k, V)
        cand = cand.view(batch, k * vocab)  # (batch, k·V): log P of every one-token extension
        top, idx = cand.topk(min(2 * k, k * vocab), dim=-1)  # (batch, 2k), best first
        origin, tok = idx // vocab, idx % vocab  # (batch, 2k): which live hypothesis, which token
        n = top.size(1)
        ends, valid = tok == end_symbol, top > float("-inf")
        at_limit = (t >= limits).unsqueeze(1)  # (batch, 1)
        finishing = valid & (rank[:n] < k) & (ends | at_limit)  # (batch, 2k)
        normed = torch.where(finishing, top / length_penalty(t, alpha), float("-inf"))
        m, j = normed.max(dim=-1)  # (batch,)
        for b in torch.nonzero(m > best_score).flatten().tolist():
            best_score[b] = m[b]
            best[b] = tokens[b, origin[b, j[b]], 1:].tolist() + [int(tok[b, j[b]])]
        live = valid & ~ends & ~at_limit  # (batch, 2k)
        order = torch.where(live, rank[:n], rank[:n] + n).argsort(dim=-1)[:, :k]  # first k live candidates
        scores = torch.where(live.gather(1, order), top.gather(1, order), float("-inf"))  # (batch, k)
        rows = (offset + origin.gather(1, order)).reshape(-1)  # (batch·k,)
        state.reorder(rows)
        tokens = torch.cat([tokens.view(batch * k, -1)[rows].view(batch, k, -1),
                            tok.gather(1, order).unsqueeze(-1)], dim=-1)  # (batch, k, t + 2)
        bound = scores[:, 0] / length_penalty(limits.float(), alpha)  # best any live hypothesis can still reach
        done |= at_limit.squeeze(1) | (best_score >= bound)
    return best



# %% [markdown]
# `translate` decodes a list of id sequences in batches of similar length (so a batch
# wastes little padding) and returns token lists without `<s>` and cut at `</s>`: greedily
# with `beam_size=1`, otherwise with beam search; with the key/value cache whenever the
# model is an `EncoderDecoder`. The result does not depend on how sentences are batched.
# Decoding runs on the device it is asked for, whatever device the model was built on
# (a model read from a checkpoint is on the CPU): `on_device` moves the model there.

# %%
def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers (our addition)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def on_device(model: nn.Module, device) -> nn.Module:
    """``model`` on ``device``: moved there (in place) when its parameters are elsewhere (our addition)."""
    device = torch.device(device)
    param = next(model.parameters(), None)
    if param is not None and (param.device.type, param.device.index) != (device.type, device.index):
        if not (device.index is None and param.device.type == device.type):  # "cuda" means the current GPU
            model.to(device)
    return model


# %% [markdown]
# `translate` itself: batches of similar length, each decoded greedily or by beam search.

# %%
@torch.no_grad()
def translate(model: EncoderDecoder, sources: Sequence[list[int]], tgt_vocab: Vocab, cfg: Config,
              device, progress: bool = False, beam_size: int = 1, alpha: float = 0.0,
              cached: Optional[bool] = None) -> list[list[str]]:
    """Translations (token lists, without <s>, cut at </s>) of id sequences — §6.1 decoding, batched by length.

    ``beam_size=1`` is greedy decoding, otherwise :func:`beam_search` with length penalty
    ``alpha``. ``cached`` (default: when the model is an :class:`EncoderDecoder`) uses the
    key/value cache. At most min(n + ``cfg.max_decode_extra``, ``cfg.max_len`` − 1) tokens follow <s>
    (see above); sources longer than ``cfg.max_len`` raise ``ValueError``."""
    if too_long := [i for i, s in enumerate(sources) if len(s) > cfg.max_len]:
        raise ValueError(f"sources {too_long[:10]} are longer than max_len={cfg.max_len} positions")
    model = on_device(unwrap(model), device)
    model.eval()
    if cached is None:
        cached = isinstance(model, EncoderDecoder)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list = [None] * len(sources)
    starts = range(0, len(order), cfg.eval_batch_size)
    for s in tqdm(starts, desc="decoding", disable=not progress, leave=False):
        idx = order[s: s + cfg.eval_batch_size]
        src = pad_sequences([sources[i] for i in idx]).to(device)
        src_mask = padding_mask(src, PAD)  # (batch, 1, src_len)
        limits = max_output_tokens(src, cfg.max_decode_extra).clamp(max=cfg.max_len - 1)  # (batch,)
        if beam_size == 1:
            decode = greedy_decode_cached if cached else greedy_decode
            ys = decode(model, src, src_mask, max_len=1 + int(limits.max()), start_symbol=BOS,
                        end_symbol=EOS, pad=PAD)
            rows = [row[1: 1 + n] for row, n in zip(ys.tolist(), limits.tolist())]  # each sentence's own limit
        else:
            rows = beam_search(model, src, src_mask, limits, BOS, EOS, beam_size, alpha, banned=[PAD],
                               cached=cached)
        for i, row in zip(idx, rows):
            out[i] = tgt_vocab.lookup_tokens(row[: row.index(EOS)] if EOS in row else row)
    return out


# %% [markdown]
# Then ids become text and sacreBLEU scores it, each data set as its record says. BPE
# pieces are joined back by sentencepiece; a word-level vocabulary's Multi30k output is
# detokenized with sacremoses. Multi30k is scored against the raw, cased references with
# sacreBLEU's default tokenizer; IWSLT14 stays tokenized and lowercased and is scored
# against the prepared references with `tokenize="none"`, the way published IWSLT14 numbers
# are computed (sacreBLEU's warning that the text looks tokenized is switched off there,
# since it is meant to be).

# %%
def detokenize(tokens_list: Sequence[list[str]], dataset: str, subwords: Optional[Subwords] = None) -> list[str]:
    """Token lists → strings in the form ``dataset``'s references have (its record says); BPE pieces are decoded."""
    if subwords is not None:
        return subwords.decode(tokens_list)
    if CORPORA[dataset].detokenize == "moses":
        from sacremoses import MosesDetokenizer

        md = MosesDetokenizer(lang=CORPORA[dataset].tgt)
        return [md.detokenize(t) for t in tokens_list]
    return [" ".join(t) for t in tokens_list]


class Bleu(NamedTuple):
    """A corpus BLEU score as sacreBLEU reports it."""

    score: float  # 0–100
    text: str  # sacreBLEU's line: "BLEU = 41.79 72.1/48.9/… (BP = … )"
    signature: str  # how it was computed (tokenizer, smoothing, version)


def bleu(hypotheses: Sequence[str], references: Sequence[str], dataset: str) -> Bleu:
    """Corpus BLEU (§6.1's metric) with sacreBLEU, tokenized as ``dataset``'s record says — the one BLEU here."""
    import sacrebleu

    tokenize = CORPORA[dataset].bleu_tokenize
    metric = sacrebleu.BLEU(tokenize=tokenize, force=tokenize == "none")
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return Bleu(result.score, str(result), str(metric.get_signature()))


# %% [markdown]
# # Appendix — machinery
#
# Everything a real run needs that is not the paper: where the data comes from and how it
# is prepared, caches, the checkpoint files, devices and processes, and the command line.
# It is defined here because Part 4 runs it; on a first reading, skip to Part 4.

# %% [markdown]
# ## A.1 Where the data comes from
#
# Each data set is a folder of parallel files. The loader looks, in order, in a local
# **mirror** folder (`Config.data_mirror`, or the environment variable `DATA_MIRROR`), then
# in its own data folder (`Config.data_dir`, or `ANNOTATED_TRANSFORMER_DATA`, or `./data`),
# and finally downloads what is missing. Downloads are checked against a pinned SHA-256
# where one is known and are written atomically (to a temporary file that is renamed only
# when complete). For IWSLT14 the download is the raw TED archive, which
# `prepare_iwslt14` turns into the standard layout.

# %% [markdown]
# Where the files are published and which checksums are pinned is in each data set's record
# (Part 2, `CORPORA`). Downloads and caches go to the data folder:

# %%
def default_data_dir() -> Path:
    """``$ANNOTATED_TRANSFORMER_DATA`` or ``./data``: where downloads and caches go."""
    return Path(os.environ.get("ANNOTATED_TRANSFORMER_DATA", "data"))


# %% [markdown]
# `download` writes through `atomic_file` (Part 2), and checks the checksum before the rename.

# %%
def download(url: str, dest: Path, sha256: Optional[str] = None, desc: Optional[str] = None) -> Path:
    """Fetch ``url`` to ``dest`` atomically, checking ``sha256`` when given.

    Any URL scheme ``urllib`` knows works, ``file://`` included. A corrupt or interrupted
    download never leaves a file at ``dest``.
    """
    digest = hashlib.sha256()
    with atomic_file(dest) as out, urllib.request.urlopen(url, timeout=60) as resp:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc or Path(dest).name, leave=False) as bar:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DataError(f"checksum mismatch for {url}: expected sha256 {sha256}, got {digest.hexdigest()}")
    return Path(dest)


# %% [markdown]
# IWSLT14 is published as the raw TED archive; we follow the widely used fairseq recipe: drop the
# metadata lines of the training talks (URL, talk id, keywords, speaker, …) and keep the
# text of titles and descriptions; take the `<seg>` lines of the evaluation XML files;
# Moses-tokenize (sacremoses) with `&apos;`/`&quot;` escaping; drop pairs with an empty or
# over-175-token side or a length ratio above 1.5; lowercase; hold out every 23rd training
# pair as the validation set; the test set is dev2010 + dev2012 + tst2010 + tst2011 + tst2012.
# First, the two kinds of file in the archive: a training file's text lines, and an XML file's segments.

# %%
_IWSLT_META = re.compile(r"^\s*<(url|talkid|keywords|speaker|reviewer|translator|doc|/doc)\b")
_IWSLT_TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                    "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")


def _iwslt_train_lines(text: str) -> list[str]:
    """Text lines of a ``train.tags.*`` file: metadata dropped, title/description tags removed."""
    lines = []
    for line in text.split("\n"):
        if _IWSLT_META.match(line):
            continue
        line = re.sub(r"</?(title|description)>", "", line).strip()
        lines.append(line)
    return lines


def _iwslt_xml_segments(text: str) -> list[str]:
    """The ``<seg id="N">…</seg>`` contents of an IWSLT evaluation XML file."""
    return [m.group(1).strip().replace("\u2019", "'")
            for m in re.finditer(r"<seg id=\"?\d+\"?>(.*?)</seg>", text)]


# %% [markdown]
# Then the recipe, `prepare_iwslt14`: read the archive's members, tokenize, filter, hold out
# every 23rd training pair for validation, and write the three splits.

# %%
def prepare_iwslt14(archive: Path, out_dir: Path, src: str = "de", tgt: str = "en") -> dict:
    """Turn the raw IWSLT14 TED archive (``de-en.tgz``) into ``{train,valid,test}.{de,en}``.

    Returns the number of pairs written per split. Output files are written atomically.
    """
    from sacremoses import MosesTokenizer

    tok = {lang: MosesTokenizer(lang=lang) for lang in (src, tgt)}

    def prep(lang: str, s: str) -> str:
        return tok[lang].tokenize(s, escape=True, return_str=True).lower()

    members: dict[str, str] = {}
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if m.isfile():
                members[Path(m.name).name] = tar.extractfile(m).read().decode("utf-8")
    pair = f"{src}-{tgt}"
    try:
        raw_src = _iwslt_train_lines(members[f"train.tags.{pair}.{src}"])
        raw_tgt = _iwslt_train_lines(members[f"train.tags.{pair}.{tgt}"])
    except KeyError as e:
        raise DataError(f"{archive} has no {e.args[0]}: is it the IWSLT14 {pair} archive?") from None
    if len(raw_src) != len(raw_tgt):
        raise DataError(f"{archive}: training talks misaligned ({len(raw_src)} vs {len(raw_tgt)} lines)")
    train, valid = [], []
    for s, t in zip(raw_src, raw_tgt):
        s, t = tok[src].tokenize(s, escape=True, return_str=True), tok[tgt].tokenize(t, escape=True, return_str=True)
        ls, lt = len(s.split()), len(t.split())
        if not (1 <= ls <= 175 and 1 <= lt <= 175) or ls / lt > 1.5 or lt / ls > 1.5:
            continue
        train.append((s.lower(), t.lower()))
    kept = []
    for i, p in enumerate(train, start=1):
        (valid if i % 23 == 0 else kept).append(p)
    test = []
    for name in _IWSLT_TEST_SETS:
        fs, ft = f"{name}.{pair}.{src}.xml", f"{name}.{pair}.{tgt}.xml"
        if fs not in members or ft not in members:
            raise DataError(f"{archive} has no {fs} / {ft}")
        segs_s, segs_t = _iwslt_xml_segments(members[fs]), _iwslt_xml_segments(members[ft])
        if len(segs_s) != len(segs_t):
            raise DataError(f"{archive}: {fs} has {len(segs_s)} segments but {ft} has {len(segs_t)}")
        test += [(prep(src, s), prep(tgt, t)) for s, t in zip(segs_s, segs_t)]
    counts = {}
    for split, pairs in (("train", kept), ("valid", valid), ("test", test)):
        write_atomic(out_dir / f"{split}.{src}", (p[0] for p in pairs))
        write_atomic(out_dir / f"{split}.{tgt}", (p[1] for p in pairs))
        counts[split] = len(pairs)
    return counts


# %% [markdown]
# Finding a data set yields a `DataSource`: its files, and a sentence saying where they came
# from, which the run log repeats.

# %%
@dataclass(frozen=True)
class DataSource:
    """Where a data set's files are: ``files`` maps split → (source path, target path)."""

    name: str
    files: dict
    origin: str  # a sentence for the user: "mirror $DATA_MIRROR/multi30k", "downloaded to …"


# %% [markdown]
# Downloading, as the record says: files as published (Multi30k's six, checked against the
# pinned sums), or an archive to prepare (IWSLT14's, through `prepare_iwslt14`). A corrupt
# archive is removed so that the next attempt downloads it again.

# %%
def fetch_dataset(name: str, data_dir: Path, url_base: Optional[str] = None) -> Path:
    """Download data set ``name`` into ``data_dir/name`` as its record says (``url_base`` replaces its url)."""
    corpus, folder = CORPORA[name], Path(data_dir) / name
    if not corpus.prepare:  # the files as published, each checked against its pinned sum
        for pair in corpus.files.values():
            for f in pair:
                if not (folder / f).is_file():
                    download((url_base or corpus.url) + f, folder / f, corpus.sha256.get(f))
        return folder
    archive = Path(data_dir) / "downloads" / f"{name}-{Path(corpus.url).name}"
    if not archive.is_file():
        download(url_base or corpus.url, archive, corpus.sha256.get(Path(corpus.url).name))
    try:
        {"fairseq-iwslt14": prepare_iwslt14}[corpus.prepare](archive, folder, corpus.src, corpus.tgt)
    except (tarfile.TarError, EOFError) as e:
        archive.unlink(missing_ok=True)  # a corrupt download must not stick
        raise DataError(f"{archive} is not a readable archive ({e}); removed, try again") from e
    return folder


# %% [markdown]
# `locate_dataset` tries the mirror, then the data folder, then downloading, and says which
# one it used. Offline, with no mirror and nothing downloaded before, it fails once, with a
# message that names both ways to get the data.

# %%
def locate_dataset(name: str, cfg: Config, url_base: Optional[str] = None) -> DataSource:
    """Find (or fetch) data set ``name`` — mirror first, then the data folder, then download.

    ``url_base`` replaces the download location (tests pass ``file://`` URLs).
    """
    if name not in CORPORA or CORPORA[name].synthetic:
        raise DataError(f"unknown data set {name!r} (known: {', '.join(n for n, c in CORPORA.items() if c.files)})")
    corpus = CORPORA[name]
    layout = corpus.files
    mirror = cfg.data_mirror or os.environ.get("DATA_MIRROR", "")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()

    def complete(folder: Path) -> Optional[dict]:
        files = {}
        for split, (s, t) in layout.items():
            if (folder / s).is_file() and (folder / t).is_file():
                files[split] = (folder / s, folder / t)
        if corpus.sample and "train" not in files and corpus.sample in files:
            files["train"] = files.pop(corpus.sample)
            files["train-is-sample"] = True
        files.pop(corpus.sample, None)
        return files if all(k in files for k in ("train", "valid", "test")) else None

    shown = Path(cfg.data_mirror or "$DATA_MIRROR") / name  # name the setting, not this machine's path
    candidates = ([(Path(mirror) / name, f"mirror {shown}")] if mirror else [])
    candidates.append((data_dir / name, f"data folder {data_dir / name}"))
    sample = None  # a folder with only the IWSLT14 training sample, used if no full one exists
    for folder, origin in candidates:
        files = complete(folder)
        if files and files.pop("train-is-sample", False):
            sample = sample or DataSource(
                name, files, origin + f" (the training *sample* {'/'.join(corpus.files[corpus.sample])}: "
                                      f"the full {'/'.join(corpus.files['train'])} are not there)")
        elif files:
            return DataSource(name, files, origin)
    if sample is not None:
        return sample

    how = (f"Either point DATA_MIRROR (or --data_mirror) at a folder that holds {name}/ "
           f"with {', '.join(f for pair in layout.values() for f in pair)}, "
           f"or go online so that it can be downloaded into {data_dir / name}.")
    if not cfg.download:
        raise DataError(f"{name} not found (looked in: {', '.join(o for _, o in candidates)}). {how}")
    folder = data_dir / name
    try:
        fetch_dataset(name, data_dir, url_base)
    except (OSError, urllib.error.URLError) as e:
        raise DataError(f"could not download {name} ({e}). {how}") from e
    files = complete(folder)
    if not files:
        raise DataError(f"{name}: download finished but files are missing in {folder}")
    files.pop("train-is-sample", None)
    return DataSource(name, files, f"downloaded to {folder}")


# %% [markdown]
# Multi30k has two more test sets of Flickr captions, from the 2017 and 2018 shared tasks,
# in the same `raw/` folder (its record's `extra_tests`). Training never needs them;
# `evaluate --split test_2017_flickr` (or `test_2018_flickr`) scores a model on them. They
# are looked for in the same places and downloaded the same way, but **without** a
# checksum: we know no authoritative SHA-256 for them, so they are not pinned.

# %%
def locate_test_split(name: str, split: str, cfg: Config, url_base: Optional[str] = None) -> tuple[Path, Path]:
    """(source file, target file) of a test split of data set ``name``: mirror, then data folder, then download.

    ``split`` is ``"test"`` (the one training scores), ``"valid"`` (the one it validates on) or one of the
    record's ``extra_tests``.
    """
    corpus = CORPORA[name]
    if split in ("test", "valid"):
        return locate_dataset(name, cfg, url_base=url_base).files[split]
    if split not in corpus.extra_tests:
        raise DataError(f"{name} has no split {split!r} here (known: {', '.join(['test', 'valid', *corpus.extra_tests])}); "
                        "give --src and --ref")
    names = corpus.extra_tests[split]
    mirror = cfg.data_mirror or os.environ.get("DATA_MIRROR", "")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    folders = ([Path(mirror) / name] if mirror else []) + [data_dir / name]
    for folder in folders:
        if all((folder / f).is_file() for f in names):
            return folder / names[0], folder / names[1]
    if not cfg.download:
        raise DataError(f"{split} not found in {', '.join(map(str, folders))}, and downloading is off")
    try:
        return tuple(download((url_base or corpus.url) + f, data_dir / name / f) for f in names)
    except (OSError, urllib.error.URLError) as e:
        raise DataError(f"could not download {name} {split} ({e})") from e


# %% [markdown]
# ### Reading parallel text, carefully
#
# Bad data fails loudly and precisely: files of different lengths name both files and both
# line counts; invalid UTF-8 names the file and line; empty lines are skipped and counted.
# Only `\n` and `\r\n` end a line — not the form feed, a lone carriage return, U+0085 or
# U+2028 that Python's `str.splitlines` also splits at — so line $i$ of a file is line $i$
# of its translation; a leading byte-order mark is dropped. Standard input is read the same way.
# Over-long pairs are filtered out of the *training* data with a count (never truncated);
# the test set is always scored in full.

# %%
def split_lines(raw: bytes, name: str) -> list[str]:
    """Lines of UTF-8 bytes (our addition): only ``\n`` and ``\r\n`` end one, a leading BOM is dropped,
    bad bytes name the line."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            out.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as e:
            raise DataError(f"{name}, line {i}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    return out


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` allowed), as :func:`split_lines` reads them; names what is wrong."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    return split_lines(raw, str(path))


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[tuple[str, str]], int]:
    """Aligned (source, target) sentence pairs and the number of pairs skipped as empty."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"misaligned parallel files: {src_path} has {len(src)} lines, "
                        f"{tgt_path} has {len(tgt)} lines")
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt)]
    kept = [p for p in pairs if p[0] and p[1]]
    return kept, len(pairs) - len(kept)


def make_tokenizer(dataset: str, lang: str) -> Callable[[list[str]], list[list[str]]]:
    """A batch word tokenizer as ``dataset``'s record says: spaCy's rules for ``lang``, or whitespace.

    ``spacy.blank(lang)`` carries the same tokenizer rules as spaCy's trained pipelines,
    without their weights.
    """
    if CORPORA[dataset].words == "spacy":
        import spacy

        nlp = spacy.blank(lang)

        def spacy_tokenize(lines: list[str]) -> list[list[str]]:
            return [[t.text for t in doc if not t.is_space] for doc in nlp.tokenizer.pipe(lines, batch_size=2000)]

        return spacy_tokenize
    return lambda lines: [line.split() for line in lines]


# %% [markdown]
# ### Putting a data set together
#
# A `Dataset` is everything training needs: the vocabularies, the id sequences of each split
# (each with `<s>` … `</s>` around it), the raw test references for BLEU, and the counts of
# what was skipped or filtered. The copy task of Part 4 is generated straight into one.

# %%
@dataclass
class Dataset:
    """Splits as lists of (source ids, target ids), vocabularies, and what was dropped."""

    name: str
    src_vocab: Vocab
    tgt_vocab: Vocab
    splits: dict  # split → list of (src ids, tgt ids)
    test_refs: list  # reference strings for BLEU, aligned with splits["test"]
    origin: str = ""
    stats: dict = field(default_factory=dict)
    subwords: Optional[Subwords] = None  # the BPE model when cfg.vocab == "bpe"


def make_copy_data(cfg: Config, vocab_size: int = 11, length: int = 10,
                   sizes: tuple = (1600, 160, 100)) -> Dataset:
    """The synthetic copy task: random sequences of symbols that the target repeats.

    Symbols are the strings "1" … str(vocab_size - 1); with the four specials that is a
    vocabulary of vocab_size + 3. Deterministic for a given ``cfg.seed``.
    """
    rng = random.Random(cfg.seed)
    symbols = [str(i) for i in range(1, vocab_size)]
    vocab = Vocab(list(SPECIALS) + symbols)
    splits, refs = {}, []
    for split, n in zip(("train", "valid", "test"), sizes):
        seqs = [[rng.choice(symbols) for _ in range(length)] for _ in range(n)]
        ids = [[BOS] + vocab(s) + [EOS] for s in seqs]
        splits[split] = [(x, list(x)) for x in ids]
        if split == "test":
            refs = [" ".join(s) for s in seqs]
    return Dataset("copy", vocab, vocab, splits, refs, origin="generated", stats={})


# %% [markdown]
# `load_dataset` is the one entry point: locate, read, build the vocabulary (words or BPE),
# filter over-long training pairs, turn every split into ids, and report what it dropped.

# %%
def load_dataset(cfg: Config, log: Callable = print, url_base: Optional[str] = None) -> Dataset:
    """Locate, read, tokenize and number the data set ``cfg.dataset``; report what was dropped."""
    corpus = CORPORA[cfg.dataset]
    if corpus.synthetic:
        return make_copy_data(cfg)
    source = locate_dataset(cfg.dataset, cfg, url_base=url_base)
    raw, stats = {}, {}
    for split in ("train", "valid", "test"):
        raw[split], stats[f"{split}_empty_skipped"] = read_parallel(*source.files[split])
        stats[f"{split}_pairs"] = len(raw[split])
    vocab_files, held = source.files["train"], ""
    if cfg.train_on_valid_rest:  # validation keeps its first pairs; the rest are training pairs again
        n = cfg.max_valid_sentences
        raw["train"], raw["valid"] = raw["train"] + raw["valid"][n:], raw["valid"][:n]
        stats["valid_pairs_trained_on"], stats["valid_pairs"] = stats["valid_pairs"] - len(raw["valid"]), len(raw["valid"])
        vocab_files, held = (*source.files["train"], *source.files["valid"]), f"|valid after {n}"
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    subwords = None
    if cfg.vocab == "bpe":
        key = _files_digest(vocab_files, f"bpe|{cfg.dataset}|{cfg.bpe_size}{held}")
        subwords = build_subwords(raw["train"], cfg, key, data_dir / "cache")
        tok_src = tok_tgt = subwords.encode
    else:
        tok_src, tok_tgt = make_tokenizer(cfg.dataset, corpus.src), make_tokenizer(cfg.dataset, corpus.tgt)
    tokens = {split: (tok_src([p[0] for p in pairs]), tok_tgt([p[1] for p in pairs])) for split, pairs in raw.items()}
    src_t, tgt_t = tokens["train"]
    keep = [i for i in range(len(src_t)) if len(src_t[i]) <= cfg.max_tokens and len(tgt_t[i]) <= cfg.max_tokens]
    stats["train_too_long_filtered"] = len(src_t) - len(keep)
    tokens["train"] = ([src_t[i] for i in keep], [tgt_t[i] for i in keep])
    stats["train_pairs"] = len(keep)
    if subwords is not None:
        src_vocab = tgt_vocab = subwords.vocab
    else:
        key = _files_digest(vocab_files, f"{cfg.dataset}|{cfg.min_freq}|{cfg.shared_vocab}|{cfg.max_tokens}{held}")
        src_vocab, tgt_vocab = build_vocabs(tokens["train"], cfg, key, data_dir / "cache")
    splits = {
        split: [([BOS] + src_vocab(s) + [EOS], [BOS] + tgt_vocab(t) + [EOS]) for s, t in zip(*tokens[split])]
        for split in ("train", "valid", "test")
    }
    unk = sum(ids.count(UNK) for pair in splits["test"] for ids in pair)
    stats["test_unk_share"] = round(unk / max(sum(len(ids) - 2 for pair in splits["test"] for ids in pair), 1), 4)
    log(f"data: {cfg.dataset} from {source.origin}; " + ", ".join(f"{k}={v:,}" for k, v in stats.items())
        + f"; {'BPE' if subwords else 'word'} vocab {len(src_vocab):,}"
        + ("" if src_vocab is tgt_vocab else f"/{len(tgt_vocab):,}"))
    return Dataset(cfg.dataset, src_vocab, tgt_vocab, splits, [p[1] for p in raw["test"]], source.origin, stats,
                   subwords)


# %% [markdown]
# `epoch_pairs` hands training the pairs of one epoch: the ids above, or, with BPE-dropout,
# the same sentences (decoded from those ids) segmented afresh for that epoch.

# %%
def epoch_pairs(data: Dataset, cfg: Config, epoch: int) -> list:
    r"""The training pairs (source ids, target ids) of epoch ``epoch``: ``data.splits["train"]``, or with
    ``cfg.bpe_dropout`` > 0 both sides segmented afresh with BPE-dropout — our addition, for small data.

    The segmentation is a function of (seed, epoch), like the epoch's batches, so a resumed run and
    every process of a multi-process run see the same pieces.
    """
    if not cfg.bpe_dropout:
        return data.splits["train"]
    if data.subwords is None:
        raise ValueError("bpe_dropout needs a BPE vocabulary (vocab=bpe)")
    vocab, pairs = data.subwords.vocab, data.splits["train"]
    # the text back from the ordinary pieces: sentencepiece's own normalisation of the sentence
    src_text, tgt_text = (data.subwords.decode([vocab.lookup_tokens(p[side][1:-1]) for p in pairs]) for side in (0, 1))
    seed = 2 * ((cfg.seed * 1_000_003 + epoch) % 2**30)  # one even seed per (run seed, epoch); +1 for the target side
    src = data.subwords.sample(src_text, cfg.bpe_dropout, seed)
    tgt = data.subwords.sample(tgt_text, cfg.bpe_dropout, seed + 1)
    return [([BOS] + vocab(s) + [EOS], [BOS] + vocab(t) + [EOS]) for s, t in zip(src, tgt)]

# %% [markdown]
# ## A.2 Devices, precision, processes and signals
#
# Small pieces a run needs from its surroundings: which device, which precision pays off
# there, whether several processes train together (`torchrun` sets `WORLD_SIZE`), and a
# way to turn Ctrl-C into "save and stop after this update".

# %%
def resolve_device(name: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# %% [markdown]
# **A precision the hardware computes fast.** bf16 autocast roughly doubles the matrix
# throughput of a CPU with native bf16 instructions (AVX-512 BF16 or AMX) and of GPUs from
# compute capability 8.0 (A100, H100, RTX 30xx and later); where bf16 is only *emulated* —
# most AVX2 CPUs, and the T4 and V100 — it runs many times slower than float32. Those GPUs
# have fast fp16 instead, whose narrow range needs a **gradient scaler**: the loss is
# multiplied by a large factor before the backward pass so that small gradients do not
# round to zero, the gradients are divided by it before the step, and an update whose
# gradients overflowed is skipped while the factor shrinks. So `precision="auto"` (the
# default) picks bf16 where it is native, fp16 with the scaler on older GPUs with fast fp16,
# float32 elsewhere, and the run log says which and why; `fp32`, `bf16` and `fp16` override
# it (the former `bf16` switch still works and maps onto them). The loss is summed in
# float32 under either autocast, and masked attention scores are $-\infty$, which fp16
# represents, so masks stay exact.

# %%
def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes in bf16 natively (not emulated), with the reason in words (our addition).

    A CUDA device does from compute capability 8.0 (Ampere) on. ``torch.cuda.is_bf16_supported()``
    is not the test: by default it also counts emulation (T4, V100), and it asks about the
    current device rather than the run's.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 0):
            return True, f"the GPU (compute capability {major}.{minor}) computes bf16 natively"
        return False, f"the GPU (compute capability {major}.{minor}) would only emulate bf16"
    if device.type == "cpu":
        kernels = torch.backends.cpu.get_cpu_capability()  # the vector kernels torch runs: "AVX512", "AVX2", …
        unit = ("AMX" if torch.cpu._is_amx_tile_supported()
                else "AVX-512 BF16" if torch.cpu._is_avx512_bf16_supported() else None)
        if unit and kernels.startswith("AVX512"):
            return True, f"the CPU has native bf16 ({unit})"
        return False, (f"the CPU has no native bf16 (kernels: {kernels}), so bf16 would be emulated "
                       "and much slower than float32")
    return False, f"bf16 autocast is not used on {device.type}"


def fast_fp16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` is a GPU where fp16 autocast pays (our addition): tensor cores (capability ≥ 7.0), or 6.0."""
    if device.type != "cuda":
        return False, f"fp16 autocast is not chosen on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (7, 0) or (major, minor) == (6, 0):
        return True, f"the GPU (compute capability {major}.{minor}) computes fp16 fast"
    return False, f"the GPU (compute capability {major}.{minor}) computes fp16 slowly"


def resolve_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """Decide ``Config.precision`` for ``device`` (our addition): ("fp32" | "bf16" | "fp16", a line for the log).

    ``auto``: bf16 where the device computes it natively, else fp16 (with a gradient scaler)
    on GPUs where fp16 is fast, else fp32. Anything else is obeyed, with a note when slow.
    """
    if setting == "auto":
        bf16, why_bf16 = native_bf16(device)
        if bf16:
            return "bf16", f"precision: bf16 autocast (auto: {why_bf16})"
        fp16, why_fp16 = fast_fp16(device)
        if fp16:
            return "fp16", f"precision: fp16 autocast with a gradient scaler (auto: {why_bf16}; {why_fp16})"
        return "fp32", f"precision: float32 (auto: {why_bf16})"
    if setting == "bf16":
        on, why = native_bf16(device)
        return "bf16", "precision: bf16 autocast (asked for" + ("" if on else f"; note: {why}") + ")"
    if setting == "fp16":
        return "fp16", "precision: fp16 autocast with a gradient scaler (asked for)"
    return "fp32", "precision: float32 (asked for)"


# %% [markdown]
# **Memory that is freed and asked for again.** On a CPU, PyTorch takes each tensor's
# memory from the C library's `malloc` and gives it back when the tensor dies. glibc (the C
# library of most Linux systems) serves a block of more than 32 MB (and, until it adapts,
# of more than 128 KB) with a fresh mapping from the operating system and unmaps it when it
# is freed, so a training step that makes the same large tensors every time (the
# (tokens × vocabulary) logits and their gradient: 77 MB in float32 for a `multi30k-small`
# batch) pays every time for the system to hand over and zero fresh pages. A whole
# `multi30k-small` step ran 1.22× faster in bf16 and 1.10× in float32 with the memory
# reused (`benchmarks/profile_step.py`, run with and without the settings below). Two of glibc's settings, read from the environment when a process starts, make it
# keep freed memory for reuse: `MALLOC_MMAP_MAX_=0` (no separate mappings) and a large
# `MALLOC_TRIM_THRESHOLD_` (do not give the top of the heap back). The `Makefile` sets both
# for everything it runs; a CPU run started another way says in its log when they are not
# set. A process then keeps its largest footprint until it ends, which is what a training
# run does anyway. Other C libraries (macOS, musl) ignore the variables.

# %%
GLIBC_MALLOC_SETTINGS = MappingProxyType({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 34)})


def allocator_note(device: torch.device, environ=None) -> str:
    """A line for the log on how freed CPU memory is reused (our addition); "" off the CPU or off glibc."""
    environ = os.environ if environ is None else environ
    if device.type != "cpu" or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return ""
    settings = " ".join(f"{k}={v}" for k, v in GLIBC_MALLOC_SETTINGS.items())
    if all(environ.get(k) == v for k, v in GLIBC_MALLOC_SETTINGS.items()):
        return f"memory: glibc keeps freed memory for reuse ({settings})"
    return (f"memory: not {settings} (what `make` sets), so with glibc's defaults large tensors get fresh "
            "pages every step; setting them made CPU training steps faster (README: Performance)")


def dropout_note(cfg: ModelConfig, device: torch.device) -> str:
    """A line for the log on how the dropout masks of §5.4 are drawn (our addition); "" where that is
    PyTorch's own doing anyway: off the CPU, with ``FastDropout``, or no dropout."""
    if device.type != "cpu" or cfg.fast_dropout or not 0 < cfg.P_drop < 1:
        return ""
    draw = mask_drawer(1 - cfg.P_drop, torch.float32)
    if getattr(draw, "func", None) is _kernel_scaled_mask:
        return "dropout masks: nn.Dropout's, drawn by the compiled kernel (csrc/dropout_mask.c)"
    if draw is None:
        return "dropout masks: nn.Dropout's own (this PyTorch's bernoulli_ cannot be replayed here)"
    where = os.environ.get("ANNOTATED_TRANSFORMER_KERNEL") or DROPOUT_KERNEL
    why = ("it was not used: it did not load or did not reproduce bernoulli_ here" if Path(where).is_file()
           else "nothing is built there; `make kernel` compiles csrc/dropout_mask.c, which draws them faster")
    return f"dropout masks: nn.Dropout's, drawn with random_ (compiled kernel {where}: {why})"


# %% [markdown]
# Several processes. The backend follows the device the run trains on — not whether CUDA
# exists: `--device cpu` on a GPU machine is a Gloo run — and every tensor handed to a
# collective lives on that device (NCCL takes CUDA tensors only). Each process keeps its own
# random streams: the first process continues the stream of `seed`, the others start their
# own (`seed_process`), so dropout differs between GPUs; a checkpoint stores each process's
# state and a resume with as many processes restores each its own.

# %%
def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a run on ``device`` (our addition): NCCL for CUDA, Gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _distributed(device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(rank, world size); starts the process group, for a run on ``device``, when launched by ``torchrun``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend(device))
    return dist.get_rank(), world


def _barrier(device: torch.device) -> None:
    """Wait for every process (our addition; NCCL is told which GPU this process uses)."""
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def any_process(flags: Sequence[bool], world: int, device: torch.device) -> list[bool]:
    """Each flag, true if it is true in any process (our addition: one collective, on the training device)."""
    if world == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [v > 0 for v in t.tolist()]


def seed_process(seed: int, rank: int, step: int = 0) -> None:
    """Seed this process's torch and Python streams (our addition): ``seed`` for process 0 at step 0, else distinct."""
    value = seed + 1_000_003 * rank + 7_919 * step
    torch.manual_seed(value)
    random.seed(value)


def rng_state(device: torch.device) -> dict:
    """This process's random-number state (our addition): torch's CPU stream, Python's, its own GPU's (if any)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng(state: dict, device: torch.device) -> None:
    """Put back a state of :func:`rng_state` (our addition); older checkpoints list every visible GPU's: by index."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if device.type == "cuda" and cuda is not None:
        if isinstance(cuda, (list, tuple)):
            index = device.index if device.index is not None else torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


# %% [markdown]
# Ctrl-C during training should not throw away the update in progress, nor leave without
# a checkpoint. `StopRequest` turns SIGINT and SIGTERM into a flag that the loop reads after
# each update.

# %%
class StopRequest:
    """Turns SIGINT/SIGTERM into a request to stop after the current update.

    A context manager: inside it the first signal only sets ``signum``; the training loop
    checks :meth:`requested` after each update, saves and stops. A second signal stops at
    once (``KeyboardInterrupt``). Handlers are installed only in the main thread, and the
    previous ones are put back on exit.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, world: int = 1, device: torch.device = torch.device("cpu")) -> bool:
        """True once a signal arrived (in any process of a distributed run on ``device``: all stop together)."""
        return any_process([self.signum is not None], world, device)[0]



# %% [markdown]
# Three small helpers for the files of A.3 and A.4: reading back a metrics log that a crash
# may have torn, and the short forms of an error and of the free disk space that their
# messages quote.

# %%

def metrics_lines_upto(raw: bytes, step: int) -> tuple[list[str], int, int]:
    """(records of step ≤ ``step``, lines that are not whole records, records after ``step``) — our addition."""
    kept, torn, later = [], 0, 0
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            record_step = json.loads(line)["step"]
            if not isinstance(record_step, int):
                raise TypeError(record_step)
        except (ValueError, KeyError, TypeError):
            torn += 1
            continue
        if record_step > step:
            later += 1
        else:
            kept.append(line)
    return kept, torn, later


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (torch's can run to many lines) — our addition, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def free_space(folder: Path) -> str:
    """How much room the disk of ``folder`` has left, in words — our addition, for error messages."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


# %% [markdown]
# ## A.3 Checkpoint files
#
# A checkpoint holds the model, optimizer, scheduler and gradient-scaler states, the step and
# the position in the epoch, every process's random-number states, the config and the
# vocabulary. It is written to a
# temporary file and renamed, so a crash never leaves a half-written checkpoint; the last
# `keep_checkpoints` are kept, for averaging (§6.1 averages the last 5). Loading uses
# `torch.load(weights_only=True)`, which never runs code from the file. Resuming restores
# everything, so that N steps, a stop and N more steps give exactly the parameters of 2N
# steps in one go (a test checks it).
#
# A checkpoint is written at the end of every epoch and, inside long epochs, every
# `checkpoint_minutes` (10 by default — the interval at which §6.1 says the paper wrote its
# checkpoints). Ctrl-C (SIGINT) or SIGTERM does not kill training mid-update: the current
# update finishes, a checkpoint is saved, and the run stops with a message saying that the
# same command continues it (a second Ctrl-C stops at once). On resuming, the records the
# metrics log received after the checkpoint are dropped, so no step is logged twice.
#
# The file is a plain dictionary of tensors and numbers, written with `torch.save` through
# `atomic_file` (Part 2) and checked on loading against the config, the vocabularies and
# the BPE model it must match.

# %%
class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: unreadable, truncated, or from another config or vocabulary."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file is missing, truncated or not one this program wrote (resuming falls back past it)."""


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used: not writable, or in use by another run (our addition)."""


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped training after the current update; a checkpoint was saved first."""




@dataclass
class Position:
    """Where training stands: updates taken, the epoch (from 0), global batches of the epoch consumed."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the epoch's global order consumed, by all processes together


def save_checkpoint(path: Path, trainer: Trainer, data: Dataset, pos: Position, rng: Optional[list] = None) -> Path:
    """Write a complete training checkpoint of ``trainer`` at ``pos`` to ``path`` atomically (our addition).

    With the model, optimizer, schedule and gradient-scaler states, the config, and ``data``'s
    vocabularies and BPE model (if any). ``pos.batch_in_epoch`` counts global batches, and the
    checkpoint records for which processes and batch settings; ``rng`` holds each process's
    random-number state, in rank order (default: this process's alone).
    """
    cfg = trainer.cfg
    rng = rng or [rng_state(trainer.device)]
    state = {
        "format": 1,
        "model": unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "step": pos.step,
        "epoch": pos.epoch,
        "batch_in_epoch": pos.batch_in_epoch,
        "layout": {"world_size": len(rng), "accum_steps": cfg.accum_steps, "batch_tokens": cfg.batch_tokens},
        "rng": {**rng[0], "ranks": rng},  # the first process's streams at the top, as older checkpoints had them
        "config": dataclasses.asdict(cfg),
        "vocab": {"src": data.src_vocab.itos, "tgt": data.tgt_vocab.itos},
        # the BPE model's bytes, as a tensor so that weights_only loading accepts it
        "subwords": torch.frombuffer(bytearray(data.subwords.model_proto), dtype=torch.uint8) if data.subwords else None,
    }
    with atomic_file(path) as f:
        torch.save(state, f)
    return Path(path)


# %% [markdown]
# `load_checkpoint` never runs code from the file, and refuses a checkpoint that does not fit: another model, vocabulary or BPE model.

# %%
def load_checkpoint(path: Path, cfg: Optional[Config] = None, src_vocab: Optional[Vocab] = None,
                    tgt_vocab: Optional[Vocab] = None, subwords: Optional[Subwords] = None) -> dict:
    """Read a checkpoint safely (``weights_only=True``) and check it fits ``cfg``, the vocabularies and BPE model."""
    if not Path(path).is_file():
        where = "is a directory (give a run directory as --run_dir)" if Path(path).is_dir() else "does not exist"
        raise UnreadableCheckpoint(f"checkpoint {path} {where}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise UnreadableCheckpoint(f"cannot read checkpoint {path}: it is truncated or not a checkpoint "
                                   f"({first_line(e)})") from e
    if not isinstance(state, dict) or state.get("format") != 1:
        raise UnreadableCheckpoint(f"{path} is not a checkpoint written by this program")
    missing = [k for k in ("model", "config", "vocab") if not isinstance(state.get(k), dict)]
    if missing:
        raise UnreadableCheckpoint(f"{path} is damaged or hand-made: it lacks {', '.join(missing)}")
    if cfg is not None:
        saved = {f.name: f.default for f in dataclasses.fields(ModelConfig)} | state["config"]  # older: defaults
        now = {k: getattr(cfg, k) for k in weight_fields()}
        saved["N_dec"], now["N_dec"] = saved["N_dec"] or saved["N"], cfg.decoder_layers  # 0 and N: one depth
        diff = [f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in weight_fields() if saved[k] != now[k]]
        if diff:
            raise CheckpointError(f"{path} was written for another model config ({'; '.join(diff)})")
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        if vocab is not None and state["vocab"][side] != vocab.itos:
            raise CheckpointError(f"{path} was written with another {side} vocabulary "
                                  f"({len(state['vocab'][side]):,} tokens vs {len(vocab):,} now)")
    if subwords is not None and checkpoint_subwords(state) != subwords:
        raise CheckpointError(f"{path} was written with another BPE model than the one in use now "
                              "(the training data or bpe_size differ); use the data and settings it was trained with")
    return state


def checkpoint_subwords(state: dict) -> Optional[Subwords]:
    """The BPE model a checkpoint carries (None for word vocabularies)."""
    blob = state.get("subwords")
    return Subwords(blob.numpy().tobytes()) if blob is not None else None


# %% [markdown]
# Listing and averaging checkpoints (§6.1 averages the last 5 for base models, the last 20
# for big ones), and the small helpers that reach the plain model or the BPE model inside.

# %%
def checkpoint_paths(run_dir: Path) -> list[Path]:
    """The checkpoints this program wrote in ``run_dir`` (``checkpoint-<step>.pt``), oldest first.

    Other files that merely look similar (a hand-made ``checkpoint-best.pt``) are not counted,
    so they are never resumed from, averaged or deleted by the rotation.
    """
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("checkpoint-*.pt")
             if (m := re.fullmatch(r"checkpoint-(\d{8,})\.pt", p.name))]
    return [p for _, p in sorted(found)]


def average_checkpoints(paths: Sequence[Path]) -> dict:
    """Element-wise mean of the models in ``paths`` (§6.1 averages the last 5)."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    avg, vocab = None, None
    for p in paths:
        state = load_checkpoint(p)
        model_state = state["model"]
        if avg is None:
            avg = {k: v.double().clone() if v.is_floating_point() else v.clone() for k, v in model_state.items()}
            vocab = state["vocab"]
        else:
            if (model_state.keys() != avg.keys() or any(v.shape != avg[k].shape for k, v in model_state.items())
                    or state["vocab"] != vocab):
                raise CheckpointError(f"{p} holds a different model or vocabulary than {paths[0]}, so the two "
                                      "cannot be averaged; use one checkpoint (--checkpoint, or --average_last 1)")
            for k, v in model_state.items():
                if v.is_floating_point():
                    avg[k] += v.double()
    return {k: (v / len(paths)).float() if v.is_floating_point() else v for k, v in avg.items()}


# %% [markdown]
# ## A.4 Running a training job
#
# Part 2's `update` is the core. Around it a run needs: epochs of length-batched updates,
# optional gradient clipping, the precision of A.2, `torch.compile` (an option;
# compiling is slow on a CPU, so the tests leave it out), several processes through
# `torchrun` with `DistributedDataParallel` (NCCL on GPUs, Gloo on CPUs), `tqdm` progress
# bars with loss, learning rate and tokens per second, a validation loss every epoch, a
# JSONL metrics log, a training-curve figure, checkpoints (A.3), resuming, and at the end
# the test set translated and scored with Part 3's decoding.
# %% [markdown]
# ### Checkpoint and metrics bookkeeping; resuming
#
# `RunFiles` is the run directory: it writes checkpoints (keeping the last
# `keep_checkpoints`) and appends records to the metrics log; only the main process
# writes. `Position` is where training stands — updates taken (the paper's $step\_num$),
# the epoch, and how many batches of the epoch's *global* order (the order of one process,
# `length_batches` without `rank`) all processes together have consumed. Counted that way,
# the position means the same whatever the number of processes or `accum_steps`, so a run
# stopped on 4 GPUs continues on 1 with exactly the batches not yet seen (and the other way
# round); the checkpoint also records the layout it was computed with. `epoch_updates`
# deals out the rest of an epoch: the batches not consumed yet, cut to a multiple of the
# number of processes, process $r$ of $W$ taking every $W$-th from the $r$-th on, grouped
# `accum_steps` at a time.
#
# Faults are expected, not exceptional (our addition; the paper says nothing of them). The
# run directory is locked (an operating-system lock, gone when the process dies) so that a
# second run there stops at once instead of writing every record twice. Metrics records
# are flushed to the disk as they are written. On resuming, a torn last record (a full disk,
# a killed process) is dropped with a warning, and an unreadable newest checkpoint (a power
# loss) is set aside with a warning in favour of the newest readable one; the metrics log is
# then cut back to that checkpoint, so no step is logged twice.

# %%
def epoch_updates(batches: Sequence, start: int, rank: int, world: int, accum: int) -> tuple[list, list, int]:
    """This process's updates for the global ``batches`` from ``start`` on (our addition).

    Returns (updates, consumed after each update, where the epoch ends): update k of every
    process together takes global batches ``[start + k·accum·world, …)``; the tail that does
    not divide among the processes is left out, as a distributed epoch leaves it out.
    """
    rest = batches[start:]
    usable = len(rest) - len(rest) % world
    mine = list(rest[:usable])[rank::world]
    updates = [mine[i: i + accum] for i in range(0, len(mine), accum)]
    consumed = [start + min((k + 1) * accum * world, usable) for k in range(len(updates))]
    return updates, consumed, start + usable


def resume_position(state: dict, cfg: Config, path) -> tuple[Position, dict]:
    """A checkpoint's position in global batches and the layout it was computed with (our addition).

    Refuses, in one line, a position inside an epoch whose batches were cut for another
    ``batch_tokens`` (the batches not yet seen are not defined then); at an epoch boundary any
    setting may change.
    """
    pos = Position(state["step"], state["epoch"], state["batch_in_epoch"])
    layout = state.get("layout")
    if layout is None:  # older checkpoints counted one process's updates and did not record the layout
        saved = state["config"]
        layout = {"world_size": 1, "accum_steps": saved.get("accum_steps", 1),
                  "batch_tokens": saved.get("batch_tokens")}
        pos.batch_in_epoch *= layout["accum_steps"]
    if pos.batch_in_epoch and layout["batch_tokens"] != cfg.batch_tokens:
        raise CheckpointError(f"{path} stopped inside epoch {pos.epoch + 1}, whose batches were cut for "
                              f"batch_tokens={layout['batch_tokens']}; resume with --batch_tokens "
                              f"{layout['batch_tokens']} (it may change once an epoch is complete)")
    return pos, layout


# %% [markdown]
# The lock `RunFiles` takes on its directory: `flock`, which the operating system releases
# when the process ends, however it ends — so a killed run never leaves a stale lock behind.

# %%
def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on ``run_dir/run.lock`` — our addition: one run per run directory.

    Returns the open lock file (the lock lasts while it is open; the operating system drops it
    when the process ends, however it ends), or None where there is no ``flock`` or when this
    same process already holds it. Raises :class:`RunDirectoryError` naming the process that holds it.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this system: runs are not locked
        return None
    f = open(Path(run_dir) / "run.lock", "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid, _, command = f.read().strip().partition(" ")
        f.close()
        if pid == str(os.getpid()):
            return None  # an earlier run of this process, not yet collected
        raise RunDirectoryError(f"run directory {run_dir} is in use by process {pid or '(unknown)'}"
                                + (f" ({command})" if command else "")
                                + "; two runs in one directory would mix their checkpoints and metrics. "
                                "Wait for it to end, or give another --run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}\n")
    f.flush()
    return f


def open_run_dir(run_dir: Path):
    """Create and lock ``run_dir`` (:func:`lock_run_dir`); remove temporary files a killed run left — our addition."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirectoryError(f"run directory {run_dir} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)
    except OSError as e:
        raise RunDirectoryError(f"cannot write in run directory {run_dir}: {e.strerror or e}") from None
    for tmp in [*run_dir.glob(".checkpoint-*.part"), *run_dir.glob(".metrics.jsonl.*.part")]:
        tmp.unlink(missing_ok=True)  # the lock says that no running process is writing them
    return lock


# %% [markdown]
# The run directory. A checkpoint is written by the first process alone, but every process
# takes part in `save`: each hands over its random-number state, so that a resume on as many
# processes restores each process's own streams.

# %%
class RunFiles:
    """A run directory's checkpoints (the last ``keep`` kept) and JSONL metrics log; writes only if ``write``."""

    def __init__(self, run_dir: Path, keep: int, write: bool):
        self.dir, self.keep, self.write = Path(run_dir), keep, write
        self.metrics = self.dir / "metrics.jsonl"
        self.saved_at = time.time()  # when a checkpoint was last written (for checkpoint_minutes)
        self.lock = open_run_dir(self.dir) if write else None  # open while this process holds the directory

    def log(self, record: dict) -> None:
        """Append one record to the metrics log, on the disk before it returns."""
        if self.write:
            with open(self.metrics, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def save(self, trainer: Trainer, data: Dataset, pos: Position, rank: int = 0) -> Optional[Path]:
        """Write a checkpoint of ``trainer`` at ``pos``; once it is on the disk, delete the oldest beyond ``keep``.

        Every process calls it: each hands its random-number state to the first, which writes.
        """
        self.saved_at = time.time()
        rng = [rng_state(trainer.device)]
        if trainer.world > 1:
            gathered = [None] * trainer.world if rank == 0 else None
            dist.gather_object(rng[0], gathered, dst=0)
            rng = gathered
        if not self.write:
            return None
        path = self.dir / f"checkpoint-{pos.step:08d}.pt"
        try:
            save_checkpoint(path, trainer, data, pos, rng)
        except (OSError, RuntimeError) as e:  # torch reports a full disk as a RuntimeError
            raise CheckpointError(f"cannot write checkpoint {path} ({first_line(e)}; {free_space(self.dir)}); "
                                  "the checkpoints already in the run directory are intact") from e
        for old in checkpoint_paths(self.dir)[: -self.keep]:
            old.unlink()
        return path

    def repair_metrics(self, step: int) -> None:
        """Make the metrics log agree with a run resumed at ``step`` — our addition: lines that are not whole
        records (torn by a crash or a full disk) are dropped with a warning, and records after ``step``."""
        if not (self.write and self.metrics.is_file()):
            return
        raw = self.metrics.read_bytes()
        kept, torn, later = metrics_lines_upto(raw, step)
        if torn:
            print(f"warning: {self.metrics}: dropped {torn} unreadable line(s), cut short by a crash or a full "
                  "disk", file=sys.stderr)
        if torn or later or not raw.endswith(b"\n"):
            write_atomic(self.metrics, kept)


# %% [markdown]
# A run is a `Trainer` (what `update` needs, Part 2) together with what the machinery
# around it needs: the data, this process's rank, the run directory and the log.

# %%
@dataclass(frozen=True)
class Run(Trainer):
    """The objects of one training run, handed explicitly from step to step (our addition)."""

    data: Dataset
    rank: int  # this process's place among the `world` (0 writes the files)
    files: RunFiles
    log: Callable


# %% [markdown]
# Resuming: the newest checkpoint that can be read, with everything it recorded.

# %%
def newest_readable_checkpoint(run_dir: Path, cfg: Config, src_vocab: Vocab, tgt_vocab: Vocab,
                               subwords: Optional[Subwords], tidy: bool) -> Optional[tuple[Path, dict]]:
    """(path, state) of the newest checkpoint of ``run_dir`` that can be read; None if there is none — our addition.

    Newer ones that cannot be read (truncated by a power loss) are skipped with a warning and,
    if ``tidy`` (the process that writes), renamed to ``*.unreadable`` so that the rotation
    never keeps them in place of good ones. A checkpoint that reads but does not fit ``cfg``
    or the vocabularies is an error, as is a directory where none can be read.
    """
    paths = checkpoint_paths(run_dir)
    bad = []
    for path in reversed(paths):
        try:
            state = load_checkpoint(path, cfg, src_vocab, tgt_vocab, subwords)
        except UnreadableCheckpoint as e:
            bad.append(path)
            if tidy:
                print(f"warning: {e}; falling back to the checkpoint before it", file=sys.stderr)
            continue
        if tidy:
            for b in bad:
                os.replace(b, b.with_name(b.name + ".unreadable"))
        return path, state
    if bad:
        raise CheckpointError(f"none of the {len(bad)} checkpoint(s) in {run_dir} can be read; move them "
                              "away to start the run over")
    return None


# %% [markdown]
# Resuming: the first process reads the checkpoint and hands it to the others (a
# broadcast), so that processes on machines without a shared disk start where it does —
# after DDP's own first broadcast of the weights, which saw only the fresh model. The
# position is checked against the settings now in force (`resume_position`, above):
# another number of processes or `accum_steps` continues the same global order of batches;
# another `batch_tokens` inside an epoch cannot, and is refused in one line.

# %%
def resume(run: Run) -> Position:
    """Restore the newest checkpoint of the run directory (model, optimizer, schedule, scaler, RNGs), if any.

    The first process reads it and hands it to the others, so machines without a shared disk
    resume in step. Metrics logged after that checkpoint are dropped, so the resumed run logs
    no step twice.
    """
    state, path, error = None, None, None
    if run.rank == 0:
        try:
            found = newest_readable_checkpoint(run.files.dir, run.cfg, run.data.src_vocab, run.data.tgt_vocab,
                                               run.data.subwords, tidy=run.files.write)
        except CheckpointError as e:
            found, error = None, e
        if found is not None:
            path, state = found
    if run.world > 1:
        box = [state, path, str(error) if error else None]
        dist.broadcast_object_list(box, src=0)
        state, path, error = box[0], box[1], box[2] and CheckpointError(box[2])
    if error:
        raise error
    if state is None:
        run.files.repair_metrics(0)
        return Position()
    pos, layout = resume_position(state, run.cfg, path)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    now = {"world_size": run.world, "accum_steps": run.cfg.accum_steps, "batch_tokens": run.cfg.batch_tokens}
    ranks = state["rng"].get("ranks")
    if ranks is not None and len(ranks) == run.world:
        restore_rng(ranks[run.rank], run.device)
    elif ranks is None and run.world == 1:
        restore_rng(state["rng"], run.device)  # an older checkpoint: one process's streams
    else:
        seed_process(run.cfg.seed, run.rank, pos.step)
        run.log(f"the checkpoint holds the random streams of {len(ranks or [0])} process(es); "
                f"{run.world} continue with fresh streams of their own")
    run.log(f"resumed from {path} at step {pos.step} (epoch {pos.epoch + 1}, {pos.batch_in_epoch} of its batches done)"
            + ("" if layout == now else f"; written with {layout}, continuing with {now}"))
    run.files.repair_metrics(pos.step)
    return pos


# %% [markdown]
# ### Validation
#
# After every epoch: the mean cross-entropy per target token on the validation split,
# without label smoothing, so that $e^{\text{loss}}$ is the perplexity.

# %%
@torch.no_grad()
def evaluate_loss(model: nn.Module, pairs: Sequence, cfg: Config, device) -> float:
    """Mean cross-entropy per target token (no label smoothing) on ``pairs``."""
    model.eval()
    total, ntokens = 0.0, 0
    lengths = [(len(s), len(t)) for s, t in pairs]
    for idx in length_batches(lengths, cfg.batch_tokens, shuffle=False):
        b = make_batch(pairs, idx).to(device)
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)
        total += float(loss_sum(unwrap(model).generator(out), b.tgt_y, 0.0))
        ntokens += b.ntokens
    return total / max(ntokens, 1)



# %% [markdown]
# ### How long, and is the run sized for this data?
#
# Before long work a run says what it will do: how many updates, and — after its first few
# updates, timed on this machine — roughly how many minutes of training that is. A preset is
# sized for a data set and a device (`iwslt14-small` for the full IWSLT14 set on a GPU), so a
# run also says, in one line, when its model is far larger than its training data, or when it
# will take hours on this device, and then goes on: the choice stays the user's.

# %%
OVERSIZED = 50  # parameters per training target token above which a model is "sized for more data"
LONG_MINUTES = 120  # an estimate above this on a CPU is said out loud


@dataclass
class UpdateClock:
    """Times updates ``skip+1 … skip+count`` of this process's run and logs one estimate for the rest."""

    remaining: int  # updates this run will take from where it starts
    device: torch.device
    log: Callable
    skip: int = 3  # the first updates are slower (allocation, caches)
    count: int = 10
    seen: int = 0
    t0: float = 0.0
    minutes: Optional[float] = None  # the estimate, once made

    def tick(self) -> None:
        """Call after every update."""
        self.seen += 1
        if self.seen == self.skip:
            self.t0 = time.time()
        elif self.seen == self.skip + self.count:
            per_update = (time.time() - self.t0) / self.count
            self.minutes = per_update * (self.remaining - self.seen) / 60
            self.log(f"estimate: {per_update:.2f} s per update measured here → about {self.minutes:.0f} min for the "
                     f"remaining {self.remaining - self.seen:,} updates (validation and test decoding come on top)")
            if self.device.type == "cpu" and self.minutes > LONG_MINUTES:
                self.log(f"note: about {self.minutes / 60:.1f} h on this CPU — this preset is sized for a GPU; "
                         "--epochs or --max_steps shortens it, or see the CPU presets in the README")


def planned_updates(cfg: Config, data: Dataset, world: int) -> tuple[int, int, list]:
    """The run's length, for the plan and the cooldown (our addition): (updates of the whole run,
    updates per epoch, (source, target) lengths of the first epoch's pairs)."""
    lengths = [(len(s), len(t)) for s, t in epoch_pairs(data, cfg, 0)]  # BPE-dropout: the first epoch's (more) pieces
    batches = len(length_batches(lengths, cfg.batch_tokens, cfg.seed, 0, rank=0, world_size=world))
    per_epoch = math.ceil(batches / cfg.accum_steps)
    total = per_epoch * cfg.epochs if not cfg.max_steps else min(per_epoch * cfg.epochs, cfg.max_steps)
    return total, per_epoch, lengths


def plan_run(cfg: Config, data: Dataset, world: int, step: int, model: nn.Module) -> tuple[int, list[str]]:
    """(updates left to take, lines for the log): the run's length and whether the model suits the data."""
    total, per_epoch, lengths = planned_updates(cfg, data, world)
    tokens = sum(t - 1 for _, t in lengths)  # target tokens predicted per epoch
    lines = [f"plan: {cfg.epochs} epochs × {per_epoch:,} updates"
             + (f", at most {cfg.max_steps:,} updates" if cfg.max_steps else "")
             + f" = {total:,} updates ({max(total - step, 0):,} to go) on {len(lengths):,} training pairs "
             f"({tokens:,} target tokens per epoch" + (", segmented with BPE-dropout" if cfg.bpe_dropout else "") + ")"]
    if cfg.cooldown:
        lines.append(f"cooldown: the learning rate falls linearly to zero over the last "
                     f"{math.ceil(cfg.cooldown * total):,} updates")
    ratio = count_parameters(model) / max(tokens, 1)
    if ratio > OVERSIZED:
        lines.append(f"note: the model has {ratio:.0f} parameters per training target token — it is sized for far "
                     "more data than this and will overfit it; a smaller preset suits this data (see the README)")
    return max(total - step, 0), lines


# %% [markdown]
# ### One epoch
#
# The batches of an epoch are a function of (seed, epoch), so `train_epoch` can start at
# any update of it. After each update: the progress bar, a metrics record every 50
# updates, and the two ways training stops early — `max_steps`, or a signal (save, then
# stop with a message) — and the checkpoint every `checkpoint_minutes` (not at the last
# update of an epoch, whose own checkpoint follows at once). It returns whether training
# is finished.

# %%
def train_epoch(run: Run, pos: Position, stop: StopRequest, progress: bool, t_start: float,
                clock: Optional[UpdateClock] = None) -> bool:
    """The updates of epoch ``pos.epoch`` from ``pos.batch_in_epoch`` on, advancing ``pos``; True once ``max_steps`` is reached."""
    cfg, pairs = run.cfg, epoch_pairs(run.data, run.cfg, pos.epoch)
    lengths = [(len(s), len(t)) for s, t in pairs]
    batches = length_batches(lengths, cfg.batch_tokens, cfg.seed, pos.epoch)  # the epoch's global order
    updates, consumed, end = epoch_updates(batches, pos.batch_in_epoch, run.rank, run.world, cfg.accum_steps)
    per_epoch = len(epoch_updates(batches, 0, 0, run.world, cfg.accum_steps)[0])
    bar = tqdm(total=per_epoch, initial=max(per_epoch - len(updates), 0), desc=f"epoch {pos.epoch + 1}/{cfg.epochs}",
               disable=not (progress and run.rank == 0), dynamic_ncols=True)
    run.train_model.train()
    seen, t0, loss_acc, tok_acc = 0, time.time(), 0.0, 0
    finished = False
    with bar:
        for u, micro in enumerate(updates):
            try:
                loss, tokens, lr = update(run, [make_batch(pairs, idx).to(run.device) for idx in micro])
            except TrainingDiverged as e:
                last = checkpoint_paths(run.files.dir)
                raise TrainingDiverged(f"{e} at step {pos.step + 1}; stopped. Last good checkpoint: "
                                       f"{last[-1] if last else 'none (no checkpoint written yet)'}") from None
            pos.step, pos.batch_in_epoch = pos.step + 1, consumed[u]
            if clock is not None:
                clock.tick()
            seen, loss_acc, tok_acc = seen + tokens, loss_acc + loss, tok_acc + tokens  # all processes
            tps = seen / max(time.time() - t0, 1e-9)
            bar.set_postfix(loss=f"{loss / max(tokens, 1):.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            bar.update(1)
            if pos.step % 50 == 0:
                run.files.log({"step": pos.step, "epoch": pos.epoch + 1, "train_loss": loss_acc / max(tok_acc, 1),
                               "lr": lr, "tokens_per_s": tps, "elapsed_s": time.time() - t_start})
                loss_acc, tok_acc = 0.0, 0
            if cfg.max_steps and pos.step >= cfg.max_steps:
                finished = True
                break
            due = bool(cfg.checkpoint_minutes and u < len(updates) - 1
                       and time.time() - run.files.saved_at >= cfg.checkpoint_minutes * 60)
            stop_now, save_now = any_process([stop.signum is not None, due], run.world, run.device)
            if stop_now:
                path = run.files.save(run, run.data, pos, run.rank)
                name = signal.Signals(stop.signum).name if stop.signum else "a signal in another process"
                raise TrainingInterrupted(f"stopped by {name} after update {pos.step}; checkpoint saved to "
                                          f"{path or 'the run directory of the first process'}. "
                                          "Run the same command again to continue from there.")
            if save_now:
                run.files.save(run, run.data, pos, run.rank)
    if pos.batch_in_epoch == end:  # the epoch is complete (also when max_steps ended it there)
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
    return finished


# %% [markdown]
# ### Setting up, scoring, and `train`
#
# `setup` builds a run's objects: the model (the same initial weights in every process),
# the optimizer and its schedule, the precision, DDP when several processes train, and the
# run directory.

# %%
def setup(cfg: Config, data: Dataset, device: torch.device, rank: int, world: int, log: Callable) -> Run:
    """The model, optimizer, schedule, precision and run directory of a training run.

    The model is initialised from ``cfg.seed`` in every process (the same weights); then each
    process switches to its own random stream, for dropout.
    """
    attention, why_attention = resolve_attention(cfg.attention, device)
    model = make_model(len(data.src_vocab), len(data.tgt_vocab), cfg, attention=attention).to(device)
    optimizer, scheduler = make_optimizer(model, cfg, planned_updates(cfg, data, world)[0] if cfg.cooldown else 0)
    train_model = torch.compile(model) if cfg.compile else model
    if world > 1:  # no buffer changes while training (the positional encodings are constant): none to broadcast
        train_model = nn.parallel.DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
        seed_process(cfg.seed, rank)
    precision, why = resolve_precision(cfg.precision, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    files = RunFiles(run_dir_for(cfg), cfg.keep_checkpoints, write=rank == 0)
    log(f"device: {device}" + (f" × {world} processes" if world > 1 else "") + f"; run directory: {files.dir}")
    log(why)
    log(why_attention)
    for note in (allocator_note(device), dropout_note(cfg, device)):
        if note:
            log(note)
    return Run(cfg=cfg, model=model, train_model=train_model, optimizer=optimizer, scheduler=scheduler,
               device=device, autocast=autocast, scaler=scaler, world=world, data=data, rank=rank, files=files,
               log=log)


# %% [markdown]
# At the end of training the test set is translated twice — greedy, and with beam search
# (§6.1) — optionally with the last checkpoints averaged, and scored; `plot_curves` draws the
# training and validation loss from the metrics log (next cell).

# %%
def evaluate_test(model: nn.Module, data: Dataset, cfg: Config, device, run_dir: Optional[Path] = None,
                  log: Callable = print, progress: bool = True) -> dict:
    """Decode the test set greedily and with beam search (§6.1), optionally averaging the last checkpoints; BLEU.

    ``bleu`` is the beam-search score (``cfg.beam_size``, ``cfg.length_penalty_alpha``),
    ``bleu_greedy`` the greedy one.
    """
    model = unwrap(model)
    if cfg.average_last > 1 and run_dir is not None:
        paths = checkpoint_paths(run_dir)[-cfg.average_last:]
        model = copy.deepcopy(model)
        model.load_state_dict(average_checkpoints(paths))
        log(f"evaluating the average of {len(paths)} checkpoints")
    model = on_device(model, device)
    test = data.splits["test"]
    refs = data.test_refs
    if cfg.max_eval_sentences:
        test, refs = test[: cfg.max_eval_sentences], refs[: cfg.max_eval_sentences]
    kind = CORPORA[data.name].bleu_kind
    sources = [s for s, _ in test]
    t0 = time.time()
    greedy_hyps = detokenize(translate(model, sources, data.tgt_vocab, cfg, device, progress=progress), data.name,
                             data.subwords)
    score_greedy = bleu(greedy_hyps, refs, data.name).score
    log(f"test BLEU ({kind}, sacreBLEU, greedy, {len(test):,} sentences): {score_greedy:.2f}")
    t1 = time.time()
    tokens = translate(model, sources, data.tgt_vocab, cfg, device, progress=progress, beam_size=cfg.beam_size,
                       alpha=cfg.length_penalty_alpha)
    hyps = detokenize(tokens, data.name, data.subwords)
    score = bleu(hyps, refs, data.name).score
    unk_share = sum(t == SPECIALS[UNK] for toks in tokens for t in toks) / max(sum(map(len, tokens)), 1)
    log(f"test BLEU ({kind}, sacreBLEU, beam {cfg.beam_size}, alpha {cfg.length_penalty_alpha}, "
        f"{len(test):,} sentences): {score:.2f}; <unk> in {unk_share:.2%} of output tokens")
    examples = []
    for i in range(min(cfg.examples_to_show, len(test))):
        pieces = data.src_vocab.lookup_tokens(test[i][0][1:-1])
        src = data.subwords.decode([pieces])[0] if data.subwords else " ".join(pieces)
        examples.append({"source": src, "reference": refs[i], "output": hyps[i]})
        log(f"  source:    {src}\n  reference: {refs[i]}\n  output:    {hyps[i]}")
    return {"bleu": score, "bleu_greedy": score_greedy, "bleu_kind": kind, "unk_share": unk_share,
            "beam_size": cfg.beam_size,
            "length_penalty_alpha": cfg.length_penalty_alpha, "test_sentences": len(test),
            "decode_minutes": (time.time() - t0) / 60, "decode_minutes_greedy": (t1 - t0) / 60,
            "examples": examples}


# %% [markdown]
# The curve: training and validation loss from the metrics log, drawn into the run directory.

# %%
def plot_curves(metrics_path: Path, out: Path) -> Path:
    """Training and validation loss against step, from the metrics log, saved as a PNG."""
    import matplotlib.pyplot as mpl

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    fig, ax = mpl.subplots(figsize=(6, 3.5))
    tr = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    va = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="training loss (label-smoothed)")
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss")
    ax.set_xlabel("update")
    ax.set_ylabel("nats per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    mpl.close(fig)
    return out


# %% [markdown]
# `train` is the function the command line, `make train` and Part 4 all call: set up, resume
# if the run directory holds a checkpoint, then epochs until `epochs` or `max_steps`, each
# followed by validation and a checkpoint; last the curve and the test score.

# %%
def train(cfg: Config, data: Optional[Dataset] = None, log: Callable = print, progress: bool = True,
          evaluate: bool = True) -> dict:
    """Train ``cfg`` (resuming from its run directory when that holds a checkpoint), then score the test set.

    Returns a summary: steps, minutes, BLEU, example translations and where the run's files are.
    """
    device, local_rank = resolve_device(cfg.device), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
    rank, world = _distributed(device)
    log = log if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t_start = time.time()
    if data is None:  # one process per machine downloads and builds the caches; the others then read them
        if world > 1 and local_rank != 0:
            _barrier(device)
        data = load_dataset(cfg, log=log)
        if world > 1 and local_rank == 0:
            _barrier(device)
    run = setup(cfg, data, device, rank, world, log)
    pos = resume(run)
    log(f"model: {count_parameters(run.model) / 1e6:.2f}M parameters "
        f"(N={cfg.N}{f', N_dec={cfg.N_dec}' if cfg.decoder_layers != cfg.N else ''}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, "
        f"h={cfg.h}, P_drop={cfg.P_drop})")
    remaining, plan = plan_run(cfg, data, world, pos.step, run.model)
    for line in plan:
        log(line)
    clock = UpdateClock(remaining, device, log)
    with StopRequest() as stop:
        finished = bool(cfg.max_steps and pos.step >= cfg.max_steps)
        while pos.epoch < cfg.epochs and not finished:
            epoch_number = pos.epoch + 1  # the epoch these updates belong to, counting from 1
            finished = train_epoch(run, pos, stop, progress, t_start, clock)
            valid = data.splits["valid"][: cfg.max_valid_sentences or None]
            valid_loss = evaluate_loss(run.model, valid, cfg, device) if rank == 0 else float("nan")
            ppl = math.exp(min(valid_loss, 50))
            run.files.log({"step": pos.step, "epoch": epoch_number, "valid_loss": valid_loss, "valid_ppl": ppl,
                           "elapsed_s": time.time() - t_start})
            log(f"step {pos.step}: validation loss {valid_loss:.3f} (perplexity {ppl:.2f})")
            path = run.files.save(run, run.data, pos, run.rank)
            if world > 1:
                _barrier(device)
            if stop.requested(world, device) and pos.epoch < cfg.epochs and not finished:
                raise TrainingInterrupted(f"stopped after update {pos.step} (end of epoch {pos.epoch}); checkpoint "
                                          f"saved to {path or 'the run directory of the first process'}. "
                                          "Run the same command again to continue from there.")
    summary = {"config": dataclasses.asdict(cfg), "steps": pos.step, "train_minutes": (time.time() - t_start) / 60,
               "device": str(device), "world_size": world, "precision": resolve_precision(cfg.precision, device)[0],
               "data": data.origin, "run_dir": str(run.files.dir)}
    if rank == 0 and run.files.metrics.is_file():
        summary["curve"] = str(plot_curves(run.files.metrics, run.files.dir / "curve.png"))
    if evaluate and rank == 0:
        summary.update(evaluate_test(run.model, data, cfg, device, run.files.dir, log=log, progress=progress))
        summary["total_minutes"] = (time.time() - t_start) / 60
        write_atomic(run.files.dir / "results.json", [json.dumps(summary, indent=2)])
    return summary


# %% [markdown]
# ## A.5 The command line
#
# `python the_annotated_transformer.py train --config NAME [--field value ...]` trains a
# preset with any config field overridden (`--max_steps 200`, `--device cuda`,
# `--data_mirror ../shared/data`, …). Under `torchrun --nproc_per_node=K` the same command
# trains on K processes. `make train CONFIG=NAME` runs it. Two more commands use a trained
# model, below: `translate` and `evaluate`.
#
# Every mistake on the command line is one line on standard error and a non-zero exit
# status, never a traceback (`--debug` shows one): a wrong option stops with status 2 before
# any work starts, and so do a missing file, an unwritable run directory, a run directory
# another run is using, a checkpoint that does not fit, and a full disk.

# %%
class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2 — our addition."""

    def error(self, message: str):
        """Print ``message`` as one line and exit with status 2 (argparse prints the usage too)."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _parse_value(text: str, like, name: str = ""):
    """Turn a command-line string into the type of the config field ``name`` whose default is ``like``."""
    if isinstance(like, bool) or name == "bf16":  # switches; bf16 also takes "auto"
        if text.lower() in ("1", "true", "yes", "on"):
            return True if isinstance(like, bool) else "true"
        if text.lower() in ("0", "false", "no", "off"):
            return False if isinstance(like, bool) else "false"
        if text.lower() == "auto" and name == "bf16":
            return "auto"
        raise argparse.ArgumentTypeError(f"expected {'auto/' if name == 'bf16' else ''}true/false, got {text!r}")
    try:
        if isinstance(like, tuple):
            return tuple(float(x) for x in text.split(","))
        return type(like)(text)
    except ValueError:
        kind = {int: "a whole number", float: "a number", tuple: "numbers separated by commas"}.get(type(like))
        raise argparse.ArgumentTypeError(f"expected {kind or 'text'}, got {text!r}") from None


def config_from_args(argv: Sequence[str]) -> tuple[str, Config]:
    """(command, Config) from ``train --config NAME --field value ...``."""
    parser = OneLineParser(prog="the_annotated_transformer.py",
                           description="Train and evaluate the Transformer of Vaswani et al. (2017).")
    parser.add_argument("command", choices=["train"])  # translate and evaluate: run_inference_command
    parser.add_argument("--config", default=None, choices=list(PRESETS),
                        help="a preset (default: iwslt14-small where CUDA is available, else iwslt14-sample)")
    defaults = Config()
    for f in dataclasses.fields(Config):
        like = getattr(defaults, f.name)
        names = sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        parser.add_argument(*names, dest=f.name, default=None,
                            type=lambda text, like=like, name=f.name: _parse_value(text, like, name), help=f"(default from preset)")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if getattr(args, f.name) is not None}
    preset = args.config or default_preset()
    try:  # the preset with the overrides: Config.__post_init__ checks every field
        cfg = get_config(preset, **overrides)
    except ValueError as e:
        parser.error(str(e))
    if not cfg.run_dir:
        cfg = dataclasses.replace(cfg, run_dir=str(run_dir_for(cfg, preset)))
    return args.command, cfg


# %% [markdown]
# ### Translating and scoring with a trained model
#
# A checkpoint carries its config, its vocabularies and (with `vocab="bpe"`) its BPE model,
# so a trained model can be rebuilt from it alone: `load_for_inference` reads one
# checkpoint file, or the last $K$ of a run directory averaged as §6.1 does.
# `encode_sources` tokenizes raw sentences the way training did: into BPE pieces with the
# checkpoint's own model, or, for word vocabularies, with spaCy (Multi30k) or at spaces
# (IWSLT14, the copy task). IWSLT14 input is expected in its prepared form (tokenized,
# lowercased) either way. `detokenize` above turns the output back into text.

# %%
def config_from_dict(values: dict) -> Config:
    """A :class:`Config` from a checkpoint's saved fields (unknown to it: defaults) — for §6.1 inference."""
    names = {f.name for f in dataclasses.fields(Config)} - {"device"}  # trained elsewhere: decode anywhere
    kept = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in names}
    return Config(**kept)


def load_for_inference(checkpoint: Optional[Path] = None, run_dir: Optional[Path] = None, average_last: int = 1,
                       device="cpu") -> tuple[EncoderDecoder, Config, Vocab, Vocab, Optional[Subwords]]:
    """(model in eval mode, config, source vocab, target vocab, BPE model or None) from a checkpoint
    file, or the average of the last ``average_last`` checkpoints of ``run_dir`` (§6.1 averages the last 5)."""
    if checkpoint is not None:
        paths = [Path(checkpoint)]
    else:
        paths = checkpoint_paths(Path(run_dir))[-max(average_last, 1):]
        if not paths:
            raise CheckpointError(f"no checkpoint-*.pt in {run_dir}"
                                  + ("" if Path(run_dir).is_dir() else " (it is not a directory)"))
    state = load_checkpoint(paths[-1])
    try:
        cfg = config_from_dict(state["config"])
        src_vocab, tgt_vocab = Vocab(state["vocab"]["src"]), Vocab(state["vocab"]["tgt"])
        model = make_model(len(src_vocab), len(tgt_vocab), cfg)
        model.load_state_dict(average_checkpoints(paths) if len(paths) > 1 else state["model"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{paths[-1]} does not hold a model this program can build ({first_line(e)})") from e
    return model.to(device).eval(), cfg, src_vocab, tgt_vocab, checkpoint_subwords(state)


def encode_sources(lines: Sequence[str], dataset: str, src_vocab: Vocab,
                   subwords: Optional[Subwords] = None) -> list[list[int]]:
    """Raw source sentences → ``<s> ids </s>``, tokenized as in training (§5.1: BPE pieces, or words)."""
    tokenize = subwords.encode if subwords is not None else make_tokenizer(dataset, CORPORA[dataset].src)
    return [[BOS] + src_vocab(toks) + [EOS] for toks in tokenize(list(lines))]



# %% [markdown]
# What `evaluate` scores: two aligned files given on the command line, or the test or
# validation split of the checkpoint's data set — the copy task's are regenerated from its
# seed; for Multi30k it can also be the 2017 or 2018 test set. `--split valid` is the whole
# split: a run trained with `train_on_valid_rest` learnt from the pairs after its first
# `max_valid_sentences`, so score such a run's held-out part with `--first`.

# %%
def evaluation_pairs(args, cfg: Config) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) for ``evaluate`` (§6.1): ``--src``/``--ref``, or a split; the first ``--first``."""
    src, ref = _all_evaluation_pairs(args, cfg)
    return (src[: args.first], ref[: args.first]) if args.first else (src, ref)


def _all_evaluation_pairs(args, cfg: Config) -> tuple[list[str], list[str]]:
    """Every (source line, reference line) that ``evaluate`` was pointed at."""
    if (args.src is None) != (args.ref is None):
        raise DataError("give both --src and --ref, or neither (to score the test split)")
    if args.src is not None:
        src, ref = read_lines(args.src), read_lines(args.ref)
        if len(src) != len(ref):
            raise DataError(f"misaligned files: {args.src} has {len(src)} lines, {args.ref} has {len(ref)}")
        if not src:
            raise DataError(f"nothing to score: {args.src} and {args.ref} hold no lines")
        return src, ref
    if CORPORA[cfg.dataset].synthetic:
        if args.split not in ("test", "valid"):
            raise DataError(f"the {cfg.dataset} task has no split {args.split!r} (known: test, valid)")
        data = make_copy_data(cfg)
        pairs = data.splits[args.split]
        return ([" ".join(data.src_vocab.lookup_tokens(s[1:-1])) for s, _ in pairs],
                [" ".join(data.tgt_vocab.lookup_tokens(t[1:-1])) for _, t in pairs])
    if args.data_mirror is not None:
        cfg = dataclasses.replace(cfg, data_mirror=args.data_mirror)
    pairs, _ = read_parallel(*locate_test_split(cfg.dataset, args.split, cfg))
    return [s for s, _ in pairs], [t for _, t in pairs]


# %% [markdown]
# The two commands. `translate` reads sentences from its arguments, from a file
# (`--input`), or from standard input, and prints one translation per line; `evaluate`
# scores a pair of parallel files (`--src`, `--ref`; by default the data set's test split,
# `--split valid` its validation split, `--first N` only the first N pairs)
# and prints sacreBLEU's score and signature line. Both decode with beam size 4 and
# $\alpha = 0.6$ (§6.1) unless told otherwise (`--beam 1` is greedy). Their options are
# checked as they are parsed: a beam of at least 1, a finite $\alpha \ge 0$ (beam search's
# early stop needs it), at least one checkpoint to average, a device this machine has.

# %%
def _whole_number(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low`` (our addition)."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return check


def _alpha(text: str) -> float:
    """An argparse type: the length penalty α of §6.1, a finite number ≥ 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text!r}")
    return value


def _device(text: str) -> str:
    """An argparse type: a device this machine has (see :func:`device_problem`)."""
    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def inference_parser(command: str) -> argparse.ArgumentParser:
    """Options of the ``translate`` and ``evaluate`` commands (§6.1 decoding)."""
    parser = OneLineParser(prog=f"the_annotated_transformer.py {command}")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run_dir", "--run-dir", type=Path, help="a run directory: average its last checkpoints")
    where.add_argument("--checkpoint", type=Path, help="one checkpoint file")
    parser.add_argument("--average_last", "--average-last", type=_whole_number(1), default=5,
                        help="checkpoints of --run_dir to average (default 5, fewer if fewer exist)")
    parser.add_argument("--beam", type=_whole_number(1), default=4, help="beam size (1 = greedy; default 4, §6.1)")
    parser.add_argument("--alpha", type=_alpha, default=0.6, help="length penalty α (default 0.6, §6.1)")
    parser.add_argument("--device", type=_device, default="auto")
    if command == "translate":
        parser.add_argument("sentences", nargs="*", help="sentences to translate (else --input or stdin)")
        parser.add_argument("--input", type=Path, help="a file with one sentence per line")
    else:
        parser.add_argument("--src", type=Path, help="source sentences, one per line (default: test split)")
        parser.add_argument("--ref", type=Path, help="references, aligned with --src")
        parser.add_argument("--split", default="test",
                            help="without --src/--ref: test, valid, or for Multi30k test_2017_flickr / test_2018_flickr")
        parser.add_argument("--first", type=_whole_number(1), default=0,
                            help="score only the first N pairs (default: all)")
        parser.add_argument("--data_mirror", "--data-mirror", default=None, help="folder holding the data sets")
    return parser


# %% [markdown]
# Output line $i$ is the translation of input line $i$, whatever the input holds. A blank
# line gives a blank line without decoding (the model would otherwise invent a sentence for
# `<s> </s>`). A line longer than the model's positional encoding covers (`max_len`
# positions, `<s>` and `</s>` included) cannot be encoded; rather than failing every other
# line with it, the commands translate the rest, print an empty line in its place, name it on
# standard error and exit with status 1.

# %%
def translate_lines(lines: Sequence[str], model: EncoderDecoder, cfg: Config, src_vocab: Vocab, tgt_vocab: Vocab,
                    subwords: Optional[Subwords], device, beam_size: int, alpha: float) -> tuple[list[str], list]:
    """One translation per line (§6.1 decoding); blank and over-long lines give ""; returns (outputs, skipped).

    ``skipped`` lists (line number from 1, tokens) of the lines longer than ``cfg.max_len`` positions.
    """
    wanted = [i for i, line in enumerate(lines) if line.strip()]
    sources = encode_sources([lines[i] for i in wanted], cfg.dataset, src_vocab, subwords)
    skipped = [(i + 1, len(ids) - 2) for i, ids in zip(wanted, sources) if len(ids) > cfg.max_len]
    todo = [(i, ids) for i, ids in zip(wanted, sources) if len(ids) <= cfg.max_len]
    out = [""] * len(lines)
    if todo:
        tokens = translate(model, [ids for _, ids in todo], tgt_vocab, cfg, device, beam_size=beam_size, alpha=alpha)
        for (i, _), text in zip(todo, detokenize(tokens, cfg.dataset, subwords)):
            out[i] = " ".join(text.splitlines())  # one output line per input line, always
    return out, skipped


def skipped_message(skipped: Sequence[tuple[int, int]], max_len: int) -> str:
    """One line naming the input lines too long for the model (our addition)."""
    named = ", ".join(f"line {n} ({k:,} tokens)" for n, k in skipped[:10])
    more = f" and {len(skipped) - 10:,} more" if len(skipped) > 10 else ""
    return (f"error: skipped {named}{more}: longer than the model's max_len={max_len:,} positions "
            "(<s> and </s> included); each gave an empty output line")


def run_inference_command(command: str, argv: Sequence[str]) -> int:
    """``translate`` or ``evaluate``: load, decode (beam search, §6.1), print; 1 if lines were skipped."""
    args = inference_parser(command).parse_args(argv)
    refs = None
    if command == "translate":  # read first: a bad input fails before the model loads
        if args.sentences:
            lines = list(args.sentences)
        elif args.input:
            lines = read_lines(args.input)
        else:
            lines = split_lines(sys.stdin.buffer.read(), "standard input")
    device = resolve_device(args.device)
    model, cfg, src_vocab, tgt_vocab, subwords = load_for_inference(args.checkpoint, args.run_dir,
                                                                    args.average_last, device)
    if command == "evaluate":
        lines, refs = evaluation_pairs(args, cfg)
        if args.first > len(lines):  # asked for more than there is: say so, rather than score fewer unannounced
            print(f"note: --first {args.first:,}, but there are only {len(lines):,} pairs: scoring all of them",
                  file=sys.stderr)
    hyps, skipped = translate_lines(lines, model, cfg, src_vocab, tgt_vocab, subwords, device, args.beam, args.alpha)
    if refs is None:
        for h in hyps:
            print(h)
    else:
        result = bleu(hyps, refs, cfg.dataset)
        print(f"{result.text}\n{result.signature}")
    if skipped:
        print(skipped_message(skipped, cfg.max_len), file=sys.stderr)
        return 1
    return 0


# %% [markdown]
# `main` runs a command and turns every failure into one line: the program's own errors
# (bad data, a checkpoint that does not fit, a run directory in use) and the operating
# system's (a missing file, a full disk) with status 2, an interruption with 130, anything
# unforeseen with 1 — and `--debug` anywhere on the line shows the traceback instead. In a
# run of several processes, the first one speaks for all of an interruption.

# %%
def main(argv: Sequence[str]) -> int:
    """Entry point of the command line: ``train``, ``translate`` or ``evaluate``; returns the exit status."""
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        if argv and argv[0] in ("translate", "evaluate"):
            return run_inference_command(argv[0], argv[1:])
        command, cfg = config_from_args(argv)
        if command == "train":
            summary = train(cfg)
            if summary.get("bleu") is not None:
                print(f"done in {summary['total_minutes']:.1f} min: BLEU {summary['bleu']:.2f}; "
                      f"results in {summary['run_dir']}/results.json")
    except TrainingInterrupted as e:
        if not dist.is_initialized() or dist.get_rank() == 0:  # one message, not one per process
            print(f"interrupted: {e}", file=sys.stderr)
        return 130
    except (DataError, CheckpointError, TrainingDiverged, RunDirectoryError, OSError) as e:
        if debug:
            raise
        print(f"error: {e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename and e.strerror
              else f"error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # unforeseen: still one line, with the way to see more
        if debug:
            raise
        print(f"error: {type(e).__name__}: {first_line(e)} (run again with --debug to see where)", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# %% [markdown]
# # Part 4 — Real runs
#
# Runs of the same `train` function: a synthetic task that needs no data, then real
# German→English translation on Multi30k and on IWSLT14. Their size comes from the Prelude's
# `NOTEBOOK_PROFILE`: `full` (the default) is what produced the outputs stored in this
# notebook, on a 2-core CPU; `smoke` runs a few steps of each. The notebook scores the full runs of the command line when they are in
# `runs/` (the stored outputs do), and trains otherwise.

# %%
if EXAMPLES:
    # The notebook's own run folders (relative, so stored outputs name no machine's paths); a fresh
    # start each time the notebook runs, since `train` would otherwise resume what is there.
    NOTEBOOK_RUNS = Path(os.environ.get("NOTEBOOK_RUNS", "runs/notebook"))
    for name in ("copy", "multi30k", "iwslt14"):
        shutil.rmtree(NOTEBOOK_RUNS / name, ignore_errors=True)
    print(f"profile: {PROFILE}; device: {resolve_device('auto')}; "
          f"{resolve_precision('auto', resolve_device('auto'))[1]}")

# %% [markdown]
# ## A first example: learning to copy
#
# The task: given ten random symbols, output the same ten. It needs no data download, and
# a two-layer model learns it in well under a minute on a CPU, which makes it the quickest
# check that masking, the schedule, the loss and decoding work together. Scored with BLEU
# like everything else, a perfect copy is 100.

# %%
if EXAMPLES:
    copy_cfg = get_config("copy", run_dir=str(NOTEBOOK_RUNS / "copy"),
                          **({"epochs": 1, "max_steps": 5} if PROFILE == "smoke" else {}))
    copy_summary = train(copy_cfg, data=make_copy_data(copy_cfg), progress=False)  # bars off in stored outputs
    print(f"copy task: {copy_summary['steps']} updates in {copy_summary['total_minutes'] * 60:.0f} s, "
          f"BLEU {copy_summary['bleu']:.1f}")

# %% [markdown]
# The joint BPE vocabulary of Multi30k (Part 2) in action: trained on the training split
# in about half a second, it spells a rare German compound with several known pieces —
# no `<unk>` — and decoding the pieces gives the sentence back exactly.

# %%
if EXAMPLES:
    m30k_train, _ = read_parallel(*locate_dataset("multi30k", get_config("multi30k-small")).files["train"])
    bpe = build_subwords(m30k_train, get_config("multi30k-small"))
    sentence = "Ein Mann repariert das Kinderwagenrad vor der Eisenbahnbrücke."
    pieces = bpe.encode([sentence])[0]
    print(f"{len(bpe.vocab):,} pieces; {sentence!r} →\n{pieces}")
    print("decoded back:", bpe.decode([pieces])[0])
    del m30k_train, _, bpe, sentence, pieces

# %% [markdown]
# ## A real example: Multi30k German→English
#
# The `multi30k-small` preset: $N=3$, $d_{\text{model}}=256$, $d_{ff}=1024$, $h=8$,
# $P_{drop}=0.1$, $\epsilon_{ls}=0.1$, about 2,500 tokens per batch, Eq. 3 with 1,000 warm-up
# steps, a joint BPE vocabulary of 8,000 pieces with three-way weight sharing, and the
# attention path that is faster on the machine (the aside after §3.5); bf16 autocast is on only where the
# hardware computes bf16 natively (`precision="auto"`, Appendix A.2). The data comes
# from the mirror named by `DATA_MIRROR`, or is downloaded.
#
# The full run is the command line's: `make train CONFIG=multi30k-small` trains 15 epochs
# (about 18 minutes on a 2-core CPU with native bf16) into `runs/multi30k-small`. When that run is there, this
# cell does not train again: it scores the average of the run's last 5 checkpoints on the
# test set, greedy and with beam search (§6.1), which is what the stored outputs show.
# Without it, the cell trains a short run of the same preset (4 epochs) and scores that.
# Progress bars are off here so the stored outputs stay short; the command line shows them.

# %%
if EXAMPLES:
    FULL_RUN = Path("runs/multi30k-small")  # where `make train CONFIG=multi30k-small` writes
    use_full_run = PROFILE == "full" and (FULL_RUN / "results.json").is_file()
    if use_full_run:
        m30k_cfg = get_config("multi30k-small", run_dir=str(FULL_RUN))
        m30k_data = load_dataset(m30k_cfg)
        trained = json.loads((FULL_RUN / "results.json").read_text())
        print(f"the full run: {trained['steps']} updates in {trained['train_minutes']:.1f} min of training")
        m30k_model = make_model(len(m30k_data.src_vocab), len(m30k_data.tgt_vocab), m30k_cfg)
        m30k_summary = evaluate_test(m30k_model, m30k_data, m30k_cfg, resolve_device("auto"), FULL_RUN,
                                     progress=False)
        m30k_summary["curve"] = str(FULL_RUN / "curve.png")
    else:
        m30k_cfg = get_config("multi30k-small", run_dir=str(NOTEBOOK_RUNS / "multi30k"), epochs=4, average_last=0,
                              **({"max_steps": 5, "max_eval_sentences": 40} if PROFILE == "smoke" else {}))
        m30k_data = load_dataset(m30k_cfg)
        m30k_summary = train(m30k_cfg, data=m30k_data, progress=False)
        print(f"{m30k_summary['steps']} updates in {m30k_summary['total_minutes']:.1f} min")
    print(f"test BLEU: beam {m30k_summary['bleu']:.2f}, greedy {m30k_summary['bleu_greedy']:.2f} "
          f"({m30k_summary['bleu_kind']})")

# %% [markdown]
# The training curve that `train` saved from its metrics log (of the run scored above):

# %%
if EXAMPLES:
    from IPython.display import Image, display

    display(Image(filename=m30k_summary["curve"]))

# %% [markdown]
# ### Learned positions instead of sinusoids (§3.5, Table 3 row (E))
#
# §3.5 (quoted in Part 1) reports that learned positional embeddings and the sinusoids
# "produced nearly identical results"; Table 3 row (E) gives 4.92 perplexity and 25.7 BLEU
# for learned positions against the base model's 4.92 and 25.8 (newstest2013, English→German).
# The same experiment at our scale: the same preset, data, seed and number of epochs, with
# `positional="learned"` as the only change. With both full runs in `runs/` (the second
# is `make train CONFIG=multi30k-small ARGS="--positional learned --run_dir
# runs/multi30k-small-learned"`) the cell shows their results, which is what the stored
# outputs hold; otherwise it trains the learned variant with the budget of the run above.
# Perplexity is per BPE piece on the validation set, so it compares the two rows, not our
# numbers with the paper's.

# %%
if EXAMPLES:
    LEARNED_RUN = Path("runs/multi30k-small-learned")

    def valid_ppl(run_dir: Path) -> tuple[float, float]:
        """(best, last) validation perplexity in a run's metrics log."""
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        ppl = [r["valid_ppl"] for r in records if "valid_ppl" in r]
        return min(ppl), ppl[-1]

    if use_full_run and (LEARNED_RUN / "results.json").is_file():
        pair = {"sinusoid": (json.loads((FULL_RUN / "results.json").read_text()), FULL_RUN),
                "learned": (json.loads((LEARNED_RUN / "results.json").read_text()), LEARNED_RUN)}
    else:
        learned_cfg = dataclasses.replace(m30k_cfg, positional="learned", run_dir=str(NOTEBOOK_RUNS / "learned"))
        pair = {"sinusoid": (m30k_summary, Path(m30k_cfg.run_dir)),
                "learned": (train(learned_cfg, data=m30k_data, progress=False), Path(learned_cfg.run_dir))}
    print("positional   BLEU beam   BLEU greedy   valid ppl best / last   updates")
    for name, (summary, run_dir) in pair.items():
        best, last = valid_ppl(run_dir)
        print(f"{name:10s}   {summary['bleu']:9.2f}   {summary['bleu_greedy']:11.2f}   {best:10.2f} / {last:5.2f}"
              f"   {summary['steps']:7d}")
    del pair, valid_ppl

# %% [markdown]
# ### What the model attends to
#
# §3.2.3 lists three uses of attention: encoder self-attention, masked decoder
# self-attention and encoder-decoder attention. `attention_maps` returns the weights of
# every layer and every head for all three, for one sentence pair. It works for any model,
# the fast class included, which never materialises the weights: forward pre-hooks note
# the inputs each attention module receives during one forward pass (and are removed
# right after), then the weights are recomputed with the readable `attention()` from the
# module's own $W^Q_i$ and $W^K_i$. Nothing is stored on the modules, so ordinary forward
# passes keep no attention tensors alive.

# %%
ATTENTION_KINDS = ("encoder", "decoder_self", "decoder_src")


@torch.no_grad()
def attention_maps(model: EncoderDecoder, src, tgt) -> dict:
    r"""Attention weights of every layer and head, for the three uses of attention of §3.2.3.

    ``src`` (src_len,) source ids; ``tgt`` (tgt_len,) decoder input ids (starting with <s>).
    Returns ``{"encoder": (N, h, src_len, src_len), "decoder_self": (N_dec, h, tgt_len, tgt_len),
    "decoder_src": (N_dec, h, tgt_len, src_len)}`` (N_dec: the decoder's layers, N unless set otherwise); each
    row is a softmax of Eq. 1 and sums to 1.
    """
    model = unwrap(model)
    was_training = model.training
    model.eval()
    src, tgt = src.view(1, -1), tgt.view(1, -1)  # (1, src_len), (1, tgt_len)
    modules = {("encoder", i): layer.self_attn for i, layer in enumerate(model.encoder.layers)}
    for i, layer in enumerate(model.decoder.layers):
        modules[("decoder_self", i)], modules[("decoder_src", i)] = layer.self_attn, layer.src_attn
    inputs: dict = {}
    handles = [m.register_forward_pre_hook(lambda _m, args, key=key: inputs.__setitem__(key, args))
               for key, m in modules.items()]
    try:
        model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1), device=tgt.device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    maps = {}
    for kind in ATTENTION_KINDS:
        layers = []
        for i in range(len(model.decoder.layers if kind != "encoder" else model.encoder.layers)):
            a, (query, key, _value, mask) = modules[(kind, i)], inputs[(kind, i)]
            q, (k, v) = a.project_q(query), a.project_kv(key, key)  # (1, h, len, d_k) each
            layers.append(attention(q, k, v, per_head(mask))[1][0])  # the weights of Eq. 1: (h, len_q, len_k)
        maps[kind] = torch.stack(layers)  # (layers of its stack, h, len_q, len_k)
    return maps


# %% [markdown]
# Twenty-four maps per kind of attention (3 layers × 8 heads of `multi30k-small`) cannot
# all carry readable token labels at the width of a page. So there are two views: an
# overview of every layer and head, small and unlabelled, to see their shapes at a glance;
# and, for each kind, one head drawn large with its source and target tokens. Which head?
# We show the one whose rows are most concentrated — lowest mean entropy
# $-\sum_j a_{ij} \ln a_{ij}$ over its query rows $i$ — since a sharp head is the easiest to
# read; that choice is ours. The figures are built as `matplotlib.figure.Figure` objects,
# not through pyplot, so drawing them leaves no global state behind, and a test draws them
# for a tiny random model and checks that every token label is there and legible.

# %%
ATTENTION_TITLES = MappingProxyType({"encoder": "encoder self-attention",
                                     "decoder_self": "masked decoder self-attention",
                                     "decoder_src": "encoder-decoder attention"})


def sharpest_head(weights: torch.Tensor) -> tuple[int, int]:
    r"""The (layer, head) of ``weights`` (N, h, len_q, len_k) with the lowest mean row entropy (our choice).

    A row's entropy is $-\sum_j a_{ij} \ln a_{ij}$ (0 for a row that puts all weight on one key).
    """
    entropy = torch.special.entr(weights).sum(dim=-1).mean(dim=-1)  # (N, h): mean over query rows
    layer, head = divmod(int(entropy.argmin()), entropy.size(1))
    return layer, head


def draw_attention_overview(maps: dict, width: float = 7.2):
    """Every layer (rows) and head (columns) of each kind of attention of §3.2.3, small and unlabelled (our addition).

    ``maps`` as :func:`attention_maps` returns; ``width`` in inches at 100 dpi. Returns the figure.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 2.4 * len(maps)), dpi=100, layout="constrained")
    for sub, kind in zip(fig.subfigures(len(maps), 1, squeeze=False)[:, 0], maps):
        w = maps[kind]
        axes = sub.subplots(w.size(0), w.size(1), squeeze=False)
        for layer in range(w.size(0)):
            for head in range(w.size(1)):
                ax = axes[layer][head]
                ax.imshow(w[layer, head].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
                ax.set_xticks([])
                ax.set_yticks([])
                if layer == 0:
                    ax.set_title(f"head {head + 1}", fontsize=8)
                if head == 0:
                    ax.set_ylabel(f"layer {layer + 1}", fontsize=8)
        sub.suptitle(ATTENTION_TITLES.get(kind, kind), fontsize=10)
    return fig


# %% [markdown]
# The large view gives each token a square cell of at most 0.34 inch and its label three
# quarters of a cell; with many keys the cells shrink so that the figure stays about as
# wide as a page, where a wider image would be scaled down, labels and all.

# %%
def draw_attention_head(weights: torch.Tensor, rows: Sequence[str], cols: Sequence[str], title: str,
                        width: float = 7.2):
    """One head's attention map (§3.2.3) with every query token (rows) and key token (columns) labelled (our addition).

    ``weights`` (len_q, len_k); the figure is about ``width`` inches wide at 100 dpi. Returns the figure.
    """
    from matplotlib.figure import Figure

    n_q, n_k = weights.shape
    cell = min(0.34, (width - 2.2) / n_k)  # inches per token; 2.2 in for row labels and the colour bar
    fontsize = min(11.0, 0.75 * 72 * cell)  # points: three quarters of a cell
    fig = Figure(figsize=(2.2 + cell * n_k, 1.6 + cell * n_q), dpi=100, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(weights.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n_k), list(cols), rotation=90, fontsize=fontsize)
    ax.set_yticks(range(n_q), list(rows), fontsize=fontsize)
    ax.set_xlabel("key (attended to)", fontsize=10)
    ax.set_ylabel("query (attending)", fontsize=10)
    ax.set_title(title, fontsize=11)
    fig.colorbar(image, ax=ax, shrink=0.6).set_label("weight", fontsize=9)
    return fig


# %% [markdown]
# For one test sentence, the model that was scored above (for the full run the average of
# its last 5 checkpoints) translates with §6.1's decoding — beam search, beam
# 4, $\alpha = 0.6$, at most input length + 50 tokens, through `max_output_tokens` as
# `translate` does — and `attention_maps` records the weights while the decoder reads that
# translation. In the encoder-decoder map each row is an output token, each column a
# source token; in the decoder's self-attention each row is the token being predicted, each
# column a token already read.

# %%
if EXAMPLES:
    viz = make_model(len(m30k_data.src_vocab), len(m30k_data.tgt_vocab), m30k_cfg)  # the attention path this machine trains with
    paths = checkpoint_paths(Path(m30k_cfg.run_dir))
    viz.load_state_dict(average_checkpoints(paths[-m30k_cfg.average_last:]) if m30k_cfg.average_last > 1
                        else load_checkpoint(paths[-1])["model"])
    viz.eval()
    src_ids = m30k_data.splits["test"][1][0]
    src = torch.tensor([src_ids])  # (1, src_len)
    limit = max_output_tokens(src, m30k_cfg.max_decode_extra)  # (1,): §6.1's n + 50
    out_ids = [BOS] + beam_search(viz, src, padding_mask(src, PAD), limit, BOS, EOS, m30k_cfg.beam_size,
                                  m30k_cfg.length_penalty_alpha, banned=[PAD])[0]
    maps = attention_maps(viz, src[0], torch.tensor(out_ids[:-1]))
    src_words = m30k_data.src_vocab.lookup_tokens(src_ids)
    out_words = m30k_data.tgt_vocab.lookup_tokens(out_ids[1:])  # the token each decoder position predicts
    in_words = m30k_data.tgt_vocab.lookup_tokens(out_ids[:-1])  # the token each decoder position reads
    labels = {"encoder": (src_words, src_words), "decoder_self": (out_words, in_words),
              "decoder_src": (out_words, src_words)}
    print(f"{len(out_ids) - 1} tokens generated (limit {int(limit[0])}):", " ".join(out_words))

# %% [markdown]
# The overview first, then one head per kind, large (click a figure on the web page to see
# it at full size):

# %%
if EXAMPLES:
    import io

    from IPython.display import Image, display

    def show(fig, alt: str):
        """Display ``fig`` as a PNG that carries alt text (the web page uses it); whatever the backend."""
        png = io.BytesIO()
        fig.savefig(png, format="png", bbox_inches="tight")
        display(Image(data=png.getvalue()), metadata={"image/png": {"alt": alt}})

    show(draw_attention_overview(maps), "Attention weights of every layer and head, for encoder self-attention, "
         "masked decoder self-attention and encoder-decoder attention, as small unlabelled heat maps")
    for kind in ATTENTION_KINDS:
        layer, head = sharpest_head(maps[kind])
        title = f"{ATTENTION_TITLES[kind]}, layer {layer + 1}, head {head + 1}"
        rows, cols = labels[kind]
        show(draw_attention_head(maps[kind][layer, head], rows, cols, title),
             f"Heat map of {title}: rows are the tokens {' '.join(rows)}; columns are the tokens {' '.join(cols)}")

# %% [markdown]
# ## IWSLT14 German→English: on a GPU, and on a CPU
#
# IWSLT14 (TED talks) is the usual "small" benchmark of the Transformer literature: its
# published 6-layer models reach about 34.5–35.6 tokenized BLEU, trained for hours on a GPU
# with the full 160,239 training pairs. So this section trains what the machine can:
#
# * **on a GPU**, `iwslt14-small` (the recipe of those published models) on the full
#   training set, which the Appendix's `locate_dataset` downloads and prepares;
# * **on a CPU**, `iwslt14-sample`: the full set would take days there, and a model sized for
#   it overfits a small one, so this preset is sized for the 8,746-pair training sample (about
#   180,000 English words — a low-resource setting, where a small model (here a decoder of 2
#   layers under an encoder of 3), a small BPE vocabulary, strong dropout and label smoothing 0.2
#   matter; the README gives the published anchors) and trains in under half an hour of two cores.
#
# The command line's run (`make train` picks the preset for the machine) is shown with the
# scores it wrote when it is in `runs/`, and a run is trained here otherwise. Scores are tokenized BLEU on the
# lowercased, tokenized text, as the published IWSLT14 numbers are; the test set has 6,750
# sentences.

# %%
if EXAMPLES:
    iwslt_device = resolve_device("auto")
    iwslt_preset = "iwslt14-small" if iwslt_device.type == "cuda" else "iwslt14-sample"
    IWSLT_RUN = Path(f"runs/{iwslt_preset}")  # where `make train` writes on this kind of machine
    if PROFILE == "full" and (IWSLT_RUN / "results.json").is_file():
        # The test set is scored once per run: show the command line's scores instead of decoding again.
        iwslt_summary = json.loads((IWSLT_RUN / "results.json").read_text())
        iwslt_summary["curve"] = str(IWSLT_RUN / "curve.png")
        print(f"the command line's run: {iwslt_summary['steps']} updates in "
              f"{iwslt_summary['train_minutes']:.1f} min of training on {iwslt_summary['device']}")
        for example in iwslt_summary["examples"]:
            print(f"  source:    {example['source']}\n  reference: {example['reference']}\n"
                  f"  output:    {example['output']}")
    else:
        iwslt_cfg = get_config(iwslt_preset, run_dir=str(NOTEBOOK_RUNS / "iwslt14"),
                               **({"max_steps": 5, "max_eval_sentences": 40} if PROFILE == "smoke" else {}))
        iwslt_summary = train(iwslt_cfg, progress=False)
    print(f"{iwslt_preset}, test BLEU: beam {iwslt_summary['bleu']:.2f}, greedy {iwslt_summary['bleu_greedy']:.2f} "
          f"({iwslt_summary['bleu_kind']}, {iwslt_summary['test_sentences']:,} sentences)")
    display(Image(filename=iwslt_summary["curve"]))

# %% [markdown]
# Run as a script with a command (`train`, `translate`, `evaluate`), the file is the command line.

# %%
if __name__ == "__main__" and not EXAMPLES:
    sys.exit(main(sys.argv[1:]))

"""Decoding a whole set of sentences with the notebook's decoders (§6.1).

Part 3 of the notebook defines the decoders themselves — greedy decoding with and
without the key/value cache, beam search with the length penalty, and §6.1's length
limit (`max_output_tokens`). `translate` is the loop a test set or the command line
needs around them: sentences sorted by length into batches (so a batch wastes little
padding), each decoded and cut at ``</s>``, in the order they came.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .devices import progress_bar
from .parts import notebook


@torch.no_grad()
def translate(
    model,
    sources: Sequence[list[int]],
    tgt_vocab,
    cfg,
    device,
    progress: bool = False,
    beam_size: int = 1,
    alpha: float = 0.0,
    cached: bool | None = None,
) -> list[list[str]]:
    """Translations (token lists, without <s>, cut at </s>) of id sequences — §6.1
    decoding, batched by length; the result does not depend on the batching.

    ``beam_size=1`` is greedy decoding, otherwise the notebook's ``beam_search`` with
    length penalty ``alpha``. ``cached`` (default: when the model is the notebook's
    ``EncoderDecoder``) uses the key/value cache. At most min(n +
    ``cfg.max_decode_extra``, ``cfg.max_len`` − 1) tokens follow <s> (the notebook's
    length limit); sources longer than ``cfg.max_len`` raise ``ValueError`` before
    anything is decoded. The model is moved to ``device`` first.
    """
    nb = notebook()
    if too_long := [i for i, s in enumerate(sources) if len(s) > cfg.max_len]:
        raise ValueError(
            f"sources {too_long[:10]} are longer than max_len={cfg.max_len} positions"
        )
    model = model.to(device)
    model.eval()
    if cached is None:
        cached = isinstance(model, nb.EncoderDecoder)
    bos, eos, pad = nb.BOS, nb.EOS, nb.PAD
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list = [None] * len(sources)
    starts = range(0, len(order), cfg.eval_batch_size)
    for s in progress_bar(starts, desc="decoding", disable=not progress, leave=False):
        idx = order[s : s + cfg.eval_batch_size]
        src = nb.pad_sequences([sources[i] for i in idx]).to(device)
        src_mask = nb.padding_mask(src, pad)  # (batch, 1, src_len)
        limits = nb.max_output_tokens(src, cfg.max_decode_extra)  # (batch,)
        limits = limits.clamp(max=cfg.max_len - 1)
        if beam_size == 1:
            state = nb.IncrementalDecoder if cached else nb.FullRecomputeDecoder
            n = 1 + int(limits.max())
            ys = nb.greedy_decode(model, src, src_mask, n, bos, eos, pad, state)
            # each sentence's own limit
            rows = [row[1 : 1 + n] for row, n in zip(ys.tolist(), limits.tolist())]
        else:
            args = (limits, bos, eos, beam_size, alpha, [pad], cached)
            rows = nb.beam_search(model, src, src_mask, *args)
        for i, row in zip(idx, rows):
            out[i] = tgt_vocab.lookup_tokens(
                row[: row.index(eos)] if eos in row else row
            )
    return out

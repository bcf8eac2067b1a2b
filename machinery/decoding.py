"""Incremental decoding with a key/value cache (Part 3 of the notebook explains it).

The decoder state `IncrementalDecoder` plugs into the notebook's `greedy_decode` and
`beam_search` in place of the readable `FullRecomputeDecoder`: the same tokens, one
decoder position per step instead of the whole prefix. It uses only the model's own
modules (each layer's `SublayerConnection`s and its attention's `project_q`,
`project_kv` and `combine`), so it follows any change to them.
"""

from __future__ import annotations

import torch


class IncrementalDecoder:
    r"""Key/value-cached decoding for :class:`EncoderDecoder` — §3 auto-regression,
    §3.2.3 masking.

    Holds each decoder layer's self-attention keys and values for the tokens fed so far,
    and the encoder-decoder keys and values of ``memory`` (computed once). ``step``
    feeds one token per row and returns the next token's log-probabilities, equal (up to
    rounding) to ``model.generator(model.decode(...))[:, -1]`` on the whole prefix.
    """

    def __init__(self, model, memory, src_mask):
        self.model = model
        self.src_mask = src_mask  # (batch, 1, src_len)
        layers = model.decoder.layers
        # per layer: (k, v), (batch, h, src_len, d_k|d_v)
        self.cross = [x.src_attn.project_kv(memory, memory) for x in layers]
        # per layer: (k, v), (batch, h, t, d_k|d_v)
        self.self_kv: list = [None] * len(model.decoder.layers)
        self.length = 0  # positions fed so far

    def step(self, tokens):
        """tokens (batch,) at position ``self.length`` → log-probs (batch, vocab)."""
        embed, posenc = self.model.tgt_embed
        x = embed(tokens.unsqueeze(1))  # (batch, 1, d_model)
        x = posenc(x, offset=self.length)
        for i, layer in enumerate(self.model.decoder.layers):
            x = layer.sublayer[0](
                x, lambda y, i=i, a=layer.self_attn: self._self_attn(i, a, y)
            )
            x = layer.sublayer[1](
                x, lambda y, i=i, a=layer.src_attn: self._src_attn(i, a, y)
            )
            x = layer.sublayer[2](x, layer.feed_forward)
        self.length += 1
        return self.model.generator(self.model.decoder.norm(x)[:, 0])  # (batch, vocab)

    def _self_attn(self, i: int, a, y):
        """The newest position attends to every position so far (no mask needed)."""
        q, (k, v) = a.project_q(y), a.project_kv(y, y)  # (batch, h, 1, d_k|d_v)
        if self.self_kv[i] is not None:
            k = torch.cat([self.self_kv[i][0], k], dim=2)  # (batch, h, t + 1, d_k)
            v = torch.cat([self.self_kv[i][1], v], dim=2)  # (batch, h, t + 1, d_v)
        self.self_kv[i] = (k, v)
        return a.combine(q, k, v)

    def _src_attn(self, i: int, a, y):
        """Encoder-decoder attention of the newest position (``memory`` cached)."""
        k, v = self.cross[i]
        return a.combine(a.project_q(y), k, v, self.src_mask)

    def reorder(self, index):
        """Keep rows ``index`` (new_batch,) of the self-attention cache; ``index`` maps
        each row to a row of the same sentence (beam search), whose source is the
        same."""
        self.self_kv = [
            (k.index_select(0, index), v.index_select(0, index))
            for k, v in self.self_kv
        ]

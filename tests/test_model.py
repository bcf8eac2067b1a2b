"""Part 1 invariants: every §3 component, the masks, and agreement with torch.nn.Transformer."""
import dataclasses
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import the_annotated_transformer as tat

TINY = tat.PRESETS["tiny"]


def tiny_model(**overrides):
    torch.manual_seed(0)
    return tat.make_model(13, 13, TINY, **overrides)


def random_batch(vocab=13, batch=3, src_len=7, tgt_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (batch, src_len), generator=g)
    tgt = torch.randint(4, vocab, (batch, tgt_len), generator=g)
    return src, tgt


def masks(src, tgt):
    src_mask = (src != tat.PAD).unsqueeze(-2)  # (batch, 1, src_len)
    tgt_mask = tat.Batch.make_std_mask(tgt, tat.PAD)  # (batch, tgt_len, tgt_len)
    return src_mask, tgt_mask


# --- shapes -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "base"])
def test_every_component_has_the_documented_shape(preset):
    cfg = tat.PRESETS[preset]
    b, n, m, d = 2, 5, 4, cfg.d_model
    x, mem = torch.randn(b, n, d), torch.randn(b, m, d)
    src_mask = torch.ones(b, 1, m, dtype=torch.bool)
    tgt_mask = tat.subsequent_mask(n).expand(b, n, n)
    mha = tat.MultiHeadedAttention(cfg.h, d, 0.0)
    assert mha(x, mem, mem, src_mask).shape == (b, n, d)
    assert not hasattr(mha, "attn")  # the forward pass keeps no attention weights
    assert tat.FastMultiHeadedAttention(cfg.h, d, 0.0)(x, x, x, tgt_mask).shape == (b, n, d)
    assert tat.PositionwiseFeedForward(d, cfg.d_ff)(x).shape == (b, n, d)
    assert tat.Embeddings(d, 11)(torch.randint(0, 11, (b, n))).shape == (b, n, d)
    assert tat.PositionalEncoding(d, 0.0)(x).shape == (b, n, d)
    assert tat.SublayerConnection(d, 0.0)(x, lambda y: y * 2).shape == (b, n, d)
    enc_layer = tat.EncoderLayer(d, tat.MultiHeadedAttention(cfg.h, d), tat.PositionwiseFeedForward(d, cfg.d_ff), 0.1)
    assert enc_layer(mem, src_mask).shape == (b, m, d)
    dec_layer = tat.DecoderLayer(d, tat.MultiHeadedAttention(cfg.h, d), tat.MultiHeadedAttention(cfg.h, d),
                                 tat.PositionwiseFeedForward(d, cfg.d_ff), 0.1)
    assert dec_layer(x, mem, src_mask, tgt_mask).shape == (b, n, d)
    assert tat.Encoder(enc_layer, 2)(mem, src_mask).shape == (b, m, d)
    assert tat.Decoder(dec_layer, 2)(x, mem, src_mask, tgt_mask).shape == (b, n, d)
    assert tat.Generator(d, 11)(x).shape == (b, n, 11)
    model = tat.make_model(11, 11, cfg, N=1)
    src, tgt = torch.randint(4, 11, (b, m)), torch.randint(4, 11, (b, n))
    out = model(src, tgt, *masks(src, tgt))
    assert out.shape == (b, n, d)
    assert model.generator(out).shape == (b, n, 11)
    assert cfg.d_k * cfg.h == cfg.d_model


def test_clones_are_independent_copies():
    layers = tat.clones(nn.Linear(3, 3), 4)
    assert len(layers) == 4
    assert len({id(layer.weight) for layer in layers}) == 4
    assert all(torch.equal(layers[0].weight, layer.weight) for layer in layers)


# --- attention and masks ----------------------------------------------------------------

def test_subsequent_mask_allows_exactly_the_past_and_present():
    mask = tat.subsequent_mask(5)
    assert mask.dtype == torch.bool and mask.shape == (1, 5, 5)
    for i in range(5):
        for j in range(5):
            assert bool(mask[0, i, j]) == (j <= i)


def test_attention_is_equation_1_and_rows_sum_to_one():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64), torch.randn(2, 4, 7, 8, dtype=torch.float64),
               torch.randn(2, 4, 7, 3, dtype=torch.float64))
    out, p = tat.attention(q, k, v)
    # PyTorch's own scaled dot-product attention (scale 1/sqrt(d_k) by default) is the reference.
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
    # With the identity as values, its output is the weight matrix itself.
    eye = torch.eye(7, dtype=torch.float64).expand(2, 4, 7, 7)
    torch.testing.assert_close(p, F.scaled_dot_product_attention(q, k, eye), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))
    # Only the products q·k matter: q scaled up and k scaled down by the same factor give the same weights,
    # q scaled alone does not.
    torch.testing.assert_close(tat.attention(q * 8 ** 0.5, k / 8 ** 0.5, v)[1], p, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(tat.attention(q * 8 ** 0.5, k, v)[1], p)


def test_masked_keys_get_exactly_zero_weight_and_true_means_may_attend():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 2)
    mask = torch.tensor([[[True, False, True, False, True]]])
    out, p = tat.attention(q, k, v, mask)
    assert torch.all(p[..., 1] == 0) and torch.all(p[..., 3] == 0)
    assert torch.all(p[..., [0, 2, 4]] > 0)
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 3))
    # Same result as attending over the allowed keys only.
    out_kept, _ = tat.attention(q, k[:, [0, 2, 4]], v[:, [0, 2, 4]])
    torch.testing.assert_close(out, out_kept)


def test_a_fully_masked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    mask = torch.tensor([[[True, True, False], [False, False, False]]])
    out, p = tat.attention(q, k, v, mask)
    assert not torch.isnan(out).any() and not torch.isnan(p).any()
    assert torch.all(p[0, 1] == 0) and torch.all(out[0, 1] == 0)
    for cls in (tat.MultiHeadedAttention, tat.FastMultiHeadedAttention):
        mha = cls(2, 4, 0.0)
        assert not torch.isnan(mha(q, k, k, mask)).any()


def test_multi_head_attention_is_h_independent_heads_concatenated_then_projected():
    torch.manual_seed(0)
    h, d = 4, 16
    mha = tat.MultiHeadedAttention(h, d, 0.0).eval()
    x, y = torch.randn(2, 3, d), torch.randn(2, 5, d)
    d_k = d // h
    heads = []
    for i in range(h):
        rows = slice(i * d_k, (i + 1) * d_k)  # head i's W^Q_i, W^K_i, W^V_i
        qi = x @ mha.w_q.weight[rows].T + mha.w_q.bias[rows]
        ki = y @ mha.w_k.weight[rows].T + mha.w_k.bias[rows]
        vi = y @ mha.w_v.weight[rows].T + mha.w_v.bias[rows]
        heads.append(tat.attention(qi, ki, vi)[0])
    expected = mha.w_o(torch.cat(heads, dim=-1))
    torch.testing.assert_close(mha(x, y, y), expected)


@pytest.mark.parametrize("norm_first", [False, True])
def test_fast_path_equals_readable_path(norm_first):
    readable = tiny_model(norm_first=norm_first).double().eval()
    fast = tat.make_model(13, 13, TINY, norm_first=norm_first, attention="fast").double().eval()
    fast.load_state_dict(readable.state_dict())
    assert isinstance(fast.encoder.layers[0].self_attn, tat.FastMultiHeadedAttention)
    src, tgt = random_batch()
    src[0, -2:] = tat.PAD  # padding exercises the source mask
    out_r = readable(src, tgt, *masks(src, tgt))
    out_f = fast(src, tgt, *masks(src, tgt))
    torch.testing.assert_close(out_f, out_r, rtol=1e-10, atol=1e-10)
    # Separate key and value tensors take the unfused branch.
    x, kk, vv = torch.randn(2, 3, 32, dtype=torch.float64), torch.randn(2, 4, 32, dtype=torch.float64), \
        torch.randn(2, 4, 32, dtype=torch.float64)
    a = readable.decoder.layers[0].src_attn
    b = fast.decoder.layers[0].src_attn
    torch.testing.assert_close(b(x, kk, vv), a(x, kk, vv), rtol=1e-10, atol=1e-10)


# --- layer norm, feed-forward, embeddings, positional encoding --------------------------

def test_layer_norm_formula_matches_nn_layernorm():
    torch.manual_seed(0)
    ln = nn.LayerNorm(10)
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    x = torch.randn(4, 6, 10) * 3 + 1
    torch.testing.assert_close(tat.layer_norm_formula(x, ln.weight, ln.bias, ln.eps), ln(x))


def test_sublayer_connection_is_post_norm_by_default_and_pre_norm_as_option():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64) * 3 + 1  # positions far from mean 0, variance 1
    f = nn.Linear(8, 8).double()
    post = tat.SublayerConnection(8, 0.0).double()
    # With the initial gain 1 and bias 0, LayerNorm(x + Sublayer(x)) has mean 0 and variance 1 at every position
    # (variance s / (s + eps) for a sum of variance s).
    out = post(x, f)
    s2 = (x + f(x)).var(-1, unbiased=False)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 3, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.var(-1, unbiased=False), s2 / (s2 + 1e-5), rtol=1e-12, atol=1e-12)
    # With a learned gain and bias: LayerNorm(x + Sublayer(x)), as F.layer_norm computes it with the module's own
    # gain and bias.
    with torch.no_grad():
        nn.init.normal_(post.norm.weight)
        nn.init.normal_(post.norm.bias)
    expected = F.layer_norm(x + f(x), (8,), post.norm.weight, post.norm.bias, eps=1e-5)
    torch.testing.assert_close(post(x, f), expected, rtol=1e-12, atol=1e-12)
    # Pre-norm: the output minus its input is the sub-layer applied to the normalised input; the sum itself is
    # not normalised.
    pre = tat.SublayerConnection(8, 0.0, norm_first=True).double()
    with torch.no_grad():
        nn.init.normal_(pre.norm.weight)
        nn.init.normal_(pre.norm.bias)
    out = pre(x, f)
    torch.testing.assert_close(out - x, f(F.layer_norm(x, (8,), pre.norm.weight, pre.norm.bias, eps=1e-5)),
                               rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, F.layer_norm(out, (8,)))


def test_feed_forward_is_equation_2():
    # Eq. 2, max(0, xW1 + b1)W2 + b2, with d_model = 2, d_ff = 3 and small whole numbers, worked out by hand.
    ff = tat.PositionwiseFeedForward(2, 3).double()
    with torch.no_grad():
        ff.w_1.weight.copy_(torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 1.0]]))  # nn.Linear stores W1 transposed
        ff.w_1.bias.copy_(torch.tensor([0.0, -1.0, 0.5]))
        ff.w_2.weight.copy_(torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 2.0]]))
        ff.w_2.bias.copy_(torch.tensor([0.5, 0.0]))
    x = torch.tensor([[[3.0, 1.0], [-1.0, 2.0], [0.0, 0.0]]], dtype=torch.float64)
    # x = (3, 1):  xW1 + b1 = (2, 5, 1.5), all kept;       W2 rows: 2 + 5 + 1.5 + 0.5 = 9,  -2 + 0 + 3 = 1
    # x = (-1, 2): xW1 + b1 = (-3, -3, 2.5) → (0, 0, 2.5); 2.5 + 0.5 = 3,                  2 · 2.5 = 5
    # x = (0, 0):  xW1 + b1 = (0, -1, 0.5) → (0, 0, 0.5);  0.5 + 0.5 = 1,                  2 · 0.5 = 1
    expected = torch.tensor([[[9.0, 1.0], [3.0, 5.0], [1.0, 1.0]]], dtype=torch.float64)
    torch.testing.assert_close(ff(x), expected, rtol=0, atol=1e-12)
    # Applied to each position separately and identically.
    torch.manual_seed(0)
    ff = tat.PositionwiseFeedForward(6, 10)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(ff(x[:, 1:2]), ff(x)[:, 1:2])
    torch.testing.assert_close(ff(x[1:, 2:]), ff(x)[1:, 2:])


def test_embeddings_are_scaled_by_sqrt_d_model():
    ids = torch.tensor([[1, 2, 3], [0, 9, 1]])
    for d_model, sqrt_d_model in ((16, 4.0), (64, 8.0), (2, 1.4142135623730951)):
        emb = tat.Embeddings(d_model, 10)
        ramp = torch.linspace(-1.0, 1.0, d_model)
        with torch.no_grad():
            emb.lut.weight.copy_(torch.arange(10.0).unsqueeze(1) * ramp)  # token k's vector: k · ramp
        expected = sqrt_d_model * ids.unsqueeze(-1).float() * ramp
        torch.testing.assert_close(emb(ids), expected)


@pytest.mark.parametrize("pos,i", [(0, 0), (1, 0), (7, 3), (50, 10), (123, 31)])
def test_positional_encoding_is_the_closed_form(pos, i):
    d_model = 64
    pe = tat.PositionalEncoding(d_model, 0.0).pe[0]
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / d_model)), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / d_model)), abs=1e-6)


def test_pe_at_pos_plus_k_is_a_linear_function_of_pe_at_pos():
    d_model, k = 32, 5
    pe = tat.PositionalEncoding(d_model, 0.0).pe[0].double()
    # Positions spread over the whole range, so that the slowest sinusoids vary too.
    fit, check = torch.arange(0, 4900, 7), torch.arange(3, 4900, 11)
    # Least squares: PE[pos + k] = PE[pos] @ M, fitted on some positions ...
    M = torch.linalg.lstsq(pe[fit], pe[fit + k], driver="gelsd").solution
    # ... holds on positions it never saw.
    torch.testing.assert_close(pe[check] @ M, pe[check + k], atol=1e-5, rtol=0)
    # It really depends on k: the map for k does not produce the encoding for k + 1.
    assert (pe[check] @ M - pe[check + k + 1]).abs().max() > 1e-2


# --- the whole model --------------------------------------------------------------------

def test_weight_sharing_is_one_tensor():
    three_way = tat.make_model(20, 20, TINY)
    w = three_way.generator.proj.weight
    assert w is three_way.tgt_embed[0].lut.weight is three_way.src_embed[0].lut.weight
    two_way = tat.make_model(20, 30, TINY, shared_vocab=False)
    assert two_way.generator.proj.weight is two_way.tgt_embed[0].lut.weight
    assert two_way.src_embed[0].lut.weight is not two_way.tgt_embed[0].lut.weight
    untied = tat.make_model(20, 20, TINY, tie_weights=False)
    assert untied.generator.proj.weight is not untied.tgt_embed[0].lut.weight
    assert tat.count_parameters(untied) - tat.count_parameters(three_way) == 2 * 20 * TINY.d_model
    with pytest.raises(ValueError):
        tat.make_model(20, 30, TINY)  # a shared vocabulary needs one size


def test_base_model_has_the_papers_parameter_count():
    n = tat.count_parameters(tat.make_model(37000, 37000, tat.PRESETS["base"]))
    assert abs(n - 65e6) / 65e6 < 0.05, n


def test_changing_future_target_tokens_leaves_earlier_outputs_unchanged():
    model = tiny_model().eval()
    src, tgt = random_batch(tgt_len=8)
    out = model(src, tgt, *masks(src, tgt))
    for t in (0, 3, 6):
        changed = tgt.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 - 4) % 9 + 4  # other real tokens
        out2 = model(src, changed, *masks(src, changed))
        torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1])
        assert not torch.allclose(out2[:, t + 1:], out[:, t + 1:])


def test_appending_source_padding_leaves_the_output_unchanged():
    model = tiny_model().eval()
    src, tgt = random_batch()
    out = model(src, tgt, *masks(src, tgt))
    padded = torch.cat([src, torch.full((src.size(0), 4), tat.PAD)], dim=1)
    torch.testing.assert_close(model(padded, tgt, *masks(padded, tgt)), out)


def test_eval_mode_is_deterministic_and_train_mode_applies_dropout():
    model = tiny_model()
    src, tgt = random_batch()
    model.eval()
    a = model(src, tgt, *masks(src, tgt))
    b = model(src, tgt, *masks(src, tgt))
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(1)
    c = model(src, tgt, *masks(src, tgt))
    torch.manual_seed(2)
    d = model(src, tgt, *masks(src, tgt))
    assert not torch.allclose(c, d)


def test_dropout_sits_exactly_where_section_5_4_puts_it():
    cfg = TINY
    model = tat.make_model(13, 13, cfg)
    active = {name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0}
    expected = {"src_embed.1.dropout", "tgt_embed.1.dropout"}  # sums of embeddings and PE
    expected |= {f"encoder.layers.{i}.sublayer.{j}.dropout" for i in range(cfg.N) for j in range(2)}
    expected |= {f"decoder.layers.{i}.sublayer.{j}.dropout" for i in range(cfg.N) for j in range(3)}
    assert active == expected
    assert all(m.p == cfg.P_drop for name, m in model.named_modules() if name in expected)


def _torch_transformer_like(model, cfg, norm_first):
    """nn.Transformer with the same sizes and our weights copied in."""
    d, h, N = cfg.d_model, cfg.h, cfg.N
    enc_layer = nn.TransformerEncoderLayer(d, h, cfg.d_ff, 0.0, batch_first=True, norm_first=norm_first)
    dec_layer = nn.TransformerDecoderLayer(d, h, cfg.d_ff, 0.0, batch_first=True, norm_first=norm_first)
    # The paper's post-norm stacks end with no extra norm; pre-norm stacks end with one.
    encoder = nn.TransformerEncoder(enc_layer, N, norm=nn.LayerNorm(d) if norm_first else None,
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(dec_layer, N, norm=nn.LayerNorm(d) if norm_first else None)
    ref = nn.Transformer(d, h, N, N, cfg.d_ff, 0.0, batch_first=True, norm_first=norm_first,
                         custom_encoder=encoder, custom_decoder=decoder).double()

    def copy_mha(theirs, ours):
        theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        theirs.out_proj.load_state_dict(ours.w_o.state_dict())

    with torch.no_grad():
        for theirs, ours in zip(ref.encoder.layers, model.encoder.layers):
            copy_mha(theirs.self_attn, ours.self_attn)
            theirs.linear1.load_state_dict(ours.feed_forward.w_1.state_dict())
            theirs.linear2.load_state_dict(ours.feed_forward.w_2.state_dict())
            theirs.norm1.load_state_dict(ours.sublayer[0].norm.state_dict())
            theirs.norm2.load_state_dict(ours.sublayer[1].norm.state_dict())
        for theirs, ours in zip(ref.decoder.layers, model.decoder.layers):
            copy_mha(theirs.self_attn, ours.self_attn)
            copy_mha(theirs.multihead_attn, ours.src_attn)
            theirs.linear1.load_state_dict(ours.feed_forward.w_1.state_dict())
            theirs.linear2.load_state_dict(ours.feed_forward.w_2.state_dict())
            for k in range(3):
                getattr(theirs, f"norm{k + 1}").load_state_dict(ours.sublayer[k].norm.state_dict())
        if norm_first:
            ref.encoder.norm.load_state_dict(model.encoder.norm.state_dict())
            ref.decoder.norm.load_state_dict(model.decoder.norm.state_dict())
    return ref.eval()


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_nn_transformer_with_copied_weights(norm_first):
    cfg = dataclasses.replace(TINY, N=2, d_model=16, d_ff=24, h=4)
    torch.manual_seed(0)
    model = tat.make_model(13, 13, cfg, norm_first=norm_first).double().eval()
    ref = _torch_transformer_like(model, cfg, norm_first)
    src, tgt = random_batch(src_len=9, tgt_len=6)
    src[1, -3:] = tat.PAD
    src_mask, tgt_mask = masks(src, tgt)
    ours = model(src, tgt, src_mask, tgt_mask)
    with torch.no_grad():
        theirs = ref(model.src_embed(src), model.tgt_embed(tgt),
                     tgt_mask=~tat.subsequent_mask(tgt.size(1))[0],  # torch: True = blocked
                     src_key_padding_mask=src == tat.PAD, memory_key_padding_mask=src == tat.PAD)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_untrained_model_decodes_end_to_end():
    model = tiny_model().eval()
    src = torch.tensor([[4, 5, 6, 7, 8]])
    out = tat.greedy_decode(model, src, torch.ones(1, 1, 5, dtype=torch.bool), max_len=7, start_symbol=tat.BOS)
    assert out.shape == (1, 7) and out[0, 0] == tat.BOS
    assert out.min() >= 0 and out.max() < 13


@pytest.mark.parametrize("device, setting, path", [
    ("cpu", "auto", "readable"), ("cuda", "auto", "fast"), ("cuda:1", "auto", "fast"),
    ("cpu", "fast", "fast"), ("cuda", "readable", "readable"), (None, "auto", "readable"),
])
def test_attention_auto_takes_the_fused_path_on_cuda_only(device, setting, path):
    chosen, line = tat.resolve_attention(setting, None if device is None else torch.device(device))
    assert chosen == path
    assert line.startswith(f"attention: {path} path (") and ("auto" in line) == (setting == "auto")


def test_attention_setting_is_checked_and_builds_its_class():
    with pytest.raises(ValueError, match="auto, readable or fast"):
        tat.resolve_attention("flash")
    for setting, cls in (("readable", tat.MultiHeadedAttention), ("fast", tat.FastMultiHeadedAttention),
                         ("auto", tat.MultiHeadedAttention)):
        model = tat.make_model(11, 11, TINY, attention=setting)
        assert type(model.encoder.layers[0].self_attn) is cls


# --- §3.5's alternative: learned positional embeddings (Table 3, row (E)) -------------------

def learned_model(**overrides):
    torch.manual_seed(0)
    return tat.make_model(13, 13, tat.MODEL_PRESETS["tiny"], positional="learned", P_drop=0.0, **overrides).eval()


def test_learned_positions_add_one_trained_vector_per_position():
    model = learned_model()
    sinusoid = tat.make_model(13, 13, tat.MODEL_PRESETS["tiny"])
    cfg = tat.MODEL_PRESETS["tiny"]
    assert tat.count_parameters(model) - tat.count_parameters(sinusoid) == 2 * cfg.max_len * cfg.d_model
    table = model.tgt_embed[1]
    assert isinstance(table, tat.LearnedPositionalEncoding) and table.weight.requires_grad
    x = torch.randn(2, 5, cfg.d_model)
    for offset in (0, 3):  # what is added is exactly rows offset … offset+4 of the table
        torch.testing.assert_close(table(x, offset=offset) - x, table.weight[offset:offset + 5].expand(2, 5, -1))


def test_learned_positions_train_only_the_rows_of_positions_seen():
    model = learned_model()
    src = torch.randint(4, 13, (3, 6))
    tgt = torch.randint(4, 13, (3, 4))
    out = model(src, tgt, tat.padding_mask(src, tat.PAD), tat.subsequent_mask(4))
    out.sum().backward()
    grad = model.src_embed[1].weight.grad
    assert grad[:6].abs().sum(dim=1).gt(0).all() and grad[6:].abs().sum() == 0
    assert model.tgt_embed[1].weight.grad[:4].abs().sum(dim=1).gt(0).all()


def test_learned_positions_keep_causality_and_padding_invariance():
    model = learned_model()
    src = torch.randint(4, 13, (2, 7))
    tgt = torch.randint(4, 13, (2, 6))
    mask = tat.subsequent_mask(6)
    out = model(src, tgt, tat.padding_mask(src, tat.PAD), mask)
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(4, 13, (2, 2))  # only the future of position 3 differs
    torch.testing.assert_close(model(src, changed, tat.padding_mask(src, tat.PAD), mask)[:, :4], out[:, :4])
    padded = torch.cat([src, torch.full((2, 3), tat.PAD)], dim=1)
    torch.testing.assert_close(model(padded, tgt, tat.padding_mask(padded, tat.PAD), mask), out)


def test_cached_decoding_equals_full_recompute_with_learned_positions():
    model = learned_model()
    src = torch.randint(4, 13, (4, 8))
    src[1, 5:] = tat.PAD
    mask = tat.padding_mask(src, tat.PAD)
    full = tat.greedy_decode(model, src, mask, 12, tat.BOS, tat.EOS, tat.PAD)
    cached = tat.greedy_decode_cached(model, src, mask, 12, tat.BOS, tat.EOS, tat.PAD)
    assert torch.equal(full, cached)


def test_positional_setting_is_checked():
    with pytest.raises(ValueError, match="positional must be one of sinusoid, learned"):
        tat.get_config("tiny", positional="rotary")


# FastDropout (the aside after §3.5): the same random function as nn.Dropout, drawn more cheaply.

@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_drops_with_probability_p_and_keeps_the_expectation(p, dtype):
    torch.manual_seed(0)
    n = 400_000
    x = torch.full((n,), 2.0, dtype=dtype)
    y = tat.FastDropout(p).train()(x)
    dropped = float((y == 0).float().mean())
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)  # five standard deviations of a binomial share
    kept = y[y != 0]
    assert torch.all(kept == kept[0])  # one scale for every kept element
    # the scale is 1 / (1 - p') for the probability rounded to 2^-15: the mean stays 2 (bf16 rounds the scale)
    assert abs(float(kept[0]) * (1 - round(p * 2**15) / 2**15) - 2.0) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert abs(float(y.float().mean()) - 2.0) < 0.02


def test_fast_dropout_masks_are_independent_across_positions_and_calls():
    torch.manual_seed(0)
    drop = tat.FastDropout(0.5).train()
    a = drop(torch.ones(200_000)) == 0
    b = drop(torch.ones(200_000)) == 0
    assert abs(float((a & b).float().mean()) - 0.25) < 0.01  # two calls: independent masks
    assert abs(float((a[:-1] & a[1:]).float().mean()) - 0.25) < 0.01  # neighbours (within one 64-bit draw) too
    for j in range(4):  # each of the four 15-bit slices of a draw drops half
        assert abs(float(a.view(-1, 4)[:, j].float().mean()) - 0.5) < 0.01


def test_fast_dropout_gradient_is_its_mask_and_scale_and_eval_is_identity():
    torch.manual_seed(0)
    drop = tat.FastDropout(0.2).train()
    x = torch.randn(3, 5, 7, requires_grad=True)
    y = drop(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach() / x.detach())  # d(x·m·s)/dx = m·s = y/x
    assert torch.equal(drop.eval()(x), x)
    torch.manual_seed(3)
    first = tat.FastDropout(0.2).train()(x)
    torch.manual_seed(3)
    assert torch.equal(tat.FastDropout(0.2).train()(x), first)  # seeded: reproducible


def test_make_model_swaps_every_dropout_for_fast_dropout_when_asked():
    fast = tat.make_model(13, 13, TINY, attn_dropout=0.1, ffn_dropout=0.1, fast_dropout=True)
    plain = tat.make_model(13, 13, TINY, attn_dropout=0.1, ffn_dropout=0.1)  # the default: nn.Dropout's numbers
    names = lambda m, cls: {n for n, mod in m.named_modules() if type(mod) is cls}  # noqa: E731
    assert names(fast, tat.SameMaskDropout) == set() and names(plain, tat.FastDropout) == set()
    assert names(fast, nn.Dropout) == names(plain, nn.Dropout) == set()  # every one replaced
    assert names(fast, tat.FastDropout) == names(plain, tat.SameMaskDropout)  # the same places
    assert len(names(plain, tat.SameMaskDropout)) == 2 + TINY.N * (2 + 1 + 1) + TINY.N * (3 + 2 + 1)
    plain.load_state_dict(fast.state_dict())
    src, tgt = random_batch()
    torch.testing.assert_close(fast.eval()(src, tgt, *masks(src, tgt)), plain.eval()(src, tgt, *masks(src, tgt)))


def test_fast_dropout_off_the_cpu_is_nn_dropout(monkeypatch):
    calls = []
    plain = F.dropout

    def counting_dropout(x, p=0.5, training=True, inplace=False):
        calls.append((x.device.type, p, training))
        return plain(x, p, training, inplace)

    monkeypatch.setattr(F, "dropout", counting_dropout)  # what nn.Dropout.forward calls
    drop = tat.FastDropout(0.1).train()
    y = drop(torch.empty(4, 8, device="meta"))  # any device but the CPU (CUDA where it exists)
    assert y.device.type == "meta" and calls == [("meta", 0.1, True)]
    drop(torch.ones(4, 8))  # on the CPU: the packed-bit mask, not F.dropout
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------
# SameMaskDropout (the aside after §3.5): nn.Dropout to the last bit, its mask drawn faster.
# --------------------------------------------------------------------------------------------

def dropout_pass(drop: nn.Module, x: torch.Tensor, seed: int):
    """Output, input gradient and the generator's state after one training pass of ``drop`` on ``x``."""
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = drop.train()(x)
    (y.float() * torch.arange(y.numel()).view(y.shape)).sum().backward()
    return y.detach(), x.grad, torch.get_rng_state()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_same_mask_dropout_gives_nn_dropouts_outputs_gradients_and_random_stream(p, dtype):
    x = torch.randn(3, 37, 64, dtype=dtype)
    for seed in (0, 7):
        want = dropout_pass(nn.Dropout(p), x, seed)
        got = dropout_pass(tat.SameMaskDropout(p), x, seed)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    torch.manual_seed(1)  # and one stream through several calls, as in a model
    first = [tat.SameMaskDropout(p).train()(x) for _ in range(3)]
    torch.manual_seed(1)
    assert all(torch.equal(a, nn.Dropout(p).train()(x)) for a in first)


def mkl_draws_bernoulli() -> bool:
    """Whether PyTorch's CPU bernoulli_ may use MKL's generator here (it does so only on Intel CPUs)."""
    cpuinfo = Path("/proc/cpuinfo")
    intel = "GenuineIntel" in cpuinfo.read_text() if cpuinfo.is_file() else True  # unknown: assume it may
    return torch.backends.mkl.is_available() and intel


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """The module as it is where nothing was compiled: masks drawn by the random_ replay."""
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_KERNEL", str(tmp_path / "not-built.so"))
    tat.mask_drawer.cache_clear()
    yield
    tat.mask_drawer.cache_clear()


@pytest.fixture(scope="module")
def kernel():
    """csrc/dropout_mask.c compiled (``make kernel``; ``make test`` builds it first). Fails where a C
    compiler exists but the kernel is not built or does not load; skips only without a compiler."""
    if not Path(tat.DROPOUT_KERNEL).is_file() and shutil.which("make") and shutil.which("cc"):
        subprocess.run(["make", "kernel"], check=False, capture_output=True)
    lib = tat.load_dropout_kernel()
    if lib is None and not shutil.which("cc"):
        pytest.skip("no C compiler: the dropout kernel is not built here (the random_ replay draws the masks)")
    assert lib is not None, f"{tat.DROPOUT_KERNEL} is not built or does not load"
    return lib


def test_same_mask_dropout_draws_without_bernoulli_where_the_check_passes(monkeypatch, no_kernel):
    if mkl_draws_bernoulli():
        pytest.skip("on an Intel CPU PyTorch may draw bernoulli_ with MKL: SameMaskDropout is nn.Dropout there")
    for q, dtype in ((0.9, torch.float32), (0.9, torch.bfloat16), (0.7, torch.float32)):
        assert tat.mask_drawer(q, dtype) is tat._replayed_scaled_mask, (q, dtype)  # the default kernel: the replay holds
    calls = []
    plain = F.dropout
    monkeypatch.setattr(F, "dropout", lambda *a, **k: calls.append(1) or plain(*a, **k))
    x = torch.ones(16, 16)
    y = tat.SameMaskDropout(0.1).train()(x)
    assert calls == [] and 0 < int((y == 0).sum()) < x.numel()
    tat.SameMaskDropout(0.1).train()(x.t())  # not contiguous: nn.Dropout's own kernel
    y = tat.SameMaskDropout(0.1).eval()(x)  # evaluation: nn.Dropout, the identity
    assert calls == [1, 1] and torch.equal(y, x)
    tat.SameMaskDropout(0.1).train()(torch.empty(4, 8, device="meta"))  # off the CPU (CUDA where it exists)
    tat.SameMaskDropout(0.1, inplace=True).train()(torch.ones(16, 16))  # in place, as nn.Dropout does it
    assert calls == [1, 1, 1, 1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # under torch.compile: Inductor's dropout
    tat.SameMaskDropout(0.1).train()(x)
    assert calls == [1, 1, 1, 1, 1]


def test_the_replay_check_fails_when_the_replayed_mask_is_not_bernoullis(monkeypatch, no_kernel):
    real = tat._replayed_scaled_mask
    monkeypatch.setattr(tat, "_replayed_scaled_mask", lambda shape, q, dtype: real(shape, q, dtype).roll(1))
    assert tat.mask_drawer(0.9, torch.float32) is None
    calls = []
    plain = F.dropout
    monkeypatch.setattr(F, "dropout", lambda *a, **k: calls.append(1) or plain(*a, **k))
    tat.SameMaskDropout(0.1).train()(torch.ones(8, 8))
    assert calls == [1]  # so SameMaskDropout is nn.Dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_kernel_draws_bernoullis_masks_and_leaves_the_generator_where_bernoulli_does(kernel, dtype):
    # sizes around the generator's 624-word blocks and the kernel's 1,024-element chunks, from
    # states part-way through a block (the words drawn before) and fresh after seeding
    for n, before, q in [(1, 0, 0.9), (311, 5, 0.9), (312, 0, 0.7), (313, 311, 0.5), (1024, 3, 0.9),
                         (1025, 600, 0.7), (5000, 1, 0.9), (1 << 17, 77, 0.9), (0, 9, 0.9)]:
        torch.manual_seed(n + before)
        torch.empty(before, dtype=torch.int64).random_()  # 2 words each
        start = torch.get_rng_state()
        want = torch.empty(n, dtype=dtype).bernoulli_(q).div_(q)
        after = torch.get_rng_state()
        torch.set_rng_state(start)
        got = tat._kernel_scaled_mask(kernel, torch.Size([n]), q, dtype)
        assert torch.equal(got, want), (n, before, q)
        assert torch.equal(torch.get_rng_state(), after), (n, before, q)


def test_only_a_library_built_from_this_kernel_source_is_loaded(kernel, tmp_path):
    import _ctypes  # a real shared library without the kernel's functions

    not_a_library = tmp_path / "dropout_mask.so"
    not_a_library.write_text("not a library")
    assert tat.load_dropout_kernel(str(not_a_library)) is None
    assert tat.load_dropout_kernel(_ctypes.__file__) is None
    assert tat.load_dropout_kernel(str(tmp_path / "missing.so")) is None
    assert kernel.dropout_mask_interface() == tat.DROPOUT_KERNEL_INTERFACE


def test_the_kernel_refuses_a_generator_state_it_does_not_know(kernel):
    state = torch.get_rng_state()
    state[8:12] = torch.tensor([0], dtype=torch.int32).view(torch.uint8)  # `left` 0: never a generator's
    before = state.clone()
    out = torch.zeros(16)
    assert kernel.dropout_mask(state.data_ptr(), 2**52, 0, out.data_ptr(), 16, 4) == -1
    assert torch.equal(state, before) and torch.equal(out, torch.zeros(16))
    assert kernel.dropout_mask(torch.get_rng_state().data_ptr(), 2**52, 0, out.data_ptr(), 16, 8) == -1  # 8-byte elements


def test_the_mask_drawer_prefers_the_kernel_and_falls_back_where_it_is_wrong(kernel, monkeypatch):
    if mkl_draws_bernoulli():
        pytest.skip("on an Intel CPU PyTorch may draw bernoulli_ with MKL: SameMaskDropout is nn.Dropout there")
    tat.mask_drawer.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            assert tat.mask_drawer(0.9, dtype).func is tat._kernel_scaled_mask
        assert tat.mask_drawer(0.9, torch.float64) is tat._replayed_scaled_mask  # 8-byte elements: not the kernel's
        assert "compiled kernel" in tat.dropout_note(TINY, torch.device("cpu"))
        real = tat._kernel_scaled_mask
        monkeypatch.setattr(tat, "_kernel_scaled_mask", lambda *a: real(*a).roll(1))  # a kernel that went wrong
        tat.mask_drawer.cache_clear()
        assert tat.mask_drawer(0.9, torch.float32) is tat._replayed_scaled_mask
        assert "it was not used" in tat.dropout_note(TINY, torch.device("cpu"))

        def refused(*args):
            raise RuntimeError("the dropout kernel does not recognise the generator's state")

        monkeypatch.setattr(tat, "_kernel_scaled_mask", refused)  # a kernel that fails is passed over too
        tat.mask_drawer.cache_clear()
        assert tat.mask_drawer(0.9, torch.float32) is tat._replayed_scaled_mask
        assert tat.mask_drawer(0.9, torch.float32, kernel=False) is tat._replayed_scaled_mask
    finally:
        tat.mask_drawer.cache_clear()


def test_the_log_says_how_dropout_masks_are_drawn(no_kernel):
    cpu = torch.device("cpu")
    note = tat.dropout_note(TINY, cpu)
    assert "random_" in note and "not-built.so: nothing is built there" in note
    assert tat.dropout_note(dataclasses.replace(TINY, fast_dropout=True), cpu) == ""
    assert tat.dropout_note(dataclasses.replace(TINY, P_drop=0.0), cpu) == ""
    assert tat.dropout_note(TINY, torch.device("meta")) == ""  # off the CPU: nn.Dropout's own kernel


@pytest.mark.parametrize("drawer", ["kernel", "replay"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_model_trains_to_the_same_weights_with_same_mask_dropout_as_with_nn_dropout(autocast, drawer, request):
    request.getfixturevalue("kernel" if drawer == "kernel" else "no_kernel")
    if not mkl_draws_bernoulli():
        used = tat.mask_drawer(0.9, torch.float32)
        assert (getattr(used, "func", None) is tat._kernel_scaled_mask) == (drawer == "kernel")
    def train(kind):
        torch.manual_seed(0)
        model = tat.use_dropout(tat.make_model(13, 13, TINY, attn_dropout=0.1, ffn_dropout=0.1), kind).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        src, tgt = random_batch()
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model.generator(model(src, tgt, *masks(src, tgt)))
            out.float().logsumexp(-1).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model

    same_mask, plain = train(tat.SameMaskDropout), train(nn.Dropout)
    assert {type(m) for m in plain.modules()} & {tat.SameMaskDropout} == set()
    for (name, a), b in zip(same_mask.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------
# Word dropout (our option for small data): whole tokens, only in training, off by default
# --------------------------------------------------------------------------------------------

def test_word_dropout_zeroes_whole_tokens_in_training_and_nothing_in_eval():
    torch.manual_seed(0)
    x = torch.randn(8, 50, 16) + 3.0  # no element is zero by chance
    drop = tat.WordDropout(0.3).train()
    y = drop(x)
    zero = (y == 0).all(-1)  # (batch, seq): the tokens dropped
    assert ((y == 0).any(-1) == zero).all()  # a token is dropped whole or not at all
    torch.testing.assert_close(y[~zero], x[~zero] / 0.7)  # the others scaled as dropout scales
    assert 0.2 < float(zero.float().mean()) < 0.4  # about p of 400 tokens
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(tat.WordDropout(0.0).train()(x), x)


def test_make_model_adds_word_dropout_before_the_positions_only_when_asked():
    plain = tat.make_model(11, 11, tat.MODEL_PRESETS["tiny"])
    assert not any(isinstance(m, tat.WordDropout) for m in plain.modules())
    torch.manual_seed(0)
    model = tat.make_model(11, 11, tat.MODEL_PRESETS["tiny"], word_dropout=0.25)
    for embed in (model.src_embed, model.tgt_embed):
        assert [type(m) for m in embed] == [tat.Embeddings, tat.WordDropout, tat.PositionalEncoding]
        assert embed[1].p == 0.25
    assert model.state_dict().keys() == plain.state_dict().keys()  # no parameters of its own
    # in eval it is the same network
    plain.load_state_dict(model.state_dict())
    src = torch.tensor([[0, 5, 6, 7, 1]])
    tgt = torch.tensor([[0, 7, 8]])
    args = (src, tgt, tat.padding_mask(src, tat.PAD), tat.subsequent_mask(3) & (tgt != tat.PAD).unsqueeze(-2))
    assert torch.equal(model.eval()(*args), plain.eval()(*args))
    with pytest.raises(ValueError, match="word_dropout must be in"):
        tat.get_config("tiny", word_dropout=1.0)


@pytest.mark.parametrize("positional", ["sinusoid", "learned"])
def test_a_model_with_word_dropout_decodes_the_same_with_and_without_the_cache(positional):
    torch.manual_seed(0)
    model = tat.make_model(11, 11, tat.MODEL_PRESETS["tiny"], word_dropout=0.3, positional=positional).eval()
    src = torch.tensor([[0, 5, 6, 7, 8, 1], [0, 9, 4, 1, tat.PAD, tat.PAD]])
    src_mask = tat.padding_mask(src, tat.PAD)
    with torch.no_grad():
        full = tat.greedy_decode(model, src, src_mask, 9, tat.BOS, tat.EOS, tat.PAD)
        cached = tat.greedy_decode_cached(model, src, src_mask, 9, tat.BOS, tat.EOS, tat.PAD)
    assert torch.equal(full, cached)


def test_n_dec_sets_the_decoder_depth_alone_and_zero_means_n():
    tiny = tat.MODEL_PRESETS["tiny"]
    same = tat.make_model(11, 11, tiny)
    assert len(same.encoder.layers) == len(same.decoder.layers) == tiny.N  # §3.1: N of each
    shallow = tat.make_model(11, 11, tiny, N=3, N_dec=1)
    assert (len(shallow.encoder.layers), len(shallow.decoder.layers)) == (3, 1)
    with pytest.raises(ValueError, match="N_dec must be 0"):
        tat.get_config("tiny", N_dec=-1)


def test_a_model_with_a_shallower_decoder_decodes_the_same_with_and_without_the_cache():
    torch.manual_seed(0)
    model = tat.make_model(11, 11, tat.MODEL_PRESETS["tiny"], N=3, N_dec=1).eval()
    src = torch.tensor([[0, 5, 6, 7, 8, 1], [0, 9, 4, 1, tat.PAD, tat.PAD]])
    src_mask = tat.padding_mask(src, tat.PAD)
    with torch.no_grad():
        full = tat.greedy_decode(model, src, src_mask, 9, tat.BOS, tat.EOS, tat.PAD)
        cached = tat.greedy_decode_cached(model, src, src_mask, 9, tat.BOS, tat.EOS, tat.PAD)
        beams = [tat.beam_search(model, src, src_mask, 9, tat.BOS, tat.EOS, 3, 0.6, banned=[tat.PAD], cached=c)
                 for c in (True, False)]
    assert torch.equal(full, cached)
    assert beams[0] == beams[1]

"""Decoding as §6.1 describes it: key/value cache, beam search, the length limit, special tokens, attention
maps, greedy decoding, translate, and BLEU."""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import machinery
import the_annotated_transformer as tat
from the_annotated_transformer import BOS, EOS, PAD
from conftest import tiny_data

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def lively_model(seed=3, vocab=16, dtype=torch.float64, **overrides):
    """A random tiny model whose greedy output varies with the source (untied, sharper output layer)."""
    torch.manual_seed(seed)
    model = tat.make_model(
        vocab, vocab, tat.MODEL_PRESETS["tiny"], N=2, tie_weights=False, **overrides
    )
    with torch.no_grad():
        model.generator.proj.weight.mul_(4)
    return model.to(dtype).eval()


def padded_sources(vocab=16, seed=0):
    """Sources ``<s> w … </s>`` of different lengths, padded into one batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 2, 5, 1, 9, 4]
    seqs = [
        [BOS] + torch.randint(4, vocab, (n,), generator=g).tolist() + [EOS]
        for n in lengths
    ]
    return seqs, tat.pad_sequences(seqs)


class TableModel(nn.Module):
    """A stand-in for EncoderDecoder: the next-token distribution is ``probs(prefix)``, set by the test.

    ``prefix`` is the tuple of ids after <s>; the source is ignored. ``decode`` hands each
    position's whole prefix to ``generator`` (as floats, -1 beyond it).
    """

    def __init__(self, probs, vocab):
        super().__init__()
        self.probs, self.vocab = probs, vocab

    def encode(self, src, src_mask):
        return src

    def decode(self, memory, src_mask, ys, tgt_mask):
        batch, length = ys.shape
        out = torch.full((batch, length, length), -1.0, dtype=torch.float64)
        for i in range(length):
            out[:, i, : i + 1] = ys[:, : i + 1]
        return out

    def generator(self, x):
        rows = []
        for feats in x:
            prefix = tuple(int(v) for v in feats if v >= 0)[1:]
            p = torch.as_tensor(self.probs(prefix), dtype=torch.float64)
            assert p.shape == (self.vocab,) and abs(float(p.sum()) - 1) < 1e-9
            rows.append(p)
        return torch.stack(rows).log()


def random_probs(vocab, eos_weight=1.0, seed=0):
    """A fixed random distribution for every prefix (no mass on <s> or <blank>)."""

    def probs(prefix):
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(prefix) % 1_000_003)
        w = torch.rand(vocab, generator=g, dtype=torch.float64) + 0.05
        w[[BOS, PAD]] = 0
        w[EOS] *= eos_weight
        return w / w.sum()

    return probs


def dist(vocab, **p):
    """A distribution from {"t<id>": probability}; every other token gets 0 (the values must sum to 1)."""
    out = torch.zeros(vocab, dtype=torch.float64)
    for k, v in p.items():
        out[int(k[1:])] = v
    return out


# --- the key/value cache ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_greedy_gives_exactly_the_tokens_of_the_full_recompute(
    dtype, fast, norm_first
):
    model = lively_model(
        dtype=dtype, attention="fast" if fast else "readable", norm_first=norm_first
    )
    _, src = padded_sources()
    mask = (src != PAD).unsqueeze(-2)
    full = tat.greedy_decode(model, src, mask, 25, BOS, EOS, PAD)
    cached = tat.greedy_decode(
        model, src, mask, 25, BOS, EOS, PAD, tat.IncrementalDecoder
    )
    assert torch.equal(cached, full), (cached, full)
    assert (
        len({tuple(r) for r in full.tolist()}) > 1
    )  # the outputs differ between sentences


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_each_cached_step_equals_the_last_position_of_a_full_decode(fast, norm_first):
    model = lively_model(
        attention="fast" if fast else "readable", norm_first=norm_first
    )
    _, src = padded_sources()
    mask = (src != PAD).unsqueeze(-2)
    memory = model.encode(src, mask)
    state = tat.IncrementalDecoder(model, memory, mask)
    ys = torch.randint(
        4, 16, (src.size(0), 8), generator=torch.Generator().manual_seed(1)
    )
    ys[:, 0] = BOS
    with torch.no_grad():
        for t in range(ys.size(1)):
            step = state.step(ys[:, t])
            full = model.generator(
                model.decode(memory, mask, ys[:, : t + 1], tat.subsequent_mask(t + 1))
            )[:, -1]
            torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)


def test_incremental_decoder_reorder_follows_the_chosen_rows():
    model = lively_model()
    _, src = padded_sources()
    src = src[:1].expand(3, -1)  # three rows of the same sentence, as in a beam
    mask = (src != PAD).unsqueeze(-2)
    memory = model.encode(src, mask)
    state = tat.IncrementalDecoder(model, memory, mask)
    ys = torch.tensor([[BOS, 5, 6], [BOS, 7, 8], [BOS, 9, 10]])
    with torch.no_grad():
        for t in range(3):
            state.step(ys[:, t])
        state.reorder(torch.tensor([2, 2, 0]))
        step = state.step(torch.tensor([11, 12, 13]))
        new = torch.cat([ys[[2, 2, 0]], torch.tensor([[11], [12], [13]])], dim=1)
        full = model.generator(model.decode(memory, mask, new, tat.subsequent_mask(4)))[
            :, -1
        ]
    torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)


# --- beam search ----------------------------------------------------------------------------


def test_length_penalty_is_gnmt():
    assert tat.length_penalty(1, 0.6) == pytest.approx(1.0)
    assert tat.length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert tat.length_penalty(13, 0.0) == 1.0


@pytest.mark.parametrize("cached", [True, False])
def test_beam_of_one_is_greedy_decoding(cached):
    model = lively_model()
    seqs, src = padded_sources()
    mask = (src != PAD).unsqueeze(-2)
    limits = tat.max_output_tokens(src, 6)
    ys = tat.greedy_decode(
        model, src, mask, 1 + int(limits.max()), BOS, EOS, PAD
    ).tolist()
    greedy = [row[1 : 1 + n] for row, n in zip(ys, limits.tolist())]
    greedy = [row[: row.index(EOS) + 1] if EOS in row else row for row in greedy]
    beam = tat.beam_search(
        model,
        src,
        mask,
        limits,
        BOS,
        EOS,
        beam_size=1,
        alpha=0.0,
        banned=[PAD],
        cached=cached,
    )
    assert beam == greedy


def test_beam_of_one_is_greedy_on_random_distributions_that_end():
    src = torch.full((8, 4), 5)
    for seed in range(4):
        model = TableModel(random_probs(7, eos_weight=3.0, seed=seed), 7)
        ys = tat.greedy_decode(
            model, src, torch.ones(8, 1, 4, dtype=torch.bool), 7, BOS, EOS, PAD
        )[0].tolist()
        greedy = ys[1 : ys.index(EOS) + 1] if EOS in ys else ys[1:]
        beam = tat.beam_search(
            model,
            src[:1],
            torch.ones(1, 1, 4, dtype=torch.bool),
            6,
            BOS,
            EOS,
            1,
            0.0,
            banned=[PAD],
            cached=False,
        )
        assert beam == [greedy]


def test_a_beam_of_one_with_alpha_may_outlive_greedys_end():
    """The notebook's claim: with alpha > 0 a beam of 1 may continue past a finished
    hypothesis and keep the longer one; with alpha = 0 it stops where greedy does."""
    v = 6
    table = {(): dist(v, t1=0.5, t4=0.48, t5=0.02), (4,): dist(v, t1=1.0)}
    model = TableModel(lambda prefix: table.get(prefix, dist(v, t1=1.0)), v)
    src, mask = torch.full((1, 3), 4), torch.ones(1, 1, 3, dtype=torch.bool)
    ys = tat.greedy_decode(model, src, mask, 6, BOS, EOS, PAD)
    assert ys[0].tolist()[:2] == [BOS, EOS]  # greedy ends at once: P = 0.5
    # [4 </s>] has P = 0.48 < 0.5, but log .48 / lp(2) > log .5 / lp(1) for alpha = 1
    assert math.log(0.48) / tat.length_penalty(2, 1.0) > math.log(0.5)
    one = {
        alpha: tat.beam_search(
            model, src, mask, 5, BOS, EOS, 1, alpha, banned=[PAD], cached=False
        )
        for alpha in (0.0, 1.0)
    }
    assert one == {0.0: [[EOS]], 1.0: [[4, EOS]]}


def test_beam_finds_the_sequence_that_greedy_misses():
    v = 6
    table = {
        (): dist(v, t4=0.5, t5=0.4, t1=0.1),  # greedy takes 4 …
        (4,): dist(v, t1=0.3, t4=0.25, t5=0.25, t3=0.2),  # … then </s>: P = 0.15
        (5,): dist(v, t1=0.9, t4=0.1),
    }  # but 5 </s> has P = 0.36
    model = TableModel(lambda prefix: table.get(prefix, dist(v, t1=1.0)), v)
    src, mask = torch.full((1, 3), 4), torch.ones(1, 1, 3, dtype=torch.bool)
    ys = tat.greedy_decode(model, src, mask, 6, BOS, EOS, PAD)
    assert ys[0].tolist()[:3] == [BOS, 4, EOS]
    assert tat.beam_search(
        model, src, mask, 5, BOS, EOS, 2, 0.0, banned=[PAD], cached=False
    ) == [[5, EOS]]
    assert tat.beam_search(
        model, src, mask, 5, BOS, EOS, 1, 0.0, banned=[PAD], cached=False
    ) == [[4, EOS]]


def test_length_penalty_prefers_longer_hypotheses_as_alpha_grows():
    v = 6
    table = {(): dist(v, t1=0.45, t4=0.55), (4,): dist(v, t1=0.7, t5=0.3)}
    model = TableModel(lambda prefix: table.get(prefix, dist(v, t1=1.0)), v)
    src, mask = torch.full((1, 3), 4), torch.ones(1, 1, 3, dtype=torch.bool)
    # log P: [</s>] = log .45 = -0.80 (length 1); [4 </s>] = log .385 = -0.95 (length 2)
    assert tat.beam_search(
        model, src, mask, 5, BOS, EOS, 2, 0.0, banned=[PAD], cached=False
    ) == [[EOS]]
    assert math.log(0.385) / tat.length_penalty(2, 2.0) > math.log(
        0.45
    ) / tat.length_penalty(1, 2.0)
    assert tat.beam_search(
        model, src, mask, 5, BOS, EOS, 2, 2.0, banned=[PAD], cached=False
    ) == [[4, EOS]]


def exhaustive_best(probs, vocab, limit, alpha):
    """Every sequence allowed by the limit: words then </s> (≤ limit in all), or ``limit`` words."""
    words = [t for t in range(vocab) if t not in (BOS, PAD, EOS)]
    best = (-math.inf, None)
    for n in range(limit + 1):
        for body in itertools.product(words, repeat=n):
            seqs = [body + (EOS,)] if n < limit else [body]
            for seq in seqs:
                logp = sum(
                    math.log(float(probs(seq[:i])[tok])) for i, tok in enumerate(seq)
                )
                score = logp / tat.length_penalty(len(seq), alpha)
                best = max(best, (score, list(seq)))
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_wide_beam_finds_the_exhaustive_best(alpha, seed):
    vocab, limit = 6, 3  # words: <unk>, 4, 5 (and </s>)
    probs = random_probs(vocab, eos_weight=0.7, seed=seed)
    score, seq = exhaustive_best(probs, vocab, limit, alpha)
    model = TableModel(probs, vocab)
    src, mask = torch.full((1, 2), 4), torch.ones(1, 1, 2, dtype=torch.bool)
    assert tat.beam_search(
        model, src, mask, limit, BOS, EOS, 27, alpha, banned=[PAD], cached=False
    ) == [seq]


def test_beam_search_does_not_depend_on_batch_composition():
    model = lively_model()
    seqs, src = padded_sources()
    cfg = machinery.get_config("tiny", eval_batch_size=4, max_decode_extra=5)
    vocab = tat.Vocab(list(tat.SPECIALS) + [f"w{i}" for i in range(12)])
    together = machinery.translate(model, seqs, vocab, cfg, CPU, beam_size=3, alpha=0.6)
    for i, s in enumerate(seqs):
        assert machinery.translate(
            model, [s], vocab, cfg, CPU, beam_size=3, alpha=0.6
        ) == [together[i]]
    reordered = machinery.translate(
        model,
        seqs[::-1],
        vocab,
        dataclasses.replace(cfg, eval_batch_size=2),
        CPU,
        beam_size=3,
        alpha=0.6,
    )
    assert reordered == together[::-1]
    assert len({tuple(t) for t in together}) > 1


def test_cached_and_full_recompute_beam_search_agree():
    model = lively_model(attention="fast", norm_first=True)
    _, src = padded_sources()
    mask = (src != PAD).unsqueeze(-2)
    limits = tat.max_output_tokens(src, 5)
    a = tat.beam_search(
        model, src, mask, limits, BOS, EOS, 4, 0.6, banned=[PAD], cached=True
    )
    b = tat.beam_search(
        model, src, mask, limits, BOS, EOS, 4, 0.6, banned=[PAD], cached=False
    )
    assert a == b


# --- the length limit of §6.1 ---------------------------------------------------------------


def never_ending_model():
    model = lively_model()
    with torch.no_grad():
        model.generator.proj.bias[EOS] = -1e4
    return model


@pytest.mark.parametrize(
    "beam_size,cached", [(1, False), (1, True), (4, False), (4, True)]
)
def test_output_is_cut_at_input_length_plus_max_decode_extra(beam_size, cached):
    seqs, _ = padded_sources()
    cfg = machinery.get_config("tiny", eval_batch_size=4, max_decode_extra=3)
    vocab = tat.Vocab(list(tat.SPECIALS) + [f"w{i}" for i in range(12)])
    out = machinery.translate(
        never_ending_model(),
        seqs,
        vocab,
        cfg,
        CPU,
        beam_size=beam_size,
        alpha=0.6,
        cached=cached,
    )
    assert [len(o) for o in out] == [len(s) - 2 + 3 for s in seqs]


def ends_at(step):
    """Ends with </s> as its ``step``-th generated token; before that, word 4 or 5."""
    v = 6
    return TableModel(
        lambda p: dist(v, t1=1.0) if len(p) + 1 == step else dist(v, t4=0.6, t5=0.4), v
    )


@pytest.mark.parametrize("beam_size", [1, 3])
def test_the_end_symbol_counts_toward_the_limit(beam_size):
    cfg = machinery.get_config("tiny", eval_batch_size=1, max_decode_extra=2)
    vocab = tat.Vocab(list(tat.SPECIALS) + ["a", "b"])
    source = [BOS, 4, 5, 4, EOS]  # n = 3: at most 5 tokens after <s>
    at_limit = machinery.translate(
        ends_at(5), [source], vocab, cfg, CPU, beam_size=beam_size, alpha=0.0
    )[0]
    assert len(at_limit) == 4  # 4 words and </s>
    beyond = machinery.translate(
        ends_at(6), [source], vocab, cfg, CPU, beam_size=beam_size, alpha=0.0
    )[0]
    assert len(beyond) == 5  # cut: 5 words, no </s>
    raw = tat.beam_search(
        ends_at(5),
        torch.tensor([source]),
        torch.ones(1, 1, 5, dtype=torch.bool),
        tat.max_output_tokens(torch.tensor([source]), 2),
        BOS,
        EOS,
        beam_size,
        0.0,
        cached=False,
    )
    assert raw[0][-1] == EOS and len(raw[0]) == 5


def test_max_output_tokens_counts_source_words_only():
    src = tat.pad_sequences([[BOS, 4, 5, 6, EOS], [BOS, 7, EOS]])
    assert tat.max_output_tokens(src, 50).tolist() == [53, 51]


# --- special tokens ---------------------------------------------------------------------------


def test_decoders_never_emit_start_or_padding_and_may_emit_unk():
    v = 6
    model = TableModel(
        lambda p: dist(v, t0=0.28, t2=0.2, t3=0.5, t1=0.02)
        if len(p) < 3
        else dist(v, t0=0.5, t2=0.3, t1=0.2),
        v,
    )
    cfg = machinery.get_config("tiny", eval_batch_size=2, max_decode_extra=4)
    vocab = tat.Vocab(list(tat.SPECIALS) + ["a", "b"])
    for beam in (1, 3):
        out = machinery.translate(
            model,
            [[BOS, 4, EOS], [BOS, 4, 5, EOS]],
            vocab,
            cfg,
            CPU,
            beam_size=beam,
            alpha=0.6,
        )
        assert out == [["<unk>"] * 3] * 2, out


@pytest.mark.parametrize("cached", [True, False])
def test_real_model_that_prefers_specials_does_not_emit_them(cached):
    model = lively_model()
    with torch.no_grad():
        model.generator.proj.bias[BOS] = 50.0
        model.generator.proj.bias[PAD] = 40.0
    seqs, src = padded_sources()
    mask = (src != PAD).unsqueeze(-2)
    decoder = tat.IncrementalDecoder if cached else tat.FullRecomputeDecoder
    ys = tat.greedy_decode(model, src, mask, 12, BOS, EOS, PAD, decoder)
    generated = [
        row[1 : row.index(EOS)] if EOS in row else row[1:] for row in ys.tolist()
    ]
    assert all(BOS not in g and PAD not in g for g in generated)
    beams = tat.beam_search(
        model, src, mask, 10, BOS, EOS, 3, 0.6, banned=[PAD], cached=cached
    )
    assert all(BOS not in b and PAD not in b for b in beams)


# --- attention maps -----------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_attention_maps_of_the_fast_path_equal_the_readable_ones(norm_first):
    fast = lively_model(attention="fast", norm_first=norm_first)
    readable = lively_model(attention="readable", norm_first=norm_first)
    readable.load_state_dict(fast.state_dict())
    src, tgt = torch.tensor([BOS, 5, 9, 7, 4, EOS]), torch.tensor([BOS, 6, 8, 11])
    a, b = (
        machinery.attention_maps(fast, src, tgt),
        machinery.attention_maps(readable, src, tgt),
    )
    cfg = tat.MODEL_PRESETS["tiny"]
    shapes = {"encoder": (6, 6), "decoder_self": (4, 4), "decoder_src": (4, 6)}
    for kind, (rows, cols) in shapes.items():
        assert a[kind].shape == (2, cfg.h, rows, cols)
        torch.testing.assert_close(a[kind], b[kind], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            a[kind].sum(-1), torch.ones(2, cfg.h, rows, dtype=torch.float64)
        )
    assert torch.equal(
        a["decoder_self"].triu(1), torch.zeros_like(a["decoder_self"])
    )  # §3.1: no look-ahead
    assert not torch.allclose(a["encoder"][0], a["encoder"][1])  # the layers differ


def test_attention_maps_are_the_weights_the_readable_forward_uses(monkeypatch):
    model = lively_model(attention="readable")
    src, tgt = torch.tensor([BOS, 5, 9, 7, EOS]), torch.tensor([BOS, 6, 8])
    seen = []
    real = tat.attention

    def spy(q, k, v, mask=None, dropout=None):
        out, p = real(q, k, v, mask, dropout)
        seen.append(p[0].clone())
        return out, p

    monkeypatch.setattr(tat, "attention", spy)
    with torch.no_grad():
        model(
            src.view(1, -1),
            tgt.view(1, -1),
            (src != PAD).view(1, 1, -1),
            tat.subsequent_mask(3),
        )
    monkeypatch.undo()
    maps = machinery.attention_maps(model, src, tgt)
    # forward order: encoder layers, then per decoder layer self then source attention
    expected = [
        maps["encoder"][0],
        maps["encoder"][1],
        maps["decoder_self"][0],
        maps["decoder_src"][0],
        maps["decoder_self"][1],
        maps["decoder_src"][1],
    ]
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert not any(
        hasattr(m, "attn") for m in model.modules()
    )  # nothing stashed on the modules


# --- greedy decoding, translate, BLEU -----------------------------------------------------


class ScriptedModel(nn.Module):
    """A stand-in for EncoderDecoder: row i emits 4 + len % 5 … and ``EOS`` once its prefix has ``finish[i]`` ids."""

    def __init__(self, finish, vocab: int = 10):
        super().__init__()
        self.finish, self.vocab = torch.tensor(finish), vocab

    def encode(self, src, src_mask):
        return src

    def decode(self, memory, src_mask, ys, tgt_mask):
        batch, length = ys.shape
        return torch.stack(
            [
                torch.full((batch, length), float(length)),
                torch.arange(batch, dtype=torch.float)
                .unsqueeze(1)
                .expand(batch, length),
            ],
            dim=-1,
        )

    def generator(self, x):
        length, row = x[:, 0].long(), x[:, 1].long()
        token = torch.where(length == self.finish[row], EOS, 4 + length % 5)
        return F.one_hot(token, self.vocab).float().log_softmax(-1)


def test_greedy_decode_pads_after_end_and_stops_when_all_ended():
    src = torch.ones(2, 3, dtype=torch.long)
    mask = torch.ones(2, 1, 3, dtype=torch.bool)
    ys = tat.greedy_decode(
        ScriptedModel([3, 6]),
        src,
        mask,
        max_len=20,
        start_symbol=BOS,
        end_symbol=EOS,
        pad=PAD,
    )
    assert ys.tolist() == [[BOS, 5, 6, EOS, PAD, PAD, PAD], [BOS, 5, 6, 7, 8, 4, EOS]]
    # without ``pad`` the end symbol fills the rest
    ys = tat.greedy_decode(
        ScriptedModel([3, 6]), src, mask, max_len=20, start_symbol=BOS, end_symbol=EOS
    )
    assert ys[0].tolist() == [BOS, 5, 6, EOS, EOS, EOS, EOS]
    # without an end symbol it runs to max_len
    ys = tat.greedy_decode(
        ScriptedModel([3, 6]), src, mask, max_len=9, start_symbol=BOS
    )
    assert ys.shape == (2, 9)


def test_greedy_decode_batched_equals_one_at_a_time():
    torch.manual_seed(0)
    model = tat.make_model(14, 14, machinery.get_config("tiny", N=1)).eval()
    sources = [[BOS, 5, 6, 7, 8, 9, 10, EOS], [BOS, 11, 12, 4, EOS], [BOS, 13, EOS]]
    max_len = 12
    src = tat.pad_sequences(sources)
    batched = tat.greedy_decode(
        model, src, (src != PAD).unsqueeze(-2), max_len, BOS, EOS, PAD
    )
    assert batched.size(0) == len(sources) and batched.size(1) <= max_len
    assert (batched[:, 0] == BOS).all()
    for i, s in enumerate(sources):
        one = torch.tensor([s])
        alone = tat.greedy_decode(
            model, one, (one != PAD).unsqueeze(-2), max_len, BOS, EOS, PAD
        )[0]
        assert alone[0] == BOS
        padded = torch.cat([alone, torch.full((batched.size(1) - len(alone),), PAD)])
        assert torch.equal(batched[i], padded), (i, batched[i].tolist(), alone.tolist())


def test_translate_drops_start_and_everything_from_the_end_symbol():
    cfg = machinery.get_config("tiny", eval_batch_size=1)
    vocab = tiny_data(cfg).tgt_vocab
    out = machinery.translate(
        ScriptedModel([4]),
        [[BOS, 5, EOS], [BOS, 6, 7, EOS]],
        vocab,
        cfg,
        torch.device("cpu"),
    )
    assert out == [vocab.lookup_tokens([5, 6, 7])] * 2 == [["2", "3", "4"]] * 2


def test_translate_does_not_depend_on_batching():
    """Each sentence is decoded as if alone: in order, and at most input length + max_decode_extra long (§6.1)."""
    torch.manual_seed(0)
    cfg = machinery.get_config("tiny", N=1, eval_batch_size=2, max_decode_extra=3)
    vocab = tiny_data(cfg).tgt_vocab
    model = tat.make_model(len(vocab), len(vocab), cfg)
    sources = [
        [BOS, 5, 6, 7, EOS],
        [BOS, 4, EOS],
        [BOS, 8, 9, 10, 11, 12, 13, EOS],
        [BOS, 9, EOS],
    ]
    out = machinery.translate(model, sources, vocab, cfg, torch.device("cpu"))
    assert len(out) == len(sources)
    for s, toks in zip(sources, out):
        alone = machinery.translate(model, [s], vocab, cfg, torch.device("cpu"))[0]
        assert len(alone) <= len(s) + cfg.max_decode_extra - 1
        assert toks == alone, (s, toks, alone)


def test_translate_decodes_the_model_it_is_given_in_eval_mode():
    """translate takes the model as given (no unwrapping): it moves it to the device and switches off dropout."""
    seqs, _ = padded_sources()
    cfg = machinery.get_config("tiny", eval_batch_size=4, max_decode_extra=5)
    vocab = tat.Vocab(list(tat.SPECIALS) + [f"w{i}" for i in range(12)])
    reference = machinery.translate(
        lively_model(dtype=torch.float32, P_drop=0.5).eval(), seqs, vocab, cfg, CPU
    )
    model = lively_model(dtype=torch.float32, P_drop=0.5).train()
    assert machinery.translate(model, seqs, vocab, cfg, CPU) == reference
    assert not model.training and {p.device.type for p in model.parameters()} == {"cpu"}
    for cached in (False, True):
        assert (
            machinery.translate(model, seqs, vocab, cfg, CPU, cached=cached)
            == reference
        )


def test_bleu_of_exact_copies_is_100():
    copy = machinery.CORPORA["copy"]
    refs = ["1 2 3 4 5 6", "7 8 9 10 1 2"]
    assert tat.bleu(
        tat.detokenize([r.split() for r in refs], copy), refs, copy
    ).score == pytest.approx(100.0)
    assert tat.bleu(["1 2 3", "4 5 6"], refs, copy).score < 50


def test_tokenized_iwslt_scoring_does_not_warn_about_tokenized_text(caplog):
    # IWSLT14 is scored on tokenized text on purpose; sacreBLEU would otherwise warn after
    # 100 lines ending in " ." that the text looks tokenized.
    lines = [f"this is line {i} ." for i in range(120)]
    with caplog.at_level("WARNING", logger="sacrebleu"):
        result = tat.bleu(lines, lines, machinery.CORPORA["iwslt14"])
        assert result.score == pytest.approx(100.0) and "tok:none" in result.signature
    assert not [r for r in caplog.records if "detokenize" in r.getMessage()]
    with caplog.at_level(
        "WARNING", logger="sacrebleu"
    ):  # the same text scored as Multi30k does warn
        tat.bleu(lines, lines, machinery.CORPORA["multi30k"])
    assert [r for r in caplog.records if "detokenize" in r.getMessage()]

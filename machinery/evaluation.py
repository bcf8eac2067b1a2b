"""Scoring a model: the validation loss after every epoch (Table 3's perplexity) and the
test set's BLEU at the end of a run (§6.1).

`evaluate_loss` is the notebook's `loss_sum` without label smoothing, over the
validation pairs, so that its exponential is the perplexity; `evaluate_test` decodes the
test set with `translate` (greedy, then §6.1's beam search), optionally from the average
of the last checkpoints, and scores it with the notebook's `bleu`. `train`
(`training.py`) calls both.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from .config import Config
from .data import CORPORA, Dataset
from .devices import on_device, unwrap
from .parts import notebook
from .runfiles import average_checkpoints, checkpoint_paths
from .translation import translate


# ### Validation
#
# After every epoch: the mean cross-entropy per target token on the validation split,
# without label smoothing, so that $e^{\text{loss}}$ is the perplexity.


@torch.no_grad()
def evaluate_loss(model: nn.Module, pairs: Sequence, cfg: Config, device) -> float:
    """Mean cross-entropy per target token (no label smoothing) on ``pairs``."""
    nb = notebook()
    model.eval()
    total, ntokens = 0.0, 0
    lengths = [(len(s), len(t)) for s, t in pairs]
    for idx in nb.length_batches(lengths, cfg.batch_tokens, shuffle=False):
        b = nb.make_batch(pairs, idx).to(device)
        out = model(b.src, b.tgt, b.src_mask, b.tgt_mask)
        total += float(nb.loss_sum(unwrap(model).generator(out), b.tgt_y, 0.0))
        ntokens += b.ntokens
    return total / max(ntokens, 1)


# At the end of training the test set is translated twice — greedy, and with beam search
# (§6.1) — optionally with the last checkpoints averaged, and scored.
# The beam's translations are written beside the run's results, one a line, and their
# SHA-256 recorded with the score (our addition).
TEST_HYPOTHESES = "test-hypotheses.txt"


def evaluate_test(
    model: nn.Module,
    data: Dataset,
    cfg: Config,
    device,
    run_dir: Optional[Path] = None,
    log: Callable = print,
    progress: bool = True,
) -> dict:
    """Decode the test set greedily and with beam search (§6.1), optionally averaging
    the last checkpoints; BLEU.

    ``bleu`` is the beam-search score (``cfg.beam_size``, ``cfg.length_penalty_alpha``),
    ``bleu_greedy`` the greedy one. With ``run_dir``, the beam's translations are
    written to ``run_dir / TEST_HYPOTHESES`` and ``hypotheses_sha256`` names them.
    """
    nb = notebook()
    model = unwrap(model)
    if cfg.average_last > 1 and run_dir is not None:
        paths = checkpoint_paths(run_dir)[-cfg.average_last :]
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
    greedy_hyps = nb.detokenize(
        translate(model, sources, data.tgt_vocab, cfg, device, progress=progress),
        CORPORA[data.name],
        data.subwords,
    )
    score_greedy = nb.bleu(greedy_hyps, refs, CORPORA[data.name]).score
    log(
        f"test BLEU ({kind}, sacreBLEU, greedy, {len(test):,} sentences): "
        f"{score_greedy:.2f}"
    )
    t1 = time.time()
    tokens = translate(
        model,
        sources,
        data.tgt_vocab,
        cfg,
        device,
        progress=progress,
        beam_size=cfg.beam_size,
        alpha=cfg.length_penalty_alpha,
    )
    hyps = nb.detokenize(tokens, CORPORA[data.name], data.subwords)
    score = nb.bleu(hyps, refs, CORPORA[data.name]).score
    kept = {}
    if run_dir is not None:  # the sentences scored, so the score can be checked
        from .inference import write_hypotheses

        path = Path(run_dir) / TEST_HYPOTHESES
        kept = {
            "hypotheses": path.name,
            "hypotheses_sha256": write_hypotheses(path, hyps),
        }
    unk_share = sum(t == nb.SPECIALS[nb.UNK] for toks in tokens for t in toks) / max(
        sum(map(len, tokens)), 1
    )
    log(
        f"test BLEU ({kind}, sacreBLEU, beam {cfg.beam_size}, alpha "
        f"{cfg.length_penalty_alpha}, "
        f"{len(test):,} sentences): {score:.2f}; <unk> in {unk_share:.2%} of output "
        "tokens"
    )
    examples = []
    for i in range(min(cfg.examples_to_show, len(test))):
        pieces = data.src_vocab.lookup_tokens(test[i][0][1:-1])
        src = data.subwords.decode([pieces])[0] if data.subwords else " ".join(pieces)
        examples.append({"source": src, "reference": refs[i], "output": hyps[i]})
        log(f"  source:    {src}\n  reference: {refs[i]}\n  output:    {hyps[i]}")
    return {
        "bleu": score,
        "bleu_greedy": score_greedy,
        "bleu_kind": kind,
        "unk_share": unk_share,
        "beam_size": cfg.beam_size,
        "length_penalty_alpha": cfg.length_penalty_alpha,
        "test_sentences": len(test),
        "decode_minutes": (time.time() - t0) / 60,
        "decode_minutes_greedy": (t1 - t0) / 60,
        "examples": examples,
        **kept,
    }

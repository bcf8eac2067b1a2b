r"""The test that reads Table 3 (§6.2) at our scale: is a variation different from the
base, by validation BLEU and by validation perplexity? (our addition)

Rows of one seed see the same batches (and, where shapes match, the same initial
weights), so runs are compared seed by seed: every finished run that trained is one
observation of a two-way model with no interaction,

    y[v, s] = μ[v] + β[s] + ε,   ε ~ N(0, σ²) independent,

fitted by least squares over all variations (the base and the learning-rate controls
included), with y = validation BLEU, or y = ln(validation perplexity) (the validation
loss, on which seeds spread evenly whatever the level). σ² is the residual mean
square on n − rank(X) degrees of freedom. A variation's difference from the base is
the contrast Δ = μ[v] − μ[base]; its standard error, σ·√(c'(X'X)⁺c), follows from the
seeds each row has, so one seed against three is judged by its own error, not by a
fixed multiple of σ. Then

* t = Δ/se with the residual degrees of freedom; two-sided p; 95% interval
  Δ ± t(0.975)·se;
* Holm's step-down correction over the paper's variations (the controls are not in
  the family): the variation of k-th smallest p among m is tested at 0.05/(m−k+1),
  and the first one not rejected stops the rejections; the family-wise error rate is
  at most 5% (tests/test_table3.py checks it on simulated tables);
* the smallest true difference the test detects with probability 0.8 at the level it
  was given, from the noncentral t (about (t(1−α/2) + t(0.8))·se) — what "no
  difference detected" can rule out.

The model's one assumption is a common σ: every variation's seeds spread alike. It is
checked before the fit, per measure, on the one quantity that needs no μ: under the
model each variation's seed difference d[v] = y[v, 2] − y[v, 1] is an independent draw
of N(β[2] − β[1], 2σ²). Grubbs's two-sided test for one outlier among the d[v] (its
critical value from t with k − 2 degrees of freedom at α/2k, k the variations with
both seeds) sets apart a variation whose seeds lie further apart than a common σ
allows (at 1%), and is repeated on the rest while it rejects. When every σ is equal
the first step rejects with probability at most 1%, so no variation is set apart in
at least 99% of tables (tests/test_table3.py checks this too). A variation set apart
leaves the fit and σ, and any comparison that involves it is a paired t-test on the
seeds both rows have: D[s] = y[v, s] − y[against, s] (the seed effect cancels), t on
n − 1 degrees of freedom from the D's own spread, not from the pooled σ;
with two seeds it has one degree of freedom and detects only a very large
difference. Its p joins the same Holm family.

Words: a difference the test finds "agrees" when it has the sign of the paper's own
difference and "disagrees" otherwise (or where the paper's difference is within its
table's rounding, which reads as no change); a difference not found is "no difference
detected (the test would see ≥ X)", never agreement. Qualifiers follow: "one seed",
"still learning at the end of its schedule", "a seed failed to train"; a variation
with either of the last two is not counted as agreeing.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
from scipy import stats as sp
from scipy.integrate import quad
from scipy.optimize import brentq

ALPHA = 0.05  # the family-wise error rate of each measure's tests
POWER = 0.8  # the power at which the detectable difference is stated
NEAR = 0.2  # a third seed where |Δ| lies within 20% of the threshold
# The check of the common σ sets a variation apart at 1%: removing the row whose
# seeds lie furthest apart leaves σ̂ low, so a check that fired often on tables with
# one σ would raise every other test's error rate (at 5% it fires in 4.8% of them
# and single tests reject 5.5%; at 1%, 5.2%).
CHECK_ALPHA = 0.01
# The paper's Table 3 gives BLEU to 0.1 and perplexity to 0.01: a difference of one
# step of that rounding (E's 25.7 against the base's 25.8) is read as no change.
PAPER_NO_CHANGE = {"bleu": 0.1, "ppl": 0.01}
PAPER_BASE = {"bleu": 25.8, "ppl": 4.92}
MEASURES = ("bleu", "ppl")


def observation(row: dict, measure: str) -> float:
    """The value the test reads of one run: validation BLEU, or the natural log of
    validation perplexity."""
    if measure == "bleu":
        return float(row["valid_bleu"])
    return math.log(float(row["valid_ppl"]))


def design(cells: list[tuple[str, int]]) -> tuple[np.ndarray, list[str]]:
    """The design matrix of y[v, s] = μ[v] + β[s] for runs ``cells`` (variation,
    seed): a column per variation, one per seed after the first; and the names."""
    names = sorted({v for v, _ in cells})
    seeds = sorted({s for _, s in cells})[1:]  # the first seed is the reference
    X = np.zeros((len(cells), len(names) + len(seeds)))
    for i, (v, s) in enumerate(cells):
        X[i, names.index(v)] = 1.0
        if s in seeds:
            X[i, len(names) + seeds.index(s)] = 1.0
    return X, names


def fit(runs: list[tuple[str, int, float]]) -> Optional[dict]:
    """Least squares of y[v, s] = μ[v] + β[s] over ``runs`` (variation, seed, y):
    the estimates, the pseudo-inverse of X'X, σ and the residual degrees of freedom
    (None where no degree of freedom is left)."""
    X, names = design([(v, s) for v, s, _ in runs])
    y = np.array([value for _, _, value in runs], dtype=float)
    dof = len(runs) - int(np.linalg.matrix_rank(X))
    if dof < 1:
        return None
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    residual = y - X @ theta
    return {
        "names": names,
        "theta": theta,
        "cov": np.linalg.pinv(X.T @ X),
        "sigma": math.sqrt(float(residual @ residual) / dof),
        "dof": int(dof),
    }


def contrast(model: dict, variation: str, against: str = "base") -> dict:
    """Δ = μ[variation] − μ[against], its standard error, t and two-sided p."""
    c = np.zeros(len(model["theta"]))
    c[model["names"].index(variation)] = 1.0
    c[model["names"].index(against)] = -1.0
    delta = float(c @ model["theta"])
    se = model["sigma"] * math.sqrt(max(float(c @ model["cov"] @ c), 0.0))
    t, p = t_test(delta, se, model["dof"])
    return {"delta": delta, "se": se, "t": t, "p": p, "dof": model["dof"]}


def t_test(delta: float, se: float, dof: int) -> tuple[float, float]:
    """t = Δ/se and its two-sided p on ``dof`` degrees of freedom; where the fit
    leaves no spread at all (se = 0), p = 1 for Δ = 0 and 0 otherwise."""
    if se > 0:
        t = delta / se
        return t, float(2 * sp.t.sf(abs(t), dof))
    return (0.0, 1.0) if delta == 0 else (math.copysign(math.inf, delta), 0.0)


def seed_differences(values: dict[str, dict[int, float]]) -> dict[str, float]:
    """Per variation with seeds 1 and 2 (``values``: variation → seed → y): the
    difference y[v, 2] − y[v, 1], which the model draws from N(β[2] − β[1], 2σ²)
    whatever the variation's μ."""
    return {v: ys[2] - ys[1] for v, ys in values.items() if 1 in ys and 2 in ys}


def grubbs_critical(k: int, alpha: float = CHECK_ALPHA) -> float:
    """The two-sided critical value of Grubbs's statistic max|d − d̄|/s among ``k``
    normal values: ((k−1)/√k)·√(t²/(k−2+t²)), t = t(1 − α/2k) on k − 2 degrees of
    freedom."""
    t = float(sp.t.ppf(1 - alpha / (2 * k), k - 2))
    return (k - 1) / math.sqrt(k) * math.sqrt(t * t / (k - 2 + t * t))


def grubbs_p(g: float, k: int) -> float:
    """The p-value of Grubbs's two-sided statistic ``g`` among ``k`` values (the
    bound 2k·P(T > t) that its critical value inverts, at most 1)."""
    top = (k - 1) ** 2 - k * g * g
    if top <= 0:
        return 0.0
    t = math.sqrt(k * (k - 2) * g * g / top)
    return min(1.0, float(2 * k * sp.t.sf(t, k - 2)))


def spread_apart(
    values: dict[str, dict[int, float]], alpha: float = CHECK_ALPHA
) -> list[dict]:
    """The check of the model's common σ (see the module's note): Grubbs's test on
    the seed differences, repeated on the rest while it rejects. Each step: the
    variation furthest from the mean difference, its difference, G, the critical
    value, p (an upper bound), k and whether it is set apart (``apart``). It reads
    seeds 1 and 2 only, so a variation set apart stays apart when a third seed
    comes (its paired test gains a degree of freedom); with fewer than three
    variations holding both seeds there is nothing to compare and no step."""
    d, steps = seed_differences(values), []
    while len(d) >= 3:
        k = len(d)
        mean = sum(d.values()) / k
        sd = math.sqrt(sum((x - mean) ** 2 for x in d.values()) / (k - 1))
        if sd == 0:
            break
        v = max(sorted(d), key=lambda name: abs(d[name] - mean))
        g = abs(d[v] - mean) / sd
        cut = grubbs_critical(k, alpha)
        step = {"variation": v, "difference": d[v], "mean": mean, "G": g}
        steps.append(step | {"critical": cut, "p": grubbs_p(g, k), "k": k})
        steps[-1]["apart"] = g > cut
        if g <= cut:
            break
        del d[v]
    return steps


def paired_contrast(
    values: dict[str, dict[int, float]], variation: str, against: str = "base"
) -> Optional[dict]:
    """Δ, its standard error, t, p and degrees of freedom of a paired t-test over
    the seeds both rows have, D[s] = y[variation, s] − y[against, s] (the pooled σ
    not used); None where they share fewer than two seeds."""
    common = sorted(set(values[variation]) & set(values[against]))
    if len(common) < 2:
        return None
    diffs = [values[variation][s] - values[against][s] for s in common]
    n = len(diffs)
    delta = sum(diffs) / n
    se = math.sqrt(sum((x - delta) ** 2 for x in diffs) / (n - 1) / n)
    t, p = t_test(delta, se, n - 1)
    return {"delta": delta, "se": se, "t": t, "p": p, "dof": n - 1, "seeds": common}


def comparisons(
    values: dict[str, dict[int, float]], pairs: list[tuple[str, str]]
) -> tuple[dict[tuple[str, str], dict], list[dict]]:
    """Each (variation, against) of ``pairs`` compared: by the seed-blocked fit of
    every variation whose seeds the check leaves together, or by a paired t-test
    where either is set apart (see the module's note); a pair that cannot be
    compared is left out. Also the check's steps."""
    steps = spread_apart(values)
    apart = {s["variation"] for s in steps if s["apart"]}
    together = [
        (v, seed, y)
        for v, ys in values.items()
        if v not in apart
        for seed, y in ys.items()
    ]
    model = fit(together) if together else None
    out = {}
    for v, against in pairs:
        if v in apart or against in apart:
            c = paired_contrast(values, v, against)
        elif model is not None:
            c = contrast(model, v, against)
        else:
            c = None
        if c is not None:
            out[(v, against)] = c | {"apart": bool({v, against} & apart)}
    return out, steps


def holm_levels(p_values: dict[str, float], alpha: float = ALPHA) -> dict[str, dict]:
    """Holm's step-down procedure: per name, the level it was tested at and whether
    it is rejected (family-wise error rate ≤ ``alpha``)."""
    order = sorted(p_values, key=lambda k: p_values[k])
    m, still, out = len(order), True, {}
    for k, name in enumerate(order):
        level = alpha / (m - k)
        still = still and p_values[name] <= level
        out[name] = {"level": level, "rejected": still}
    return out


def critical(level: float, dof: int) -> float:
    """The two-sided t cut-off at ``level``."""
    return float(sp.t.ppf(1 - level / 2, dof))


def detectable(se: float, level: float, dof: int, power: float = POWER) -> float:
    """The smallest true difference detected with probability ``power`` at
    ``level``: se times the root of :func:`power_at` in units of se (the usual
    approximation, (t(1−level/2) + t(power))·se, falls short of it: by 1–2% on 15
    degrees of freedom, by a fifth on one)."""
    return se * _detectable_shift(level, dof, power) if se > 0 else 0.0


@functools.lru_cache(maxsize=None)
def _detectable_shift(level: float, dof: int, power: float) -> float:
    """The true difference, in standard errors, that the test at ``level`` on
    ``dof`` degrees of freedom detects with probability ``power``."""
    guess = critical(level, dof) + float(sp.t.ppf(power, dof))
    high = guess
    while power_at(high, 1.0, level, dof) < power:
        high *= 1.5
    return float(brentq(lambda d: power_at(d, 1.0, level, dof) - power, 0.0, high))


def power_at(delta: float, se: float, level: float, dof: int) -> float:
    r"""The probability that the two-sided t-test at ``level`` detects a true
    difference ``delta`` whose estimate has standard error ``se``: with
    T = (Z + δ)/√(V/ν), δ = Δ/se, V ~ χ²(ν), the power
    E_V[Φ(δ − c√(V/ν)) + Φ(−δ − c√(V/ν))]: the noncentral t's two tails, or, where
    scipy's routine for them gives NaN (far out), the same integrated over V."""
    if se <= 0:
        return 1.0
    cut, shift = critical(level, dof), abs(delta) / se
    tail = float(sp.nct.sf(cut, dof, shift) + sp.nct.cdf(-cut, dof, shift))
    if math.isfinite(tail):
        return tail

    def tails(v: float) -> float:
        c = cut * math.sqrt(v / dof)
        return (sp.norm.sf(c - shift) + sp.norm.cdf(-c - shift)) * sp.chi2.pdf(v, dof)

    total = quad(tails, 0, dof, limit=200)[0] + quad(tails, dof, math.inf, limit=200)[0]
    return float(min(1.0, max(0.0, total)))


def paper_difference(paper: dict, measure: str) -> float:
    """The paper's own difference from its base (dev BLEU or dev perplexity)."""
    key = "bleu_dev" if measure == "bleu" else "ppl_dev"
    return round(paper[key] - PAPER_BASE[measure], 2)


def sign_word(ours: float, theirs: float, measure: str) -> str:
    """ "agrees" or "disagrees" for a difference the test found."""
    if abs(theirs) <= PAPER_NO_CHANGE[measure] + 1e-9:
        return "disagrees"  # the paper saw no change
    return "agrees" if (ours > 0) == (theirs > 0) else "disagrees"


def test_table(
    runs: dict[str, list[tuple[int, dict]]],
    paper: dict[str, dict],
    controls: dict[str, str],
    measure: str,
    alpha: float = ALPHA,
) -> dict[str, dict]:
    """The test of every variation against the base for one measure.

    ``runs``: per variation, its trained seeds as (seed, record); ``paper``: per
    paper variation, the paper's row; ``controls``: per control, the variation it
    holds Eq. 3's rate apart from. Returns per variation Δ (BLEU points, or the
    ratio of perplexities − 1), its 95% interval, p, Holm's level and decision, the
    threshold |Δ| at that level, the detectable difference, and (paper variations)
    the word; a comparison paired because the check set a row apart says so
    (``apart``, with the check's step). A control gets its difference from the
    variation it controls (from the base where that variation is not in ``runs``,
    or where one of the two is set apart and they share fewer than two seeds) and,
    where the base can be compared with it, from the base (``vs_base``). A
    variation that cannot be compared with the base (a row set apart, and fewer than
    two seeds shared) gets no entry."""
    if "base" not in runs:
        return {}
    values = {
        v: {seed: observation(r, measure) for seed, r in rs} for v, rs in runs.items()
    }
    against = {
        v: (c if c in runs else "base") for v, c in controls.items() if v in runs
    }
    pairs = [(v, "base") for v in runs if v != "base" and v in paper]
    pairs += [(v, a) for v, a in against.items()]
    pairs += [(v, "base") for v, a in against.items() if a != "base"]
    found, steps = comparisons(values, pairs)
    check = {s["variation"]: s for s in steps if s["apart"]}
    tested = {v: found[(v, "base")] for v in paper if (v, "base") in found}
    holm = holm_levels({v: c["p"] for v, c in tested.items()}, alpha)
    out = {}
    for v, c in tested.items():
        level, dof = holm[v]["level"], c["dof"]
        half = critical(0.05, dof) * c["se"]
        theirs = paper_difference(paper[v], measure)
        entry = {
            "delta": c["delta"],
            "interval": [c["delta"] - half, c["delta"] + half],
            "p": c["p"],
            "holm_level": level,
            "differs": holm[v]["rejected"],
            "threshold": critical(level, dof) * c["se"],
            "detectable": detectable(c["se"], level, dof),
            "se": c["se"],
            "dof": dof,
            "paper_delta": theirs,
        }
        entry["near_threshold"] = (
            abs(abs(entry["delta"]) - entry["threshold"]) <= NEAR * entry["threshold"]
        )
        entry["word"] = (
            sign_word(c["delta"], theirs, measure)
            if entry["differs"]
            else "no difference detected"
        )
        out[v] = entry | apart_record(c, check, (v, "base")) | shown(entry, measure)
    for v, a in against.items():
        if (v, a) not in found:  # its width set apart and too few seeds shared
            a = "base"
        if (v, a) not in found:
            continue
        c = found[(v, a)]
        half = critical(0.05, c["dof"]) * c["se"]
        entry = {
            "against": a,
            "delta": c["delta"],
            "interval": [c["delta"] - half, c["delta"] + half],
            "p": c["p"],
            "se": c["se"],
            "dof": c["dof"],
        }
        if (v, "base") in found:  # and from the base, at its own peak rate
            b = found[(v, "base")]
            reach = critical(0.05, b["dof"]) * b["se"]
            base = {"delta": b["delta"], "p": b["p"], "se": b["se"], "dof": b["dof"]}
            base["interval"] = [b["delta"] - reach, b["delta"] + reach]
            entry["vs_base"] = base | shown(base, measure)
        out[v] = entry | apart_record(c, check, (v, a)) | shown(entry, measure)
    return out


def apart_record(c: dict, check: dict[str, dict], rows: tuple[str, str]) -> dict:
    """What a comparison of ``rows`` records of the check of σ: nothing where the fit
    made it, else that it was paired on the seeds both rows have, and the check's
    step that set either row apart."""
    if not c["apart"]:
        return {}
    return {
        "apart": True,
        "paired_seeds": c["seeds"],
        "spread_check": [check[n] for n in rows if n in check],
    }


def shown(entry: dict, measure: str) -> dict:
    """Δ and its interval as a reader sees them: BLEU points, or for perplexity the
    percentage change (exp of the log-scale difference, minus one)."""
    if measure == "bleu":
        return {}
    pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
    out = {
        "delta_pct": pct(entry["delta"]),
        "interval_pct": [pct(x) for x in entry["interval"]],
    }
    if "detectable" in entry:
        out["detectable_pct"] = pct(entry["detectable"])
    return out


def simulate_false_positives(
    tables: int,
    seeds: dict[str, int],
    sigma: float = 0.6,
    seed_effect: float = 0.9,
    rng: Optional[np.random.Generator] = None,
    noisier: Optional[dict[str, float]] = None,
) -> dict:
    """Tables with no true effect (every variation equal to the base), seeds per
    variation as ``seeds``, each run's noise σ (times ``noisier[v]`` for the
    variations named there), read as the file is read (the check of σ, then the
    tests): the share of single tests at 5% that reject, the share of tables in
    which Holm rejects any, and the share in which the check sets any variation
    apart — the test's false-positive rates."""
    rng = rng or np.random.default_rng(0)
    noisier = noisier or {}
    single = family = comparisons_made = apart = 0
    others = [v for v in seeds if v != "base"]
    for _ in range(tables):
        shift = rng.normal(0, seed_effect, size=max(seeds.values()) + 1)
        values = {
            v: {
                s: 40.0 + shift[s] + rng.normal(0, sigma * noisier.get(v, 1.0))
                for s in range(1, n + 1)
            }
            for v, n in seeds.items()
        }
        found, steps = comparisons(values, [(v, "base") for v in others])
        ps = {v: c["p"] for (v, _), c in found.items()}
        single += sum(p <= ALPHA for p in ps.values())
        comparisons_made += len(ps)
        family += any(h["rejected"] for h in holm_levels(ps).values())
        apart += any(step["apart"] for step in steps)
    return {
        "single": single / comparisons_made,
        "family": family / tables,
        "apart": apart / tables,
    }


def design_power(
    delta: float, variation_seeds: int, sigma: float, seeds: dict[str, int]
) -> float:
    """The power of one variation's test (at 5%, before Holm) against a true
    difference ``delta`` when it has ``variation_seeds`` seeds, the rest of the
    table ``seeds`` and the residual deviation ``sigma``: read from the design alone
    (the contrast's standard error is σ·√(c'(X'X)⁺c), whatever the observations)."""
    table = dict(seeds) | {"v": variation_seeds}
    X, names = design([(v, s) for v, n in table.items() for s in range(1, n + 1)])
    dof = X.shape[0] - int(np.linalg.matrix_rank(X))
    c = np.zeros(X.shape[1])
    c[names.index("v")], c[names.index("base")] = 1.0, -1.0
    se = sigma * math.sqrt(float(c @ np.linalg.pinv(X.T @ X) @ c))
    return power_at(delta, se, ALPHA, dof)


# The sentence-level test: one seed's variation against the same seed's base on the
# same validation sentences, by sacreBLEU's approximate randomization: each trial
# swaps the two systems' translations of each sentence with probability one half and
# recomputes both corpus BLEU scores; p = (1 + trials whose |difference| exceeds the
# one seen) / (1 + trials). It asks a narrower question than the seed-blocked test
# above: whether these two trained models translate these sentences differently, not
# whether another seed would.
PAIRED_TRIALS = 10_000
PAIRED_SEED = 12345  # sacreBLEU's own default seed for its paired tests


def paired_bleu_test(
    base: list[str],
    variation: list[str],
    references: list[str],
    tokenize: str = "13a",
    trials: int = PAIRED_TRIALS,
) -> dict:
    """Paired approximate randomization (sacreBLEU's ``PairedTest``, ``ar``) of a
    variation's translations against the base's, sentence by sentence, for corpus
    BLEU (§6.1's metric): {"base", "variation", "delta", "p", "trials", "sentences",
    "test"}."""
    import os

    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not (len(base) == len(variation) == len(references)) or not references:
        raise ValueError(
            f"a paired test needs as many translations as references: {len(base)}, "
            f"{len(variation)} and {len(references)}"
        )
    metric = BLEU(tokenize=tokenize, force=tokenize == "none")
    if list(base) == list(variation):  # sacreBLEU's count would give p = 1/(1+trials)
        score = metric.corpus_score(list(base), [list(references)]).score
        return paired_result(score, score, 1.0, trials, len(references), tokenize)
    seed = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(PAIRED_SEED)  # read by PairedTest itself
    try:
        test = PairedTest(
            [("base", list(base)), ("variation", list(variation))],
            {"BLEU": metric},
            [list(references)],
            test_type="ar",
            n_samples=trials,
        )
        _, scores = test()
    finally:
        if seed is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = seed
    ours, theirs = scores["BLEU"][1], scores["BLEU"][0]
    return paired_result(
        theirs.score, ours.score, float(ours.p_value), trials, len(references), tokenize
    )


def paired_result(
    base: float, variation: float, p: float, trials: int, sentences: int, tokenize: str
) -> dict:
    """The record of one paired sentence-level test (see :func:`paired_bleu_test`)."""
    return {
        "base": base,
        "variation": variation,
        "delta": variation - base,
        "p": p,
        "trials": trials,
        "sentences": sentences,
        "test": f"sacreBLEU paired approximate randomization, {trials:,} trials, "
        f"seed {PAIRED_SEED}, tokenize {tokenize}",
    }

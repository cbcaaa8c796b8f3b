"""The statistics beside every verdict of the committed studies (chapters 4a and 7).

Runs of two variants with the same seed share their initialization of the common weights and
see the same batches (:func:`normtools.lab.grid.run_cell`), so variants are compared **paired by
seed**: d_s = m(arm, s) − m(baseline, s) for each seed s present in both, and

* the effect is the mean difference d̄ = (1/n) Σ_s d_s;
* its confidence interval is the percentile bootstrap of d̄ over the pairs
  (:func:`paired_bootstrap_ci`: resample the n pairs with replacement, take the
  (1−c)/2 and (1+c)/2 quantiles of the resampled means);
* the p-value is the exact two-sided sign test (:func:`sign_test_p`), the p-value of the
  criterion "lower (or higher) in k of n seeds": "lower in every one of 3 seeds" is p = 1/4
  two-sided (1/8 one-sided);
* a verdict ("lower", "higher") needs the interval to exclude zero **and** the sign test's
  p ≤ 1 − confidence (the percentile bootstrap of 3 pairs of one sign excludes zero, but 3 pairs
  can never give p < 0.25); otherwise it is "not shown", printed with the minimum detectable
  effect (:func:`minimum_detectable_effect`).

Quantities that grow by orders of magnitude (peak attention logits) are compared as log10
ratios (``log=True``): the effect is then the mean of log10(arm/baseline).

One failure criterion for both chapters, :func:`run_outcome`: a run *diverged* (non-finite loss),
*stalled* (final loss within ``stall_margin`` nats of the byte-unigram loss,
:func:`normtools.lab.train.byte_unigram_loss`), or *trained*.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

#: The statistics' settings, fixed before a study runs and recorded in its JSON
#: (:class:`normtools.lab.studies.Study`): confidence level, bootstrap resamples and seed, the
#: power of the minimum detectable effect, and the failure criterion's margin in nats.
DEFAULT_THRESHOLDS = {"confidence": 0.95, "bootstrap_resamples": 10_000, "bootstrap_seed": 0,
                      "power": 0.8, "stall_margin_nats": 0.05}

OUTCOMES = ("trained", "stalled", "diverged")


def paired_bootstrap_ci(differences, confidence: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired ``differences``: the (1−c)/2 and
    (1+c)/2 quantiles of the means of ``resamples`` resamples (with replacement, n of n)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size < 2 or not np.all(np.isfinite(d)):
        raise ValueError(f"need at least 2 finite paired differences, got {d}")
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError(f"confidence must be in (0, 1) and resamples ≥ 1, got {confidence}, {resamples}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def sign_test_p(differences) -> float:
    """Exact two-sided sign test: with k of the n non-zero differences positive,
    p = min(1, 2 · Σ_{i ≤ min(k, n−k)} C(n, i) / 2ⁿ) (zero differences are dropped; no
    non-zero difference gives p = 1)."""
    d = np.asarray(differences, dtype=np.float64)
    d = d[d != 0]
    n = int(d.size)
    if n == 0:
        return 1.0
    k = int(min((d > 0).sum(), (d < 0).sum()))
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def minimum_detectable_effect(differences, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest mean difference that n pairs with the observed spread would detect:
    (z_{(1+c)/2} + z_{power}) · s / √n, s the sample standard deviation (ddof 1) of the
    differences (a normal approximation)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2:
        raise ValueError("need at least 2 paired differences")
    z = NormalDist().inv_cdf((1 + confidence) / 2) + NormalDist().inv_cdf(power)
    return float(z * d.std(ddof=1) / math.sqrt(d.size))


def compare_paired(baseline, arm, *, log: bool = False, thresholds: dict | None = None) -> dict:
    """The paired comparison of ``arm`` against ``baseline`` (two equal-length sequences, one
    value per seed, same seed order): n, effect (mean of arm − baseline, or of
    log10(arm/baseline) with ``log``), ci_low, ci_high (:func:`paired_bootstrap_ci`), p_sign
    (:func:`sign_test_p`), mde (:func:`minimum_detectable_effect`), and ``verdict``: "lower" or
    "higher" when the interval excludes 0 and p_sign ≤ 1 − confidence, else "not shown"."""
    t = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(arm, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"baseline and arm must pair up, got {a.shape} and {b.shape}")
    d = np.log10(b / a) if log else b - a
    if d.size < 2:   # one pair (a size="gpu" run of one seed): no interval, no verdict
        return {"n": int(d.size), "effect": float(d.mean()) if d.size else math.nan,
                "ci_low": math.nan, "ci_high": math.nan, "p_sign": sign_test_p(d), "mde": math.nan,
                "verdict": "not shown"}
    low, high = paired_bootstrap_ci(d, t["confidence"], t["bootstrap_resamples"], t["bootstrap_seed"])
    p_sign = sign_test_p(d)
    significant = p_sign <= 1 - t["confidence"]
    verdict = ("lower" if high < 0 else "higher" if low > 0 else "not shown") if significant else "not shown"
    return {"n": int(d.size), "effect": float(d.mean()), "ci_low": low, "ci_high": high,
            "p_sign": p_sign, "mde": minimum_detectable_effect(d, t["confidence"], t["power"]),
            "verdict": verdict}


def verdict_text(result: dict, unit: str = "", fmt: str = "{:+.3g}") -> str:
    """One line for a chapter: "lower by 0.12 [0.08, 0.15] nats, sign test p = 0.002 (n = 10)",
    or "not shown: +0.01 [−0.02, 0.04] nats, minimum detectable effect 0.05 (n = 10)"."""
    unit = f" {unit}" if unit else ""
    interval = f"{fmt.format(result['effect'])} [{fmt.format(result['ci_low'])}, " \
               f"{fmt.format(result['ci_high'])}]{unit}"
    if result["verdict"] == "not shown":
        return (f"not shown: {interval}, minimum detectable effect "
                f"{abs(result['mde']):.2g}{unit} (n = {result['n']})")
    return f"{result['verdict']}: {interval}, sign test p = {result['p_sign']:.2g} (n = {result['n']})"


def compare_run_times(before_seconds, after_seconds, before_losses, after_losses,
                      thresholds: dict | None = None) -> dict:
    """Two versions of the code timed on the same runs (one value per run, same order):
    :func:`compare_paired` of log10(after / before) over the runs that trained every step in
    both, i.e. whose final loss is finite in both (a diverged run stops early, so its seconds
    time less work). Adds ``ratio``, ``ratio_low`` and ``ratio_high``: 10 to the effect and to
    its interval, the geometric mean of after ÷ before per run."""
    columns = [list(c) for c in (before_seconds, after_seconds, before_losses, after_losses)]
    if len({len(c) for c in columns}) != 1 or not columns[0]:
        raise ValueError(f"one time and one final loss per run and version, got "
                         f"{[len(c) for c in columns]} values")
    runs = list(zip(*columns))
    both = [(b, a) for b, a, loss_b, loss_a in runs
            if math.isfinite(loss_b) and math.isfinite(loss_a)]
    if not both:
        raise ValueError(f"none of the {len(runs)} runs trained every step in both versions")
    result = compare_paired(*zip(*both), log=True, thresholds=thresholds)
    return {**result, **{name: 10 ** result[key] for name, key in
                         (("ratio", "effect"), ("ratio_low", "ci_low"), ("ratio_high", "ci_high"))}}


def run_time_text(result: dict) -> str:
    """One line for a chapter from :func:`compare_run_times`: "0.62× [0.60, 0.64], sign test
    p = 0.002 over 20 runs: faster" (slower, or no change shown)."""
    words = {"lower": "faster", "higher": "slower", "not shown": "no change shown"}
    return (f"{result['ratio']:.2f}× [{result['ratio_low']:.2f}, {result['ratio_high']:.2f}], "
            f"sign test p = {result['p_sign']:.2g} over {result['n']} runs: "
            f"{words[result['verdict']]}")


def paired_by_seed(table, metric: str, baseline: dict, arm: dict, min_seeds: int = 2):
    """(baseline values, arm values) of ``metric`` for the seeds present in both selections of
    ``table`` (rows whose columns equal each dict's values, e.g. ``{"variant": "Pre-LN",
    "lr": 0.1}``), in seed order; ``ValueError`` with fewer than ``min_seeds`` such seeds."""
    def select(match):
        rows = table
        for k, v in match.items():
            rows = rows[np.isclose(rows[k], v)] if isinstance(v, float) else rows[rows[k] == v]
        return rows.set_index("seed")[metric]

    a, b = select(baseline), select(arm)
    seeds = sorted(set(a.index) & set(b.index))
    if len(seeds) < min_seeds:
        found = "no seed" if not seeds else f"{len(seeds)} seed(s), fewer than {min_seeds},"
        raise ValueError(f"{found} in both {baseline} and {arm}")
    return a.loc[seeds].to_numpy(dtype=float), b.loc[seeds].to_numpy(dtype=float)


def compare_by_seed(table, metric: str, baseline: str | dict, arm: str | dict,
                    column: str = "variant", *, log: bool = False,
                    thresholds: dict | None = None) -> dict:
    """:func:`compare_paired` of ``metric`` for ``arm`` against ``baseline``, paired by seed
    (:func:`paired_by_seed`): each side the rows whose ``column`` has that value, or a dict of
    column values (e.g. ``{"variant": "QK-Norm", "lr": 1.0}``). One seed in both gives "not
    shown" (a size="gpu" run of one seed); none, a ``ValueError``."""
    a, b = paired_by_seed(table, metric, *(side if isinstance(side, dict) else {column: side}
                                           for side in (baseline, arm)), min_seeds=1)
    return compare_paired(a, b, log=log, thresholds=thresholds)


def run_outcome(final_loss: float, unigram_loss: float, stall_margin: float = 0.05,
                diverged: bool = False) -> str:
    """"diverged" (``diverged`` or a non-finite final loss), "stalled" (final loss ≥ the
    byte-unigram loss − ``stall_margin`` nats: nothing learned beyond byte frequencies) or
    "trained"."""
    if diverged or not math.isfinite(final_loss):
        return "diverged"
    return "stalled" if final_loss >= unigram_loss - stall_margin else "trained"


def outcome_counts(table, unigram_loss: float, stall_margin: float = 0.05,
                   by=("variant", "lr")) -> "pandas.DataFrame":
    """Per group of ``by``: how many runs trained, stalled and diverged (:func:`run_outcome`)."""
    import pandas as pd

    outcomes = [run_outcome(loss, unigram_loss, stall_margin, bool(div))
                for loss, div in zip(table["final_loss"], table.get("diverged", [False] * len(table)))]
    counts = pd.crosstab([table[c] for c in by], pd.Series(outcomes, index=table.index, name="outcome"))
    return counts.reindex(columns=list(OUTCOMES), fill_value=0)


def paired_verdict(table, metric: str, arm: str | dict, baseline: str | dict,
                   column: str = "design", unit: str = "", fmt: str = "{:+.3g}", log: bool = False,
                   thresholds: dict | None = None, numbers: bool = True) -> str:
    """:func:`verdict_text` of :func:`compare_paired` for the rows of ``table`` whose
    ``column`` is ``arm`` against those whose ``column`` is ``baseline``, paired by seed
    (:func:`paired_by_seed`); the table holds one configuration (e.g. one learning rate).
    ``arm`` and ``baseline`` may instead be dicts of column values (e.g. ``{"design":
    "Post-LN", "lr": 0.01}``), to compare two configurations: each design at its own learning
    rate. ``numbers=False``: the verdict, n and the sign test's p only (for runs trained live,
    whose last digits move from machine to machine)."""
    result = compare_by_seed(table, metric, baseline, arm, column, log=log, thresholds=thresholds)
    if not numbers:
        return f"{result['verdict']} (n = {result['n']}, sign test p = {result['p_sign']:.2g})"
    return verdict_text(result, unit, fmt)

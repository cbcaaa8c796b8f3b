"""normtools.lab.verdicts against independent references: scipy.stats' bootstrap and binomial
test, the normal quantiles of scipy, and hand-made outcomes."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from normtools.lab import verdicts
from normtools.lab.data import TextData
from normtools.lab.train import byte_unigram_loss


def test_paired_bootstrap_ci_agrees_with_scipy():
    d = np.random.default_rng(3).normal(0.2, 0.5, size=12)
    low, high = verdicts.paired_bootstrap_ci(d, 0.95, resamples=40_000, seed=1)
    ref = stats.bootstrap((d,), np.mean, confidence_level=0.95, n_resamples=40_000,
                          method="percentile", random_state=7).confidence_interval
    width = ref.high - ref.low
    assert abs(low - ref.low) < 0.05 * width and abs(high - ref.high) < 0.05 * width
    assert low < d.mean() < high


@pytest.mark.parametrize("signs", [(10, 0), (9, 1), (7, 3), (5, 5), (3, 0), (1, 0)])
def test_sign_test_is_scipys_exact_binomial_test(signs):
    positive, negative = signs
    d = [1.5] * positive + [-0.5] * negative + [0.0, 0.0]  # zeros are dropped
    assert verdicts.sign_test_p(d) == pytest.approx(
        stats.binomtest(positive, positive + negative, 0.5).pvalue, rel=1e-12)


def test_lower_in_every_one_of_three_seeds_is_p_one_quarter_two_sided():
    assert verdicts.sign_test_p([-1, -2, -3]) == pytest.approx(0.25)
    assert verdicts.sign_test_p([]) == 1.0


def test_minimum_detectable_effect_is_the_normal_approximation():
    d = np.array([0.1, -0.3, 0.25, 0.05, -0.1, 0.4])
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert verdicts.minimum_detectable_effect(d) == pytest.approx(
        z * np.std(d, ddof=1) / math.sqrt(d.size), rel=1e-12)


def test_verdict_needs_the_interval_and_the_sign_test():
    rng = np.random.default_rng(0)
    base = rng.normal(3.0, 0.1, size=10)
    lower = verdicts.compare_paired(base, base - 0.2 + rng.normal(0, 0.01, 10))
    assert lower["verdict"] == "lower" and lower["ci_high"] < 0 and lower["p_sign"] < 0.05
    noise = verdicts.compare_paired(base, base + rng.normal(0, 0.1, 10))
    assert noise["ci_low"] < 0 < noise["ci_high"] and noise["verdict"] == "not shown"
    # three seeds of one sign: the bootstrap interval excludes zero, the sign test cannot reach 0.05
    three = verdicts.compare_paired([3.0, 3.1, 3.2], [2.9, 3.0, 3.05])
    assert three["ci_high"] < 0 and three["verdict"] == "not shown"
    assert "minimum detectable effect" in verdicts.verdict_text(three, "nats")
    logs = verdicts.compare_paired([100.0, 200.0, 50.0, 80.0, 120.0, 90.0],
                                   [1.0, 2.0, 0.5, 0.8, 1.2, 0.9], log=True)
    assert logs["effect"] == pytest.approx(-2.0) and logs["verdict"] == "lower"


def test_run_times_pair_the_runs_that_trained_in_both():
    """After ÷ before per run, over the runs whose final loss is finite in both versions: a
    run that diverged in either (its seconds time fewer steps) is left out of both sides; the
    ratio is the geometric mean of the kept runs' after / before (scipy's gmean), its interval
    10 to compare_paired's, and the line says faster, slower or no change."""
    rng = np.random.default_rng(1)
    before = rng.uniform(50.0, 70.0, size=12)
    after = before * rng.uniform(0.58, 0.62, size=12)
    losses = np.full(12, 2.5)
    after_losses = losses.copy()
    after_losses[3] = math.nan      # diverged after the change: stopped early, looks fast
    after[3] = 1.0
    losses_before = losses.copy()
    losses_before[7] = math.inf     # diverged before the change
    before[7] = 1.0
    result = verdicts.compare_run_times(before, after, losses_before, after_losses)
    kept = [i for i in range(12) if i not in (3, 7)]
    assert result["n"] == len(kept)
    assert result["ratio"] == pytest.approx(stats.gmean(after[kept] / before[kept]), rel=1e-12)
    assert result["ratio_low"] < result["ratio"] < result["ratio_high"] < 1
    assert result["verdict"] == "lower"
    assert verdicts.run_time_text(result).endswith(f"over {len(kept)} runs: faster")
    same = verdicts.compare_run_times(before, before * rng.uniform(0.95, 1.05, 12), losses, losses)
    assert verdicts.run_time_text(same).endswith("no change shown")
    with pytest.raises(ValueError, match=r"got \[3, 2, 3, 3\] values"):
        verdicts.compare_run_times([1.0, 2.0, 3.0], [1.0, 2.0], losses[:3], losses[:3])
    with pytest.raises(ValueError, match="none of the 2 runs"):
        verdicts.compare_run_times([1.0, 2.0], [1.0, 2.0], [math.nan, 1.0], [1.0, math.nan])


def test_paired_by_seed_pairs_the_common_seeds_in_order():
    table = pd.DataFrame({"variant": ["a"] * 3 + ["b"] * 3, "lr": [0.1] * 6,
                          "seed": [0, 1, 2, 2, 0, 3], "x": [1.0, 2.0, 3.0, 30.0, 10.0, 99.0]})
    a, b = verdicts.paired_by_seed(table, "x", {"variant": "a", "lr": 0.1}, {"variant": "b", "lr": 0.1})
    assert a.tolist() == [1.0, 3.0] and b.tolist() == [10.0, 30.0]


def test_one_failure_criterion():
    assert verdicts.run_outcome(float("nan"), 3.3) == "diverged"
    assert verdicts.run_outcome(2.0, 3.3, diverged=True) == "diverged"
    assert verdicts.run_outcome(3.27, 3.3, 0.05) == "stalled"
    assert verdicts.run_outcome(3.4, 3.3, 0.05) == "stalled"
    assert verdicts.run_outcome(3.2, 3.3, 0.05) == "trained"
    table = pd.DataFrame({"variant": ["a", "a", "b"], "lr": [1.0, 1.0, 1.0],
                          "final_loss": [2.0, 3.3, float("inf")], "diverged": [False, False, True]})
    counts = verdicts.outcome_counts(table, 3.3)
    assert counts.loc[("a", 1.0)].tolist() == [1, 1, 0]
    assert counts.loc[("b", 1.0)].tolist() == [0, 0, 1]


def test_byte_unigram_loss_is_the_cross_entropy_of_smoothed_train_frequencies():
    train = torch.tensor([0, 0, 0, 1, 2, 2])
    val = torch.tensor([0, 1, 3])
    vocab = 4
    counts = np.array([3, 1, 2, 0]) + 1.0
    p = counts / counts.sum()
    expected = -np.mean(np.log(p[[0, 1, 3]]))
    assert byte_unigram_loss(TextData(train=train, val=val, vocab_size=vocab)) == pytest.approx(expected, rel=1e-12)


def test_paired_verdict_reads_a_design_table():
    seeds = list(range(8))
    table = pd.DataFrame({"design": ["A"] * 8 + ["B"] * 8, "seed": seeds * 2,
                          "loss": [3.0 + 0.01 * s for s in seeds] + [2.5 + 0.012 * s for s in seeds]})
    assert verdicts.paired_verdict(table, "loss", "B", "A", unit="nats").startswith("lower: -0.")
    assert verdicts.paired_verdict(table, "loss", "A", "B").startswith("higher")
    assert verdicts.paired_verdict(table.iloc[[0, 1, 8, 9]], "loss", "B", "A").startswith("not shown")
    assert verdicts.paired_verdict(table, "loss", "B", "A", numbers=False) == \
        f"lower (n = 8, sign test p = {2 / 2 ** 8:.2g})"


def test_paired_verdict_compares_two_configurations_given_as_column_values():
    # B at lr 0.1 against A at lr 0.01 (each at its own rate): lower in all 6 seeds by 0.5 + s/100
    seeds = list(range(6))
    rows = [("A", 0.01, s, 3.0 + 0.01 * s) for s in seeds] + [("A", 0.1, s, 9.0) for s in seeds]
    rows += [("B", 0.1, s, 2.5) for s in seeds] + [("B", 0.01, s, 4.0) for s in seeds]
    table = pd.DataFrame(rows, columns=["design", "lr", "seed", "loss"])
    text = verdicts.paired_verdict(table, "loss", {"design": "B", "lr": 0.1},
                                   {"design": "A", "lr": 0.01}, unit="nats", fmt="{:+.3f}")
    effect = np.mean([2.5 - (3.0 + 0.01 * s) for s in seeds])
    assert text.startswith(f"lower: {effect:+.3f} [") and f"p = {2 / 2 ** 6:.2g}" in text
    # the same designs at one rate (B's 0.01) read the other way
    assert verdicts.paired_verdict(table, "loss", {"design": "B", "lr": 0.01},
                                   {"design": "A", "lr": 0.01}).startswith("higher")


def test_compare_by_seed_pairs_a_study_table_by_variant():
    """A study's table (column "variant"): arm minus baseline per seed, the seeds in any order
    and a seed only one side has left out; log=True compares log10 of the values."""
    rows = [("a", s, 10.0 ** s) for s in (2, 0, 1, 3)] + [("b", s, 10.0 ** (s + 2)) for s in (1, 2, 0, 5)]
    table = pd.DataFrame(rows, columns=["variant", "seed", "peak"])
    result = verdicts.compare_by_seed(table, "peak", "a", "b", log=True)
    assert result["n"] == 3 and result["effect"] == pytest.approx(2.0)
    plain = verdicts.compare_by_seed(table, "peak", "a", "b")
    assert plain["effect"] == pytest.approx(np.mean([100.0 - 1.0, 1000.0 - 10.0, 10000.0 - 100.0]))
    one = verdicts.compare_by_seed(table[table["seed"] == 0], "peak", "a", "b", log=True)
    assert one["n"] == 1 and one["verdict"] == "not shown" and one["effect"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no seed in both"):
        verdicts.compare_by_seed(table, "peak", "a", "typo")

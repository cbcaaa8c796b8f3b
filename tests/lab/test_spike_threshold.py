"""Issue 34: the spike score's threshold is OLMo 2's 7σ; a bump at 6.5σ is no spike, at 7.5σ it is."""

import numpy as np
import pytest

from normtools.lab import studies, train


def _window_then(value, window=1000):
    """``window`` values of mean 0 and population std 1 (alternating ±1), then ``value``."""
    return np.append(np.tile([1.0, -1.0], window // 2), value)


@pytest.mark.parametrize("sigmas, score", [(6.5, 0.0), (-6.5, 0.0), (7.5, 100.0), (-7.5, 100.0)])
def test_spike_score_counts_a_bump_beyond_7_sigma_and_not_below(sigmas, score):
    assert train.spike_score(_window_then(sigmas)) == score


def test_every_study_scores_spikes_at_olmo2s_7_sigma():
    """OLMo 2 (Team OLMo 2024): 7 standard deviations (the studies shorten the window)."""
    for study in studies.STUDIES.values():
        window = study.spike_window
        assert window % 2 == 0
        for sigmas, score in ((6.5, 0.0), (7.5, 100.0)):
            assert train.spike_score(_window_then(sigmas, window), window, study.spike_k) == score, study.name

"""Issue 34, the library: wrong arguments fail loudly instead of giving a wrong answer."""

import pytest
import torch

import normtools
from normtools import tp


@pytest.mark.parametrize("num_heads, world_size, rank", [(0, 2, 0), (2, 0, 0), (-2, 2, 0), (2.0, 2, 0)])
def test_head_range_rejects_counts_that_are_not_positive_integers(num_heads, world_size, rank):
    with pytest.raises(ValueError, match="positive integer"):
        tp.head_range(num_heads, world_size, rank)


@pytest.mark.parametrize("num_heads", [2, 3, 8])
def test_shard_columns_rejects_a_head_count_that_does_not_fit_the_tensor(num_heads):
    """Four heads of 8 columns: any other head count would cut short or empty shards."""
    x = torch.randn(3, 4 * 8)
    with pytest.raises(ValueError, match="num_heads"):
        tp.shard_columns(x, head_dim=8, num_heads=num_heads, world_size=2, rank=1)


def test_shard_columns_with_the_right_head_count_still_cuts_each_rank_its_heads():
    x = torch.arange(4 * 8.0).expand(3, -1)
    shards = [tp.shard_columns(x, head_dim=8, num_heads=4, world_size=2, rank=r) for r in range(2)]
    assert torch.equal(torch.cat(shards, -1), x)


@pytest.mark.parametrize("eps", [1e-50, 1e-39, 1e-45])
def test_an_eps_that_is_zero_or_subnormal_in_float32_is_refused(eps):
    """1e-50 is 0 in float32 and 1e-39 subnormal: an all-zero row would be 0 · rsqrt(0) = NaN."""
    x = torch.zeros(1, 16)
    assert torch.tensor(eps, dtype=torch.float32).item() < torch.finfo(torch.float32).tiny
    for call in (lambda: normtools.rms_norm(x, torch.ones(16), eps),
                 lambda: normtools.layer_norm(x, torch.ones(16), None, eps),
                 lambda: normtools.RMSNorm(16, eps)):
        with pytest.raises(ValueError, match="smallest normal"):
            call()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_smallest_accepted_eps_normalizes_an_all_zero_row_to_zero(backend):
    eps = torch.finfo(torch.float32).tiny
    y = normtools.rms_norm(torch.zeros(1, 16), torch.ones(16), eps, backend=backend)
    assert torch.equal(y, torch.zeros(1, 16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(2, 16), (1, 16), (16, 1)])
def test_a_weight_or_bias_that_is_not_one_dimensional_is_refused(backend, shape):
    """A (2, N) weight has N as its last dimension; Triton would silently use its row 0."""
    x = torch.randn(3, 16)
    bad = torch.ones(shape)
    calls = {"rms_norm weight": lambda: normtools.rms_norm(x, bad, backend=backend),
             "add_rms_norm weight": lambda: normtools.add_rms_norm(x, x, bad, backend=backend),
             "layer_norm weight": lambda: normtools.layer_norm(x, bad, None, backend=backend),
             "layer_norm bias": lambda: normtools.layer_norm(x, torch.ones(16), bad, backend=backend)}
    for what, call in calls.items():
        with pytest.raises(ValueError, match="has shape"):
            call()

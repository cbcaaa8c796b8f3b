"""Issue 34, the library: wrong arguments fail loudly instead of giving a wrong answer."""

import pytest
import torch

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

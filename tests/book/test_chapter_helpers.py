"""convert_scale against the Hugging Face norm modules themselves; head_rms against float64 math."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from normtools.book.qk_norm_scopes import head_rms
from normtools.book.scale_offset import convert_scale
from normtools.book.sharded_qk_norm import naive_tp_qk_norm


def _norms(dim, w_gemma, w_llama, eps=1e-6):
    gemma, llama = Gemma3RMSNorm(dim, eps=eps), LlamaRMSNorm(dim, eps=eps)
    with torch.no_grad():
        gemma.weight.copy_(w_gemma)
        llama.weight.data = w_llama.clone()
    return gemma, llama


def test_gemma_weights_converted_in_float32_give_the_same_layer():
    gen = torch.Generator().manual_seed(0)
    dim = 96
    x = torch.randn(16, dim, generator=gen) * 3
    w = 0.5 * torch.randn(dim, generator=gen)
    gemma, llama = _norms(dim, w, convert_scale(w, 1, 0))
    with torch.no_grad():
        assert torch.equal(llama(x), gemma(x))
        # and the unconverted weight does not
        _, unconverted = _norms(dim, w, w)
        assert not torch.allclose(unconverted(x), gemma(x), atol=1e-2)


def test_conversion_roundtrips_and_keeps_the_scale():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, generator=gen)
    there = convert_scale(w, 1, 0)
    torch.testing.assert_close(there.double(), w.double() + 1.0, rtol=0, atol=1e-6)
    torch.testing.assert_close(convert_scale(there, 0, 1), w, rtol=0, atol=1e-6)
    assert convert_scale(w, 0.5, 0.5).equal(w)


def test_bfloat16_storage_rounds_one_plus_a_small_weight():
    w = torch.tensor([2.0 ** -10, -(2.0 ** -10), 0.25], dtype=torch.bfloat16)
    converted = convert_scale(w, 1, 0)  # stored in w's dtype, bfloat16
    assert converted.dtype == torch.bfloat16
    assert converted[0].item() == 1.0 and converted[1].item() == 1.0  # the small w is lost
    assert converted[2].item() == 1.25
    exact = convert_scale(w, 1, 0, dtype=torch.float32)
    assert exact[0].item() == 1.0 + 2.0 ** -10


def test_convert_scale_refuses_bad_input():
    with pytest.raises(TypeError):
        convert_scale([1.0], 1, 0)
    with pytest.raises(TypeError):
        convert_scale(torch.ones(3, dtype=torch.int32), 1, 0)
    with pytest.raises(ValueError):
        convert_scale(torch.ones(3), float("nan"), 0)


def test_head_rms_matches_float64_math():
    gen = torch.Generator().manual_seed(2)
    heads, head_dim = 5, 8
    scales = torch.tensor([0.1, 1.0, 3.0, 10.0, 0.5])
    x = (torch.randn(3, 7, heads, head_dim, generator=gen) * scales[:, None]).flatten(-2)
    expected = x.double().reshape(3, 7, heads, head_dim).pow(2).mean(-1).sqrt()
    got = head_rms(x.to(torch.bfloat16), head_dim)
    assert got.shape == (3, 7, heads) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=0)
    torch.testing.assert_close(head_rms(x, head_dim).double(), expected, rtol=1e-6, atol=0)


def test_head_rms_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple"):
        head_rms(torch.ones(2, 10), 4)
    with pytest.raises(ValueError, match="positive"):
        head_rms(torch.ones(2, 8), 0)
    with pytest.raises(TypeError):
        head_rms(torch.ones(2, 8, dtype=torch.int64), 4)


def _shard_norm_float64(x, weight, eps, head_dim, world_size):
    """Each of world_size contiguous column blocks normalized on its own, in float64."""
    x, weight = x.double(), weight.double()
    blocks = zip(x.chunk(world_size, dim=-1), weight.chunk(world_size))
    return torch.cat([b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + eps) * w for b, w in blocks], -1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_naive_tp_qk_norm_matches_float64_shard_math(world_size):
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hk, d = 5, 8, 4, 16
    scales = torch.logspace(-1, 1, hq)
    q = (torch.randn(tokens, hq, d, generator=gen) * scales[:, None]).flatten(-2)
    k = torch.randn(tokens, hk * d, generator=gen)
    wq, wk = 1 + 0.1 * torch.randn(hq * d, generator=gen), 1 + 0.1 * torch.randn(hk * d, generator=gen)
    q_naive, k_naive = naive_tp_qk_norm(q, k, wq, wk, 1e-6, head_dim=d, world_size=world_size)
    torch.testing.assert_close(q_naive.double(), _shard_norm_float64(q, wq, 1e-6, d, world_size),
                               rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(k_naive.double(), _shard_norm_float64(k, wk, 1e-6, d, world_size),
                               rtol=2e-6, atol=1e-6)


def test_naive_tp_qk_norm_is_exact_on_one_rank_and_wrong_on_two():
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    gen = torch.Generator().manual_seed(4)
    d, hq, hk = 8, 4, 2
    q = (torch.randn(3, hq, d, generator=gen) * torch.tensor([0.1, 1.0, 5.0, 2.0])[:, None]).flatten(-2)
    k = torch.randn(3, hk * d, generator=gen)
    q_norm = MiniMaxM2RMSNorm(hq * d, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * torch.randn(hq * d, generator=gen))
        expected = q_norm(q)
        one, _ = naive_tp_qk_norm(q, k, q_norm.weight, torch.ones(hk * d), 1e-6, head_dim=d, world_size=1)
        two, _ = naive_tp_qk_norm(q, k, q_norm.weight, torch.ones(hk * d), 1e-6, head_dim=d, world_size=2)
    assert torch.equal(one, expected)
    assert not torch.allclose(two, expected, rtol=1e-2)


def test_naive_tp_qk_norm_refuses_bad_input():
    q, k = torch.ones(2, 32), torch.ones(2, 16)
    with pytest.raises(ValueError):
        naive_tp_qk_norm(q, k, torch.ones(32), torch.ones(16), head_dim=8, world_size=3)
    with pytest.raises(ValueError):
        naive_tp_qk_norm(q, k, torch.ones(31), torch.ones(16), head_dim=8, world_size=2)

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


def _first_and_second_order(op, backend):
    """(x's gradient of <op(x), dy> with create_graph=True, a call taking the gradient of its
    squared sum): one op of normtools on ``backend`` over small random inputs."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    w, dy = torch.randn(32), torch.randn(4, 32)
    cos, sin = torch.randn(4, 16), torch.randn(4, 16)
    calls = {
        "rms_norm": lambda: normtools.rms_norm(x, w, backend=backend),
        "add_rms_norm": lambda: normtools.add_rms_norm(x, x.detach(), w, backend=backend)[0],
        "layer_norm": lambda: normtools.layer_norm(x, w, None, backend=backend),
        "qk_norm": lambda: torch.cat(normtools.qk_norm(x, x * 2, w[:16], w[16:], head_dim=16,
                                                       backend=backend), -1),
        "qk_norm_rope": lambda: torch.cat(normtools.qk_norm_rope(
            x, x * 2, w[:16], w[16:], cos, sin, head_dim=16, backend=backend), -1)}
    y = calls[op]()
    dy = dy.repeat(1, y.shape[-1] // dy.shape[-1])
    grad, = torch.autograd.grad((y * dy).sum(), x, create_graph=True)
    plain, = torch.autograd.grad((calls[op]() * dy).sum(), x)
    return grad, plain, lambda: torch.autograd.grad(grad.pow(2).sum(), x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "qk_norm",
                                "qk_norm_rope"])
def test_a_gradient_of_a_gradient_is_refused_not_wrong(op, backend):
    """The backwards take the saved inverse RMS as a constant, so differentiating them again
    gave a second derivative off by about its own size on the torch backend, silently, and on
    the triton backend PyTorch's note to the op's author. The first gradient with
    create_graph=True is the ordinary one; the second raises, naming why."""
    grad, plain, second = _first_and_second_order(op, backend)
    torch.testing.assert_close(grad, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="differentiable once|differentiate twice"):
        second()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fused", [False, True])
def test_no_tokens_in_the_flat_layout_give_empty_results(backend, fused):
    """Per-head QK-Norm (and its fusion with RoPE) of q (0, 4·16), k (0, 2·16): empty outputs
    of the inputs' shapes and empty gradients, not a reshape error on the torch backend."""
    q = torch.randn(0, 64, requires_grad=True)
    k = torch.randn(0, 32, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    if fused:
        tables = torch.randn(0, 16)
        q_out, k_out = normtools.qk_norm_rope(q, k, w, w, tables, tables, head_dim=16,
                                              backend=backend)
    else:
        q_out, k_out = normtools.qk_norm(q, k, w, w, head_dim=16, backend=backend)
    assert q_out.shape == (0, 64) and k_out.shape == (0, 32)
    dq, dk, dw = torch.autograd.grad(q_out.sum() + k_out.sum(), (q, k, w))
    assert dq.shape == (0, 64) and dk.shape == (0, 32) and torch.equal(dw, torch.zeros(16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_flat_head_per_token_takes_the_tokens_of_the_rope_tables(backend):
    """q (B, S, head_dim) reads as B tokens of S heads or as B·S tokens of one head. For
    QK-Norm both are the same; for RoPE the tables decide: cos (S, head_dim) fits the tokens
    (B, S), not (B,), when B != S, so each q[b, s] is rotated by cos[s] (it raised, naming
    the tables). Where both fit (B = S), the headed reading stays, and (B, S, 1, head_dim)
    says one head. Against the reference norm and rotation."""
    from normtools.core.reference import rms_norm_reference, rope_reference

    torch.manual_seed(0)
    w = torch.randn(16)
    cos, sin = torch.randn(4, 16), torch.randn(4, 16)
    for batch in (2, 4):
        q, k = torch.randn(batch, 4, 16), torch.randn(batch, 4, 16)
        flat = [rope_reference(rms_norm_reference(x, w), cos, sin) for x in (q, k)]
        one_head = normtools.qk_norm_rope(q[:, :, None], k[:, :, None], w, w, cos, sin,
                                          head_dim=16, backend=backend)
        for got, want in zip(one_head, flat):
            torch.testing.assert_close(got[:, :, 0], want, rtol=1e-5, atol=1e-5)
        got = normtools.qk_norm_rope(q, k, w, w, cos, sin, head_dim=16, backend=backend)
        if batch == 4:      # 4 tokens of 4 heads: token b rotated by cos[b]
            flat = [rope_reference(rms_norm_reference(x, w), cos[:, None], sin[:, None])
                    for x in (q, k)]
        for g, want in zip(got, flat):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cast_back", ["False", 0, None])
def test_cast_back_must_be_a_bool(cast_back):
    """Any truthy value had counted as True ("False" cast the result back)."""
    x, tables = torch.randn(2, 16), torch.randn(2, 16)
    with pytest.raises(TypeError, match="cast_back must be True or False"):
        normtools.qk_norm_rope(x, x, torch.ones(16), torch.ones(16), tables, tables,
                               head_dim=16, cast_back=cast_back)


@pytest.mark.parametrize("argument, match", [({"eps": -1.0}, "eps"), ({"offset": float("nan")},
                                             "offset"), ({"casting": "gemma2"}, "casting"),
                                            ({"backend": "cuda"}, "backend")])
def test_qk_norm_module_refuses_bad_settings_at_construction(argument, match):
    """As normtools.RMSNorm does: not at the first forward call."""
    with pytest.raises(ValueError, match=match):
        normtools.QKNorm(16, 4, 2, **argument)

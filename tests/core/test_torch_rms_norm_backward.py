"""The torch backend's RMSNorm with a gradient to record (issue 35): eager, it runs torch's
RMSNorm op forward, saves the inverse RMS that op computes, and takes the analytic float32
backward dx = r · (g − x̂ · mean(x̂ ⊙ g)) instead of autograd of the module's operations, at
every shape and dtype. Its forward is the HF module's, bit for bit; its gradients meet the
float64 oracle's tolerance, as the HF module's own autograd does, for llama and gemma casting,
float32 and bfloat16, with and without a fused residual, and for QK-Norm's per-head rows with a
(H, head_dim) weight."""

import os
import subprocess
import sys

import pytest
import torch
from _oracle import assert_close_to_oracle, make_input, rms_norm_f64, run_with_grads
from torch.func import functional_call
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import normtools
from normtools.core import ops, reference

FAMILIES = {"llama": (LlamaRMSNorm, 0.0), "gemma": (Gemma3RMSNorm, 1.0)}
SHAPES = ((2, 16, 96), (300, 8))    # several rows of a wide row; many rows of a narrow one


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_recorded_graph_takes_the_analytic_backward_with_the_modules_numbers(family, residual,
                                                                            dtype, shape):
    module_class, offset = FAMILIES[family]
    n = shape[-1]
    module = module_class(n, eps=1e-6).to(dtype)
    x, res = make_input(shape, dtype, seed=0), make_input(shape, dtype, seed=1)
    w = (torch.linspace(-0.25, 0.25, n) + (1.0 - offset)).to(dtype)
    dys = [make_input(shape, dtype, seed=2)]

    def normed_input(x, res):
        return x + res if residual else x

    def with_normtools(x, res, w):
        if residual:
            return normtools.add_rms_norm(x, res, w, 1e-6, offset=offset, casting=family,
                                          backend="torch")[0]
        return normtools.rms_norm(x, w, 1e-6, offset=offset, casting=family, backend="torch")

    def with_module(x, res, w):
        return functional_call(module, {"weight": w}, (normed_input(x, res),))

    def in_float64(x, res, w):
        summed = normed_input(x, res)
        if residual:   # the op rounds x + residual to the input dtype; its gradient is 1
            summed = summed + (summed.detach().to(dtype).double() - summed.detach())
        return rms_norm_f64(summed, w, 1e-6, offset)

    (y,), grads = run_with_grads(with_normtools, (x, res, w), dys)
    (y_module,), module_grads = run_with_grads(with_module, (x, res, w), dys)
    _, exact = run_with_grads(in_float64, (x, res, w), dys, cast=torch.float64)
    assert torch.equal(y, y_module)
    leaf = x.detach().requires_grad_()
    assert type(with_normtools(leaf, res, w).grad_fn).__name__ == "_TorchRMSNormBackward"
    for name, got, by_module, ref in zip(("dx", "dres", "dw"), grads, module_grads, exact):
        if not residual and name == "dres":
            assert got is None and by_module is None
            continue
        assert got.dtype == by_module.dtype, name
        assert_close_to_oracle(by_module, ref, by_module, dtype, f"module {name}")
        assert_close_to_oracle(got, ref, by_module, dtype, f"normtools {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_per_head_weight_rows_get_their_own_gradient(dtype):
    """QK-Norm per head with one weight row per head (Cohere's (H, head_dim) layout): the
    analytic backward sums dw over the tokens of each head, not over the heads; q and k, one
    autograd node, each get their own gradients; checked against the float64 oracle of each head
    normalized on its own."""
    tokens, heads, head_dim = 12, 4, 16
    q = make_input((tokens, heads * head_dim), dtype, seed=0)
    k = make_input((tokens, 2 * head_dim), dtype, seed=1)
    qw = (torch.rand(heads, head_dim, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    kw = (torch.rand(2, head_dim, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    dys = [make_input(q.shape, dtype, seed=4), make_input(k.shape, dtype, seed=5)]

    def with_normtools(q, k, qw, kw):
        return normtools.qk_norm(q, k, qw, kw, 1e-6, head_dim=head_dim, backend="torch")

    def per_head(norm):
        def both(q, k, qw, kw):
            return tuple(norm(t.unflatten(-1, (-1, head_dim)), w).flatten(-2)
                         for t, w in ((q, qw), (k, kw)))
        return both

    inputs = (q, k, qw, kw)
    _, grads = run_with_grads(with_normtools, inputs, dys)
    q_out, k_out = with_normtools(*(t.detach().requires_grad_() for t in inputs))
    q_node, k_node = (out.grad_fn.next_functions[0][0] for out in (q_out, k_out))  # under a view
    assert q_node is k_node and type(q_node).__name__ == "_TorchRMSNormPairBackward"
    # autograd of the reference operations, in the input dtype
    _, by_autograd = run_with_grads(per_head(reference.rms_norm_reference), inputs, dys)
    _, exact = run_with_grads(per_head(rms_norm_f64), inputs, dys, cast=torch.float64)
    for name, got, same, ref in zip(("dq", "dk", "dqw", "dkw"), grads, by_autograd, exact):
        assert got.shape == ref.shape, name
        assert_close_to_oracle(got, ref, same, dtype, name)


def test_without_a_graph_to_record_no_autograd_function_runs():
    """Without a gradient to record the op is torch's RMSNorm op alone (no autograd node)."""
    x, w = make_input((4, 32), torch.float32), torch.ones(32, requires_grad=True)
    with torch.no_grad():
        assert normtools.rms_norm(x, w, backend="torch").grad_fn is None
    assert type(ops.torch_rms_norm(x, w, 1e-6, 0.0, "llama").grad_fn).__name__ == \
        "_TorchRMSNormBackward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autograd_backward_gives_the_modules_gradient_bits(monkeypatch, dtype):
    """RMS_NORM_BACKWARD = "autograd" (what a study trained before the analytic backward reruns
    on) differentiates torch's RMSNorm op: every gradient equals the HF module's bit for bit."""
    monkeypatch.setattr(ops, "RMS_NORM_BACKWARD", "autograd")
    n = 48
    module = LlamaRMSNorm(n, eps=1e-6).to(dtype)
    x, w = make_input((5, 7, n), dtype, seed=0), torch.linspace(0.5, 1.5, n).to(dtype)
    dys = [make_input(x.shape, dtype, seed=1)]
    outs, grads = run_with_grads(lambda x, w: normtools.rms_norm(x, w, backend="torch"), (x, w),
                                 dys)
    outs_module, grads_module = run_with_grads(
        lambda x, w: functional_call(module, {"weight": w}, (x,)), (x, w), dys)
    for got, expected in zip(outs + grads, outs_module + grads_module):
        assert torch.equal(got, expected)


def test_unknown_backward_in_the_environment_is_refused_at_import():
    env = {**os.environ, "NORMTOOLS_RMS_NORM_BACKWARD": "exact"}
    done = subprocess.run([sys.executable, "-c", "import normtools.core.ops"], env=env, text=True,
                          capture_output=True)
    assert done.returncode != 0
    assert "unknown NORMTOOLS_RMS_NORM_BACKWARD 'exact'" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_without_torchs_fused_op_the_same_bits_and_statistic(monkeypatch, dtype, family):
    """A torch without a usable ``_fused_rms_norm`` (an older one) takes F.rms_norm and inv_rms:
    the same output bits as the module and the same inverse RMS as the fused op."""
    module_class, offset = FAMILIES[family]
    n = 40
    x = make_input((6, n), dtype, seed=3)
    w = (torch.linspace(-0.25, 0.25, n) + (1.0 - offset)).to(dtype)
    fused = reference.rms_norm_native_with_rstd(x, w, 1e-6, offset, family)
    monkeypatch.setattr(reference, "_FUSED_RMS_NORM", None)
    fallback = reference.rms_norm_native_with_rstd(x, w, 1e-6, offset, family)
    module = module_class(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        expected = functional_call(module, {"weight": w}, (x,))
    assert torch.equal(fallback[0], expected) and torch.equal(fused[0], expected)
    assert torch.equal(fallback[1], fused[1])


def test_x_and_residual_get_separate_gradient_tensors():
    """The node hands one dx to x and to the residual; their .grad must not share storage, or an
    in-place change of one (gradient clipping) would change the other."""
    x, res = make_input((4, 8), torch.float32, seed=0), make_input((4, 8), torch.float32, seed=1)
    x.requires_grad_(), res.requires_grad_()
    w = torch.linspace(0.5, 1.5, 8, requires_grad=True)
    normed, summed = normtools.add_rms_norm(x, res, w, backend="torch")
    (normed.sum() + summed.sum()).backward()
    assert torch.equal(x.grad, res.grad)
    x.grad.mul_(2)
    assert torch.equal(x.grad, 2 * res.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, weight_shape, offset", [
    ((7, 40), None, 0.0),          # no weight: g is dy itself (a copy, dy is not written)
    ((40,), (40,), 0.0),           # a single row: dw is that row's dy ⊙ x̂, no sum
    ((3, 5, 40), (40,), 1.0),      # Gemma's 1 + w, leading dims summed for dw
    ((6, 4, 16), (4, 16), 0.0),    # one weight row per head: dw summed over tokens only
], ids=str)
@pytest.mark.parametrize("dy_kind", ["dense", "expanded"])
def test_reference_backward_meets_the_float64_gradients(dtype, shape, weight_shape, offset,
                                                        dy_kind):
    """``reference.rms_norm_backward_reference`` called directly, for every weight layout it
    serves, against autograd of the float64 oracle; with an expanded dy (what ``y.sum()``
    hands back) as well as a dense one, and neither dy nor x is written."""
    x = make_input(shape, dtype, seed=0)
    weight = None if weight_shape is None else \
        (torch.rand(weight_shape, generator=torch.Generator().manual_seed(1)) + 0.5
         - offset).to(dtype)
    dy = (make_input(shape, dtype, seed=2) if dy_kind == "dense"
          else torch.full((), 0.75, dtype=dtype).expand(shape))
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6).float()
    x_before, dy_before = x.clone(), dy.clone()
    dx, dw = reference.rms_norm_backward_reference(dy, x, weight, rstd, offset)
    assert torch.equal(x, x_before) and torch.equal(dy, dy_before)
    _, exact = run_with_grads(lambda x, w: rms_norm_f64(x, w, 1e-6, offset), (x, weight), [dy],
                              cast=torch.float64)
    _, same = run_with_grads(lambda x, w: reference.rms_norm_reference(x, w, 1e-6, offset),
                             (x, weight), [dy])
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert_close_to_oracle(dx, exact[0], same[0], dtype, "dx")
    if weight is None:
        assert dw is None
    else:
        assert dw.shape == weight.shape and dw.dtype == weight.dtype
        assert_close_to_oracle(dw, exact[1], same[1], dtype, "dw")

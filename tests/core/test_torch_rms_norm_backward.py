"""The torch backend's analytic RMSNorm backward (issue 35): a float32 input of
``ops.ANALYTIC_BACKWARD_MIN_ELEMENTS`` or more, with a gradient to record, runs the reference
forward and dx = r · (g − x̂ · mean(x̂ ⊙ g)) instead of autograd of F.rms_norm. Its forward
is the HF module's, bit for bit; its gradients meet the float64 oracle's tolerance, as the HF
module's own autograd does, for llama and gemma casting, with and without a fused residual."""

import pytest
import torch
from _oracle import assert_close_to_oracle, make_input, rms_norm_f64, run_with_grads
from torch.func import functional_call
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import normtools
from normtools.core import ops

SHAPE = (2, 128, 1024)     # 262144 float32 elements: the smallest input that takes the route
FAMILIES = {"llama": (LlamaRMSNorm, 0.0), "gemma": (Gemma3RMSNorm, 1.0)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("residual", [False, True])
def test_large_float32_rows_take_the_analytic_backward_with_the_modules_numbers(family,
                                                                              residual):
    assert SHAPE[0] * SHAPE[1] * SHAPE[2] == ops.ANALYTIC_BACKWARD_MIN_ELEMENTS
    module_class, offset = FAMILIES[family]
    n = SHAPE[-1]
    module = module_class(n, eps=1e-6)
    x, res = make_input(SHAPE, torch.float32, seed=0), make_input(SHAPE, torch.float32, seed=1)
    w = torch.linspace(-0.25, 0.25, n) + (1.0 - offset)
    dys = [make_input(SHAPE, torch.float32, seed=2)]

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
        return rms_norm_f64(normed_input(x, res), w, 1e-6, offset)

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
        assert_close_to_oracle(by_module, ref, None, torch.float32, f"module {name}")
        assert_close_to_oracle(got, ref, None, torch.float32, f"normtools {name}")

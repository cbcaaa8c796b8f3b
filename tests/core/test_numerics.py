"""Numerics the other kernel tests cannot see: eps, and the rounding of each casting convention.

* eps. With unit-scale rows any eps from 1e-12 to 2e-5 gives the same result to float32
  precision, so a kernel could drop or replace it unnoticed. Here the rows have a mean square
  comparable to eps (0.1, 1 and 10 times it), for several eps: the float64 oracle with a wrong
  eps is far outside the tolerance (checked below, so the test can fail), and the ops must stay
  inside it.
* Casting, in ulps. The Triton backend is compared with the transformers RMSNorm modules
  themselves for every casting convention (Llama, Gemma 3 with 1 + w, OLMo 2), every dtype mix
  (bfloat16 input with a float32 weight included) and both kernel paths (a row in one block,
  and a row in chunks, forced at small N by shrinking the launcher's chunk size). In float16 and
  bfloat16 the outputs must equal the module's up to at most one ulp on a tiny fraction of
  elements (a swapped casting convention differs on a quarter of them, a 1 % scale or
  eps = 1e-2 on most). Errors against float64 follow FlashAttention's rule: the kernel's error
  is at most a small multiple of the error of the module in the same dtype.
"""

import pytest
import torch
from _oracle import FP32_MAX_REL_ERR, layer_norm_f64, make_input, rms_norm_f64, run_with_grads
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

import normtools
from normtools.core import launch_plans
from normtools.core import ops as ops_module

# ----------------------------------------------------------------------------- eps

RMS_EPS = (1e-6, 1e-5, 1e-3)
LN_EPS = (1e-5, 1e-6, 1e-3)
WRONG_EPS = (1e-12, 2e-5, 1e-2)


def rows_near_eps(eps, n=48, seed=0):
    """Rows whose mean square is 0.1, 1 and 10 times eps (two rows each)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, n, generator=gen)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()               # mean square exactly ~1
    return x * torch.tensor([0.1, 0.1, 1.0, 1.0, 10.0, 10.0]).mul(eps).sqrt()[:, None]


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def eps_cases():
    """(name, op(x, w, eps, backend) -> y, oracle(x, w, eps) -> y, eps values)."""
    return [
        ("rms_norm", lambda x, w, eps, backend: normtools.rms_norm(x, w, eps, backend=backend),
         lambda x, w, eps: rms_norm_f64(x, w, eps), RMS_EPS),
        ("rms_norm_gemma",
         lambda x, w, eps, backend: normtools.rms_norm(x, w - 1, eps, offset=1.0,
                                                       casting="gemma", backend=backend),
         lambda x, w, eps: rms_norm_f64(x, w, eps), RMS_EPS),
        ("add_rms_norm",
         lambda x, w, eps, backend: normtools.add_rms_norm(x, torch.zeros_like(x), w, eps,
                                                           backend=backend)[0],
         lambda x, w, eps: rms_norm_f64(x, w, eps), RMS_EPS),
        ("layer_norm", lambda x, w, eps, backend: normtools.layer_norm(x, w, None, eps,
                                                                       backend=backend),
         lambda x, w, eps: layer_norm_f64(x, w, None, eps), LN_EPS),
        ("qk_norm", lambda x, w, eps, backend: normtools.qk_norm(
            x.unflatten(-1, (4, 12)), x.unflatten(-1, (4, 12)), w[:12], w[:12], eps,
            head_dim=12, backend=backend)[0].flatten(-2),
         lambda x, w, eps: rms_norm_f64(x.unflatten(-1, (4, 12)), w[:12], eps).flatten(-2),
         RMS_EPS),
        ("qk_norm_per_layer", lambda x, w, eps, backend: normtools.qk_norm(
            x, x, w, w, eps, head_dim=12, scope="per_layer", backend=backend)[0],
         lambda x, w, eps: rms_norm_f64(x, w, eps), RMS_EPS),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", eps_cases(), ids=lambda c: c[0])
def test_eps_is_visible(case, backend):
    """Outputs and dx on rows with mean square ~ eps match float64 with the right eps; the
    oracle with any of WRONG_EPS (or eps × 2) would not."""
    name, op, oracle, eps_values = case
    w = torch.linspace(0.5, 1.5, 48)
    dy = make_input((6, 48), torch.float32, seed=7)
    for eps in eps_values:
        x = rows_near_eps(eps)
        (y,), (dx,) = run_with_grads(lambda t: op(t, w, eps, backend), (x,), [dy])
        (y64,), (dx64,) = run_with_grads(lambda t: oracle(t, w.double(), eps), (x,), [dy],
                                         cast=torch.float64)
        assert rel_err(y, y64) <= FP32_MAX_REL_ERR, f"{name} eps={eps}: output"
        assert rel_err(dx, dx64) <= FP32_MAX_REL_ERR, f"{name} eps={eps}: dx"
        for wrong in (*WRONG_EPS, 2 * eps, eps / 2):
            if wrong != eps:
                y_wrong = oracle(x.double(), w.double(), wrong)
                assert rel_err(y_wrong, y64) > 100 * FP32_MAX_REL_ERR, \
                    f"{name}: eps {wrong} is not distinguishable from {eps} on these rows"


# ----------------------------------------------------------------------------- ulps vs HF

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
# FlashAttention-style bound: kernel error vs float64 ≤ FACTOR · the module's error (same
# dtype) vs float64, plus one ulp of the largest value (the module may round exactly).
FA_FACTOR = 2.0
# float16 / bfloat16 outputs: elements one ulp away from the module's (reduction order moves r
# by about one float32 ulp, which can flip a rounding); none further.
MAX_ULP_MISMATCH_FRACTION = 1e-3

FAMILIES = {                          # HF module, offset, casting
    "llama": (LlamaRMSNorm, 0.0, "llama"),
    "gemma3": (Gemma3RMSNorm, 1.0, "gemma"),
    "olmo2": (Olmo2RMSNorm, 0.0, "gemma"),
}
DTYPE_MIXES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]


def ulps(a, b, dtype):
    """|a − b| in units of the spacing of ``dtype`` at max(|a|, |b|)."""
    a, b = a.double(), b.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(dtype).tiny)
    _, exponent = torch.frexp(mag)
    return (a - b).abs() / torch.ldexp(torch.ones_like(mag), exponent - 1 - MANTISSA_BITS[dtype])


@pytest.fixture(params=["single_pass", "chunked"])
def kernel_path(request, monkeypatch):
    """Run the Triton launches of the test on the given path; yields a list that receives the
    SINGLE_PASS flag of each RMSNorm launch (to check that the path really is the one named)."""
    if request.param == "chunked":
        monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64)   # 16 float32 / 32 bf16 values
    flags = []
    real_kernel_for = ops_module.kernel_for

    def recording_kernel_for(kernel, device):
        launcher = real_kernel_for(kernel, device)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    flags.append(kwargs["SINGLE_PASS"])
                    return launcher[grid](*args, **kwargs)
                return launch
        return Recorder()

    monkeypatch.setattr(ops_module, "kernel_for", recording_kernel_for)
    yield request.param, flags


def hf_module(family, n, weight_dtype, seed):
    hf_class, offset, _ = FAMILIES[family]
    module = hf_class(n, eps=1e-6).to(weight_dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(0.3 * torch.randn(n, generator=gen) + (1.0 - offset))
    return module


@pytest.mark.parametrize("x_dtype, w_dtype", DTYPE_MIXES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_matches_hf_modules_in_ulps(family, x_dtype, w_dtype, kernel_path):
    path, flags = kernel_path
    _, offset, casting = FAMILIES[family]
    n = 96
    hf = hf_module(family, n, w_dtype, seed=1)
    w = hf.weight.detach()
    x = make_input((64, n), x_dtype, "contiguous", seed=2, scale=3.0)
    dy = make_input((64, n), torch.float32, "contiguous", seed=3)

    (y,), (dx,) = run_with_grads(lambda t: normtools.rms_norm(
        t, w, 1e-6, offset=offset, casting=casting, backend="triton"), (x,), [dy])
    assert flags and all(flag == (path == "single_pass") for flag in flags), flags
    (y_hf,), (dx_hf,) = run_with_grads(hf, (x,), [dy])
    (y64,), (dx64,) = run_with_grads(lambda t: rms_norm_f64(t, w.double(), 1e-6, offset),
                                     (x,), [dy], cast=torch.float64)
    what = f"{family} {x_dtype}/{w_dtype} {path}"
    assert y.dtype == y_hf.dtype, what

    # outputs in ulps of the output dtype
    distance = ulps(y, y_hf, y_hf.dtype)
    if y_hf.dtype == torch.float32 and x_dtype == torch.float32:
        assert distance.max() <= 8, f"{what}: {distance.max():.0f} ulps from the module"
    else:
        mismatch = (distance > 0).double().mean().item()
        assert distance.max() <= 1 and mismatch <= MAX_ULP_MISMATCH_FRACTION, (
            f"{what}: up to {distance.max():.1f} ulps, {mismatch:.2%} of elements differ")

    # errors against float64, FlashAttention style (outputs and the input gradient)
    for name, got, same, ref in (("y", y, y_hf, y64), ("dx", dx, dx_hf, dx64)):
        spacing = torch.finfo(got.dtype).eps * ref.abs().max().item()
        err, err_same = ((got.double() - ref).abs().max().item(),
                         (same.double() - ref).abs().max().item())
        assert err <= FA_FACTOR * err_same + spacing, (
            f"{what} {name}: error {err:.3g} vs the module's {err_same:.3g}")

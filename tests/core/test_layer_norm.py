"""normtools.layer_norm / LayerNorm: kernels and reference against float64 math and PyTorch.

On CPU the Triton kernels run under the interpreter (small shapes); the same tests run compiled
on CUDA (``-m gpu``), plus larger shapes there.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from _oracle import (
    DEVICES,
    DTYPES,
    DTYPE_MIXES,
    EPS_CHOICES,
    HYPOTHESIS_SETTINGS,
    LAYOUTS,
    eps_and_scale,
    examples,
    row_shapes,
    assert_close_to_oracle,
    layer_norm_f64,
    make_input,
    run_with_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import normtools
from normtools.core.reference import layer_norm_reference

SETTINGS = HYPOTHESIS_SETTINGS
SETTINGS_CUDA = settings(SETTINGS, max_examples=10)


def check_layer_norm(device, backend, shape, dtype, param_dtype, has_weight, has_bias, layout,
                     eps=1e-5, scale=1.0, seed=0):
    """Forward and every gradient of layer_norm against the float64 oracle; x is normal times
    ``scale`` (its variance is scale²)."""
    n = shape[-1]
    # a common offset makes the mean matter (and tests the two-pass variance)
    x = make_input(shape, dtype, layout, device, seed, scale=scale, shift=3.0 * scale)
    gen = torch.Generator().manual_seed(seed + 2)
    weight = (0.5 + torch.rand(n, generator=gen)).to(device, param_dtype) if has_weight else None
    bias = (0.5 * torch.randn(n, generator=gen)).to(device, param_dtype) if has_bias else None
    inputs = (x, weight, bias)

    def kernel(x, w, b):
        return normtools.layer_norm(x, w, b, eps, backend=backend)

    def same(x, w, b):
        return layer_norm_reference(x, w, b, eps)

    def oracle(x, w, b):
        return layer_norm_f64(x, w, b, eps)

    dy = torch.randn(shape, generator=gen).to(device, dtype)
    (out,), grads = run_with_grads(kernel, inputs, [dy])
    (out_same,), grads_same = run_with_grads(same, inputs, [dy])
    (out64,), grads64 = run_with_grads(oracle, inputs, [dy], cast=torch.float64)
    assert out.dtype == dtype
    assert_close_to_oracle(out, out64, out_same, dtype, "y")
    for name, g, ref, s in zip(["dx", "dw", "db"], grads, grads64, grads_same):
        assert g.dtype == s.dtype, f"{name}: dtype {g.dtype}, expected {s.dtype}"
        assert_close_to_oracle(g, ref, s, dtype, name)


@st.composite
def cases(draw):
    shape = draw(row_shapes())
    dtype, param_dtype = draw(st.sampled_from(DTYPE_MIXES))
    affine = st.sampled_from([True, True, False])               # mostly with weight and bias
    has_weight, has_bias = draw(affine), draw(affine)
    layout = draw(st.sampled_from(LAYOUTS))
    eps, scale = draw(eps_and_scale())
    return shape, dtype, param_dtype, has_weight, has_bias, layout, eps, scale


def test_draws_cover_the_space():
    """The draws are not degenerate: non-empty with N > 1; low precision with a weight, in
    the input dtype and in float32; every eps; rows at the scale of eps."""
    drawn = examples(cases())
    assert all(math.prod(shape) > 0 and shape[-1] > 1 for shape, *_ in drawn)
    weighted = {(dtype, param_dtype) for _, dtype, param_dtype, w, *_ in drawn if w}
    assert {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)} & weighted
    assert any(dtype == torch.float32 for dtype, _ in weighted)
    assert {eps for *_, eps, _ in drawn} == set(EPS_CHOICES)
    assert any(scale < 1 for *_, scale in drawn)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@SETTINGS
@given(case=cases())
def test_matches_float64(backend, case):
    check_layer_norm("cpu", backend, *case)


@pytest.mark.gpu
@SETTINGS_CUDA
@given(case=cases())
def test_matches_float64_cuda(case):
    """The same draws, compiled on CUDA (fewer: each new configuration is a compilation)."""
    check_layer_norm("cuda", "triton", *case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 17), (1, 17), (1, 1), (3, 0, 8), (2, 70001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_shapes(device, shape, dtype):
    """M = 0 and 1, N = 1, and a row longer than 65536 (chunked loop)."""
    check_layer_norm(device, "triton", shape, dtype, dtype, True, True, "padded_rows")


@pytest.mark.gpu
# rows past one CTA (16384 forward, 8192 backward) run on thread-block clusters of 2-16 CTAs
@pytest.mark.parametrize("shape", [(4096, 2048), (16, 16384), (16, 32768), (5, 40000), (8, 131072),
                                   (3, 5, 131071), (1000, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_shapes_cuda(shape, dtype):
    check_layer_norm("cuda", "triton", shape, dtype, dtype, True, True, "contiguous")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_layer_norm(backend, dtype):
    """Same results as torch.nn.functional.layer_norm (float32 parameters, as nn.LayerNorm)."""
    x = make_input((3, 7, 96), dtype, "contiguous")
    w, b = torch.rand(96) + 0.5, torch.randn(96)
    got = normtools.layer_norm(x, w, b, backend=backend)
    want = F.layer_norm(x.float(), (96,), w, b).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_stride0_upstream_gradient(device):
    x = make_input((3, 5, 40), torch.float32, "contiguous", device)
    w, b = torch.linspace(0.5, 1.5, 40, device=device), torch.linspace(-1, 1, 40, device=device)
    grads = {}
    for backend, dtype in (("triton", torch.float32), ("oracle", torch.float64)):
        xl, wl, bl = (t.to(dtype).detach().requires_grad_() for t in (x, w, b))
        y = (layer_norm_f64(xl, wl, bl) if backend == "oracle"
             else normtools.layer_norm(xl, wl, bl, backend=backend))
        y.sum().backward()
        grads[backend] = (xl.grad, wl.grad, bl.grad)
    for got, ref in zip(grads["triton"], grads["oracle"]):
        assert_close_to_oracle(got, ref, None, torch.float32, "stride-0 grad")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, n", [(2000, 96), (24, 9001)])
def test_dw_db_are_deterministic(device, m, n):
    x = make_input((m, n), torch.bfloat16, "contiguous", device, seed=3)
    dy = make_input((m, n), torch.bfloat16, "contiguous", device, seed=4)

    def dw_db():
        w = torch.ones(n, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.zeros(n, device=device, dtype=torch.bfloat16, requires_grad=True)
        normtools.layer_norm(x, w, b, backend="triton").backward(dy)
        return w.grad, b.grad

    (dw1, db1), (dw2, db2) = dw_db(), dw_db()
    assert torch.equal(dw1, dw2) and torch.equal(db1, db2)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_row_stays_in_its_row(device):
    x = make_input((6, 50), torch.bfloat16, "contiguous", device, seed=5)
    w, b = torch.full((50,), 1.25, device=device), torch.full((50,), 0.5, device=device)
    clean = normtools.layer_norm(x, w, b, backend="triton")
    for bad in (math.nan, math.inf):
        xb = x.clone()
        xb[2, 7] = bad
        y = normtools.layer_norm(xb, w, b, backend="triton")
        others = [i for i in range(6) if i != 2]
        assert torch.isfinite(y[others]).all()
        assert torch.equal(y[others], clean[others])
        assert not torch.isfinite(y[2]).all()
        xl = xb.clone().requires_grad_()
        normtools.layer_norm(xl, w, b, backend="triton").backward(torch.ones_like(y))
        assert torch.isfinite(xl.grad[others]).all()


def test_bad_inputs_raise_before_launch():
    x = torch.randn(4, 8)
    cases = [
        (ValueError, dict(weight=torch.ones(7))),
        (ValueError, dict(bias=torch.ones(9))),
        (ValueError, dict(bias=torch.ones(8, device="meta"))),
        (TypeError, dict(x=x.double())),
        (TypeError, dict(bias=torch.ones(8, dtype=torch.int64))),
        (ValueError, dict(eps=0.0)),
        (ValueError, dict(eps=math.inf)),
        (TypeError, dict(eps="1e-5")),
        (ValueError, dict(backend="numpy")),
    ]
    for error, change in cases:
        args = dict(x=x, weight=torch.ones(8), bias=torch.zeros(8), eps=1e-5,
                    backend="triton") | change
        with pytest.raises(error):
            normtools.layer_norm(args.pop("x"), **args)


def test_torch_compile_fullgraph():
    x = make_input((2, 3, 48), torch.float32, "contiguous")
    w, b = torch.linspace(0.5, 1.5, 48), torch.linspace(-1, 1, 48)

    def f(x, w, b):
        return normtools.layer_norm(x, w, b, backend="triton")

    compiled = torch.compile(f, fullgraph=True)
    eager = run_with_grads(f, (x, w, b), [torch.ones_like(x)])
    comp = run_with_grads(compiled, (x, w, b), [torch.ones_like(x)])
    for a, c in zip(eager[0] + eager[1], comp[0] + comp[1]):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_module():
    norm = normtools.LayerNorm(16, eps=1e-5)
    bare = normtools.LayerNorm(16, bias=False)
    assert bare.bias is None and "bias=False" in repr(bare)
    assert norm.backend == "auto"
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = make_input((2, 16), torch.float32, "contiguous")
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    ref.load_state_dict(norm.state_dict())
    for backend in ("torch", "triton"):
        norm.backend = backend
        torch.testing.assert_close(norm(x), ref(x), rtol=1e-5, atol=1e-5)

"""normtools.rms_norm / add_rms_norm / RMSNorm: kernels and reference against float64 math.

On CPU the Triton kernels run under the interpreter (small shapes); the same tests run compiled
on CUDA (``-m gpu``), plus larger shapes there.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
from _oracle import (
    DEVICES,
    DTYPE_MIXES,
    EPS_CHOICES,
    HYPOTHESIS_SETTINGS,
    LAYOUTS,
    assert_close_to_oracle,
    eps_and_scale,
    examples,
    make_input,
    rms_norm_f64,
    row_shapes,
    run_with_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import normtools
from normtools.core.reference import rms_norm_reference

SETTINGS = HYPOTHESIS_SETTINGS
SETTINGS_CUDA = settings(SETTINGS, max_examples=10)


def check_rms_norm(device, backend, shape, dtype, weight_dtype, casting, offset, layout,
                   eps=1e-6, scale=1.0, residual=False, seed=0):
    """Forward and every gradient of rms_norm (add_rms_norm with ``residual``) against the
    float64 oracle; ``weight_dtype=None`` means no weight; x (and the residual) are normal
    times ``scale``."""
    n = shape[-1]
    x = make_input(shape, dtype, layout, device, seed, scale=scale)
    res = make_input(shape, dtype, "contiguous", device, seed + 1, scale=scale) if residual else None
    gen = torch.Generator().manual_seed(seed + 2)
    weight = None
    if weight_dtype is not None:
        # effective scale offset + w in [0.5, 1.5]: outputs stay below 8, where one bfloat16
        # ulp (0.03) is below the absolute tolerance
        weight = (0.5 - offset + torch.rand(n, generator=gen)).to(device, weight_dtype)
    kw = dict(offset=offset, casting=casting)

    if residual:
        def kernel(x, res, w):
            return normtools.add_rms_norm(x, res, w, eps, backend=backend, **kw)

        def same(x, res, w):
            summed = x + res
            return rms_norm_reference(summed, w, eps, offset, casting), summed

        def oracle(x, res, w):
            # the op rounds x + residual to the input dtype, then normalizes that rounded sum
            # (which matters for rows at the scale of eps); the rounding's gradient is 1
            summed = x + res
            summed = summed + (summed.detach().to(dtype).double() - summed.detach())
            return rms_norm_f64(summed, w, eps, offset), summed
        inputs = (x, res, weight)
    else:
        def kernel(x, w):
            return normtools.rms_norm(x, w, eps, backend=backend, **kw)

        def same(x, w):
            return rms_norm_reference(x, w, eps, offset, casting)

        def oracle(x, w):
            return rms_norm_f64(x, w, eps, offset)
        inputs = (x, weight)

    with torch.no_grad():
        like = same(*inputs)
    like = like if isinstance(like, tuple) else (like,)
    dys = [torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in like]
    outs, grads = run_with_grads(kernel, inputs, dys)
    outs_same, grads_same = run_with_grads(same, inputs, dys)
    outs64, grads64 = run_with_grads(oracle, inputs, dys, cast=torch.float64)

    names = ["normed", "summed"]
    for name, out, ref, s in zip(names, outs, outs64, outs_same):
        assert out.dtype == s.dtype, f"{name}: dtype {out.dtype}, expected {s.dtype}"
        assert_close_to_oracle(out, ref, s, dtype, name)
    grad_names = ["dx", "dresidual", "dw"] if residual else ["dx", "dw"]
    for name, g, ref, s in zip(grad_names, grads, grads64, grads_same):
        if ref is None:
            assert g is None, name
            continue
        assert g.dtype == s.dtype, f"{name}: dtype {g.dtype}, expected {s.dtype}"
        assert_close_to_oracle(g, ref, s, dtype, name)


@st.composite
def cases(draw):
    shape = draw(row_shapes())
    dtype, weight_dtype = draw(st.sampled_from(DTYPE_MIXES))
    if not draw(st.sampled_from([True, True, True, False])):     # one draw in four unweighted
        weight_dtype = None
    casting = draw(st.sampled_from(["llama", "gemma"]))
    offset = draw(st.sampled_from([0.0, 1.0, 0.5]))
    layout = draw(st.sampled_from(LAYOUTS))
    eps, scale = draw(eps_and_scale())
    return shape, dtype, weight_dtype, casting, offset, layout, eps, scale


def test_draws_cover_the_space():
    """The draws are not degenerate: non-empty with N > 1, every dtype mix with a weight
    (bfloat16 input with a float32 weight included, with N > 1), unweighted draws, every eps,
    and rows at the scale of eps."""
    drawn = examples(cases())
    assert all(math.prod(shape) > 0 and shape[-1] > 1 for shape, *_ in drawn)
    mixes = {(dtype, weight_dtype) for _, dtype, weight_dtype, *_ in drawn}
    assert {(torch.bfloat16, torch.float32), (torch.float32, torch.float32)} <= mixes
    assert any(w is None for _, _, w, *_ in drawn)
    assert {eps for *_, eps, _ in drawn} == set(EPS_CHOICES)
    assert any(scale < 1 for *_, scale in drawn) and any(scale == 1 for *_, scale in drawn)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@SETTINGS
@given(case=cases(), residual=st.booleans())
def test_matches_float64(backend, case, residual):
    check_rms_norm("cpu", backend, *case, residual=residual)


@pytest.mark.gpu
@SETTINGS_CUDA
@given(case=cases(), residual=st.booleans())
def test_matches_float64_cuda(case, residual):
    """The same draws, compiled on CUDA (fewer: each new configuration is a compilation)."""
    check_rms_norm("cuda", "triton", *case, residual=residual)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 17), (1, 17), (1, 1), (3, 0, 8), (2, 70001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_edge_shapes(device, shape, dtype, residual):
    """M = 0 and 1, N = 1, and a row longer than 65536 (chunked loop)."""
    check_rms_norm(device, "triton", shape, dtype, dtype, "llama", 0.0, "padded_rows",
                   residual=residual)


@pytest.mark.gpu
# rows past one CTA (16384 forward, 8192 backward) run on thread-block clusters of 2-16 CTAs
@pytest.mark.parametrize("shape", [(4096, 2048), (16, 16384), (16, 32768), (5, 40000), (8, 131072),
                                   (3, 5, 131071), (1000, 96)])
@pytest.mark.parametrize("dtype, casting", [(torch.bfloat16, "llama"), (torch.float16, "gemma"),
                                            (torch.float32, "llama")])
def test_large_shapes_cuda(shape, dtype, casting):
    check_rms_norm("cuda", "triton", shape, dtype, dtype, casting, 1.0 if casting == "gemma" else 0.0,
                   "contiguous", residual=True)


@pytest.mark.parametrize("device", DEVICES)
def test_stride0_upstream_gradient(device):
    """y.sum().backward() hands the op an expanded (stride-0) gradient."""
    x = make_input((3, 5, 40), torch.float32, "contiguous", device)
    w = torch.linspace(0.5, 1.5, 40, device=device)
    grads = {}
    for backend, dtype in (("triton", torch.float32), ("oracle", torch.float64)):
        xl, wl = (t.to(dtype).detach().requires_grad_() for t in (x, w))
        y = rms_norm_f64(xl, wl) if backend == "oracle" else normtools.rms_norm(xl, wl, backend=backend)
        y.sum().backward()
        grads[backend] = (xl.grad, wl.grad)
    for got, ref in zip(grads["triton"], grads["oracle"]):
        assert_close_to_oracle(got, ref, None, torch.float32, "stride-0 grad")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, n", [(2000, 96), (24, 9001)])
def test_dw_is_deterministic(device, m, n):
    """dw from the per-program partial rows is bitwise identical run to run. The shapes give
    the CPU grid 4 programs, the last of which gets no rows for (24, 9001)."""
    x = make_input((m, n), torch.bfloat16, "contiguous", device, seed=3)
    w = torch.ones(n, device=device, dtype=torch.bfloat16)
    dy = make_input((m, n), torch.bfloat16, "contiguous", device, seed=4)

    def dw():
        wl = w.clone().requires_grad_()
        normtools.rms_norm(x, wl, backend="triton").backward(dy)
        return wl.grad

    assert torch.equal(dw(), dw())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_nonfinite_row_stays_in_its_row(device, casting):
    x = make_input((6, 50), torch.bfloat16, "contiguous", device, seed=5)
    w = torch.full((50,), 1.25, device=device, dtype=torch.bfloat16)
    clean = normtools.rms_norm(x, w, casting=casting, backend="triton")
    for bad in (math.nan, math.inf):
        xb = x.clone()
        xb[2, 7] = bad
        y = normtools.rms_norm(xb, w, casting=casting, backend="triton")
        others = [i for i in range(6) if i != 2]
        assert torch.isfinite(y[others]).all()
        assert torch.equal(y[others], clean[others])
        assert not torch.isfinite(y[2]).all()
        xl = xb.clone().requires_grad_()
        normtools.rms_norm(xl, w, casting=casting, backend="triton").backward(torch.ones_like(y))
        assert torch.isfinite(xl.grad[others]).all()


def test_bad_inputs_raise_before_launch():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    cases = [
        (ValueError, dict(weight=torch.ones(7))),
        (ValueError, dict(weight=torch.ones(8, 1))),
        (ValueError, dict(weight=torch.ones(8, device="meta"))),
        (TypeError, dict(x=x.double())),
        (TypeError, dict(x=x.to(torch.int32))),
        (TypeError, dict(weight=torch.ones(8, dtype=torch.float16))),
        (ValueError, dict(eps=0.0)),
        (ValueError, dict(eps=-1e-6)),
        (ValueError, dict(eps=math.nan)),
        (ValueError, dict(eps=math.inf)),
        (ValueError, dict(casting="t5")),
        (ValueError, dict(backend="cuda")),
        (ValueError, dict(x=torch.randn(4, 0), weight=None)),
    ]
    for error, change in cases:
        args = dict(x=x, weight=w, eps=1e-6, casting="llama", backend="triton") | change
        with pytest.raises(error):
            normtools.rms_norm(args.pop("x"), **args)
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        normtools.rms_norm(x.double(), w)
    with pytest.raises(ValueError, match="shape"):
        normtools.add_rms_norm(x, torch.randn(4, 9), w)
    with pytest.raises(TypeError):
        normtools.add_rms_norm(x, x.half(), w)
    with pytest.raises(ValueError):
        normtools.add_rms_norm(x, x.to("meta"), w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    x = make_input((2, 3, 48), torch.float32, "contiguous")
    res = make_input((2, 3, 48), torch.float32, "contiguous", seed=1)
    w = torch.linspace(0.5, 1.5, 48)

    def f(x, res, w):
        y1 = normtools.rms_norm(x, w, casting="gemma", offset=1.0, backend=backend)
        y2, summed = normtools.add_rms_norm(x, res, w, backend=backend)
        return y1, y2, summed

    compiled = torch.compile(f, fullgraph=True)
    eager_out, eager_grads = run_with_grads(f, (x, res, w), [torch.ones_like(x)] * 3)
    comp_out, comp_grads = run_with_grads(compiled, (x, res, w), [torch.ones_like(x)] * 3)
    for a, b in zip(eager_out + eager_grads, comp_out + comp_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_interpreter_works_without_env_var(tmp_path):
    """CPU tensors with backend="triton" in a fresh process where TRITON_INTERPRET is unset; and
    backend="auto" (the torch reference there) traced by torch.compile(fullgraph=True)."""
    script = (
        "import torch, normtools\n"
        "from normtools.core.reference import rms_norm_reference\n"
        "x = torch.randn(5, 33, dtype=torch.bfloat16); w = torch.rand(33) + 0.5\n"
        "y = normtools.rms_norm(x, w, backend='triton')\n"
        "y0 = rms_norm_reference(x, w, 1e-6, 0.0, 'llama')\n"
        "assert (y - y0).abs().max() < 1e-2, (y - y0).abs().max()\n"
        "auto = torch.compile(normtools.RMSNorm(33), fullgraph=True, backend='eager')(x)\n"
        "assert torch.equal(auto, rms_norm_reference(x, torch.ones(33), 1e-6, 0.0, 'llama'))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_module():
    gemma = normtools.RMSNorm(16, eps=1e-5, offset=1.0, casting="gemma")
    llama = normtools.RMSNorm(16)
    assert torch.equal(gemma.weight.detach(), torch.zeros(16))
    assert torch.equal(llama.weight.detach(), torch.ones(16))
    assert "offset=1.0" in repr(gemma) and "casting='gemma'" in repr(gemma)
    assert gemma.backend == "auto"
    x = make_input((2, 16), torch.float32, "contiguous")
    for backend in ("torch", "triton"):
        gemma.backend = backend
        assert_close_to_oracle(gemma(x).detach(), rms_norm_f64(x, gemma.weight.detach(), 1e-5, 1.0),
                               None, torch.float32, "module")

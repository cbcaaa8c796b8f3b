"""torch.compile(fullgraph=True) over the normtools ops with several eps and offsets.

Once Dynamo has seen two values of a float argument it traces it as a symbolic float; the input
checks (``normtools.core.validate``) must then trace too instead of breaking the graph (they
once called ``math.isfinite`` on it). Everything runs in this one process, with CPU Inductor,
the way QuACK's own tests compile their norms: the same function with a second and a third eps,
and two modules with different eps. The compiled results are compared with eager ones, forward
and backward. (The custom ops take eps as a constant, so each distinct eps is one more graph.)
"""

import math

import pytest
import torch
from _oracle import make_input, run_with_grads

import normtools

EPS_VALUES = (1e-6, 1e-5, 1e-2)
OFFSETS = (0.0, 1.0, 0.5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_compiled_equals_eager(fn, inputs, kwargs_list, compiled=None, rtol=1e-6, atol=1e-6,
                                 atol_of_largest=False):
    """``compiled`` (default: ``torch.compile(fn, fullgraph=True)``) gives fn's outputs and input
    gradients for every keyword set in turn (all in one compiled object: a second eps is a
    second call), within ``rtol`` and ``atol`` (with ``atol_of_largest``: ``atol`` times the
    largest |value| of the eager tensor, for results formed by cancellation)."""
    compiled = compiled or torch.compile(fn, fullgraph=True)
    for kwargs in kwargs_list:
        with torch.no_grad():
            outs = fn(*inputs, **kwargs)
        gen = torch.Generator().manual_seed(0)
        dys = [torch.randn(o.shape, generator=gen) for o in outs]
        eager = run_with_grads(lambda *a: fn(*a, **kwargs), inputs, dys)
        comp = run_with_grads(lambda *a: compiled(*a, **kwargs), inputs, dys)
        for a, b in zip(eager[0] + eager[1], comp[0] + comp[1]):
            tol = atol * float(a.abs().max()) if atol_of_largest else atol
            torch.testing.assert_close(b, a, rtol=rtol, atol=tol, msg=lambda m: f"{kwargs}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_with_several_eps_and_offsets(backend):
    x = make_input((3, 40), torch.float32)
    res = make_input((3, 40), torch.float32, seed=1)
    w = torch.linspace(0.5, 1.5, 40)
    b = torch.linspace(-0.5, 0.5, 40)
    q = make_input((3, 4, 8), torch.float32, seed=2)
    k = make_input((3, 2, 8), torch.float32, seed=3)
    qw, kw = torch.linspace(0.5, 1.5, 8), torch.linspace(1.5, 0.5, 8)

    def rms(x, w, eps, offset):
        return (normtools.rms_norm(x, w, eps, offset=offset, backend=backend),)

    def add_rms(x, res, w, eps, offset):
        return normtools.add_rms_norm(x, res, w, eps, offset=offset, backend=backend)

    def ln(x, w, b, eps):
        return (normtools.layer_norm(x, w, b, eps, backend=backend),)

    def qk(q, k, qw, kw, eps, offset):
        return normtools.qk_norm(q, k, qw, kw, eps, head_dim=8, offset=offset, backend=backend)

    angles = torch.linspace(0, 3, 3 * 4).view(3, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def qk_rope(q, k, qw, kw, eps, offset):
        return normtools.qk_norm_rope(q, k, qw, kw, cos, sin, eps, head_dim=8, offset=offset,
                                      backend=backend)

    settings = [dict(eps=e, offset=o) for e, o in zip(EPS_VALUES, OFFSETS)]
    assert_compiled_equals_eager(rms, (x, w), settings)
    assert_compiled_equals_eager(add_rms, (x, res, w), settings)
    assert_compiled_equals_eager(ln, (x, w, b), [dict(eps=e) for e in EPS_VALUES])
    assert_compiled_equals_eager(qk, (q, k, qw, kw), settings)
    assert_compiled_equals_eager(qk_rope, (q, k, qw, kw), settings)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_two_modules_with_different_eps(backend):
    """Two RMSNorm modules (and two LayerNorms) with different eps, each compiled, one process.
    The input's mean square (about 1e-5) is of the order of the eps values, so a module run with
    the other's eps is off by far more than the tolerance. That tolerance, 1e-5 of the largest
    value, allows Inductor's reordered float32 reductions: the input gradient
    rstd·(w·dy − x̂·mean(w·dy·x̂)) is a difference of near-equal terms, so a few ulps of its
    terms are a larger relative error of the small elements."""
    x = make_input((2, 3, 24), torch.float32) * 3e-3
    modules = [normtools.RMSNorm(24, eps=1e-6), normtools.RMSNorm(24, eps=1e-5, offset=1.0,
                                                                 casting="gemma"),
               normtools.LayerNorm(24, eps=1e-5), normtools.LayerNorm(24, eps=1e-3)]
    gen = torch.Generator().manual_seed(0)
    for module in modules:
        module.backend = backend
        with torch.no_grad():
            module.weight.copy_(torch.rand(24, generator=gen) + 0.5)
        compiled = torch.compile(module, fullgraph=True)
        assert_compiled_equals_eager(lambda t, m=module: (m(t),), (x,), [{}],
                                     compiled=lambda t, c=compiled: (c(t),), rtol=1e-5, atol=1e-5,
                                     atol_of_largest=True)
    with pytest.raises(AssertionError):     # the check sees an eps of the other module
        other = normtools.RMSNorm(24, eps=1e-5)
        other.backend = backend
        with torch.no_grad():
            other.weight.copy_(modules[0].weight)
        first = torch.compile(modules[0], fullgraph=True)
        assert_compiled_equals_eager(lambda t: (other(t),), (x,), [{}],
                                     compiled=lambda t: (first(t),), rtol=1e-5, atol=1e-5,
                                     atol_of_largest=True)


def test_bad_eps_is_still_refused_under_compile():
    """A symbolic eps that is not > 0 is refused with the eps message (Dynamo reports the
    ValueError raised while tracing); eager keeps the plain ValueError."""
    x, w = make_input((2, 16), torch.float32), torch.ones(16)
    compiled = torch.compile(normtools.rms_norm, fullgraph=True)
    compiled(x, w, 1e-6)
    compiled(x, w, 1e-5)           # eps is symbolic from here on
    with pytest.raises(Exception, match="eps must be finite and > 0"):
        compiled(x, w, -1.0)
    for bad in (0.0, -1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match="eps must be finite and > 0"):
            normtools.rms_norm(x, w, bad)
    with pytest.raises(ValueError, match="offset must be finite"):
        normtools.rms_norm(x, w, 1e-6, offset=math.nan)

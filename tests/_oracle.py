"""Float64 oracles and the tolerance table shared by the normalization tests (RMSNorm, LayerNorm,
QK-Norm).

The oracles are the textbook equations evaluated in float64, written independently of
normtools. Tolerances (defined in normtools.measure.oracle, per input dtype):

* float32: max|out − ref64| ≤ 1e-5 · max(max|ref64|, 1) (max relative error, normwise; the
  floor of 1 matters only when the exact result is ~0 through cancellation, e.g. dx for N = 1,
  where float32 rounding of O(1) intermediates is all that is left — the test data are O(1));
* float16 / bfloat16: |out − ref64| ≤ 2 · |same − ref64| + atol + ulp(ref64) elementwise, where
  ``same`` is plain PyTorch computing the same thing in the same dtype (atol 1e-2 fp16, 5e-2
  bf16; ulp(v) = finfo(dtype).eps · |v|). The casting conventions are told apart in ulps
  against the HF modules (tests/core/test_numerics.py), not by this bound.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normtools.measure.oracle import FP32_MAX_REL_ERR, oracle_excess, run_with_grads  # noqa: F401

# Tests parametrized over these run under the interpreter on CPU and compiled on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Hypothesis: deterministic examples (CI reruns see the same ones), no deadline (interpreter).
HYPOTHESIS_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                               suppress_health_check=[HealthCheck.too_slow])

# Strategies of the property tests. They draw the space where kernels go wrong: non-empty
# inputs with N > 1 (empty inputs and N = 1 are edge cases with explicit tests), every dtype
# mix of input and parameter (a bfloat16 or float16 input with a float32 weight included),
# several eps, and rows whose mean square is comparable to eps (where eps changes the result).
DTYPE_MIXES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
               (torch.float16, torch.float16)]
EPS_CHOICES = (1e-6, 1e-5, 1e-3)


@st.composite
def row_shapes(draw, long_rows=(1023, 2048, 9001)):
    """(lead..., N): one to three non-empty leading dims, 2 ≤ N ≤ 160 or a long row."""
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    return (*lead, draw(st.one_of(st.integers(2, 160), st.sampled_from(long_rows))))


@st.composite
def eps_and_scale(draw):
    """(eps, scale of x): unit-scale rows, or rows of mean square ~ eps (scale √eps)."""
    eps = draw(st.sampled_from(EPS_CHOICES))
    return eps, draw(st.sampled_from([1.0, math.sqrt(eps)]))


def examples(strategy, hypothesis_settings=HYPOTHESIS_SETTINGS):
    """Examples drawn from ``strategy`` with these settings, as a property test draws them (the
    derandomized seed depends on the test function, so the draws are typical, not identical):
    for tests of what the strategies cover."""
    drawn = []

    @hypothesis_settings
    @given(strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn


def rms_norm_f64(x, weight=None, eps=1e-6, offset=0.0):
    """y = (offset + w) · x / sqrt(mean(x², -1) + eps) in float64 (y = x̂ without a weight)."""
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())


def layer_norm_f64(x, weight=None, bias=None, eps=1e-5):
    """y = (x − mean) / sqrt(var + eps) · w + b in float64 (biased variance)."""
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def assert_close_to_oracle(out, ref64, same, dtype, what):
    """Check ``out`` against the float64 ``ref64`` with the tolerance of input dtype ``dtype``
    (``normtools.measure.oracle.oracle_excess``); ``same`` is the plain-PyTorch result in the
    same dtype (used for float16 / bfloat16)."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    excess, description = oracle_excess(out, ref64, same, dtype)
    assert excess <= 0, f"{what}: {description}"


LAYOUTS = ("contiguous", "padded_rows", "permuted_leading", "strided_last", "transposed_last",
           "expanded")


def make_input(shape, dtype, layout="contiguous", device="cpu", seed=0, scale=1.0, shift=0.0,
               generator=None):
    """Random normal tensor (times ``scale``, plus ``shift``) of ``shape`` whose memory layout
    is one of LAYOUTS:

    * "padded_rows": rows of a wider buffer (row stride > N);
    * "permuted_leading": the first two leading dims transposed (not viewable as (M, N) rows;
      plain contiguous with fewer than two leading dims);
    * "strided_last": every other element along the last dim (last-dim stride 2);
    * "transposed_last": the last two dims transposed in memory (last-dim stride = the size of
      the dim before it; plain contiguous for a 1-D tensor);
    * "expanded": stride 0 along the first dim (every row, or for a 1-D tensor every element,
      is the same value), as ``t.expand`` or an upstream gradient of ``y.sum()`` gives.

    ``generator`` (a torch.Generator) replaces ``seed`` when given.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    *lead, n = shape
    if layout == "padded_rows":
        owner, view = torch.randn(*lead, n + 3, generator=gen), lambda t: t[..., :n]
    elif layout == "permuted_leading" and len(lead) >= 2:
        owner = torch.randn(lead[1], lead[0], *lead[2:], n, generator=gen)
        view = lambda t: t.transpose(0, 1)  # noqa: E731
    elif layout == "strided_last":
        owner, view = torch.randn(*lead, 2 * n, generator=gen), lambda t: t[..., ::2]
    elif layout == "transposed_last" and lead:
        owner = torch.randn(*lead[:-1], n, lead[-1], generator=gen)
        view = lambda t: t.transpose(-1, -2)  # noqa: E731
    elif layout == "expanded":
        owner = torch.randn(1, *shape[1:], generator=gen)
        view = lambda t: t.expand(shape)  # noqa: E731
    else:
        owner, view = torch.randn(*shape, generator=gen), lambda t: t  # noqa: E731
    return view((owner * scale + shift).to(device=device, dtype=dtype))

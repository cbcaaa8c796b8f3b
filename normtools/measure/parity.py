"""Parity: how far apart are two outputs of "the same" normalization, and which weights exist.

The check to run before and after switching a model's norm to another backend:

* ``compare(reference, candidate)`` — one ``Parity`` record: max abs and relative error, max
  distance in units in the last place (ulps) of the candidate's dtype, the count of elements
  outside the dtype's tolerance, and whether NaNs sit in the same places.
* ``norm_parity(module, x, ...)`` — runs one Hugging Face norm module and the normtools
  backends (eager torch, Triton, torch.compile) on the same input and tabulates every output
  against the module (the "before" of a backend switch) and against float32 math.
* ``learned_shapes(model)`` — every learned norm scale and bias of a model, and every
  projection bias, with module name, shape and dtype.

Ulps are counted on the bit patterns: for a float of w bits, reinterpret it as a w-bit signed
integer i and map it to a monotone integer line, o(x) = i for i ≥ 0 and o(x) = −(i & (2^(w−1) − 1))
for i < 0 (the sign-magnitude pattern turned into an ordered one, with −0 and +0 both at 0).
Then ulps(a, b) = |o(a) − o(b)| is the number of representable values between a and b: the
number of ``torch.nextafter`` steps that lead from one to the other.
"""

from dataclasses import asdict, dataclass
from functools import partial

import torch

__all__ = ["DEFAULT_TOLERANCES", "Parity", "ulp_distance", "compare", "agreement", "norm_parity",
           "learned_shapes"]

# (rtol, atol) per output dtype: torch.testing.assert_close's defaults.
DEFAULT_TOLERANCES = {
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
}

# Integer dtype of the same width, used to read a float's bit pattern.
_BITS_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

# ulp_distance where exactly one of the two values is NaN: no finite count of steps.
NAN_ULPS = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Parity:
    """One comparison of a candidate output against a reference output.

    max_abs  = max |c − r|;  max_rel = max |c − r| / |r| over finite r ≠ 0 (both in float64);
    max_ulps = max ulps(r.to(c.dtype), c) over positions where neither is NaN;
    n_mismatch counts the elements that differ with |c − r| > atol + rtol·|r|, or with a NaN or
    infinity on one side only (NaN and NaN, inf and inf of one sign, count as equal);
    allclose is n_mismatch == 0.
    """

    reference: str
    candidate: str
    dtype: str
    shape: tuple
    n_elements: int
    max_abs: float
    max_rel: float
    max_ulps: int
    n_mismatch: int
    n_nan_mismatch: int
    rtol: float
    atol: float
    allclose: bool

    def as_dict(self):
        return asdict(self)


def _check_pair(a, b, a_name, b_name):
    for t, name in ((a, a_name), (b, b_name)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"{a_name} has shape {tuple(a.shape)} but {b_name} has shape "
                         f"{tuple(b.shape)}")


def _ordered_bits(x):
    """Bit pattern of x as a monotone int64: o(x) (see the module docstring)."""
    bits = x.contiguous().view(_BITS_AS_INT[x.dtype]).to(torch.int64)
    magnitude = bits & (2 ** (x.element_size() * 8 - 1) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a, b):
    """Elementwise number of representable values between a and b (same float dtype and shape).

    ulps(a, b) = |o(a) − o(b)|, an int64 tensor. Equal values (−0 and +0 included) give 0,
    neighbours (``torch.nextafter``) give 1. Where both are NaN the distance is 0; where only one
    is NaN it is ``NAN_ULPS``. Supports bfloat16, float16 and float32.
    """
    _check_pair(a, b, "a", "b")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.dtype not in _BITS_AS_INT:
        raise TypeError(f"ulps are defined here for bfloat16, float16 and float32, got {a.dtype}")
    distance = (_ordered_bits(a) - _ordered_bits(b)).abs()
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    distance = distance.masked_fill(a_nan & b_nan, 0)
    return distance.masked_fill(a_nan ^ b_nan, NAN_ULPS)


def compare(reference, candidate, *, rtol=None, atol=None, reference_name="reference",
            candidate_name="candidate"):
    """Compare ``candidate`` with ``reference`` in the candidate's dtype; returns ``Parity``.

    ``reference`` may be of higher precision (e.g. float32 math for a bfloat16 candidate): the
    errors are taken against its exact values, the ulps against it rounded to the candidate's
    dtype, so 0 ulps means "correctly rounded". The tolerance defaults to
    ``DEFAULT_TOLERANCES[candidate.dtype]``. Tensors may live on any device; they are compared
    on the CPU.
    """
    _check_pair(reference, candidate, reference_name, candidate_name)
    if candidate.dtype not in DEFAULT_TOLERANCES:
        raise TypeError(f"{candidate_name} has dtype {candidate.dtype}; supported are "
                        f"bfloat16, float16 and float32")
    default_rtol, default_atol = DEFAULT_TOLERANCES[candidate.dtype]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol

    r = reference.detach().cpu().to(torch.float64)
    c = candidate.detach().cpu().to(torch.float64)
    r_nan, c_nan = torch.isnan(r), torch.isnan(c)
    nan_mismatch = r_nan ^ c_nan
    same = (r == c) | (r_nan & c_nan)
    abs_err = torch.where(same, 0.0, (c - r).abs()).masked_fill(nan_mismatch, 0.0)
    finite_r = torch.isfinite(r) & (r != 0)
    rel_err = torch.where(finite_r, abs_err / r.abs().masked_fill(~finite_r, 1.0), 0.0)
    both_finite = torch.isfinite(r) & torch.isfinite(c)
    mismatch = ~same & (~both_finite | (abs_err > atol + rtol * r.abs()))

    ulps = ulp_distance(reference.detach().cpu().to(candidate.dtype), candidate.detach().cpu())
    ulps = ulps.masked_fill(r_nan | c_nan, 0)
    n_mismatch = int(mismatch.sum())
    return Parity(
        reference=reference_name,
        candidate=candidate_name,
        dtype=str(candidate.dtype).removeprefix("torch."),
        shape=tuple(candidate.shape),
        n_elements=candidate.numel(),
        max_abs=float(abs_err.max()) if abs_err.numel() else 0.0,
        max_rel=float(rel_err.max()) if rel_err.numel() else 0.0,
        max_ulps=int(ulps.max()) if ulps.numel() else 0,
        n_mismatch=n_mismatch,
        n_nan_mismatch=int(nan_mismatch.sum()),
        rtol=rtol,
        atol=atol,
        allclose=n_mismatch == 0,
    )


def agreement(max_ulps, allclose):
    """The verdict of one comparison that survives another machine's rounding.

    "≤ 1 ulp" when no element is more than one representable value away (bit-identical
    included: whether a sum in another order lands on the same side of a rounding boundary
    changes from machine to machine, a bound of one ulp does not); else "within tolerance" when
    ``allclose`` (the dtype's default rtol/atol); else "outside tolerance".
    """
    if max_ulps <= 1:
        return "≤ 1 ulp"
    return "within tolerance" if allclose else "outside tolerance"


def _norm_eps(module):
    """eps of an HF norm module: ``variance_epsilon`` (Llama, Qwen) or ``eps`` (Gemma, nn)."""
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if eps is not None:
            return float(eps)
    raise ValueError(f"{type(module).__name__} has neither variance_epsilon nor eps")


def _backend_fns(kind, weight, bias, eps, offset, casting):
    """{label: callable(x) -> y} for the normtools backends of one norm."""
    from normtools.core import ops
    from normtools.core import reference

    if kind == "layer":
        def run(x, backend):
            return ops.layer_norm(x, weight, bias, eps, backend=backend)
        reference_fn = partial(reference.layer_norm_reference, weight=weight, bias=bias, eps=eps)
    else:
        def run(x, backend):
            return ops.rms_norm(x, weight, eps, offset=offset, casting=casting,
                                      backend=backend)
        reference_fn = partial(reference.rms_norm_reference, weight=weight, eps=eps,
                               offset=offset, casting=casting)
    def compiled(x):
        # A fresh compile for every call: after a few recompiles (new dtypes, shapes, weights)
        # torch.compile would otherwise fall back to eager without failing.
        torch.compiler.reset()
        return torch.compile(reference_fn, dynamic=False)(x)

    return {
        "normtools torch": partial(run, backend="torch"),
        "normtools triton": partial(run, backend="triton"),
        "torch.compile": compiled,
    }


def norm_parity(module, x, *, casting="llama", offset=0.0,
                backends=("normtools torch", "normtools triton", "torch.compile")):
    """Forward parity of one norm module against the normtools backends, as a list of rows.

    ``module`` is a Hugging Face norm module (``LlamaRMSNorm``, ``Gemma3RMSNorm``, ...) or an
    ``nn.LayerNorm``; ``casting`` and ``offset`` describe its RMSNorm convention (see
    ``normtools.core.reference``). Each of "HF module" and ``backends`` is compared

    * against "float32 math": the reference applied to float32 copies of x and the weights
      (errors of each output relative to what a float32 computation gives), and
    * against "HF module" (the check "did switching the backend change the output?").

    Each row is ``Parity.as_dict()`` plus ``status`` "ok", or ``status`` "skipped" and the
    ``reason`` when a backend raised (e.g. no C++ compiler for torch.compile, no Triton).
    """
    from normtools.core import reference

    kind = "layer" if isinstance(module, torch.nn.LayerNorm) else "rms"
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = _norm_eps(module)
    with torch.no_grad():
        expected = module(x)
        w32 = None if weight is None else weight.float()
        if kind == "layer":
            b32 = None if bias is None else bias.float()
            exact = reference.layer_norm_reference(x.float(), w32, b32, eps)
        else:
            exact = reference.rms_norm_reference(x.float(), w32, eps, offset, casting)
        fns = _backend_fns(kind, weight, bias, eps, offset, casting)
        unknown = set(backends) - set(fns)
        if unknown:
            raise ValueError(f"unknown backends {sorted(unknown)}; expected some of {list(fns)}")
        outputs, rows = {"HF module": expected}, []
        for label in backends:
            try:
                outputs[label] = fns[label](x)
            except Exception as exc:  # a backend that cannot run here is reported, not fatal
                rows.append({"reference": "HF module", "candidate": label, "status": "skipped",
                             "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    for label, out in outputs.items():
        rows.append({**compare(exact, out, reference_name="float32 math",
                               candidate_name=label).as_dict(), "status": "ok", "reason": ""})
        if label != "HF module":
            rows.append({**compare(expected, out, reference_name="HF module",
                                   candidate_name=label).as_dict(), "status": "ok", "reason": ""})
    return rows


def learned_shapes(model):
    """Every learned norm scale and bias, and every projection bias, of ``model``.

    Returns a list of dicts (one per parameter, in module order) with keys module (qualified
    name), class, parameter, kind ("norm scale" for a norm parameter named ``*weight``, e.g.
    QKNorm's ``q_weight``; "norm bias" for ``*bias``; "norm <name>" for another parameter of a
    norm; "projection bias"), shape, dtype and numel. A norm is a module for which
    ``normtools.cards.is_norm_module`` holds; the projection biases are exactly
    ``normtools.cards.bias_parameters(model)`` (linear layers, routers, and expert tensors such
    as gpt-oss's ``mlp.experts.gate_up_proj_bias``).
    """
    from normtools.cards.params import bias_parameters, is_norm_module

    biases = bias_parameters(model)
    rows = []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if is_norm_module(module):
            kinds = {p: "norm scale" if p.endswith("weight") else
                        "norm bias" if p.endswith("bias") else f"norm {p}" for p in own}
        else:
            kinds = {p: "projection bias" for p in own
                     if (f"{name}.{p}" if name else p) in biases}
        for pname, kind in kinds.items():
            p = own[pname]
            rows.append({"module": name, "class": type(module).__name__, "parameter": pname,
                         "kind": kind, "shape": tuple(p.shape),
                         "dtype": str(p.dtype).removeprefix("torch."), "numel": p.numel()})
    return rows

"""Input checks shared by every normtools op (RMSNorm, LayerNorm, QK-Norm).

Each check raises a clear ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
shape, device or value) before anything is launched.
"""

import math
import numbers

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASTINGS = ("llama", "gemma")
BACKENDS = ("auto", "torch", "triton")


def _dtype_names():
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def check_input(x, name="x"):
    """x must be a tensor of a supported dtype whose last (normalized) dimension is not empty."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are {_dtype_names()}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension (the normalized one), "
                         f"got shape {tuple(x.shape)}")


def check_like(other, x, name, other_x_name="x"):
    """``other`` (e.g. the residual) must match x in shape, dtype and device."""
    check_input(other, name)
    if other.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(other.shape)}, expected {other_x_name}'s "
                         f"shape {tuple(x.shape)}")
    if other.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {other.dtype}, expected {other_x_name}'s dtype {x.dtype}")
    if other.device != x.device:
        raise ValueError(f"{name} is on {other.device} but {other_x_name} is on {x.device}")


def check_param(param, x, name):
    """An optional per-feature parameter (weight, bias): None, or shape (N,) with N = x.shape[-1],
    on x's device, of dtype float32 or x's dtype."""
    if param is None:
        return
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(param).__name__}")
    n = x.shape[-1]
    if param.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(param.shape)}, expected ({n},) "
                         f"to match the last dimension of x")
    if param.device != x.device:
        raise ValueError(f"{name} is on {param.device} but x is on {x.device}")
    if param.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{name} has dtype {param.dtype}; supported are float32 or x's dtype "
                        f"({x.dtype})")


def _is_real(value):
    """A Python real number (not a bool), or the symbolic float / int that torch.compile passes
    for one once it has seen two different values."""
    if type(value) in (float, int):   # the usual case, without the ABC check below
        return True
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return True
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


# The statistics are computed in float32 for every input dtype: an eps below float32's smallest
# normal number is subnormal there (or rounds to 0, as 1e-50 does), and an all-zero row gives NaN.
SMALLEST_EPS = torch.finfo(torch.float32).tiny


def check_eps(eps):
    """eps must be a finite real number, at least float32's smallest normal number
    (``SMALLEST_EPS`` ≈ 1.18e-38: the statistics are computed in float32).

    Written with comparisons only (a NaN fails both), so that it also holds for the symbolic
    float of a traced eps: ``torch.compile(fullgraph=True)`` guards on it instead of breaking
    the graph (``math.isfinite`` cannot take a symbolic float)."""
    if not _is_real(eps):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not SMALLEST_EPS <= eps < math.inf:
        raise ValueError(f"eps must be finite and > 0, at least float32's smallest normal number "
                         f"{SMALLEST_EPS:.3g} (the statistics are float32), got {float(eps)}")


def check_offset(offset):
    """offset (added to the weight in float32) must be a finite real number (comparisons only,
    as in ``check_eps``)."""
    if not _is_real(offset):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if not -math.inf < offset < math.inf:
        raise ValueError(f"offset must be finite, got {float(offset)}")


def check_choice(name, value, choices):
    """value must be one of choices (``name`` says what it is in the error)."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def check_casting(casting):
    """casting must be one of CASTINGS."""
    if casting not in CASTINGS:
        raise ValueError(f"unknown casting {casting!r}; expected one of {', '.join(CASTINGS)}")


def check_backend(backend):
    """backend must be one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")

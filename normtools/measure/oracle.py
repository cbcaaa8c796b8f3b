"""How a kernel's result is checked against a float64 oracle: the tolerance of the kernel tests
(``tests/_oracle.py``) and of the GPU run's cluster pass (``normtools.measure.cluster_check``),
defined once here.

Tolerance, per input dtype:

* float32: max|out − ref64| ≤ 1e-5 · max(max|ref64|, 1) (max relative error, normwise; the
  floor of 1 matters only when the exact result is ~0 through cancellation, e.g. dx for N = 1,
  where float32 rounding of O(1) intermediates is all that is left);
* float16 / bfloat16: |out − ref64| ≤ 2 · |same − ref64| + atol + ulp(ref64) elementwise, where
  ``same`` is plain PyTorch computing the same thing in the same dtype (atol 1e-2 fp16, 5e-2
  bf16; ulp(v) = finfo(dtype).eps · |v|): the error of the kernel is bounded by a small
  multiple of the error the framework's own same-dtype computation makes.

``run_with_grads`` runs a function forward and backward on fresh leaves, the way every
comparison gets its outputs and gradients.
"""

import torch

__all__ = ["FP32_MAX_REL_ERR", "LOW_PRECISION_FACTOR", "LOW_PRECISION_ATOL", "oracle_excess",
           "run_with_grads"]

FP32_MAX_REL_ERR = 1e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_ATOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def oracle_excess(out, ref64, same, dtype):
    """(excess, description) of ``out`` against the float64 ``ref64`` with the tolerance of input
    dtype ``dtype`` (see the module docstring); ``same`` is the plain-PyTorch result in the same
    dtype (used for float16 / bfloat16). ``out`` is within the tolerance when excess ≤ 0: for
    float32 excess = max relative error − 1e-5, else max(|out − ref64| − bound). Tensors on any
    one device; no elements: (-inf, "no elements")."""
    if out.numel() == 0:
        return float("-inf"), "no elements"
    err = (out.double() - ref64).abs()
    if dtype == torch.float32:
        scale = ref64.abs().max().clamp_min(1.0)
        rel = (err.max() / scale).item()
        return rel - FP32_MAX_REL_ERR, f"max relative error {rel:.3g} (bound {FP32_MAX_REL_ERR})"
    # one ulp of the value itself: rounding the result to ``dtype`` is unavoidable, and ``same``
    # may round an element exactly by luck (matters for large values, e.g. dx of rows at the
    # scale of eps)
    bound = (LOW_PRECISION_FACTOR * (same.double() - ref64).abs() + LOW_PRECISION_ATOL[dtype]
             + torch.finfo(dtype).eps * ref64.abs())
    worst = (err - bound).max().item()
    return worst, (f"|out − ref64| exceeds 2·|same − ref64| + atol + 1 ulp by {worst:.3g} "
                   f"(max error {err.max().item():.3g}, {dtype})")


def run_with_grads(fn, inputs, grad_outputs, cast=None):
    """Call ``fn(*leaves)`` on fresh leaf copies of ``inputs`` (optionally ``.to(cast)``; None and
    non-tensors pass through), backpropagate ``grad_outputs`` (one per output, or None for an
    output that gets no gradient) and return (outputs, gradients of the tensor inputs)."""
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() if isinstance(t, torch.Tensor)
              else t for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grad_outputs) if g is not None]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    grads = torch.autograd.grad([o for o, _ in pairs], tensors, [g for _, g in pairs],
                                allow_unused=True)
    return [o.detach() for o in outputs], list(grads)

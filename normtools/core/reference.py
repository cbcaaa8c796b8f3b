"""Reference math of RMSNorm, LayerNorm and RoPE in plain PyTorch: the few lines that compute them.

These functions are the single source of truth for the numerics of normtools. They are written
with the same PyTorch operations, in the same order, as the Hugging Face transformers modules,
so that they reproduce them bit for bit (``torch.equal``) for the same input and weight dtypes:

* ``casting="llama"`` — ``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``MiniMaxM2RMSNorm``:
  normalize in float32, cast the normalized row back to the input dtype, then multiply by the
  weight (with PyTorch type promotion: a float32 weight and a bfloat16 input give float32).
* ``casting="gemma"`` — ``Gemma3RMSNorm`` (offset 1), ``Olmo2RMSNorm`` and ``GptOssRMSNorm``
  (offset 0): normalize and multiply by the weight in float32, then cast to the input dtype.

Statistics (the inverse RMS, the mean and variance of LayerNorm) are always float32. The offset
of a "zero-centred" weight (Gemma's ``1 + w``) is always added in float32: in bfloat16,
``1 + 0.0039`` rounds to ``1``.

``backend="torch"`` runs these functions as plain PyTorch operations; RMSNorm through
``rms_norm_native``, the same numbers from torch's own ``torch.nn.functional.rms_norm``. The
backward functions give the analytic gradients in float32 from the saved statistics: the torch
backend's autograd functions and the custom ops (for a tensor subclass such as a DTensor, and
under ``torch.compile``) run them backward (see ``normtools.core.ops``).
"""

import torch
import torch.nn.functional as F

__all__ = [
    "inv_rms",
    "rms_norm_output_dtype",
    "rms_norm_reference",
    "rms_norm_apply",
    "rms_norm_native",
    "rms_norm_native_with_rstd",
    "rms_norm_backward_reference",
    "layer_norm_statistics",
    "layer_norm_reference",
    "layer_norm_apply",
    "layer_norm_backward_reference",
    "rotate_half",
    "rope_reference",
    "rope_tables",
    "rope_backward_reference",
]


def inv_rms(x, eps):
    """Inverse root mean square over the last dimension, in float32, keeping that dimension.

    r = rsqrt(mean(x.float()², -1) + eps)
    """
    x = x.to(torch.float32)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_output_dtype(x_dtype, weight_dtype, casting):
    """Dtype of an RMSNorm output.

    "gemma" casts the float32 product back to the input dtype. "llama" multiplies the weight by
    the normalized row cast to the input dtype, so PyTorch's type promotion decides:
    ``promote(weight_dtype, x_dtype)`` (a float32 weight with a bfloat16 input gives float32).
    Without a weight the output has the input dtype.
    """
    if casting == "llama" and weight_dtype is not None:
        return torch.promote_types(weight_dtype, x_dtype)
    return x_dtype


def rms_norm_reference(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """RMSNorm over the last dimension.

    With x̂ = x.float() · r and r = rsqrt(mean(x.float()², -1) + eps):

    * casting="llama":  y = (offset + w) · x̂.to(x.dtype)       (product rounded once to
      promote(w.dtype, x.dtype); with offset 0 this is exactly ``w * x̂.to(x.dtype)``)
    * casting="gemma":  y = (x̂ · (offset + w.float())).to(x.dtype)

    ``weight=None`` means no learned scale: y = x̂ in the output dtype (the offset is unused).
    """
    return rms_norm_apply(x, inv_rms(x, eps), weight, offset, casting)


def rms_norm_apply(x, rstd, weight=None, offset=0.0, casting="llama"):
    """The last step of ``rms_norm_reference`` for a given float32 inverse RMS ``rstd`` (``(..., 1)``).

    y = (offset + w) · (x.float() · r).to(x.dtype)  ("llama"),  (x.float() · r · (offset + w)).to(x.dtype)
    ("gemma"). Split out for callers whose statistic spans more than the local row, such as
    per-layer QK-Norm under tensor parallelism, where r comes from an all-reduce.
    """
    input_dtype = x.dtype
    hidden = x.to(torch.float32) * rstd
    if weight is None:
        return hidden.to(input_dtype)
    out_dtype = rms_norm_output_dtype(input_dtype, weight.dtype, casting)
    scale = offset + weight.to(torch.float32)
    if casting == "llama":
        return (scale * hidden.to(input_dtype)).to(out_dtype)
    return (hidden * scale).to(out_dtype)


def _fused_rms_norm_op():
    """torch's fused RMSNorm op, the one F.rms_norm calls, where it takes (x, normalized_shape,
    weight, eps) on any device and returns (y, r), y the bits of F.rms_norm (recent torch; an
    older one had an op of that name for MPS only, with another signature): tried once on a
    small CPU row; None where it is missing or differs."""
    fused = getattr(torch, "_fused_rms_norm", None)
    if fused is None:
        return None
    row = torch.tensor([[0.5, -1.0, 2.0]])
    try:
        y, _ = fused(row, [3], None, 1e-6)
    except (RuntimeError, TypeError, ValueError):
        return None
    return fused if torch.equal(y, F.rms_norm(row, (3,), None, 1e-6)) else None


_FUSED_RMS_NORM = _fused_rms_norm_op()


def _f_rms_norm(x, scale, eps):
    """(F.rms_norm(x, (N,), scale, eps), r) with r the float32 inverse RMS (``(..., 1)``) the op
    computes: one call of torch's fused op where this torch has it (``_fused_rms_norm_op``),
    else (and under ``torch.compile``, whose Dynamo does not trace that binding; Inductor drops
    an unused r) F.rms_norm and ``inv_rms``."""
    if _FUSED_RMS_NORM is None or torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), scale, eps), inv_rms(x, eps)
    return _FUSED_RMS_NORM(x, [x.shape[-1]], scale, eps)


def rms_norm_native_with_rstd(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """(y, r): ``rms_norm_reference`` computed with torch's RMSNorm op ``F.rms_norm``, bit for
    bit, and the float32 inverse RMS r (``(..., 1)``) it computed on the way.

    ``F.rms_norm(x, (N,), s, eps)`` is ``(x.float() · r).to(x.dtype) · s`` with
    r = rsqrt(mean(x.float()², -1) + eps), the reference's operations in its order, in one call,
    where its result is the reference's (checked by tests/core/test_hf_parity_norms.py):

    * without a weight: ``F.rms_norm(x, (N,), None, eps)``;
    * "llama": a float32 x with a (N,) scale s = offset + w: ``F.rms_norm(x, (N,), s, eps)``;
      otherwise ``s · F.rms_norm(x, (N,), None, eps)`` cast to promote(w, x) (with a bfloat16
      or float16 weight torch's op does not round x̂ before the multiply);
    * "gemma": ``F.rms_norm(x.float(), (N,), s, eps).to(x.dtype)``, s = offset + w.float()
      (x̂ is not rounded before the multiply);

    a weight of more than one dimension (QK-Norm's (H, N), one row per head) multiplies outside.
    """
    if weight is None:
        return _f_rms_norm(x, None, eps)
    if casting == "gemma":
        scale = offset + weight.to(torch.float32)
        if weight.dim() == 1:
            normed, rstd = _f_rms_norm(_float32(x), scale, eps)
        else:
            normed, rstd = _f_rms_norm(_float32(x), None, eps)
            normed = normed * scale
        return _cast(normed, x.dtype), rstd
    scale = weight if offset == 0 else offset + weight.to(torch.float32)
    if x.dtype == torch.float32 and weight.dim() == 1:
        return _f_rms_norm(x, scale, eps)
    normed, rstd = _f_rms_norm(x, None, eps)
    return _cast(scale * normed, rms_norm_output_dtype(x.dtype, weight.dtype, casting)), rstd


def rms_norm_native(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """``rms_norm_reference`` computed with torch's RMSNorm op, bit for bit: the result of
    ``rms_norm_native_with_rstd``."""
    return rms_norm_native_with_rstd(x, weight, eps, offset, casting)[0]


def rms_norm_backward_reference(dy, x, weight, rstd, offset=0.0):
    """Gradients of RMSNorm from the saved float32 inverse RMS ``rstd`` (shape ``(..., 1)``).

    With x̂ = x · r, y = s ⊙ x̂ and s = offset + w (s = 1 without a weight), and g = s ⊙ dy:

        dx = r · (g − x̂ · mean(x̂ ⊙ g, -1))
        dw = Σ_rows dy ⊙ x̂

    (the cast of x̂ to the input dtype in "llama" casting is treated as the identity).
    Returns (dx in x.dtype, dw in weight.dtype or None); all math in float32.

    Written for few passes, buffers and calls, which decide its time at a small row block
    (issue 35: a call costs a few µs before any arithmetic, and each new buffer is a cold one):
    p = dy ⊙ x̂ serves both gradients, dw its sum over the rows and Σ x̂ ⊙ g = p · s one
    matrix-vector product per row block; dx is computed in g's buffer, and the float32 copies
    of bfloat16 inputs are reused in place; the 1/N rides on addcmul's scalar; a cast runs only
    where the dtype changes.
    """
    x_hat = x.to(torch.float32).mul_(rstd) if x.dtype != torch.float32 else x * rstd
    dy32 = _float32(dy)
    dy_x_hat = dy32 * x_hat
    if weight is None:
        g, row_dot = dy32.clone() if dy32 is dy else dy32, dy_x_hat.sum(-1, keepdim=True)
    else:
        scale = _float32(weight) if offset == 0 else weight.to(torch.float32) + offset
        g = dy32 * scale if dy32 is dy else dy32.mul_(scale)
        # Σ_j x̂ g = Σ_j p s: a (.., N) @ (N,) product, or per head for a (H, N) scale
        row_dot = (dy_x_hat @ scale if scale.dim() == 1
                   else torch.linalg.vecdot(dy_x_hat, scale)).unsqueeze(-1)
    dx = _cast(g.addcmul_(x_hat, row_dot, value=-1 / x.shape[-1]).mul_(rstd), x.dtype)
    if weight is None:
        return dx, None
    # Σ over the leading dims (a (H, N) weight keeps its heads); a single row is its own sum
    leading = tuple(range(dy_x_hat.dim() - weight.dim()))
    dw = dy_x_hat.sum(leading) if leading else dy_x_hat
    return dx, _cast(dw, weight.dtype)


def _float32(t):
    """t in float32: ``_cast(t, torch.float32)``."""
    return _cast(t, torch.float32)


def _cast(t, dtype):
    """t in ``dtype``; t itself where it has it (``.to`` then returns t too, after a dispatch
    of about a µs, which the backward's small calls cannot spare)."""
    return t if t.dtype == dtype else t.to(dtype)


def layer_norm_statistics(x, eps):
    """Mean and inverse standard deviation over the last dimension, in float32, keepdim.

    mean = mean(x.float(), -1),  rstd = rsqrt(mean((x.float() − mean)², -1) + eps)
    (the biased variance, as ``torch.nn.LayerNorm``).
    """
    _, mean, rstd = _centered_statistics(x.to(torch.float32), eps)
    return mean, rstd


def _centered_statistics(x32, eps):
    """(x32 − mean, mean, rstd) of a float32 x32: ``layer_norm_statistics`` with the centred
    row it computes on the way."""
    mean = x32.mean(-1, keepdim=True)
    centered = x32 - mean
    return centered, mean, torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the last dimension, computed in float32 and cast to x.dtype.

    y = ((x − mean) · rstd · w + b).to(x.dtype), mean and rstd from ``layer_norm_statistics``;
    w = 1 and b = 0 when absent. (x − mean) is computed once, for the variance and for y.
    """
    centered, _, rstd = _centered_statistics(x.to(torch.float32), eps)
    return _scale_and_shift(centered * rstd, weight, bias).to(x.dtype)


def layer_norm_apply(x, mean, rstd, weight=None, bias=None):
    """The last step of ``layer_norm_reference`` for given float32 statistics ``mean`` and
    ``rstd`` (``(..., 1)``): y = ((x.float() − mean) · rstd · w + b).to(x.dtype)."""
    return _scale_and_shift((x.to(torch.float32) - mean) * rstd, weight, bias).to(x.dtype)


def _scale_and_shift(x_hat, weight, bias):
    """x̂ · w + b in float32 (w = 1, b = 0 when absent)."""
    if weight is not None:
        x_hat = x_hat * weight.to(torch.float32)
    if bias is not None:
        x_hat = x_hat + bias.to(torch.float32)
    return x_hat


def layer_norm_backward_reference(dy, x, weight, bias, mean, rstd):
    """Gradients of LayerNorm from the saved float32 ``mean`` and ``rstd`` (shape ``(..., 1)``).

    With x̂ = (x − mean) · r, y = w ⊙ x̂ + b and g = w ⊙ dy (g = dy without a weight):

        dx = r · (g − mean(g, -1) − x̂ · mean(x̂ ⊙ g, -1))
        dw = Σ_rows dy ⊙ x̂,    db = Σ_rows dy

    Returns (dx in x.dtype, dw in weight.dtype or None, db in bias.dtype or None); all math in
    float32.
    """
    n = x.shape[-1]
    dy32 = dy.to(torch.float32)
    x_hat = (x.to(torch.float32) - mean).mul_(rstd)
    g = dy32 if weight is None else dy32 * weight.to(torch.float32)
    # in place where a temporary is free: the same roundings, fewer (M, N) buffers allocated
    dx = (g - g.mean(-1, keepdim=True)).sub_(x_hat * (x_hat * g).mean(-1, keepdim=True)).mul_(rstd)
    dw = None if weight is None else (dy32 * x_hat).reshape(-1, n).sum(0).to(weight.dtype)
    db = None if bias is None else dy32.reshape(-1, n).sum(0).to(bias.dtype)
    return dx.to(x.dtype), dw, db


def rotate_half(x):
    """(x₁, x₂) ↦ (−x₂, x₁) over the two halves of the last dimension (transformers' form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x, cos, sin):
    """Rotary position embedding of one tensor, with the operations and order of transformers'
    ``apply_rotary_pos_emb`` (so that it equals it bit for bit):

        RoPE(x) = x · cos + rotate_half(x) · sin

    in PyTorch's promoted dtype of x, cos and sin (each product and the sum rounded to it).
    ``cos`` and ``sin`` broadcast against x (e.g. (T, 1, D) for x of shape (T, H, D)).
    """
    return (x * cos) + (rotate_half(x) * sin)


def rope_tables(n_tokens, head_dim, theta, dtype=torch.float32, device=None):
    """(cos, sin), each (n_tokens, head_dim): the rotary tables of positions 0 … n_tokens − 1 as
    transformers' default RoPE builds them,

        angle[t, j] = t · theta^(−2 (j mod D/2) / D)      (D = head_dim)

    (the D/2 frequencies repeated over the two halves, so that the pair (j, j + D/2) turns by one
    angle), computed in float32 on ``device``, then cast to ``dtype``."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)
    angles = torch.arange(n_tokens, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_backward_reference(dout, cos, sin):
    """Gradient of ``rope_reference`` with respect to x, in float32 (roundings as identity):

        dx = dout · cos + rotate_halfᵀ(dout · sin),   rotate_halfᵀ(u₁, u₂) = (u₂, −u₁)
    """
    dout32 = _float32(dout)
    u1, u2 = (dout32 * _float32(sin)).chunk(2, dim=-1)
    return torch.cat((u2, -u1), dim=-1).addcmul_(dout32, _float32(cos))

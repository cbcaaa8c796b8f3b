"""Moving a norm's learned scale between conventions, and what a mismatch costs (chapter 3).

A norm multiplies by a scale s = offset + w. Llama-style checkpoints store s itself (offset 0);
Gemma-style checkpoints store a zero-centred w and the module adds 1 (offset 1). Re-expressing a
stored weight in the other convention keeps s:

    offset_from + w = offset_to + w'   ⇒   w' = w + (offset_from − offset_to)

:func:`convert_scale` does that sum in float32. Whether the result is exact depends on where it is
stored: in float32 it is (s is the same float32 number the module would compute), in bfloat16 it
is rounded, and 1 + w loses the low bits of a small w (in bfloat16, 1 + 2⁻⁹ rounds to 1).
:func:`head_rms` reads each head's RMS of a (..., H·head_dim) projection, the quantity that a
per-head QK-Norm sets to 1 and a per-layer one leaves free. :func:`naive_tp_qk_norm` is the
mistake a tensor-parallel port of a per-layer QK-Norm can make: each rank normalizes its own
column shard with the shard's mean square instead of the token's (``normtools.core.tp.qk_norm`` is the
right version, with one all-reduce).
"""

import torch

from normtools.core import _validate, qk, tp

__all__ = ["convert_scale", "head_rms", "naive_tp_qk_norm"]


def convert_scale(weight, from_offset, to_offset, dtype=None):
    """The weight w' with to_offset + w' = from_offset + w, computed in float32.

    ``dtype`` is the storage dtype of the result (default: ``weight.dtype``); pass
    ``torch.float32`` to keep the conversion exact. Gemma → Llama: ``convert_scale(w, 1, 0)``.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor, got {weight.dtype}")
    _validate.check_offset(from_offset)
    _validate.check_offset(to_offset)
    dtype = weight.dtype if dtype is None else dtype
    shift = float(from_offset) - float(to_offset)
    return (weight.to(torch.float32) + shift).to(dtype)


def head_rms(x, head_dim):
    """RMS of each head of x (..., H·head_dim), in float32: shape (..., H).

    rms_h = sqrt(mean over the head's head_dim features of x²)
    """
    _validate.check_input(x)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if x.shape[-1] % head_dim:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of head_dim={head_dim}")
    heads = x.to(torch.float32).unflatten(-1, (x.shape[-1] // head_dim, head_dim))
    return heads.pow(2).mean(-1).sqrt()


def naive_tp_qk_norm(q, k, q_weight, k_weight, eps=1e-6, *, head_dim, world_size, offset=0.0,
                     casting="llama"):
    """Per-layer QK-Norm as P = ``world_size`` ranks would compute it without communication.

    q (T, Hq·head_dim), k (T, Hk·head_dim) and the per-layer weights are split by heads as a
    column-parallel projection splits them (``normtools.core.tp.shard_columns``/``shard_weight``);
    each rank j normalizes its shard x_j on its own,

        y_j = (offset + w_j) · x_j · rsqrt(mean(x_j²) + eps),

    and the shards are put back together (``tp.unshard_columns``). Returns (q_naive, k_naive),
    to compare with the single-device ``normtools.qk_norm(..., scope="per_layer")``.
    """
    qk.check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, "per_layer", offset, casting, "torch")
    if q.dim() != 2 or k.dim() != 2:
        raise ValueError(f"q and k must be (tokens, H*head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    heads = {"q": q.shape[-1] // head_dim, "k": k.shape[-1] // head_dim}
    pieces = {"q": [], "k": []}
    for rank in range(world_size):
        cut = dict(head_dim=head_dim, world_size=world_size, rank=rank)
        q_j = tp.shard_columns(q, num_heads=heads["q"], **cut)
        k_j = tp.shard_columns(k, num_heads=heads["k"], **cut)
        wq_j = tp.shard_weight(q_weight, num_heads=heads["q"], **cut)
        wk_j = tp.shard_weight(k_weight, num_heads=heads["k"], **cut)
        q_out, k_out = qk.qk_norm(q_j, k_j, wq_j, wk_j, eps, head_dim=head_dim, scope="per_layer",
                                  offset=offset, casting=casting, backend="torch")
        pieces["q"].append(q_out)
        pieces["k"].append(k_out)
    return tuple(tp.unshard_columns(pieces[name], head_dim=head_dim, num_heads=heads[name],
                                    world_size=world_size) for name in ("q", "k"))

"""Moving a norm's learned scale between conventions, and what a mismatch costs (chapter 3).

A norm multiplies by a scale s = offset + w. Llama-style checkpoints store s itself (offset 0);
Gemma-style checkpoints store a zero-centred w and the module adds 1 (offset 1). Re-expressing a
stored weight in the other convention keeps s:

    offset_from + w = offset_to + w'   ⇒   w' = w + (offset_from − offset_to)

:func:`convert_scale` does that sum in float32. Whether the result is exact depends on where it is
stored: in float32 it is (s is the same float32 number the module would compute), in bfloat16 it
is rounded, and 1 + w loses the low bits of a small w (in bfloat16, 1 + 2⁻⁹ rounds to 1).
:func:`head_rms` reads each head's RMS of a (..., H·head_dim) projection, the quantity that a
per-head QK-Norm sets to 1 and a per-layer one leaves free.
"""

import torch

from normtools import _validate

__all__ = ["convert_scale", "head_rms"]


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

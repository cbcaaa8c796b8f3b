"""Moving a norm's learned scale between conventions (the scale parameterization s = offset + w).

A norm multiplies by a scale s = offset + w. Llama-style checkpoints store s itself (offset 0);
Gemma-style checkpoints store a zero-centred w and the module adds 1 (offset 1). Re-expressing a
stored weight in the other convention keeps s:

    offset_from + w = offset_to + w'   ⇒   w' = w + (offset_from − offset_to)

:func:`convert_scale` does that sum in float32. Whether the result is exact depends on where it is
stored: in float32 it is (s is the same float32 number the module would compute), in bfloat16 it
is rounded, and 1 + w loses the low bits of a small w (in bfloat16, 1 + 2⁻⁹ rounds to 1).
"""

import torch

from normtools.core import validate


def convert_scale(weight, from_offset, to_offset, dtype=None):
    """The weight w' with to_offset + w' = from_offset + w, computed in float32.

    ``dtype`` is the storage dtype of the result (default: ``weight.dtype``); pass
    ``torch.float32`` to keep the conversion exact. Gemma → Llama: ``convert_scale(w, 1, 0)``.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor, got {weight.dtype}")
    validate.check_offset(from_offset)
    validate.check_offset(to_offset)
    dtype = weight.dtype if dtype is None else dtype
    shift = float(from_offset) - float(to_offset)
    return (weight.to(torch.float32) + shift).to(dtype)

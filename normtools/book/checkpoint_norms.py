"""The norm tensors of a safetensors checkpoint: names, dtypes and shapes, and where the values sit.

A checkpoint names each tensor after the module that owns it: ``model.layers.0.input_layernorm.
weight``, ``encoder.layer.0.output.LayerNorm.bias``. A norm's tensors are those whose module
name (the name without its last part) contains "norm" in any case. For each one, the dtype and
shape come from the file's header (:func:`normtools.cards.safetensors_header.read_header`), and
the values, read one tensor at a time, give its centre and spread in float64:

    mean = (1/n) Σ vᵢ        std = √((1/n) Σ (vᵢ − mean)²)

A stored scale centred near 1 is the multiplier itself (``w``); one centred near 0 is either an
offset from one (``1 + w``) or a norm that multiplies by almost nothing: the tensor cannot say
which, the card records it.
"""

import re

import torch

from normtools.cards.safetensors_header import read_header

__all__ = ["norm_tensors"]

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer)\.(\d+)\.")


def norm_tensors(path) -> dict:
    """``{name: row}`` for every norm tensor of the ``.safetensors`` file at ``path``, in the
    file's order. A row holds ``layer`` (the block index in the name, or ``None`` for a tensor
    outside the blocks), ``dtype`` (the header's spelling, e.g. ``"BF16"``), ``shape`` and the
    values' ``mean``, ``std``, ``min`` and ``max`` (float64, population std)."""
    from safetensors import safe_open

    header = read_header(path)
    names = [name for name in header if "norm" in name.rpartition(".")[0].lower()]
    rows = {}
    with safe_open(str(path), framework="pt") as f:
        for name in names:
            values = f.get_tensor(name).to(torch.float64)
            layer = _LAYER_INDEX.search(name)
            rows[name] = {"layer": int(layer.group(1)) if layer else None,
                          "dtype": header[name].dtype, "shape": header[name].shape,
                          "mean": values.mean().item(), "std": values.std(correction=0).item(),
                          "min": values.min().item(), "max": values.max().item()}
    return rows

"""RMSNorm against LayerNorm on the same rows, and the rows the norms of a model receive.

With the row mean μ and standard deviation σ (so that rms² = μ² + σ²) and no weight or bias,

    LayerNorm(x) = (x − μ) / σ,      RMSNorm(x) = x / √(μ² + σ²),

and, ignoring eps, the relative distance between the two outputs depends on ρ = μ/σ alone:

    ‖RMSNorm(x) − LayerNorm(x)‖ / ‖LayerNorm(x)‖ = √(2 − 2/√(1 + ρ²))

(zero on zero-mean rows; √2 in the limit of a row that is all mean). :func:`rms_layer_gap`
measures it, :func:`rms_layer_gap_theory` is the formula, and :func:`norm_inputs` collects the
rows that the norms of a model actually receive.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from normtools.cards.params import is_norm_module
from normtools.core import ops, reference


def rms_layer_gap(x: torch.Tensor, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    """Per row of ``x`` (last dimension): how far RMSNorm is from LayerNorm, both without weight
    or bias and with the same ``eps``.

    Returns float32 tensors of shape ``x.shape[:-1]``:
    ``rel_gap`` = ‖rms_norm(x) − layer_norm(x)‖ / ‖layer_norm(x)‖ and
    ``mean_to_std`` = |μ| / σ (σ the biased standard deviation, as LayerNorm uses).
    """
    x = x.detach().to(torch.float32)
    rms_out = ops.rms_norm(x, None, eps, backend="torch")
    layer_out = ops.layer_norm(x, None, None, eps, backend="torch")
    mean, rstd = reference.layer_norm_statistics(x, 0.0)
    return {
        "rel_gap": (rms_out - layer_out).norm(dim=-1) / layer_out.norm(dim=-1),
        "mean_to_std": (mean * rstd).abs().squeeze(-1),
    }


def rms_layer_gap_theory(mean_to_std: torch.Tensor) -> torch.Tensor:
    """The eps-free relative gap √(2 − 2/√(1 + ρ²)) for ρ = |μ|/σ (see the module docstring)."""
    rho = torch.as_tensor(mean_to_std, dtype=torch.float64)
    return (2.0 - 2.0 / torch.sqrt(1.0 + rho**2)).sqrt()


def norm_inputs(model: nn.Module, run) -> dict[str, torch.Tensor]:
    """The input of every norm module of ``model`` (``normtools.cards.params.is_norm_module``)
    during ``run()`` (a callable that runs the model), as {module name: rows (-1, features),
    float32}: the rows its statistics run over (tokens for block norms, heads for a per-head
    QK-Norm). A module called several times keeps its rows from all calls, concatenated."""
    captured: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, args):
            captured.setdefault(name, []).append(args[0].detach().float().reshape(-1, args[0].shape[-1]))
        return hook

    handles = [m.register_forward_pre_hook(keep(name)) for name, m in model.named_modules() if is_norm_module(m)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(rows) for name, rows in captured.items()}

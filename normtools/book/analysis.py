"""The small computations behind chapters 1 (Definition) and 2 (Flow).

* RMSNorm against LayerNorm on the same rows (:func:`rms_layer_gap`): with the row mean μ and
  standard deviation σ (so that rms² = μ² + σ²) and no weight or bias,

      LayerNorm(x) = (x − μ) / σ,      RMSNorm(x) = x / √(μ² + σ²),

  and, ignoring eps, the relative distance between the two outputs depends on ρ = μ/σ alone:

      ‖RMSNorm(x) − LayerNorm(x)‖ / ‖LayerNorm(x)‖ = √(2 − 2/√(1 + ρ²))

  (zero on zero-mean rows; √2 in the limit of a row that is all mean). :func:`norm_inputs`
  collects the rows that the norms of a model actually receive.
* Cost per row (:func:`count_flops`, :func:`row_costs`): the arithmetic of the reference code
  in ``normtools.core.reference``, counted by running it on meta tensors, and the bytes it must move.
* The amplifier analogy (:func:`random_amplifiers`, :func:`signal_through_stages`): a signal
  through a chain of random linear stages, with or without a leveller after each stage.
* Block equations from norm cards (:func:`tinylm_config_from_spec`,
  :func:`block_equation_from_spec`, :func:`norm_legend`): a ``ModelNormSpec`` is turned into the
  TinyLM configuration with the same placement, and TinyLM's own equation printer renders it.
* :func:`tiny_hf_model`: a randomly initialized transformers model of a supported family, built
  from ``normtools.cards.tiny_config`` (nothing is downloaded). :func:`forced_flags` lists the
  boolean switches that a tiny config sets against the family's published default (e.g. Phi's
  ``qk_layernorm``), and :func:`family_default_config` resets them to that default, read from
  the transformers config class.
* QK-Norm scopes (:func:`statistic_footprint`, :func:`draw_statistic_footprint`): which
  elements of a (T, H, d) projection feed the statistic of one element, read from the gradient
  of ``normtools.qk_norm``, and a drawing of that region.
* Residual growth with depth (:func:`residual_growth`, :func:`growth_exponent`): the RMS of the
  residual stream after the last block of a freshly initialized TinyLM, over depths and seeds,
  and the exponent a of RMS ∝ depth^a fitted in log-log (a = 1 linear growth, a = 1/2 √depth).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from normtools.cards.params import is_norm_module
from normtools.core import reference

__all__ = [
    "rms_layer_gap", "rms_layer_gap_theory", "norm_inputs",
    "count_flops", "tensor_bytes", "row_costs",
    "random_amplifiers", "signal_through_stages",
    "tinylm_config_from_spec", "block_equation_from_spec", "norm_legend", "tiny_hf_model",
    "forced_flags", "family_default_config",
    "statistic_footprint", "draw_statistic_footprint", "residual_growth", "growth_exponent",
    "plot_profile_rows",
]


# ----------------------------------------------------------------------------------------------
# RMSNorm against LayerNorm


def rms_layer_gap(x: torch.Tensor, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    """Per row of ``x`` (last dimension): how far RMSNorm is from LayerNorm, both without weight
    or bias and with the same ``eps``.

    Returns float32 tensors of shape ``x.shape[:-1]``:
    ``rel_gap`` = ‖rms_norm(x) − layer_norm(x)‖ / ‖layer_norm(x)‖ and
    ``mean_to_std`` = |μ| / σ (σ the biased standard deviation, as LayerNorm uses).
    """
    from normtools.core import ops

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


# ----------------------------------------------------------------------------------------------
# Cost per row

_aten = torch.ops.aten
#: Elementwise arithmetic: one operation per output element.
_ELEMENTWISE = {_aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.mul.Tensor,
                _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar, _aten.pow.Tensor_Scalar,
                _aten.rsqrt.default, _aten.sqrt.default, _aten.neg.default, _aten.rsub.Scalar}
#: Reductions: one operation per input element.
_REDUCTIONS = {_aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim, _aten.mean.default}
#: Data movement only (views, casts, copies, allocation): no arithmetic.
_FREE = {_aten._to_copy.default, _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
         _aten.expand.default, _aten.clone.default, _aten.copy_.default, _aten.detach.default,
         _aten.alias.default, _aten.empty.memory_format, _aten.t.default, _aten.unsqueeze.default,
         _aten.squeeze.dim, _aten.lift_fresh.default}


class _FlopCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ELEMENTWISE:
            self.flops += out.numel()
        elif func in _REDUCTIONS:
            self.flops += args[0].numel()
        elif func not in _FREE and isinstance(out, torch.Tensor):
            raise NotImplementedError(f"count_flops does not know how to count {func}")
        return out


def count_flops(fn, *args, **kwargs):
    """(fn(*args, **kwargs), number of arithmetic operations it executed).

    Counted at the ATen level: an elementwise op costs one operation per output element, a sum
    or mean one per input element, casts, views, copies and ops without a tensor result nothing.
    An ATen op outside these lists raises NotImplementedError rather than being counted wrong.
    Run it on meta tensors to count without computing.
    """
    counter = _FlopCounter()
    with counter:
        out = fn(*args, **kwargs)
    return out, counter.flops


def tensor_bytes(*values) -> int:
    """Bytes of every tensor among ``values`` (nested tuples and lists allowed; None ignored)."""
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (tuple, list)):
            total += tensor_bytes(*v)
    return total


def _cost_cases(rows, n, dtype):
    """(op, direction, function, arguments, tensors read) of the four reference computations, on
    meta tensors. LayerNorm's backward takes the bias only to know that db is wanted: not read."""
    def t(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device="meta")

    x, dy, w, b = t(rows, n), t(rows, n), t(n), t(n)
    stat = t(rows, 1, dt=torch.float32)
    return [
        ("rms_norm", "forward", reference.rms_norm_reference, (x, w, 1e-6), (x, w)),
        ("rms_norm", "backward", reference.rms_norm_backward_reference, (dy, x, w, stat), (dy, x, w, stat)),
        ("layer_norm", "forward", reference.layer_norm_reference, (x, w, b, 1e-5), (x, w, b)),
        ("layer_norm", "backward", reference.layer_norm_backward_reference, (dy, x, w, b, stat, stat),
         (dy, x, w, stat, stat)),
    ]


def row_costs(n: int, dtype: torch.dtype = torch.bfloat16, rows: int = 4096) -> list[dict]:
    """Operations and bytes per row of RMSNorm and LayerNorm, forward and backward.

    The four functions of ``normtools.core.reference`` run on ``rows`` × ``n`` meta tensors of
    ``dtype`` (weights in ``dtype``, saved statistics float32). ``flops`` counts what the
    reference code executes (:func:`count_flops`); ``bytes`` is what a fused kernel must move:
    every input read once and every result written once (forward: x, w[, b] in, y out; the
    statistics a training forward also saves are not counted; backward: dy, x, w and the saved
    statistics in, dx, dw[, db] out). Both are divided by ``rows`` (weights are
    shared by all rows). Returns one dict per (op, direction) with flops_per_row,
    bytes_per_row and flops_per_byte.
    """
    results = []
    for op, direction, fn, args, read in _cost_cases(rows, n, dtype):
        out, flops = count_flops(fn, *args)
        nbytes = tensor_bytes(read, out)
        results.append({"op": op, "direction": direction, "n": n, "dtype": str(dtype).removeprefix("torch."),
                        "flops_per_row": flops / rows, "bytes_per_row": nbytes / rows,
                        "flops_per_byte": flops / nbytes})
    return results


# ----------------------------------------------------------------------------------------------
# The amplifier analogy


def random_amplifiers(depth: int, width: int, gain: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``depth`` random stages (depth, width, width), float32 entries N(0, gain²/width): each stage
    multiplies the mean square of a signal by gain² in expectation, with a random deviation."""
    if depth < 1 or width < 1 or gain <= 0:
        raise ValueError(f"depth and width must be positive and gain > 0, got {depth}, {width}, {gain}")
    return torch.randn(depth, width, width, generator=generator) * (gain / width**0.5)


def signal_through_stages(x: torch.Tensor, amplifiers: torch.Tensor, level=None) -> torch.Tensor:
    """RMS of the signal at the input and after each stage: x ← A_i x, then x ← level(x) when a
    leveller is given (e.g. ``normtools.rms_norm``), in float32. Returns a (depth + 1,) tensor."""
    if amplifiers.dim() != 3 or amplifiers.shape[1:] != (x.shape[-1], x.shape[-1]):
        raise ValueError(f"amplifiers must be (depth, {x.shape[-1]}, {x.shape[-1]}), got {tuple(amplifiers.shape)}")
    x = x.to(torch.float32)
    levels = [x.pow(2).mean().sqrt()]
    for a in amplifiers:
        x = x @ a.T
        if level is not None:
            x = level(x)
        levels.append(x.pow(2).mean().sqrt())
    return torch.stack(levels)


# ----------------------------------------------------------------------------------------------
# Block equations from norm cards

#: ModelNormSpec QK-Norm scopes → TinyLM's (TinyLM keeps one weight per feature either way).
_QK_SCOPE = {"none": "none", "per_head": "per_head", "per_head_weights": "per_head", "per_layer": "per_layer"}


def tinylm_config_from_spec(spec, **overrides):
    """The TinyLM configuration with the norm layout of ``spec`` (a ``ModelNormSpec``): the same
    placement, norm kind (RMSNorm or LayerNorm), QK-Norm scope, final norm and eps; the sizes are
    TinyLM's defaults unless overridden. (TinyLM's norms have scale w, no offset.)"""
    from normtools.lab.tinylm import TinyLMConfig

    fields = dict(placement=spec.placement, norm=spec.block_norm.kind, qk_norm=_QK_SCOPE[spec.qk_norm.scope],
                  final_norm=spec.final_norm is not None, eps=spec.block_norm.eps)
    return TinyLMConfig(**{**fields, **overrides})


def block_equation_from_spec(spec, fmt: str = "latex") -> str:
    """The block equation of the model that ``spec`` describes, printed by TinyLM's own
    ``block_equation`` for the configuration of :func:`tinylm_config_from_spec` ("text" or
    "latex"). The symbols N_… are named in :func:`norm_legend`."""
    from normtools.lab.tinylm import block_equation

    return block_equation(tinylm_config_from_spec(spec), fmt)


def norm_legend(spec) -> list[tuple[str, str]]:
    """(symbol in the block equation, module name in each layer of the model) for each block
    norm of ``spec``, in the order the block applies them. (QK-Norm and the final norm are
    described by the spec's card rows.)"""
    from normtools.lab.tinylm import norm_names

    symbols = norm_names(spec.placement)
    if len(symbols) != len(spec.layer_norms):
        raise ValueError(f"{spec.model_type}: placement {spec.placement!r} has {len(symbols)} norms, "
                         f"the spec names {len(spec.layer_norms)}: {spec.layer_norms}")
    return [(f"N_{s}", module) for s, module in zip(symbols, spec.layer_norms)]


def tiny_hf_model(model_type: str, **overrides) -> nn.Module:
    """A randomly initialized ``AutoModelForCausalLM`` of ``model_type`` with the tiny shapes of
    ``normtools.cards.tiny_config`` (hidden 32, 2 layers unless overridden), in eval mode."""
    from normtools.cards import build_model, tiny_config

    return build_model(tiny_config(model_type, **overrides)).eval()


def forced_flags(model_type: str) -> dict[str, tuple[bool, bool]]:
    """{flag: (value in ``cards.tiny_config``, the config class's default)} for every boolean
    setting of the tiny config that differs from the family's published default."""
    from transformers import AutoConfig

    from normtools.cards import tiny_config

    config = tiny_config(model_type)
    default = AutoConfig.for_model(config["model_type"])
    return {k: (v, getattr(default, k)) for k, v in config.items()
            if isinstance(v, bool) and hasattr(default, k) and getattr(default, k) != v}


def family_default_config(model_type: str) -> dict:
    """``cards.tiny_config(model_type)`` with every :func:`forced_flags` switch back at the
    default of the family's transformers config class (the published architecture)."""
    from normtools.cards import tiny_config

    return tiny_config(model_type, **{k: default for k, (_, default) in forced_flags(model_type).items()})


# ----------------------------------------------------------------------------------------------
# QK-Norm scopes


def statistic_footprint(scope: str, tokens: int, heads: int, head_dim: int, at=(0, 0, 0)) -> torch.Tensor:
    """Bool (tokens, heads, head_dim): the elements of q whose value changes the output of
    ``normtools.qk_norm`` at element ``at`` = (token, head, feature), i.e. the features that one
    statistic covers under ``scope``. Read from the gradient of that one output (reference
    backend, float32 random q); the element itself is included."""
    from normtools.core.qk import qk_norm

    q = torch.randn(tokens, heads, head_dim, requires_grad=True)
    k = torch.randn(tokens, head_dim)  # one key head: its weight has head_dim entries either way
    q_width = head_dim if scope == "per_head" else heads * head_dim
    q_out, _ = qk_norm(q.flatten(-2), k, torch.ones(q_width), torch.ones(head_dim), 1e-6,
                       head_dim=head_dim, scope=scope, backend="torch")
    (grad,) = torch.autograd.grad(q_out.view(tokens, heads, head_dim)[at], q)
    footprint = grad != 0
    footprint[at] = True
    return footprint


def draw_statistic_footprint(ax, footprint: torch.Tensor, title: str) -> None:
    """Draw a (T, H, d) footprint as T rows of H·d cells, heads separated by thick lines, the
    covered cells shaded."""
    tokens, heads, head_dim = footprint.shape
    ax.imshow(footprint.reshape(tokens, heads * head_dim).float().numpy(), cmap="Blues", vmin=-0.3,
              vmax=1.2, aspect="equal", interpolation="nearest")
    ax.set_xticks([h * head_dim + (head_dim - 1) / 2 for h in range(heads)],
                  [f"head {h}" for h in range(heads)])
    ax.set_yticks(range(tokens), [f"token {t}" for t in range(tokens)])
    ax.set_xticks([x - 0.5 for x in range(heads * head_dim + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(tokens + 1)], minor=True)
    ax.grid(which="minor", color="white", lw=0.8)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    for h in range(heads + 1):
        ax.axvline(h * head_dim - 0.5, color="black", lw=2)
    ax.set_title(title)


# ----------------------------------------------------------------------------------------------
# Residual growth with depth


def residual_growth(batch, depths, seeds=(0, 1, 2), placement: str = "pre", **config) -> "pandas.DataFrame":
    """One row per (depth, seed): the RMS of the residual stream after the first and after the
    last block of a freshly initialized TinyLM (``placement``, TinyLM keyword ``config``) on
    ``batch``, from ``normtools.lab.probes.depth_profile``."""
    import pandas as pd

    from normtools.lab import probes
    from normtools.lab.tinylm import TinyLM

    rows = []
    for depth in depths:
        for seed in seeds:
            torch.manual_seed(seed)
            profile = probes.depth_profile(TinyLM(placement=placement, depth=depth, **config), batch)
            rows.append({"depth": depth, "seed": seed, "placement": placement,
                         "residual_rms_first": profile["residual_rms"].iloc[0],
                         "residual_rms_last": profile["residual_rms"].iloc[-1]})
    return pd.DataFrame(rows)


def growth_exponent(depths, values) -> float:
    """The least-squares slope a of log(value) against log(depth): value ∝ depth^a."""
    x = torch.log(torch.tensor([float(v) for v in depths], dtype=torch.float64))
    y = torch.log(torch.tensor([float(v) for v in values], dtype=torch.float64))
    if x.numel() < 2 or x.unique().numel() < 2:
        raise ValueError("growth_exponent needs at least two different depths")
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x * x).sum())


def plot_profile_rows(df, metrics, by: str, title: str, width: float = 4.5):
    """``normtools.lab.probes.plot_depth_profile`` laid out for a phone: one panel per metric,
    stacked, log scale, one shared legend under the panels instead of one over each. Returns
    the figure."""
    import matplotlib.pyplot as plt

    from normtools.lab import probes

    fig, axes = plt.subplots(len(metrics), 1, figsize=(width, 2.4 * len(metrics) + 1.2),
                             sharex=True)
    probes.plot_depth_profile(df, metrics=metrics, by=by, ax=list(axes), logy=True)
    handles, labels = axes[0].get_legend_handles_labels()
    for axis in axes:
        if axis.get_legend() is not None:
            axis.get_legend().remove()
        axis.yaxis.label.set_size(9)
    for axis in axes[:-1]:
        axis.set_xlabel("")
    fig.suptitle(title, fontsize=11)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9, title=by,
               title_fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.11 if len(labels) > 2 else 0.07, 1, 1))
    return fig

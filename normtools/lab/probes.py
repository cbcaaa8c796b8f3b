"""Depth probes: what each layer of a model does to the residual stream, on one batch.

:func:`depth_profile` runs one forward and one backward pass (next-token cross-entropy) and
returns, per decoder layer ``i``:

    residual_rms    RMS of the residual stream after block i (the block's output)
    attn_out_rms    RMS of the attention sublayer's output (``self_attn``, after o_proj,
                    before any norm of the block that follows it)
    mlp_out_rms     RMS of the MLP sublayer's output (``mlp``)
    grad_norm       L2 norm of the gradient of all parameters of block i (its norms included)
    grad_norm_attn  the same for the attention sublayer's parameters (QK-Norm weights included)
    grad_norm_mlp   the same for the MLP's parameters
    logit_max       max of the pre-softmax attention logits s = q·kᵀ·scale over the attended
                    (query, key) pairs, all heads and sequences
    logit_p99       their 99th percentile
    logit_abs_mean  mean of |s|
    attn_entropy    mean over heads and queries of −Σ_j p_j log p_j (nats), p = softmax of
                    the masked logits

RMS is over every element: sqrt(mean(v²)). The probes work through standard module names:
decoder layers ``model.layers`` (TinyLM) or ``model.model.layers`` (Hugging Face), each with
``self_attn`` and ``mlp``. Logits are read, not recomputed: TinyLM keeps them when
``self_attn.keep_logits`` is set; a Hugging Face model is switched for the duration of the probe
to the attention implementation ``"normtools_probe"`` (registered with transformers'
``AttentionInterface``), which is eager attention that keeps the logits it computes, and uses
the eager (additive float) mask, so the attended pairs are those the model's own mask allows
(causal, and the sliding window of Gemma 3's local layers).

Two more probes for the stability chapter: :func:`low_precision_attention` (what rounding the
attention logits to bfloat16 does to the softmax) and :func:`init_gradients` (Xiong et al.
2020's measurement: at initialization, the gradient norm of each layer's FFN output matrix and
the RMS of the residual stream, Post-LN against Pre-LN, over depths and seeds).
:func:`residual_growth` reads the residual stream's RMS after the first and the last block of
fresh TinyLMs over depths and seeds (chapter 2), and :func:`plot_profile_rows` stacks a depth
profile's panels for a phone.
"""

from __future__ import annotations

import math
import textwrap
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from normtools.lab.blocks import PLACEMENT_NAMES
from normtools.lab.tinylm import TinyLM, causal_mask

_PROBE_ATTENTION = "normtools_probe"

PROFILE_COLUMNS = (
    "layer", "residual_rms", "attn_out_rms", "mlp_out_rms", "grad_norm", "grad_norm_attn",
    "grad_norm_mlp", "logit_max", "logit_p99", "logit_abs_mean", "attn_entropy",
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: ``model.layers`` (TinyLM) or ``model.model.layers`` (HF *ForCausalLM)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"{type(model).__name__} has no decoder layers at .layers or .model.layers")


def rms(v: torch.Tensor) -> float:
    """sqrt(mean(v²)) over every element, in float32."""
    return v.detach().float().pow(2).mean().sqrt().item()


def _logit_stats(logits: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Statistics of attention logits (B, H, Tq, Tk) over the pairs where ``valid`` (broadcast to
    the logits' shape) is True: max, 99th percentile, mean |s|, and the mean attention entropy."""
    logits = logits.detach().float()
    valid = valid.expand_as(logits)
    attended = logits[valid]
    log_p = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p.masked_fill(~valid, 0.0)).sum(-1)
    return {
        "logit_max": attended.max().item(),
        "logit_p99": float(np.percentile(attended.cpu().numpy(), 99)),
        "logit_abs_mean": attended.abs().mean().item(),
        "attn_entropy": entropy.mean().item(),
    }


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, **kwargs):
    """Eager attention (as transformers' ``eager_attention_forward``) that keeps its logits.

    s = q kᵀ · scaling (then softcap · tanh(s / softcap) where the model soft-caps), kept in
    ``module.logits``; the attended pairs (mask == 0) in ``module.logit_mask``.
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("the normtools probe attention does not support attention sinks")
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = (query @ key.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if attention_mask is None:
        valid = causal_mask(query.shape[2], query.device)[None, None]
    elif attention_mask.dtype == torch.bool:
        valid = attention_mask[:, :, :, : key.shape[2]]
    else:
        valid = attention_mask[:, :, :, : key.shape[2]] == 0
    module.logits, module.logit_mask = logits.detach(), valid
    probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1, dtype=torch.float32)
    probs = F.dropout(probs.to(query.dtype), p=dropout, training=module.training)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def _register_probe_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(_PROBE_ATTENTION, _probe_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_PROBE_ATTENTION, eager_mask)


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "set_attn_implementation")


class Recording:
    """Per-layer values collected during the forward passes inside :func:`recording`."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = layers
        self.residual_rms: dict[int, float] = {}
        self.attn_out_rms: dict[int, float] = {}
        self.mlp_out_rms: dict[int, float] = {}

    def logits(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's last attention logits (B, H, Tq, Tk) and the mask of the attended pairs."""
        attn = self.layers[i].self_attn
        valid = attn.logit_mask
        if valid is None:
            valid = causal_mask(attn.logits.shape[-1], attn.logits.device)
        return attn.logits, valid

    def logit_stats(self, i: int) -> dict[str, float]:
        """:func:`_logit_stats` of layer i's last attention logits."""
        return _logit_stats(*self.logits(i))

    def logit_max(self, i: int) -> float:
        """Max attended logit of layer i (cheaper than :meth:`logit_stats`)."""
        logits, valid = self.logits(i)
        return logits.masked_fill(~valid, float("-inf")).max().item()


@contextmanager
def recording(model: nn.Module):
    """Within the block, forward passes of ``model`` record per layer the RMS of the residual
    stream and of both sublayers' outputs, and keep the attention logits (see module docs).
    Everything is put back on exit."""
    layers = decoder_layers(model)
    rec = Recording(layers)

    def store(table, i):
        def hook(module, args, output):
            table[i] = rms(output[0] if isinstance(output, tuple) else output)
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(store(rec.residual_rms, i)))
        handles.append(layer.self_attn.register_forward_hook(store(rec.attn_out_rms, i)))
        handles.append(layer.mlp.register_forward_hook(store(rec.mlp_out_rms, i)))
    hf = _is_hf(model)
    if hf:
        _register_probe_attention()
        previous = model.config._attn_implementation
        model.set_attn_implementation(_PROBE_ATTENTION)
    else:
        for layer in layers:
            layer.self_attn.keep_logits = True
    try:
        yield rec
    finally:
        for handle in handles:
            handle.remove()
        if hf:
            model.set_attn_implementation(previous)
        for layer in layers:
            attn = layer.self_attn
            attn.keep_logits = False
            attn.logits = None
            attn.logit_mask = None


def grad_norm(module: nn.Module) -> float:
    """L2 norm of the gradients of all of ``module``'s parameters (those that have one)."""
    squares = [p.grad.float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return torch.stack(squares).sum().sqrt().item() if squares else 0.0


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): a pair (x, y) as given, or ids (B, T+1) as x = ids[:, :-1], y = ids[:, 1:]."""
    if isinstance(batch, (tuple, list)):
        x, y = batch
        return x, y
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError("batch must be token ids (B, T+1) with T ≥ 1 or a pair (inputs, targets)")
    return batch[:, :-1], batch[:, 1:]


def _next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of the targets under the model's logits (TinyLM or HF causal LM)."""
    x, y = split_batch(batch)
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def depth_profile(model: nn.Module, batch) -> "pandas.DataFrame":
    """One forward + backward pass on ``batch``; one row per decoder layer (see module docs).

    ``batch`` is token ids (B, T+1) or a pair (inputs, targets). The model's gradients are
    cleared before and after. TinyLM rows also carry its ``placement``, ``norm`` and ``qk_norm``;
    HF rows the ``model_type``. The loss is in ``df.attrs["loss"]``.
    """
    import pandas as pd

    layers = decoder_layers(model)
    model.zero_grad(set_to_none=True)
    with recording(model) as rec:
        loss = _next_token_loss(model, batch)
        loss.backward()
        rows = []
        for i, layer in enumerate(layers):
            rows.append({
                "layer": i,
                "residual_rms": rec.residual_rms[i],
                "attn_out_rms": rec.attn_out_rms[i],
                "mlp_out_rms": rec.mlp_out_rms[i],
                "grad_norm": grad_norm(layer),
                "grad_norm_attn": grad_norm(layer.self_attn),
                "grad_norm_mlp": grad_norm(layer.mlp),
                **rec.logit_stats(i),
            })
    model.zero_grad(set_to_none=True)
    df = pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))
    config = model.config
    if _is_hf(model):
        df["model_type"] = config.model_type
    else:
        df["placement"], df["norm"], df["qk_norm"] = config.placement, config.norm, config.qk_norm
    df.attrs["loss"] = loss.item()
    return df


def profile_placements(batch, placements=PLACEMENT_NAMES, seed: int = 0, **config) -> "pandas.DataFrame":
    """:func:`depth_profile` of a freshly initialized TinyLM (seeded with ``seed``, so every
    placement starts from the same random draws) per placement, concatenated; ``config`` are
    TinyLM's keyword arguments (``depth=24``, ``norm="layer"``, ...)."""
    import pandas as pd

    frames = []
    for placement in placements:
        torch.manual_seed(seed)
        frames.append(depth_profile(TinyLM(placement=placement, **config), batch))
    return pd.concat(frames, ignore_index=True)


def residual_growth(batch, depths, seeds=(0, 1, 2), placement: str = "pre", **config) -> "pandas.DataFrame":
    """One row per (depth, seed): the RMS of the residual stream after the first and after the
    last block of a freshly initialized TinyLM (``placement``, TinyLM keyword ``config``) on
    ``batch``, from :func:`depth_profile`."""
    import pandas as pd

    rows = []
    for depth in depths:
        for seed in seeds:
            torch.manual_seed(seed)
            profile = depth_profile(TinyLM(placement=placement, depth=depth, **config), batch)
            rows.append({"depth": depth, "seed": seed, "placement": placement,
                         "residual_rms_first": profile["residual_rms"].iloc[0],
                         "residual_rms_last": profile["residual_rms"].iloc[-1]})
    return pd.DataFrame(rows)


_METRIC_LABELS = {
    "residual_rms": "RMS of the residual stream",
    "attn_out_rms": "RMS of the attention output",
    "mlp_out_rms": "RMS of the MLP output",
    "grad_norm": "gradient norm of the layer",
    "grad_norm_attn": "gradient norm of the attention",
    "grad_norm_mlp": "gradient norm of the MLP",
    "logit_max": "max attention logit",
    "logit_p99": "99th percentile attention logit",
    "logit_abs_mean": "mean |attention logit|",
    "attn_entropy": "attention entropy (nats)",
}


# (marker, line style) per line, so that lines that coincide stay distinguishable
_LINE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (6, 2, 1, 2))))


def plot_depth_profile(df, metrics=("residual_rms", "grad_norm"), by="placement", ax=None,
                       logy=False):
    """One panel per metric against the layer index, one line per value of column ``by``
    (a single line if ``df`` has no such column), each with its own marker and line style.
    ``ax``: an Axes or a sequence of Axes, one per metric. Returns the figure."""
    from matplotlib.ticker import MaxNLocator

    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    fig, axes = _panels(len(metrics), ax)
    groups = df.groupby(by, sort=False) if by in df.columns else [(None, df)]
    for metric, axis in zip(metrics, axes):
        for i, (label, part) in enumerate(groups):
            part = part.sort_values("layer")
            marker, style = _LINE_STYLES[i % len(_LINE_STYLES)]
            # hollow markers, and lines drawn later thinner: a line under another shows
            axis.plot(part["layer"], part[metric], marker=marker, markersize=5,
                      markerfacecolor="none", linestyle=style,
                      linewidth=max(2.4 - 0.3 * i, 1.0), label=label)
        axis.set_xlabel("layer")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(_METRIC_LABELS.get(metric, metric))
        if logy:
            axis.set_yscale("log")
        if by in df.columns:
            axis.legend(title=by, fontsize="small")
    fig.tight_layout()
    return fig


def plot_profile_rows(df, metrics, by: str, title: str, width: float = 4.5,
                      panel_height: float = 2.4):
    """:func:`plot_depth_profile` laid out for a phone: one panel per metric, stacked, log
    scale, each line labelled in its colour at its last point (no legend over the data).
    Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 1, figsize=(width, panel_height * len(metrics) + 0.6),
                             sharex=True)
    plot_depth_profile(df, metrics=metrics, by=by, ax=list(axes), logy=True)
    # a y-label longer than its panel runs into the next panel's: wrap it to the panel's height
    # (9 pt text, about 5.5 pt per character)
    label_chars = max(12, int(panel_height * 72 / 5.5))
    for axis in axes:
        if axis.get_legend() is not None:
            axis.get_legend().remove()
        axis.set_ylabel(textwrap.fill(axis.get_ylabel(), label_chars), size=9)
        _label_line_ends(axis)
    for axis in axes[:-1]:
        axis.set_xlabel("")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _label_line_ends(axis, min_gap: float = 0.085):
    """Write each line's label right of the axes, in the line's colour, at the height of its
    last point; labels closer than ``min_gap`` (a fraction of the axes' height) are spread apart."""
    lines = [line for line in axis.get_lines() if not line.get_label().startswith("_")]
    axis.get_ylim()  # settle the autoscaled limits before reading positions
    to_axes = axis.transData + axis.transAxes.inverted()
    ends = [to_axes.transform((line.get_xdata()[-1], line.get_ydata()[-1]))[1] for line in lines]
    order = sorted(range(len(lines)), key=lambda i: ends[i])
    placed = {}
    for i in order:  # bottom to top, each at least min_gap above the previous
        placed[i] = max(ends[i], max(placed.values(), default=-1.0) + min_gap)
    overflow = max(max(placed.values(), default=0.0) - 1.0, 0.0)
    for i, line in enumerate(lines):
        axis.text(1.02, placed[i] - overflow, line.get_label(), transform=axis.transAxes,
                  color=line.get_color(), fontsize=9, va="center", ha="left", clip_on=False)


def _panels(n: int, ax=None):
    """(figure, n axes): new side-by-side panels, or the given Axes (one, or a sequence of n)."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.2), squeeze=False)
        return fig, list(axes[0])
    axes = list(np.atleast_1d(ax))
    if len(axes) != n:
        raise ValueError(f"got {len(axes)} axes for {n} panels")
    return axes[0].figure, axes


@torch.no_grad()
def low_precision_attention(logits: torch.Tensor, valid: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16,
                            saturation: float = 0.99) -> dict[str, float]:
    """What rounding the attention logits s (B, H, Tq, Tk) to ``dtype`` does, over the pairs
    where ``valid`` (broadcast to the logits) is True. The softmax is taken in float32, of s
    and of round(s), over each query's valid keys:

        logit_max           max |s|
        spacing_at_max      spacing of ``dtype`` at max |s|: eps · 2^⌊log2 max|s|⌋
                            (bfloat16: eps = 2⁻⁷, so 16 at |s| = 2048)
        rounding_error_max  max |s − round(s)|
        entropy             mean over queries of −Σ_j p_j log p_j (nats), p = softmax(s)
        entropy_rounded     the same for p = softmax(round(s))
        saturated           fraction of queries whose largest p_j ≥ ``saturation``
        prob_error_max      max |softmax(s) − softmax(round(s))| over the pairs
        argmax_changed      fraction of queries whose arg-max key differs between s and
                            round(s) (ties in round(s) broken towards the first key)
        tv_mean             mean over queries of the total-variation distance
                            ½ Σ_j |softmax(s)_j − softmax(round(s))_j|
    """
    s = logits.detach().float()
    valid = valid.expand_as(s)
    rounded = s.to(dtype).float()
    attended = s[valid].abs()
    logit_max = attended.max().item()

    def softmax_entropy(v):
        log_p = torch.log_softmax(v.masked_fill(~valid, float("-inf")), dim=-1)
        p = log_p.exp()
        return p, -(p * log_p.masked_fill(~valid, 0.0)).sum(-1).mean().item()

    p, entropy = softmax_entropy(s)
    p_rounded, entropy_rounded = softmax_entropy(rounded)
    spacing = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(logit_max)) if logit_max > 0 else 0.0
    return {
        "logit_max": logit_max,
        "spacing_at_max": spacing,
        "rounding_error_max": (s - rounded)[valid].abs().max().item(),
        "entropy": entropy,
        "entropy_rounded": entropy_rounded,
        "saturated": (p.amax(-1) >= saturation).float().mean().item(),
        "prob_error_max": (p - p_rounded)[valid].abs().max().item(),
        "argmax_changed": (s.masked_fill(~valid, float("-inf")).argmax(-1)
                           != rounded.masked_fill(~valid, float("-inf")).argmax(-1)).float().mean().item(),
        "tv_mean": (0.5 * (p - p_rounded).abs().sum(-1)).mean().item(),
    }


def init_gradients(batch, placements=("post", "pre"), depths=(6,), seeds=(0, 1, 2),
                   **config) -> "pandas.DataFrame":
    """Xiong et al. 2020's measurement, at initialization: one forward and one backward pass of
    a fresh TinyLM (seeded with ``seed``) per placement, depth and seed, on ``batch``. One row
    per layer with

        w2_grad_norm   ‖∂L/∂W²‖_F of the layer's FFN output matrix (``mlp.down_proj.weight``:
                       the second FFN matrix, W² in their notation)
        residual_rms   RMS of the residual stream after the layer

    and the loss of the pass in ``loss``. ``config`` are TinyLM's keyword arguments."""
    import pandas as pd

    rows = []
    for placement in placements:
        for depth in depths:
            for seed in seeds:
                torch.manual_seed(seed)
                model = TinyLM(placement=placement, depth=depth, **config)
                with recording(model) as rec:
                    loss = _next_token_loss(model, batch)
                    loss.backward()
                for i, layer in enumerate(model.layers):
                    rows.append({"placement": placement, "depth": depth, "seed": seed, "layer": i,
                                 "w2_grad_norm": layer.mlp.down_proj.weight.grad.norm().item(),
                                 "residual_rms": rec.residual_rms[i], "loss": loss.item()})
    return pd.DataFrame(rows)


def power_law_exponent(x, y) -> float:
    """The exponent a of y ∝ x^a (a = 1: linear growth, a = 1/2: √x; e.g. the residual RMS
    against the depth): the slope of the least-squares line log y = a · log x + b, in float64,

        a = Σ (u − ū)(v − v̄) / Σ (u − ū)²,    u = log x, v = log y.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or (x <= 0).any() or (y <= 0).any() or np.unique(x).size < 2:
        raise ValueError("need positive (x, y) pairs of the same shape, at two different x at least")
    u, v = np.log(x), np.log(y)
    u, v = u - u.mean(), v - v.mean()
    return float((u * v).sum() / (u * u).sum())

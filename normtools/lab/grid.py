"""Experiment drivers for the stability chapter: grids of TinyLM runs, returned as tidy tables.

One *cell* of a grid is a dict of :class:`normtools.lab.tinylm.TinyLMConfig` fields plus the peak
learning rate ``lr``, and optionally the ``seed`` and the training options of
:data:`_TRAIN_FIELDS` (``precision``, ``z_loss_coef``, ``grad_clip`` (None: no clipping), ``weight_decay``,
``independent_weight_decay``, ``qk_gain_weight_decay``), e.g.
``{"placement": "pre", "qk_norm": "per_head", "lr": 3e-2, "seed": 1}``.
:func:`run_grid` trains a fresh TinyLM per cell, on the same data; cells with the same seed
share the initialization of the weights they have in common and see the same batches in the
same order (``seeds=(0, 1, 2)`` repeats every cell with each seed). It keeps:

* the per-step records of :func:`normtools.lab.train.train` (loss, global gradient norm, max
  attention logit, and per layer ``logit_max_<i>``, ``act_rms_<i>``), with the gradient norm
  of every layer added as ``grad_norm_<i>`` (:func:`layer_grad_norms`);
* the attended attention logits of all layers on one fixed batch, before and after training
  (:func:`attention_logits`), for their distribution, and what rounding the trained model's
  logits to bfloat16 would do to its attention (:func:`_attention_summary`).

:func:`summarize` reduces each run to one row (final loss, peak logit, spike scores);
:func:`lr_sensitivity_table` applies Wortsman et al. (2023)'s LR sensitivity per group and seed;
:func:`over_seeds` reduces the rows of each configuration over its seeds to the median and the
range (min, max).
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn as nn

from normtools.lab.tinylm import TinyLM, TinyLMConfig
from normtools.lab.probes import (causal_mask, decoder_layers, low_precision_attention, recording,
                                  split_batch)
from normtools.lab.train import OLMO2_SPIKE_K, OLMO2_SPIKE_WINDOW, lr_sensitivity, spike_score, train

#: Settings of the stability chapter per ``size``: the model (TinyLMConfig fields), the run
#: length and batch, the two learning rates of the placement grid, the LR sweep, the batch
#: whose attention logits are kept before and after training (one sequence on "gpu": 2M logits),
#: and the initialization probe of Xiong et al. (``xiong``: model fields, depths, batch size).
STABILITY_SIZES = {
    "test": dict(model=dict(width=32, depth=2, heads=2, max_seq_len=16), steps=24, batch_size=2,
                 normal_lr=3e-3, high_lr=3e-2, sweep_lrs=(3e-3, 3e-2), probe_batch_size=2,
                 xiong=dict(model=dict(width=32, heads=2, max_seq_len=16), depths=(2, 4),
                            batch_size=2)),
    "cpu": dict(model=dict(width=64, depth=4, heads=4, max_seq_len=32), steps=100, batch_size=8,
                normal_lr=3e-3, high_lr=1e-1, sweep_lrs=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0),
                probe_batch_size=4,
                xiong=dict(model=dict(width=64, heads=4, max_seq_len=32), depths=(6, 12, 24),
                           batch_size=8)),
    "gpu": dict(model=dict(width=512, depth=8, heads=8, max_seq_len=256), steps=1000, batch_size=32,
                normal_lr=3e-3, high_lr=1e-1, sweep_lrs=(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
                probe_batch_size=1,
                xiong=dict(model=dict(width=512, heads=8, max_seq_len=256), depths=(6, 12, 24, 48),
                           batch_size=8)),
}

_CONFIG_FIELDS = {f.name for f in fields(TinyLMConfig)}
#: Cell fields that go to :func:`normtools.lab.train.train` rather than to the model.
_TRAIN_FIELDS = ("precision", "z_loss_coef", "grad_clip", "weight_decay", "independent_weight_decay",
                 "qk_gain_weight_decay")


def cells(**axes) -> list[dict]:
    """The cartesian product of the axes, as a list of cells (dicts), last axis varying fastest.

    ``cells(placement=["pre", "post"], lr=[1e-3, 1e-2])`` gives four cells.
    """
    if not axes:
        raise ValueError("cells needs at least one axis")
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"axis {name!r} must be a sequence of values, got {values!r}")
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def cell_key(cell: dict) -> tuple:
    """A hashable, order-independent key of a cell: its sorted (name, value) pairs."""
    return tuple(sorted(cell.items()))


@contextmanager
def layer_grad_norms(model: nn.Module):
    """Within the block, every backward pass appends one row of per-layer gradient norms.

    Yields a list that receives, per backward pass, ``[‖g_0‖, ‖g_1‖, ...]`` with
    ‖g_i‖ = sqrt(Σ_p ‖∂L/∂p‖²) over the parameters p of decoder layer i (the gradient of that
    pass alone: the caller clears gradients between passes, as an optimizer loop does). The
    norms are read by hooks that run when each parameter's gradient is complete.
    """
    layers = decoder_layers(model)
    params = [(i, p) for i, layer in enumerate(layers) for p in layer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model's decoder layers have no trainable parameters")
    rows: list[list[float]] = []
    pending = {"count": 0, "sums": [0.0] * len(layers)}

    def hook_for(i):
        def hook(p):
            pending["sums"][i] = pending["sums"][i] + p.grad.detach().float().pow(2).sum()
            pending["count"] += 1
            if pending["count"] == len(params):  # every layer parameter has its gradient
                rows.append(torch.stack(pending["sums"]).sqrt().tolist())  # one device sync
                pending["count"], pending["sums"] = 0, [0.0] * len(layers)
        return hook

    handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in params]
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def attention_logits(model: nn.Module, batch) -> np.ndarray:
    """The pre-softmax attention logits s = q·kᵀ/√d of every layer and head on ``batch``, over
    the attended (causal) pairs only, as one flat float32 array (layer by layer)."""
    x, _ = split_batch(batch)
    was_training = model.training
    model.eval()
    with recording(model) as rec:
        model(x)
        parts = []
        for layer in rec.layers:
            logits = layer.self_attn.logits
            valid = causal_mask(logits.shape[-1], logits.device).expand_as(logits)
            parts.append(logits[valid].float().cpu().numpy())
    model.train(was_training)
    return np.concatenate(parts)


@torch.no_grad()
def _attention_summary(model: nn.Module, batch) -> dict[str, float]:
    """:func:`normtools.lab.probes.low_precision_attention` (bfloat16) of every layer's logits on
    ``batch``, combined over layers: the max of ``logit_max``, ``spacing_at_max``,
    ``rounding_error_max`` and ``prob_error_max``, the mean of ``entropy``,
    ``entropy_rounded``, ``saturated``, ``argmax_changed`` and ``tv_mean`` (every layer has
    the same queries). In a soft-capped model these are of the capped
    logits c·tanh(s/c), the values its softmax sees."""
    x, _ = split_batch(batch)
    was_training = model.training
    model.eval()
    with recording(model) as rec:
        model(x)
        per_layer = []
        for i, layer in enumerate(rec.layers):
            logits, valid = rec.logits(i)
            cap = getattr(layer.self_attn, "softcap", None)
            if cap is not None:
                logits = cap * torch.tanh(logits / cap)
            per_layer.append(low_precision_attention(logits, valid))
    model.train(was_training)
    combine = {"logit_max": max, "spacing_at_max": max, "rounding_error_max": max,
               "prob_error_max": max, "entropy": np.mean, "entropy_rounded": np.mean,
               "saturated": np.mean, "argmax_changed": np.mean, "tv_mean": np.mean}
    return {k: float(f([row[k] for row in per_layer])) for k, f in combine.items()}


@dataclass
class Run:
    """One trained cell: its settings, per-step records, logits before and after training, and
    :func:`_attention_summary` of the trained model on the same batch."""

    cell: dict
    config: TinyLMConfig
    records: "pandas.DataFrame"
    logits_init: np.ndarray
    logits_final: np.ndarray
    attention_final: dict


def run_cell(cell: dict, data, base_config: TinyLMConfig, *, steps: int, batch_size: int,
             seed: int = 0, device: str | torch.device = "cpu", probe_batch_size: int = 4,
             **train_kwargs) -> Run:
    """Train a fresh TinyLM (``base_config`` with the cell's model fields) at the cell's ``lr``.

    The weights are initialized after ``torch.manual_seed(seed)`` (the cell's ``seed`` if it has
    one) and the batches follow the seed, so two cells with one seed differ only in what the
    cell changes. The cell's :data:`_TRAIN_FIELDS` and ``train_kwargs`` go to
    :func:`normtools.lab.train.train`.
    """
    if "lr" not in cell:
        raise ValueError(f"a cell needs a learning rate 'lr', got {cell}")
    unknown = set(cell) - _CONFIG_FIELDS - {"lr", "seed", *_TRAIN_FIELDS}
    if unknown:
        raise ValueError(f"unknown cell fields {sorted(unknown)}; expected TinyLMConfig fields, "
                         f"'lr', 'seed' and {', '.join(_TRAIN_FIELDS)}")
    seed = cell.get("seed", seed)
    train_kwargs = {**train_kwargs, **{k: cell[k] for k in _TRAIN_FIELDS if k in cell}}
    config = base_config.replace(**{k: v for k, v in cell.items() if k in _CONFIG_FIELDS})
    torch.manual_seed(seed)
    model = TinyLM(config).to(device)
    # Admin's profiling pass, on the run's first training batch (the data order follows the seed)
    model.initialize_from_data(split_batch(data.get_batch(
        "train", batch_size, config.max_seq_len, torch.Generator().manual_seed(seed), device))[0])
    probe = data.get_batch("val", probe_batch_size, config.max_seq_len,
                           torch.Generator().manual_seed(seed), device)
    logits_init = attention_logits(model, probe)
    with layer_grad_norms(model) as grad_rows:
        records = train(model, data, steps, cell["lr"], batch_size=batch_size, seed=seed,
                        quiet=True, **train_kwargs)
    per_layer = np.asarray(grad_rows[:len(records)])
    for i in range(per_layer.shape[1]):
        records[f"grad_norm_{i}"] = per_layer[:, i]
    return Run(cell=dict(cell), config=config, records=records, logits_init=logits_init,
               logits_final=attention_logits(model, probe),
               attention_final=_attention_summary(model, probe))


def _with_seeds(cells, seeds) -> list[dict]:
    """Every cell once per seed: ``{**cell, "seed": s}`` for each cell, then each seed."""
    return [{**cell, "seed": int(s)} for cell in cells for s in seeds]


def run_grid(cells, data, base_config: TinyLMConfig, seeds=None, **run_kwargs) -> dict[tuple, Run]:
    """:func:`run_cell` for each distinct cell (duplicates run once), keyed by :func:`cell_key`;
    with ``seeds``, each cell once per seed (:func:`_with_seeds`)."""
    runs = {}
    for cell in (_with_seeds(cells, seeds) if seeds is not None else cells):
        key = cell_key(cell)
        if key not in runs:
            runs[key] = run_cell(cell, data, base_config, **run_kwargs)
    return runs


def summarize(runs, spike_window: int = OLMO2_SPIKE_WINDOW,
              spike_k: float = OLMO2_SPIKE_K) -> "pandas.DataFrame":
    """One row per run: the cell's fields, then

    initial_loss, final_loss   validation loss before and after training (``records.attrs``)
    logit_max_peak             max attention logit over all layers and steps
    logit_max_final            max attention logit at the last step
    log_z_final                mean log Z of the output logits at the last step
    attn_<k>                   :func:`_attention_summary` of the trained model (k: logit_max,
                               entropy, entropy_rounded, saturated, prob_error_max, ...)
    grad_norm_spike_score      :func:`normtools.lab.train.spike_score` (percent) of the global
                               gradient norm, with ``spike_window`` and ``spike_k`` (default:
                               OLMo 2's 1000 values and 7σ)
    loss_spike_score           the same for the training loss
    diverged                   the loss became non-finite (the run stopped early)

    A run with no more than ``spike_window`` steps has no spike scores: they are NaN.
    """
    import pandas as pd

    def scored(series):
        return spike_score(series, spike_window, spike_k) if len(series) > spike_window else float("nan")

    rows = []
    for run in (runs.values() if isinstance(runs, dict) else runs):
        rec = run.records
        rows.append({
            **run.cell,
            "initial_loss": rec.attrs.get("initial_loss", float("nan")),
            "final_loss": rec.attrs.get("final_loss", float("nan")),
            "logit_max_peak": float(rec["logit_max"].max()),
            "logit_max_final": float(rec["logit_max"].iloc[-1]),
            "log_z_final": float(rec["log_z"].iloc[-1]),
            **{f"attn_{k}": v for k, v in run.attention_final.items()},
            "grad_norm_spike_score": scored(rec["grad_norm"]),
            "loss_spike_score": scored(rec["loss"]),
            "diverged": not math.isfinite(rec["loss"].iloc[-1]),
        })
    return pd.DataFrame(rows)


def lr_sensitivity_table(summary, by=("placement", "qk_norm")) -> "pandas.DataFrame":
    """Per group of ``by`` (and per ``seed`` when the summary has that column):
    :func:`normtools.lab.train.lr_sensitivity` over the group's learning rates (ℓ₀: the group's
    initial validation loss), the best lr and its final loss."""
    import pandas as pd

    by = tuple(by) + (("seed",) if "seed" in summary.columns and "seed" not in by else ())
    rows = []
    for key, part in summary.groupby(list(by), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        losses = dict(zip(part["lr"], part["final_loss"]))
        best = part.loc[part["final_loss"].idxmin()]
        rows.append({**dict(zip(by, key)), "n_lrs": len(losses),
                     "lr_sensitivity": lr_sensitivity(losses, float(part["initial_loss"].mean())),
                     "best_lr": best["lr"], "best_final_loss": best["final_loss"]})
    return pd.DataFrame(rows)


def over_seeds(table, metrics, by=None) -> "pandas.DataFrame":
    """Each configuration's rows reduced over its seeds: per group of ``by`` (default: every
    column that is neither ``seed`` nor a metric), ``n_seeds`` and, for each metric m,
    ``m_median``, ``m_min`` and ``m_max`` (NaN values are left out; a metric with none left
    gives NaN)."""
    import pandas as pd

    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    missing = [m for m in metrics if m not in table.columns]
    if missing:
        raise ValueError(f"no columns {missing} in the table")
    if by is None:
        by = [c for c in table.columns if c != "seed" and c not in metrics]
    by = list(by)
    if not by:
        raise ValueError("over_seeds needs at least one column to group by")
    rows = []
    for key, part in table.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row = {**dict(zip(by, key)), "n_seeds": len(part)}
        for m in metrics:
            values = part[m].to_numpy(dtype=float)
            values = values[~np.isnan(values)]
            stats = (np.median(values), values.min(), values.max()) if values.size else (np.nan,) * 3
            row.update({f"{m}_median": stats[0], f"{m}_min": stats[1], f"{m}_max": stats[2]})
        rows.append(row)
    return pd.DataFrame(rows)

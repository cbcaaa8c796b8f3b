"""A small training loop for TinyLM, with the per-step records the stability chapters plot.

:func:`train` runs AdamW with linear warm-up and cosine decay, clips the global gradient norm,
runs in float32 or under bfloat16 autocast (``precision="bf16"``, on a CPU or a GPU; fp16 with
loss scaling on a GPU only), optionally adds PaLM's z-loss, and records at every step

    step, lr, loss, grad_norm          loss: the cross-entropy (without the z-loss term);
                                       grad_norm: global L2 norm before clipping
    log_z                              mean over tokens of log Z, Z = Σ_v exp(output logit v)
    logit_max                          max attention logit over all layers
    logit_max_<i>, act_rms_<i>         per layer i: max attention logit, RMS of the residual
                                       stream after block i (see normtools.lab.probes)

The data order is fixed by ``seed`` (a seeded ``torch.Generator``), so on CPU a run is
deterministic for a given model initialization. Two stability measures:

* :func:`spike_score` — OLMo 2's spike score (OLMo et al. 2024, "2 OLMo 2 Furious"): the
  percentage of steps whose value lies at least 7 standard deviations away from the rolling
  average of the last 1000 values. ``window`` and ``k`` can be changed for short runs; a
  score computed with other values is an adaptation, not OLMo 2's measure.
* :func:`lr_sensitivity` — Wortsman et al. 2023 ("Small-scale proxies for large-scale
  Transformer training instabilities"): E_{η ∈ grid}[min(ℓ(η), ℓ₀) − min_η ℓ(η)], ℓ(η) the
  final loss at learning rate η and ℓ₀ the loss at initialization.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm  # the text bar: tqdm.auto warns at import in kernels without ipywidgets

from normtools.core.precision import compute_dtype
from normtools.lab.probes import decoder_layers, recording, split_batch

_PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate at ``step`` (0-based): linear warm-up to ``lr`` over ``warmup`` steps, then
    cosine decay to ``min_lr_ratio · lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), independent_weight_decay: bool = False,
                    qk_gain_weight_decay: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim ≥ 2) only, not on norm weights and biases (nanoGPT);
    with ``qk_gain_weight_decay`` also on the QK-Norm gains (``…qk_norm.q_weight``/``k_weight``).

    torch's AdamW shrinks a decayed parameter by p ← p·(1 − η_t·λ) at step t, so the decay is
    coupled to the learning rate η_t. ``independent_weight_decay`` (Wortsman et al. 2023,
    "independent weight decay") sets λ' = λ/η, η the peak learning rate, so that
    p ← p·(1 − λ·η_t/η): the decay follows the schedule's shape but not the peak rate, and a
    learning-rate sweep changes the update alone."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def decayed(name, p):
        return p.dim() >= 2 or (qk_gain_weight_decay and ".qk_norm." in f".{name}")

    decay = weight_decay / lr if independent_weight_decay else weight_decay
    groups = [
        {"params": [p for n, p in params if decayed(n, p)], "weight_decay": decay},
        {"params": [p for n, p in params if not decayed(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def autocast_for(precision: str, device: torch.device):
    """(precision, context) for a forward pass: ``"fp32"`` runs as is; ``"bf16"`` under
    ``torch.autocast(device.type, torch.bfloat16)`` (CPU or GPU: matrix products, and so the
    attention logits q·kᵀ and the output logits, are computed and stored in bfloat16); ``"fp16"``
    under float16 autocast, GPU only; ``"auto"``: bf16 on a GPU that supports it, else fp32."""
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(_PRECISIONS)}")
    if precision == "auto":
        # compute_dtype: bf16 arithmetic, not emulated (a T4 falls back to fp32, with a message)
        precision = ("bf16" if device.type == "cuda"
                     and compute_dtype(device, torch.float32) == torch.bfloat16 else "fp32")
    if precision == "fp32":
        return precision, nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"precision 'fp16' needs a CUDA device; use 'bf16' or 'fp32' on {device.type}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return precision, torch.autocast(device.type, dtype=dtype)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """PaLM's auxiliary z-loss (Chowdhery et al. 2022): mean over tokens of (log Z)², with
    log Z = logsumexp of the output logits over the vocabulary (last dim), in float32. Added
    as ``coefficient · z_loss`` (PaLM: 1e-4), it pulls log Z towards 0."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def loss_terms(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of the targets, output logits in float32) of the model's next-token
    predictions on ``batch`` (token ids (B, T+1) or a pair (inputs, targets))."""
    x, y = split_batch(batch)
    out = model(x)
    logits = (out.logits if hasattr(out, "logits") else out[0]).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits


@torch.no_grad()
def evaluate(model: nn.Module, data, split: str = "val", batches: int | str = 4, batch_size: int = 16,
             seq_len: int | None = None, seed: int = 1234) -> float:
    """Mean next-token loss of ``model`` on ``split``, in float32 (outside any autocast).

    ``batches`` an int: over that many fixed (seeded) random batches. ``batches="all"``: over
    the whole split, cut into consecutive windows of ``seq_len`` tokens (the last partial window
    dropped), every predicted byte weighted once: ℓ = (1/N) Σ_t −log p(x_{t+1} | window of t)."""
    seq_len = seq_len or model.config.max_seq_len
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.autocast(device.type, enabled=False):
        if batches == "all":
            ids = data.train if split == "train" else data.val
            n_windows = (ids.numel() - 1) // seq_len
            starts = torch.arange(n_windows) * seq_len
            offsets = torch.arange(seq_len)
            total, count = 0.0, 0
            for chunk in starts.split(256):
                x = ids[chunk[:, None] + offsets].to(device)
                y = ids[chunk[:, None] + offsets + 1].to(device)
                loss = loss_terms(model, (x, y))[0].double().item()
                total, count = total + loss * y.numel(), count + y.numel()
            result = total / count
        elif isinstance(batches, int) and batches > 0:
            generator = torch.Generator().manual_seed(seed)
            result = float(np.mean([
                loss_terms(model, data.get_batch(split, batch_size, seq_len, generator, device))[0].item()
                for _ in range(batches)]))
        else:
            raise ValueError(f"batches must be a positive int or 'all', got {batches!r}")
    model.train(was_training)
    return result


def byte_unigram_loss(data) -> float:
    """The loss of the best model that ignores context: the cross-entropy of the validation
    bytes under the training split's byte frequencies p̂(b) (add-one smoothed),
    −(1/N) Σ_t log p̂(x_t). A run whose final loss stays at this level has learned nothing but
    byte frequencies ("stalled", :func:`normtools.lab.verdicts.run_outcome`)."""
    counts = torch.bincount(data.train, minlength=data.vocab_size).double() + 1.0
    log_p = torch.log(counts / counts.sum())
    return float(-log_p[data.val].mean())


def default_warmup(steps: int) -> int:
    """The warm-up of :func:`train` when none is given: max(1, ⌊steps / 10⌋) steps."""
    return max(1, steps // 10)


def clipped_steps(grad_norms, clip: float = 1.0, warmup: int | None = None) -> int:
    """The number of steps after warm-up whose gradient norm (before clipping) exceeds ``clip``:
    #{t ≥ warmup : g_t > clip}, the steps :func:`train`'s clipping rescaled. ``warmup``
    defaults to :func:`default_warmup` of the series' length; non-finite norms count."""
    g = np.asarray(grad_norms, dtype=np.float64)
    warmup = default_warmup(g.size) if warmup is None else warmup
    tail = g[warmup:]
    return int((~np.isfinite(tail)).sum() + (tail[np.isfinite(tail)] > clip).sum())


def train(model: nn.Module, data, steps: int, lr: float, *, batch_size: int = 16,
          seq_len: int | None = None, warmup: int | None = None, min_lr_ratio: float = 0.1,
          weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
          grad_clip: float | None = 1.0, precision: str = "auto", z_loss_coef: float = 0.0,
          independent_weight_decay: bool = False, qk_gain_weight_decay: bool = False,
          seed: int = 0, eval_batches: int | str = 4, quiet: bool = False) -> "pandas.DataFrame":
    """Train ``model`` in place for ``steps`` steps on ``data`` (a :class:`normtools.lab.data.TextData`)
    and return one record per step (see module docs).

    ``warmup`` defaults to 10 % of the steps; ``grad_clip=None`` disables clipping;
    ``z_loss_coef`` > 0 minimizes cross-entropy + z_loss_coef · :func:`z_loss` (PaLM: 1e-4);
    ``precision`` is one of :data:`_PRECISIONS` (see :func:`autocast_for`; the validation loss is
    always computed in float32, :func:`evaluate`, over ``eval_batches`` batches or the whole
    split with ``"all"``); ``independent_weight_decay`` and ``qk_gain_weight_decay``: see
    :func:`_make_optimizer`; ``quiet`` turns the progress bar off. A model with an
    ``after_optimizer_step()`` method has it called after every optimizer step (TinyLM: nGPT's
    weight renormalization). With ``eval_batches > 0`` the validation loss before and after
    training is in ``df.attrs["initial_loss"]`` and ``df.attrs["final_loss"]``. A run whose loss
    becomes non-finite stops there (its last record has the non-finite loss).
    """
    import pandas as pd

    if steps < 1 or lr <= 0:
        raise ValueError(f"steps must be ≥ 1 and lr > 0, got steps={steps}, lr={lr}")
    if not z_loss_coef >= 0:
        raise ValueError(f"z_loss_coef must be ≥ 0, got {z_loss_coef}")
    seq_len = seq_len or model.config.max_seq_len
    warmup = default_warmup(steps) if warmup is None else warmup
    device = next(model.parameters()).device
    precision, autocast = autocast_for(precision, device)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = _make_optimizer(model, lr, weight_decay, betas, independent_weight_decay,
                                qk_gain_weight_decay)
    after_step = getattr(model, "after_optimizer_step", None)  # TinyLM: nGPT's renormalization
    depth = len(decoder_layers(model))
    attrs = {"lr": lr, "steps": steps, "precision": precision, "z_loss_coef": z_loss_coef}
    if eval_batches:
        attrs["initial_loss"] = evaluate(model, data, "val", eval_batches, batch_size, seq_len)

    records = []
    model.train()
    bar = tqdm(range(steps), disable=quiet, desc=f"lr={lr:g}", leave=False)
    for step in bar:
        step_lr = lr_at(step, steps, lr, warmup, min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        batch = data.get_batch("train", batch_size, seq_len, generator, device)
        with recording(model) as rec:
            with autocast:
                loss, output_logits = loss_terms(model, batch)
            logit_max = [rec.logit_max(i) for i in range(depth)]
        objective = loss + z_loss_coef * z_loss(output_logits) if z_loss_coef else loss
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(objective).backward()
            scaler.unscale_(optimizer)
        else:
            objective.backward()
        clip = grad_clip if grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if after_step is not None:
            after_step()
        record = {"step": step, "lr": step_lr, "loss": loss.item(), "grad_norm": grad_norm,
                  "log_z": torch.logsumexp(output_logits.detach(), -1).mean().item(),
                  "logit_max": max(logit_max)}
        record.update({f"logit_max_{i}": v for i, v in enumerate(logit_max)})
        record.update({f"act_rms_{i}": rec.residual_rms[i] for i in range(depth)})
        records.append(record)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{record['loss']:.3f}")
        if not math.isfinite(record["loss"]):
            break
    bar.close()
    if eval_batches:
        attrs["final_loss"] = evaluate(model, data, "val", eval_batches, batch_size, seq_len)
    df = pd.DataFrame(records)
    df.attrs.update(attrs)
    return df


def per_layer(records, metric: str) -> "pandas.DataFrame":
    """The per-layer columns ``<metric>_<i>`` of :func:`train`'s records as a (steps × layers)
    frame, columns 0..depth−1, indexed by step."""
    prefix = f"{metric}_"
    layers = sorted(int(c[len(prefix):]) for c in records.columns
                    if c.startswith(prefix) and c[len(prefix):].isdigit())
    if not layers:
        raise ValueError(f"no per-layer columns {prefix}<i> in the records")
    out = records.set_index("step")[[f"{prefix}{i}" for i in layers]]
    out.columns = layers
    return out


#: OLMo 2's spike score: window of the rolling average, and the threshold in standard deviations.
OLMO2_SPIKE_WINDOW, OLMO2_SPIKE_K = 1000, 7.0


def spike_score(series: Sequence[float], window: int = OLMO2_SPIKE_WINDOW,
                k: float = OLMO2_SPIKE_K) -> float:
    """Spike score in percent: 100 · (number of steps t ≥ window with
    |x_t − mean(x_{t−window..t−1})| ≥ k · std(x_{t−window..t−1})) / (len(x) − window).

    The defaults are OLMo 2's definition (the last 1000 values, 7σ); it needs more than
    ``window`` values. The window statistics ignore non-finite values (std: population, ddof 0);
    a non-finite x_t counts as a spike, a value equal to the window's mean never does (so a
    constant series has none).
    """
    x = np.asarray(series, dtype=np.float64)
    if window < 2 or k <= 0:
        raise ValueError(f"window must be ≥ 2 and k > 0, got window={window}, k={k}")
    if x.size <= window:
        raise ValueError(f"need more than window={window} values, got {x.size}")
    spikes = 0
    for t in range(window, x.size):
        past = x[t - window:t]
        past = past[np.isfinite(past)]
        if not np.isfinite(x[t]):
            spikes += 1
        elif past.size >= 2 and 0 < abs(x[t] - past.mean()) >= k * past.std():
            spikes += 1
    return 100.0 * spikes / (x.size - window)


def lr_sensitivity(final_losses_by_lr: Mapping[float, float], initial_loss: float) -> float:
    """Wortsman et al. 2023: E_η[min(ℓ(η), ℓ₀) − min_η ℓ(η)] over the grid of learning rates η.

    A non-finite final loss (a diverged run) counts as ℓ₀."""
    if not final_losses_by_lr:
        raise ValueError("need at least one learning rate")
    capped = np.array([min(loss, initial_loss) if math.isfinite(loss) else initial_loss
                       for loss in final_losses_by_lr.values()])
    return float(np.mean(capped - capped.min()))


def lr_sweep(make_model: Callable[[], nn.Module], data, lrs: Sequence[float], steps: int,
             **train_kwargs) -> "pandas.DataFrame":
    """Train a fresh ``make_model()`` at each learning rate; one row per lr with the initial and
    final validation loss and the run's max attention logit."""
    import pandas as pd

    rows = []
    for lr in lrs:
        records = train(make_model(), data, steps, lr, **train_kwargs)
        rows.append({"lr": lr, "initial_loss": records.attrs["initial_loss"],
                     "final_loss": records.attrs["final_loss"],
                     "logit_max": records["logit_max"].max()})
    return pd.DataFrame(rows)


def plot_seed_band(ax, x, curves, label: str, color=None, style: str = "-"):
    """The median over seeds of ``curves`` (one row per seed) against ``x`` as a line, and the
    range (min to max over seeds) as a band of the same colour. Returns the line."""
    curves = np.atleast_2d(np.asarray(curves, dtype=float))
    with np.errstate(all="ignore"):
        median, lo, hi = (np.nanmedian(curves, 0), np.nanmin(curves, 0), np.nanmax(curves, 0))
    (line,) = ax.plot(x, median, style, color=color, label=label, linewidth=1.5)
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    return line

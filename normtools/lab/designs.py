"""The comparisons of chapter 7 ("Related"): each design a TinyLM option, over several seeds.

A *design* is a label and the :class:`normtools.lab.tinylm.TinyLMConfig` fields that make it
(:data:`DESIGNS`). Two measurements, both repeated for every seed:

* :func:`depth_profiles` — :func:`normtools.lab.probes.depth_profile` of a freshly initialized
  deep model per design: RMS of the residual stream and gradient norm of every layer on one
  batch; :func:`depth_summary` reduces each profile to two numbers, the growth of the residual
  RMS over depth (last layer / first layer) and the ratio of the gradient norms of the first
  and the last layer;
* :func:`train_designs` — :func:`normtools.lab.grid.run_cell` per design, learning rate
  and seed, summarized per run by :func:`normtools.lab.grid.summarize` (final validation
  loss, peak attention logit, gradient-norm spike score, diverged: the criteria of chapter 4a;
  for short runs pass chapter 4a's adapted spike window, ``studies.STUDIES["spikes"]``).

:func:`seed_spread` gives each design's mean, min and max of a metric over the seeds; two
designs are compared paired by seed with :func:`normtools.lab.verdicts.paired_verdict`.

:func:`transformers_qk_norm` returns the QK-Norm modules of two models whose QK-Norm is not an
RMSNorm with a learned scale (Llama 4, Chameleon), built by transformers from a tiny config;
:func:`atlas_table` lists what the atlas (:mod:`normtools.cards.atlas`) measured for every
causal-LM family of transformers, and :func:`released_designs` what the derived norm cards record
(including the notes on soft-capping, which the atlas does not measure).
"""

from __future__ import annotations

import torch

from normtools.cards import bundled_configs, from_hf_config, load_bundled_config, tiny_config
from normtools.cards.atlas import atlas_rows, atlas_spec, load_atlas
from normtools.lab.grid import run_cell, summarize
from normtools.lab.probes import depth_profile, split_batch
from normtools.lab.tinylm import TinyLM, TinyLMConfig
from normtools.lab.train import OLMO2_SPIKE_K, OLMO2_SPIKE_WINDOW

#: label → TinyLMConfig fields. The first two are the baselines of the seed chapters.
DESIGNS = {
    "Pre-LN": dict(placement="pre"),
    "Post-LN": dict(placement="post"),
    "DeepNorm": dict(placement="deepnorm"),
    "Admin": dict(placement="admin"),
    "Mix-LN": dict(placement="mix_ln"),
    "LayerNorm Scaling": dict(placement="lns"),
    "Peri-LN (sandwich)": dict(placement="sandwich"),
    "res-post-norm": dict(placement="post_sublayer"),
    "nGPT": dict(placement="ngpt"),
    "DyT (Pre-LN)": dict(placement="pre", norm="dyt"),
}


#: The chapter's settings per ``size``: the deep model of the depth probe and its batch, the
#: trained model, the run length and batch, the peak learning rates, and the designs trained
#: (the sandwich and OLMo 2's post-sublayer norm are trained in chapter 4a's grid).
RELATED_SIZES = {
    "test": dict(probe_model=dict(width=32, depth=4, heads=2, max_seq_len=16), probe_batch_size=2,
                 model=dict(width=32, depth=2, heads=2, max_seq_len=16), steps=4, batch_size=2,
                 lrs=(1e-2,)),
    "cpu": dict(probe_model=dict(width=64, depth=16, heads=4, max_seq_len=32), probe_batch_size=8,
                model=dict(width=64, depth=4, heads=4, max_seq_len=32), steps=60, batch_size=8,
                lrs=(1e-2,)),
    "gpu": dict(probe_model=dict(width=256, depth=48, heads=4, max_seq_len=128), probe_batch_size=16,
                model=dict(width=512, depth=12, heads=8, max_seq_len=256), steps=1000, batch_size=32,
                lrs=(3e-3, 1e-2)),
}
TRAINED_DESIGNS = ("Pre-LN", "Post-LN", "DeepNorm", "Admin", "Mix-LN", "LayerNorm Scaling",
                   "nGPT", "DyT (Pre-LN)")


def _designs(names):
    unknown = [n for n in names if n not in DESIGNS]
    if unknown:
        raise ValueError(f"unknown designs {unknown}; expected some of {', '.join(DESIGNS)}")
    return {n: DESIGNS[n] for n in names}


def depth_profiles(names, batch, seeds, base_config: TinyLMConfig) -> "pandas.DataFrame":
    """:func:`normtools.lab.probes.depth_profile` of a TinyLM (``base_config`` with the design's
    fields, initialized after ``torch.manual_seed(seed)``, on the batch's device; Admin's
    profiling pass, :meth:`TinyLM.initialize_from_data`, on the same batch) per design and
    seed, on ``batch``; one row per (design, seed, layer)."""
    import pandas as pd

    designs = _designs(names)
    device = split_batch(batch)[0].device
    frames = []
    for name, fields in designs.items():
        for seed in seeds:
            torch.manual_seed(seed)
            model = TinyLM(base_config.replace(**fields)).to(device)
            model.initialize_from_data(split_batch(batch)[0])
            df = depth_profile(model, batch)
            df.insert(0, "seed", seed)
            df.insert(0, "design", name)
            frames.append(df)
    return pd.concat(frames, ignore_index=True)


def depth_summary(profiles) -> "pandas.DataFrame":
    """One row per (design, seed) of :func:`depth_profiles`:

    rms_growth   residual RMS after the last layer / after the first layer
    grad_ratio   gradient norm of the first layer / of the last layer
    """
    import pandas as pd

    rows = []
    for (design, seed), part in profiles.groupby(["design", "seed"], sort=False):
        part = part.sort_values("layer")
        first, last = part.iloc[0], part.iloc[-1]
        rows.append({"design": design, "seed": seed,
                     "rms_growth": last["residual_rms"] / first["residual_rms"],
                     "grad_ratio": first["grad_norm"] / last["grad_norm"]})
    return pd.DataFrame(rows)


def train_designs(names, data, base_config: TinyLMConfig, lrs, seeds, *, steps: int,
                  batch_size: int, spike_window: int = OLMO2_SPIKE_WINDOW,
                  spike_k: float = OLMO2_SPIKE_K, **run_kwargs) -> "pandas.DataFrame":
    """Train each design at each peak learning rate with each seed
    (:func:`normtools.lab.grid.run_cell`: same initialization of shared weights and same
    batches per seed); one row per run, :func:`normtools.lab.grid.summarize`'s columns
    (spike scores with ``spike_window`` and ``spike_k``: OLMo 2's by default, NaN for runs no
    longer than the window) with ``design`` and ``seed`` in front."""
    import pandas as pd

    frames = []
    for name, fields in _designs(names).items():
        for lr in lrs:
            for seed in seeds:
                run = run_cell({**fields, "lr": lr}, data, base_config, steps=steps,
                               batch_size=batch_size, seed=seed, **run_kwargs)
                row = summarize([run], spike_window, spike_k)
                row.insert(0, "seed", seed)
                row.insert(0, "design", name)
                frames.append(row)
    return pd.concat(frames, ignore_index=True)


def seed_spread(table, metric: str, by=("design",)) -> "pandas.DataFrame":
    """Per group of ``by`` (in order of appearance): median, mean, min and max of ``metric``
    over the seeds, and the number of seeds."""
    grouped = table.groupby(list(by), sort=False)[metric]
    return grouped.agg(["median", "mean", "min", "max", "count"]).rename(columns={"count": "seeds"})


# --------------------------------------------------------------------------------------------
# Released models: QK-Norm variants in transformers' code, and what the norm cards record

def transformers_qk_norm(model_type: str):
    """(q_norm, k_norm, config): the QK-Norm modules of layer 0's attention as transformers
    builds them from ``cards.tiny_config`` (random weights, nothing downloaded).

    ``"llama4_text"``: ``Llama4TextL2Norm``, one module without parameters used for q and k;
    ``"chameleon"``: ``ChameleonLayerNorm`` over (heads, head_dim), one weight and bias per head.
    """
    from transformers import AutoConfig

    if model_type not in ("llama4_text", "chameleon"):
        raise ValueError(f"unknown model_type {model_type!r}; expected llama4_text or chameleon")
    config = AutoConfig.for_model(**tiny_config(model_type))
    if model_type == "llama4_text":
        from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

        attn = Llama4TextAttention(config, layer_idx=0)
        return attn.qk_norm, attn.qk_norm, config
    from transformers.models.chameleon.modeling_chameleon import ChameleonAttention

    attn = ChameleonAttention(config, layer_idx=0)
    return attn.q_norm, attn.k_norm, config


#: Families the cards cover that have no bundled published config: their tiny configs.
_TINY_FAMILIES = ("gemma2", "cohere", "phi", "deepseek_v3")


def released_designs() -> "pandas.DataFrame":
    """One row per model card: the six bundled published configs (``source`` "published") and a
    tiny config of each other family the cards cover (``source`` "tiny", transformers' defaults
    for what the tiny config leaves out): placement, QK-Norm scope, the norms outside the
    block/final/QK pattern, and the card's notes on attention-logit soft-capping."""
    import pandas as pd

    sources = [(name, "published", load_bundled_config(name)) for name in bundled_configs()]
    sources += [(family, "tiny", tiny_config(family)) for family in _TINY_FAMILIES]
    rows = []
    for name, source, config in sources:
        card = from_hf_config(config)
        rows.append({
            "model": name, "source": source, "model_type": card.model_type,
            "placement": card.placement, "qk_norm": card.qk_norm.scope,
            "other_norms": ", ".join(o.name for o in card.other_norms) or "-",
            "softcapping": "; ".join(n for n in card.notes if "softcapping" in n) or "-",
        })
    return pd.DataFrame(rows)


def atlas_table(atlas=None) -> "pandas.DataFrame":
    """The atlas's rows (:func:`normtools.cards.atlas.atlas_rows`), one per probed family, with
    the names of each family's other norms (``other_norm_names``, comma-separated, "-" for
    none)."""
    import pandas as pd

    atlas = atlas or load_atlas()
    table = pd.DataFrame(atlas_rows(atlas))
    table["other_norm_names"] = [", ".join(o.name for o in atlas_spec(t, atlas).other_norms) or "-"
                                 for t in table["model_type"]]
    return table


"""The atlas: a norm card for every causal-LM family of the installed transformers, read from the
running code rather than written as a rule.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the probe builds a tiny instance from
the family's config class (its defaults, shrunk to hidden 64 and 2-4 layers by
:func:`normtools.cards.tiny_config`; offline, random weights, CPU) and measures the modules
while they run:

* **norm kind**: rows with a non-zero mean are normalized; the output matches exactly one of
  RMSNorm ``s * x * rsqrt(mean(x^2) + eps)`` and LayerNorm ``s * (x - mean) * rsqrt(var + eps) + b``;
* **eps**: read from the module, then measured on rows whose mean square is about eps:
  with ``s = 1``, ``y / x = rsqrt(ms + eps)`` gives ``eps_measured = (x / y)^2 - ms``;
* **scale** ``s = offset + w``: a zero weight that still gives a non-zero output means ``1 + w``;
* **casting**: the bf16 output is compared bit for bit with the "llama" and "gemma" conventions
  of :mod:`normtools.core.reference` (and ``torch.nn.functional.layer_norm`` for LayerNorm);
* **placement**: forward hooks record what each norm and each sublayer of a layer read and
  wrote; a norm whose output is a sublayer's input is an input norm, a norm whose input is a
  sublayer's output is an output norm, a norm whose output is the layer's (or an enclosing
  sublayer's) output after the residual add is a post norm; two sublayers fed from the layer's
  input are parallel. pre = input norms only, sandwich = input and output norms, post_sublayer
  = output norms only, post = post norms; layers that differ make the family "mixed";
* **QK-Norm**: a q/k norm inside attention; scope by perturbing one head of its input and
  seeing which heads of its output move (one head: per head; all: per layer), the weight shape
  ((head_dim,), (H, head_dim), (H*head_dim,)), and before/after RoPE: the same tokens run again
  with every position id moved by the same offset; relative positions do not change, so only
  RoPE's rotation does, and a norm before RoPE reads the same input both times (undetermined
  when the model's rotary embedding ignores the offset). The first layer with a q/k norm is
  probed: in a hybrid (Qwen3-Next, `qwen3_5`) layer 0 may be linear attention, without one;
* **final norm** (the norm whose output is the LM head's input), **other norms** (latent norms,
  embedding norms, norms inside mixers), **projection biases** and **attention sinks**
  (from the parameters).

Families the probe cannot build or run are listed with the reason (never dropped). The result
is the committed ``normtools/cards/data/atlas.json`` (:func:`build_atlas`, ``normtools atlas
--refresh``), which records the transformers version and :data:`PROBE_VERSION`;
:func:`compare_atlases` diffs two atlases (a new transformers release against the committed one).

Modules, in the order a probe runs: ``run`` (build the tiny model, run it with hooks:
:func:`probe_family`), ``probed`` (what the hooks saw, :class:`ProbedModel`), ``layers`` (each
layer's norms by role, and its placement), ``qk`` (QK-Norm), ``norm`` (one norm module:
:func:`probe_norm`), ``pattern`` (the per-layer pattern of a layer-varying family), ``card`` (the card, one
function per field), ``table`` (the whole atlas: build, load, save, rows, comparisons) and
``html`` (the atlas page's filterable table).
"""

from normtools.cards.atlas.norm import probe_norm
from normtools.cards.atlas.probed import ProbedModel, ProbeError
from normtools.cards.atlas.run import probe_family
from normtools.cards.atlas.table import (ATLAS_FILE, PROBE_VERSION, atlas_rows, atlas_spec, build_atlas,
                                         causal_lm_model_types, checkpoint_differences, compare_atlases, load_atlas,
                                         rule_disagreements, save_atlas)

__all__ = ["PROBE_VERSION", "ATLAS_FILE", "ProbeError", "ProbedModel", "probe_norm", "probe_family",
           "causal_lm_model_types", "build_atlas", "load_atlas", "save_atlas", "atlas_spec", "atlas_rows",
           "compare_atlases", "rule_disagreements", "checkpoint_differences"]

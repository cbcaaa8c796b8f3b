"""Model norm cards: write down every normalization choice of a model before comparing checkpoints.

A :class:`ModelNormSpec` ("norm card") records, for one model, what a reader needs to reproduce the
norms of its forward pass:

* the block norm: kind (RMSNorm ``y = s * x * rsqrt(mean(x^2) + eps)`` or LayerNorm
  ``y = s * (x - mean) * rsqrt(var + eps) + b``), eps, bias, scale parameterization
  ``s = offset + w`` (offset 0 for ``w``, 1 for ``1 + w``) and casting (see below);
* where the block norms sit (placement) and what each layer's norm modules are called;
* the final norm, QK-Norm (scope, its own norm, before or after RoPE), other norms (latent norms,
  embedding norms), projection biases and attention sinks;
* the shapes needed to check a checkpoint against its config, and the config values that the
  source could not confirm.

Casting, with x̂ the normalized row in float32 (``x.float() * r``, r = rsqrt(mean(x.float()**2) + eps),
for RMSNorm; ``(x.float() - mean) * rstd`` for LayerNorm; statistics always float32):

* ``"llama"``: ``(offset + w) * x̂.to(x.dtype)``  (HF Llama, Qwen3, MiniMax-M2, DeepSeek-V3)
* ``"gemma"``: ``(x̂ * (offset + w.float())).to(x.dtype)``  (HF Gemma 2/3, OLMo 2/3, gpt-oss,
  Cohere's LayerNorm)
* ``"torch"``: ``torch.nn.LayerNorm`` in the input dtype (HF BERT, Phi)

Placement: ``"pre"`` ``x + f(norm(x))``; ``"post"`` ``norm(x + f(x))`` (BERT);
``"sandwich"`` ``x + norm2(f(norm1(x)))`` (Gemma 2/3); ``"post_sublayer"`` ``x + norm(f(x))``
(OLMo 2/3); ``"parallel"`` ``x + attn(norm(x)) + mlp(norm(x))`` (Cohere, Phi).

QK-Norm scope: ``"per_head"`` one weight of size head_dim shared by all heads; ``"per_head_weights"``
one weight per head, shape (H, head_dim); ``"per_layer"`` one norm over all H*head_dim features.

Modules: ``types`` (the card's data types and :func:`diff`), ``derive`` (a card from a
transformers config, one rule per family, and the model of a config), ``tiny`` (tiny configs of
random-weight models, :func:`tiny_config`), ``sources`` (checkpoint directories, config.json
files, bundled published configs in ``configs/``), ``params`` (exact parameter counts),
``render`` (rows, Markdown), ``cli`` (``normtools card`` / ``diff`` / ``atlas``),
``safetensors_header`` (tensor names and shapes without loading weights), ``patching`` (swap a
transformers model's norms for the library's, as its card says; imported on its own, since it
loads the kernels) and the subpackage ``atlas`` (a card for every causal-LM family of the
installed transformers, probed from its running code: ``run``, ``probed``, ``layers``, ``qk``,
``norm``, ``card``, ``table``; the committed result is ``data/atlas.json``).
"""

from normtools.cards.derive import SUPPORTED_MODEL_TYPES, build_model, from_hf_config
from normtools.cards.params import COUNT_KEYS, TEXTBOOK_KEYS, count_parameters
from normtools.cards.render import CASTING_FORMULAS, card, card_rows, diff_table
from normtools.cards.sources import bundled_configs, from_checkpoint, load, load_bundled_config, read_config_json
from normtools.cards.tiny import forced_flags, tiny_config
from normtools.cards.types import (PLACEMENTS, QK_SCOPES, CheckpointMismatchError, ModelNormSpec, NormSpec,
                                   OtherNorm, ProjectionBiases, QKNormSpec, SpecError, diff)

__all__ = ["SUPPORTED_MODEL_TYPES", "PLACEMENTS", "QK_SCOPES", "SpecError", "CheckpointMismatchError",
           "NormSpec", "QKNormSpec", "ProjectionBiases", "OtherNorm", "ModelNormSpec", "diff",
           "from_hf_config", "build_model", "tiny_config", "forced_flags", "read_config_json", "from_checkpoint",
           "bundled_configs", "load_bundled_config", "load", "COUNT_KEYS", "TEXTBOOK_KEYS",
           "count_parameters", "CASTING_FORMULAS", "card_rows", "card", "diff_table"]

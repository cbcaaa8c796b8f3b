"""Deriving a card from a transformers config: one rule per supported family, and the transformers
model of a config (:func:`build_model`)."""

import contextlib

from normtools.cards.types import (SUPPORTED_MODEL_TYPES, ModelNormSpec, NormSpec, OtherNorm,
                                   ProjectionBiases, QKNormSpec, SpecError)
from normtools.core.validate import check_eps


def transformers_config(config):
    """(transformers config object of the text model, unconfirmed keys) from a config or dict."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig

    unconfirmed = ()
    if isinstance(config, dict):
        model_type = config.get("model_type")
        _check_supported(model_type)
        unconfirmed = config.get("_unconfirmed", [])
        if not isinstance(unconfirmed, (list, tuple)) or not all(isinstance(k, str) for k in unconfirmed):
            raise SpecError(f"_unconfirmed must be a list of config keys, got {str(unconfirmed)[:80]}")
        unconfirmed = tuple(unconfirmed)
        values = {k: v for k, v in config.items() if not k.startswith("_") and k != "model_type"}
        try:
            config = AutoConfig.for_model(model_type, **values)
        except (StrictDataclassError, TypeError, ValueError, ArithmeticError) as e:
            raise SpecError(f"{model_type} config rejected by transformers: {' '.join(str(e).split())}") from None
    elif not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers config or a config.json dict, got {type(config).__name__}")
    _check_supported(config.model_type)
    if config.model_type == "gemma3":  # multimodal wrapper: the norms live in the text model
        config = config.text_config
    _check_sizes(config)
    _check_eps(config)
    return config, unconfirmed


# The sizes a parameter count and a checkpoint check rely on; each, where the config has it,
# must be an integer in [1, MAX_SIZE] (no published model comes within 100x of the bound).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
               "num_local_experts", "n_routed_experts", "q_lora_rank", "kv_lora_rank")
MAX_SIZE = 2**31 - 1


def _check_sizes(c) -> None:
    """:class:`SpecError` for a size that is not a positive integer up to ``MAX_SIZE``, or
    attention heads that key/value heads do not divide."""
    for field in SIZE_FIELDS:
        value = getattr(c, field, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise SpecError(f"{c.model_type} config: {field} must be an integer in [1, {MAX_SIZE}], "
                            f"got {str(value)[:40]}")
    heads, kv_heads = getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise SpecError(f"{c.model_type} config: num_key_value_heads {kv_heads} does not divide "
                        f"num_attention_heads {heads}")


# The norm eps keys the family rules read; each, where the config has it, must pass
# normtools.core.validate.check_eps (a finite real number, at least float32's smallest normal one).
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps")


def _check_eps(c) -> None:
    """:class:`SpecError` naming the key for an eps of ``EPS_FIELDS`` that ``check_eps`` rejects."""
    for field in EPS_FIELDS:
        value = getattr(c, field, None)
        if value is None:
            continue
        try:
            check_eps(value)
        except (TypeError, ValueError) as e:
            raise SpecError(f"{c.model_type} config: {field}: {e}") from None


def build_model(config, *, device=None):
    """The transformers model of ``config`` (a config object or a config.json dict), with random
    weights: ``AutoModel`` for BERT (an encoder), ``AutoModelForCausalLM`` otherwise (the text
    model of a multimodal Gemma 3). ``device="meta"`` builds the full-size shapes without memory.
    This is the model whose ``numel`` :func:`count_parameters` must equal."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    config, _ = transformers_config(config)
    auto = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return auto.from_config(config)


def _check_supported(model_type):
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def from_hf_config(config) -> ModelNormSpec:
    """The norm spec of the model that transformers builds from ``config`` (object or dict).

    An unknown ``model_type`` raises :class:`SpecError` naming the supported ones.
    """
    c, unconfirmed = transformers_config(config)
    family = FAMILY_RULES[c.model_type]
    fields = family(c)
    return ModelNormSpec(
        model_type=c.model_type,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=_head_dim(c),
        unconfirmed=unconfirmed,
        **fields,
    )


def _rms(eps, casting, offset=0.0) -> NormSpec:
    return NormSpec("rms", float(eps), False, float(offset), casting)


PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
_POST_SUBLAYER = ("post_attention_layernorm", "post_feedforward_layernorm")


def _attn_biases(c, mlp=False, **extra) -> ProjectionBiases:
    b = bool(c.attention_bias)
    return ProjectionBiases(q=b, k=b, v=b, o=b, mlp=mlp, **extra)


def _llama(c):
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=PRE_NORMS, final_norm=norm,
                qk_norm=QKNormSpec(), biases=_attn_biases(c, mlp=bool(c.mlp_bias)))


def _qwen3(c):
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=PRE_NORMS, final_norm=norm,
                qk_norm=QKNormSpec("per_head", norm, True), biases=_attn_biases(c))


def _olmo2(c):
    norm = _rms(c.rms_norm_eps, "gemma")
    return dict(block_norm=norm, placement="post_sublayer", layer_norms=_POST_SUBLAYER, final_norm=norm,
                qk_norm=QKNormSpec("per_layer", norm, True), biases=_attn_biases(c))


def _gemma_notes(c):
    notes = [f"embeddings scaled by sqrt(hidden_size) = {c.hidden_size ** 0.5:.4g} (rounded to the model dtype)",
             f"attention scale query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = {c.query_pre_attn_scalar}"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key, None) is not None:
            notes.append(f"{key} = {getattr(c, key)}")
    return tuple(notes)


def _gemma2(c):
    norm = _rms(c.rms_norm_eps, "gemma", offset=1.0)
    return dict(block_norm=norm, placement="sandwich", layer_norms=SANDWICH_NORMS, final_norm=norm,
                qk_norm=QKNormSpec(), biases=_attn_biases(c), notes=_gemma_notes(c))


def _gemma3(c):
    norm = _rms(c.rms_norm_eps, "gemma", offset=1.0)
    return dict(block_norm=norm, placement="sandwich", layer_norms=SANDWICH_NORMS, final_norm=norm,
                qk_norm=QKNormSpec("per_head", norm, True), biases=_attn_biases(c), notes=_gemma_notes(c))


def _gpt_oss(c):
    norm = _rms(c.rms_norm_eps, "gemma")
    return dict(block_norm=norm, placement="pre", layer_norms=PRE_NORMS, final_norm=norm, qk_norm=QKNormSpec(),
                biases=_attn_biases(c, router=True, experts=True), attention_sinks=True,
                notes=("one learned attention-sink logit per head joins each softmax",))


def _minimax_m2(c):
    # transformers' MiniMaxM2Attention always builds per-layer q_norm/k_norm; a config asking for
    # anything else describes a model transformers does not build, so refuse rather than guess.
    if getattr(c, "use_qk_norm", True) is not True or getattr(c, "qk_norm_type", "per_layer") != "per_layer":
        raise SpecError(
            "minimax_m2: transformers builds per_layer QK-Norm only; config has "
            f"use_qk_norm={getattr(c, 'use_qk_norm', None)!r}, qk_norm_type={getattr(c, 'qk_norm_type', None)!r}"
        )
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=PRE_NORMS, final_norm=norm,
                qk_norm=QKNormSpec("per_layer", norm, True),
                biases=ProjectionBiases(q=False, k=False, v=False, o=False, mlp=False),
                notes=("router e_score_correction_bias is a buffer (not a parameter): it shifts expert "
                       "choice, not the routing weights",))


def _cohere(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), False, 0.0, "gemma")
    qk = QKNormSpec("per_head_weights", norm, True) if c.use_qk_norm else QKNormSpec()
    return dict(block_norm=norm, placement="parallel", layer_norms=("input_layernorm",), final_norm=norm,
                qk_norm=qk, biases=_attn_biases(c), notes=(f"logits multiplied by logit_scale = {c.logit_scale}",))


def _phi(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), True, 0.0, "torch")
    qk = QKNormSpec("per_head", norm, True) if c.qk_layernorm else QKNormSpec()
    factor = c.rope_parameters.get("partial_rotary_factor", 1.0)
    return dict(block_norm=norm, placement="parallel", layer_norms=("input_layernorm",), final_norm=norm,
                qk_norm=qk, biases=ProjectionBiases(q=True, k=True, v=True, o=True, mlp=True, lm_head=True),
                notes=(f"partial rotary: RoPE on {factor:g} of each head's features",))


def _deepseek_v3(c):
    norm = _rms(c.rms_norm_eps, "llama")
    latent = _rms(1e-6, "llama")  # DeepseekV3RMSNorm's default eps: the config's rms_norm_eps is not passed
    others = []
    if c.q_lora_rank is not None:
        others.append(OtherNorm("self_attn.q_a_layernorm", True, c.q_lora_rank, latent))
    others.append(OtherNorm("self_attn.kv_a_layernorm", True, c.kv_lora_rank, latent))
    b = bool(c.attention_bias)
    biases = ProjectionBiases(q=b and c.q_lora_rank is not None, k=b, v=b, o=b, mlp=False)
    return dict(block_norm=norm, placement="pre", layer_norms=PRE_NORMS, final_norm=norm, qk_norm=QKNormSpec(),
                biases=biases, other_norms=tuple(others),
                notes=("MLA: q and kv are norms of low-rank latents (other norms), not QK-Norm on heads",
                       "router e_score_correction_bias is a buffer (not a parameter)"))


def _bert(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), True, 0.0, "torch")
    return dict(block_norm=norm, placement="post", layer_norms=("attention.output.LayerNorm", "output.LayerNorm"),
                final_norm=None, qk_norm=QKNormSpec(),
                biases=ProjectionBiases(q=True, k=True, v=True, o=True, mlp=True),
                other_norms=(OtherNorm("embeddings.LayerNorm", False, c.hidden_size, norm),))


FAMILY_RULES = {
    "llama": _llama, "qwen3": _qwen3, "olmo2": _olmo2, "olmo3": _olmo2, "gemma2": _gemma2,
    "gemma3_text": _gemma3, "gpt_oss": _gpt_oss, "minimax_m2": _minimax_m2, "cohere": _cohere,
    "phi": _phi, "deepseek_v3": _deepseek_v3, "bert": _bert,
}

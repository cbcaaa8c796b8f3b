"""Exact parameter counts of the model transformers builds from a config, broken down by kind,
beside the bias-free "textbook" formula."""

from normtools.cards.derive import transformers_config, from_hf_config
from normtools.cards.types import ModelNormSpec


COUNT_KEYS = (
    "embeddings", "attention_weights", "attention_biases", "norms", "mlp_weights", "mlp_biases",
    "router_weights", "router_biases", "attention_sinks", "lm_head", "lm_head_bias",
    "pooler_weights", "pooler_biases",
)
# the weight matrices: what the bias-free "textbook" formula counts
TEXTBOOK_KEYS = ("embeddings", "attention_weights", "mlp_weights", "router_weights", "lm_head", "pooler_weights")


def count_parameters(config) -> dict:
    """Exact parameter count of the model transformers builds from ``config``, broken down.

    The model is ``AutoModelForCausalLM.from_config(config)`` for decoders (for a multimodal Gemma 3
    config: its text model, ``Gemma3ForCausalLM``) and ``BertModel`` (with pooler) for BERT; tied
    embeddings are counted once. ``total`` equals ``sum(p.numel() for p in model.parameters())``.
    Every key of :data:`COUNT_KEYS` is present (0 where a model has none), plus ``total`` and
    ``textbook_bias_free``: the weight matrices only (embeddings, attention and MLP/expert/router
    matrices, lm_head), i.e. the usual formula that drops biases, norms and attention sinks.
    """
    c, _ = transformers_config(config)
    spec = from_hf_config(c)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    counts["embeddings"] = V * H
    if not c.tie_word_embeddings:
        counts["lm_head"] = V * H
    counts["lm_head_bias"] = V if spec.biases.lm_head else 0
    counts["norms"] = _norm_parameters(spec)
    counts["attention_sinks"] = L * spec.num_heads if spec.attention_sinks else 0
    _ATTENTION_COUNTERS.get(c.model_type, _mha_counts)(c, spec, counts)
    _MLP_COUNTERS.get(c.model_type, _gated_mlp_counts)(c, spec, counts)
    counts["total"] = sum(counts[k] for k in COUNT_KEYS)
    counts["textbook_bias_free"] = sum(counts[k] for k in TEXTBOOK_KEYS)
    return counts


def _norm_parameters(spec: ModelNormSpec) -> int:
    def size(norm, numel):
        return numel * (2 if norm.bias else 1)

    n = spec.num_layers * len(spec.layer_norms) * size(spec.block_norm, spec.hidden_size)
    if spec.final_norm is not None:
        n += size(spec.final_norm, spec.hidden_size)
    qk, d = spec.qk_norm, spec.head_dim
    if qk.scope == "per_head":
        n += spec.num_layers * 2 * size(qk.norm, d)
    elif qk.scope in ("per_head_weights", "per_layer"):
        n += spec.num_layers * size(qk.norm, (spec.num_heads + spec.num_kv_heads) * d)
    for other in spec.other_norms:
        n += (spec.num_layers if other.per_layer else 1) * size(other.norm, other.dim)
    return n


def _mha_counts(c, spec, counts):
    """q, k, v, o projections: (H -> nh*d), 2 x (H -> nkv*d), (nh*d -> H)."""
    H, L = c.hidden_size, c.num_hidden_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    counts["attention_weights"] = L * (2 * H * q + 2 * H * kv)
    b = spec.biases
    counts["attention_biases"] = L * (q * b.q + kv * b.k + kv * b.v + H * b.o)


def _mla_counts(c, spec, counts):
    """DeepSeek MLA: q via a q_lora_rank latent (or one matrix), kv via a kv_lora_rank latent."""
    H, L, nh = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = H * nh * qk_head
    else:
        q = H * c.q_lora_rank + c.q_lora_rank * nh * qk_head
    kv = H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
    o = nh * c.v_head_dim * H
    counts["attention_weights"] = L * (q + kv + o)
    b = spec.biases
    q_bias = c.q_lora_rank if b.q else 0
    kv_bias = (c.kv_lora_rank + c.qk_rope_head_dim) if b.k else 0
    counts["attention_biases"] = L * (q_bias + kv_bias + (H if b.o else 0))


def _bert_attention_counts(c, spec, counts):
    _mha_counts(c, spec, counts)
    counts["embeddings"] += (c.max_position_embeddings + c.type_vocab_size) * c.hidden_size
    counts["pooler_weights"] = c.hidden_size * c.hidden_size
    counts["pooler_biases"] = c.hidden_size


def _gated_mlp_counts(c, spec, counts):
    """SwiGLU/GeGLU MLP: gate and up (H -> I), down (I -> H)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    counts["mlp_weights"] = L * 3 * H * I
    counts["mlp_biases"] = L * (2 * I + H) if spec.biases.mlp else 0


def _two_layer_mlp_counts(c, spec, counts):
    """fc1 (H -> I), activation, fc2 (I -> H), both with bias (Phi, BERT)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    counts["mlp_weights"] = L * 2 * H * I
    counts["mlp_biases"] = L * (I + H)


def _gpt_oss_mlp_counts(c, spec, counts):
    """E experts of gate_up (H -> 2I) and down (I -> H), each with bias; router (H -> E) with bias."""
    H, I, L, E = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_local_experts
    counts["mlp_weights"] = L * E * 3 * H * I
    counts["mlp_biases"] = L * E * (2 * I + H)
    counts["router_weights"] = L * E * H
    counts["router_biases"] = L * E


def _minimax_mlp_counts(c, spec, counts):
    """E bias-free experts of gate_up (H -> 2I) and down (I -> H); bias-free router (H -> E)."""
    H, I, L, E = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_local_experts
    counts["mlp_weights"] = L * E * 3 * H * I
    counts["router_weights"] = L * E * H


def _deepseek_mlp_counts(c, spec, counts):
    """first_k_dense_replace dense layers, then MoE layers: routed + shared experts and a router."""
    H, L, E = c.hidden_size, c.num_hidden_layers, c.n_routed_experts
    dense = min(c.first_k_dense_replace, L)
    moe_experts = E * 3 * H * c.moe_intermediate_size + 3 * H * c.moe_intermediate_size * c.n_shared_experts
    counts["mlp_weights"] = dense * 3 * H * c.intermediate_size + (L - dense) * moe_experts
    counts["router_weights"] = (L - dense) * E * H


_ATTENTION_COUNTERS = {"deepseek_v3": _mla_counts, "bert": _bert_attention_counts}
_MLP_COUNTERS = {
    "phi": _two_layer_mlp_counts, "bert": _two_layer_mlp_counts, "gpt_oss": _gpt_oss_mlp_counts,
    "minimax_m2": _minimax_mlp_counts, "deepseek_v3": _deepseek_mlp_counts,
}


# count_parameters' keys that hold additive biases of projections, experts, router, lm_head and
# pooler; the biases of norms are counted under "norms".
BIAS_KEYS = ("attention_biases", "mlp_biases", "router_biases", "lm_head_bias", "pooler_biases")


_NORM_CLASS_ENDINGS = ("Norm", "NormGated")


def is_norm_module(module) -> bool:
    """A leaf normalization module: a subclass of torch's LayerNorm, RMSNorm or GroupNorm
    (Nemotron's ``LayerNorm1P``), or a class whose name ends in "Norm" (LlamaRMSNorm, ...) or
    "NormGated" (the gated RMSNorm of linear-attention layers, Qwen3-Next's ``linear_attn.norm``),
    that holds no other such module. The one rule of every chapter and of the atlas (which also
    recognises a norm by its output, :func:`normtools.cards.atlas.norm.behaves_as_norm`)."""
    return _norm_class(module) and not any(_norm_class(m) for m in list(module.modules())[1:])


def _norm_class(module) -> bool:
    import torch

    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm)) or \
        type(module).__name__.endswith(_NORM_CLASS_ENDINGS)


def bias_parameters(model) -> dict:
    """Every additive bias of ``model`` outside its norms: {qualified parameter name: parameter}.

    A bias is a parameter named ``bias`` or ending in ``_bias``, of a module that is not a norm
    (:func:`is_norm_module`). The name rule, not the shape of a neighbouring ``weight``, decides:
    gpt-oss's experts keep ``gate_up_proj_bias`` and ``down_proj_bias`` as plain parameters of
    one module, beside 3-D expert matrices. The sum of their numel equals the sum of
    :data:`BIAS_KEYS` of :func:`count_parameters` for the same config.
    """
    biases = {}
    for module_name, module in model.named_modules():
        if is_norm_module(module):
            continue
        for name, p in module.named_parameters(recurse=False):
            if name == "bias" or name.endswith("_bias"):
                biases[f"{module_name}.{name}" if module_name else name] = p
    return biases

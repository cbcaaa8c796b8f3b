"""``normtools.patch``: swap a transformers model's norm modules for normtools ones.

The model's norm spec (``normtools.cards.from_hf_config(model.config)``) decides every choice:
each block norm, the final norm, the QK-Norm modules and the other norms (DeepSeek-V3's latent
norms) become a ``normtools.RMSNorm(dim, eps, offset=..., casting=...)`` (or a
``normtools.LayerNorm`` for a LayerNorm without bias computed in float32, as Cohere's), holding
the old module's parameter objects (their ``requires_grad``, and an optimizer's references to
them, are unchanged) and its hooks, with ``.backend`` set. The HF attention modules keep calling ``self.q_norm(...)``
on the same tensors, so a per_head norm (weight ``(head_dim,)``) still sees the
``(..., H, head_dim)`` view and a per_layer norm (weight ``(H*head_dim,)``) the flat projection.

Everything is checked before anything is replaced: a model whose norms the spec cannot match
(an unsupported family or layout, a module of the wrong class, size or eps) raises
:class:`PatchError` naming every problem, and the model is left untouched.

``fuse_qk_rope=True`` also fuses QK-Norm with the RoPE that follows it (``normtools.qk_norm_rope``)
in the models that apply RoPE right after their q/k norms: Qwen3, OLMo 2 and Gemma 3. That
needs a new attention forward, which is ``_fused_attention_forward`` below: the same steps as
the transformers forward, with ``q_norm``, ``k_norm`` and ``apply_rotary_pos_emb`` replaced by
one call. Since it restates transformers' code, it is used only for the exact forward it was
checked against (a hash of its source, per class, in ``FUSABLE_ATTENTION``); any other
transformers version gets a PatchError instead of a forward that may have drifted.
"""

import dataclasses
import hashlib
import inspect
import sys
import types

from normtools.core import validate
from normtools.core.modules import LayerNorm, RMSNorm
from normtools.core.rope import qk_norm_rope
from normtools.cards.derive import from_hf_config
from normtools.cards.types import NormSpec, SpecError

__all__ = ["patch", "PatchError"]


class PatchError(ValueError):
    """A model whose norms ``normtools.patch`` cannot replace exactly."""


@dataclasses.dataclass(frozen=True)
class _Swap:
    name: str  # module path in the model
    norm: NormSpec


def patch(model, backend="auto", *, fuse_qk_rope=False):
    """Replace, in place, every norm module of a transformers ``model`` by a normtools module.

    ``backend``: "auto", "torch" or "triton" (set on every new module). With ``fuse_qk_rope``,
    each attention's q/k norms and RoPE run as one ``normtools.qk_norm_rope`` (Qwen3, OLMo 2,
    Gemma 3 at the transformers version in FUSABLE_ATTENTION). Returns the list of the
    replaced module names. Raises :class:`PatchError`, before changing anything, when the model's
    spec cannot be matched.
    """
    validate.check_backend(backend)
    swaps = _plan(model)
    problems = [p for swap in swaps for p in _check(model, swap)]
    attentions = _fusable_attentions(model, problems) if fuse_qk_rope else []
    if problems:
        raise PatchError(f"cannot patch {type(model).__name__}: " + "; ".join(problems))
    for swap in swaps:
        old = model.get_submodule(swap.name)
        new = _normtools_module(swap.norm, old)
        new.backend = backend
        parent, _, child = swap.name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    for attention, fused in attentions:
        attention.normtools_fused = fused
        attention.forward = types.MethodType(_fused_attention_forward, attention)
    return [swap.name for swap in swaps]


# ----------------------------------------------------------------------------- QK-Norm + RoPE

@dataclasses.dataclass(frozen=True)
class _FusedAttention:
    """How one attention class is fused: the sha256 (first 16 hex digits) of the source of the
    transformers forward that ``_fused_attention_forward`` restates, its QK-Norm scope, whether
    that forward passes ``sliding_window`` to the attention function, and whether its
    apply_rotary_pos_emb casts the result back to q's dtype (OLMo 2 computes RoPE with float32
    tables)."""
    source_sha256: str
    scope: str
    sliding_window: bool
    cast_back: bool


# transformers 5.24: each forward is q/k/v projections → q_norm, k_norm (OLMo 2: on the flat
# projection; Qwen3: on (B, S, H, D); Gemma 3: on (B, H, S, D)) → apply_rotary_pos_emb → cache
# update → attention function → o_proj.
FUSABLE_ATTENTION = {
    "Qwen3Attention": _FusedAttention("648a188563d3f5ea", "per_head", sliding_window=True,
                                     cast_back=False),
    "Olmo2Attention": _FusedAttention("4c62a7cb133a0250", "per_layer", sliding_window=False,
                                     cast_back=True),
    "Gemma3Attention": _FusedAttention("bad1000e691e807e", "per_head", sliding_window=True,
                                      cast_back=False),
}


def _source_sha256(cls):
    return hashlib.sha256(inspect.getsource(cls.forward).encode()).hexdigest()[:16]


def _fusable_attentions(model, problems):
    """(attention module, _FusedAttention) of every layer; appends to ``problems`` why not."""
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "q_norm") and hasattr(module, "q_proj")):
            continue
        cls = type(module)
        fused = FUSABLE_ATTENTION.get(cls.__name__)
        if fused is None:
            problems.append(f"{name}: fusing QK-Norm with RoPE is supported for "
                            f"{', '.join(FUSABLE_ATTENTION)}, not {cls.__name__}")
        elif _source_sha256(cls) != fused.source_sha256:
            problems.append(f"{name}: {cls.__name__}.forward is not the transformers version "
                            f"normtools fuses (source sha256 {_source_sha256(cls)}, expected "
                            f"{fused.source_sha256}); patch without fuse_qk_rope")
        else:
            found.append((module, fused))
    if not found and not problems:
        problems.append("no attention module with q_norm / k_norm to fuse")
    return found


def _fused_attention_forward(self, hidden_states, position_embeddings, attention_mask,
                             cache=None, **kwargs):
    """The transformers attention forward (FUSABLE_ATTENTION) with q_norm, k_norm and
    apply_rotary_pos_emb as one ``qk_norm_rope`` on the (B, S, H, D) projections; the norms'
    parameters and settings are those of the (normtools) q_norm / k_norm modules."""
    fused, modeling = self.normtools_fused, sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    q_norm, k_norm = self.q_norm, self.k_norm
    cos, sin = position_embeddings
    query_states, key_states = qk_norm_rope(
        query_states, key_states, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps,
        head_dim=self.head_dim, scope=fused.scope,
        offset=q_norm.offset, casting=q_norm.casting, cast_back=fused.cast_back,
        backend=q_norm.backend)
    query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                kwargs=kwargs)
    attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward)
    if fused.sliding_window:
        kwargs["sliding_window"] = self.sliding_window
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _plan(model) -> list:
    """Every norm module to replace, with the NormSpec it must compute."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        raise PatchError(f"{type(model).__name__} is not a transformers decoder model")
    try:
        spec = from_hf_config(config)
    except (SpecError, TypeError) as e:
        raise PatchError(f"cannot patch {type(model).__name__}: {e}") from None
    if spec.block_norm.casting == "torch":
        raise PatchError(
            f"cannot patch {spec.model_type}: its norms are torch.nn.LayerNorm, whose fused kernel "
            "normtools does not reproduce bit for bit; supported: RMSNorm models and float32 LayerNorms "
            "without bias (Cohere)"
        )
    if spec.qk_norm.scope == "per_head_weights":
        raise PatchError(f"cannot patch {spec.model_type}: QK-Norm with one weight per head, shape "
                         f"(H, head_dim), has no normtools module (supported scopes: per_head, per_layer)")
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    base = f"{prefix}." if prefix else ""
    swaps = []
    for i in range(len(decoder.layers)):
        layer = f"{base}layers.{i}"
        swaps += [_Swap(f"{layer}.{name}", spec.block_norm) for name in spec.layer_norms]
        if spec.qk_norm.scope != "none":
            swaps += [_Swap(f"{layer}.self_attn.{n}", spec.qk_norm.norm) for n in ("q_norm", "k_norm")]
        swaps += [_Swap(f"{layer}.{o.name}", o.norm) for o in spec.other_norms if o.per_layer]
    if spec.final_norm is not None:
        swaps.append(_Swap(f"{base}norm", spec.final_norm))
    return swaps


def _eps_of(module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def _check(model, swap) -> list:
    """Problems that stop ``swap`` from being exact (empty when it is)."""
    try:
        module = model.get_submodule(swap.name)
    except AttributeError:
        return [f"{swap.name} is missing"]
    norm = swap.norm
    expected_class = "RMSNorm" if norm.kind == "rms" else "LayerNorm"
    problems = []
    if not type(module).__name__.endswith(expected_class):
        problems.append(f"{swap.name} is a {type(module).__name__}, the spec says {expected_class}")
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 1:
        problems.append(f"{swap.name} has no 1-D weight")
    if _eps_of(module) != norm.eps:
        problems.append(f"{swap.name} has eps {_eps_of(module)}, the spec says {norm.eps}")
    if (getattr(module, "bias", None) is not None) != norm.bias:
        problems.append(f"{swap.name} bias does not match the spec (bias={norm.bias})")
    if "forward" in vars(module) or hasattr(module, "_hf_hook"):
        problems.append(f"{swap.name} has its forward replaced (an accelerate hook or a monkey "
                        f"patch), which a new module cannot carry")
    return problems


# The hook registries of an nn.Module. patch hands the old module's dicts themselves to the new
# module, so hooks keep firing and the handles a user holds still remove them.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _normtools_module(norm: NormSpec, old):
    """The normtools module computing ``norm`` with ``old``'s own parameter objects (so their
    ``requires_grad`` and an optimizer built before ``patch`` still apply) and its hooks."""
    weight = old.weight
    if norm.kind == "rms":
        new = RMSNorm(weight.shape[0], norm.eps, offset=norm.offset, casting=norm.casting, device="meta")
    else:
        new = LayerNorm(weight.shape[0], norm.eps, bias=norm.bias, device="meta")
    new.weight = weight
    if norm.bias:
        new.bias = old.bias
    for hooks in _HOOK_DICTS:
        setattr(new, hooks, getattr(old, hooks))
    new._is_full_backward_hook = old._is_full_backward_hook
    new.train(old.training)
    return new

"""``normtools.patch``: swap a transformers model's norm modules for normtools ones.

The model's norm spec (``normtools.cards.from_hf_config(model.config)``) decides every choice:
each block norm, the final norm, the QK-Norm modules and the other norms (DeepSeek-V3's latent
norms) become a ``normtools.RMSNorm(dim, eps, offset=..., casting=...)`` (or a
``normtools.LayerNorm`` for a LayerNorm without bias computed in float32, as Cohere's), with the
weights copied and ``.backend`` set. The HF attention modules keep calling ``self.q_norm(...)``
on the same tensors, so a per_head norm (weight ``(head_dim,)``) still sees the
``(..., H, head_dim)`` view and a per_layer norm (weight ``(H*head_dim,)``) the flat projection.

Everything is checked before anything is replaced: a model whose norms the spec cannot match
(an unsupported family or layout, a module of the wrong class, size or eps) raises
:class:`PatchError` naming every problem, and the model is left untouched.
"""

import dataclasses

from normtools.core import _validate
from normtools.core.modules import LayerNorm, RMSNorm
from normtools.cards.derive import from_hf_config
from normtools.cards.types import NormSpec, SpecError

__all__ = ["patch", "PatchError"]


class PatchError(ValueError):
    """A model whose norms ``normtools.patch`` cannot replace exactly."""


@dataclasses.dataclass(frozen=True)
class _Swap:
    name: str  # module path in the model
    norm: NormSpec


def patch(model, backend="auto"):
    """Replace, in place, every norm module of a transformers ``model`` by a normtools module.

    ``backend``: "auto", "torch" or "triton" (set on every new module). Returns the list of the
    replaced module names. Raises :class:`PatchError`, before changing anything, when the model's
    spec cannot be matched.
    """
    _validate.check_backend(backend)
    swaps = _plan(model)
    problems = [p for swap in swaps for p in _check(model, swap)]
    if problems:
        raise PatchError(f"cannot patch {type(model).__name__}: " + "; ".join(problems))
    for swap in swaps:
        old = model.get_submodule(swap.name)
        new = _normtools_module(swap.norm, old)
        new.backend = backend
        parent, _, child = swap.name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return [swap.name for swap in swaps]


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
    return problems


def _normtools_module(norm: NormSpec, old):
    """The normtools module computing ``norm``, holding a copy of ``old``'s parameters."""
    weight = old.weight
    kwargs = dict(device=weight.device, dtype=weight.dtype)
    if norm.kind == "rms":
        new = RMSNorm(weight.shape[0], norm.eps, offset=norm.offset, casting=norm.casting, **kwargs)
    else:
        new = LayerNorm(weight.shape[0], norm.eps, bias=norm.bias, **kwargs)
    new.load_state_dict(old.state_dict())
    new.train(old.training)
    return new

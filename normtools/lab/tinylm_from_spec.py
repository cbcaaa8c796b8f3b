"""Block equations from norm cards: a ``ModelNormSpec`` turned into the TinyLM configuration with
the same norm layout (:func:`tinylm_config_from_spec`), whose equation TinyLM's own printer
renders (:func:`block_equation_from_spec`), with each norm symbol named by the module that holds
its weight in the model (:func:`norm_legend`).
"""

from normtools.lab.blocks import block_equation, norm_names
from normtools.lab.tinylm import TinyLMConfig

#: ModelNormSpec QK-Norm scopes → TinyLM's (TinyLM keeps one weight per feature either way).
_QK_SCOPE = {"none": "none", "per_head": "per_head", "per_head_weights": "per_head", "per_layer": "per_layer"}


def tinylm_config_from_spec(spec, **overrides):
    """The TinyLM configuration with the norm layout of ``spec`` (a ``ModelNormSpec``): the same
    placement, norm kind (RMSNorm or LayerNorm), QK-Norm scope, final norm and eps; the sizes are
    TinyLM's defaults unless overridden. (TinyLM's norms have scale w, no offset.)"""
    fields = dict(placement=spec.placement, norm=spec.block_norm.kind, qk_norm=_QK_SCOPE[spec.qk_norm.scope],
                  final_norm=spec.final_norm is not None, eps=spec.block_norm.eps)
    return TinyLMConfig(**{**fields, **overrides})


def block_equation_from_spec(spec, fmt: str = "latex") -> str:
    """The block equation of the model that ``spec`` describes, printed by TinyLM's own
    ``block_equation`` for the configuration of :func:`tinylm_config_from_spec` ("text" or
    "latex"). The symbols N_… are named in :func:`norm_legend`."""
    return block_equation(tinylm_config_from_spec(spec), fmt)


def norm_legend(spec) -> list[tuple[str, str]]:
    """(symbol in the block equation, module name in each layer of the model) for each block
    norm of ``spec``, in the order the block applies them. (QK-Norm and the final norm are
    described by the spec's card rows.)"""
    symbols = norm_names(spec.placement)
    if len(symbols) != len(spec.layer_norms):
        raise ValueError(f"{spec.model_type}: placement {spec.placement!r} has {len(symbols)} norms, "
                         f"the spec names {len(spec.layer_norms)}: {spec.layer_norms}")
    return [(f"N_{s}", module) for s, module in zip(symbols, spec.layer_norms)]

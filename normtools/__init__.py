"""normtools: normalization layers for Transformers, with reference math, Triton kernels and probes.

Public names are loaded lazily (PEP 562) so that ``import normtools`` stays cheap and
does not import transformers or Triton until a function that needs them is used.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    # RMSNorm / LayerNorm ops and modules
    "rms_norm": "normtools.core.ops",
    "add_rms_norm": "normtools.core.ops",
    "layer_norm": "normtools.core.ops",
    "RMSNorm": "normtools.core.modules",
    "LayerNorm": "normtools.core.modules",
    # QK-Norm
    "qk_norm": "normtools.core.qk",
    "QKNorm": "normtools.core.qk",
    "qk_norm_rope": "normtools.core.rope",
    # model norm specs
    "count_parameters": "normtools.cards.params",
    "patch": "normtools.cards.patching",
    "PatchError": "normtools.cards.patching",
}
# The layers, bottom up (imports point down only; tests/test_layers.py keeps it so):
#   core     the library: ops, modules, QK-Norm, tensor parallelism, reference math, kernel launch
#   cards    model norm cards, parameter counts, patching transformers models
#   lab      toy Transformer, depth probes, training, experiment grids
#   measure  parity and benchmarks
#   book     the book's own helpers
# and normtools.tp, the public name of normtools.core.tp (per-layer QK-Norm under tensor
# parallelism), which imports the library only.
_SUBMODULES = {"core", "cards", "lab", "measure", "book", "cli", "tp"}

__all__ = sorted(_PUBLIC) + sorted(_SUBMODULES)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = import_module(f"normtools.{name}")
    else:
        raise AttributeError(f"module 'normtools' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__

"""normtools: normalization layers for Transformers, with reference math, Triton kernels and probes.

Public names are loaded lazily (PEP 562) so that ``import normtools`` stays cheap and
does not import transformers or Triton until a function that needs them is used.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    # RMSNorm / LayerNorm ops and modules
    "rms_norm": "normtools.ops",
    "add_rms_norm": "normtools.ops",
    "layer_norm": "normtools.ops",
    "RMSNorm": "normtools.modules",
    "LayerNorm": "normtools.modules",
    # QK-Norm
    "qk_norm": "normtools.qk",
    "QKNorm": "normtools.qk",
    # model norm specs
    "count_parameters": "normtools.spec",
    "patch": "normtools.patching",
    "PatchError": "normtools.patching",
}
_SUBMODULES = {
    "ops", "modules", "reference", "qk", "tp", "spec", "patching",
    "models", "probes", "train", "data", "parity", "bench", "sysinfo", "cli",
    "analysis", "solution", "experiments", "glossary", "notebook", "book_build",
}

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

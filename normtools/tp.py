"""``normtools.tp``: per-layer QK-Norm under tensor parallelism, as a user imports it
(``import normtools.tp``, ``from normtools.tp import qk_norm``).

The code lives in the library, ``normtools.core.tp`` (the math and the all-reduce of the sum of
squares are described there) and ``normtools.core.tp_dtensor`` (PyTorch's DTensor engine: the
ops' sharding rules, registered on import, and the ``QKNormParallel`` style); this module is
their public name. Running processes (``spawn``) and the chapter's demonstration live in
``normtools.measure``.
"""

from normtools.core.tp import head_range, qk_norm, shard_columns, shard_weight, unshard_columns
from normtools.core.tp_dtensor import NormalizedDimShardError, QKNormParallel

__all__ = [
    "head_range",
    "shard_weight",
    "shard_columns",
    "unshard_columns",
    "qk_norm",
    "QKNormParallel",
    "NormalizedDimShardError",
]

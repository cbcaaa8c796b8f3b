"""``normtools.tp``: per-layer QK-Norm under tensor parallelism, as a user imports it
(``import normtools.tp``, ``from normtools.tp import qk_norm``).

The code lives in the library, ``normtools.core.tp`` (the math and the all-reduce of the sum of
squares are described there); this module is its public name.
"""

from normtools.core.tp import (
    compare_naive_vs_allreduce,
    demo_errors,
    demo_inputs,
    head_range,
    qk_norm,
    run_all,
    run_sharded_qk_norm,
    shard_columns,
    shard_weight,
    spawn,
    unshard_columns,
)

__all__ = [
    "head_range",
    "shard_weight",
    "shard_columns",
    "unshard_columns",
    "qk_norm",
    "spawn",
    "run_all",
    "run_sharded_qk_norm",
    "demo_inputs",
    "demo_errors",
    "compare_naive_vs_allreduce",
]

"""The cases of a GPU run, in the order they run: a first pass, the real shapes, the full sweep.

A case is one (op, shape) timed on every backend, with what the conditions of the results need:
its ``phase``, the ``regime`` and ``models`` of a real shape, the ``batch`` of sequences and
``tokens_per_sequence``, and the ``cache`` state of its inputs ("rotated": the inputs rotate over
enough buffers to exceed the last-level cache twice; "warm": one input set, called again and
again, as a decode step finds its small activations in cache).

* ``first_pass_cases``: the ops with performance targets (RMSNorm forward, forward + backward,
  per-head QK-Norm) at N = 2K, 8K, 32K, 128K, so that a cut run still has the targets' numbers.
* ``real_shape_cases``: the hidden sizes and head layouts of the bundled models
  (``normtools.cards.bundled_configs``) in two regimes. Prefill: one sequence of
  ``prefill_tokens`` tokens (forward, and forward + backward as in training). Decode:
  ``decode_batch`` sequences, one new token each (forward only), with warm and rotated inputs.
  Block norms run as ``rms_norm`` and ``add_rms_norm`` (the residual add fused) at the hidden
  size; QK-Norm as per head (head_dim) or per layer (heads · head_dim) with the model's heads,
  alone and fused with RoPE (``qk_norm_rope_*``, forward + backward in prefill too; the
  rotation over the whole head).
* ``_synthetic_cases``: every op at N = 1K … 128K and the QK layouts of ``shapes.default_shapes``.

Synthetic cases (first pass and sweep) move at least ``MIN_CASE_BYTES`` = 256 MiB
(``bytes_moved``): the rows M (tokens T) scale with N, so that a call lasts long enough that its
time is the memory's, not the launch's. Real shapes keep their own token counts: a decode step
moves a few MB, and its time is mostly launch latency, which is what a real decode step pays.
"""

import math
from dataclasses import asdict, dataclass, field

import torch

from normtools.measure.bench.backends import offered
from normtools.measure.bench.shapes import OPS, QK_OPS, ROW_OPS
from normtools.measure.bench.minimum_bytes import bytes_moved

MIN_CASE_BYTES = 2**28
_TARGET_OPS = ("rms_norm", "rms_norm_fwd_bwd", "qk_norm_per_head")
_FIRST_PASS_N = (2048, 8192, 32768, 131072)
_SWEEP_N = tuple(2**p for p in range(10, 18))
# (Hq, Hk, D) of the synthetic QK-Norm cases; the first pass uses the first (Qwen 3's layout).
_SWEEP_QK = ((32, 8, 128),) + tuple((hq, hk, d) for d in (64, 128, 256)
                                   for hq, hk in ((32, 8), (64, 8), (16, 16))
                                   if (hq, hk, d) != (32, 8, 128))
PREFILL_TOKENS, DECODE_BATCH = 8192, 64
# The order of the real shapes, so that a run cut by its budget keeps the most telling ones:
# the block norm and QK-Norm (alone, then fused with RoPE) of every model in both regimes, then
# the backward passes, then the fused residual add.
REAL_SHAPE_ORDER = ("rms_norm", "qk_norm_per_head", "qk_norm_per_layer", "qk_norm_rope_per_head",
                    "qk_norm_rope_per_layer", "rms_norm_fwd_bwd", "qk_norm_rope_per_head_fwd_bwd",
                    "qk_norm_rope_per_layer_fwd_bwd", "add_rms_norm")
_ROW_MULTIPLE = 64   # scaled M and T are rounded up to a multiple of this


@dataclass(frozen=True)
class Case:
    """One (op, shape) of a run and the conditions it is measured under."""

    phase: str                      # "first pass", "real shapes" or "sweep"
    op: str
    shape: dict = field(hash=False)
    cache: str = "rotated"          # "rotated" or "warm"
    regime: str | None = None       # "prefill" or "decode" for a real shape
    models: tuple = ()              # the bundled models with this shape
    batch: int | None = None        # sequences
    tokens_per_sequence: int | None = None

    def conditions(self):
        """The per-row conditions: everything but op and shape."""
        row = asdict(self)
        del row["op"], row["shape"]
        row["models"] = list(self.models)
        return row


def _scaled_shape(op, n_or_layout, dtype, min_bytes=MIN_CASE_BYTES):
    """The smallest shape of ``op`` with ``bytes_moved`` ≥ ``min_bytes``.

    Row ops: ``n_or_layout`` is N and M is scaled; QK ops: it is (Hq, Hk, D) and T is scaled.
    M and T are rounded up to a multiple of 64.
    """
    if op in QK_OPS:
        hq, hk, d = n_or_layout
        per_row = bytes_moved(op, {"T": 1, "Hq": hq, "Hk": hk, "D": d}, dtype)
        rows = _round_up(math.ceil(min_bytes / per_row))
        shape = {"T": rows, "Hq": hq, "Hk": hk, "D": d}
    else:
        per_row = bytes_moved(op, {"M": 1, "N": n_or_layout}, dtype)
        shape = {"M": _round_up(math.ceil(min_bytes / per_row)), "N": n_or_layout}
    while bytes_moved(op, shape, dtype) < min_bytes:   # the weights were counted once per row
        key = "T" if op in QK_OPS else "M"
        shape[key] += _ROW_MULTIPLE
    return shape


def _round_up(rows):
    return max(_ROW_MULTIPLE, math.ceil(rows / _ROW_MULTIPLE) * _ROW_MULTIPLE)


def first_pass_cases(dtype, min_bytes=MIN_CASE_BYTES):
    """The target ops at ``_FIRST_PASS_N`` (QK-Norm per head: Qwen 3's layout), ≥ min_bytes each."""
    cases = []
    for op in _TARGET_OPS:
        if op in QK_OPS:
            cases.append(Case("first pass", op, _scaled_shape(op, _SWEEP_QK[0], dtype, min_bytes)))
        else:
            cases += [Case("first pass", op, _scaled_shape(op, n, dtype, min_bytes))
                      for n in _FIRST_PASS_N]
    return cases


def _synthetic_cases(dtype, min_bytes=MIN_CASE_BYTES, ops=OPS, skip=()):
    """Every op of ``ops`` at ``_SWEEP_N`` (row ops) or ``_SWEEP_QK`` (QK ops), ≥ min_bytes each,
    leaving out the (op, shape) pairs of ``skip`` (cases already run)."""
    done = {(c.op, tuple(c.shape.items())) for c in skip}
    cases = []
    for op in ops:
        sizes = _SWEEP_QK if op in QK_OPS else _SWEEP_N
        for size in sizes:
            shape = _scaled_shape(op, size, dtype, min_bytes)
            if (op, tuple(shape.items())) not in done:
                cases.append(Case("sweep", op, shape))
    return cases


def _model_layouts():
    """{model: (hidden, heads, kv_heads, head_dim, QK-Norm scope)} of the bundled configs."""
    from normtools import cards

    layouts = {}
    for name in cards.bundled_configs():
        spec, _ = cards.load(name)
        layouts[name] = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                         spec.qk_norm.scope)
    return layouts


def real_shape_cases(prefill_tokens=PREFILL_TOKENS, decode_batch=DECODE_BATCH, ops=OPS):
    """The bundled models' shapes in the prefill and decode regimes (see the module docstring);
    models that share a shape share its case (``models`` lists them). In the order of
    ``REAL_SHAPE_ORDER`` (by op; the models and regimes in their order within an op)."""
    regimes = (("prefill", 1, prefill_tokens, ("rotated",)),
               ("decode", decode_batch, 1, ("warm", "rotated")))
    grouped = {}
    for model, (hidden, heads, kv_heads, head_dim, scope) in _model_layouts().items():
        for regime, batch, tokens, caches in regimes:
            t = batch * tokens
            wanted = [("rms_norm", {"M": t, "N": hidden}), ("add_rms_norm", {"M": t, "N": hidden})]
            if regime == "prefill":
                wanted.append(("rms_norm_fwd_bwd", {"M": t, "N": hidden}))
            if scope in ("per_head", "per_layer"):
                qk_shape = {"T": t, "Hq": heads, "Hk": kv_heads, "D": head_dim}
                wanted += [(f"qk_norm_{scope}", qk_shape), (f"qk_norm_rope_{scope}", qk_shape)]
                if regime == "prefill":
                    wanted.append((f"qk_norm_rope_{scope}_fwd_bwd", qk_shape))
            for op, shape in wanted:
                if op not in ops:
                    continue
                for cache in caches:
                    key = (op, tuple(shape.items()), regime, cache)
                    grouped.setdefault(key, {"batch": batch, "tokens": tokens, "models": []})
                    grouped[key]["models"].append(model)
    cases = [Case("real shapes", op, dict(shape), cache=cache, regime=regime,
                  models=tuple(v["models"]), batch=v["batch"], tokens_per_sequence=v["tokens"])
             for (op, shape, regime, cache), v in grouped.items()]
    return sorted(cases, key=lambda case: REAL_SHAPE_ORDER.index(case.op))


#: The phases of a GPU run, in the order they run.
PHASES = ("first pass", "real shapes", "sweep")


def gpu_run_cases(dtype=torch.bfloat16, ops=OPS, phases=PHASES,
                  min_bytes=MIN_CASE_BYTES):
    """All cases of a GPU run in order: first pass, real shapes, then the rest of the sweep."""
    cases = []
    if "first pass" in phases:
        cases += [c for c in first_pass_cases(dtype, min_bytes) if c.op in ops]
    if "real shapes" in phases:
        cases += real_shape_cases(ops=ops)
    if "sweep" in phases:
        cases += _synthetic_cases(dtype, min_bytes, ops=ops, skip=cases)
    return cases


# ------------------------------------------------------------------------- time estimate

# Assumptions of the estimate (an H200: ~4.8 TB/s HBM; Triton JIT and Inductor compile times
# measured on other machines): seconds per first call of a backend, per later shape.
_FIRST_CALL_S = {"torch-compile": (25.0, 4.0), "normtools-triton": (3.0, 1.0),
                "normtools-triton-chunks": (3.0, 1.0), "normtools-triton-prefetch": (3.0, 1.0),
                "liger": (3.0, 1.0),
                "normtools-torch": (0.5, 0.0), "torch-F": (0.5, 0.0)}
_LAUNCH_US = 6.0
_SETUP_GBS = 200.0   # generating the rotated input sets on the device


def estimate_seconds(cases, backends, *, warmup, reps, bandwidth_gbs=4000.0,
                     rotation_bytes=8 * 2**30, cache_bytes=50 * 2**20, dtype=torch.bfloat16):
    """Estimated wall time of each case: [(case, seconds)], for the dry run and the budget.

    Per case: creating its input sets (rotated: ≥ 2× cache and ≥ 4 sets, within
    ``rotation_bytes``; warm: one), then for each backend its first call at a new shape (a
    compile for torch-compile, a JIT for Triton kernels: ``_FIRST_CALL_S``, more the first time) and
    ``warmup + reps`` samples of max(bytes / bandwidth, launch latency), a sample lasting ≥ 20 µs.
    A backend that does not time the case (``backends.offered``) adds nothing.
    """
    from normtools.measure.bench.timing import n_buffer_sets

    seen, compiled, estimates = set(), set(), []
    for case in cases:
        moved = bytes_moved(case.op, case.shape, dtype)
        sets = 1 if case.cache == "warm" else n_buffer_sets(moved, cache_bytes, rotation_bytes)
        seconds = sets * moved / (_SETUP_GBS * 1e9)
        call_us = max(moved / (bandwidth_gbs * 1e3), _LAUNCH_US)
        sample_us = max(call_us, 20.0)
        for backend in (b for b in backends if offered(case.op, b, case.shape)):
            first, later = _FIRST_CALL_S.get(backend, (1.0, 0.5))
            key = (backend, case.op, tuple(case.shape.items()))
            if key not in compiled:   # a shape seen before (warm, then rotated) compiles once
                seconds += later if backend in seen else first
            seen.add(backend)
            compiled.add(key)
            seconds += (warmup + reps) * sample_us * 1e-6 * 2   # plus host overhead, ~2×
        estimates.append((case, seconds))
    return estimates


def plan_rows(cases, backends, *, warmup, reps, budget_s=None, dtype=torch.bfloat16, **assumed):
    """The dry run's table: one row per case with its bytes (MiB), estimated seconds, the
    running total and whether it starts within ``budget_s`` (the sweep's own rule: a case
    starts only if its estimate still fits; a later, smaller one may)."""
    rows, total = [], 0.0
    for case, seconds in estimate_seconds(cases, backends, warmup=warmup, reps=reps,
                                          dtype=dtype, **assumed):
        fits = budget_s is None or total + seconds <= budget_s
        total += seconds if fits else 0.0
        rows.append({"phase": case.phase, "op": case.op,
                     "shape": " ".join(f"{k}={v}" for k, v in case.shape.items()),
                     "cache": case.cache, "regime": case.regime or "-",
                     "models": ", ".join(case.models) or "-",
                     "MiB": bytes_moved(case.op, case.shape, dtype) / 2**20,
                     "estimate_s": seconds, "runs": fits, "total_s": total})
    return rows

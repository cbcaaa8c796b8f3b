"""Bytes that the Triton kernels' loads and stores touch, counted on CPU.

``counting_bytes()`` instruments Triton's interpreter: every ``tl.load`` / ``tl.store`` of an
interpreted launch adds (masked-in lanes) × (element size) to the running kernel's count,
split by direction and eviction hint, and the distinct addresses are kept too. Inside
``normtools.core.launch_hooks.planning_for_cuda`` the ops launch exactly as on a GPU: the block
sizes, chunking, warps and persistent grid of the CUDA launch plan, not the CPU's tiles.

``kernel_traffic()`` runs every op (forward, forward+backward) that way and reports the bytes
touched against the minimum of ``normtools.measure.bench.minimum_bytes.bytes_moved``:

    touched = Σ over launches, loads and stores, of the bytes of masked-in lanes
    unique  = Σ over launches of the distinct bytes addressed (an ideal cache's traffic)
    dram    = the DRAM bytes of the accesses replayed through the L2 model of
              ``normtools.measure.l2_model`` (an H200's 50 MB, LRU, write-back, 32-byte
              sectors, eviction hints obeyed); dram_no_hints: the same trace, hints stripped
    ratio   = touched / minimum

Scaling. Traffic per row is what matters, and the interpreter costs about 1 ms per program,
so a case does not run its real M (4096 rows by default) but a few programs of its real plan:
each kernel keeps the real plan's rows per program (and heads per slot) of each tensor
(``launch_hooks.replaying_rows``: q's and k's differ), and M_sim = _SIMULATED_PROGRAMS × the
largest of them, with as many programs as M_sim needs on a GPU of that many SMs (× num_ctas /
PROGRAMS_PER_SM; on sm_90 a long row's program is a cluster of num_ctas CTAs, which the
interpreter runs as one program: the row is still loaded once, whichever CTA holds which
part). Every program then does exactly what it does in the real launch, and the bytes are
scaled by M / M_sim; the minimum is counted at the real M. The L2 model gives the simulated
SMs their share of the L2 (capacity × simulated SMs / SMs of the GPU). What this leaves out:
the real grid's last program of a slot, which gets fewer rows when rows_per_program does not
divide M; in ``touched`` the caches (a re-read that hits L2 is counted like one that goes to
DRAM; ``unique`` is the other bound, and ``dram`` a model in between). ``python -m
normtools.measure.bytes_counter`` prints the full table.
"""

import argparse
import contextlib
import dataclasses
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import triton.runtime.interpreter as triton_interpreter

from normtools.core import launch_hooks, launch_plans
from normtools.measure.bench.shapes import rows_and_length
from normtools.measure.bench.minimum_bytes import bytes_moved
from normtools.measure.triton_runs import (QK_HEADS, kernels_of, launch_of, op_inputs,
                                           run_on_triton)
from normtools.measure.l2_model import H200_L2_BYTES, LINE_BYTES, Access, dram_bytes

# The ops of the issue: forward, forward+backward of each row op, QK-Norm both scopes, and
# the fused QK-Norm + RoPE.
OPS = ("rms_norm", "rms_norm_fwd_bwd", "add_rms_norm", "layer_norm", "layer_norm_fwd_bwd",
       "qk_norm_per_head", "qk_norm_per_head_fwd_bwd", "qk_norm_per_layer",
       "qk_norm_per_layer_fwd_bwd", "qk_norm_rope_per_head", "qk_norm_rope_per_head_fwd_bwd",
       "qk_norm_rope_per_layer", "qk_norm_rope_per_layer_fwd_bwd")
ROW_LENGTHS = tuple(2**p for p in range(10, 18))        # N = 1K ... 128K
_SIMULATED_PROGRAMS = 2
REAL_M = 4096
# GPUs whose launch plans the counter runs: SMs, compute capability, L2 (NVIDIA's data sheets).
# The A100 (sm_80) has no thread-block clusters: its plan reads long rows in chunks.
GPUS = {"h200": dict(sm_count=launch_plans.DEFAULT_SM_COUNT,
                     capability=launch_plans.DEFAULT_CAPABILITY, l2_bytes=H200_L2_BYTES),
        "a100": dict(sm_count=108, capability=80, l2_bytes=40 * 2**20)}


@dataclasses.dataclass
class _KernelBytes:
    """Bytes one kernel's launches touched: ``loads`` / ``stores`` keyed by eviction hint
    ("" for none), ``unique`` distinct bytes summed over launches, and the launch count."""

    loads: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    stores: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    unique: int = 0
    launches: int = 0

    @property
    def touched(self):
        return sum(self.loads.values()) + sum(self.stores.values())


@contextlib.contextmanager
def counting_bytes(touch_memory=True, trace=None, trace_line=None):
    """Count the bytes of every load and store of interpreted launches in this context.

    Yields a dict {kernel name: _KernelBytes}. A lane counts when its mask is true; a load or
    store without a mask counts every lane. With ``trace`` (a list), each access appends an
    ``l2_model.Access``: "load" | "store", the element addresses of the masked-in lanes, the
    element size, the eviction hint, the launch (counted from 0 in this context) and the
    program (linear index in its grid) that issued it; with ``trace_line`` (bytes) it keeps
    only the distinct lines of each access (their first byte, element size 1), which is all
    the L2 model needs and 1/16 of the memory for bf16 lanes in 32-byte lines. With
    ``touch_memory=False`` nothing is read or written: loads return their ``other`` value (0),
    stores are dropped, so offsets can be checked at sizes that do not fit in memory.
    Restores the interpreter on exit.
    """
    builder = triton_interpreter.interpreter_builder
    counts = defaultdict(_KernelBytes)
    state = {"kernel": None, "runs": [], "launch": -1}

    def finish_launch():
        if state["kernel"] is not None and state["runs"]:
            counts[state["kernel"]].unique += _distinct_bytes(state["runs"])
        state["runs"] = []

    def observe(kernel_name, grid):
        finish_launch()
        state["kernel"] = kernel_name
        state["launch"] += 1
        counts[kernel_name].launches += 1

    def record(kind, table, ptrs, mask, hint):
        hint = "" if hint in (None, "evict_normal") else hint       # no hint
        itemsize = np.dtype(triton_interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        lanes = np.broadcast_to(mask.data, ptrs.data.shape)
        table[hint] += int(lanes.sum()) * itemsize
        addresses = ptrs.data[lanes].astype(np.int64)
        state["runs"].append(_byte_runs(addresses, itemsize))
        if trace is not None:
            (x, y, z), (gx, gy, _) = builder.grid_idx, builder.grid_dim
            size = itemsize
            if trace_line:
                addresses = np.unique(np.concatenate(
                    [addresses // trace_line, (addresses + itemsize - 1) // trace_line]))
                addresses, size = addresses * trace_line, 1
            trace.append(Access(kind, addresses, size, hint, state["launch"],
                                x + gx * (y + gy * z)))

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        record("load", counts[state["kernel"]].loads, ptrs, mask, cache_policy)
        if touch_memory:
            return original_load(ptrs, mask, other, cache_policy, is_volatile)
        dtype = ptrs.get_element_ty()
        data = np.zeros(ptrs.data.shape, dtype=triton_interpreter._get_np_dtype(dtype))
        if other is not None:
            data = np.broadcast_to(other.data, ptrs.data.shape).copy()
        return triton_interpreter.TensorHandle(data, dtype)

    def masked_store(ptrs, value, mask, cache_policy):
        record("store", counts[state["kernel"]].stores, ptrs, mask, cache_policy)
        if touch_memory:
            return original_store(ptrs, value, mask, cache_policy)

    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.get_cache_policy = lambda cache_modifier, eviction_policy: eviction_policy or ""
    token = launch_hooks.INTERPRETED_LAUNCH_OBSERVER.set(observe)
    try:
        yield counts
        finish_launch()
    finally:
        launch_hooks.INTERPRETED_LAUNCH_OBSERVER.reset(token)
        for name in ("create_masked_load", "create_masked_store", "get_cache_policy"):
            vars(builder).pop(name, None)


def _byte_runs(addresses, itemsize):
    """The bytes that elements of ``itemsize`` bytes at ``addresses`` cover, as runs
    (starts, ends) of consecutive elements: a contiguous row is one run, so a launch's
    distinct bytes are kept in a few numbers per access, not 8 bytes per element."""
    if addresses.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    a = np.unique(addresses.astype(np.int64, copy=False))
    breaks = np.flatnonzero(np.diff(a) != itemsize) + 1
    starts = a[np.concatenate(([0], breaks))]
    ends = a[np.concatenate((breaks - 1, [a.size - 1]))] + itemsize
    return starts, ends


def _distinct_bytes(runs):
    """Bytes in the union of the byte runs [(starts, ends), ...] of a launch's accesses."""
    starts = np.concatenate([s for s, _ in runs])
    ends = np.concatenate([e for _, e in runs])
    if starts.size == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    # a run opens a new interval when it starts past every earlier run's end
    opens = np.concatenate(([True], starts[1:] > ends[:-1]))
    closes = np.concatenate((np.flatnonzero(opens)[1:] - 1, [starts.size - 1]))
    return int((ends[closes] - starts[opens]).sum())


def _real_plans(op, shape, dtype, sm_count, capability):
    """{kernel name: its launch plan at the real shape} of the row-wise kernels ``op``
    launches (the forward, and the backward for *_fwd_bwd) on the GPU's plan."""
    with launch_hooks.planning_for_cuda(sm_count, capability):
        return {kernel: launch_of(kernel, op, shape, dtype)[0] for kernel in kernels_of(op)}


def _simulated_launch(op, shape, dtype, sm_count=launch_plans.DEFAULT_SM_COUNT,
                     capability=launch_plans.DEFAULT_CAPABILITY):
    """(shape, SMs, rows) a case runs at: rows = {kernel: (rows_per_program, units_per_slot)
    per tensor} of each kernel's real plan, which the simulation replays
    (``launch_hooks.replaying_rows``) at the rows of _SIMULATED_PROGRAMS programs of the
    tensor whose programs hold the most rows (q and k get different rows per program: each of
    the real plan's programs then does exactly its work), on a GPU of as many SMs as the
    simulated programs (x their CTAs: a cluster plan's program spans num_ctas SMs)."""
    plans = _real_plans(op, shape, dtype, sm_count, capability)
    rows = {kernel: tuple((share.rows_per_program, share.units_per_slot) for share in plan.shares)
            for kernel, plan in plans.items()}
    key = "T" if "T" in shape else "M"
    longest = max(share.rows_per_program for plan in plans.values() for share in plan.shares)
    sim = dict(shape, **{key: min(shape[key], _SIMULATED_PROGRAMS * longest)})
    programs = max(sum(share.slots * -(-sim[key] // share.rows_per_program)
                       for share in plan.shares) * plan.num_ctas for plan in plans.values())
    return sim, max(1, programs // launch_plans.PROGRAMS_PER_SM), rows


def case_traffic(op, shape, dtype=torch.bfloat16, sm_count=launch_plans.DEFAULT_SM_COUNT,
                 l2_bytes=H200_L2_BYTES, capability=launch_plans.DEFAULT_CAPABILITY):
    """Counted bytes of one case: a dict with the simulated shape, the scale to the real
    shape, touched / unique bytes (scaled), the minimum, launches and the bytes by hint; and,
    unless ``l2_bytes`` is None, the DRAM bytes of the L2 model (``l2_model.dram_bytes``,
    read + written, scaled) with the kernels' hints (``dram``) and with the hints stripped
    (``dram_no_hints``). The simulated SMs get their share of the L2, l2_bytes × simulated
    SMs / ``sm_count``, and run one wave of PROGRAMS_PER_SM programs each. ``sm_count`` and
    ``capability`` are the GPU's whose launch plan is counted (default: an H200's)."""
    sim, simulated_sms, rows = _simulated_launch(op, shape, dtype, sm_count, capability)
    inputs = op_inputs(op, sim, dtype)
    scale = (shape["T"] / sim["T"]) if "T" in shape else (shape["M"] / sim["M"])
    trace = [] if l2_bytes is not None else None
    with (launch_hooks.planning_for_cuda(simulated_sms, capability),
          launch_hooks.replaying_rows(rows),
          counting_bytes(trace=trace, trace_line=LINE_BYTES) as counts):
        run_on_triton(op, inputs)
    modelled = {}
    if trace is not None:
        share = dict(capacity=l2_bytes * simulated_sms // sm_count, line=LINE_BYTES,
                     resident=simulated_sms * launch_plans.PROGRAMS_PER_SM)
        modelled = {"dram": sum(dram_bytes(trace, **share)) * scale,
                    "dram_no_hints": sum(dram_bytes(trace, hints=False, **share)) * scale}
    hints = defaultdict(int)
    for kb in counts.values():
        for hint, b in list(kb.loads.items()) + list(kb.stores.items()):
            hints[hint or "none"] += b
    touched = sum(kb.touched for kb in counts.values()) * scale
    minimum = bytes_moved(op, shape, dtype)
    return {"touched": touched, "unique": sum(kb.unique for kb in counts.values()) * scale,
            "minimum": minimum, "ratio": touched / minimum,
            "launches": sum(kb.launches for kb in counts.values()),
            "kernels": ", ".join(sorted(counts)), "scale": scale, **modelled,
            **{f"bytes_{h}": b * scale for h, b in sorted(hints.items())}}


def kernel_traffic(ops=OPS, ns=ROW_LENGTHS, dtype=torch.bfloat16, m=REAL_M,
                   qk_layout=(*QK_HEADS, 128), sm_count=launch_plans.DEFAULT_SM_COUNT,
                   l2_bytes=H200_L2_BYTES, capability=launch_plans.DEFAULT_CAPABILITY):
    """Bytes touched ÷ minimum for every op and row length, with the CUDA launch plans of a
    GPU of ``sm_count`` SMs, compute capability ``capability`` and ``l2_bytes`` of L2
    (default: an H200).

    Row ops run at (m, N) for N in ``ns``; QK ops at T = m tokens with (Hq, Hk, D) =
    ``qk_layout`` (one shape: N is head_dim per head and Hq · head_dim per layer). Returns a
    DataFrame: op, dtype, shape, N, touched, unique, minimum, ratio, unique_ratio, launches,
    kernels, scale, the bytes by eviction hint, and with an L2 (``l2_bytes``) the modelled
    DRAM bytes dram / dram_no_hints and their ratios to the minimum, dram_ratio /
    dram_no_hints_ratio. See the module docstring for the scaling.
    """
    rows = []
    for op in ops:
        if op.startswith("qk_norm"):
            hq, hk, d = qk_layout
            shapes = [{"T": m, "Hq": hq, "Hk": hk, "D": d}]
        else:
            shapes = [{"M": m, "N": n} for n in ns]
        for shape in shapes:
            result = case_traffic(op, shape, dtype, sm_count, l2_bytes, capability)
            n = rows_and_length(op, shape)[1]
            ratios = {f"{k}_ratio": result[k] / result["minimum"]
                      for k in ("unique", "dram", "dram_no_hints") if k in result}
            rows.append({"op": op, "dtype": str(dtype).removeprefix("torch."),
                         "shape": " ".join(f"{k}={v}" for k, v in shape.items()), "N": n,
                         **result, **ratios})
    return pd.DataFrame(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument("--n", type=int, action="append", help="row length (repeatable; "
                        "default 1K ... 128K)")
    parser.add_argument("--op", action="append", choices=OPS, help="op (repeatable; default "
                        "all)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                        help="the GPU whose launch plan and L2 are counted (default h200)")
    args = parser.parse_args(argv)
    table = kernel_traffic(ops=tuple(args.op or OPS), ns=tuple(args.n or ROW_LENGTHS),
                           **GPUS[args.gpu])
    if args.csv:
        table.to_csv(args.csv, index=False)
    columns = ["op", "N", "ratio", "unique_ratio", "dram_ratio", "dram_no_hints_ratio",
               "launches", "kernels"]
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(table[columns].round(3).to_string(index=False))


if __name__ == "__main__":
    main()

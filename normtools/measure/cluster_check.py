"""The GPU run's correctness pass over every thread-block cluster configuration (issue 31).

``bench/gpu_check.sh`` runs it before the sweep: ``python -m normtools.measure.cluster_check
--budget-s S --out cluster-check.json`` (``--dry-run``: the plan, without CUDA or kernels).

Configurations: every row of ``launch_plans.CUDA_ROW_CONFIGS`` with ``num_ctas`` > 1, forward
and backward (``cluster_configs``). The ops that launch them (``CLUSTER_OPS``): RMSNorm,
add+RMSNorm, LayerNorm and per-layer QK-Norm (per-head QK-Norm's rows are one head, QK-Norm +
RoPE cuts its rows into heads: neither takes a cluster). Row lengths ``ROW_LENGTHS``: both ends
of every cluster row's range, 8,193 to 131,072 (the issue's 16,385 to 131,072, and the
backward's cluster of 2 below it); per-layer QK-Norm's q row is 32 heads of ceil(N / 32)
(``triton_runs.op_shape``), k's 8. Rows M = 1, 7, 133 and 4,096; bfloat16 and float32.

Each case runs forward and backward (random output gradients, one per output) four ways on the
same inputs:

* ``cluster``: the Triton kernels on the plan of an sm_90 GPU (the device's own on CUDA;
  ``launch_hooks.planning_for_cuda`` with the H200's on CPU, where Triton's interpreter runs a
  cluster program as one program), so every long row is one block on a cluster;
* ``chunked``: the same kernels on the plan of a GPU without clusters
  (``bench.backends.on_chunked_plan``): long rows read in chunks by one CTA;
* ``same``: the torch backend in the same dtype (plain PyTorch, the baseline of the bound);
* ``float64``: ``torch.nn.functional.rms_norm`` / ``layer_norm`` in float64 (``FLOAT64_OPS``;
  add+RMSNorm normalizes the sum rounded to the input dtype, as the op does).

Checks, for every output and gradient, with the kernel tests' tolerance
(``normtools.measure.oracle.oracle_excess``): cluster and chunked each against float64 with
``same`` as the baseline, and cluster against float64 with chunked as the baseline (the
cluster's error at most twice the chunked plan's, plus atol and an ulp, in bfloat16; within
1e-5 relative in float32). The largest ulp distance between cluster and chunked is recorded.

Repeats: at the largest N and ``REPEAT_ROWS`` rows, every op and dtype runs on the cluster plan
``--repeats`` times (default 200); every output and gradient must be bitwise the first run's
(a race in the cross-CTA reduction shows as a changed bit).

Occupancy (CUDA only): for every compiled cluster kernel, its registers, spills and shared
memory, and ``cuOccupancyMaxActiveClusters`` asked with the kernel's real block (num_warps × 32
threads) and shared memory (``normtools.core.occupancy``; Triton's own helper assumes 128
threads), against the clusters the launch table's plan asks for (``PROGRAMS_PER_SM`` × SMs //
num_ctas): where that is more than the GPU holds, the launcher caps the grid of every later
launch of the kernel at the resident count (``launcher.plan_for``), so a second wave here
flags a table whose first launch of each cluster kernel runs two waves.

Writes a JSON file (run conditions, configurations, every case with its plans and checks, the
repeats and the occupancy rows), rewritten after every case. A case starts only if its
estimated time fits ``--budget-s`` (cases not started are listed, not failed). Exit status 1
when any check, repeat or case failed, 2 when the pass cannot run here.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from normtools._kernels import layer_norm as _layer_norm_kernels
from normtools._kernels import qk_norm as _qk_norm_kernels
from normtools._kernels import rms_norm as _rms_norm_kernels
from normtools.core import launch_hooks, launch_plans, sysinfo
from normtools.core.launcher import cuda_sm_count_and_capability
from normtools.core.occupancy import resident_clusters
from normtools.core.ops import add_rms_norm, layer_norm, rms_norm
from normtools.core.qk import qk_norm
from normtools.measure.bench.backends import on_chunked_plan
from normtools.measure.bench.shapes import LAYER_EPS, RMS_EPS, make_inputs, shape_label
from normtools.measure.oracle import oracle_excess, run_with_grads
from normtools.measure.parity import ulp_distance
from normtools.measure.triton_runs import QK_HEADS, kernels_of, launch_of, op_shape

CLUSTER_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "qk_norm_per_layer")
# The kernels that a cluster plan can launch, by the name launch_plans gives them.
CLUSTER_KERNELS = {"rms_norm_fwd": _rms_norm_kernels.rms_norm_fwd,
                   "rms_norm_bwd": _rms_norm_kernels.rms_norm_bwd,
                   "layer_norm_fwd": _layer_norm_kernels.layer_norm_fwd,
                   "layer_norm_bwd": _layer_norm_kernels.layer_norm_bwd,
                   "qk_norm_fwd": _qk_norm_kernels.qk_norm_fwd,
                   "qk_norm_bwd": _qk_norm_kernels.qk_norm_bwd}
DTYPES = (torch.bfloat16, torch.float32)
ROWS = (133, 7, 1, 4096)     # in the order they run: 133 first (more rows than clusters)
REPEAT_ROWS = 133
REPEATS = 200

# The time estimate (an estimate: it gates which cases start within the budget; each record of
# the results has its measured seconds beside it). A compile of a kernel specialization for
# sm_90a is taken as 1 s (assumed, not yet measured on the GPU machine); a case's device time is its bytes at a fraction
# of the H200's bandwidth: the cluster and chunked runs (forward and backward, about 5 passes
# over a row tensor each) and the torch backend's (about 14) in the input dtype, the float64
# reference (about 12) and the comparisons (about 18) in float64; plus a fixed cost per case
# (launches, autograd, synchronizing reads of each check's result).
COMPILE_S = 1.0
CASE_FIXED_S = 0.05
REPEAT_FIXED_S = 0.002
INPUT_DTYPE_PASSES, FLOAT64_PASSES, REPEAT_PASSES = 24, 30, 10
BANDWIDTH_BYTES_S = 2e12


def cluster_configs():
    """Every cluster row of launch_plans.CUDA_ROW_CONFIGS for the norms' kernels: dicts of
    direction ("fwd" / "bwd"), element bytes, the range of N it takes (lowest, highest), CTAs,
    BLOCK_N (None: the whole row), warps and its reason."""
    configs = []
    for direction in ("fwd", "bwd"):
        for element_bytes in (2, 4):
            lowest = 1
            for config in launch_plans.CUDA_ROW_CONFIGS[direction, element_bytes]:
                if config.num_ctas > 1:
                    configs.append({"direction": direction, "element_bytes": element_bytes,
                                    "n_lowest": lowest, "n_highest": config.n_max,
                                    "num_ctas": config.num_ctas, "block_n": config.block_n,
                                    "num_warps": config.num_warps, "reason": config.reason})
                lowest = config.n_max + 1
    return configs


ROW_LENGTHS = tuple(sorted({n for c in cluster_configs() for n in (c["n_lowest"],
                                                                    c["n_highest"])}))


def case_shape(op, n, m):
    """The shape of ``op`` at row length ``n`` and ``m`` rows (per-layer QK-Norm: q's row of
    QK_HEADS[0] heads of ceil(n / QK_HEADS[0]))."""
    if op.startswith("qk_norm"):
        return op_shape(op, QK_HEADS[0] * triton.cdiv(n, QK_HEADS[0]), m)
    return op_shape(op, n, m)


def _add_rms_norm_float64(dtype):
    def reference(x, residual, w):
        # the op rounds x + residual to the input dtype, then normalizes that rounded sum; the
        # rounding's gradient is 1
        summed = x + residual
        summed = summed + (summed.detach().to(dtype).double() - summed.detach())
        return F.rms_norm(summed, (summed.shape[-1],), w, RMS_EPS), summed
    return reference


# op: (input names, fn(backend) -> fn(*inputs), float64 reference for an input dtype)
NORMTOOLS_OPS = {
    "rms_norm": (("x", "w"),
                 lambda backend: lambda x, w: rms_norm(x, w, RMS_EPS, backend=backend)),
    "add_rms_norm": (("x", "residual", "w"),
                     lambda backend: lambda x, r, w: add_rms_norm(x, r, w, RMS_EPS,
                                                                  backend=backend)),
    "layer_norm": (("x", "w", "b"),
                   lambda backend: lambda x, w, b: layer_norm(x, w, b, LAYER_EPS,
                                                              backend=backend)),
    "qk_norm_per_layer": (("q", "k", "q_w", "k_w"),
                          lambda backend: lambda q, k, qw, kw: qk_norm(
                              q, k, qw, kw, RMS_EPS, head_dim=q.shape[-1] // QK_HEADS[0],
                              scope="per_layer", backend=backend)),
}
FLOAT64_OPS = {
    "rms_norm": lambda dtype: lambda x, w: F.rms_norm(x, (x.shape[-1],), w, RMS_EPS),
    "add_rms_norm": _add_rms_norm_float64,
    "layer_norm": lambda dtype: lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b,
                                                            LAYER_EPS),
    "qk_norm_per_layer": lambda dtype: lambda q, k, qw, kw: (
        F.rms_norm(q, (q.shape[-1],), qw, RMS_EPS), F.rms_norm(k, (k.shape[-1],), kw, RMS_EPS)),
}
OUTPUT_NAMES = {"rms_norm": ("y",), "add_rms_norm": ("y", "summed"), "layer_norm": ("y",),
                "qk_norm_per_layer": ("q_out", "k_out")}


class _Target:
    """Where the pass runs: the device, and the SMs and compute capability its cluster plan is
    made for (the device's own on CUDA, the H200's on CPU)."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.sm_count, self.capability = cuda_sm_count_and_capability(self.device)
        else:
            self.sm_count = launch_plans.DEFAULT_SM_COUNT
            self.capability = launch_plans.DEFAULT_CAPABILITY


def _plans(op, dtype, n, m, target):
    """{"cluster": [(kernel, num_ctas, block_n, programs)], "chunked": [...]}: the forward and
    backward plans of ``op``'s kernels on each plan."""
    shape = case_shape(op, n, m)

    def plans():
        return [{"kernel": kernel, "num_ctas": plan.num_ctas, "block_n": plan.block_n,
                 "programs": plan.programs}
                for kernel in kernels_of(op + "_fwd_bwd")
                for plan in [launch_of(kernel, op, shape, dtype)[0]]]
    return {"cluster": _on_plan("cluster", plans, target), "chunked": _on_plan("chunked", plans,
                                                                              target)}


def _on_plan(plan, fn, target):
    """``fn()`` with every launch (backward included) on the ``plan`` "cluster" (an sm_90 plan
    for the target's SMs) or "chunked" (``bench.backends.on_chunked_plan``)."""
    if plan == "chunked":
        return on_chunked_plan(lambda _: fn(), target.sm_count)(None)
    with launch_hooks.planning_for_cuda(target.sm_count, target.capability):
        return fn()


def _run(op, inputs, dys, plan, target):
    """(outputs, gradients) of ``op`` on ``inputs``, backpropagating ``dys``: on the Triton
    kernels with the "cluster" or "chunked" plan, or on the torch backend ("same")."""
    names, make = NORMTOOLS_OPS[op]
    if plan == "same":
        return run_with_grads(make("torch"), inputs, dys)
    return _on_plan(plan, lambda: run_with_grads(make("triton"), inputs, dys), target)


def _inputs(op, dtype, n, m, target, seed):
    names, _ = NORMTOOLS_OPS[op]
    tensors = make_inputs(op, case_shape(op, n, m), dtype, target.device, seed)
    return [tensors[name] for name in names]


def _output_grads(op, inputs, dtype, seed):
    """One random output gradient per output of ``op`` (shapes of its outputs)."""
    gen = torch.Generator(device=inputs[0].device).manual_seed(seed + 1)
    shapes = {"qk_norm_per_layer": (inputs[0].shape, inputs[1].shape),
              "add_rms_norm": (inputs[0].shape, inputs[0].shape)}.get(op, (inputs[0].shape,))
    return [torch.randn(shape, generator=gen, device=inputs[0].device).to(dtype)
            for shape in shapes]


def check_case(op, dtype, n, m, target, seed=0):
    """One case: run the four ways (module docstring) and return its record with every check;
    ``ok`` is False when any check exceeds the bound."""
    names, _ = NORMTOOLS_OPS[op]
    inputs = _inputs(op, dtype, n, m, target, seed)
    dys = _output_grads(op, inputs, dtype, seed)
    results = {plan: _run(op, inputs, dys, plan, target)
               for plan in ("cluster", "chunked", "same")}
    results["float64"] = run_with_grads(FLOAT64_OPS[op](dtype), inputs, dys, cast=torch.float64)
    labels = list(OUTPUT_NAMES[op]) + ["d" + name for name in names]
    checks, ulps = [], {}
    for index, label in enumerate(labels):
        cluster, chunked, same, ref64 = (
            (results[p][0] + results[p][1])[index] for p in ("cluster", "chunked", "same",
                                                             "float64"))
        for candidate, baseline, name in ((cluster, same, "cluster vs float64 (baseline: torch)"),
                                          (chunked, same, "chunked vs float64 (baseline: torch)"),
                                          (cluster, chunked,
                                           "cluster vs float64 (baseline: chunked)")):
            excess, description = oracle_excess(candidate, ref64, baseline, dtype)
            checks.append({"output": label, "check": name, "excess": excess,
                           "description": description, "ok": excess <= 0})
        ulps[label] = int(ulp_distance(chunked, cluster).max())
    return {"op": op, "dtype": str(dtype).removeprefix("torch."), "n": n, "m": m,
            "shape": case_shape(op, n, m), "plans": _plans(op, dtype, n, m, target),
            "checks": checks, "max_ulps_cluster_vs_chunked": ulps,
            "ok": all(c["ok"] for c in checks)}


def check_repeats(op, dtype, n, m, repeats, target, seed=0):
    """Run ``op`` forward and backward on the cluster plan ``repeats`` times on the same inputs;
    the record counts the runs whose outputs or gradients differ in any bit from the first."""
    inputs = _inputs(op, dtype, n, m, target, seed)
    dys = _output_grads(op, inputs, dtype, seed)
    first_outputs, first_grads = _run(op, inputs, dys, "cluster", target)
    first = first_outputs + first_grads
    differing = []
    for index in range(1, repeats):
        outputs, grads = _run(op, inputs, dys, "cluster", target)
        if not all(torch.equal(a, b) for a, b in zip(first, outputs + grads)):
            differing.append(index)
    return {"op": op, "dtype": str(dtype).removeprefix("torch."), "n": n, "m": m,
            "repeats": repeats, "differing_runs": len(differing),
            "first_differing": differing[:10], "ok": not differing}


# ------------------------------------------------------------------------------- occupancy
def occupancy(target):
    """One row per compiled cluster kernel (``CLUSTER_KERNELS`` compiled with num_ctas > 1 in
    this process): registers, spills, shared memory, the clusters the GPU holds at once and
    the most a plan launches (one wave when the second is at most the first)."""
    rows = []
    for name, kernel in CLUSTER_KERNELS.items():
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                num_ctas = compiled.metadata.num_ctas
                if num_ctas <= 1:
                    continue
                num_warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
                resident = resident_clusters(compiled)
                launched = max(1, launch_plans.PROGRAMS_PER_SM * target.sm_count // num_ctas)
                rows.append({"kernel": name, "num_ctas": num_ctas, "num_warps": num_warps,
                             "registers": compiled.n_regs, "spills": compiled.n_spills,
                             "shared_bytes": shared, "max_active_clusters": resident,
                             "plan_clusters": launched, "one_wave": launched <= resident})
    return sorted(rows, key=lambda r: (r["num_ctas"], r["kernel"]))


# ---------------------------------------------------------------------------- plan, estimate
def _compile_keys(op, dtype, n, target):
    """The kernel specializations ``op`` at row length n compiles on the cluster and the
    chunked plan (launches recorded on CPU, M = 1, nothing run): (kernel, constexpr arguments,
    warps, CTAs, tensor dtypes, and of every integer argument whether it is 1 and whether 16
    divides it, as Triton specializes them). Returns (keys, Triton launches per run of both
    plans)."""
    keys, launches_per_run = set(), 0
    inputs = _inputs(op, dtype, n, 1, _Target("cpu"), 0)
    dys = _output_grads(op, inputs, dtype, 0)
    def record():
        with launch_hooks.recording_launches() as launches:
            run_with_grads(NORMTOOLS_OPS[op][1]("triton"), inputs, dys)
        return launches

    for plan in ("cluster", "chunked"):
        launches = _on_plan(plan, record, target)
        launches_per_run += len(launches)
        for launch in launches:
            values = list(launch.args) + list(launch.kwargs.values())
            keys.add((launch.kernel.fn.__name__,
                      tuple(sorted((k, v) for k, v in launch.kwargs.items()
                                   if k.isupper() or k in ("num_warps", "num_ctas"))),
                      tuple(str(v.dtype) for v in values if isinstance(v, torch.Tensor)),
                      tuple((v == 1, v % 16 == 0) for v in values
                            if isinstance(v, int) and not isinstance(v, bool))))
    return keys, launches_per_run


def _row_elements(op, n, m):
    shape = case_shape(op, n, m)
    if "T" in shape:
        return shape["T"] * (shape["Hq"] + shape["Hk"]) * shape["D"]
    return m * n * (2 if op == "add_rms_norm" else 1)


def plan_pass(ops=CLUSTER_OPS, dtypes=DTYPES, ns=ROW_LENGTHS, ms=ROWS, repeats=REPEATS,
              repeat_rows=REPEAT_ROWS, target=None):
    """The pass in the order it runs, so that a budget cut keeps the most: [(kind, op, dtype,
    n, m, launches, estimated s)], kind "case" or "repeats". First the first M at the largest
    N, then the repeats there (its kernels compiled), then the first M with the other row
    lengths that end a cluster range (``cluster_configs``' highest N, longest first: every
    configuration once per op and dtype), then the first M with the other row lengths, then
    the other M. A compile is charged to the first entry that needs it."""
    target = target or _Target("cpu")
    seen, entries = set(), []
    per_n = {(op, dtype, n): _compile_keys(op, dtype, n, target)
             for op in ops for dtype in dtypes for n in ns}

    def entry(kind, op, dtype, n, m):
        keys, launches = per_n[op, dtype, n]
        compiles = len(keys - seen)
        seen.update(keys)
        element = torch.empty(0, dtype=dtype).element_size()
        elements = _row_elements(op, n, m)
        if kind == "case":
            seconds = CASE_FIXED_S + elements * (element * INPUT_DTYPE_PASSES
                                                 + 8 * FLOAT64_PASSES) / BANDWIDTH_BYTES_S
            count = launches
        else:   # the cluster plan only: half the recorded launches, repeats times
            seconds = repeats * (REPEAT_FIXED_S + elements * element * REPEAT_PASSES
                                 / BANDWIDTH_BYTES_S)
            count = repeats * launches // 2
        entries.append((kind, op, dtype, n, m, count, seconds + COMPILE_S * compiles))

    highest = {c["n_highest"] for c in cluster_configs()}
    first_ns = sorted((n for n in ns if n in highest), reverse=True)
    for phase_ms, phase_ns in (((ms[0],), first_ns[:1]), ("repeats", None),
                               ((ms[0],), first_ns[1:]),
                               ((ms[0],), [n for n in ns if n not in highest]), (ms[1:], ns)):
        if phase_ms == "repeats":
            for dtype in dtypes:
                for op in ops:
                    if repeats > 1:
                        entry("repeats", op, dtype, max(ns), repeat_rows)
            continue
        for m in phase_ms:
            for n in phase_ns:
                for dtype in dtypes:
                    for op in ops:
                        entry("case", op, dtype, n, m)
    return entries


def describe_plan(entries, repeats, budget_s, target, log=print):
    """Print the plan (configurations, shapes, plans, launches, time estimate) and which
    entries start within ``budget_s`` (None: every entry) if each takes its estimate; returns
    that, one bool per entry."""
    log(f"cluster configurations ({len(cluster_configs())}, launch_plans.CUDA_ROW_CONFIGS):")
    for c in cluster_configs():
        log(f"  {c['direction']} {c['element_bytes']}-byte  N {c['n_lowest']:>6}-"
            f"{c['n_highest']:<6}  {c['num_ctas']:>2} CTAs x {c['num_warps']} warps, "
            f"BLOCK_N {'whole row' if c['block_n'] is None else c['block_n']}")
    ops = sorted({e[1] for e in entries}, key=CLUSTER_OPS.index)
    ns = sorted({e[3] for e in entries if e[0] == "case"})
    log(f"ops: {', '.join(ops)}; row lengths N: {', '.join(map(str, ns))}; "
        f"rows M: {', '.join(map(str, sorted({e[4] for e in entries if e[0] == 'case'})))}; "
        f"dtypes: {', '.join(sorted({str(e[2]).removeprefix('torch.') for e in entries}))}")
    log("plans (fwd / bwd CTAs per program, cluster plan | chunked plan's BLOCK_N):")
    for op in ops:
        for n in ns:
            plans = _plans(op, torch.bfloat16, n, 4096, target)
            cluster = " / ".join(str(p["num_ctas"]) for p in plans["cluster"])
            chunked = " / ".join(str(p["block_n"]) for p in plans["chunked"])
            log(f"  {op:<18} N={n:<6} {shape_label(case_shape(op, n, 4096)):<28} "
                f"clusters {cluster:<7} | chunks {chunked}")
    elapsed, started = 0.0, []
    for e in entries:
        fits = budget_s is None or elapsed + e[6] <= budget_s
        if fits:
            elapsed += e[6]
        started.append(fits)
    cases = [e for e in entries if e[0] == "case"]
    repeat_entries = [e for e in entries if e[0] == "repeats"]
    total = sum(e[6] for e in entries)
    launches = sum(e[5] for e in entries)
    log(f"cases: {len(cases)} (forward + backward, each on the cluster and the chunked plan, "
        f"the torch backend and float64); repeats: {len(repeat_entries)} (op, dtype) x "
        f"{repeats} runs on the cluster plan at N={max(ns)} "
        f"M={repeat_entries[0][4] if repeat_entries else '-'}, compared bitwise")
    log(f"Triton launches: {launches}; estimated total {total:.0f} s; budget "
        f"{'none' if budget_s is None else f'{budget_s:.0f} s'}, by the estimate: "
        f"{sum(s for s, e in zip(started, entries) if e[0] == 'case')} of {len(cases)} cases "
        f"and {sum(s for s, e in zip(started, entries) if e[0] == 'repeats')} of "
        f"{len(repeat_entries)} repeats start")
    sizes = sorted({c["num_ctas"] for c in cluster_configs()})
    log(f"occupancy: cuOccupancyMaxActiveClusters for cluster sizes "
        f"{', '.join(map(str, sizes))} (every compiled cluster kernel: "
        f"{', '.join(CLUSTER_KERNELS)}), real block size and shared memory; CUDA only")
    return started


def run_pass(entries, target, repeats=REPEATS, budget_s=None, out=None, log=print):
    """Run ``entries`` (``plan_pass``) in order, each one only if the seconds spent so far plus
    its estimate fit ``budget_s`` (None: all); returns the results dict (also written to
    ``out`` after every entry)."""
    results = {"conditions": {**sysinfo.run_conditions(target.device.type),
                              "sm_count": target.sm_count, "capability": target.capability,
                              "triton": triton.__version__, "torch": torch.__version__},
               "configurations": cluster_configs(), "cases": [], "repeats": [],
               "not_started": [], "occupancy": None, "failures": 0}

    def write():
        if out is not None:
            with open(out, "w") as f:
                json.dump(results, f, indent=1, default=str)

    pass_began = time.perf_counter()
    for kind, op, dtype, n, m, _, estimate in entries:
        if budget_s is not None and time.perf_counter() - pass_began + estimate > budget_s:
            results["not_started"].append({"kind": kind, "op": op, "dtype": str(dtype), "n": n,
                                           "m": m})
            continue
        began = time.perf_counter()
        try:
            record = (check_case(op, dtype, n, m, target) if kind == "case" else
                      check_repeats(op, dtype, n, m, repeats, target))
        except Exception as error:   # a launch that fails is a failed case, the pass goes on
            record = {"op": op, "dtype": str(dtype), "n": n, "m": m, "ok": False,
                      "error": f"{type(error).__name__}: {error}"}
        record["seconds"] = time.perf_counter() - began
        record["estimated_s"] = estimate
        results["cases" if kind == "case" else "repeats"].append(record)
        results["failures"] += not record["ok"]
        if not record["ok"]:
            failed = [c for c in record.get("checks", []) if not c["ok"]]
            log(f"MISMATCH {kind} {op} {record['dtype']} N={n} M={m}: "
                + (record.get("error") or "; ".join(f"{c['output']} {c['check']}: "
                                                    f"{c['description']}" for c in failed[:3])
                   or f"{record.get('differing_runs')} of {record.get('repeats')} runs differ"))
        write()
    if target.device.type == "cuda":
        try:
            results["occupancy"] = occupancy(target)
        except Exception as error:
            results["occupancy"] = {"error": f"{type(error).__name__}: {error}"}
        write()
    return results


def summary(results):
    """Lines that tell the run's outcome."""
    cases, repeats = results["cases"], results["repeats"]
    lines = [f"cluster check: {sum(c['ok'] for c in cases)} of {len(cases)} cases pass, "
             f"{sum(r['ok'] for r in repeats)} of {len(repeats)} repeat runs are bitwise stable, "
             f"{len(results['not_started'])} not started (budget)"]
    worst = max((u for c in cases for u in c.get("max_ulps_cluster_vs_chunked", {}).values()),
                default=None)
    if worst is not None:
        lines.append(f"largest ulp distance cluster vs chunked: {worst}")
    occupancy_rows = results["occupancy"]
    if isinstance(occupancy_rows, list):
        for row in occupancy_rows:
            lines.append(f"occupancy {row['kernel']} {row['num_ctas']} CTAs x {row['num_warps']} "
                         f"warps: {row['registers']} registers, {row['spills']} spills, "
                         f"{row['shared_bytes']} B shared; {row['max_active_clusters']} clusters "
                         f"resident, plans launch {row['plan_clusters']}"
                         + ("" if row["one_wave"] else " (SECOND WAVE)"))
    elif occupancy_rows is not None:
        lines.append(f"occupancy query failed: {occupancy_rows['error']}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the configurations, shapes, launches and time estimate")
    parser.add_argument("--ops", nargs="+", default=list(CLUSTER_OPS), choices=CLUSTER_OPS)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--ns", nargs="+", type=int, default=list(ROW_LENGTHS))
    parser.add_argument("--ms", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--repeat-rows", type=int, default=REPEAT_ROWS)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    target = _Target("cpu" if args.dry_run else args.device)
    if args.dry_run:
        target.sm_count, target.capability = (launch_plans.DEFAULT_SM_COUNT,
                                              launch_plans.DEFAULT_CAPABILITY)
    if target.capability < 90 or launch_plans.TRITON_VERSION < launch_plans.CLUSTER_MIN_TRITON:
        print(f"cluster check: no cluster plans here (compute capability {target.capability}, "
              f"Triton {triton.__version__}; clusters need sm_90 and Triton "
              f"{'.'.join(map(str, launch_plans.CLUSTER_MIN_TRITON))})")
        return 2
    entries = plan_pass(args.ops, dtypes, args.ns, args.ms, args.repeats, args.repeat_rows,
                        target)
    describe_plan(entries, args.repeats, args.budget_s, target)
    if args.dry_run:
        print(f"would write: {args.out or '(no --out)'}")
        return 0
    results = run_pass(entries, target, args.repeats, args.budget_s, args.out)
    for line in summary(results):
        print(line)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

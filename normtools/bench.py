"""Benchmark harness: ``normtools bench`` (also ``python -m normtools.bench``).

Times the normalization ops on every available backend over a sweep of shapes and writes one
JSON file: the run conditions, the device's copy bandwidth measured in the same run, and one row
per (op, backend, shape).

Ops (``OPS``): ``rms_norm`` (forward), ``rms_norm_fwd_bwd`` (forward + backward to x and w),
``add_rms_norm`` (residual add fused with RMSNorm), ``layer_norm``, ``qk_norm_per_head`` and
``qk_norm_per_layer``. Backends (``BACKENDS``):

* "normtools-triton", "normtools-torch": ``normtools.<op>(..., backend="triton" | "torch")``;
* "torch-F": ``torch.nn.functional.rms_norm`` / ``layer_norm`` (the add as ``x + residual``,
  QK-Norm as one call on q and one on k, viewed per head for per_head);
* "torch-compile": ``torch.compile`` of the same composition written with
  ``normtools.reference`` (the plain-PyTorch reference), one fresh compile per shape;
* "liger": Liger-Kernel's ``liger_rms_norm`` / ``liger_layer_norm`` (and its fused add+RMSNorm
  when the installed version has one), when ``liger_kernel`` imports and the device is CUDA.

A backend that cannot run is recorded with status "skipped" and the reason; one that raises
is recorded with status "error". Nothing is silently dropped.

Timing. Each sample is one call (or, on CUDA, the mean of a group of calls lasting ≥ 20 µs).
The inputs rotate over several buffer sets, enough that together they are ≥ 2× the last-level
cache (GPU L2, CPU L3), so no call finds its inputs in cache; each output is kept until its set
comes round again, so the outputs rotate too (``rotating_calls``). CUDA: events around each
sample, with the stream first held busy by ``torch.cuda._sleep`` so that the launches queue up
and the events measure device time, not Python launch overhead (the method of
``triton.testing.do_bench``, without its per-call cache flush, which the rotation replaces).
CPU: ``time.perf_counter_ns`` around each call. Reported: p50, p95, p99, mean and min in µs.

Bandwidth. ``bytes`` is the minimum traffic of the op (``bytes_moved``): every input read once,
every output written once, no saved statistics. ``gbs_p50 = bytes / p50``, and
``pct_of_copy_bw = 100 · gbs_p50 / copy_bandwidth_gbs``, where the copy bandwidth is that of a
device-to-device ``dst.copy_(src)`` of a large buffer (1 GiB on CUDA, 128 MiB on CPU), counting
the bytes read and written, timed the same way in the same run.
"""

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from importlib import import_module, util
from pathlib import Path

import numpy as np
import torch

from normtools import sysinfo

__all__ = ["OPS", "BACKENDS", "ROW_OPS", "QK_OPS", "BANDWIDTH_TARGETS", "SPEEDUP_BASELINES",
           "Unavailable", "default_shapes", "shape_label", "make_inputs", "bytes_moved",
           "backend_fn", "default_backends", "n_buffer_sets", "input_sets", "rotating_calls",
           "time_calls",
           "summarize", "TIMERS", "copy_bandwidth", "bench_case", "run_sweep", "load_results",
           "targets_report", "markdown_summary", "add_cli", "main"]

ROW_OPS = ("rms_norm", "rms_norm_fwd_bwd", "add_rms_norm", "layer_norm")
QK_OPS = ("qk_norm_per_head", "qk_norm_per_layer")
# Sweep order: the ops with performance targets first, so a time budget cuts the others.
OPS = ("rms_norm", "rms_norm_fwd_bwd", "qk_norm_per_head", "add_rms_norm", "layer_norm",
       "qk_norm_per_layer")
BACKENDS = ("normtools-triton", "normtools-torch", "torch-F", "torch-compile", "liger")
RMS_EPS, LAYER_EPS = 1e-6, 1e-5

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MIN_SAMPLE_US = 20.0        # CUDA: a sample groups calls until it lasts about this long
_ROTATION_BUDGET = {"cuda": 8 * 2**30, "cpu": 512 * 2**20}   # bytes of rotated input sets
_COPY_BYTES = {"cuda": 2**30, "cpu": 128 * 2**20}
_DEFAULT_REPS = {"cuda": (10, 100), "cpu": (5, 30)}           # (warm-up samples, samples)
_QUICK_REPS = (1, 3)


# ------------------------------------------------------------------------------------ shapes

def default_shapes(device, quick=False):
    """The sweep: {op: [shape, ...]}; a shape is a dict of ints.

    Row ops: M tokens × N features. QK ops: T tokens, Hq query heads, Hk key heads (GQA), head
    dim D. CUDA: M = 4096, N = 1K … 128K; T = 8192, D ∈ {64, 128, 256},
    (Hq, Hk) ∈ {(32, 8), (64, 8), (16, 16)}. CPU: a few small shapes; ``quick``: one tiny shape
    per op (for tests).
    """
    if quick:
        rows, qk = [{"M": 64, "N": 256}], [{"T": 16, "Hq": 4, "Hk": 2, "D": 64}]
    elif torch.device(device).type == "cuda":
        rows = [{"M": 4096, "N": 2**p} for p in range(10, 18)]
        qk = [{"T": 8192, "Hq": hq, "Hk": hk, "D": d} for d in (64, 128, 256)
              for hq, hk in ((32, 8), (64, 8), (16, 16))]
    else:
        rows = [{"M": 256, "N": 1024}, {"M": 256, "N": 4096}]
        qk = [{"T": 256, "Hq": 8, "Hk": 2, "D": 128}]
    return {op: (rows if op in ROW_OPS else qk) for op in OPS}


def shape_label(shape):
    """"M=4096 N=2048" for a shape dict."""
    return " ".join(f"{k}={v}" for k, v in shape.items())


# ------------------------------------------------------------------------ inputs and bytes

def make_inputs(op, shape, dtype, device, seed=0):
    """One set of random inputs for ``op`` at ``shape``: a dict of tensors.

    Row ops: x (M, N), w (N,), plus residual (M, N) for add_rms_norm, b (N,) for layer_norm, and
    dy (M, N) for rms_norm_fwd_bwd (x and w then require grad). QK ops: q (T, Hq·D), k (T, Hk·D)
    and weights q_w, k_w of shape (D,) per head or (Hq·D,), (Hk·D,) per layer. Weights are
    1 + small noise in the activation dtype; nothing is zero.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0, base=0.0):
        z = torch.randn(*size, generator=g, device=device, dtype=torch.float32)
        return (base + scale * z).to(dtype)

    if op in QK_OPS:
        t, hq, hk, d = shape["T"], shape["Hq"], shape["Hk"], shape["D"]
        per_head = op == "qk_norm_per_head"
        return {"q": randn(t, hq * d), "k": randn(t, hk * d),
                "q_w": randn(d if per_head else hq * d, scale=0.1, base=1.0),
                "k_w": randn(d if per_head else hk * d, scale=0.1, base=1.0)}
    m, n = shape["M"], shape["N"]
    inputs = {"x": randn(m, n), "w": randn(n, scale=0.1, base=1.0)}
    if op == "add_rms_norm":
        inputs["residual"] = randn(m, n)
    if op == "layer_norm":
        inputs["b"] = randn(n, scale=0.1)
    if op == "rms_norm_fwd_bwd":
        inputs["x"].requires_grad_(True)
        inputs["w"].requires_grad_(True)
        inputs["dy"] = randn(m, n)
    return inputs


def bytes_moved(op, shape, dtype):
    """Minimum bytes ``op`` must move: each input read once, each output written once.

    With s the element size, A = M·N·s one activation and W = N·s one weight row (weights have
    the activation dtype here):

    * rms_norm:          read x, w; write y                        = 2A + W
    * rms_norm_fwd_bwd:  forward 2A + W; backward read x, dy, w,
                         write dx, dw (the inverse RMS is recomputable, so not counted)
                                                                   = 5A + 3W
    * add_rms_norm:      read x, residual, w; write normed, summed = 4A + W
    * layer_norm:        read x, w, b; write y                     = 2A + 2W
    * qk_norm_*:         read q, k, q_w, k_w; write q_out, k_out   = 2Q + 2K + Wq + Wk
      with Q = T·Hq·D·s, K = T·Hk·D·s; Wq = Wk = D·s per head, Wq = Hq·D·s, Wk = Hk·D·s per layer.
    """
    s = torch.empty(0, dtype=dtype).element_size()
    if op in QK_OPS:
        t, hq, hk, d = shape["T"], shape["Hq"], shape["Hk"], shape["D"]
        weights = 2 * d * s if op == "qk_norm_per_head" else (hq + hk) * d * s
        return 2 * t * hq * d * s + 2 * t * hk * d * s + weights
    act, row = shape["M"] * shape["N"] * s, shape["N"] * s
    per_op = {"rms_norm": 2 * act + row, "rms_norm_fwd_bwd": 5 * act + 3 * row,
              "add_rms_norm": 4 * act + row, "layer_norm": 2 * act + 2 * row}
    if op not in per_op:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return per_op[op]


# ---------------------------------------------------------------------------------- backends

class Unavailable(Exception):
    """A backend that cannot run here; the message is the reason recorded in the results."""


def _composed_ops(rms, layer, head_dim):
    """The ops composed from ``rms(x, w, eps)`` and ``layer(x, w, b, eps)`` over the last dim.

    add_rms_norm is ``summed = x + residual`` then ``rms(summed)``; QK-Norm is one ``rms`` call on
    q and one on k, viewed as (T, H, D) per head. Returns {op: fn(inputs) -> output(s)}.
    """
    def per_head(x, w):
        return rms(x.view(x.shape[0], -1, head_dim), w, RMS_EPS).view(x.shape)

    def add_rms_norm(t):
        summed = t["x"] + t["residual"]
        return rms(summed, t["w"], RMS_EPS), summed

    return {
        "rms_norm": lambda t: rms(t["x"], t["w"], RMS_EPS),
        "add_rms_norm": add_rms_norm,
        "layer_norm": lambda t: layer(t["x"], t["w"], t["b"], LAYER_EPS),
        "qk_norm_per_head": lambda t: (per_head(t["q"], t["q_w"]), per_head(t["k"], t["k_w"])),
        "qk_norm_per_layer": lambda t: (rms(t["q"], t["q_w"], RMS_EPS),
                                        rms(t["k"], t["k_w"], RMS_EPS)),
    }


def _normtools_ops(backend, head_dim):
    import normtools

    def qk(t, scope):
        return normtools.qk_norm(t["q"], t["k"], t["q_w"], t["k_w"], RMS_EPS, head_dim=head_dim,
                                 scope=scope, backend=backend)

    return {
        "rms_norm": lambda t: normtools.rms_norm(t["x"], t["w"], RMS_EPS, backend=backend),
        "add_rms_norm": lambda t: normtools.add_rms_norm(t["x"], t["residual"], t["w"], RMS_EPS,
                                                         backend=backend),
        "layer_norm": lambda t: normtools.layer_norm(t["x"], t["w"], t["b"], LAYER_EPS,
                                                     backend=backend),
        "qk_norm_per_head": partial(qk, scope="per_head"),
        "qk_norm_per_layer": partial(qk, scope="per_layer"),
    }


def _torch_f_ops(head_dim):
    import torch.nn.functional as F

    def rms(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def layer(x, w, b, eps):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    return _composed_ops(rms, layer, head_dim)


def _compiled_reference_ops(head_dim):
    from normtools.reference import layer_norm_reference, rms_norm_reference

    ops = _composed_ops(rms_norm_reference, layer_norm_reference, head_dim)
    return {op: torch.compile(fn, dynamic=False) for op, fn in ops.items()}


def _liger_ops(device, head_dim):
    if torch.device(device).type != "cuda":
        raise Unavailable("Liger-Kernel runs on CUDA only")
    if util.find_spec("liger_kernel") is None:
        raise Unavailable("liger_kernel is not installed")
    functional = import_module("liger_kernel.transformers.functional")

    def rms(x, w, eps):
        return functional.liger_rms_norm(x, w, eps, in_place=False)

    ops = _composed_ops(rms, functional.liger_layer_norm, head_dim)
    fused_add = getattr(functional, "liger_fused_add_rms_norm", None)
    if fused_add is not None:
        ops["add_rms_norm"] = lambda t: fused_add(t["x"], t["residual"], t["w"], RMS_EPS)
    return ops


def _with_backward(forward):
    """forward + backward: y = forward(t); return (dx, dw) = ∂⟨y, dy⟩/∂(x, w)."""
    def fwd_bwd(t):
        return torch.autograd.grad(forward(t), (t["x"], t["w"]), t["dy"])
    return fwd_bwd


def _no_grad(fn):
    def call(t):
        with torch.no_grad():
            return fn(t)
    return call


def backend_fn(op, backend, device, shape):
    """fn(inputs) -> output(s) running ``op`` on ``backend``; raises ``Unavailable``."""
    head_dim = shape.get("D")
    builders = {
        "normtools-triton": lambda: _normtools_ops("triton", head_dim),
        "normtools-torch": lambda: _normtools_ops("torch", head_dim),
        "torch-F": lambda: _torch_f_ops(head_dim),
        "torch-compile": lambda: _compiled_reference_ops(head_dim),
        "liger": lambda: _liger_ops(device, head_dim),
    }
    if backend not in builders:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "torch-compile":
        torch.compiler.reset()  # one fresh compile per shape; no recompile limit is reached
    ops = builders[backend]()
    if op == "rms_norm_fwd_bwd":
        return _with_backward(ops["rms_norm"])
    return _no_grad(ops[op])


def default_backends(device):
    """{backend: None (run it) or the reason it is skipped by default}."""
    skips = {b: None for b in BACKENDS}
    if torch.device(device).type != "cuda":
        skips["normtools-triton"] = ("skipped on CPU by default: Triton's interpreter runs "
                                     "kernels in Python, its timing is meaningless")
    return skips


# ------------------------------------------------------------------------------------ timing

def _cache_bytes(device):
    if torch.device(device).type == "cuda":
        gpu = sysinfo.cuda_device(torch.device(device).index or 0)
        return gpu["l2_cache_bytes"] or 50 * 2**20
    return sysinfo.cpu_cache_bytes() or 32 * 2**20


def n_buffer_sets(set_bytes, cache_bytes, budget_bytes, max_sets=256):
    """How many input sets to rotate: ≥ 4 and together ≥ 2× the cache, but at most
    ``max_sets`` and within ``budget_bytes`` (never fewer than 2)."""
    wanted = max(4, math.ceil(2 * cache_bytes / max(set_bytes, 1)))
    return max(2, min(wanted, max_sets, budget_bytes // max(set_bytes, 1)))


def input_sets(op, shape, dtype, device, cache_bytes):
    """The rotated input sets of one (op, shape): ``n_buffer_sets`` of ``make_inputs``."""
    first = make_inputs(op, shape, dtype, device, seed=0)
    set_bytes = sum(t.nbytes for t in first.values())
    n = n_buffer_sets(set_bytes, cache_bytes, _ROTATION_BUDGET[torch.device(device).type])
    return [first] + [make_inputs(op, shape, dtype, device, seed=i) for i in range(1, n)]


_SLEEP_CYCLES_PER_US = None


def _sleep_cycles_per_us():
    """Calibrate ``torch.cuda._sleep``: GPU clock cycles per microsecond (measured once)."""
    global _SLEEP_CYCLES_PER_US
    if _SLEEP_CYCLES_PER_US is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_CYCLES_PER_US = cycles / (start.elapsed_time(end) * 1e3)
    return _SLEEP_CYCLES_PER_US


def _stall(us):
    """Hold the current CUDA stream busy for about ``us`` microseconds (launches queue behind)."""
    torch.cuda._sleep(int(us * _sleep_cycles_per_us()))


def _time_cuda(calls, warmup, reps):
    n = len(calls)
    for i in range(max(warmup, 1)):
        calls[i % n]()
    torch.cuda.synchronize()
    # Host cost of one call (an upper bound: the wait for the device is included) ...
    t0 = time.perf_counter()
    for call in calls:
        call()
    torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) * 1e6 / n
    # ... then its device time, with the launches queued behind a stall.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _stall(1.5 * n * host_us + 50)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize()
    device_us = start.elapsed_time(end) * 1e3 / n
    group = max(1, math.ceil(_MIN_SAMPLE_US / max(device_us, 1e-3)))
    batch = max(1, min(reps, int(20_000 / (group * host_us))))  # ≤ ~20 ms of queued launches
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    k = 0
    for first in range(0, reps, batch):
        todo = range(first, min(reps, first + batch))
        _stall(1.5 * len(todo) * group * host_us + 50)
        for r in todo:
            starts[r].record()
            for _ in range(group):
                calls[k % n]()
                k += 1
            ends[r].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 / group for s, e in zip(starts, ends)], group


def _time_cpu(calls, warmup, reps):
    n = len(calls)
    for i in range(warmup):
        calls[i % n]()
    times = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        calls[(warmup + i) % n]()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times, 1


def _time_do_bench(calls):
    import itertools

    from triton.testing import do_bench

    rotation = itertools.cycle(calls)
    times_ms = do_bench(lambda: next(rotation)(), warmup=25, rep=100, return_mode="all")
    return [t * 1e3 for t in times_ms], 1


TIMERS = {
    "events": "cuda events, stream held busy by torch.cuda._sleep so launches queue; a sample "
              "is a group of calls lasting ≥ 20 us (calls_per_sample)",
    "do_bench": "triton.testing.do_bench(warmup=25 ms, rep=100 ms, return_mode='all'): events "
                "around each call, L2 cleared before it; launch overhead included",
    "wall": "time.perf_counter_ns per call",
}


def time_calls(calls, device, warmup, reps, timer=None):
    """Per-sample times in µs of calling ``calls[0], calls[1], ...`` in rotation.

    Returns (times, calls_per_sample). ``timer`` (``TIMERS``; default "events" on CUDA, "wall"
    on CPU): "events", event timing of queued launches (see the module docstring), a sample
    being the mean of a group of calls lasting ≥ 20 µs; "do_bench", Triton's own timer (its
    warm-up and repetitions are times, so ``warmup`` and ``reps`` do not apply); "wall", wall
    clock per call. ``warmup`` samples run first and are discarded.
    """
    if reps < 1:
        raise ValueError(f"reps must be ≥ 1, got {reps}")
    is_cuda = torch.device(device).type == "cuda"
    timer = timer or ("events" if is_cuda else "wall")
    if timer not in TIMERS or (timer != "wall") != is_cuda:
        raise ValueError(f"timer {timer!r} does not apply to {device}; use "
                         f"{'events or do_bench' if is_cuda else 'wall'}")
    if timer == "events":
        return _time_cuda(calls, warmup, reps)
    if timer == "do_bench":
        return _time_do_bench(calls)
    return _time_cpu(calls, warmup, reps)


def summarize(times_us):
    """p50, p95, p99, mean and min of per-sample times (µs)."""
    t = np.asarray(times_us, dtype=np.float64)
    p50, p95, p99 = np.percentile(t, [50, 95, 99])
    return {"p50_us": float(p50), "p95_us": float(p95), "p99_us": float(p99),
            "mean_us": float(t.mean()), "min_us": float(t.min())}


def copy_bandwidth(device, nbytes=None, warmup=None, reps=None, timer=None):
    """Device-to-device copy bandwidth in GB/s (10⁹ B/s), counting bytes read plus written.

    ``dst.copy_(src)`` of an ``nbytes`` buffer (default 1 GiB on CUDA, 128 MiB on CPU), timed
    like the ops; the p50 time is used. Returns (GB/s, stats dict).
    """
    kind = torch.device(device).type
    nbytes = nbytes or _COPY_BYTES[kind]
    default_warmup, default_reps = _DEFAULT_REPS[kind]
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
    dst = torch.empty_like(src)
    times, _ = time_calls([lambda: dst.copy_(src)], device,
                          default_warmup if warmup is None else warmup,
                          default_reps if reps is None else reps, timer)
    stats = summarize(times)
    return 2 * nbytes / (stats["p50_us"] * 1e3), {"bytes": 2 * nbytes, **stats}


def _first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _max_abs_diff(a, b):
    a, b = _first_tensor(a), _first_tensor(b)
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def rotating_calls(fn, sets):
    """One zero-argument call per input set. Each keeps its output until its set comes round
    again, so the outputs rotate over as many buffers as the inputs: the allocator cannot hand
    every call the same, still cached, output block."""
    kept = [None] * len(sets)

    def call(i):
        kept[i] = None
        kept[i] = fn(sets[i])

    return [partial(call, i) for i in range(len(sets))]


def _skip_or_error(backend, exc):
    """Status and reason of a backend that raised: a third-party backend that fails here
    (torch.compile without a working compiler, Liger) is "skipped"; normtools is an "error"."""
    reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    if backend in ("torch-compile", "liger"):
        return "skipped", f"failed here: {reason}"
    return "error", reason


_MEASURED = ("p50_us", "p95_us", "p99_us", "mean_us", "min_us", "gbs_p50", "pct_of_copy_bw",
             "n_buffer_sets", "calls_per_sample", "max_abs_diff")


def _row(op, backend, shape, dtype, status="ok", reason=""):
    """A result row; the measured fields stay None unless the case runs."""
    return {"op": op, "backend": backend, "dtype": str(dtype).removeprefix("torch."),
            "shape": dict(shape), "bytes": bytes_moved(op, shape, dtype), "status": status,
            "reason": reason, **dict.fromkeys(_MEASURED)}


def bench_case(op, backend, shape, sets, device, *, warmup, reps, copy_gbs, check=None,
               timer=None):
    """Time one (op, backend, shape) over the rotated input ``sets``.

    Returns (row, output on ``sets[0]`` or None). ``check``: another backend's output on
    ``sets[0]``; the row then records ``max_abs_diff`` of the first output tensor against it
    (a fast but wrong kernel shows here).
    """
    dtype = next(iter(sets[0].values())).dtype
    row = _row(op, backend, shape, dtype)
    try:
        fn = backend_fn(op, backend, device, shape)
    except Unavailable as exc:
        return {**row, "status": "skipped", "reason": str(exc)}, None
    try:
        out = fn(sets[0])
        if check is not None:
            row["max_abs_diff"] = _max_abs_diff(out, check)
        times, group = time_calls(rotating_calls(fn, sets), device, warmup, reps, timer)
    except Exception as exc:  # recorded in the results; the sweep goes on
        status, reason = _skip_or_error(backend, exc)
        return {**row, "status": status, "reason": reason}, None
    stats = summarize(times)
    gbs = row["bytes"] / (stats["p50_us"] * 1e3)
    row.update(stats, gbs_p50=gbs, pct_of_copy_bw=100 * gbs / copy_gbs,
               n_buffer_sets=len(sets), calls_per_sample=group)
    return row, out


# ------------------------------------------------------------------------------------- sweep

def run_sweep(device="cpu", dtype=torch.float32, *, ops=OPS, backends=None, shapes=None,
              warmup=None, reps=None, timer=None, quick=False, budget_s=None, out_path=None,
              log=None):
    """Run the benchmark sweep; returns the results dict (also written to ``out_path``).

    ``backends``: names to run; default ``default_backends(device)`` (on CPU without
    normtools-triton). ``shapes``: {op: [shape, ...]}, default ``default_shapes``. ``timer``:
    see ``time_calls``. ``budget_s``: stop starting new cases after this many seconds (the rest
    are recorded as skipped). ``out_path``: the JSON is rewritten after every case, so an
    interrupted run keeps its rows.

    The dict: {"conditions": {run conditions, dtype, warmup, reps, rotation, timer},
    "copy_bandwidth_gbs": float, "copy": {...}, "results": [row, ...]}; a row has op, backend,
    dtype, shape, bytes, status ("ok", "skipped", "error"), reason, and the measured fields
    p50_us, p95_us, p99_us, mean_us, min_us, gbs_p50, pct_of_copy_bw, n_buffer_sets,
    calls_per_sample and max_abs_diff (against the first backend that ran, normtools-torch when
    it runs), None where the case did not run.
    """
    device = str(device)
    kind = torch.device(device).type
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    default_warmup, default_reps = _QUICK_REPS if quick else _DEFAULT_REPS[kind]
    warmup = default_warmup if warmup is None else warmup
    reps = default_reps if reps is None else reps
    shapes = shapes or default_shapes(device, quick)
    defaults = default_backends(device)
    selected = {b: (defaults[b] if backends is None else None)
                for b in (BACKENDS if backends is None else backends)}
    unknown = set(selected) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; expected some of {list(BACKENDS)}")
    if set(ops) - set(OPS):
        raise ValueError(f"unknown ops {sorted(set(ops) - set(OPS))}; expected some of {list(OPS)}")
    # The reference backend first, so that the others are checked against its output.
    order = sorted(selected, key=lambda b: b != "normtools-torch")
    cache_bytes = _cache_bytes(device)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    copy_gbs, copy_stats = copy_bandwidth(device, nbytes=64 * 2**20 if quick else None,
                                          warmup=warmup, reps=reps, timer=timer)
    log(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    data = {
        "conditions": {
            **sysinfo.run_conditions(device), "dtype": str(dtype).removeprefix("torch."),
            "warmup": warmup, "reps": reps, "quick": quick, "cache_bytes": cache_bytes,
            "rotate_buffers": "input sets rotated until they total ≥ 2× cache_bytes (≥ 4 sets, "
                              "capped by memory); per-row count in n_buffer_sets",
            "timer": TIMERS[timer or ("events" if kind == "cuda" else "wall")],
            "bytes_model": "minimum bytes: inputs read once, outputs written once "
                           "(normtools.bench.bytes_moved)",
        },
        "copy_bandwidth_gbs": copy_gbs, "copy": copy_stats, "results": [],
    }
    start = time.monotonic()
    for op in ops:
        for shape in shapes[op]:
            check, sets = None, None
            for backend in order:
                reason = selected[backend]
                if reason is None and budget_s is not None and time.monotonic() - start >= budget_s:
                    reason = f"time budget of {budget_s:.0f} s exhausted before this case"
                if reason is not None:
                    row = _row(op, backend, shape, dtype, "skipped", reason)
                else:
                    sets = sets or input_sets(op, shape, dtype, device, cache_bytes)
                    row, out = bench_case(op, backend, shape, sets, device, warmup=warmup,
                                          reps=reps, copy_gbs=copy_gbs, check=check, timer=timer)
                    check = out if check is None else check
                data["results"].append(row)
                log(_row_line(row))
                if out_path is not None:
                    _write_json(data, out_path)
    return data


def _write_json(data, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def _row_line(row):
    head = f"{row['op']:<18} {shape_label(row['shape']):<26} {row['backend']:<17}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    return (f"{head} p50 {row['p50_us']:10.1f} us  {row['gbs_p50']:8.1f} GB/s  "
            f"{row['pct_of_copy_bw']:5.1f}% of copy")


# ---------------------------------------------------------------------------- reading results

_SHAPE_KEYS = ("M", "N", "T", "Hq", "Hk", "D")


def _read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_results(path):
    """Load one results JSON file, or every ``*.json`` in a directory, for the book.

    Returns (frame, conditions): a pandas DataFrame with one row per result (columns of the
    JSON rows, ``shape`` as a label "M=4096 N=2048", the shape's numbers as columns M, N, T, Hq,
    Hk, D, and ``source``, the file's name) and {source: conditions, with
    ``copy_bandwidth_gbs`` added}. A missing or empty directory gives an empty frame and {}.
    """
    import pandas as pd

    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else ([path] if path.exists() else [])
    rows, conditions = [], {}
    for file in files:
        data = _read_json(file)
        conditions[file.name] = {**data["conditions"],
                                 "copy_bandwidth_gbs": data["copy_bandwidth_gbs"]}
        for row in data["results"]:
            numbers = {k: row["shape"].get(k) for k in _SHAPE_KEYS}
            rows.append({**row, **numbers, "shape": shape_label(row["shape"]),
                         "source": file.name})
    columns = ["source", "op", "backend", "dtype", "shape", *_SHAPE_KEYS, "status", "reason",
               "p50_us", "p95_us", "p99_us", "mean_us", "gbs_p50", "pct_of_copy_bw", "bytes"]
    frame = pd.DataFrame(rows)
    if frame.empty:
        frame = pd.DataFrame(columns=columns)
    return frame, conditions


# (op, minimum N or None, minimum % of copy bandwidth) for normtools-triton: the targets.
BANDWIDTH_TARGETS = (("rms_norm", 2048, 90.0), ("rms_norm_fwd_bwd", 2048, 80.0),
                     ("qk_norm_per_head", None, 80.0))
SPEEDUP_BASELINES = ("torch-compile", "liger")


def targets_report(data):
    """The issue's performance targets checked on a results dict (``run_sweep``'s output) or
    on the path of a results JSON file.

    * % of copy bandwidth of normtools-triton (``BANDWIDTH_TARGETS``): rms_norm ≥ 90 % for
      N ≥ 2048, rms_norm_fwd_bwd ≥ 80 % for N ≥ 2048, qk_norm_per_head ≥ 80 %;
    * speedup = p50(baseline) / p50(normtools-triton) ≥ 1.0 against torch-compile and liger, on
      every op and shape where both ran.

    Returns a list of rows {target, op, shape, measured, threshold, passed}; ``passed`` is None
    when the needed measurement is missing (backend skipped or failed), with the reason in
    ``note``. Meant for a CUDA results file; on CPU the numbers are not the issue's targets.
    """
    if isinstance(data, (str, Path)):
        data = _read_json(data)
    ok = {}
    for row in data["results"]:
        ok[(row["op"], shape_label(row["shape"]), row["backend"])] = row
    report = []
    cases = {(row["op"], shape_label(row["shape"])): row["shape"] for row in data["results"]}
    for (op, label), shape in cases.items():
        ours = ok.get((op, label, "normtools-triton"))
        ours_ok = ours is not None and ours["status"] == "ok"
        note = "" if ours_ok else ("normtools-triton: " + (ours["reason"] if ours else "not run"))
        for target_op, min_n, threshold in BANDWIDTH_TARGETS:
            if op == target_op and (min_n is None or shape.get("N", 0) >= min_n):
                report.append({"target": f"% of copy bandwidth ≥ {threshold:g}", "op": op,
                               "shape": label, "threshold": threshold,
                               "measured": ours["pct_of_copy_bw"] if ours_ok else None,
                               "passed": (ours["pct_of_copy_bw"] >= threshold) if ours_ok else None,
                               "note": note})
        for baseline in SPEEDUP_BASELINES:
            other = ok.get((op, label, baseline))
            if other is None:
                continue
            if other["status"] != "ok" or not ours_ok:
                missing = note or f"{baseline}: {other['reason']}"
                report.append({"target": f"speedup vs {baseline} ≥ 1.0", "op": op, "shape": label,
                               "threshold": 1.0, "measured": None, "passed": None,
                               "note": missing})
                continue
            speedup = other["p50_us"] / ours["p50_us"]
            report.append({"target": f"speedup vs {baseline} ≥ 1.0", "op": op, "shape": label,
                           "threshold": 1.0, "measured": speedup, "passed": speedup >= 1.0,
                           "note": ""})
    return report


def _fmt(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_summary(data):
    """A short Markdown report of a results dict: conditions, a p50 table, the targets."""
    c = data["conditions"]
    gpu = c.get("gpu") or {}
    versions = c.get("versions", {})
    lines = [
        "# normtools bench",
        "",
        f"- device: {gpu.get('name') or c.get('cpu_model')} ({c['device']}); driver "
        f"{c.get('nvidia_driver') or '–'}; CUDA {c.get('cuda_runtime') or '–'}",
        f"- torch {versions.get('torch')}, triton {versions.get('triton')}, "
        f"liger-kernel {versions.get('liger-kernel') or 'not installed'}; python {c['python']}",
        f"- dtype {c['dtype']}, warm-up {c['warmup']} samples, {c['reps']} samples; "
        f"{c['utc']}",
        f"- copy bandwidth: {data['copy_bandwidth_gbs']:.1f} GB/s",
        "",
    ]
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in data["results"])]
    lines += ["p50 µs per call (% of the copy bandwidth):", "",
              "| op | shape | " + " | ".join(backends) + " |",
              "|---|---|" + "---|" * len(backends)]
    cases = {}
    for row in data["results"]:
        cases.setdefault((row["op"], shape_label(row["shape"])), {})[row["backend"]] = row
    for (op, label), by_backend in cases.items():
        cells = []
        for b in backends:
            row = by_backend.get(b)
            if row is None:
                cells.append("–")
            elif row["status"] == "ok":
                cells.append(f"{row['p50_us']:.1f} ({row['pct_of_copy_bw']:.0f}%)")
            else:
                cells.append(row["status"])
        lines.append(f"| {op} | {label} | " + " | ".join(cells) + " |")
    if c["device"] != "cuda":
        lines += ["", "Targets: defined for a CUDA run (H200, bfloat16); not evaluated on a CPU "
                      "run."]
        return "\n".join(lines) + "\n"
    report = targets_report(data)
    failed = [r for r in report if r["passed"] is False]
    missing = [r for r in report if r["passed"] is None]
    lines += ["", f"## Targets: {sum(r['passed'] is True for r in report)} passed, "
                  f"{len(failed)} missed, {len(missing)} without data", ""]
    if failed or missing:
        lines += ["| target | op | shape | measured | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['op']} | {r['shape']} | {_fmt(r['measured'], 2)} | "
                  f"{r['note']} |" for r in failed + missing]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------- CLI

_DESCRIPTION = ("Time the normalization ops on every backend over a sweep of shapes; write the "
                "results, the copy bandwidth and the run conditions as JSON.")


def _add_arguments(parser):
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="activation and weight dtype (default: bfloat16 on CUDA, float32 "
                             "on CPU)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"ops to time (default: all): {', '.join(OPS)}")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, metavar="BACKEND",
                        help=f"backends to run (default: all that apply to the device): "
                             f"{', '.join(BACKENDS)}")
    parser.add_argument("--quick", action="store_true", help="one tiny shape per op, 3 samples")
    parser.add_argument("--warmup", type=int, help="warm-up samples")
    parser.add_argument("--reps", type=int, help="timed samples")
    parser.add_argument("--timer", choices=sorted(TIMERS),
                        help="events (CUDA default), do_bench (CUDA, Triton's timer, for a "
                             "cross-check) or wall (CPU)")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads for the run (recorded in the conditions)")
    parser.add_argument("--budget-s", type=float,
                        help="start no new case after this many seconds")
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--summary", help="write the Markdown summary here")
    parser.add_argument("--report", metavar="RESULTS_JSON",
                        help="only print the Markdown summary of an existing results file")


def run_cli(args):
    """Entry point of ``normtools bench``; returns the exit code."""
    if args.report:
        text = markdown_summary(_read_json(args.report))
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
            else args.device
        is_cuda = torch.device(device).type == "cuda"
        if is_cuda and not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
            return 2
        if not is_cuda and args.backends and "normtools-triton" in args.backends:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        dtype = args.dtype or ("bfloat16" if is_cuda else "float32")
        if args.threads:
            torch.set_num_threads(args.threads)
        try:
            data = run_sweep(device, dtype, ops=args.ops, backends=args.backends,
                             warmup=args.warmup, reps=args.reps, quick=args.quick,
                             timer=args.timer, budget_s=args.budget_s, out_path=args.out)
        except ValueError as exc:  # options that do not fit together
            print(f"error: {exc}", file=sys.stderr)
            return 2
        text = markdown_summary(data)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(text, encoding="utf-8")
    print(text)
    return 0


def add_cli(subparsers):
    """Register the ``bench`` subcommand of the ``normtools`` command line."""
    parser = subparsers.add_parser("bench", help="time the norm ops on every backend (JSON)",
                                   description=_DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run_cli)
    return parser


def main(argv=None):
    """``python -m normtools.bench``: the same options as ``normtools bench``."""
    parser = argparse.ArgumentParser(prog="python -m normtools.bench", description=_DESCRIPTION)
    _add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

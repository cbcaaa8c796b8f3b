"""Timing: rotated input sets (cold caches), CUDA events or wall clock per sample, percentiles,
and the copy bandwidth that every op is compared with."""

import math
import time
from functools import partial

import numpy as np
import torch

from normtools.core import sysinfo
from normtools.measure.bench.shapes import make_inputs

_MIN_SAMPLE_US = 20.0        # CUDA: a sample groups calls until it lasts about this long
_ROTATION_BUDGET = {"cuda": 8 * 2**30, "cpu": 512 * 2**20}   # bytes of rotated input sets
_COPY_BYTES = {"cuda": 2**30, "cpu": 128 * 2**20}
# (warm-up samples, samples); ≥ 300 samples on CUDA, so that the p99 rests on three of them
_DEFAULT_REPS = {"cuda": (10, 300), "cpu": (5, 30)}
_QUICK_REPS = (1, 3)


def sample_counts(device, quick=False, warmup=None, reps=None):
    """(warm-up samples, samples) of a run on ``device``: ``warmup`` and ``reps`` where given,
    else the defaults of the device, or of a ``quick`` run."""
    default_warmup, default_reps = _QUICK_REPS if quick else _DEFAULT_REPS[torch.device(device).type]
    return (default_warmup if warmup is None else warmup, default_reps if reps is None else reps)
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


def timer_for(device, timer=None):
    """``timer``, or the default of ``device`` ("events" on CUDA, "wall" on CPU); ValueError
    for one of ``TIMERS`` that does not apply to the device, or none of them."""
    is_cuda = torch.device(device).type == "cuda"
    timer = timer or ("events" if is_cuda else "wall")
    if timer not in TIMERS or (timer != "wall") != is_cuda:
        raise ValueError(f"timer {timer!r} does not apply to {device}; use "
                         f"{'events or do_bench' if is_cuda else 'wall'}")
    return timer


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
    timer = timer_for(device, timer)
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
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
    dst = torch.empty_like(src)
    times, _ = time_calls([lambda: dst.copy_(src)], device,
                          *sample_counts(device, warmup=warmup, reps=reps), timer)
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

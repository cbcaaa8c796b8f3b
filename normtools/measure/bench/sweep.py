"""The sweep: every (op, backend, shape) case timed, checked against the first backend, written
as one JSON file with its run conditions."""

import sys
import time

import torch

from normtools.core import sysinfo
from normtools.measure.bench.backends import Unavailable, backend_fn, default_backends
from normtools.measure.bench.cases import Case, estimate_seconds
from normtools.measure.bench.peers import Peers
from normtools.measure.bench.shapes import _DTYPES, BACKENDS, OPS, default_shapes, make_inputs, shape_label
from normtools.measure.bench.results import _write_json
from normtools.measure.bench.timing import (TIMERS, _cache_bytes, _max_abs_diff, copy_bandwidth, input_sets,
                                            rotating_calls, sample_counts, summarize, time_calls,
                                            timer_for)
from normtools.measure.bench.minimum_bytes import bytes_moved


def _skip_or_error(backend, exc):
    """Status and reason of a backend that raised: a third-party backend that fails here
    (torch.compile without a working compiler, Liger) is "skipped"; normtools is an "error"."""
    reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    if backend in ("torch-compile", "liger"):
        return "skipped", f"failed here: {reason}"
    return "error", reason


_MEASURED = ("p50_us", "p95_us", "p99_us", "mean_us", "min_us", "gbs_p50", "pct_of_copy_bw",
             "n_buffer_sets", "calls_per_sample", "max_abs_diff", "first_call_s",
             "peer_p50_us", "aggregate_gbs_p50", "overlap")
_CASE_KEYS = tuple(Case("sweep", "rms_norm", {}).conditions())


def _row(op, backend, shape, dtype, status="ok", reason="", case=None, processes=1):
    """A result row; the measured fields stay None unless the case runs. ``case`` (a
    ``cases.Case``) adds its conditions: phase, cache, regime, models, batch, tokens;
    ``processes`` is how many processes time the case at once (``peers``)."""
    conditions = case.conditions() if case is not None else dict.fromkeys(_CASE_KEYS)
    return {"op": op, "backend": backend, "dtype": str(dtype).removeprefix("torch."),
            "shape": dict(shape), "bytes": bytes_moved(op, shape, dtype), "status": status,
            "reason": reason, **conditions, "processes": processes,
            **dict.fromkeys(_MEASURED)}


def bench_case(op, backend, shape, sets, device, *, warmup, reps, copy_gbs, check=None,
               timer=None, case=None, peers=None):
    """Time one (op, backend, shape) over the rotated input ``sets``.

    Returns (row, output on ``sets[0]`` or None). ``check``: another backend's output on
    ``sets[0]``; the row then records ``max_abs_diff`` of the first output tensor against it
    (a fast but wrong kernel shows here). ``first_call_s`` is the wall time of the first call,
    measured apart from the samples: a compile (torch.compile) or JIT (Triton) at a new shape.
    ``peers`` (``peers.Peers``): its processes time the same case at the same moment (the row
    then has their p50s, the aggregate bandwidth and the overlap of the timing windows).
    """
    dtype = next(iter(sets[0].values())).dtype
    row = _row(op, backend, shape, dtype, case=case,
               processes=1 if peers is None else peers.processes)
    try:
        fn = backend_fn(op, backend, device, shape)
    except Unavailable as exc:
        return {**row, "status": "skipped", "reason": str(exc)}, None
    try:
        t0 = time.perf_counter()
        out = fn(sets[0])
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        row["first_call_s"] = time.perf_counter() - t0
        if check is not None:
            row["max_abs_diff"] = _max_abs_diff(out, check)
        calls = rotating_calls(fn, sets)
        if peers is None:
            times, group = time_calls(calls, device, warmup, reps, timer)
            peer_times, overlap = [], None
        else:
            task = (op, backend, dict(shape), dtype, device,
                    "rotated" if case is None else case.cache, warmup, reps, timer)
            times, group, peer_times, overlap = peers.time_together(
                task, lambda: time_calls(calls, device, warmup, reps, timer))
    except Exception as exc:  # recorded in the results; the sweep goes on
        status, reason = _skip_or_error(backend, exc)
        return {**row, "status": status, "reason": reason}, None
    stats = summarize(times)
    gbs = row["bytes"] / (stats["p50_us"] * 1e3)
    peer_p50 = [summarize(t)["p50_us"] for t in peer_times]
    row.update(stats, gbs_p50=gbs, pct_of_copy_bw=100 * gbs / copy_gbs,
               n_buffer_sets=len(sets), calls_per_sample=group,
               peer_p50_us=peer_p50 if peers is not None else None,
               aggregate_gbs_p50=gbs + sum(row["bytes"] / (p * 1e3) for p in peer_p50),
               overlap=overlap)
    return row, out


# ------------------------------------------------------------------------------------- sweep

def run_sweep(device="cpu", dtype=torch.float32, *, ops=OPS, backends=None, shapes=None,
              cases=None, warmup=None, reps=None, timer=None, quick=False, budget_s=None,
              out_path=None, log=None, processes=1):
    """Run the benchmark sweep; returns the results dict (also written to ``out_path``).

    ``backends``: names to run; default ``default_backends(device)`` (on CPU without
    normtools-triton). ``cases``: a list of ``cases.Case`` (e.g. ``cases.gpu_run_cases()``), run
    in order; otherwise ``shapes``, {op: [shape, ...]} (default ``default_shapes``), each shape a
    "sweep" case with rotated inputs. ``timer``: see ``time_calls``. ``budget_s``: a case starts
    only if its estimated time (``cases.estimate_seconds`` at the copy bandwidth measured here)
    still fits in the budget, and then runs on every backend: a shape is all or nothing, so no
    ratio lacks its other side; the cases left out are recorded as skipped. ``out_path``: the
    JSON is rewritten after every row, so an interrupted run keeps its rows. ``processes``: K
    processes time each case at once (``peers``: K − 1 peer processes, each on one stream, and
    this one); K and the concurrency are recorded in the conditions and in every row.

    The dict: {"conditions": {run conditions, dtype, warmup, reps, rotation, timer,
    concurrency}, "copy_bandwidth_gbs": float, "copy": {...}, "results": [row, ...]}; a row has
    op, backend, dtype, shape, bytes, status ("ok", "skipped", "error"), reason, the case's
    conditions (phase, cache, regime, models, batch, tokens_per_sequence), and the measured
    fields p50_us, p95_us, p99_us, mean_us, min_us, gbs_p50, pct_of_copy_bw, n_buffer_sets,
    calls_per_sample, max_abs_diff (against the first backend that ran, normtools-torch when
    it runs), first_call_s, processes, peer_p50_us, aggregate_gbs_p50 and overlap (see
    ``peers``; one process: no peers, aggregate = gbs_p50, overlap None), None where the case
    did not run.
    """
    device = str(device)
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    warmup, reps = sample_counts(device, quick, warmup, reps)
    if set(ops) - set(OPS):
        raise ValueError(f"unknown ops {sorted(set(ops) - set(OPS))}; expected some of {list(OPS)}")
    if cases is None:
        shapes = shapes or default_shapes(device, quick)
        cases = [Case("sweep", op, shape) for op in ops for shape in shapes[op]]
    else:
        cases = [c for c in cases if c.op in ops]
    defaults = default_backends(device)
    selected = {b: (defaults[b] if backends is None else None)
                for b in (BACKENDS if backends is None else backends)}
    unknown = set(selected) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; expected some of {list(BACKENDS)}")
    # The reference backend first, so that the others are checked against its output.
    order = sorted(selected, key=lambda b: b != "normtools-torch")
    running = [b for b in order if selected[b] is None]
    cache_bytes = _cache_bytes(device)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    copy_gbs, copy_stats = copy_bandwidth(device, nbytes=64 * 2**20 if quick else None,
                                          warmup=warmup, reps=reps, timer=timer)
    log(f"copy bandwidth: {copy_gbs:.1f} GB/s")
    estimates = estimate_seconds(cases, running, warmup=warmup, reps=reps, dtype=dtype,
                                 bandwidth_gbs=copy_gbs, cache_bytes=cache_bytes)
    data = {
        "conditions": {
            **sysinfo.run_conditions(device), "dtype": str(dtype).removeprefix("torch."),
            "warmup": warmup, "reps": reps, "quick": quick, "cache_bytes": cache_bytes,
            "rotate_buffers": "input sets rotated until they total ≥ 2× cache_bytes (≥ 4 sets, "
                              "capped by memory); per-row count in n_buffer_sets; rows with "
                              "cache 'warm' call one input set again and again",
            "timer": TIMERS[timer_for(device, timer)],
            "processes": processes,
            "concurrency": ("one process, one stream" if processes == 1 else
                            f"{processes} processes at once on each case (one stream each), "
                            f"started together at a barrier"),
            "bytes_model": "minimum bytes: inputs read once, outputs written once "
                           "(normtools.measure.bench.bytes_moved)",
        },
        "copy_bandwidth_gbs": copy_gbs, "copy": copy_stats, "results": [],
    }
    peers = Peers(processes - 1, cache_bytes) if processes > 1 else None
    try:
        _run_cases(data, estimates, order, selected, dtype, device, budget_s, cache_bytes,
                   warmup=warmup, reps=reps, copy_gbs=copy_gbs, timer=timer, peers=peers,
                   out_path=out_path, log=log)
    finally:
        if peers is not None:
            peers.close()
    return data


def _run_cases(data, estimates, order, selected, dtype, device, budget_s, cache_bytes, *,
               warmup, reps, copy_gbs, timer, peers, out_path, log):
    """The sweep's loop: every case on every backend (or all skipped), one row each."""
    start = time.monotonic()
    for case, estimate in estimates:
        op, shape = case.op, case.shape
        elapsed = time.monotonic() - start
        over = budget_s is not None and elapsed + estimate > budget_s
        check, sets = None, None
        for backend in order:
            reason = selected[backend]
            if reason is None and over:
                reason = (f"time budget of {budget_s:.0f} s: {elapsed:.0f} s spent, this case "
                          f"needs about {estimate:.0f} s")
            if reason is not None:
                row = _row(op, backend, shape, dtype, "skipped", reason, case=case,
                           processes=1 if peers is None else peers.processes)
            else:
                if sets is None:
                    sets = ([make_inputs(op, shape, dtype, device)] if case.cache == "warm"
                            else input_sets(op, shape, dtype, device, cache_bytes))
                row, out = bench_case(op, backend, shape, sets, device, warmup=warmup,
                                      reps=reps, copy_gbs=copy_gbs, check=check, timer=timer,
                                      case=case, peers=peers)
                check = out if check is None else check
            data["results"].append(row)
            log(_row_line(row))
            if out_path is not None:
                _write_json(data, out_path)
        del sets, check


def _row_line(row):
    head = f"{row['op']:<18} {shape_label(row['shape']):<26} {row['backend']:<17}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    return (f"{head} p50 {row['p50_us']:10.1f} us  {row['gbs_p50']:8.1f} GB/s  "
            f"{row['pct_of_copy_bw']:5.1f}% of copy")

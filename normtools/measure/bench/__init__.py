"""Benchmark harness: ``normtools bench`` (also ``python -m normtools.measure.bench``).

Times the normalization ops on every available backend over a sweep of shapes and writes one
JSON file: the run conditions, the device's copy bandwidth measured in the same run, and one row
per (op, backend, shape).

Ops (``OPS``): ``rms_norm`` (forward), ``rms_norm_fwd_bwd`` (forward + backward to x and w),
``add_rms_norm`` (residual add fused with RMSNorm), ``layer_norm``, ``qk_norm_per_head``,
``qk_norm_per_layer`` and the fused QK-Norm + RoPE ``qk_norm_rope_per_head`` /
``qk_norm_rope_per_layer`` (and their ``_fwd_bwd``: forward + backward to q, k and both weights).
Backends (``BACKENDS``):

* "normtools-triton", "normtools-torch": ``normtools.<op>(..., backend="triton" | "torch")``;
* "normtools-triton-chunks": normtools-triton on the launch plan of a GPU without thread-block
  clusters (sm_80), timed only where an sm_90 plan uses clusters (rows past one CTA): the
  same kernels reading a long row in chunks, twice, the A/B of the cluster plan;
* "normtools-triton-prefetch": normtools-triton with the single-pass loops (row norms, QK-Norm,
  QK-Norm + RoPE) loading the next row block ahead (``launch_hooks.prefetching``, cp.async into
  shared memory), timed only where an sm_90 program loops over several row blocks: the A/B of
  the prefetch;
* "torch-F": ``torch.nn.functional.rms_norm`` / ``layer_norm`` (the add as ``x + residual``,
  QK-Norm as one call on q and one on k, viewed per head for per_head);
* "torch-compile": ``torch.compile`` of the same composition written with
  ``normtools.core.reference`` (the plain-PyTorch reference), compiled once per head_dim and
  recompiled per shape in the same process;
* "liger": Liger-Kernel's ``liger_rms_norm`` / ``liger_layer_norm`` (and its fused add+RMSNorm
  when the installed version has one), when ``liger_kernel`` imports and the device is CUDA;
  it has no fused QK-Norm + RoPE, so those rows are skipped with that reason.

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

Cases. ``cases.gpu_run_cases`` is the plan of a GPU run (``--cases gpu-run``): a first pass of
the target ops, the bundled models' real shapes (prefill and decode, warm and rotated inputs),
then the full sweep, every synthetic case ≥ 256 MiB; each row records its phase, regime,
batch, tokens per sequence and cache state. ``--dry-run`` prints the plan with its estimate.

Modules, in the order of a run: ``shapes`` (ops, backends, shapes, inputs), ``minimum_bytes``
(the minimum bytes of each op), ``cases`` (the cases of a GPU run and their time estimate),
``backends`` (one callable per op and backend), ``timing`` (rotated inputs, timers,
percentiles, copy bandwidth), ``sweep`` (the cases of a run), ``peers`` (concurrency: K
processes timing each case at once, ``--processes K``), ``results`` (JSON in and out),
``report`` (targets and the Markdown summary), ``cpu_table`` (normtools' CPU path against the
module it reproduces), ``cli``. The model-level benchmark is
``normtools.measure.model_bench``.
"""

from normtools.measure.bench.backends import Unavailable, backend_fn, default_backends
from normtools.measure.bench.cases import Case, estimate_seconds, gpu_run_cases, real_shape_cases
from normtools.measure.bench.cli import add_cli, main
from normtools.measure.bench.shapes import BACKENDS, OPS, QK_OPS, ROW_OPS, default_shapes, make_inputs, shape_label
from normtools.measure.bench.report import BANDWIDTH_TARGETS, SPEEDUP_BASELINES, markdown_summary, targets_report
from normtools.measure.bench.results import load_results
from normtools.measure.bench.sweep import bench_case, run_sweep
from normtools.measure.bench.timing import (TIMERS, copy_bandwidth, input_sets, n_buffer_sets, rotating_calls,
                                            summarize, time_calls)
from normtools.measure.bench.minimum_bytes import bytes_moved

__all__ = ["Case", "gpu_run_cases", "real_shape_cases", "estimate_seconds", "OPS", "BACKENDS", "ROW_OPS", "QK_OPS", "BANDWIDTH_TARGETS", "SPEEDUP_BASELINES",
           "Unavailable", "default_shapes", "shape_label", "make_inputs", "bytes_moved",
           "backend_fn", "default_backends", "n_buffer_sets", "input_sets", "rotating_calls",
           "time_calls", "summarize", "TIMERS", "copy_bandwidth", "bench_case", "run_sweep",
           "load_results", "targets_report", "markdown_summary", "add_cli", "main"]

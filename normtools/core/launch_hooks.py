"""Launch hooks: the one extension point through which measurement sees the kernel launches.

Every launch of every op goes through ``normtools.core.launch.kernel_for`` and
``normtools.core.launcher.plan_for``; these four hooks, each a context variable (so a hook set
in one thread or task never leaks into another), change what those two do:

* ``planning_for_cuda(sm_count, capability)``: plan_for gives CPU tensors the launch plan of a
  CUDA device, so the interpreter runs exactly the block sizes and grid a GPU run gets. Used by
  ``normtools.measure.bytes_counter`` (bytes counted on the GPU's plan),
  ``normtools.measure.spills`` (compiling each plan per compute capability) and
  ``normtools.measure.bench.backends`` (the chunked plan of a GPU without clusters).
* ``replaying_rows(rows)``: plan_for keeps each tensor's rows per program (and heads per
  slot) of a kernel from ``rows`` whatever the number of rows, so a few programs of a real
  plan run at a fraction of its rows. Used by the bytes counter, which counts a launch's
  bytes on a few of its programs.
* ``prefetching(stages)``: the CUDA plans of the single-pass kernels (row norms, QK-Norm,
  QK-Norm + RoPE) load rows ahead in their persistent loops (``tl.range(..., num_stages)``). Used by the benchmark's normtools-triton-prefetch
  backend and the spill report (each stage count compiled).
* ``recording_launches()``: kernel_for records each launch (kernel, grid, arguments) instead
  of running it. Used by ``normtools.measure.spills``, which compiles the recorded launches
  for a GPU ahead of time.
* ``INTERPRETED_LAUNCH_OBSERVER``: called with (kernel name, grid) before each launch run by
  Triton's interpreter. Used by the bytes counter (``normtools.measure.bytes_counter``) to split
  its counts by launch.

Nothing in the library sets them; without them the ops launch as they are.
"""

import contextlib
import contextvars
import dataclasses

from triton.runtime import JITFunction

from normtools.core.launch_plans import DEFAULT_CAPABILITY, DEFAULT_SM_COUNT

# Called with (kernel name, grid) before each interpreted launch (the bytes counter's hook).
INTERPRETED_LAUNCH_OBSERVER = contextvars.ContextVar("normtools_launch_observer", default=None)

_LAUNCH_RECORDER = contextvars.ContextVar("normtools_launch_recorder", default=None)
_PLAN_TARGET = contextvars.ContextVar("normtools_plan_target", default=None)
_REPLAYED_ROWS = contextvars.ContextVar("normtools_replayed_rows", default=None)
_PREFETCH_STAGES = contextvars.ContextVar("normtools_prefetch_stages", default=1)


@contextlib.contextmanager
def prefetching(stages):
    """Within this context, CUDA plans of the single-pass kernels (row norms, QK-Norm, QK-Norm
    + RoPE) load their rows ``stages`` − 1 iterations ahead (``LaunchPlan.num_stages``,
    launch_plans.PREFETCH_KERNELS): how the GPU run times the prefetch against the default plan
    (no prefetch)."""
    if stages < 1:
        raise ValueError(f"prefetch stages must be at least 1, got {stages}")
    token = _PREFETCH_STAGES.set(stages)
    try:
        yield
    finally:
        _PREFETCH_STAGES.reset(token)


def prefetch_stages():
    """The stages of the enclosing ``prefetching``, or 1 (no prefetch)."""
    return _PREFETCH_STAGES.get()


@contextlib.contextmanager
def planning_for_cuda(sm_count=DEFAULT_SM_COUNT, capability=DEFAULT_CAPABILITY):
    """Within this context, launches on CPU tensors (Triton's interpreter) use the plans of a
    CUDA device with ``sm_count`` SMs and compute capability ``capability``: how the bytes
    counter and the spill report see exactly the block sizes and grids that a GPU run gets
    (the interpreter runs a cluster plan's program as one program: ``num_ctas`` changes where
    the row's values live, not which bytes the program loads and stores)."""
    token = _PLAN_TARGET.set((sm_count, capability))
    try:
        yield
    finally:
        _PLAN_TARGET.reset(token)


def cuda_plan_target():
    """(SMs, compute capability) of the enclosing ``planning_for_cuda``, or None."""
    return _PLAN_TARGET.get()


@contextlib.contextmanager
def replaying_rows(rows):
    """Within this context, ``plan_for`` gives the kernels named in ``rows`` ({kernel name:
    ((rows_per_program, units_per_slot) per tensor, ...)}) those rows per program and units
    per slot (``launch_plans.Share``), with as many programs as the rows need
    (``launch_plan``'s ``fixed_rows``)."""
    token = _REPLAYED_ROWS.set(rows)
    try:
        yield
    finally:
        _REPLAYED_ROWS.reset(token)


def replayed_rows(kernel):
    """The rows per program of ``kernel`` in an enclosing ``replaying_rows``, or None."""
    return (_REPLAYED_ROWS.get() or {}).get(kernel)


@contextlib.contextmanager
def recording_launches():
    """Within this context, kernel launches are recorded instead of run: yields a list that
    receives a ``RecordedLaunch`` per launch (the ops' outputs are then uninitialized)."""
    launches = []
    token = _LAUNCH_RECORDER.set(launches)
    try:
        yield launches
    finally:
        _LAUNCH_RECORDER.reset(token)


@dataclasses.dataclass
class RecordedLaunch:
    """A launch ``kernel[grid](*args, **kwargs)`` seen inside ``recording_launches``."""

    kernel: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


def recording_kernel(kernel):
    """Inside ``recording_launches``: a stand-in for ``kernel`` whose launches
    ``[grid](*args, **kwargs)`` are recorded, not run; outside: None."""
    launches = _LAUNCH_RECORDER.get()
    return None if launches is None else _RecordingKernel(kernel, launches)


class _RecordingKernel:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(RecordedLaunch(self.kernel, tuple(grid), args, kwargs))
        return launch

"""How a launcher runs a kernel: the plan for its tensors, then the kernel for their device.

A launcher (``normtools.core.ops``, ``qk``, ``rope``) does, for every kernel it runs::

    plan = plan_for("rms_norm_fwd", x.dtype, m, n, x.device)       # launch_plans' table
    kernel_for(kernels.rms_norm_fwd, x.device)[(plan.programs,)](..., eps=eps, ...)

* ``resolve_backend``: "auto" → "triton" on CUDA, "torch" on CPU unless the interpreter is
  asked for (``TRITON_INTERPRET=1``).
* ``plan_for``: ``launch_plans.launch_plan`` for the tensors' device (its SM count and compute
  capability on CUDA), or for the CUDA device of an enclosing ``launch_hooks.planning_for_cuda``
  (with the prefetch stages of an enclosing ``launch_hooks.prefetching``).
  A cluster plan on CUDA is capped at the clusters the GPU holds at once (``_RESIDENT_CLUSTERS``,
  filled by the launches: see ``record_resident_clusters``), so its grid is one wave.
* ``kernel_for``: the callable kernel for a device: the compiled ``@triton.jit`` kernel inside
  a device guard for CUDA tensors; the same kernel run by Triton's interpreter for CPU tensors
  (``normtools.core._triton_interpreter``), also in a process in which ``TRITON_INTERPRET`` was
  never set; a recorder inside ``launch_hooks.recording_launches``. Every launch gets
  ``launch_plans.launch_options`` (``enable_fp_fusion=True``, ``maxnreg`` for one CTA per
  SM), and the first compile of a
  cluster kernel (``num_ctas`` > 1) on CUDA is checked by ``check_cluster_ptx`` and measured
  by the occupancy query (``record_resident_clusters``).
* ``as_rows``: a (M, N) view of a tensor with unit stride along N (a copy only if needed).
* ``sum_partials``: the last launch of every backward, the weight gradients (one or two:
  q's and k's, w's and b's) from the per-program partial rows (``kernels/partials.py``), on
  the grid of ``launch_plans.partials_plan``.
"""

import functools
import os
import warnings

import torch
import triton

from normtools._kernels import partials as _partials
from normtools.core import launch_hooks, launch_plans, occupancy
from normtools.core._triton_interpreter import InterpretedKernel, is_interpreted
from normtools.core.launch_plans import launch_options, launch_plan

# PTX instructions that a kernel split over a thread-block cluster must contain: the
# cluster-wide barrier and the mapping of a shared-memory address to another CTA's (the
# reduction across CTAs through distributed shared memory).
CLUSTER_PTX_MARKERS = ("barrier.cluster", "mapa")


def _interpreter_requested():
    """True when the environment asks for Triton's interpreter (TRITON_INTERPRET=1). Only the
    environment is read, so that torch.compile can trace this."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend, device):
    """Map "auto" to a concrete backend: "triton" on CUDA, "torch" on CPU unless
    ``TRITON_INTERPRET=1``; "torch" and "triton" are returned unchanged."""
    if backend != "auto":
        return backend
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return "triton" if kind == "cuda" or _interpreter_requested() else "torch"


def plan_for(kernel, dtype, m, n, device, tensors=((1, 1),), group_heads=False,
             pair_tensors=False, norm_length=None):
    """``launch_plans.launch_plan`` for tensors on ``device`` (its SM count on CUDA), or for
    the CUDA device of an enclosing ``launch_hooks.planning_for_cuda``; ``tensors``: per
    tensor of the launch, (slots, work of a row of a slot); ``group_heads``: a program may
    take several slots; ``pair_tensors``: a grid program may run a program of each tensor;
    ``norm_length``: the values normalized together, when not the row of n.

    On CUDA, a cluster plan (``num_ctas`` > 1) whose grid has more programs than the GPU holds
    clusters of the compiled kernel at once (``_RESIDENT_CLUSTERS``, the occupancy query's
    answer recorded at the kernel's first launch on the device) is made again with that count
    as its limit (``launch_plan``'s ``resident_limit``), so the grid is one wave. Until the
    first launch of the kernel with that cluster shape has compiled it (or when the query
    failed), the table's grid is kept."""
    target = cuda_target(device)
    if target is None:
        return launch_plan(kernel, dtype, m, n, "cpu", tensors=tensors, group_heads=group_heads,
                           pair_tensors=pair_tensors, norm_length=norm_length)
    sm_count, capability = target
    stages = launch_hooks.prefetch_stages()
    plan = launch_plan(kernel, dtype, m, n, "cuda", sm_count, tensors, capability,
                       group_heads=group_heads, fixed_rows=launch_hooks.replayed_rows(kernel),
                       prefetch_stages=stages, pair_tensors=pair_tensors,
                       norm_length=norm_length)
    if plan.num_ctas > 1 and launch_hooks.cuda_plan_target() is None:
        resident = _RESIDENT_CLUSTERS.get(
            (kernel, cuda_index(device), plan.num_ctas, plan.num_warps))
        if resident is not None and plan.programs > resident:
            plan = launch_plan(kernel, dtype, m, n, "cuda", sm_count, tensors, capability,
                               resident_limit=resident, group_heads=group_heads,
                               prefetch_stages=stages, pair_tensors=pair_tensors,
                               norm_length=norm_length)
    return plan


def cuda_target(device):
    """(SMs, compute capability) that launches on ``device`` plan for: those of an enclosing
    ``launch_hooks.planning_for_cuda``, else the CUDA device's; None for CPU plans."""
    target = launch_hooks.cuda_plan_target()
    if target is None and torch.device(device).type == "cuda":
        target = cuda_sm_count_and_capability(device)
    return target


def cuda_index(device):
    """The index of a CUDA ``device`` (index None: the current device)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_sm_count_and_capability(device):
    """(SMs, compute capability as 10 · major + minor) of a CUDA ``device`` (index None: the
    current device)."""
    return _sm_count_and_capability(cuda_index(device))


@functools.cache
def _sm_count_and_capability(index):
    properties = torch.cuda.get_device_properties(index)
    return properties.multi_processor_count, 10 * properties.major + properties.minor


def kernel_for(kernel, device):
    """The callable form of a ``@triton.jit`` kernel for tensors on ``device``: the compiled
    kernel for CUDA tensors; for CPU tensors the kernel run by Triton's interpreter (also when
    TRITON_INTERPRET=1 made it an interpreted function at import). Use as
    ``kernel_for(k, x.device)[grid](...)``. A CUDA launch runs inside a device guard for
    ``device``. Inside ``launch_hooks.recording_launches`` the launch is recorded, not run.
    Every launch gets the options ``launch_plans.launch_options`` of its warps."""
    recorder = launch_hooks.recording_kernel(kernel)
    if recorder is not None:
        return _WithLaunchOptions(recorder)
    if torch.device(device).type == "cuda" and not is_interpreted(kernel):
        return _WithLaunchOptions(_DeviceGuardedKernel(kernel, torch.device(device)))
    return _WithLaunchOptions(InterpretedKernel(kernel))


class _WithLaunchOptions:
    """``runner[grid](*args, **kwargs)`` with ``launch_options(num_warps)`` set over the call's
    own (num_warps: the call's, else Triton's default 4)."""

    def __init__(self, runner):
        self.runner = runner

    def __getitem__(self, grid):
        launch = self.runner[grid]
        return lambda *args, **kwargs: launch(
            *args, **(kwargs | launch_options(kwargs.get("num_warps", 4))))


def check_cluster_ptx(ptx, kernel_name, num_ctas):
    """Raise RuntimeError when a kernel compiled for a cluster of ``num_ctas`` > 1 CTAs lacks
    one of CLUSTER_PTX_MARKERS in its PTX ``ptx``: then the Triton in use did not split the
    row across the cluster's CTAs as launch_plans assumes."""
    missing = [marker for marker in CLUSTER_PTX_MARKERS if marker not in ptx]
    if num_ctas > 1 and missing:
        raise RuntimeError(
            f"{kernel_name} compiled for a cluster of {num_ctas} CTAs has no {', '.join(missing)} "
            f"in its PTX: this Triton ({triton.__version__}) does not reduce across the "
            f"cluster as normtools.core.launch_plans assumes; use Triton "
            f"{'.'.join(map(str, launch_plans.CLUSTER_MIN_TRITON))} or plan without clusters")


class _DeviceGuardedKernel:
    """A compiled kernel launched inside ``torch.cuda.device(device)``, as Liger-Kernel does:
    Triton launches on the current CUDA device, so without the guard tensors on another GPU
    would be read by a launch on the wrong one."""

    def __init__(self, kernel, device):
        self.kernel, self.device = kernel, device

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with torch.cuda.device(self.device):
                compiled = self.kernel[grid](*args, **kwargs)
                num_ctas = kwargs.get("num_ctas", 1)
                if num_ctas > 1 and id(compiled) not in _CHECKED_CLUSTER_KERNELS:
                    check_cluster_ptx(compiled.asm["ptx"], self.kernel.fn.__name__, num_ctas)
                    record_resident_clusters(self.kernel.fn.__name__, cuda_index(self.device),
                                             compiled)
                    _CHECKED_CLUSTER_KERNELS.add(id(compiled))
            return compiled
        return launch


# ids of the compiled cluster kernels whose PTX check_cluster_ptx has passed and whose
# occupancy was asked (Triton keeps every compiled kernel in its cache for the life of the
# process, so an id is never reused)
_CHECKED_CLUSTER_KERNELS = set()
# Clusters resident at once, by (kernel name, device index, CTAs per cluster, warps per CTA):
# the fewest over the kernel's compiled specializations asked so far (plan_for cannot tell
# them apart before a compile; the grid does not change the compiled code). The kernel names
# are launch_plans.KERNELS, the names of the @triton.jit functions.
_RESIDENT_CLUSTERS = {}
# The keys (as _RESIDENT_CLUSTERS') of the occupancy queries that failed in this process; the
# warning is given for the first only.
_OCCUPANCY_FAILED = []


def record_resident_clusters(kernel_name, device_index, compiled):
    """Ask the occupancy query (``occupancy.resident_clusters``) how many clusters of the
    compiled kernel ``compiled`` the current GPU holds at once, and keep the fewest for its
    kernel, device and cluster shape in ``_RESIDENT_CLUSTERS`` (read by ``plan_for``). When the
    query cannot answer (no libcuda, a driver error, no cluster fits), warn once per process
    and record nothing: the launches keep the launch table's grid."""
    key = (kernel_name, device_index, compiled.metadata.num_ctas, compiled.metadata.num_warps)
    try:
        resident = occupancy.resident_clusters(compiled)
        if resident < 1:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters answered {resident} clusters")
    except Exception as error:   # any failure of the query keeps the grid, never the launch
        if not _OCCUPANCY_FAILED:
            warnings.warn(f"normtools: the occupancy query for {kernel_name} on a cluster of "
                          f"{key[2]} CTAs failed ({type(error).__name__}: {error}); cluster "
                          f"kernels keep the launch table's grid, which may run a second wave",
                          RuntimeWarning, stacklevel=2)
        _OCCUPANCY_FAILED.append(key)
        return
    _RESIDENT_CLUSTERS[key] = min(resident, _RESIDENT_CLUSTERS.get(key, resident))


def as_rows(t):
    """View ``t`` as (M, N) rows, N = t.shape[-1], with unit stride along N.

    The row stride is whatever it is (it may differ from N, or be 0 for an expanded gradient);
    a copy is made only when the last dimension is strided or the leading dimensions cannot be
    merged into one stride.
    """
    n = t.shape[-1]
    if t.stride(-1) != 1 and n > 1:
        t = t.contiguous()
    return t.reshape(-1, n)


def sum_partials(*gradients):
    """The weight gradients from the backward's per-program float32 partial rows, one launch
    of ``kernels/partials.py`` for up to two: each of ``gradients`` is (partial, dtype),
    ``partial`` of shape (n_partials, *shape) with each partial row partial[i] contiguous;
    its gradient is Σ_i partial[i] in float32, written as ``dtype`` (shape ``shape``).
    Returns the gradients, in order."""
    if not 1 <= len(gradients) <= 2:
        raise ValueError(f"sum_partials sums one or two gradients per launch, got {len(gradients)}")
    outs = [torch.empty(partial.shape[1:], dtype=dtype, device=partial.device)
            for partial, dtype in gradients]
    summed = [(partial.reshape(partial.shape[0], -1), out.view(-1))
              for (partial, _), out in zip(gradients, outs) if partial.shape[0] > 0]
    for (partial, _), out in zip(gradients, outs):
        if partial.shape[0] == 0:
            out.zero_()
    if not summed:
        return outs
    device = summed[0][0].device
    target = cuda_target(device)
    plan = launch_plans.partials_plan(
        [out.numel() for _, out in summed], max(p.shape[0] for p, _ in summed),
        "cpu" if target is None else "cuda", None if target is None else target[0])
    (partial_a, out_a), (partial_b, out_b) = summed[0], summed[-1]
    kernel_for(_partials.sum_partials, device)[(sum(plan.programs),)](
        partial_a, out_a, n_partials_a=partial_a.shape[0], size_a=out_a.numel(),
        stride_a=partial_a.stride(0), programs_a=plan.programs[0],
        PARTIAL_B=partial_b, OUT_B=out_b, n_partials_b=partial_b.shape[0],
        size_b=out_b.numel(), stride_b=partial_b.stride(0),
        BLOCK_P=plan.block_p, BLOCK_N=plan.block_n, num_warps=plan.num_warps)
    return outs

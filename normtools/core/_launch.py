"""Launcher glue shared by the Python launchers of the Triton kernels (RMSNorm, LayerNorm, QK-Norm).

* ``resolve_backend``: "auto" → "triton" on CUDA, "torch" on CPU unless the interpreter is asked
  for (``TRITON_INTERPRET=1``).
* ``kernel_for``: the callable kernel for a device: the compiled ``@triton.jit`` kernel for CUDA
  tensors, the same kernel run by Triton's interpreter for CPU tensors, also in a fresh process
  in which ``TRITON_INTERPRET`` was never set (helper ``@triton.jit`` functions included).
* ``as_rows``: a (M, N) view of a tensor with unit stride along N (a copy only if needed).
* ``launch_plan`` / ``plan_for``: block sizes, warps, grid and rows per program of a launch, from
  the table ``CUDA_ROW_CONFIGS`` on CUDA (also for CPU tensors inside ``planning_for_cuda``).
"""

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
import threading
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from normtools._kernels import partials as _partials

# CPU launch knobs (the interpreter pays ~1 ms per program instance, so CPU tiles are large;
# tests shrink these to force chunking and many programs on CPU). CUDA plans come from
# CUDA_ROW_CONFIGS below.
MAX_CHUNK_BYTES = 32768         # a CPU row chunk: 8192 fp32 or 16384 bf16 values
TILE_ELEMENTS = {"cpu": 65536}  # values in one CPU program's tile of short rows
CPU_PROGRAMS = 4                # persistent backward grid on CPU
# Persistent grids on CUDA: programs per SM. One: every backward program adds a float32
# partial row (written, then read by kernels/partials.py) and every forward program reads the
# weight, so at M = 4096 rows two per SM cost RMSNorm forward+backward 8 % above the minimum
# bytes and LayerNorm 15 %, one per SM 4 % and 7.5 % (normtools.measure.kernel_traffic); the
# short-row tiles below are 16 warps, so that one program still keeps 16 warps on its SM.
PROGRAMS_PER_SM = 1
# The GPU that plans are made for when no GPU is present (H200, the benchmark target): its
# SMs and compute capability (sm_90).
DEFAULT_SM_COUNT = 132
DEFAULT_CAPABILITY = 90

def interpreter_requested():
    """True when the environment asks for Triton's interpreter (TRITON_INTERPRET=1). Only the
    environment is read, so that torch.compile can trace this."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend, device):
    """Map "auto" to a concrete backend: "triton" on CUDA, "torch" on CPU unless
    ``TRITON_INTERPRET=1``; "torch" and "triton" are returned unchanged."""
    if backend != "auto":
        return backend
    if torch.device(device).type == "cuda" or interpreter_requested():
        return "triton"
    return "torch"


def _fp32_to_bf16_bits(data):
    """float32 numpy array → bfloat16 bit patterns (uint16), rounded to nearest even."""
    flat = torch.from_numpy(np.array(data, dtype=np.float32).reshape(-1))
    return flat.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)


def _convert_float_rne(data, input_dtype, output_dtype, rounding_mode):
    """Triton 3.9's interpreter truncates float32 → bfloat16 (the GPU rounds to nearest even);
    this replacement of its ``_convert_float`` rounds that conversion as the GPU does."""
    if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
        return _fp32_to_bf16_bits(data)
    return _TRITON_CONVERT_FLOAT(data, input_dtype, output_dtype, rounding_mode)


_TRITON_CONVERT_FLOAT = triton_interpreter._convert_float


class _InterpretedKernel:
    """A ``@triton.jit`` kernel run by Triton's interpreter: ``kernel[grid](*args, **kwargs)``.

    Triton decides at decoration time whether a ``@triton.jit`` function is compiled or
    interpreted (TRITON_INTERPRET=1 must be set before ``import triton``), and the interpreter
    cannot call compiled ``@triton.jit`` functions: the kernel's helpers and the ``tl.*``
    functions written in Triton (tl.sum, tl.zeros, ...). For the duration of a launch this
    swaps each of them, in the namespaces of the kernel's module and of triton.language, for an
    interpreted twin, switches the interpreter knob on and makes float32 → bfloat16 casts
    round to nearest even; everything is restored afterwards. Launches are serialized by a lock.
    """

    _lock = threading.Lock()
    _twins = {}

    def __init__(self, kernel):
        self.kernel = kernel
        self.namespaces = (sys.modules[kernel.fn.__module__].__dict__, tl.__dict__,
                           tl.standard.__dict__)

    @classmethod
    def _twin(cls, fn):
        if isinstance(fn, InterpretedFunction):
            return fn
        # keyed by id: hashing a JITFunction walks its globals
        if id(fn) not in cls._twins:
            cls._twins[id(fn)] = InterpretedFunction(fn.fn)
        return cls._twins[id(fn)]

    @contextlib.contextmanager
    def _interpreter_mode(self):
        swapped = [(ns, name, value) for ns in self.namespaces
                   for name, value in ns.items() if isinstance(value, JITFunction)]
        twins = [self._twin(value) for _, _, value in swapped]
        previous_knob = triton.knobs.runtime.interpret
        try:
            triton.knobs.runtime.interpret = True
            triton_interpreter._convert_float = _convert_float_rne
            for (ns, name, _), twin in zip(swapped, twins):
                ns[name] = twin
            yield
        finally:
            for ns, name, value in swapped:
                ns[name] = value
            triton_interpreter._convert_float = _TRITON_CONVERT_FLOAT
            triton.knobs.runtime.interpret = previous_knob

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with self._lock, self._interpreter_mode():
                observer = INTERPRETED_LAUNCH_OBSERVER.get()
                if observer is not None:
                    observer(self.kernel.fn.__name__, tuple(grid))
                return self._twin(self.kernel)[grid](*args, **kwargs)
        return launch


# Called with (kernel name, grid) before each interpreted launch (the bytes counter's hook).
INTERPRETED_LAUNCH_OBSERVER = contextvars.ContextVar("normtools_launch_observer", default=None)


_LAUNCH_RECORDER = contextvars.ContextVar("normtools_launch_recorder", default=None)


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


class _RecordingKernel:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(RecordedLaunch(self.kernel, tuple(grid), args, kwargs))
        return launch


def kernel_for(kernel, device):
    """The callable form of a ``@triton.jit`` kernel for tensors on ``device``: the compiled
    kernel for CUDA tensors; for CPU tensors the kernel run by Triton's interpreter (also when
    TRITON_INTERPRET=1 made it an interpreted function at import). Use as
    ``kernel_for(k, x.device)[grid](...)``. A CUDA launch runs inside a device guard for
    ``device``. Inside ``recording_launches`` the launch is recorded, not run."""
    launches = _LAUNCH_RECORDER.get()
    if launches is not None:
        return _RecordingKernel(kernel, launches)
    if torch.device(device).type == "cuda" and not isinstance(kernel, InterpretedFunction):
        return _DeviceGuardedKernel(kernel, torch.device(device))
    return _InterpretedKernel(kernel)


class _DeviceGuardedKernel:
    """A compiled kernel launched inside ``torch.cuda.device(device)``, as Liger-Kernel does:
    Triton launches on the current CUDA device, so without the guard tensors on another GPU
    would be read by a launch on the wrong one."""

    def __init__(self, kernel, device):
        self.kernel, self.device = kernel, device

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with torch.cuda.device(self.device):
                return self.kernel[grid](*args, **kwargs)
        return launch


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


# ---------------------------------------------------------------------------------------------
# Launch plans: what every launch of a row-wise kernel uses (block sizes, warps, grid)
# ---------------------------------------------------------------------------------------------

KERNELS = ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
           "qk_norm_fwd", "qk_norm_bwd", "qk_norm_rope_fwd", "qk_norm_rope_bwd")


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """How a row of up to ``n_max`` elements is launched on CUDA: ``block_n`` columns per tile
    (None: the whole row, next_power_of_2(N), read once), ``num_warps``, ``tile`` values per
    program (short rows are packed tile // BLOCK_N to a program), and ``num_ctas``, the CTAs of
    a thread-block cluster that one program spans, on GPUs of compute capability
    ``min_capability`` or newer (clusters need sm_90).

    A cluster keeps a row too long for one SM's registers on chip: Triton lays the
    (1, BLOCK_N) block across the cluster's CTAs, one SM each, and reduces across them through
    distributed shared memory (``barrier.cluster``, ``mapa``), so the kernel's source does not
    change and its row is still read once."""

    n_max: int
    block_n: Optional[int]
    num_warps: int
    tile: int
    reason: str
    num_ctas: int = 1
    min_capability: int = 0


# CUDA_ROW_CONFIGS[(direction, element bytes)]: one row per range of N, first match wins
# (direction "fwd" / "bwd"; "rope_fwd" / "rope_bwd" for the fused QK-Norm + RoPE kernels).
# Checked ahead of time by normtools.measure.spills (0 B of spill at sm_90 for every row, and
# every row compiles for sm_75 and sm_80) and normtools.measure.kernel_traffic (bytes touched).
_ = None  # "the whole row"


def _cluster_rows(values_per_cta, num_warps, sizes, what):
    """Whole rows of values_per_cta · num_ctas elements on clusters of ``sizes`` CTAs (sm_90+)."""
    return tuple(RowConfig(values_per_cta * ctas, _, num_warps, values_per_cta * ctas,
                           f"{what} on a cluster of {ctas} CTAs (sm_90+), read once", ctas, 90)
                 for ctas in sizes)


# Forward: 16 warps x 32 values per thread = 16384 values per CTA; backward (x and dy):
# 8192. Clusters of 2-8 CTAs are portable; 16 is not, and Triton's launcher allows it.
_FWD_CLUSTERS = _cluster_rows(16384, 16, (2, 4, 8),
                              "one row, 32 values per thread in each CTA's 16 warps")
_BWD_CLUSTERS = _cluster_rows(8192, 16, (2, 4, 8, 16),
                              "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps")
CUDA_ROW_CONFIGS = {
    ("fwd", 2): (
        RowConfig(8192, _, 16, 16384, "rows up to 8192 packed in 16384-value tiles, 16 warps "
                  "(one program per SM), 32 values per thread"),
        RowConfig(16384, _, 16, 16384, "one row per block, 32 values per thread (<= 128 regs)"),
        *_FWD_CLUSTERS,
        RowConfig(1 << 62, 8192, 16, 8192, "before sm_90, or past a cluster of 8: a whole row "
                  "spills (32768 in 32 warps: 40-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("fwd", 4): (
        RowConfig(8192, _, 16, 16384, "rows up to 8192 packed in 16384-value tiles, 16 warps "
                  "(one program per SM), 32 values per thread"),
        RowConfig(16384, _, 16, 16384, "one row per block, 32 values per thread (<= 128 regs)"),
        *_FWD_CLUSTERS,
        RowConfig(1 << 62, 8192, 16, 8192, "before sm_90, or past a cluster of 8: a whole row "
                  "spills (32768 in 32 warps: 72-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("bwd", 2): (
        RowConfig(8192, _, 16, 8192, "rows up to 8192 packed in 8192-value tiles, 16 warps (one "
                  "program per SM): x and dy 2 x 16 values per thread"),
        *_BWD_CLUSTERS,
        RowConfig(1 << 62, 4096, 16, 4096, "before sm_90, or past a cluster of 16: a whole row "
                  "spills (16384 at sm_90: 164 B RMSNorm, 292 B LayerNorm in 16 warps, 104 / "
                  "216 B in 32), chunks of 4096"),
    ),
    ("bwd", 4): (
        RowConfig(8192, _, 16, 8192, "rows up to 8192 packed in 8192-value tiles, 16 warps (one "
                  "program per SM): x and dy 2 x 16 values per thread"),
        *_BWD_CLUSTERS,
        RowConfig(1 << 62, 2048, 8, 2048, "before sm_90, or past a cluster of 16: x, dy and dw "
                  "of a whole row spill; QK-Norm's chunked kernel spills 4 B with chunks of "
                  "4096: chunks of 2048"),
    ),
}
# The fused QK-Norm + RoPE kernels (kernels/qk_norm_rope.py) tile the heads of a token: their
# row is q's Hq · 2 · next_power_of_2(head_dim / 2) values, cut into whole heads. Forward: the
# rows of the norms, but short rows in 8192-value tiles; backward: tiles of 2048 for rows past
# 8192 (16 warps for 2-byte values, 8 for float32). No clusters: these tiles are cut by head.
_ROPE_SHORT = RowConfig(8192, None, 16, 8192, "rows up to 8192 in 8192-value tiles, 16 warps "
                        "(16384-value tiles spill 40 B at sm_90 in float32, 32 heads of 32)")


def _without_clusters(rows):
    return tuple(row for row in rows if row.num_ctas == 1)


for _size in (2, 4):
    CUDA_ROW_CONFIGS["rope_fwd", _size] = (
        (_ROPE_SHORT,) + _without_clusters(CUDA_ROW_CONFIGS["fwd", _size][1:]))
CUDA_ROW_CONFIGS["rope_bwd", 2] = _without_clusters(CUDA_ROW_CONFIGS["bwd", 2][:-1]) + (
    RowConfig(1 << 62, 2048, 16, 2048, "per_layer rows past a tile, read twice; at sm_90 "
              "tiles of 4096 in 16 warps spill 8 B (N = 65536: 2 heads of 2048), of 2048 in 8 "
              "warps 4 B in float16 (N = 16384): tiles of 2048 in 16 warps"),)
CUDA_ROW_CONFIGS["rope_bwd", 4] = _without_clusters(CUDA_ROW_CONFIGS["bwd", 4][:-1]) + (
    dataclasses.replace(CUDA_ROW_CONFIGS["bwd", 4][-1],
                        reason="per_layer rows past a tile, read twice: tiles of 2048 in 8 warps, "
                               "the float32 chunks of the norms' backward"),)
del _, _size


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One launch of a row-wise kernel over an (M, N) matrix: BLOCK_M rows x BLOCK_N columns
    per tile, ``num_warps`` per CTA, a persistent grid of ``programs`` of ``num_ctas`` CTAs
    each (a cluster when > 1), each looping over ``rows_per_program`` rows, and the reason
    the configuration was picked."""

    block_m: int
    block_n: int
    num_warps: int
    programs: int
    rows_per_program: int
    single_pass: bool
    reason: str
    num_ctas: int = 1


def cuda_row_config(kernel, element_size, n, capability=DEFAULT_CAPABILITY):
    """The CUDA_ROW_CONFIGS row for ``kernel`` ("..._fwd" / "..._bwd"), a row of n elements
    and a GPU of compute capability ``capability`` (e.g. 90 for sm_90)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    direction = ("rope_" if kernel.startswith("qk_norm_rope") else "") + kernel.rsplit("_", 1)[1]
    table = CUDA_ROW_CONFIGS[direction, 4 if element_size >= 4 else 2]
    return next(config for config in table
                if n <= config.n_max and capability >= config.min_capability)


def launch_plan(kernel, dtype, m, n, device_type="cuda", sm_count=DEFAULT_SM_COUNT, slots=1,
                capability=DEFAULT_CAPABILITY):
    """The plan for ``kernel`` over an (m, n) matrix of ``dtype`` on ``device_type``: pure (it
    reads no device), so that the real launch and the ahead-of-time tools (bytes counter,
    spill report) use the same block sizes and grid.

    Grids are persistent: ``slots`` independent row sets (QK-Norm: one per head slot of q and
    k) get ``groups`` programs each, about PROGRAMS_PER_SM x ``sm_count`` CTAs in all (a
    program of a cluster plan is ``num_ctas`` CTAs), and a program loops over
    ``rows_per_program`` rows of its slot (a multiple of BLOCK_M), so the weight is read once
    per program, not once per row.

    CUDA: the CUDA_ROW_CONFIGS row for (direction, element size, n, ``capability``). CPU
    (Triton's interpreter): BLOCK_N = next_power_of_2(n) up to MAX_CHUNK_BYTES / element size,
    TILE_ELEMENTS["cpu"] values per tile, CPU_PROGRAMS programs in a persistent grid.
    """
    element_size = torch.empty(0, dtype=dtype).element_size()
    whole_row = triton.next_power_of_2(max(n, 1))
    if device_type == "cuda":
        config = cuda_row_config(kernel, element_size, n, capability)
        block_n = whole_row if config.block_n is None else min(config.block_n, whole_row)
        tile, num_warps, reason = config.tile, config.num_warps, config.reason
        num_ctas = config.num_ctas
        limit = max(1, PROGRAMS_PER_SM * sm_count // num_ctas)
    else:
        block_n = min(whole_row, MAX_CHUNK_BYTES // element_size)
        tile, num_warps, limit, num_ctas = TILE_ELEMENTS["cpu"], 4, CPU_PROGRAMS, 1
        reason = "CPU interpreter: large tiles (about 1 ms per program)"
    block_m = max(1, min(tile // block_n, triton.next_power_of_2(max(m, 1))))
    blocks = triton.cdiv(m, block_m)
    groups = max(1, min(blocks, triton.cdiv(limit, slots)))
    programs, rows_per_program = slots * groups, triton.cdiv(blocks, groups) * block_m
    return LaunchPlan(block_m, block_n, num_warps, programs, rows_per_program, n <= block_n,
                      reason, num_ctas)


_PLAN_TARGET = contextvars.ContextVar("normtools_plan_target", default=None)


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


def cuda_sm_count_and_capability(device):
    """(SMs, compute capability as 10 · major + minor) of a CUDA ``device`` (index None: the
    current device)."""
    device = torch.device(device)
    return _sm_count_and_capability(device.index if device.index is not None
                                    else torch.cuda.current_device())


@functools.cache
def _sm_count_and_capability(index):
    properties = torch.cuda.get_device_properties(index)
    return properties.multi_processor_count, 10 * properties.major + properties.minor


def plan_for(kernel, dtype, m, n, device, slots=1):
    """``launch_plan`` for tensors on ``device`` (its SM count on CUDA), or for the CUDA device
    of an enclosing ``planning_for_cuda``."""
    target = _PLAN_TARGET.get()
    if target is not None:
        sm_count, capability = target
        return launch_plan(kernel, dtype, m, n, "cuda", sm_count, slots, capability)
    if torch.device(device).type == "cuda":
        sm_count, capability = cuda_sm_count_and_capability(device)
        return launch_plan(kernel, dtype, m, n, "cuda", sm_count, slots, capability)
    return launch_plan(kernel, dtype, m, n, "cpu", slots=slots)


def sum_partials(partial, dtype):
    """OUT[o] = Σ_i partial[i, o] in float32, written as ``dtype``: the weight gradient from
    the backward's per-program partial rows ``partial`` (n_partials, n_out, N; the last two
    dimensions contiguous), one launch of ``kernels/partials.py``. Returns (n_out, N)."""
    n_partials, n_out, n = partial.shape
    out = torch.empty((n_out, n), dtype=dtype, device=partial.device)
    # (32, 128) tiles: 32 float32 values per thread in 4 warps, N / 128 programs per row
    block_n = min(triton.next_power_of_2(max(n, 1)), 128)
    block_p = min(triton.next_power_of_2(max(n_partials, 1)), 32)
    if n_partials == 0:
        return out.zero_()
    kernel_for(_partials.sum_partials, partial.device)[(triton.cdiv(n, block_n), n_out)](
        partial, out, n_partials, n_out, n, partial.stride(0), BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=4)
    return out

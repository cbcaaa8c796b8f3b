"""Launcher glue shared by the Python launchers of the Triton kernels (RMSNorm, LayerNorm, QK-Norm).

* ``resolve_backend``: "auto" → "triton" on CUDA, "torch" on CPU unless the interpreter is asked
  for (``TRITON_INTERPRET=1``).
* ``kernel_for``: the callable kernel for a device: the compiled ``@triton.jit`` kernel for CUDA
  tensors, the same kernel run by Triton's interpreter for CPU tensors, also in a fresh process
  in which ``TRITON_INTERPRET`` was never set (helper ``@triton.jit`` functions included).
* ``as_rows``: a (M, N) view of a tensor with unit stride along N (a copy only if needed).
* ``row_blocking`` / ``num_programs``: block sizes, rows per program, warps and the size of a
  persistent grid.
"""

import contextlib
import functools
import os
import sys
import threading

import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# Elements of one row chunk held in registers: rows longer than this are processed in a loop
# over chunks of this many elements (the cap is in bytes, so 8192 fp32 or 16384 bf16 values).
MAX_CHUNK_BYTES = 32768
# Target elements in one program's tile when several short rows share a program. The
# interpreter pays ~1 ms per program instance, so CPU tiles are larger.
TILE_ELEMENTS = {"cuda": 4096, "cpu": 65536}
# Persistent grid of the backward pass: programs per SM on CUDA (two resident programs per SM
# hide some load latency; each adds one float32 partial row to reduce), a few on CPU.
PROGRAMS_PER_SM = 2
CPU_PROGRAMS = 4


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
                return self._twin(self.kernel)[grid](*args, **kwargs)
        return launch


def kernel_for(kernel, device):
    """The callable form of a ``@triton.jit`` kernel for tensors on ``device``: the compiled
    kernel for CUDA tensors; for CPU tensors the kernel run by Triton's interpreter (also when
    TRITON_INTERPRET=1 made it an interpreted function at import). Use as
    ``kernel_for(k, x.device)[grid](...)``."""
    if torch.device(device).type == "cuda" and not isinstance(kernel, InterpretedFunction):
        return kernel
    return _InterpretedKernel(kernel)


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


def row_blocking(m, n, element_size, device):
    """Choose (BLOCK_M, BLOCK_N, num_warps) for a row-wise kernel over an (m, n) matrix.

    BLOCK_N is next_power_of_2(n) up to MAX_CHUNK_BYTES / element_size: a row that fits is read
    once; a longer one is processed in a loop over chunks. Short rows are packed BLOCK_M per
    program so that a program's tile has about TILE_ELEMENTS values.
    """
    max_block_n = MAX_CHUNK_BYTES // element_size
    block_n = min(triton.next_power_of_2(max(n, 1)), max_block_n)
    tile = TILE_ELEMENTS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    block_m = max(1, min(tile // block_n, triton.next_power_of_2(max(m, 1))))
    num_warps = min(max(block_m * block_n // 512, 1), 16)
    return block_m, block_n, num_warps


@functools.cache
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device, num_blocks):
    """Size of a persistent grid: PROGRAMS_PER_SM per SM on CUDA, CPU_PROGRAMS on CPU, never
    more than the number of row blocks (and at least 1)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = PROGRAMS_PER_SM * _sm_count(index)
    else:
        limit = CPU_PROGRAMS
    return max(1, min(limit, num_blocks))

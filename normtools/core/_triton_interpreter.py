"""Every use of Triton's private API in normtools: running a ``@triton.jit`` kernel on CPU
tensors with Triton's interpreter, its bfloat16 conversion fixes and its faster reductions.

Written against Triton 3.9.0. It relies on internals that may change between releases:
``triton.runtime.interpreter.InterpretedFunction`` (an interpreted twin of a kernel),
``triton.runtime.interpreter._convert_float`` (the interpreter's float conversion, replaced
for the duration of a launch), ``triton.runtime.interpreter.ReduceOps.generic_reduce`` (its
reduction with a combine function of the kernel's, replaced likewise),
``triton.runtime.jit.JITFunction`` (to find the compiled helpers to swap) and the knob
``triton.knobs.runtime.interpret``. Used by ``normtools.core.launcher`` (``kernel_for``)
only.
"""

import contextlib
import sys
import threading

import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from normtools.core.launch_hooks import INTERPRETED_LAUNCH_OBSERVER


def is_interpreted(kernel):
    """True for a kernel that TRITON_INTERPRET=1 made an interpreted function at import."""
    return isinstance(kernel, InterpretedFunction)


def _fp32_to_bf16_bits(data):
    """float32 numpy array → bfloat16 bit patterns (uint16), rounded to nearest even."""
    flat = torch.from_numpy(np.array(data, dtype=np.float32).reshape(-1))
    return flat.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)


def _bf16_bits_to_fp32_bits(data):
    """bfloat16 bit patterns → the float32 bit patterns of the same values (uint32): exact, the
    bfloat16 bits are the upper half of the float32's, subnormals included."""
    bits = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).reshape(np.shape(data))


def _convert_float_exact(data, input_dtype, output_dtype, rounding_mode):
    """Triton 3.9's interpreter truncates float32 → bfloat16 (the GPU rounds to nearest even)
    and mis-converts bfloat16 subnormals (|x| < 2^-126) on bfloat16 → float32 (up to 4.4x
    off); this replacement of its ``_convert_float`` does both conversions as the GPU does."""
    if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
        return _fp32_to_bf16_bits(data)
    if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
        return _bf16_bits_to_fp32_bits(data)
    return _TRITON_CONVERT_FLOAT(data, input_dtype, output_dtype, rounding_mode)


_TRITON_CONVERT_FLOAT = triton_interpreter._convert_float


def _pairwise_generic_reduce(self, input):
    """``tl.reduce`` with a combine function of the kernel's (not tl.sum, min or max), applied
    to whole arrays: neighbours are combined pairwise, (0, 1), (2, 3), ..., an odd last one
    carried, until one is left along the axis; left operands always come first, so any
    associative combine gives its reduction. Triton 3.9's interpreter calls the combine once
    per element in a Python loop (seconds for one row of 131072 values); this does log2(n)
    calls on arrays. Replaces ``ReduceOps.generic_reduce`` for the duration of a launch."""
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    while data[0].shape[0] > 1:
        pairs = data[0].shape[0] // 2
        left = [self.to_tensor(d[0:2 * pairs:2], t) for d, t in zip(data, dtypes)]
        right = [self.to_tensor(d[1:2 * pairs:2], t) for d, t in zip(data, dtypes)]
        combined = self.combine_fn.fn(*left, *right)
        combined = combined if isinstance(combined, tuple) else (combined,)
        combined = [np.broadcast_to(c.handle.data if isinstance(c, tl.core.tensor) else c,
                                    d[0:2 * pairs:2].shape).astype(d.dtype)
                    for c, d in zip(combined, data)]
        data = [np.concatenate([c, d[2 * pairs:]]) for c, d in zip(combined, data)]
    reduced = [d[0] for d in data]
    if self.keep_dims:
        reduced = [np.expand_dims(r, axis) if self.axis is not None
                   else r.reshape((1,) * input[0].handle.data.ndim) for r in reduced]
    elif self.axis is None:
        reduced = [r.item() for r in reduced]
    return [self.to_tensor(r, t) for r, t in zip(reduced, dtypes)]


_TRITON_GENERIC_REDUCE = triton_interpreter.ReduceOps.generic_reduce


class InterpretedKernel:
    """A ``@triton.jit`` kernel run by Triton's interpreter: ``kernel[grid](*args, **kwargs)``.

    Triton decides at decoration time whether a ``@triton.jit`` function is compiled or
    interpreted (TRITON_INTERPRET=1 must be set before ``import triton``), and the interpreter
    cannot call compiled ``@triton.jit`` functions: the kernel's helpers and the ``tl.*``
    functions written in Triton (tl.sum, tl.zeros, ...). For the duration of a launch this
    swaps each of them, in the namespaces of the kernel's module (helpers imported from
    kernels/tiles.py included, since they are bound there) and of triton.language, for an
    interpreted twin, switches the interpreter knob on, makes float32 → bfloat16 casts
    round to nearest even and bfloat16 → float32 casts exact, and reductions with a combine
    function of the kernel's run on whole arrays (``_pairwise_generic_reduce``); everything is
    restored afterwards. Launches are serialized by a lock. Before each launch the observer
    of ``launch_hooks.INTERPRETED_LAUNCH_OBSERVER``, if any, is called with (kernel name,
    grid).
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
            triton_interpreter._convert_float = _convert_float_exact
            triton_interpreter.ReduceOps.generic_reduce = _pairwise_generic_reduce
            for (ns, name, _), twin in zip(swapped, twins):
                ns[name] = twin
            yield
        finally:
            for ns, name, value in swapped:
                ns[name] = value
            triton_interpreter._convert_float = _TRITON_CONVERT_FLOAT
            triton_interpreter.ReduceOps.generic_reduce = _TRITON_GENERIC_REDUCE
            triton.knobs.runtime.interpret = previous_knob

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with self._lock, self._interpreter_mode():
                observer = INTERPRETED_LAUNCH_OBSERVER.get()
                if observer is not None:
                    observer(self.kernel.fn.__name__, tuple(grid))
                return self._twin(self.kernel)[grid](*args, **kwargs)
        return launch

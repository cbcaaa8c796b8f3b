"""Operations and bytes per row of RMSNorm and LayerNorm (chapter 1's table).

* :func:`count_flops`: the arithmetic a function executes, counted at the ATen level.
* :func:`row_costs`: per row, the arithmetic of the reference RMSNorm and LayerNorm of
  ``normtools.core.reference``, forward and backward, and the bytes a fused kernel must move
  (the minimum of ``normtools.measure.bench.minimum_bytes.bytes_moved``).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normtools.core import reference
from normtools.measure.bench.minimum_bytes import bytes_moved


# ----------------------------------------------------------------------------------------------
# Arithmetic

_aten = torch.ops.aten
#: Elementwise arithmetic: one operation per output element.
_ELEMENTWISE = {_aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.mul.Tensor,
                _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar, _aten.pow.Tensor_Scalar,
                _aten.rsqrt.default, _aten.sqrt.default, _aten.neg.default, _aten.rsub.Scalar,
                # in place (the backward references reuse their temporaries)
                _aten.add_.Tensor, _aten.sub_.Tensor, _aten.mul_.Tensor, _aten.div_.Tensor,
                _aten.div_.Scalar}
#: Fused elementwise: two operations per output element (addcmul: a + v·b·c, a multiply and an add).
_FUSED_PAIRS = {_aten.addcmul.default, _aten.addcmul_.default}
#: Matrix-vector products: a multiply and an add per matrix element.
_MATRIX_VECTOR = {_aten.mv.default}
#: Reductions: one operation per input element.
_REDUCTIONS = {_aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim, _aten.mean.default}
#: Data movement only (views, casts, copies, allocation): no arithmetic.
_FREE = {_aten._to_copy.default, _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
         _aten.expand.default, _aten.clone.default, _aten.copy_.default, _aten.detach.default,
         _aten.alias.default, _aten.empty.memory_format, _aten.t.default, _aten.unsqueeze.default,
         _aten.squeeze.dim, _aten.lift_fresh.default}


class _FlopCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ELEMENTWISE:
            self.flops += out.numel()
        elif func in _FUSED_PAIRS:
            self.flops += 2 * out.numel()
        elif func in _MATRIX_VECTOR:
            self.flops += 2 * args[0].numel()
        elif func in _REDUCTIONS:
            self.flops += args[0].numel()
        elif func not in _FREE and isinstance(out, torch.Tensor):
            raise NotImplementedError(f"count_flops does not know how to count {func}")
        return out


def count_flops(fn, *args, **kwargs):
    """(fn(*args, **kwargs), number of arithmetic operations it executed).

    Counted at the ATen level: an elementwise op costs one operation per output element (two
    for addcmul), a sum or mean one per input element, a matrix-vector product two per matrix
    element, casts, views, copies and ops without a tensor result nothing.
    An ATen op outside these lists raises NotImplementedError rather than being counted wrong.
    Run it on meta tensors to count without computing.
    """
    counter = _FlopCounter()
    with counter:
        out = fn(*args, **kwargs)
    return out, counter.flops


# ----------------------------------------------------------------------------------------------
# Cost per row

#: float32 values per row that a training forward saves and the reference backward reads: the
#: inverse RMS; LayerNorm's mean and inverse standard deviation.
_SAVED_STATISTICS = {"rms_norm": 1, "layer_norm": 2}


def _cost_cases(rows, n, dtype):
    """(op, direction, function, arguments) of the four reference computations, on meta tensors."""
    def t(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device="meta")

    x, dy, w, b = t(rows, n), t(rows, n), t(n), t(n)
    stat = t(rows, 1, dt=torch.float32)
    return [
        ("rms_norm", "forward", reference.rms_norm_reference, (x, w, 1e-6)),
        ("rms_norm", "backward", reference.rms_norm_backward_reference, (dy, x, w, stat)),
        ("layer_norm", "forward", reference.layer_norm_reference, (x, w, b, 1e-5)),
        ("layer_norm", "backward", reference.layer_norm_backward_reference, (dy, x, w, b, stat, stat)),
    ]


def row_costs(n: int, dtype: torch.dtype = torch.bfloat16, rows: int = 4096) -> list[dict]:
    """Operations and bytes per row of RMSNorm and LayerNorm, forward and backward.

    The four functions of ``normtools.core.reference`` run on ``rows`` × ``n`` meta tensors of
    ``dtype`` (weights in ``dtype``, saved statistics float32). ``flops`` counts what the
    reference code executes (:func:`count_flops`); ``bytes`` is what a fused kernel must move,
    from :func:`bytes_moved` at M = ``rows``, N = ``n``:

        forward  = bytes_moved(op)
        backward = bytes_moved(op_fwd_bwd) − bytes_moved(op) + 4 · rows · k

    (forward: x, w[, b] in, y out; the statistics a training forward also saves are not
    counted; backward: dy, x, w in, dx, dw[, db] out, plus the k float32 statistics per row it
    reads, k = 1 for RMSNorm, 2 for LayerNorm). Both are divided by ``rows`` (weights are
    shared by all rows). Returns one dict per (op, direction) with flops_per_row,
    bytes_per_row and flops_per_byte.
    """
    shape = {"M": rows, "N": n}
    results = []
    for op, direction, fn, args in _cost_cases(rows, n, dtype):
        _, flops = count_flops(fn, *args)
        nbytes = bytes_moved(op, shape, dtype)
        if direction == "backward":
            statistics = rows * _SAVED_STATISTICS[op] * torch.float32.itemsize
            nbytes = bytes_moved(op + "_fwd_bwd", shape, dtype) - nbytes + statistics
        results.append({"op": op, "direction": direction, "n": n, "dtype": str(dtype).removeprefix("torch."),
                        "flops_per_row": flops / rows, "bytes_per_row": nbytes / rows,
                        "flops_per_byte": flops / nbytes})
    return results

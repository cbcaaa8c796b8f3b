"""RMSNorm and LayerNorm ops: ``rms_norm``, ``add_rms_norm``, ``layer_norm``.

The backend is a plain string argument:

* "torch": plain PyTorch operations (normtools.core.reference), the forward equal to the HF
  modules bit for bit. RMSNorm runs ``F.rms_norm``'s op (the same bits); with a gradient to
  record it saves the inverse RMS that op computes and runs the analytic float32 backward in an
  autograd function (``_TorchRMSNorm``: why), and LayerNorm does the same (``_TorchLayerNorm``);
  under ``torch.compile`` both run as the custom op's torch branch (``torch_rms_norm``);
* "triton": the kernels in kernels/, compiled on CUDA, interpreted for CPU tensors, behind a
  ``torch.library`` custom op (``normtools::rms_norm_fwd`` / ``_bwd``,
  ``normtools::layer_norm_fwd`` / ``_bwd``) with autograd and a fake implementation, so that
  ``torch.compile(fullgraph=True)`` traces through it;
* "auto": "triton" on CUDA, "torch" on CPU unless TRITON_INTERPRET=1.

A tensor subclass (a DTensor) goes through the custom op on either backend: its sharding rules
(normtools.core.tp_dtensor) place it; there the torch backend runs the reference forward and the
analytic float32 gradient (``*_backward_reference``).

Inputs are checked (normtools.core.validate) before anything runs.
"""

import functools
import os
from typing import Optional

import torch

from normtools.core import validate
from normtools._kernels import layer_norm as _ln
from normtools._kernels import rms_norm as _rms
from normtools.core.launcher import as_rows, kernel_for, plan_for, resolve_backend, sum_partials
from normtools.core.reference import (
    layer_norm_apply,
    layer_norm_backward_reference,
    layer_norm_reference,
    layer_norm_statistics,
    rms_norm_backward_reference,
    rms_norm_native,
    rms_norm_native_with_rstd,
    rms_norm_output_dtype,
)

__all__ = ["rms_norm", "add_rms_norm", "layer_norm"]

Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def runs_torch_math(x, backend):
    """Whether an op on ``x`` runs as plain PyTorch operations: ``backend`` resolves to "torch"
    and x is a plain tensor (not a subclass such as a DTensor, which takes the custom op)."""
    return type(x) in _PLAIN_TENSORS and resolve_backend(backend, x.device) == "torch"


def records_graph(*tensors):
    """Whether a call on ``tensors`` records an autograd graph: gradients are enabled and one of
    the tensors (None allowed) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _stat_shape(x):
    """Shape of a saved per-row statistic: x.shape with the last dimension 1."""
    return (*x.shape[:-1], 1)


def _param_or(param, placeholder):
    """A per-feature parameter (weight, bias) as a contiguous tensor, since the kernels address it
    as ``W + col`` (a copy of N values at most: a sliced or expanded weight is honoured); or
    ``placeholder`` as the unused pointer when there is none."""
    return placeholder if param is None else param.contiguous()


# ---------------------------------------------------------------------------------------------
# RMSNorm (optionally fused with a residual add)
# ---------------------------------------------------------------------------------------------

def _rms_norm_fwd_triton(x, residual, weight, eps, offset, casting):
    x2 = as_rows(x)
    m, n = x2.shape
    out_dtype = rms_norm_output_dtype(x.dtype, None if weight is None else weight.dtype, casting)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(_stat_shape(x), dtype=torch.float32, device=x.device)
    if residual is None:
        res2 = summed = x2  # unused by the kernel (HAS_RESIDUAL=False)
    else:
        res2 = as_rows(residual)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sum2 = summed.view(-1, n)
    plan = plan_for("rms_norm_fwd", x.dtype, m, n, x.device)
    if m > 0:
        kernel_for(_rms.rms_norm_fwd, x.device)[(plan.programs,)](
            x2, res2, y, sum2, _param_or(weight, x2), rstd,
            stride_x=x2.stride(0), stride_res=res2.stride(0), stride_y=n,
            stride_sum=sum2.stride(0), M=m, N=n, eps=eps, offset=offset,
            rows_per_program=plan.rows_per_program,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            ROUND_XHAT=casting == "llama", BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            SINGLE_PASS=plan.single_pass, NUM_STAGES=plan.num_stages, num_warps=plan.num_warps,
            num_ctas=plan.num_ctas,
        )
    return y, (summed if residual is not None else x.new_empty(0)), rstd


def _rms_norm_bwd_triton(dy, x, weight, rstd, dsum, offset):
    dy2, x2 = as_rows(dy), as_rows(x)
    m, n = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dsum2 = x2 if dsum is None else as_rows(dsum)
    plan = plan_for("rms_norm_bwd", x.dtype, m, n, x.device)
    dw_partial = torch.empty((plan.programs, 1, n), dtype=torch.float32, device=x.device)
    row_c = torch.empty(0 if plan.single_pass else m, dtype=torch.float32, device=x.device)
    kernel_for(_rms.rms_norm_bwd, x.device)[(plan.programs,)](
        dy2, x2, _param_or(weight, x2), rstd, dsum2, dx, dw_partial, row_c,
        stride_dy=dy2.stride(0), stride_x=x2.stride(0), stride_dsum=dsum2.stride(0),
        stride_dx=n, M=m, N=n, offset=offset, rows_per_program=plan.rows_per_program,
        HAS_WEIGHT=weight is not None, HAS_DSUM=dsum is not None, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, SINGLE_PASS=plan.single_pass, NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        num_ctas=plan.num_ctas,
    )
    dw = x.new_empty(0) if weight is None else sum_partials((dw_partial[:, 0], weight.dtype))[0]
    return dx, dw


def _rms_norm_torch_forward(x, residual, weight, eps, offset, casting):
    """(y, summed, rstd) on the torch backend: summed = x (+ residual), y = RMSNorm(summed) and
    its float32 inverse RMS from ``rms_norm_native_with_rstd``; the custom op's torch branch and
    ``_TorchRMSNorm`` forward."""
    summed = x if residual is None else x + residual
    y, rstd = rms_norm_native_with_rstd(summed, weight, eps, offset, casting)
    return y, summed, rstd


def _rms_norm_torch_backward(dy, summed, weight, rstd, dsum, offset):
    """(dx, dw) on the torch backend: ``rms_norm_backward_reference``, dx plus the gradient
    ``dsum`` of the residual sum, if any; the custom op's torch branch and ``_TorchRMSNorm``
    backward."""
    dx, dw = rms_norm_backward_reference(dy, summed, weight, rstd, offset)
    return (dx if dsum is None else dx.add_(dsum)), dw


def _second_derivative_refused(name):
    return RuntimeError(f"normtools.{name} is differentiable once: a gradient of its gradient "
                        f"(double backward, create_graph=True) is not computed; differentiate "
                        f"its reference in normtools.core.reference instead")


def differentiable_once(backward_op, name):
    """Give the custom op ``backward_op``, the backward of normtools' ``name``, an autograd
    formula that raises: its gradient would be a second derivative of the norm, which normtools
    does not compute. Without one, a gradient of a gradient (``create_graph=True``) failed with
    PyTorch's note to the op's author, after the kernels had run."""
    def backward(ctx, *grads):
        raise _second_derivative_refused(name)
    backward_op.register_autograd(backward)


class _SecondDerivativeRefused(torch.autograd.Function):
    """The results of a norm's backward, unchanged, with a gradient that raises: ``anchors``
    are the tensors they depend on that require a gradient (the saved input, the incoming
    gradient), so that a second derivative through the norm reaches this node."""

    @staticmethod
    def forward(ctx, name, n_anchors, *tensors):
        ctx.name = name
        return tuple(t.view_as(t) for t in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise _second_derivative_refused(ctx.name)


def once_differentiable_norm(name):
    """Decorate the backward of a torch-backend autograd node of normtools' ``name`` (as
    PyTorch's ``once_differentiable``, with this library's message): it runs without
    recording, and under ``create_graph=True`` its results carry a gradient that raises. The
    analytic backwards take the saved inverse RMS as a constant, so differentiating what they
    record would give a second derivative off by about its own size, silently."""
    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():     # an ordinary backward: nothing to record
                return backward(ctx, *grads)
            with torch.no_grad():
                results = backward(ctx, *grads)
            anchors = [t for t in (*ctx.saved_tensors, *grads)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not anchors:
                return results
            refused = iter(_SecondDerivativeRefused.apply(
                name, len(anchors), *anchors, *[r for r in results if r is not None]))
            return tuple(None if r is None else next(refused) for r in results)
        return wrapper
    return decorate


@torch.library.custom_op("normtools::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
                  offset: float, casting: str, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(y, summed, rstd): summed = x + residual (an empty tensor without a residual),
    y = RMSNorm(summed), rstd the float32 inverse RMS of shape (..., 1)."""
    if backend == "triton":
        return _rms_norm_fwd_triton(x, residual, weight, eps, offset, casting)
    y, summed, rstd = _rms_norm_torch_forward(x, residual, weight, eps, offset, casting)
    return y, (x.new_empty(0) if residual is None else summed), rstd


@_rms_norm_fwd.register_fake
def _(x, residual, weight, eps, offset, casting, backend):
    out_dtype = rms_norm_output_dtype(x.dtype, None if weight is None else weight.dtype, casting)
    summed = x.new_empty(0) if residual is None else torch.empty_like(x)
    return (x.new_empty(x.shape, dtype=out_dtype), summed,
            x.new_empty(_stat_shape(x), dtype=torch.float32))


@torch.library.custom_op("normtools::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                  dsum: Optional[Tensor], offset: float, backend: str) -> tuple[Tensor, Tensor]:
    """(dx, dw): dx includes the gradient ``dsum`` of the fused residual sum, if any; dw is an
    empty tensor without a weight."""
    if backend == "triton":
        return _rms_norm_bwd_triton(dy, x, weight, rstd, dsum, offset)
    dx, dw = _rms_norm_torch_backward(dy, x, weight, rstd, dsum, offset)
    return dx, (x.new_empty(0) if dw is None else dw)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, dsum, offset, backend):
    return torch.empty_like(x), (x.new_empty(0) if weight is None else torch.empty_like(weight))


def _rms_norm_setup_context(ctx, inputs, output):
    x, residual, weight, eps, offset, casting, backend = inputs
    y, summed, rstd = output
    ctx.save_for_backward(x if residual is None else summed, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.offset, ctx.backend = offset, backend


def _rms_norm_backward(ctx, dy, dsum, drstd):
    normed_input, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(normed_input)
    dx, dw = _rms_norm_bwd(dy, normed_input, weight, rstd, dsum if ctx.has_residual else None,
                           ctx.offset, ctx.backend)
    return (dx, dx if ctx.has_residual else None, None if weight is None else dw,
            None, None, None, None)


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)
differentiable_once(_rms_norm_bwd, "rms_norm")


class _TorchRMSNorm(torch.autograd.Function):
    """RMSNorm on the torch backend, eager, when a gradient is recorded, optionally of a residual
    sum (add_rms_norm: summed = x + residual, returned with y): the forward of
    ``reference.rms_norm_native_with_rstd`` (torch's RMSNorm op, the HF module's bits, with the
    inverse RMS r it computes saved) and the analytic float32 backward
    ``rms_norm_backward_reference``,

        dx = r · (g − x̂ · mean(x̂ ⊙ g, -1)),  g = (offset + w) ⊙ dy,   dw = Σ_rows dy ⊙ x̂,

    plus the gradient of summed, which x and the residual both receive.

    Autograd of the module's operations (or of ``F.rms_norm``, the same operations on CPU)
    runs one backward node per operation, each a pass over (M, N) tensors and a dispatch (issue
    35: bfloat16 64 × 256 on one thread, about 150 µs of the module's backward against 56 µs of
    ``rms_norm_backward_reference``). The residual add inside the node spares autograd's add
    node and the sum of summed's two gradients. Under ``torch.compile`` the custom op's torch
    branch runs the same forward and backward (``torch_rms_norm``).
    """

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting):
        y, summed, rstd = _rms_norm_torch_forward(x, residual, weight, eps, offset, casting)
        ctx.save_for_backward(summed, weight, rstd)
        ctx.offset, ctx.has_residual = offset, residual is not None
        return y if residual is None else (y, summed)

    @staticmethod
    @once_differentiable_norm("rms_norm")
    def backward(ctx, dy, dsummed=None):
        summed, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_torch_backward(dy, summed, weight, rstd,
                                          dsummed if ctx.has_residual else None, ctx.offset)
        return dx, (dx if ctx.has_residual else None), dw, None, None, None


class _TorchRMSNormPair(torch.autograd.Function):
    """``_TorchRMSNorm`` of two tensors in one autograd node: QK-Norm's q and k (one Python
    forward and one backward call where two ``_TorchRMSNorm`` nodes make two of each)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, offset, casting):
        q_out, q_rstd = rms_norm_native_with_rstd(q, q_weight, eps, offset, casting)
        k_out, k_rstd = rms_norm_native_with_rstd(k, k_weight, eps, offset, casting)
        ctx.save_for_backward(q, k, q_weight, k_weight, q_rstd, k_rstd)
        ctx.offset = offset
        return q_out, k_out

    @staticmethod
    @once_differentiable_norm("qk_norm")
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, q_rstd, k_rstd = ctx.saved_tensors
        dq, dq_weight = rms_norm_backward_reference(dq_out, q, q_weight, q_rstd, ctx.offset)
        dk, dk_weight = rms_norm_backward_reference(dk_out, k, k_weight, k_rstd, ctx.offset)
        return dq, dk, dq_weight, dk_weight, None, None, None


#: How the torch backend differentiates RMSNorm eagerly: "analytic" (``_TorchRMSNorm``) or
#: "autograd" (autograd of torch's RMSNorm op: the HF module's gradients bit for bit, at the
#: cost of the module's backward). Read from the environment variable
#: NORMTOOLS_RMS_NORM_BACKWARD when this module is imported; a study records the one it trained
#: with (``sysinfo.study_machine``) and its rerun sets it (``lab.reproduce``).
RMS_NORM_BACKWARDS = ("analytic", "autograd")
RMS_NORM_BACKWARD = os.environ.get("NORMTOOLS_RMS_NORM_BACKWARD", "analytic")
validate.check_choice("NORMTOOLS_RMS_NORM_BACKWARD", RMS_NORM_BACKWARD, RMS_NORM_BACKWARDS)


def records_analytic_node(*tensors):
    """Whether the torch backend differentiates an RMSNorm of ``tensors`` (None allowed) in its
    own eager autograd node: a gradient to record, ``RMS_NORM_BACKWARD`` "analytic", and not
    under ``torch.compile`` (which takes the custom op)."""
    return (RMS_NORM_BACKWARD == "analytic" and not torch.compiler.is_compiling()
            and records_graph(*tensors))


def torch_rms_norm(x, weight, eps, offset, casting, residual=None):
    """The torch backend's RMSNorm of a plain tensor x (with ``residual``: of summed = x +
    residual, returning (y, summed)), its weight (N,), per-row-group (H, N) or None:
    ``reference.rms_norm_native`` when no gradient is recorded (``torch.compile`` traces it) or
    ``RMS_NORM_BACKWARD`` is "autograd"; with a gradient to record, eager, ``_TorchRMSNorm``;
    under ``torch.compile``, the custom op's torch branch, the same forward and backward, opaque
    to Inductor so that compiled gradients are eager's bits (Inductor's fused sums of a traced
    backward differ from eager's past float32 round-off: tests/core/test_compile.py)."""
    if RMS_NORM_BACKWARD == "autograd" or not records_graph(x, residual, weight):
        if residual is None:
            return rms_norm_native(x, weight, eps, offset, casting)
        summed = x + residual
        return rms_norm_native(summed, weight, eps, offset, casting), summed
    if torch.compiler.is_compiling():
        y, summed, _ = _rms_norm_fwd(x, residual, weight, eps, offset, casting, "torch")
        return y if residual is None else (y, summed)
    return _TorchRMSNorm.apply(x, residual, weight, eps, offset, casting)


def torch_rms_norm_pair(q, k, q_weight, k_weight, eps, offset, casting):
    """(``torch_rms_norm`` of q, of k), eagerly with a gradient to record in one autograd node
    (``_TorchRMSNormPair``)."""
    if not records_analytic_node(q, k, q_weight, k_weight):
        return (torch_rms_norm(q, q_weight, eps, offset, casting),
                torch_rms_norm(k, k_weight, eps, offset, casting))
    return _TorchRMSNormPair.apply(q, k, q_weight, k_weight, eps, offset, casting)


def _check_rms_norm_args(x, weight, eps, offset, casting, backend):
    validate.check_input(x)
    validate.check_param(weight, x, "weight")
    validate.check_eps(eps)
    validate.check_offset(offset)
    validate.check_casting(casting)
    validate.check_backend(backend)


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, casting="llama", backend="auto"):
    """RMSNorm over the last dimension: y = (offset + w) ⊙ x · rsqrt(mean(x², -1) + eps).

    ``casting`` says where the result is rounded ("llama": x̂ is cast to x.dtype before the
    weight multiply, output dtype promote(w, x); "gemma": multiply in float32, cast to x.dtype);
    see ``normtools.core.reference.rms_norm_reference`` for the exact definition. ``weight`` is
    (N,) or None (no scale).
    """
    _check_rms_norm_args(x, weight, eps, offset, casting, backend)
    if runs_torch_math(x, backend):
        return torch_rms_norm(x, weight, float(eps), float(offset), casting)
    backend = resolve_backend(backend, x.device)
    return _rms_norm_fwd(x, None, weight, float(eps), float(offset), casting, backend)[0]


def add_rms_norm(x, residual, weight=None, eps=1e-6, *, offset=0.0, casting="llama",
                 backend="auto"):
    """Fused residual add and RMSNorm (the pre-norm hot path), in one kernel pass.

    Returns (normed, summed) with summed = x + residual (in x.dtype) and
    normed = rms_norm(summed, weight, eps, offset=offset, casting=casting).
    """
    _check_rms_norm_args(x, weight, eps, offset, casting, backend)
    validate.check_like(residual, x, "residual")
    if runs_torch_math(x, backend):
        return torch_rms_norm(x, weight, float(eps), float(offset), casting, residual)
    backend = resolve_backend(backend, x.device)
    y, summed, _ = _rms_norm_fwd(x, residual, weight, float(eps), float(offset), casting, backend)
    return y, summed


# ---------------------------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------------------------

def _layer_norm_fwd_triton(x, weight, bias, eps):
    x2 = as_rows(x)
    m, n = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(_stat_shape(x), dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    plan = plan_for("layer_norm_fwd", x.dtype, m, n, x.device)
    if m > 0:
        kernel_for(_ln.layer_norm_fwd, x.device)[(plan.programs,)](
            x2, y, _param_or(weight, x2), _param_or(bias, x2), mean, rstd,
            stride_x=x2.stride(0), stride_y=n, M=m, N=n, eps=eps,
            rows_per_program=plan.rows_per_program,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, SINGLE_PASS=plan.single_pass,
            NUM_STAGES=plan.num_stages,
            num_warps=plan.num_warps, num_ctas=plan.num_ctas,
        )
    return y, mean, rstd


def _layer_norm_bwd_triton(dy, x, weight, bias, mean, rstd):
    dy2, x2 = as_rows(dy), as_rows(x)
    m, n = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    plan = plan_for("layer_norm_bwd", x.dtype, m, n, x.device)
    params = [p for p in (weight, bias) if p is not None]   # partial slots: dw first, then db
    partial = torch.empty((plan.programs, max(len(params), 1), n), dtype=torch.float32,
                          device=x.device)
    row_c1_c2 = torch.empty((2, 0 if plan.single_pass else m), dtype=torch.float32,
                            device=x.device)
    kernel_for(_ln.layer_norm_bwd, x.device)[(plan.programs,)](
        dy2, x2, _param_or(weight, x2), mean, rstd, dx, partial, row_c1_c2,
        stride_dy=dy2.stride(0), stride_x=x2.stride(0), stride_dx=n, M=m, N=n,
        rows_per_program=plan.rows_per_program,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, SINGLE_PASS=plan.single_pass, NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        num_ctas=plan.num_ctas,
    )
    grads = list(sum_partials(*((partial[:, slot], p.dtype) for slot, p in enumerate(params)))
                 if params else [])                      # dw and db in one launch
    dw = x.new_empty(0) if weight is None else grads.pop(0)
    db = x.new_empty(0) if bias is None else grads.pop(0)
    return dx, dw, db


@torch.library.custom_op("normtools::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                    backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd), the statistics float32 of shape (..., 1)."""
    if backend == "triton":
        return _layer_norm_fwd_triton(x, weight, bias, eps)
    mean, rstd = layer_norm_statistics(x, eps)
    return layer_norm_apply(x, mean, rstd, weight, bias), mean, rstd


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps, backend):
    stat = x.new_empty(_stat_shape(x), dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op("normtools::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    mean: Tensor, rstd: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db); dw / db are empty tensors when there is no weight / bias."""
    if backend == "triton":
        return _layer_norm_bwd_triton(dy, x, weight, bias, mean, rstd)
    dx, dw, db = layer_norm_backward_reference(dy, x, weight, bias, mean, rstd)
    return dx, (x.new_empty(0) if dw is None else dw), (x.new_empty(0) if db is None else db)


@_layer_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, backend):
    return (torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight),
            x.new_empty(0) if bias is None else torch.empty_like(bias))


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, eps, backend = inputs
    y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.backend = backend


def _layer_norm_backward(ctx, dy, dmean, drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.backend)
    return dx, (None if weight is None else dw), (None if bias is None else db), None, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)
differentiable_once(_layer_norm_bwd, "layer_norm")


class _TorchLayerNorm(torch.autograd.Function):
    """LayerNorm on the torch backend, eager: the reference forward (its statistics computed
    once and saved) and the analytic float32 backward ``layer_norm_backward_reference``, the
    computation of the custom op's torch branch. Under ``torch.compile`` the custom op runs
    instead, opaque to Inductor, so that a compiled graph gives eager's bits: Inductor's fused
    reductions would sum the statistics in another order, and dx = r·(g − mean(g) − x̂·mean(x̂g))
    amplifies that difference past float32 round-off (RMSNorm's F.rms_norm path stays within it).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        mean, rstd = layer_norm_statistics(x, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return layer_norm_apply(x, mean, rstd, weight, bias)

    @staticmethod
    @once_differentiable_norm("layer_norm")
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        return (*layer_norm_backward_reference(dy, x, weight, bias, mean, rstd), None)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, backend="auto"):
    """LayerNorm over the last dimension: y = (x − mean) · rsqrt(var + eps) ⊙ w + b, with float32
    statistics and the result cast to x.dtype (see normtools.core.reference.layer_norm_reference)."""
    validate.check_input(x)
    validate.check_param(weight, x, "weight")
    validate.check_param(bias, x, "bias")
    validate.check_eps(eps)
    validate.check_backend(backend)
    if runs_torch_math(x, backend) and not torch.compiler.is_compiling():
        if records_graph(x, weight, bias):
            return _TorchLayerNorm.apply(x, weight, bias, float(eps))
        return layer_norm_reference(x, weight, bias, float(eps))   # its forward, no graph
    backend = resolve_backend(backend, x.device)
    return _layer_norm_fwd(x, weight, bias, float(eps), backend)[0]

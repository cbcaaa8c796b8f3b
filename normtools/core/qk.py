"""QK-Norm: RMSNorm of the query and key projections before RoPE, one launch for both.

For a row x (what one set of statistics covers),

    r = rsqrt(mean(x.float()², -1) + eps),   y = (offset + w) · cast(x · r)   ("llama" casting)
                                             y = cast(x · r · (offset + w))   ("gemma" casting)

with the rows chosen by ``scope``:

* ``"per_head"``: each head of each token, statistics over ``head_dim``; the weight is
  ``(head_dim,)`` shared by all heads (Qwen3; Gemma 3 with offset=1 and gemma casting) or
  ``(H, head_dim)``, one row per head (Cohere's layout).
* ``"per_layer"``: the whole projection of each token, statistics over ``H · head_dim``; the
  weights are ``(Hq · head_dim,)`` and ``(Hk · head_dim,)`` (OLMo 2, MiniMax-M2).

q is ``(..., Hq · head_dim)`` or ``(..., Hq, head_dim)`` and k likewise with Hk heads (Hk divides
Hq: grouped-query attention); both outputs keep their input's shape. The math of each row is
``normtools.core.reference.rms_norm_reference``. ``backend="torch"`` computes it as plain
PyTorch operations (``ops.torch_rms_norm_pair`` of q and k viewed as rows: torch's RMSNorm op
forward, the analytic backward of both in one autograd node), the transformers modules'
numbers.

``backend="triton"`` runs ``kernels/qk_norm.py``, one launch for q and k in each direction,
behind the custom op ``normtools::qk_norm_fwd`` (backward ``normtools::qk_norm_bwd``), with
fake implementations for ``torch.compile``; a tensor subclass (a DTensor) takes the custom op
on either backend (see ``normtools.core.ops``). Inside the op q and k are (T, H·head_dim)
matrices, T tokens, and a row is one ``row_len``-long piece of a token: ``row_len = head_dim``
(per_head) or ``H·head_dim`` (per_layer).
"""

import torch
import triton
from torch import nn

from normtools.core import validate
from normtools._kernels import qk_norm as _k
from normtools.core.launcher import as_rows, kernel_for, plan_for, resolve_backend, sum_partials
from normtools.core.ops import differentiable_once, runs_torch_math, torch_rms_norm_pair
from normtools.core.reference import (rms_norm_backward_reference, rms_norm_native_with_rstd,
                                      rms_norm_output_dtype)

__all__ = ["qk_norm", "QKNorm", "SCOPES", "check_qk_inputs"]

SCOPES = ("per_head", "per_layer")
Tensor = torch.Tensor


# ----------------------------------------------------------------------------- input checks

def _weight_heads(weight, head_dim, scope, name):
    """Number of heads a weight's shape pins down (None for a shared ``(head_dim,)`` weight)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if scope == "per_layer":
        if weight.dim() != 1 or weight.numel() == 0 or weight.numel() % head_dim:
            raise ValueError(f"per_layer {name} must have shape (H*head_dim,) with head_dim="
                             f"{head_dim}, got {tuple(weight.shape)}")
        return weight.numel() // head_dim
    if weight.shape == (head_dim,):
        return None
    if weight.dim() == 2 and weight.shape[1] == head_dim and weight.shape[0] > 0:
        return weight.shape[0]
    raise ValueError(f"per_head {name} must have shape ({head_dim},) (shared by all heads) or "
                     f"(H, {head_dim}) (one row per head), got {tuple(weight.shape)}")


def _fits(x, head_dim, heads, headed):
    """Whether x reads as (..., H, head_dim) (``headed``) or (..., H*head_dim), H = ``heads``
    when the weight pins it."""
    if headed:
        return x.dim() >= 2 and x.shape[-1] == head_dim and heads in (None, x.shape[-2])
    return x.shape[-1] % head_dim == 0 and heads in (None, x.shape[-1] // head_dim)


def _resolve_layout(q, k, head_dim, q_heads, k_heads, layouts=(True, False)):
    """True for the (..., H, head_dim) layout, False for (..., H*head_dim).

    q and k share one layout and their leading (token) dimensions. The readings are tried in
    the order of ``layouts`` (True: headed); they differ only when the last dimension equals
    head_dim (one head per token in the flat reading), and then QK-Norm's result is the same
    unless a weight pins the number of heads, which picks the reading. (RoPE's is not: its
    tables follow the tokens, so ``rope.qk_norm_rope`` lets them decide.)
    """
    for headed in layouts:
        lead = 2 if headed else 1
        if (_fits(q, head_dim, q_heads, headed) and _fits(k, head_dim, k_heads, headed)
                and q.shape[:-lead] == k.shape[:-lead]):
            return headed
    raise ValueError(
        f"q {tuple(q.shape)} and k {tuple(k.shape)} must both be (..., H*head_dim) or both "
        f"(..., H, head_dim) with head_dim={head_dim}, the same leading dimensions, and as many "
        f"heads as their weights have (q weight: {q_heads or 'any'}, k weight: "
        f"{k_heads or 'any'})")


def check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, scope, offset, casting, backend,
                    layouts=(True, False)):
    """Validate the arguments of ``qk_norm``; return (headed, Hq, Hk).

    ``headed`` is True for the (..., H, head_dim) layout, the first of ``layouts`` that fits
    (``_resolve_layout``). Raises TypeError / ValueError naming the bad argument, before
    anything is launched.
    """
    validate.check_input(q, "q")
    validate.check_input(k, "k")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype}, expected q's dtype {q.dtype}")
    device = q.device
    if k.device != device:
        raise ValueError(f"k is on {k.device} but q is on {device}")
    validate.check_eps(eps)
    validate.check_offset(offset)
    validate.check_casting(casting)
    validate.check_backend(backend)
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; expected one of {', '.join(SCOPES)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    q_heads = _weight_heads(q_weight, head_dim, scope, "q_weight")
    k_heads = _weight_heads(k_weight, head_dim, scope, "k_weight")
    headed = _resolve_layout(q, k, head_dim, q_heads, k_heads, layouts)
    hq, hk = (q.shape[-2], k.shape[-2]) if headed else (q.shape[-1] // head_dim,
                                                        k.shape[-1] // head_dim)
    if hq == 0 or hk == 0 or hq % hk:
        raise ValueError(f"the number of k heads ({hk}) must divide the number of q heads "
                         f"({hq}) and neither may be 0")
    for weight, name in ((q_weight, "q_weight"), (k_weight, "k_weight")):
        if weight.device != device:
            raise ValueError(f"{name} is on {weight.device} but q is on {device}")
        if weight.dtype not in (torch.float32, q.dtype):
            raise TypeError(f"{name} has dtype {weight.dtype}; supported are float32 or q's "
                            f"dtype ({q.dtype})")
    return headed, hq, hk


# ----------------------------------------------------------------------------- torch backend

def _rows(x2d, row_len):
    """(T, H*row_len) → (T, H, row_len): one statistics row per (token, head slot)."""
    return x2d.unflatten(-1, (-1, row_len))


def norm_rows(x, head_dim, headed, per_layer):
    """x as the rows QK-Norm normalizes: (..., H·head_dim) per layer, (..., H, head_dim) per
    head (x itself where its layout already is its rows)."""
    if per_layer:
        return x.flatten(-2) if headed else x
    return x if headed else x.view(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def rows_as_heads(y, head_dim, per_layer):
    """Normalized rows (``norm_rows``' layout) viewed as (..., H, head_dim) heads, the layout
    RoPE rotates (as transformers' ``view(hidden_shape)``)."""
    return y.view(*y.shape[:-1], y.shape[-1] // head_dim, head_dim) if per_layer else y


def torch_qk_norm_rows(q, k, q_weight, k_weight, eps, head_dim, headed, per_layer, offset,
                       casting):
    """QK-Norm of q and k as plain PyTorch operations, ``ops.torch_rms_norm_pair`` (one
    autograd node for both) of their rows (``norm_rows``)."""
    return torch_rms_norm_pair(norm_rows(q, head_dim, headed, per_layer),
                               norm_rows(k, head_dim, headed, per_layer), q_weight, k_weight,
                               eps, offset, casting)


def torch_qk_norm_heads(q, k, q_weight, k_weight, eps, head_dim, headed, per_layer, offset,
                        casting):
    """``torch_qk_norm_rows`` viewed as heads (``rows_as_heads``)."""
    normed = torch_qk_norm_rows(q, k, q_weight, k_weight, eps, head_dim, headed, per_layer,
                                offset, casting)
    return tuple(rows_as_heads(y, head_dim, per_layer) for y in normed)


def torch_forward(x2d, weight, row_len, eps, offset, casting):
    """Reference output (T, W) and float32 inverse RMS (H_rows, T) of one tensor."""
    y, rstd = rms_norm_native_with_rstd(_rows(x2d, row_len), weight, eps, offset, casting)
    return y.flatten(-2), rstd.squeeze(-1).transpose(0, 1).contiguous()


def torch_backward(dy2d, x2d, weight, rstd, row_len, offset):
    """Reference (dx, dw) of one tensor from the saved inverse RMS (H_rows, T)."""
    dy, x, rstd = _rows(dy2d, row_len), _rows(x2d, row_len), rstd.transpose(0, 1).unsqueeze(-1)
    dx, dw = rms_norm_backward_reference(dy, x, weight, rstd, offset)   # (H, N): dw per head
    return dx.flatten(-2), dw


# ----------------------------------------------------------------------------- triton backend

def launch_shape(kernel, n_tokens, nq, nk, hq, hk, dtype, device):
    """(launch plan, BLOCK_NQ, BLOCK_NK) of the q/k launch of ``kernel`` ("qk_norm_fwd" /
    "qk_norm_bwd") over q's rows, ``hq`` head slots of nq values per token (per_head: Hq of
    head_dim; per_layer: one of Hq · head_dim), and k's, from the plan of the longer row. The
    plan's ``shares`` give each tensor's programs and heads per program slot
    (``launch_plans.share_programs`` with ``group_heads``): q and k get programs in proportion
    to their work, and a program takes as many heads as keeps the SMs evenly busy; or, where
    that is better balanced, a program runs the q and the k rows of its tokens
    (``launch_plans.pair_programs``)."""
    plan = plan_for(kernel, dtype, n_tokens, max(nq, nk), device,
                    tensors=((hq, nq), (hk, nk)), group_heads=True, pair_tensors=True)
    return (plan, min(triton.next_power_of_2(nq), plan.block_n),
            min(triton.next_power_of_2(nk), plan.block_n))


def _partial_rows(share, heads, weight):
    """Rows of one tensor's float32 dw partials (kernels/qk_norm.py): one per program when
    the heads share the weight, one per token group and head when each has its own."""
    return share.groups * heads if weight.dim() == 2 else share.programs


def _triton_forward(q2d, k2d, q_weight, k_weight, nq, nk, eps, offset, casting):
    """``kernels/qk_norm.py:qk_norm_fwd``: (qy, ky, q_rstd, k_rstd) in one launch."""
    device, n_tokens = q2d.device, q2d.shape[0]
    hq, hk = q2d.shape[1] // nq, k2d.shape[1] // nk
    qy = torch.empty(q2d.shape, device=device,
                     dtype=rms_norm_output_dtype(q2d.dtype, q_weight.dtype, casting))
    ky = torch.empty(k2d.shape, device=device,
                     dtype=rms_norm_output_dtype(k2d.dtype, k_weight.dtype, casting))
    q_rstd = torch.empty(hq, n_tokens, device=device, dtype=torch.float32)
    k_rstd = torch.empty(hk, n_tokens, device=device, dtype=torch.float32)
    if n_tokens == 0:
        return qy, ky, q_rstd, k_rstd
    plan, block_nq, block_nk = launch_shape("qk_norm_fwd", n_tokens, nq, nk, hq, hk,
                                            q2d.dtype, device)
    q_share, k_share = plan.shares
    kernel_for(_k.qk_norm_fwd, device)[(plan.programs,)](
        q2d, k2d, q_weight.contiguous(), k_weight.contiguous(), qy, ky, q_rstd, k_rstd,
        n_tokens=n_tokens, q_tokens_per_program=q_share.rows_per_program,
        k_tokens_per_program=k_share.rows_per_program, q_heads=hq, k_heads=hk,
        q_heads_per_slot=q_share.units_per_slot, k_heads_per_slot=k_share.units_per_slot,
        n_q_programs=q_share.programs,
        stride_q=q2d.stride(0), stride_k=k2d.stride(0), stride_qy=qy.stride(0),
        stride_ky=ky.stride(0), eps=eps, offset=offset,
        NQ=nq, NK=nk, BLOCK_M=plan.block_m, BLOCK_NQ=block_nq, BLOCK_NK=block_nk,
        QW_PER_HEAD=q_weight.dim() == 2, KW_PER_HEAD=k_weight.dim() == 2,
        ROUND_XHAT=casting == "llama", NUM_STAGES=plan.num_stages, PAIRED=plan.paired,
        num_warps=plan.num_warps, num_ctas=plan.num_ctas)
    return qy, ky, q_rstd, k_rstd


def weight_grads_from_partials(q_partial, q_weight, k_partial, k_weight):
    """dq_weight and dk_weight from their float32 partial rows, in one launch
    (``launcher.sum_partials``). A tensor's partial rows hold its weight's values in groups:
    (groups · H, D) for one row per head (row group · H + head), summed over the groups; one
    row per program, all summed, when the heads share one weight row."""
    return tuple(sum_partials((q_partial.view(-1, *q_weight.shape), q_weight.dtype),
                              (k_partial.view(-1, *k_weight.shape), k_weight.dtype)))


def _triton_backward(dqy, dky, q2d, k2d, q_weight, k_weight, q_rstd, k_rstd, nq, nk, offset):
    """``kernels/qk_norm.py:qk_norm_bwd``: (dq, dk, dq_weight, dk_weight) in one launch."""
    device, n_tokens = q2d.device, q2d.shape[0]
    hq, hk = q2d.shape[1] // nq, k2d.shape[1] // nk
    dqy, dky = as_rows(dqy), as_rows(dky)
    dq = torch.empty(q2d.shape, device=device, dtype=q2d.dtype)
    dk = torch.empty(k2d.shape, device=device, dtype=k2d.dtype)
    plan, block_nq, block_nk = launch_shape("qk_norm_bwd", n_tokens, nq, nk, hq, hk,
                                            q2d.dtype, device)
    q_share, k_share = plan.shares
    dqw_partial = torch.empty(_partial_rows(q_share, hq, q_weight) if n_tokens > 0 else 0, nq,
                              device=device, dtype=torch.float32)
    dkw_partial = torch.empty(_partial_rows(k_share, hk, k_weight) if n_tokens > 0 else 0, nk,
                              device=device, dtype=torch.float32)
    if n_tokens > 0:
        kernel_for(_k.qk_norm_bwd, device)[(plan.programs,)](
            q2d, k2d, q_weight.contiguous(), k_weight.contiguous(), dqy, dky, dq, dk,
            q_rstd, k_rstd, dqw_partial, dkw_partial,
            n_tokens=n_tokens, q_tokens_per_program=q_share.rows_per_program,
            k_tokens_per_program=k_share.rows_per_program, q_heads=hq, k_heads=hk,
            q_heads_per_slot=q_share.units_per_slot, k_heads_per_slot=k_share.units_per_slot,
            n_q_programs=q_share.programs,
            stride_q=q2d.stride(0), stride_k=k2d.stride(0), stride_dqy=dqy.stride(0),
            stride_dky=dky.stride(0), stride_dq=dq.stride(0), stride_dk=dk.stride(0),
            offset=offset, NQ=nq, NK=nk, BLOCK_M=plan.block_m, BLOCK_NQ=block_nq,
            BLOCK_NK=block_nk, QW_PER_HEAD=q_weight.dim() == 2, KW_PER_HEAD=k_weight.dim() == 2,
            PAIRED=plan.paired, num_warps=plan.num_warps, num_ctas=plan.num_ctas)
    return (dq, dk, *weight_grads_from_partials(dqw_partial, q_weight, dkw_partial, k_weight))


# ----------------------------------------------------------------------------- custom ops

def row_lens(q2d, k2d, head_dim, per_layer):
    """Length of one statistics row of q and of k."""
    return (q2d.shape[1], k2d.shape[1]) if per_layer else (head_dim, head_dim)


@torch.library.custom_op("normtools::qk_norm_fwd", mutates_args=())
def _qk_norm_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, head_dim: int,
                 per_layer: bool, eps: float, offset: float, casting: str,
                 backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(qy, ky, q_rstd, k_rstd) for q (T, Hq·head_dim) and k (T, Hk·head_dim); the float32
    inverse RMS is laid out (H_rows, T)."""
    nq, nk = row_lens(q, k, head_dim, per_layer)
    if backend == "torch":
        qy, q_rstd = torch_forward(q, q_weight, nq, eps, offset, casting)
        ky, k_rstd = torch_forward(k, k_weight, nk, eps, offset, casting)
        return qy, ky, q_rstd, k_rstd
    return _triton_forward(q, k, q_weight, k_weight, nq, nk, eps, offset, casting)


@_qk_norm_fwd.register_fake
def _(q, k, q_weight, k_weight, head_dim, per_layer, eps, offset, casting, backend):
    nq, nk = row_lens(q, k, head_dim, per_layer)
    return (q.new_empty(q.shape, dtype=rms_norm_output_dtype(q.dtype, q_weight.dtype, casting)),
            k.new_empty(k.shape, dtype=rms_norm_output_dtype(k.dtype, k_weight.dtype, casting)),
            q.new_empty((q.shape[1] // nq, q.shape[0]), dtype=torch.float32),
            k.new_empty((k.shape[1] // nk, k.shape[0]), dtype=torch.float32))


@torch.library.custom_op("normtools::qk_norm_bwd", mutates_args=())
def _qk_norm_bwd(dqy: Tensor, dky: Tensor, q: Tensor, k: Tensor, q_weight: Tensor,
                 k_weight: Tensor, q_rstd: Tensor, k_rstd: Tensor, head_dim: int,
                 per_layer: bool, offset: float,
                 backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight) from the output gradients and the saved inverse RMS."""
    nq, nk = row_lens(q, k, head_dim, per_layer)
    if backend == "torch":
        dq, dqw = torch_backward(dqy, q, q_weight, q_rstd, nq, offset)
        dk, dkw = torch_backward(dky, k, k_weight, k_rstd, nk, offset)
        return dq, dk, dqw, dkw
    return _triton_backward(dqy, dky, q, k, q_weight, k_weight, q_rstd, k_rstd, nq, nk, offset)


@_qk_norm_bwd.register_fake
def _(dqy, dky, q, k, q_weight, k_weight, q_rstd, k_rstd, head_dim, per_layer, offset, backend):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight),
            torch.empty_like(k_weight))


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, head_dim, per_layer, _eps, offset, _casting, backend = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, output[2], output[3])
    ctx.head_dim, ctx.per_layer, ctx.offset, ctx.backend = head_dim, per_layer, offset, backend


def _backward(ctx, dqy, dky, _d_q_rstd, _d_k_rstd):
    q, k, q_weight, k_weight, q_rstd, k_rstd = ctx.saved_tensors
    dqy = torch.zeros_like(q) if dqy is None else dqy   # only one of the outputs was used
    dky = torch.zeros_like(k) if dky is None else dky
    dq, dk, dqw, dkw = _qk_norm_bwd(dqy, dky, q, k, q_weight, k_weight, q_rstd, k_rstd,
                                         ctx.head_dim, ctx.per_layer, ctx.offset, ctx.backend)
    return dq, dk, dqw, dkw, None, None, None, None, None, None


_qk_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
differentiable_once(_qk_norm_bwd, "qk_norm")


# ----------------------------------------------------------------------------- public API

def qk_norm(q, k, q_weight, k_weight, eps=1e-6, *, head_dim, scope="per_head", offset=0.0,
            casting="llama", backend="auto"):
    """Normalize q and k (RMSNorm, statistics in float32) before RoPE; one launch for both.

    q: (..., Hq·head_dim) or (..., Hq, head_dim); k likewise with Hk heads, Hk dividing Hq.
    scope="per_head": r over each head's head_dim, weights (head_dim,) or (H, head_dim).
    scope="per_layer": r over the whole projection, weights (Hq·head_dim,) and (Hk·head_dim,).
    casting, offset, backend as in ``normtools.rms_norm``. Returns (q_normed, k_normed) with
    the input shapes; the dtype is ``rms_norm_output_dtype(x.dtype, w.dtype, casting)``.
    """
    headed, _, _ = check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, scope, offset,
                                   casting, backend)
    if runs_torch_math(q, backend):
        eps, offset, per_layer = float(eps), float(offset), scope == "per_layer"
        normed = torch_qk_norm_rows(q, k, q_weight, k_weight, eps, head_dim, headed, per_layer,
                                    offset, casting)
        if per_layer != headed:      # the rows are q's and k's own layout
            return normed
        return tuple(y.reshape(x.shape) for y, x in zip(normed, (q, k)))
    q2d = as_rows(q.flatten(-2) if headed else q)
    k2d = as_rows(k.flatten(-2) if headed else k)
    qy, ky, _, _ = _qk_norm_fwd(q2d, k2d, q_weight, k_weight, head_dim, scope == "per_layer",
                                    float(eps), float(offset), casting,
                                    resolve_backend(backend, q.device))
    return qy.view(q.shape), ky.view(k.shape)


class QKNorm(nn.Module):
    """The q_norm and k_norm of one attention layer: ``forward(q, k) -> (q_normed, k_normed)``.

    Weight shapes: per_head (head_dim,) each, or (H, head_dim) with ``weight_per_head=True``;
    per_layer (num_heads·head_dim,) and (num_kv_heads·head_dim,). They start at 1 - offset, so
    that the scale offset + w starts at 1.
    """

    def __init__(self, head_dim, num_heads, num_kv_heads=None, *, scope="per_head",
                 weight_per_head=False, eps=1e-6, offset=0.0, casting="llama", backend="auto",
                 device=None, dtype=None):
        super().__init__()
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; expected one of {', '.join(SCOPES)}")
        validate.check_eps(eps)     # at construction, as RMSNorm's, not at the first call
        validate.check_offset(offset)
        validate.check_casting(casting)
        validate.check_backend(backend)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if scope == "per_layer":
            q_shape, k_shape = (num_heads * head_dim,), (num_kv_heads * head_dim,)
        elif weight_per_head:
            q_shape, k_shape = (num_heads, head_dim), (num_kv_heads, head_dim)
        else:
            q_shape = k_shape = (head_dim,)
        factory = {"device": device, "dtype": dtype}
        self.q_weight = nn.Parameter(torch.full(q_shape, 1.0 - offset, **factory))
        self.k_weight = nn.Parameter(torch.full(k_shape, 1.0 - offset, **factory))
        self.head_dim, self.scope, self.eps = head_dim, scope, eps
        self.offset, self.casting, self.backend = offset, casting, backend

    def forward(self, q, k):
        return qk_norm(q, k, self.q_weight, self.k_weight, self.eps, head_dim=self.head_dim,
                       scope=self.scope, offset=self.offset, casting=self.casting,
                       backend=self.backend)

    def extra_repr(self):
        return (f"head_dim={self.head_dim}, scope={self.scope}, "
                f"q_weight={tuple(self.q_weight.shape)}, k_weight={tuple(self.k_weight.shape)}, "
                f"eps={self.eps}, offset={self.offset}, casting={self.casting}")

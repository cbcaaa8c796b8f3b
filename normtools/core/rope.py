"""Fused QK-Norm + RoPE: ``qk_norm_rope``, the norm of ``normtools.qk_norm`` followed by the
rotary position embedding, forward and backward, one launch for q and k in each direction.

    q_out = RoPE(qk_norm(q)),  k_out = RoPE(qk_norm(k)),  RoPE(y) = y · cos + rotate_half(y) · sin

exactly as Qwen3, Gemma 3 and OLMo 2 compute them in transformers (their q_norm / k_norm, then
``apply_rotary_pos_emb``): the norm's output is rounded to its dtype, then the rotation is
computed in PyTorch's promoted dtype of that output and cos / sin, each product and the sum
rounded (normtools.core.reference.rope_reference); with ``cast_back=True`` the result is cast
to the norm's output dtype (OLMo 2: float32 tables, ``q_embed.to(q.dtype)``).
``backend="torch"`` runs that reference as plain PyTorch operations (the norm of
``qk.torch_qk_norm_heads``, then ``rope_reference``), differentiated eagerly by one autograd
node whose backward is analytic (``_TorchQKNormRope``);
``backend="triton"`` runs ``kernels/qk_norm_rope.py`` (kernels ``qk_norm_rope_fwd`` and
``qk_norm_rope_bwd``) behind the custom op ``normtools::qk_norm_rope_fwd`` (backward
``normtools::qk_norm_rope_bwd``), with fake implementations for ``torch.compile``, which a
tensor subclass takes on either backend.

cos and sin are the rotary tables of the tokens, ``(..., head_dim)`` with the leading (token)
dimensions of q, or broadcastable to them (e.g. (1, S, D) for a batch); they get no gradient
(transformers computes them without one) and must not require one.
"""

import torch
import triton
import triton.language as tl

from normtools._kernels import qk_norm_rope as _k
from normtools.core.launcher import as_rows, kernel_for, plan_for, resolve_backend
from normtools.core.ops import (differentiable_once, once_differentiable_norm,
                                records_analytic_node, runs_torch_math)
from normtools.core.qk import (check_qk_inputs, norm_rows, row_lens, rows_as_heads,
                               torch_backward, torch_forward, torch_qk_norm_heads,
                               weight_grads_from_partials)
from normtools.core.reference import (rms_norm_backward_reference, rms_norm_native_with_rstd,
                                      rms_norm_output_dtype, rope_backward_reference,
                                      rope_reference)

__all__ = ["qk_norm_rope"]

Tensor = torch.Tensor
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _check_rope_tables(cos, sin, q, head_dim, token_shape):
    """cos and sin: tensors of one supported dtype on q's device, last dimension head_dim
    (even), leading dimensions broadcastable to ``token_shape``, not requiring grad."""
    for table, name in ((cos, "cos"), (sin, "sin")):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
        if table.dtype not in _TL_DTYPES:
            raise TypeError(f"{name} has dtype {table.dtype}; supported are "
                            f"{', '.join(str(d) for d in _TL_DTYPES)}")
        if table.device != q.device:
            raise ValueError(f"{name} is on {table.device} but q is on {q.device}")
        if table.requires_grad:
            raise ValueError(f"{name} requires grad; qk_norm_rope treats the rotary tables as "
                             f"constants (compute them under torch.no_grad())")
        if table.dim() == 0 or table.shape[-1] != head_dim:
            raise ValueError(f"{name} has shape {tuple(table.shape)}; its last dimension must be "
                             f"head_dim={head_dim} (the whole head is rotated)")
        lead = table.shape[:-1]
        if lead == token_shape:    # one row per token: nothing to broadcast
            continue
        pairs = list(zip(reversed(lead), reversed(token_shape)))   # aligned from the right
        if any(a != b and a != 1 and b != 1 for a, b in pairs):
            raise ValueError(f"{name} has shape {tuple(table.shape)}; its leading dimensions "
                             f"do not broadcast to q's token dimensions {tuple(token_shape)}")
        if len(lead) > len(token_shape) or any(a != b and b == 1 for a, b in pairs):
            raise ValueError(f"{name} {tuple(table.shape)} would broadcast q's token dimensions "
                             f"{tuple(token_shape)} to more tokens")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin has dtype {sin.dtype}, expected cos's dtype {cos.dtype}")
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of channels: head_dim must be even, got {head_dim}")


def _dtypes(x_dtype, weight_dtype, casting, table_dtype, cast_back):
    """(norm output dtype, dtype the rotation is computed in, result dtype)."""
    norm_dtype = rms_norm_output_dtype(x_dtype, weight_dtype, casting)
    rope_dtype = torch.promote_types(norm_dtype, table_dtype)
    return norm_dtype, rope_dtype, norm_dtype if cast_back else rope_dtype


# ----------------------------------------------------------------------------- torch backend

def _rotated(heads, cos_heads, sin_heads, cast_back):
    """``rope_reference`` of normalized heads, cast back to their dtype with ``cast_back``
    (OLMo 2's ``q_embed.to(q.dtype)``)."""
    rotated = rope_reference(heads, cos_heads, sin_heads)
    return rotated.to(heads.dtype) if cast_back else rotated


def _torch_forward_one(x2d, weight, cos2d, sin2d, row_len, head_dim, eps, offset, casting,
                       cast_back):
    normed, rstd = torch_forward(x2d, weight, row_len, eps, offset, casting)
    heads = normed.unflatten(-1, (-1, head_dim))
    return _rotated(heads, cos2d[:, None], sin2d[:, None], cast_back).flatten(-2), rstd


class _TorchQKNormRope(torch.autograd.Function):
    """RoPE(QK-Norm(q)), RoPE(QK-Norm(k)) on the torch backend, eager, when a gradient is
    recorded, in one autograd node: forward, the norm of ``ops.torch_rms_norm_pair``'s node
    (torch's RMSNorm op, its inverse RMS saved) and ``rope_reference`` of the heads, the
    transformers bits; backward, in float32, the rotation's transpose
    (``rope_backward_reference``) then the norm's analytic backward
    (``rms_norm_backward_reference``). Autograd of ``rope_reference`` would record six nodes
    a tensor (two products; rotate_half's chunk, negation and concatenation; the sum), each a
    backward call and a pass, and add the two paths' gradients."""

    @staticmethod
    def forward(ctx, q_rows, k_rows, q_weight, k_weight, cos_heads, sin_heads, eps, offset,
                casting, head_dim, per_layer, cast_back):
        outs, rstds = [], []
        for rows, weight in ((q_rows, q_weight), (k_rows, k_weight)):
            normed, rstd = rms_norm_native_with_rstd(rows, weight, eps, offset, casting)
            outs.append(_rotated(rows_as_heads(normed, head_dim, per_layer), cos_heads,
                                 sin_heads, cast_back))
            rstds.append(rstd)
        ctx.save_for_backward(q_rows, k_rows, q_weight, k_weight, cos_heads, sin_heads, *rstds)
        ctx.offset, ctx.per_layer = offset, per_layer
        return tuple(outs)

    @staticmethod
    @once_differentiable_norm("qk_norm_rope")
    def backward(ctx, dq_out, dk_out):
        q_rows, k_rows, q_weight, k_weight, cos_heads, sin_heads, q_rstd, k_rstd = \
            ctx.saved_tensors
        grads = []
        for dout, rows, weight, rstd in ((dq_out, q_rows, q_weight, q_rstd),
                                         (dk_out, k_rows, k_weight, k_rstd)):
            dnormed = rope_backward_reference(dout, cos_heads, sin_heads)
            grads.append(rms_norm_backward_reference(
                dnormed.flatten(-2) if ctx.per_layer else dnormed, rows, weight, rstd,
                ctx.offset))
        (dq, dq_weight), (dk, dk_weight) = grads
        return dq, dk, dq_weight, dk_weight, *[None] * 8


def _torch_qk_norm_rope(q, k, q_weight, k_weight, cos_heads, sin_heads, eps, head_dim, headed,
                        per_layer, offset, casting, cast_back):
    """RoPE(QK-Norm(q)), RoPE(QK-Norm(k)) as plain PyTorch operations, on the norm's results
    viewed as (..., H, head_dim) heads; ``cos_heads`` / ``sin_heads``: the (..., 1, D) tables
    that broadcast over the heads (made once for q and k, as transformers' ``unsqueeze``). The
    results have q's and k's shapes. Eagerly with a gradient to record, one autograd node
    (``_TorchQKNormRope``); else the norm (``qk.torch_qk_norm_heads``), then
    ``rope_reference``."""
    if records_analytic_node(q, k, q_weight, k_weight):
        rotated = _TorchQKNormRope.apply(
            norm_rows(q, head_dim, headed, per_layer), norm_rows(k, head_dim, headed, per_layer),
            q_weight, k_weight, cos_heads, sin_heads, eps, offset, casting, head_dim, per_layer,
            cast_back)
    else:
        heads = torch_qk_norm_heads(q, k, q_weight, k_weight, eps, head_dim, headed, per_layer,
                                    offset, casting)
        rotated = [_rotated(h, cos_heads, sin_heads, cast_back) for h in heads]
    return tuple(r if headed else r.reshape(x.shape) for r, x in zip(rotated, (q, k)))


def _torch_backward_one(dout2d, x2d, weight, cos2d, sin2d, rstd, row_len, head_dim, offset):
    dnormed = rope_backward_reference(dout2d.unflatten(-1, (-1, head_dim)), cos2d[:, None],
                                      sin2d[:, None])
    return torch_backward(dnormed.flatten(-2), x2d, weight, rstd, row_len, offset)


# ----------------------------------------------------------------------------- triton backend

def launch_shape(kernel, n_tokens, hq, hk, head_dim, per_layer, dtype, device):
    """(plan, BLOCK_HQ, BLOCK_HK, BLOCK_HALF) of a launch of ``kernel`` ("qk_norm_rope_fwd" /
    "qk_norm_rope_bwd"): the launch plan for q's row of one token (Hq heads of 2 · BLOCK_HALF
    columns), its tile of BLOCK_N columns cut into whole heads; per_head a slot is
    ``units_per_slot`` tiles of heads (``launch_plans.share_programs``' ``group_heads``: one
    tile per slot with few tokens, several with many), per_layer the whole row. q and k get
    programs in proportion to the heads of a slot (``plan.shares``: per tensor its slots,
    tiles per slot and tokens per program), or, where that is better balanced, a program runs
    the q and the k heads of its tokens (``launch_plans.pair_programs``)."""
    block_half = triton.next_power_of_2(head_dim // 2)
    row = hq * 2 * block_half
    block_n = plan_for(kernel, dtype, n_tokens, row, device).block_n
    block_hq = max(1, min(block_n // (2 * block_half), triton.next_power_of_2(hq)))
    block_hk = min(block_hq, triton.next_power_of_2(hk))
    if per_layer:
        tensors = ((1, hq), (1, hk))
    else:
        tensors = ((triton.cdiv(hq, block_hq), min(block_hq, hq)),
                   (triton.cdiv(hk, block_hk), min(block_hk, hk)))
    # per head a tile holds whole heads, and a head is what is normalized: one pass
    plan = plan_for(kernel, dtype, n_tokens, row, device, tensors=tensors,
                    group_heads=not per_layer, pair_tensors=True,
                    norm_length=row if per_layer else 2 * block_half)
    return plan, block_hq, block_hk, block_half


def _weight_head_stride(weight, head_dim, per_layer):
    """Elements between the weights of consecutive heads: 0 for one (head_dim,) weight shared
    by every head, head_dim for one row per head or a per_layer weight."""
    return head_dim if per_layer or weight.dim() == 2 else 0


def _triton_forward(q2d, k2d, q_weight, k_weight, cos2d, sin2d, nq, nk, head_dim, eps, offset,
                    casting, cast_back):
    device, n_tokens = q2d.device, q2d.shape[0]
    # (per_layer with one head is the per_head case: the same statistics)
    hq, hk, per_layer = q2d.shape[1] // head_dim, k2d.shape[1] // head_dim, nq > head_dim
    q_norm_dtype, q_rope_dtype, q_out_dtype = _dtypes(q2d.dtype, q_weight.dtype, casting,
                                                      cos2d.dtype, cast_back)
    k_norm_dtype, k_rope_dtype, k_out_dtype = _dtypes(k2d.dtype, k_weight.dtype, casting,
                                                      cos2d.dtype, cast_back)
    qo = torch.empty(q2d.shape, device=device, dtype=q_out_dtype)
    ko = torch.empty(k2d.shape, device=device, dtype=k_out_dtype)
    q_rstd = torch.empty(q2d.shape[1] // nq, n_tokens, device=device, dtype=torch.float32)
    k_rstd = torch.empty(k2d.shape[1] // nk, n_tokens, device=device, dtype=torch.float32)
    if n_tokens == 0:
        return qo, ko, q_rstd, k_rstd
    plan, block_hq, block_hk, block_half = launch_shape(
        "qk_norm_rope_fwd", n_tokens, hq, hk, head_dim, per_layer, q2d.dtype, device)
    q_share, k_share = plan.shares
    kernel_for(_k.qk_norm_rope_fwd, device)[(plan.programs,)](
        q2d, k2d, q_weight.contiguous(), k_weight.contiguous(), cos2d, sin2d, qo, ko,
        q_rstd, k_rstd, n_tokens=n_tokens, q_tokens_per_program=q_share.rows_per_program,
        k_tokens_per_program=k_share.rows_per_program, q_slots=q_share.slots,
        k_slots=k_share.slots, q_tiles_per_slot=q_share.units_per_slot,
        k_tiles_per_slot=k_share.units_per_slot, n_q_programs=q_share.programs,
        stride_q=q2d.stride(0), stride_k=k2d.stride(0), stride_qo=qo.stride(0),
        stride_ko=ko.stride(0), stride_cos=cos2d.stride(0), stride_sin=sin2d.stride(0),
        qw_head_stride=_weight_head_stride(q_weight, head_dim, per_layer),
        kw_head_stride=_weight_head_stride(k_weight, head_dim, per_layer), eps=eps,
        offset=offset, HEAD_DIM=head_dim,
        Q_HEADS=hq, K_HEADS=hk, PER_LAYER=per_layer, BLOCK_M=plan.block_m, BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk, BLOCK_HALF=block_half, ROUND_XHAT=casting == "llama",
        Q_NORM_DTYPE=_TL_DTYPES[q_norm_dtype], K_NORM_DTYPE=_TL_DTYPES[k_norm_dtype],
        Q_ROPE_DTYPE=_TL_DTYPES[q_rope_dtype], K_ROPE_DTYPE=_TL_DTYPES[k_rope_dtype],
        NUM_STAGES=plan.num_stages, PAIRED=plan.paired, num_warps=plan.num_warps)
    return qo, ko, q_rstd, k_rstd


def _partial_buffer(weight, heads, head_dim, per_layer, programs, groups, device):
    """The float32 partials of one tensor's weight gradient, shaped for
    ``weight_grads_from_partials``:
    (programs, D) for a shared (D,) weight, (groups · H, D) for one row per head,
    (groups, H · D) per layer (the layouts of kernels/qk_norm_rope.py)."""
    if per_layer:
        shape = (groups, heads * head_dim)
    elif weight.dim() == 2:
        shape = (groups * heads, head_dim)
    else:
        shape = (programs, head_dim)
    return torch.empty(shape, device=device, dtype=torch.float32)


def _triton_backward(dqo, dko, q2d, k2d, q_weight, k_weight, cos2d, sin2d, q_rstd, k_rstd, nq,
                     nk, head_dim, offset):
    device, n_tokens = q2d.device, q2d.shape[0]
    # (per_layer with one head is the per_head case: the same statistics)
    hq, hk, per_layer = q2d.shape[1] // head_dim, k2d.shape[1] // head_dim, nq > head_dim
    dqo, dko = as_rows(dqo), as_rows(dko)
    dq = torch.empty(q2d.shape, device=device, dtype=q2d.dtype)
    dk = torch.empty(k2d.shape, device=device, dtype=k2d.dtype)
    plan, block_hq, block_hk, block_half = launch_shape(
        "qk_norm_rope_bwd", n_tokens, hq, hk, head_dim, per_layer, q2d.dtype, device)
    q_share, k_share = plan.shares
    q_groups, k_groups = (q_share.groups, k_share.groups) if n_tokens > 0 else (0, 0)
    dqw_partial = _partial_buffer(q_weight, hq, head_dim, per_layer, q_share.slots * q_groups,
                                  q_groups, device)
    dkw_partial = _partial_buffer(k_weight, hk, head_dim, per_layer, k_share.slots * k_groups,
                                  k_groups, device)
    if n_tokens > 0:
        kernel_for(_k.qk_norm_rope_bwd, device)[(plan.programs,)](
            q2d, k2d, q_weight.contiguous(), k_weight.contiguous(), cos2d, sin2d, dqo, dko,
            dq, dk, q_rstd, k_rstd, dqw_partial, dkw_partial,
            n_tokens=n_tokens, q_tokens_per_program=q_share.rows_per_program,
            k_tokens_per_program=k_share.rows_per_program, q_slots=q_share.slots,
            k_slots=k_share.slots, q_tiles_per_slot=q_share.units_per_slot,
            k_tiles_per_slot=k_share.units_per_slot, n_q_programs=q_share.programs,
            stride_q=q2d.stride(0), stride_k=k2d.stride(0), stride_dqo=dqo.stride(0),
            stride_dko=dko.stride(0), stride_dq=dq.stride(0), stride_dk=dk.stride(0),
            stride_cos=cos2d.stride(0), stride_sin=sin2d.stride(0),
            qw_head_stride=_weight_head_stride(q_weight, head_dim, per_layer),
            kw_head_stride=_weight_head_stride(k_weight, head_dim, per_layer), offset=offset,
            HEAD_DIM=head_dim, Q_HEADS=hq, K_HEADS=hk, PER_LAYER=per_layer, BLOCK_M=plan.block_m,
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
            NUM_STAGES=plan.num_stages, PAIRED=plan.paired, num_warps=plan.num_warps)
    return (dq, dk, *weight_grads_from_partials(dqw_partial, q_weight, dkw_partial, k_weight))


# ----------------------------------------------------------------------------- custom ops

@torch.library.custom_op("normtools::qk_norm_rope_fwd", mutates_args=())
def _qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                      sin: Tensor, head_dim: int, per_layer: bool, eps: float, offset: float,
                      casting: str, cast_back: bool,
                      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_out, k_out, q_rstd, k_rstd) for q (T, Hq·D), k (T, Hk·D), cos / sin (T, D); the
    float32 inverse RMS is laid out (H_rows, T)."""
    nq, nk = row_lens(q, k, head_dim, per_layer)
    if backend == "torch":
        qo, q_rstd = _torch_forward_one(q, q_weight, cos, sin, nq, head_dim, eps, offset, casting,
                                        cast_back)
        ko, k_rstd = _torch_forward_one(k, k_weight, cos, sin, nk, head_dim, eps, offset, casting,
                                        cast_back)
        return qo, ko, q_rstd, k_rstd
    return _triton_forward(q, k, q_weight, k_weight, cos, sin, nq, nk, head_dim, eps, offset,
                           casting, cast_back)


@_qk_norm_rope_fwd.register_fake
def _(q, k, q_weight, k_weight, cos, sin, head_dim, per_layer, eps, offset, casting, cast_back,
      backend):
    nq, nk = row_lens(q, k, head_dim, per_layer)
    q_dtype = _dtypes(q.dtype, q_weight.dtype, casting, cos.dtype, cast_back)[2]
    k_dtype = _dtypes(k.dtype, k_weight.dtype, casting, cos.dtype, cast_back)[2]
    return (q.new_empty(q.shape, dtype=q_dtype), k.new_empty(k.shape, dtype=k_dtype),
            q.new_empty((q.shape[1] // nq, q.shape[0]), dtype=torch.float32),
            k.new_empty((k.shape[1] // nk, k.shape[0]), dtype=torch.float32))


@torch.library.custom_op("normtools::qk_norm_rope_bwd", mutates_args=())
def _qk_norm_rope_bwd(dqo: Tensor, dko: Tensor, q: Tensor, k: Tensor, q_weight: Tensor,
                      k_weight: Tensor, cos: Tensor, sin: Tensor, q_rstd: Tensor,
                      k_rstd: Tensor, head_dim: int, per_layer: bool, offset: float,
                      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight) from the output gradients and the saved inverse RMS."""
    nq, nk = row_lens(q, k, head_dim, per_layer)
    if backend == "torch":
        dq, dqw = _torch_backward_one(dqo, q, q_weight, cos, sin, q_rstd, nq, head_dim, offset)
        dk, dkw = _torch_backward_one(dko, k, k_weight, cos, sin, k_rstd, nk, head_dim, offset)
        return dq, dk, dqw, dkw
    return _triton_backward(dqo, dko, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, nq, nk,
                            head_dim, offset)


@_qk_norm_rope_bwd.register_fake
def _(dqo, dko, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, head_dim, per_layer, offset,
      backend):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight),
            torch.empty_like(k_weight))


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, head_dim, per_layer, _eps, offset, *_, backend = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, output[2], output[3])
    ctx.head_dim, ctx.per_layer, ctx.offset, ctx.backend = head_dim, per_layer, offset, backend


def _backward(ctx, dqo, dko, _d_q_rstd, _d_k_rstd):
    q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd = ctx.saved_tensors
    dqo = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if dqo is None else dqo
    dko = torch.zeros(k.shape, dtype=k.dtype, device=k.device) if dko is None else dko
    dq, dk, dqw, dkw = _qk_norm_rope_bwd(dqo, dko, q, k, q_weight, k_weight, cos, sin, q_rstd,
                                         k_rstd, ctx.head_dim, ctx.per_layer, ctx.offset,
                                         ctx.backend)
    return dq, dk, dqw, dkw, None, None, None, None, None, None, None, None, None


_qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)
differentiable_once(_qk_norm_rope_bwd, "qk_norm_rope")


# ----------------------------------------------------------------------------- public API

def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, *, head_dim, scope="per_head",
                 offset=0.0, casting="llama", cast_back=False, backend="auto"):
    """QK-Norm then RoPE, fused: ``RoPE(qk_norm(q))``, ``RoPE(qk_norm(k))`` in one launch.

    q: (..., Hq·head_dim) or (..., Hq, head_dim); k likewise with Hk heads (Hk divides Hq);
    weights, eps, scope, offset, casting and backend as in ``normtools.qk_norm``. cos, sin:
    (..., head_dim), the rotary tables of q's tokens (leading dimensions broadcastable to q's
    token dimensions; no gradient). RoPE(y) = y · cos + rotate_half(y) · sin over the whole
    head, as transformers' ``apply_rotary_pos_emb``, computed in dtype
    promote(rms_norm_output_dtype(x, w, casting), cos.dtype). Returns (q_out, k_out) with the
    input shapes, in that dtype, or in the norm's output dtype with ``cast_back=True`` (OLMo 2).

    A q whose last dimension is head_dim reads two ways: (..., H, head_dim), tokens q.shape[:-2],
    or one head per token, tokens q.shape[:-1]. The first is taken when the tables fit its
    tokens, else the second; where the tables fit both (q (B, S, head_dim), cos (S, head_dim)
    and B = S), pass one head as (B, S, 1, head_dim).
    """
    if not isinstance(cast_back, bool):
        raise TypeError(f"cast_back must be True or False, got {cast_back!r}")
    headed, _, _ = check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, scope, offset,
                                   casting, backend)
    token_shape = q.shape[:-2] if headed else q.shape[:-1]
    try:
        _check_rope_tables(cos, sin, q, head_dim, token_shape)
    except ValueError as tables_error:
        if not headed:
            raise
        try:    # one head per token in the flat layout, if its tokens are the tables'
            check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, scope, offset, casting,
                            backend, layouts=(False,))
        except ValueError:
            raise tables_error from None    # not that either: the tables do not fit
        headed, token_shape = False, q.shape[:-1]
        _check_rope_tables(cos, sin, q, head_dim, token_shape)
    if runs_torch_math(q, backend):
        return _torch_qk_norm_rope(q, k, q_weight, k_weight, cos.unsqueeze(-2), sin.unsqueeze(-2),
                                   float(eps), head_dim, headed, scope == "per_layer",
                                   float(offset), casting, cast_back)
    q2d = as_rows(q.flatten(-2) if headed else q)
    k2d = as_rows(k.flatten(-2) if headed else k)
    cos2d = as_rows(cos.expand(*token_shape, head_dim))
    sin2d = as_rows(sin.expand(*token_shape, head_dim))
    qo, ko, _, _ = _qk_norm_rope_fwd(q2d, k2d, q_weight, k_weight, cos2d, sin2d, head_dim,
                                     scope == "per_layer", float(eps), float(offset), casting,
                                     cast_back, resolve_backend(backend, q.device))
    return qo.view(q.shape), ko.view(k.shape)

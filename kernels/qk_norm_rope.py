"""Fused QK-Norm + RoPE: RMSNorm of the query and key projections, then the rotary embedding,
one launch for q and k in each direction.

In Qwen3, Gemma 3 and OLMo 2 the rotary embedding follows QK-Norm, so the two can share one
read and one write of q and k (vLLM fuses them for inference). The norm is that of
kernels/qk_norm.py. A *row* is what one set of statistics covers:

    scope per_head : one head of one token,       N = head_dim       (HEADS_PER_ROW = 1)
    scope per_layer: the projection of one token, N = H * head_dim   (HEADS_PER_ROW = H)

For a row x, with D = head_dim and the two halves of each head written x = (x₁, x₂):

    rstd  = rsqrt(mean_j x_j² + eps)                  statistics in float32
    x_hat = x * rstd
    y     = s * cast(x_hat)     casting "llama" (ROUND_XHAT: x_hat rounded to x's dtype)
    y     = x_hat * s           casting "gemma",  s = offset + w (offset added in float32)
    y     = round_norm(y)       the norm's output dtype (what the model's q_norm returns)

and RoPE on each head of y, in the "rotate half" form of transformers' apply_rotary_pos_emb,
with the cos and sin rows (length D) of the token:

    o₁ = y₁ cos₁ − y₂ sin₁
    o₂ = y₂ cos₂ + y₁ sin₂

The model computes the rotation in PyTorch's promoted dtype of y and the tables (ROPE_DTYPE):
every product and the sum is rounded to it, which this kernel does too, so that bfloat16
results equal the model's; the result is stored in the output's dtype (OLMo 2 computes in
float32 with float32 tables and casts back to y's dtype). (transformers writes
y₁ cos₁ + (−y₂) sin₁; rounding is symmetric, so that is o₁ above exactly.)

Backward. The rotation is orthogonal per (j, j + D/2) pair; its transpose gives the gradient of
y from the output gradient do:

    dy₁ = do₁ cos₁ + do₂ sin₂
    dy₂ = do₂ cos₂ − do₁ sin₁

then the RMSNorm backward with g = dy * s (the roundings count as the identity):

    dx = rstd * (g − x_hat * mean_j(g_j * x_hat_j))
    dw = Σ over the rows that share w of dy * x_hat

cos and sin are constants (the rotary embedding is computed without gradient).

Program layout (as kernels/qk_norm.py's forward): program p of a tensor with H_rows row slots
per token handles ROWS consecutive tokens of row slot  p % H_rows; the q programs come first.
Each backward program stores the float32 partial dw of its tokens to its own row of
DW_PARTIAL (length N), summed by the launcher: deterministic, no atomics.

Addressing. Element (token t, row slot r, head j of the row, column c) is at
t * stride_t + (r * HEADS_PER_ROW + j) * D + c; its weight at r * w_row_stride + j * D + c
(w_row_stride = 0 when every row shares the weight, D for one weight row per head); its cos
and sin at t * stride_cos + c. Offsets are 64-bit.

In the forward, a per_head row is read once and a per_layer row twice (pass 1: the sum of
squares over its heads; pass 2: normalize, rotate and store head by head); the backward reads
every row twice (pass 1: mean(g * x_hat); pass 2: dx and dw). Under the Triton interpreter
there is no bf16 arithmetic: values are upcast to float32 right after tl.load and cast down
only to store or to emulate a rounding.
"""

import triton
import triton.language as tl


@triton.jit
def qk_norm_rope_fwd(Q, K, QW, KW, COS, SIN, QO, KO, Q_RSTD, K_RSTD,
                     n_tokens, q_slots, k_slots, n_q_programs,
                     stride_q, stride_k, stride_qo, stride_ko, stride_cos, stride_sin,
                     qw_row_stride, kw_row_stride, eps, offset,
                     HEAD_DIM: tl.constexpr, Q_HEADS_PER_ROW: tl.constexpr,
                     K_HEADS_PER_ROW: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     ROUND_XHAT: tl.constexpr, Q_NORM_DTYPE: tl.constexpr,
                     K_NORM_DTYPE: tl.constexpr, Q_ROPE_DTYPE: tl.constexpr,
                     K_ROPE_DTYPE: tl.constexpr):
    """Forward of q and k. Grid: (n_q_programs + n_k_programs,), q programs first; q_slots /
    k_slots are the row slots per token (H_rows). Writes QO, KO (rows of stride stride_qo /
    stride_ko) and the float32 inverse RMS Q_RSTD, K_RSTD laid out (H_rows, n_tokens)."""
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _forward_tensor(Q, QW, COS, SIN, QO, Q_RSTD, pid, n_tokens, q_slots, stride_q,
                        stride_qo, stride_cos, stride_sin, qw_row_stride, eps, offset,
                        HEAD_DIM, Q_HEADS_PER_ROW, ROWS, BLOCK_HALF, ROUND_XHAT, Q_NORM_DTYPE,
                        Q_ROPE_DTYPE)
    else:
        _forward_tensor(K, KW, COS, SIN, KO, K_RSTD, pid - n_q_programs, n_tokens, k_slots,
                        stride_k, stride_ko, stride_cos, stride_sin, kw_row_stride, eps, offset,
                        HEAD_DIM, K_HEADS_PER_ROW, ROWS, BLOCK_HALF, ROUND_XHAT, K_NORM_DTYPE,
                        K_ROPE_DTYPE)


@triton.jit
def _forward_tensor(X, W, COS, SIN, OUT, RSTD, pid, n_tokens, n_slots, stride_x, stride_out,
                    stride_cos, stride_sin, w_row_stride, eps, offset,
                    HEAD_DIM: tl.constexpr, HEADS_PER_ROW: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, ROUND_XHAT: tl.constexpr,
                    NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr):
    """Normalize and rotate the rows of one program of one tensor (q or k); store o and rstd."""
    slot = pid % n_slots
    tokens = ((pid // n_slots) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    token_mask = tokens < n_tokens
    half = tl.arange(0, BLOCK_HALF)
    mask = token_mask[:, None] & (half < HEAD_DIM // 2)[None, :]
    first_head = slot.to(tl.int64) * HEADS_PER_ROW
    x_rows = X + tokens[:, None] * stride_x
    out_rows = OUT + tokens[:, None] * stride_out
    cos_rows = COS + tokens[:, None] * stride_cos
    sin_rows = SIN + tokens[:, None] * stride_sin
    w_row = W + slot * w_row_stride
    if HEADS_PER_ROW == 1:
        # per_head: the row is one head, read once
        x1, x2 = _load_halves(x_rows + first_head * HEAD_DIM, half, mask, HEAD_DIM)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        _normalize_rotate_store(x1, x2, rstd, w_row, cos_rows, sin_rows,
                                out_rows + first_head * HEAD_DIM, half, mask, offset, HEAD_DIM,
                                ROUND_XHAT, X.dtype.element_ty, NORM_DTYPE, ROPE_DTYPE)
    else:
        # per_layer: pass 1, the sum of squares over the heads of the row
        sum_sq = tl.zeros([ROWS], dtype=tl.float32)
        for j in range(HEADS_PER_ROW):
            x1, x2 = _load_halves(x_rows + (first_head + j) * HEAD_DIM, half, mask, HEAD_DIM)
            sum_sq += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.rsqrt(sum_sq / (HEADS_PER_ROW * HEAD_DIM) + eps)
        # pass 2: normalize, rotate and store head by head
        for j in range(HEADS_PER_ROW):
            x1, x2 = _load_halves(x_rows + (first_head + j) * HEAD_DIM, half, mask, HEAD_DIM)
            _normalize_rotate_store(x1, x2, rstd, w_row + j * HEAD_DIM, cos_rows, sin_rows,
                                    out_rows + (first_head + j) * HEAD_DIM, half, mask, offset,
                                    HEAD_DIM, ROUND_XHAT, X.dtype.element_ty, NORM_DTYPE,
                                    ROPE_DTYPE)
    tl.store(RSTD + slot.to(tl.int64) * n_tokens + tokens, rstd, mask=token_mask)


@triton.jit
def _load_halves(rows, half, mask, HEAD_DIM: tl.constexpr):
    """The two halves (float32, (ROWS, BLOCK_HALF)) of one head of ROWS rows."""
    first = tl.load(rows + half[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(rows + HEAD_DIM // 2 + half[None, :], mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _normalize_rotate_store(x1, x2, rstd, w_head, cos_rows, sin_rows, out_rows, half, mask,
                            offset, HEAD_DIM: tl.constexpr, ROUND_XHAT: tl.constexpr,
                            X_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                            ROPE_DTYPE: tl.constexpr):
    """One head: y = norm(x), rounded to NORM_DTYPE; o = RoPE(y) with every product and the sum
    rounded to ROPE_DTYPE; store o in the output's dtype."""
    s1 = offset + tl.load(w_head + half, mask=half < HEAD_DIM // 2, other=0.0).to(tl.float32)
    s2 = offset + tl.load(w_head + HEAD_DIM // 2 + half, mask=half < HEAD_DIM // 2,
                          other=0.0).to(tl.float32)
    y1 = x1 * rstd[:, None]
    y2 = x2 * rstd[:, None]
    if ROUND_XHAT:
        y1 = y1.to(X_DTYPE).to(tl.float32)
        y2 = y2.to(X_DTYPE).to(tl.float32)
    y1 = (y1 * s1[None, :]).to(NORM_DTYPE).to(tl.float32)
    y2 = (y2 * s2[None, :]).to(NORM_DTYPE).to(tl.float32)
    cos1, cos2 = _load_halves(cos_rows, half, mask, HEAD_DIM)
    sin1, sin2 = _load_halves(sin_rows, half, mask, HEAD_DIM)
    o1 = (y1 * cos1).to(ROPE_DTYPE).to(tl.float32) - (y2 * sin1).to(ROPE_DTYPE).to(tl.float32)
    o2 = (y2 * cos2).to(ROPE_DTYPE).to(tl.float32) + (y1 * sin2).to(ROPE_DTYPE).to(tl.float32)
    o1 = o1.to(ROPE_DTYPE)
    o2 = o2.to(ROPE_DTYPE)
    tl.store(out_rows + half[None, :], o1.to(out_rows.dtype.element_ty), mask=mask)
    tl.store(out_rows + HEAD_DIM // 2 + half[None, :], o2.to(out_rows.dtype.element_ty),
             mask=mask)


@triton.jit
def qk_norm_rope_bwd(Q, K, QW, KW, COS, SIN, DQO, DKO, DQ, DK, Q_RSTD, K_RSTD,
                     DQW_PARTIAL, DKW_PARTIAL,
                     n_tokens, q_slots, k_slots, n_q_programs,
                     stride_q, stride_k, stride_dqo, stride_dko, stride_dq, stride_dk,
                     stride_cos, stride_sin, qw_row_stride, kw_row_stride, offset,
                     HEAD_DIM: tl.constexpr, Q_HEADS_PER_ROW: tl.constexpr,
                     K_HEADS_PER_ROW: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
    """Backward of q and k. Same grid as the forward; DQW_PARTIAL has one float32 row of length
    N (= Q_HEADS_PER_ROW * HEAD_DIM) per q program (DKW_PARTIAL likewise for k), summed by the
    launcher into the weight gradients."""
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _backward_tensor(Q, QW, COS, SIN, DQO, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens, q_slots,
                         stride_q, stride_dqo, stride_dq, stride_cos, stride_sin, qw_row_stride,
                         offset, HEAD_DIM, Q_HEADS_PER_ROW, ROWS, BLOCK_HALF)
    else:
        _backward_tensor(K, KW, COS, SIN, DKO, DK, K_RSTD, DKW_PARTIAL, pid - n_q_programs,
                         n_tokens, k_slots, stride_k, stride_dko, stride_dk, stride_cos,
                         stride_sin, kw_row_stride, offset, HEAD_DIM, K_HEADS_PER_ROW, ROWS,
                         BLOCK_HALF)


@triton.jit
def _backward_tensor(X, W, COS, SIN, DO, DX, RSTD, DW_PARTIAL, pid, n_tokens, n_slots,
                     stride_x, stride_do, stride_dx, stride_cos, stride_sin, w_row_stride,
                     offset, HEAD_DIM: tl.constexpr, HEADS_PER_ROW: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """dx for the rows of one program of one tensor, and its partial dw row."""
    slot = pid % n_slots
    tokens = ((pid // n_slots) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    token_mask = tokens < n_tokens
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < HEAD_DIM // 2
    mask = token_mask[:, None] & half_mask[None, :]
    first_head = slot.to(tl.int64) * HEADS_PER_ROW
    x_rows = X + tokens[:, None] * stride_x
    do_rows = DO + tokens[:, None] * stride_do
    dx_rows = DX + tokens[:, None] * stride_dx
    cos_rows = COS + tokens[:, None] * stride_cos
    sin_rows = SIN + tokens[:, None] * stride_sin
    w_row = W + slot * w_row_stride
    dw_row = DW_PARTIAL + pid.to(tl.int64) * (HEADS_PER_ROW * HEAD_DIM)
    rstd = tl.load(RSTD + slot.to(tl.int64) * n_tokens + tokens, mask=token_mask, other=0.0)
    # pass 1 (per_layer: over every head of the row): mean(g * x_hat)
    sum_g_xhat = tl.zeros([ROWS], dtype=tl.float32)
    for j in range(HEADS_PER_ROW):
        x1, x2, g1, g2, dy1, dy2 = _load_grad_head(
            x_rows + (first_head + j) * HEAD_DIM, do_rows + (first_head + j) * HEAD_DIM,
            cos_rows, sin_rows, w_row + j * HEAD_DIM, half, mask, offset, HEAD_DIM)
        sum_g_xhat += (tl.sum(g1 * x1, axis=1) + tl.sum(g2 * x2, axis=1)) * rstd
    mean_g_xhat = sum_g_xhat / (HEADS_PER_ROW * HEAD_DIM)
    # pass 2: dx and the dw partial, head by head (per_head too reads its one head twice: the
    # second read mostly from cache)
    for j in range(HEADS_PER_ROW):
        x1, x2, g1, g2, dy1, dy2 = _load_grad_head(
            x_rows + (first_head + j) * HEAD_DIM, do_rows + (first_head + j) * HEAD_DIM,
            cos_rows, sin_rows, w_row + j * HEAD_DIM, half, mask, offset, HEAD_DIM)
        x_hat1 = x1 * rstd[:, None]
        x_hat2 = x2 * rstd[:, None]
        dx1 = rstd[:, None] * (g1 - x_hat1 * mean_g_xhat[:, None])
        dx2 = rstd[:, None] * (g2 - x_hat2 * mean_g_xhat[:, None])
        head_dx = dx_rows + (first_head + j) * HEAD_DIM
        tl.store(head_dx + half[None, :], dx1.to(DX.dtype.element_ty), mask=mask)
        tl.store(head_dx + HEAD_DIM // 2 + half[None, :], dx2.to(DX.dtype.element_ty), mask=mask)
        tl.store(dw_row + j * HEAD_DIM + half, tl.sum(dy1 * x_hat1, axis=0), mask=half_mask)
        tl.store(dw_row + j * HEAD_DIM + HEAD_DIM // 2 + half, tl.sum(dy2 * x_hat2, axis=0),
                 mask=half_mask)


@triton.jit
def _load_grad_head(x_head, do_head, cos_rows, sin_rows, w_head, half, mask, offset,
                    HEAD_DIM: tl.constexpr):
    """For one head of ROWS rows: x (two halves), dy = RoPEᵀ(do) and g = dy * s, float32."""
    x1, x2 = _load_halves(x_head, half, mask, HEAD_DIM)
    do1, do2 = _load_halves(do_head, half, mask, HEAD_DIM)
    cos1, cos2 = _load_halves(cos_rows, half, mask, HEAD_DIM)
    sin1, sin2 = _load_halves(sin_rows, half, mask, HEAD_DIM)
    dy1 = do1 * cos1 + do2 * sin2
    dy2 = do2 * cos2 - do1 * sin1
    half_mask = half < HEAD_DIM // 2
    s1 = offset + tl.load(w_head + half, mask=half_mask, other=0.0).to(tl.float32)
    s2 = offset + tl.load(w_head + HEAD_DIM // 2 + half, mask=half_mask, other=0.0).to(tl.float32)
    return x1, x2, dy1 * s1[None, :], dy2 * s2[None, :], dy1, dy2

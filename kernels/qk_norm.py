"""QK-Norm: RMSNorm of the query and the key projection, both in one launch.

launched by: normtools.core.qk (qk_norm), plans from normtools.core.launch_plans.

A *row* is the vector that one set of statistics covers:

    scope per_head : one head of one token,       N = head_dim      (Qwen3, Gemma 3, Cohere)
    scope per_layer: the projection of one token, N = H * head_dim  (OLMo 2, MiniMax-M2)

so a tensor of T tokens has H_rows = H (per_head) or 1 (per_layer) rows per token. For a row x

    rstd  = rsqrt(mean_j x_j^2 + eps)            statistics in float32
    x_hat = x * rstd
    s     = offset + w                           offset added in float32
    y     = s * cast(x_hat)                      casting "llama" (ROUND_XHAT: round to x's dtype)
    y     = cast(x_hat * s)                      casting "gemma"

and backward, with g = dy * s (float32):

    dx   = rstd * (g - x_hat * mean_j(g_j * x_hat_j))
    dw   = sum over the rows that share w of dy * x_hat

Program layout. Program p of one tensor, which has H_rows head slots per token, handles one
head slot of a range of tokens:

    head slot   = p %  H_rows                    (always 0 for per_layer)
    token group = p // H_rows

so programs with neighbouring ids cover neighbouring memory (the head slots of the same
tokens) and all rows of a program use the same weight row. Programs are persistent: a
program loops over the BLOCK_M-token blocks of ``tokens_per_program`` tokens, so it reads its
weight row once; a backward program accumulates dy * x_hat in registers and stores its
float32 partial dw row DW_PARTIAL[p] once, so the partials cost one row per program, not one
per token block (per_layer: not one row of H * head_dim floats per token). kernels/partials.py
sums them in a fixed order: deterministic without atomics. The q programs come first and the
k programs after them: one launch covers both tensors, forward and backward.

Addressing. Element (token t, head slot h, column j) is at  t * stride_t + h * N + j,  its
weight at  h * w_head_stride + j  (w_head_stride = 0 when all heads share one weight row, N for
one weight row per head); the inverse RMS of (h, t) at  h * T + t. Token and head offsets are
64-bit: T * H * head_dim, and H_rows * T partial or statistics entries, may pass 2^31. Rows
that fit in BLOCK_N stay in registers (on sm_90, per_layer rows of up to 131072 values too,
a program then a cluster of CTAs: see rms_norm.py); longer rows are read in BLOCK_N chunks,
twice, and the chunked backward adds each block's dw into its partial row.

Under the Triton interpreter there is no bf16 arithmetic: values are upcast to float32 right
after tl.load and cast down only right before tl.store (or to emulate the "llama" rounding).
"""

import triton
import triton.language as tl

from normtools._kernels.tiles import load_grad_tile, load_param, row_block


@triton.jit
def qk_norm_fwd(Q, K, QW, KW, QY, KY, Q_RSTD, K_RSTD,
                n_tokens, tokens_per_program, q_heads, k_heads, n_q_programs,
                stride_q, stride_k, stride_qy, stride_ky, qw_head_stride, kw_head_stride,
                eps, offset,
                NQ: tl.constexpr, NK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr, ROUND_XHAT: tl.constexpr):
    """Forward of q and k. Grid: (q_heads + k_heads) * groups persistent programs, q first,
    each over ``tokens_per_program`` tokens (a multiple of BLOCK_M) of one head slot; q_heads /
    k_heads are the head slots per token (H_rows), n_q_programs = q_heads * groups.

    Writes QY, KY (contiguous outputs) and the float32 inverse RMS Q_RSTD, K_RSTD laid out as
    (H_rows, n_tokens), which the backward reuses.
    """
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _forward_tensor(Q, QW, QY, Q_RSTD, pid, n_tokens, tokens_per_program, q_heads,
                        stride_q, stride_qy, qw_head_stride, eps, offset, NQ, BLOCK_M, BLOCK_NQ,
                        ROUND_XHAT)
    else:
        _forward_tensor(K, KW, KY, K_RSTD, pid - n_q_programs, n_tokens, tokens_per_program,
                        k_heads, stride_k, stride_ky, kw_head_stride, eps, offset, NK, BLOCK_M,
                        BLOCK_NK, ROUND_XHAT)


@triton.jit
def qk_norm_bwd(Q, K, QW, KW, DQY, DKY, DQ, DK, Q_RSTD, K_RSTD, DQW_PARTIAL, DKW_PARTIAL,
                n_tokens, tokens_per_program, q_heads, k_heads, n_q_programs,
                stride_q, stride_k, stride_dqy, stride_dky, stride_dq, stride_dk,
                qw_head_stride, kw_head_stride, offset,
                NQ: tl.constexpr, NK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr):
    """Backward of q and k. Grid: (q_heads + k_heads) * groups persistent programs, q first,
    each over ``tokens_per_program`` tokens (a multiple of BLOCK_M) of one head slot;
    DQW_PARTIAL has one float32 row of length NQ per q program (DKW_PARTIAL likewise for k),
    summed by the launcher into the weight grads."""
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _backward_tensor(Q, QW, DQY, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens, tokens_per_program,
                         q_heads, stride_q, stride_dqy, stride_dq, qw_head_stride, offset,
                         NQ, BLOCK_M, BLOCK_NQ)
    else:
        _backward_tensor(K, KW, DKY, DK, K_RSTD, DKW_PARTIAL, pid - n_q_programs, n_tokens,
                         tokens_per_program, k_heads, stride_k, stride_dky, stride_dk,
                         kw_head_stride, offset, NK, BLOCK_M, BLOCK_NK)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _forward_tensor(X, W, Y, RSTD, pid, n_tokens, tokens_per_program, n_heads, stride_x,
                    stride_y, w_head_stride, eps, offset,
                    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROUND_XHAT: tl.constexpr):
    """Normalize the rows of one persistent program of one tensor (q or k); store y and
    rstd. The weight row is read once per program (per chunk and token block when chunked)."""
    SINGLE_PASS: tl.constexpr = BLOCK_N >= N
    head = (pid % n_heads).to(tl.int64)
    token_start = (pid // n_heads) * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    w_row = W + head * w_head_stride
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        # whole row in registers: one read, one write
        s = load_param(w_row, cols, cols < N, offset, 1.0, True)
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            mask = token_mask[:, None] & (cols < N)[None, :]
            x = tl.load(X + tokens[:, None] * stride_x + head * N + cols[None, :], mask=mask,
                        other=0.0, eviction_policy="evict_first").to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            y = _normalize(x, rstd, s, ROUND_XHAT, X.dtype.element_ty)
            tl.store(Y + tokens[:, None] * stride_y + head * N + cols[None, :],
                     y.to(Y.dtype.element_ty), mask=mask)
            tl.store(RSTD + head * n_tokens + tokens, rstd, mask=token_mask)
    else:
        # per token block: pass 1 sum of squares over the chunks; pass 2 normalize by chunk
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            x_rows = X + tokens[:, None] * stride_x + head * N
            y_rows = Y + tokens[:, None] * stride_y + head * N
            sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                chunk = start + cols
                mask = token_mask[:, None] & (chunk < N)[None, :]
                x = tl.load(x_rows + chunk[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
                sum_sq += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(sum_sq / N + eps)
            for start in range(0, N, BLOCK_N):
                chunk = start + cols
                mask = token_mask[:, None] & (chunk < N)[None, :]
                x = tl.load(x_rows + chunk[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                s = load_param(w_row, chunk, chunk < N, offset, 1.0, True)
                y = _normalize(x, rstd, s, ROUND_XHAT, X.dtype.element_ty)
                tl.store(y_rows + chunk[None, :], y.to(Y.dtype.element_ty), mask=mask)
            tl.store(RSTD + head * n_tokens + tokens, rstd, mask=token_mask)


@triton.jit
def _backward_tensor(X, W, DY, DX, RSTD, DW_PARTIAL, pid, n_tokens, tokens_per_program,
                     n_heads, stride_x, stride_dy, stride_dx, w_head_stride, offset,
                     N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx for the tokens of one persistent program of one tensor, and its partial dw row."""
    SINGLE_PASS: tl.constexpr = BLOCK_N >= N
    head = (pid % n_heads).to(tl.int64)
    token_start = (pid // n_heads) * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    w_row = W + head * w_head_stride
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N
    x_head, dy_head = X + head * N, DY + head * N
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        s = load_param(w_row, cols, cols < N, offset, 1.0, True)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            rstd = tl.load(RSTD + head * n_tokens + tokens, mask=token_mask, other=0.0)
            mask = token_mask[:, None] & (cols < N)[None, :]
            x, dy = load_grad_tile(x_head, dy_head, tokens, cols, mask, stride_x, stride_dy,
                                   "evict_first")
            x_hat = x * rstd[:, None]
            g = dy * s[None, :]
            c = tl.sum(g * x_hat, axis=1) / N                      # mean(g ⊙ x_hat)
            dx = rstd[:, None] * (g - x_hat * c[:, None])
            tl.store(DX + tokens[:, None] * stride_dx + head * N + cols[None, :],
                     dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * x_hat
        tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=cols < N)
    else:
        # per token block: pass 1 c = mean(g * x_hat) over the chunks; pass 2 dx chunk by
        # chunk, each chunk's dw added into this program's partial row (zeroed first)
        for start in range(0, N, BLOCK_N):
            tl.store(dw_row + start + cols, tl.zeros([BLOCK_N], dtype=tl.float32),
                     mask=start + cols < N)
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            rstd = tl.load(RSTD + head * n_tokens + tokens, mask=token_mask, other=0.0)
            sum_g_xhat = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                chunk = start + cols
                mask = token_mask[:, None] & (chunk < N)[None, :]
                x, dy = load_grad_tile(x_head, dy_head, tokens, chunk, mask, stride_x,
                                       stride_dy, "evict_last")
                s = load_param(w_row, chunk, chunk < N, offset, 1.0, True)
                sum_g_xhat += tl.sum(dy * s[None, :] * x, axis=1) * rstd
            c = sum_g_xhat / N
            for start in range(0, N, BLOCK_N):
                chunk = start + cols
                mask = token_mask[:, None] & (chunk < N)[None, :]
                x, dy = load_grad_tile(x_head, dy_head, tokens, chunk, mask, stride_x,
                                       stride_dy, "evict_first")
                s = load_param(w_row, chunk, chunk < N, offset, 1.0, True)
                x_hat = x * rstd[:, None]
                dx = rstd[:, None] * (dy * s[None, :] - x_hat * c[:, None])
                tl.store(DX + tokens[:, None] * stride_dx + head * N + chunk[None, :],
                         dx.to(DX.dtype.element_ty), mask=mask)
                tl.debug_barrier()  # the partial row is read and written by this program only
                dw = tl.load(dw_row + chunk, mask=chunk < N, other=0.0)
                tl.store(dw_row + chunk, dw + tl.sum(dy * x_hat, axis=0), mask=chunk < N)


@triton.jit
def _normalize(x, rstd, s, ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr):
    """y (float32) = s * cast(x_hat) ("llama") or x_hat * s ("gemma") for a (BLOCK_M, BLOCK)
    tile, s = offset + w."""
    x_hat = x * rstd[:, None]
    if ROUND_XHAT:
        x_hat = x_hat.to(X_DTYPE).to(tl.float32)
    return x_hat * s[None, :]

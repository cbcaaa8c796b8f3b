"""QK-Norm: RMSNorm of the query and the key projection, both in one launch.

A *row* is the vector that one set of statistics covers:

    scope per_head : one head of one token,       N = head_dim      (Qwen3, Gemma 3, Cohere)
    scope per_layer: the projection of one token, N = H * head_dim  (OLMo 2, MiniMax-M2)

so a tensor of T tokens has H_rows = H (per_head) or 1 (per_layer) rows per token. For a row x

    r    = rsqrt(mean_j x_j^2 + eps)             statistics in float32
    xhat = x * r
    s    = offset + w                            offset added in float32
    y    = s * cast(xhat)                        casting "llama" (cast: round to x's dtype)
    y    = cast(xhat * s)                        casting "gemma"

and backward, with g = dy * s (float32):

    dx   = r * (g - xhat * mean_j(g_j * xhat_j))
    dw   = sum over the rows that share w of dy * xhat

Program layout. Program p of one tensor, which has H_rows head slots per token, handles ROWS
consecutive tokens of one head slot:

    head slot   = p %  H_rows                    (always 0 for per_layer)
    token block = p // H_rows

so programs with neighbouring ids cover neighbouring memory (the head slots of the same
tokens) and all rows of a program use the same weight row. The latter keeps the weight
gradient deterministic without atomics: each backward program writes the float32 partial sum
of dy * xhat over its rows to its own row of DW_PARTIAL, and the launcher sums those rows.
The q programs come first and the k programs after them: one launch covers both tensors,
forward and backward.

Addressing. Element (token t, head slot h, column j) is at  t * stride_t + h * N + j,  its
weight at  h * w_head_stride + j  (w_head_stride = 0 when all heads share one weight row, N for
one weight row per head). Rows that fit in BLOCK_N stay in registers; longer rows (per_layer on
wide models) are read in BLOCK_N chunks, twice.

Under the Triton interpreter there is no bf16 arithmetic: values are upcast to float32 right
after tl.load and cast down only right before tl.store (or to emulate the "llama" rounding).
"""

import triton
import triton.language as tl


@triton.jit
def _tile(pid, n_tokens, n_heads, ROWS: tl.constexpr):
    """Head slot, the ROWS token indices and their mask for program ``pid`` of one tensor."""
    head = pid % n_heads
    tokens = (pid // n_heads) * ROWS + tl.arange(0, ROWS)
    return head, tokens.to(tl.int64), tokens < n_tokens


@triton.jit
def _normalize(x, rstd, w, offset, ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr):
    """y (float32) = s * cast(xhat) ("llama") or xhat * s ("gemma") for a (ROWS, BLOCK) tile."""
    xhat = x * rstd[:, None]
    if ROUND_XHAT:
        xhat = xhat.to(X_DTYPE).to(tl.float32)
    return xhat * (offset + w)[None, :]


@triton.jit
def _forward_tensor(X, W, Y, RSTD, pid, n_tokens, n_heads, stride_x, stride_y,
                    w_head_stride, eps, offset,
                    N: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROUND_XHAT: tl.constexpr):
    """Normalize the rows of one program of one tensor (q or k); store y and r."""
    head, tokens, token_mask = _tile(pid, n_tokens, n_heads, ROWS)
    x_rows = X + tokens[:, None] * stride_x + head * N      # (ROWS, 1) pointers to row starts
    y_rows = Y + tokens[:, None] * stride_y + head * N
    w_row = W + head * w_head_stride
    cols = tl.arange(0, BLOCK_N)
    if BLOCK_N >= N:
        # whole row in registers: one read, one write
        mask = token_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = _normalize(x, rstd, w, offset, ROUND_XHAT, X.dtype.element_ty)
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # pass 1: sum of squares over the chunks; pass 2: normalize chunk by chunk
        sum_sq = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = token_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sum_sq / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = token_mask[:, None] & (c < N)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_row + c, mask=c < N, other=0.0).to(tl.float32)
            y = _normalize(x, rstd, w, offset, ROUND_XHAT, X.dtype.element_ty)
            tl.store(y_rows + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + head * n_tokens + tokens, rstd, mask=token_mask)


@triton.jit
def qk_norm_fwd(Q, K, QW, KW, QY, KY, Q_RSTD, K_RSTD,
                n_tokens, q_heads, k_heads, n_q_programs,
                stride_q, stride_k, stride_qy, stride_ky, qw_head_stride, kw_head_stride,
                eps, offset,
                NQ: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr, ROUND_XHAT: tl.constexpr):
    """Forward of q and k. Grid: (n_q_programs + n_k_programs,), q programs first;
    q_heads / k_heads are the head slots per token (H_rows), n_q_programs = q_heads * blocks.

    Writes QY, KY (contiguous outputs) and the float32 inverse RMS Q_RSTD, K_RSTD laid out as
    (H_rows, n_tokens), which the backward reuses.
    """
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _forward_tensor(Q, QW, QY, Q_RSTD, pid, n_tokens, q_heads, stride_q, stride_qy,
                        qw_head_stride, eps, offset, NQ, ROWS, BLOCK_NQ, ROUND_XHAT)
    else:
        _forward_tensor(K, KW, KY, K_RSTD, pid - n_q_programs, n_tokens, k_heads,
                        stride_k, stride_ky, kw_head_stride, eps, offset, NK, ROWS, BLOCK_NK,
                        ROUND_XHAT)


@triton.jit
def _load_grad_chunk(x_rows, dy_rows, w_row, c, token_mask, N: tl.constexpr):
    """x, dy (float32, (ROWS, BLOCK_N)) and w (float32) of the columns ``c`` of a long row, and
    the chunk's mask: what both passes of the chunked backward read."""
    mask = token_mask[:, None] & (c < N)[None, :]
    x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_row + c, mask=c < N, other=0.0).to(tl.float32)
    return x, dy, w, mask


@triton.jit
def _backward_tensor(X, W, DY, DX, RSTD, DW_PARTIAL, pid, n_tokens, n_heads,
                     stride_x, stride_dy, stride_dx, w_head_stride, offset,
                     N: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx for the rows of one program of one tensor, and its partial dw row (length N)."""
    head, tokens, token_mask = _tile(pid, n_tokens, n_heads, ROWS)
    x_rows = X + tokens[:, None] * stride_x + head * N
    dy_rows = DY + tokens[:, None] * stride_dy + head * N
    dx_rows = DX + tokens[:, None] * stride_dx + head * N
    w_row = W + head * w_head_stride
    dw_row = DW_PARTIAL + pid * N
    rstd = tl.load(RSTD + head * n_tokens + tokens, mask=token_mask, other=0.0)
    cols = tl.arange(0, BLOCK_N)
    if BLOCK_N >= N:
        mask = token_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        xhat = x * rstd[:, None]
        g = dy * (offset + w)[None, :]
        mean_g_xhat = tl.sum(g * xhat, axis=1) / N
        dx = rstd[:, None] * (g - xhat * mean_g_xhat[:, None])
        tl.store(dx_rows + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dw_row + cols, tl.sum(dy * xhat, axis=0), mask=cols < N)
    else:
        # pass 1: mean(g * xhat) over the chunks; pass 2: dx and the dw partial chunk by chunk
        sum_g_xhat = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x, dy, w, mask = _load_grad_chunk(x_rows, dy_rows, w_row, c, token_mask, N)
            sum_g_xhat += tl.sum(dy * (offset + w)[None, :] * x, axis=1) * rstd
        mean_g_xhat = sum_g_xhat / N
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x, dy, w, mask = _load_grad_chunk(x_rows, dy_rows, w_row, c, token_mask, N)
            xhat = x * rstd[:, None]
            g = dy * (offset + w)[None, :]
            dx = rstd[:, None] * (g - xhat * mean_g_xhat[:, None])
            tl.store(dx_rows + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            tl.store(dw_row + c, tl.sum(dy * xhat, axis=0), mask=c < N)


@triton.jit
def qk_norm_bwd(Q, K, QW, KW, DQY, DKY, DQ, DK, Q_RSTD, K_RSTD, DQW_PARTIAL, DKW_PARTIAL,
                n_tokens, q_heads, k_heads, n_q_programs,
                stride_q, stride_k, stride_dqy, stride_dky, stride_dq, stride_dk,
                qw_head_stride, kw_head_stride, offset,
                NQ: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr):
    """Backward of q and k. Same grid as the forward; DQW_PARTIAL has one float32 row of length
    NQ per q program (DKW_PARTIAL likewise for k), summed by the launcher into the weight grads."""
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _backward_tensor(Q, QW, DQY, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens, q_heads,
                         stride_q, stride_dqy, stride_dq, qw_head_stride, offset,
                         NQ, ROWS, BLOCK_NQ)
    else:
        _backward_tensor(K, KW, DKY, DK, K_RSTD, DKW_PARTIAL, pid - n_q_programs, n_tokens,
                         k_heads, stride_k, stride_dky, stride_dk, kw_head_stride,
                         offset, NK, ROWS, BLOCK_NK)

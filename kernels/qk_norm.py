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

Program layout. A tensor's H_rows head slots per token are cut into slots of
``heads_per_slot`` consecutive heads; program p of the tensor handles one slot for a range of
``tokens_per_program`` tokens, head by head:

    slot        = p %  n_slots,   n_slots = ceil(H_rows / heads_per_slot)   (1 for per_layer)
    token group = p // n_slots

The launch plan picks heads_per_slot and the programs of each tensor
(``launch_plans.share_programs``): a slot per head where there are few tokens (decode: the
heads are the parallelism), several heads per slot where there are many (often every head,
one slot per tensor), so that q and k get programs in proportion to their heads and no SM
idles at the end (one program per head slot left 60 of 132 SMs idle with 72 head slots).
Programs are persistent: for each head a program loops over the BLOCK_M-token blocks of its
tokens, so it reads each weight row once; a backward program accumulates dy * x_hat in
registers and stores its float32 partial dw once, DW_PARTIAL[p] (one row per program) when
all heads share the weight, DW_PARTIAL[g, h] (one row per token group and head) when each
head has its own, so the partials cost a row per program or per head, not one per token
block (per_layer: not one row of H * head_dim floats per token). kernels/partials.py sums
them in a fixed order: deterministic without atomics. The q programs come first and the k
programs after them: one launch covers both tensors, forward and backward. A paired plan
(``launch_plans.pair_programs``: one slot per tensor, as many q as k programs over the same
tokens; the kernels' PAIRED) launches that many programs instead, and program p runs q
program p and then k program p: the q and the k rows of its tokens, a finer unit of work than
q's rows alone.

Addressing. Element (token t, head slot h, column j) is at  t * stride_t + h * N + j,  its
weight at  j  when all heads share one weight row, at  h * N + j  with one weight row per head
(W_PER_HEAD, a compile-time flag: the backward's partials differ); the inverse RMS of (h, t)
at  h * T + t. Token and head offsets are 64-bit: T * H * head_dim, and H_rows * T partial
or statistics entries, may pass 2^31. Rows that fit in BLOCK_N stay in registers (on sm_90,
per_layer rows of up to 131072 values too, a program then a cluster of CTAs: see
rms_norm.py); longer rows are read in BLOCK_N chunks, twice, and the chunked backward adds
each block's dw into its partial row.

Prefetch. The forward's single-pass loop over a head's token blocks is ``tl.range(...,
num_stages=NUM_STAGES)``, as in kernels/rms_norm.py: NUM_STAGES = s > 1 loads the next s − 1
blocks into shared memory (cp.async) while the current one is reduced; the plans set 1 unless
asked (launch_plans.PREFETCH_KERNELS, which leaves the backward out: it would spill).

Under the Triton interpreter there is no bf16 arithmetic: values are upcast to float32 right
after tl.load and cast down only right before tl.store (or to emulate the "llama" rounding).
"""

import triton
import triton.language as tl

from normtools._kernels.tiles import load_grad_tile, load_param, row_block


@triton.jit
def qk_norm_fwd(Q, K, QW, KW, QY, KY, Q_RSTD, K_RSTD,
                n_tokens, q_tokens_per_program, k_tokens_per_program, q_heads, k_heads,
                q_heads_per_slot, k_heads_per_slot, n_q_programs,
                stride_q, stride_k, stride_qy, stride_ky, eps, offset,
                NQ: tl.constexpr, NK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr, QW_PER_HEAD: tl.constexpr,
                KW_PER_HEAD: tl.constexpr, ROUND_XHAT: tl.constexpr, NUM_STAGES: tl.constexpr,
                PAIRED: tl.constexpr):
    """Forward of q and k. Grid: n_q_programs q programs, then the k programs, or with PAIRED
    n_q_programs grid programs that each run q program p and then k program p (see the module
    docstring); a program of q covers ``q_heads_per_slot`` of q's ``q_heads`` head slots
    (H_rows) for ``q_tokens_per_program`` tokens (k likewise).

    Writes QY, KY (contiguous outputs) and the float32 inverse RMS Q_RSTD, K_RSTD laid out as
    (H_rows, n_tokens), which the backward reuses.
    """
    pid = tl.program_id(0)
    if PAIRED:
        _forward_tensor(Q, QW, QY, Q_RSTD, pid, n_tokens, q_tokens_per_program, q_heads,
                        q_heads_per_slot, stride_q, stride_qy, eps, offset, NQ, BLOCK_M,
                        BLOCK_NQ, QW_PER_HEAD, ROUND_XHAT, NUM_STAGES)
        _forward_tensor(K, KW, KY, K_RSTD, pid, n_tokens, k_tokens_per_program, k_heads,
                        k_heads_per_slot, stride_k, stride_ky, eps, offset, NK, BLOCK_M,
                        BLOCK_NK, KW_PER_HEAD, ROUND_XHAT, NUM_STAGES)
    elif pid < n_q_programs:
        _forward_tensor(Q, QW, QY, Q_RSTD, pid, n_tokens, q_tokens_per_program, q_heads,
                        q_heads_per_slot, stride_q, stride_qy, eps, offset, NQ, BLOCK_M,
                        BLOCK_NQ, QW_PER_HEAD, ROUND_XHAT, NUM_STAGES)
    else:
        _forward_tensor(K, KW, KY, K_RSTD, pid - n_q_programs, n_tokens, k_tokens_per_program,
                        k_heads, k_heads_per_slot, stride_k, stride_ky, eps, offset, NK,
                        BLOCK_M, BLOCK_NK, KW_PER_HEAD, ROUND_XHAT, NUM_STAGES)


@triton.jit
def qk_norm_bwd(Q, K, QW, KW, DQY, DKY, DQ, DK, Q_RSTD, K_RSTD, DQW_PARTIAL, DKW_PARTIAL,
                n_tokens, q_tokens_per_program, k_tokens_per_program, q_heads, k_heads,
                q_heads_per_slot, k_heads_per_slot, n_q_programs,
                stride_q, stride_k, stride_dqy, stride_dky, stride_dq, stride_dk, offset,
                NQ: tl.constexpr, NK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr, QW_PER_HEAD: tl.constexpr,
                KW_PER_HEAD: tl.constexpr, PAIRED: tl.constexpr):
    """Backward of q and k. Same grid as the forward; DQW_PARTIAL receives q's float32
    partial dw rows of length NQ (one per q program when the heads share the weight, else one
    per token group and head; DKW_PARTIAL likewise for k), summed by the launcher into the
    weight grads."""
    pid = tl.program_id(0)
    if PAIRED:
        _backward_tensor(Q, QW, DQY, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens,
                         q_tokens_per_program, q_heads, q_heads_per_slot, stride_q, stride_dqy,
                         stride_dq, offset, NQ, BLOCK_M, BLOCK_NQ, QW_PER_HEAD)
        _backward_tensor(K, KW, DKY, DK, K_RSTD, DKW_PARTIAL, pid, n_tokens,
                         k_tokens_per_program, k_heads, k_heads_per_slot, stride_k, stride_dky,
                         stride_dk, offset, NK, BLOCK_M, BLOCK_NK, KW_PER_HEAD)
    elif pid < n_q_programs:
        _backward_tensor(Q, QW, DQY, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens,
                         q_tokens_per_program, q_heads, q_heads_per_slot, stride_q, stride_dqy,
                         stride_dq, offset, NQ, BLOCK_M, BLOCK_NQ, QW_PER_HEAD)
    else:
        _backward_tensor(K, KW, DKY, DK, K_RSTD, DKW_PARTIAL, pid - n_q_programs, n_tokens,
                         k_tokens_per_program, k_heads, k_heads_per_slot, stride_k, stride_dky,
                         stride_dk, offset, NK, BLOCK_M, BLOCK_NK, KW_PER_HEAD)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _forward_tensor(X, W, Y, RSTD, pid, n_tokens, tokens_per_program, n_heads, heads_per_slot,
                    stride_x, stride_y, eps, offset,
                    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    W_PER_HEAD: tl.constexpr, ROUND_XHAT: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """Normalize the rows of one persistent program of one tensor (q or k), head by head of
    its slot; store y and rstd. A weight row is read once per program (a shared one for all
    its heads; per chunk and token block when chunked)."""
    SINGLE_PASS: tl.constexpr = BLOCK_N >= N
    n_slots = tl.cdiv(n_heads, heads_per_slot)
    head_start = (pid % n_slots) * heads_per_slot
    head_end = tl.minimum(head_start + heads_per_slot, n_heads)
    token_start = (pid // n_slots) * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS and not W_PER_HEAD:
        s = load_param(W, cols, cols < N, offset, 1.0, True)     # every head's weight, once
    for i in range(0, head_end - head_start):
        head = head_start.to(tl.int64) + i
        w_row = W + head * N if W_PER_HEAD else W
        if SINGLE_PASS:
            # whole row in registers: one read, one write
            if W_PER_HEAD:
                s = load_param(w_row, cols, cols < N, offset, 1.0, True)
            for block_start in tl.range(token_start, token_end, BLOCK_M, num_stages=NUM_STAGES):
                tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
                mask = token_mask[:, None] & (cols < N)[None, :]
                x = tl.load(X + tokens[:, None] * stride_x + head * N + cols[None, :],
                            mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
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
                     n_heads, heads_per_slot, stride_x, stride_dy, stride_dx, offset,
                     N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     W_PER_HEAD: tl.constexpr):
    """dx for the tokens of one persistent program of one tensor, head by head of its slot,
    and its partial dw rows: one for the program when the heads share the weight
    (DW_PARTIAL[pid]), else one per head (DW_PARTIAL[token group, head])."""
    SINGLE_PASS: tl.constexpr = BLOCK_N >= N
    n_slots = tl.cdiv(n_heads, heads_per_slot)
    head_start = (pid % n_slots) * heads_per_slot
    head_end = tl.minimum(head_start + heads_per_slot, n_heads)
    token_group = pid // n_slots
    token_start = token_group * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    shared_row = DW_PARTIAL + pid.to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if not W_PER_HEAD:
            s = load_param(W, cols, cols < N, offset, 1.0, True)     # every head's weight, once
        for i in range(0, head_end - head_start):
            head = head_start.to(tl.int64) + i
            if W_PER_HEAD:
                s = load_param(W + head * N, cols, cols < N, offset, 1.0, True)
            x_head, dy_head = X + head * N, DY + head * N
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
            if W_PER_HEAD:       # this head's own weight row: its partial, then afresh
                tl.store(DW_PARTIAL + (token_group * n_heads + head) * N + cols,
                         tl.sum(dw_acc, axis=0), mask=cols < N)
                dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if not W_PER_HEAD:
            tl.store(shared_row + cols, tl.sum(dw_acc, axis=0), mask=cols < N)
    else:
        # per token block: pass 1 c = mean(g * x_hat) over the chunks; pass 2 dx chunk by
        # chunk, each chunk's dw added into the partial row (zeroed first)
        if not W_PER_HEAD:
            _zero_row(shared_row, N, BLOCK_N)
        for i in range(0, head_end - head_start):
            head = head_start.to(tl.int64) + i
            w_row = W + head * N if W_PER_HEAD else W
            x_head, dy_head = X + head * N, DY + head * N
            if W_PER_HEAD:
                dw_row = DW_PARTIAL + (token_group * n_heads + head) * N
                _zero_row(dw_row, N, BLOCK_N)
            else:
                dw_row = shared_row
            for block_start in range(token_start, token_end, BLOCK_M):
                tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
                rstd = tl.load(RSTD + head * n_tokens + tokens, mask=token_mask, other=0.0)
                sum_g_xhat = tl.zeros([BLOCK_M], dtype=tl.float32)
                for start in range(0, N, BLOCK_N):
                    chunk, mask, x, dy, s = _grad_chunk(x_head, dy_head, w_row, tokens,
                                                        token_mask, start + cols, stride_x,
                                                        stride_dy, offset, N, "evict_last")
                    sum_g_xhat += tl.sum(dy * s[None, :] * x, axis=1) * rstd
                c = sum_g_xhat / N
                for start in range(0, N, BLOCK_N):
                    chunk, mask, x, dy, s = _grad_chunk(x_head, dy_head, w_row, tokens,
                                                        token_mask, start + cols, stride_x,
                                                        stride_dy, offset, N, "evict_first")
                    x_hat = x * rstd[:, None]
                    dx = rstd[:, None] * (dy * s[None, :] - x_hat * c[:, None])
                    tl.store(DX + tokens[:, None] * stride_dx + head * N + chunk[None, :],
                             dx.to(DX.dtype.element_ty), mask=mask)
                    tl.debug_barrier()  # the partial row is read and written by this program only
                    dw = tl.load(dw_row + chunk, mask=chunk < N, other=0.0)
                    tl.store(dw_row + chunk, dw + tl.sum(dy * x_hat, axis=0), mask=chunk < N)


@triton.jit
def _grad_chunk(x_head, dy_head, w_row, tokens, token_mask, chunk, stride_x, stride_dy, offset,
                N: tl.constexpr, EVICTION: tl.constexpr):
    """Columns ``chunk`` of the tokens' rows: the columns, their mask, x and dy (float32) and
    the scale s = offset + w."""
    mask = token_mask[:, None] & (chunk < N)[None, :]
    x, dy = load_grad_tile(x_head, dy_head, tokens, chunk, mask, stride_x, stride_dy, EVICTION)
    return chunk, mask, x, dy, load_param(w_row, chunk, chunk < N, offset, 1.0, True)


@triton.jit
def _zero_row(ROW, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store N float32 zeros at ROW, BLOCK_N at a time."""
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        tl.store(ROW + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)


@triton.jit
def _normalize(x, rstd, s, ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr):
    """y (float32) = s * cast(x_hat) ("llama") or x_hat * s ("gemma") for a (BLOCK_M, BLOCK)
    tile, s = offset + w."""
    x_hat = x * rstd[:, None]
    if ROUND_XHAT:
        x_hat = x_hat.to(X_DTYPE).to(tl.float32)
    return x_hat * s[None, :]

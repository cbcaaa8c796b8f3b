"""Fused QK-Norm + RoPE: RMSNorm of the query and key projections, then the rotary embedding,
one launch for q and k in each direction.

launched by: normtools.core.rope (qk_norm_rope), plans from normtools.core.launch_plans.

In Qwen3, Gemma 3 and OLMo 2 the rotary embedding follows QK-Norm, so the two can share one
read and one write of q and k (vLLM fuses them for inference). The norm is that of
kernels/qk_norm.py. A *row* is what one set of statistics covers:

    scope per_head : one head of one token,       N = head_dim
    scope per_layer: the projection of one token, N = H * head_dim   (its H heads)

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

Program layout. The heads of a token are worked on BLOCK_H at a time, as one
(BLOCK_M tokens, BLOCK_H heads, BLOCK_HALF columns) tile per half of the head. A *slot* is what
one program covers across the tokens: per_head, tiles_per_slot consecutive tiles of BLOCK_H
heads (n_slots = ceil(H / (BLOCK_H · tiles_per_slot)) slots per tensor, the last one may hold
fewer), worked one tile after another; per_layer, the whole row (one slot, its heads in
GROUPS = H / BLOCK_H tiles). Program p of a tensor handles slot p % n_slots for the tokens
[(p // n_slots) · tokens_per_program, +tokens_per_program), BLOCK_M at a time. The grid is
persistent. Each tensor has its own tokens_per_program and tiles_per_slot. The launch plan
either splits the grid, the q programs first, then the k programs, in proportion to the heads
of their slots (so that a k program of Hk heads is not done Hq / Hk times sooner than a q
program), and lets a program take several tiles when one tile per slot would leave SMs idle
(9 slots of 8 heads on 132 SMs: 14 programs per slot, 6 SMs without work); or it pairs them
(PAIRED, ``launch_plans.pair_programs``): one slot per tensor, as many q as k programs over
the same tokens and a grid of that many, program p running q program p and then k program p,
the q and the k heads of its tokens (a token's q and k together are a finer unit of work than
q's row alone).

Traffic. When every tile is a whole row (per_head always; per_layer while H · D fits one
tile, which the launch plan decides) a tile's weights are read once per program and every
token's x, cos and sin once per tile: with every head of q in one tile, q, k and the tables are
each read once per token and the outputs written once. A per_layer row longer than a tile is
read twice (pass 1: the sum of squares over its tiles; pass 2: normalize, rotate and store tile
by tile).
The backward reads x and do once per tile in the same cases, and twice for a long per_layer
row (pass 1: mean(g · x_hat); pass 2: dx and dw).

Weight gradient. Each backward program accumulates dy · x_hat over its tokens in registers
(BLOCK_H × D float32 per tile) and stores one partial per tile, deterministic and without
atomics; the launcher sums the partials with kernels/partials.py. A weight shared by all heads
(per_head (D,)): the partial of program p is DW_PARTIAL[p] (D values, summed over the heads of
its tiles). One weight row per head, or per_layer: DW_PARTIAL[g, h, c] for the program of
token group g (D values per head h, H · D per group). A long per_layer row adds tile by tile
into its program's own partial row instead (read, add, store), zeroed first.

Prefetch. The single-pass loop over a tile's token blocks is ``tl.range(..., num_stages=
NUM_STAGES)``, as in kernels/rms_norm.py: NUM_STAGES = s > 1 loads the next s − 1 blocks into
shared memory (cp.async) while the current one is worked on; the plans set 1 unless asked
(launch_plans.PREFETCH_KERNELS), and a per_layer row longer than a tile never prefetches.

Addressing. Element (token t, head h, column c) is at t · stride_t + h · D + c; its weight at
h · w_head_stride + c (w_head_stride = 0 when every head shares the weight, D otherwise); its
cos and sin at t · stride_cos + c. Offsets are 64-bit. Under the Triton interpreter there is
no bf16 arithmetic: values are upcast to float32 right after tl.load and cast down only to
store or to emulate a rounding.
"""

import triton
import triton.language as tl

from normtools._kernels.tiles import row_block


@triton.jit
def qk_norm_rope_fwd(Q, K, QW, KW, COS, SIN, QO, KO, Q_RSTD, K_RSTD,
                     n_tokens, q_tokens_per_program, k_tokens_per_program, q_slots, k_slots,
                     q_tiles_per_slot, k_tiles_per_slot,
                     n_q_programs, stride_q, stride_k, stride_qo, stride_ko, stride_cos,
                     stride_sin, qw_head_stride, kw_head_stride, eps, offset,
                     HEAD_DIM: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
                     PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HQ: tl.constexpr,
                     BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     ROUND_XHAT: tl.constexpr, Q_NORM_DTYPE: tl.constexpr,
                     K_NORM_DTYPE: tl.constexpr, Q_ROPE_DTYPE: tl.constexpr,
                     K_ROPE_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
                     PAIRED: tl.constexpr):
    """Forward of q and k. Grid: (n_q_programs + n_k_programs,), q programs first, or with
    PAIRED (n_q_programs,), program p running q program p and then k program p; q_slots /
    k_slots slots of q_tiles_per_slot / k_tiles_per_slot tiles per tensor (see the module
    docstring). Writes QO, KO and the float32 inverse RMS Q_RSTD, K_RSTD laid out
    (H_rows, n_tokens): H_rows = H per head, 1 per layer."""
    pid = tl.program_id(0)
    if PAIRED:
        _forward_tensor(Q, QW, COS, SIN, QO, Q_RSTD, pid, n_tokens, q_tokens_per_program,
                        q_slots, q_tiles_per_slot, stride_q, stride_qo, stride_cos, stride_sin,
                        qw_head_stride, eps, offset, HEAD_DIM, Q_HEADS, PER_LAYER, BLOCK_M,
                        BLOCK_HQ, BLOCK_HALF, ROUND_XHAT, Q_NORM_DTYPE, Q_ROPE_DTYPE,
                        NUM_STAGES)
        _forward_tensor(K, KW, COS, SIN, KO, K_RSTD, pid, n_tokens, k_tokens_per_program,
                        k_slots, k_tiles_per_slot, stride_k, stride_ko, stride_cos, stride_sin,
                        kw_head_stride, eps, offset, HEAD_DIM, K_HEADS, PER_LAYER, BLOCK_M,
                        BLOCK_HK, BLOCK_HALF, ROUND_XHAT, K_NORM_DTYPE, K_ROPE_DTYPE,
                        NUM_STAGES)
    elif pid < n_q_programs:
        _forward_tensor(Q, QW, COS, SIN, QO, Q_RSTD, pid, n_tokens, q_tokens_per_program,
                        q_slots, q_tiles_per_slot, stride_q, stride_qo, stride_cos, stride_sin,
                        qw_head_stride, eps, offset, HEAD_DIM, Q_HEADS, PER_LAYER, BLOCK_M,
                        BLOCK_HQ, BLOCK_HALF, ROUND_XHAT, Q_NORM_DTYPE, Q_ROPE_DTYPE,
                        NUM_STAGES)
    else:
        _forward_tensor(K, KW, COS, SIN, KO, K_RSTD, pid - n_q_programs, n_tokens,
                        k_tokens_per_program, k_slots, k_tiles_per_slot, stride_k, stride_ko,
                        stride_cos, stride_sin, kw_head_stride, eps, offset, HEAD_DIM, K_HEADS,
                        PER_LAYER, BLOCK_M, BLOCK_HK, BLOCK_HALF, ROUND_XHAT, K_NORM_DTYPE,
                        K_ROPE_DTYPE, NUM_STAGES)


@triton.jit
def qk_norm_rope_bwd(Q, K, QW, KW, COS, SIN, DQO, DKO, DQ, DK, Q_RSTD, K_RSTD,
                     DQW_PARTIAL, DKW_PARTIAL,
                     n_tokens, q_tokens_per_program, k_tokens_per_program, q_slots, k_slots,
                     q_tiles_per_slot, k_tiles_per_slot,
                     n_q_programs, stride_q, stride_k, stride_dqo, stride_dko, stride_dq,
                     stride_dk, stride_cos, stride_sin, qw_head_stride, kw_head_stride, offset,
                     HEAD_DIM: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
                     PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HQ: tl.constexpr,
                     BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     NUM_STAGES: tl.constexpr, PAIRED: tl.constexpr):
    """Backward of q and k. Same grid as the forward; DQW_PARTIAL / DKW_PARTIAL receive the
    float32 partial weight gradients (layout in the module docstring), summed by the
    launcher."""
    pid = tl.program_id(0)
    if PAIRED:
        _backward_tensor(Q, QW, COS, SIN, DQO, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens,
                         q_tokens_per_program, q_slots, q_tiles_per_slot, stride_q, stride_dqo,
                         stride_dq, stride_cos, stride_sin, qw_head_stride, offset, HEAD_DIM,
                         Q_HEADS, PER_LAYER, BLOCK_M, BLOCK_HQ, BLOCK_HALF, NUM_STAGES)
        _backward_tensor(K, KW, COS, SIN, DKO, DK, K_RSTD, DKW_PARTIAL, pid, n_tokens,
                         k_tokens_per_program, k_slots, k_tiles_per_slot, stride_k, stride_dko,
                         stride_dk, stride_cos, stride_sin, kw_head_stride, offset, HEAD_DIM,
                         K_HEADS, PER_LAYER, BLOCK_M, BLOCK_HK, BLOCK_HALF, NUM_STAGES)
    elif pid < n_q_programs:
        _backward_tensor(Q, QW, COS, SIN, DQO, DQ, Q_RSTD, DQW_PARTIAL, pid, n_tokens,
                         q_tokens_per_program, q_slots, q_tiles_per_slot, stride_q, stride_dqo,
                         stride_dq, stride_cos, stride_sin, qw_head_stride, offset, HEAD_DIM,
                         Q_HEADS, PER_LAYER, BLOCK_M, BLOCK_HQ, BLOCK_HALF, NUM_STAGES)
    else:
        _backward_tensor(K, KW, COS, SIN, DKO, DK, K_RSTD, DKW_PARTIAL, pid - n_q_programs,
                         n_tokens, k_tokens_per_program, k_slots, k_tiles_per_slot, stride_k,
                         stride_dko, stride_dk, stride_cos, stride_sin, kw_head_stride, offset,
                         HEAD_DIM, K_HEADS, PER_LAYER, BLOCK_M, BLOCK_HK, BLOCK_HALF,
                         NUM_STAGES)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _forward_tensor(X, W, COS, SIN, OUT, RSTD, pid, n_tokens, tokens_per_program, n_slots,
                    tiles_per_slot, stride_x, stride_out, stride_cos, stride_sin, w_head_stride,
                    eps, offset, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
                    PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, ROUND_XHAT: tl.constexpr,
                    NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """Normalize and rotate the tokens of one program of one tensor (q or k); store o and
    rstd."""
    TILES: tl.constexpr = (HEADS + BLOCK_H - 1) // BLOCK_H
    GROUPS: tl.constexpr = TILES if PER_LAYER else 1
    SINGLE_PASS: tl.constexpr = GROUPS == 1     # every tile is a whole row
    slot = pid % n_slots
    token_start = (pid // n_slots) * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < HEAD_DIM // 2
    X_DTYPE: tl.constexpr = X.dtype.element_ty
    if SINGLE_PASS:
        # The slot's tiles one after another: a tile's weights once per program, each
        # token's tile once.
        first_tile = slot * tiles_per_slot
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_slot, TILES)):
            heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            head_mask = heads < HEADS
            s1, s2 = _scale_halves(W, heads, head_mask, half, half_mask, w_head_stride,
                                   offset, HEAD_DIM)
            _forward_tile(X, COS, SIN, OUT, RSTD, s1, s2, heads, head_mask, half, half_mask,
                          token_start, token_end, n_tokens, stride_x, stride_out, stride_cos,
                          stride_sin, eps, HEAD_DIM, HEADS, PER_LAYER, BLOCK_M, ROUND_XHAT,
                          X_DTYPE, NORM_DTYPE, ROPE_DTYPE, NUM_STAGES)
    else:
        # A per_layer row longer than a tile: pass 1, the sum of squares over its tiles;
        # pass 2, normalize, rotate and store tile by tile (the tiles again, their weights
        # once per token block).
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for group in range(GROUPS):
                heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
                x1, x2, mask = _load_tile(X, tokens, token_mask, heads, heads < HEADS, half,
                                          half_mask, stride_x, HEAD_DIM, "evict_last")
                sum_sq += tl.sum(tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2), axis=1)
            rstd = tl.rsqrt(sum_sq / (HEADS * HEAD_DIM) + eps)
            tl.store(RSTD + tokens, rstd, mask=token_mask)
            cos1, cos2, sin1, sin2 = _load_tables(COS, SIN, tokens, token_mask, half,
                                                  half_mask, stride_cos, stride_sin, HEAD_DIM)
            for group in range(GROUPS):
                heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
                head_mask = heads < HEADS
                s1, s2 = _scale_halves(W, heads, head_mask, half, half_mask, w_head_stride,
                                       offset, HEAD_DIM)
                x1, x2, mask = _load_tile(X, tokens, token_mask, heads, head_mask, half,
                                          half_mask, stride_x, HEAD_DIM, "evict_first")
                _normalize_rotate_store(x1, x2, rstd[:, None, None], s1, s2, cos1, cos2, sin1,
                                        sin2, OUT, tokens, heads, half, mask, stride_out,
                                        HEAD_DIM, ROUND_XHAT, X_DTYPE, NORM_DTYPE, ROPE_DTYPE)


@triton.jit
def _forward_tile(X, COS, SIN, OUT, RSTD, s1, s2, heads, head_mask, half, half_mask,
                  token_start, token_end, n_tokens, stride_x, stride_out, stride_cos,
                  stride_sin, eps, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
                  PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr, ROUND_XHAT: tl.constexpr,
                  X_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    """One tile of heads that holds its rows whole (per_head: each head a row; per_layer: the
    tile is the row), over the tokens [token_start, token_end), BLOCK_M at a time: rstd,
    stored; o = RoPE(norm(x)), stored."""
    for block_start in tl.range(token_start, token_end, BLOCK_M, num_stages=NUM_STAGES):
        tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
        cos1, cos2, sin1, sin2 = _load_tables(COS, SIN, tokens, token_mask, half,
                                              half_mask, stride_cos, stride_sin, HEAD_DIM)
        x1, x2, mask = _load_tile(X, tokens, token_mask, heads, head_mask, half, half_mask,
                                  stride_x, HEAD_DIM, "evict_first")
        sum_sq = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)     # (BLOCK_M, BLOCK_H)
        if PER_LAYER:
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / (HEADS * HEAD_DIM) + eps)
            tl.store(RSTD + tokens, rstd, mask=token_mask)
            rstd3 = rstd[:, None, None]
        else:
            rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)
            tl.store(RSTD + heads[None, :].to(tl.int64) * n_tokens + tokens[:, None], rstd,
                     mask=token_mask[:, None] & head_mask[None, :])
            rstd3 = rstd[:, :, None]
        _normalize_rotate_store(x1, x2, rstd3, s1, s2, cos1, cos2, sin1, sin2, OUT,
                                tokens, heads, half, mask, stride_out, HEAD_DIM, ROUND_XHAT,
                                X_DTYPE, NORM_DTYPE, ROPE_DTYPE)


@triton.jit
def _normalize_rotate_store(x1, x2, rstd3, s1, s2, cos1, cos2, sin1, sin2, OUT, tokens, heads,
                            half, mask, stride_out, HEAD_DIM: tl.constexpr,
                            ROUND_XHAT: tl.constexpr, X_DTYPE: tl.constexpr,
                            NORM_DTYPE: tl.constexpr, ROPE_DTYPE: tl.constexpr):
    """One tile: y = norm(x), rounded to NORM_DTYPE; o = RoPE(y) with every product and the
    sum rounded to ROPE_DTYPE; store o in the output's dtype."""
    y1 = x1 * rstd3
    y2 = x2 * rstd3
    if ROUND_XHAT:
        y1 = y1.to(X_DTYPE).to(tl.float32)
        y2 = y2.to(X_DTYPE).to(tl.float32)
    y1 = (y1 * s1).to(NORM_DTYPE).to(tl.float32)
    y2 = (y2 * s2).to(NORM_DTYPE).to(tl.float32)
    o1 = (y1 * cos1).to(ROPE_DTYPE).to(tl.float32) - (y2 * sin1).to(ROPE_DTYPE).to(tl.float32)
    o2 = (y2 * cos2).to(ROPE_DTYPE).to(tl.float32) + (y1 * sin2).to(ROPE_DTYPE).to(tl.float32)
    out = OUT + _tile_offsets(tokens, heads, half, stride_out, HEAD_DIM)
    tl.store(out, o1.to(ROPE_DTYPE).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HEAD_DIM // 2, o2.to(ROPE_DTYPE).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _backward_tensor(X, W, COS, SIN, DO, DX, RSTD, DW_PARTIAL, pid, n_tokens,
                     tokens_per_program, n_slots, tiles_per_slot, stride_x, stride_do, stride_dx,
                     stride_cos, stride_sin, w_head_stride, offset, HEAD_DIM: tl.constexpr,
                     HEADS: tl.constexpr, PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NUM_STAGES: tl.constexpr):
    """dx for the tokens of one program of one tensor, and its partial weight gradient."""
    TILES: tl.constexpr = (HEADS + BLOCK_H - 1) // BLOCK_H
    GROUPS: tl.constexpr = TILES if PER_LAYER else 1
    SINGLE_PASS: tl.constexpr = GROUPS == 1     # every tile is a whole row
    slot = pid % n_slots
    token_group = pid // n_slots
    token_start = token_group * tokens_per_program
    token_end = tl.minimum(token_start + tokens_per_program, n_tokens)
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < HEAD_DIM // 2
    # this program's partial: (D,) per program for a shared weight, else its token group's
    # (H, D) rows
    if w_head_stride == 0:
        dw_tile = DW_PARTIAL + pid.to(tl.int64) * HEAD_DIM
    else:
        dw_tile = DW_PARTIAL + token_group.to(tl.int64) * (HEADS * HEAD_DIM)
    if SINGLE_PASS:
        # The slot's tiles one after another; a shared weight's partial sums every head of
        # them, one row per head is stored tile by tile.
        dw_shared1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        dw_shared2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        first_tile = slot * tiles_per_slot
        for tile in range(first_tile, tl.minimum(first_tile + tiles_per_slot, TILES)):
            heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            head_mask = heads < HEADS
            dw1, dw2 = _backward_tile(X, W, COS, SIN, DO, DX, RSTD, heads, head_mask, half,
                                      half_mask, token_start, token_end, n_tokens, stride_x,
                                      stride_do, stride_dx, stride_cos, stride_sin,
                                      w_head_stride, offset, HEAD_DIM, HEADS, PER_LAYER,
                                      BLOCK_M, BLOCK_H, BLOCK_HALF, NUM_STAGES)
            if w_head_stride == 0:
                dw_shared1 += tl.sum(dw1, axis=0)
                dw_shared2 += tl.sum(dw2, axis=0)
            else:
                dw_mask = head_mask[:, None] & half_mask[None, :]
                dw_heads = dw_tile + heads[:, None].to(tl.int64) * HEAD_DIM + half[None, :]
                tl.store(dw_heads, dw1, mask=dw_mask)
                tl.store(dw_heads + HEAD_DIM // 2, dw2, mask=dw_mask)
        if w_head_stride == 0:   # heads share the weight: one (D,) partial
            tl.store(dw_tile + half, dw_shared1, mask=half_mask)
            tl.store(dw_tile + HEAD_DIM // 2 + half, dw_shared2, mask=half_mask)
    else:
        # A per_layer row longer than a tile: pass 1, c = mean(g · x_hat) over its tiles;
        # pass 2, dx tile by tile, and dw added into this program's partial row.
        for group in range(GROUPS):
            heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
            dw_mask = (heads < HEADS)[:, None] & half_mask[None, :]
            dw_heads = dw_tile + heads[:, None].to(tl.int64) * HEAD_DIM + half[None, :]
            tl.store(dw_heads, tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32), mask=dw_mask)
            tl.store(dw_heads + HEAD_DIM // 2, tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32),
                     mask=dw_mask)
        for block_start in range(token_start, token_end, BLOCK_M):
            tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
            rstd = tl.load(RSTD + tokens, mask=token_mask, other=0.0)[:, None, None]
            sum_g_xhat = tl.zeros([BLOCK_M], dtype=tl.float32)
            for group in range(GROUPS):
                heads, head_mask, s1, s2, x1, x2, dy1, dy2, mask = _group_grad_tile(
                    X, DO, COS, SIN, W, tokens, token_mask, group, half, half_mask, stride_x,
                    stride_do, stride_cos, stride_sin, w_head_stride, offset, HEAD_DIM, HEADS,
                    BLOCK_H, "evict_last")
                sum_g_xhat += tl.sum(tl.sum(dy1 * s1 * x1 * rstd, axis=2)
                              + tl.sum(dy2 * s2 * x2 * rstd, axis=2), axis=1)
            c = (sum_g_xhat / (HEADS * HEAD_DIM))[:, None, None]
            for group in range(GROUPS):
                heads, head_mask, s1, s2, x1, x2, dy1, dy2, mask = _group_grad_tile(
                    X, DO, COS, SIN, W, tokens, token_mask, group, half, half_mask, stride_x,
                    stride_do, stride_cos, stride_sin, w_head_stride, offset, HEAD_DIM, HEADS,
                    BLOCK_H, "evict_first")
                x_hat1 = x1 * rstd
                x_hat2 = x2 * rstd
                _dx_store(DX, tokens, heads, half, mask, stride_dx,
                          rstd * (dy1 * s1 - x_hat1 * c), rstd * (dy2 * s2 - x_hat2 * c),
                          HEAD_DIM)
                dw_mask = head_mask[:, None] & half_mask[None, :]
                dw_heads = dw_tile + heads[:, None].to(tl.int64) * HEAD_DIM + half[None, :]
                tl.store(dw_heads, tl.load(dw_heads, mask=dw_mask, other=0.0)
                         + tl.sum(dy1 * x_hat1, axis=0), mask=dw_mask)
                tl.store(dw_heads + HEAD_DIM // 2,
                         tl.load(dw_heads + HEAD_DIM // 2, mask=dw_mask, other=0.0)
                         + tl.sum(dy2 * x_hat2, axis=0), mask=dw_mask)


@triton.jit
def _backward_tile(X, W, COS, SIN, DO, DX, RSTD, heads, head_mask, half, half_mask,
                   token_start, token_end, n_tokens, stride_x, stride_do, stride_dx,
                   stride_cos, stride_sin, w_head_stride, offset, HEAD_DIM: tl.constexpr,
                   HEADS: tl.constexpr, PER_LAYER: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One tile of heads that holds its rows whole (as in _forward_tile), over the tokens
    [token_start, token_end), BLOCK_M at a time: dx, stored; returns Σ over the tokens of
    dy · x_hat, two halves (float32, (BLOCK_H, BLOCK_HALF))."""
    s1, s2 = _scale_halves(W, heads, head_mask, half, half_mask, w_head_stride, offset,
                           HEAD_DIM)
    dw1 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    for block_start in tl.range(token_start, token_end, BLOCK_M, num_stages=NUM_STAGES):
        tokens, token_mask = row_block(block_start, token_end, BLOCK_M)
        x1, x2, dy1, dy2, mask = _load_x_dy_halves(X, DO, COS, SIN, tokens, token_mask,
                                                   heads, head_mask, half, half_mask,
                                                   stride_x, stride_do, stride_cos,
                                                   stride_sin, HEAD_DIM, "evict_first")
        g1 = dy1 * s1
        g2 = dy2 * s2
        if PER_LAYER:
            rstd = tl.load(RSTD + tokens, mask=token_mask, other=0.0)[:, None, None]
        else:
            rstd = tl.load(RSTD + heads[None, :].to(tl.int64) * n_tokens + tokens[:, None],
                           mask=token_mask[:, None] & head_mask[None, :],
                           other=0.0)[:, :, None]
        x_hat1 = x1 * rstd
        x_hat2 = x2 * rstd
        # (BLOCK_M, BLOCK_H): Σ g · x_hat over each head
        sum_g_xhat = tl.sum(g1 * x_hat1, axis=2) + tl.sum(g2 * x_hat2, axis=2)
        if PER_LAYER:
            c = (tl.sum(sum_g_xhat, axis=1) / (HEADS * HEAD_DIM))[:, None, None]
        else:
            c = (sum_g_xhat / HEAD_DIM)[:, :, None]
        _dx_store(DX, tokens, heads, half, mask, stride_dx, rstd * (g1 - x_hat1 * c),
                  rstd * (g2 - x_hat2 * c), HEAD_DIM)
        dw1 += tl.sum(dy1 * x_hat1, axis=0)
        dw2 += tl.sum(dy2 * x_hat2, axis=0)
    return dw1, dw2


@triton.jit
def _load_x_dy_halves(X, DO, COS, SIN, tokens, token_mask, heads, head_mask, half, half_mask,
                      stride_x, stride_do, stride_cos, stride_sin, HEAD_DIM: tl.constexpr,
                      EVICTION: tl.constexpr):
    """x (two halves) and dy = RoPEᵀ(do) of one tile, float32, and the tile's mask."""
    x1, x2, mask = _load_tile(X, tokens, token_mask, heads, head_mask, half, half_mask,
                              stride_x, HEAD_DIM, EVICTION)
    do1, do2, _ = _load_tile(DO, tokens, token_mask, heads, head_mask, half, half_mask,
                             stride_do, HEAD_DIM, EVICTION)
    cos1, cos2, sin1, sin2 = _load_tables(COS, SIN, tokens, token_mask, half, half_mask,
                                          stride_cos, stride_sin, HEAD_DIM)
    return x1, x2, do1 * cos1 + do2 * sin2, do2 * cos2 - do1 * sin1, mask


@triton.jit
def _group_grad_tile(X, DO, COS, SIN, W, tokens, token_mask, group, half, half_mask, stride_x,
                     stride_do, stride_cos, stride_sin, w_head_stride, offset,
                     HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                     EVICTION: tl.constexpr):
    """Tile ``group`` of a long per_layer row: its heads and their mask, the scale s, x and
    dy (two halves each) and the tile's mask."""
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < HEADS
    s1, s2 = _scale_halves(W, heads, head_mask, half, half_mask, w_head_stride, offset,
                           HEAD_DIM)
    x1, x2, dy1, dy2, mask = _load_x_dy_halves(X, DO, COS, SIN, tokens, token_mask, heads,
                                               head_mask, half, half_mask, stride_x, stride_do,
                                               stride_cos, stride_sin, HEAD_DIM, EVICTION)
    return heads, head_mask, s1, s2, x1, x2, dy1, dy2, mask


@triton.jit
def _tile_offsets(tokens, heads, half, stride, HEAD_DIM: tl.constexpr):
    """Element offsets (BLOCK_M, BLOCK_H, BLOCK_HALF) of the first halves of a tile's heads."""
    return (tokens[:, None, None] * stride + heads[None, :, None].to(tl.int64) * HEAD_DIM
            + half[None, None, :])


@triton.jit
def _load_tile(X, tokens, token_mask, heads, head_mask, half, half_mask, stride,
               HEAD_DIM: tl.constexpr, EVICTION: tl.constexpr):
    """The two halves (float32, (BLOCK_M, BLOCK_H, BLOCK_HALF)) of a tile, and its mask."""
    mask = (token_mask[:, None, None] & head_mask[None, :, None]) & half_mask[None, None, :]
    first = X + _tile_offsets(tokens, heads, half, stride, HEAD_DIM)
    x1 = tl.load(first, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=mask, other=0.0,
                 eviction_policy=EVICTION).to(tl.float32)
    return x1, x2, mask


@triton.jit
def _load_tables(COS, SIN, tokens, token_mask, half, half_mask, stride_cos, stride_sin,
                 HEAD_DIM: tl.constexpr):
    """cos and sin of the tokens, each as two halves (float32, (BLOCK_M, 1, BLOCK_HALF)). The q
    and the k programs both read them: evict_last."""
    mask = token_mask[:, None] & half_mask[None, :]
    cos = COS + tokens[:, None] * stride_cos + half[None, :]
    sin = SIN + tokens[:, None] * stride_sin + half[None, :]
    cos1 = tl.load(cos, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    cos2 = tl.load(cos + HEAD_DIM // 2, mask=mask, other=0.0,
                   eviction_policy="evict_last").to(tl.float32)
    sin1 = tl.load(sin, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    sin2 = tl.load(sin + HEAD_DIM // 2, mask=mask, other=0.0,
                   eviction_policy="evict_last").to(tl.float32)
    return cos1[:, None, :], cos2[:, None, :], sin1[:, None, :], sin2[:, None, :]


@triton.jit
def _scale_halves(W, heads, head_mask, half, half_mask, w_head_stride, offset,
                  HEAD_DIM: tl.constexpr):
    """s = offset + w of a tile's heads, two halves (float32, (1, BLOCK_H, BLOCK_HALF)).
    Every program reads the weights: evict_last."""
    mask = head_mask[:, None] & half_mask[None, :]
    w = W + heads[:, None].to(tl.int64) * w_head_stride + half[None, :]
    s1 = offset + tl.load(w, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s2 = offset + tl.load(w + HEAD_DIM // 2, mask=mask, other=0.0,
                          eviction_policy="evict_last").to(tl.float32)
    return s1[None, :, :], s2[None, :, :]


@triton.jit
def _dx_store(DX, tokens, heads, half, mask, stride_dx, dx1, dx2, HEAD_DIM: tl.constexpr):
    """Store the two halves of a tile's dx in DX's dtype."""
    dx = DX + _tile_offsets(tokens, heads, half, stride_dx, HEAD_DIM)
    tl.store(dx, dx1.to(DX.dtype.element_ty), mask=mask)
    tl.store(dx + HEAD_DIM // 2, dx2.to(DX.dtype.element_ty), mask=mask)

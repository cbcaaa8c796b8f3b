"""RMSNorm in Triton: forward (optionally fused with a residual add) and backward.

launched by: normtools.core.ops (rms_norm, add_rms_norm), plans from normtools.core.launch_plans.

Each row x ∈ R^N of the (M, N) input is normalized by its root mean square:

    rstd = rsqrt(mean(x², -1) + eps)        float32, saved for the backward pass
    x_hat = x · rstd
    y    = s ⊙ x_hat,   s = offset + w      (s = 1 without a weight)

Two casting conventions (see normtools.core.reference):

    "llama" (ROUND_XHAT):  y = s ⊙ x_hat.to(x.dtype)   x_hat is rounded to the input dtype first
    "gemma":               y = s ⊙ x_hat               multiply in float32; y rounded once at store

Backward. With g = s ⊙ dy, and using ∂rstd/∂x = −rstd³ x / N:

    dx = rstd · g − x · rstd³ · Σ(x ⊙ g) / N
       = rstd · (g − x_hat · c),    c = mean(x_hat ⊙ g)
    dw = Σ_rows dy ⊙ x_hat

Fused residual (the pre-norm hot path): x = x_in + residual is rounded to the input dtype,
stored as the second output, and normalized. Its gradient is the sum of the gradient through
the norm and the gradient of the stored sum, and it flows unchanged to x_in and residual.

Layout. Rows are addressed through their row stride (the last dimension has unit stride). A
row that fits in one block of BLOCK_N columns is read once (SINGLE_PASS; BLOCK_M rows per
program). On sm_90 and newer the launcher keeps rows of up to 131072 values in one block by
launching each program as a thread-block cluster of 2-16 CTAs (``num_ctas``): Triton spreads
the block over the cluster's SMs and sums across them through distributed shared memory, and
this source does not change. A longer row, or a long row before sm_90, is read in BLOCK_N-wide
chunks: the forward reads it twice (sum of
squares, then output; with a residual the second pass reads the stored sum, not both inputs),
the backward reads x and dy twice (c per row, then dx and dw).

Both grids are persistent: a program handles ``rows_per_program`` rows and reads the weight
once (once per chunk when chunked), not once per row. The chunked passes that need the weight
run column chunk by column chunk over all rows of the program.

Prefetch. The single-pass loop over a program's row blocks is ``tl.range(..., num_stages=
NUM_STAGES)``: with NUM_STAGES = s > 1, Triton loads the next s − 1 row blocks into shared
memory (cp.async) while the current one is reduced. The plans set 1, no prefetch, unless asked
(launch_plans.PREFETCH_KERNELS); whether it pays is for the GPU run to measure.

Traffic (A = one M × N activation): single pass: forward 2A (add: 4A), backward 3A (+A with a
residual gradient). Chunked: forward 3A (add: 5A), backward 5A. The bytes are counted by
normtools.measure.bytes_counter. Loads read once are marked evict_first; what a later pass
or every program re-reads (the weight, the first pass over a chunked row) evict_last.

Determinism. dw is reduced in two steps with no atomics: each program of the persistent
backward grid accumulates dy ⊙ x_hat over its rows in registers and stores its float32 partial
row DW_PARTIAL[pid] once (zeros when it got no rows); kernels/partials.py sums those rows in a
fixed order.

All arithmetic is float32: values are upcast right after tl.load and downcast before tl.store.
"""

import triton
import triton.language as tl

from normtools._kernels.tiles import load_grad_tile, load_param, row_block


@triton.jit
def rms_norm_fwd(
    X, RES, Y, SUM, W, RSTD,                # pointers; RES/SUM/W unused without residual/weight
    stride_x, stride_res, stride_y, stride_sum,   # row strides (elements)
    M, N, eps, offset, rows_per_program,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_XHAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Persistent program pid normalizes rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows; the weight is read once per program (per chunk when chunked)."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    X_DTYPE = X.dtype.element_ty

    if SINGLE_PASS:
        # The whole row is in registers: read it once, reduce, normalize, write.
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        s = load_param(W, cols, col_mask, offset, 1.0, HAS_WEIGHT)
        for block_start in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_x(X, RES, SUM, rows, cols, mask, stride_x, stride_res, stride_sum,
                        HAS_RESIDUAL, "evict_first")
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            tl.store(RSTD + rows, rstd, mask=row_mask)
            _normalize_store(Y, rows[:, None] * stride_y + cols[None, :], mask, x, rstd, s,
                             X_DTYPE, ROUND_XHAT)
    else:
        # Pass 1, row block by row block: sum of squares over the chunks of each row, rstd
        # stored (and the residual sum). Pass 2, column chunk by column chunk over all rows of
        # this program: the chunk's scale is read once, the row chunk again (the stored sum
        # with a residual) and y written.
        for block_start in range(row_start, row_end, BLOCK_M):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            sum_sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols[None, :] < N)
                x = _load_x(X, RES, SUM, rows, cols, mask, stride_x, stride_res, stride_sum,
                            HAS_RESIDUAL, "evict_last")
                sum_sq += x * x
            tl.store(RSTD + rows, tl.rsqrt(tl.sum(sum_sq, axis=1) / N + eps), mask=row_mask)
        tl.debug_barrier()  # rstd and the stored sum are re-read by other threads
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            s = load_param(W, cols, col_mask, offset, 1.0, HAS_WEIGHT)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                mask = row_mask[:, None] & col_mask[None, :]
                if HAS_RESIDUAL:
                    x = tl.load(SUM + rows[:, None] * stride_sum + cols[None, :], mask=mask,
                                other=0.0, eviction_policy="evict_first").to(tl.float32)
                else:
                    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask,
                                other=0.0, eviction_policy="evict_first").to(tl.float32)
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                _normalize_store(Y, rows[:, None] * stride_y + cols[None, :], mask, x, rstd, s,
                                 X_DTYPE, ROUND_XHAT)


@triton.jit
def rms_norm_bwd(
    DY, X, W, RSTD, DSUM, DX, DW_PARTIAL,   # DW_PARTIAL: (programs, N) float32
    ROW_C,                                  # (M,) float32 scratch of the chunked path: c per row
    stride_dy, stride_x, stride_dsum, stride_dx,
    M, N, offset, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_DSUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Persistent program pid handles rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows and writes its partial dw row DW_PARTIAL[pid] once."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        s = load_param(W, cols, col_mask, offset, 1.0, HAS_WEIGHT)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block_start in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            mask = row_mask[:, None] & col_mask[None, :]
            x, dy = load_grad_tile(X, DY, rows, cols, mask, stride_x, stride_dy, "evict_first")
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_hat = x * rstd[:, None]
            g = dy * s[None, :]
            c = tl.sum(x_hat * g, axis=1) / N                      # mean(x_hat ⊙ g)
            dx = rstd[:, None] * (g - x_hat * c[:, None])
            _dx_store(DX, DSUM, rows[:, None] * stride_dx + cols[None, :],
                      rows[:, None] * stride_dsum + cols[None, :], mask, dx, HAS_DSUM)
            dw_acc += dy * x_hat
        if HAS_WEIGHT:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # Long rows, two passes over the columns, each chunk's scale read once per program.
        # Pass 1: ROW_C[row] = Σ_chunks rstd · Σ(x ⊙ g) / N = c = mean(x_hat ⊙ g) of each row
        # of this program. Pass 2: dx, and the chunk's dw accumulated in registers over the
        # rows and stored once.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            s = load_param(W, cols, col_mask, offset, 1.0, HAS_WEIGHT)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                mask = row_mask[:, None] & col_mask[None, :]
                x, dy = load_grad_tile(X, DY, rows, cols, mask, stride_x, stride_dy,
                                       "evict_last")
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                c = rstd * tl.sum(x * dy * s[None, :], axis=1) / N
                if start > 0:
                    c += tl.load(ROW_C + rows, mask=row_mask, other=0.0)
                tl.store(ROW_C + rows, c, mask=row_mask)
            tl.debug_barrier()  # ROW_C is read back, by other threads of this program too
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            s = load_param(W, cols, col_mask, offset, 1.0, HAS_WEIGHT)
            dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                mask = row_mask[:, None] & col_mask[None, :]
                x, dy = load_grad_tile(X, DY, rows, cols, mask, stride_x, stride_dy,
                                       "evict_first")
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                c = tl.load(ROW_C + rows, mask=row_mask, other=0.0)
                x_hat = x * rstd[:, None]
                dx = rstd[:, None] * (dy * s[None, :] - x_hat * c[:, None])
                _dx_store(DX, DSUM, rows[:, None] * stride_dx + cols[None, :],
                          rows[:, None] * stride_dsum + cols[None, :], mask, dx, HAS_DSUM)
                dw_acc += dy * x_hat
            if HAS_WEIGHT:
                tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _load_x(X, RES, SUM, rows, cols, mask, stride_x, stride_res, stride_sum,
            HAS_RESIDUAL: tl.constexpr, EVICTION: tl.constexpr):
    """Load a tile of x as float32; with a residual, x = (x_in + residual) rounded to the input
    dtype, and stored to SUM."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy=EVICTION).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0,
                      eviction_policy="evict_first").to(tl.float32)
        x_sum = (x + res).to(SUM.dtype.element_ty)
        tl.store(SUM + rows[:, None] * stride_sum + cols[None, :], x_sum, mask=mask)
        x = x_sum.to(tl.float32)
    return x


@triton.jit
def _normalize_store(Y, y_offsets, mask, x, rstd, s, X_DTYPE: tl.constexpr,
                     ROUND_XHAT: tl.constexpr):
    """y = s ⊙ x_hat with x_hat = x · rstd, rounded as the casting convention says, stored."""
    x_hat = x * rstd[:, None]
    if ROUND_XHAT:
        x_hat = x_hat.to(X_DTYPE).to(tl.float32)
    y = x_hat * s[None, :]
    tl.store(Y + y_offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dx_store(DX, DSUM, dx_offsets, dsum_offsets, mask, dx, HAS_DSUM: tl.constexpr):
    """Store dx, adding the gradient of the fused residual sum when there is one."""
    if HAS_DSUM:
        dx += tl.load(DSUM + dsum_offsets, mask=mask, other=0.0,
                      eviction_policy="evict_first").to(tl.float32)
    tl.store(DX + dx_offsets, dx.to(DX.dtype.element_ty), mask=mask)

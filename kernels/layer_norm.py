"""LayerNorm in Triton: forward and backward.

launched by: normtools.core.ops (layer_norm), plans from normtools.core.launch_plans.

Each row x ∈ R^N of the (M, N) input is centred and scaled:

    mean  = mean(x, -1)                                 float32, saved
    rstd  = rsqrt(mean((x − mean)², -1) + eps)          float32, saved (biased variance)
    x_hat = (x − mean) · rstd
    y     = w ⊙ x_hat + b                 (w = 1, b = 0 when absent), rounded once to x.dtype

Backward. With g = w ⊙ dy, and differentiating through mean and rstd:

    dx = rstd · (g − c1 − x_hat · c2),   c1 = mean(g),  c2 = mean(x_hat ⊙ g)
    dw = Σ_rows dy ⊙ x_hat,    db = Σ_rows dy

Reductions. Each reduction of a row is an exchange between its threads, warps and, on a
cluster, CTAs, each exchange behind a barrier (a cluster barrier across SMs). The backward's
two sums are independent: they are packed as two float32 halves of one uint64 (_pack) and
reduced together, one exchange instead of two. The forward keeps two: Σ (x − mean)² needs the
mean first. (Its single-reduction form, Welford's (mean, M2, count) merged pairwise, needs the
count as a second value to exchange, and compiled for sm_90 at N = 65536 on a cluster of 4
CTAs it spilled; two reductions do not.)

Layout, chunking, prefetch and determinism follow kernels/rms_norm.py: rows are addressed
through their row stride; grids are persistent (a program loops over rows_per_program rows and
reads w and b once, or once per chunk); a row that fits in BLOCK_N columns is read once
(SINGLE_PASS), on sm_90 rows of up to 131072 values too, each program then a cluster of CTAs
(see rms_norm.py).
A longer row is read in chunks: the forward reads it twice, once for the statistics
(each chunk's mean and squared deviations, merged into the row's with Chan's formula, as
accurate as two passes) and once for the output; the backward reads x and dy twice (c1, c2
per row, then dx, dw and db column chunk by column chunk). Each program of the persistent
backward grid stores its float32 partial rows of dw and db once, in PARTIAL[pid]
((programs, slots, N): dw in slot 0, db in the next), zeros when it got no rows;
kernels/partials.py sums them. No atomics.

Traffic (A = one M × N activation): single pass forward 2A, backward 3A; chunked forward 3A,
backward 5A (normtools.measure.bytes_counter counts them).

All arithmetic is float32: values are upcast right after tl.load and downcast before tl.store.
"""

import triton
import triton.language as tl

from normtools._kernels.tiles import load_grad_tile, load_param, row_block


@triton.jit
def layer_norm_fwd(
    X, Y, W, B, MEAN, RSTD,                 # pointers; W/B unused without weight/bias
    stride_x, stride_y,                     # row strides (elements)
    M, N, eps, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Persistent program pid normalizes rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows; w and b are read once per program (per chunk when chunked)."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = load_param(W, cols, col_mask, -0.0, 1.0, HAS_WEIGHT)
        b = load_param(B, cols, col_mask, -0.0, 0.0, HAS_BIAS)
        for block_start in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            mean = tl.sum(x, axis=1) / N
            x_c = tl.where(mask, x - mean[:, None], 0.0)        # padding must not count
            rstd = tl.rsqrt(tl.sum(x_c * x_c, axis=1) / N + eps)
            y = x_c * rstd[:, None] * w[None, :] + b[None, :]
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty),
                     mask=mask)
            tl.store(MEAN + rows, mean, mask=row_mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        # Pass 1, row block by row block: mean and sum of squared deviations. Each chunk's own
        # (mean, M2) is exact two-pass arithmetic in registers; chunks merge with Chan's formula
        #   M2 += M2_chunk + δ² · n·n_chunk / (n + n_chunk),   δ = mean_chunk − mean.
        for block_start in range(row_start, row_end, BLOCK_M):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
            m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols[None, :] < N)
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
                n_seen = start * 1.0                             # values merged so far
                n_chunk = tl.minimum(N - start, BLOCK_N) * 1.0
                chunk_mean = tl.sum(x, axis=1) / n_chunk
                x_c = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                n_total = n_seen + n_chunk
                mean += delta * (n_chunk / n_total)
                m2 += tl.sum(x_c * x_c, axis=1) + delta * delta * (n_seen * n_chunk / n_total)
            tl.store(MEAN + rows, mean, mask=row_mask)
            tl.store(RSTD + rows, tl.rsqrt(m2 / N + eps), mask=row_mask)
        tl.debug_barrier()  # the statistics are re-read by other threads of this program
        # Pass 2, column chunk by column chunk over all rows of this program: w and b read
        # once, the rows' chunk again, y written.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            w = load_param(W, cols, col_mask, -0.0, 1.0, HAS_WEIGHT)
            b = load_param(B, cols, col_mask, -0.0, 0.0, HAS_BIAS)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                y = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
                tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty),
                         mask=mask)


@triton.jit
def layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, PARTIAL,      # PARTIAL: (programs, slots, N) float32
    ROW_C1_C2,                              # (2, M) float32 scratch of the chunked path: c1, c2
    stride_dy, stride_x, stride_dx,
    M, N, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Persistent program pid handles rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows and stores its partial rows of dw and db once."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    SLOTS: tl.constexpr = 2 if (HAS_WEIGHT and HAS_BIAS) else 1
    dw_row = PARTIAL + pid.to(tl.int64) * (SLOTS * N)
    db_row = dw_row + N if HAS_WEIGHT else dw_row

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = load_param(W, cols, col_mask, -0.0, 1.0, HAS_WEIGHT)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block_start in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
            rows, row_mask = row_block(block_start, row_end, BLOCK_M)
            x_hat, dy, rstd, mask = _load_xhat_dy(X, DY, MEAN, RSTD, rows, row_mask, cols,
                                                  col_mask, stride_x, stride_dy, "evict_first")
            g = dy * w[None, :]
            sum_g, sum_xhat_g = _unpack(tl.reduce(_pack(g, x_hat * g), 1, _add_packed))
            c1 = sum_g / N                                         # mean(g)
            c2 = sum_xhat_g / N                                    # mean(x_hat ⊙ g)
            dx = rstd[:, None] * (g - c1[:, None] - x_hat * c2[:, None])
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                     mask=mask)
            dw_acc += dy * x_hat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # Long rows, two passes over the columns, each chunk of w read once per program.
        # Pass 1: ROW_C1_C2[0, row] = c1 = mean(g) and ROW_C1_C2[1, row] = c2 = mean(x_hat ⊙ g),
        # summed chunk by chunk. Pass 2: dx, and the chunk's dw and db accumulated in
        # registers over the rows and stored once.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            w = load_param(W, cols, col_mask, -0.0, 1.0, HAS_WEIGHT)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                x_hat, dy, _, mask = _load_xhat_dy(X, DY, MEAN, RSTD, rows, row_mask, cols,
                                                   col_mask, stride_x, stride_dy, "evict_last")
                g = dy * w[None, :]
                sum_g, sum_xhat_g = _unpack(tl.reduce(_pack(g, x_hat * g), 1, _add_packed))
                c1 = sum_g / N
                c2 = sum_xhat_g / N
                if start > 0:
                    c1 += tl.load(ROW_C1_C2 + rows, mask=row_mask, other=0.0)
                    c2 += tl.load(ROW_C1_C2 + M + rows, mask=row_mask, other=0.0)
                tl.store(ROW_C1_C2 + rows, c1, mask=row_mask)
                tl.store(ROW_C1_C2 + M + rows, c2, mask=row_mask)
            tl.debug_barrier()  # ROW_C1_C2 is read back, by other threads of this program too
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            w = load_param(W, cols, col_mask, -0.0, 1.0, HAS_WEIGHT)
            dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for block_start in range(row_start, row_end, BLOCK_M):
                rows, row_mask = row_block(block_start, row_end, BLOCK_M)
                x_hat, dy, rstd, mask = _load_xhat_dy(X, DY, MEAN, RSTD, rows, row_mask, cols,
                                                      col_mask, stride_x, stride_dy,
                                                      "evict_first")
                c1 = tl.load(ROW_C1_C2 + rows, mask=row_mask, other=0.0)
                c2 = tl.load(ROW_C1_C2 + M + rows, mask=row_mask, other=0.0)
                dx = rstd[:, None] * (dy * w[None, :] - c1[:, None] - x_hat * c2[:, None])
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :],
                         dx.to(DX.dtype.element_ty), mask=mask)
                dw_acc += dy * x_hat
                db_acc += dy
            if HAS_WEIGHT:
                tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
            if HAS_BIAS:
                tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _pack(a, b):
    """Two float32 tensors as one uint64 tensor (a in the low half): one value to exchange."""
    return (a.to(tl.uint32, bitcast=True).to(tl.uint64)
            | (b.to(tl.uint32, bitcast=True).to(tl.uint64) << 32))


@triton.jit
def _unpack(p):
    """The two float32 tensors of _pack(a, b)."""
    return ((p & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
            (p >> 32).to(tl.uint32).to(tl.float32, bitcast=True))


@triton.jit
def _add_packed(p, q):
    """_pack(a1 + a2, b1 + b2) of p = _pack(a1, b1), q = _pack(a2, b2): two sums, one reduction."""
    a1, b1 = _unpack(p)
    a2, b2 = _unpack(q)
    return _pack(a1 + a2, b1 + b2)


@triton.jit
def _load_xhat_dy(X, DY, MEAN, RSTD, rows, row_mask, cols, col_mask, stride_x, stride_dy,
                  EVICTION: tl.constexpr):
    """x_hat and dy (float32) of a (BLOCK_M, BLOCK_N) tile (x_hat = 0 in masked lanes), the
    rows' rstd, and the tile's mask."""
    mask = row_mask[:, None] & col_mask[None, :]
    x, dy = load_grad_tile(X, DY, rows, cols, mask, stride_x, stride_dy, EVICTION)
    mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return x_hat, dy, rstd, mask

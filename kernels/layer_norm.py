"""LayerNorm in Triton: forward and backward.

Each row x ∈ R^N of the (M, N) input is centred and scaled:

    μ  = mean(x, -1)                             float32, saved
    r  = rsqrt(mean((x − μ)², -1) + eps)         float32, saved (biased variance, as nn.LayerNorm)
    x̂  = (x − μ) · r
    y  = w ⊙ x̂ + b                               (w = 1, b = 0 when absent), rounded once to x.dtype

Backward. With g = w ⊙ dy, and differentiating through μ and r:

    dx = r · (g − mean(g) − x̂ · mean(x̂ ⊙ g))
    dw = Σ_rows dy ⊙ x̂,    db = Σ_rows dy

Layout, chunking and determinism follow kernels/rms_norm.py: rows are addressed through their
row stride; a row that fits in BLOCK_N columns is read once (SINGLE_PASS, BLOCK_M rows per
program), a longer row in a loop over chunks (three passes: mean, variance, output). dw and db
are accumulated per program of the persistent backward grid into float32 partial rows
(DW_PARTIAL, DB_PARTIAL: (programs, N)), written even by programs without rows, and summed over
programs by the launcher. No atomics.

All arithmetic is float32: values are upcast right after tl.load and downcast before tl.store.
"""

import triton
import triton.language as tl


@triton.jit
def _param(P, cols, col_mask, default: tl.constexpr, HAS_PARAM: tl.constexpr):
    """A chunk of a per-column parameter (weight or bias) in float32, or ``default`` if absent."""
    if HAS_PARAM:
        p = tl.load(P + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        p = tl.full(cols.shape, default, tl.float32)
    return p


@triton.jit
def layer_norm_fwd(
    X, Y, W, B, MEAN, RSTD,                 # pointers; W/B unused without weight/bias
    stride_x, stride_y,                     # row strides (elements)
    M, N, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    """One program normalizes BLOCK_M consecutive rows."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # 64-bit offsets: M · stride may exceed 2³¹
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)               # padding must not count
        r = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = _param(W, cols, col_mask, 1.0, HAS_WEIGHT)
        b = _param(B, cols, col_mask, 0.0, HAS_BIAS)
        y = xc * r[:, None] * w[None, :] + b[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: mean.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            acc += tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=1) / N
        # Pass 2: variance around the mean (two-pass, as accurate as the single-pass branch).
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        r = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        # Pass 3: normalize and write.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = _param(W, cols, col_mask, 1.0, HAS_WEIGHT)
            b = _param(B, cols, col_mask, 0.0, HAS_BIAS)
            y = (x - mean[:, None]) * r[:, None] * w[None, :] + b[None, :]
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, r, mask=row_mask)


@triton.jit
def _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x, stride_dy, N, mean, r,
                     HAS_WEIGHT: tl.constexpr):
    """x̂ and dy (float32) of a (BLOCK_M, BLOCK_N) chunk of a long row, the weight w of its
    columns, and the chunk's mask: what both passes of the chunked backward read."""
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = _param(W, cols, col_mask, 1.0, HAS_WEIGHT)
    x_hat = tl.where(mask, (x - mean[:, None]) * r[:, None], 0.0)
    return x_hat, dy, w, mask


@triton.jit
def layer_norm_bwd(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,   # partials: (programs, N) float32
    stride_dy, stride_x, stride_dx,
    M, N, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    """Persistent program pid handles rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows and writes its partial rows DW_PARTIAL[pid] and DB_PARTIAL[pid]."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N
    db_row = DB_PARTIAL + pid.to(tl.int64) * N

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = _param(W, cols, col_mask, 1.0, HAS_WEIGHT)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block_start in range(row_start, row_end, BLOCK_M):
            rows = block_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * r[:, None], 0.0)
            g = dy * w[None, :]
            c1 = tl.sum(g, axis=1) / N                             # mean(g)
            c2 = tl.sum(x_hat * g, axis=1) / N                     # mean(x̂ ⊙ g)
            dx = r[:, None] * (g - c1[:, None] - x_hat * c2[:, None])
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * x_hat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # Long rows: zero this program's partial rows, then for each block of rows one pass for
        # mean(g) and mean(x̂ ⊙ g) and a second pass for dx, dw and db. The partial rows are
        # read and written only by this program, always with the same block shape.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            zeros = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if HAS_WEIGHT:
                tl.store(dw_row + cols, zeros, mask=cols < N)
            if HAS_BIAS:
                tl.store(db_row + cols, zeros, mask=cols < N)
        for block_start in range(row_start, row_end, BLOCK_M):
            rows = block_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows = rows.to(tl.int64)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            sum_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            sum_xg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                x_hat, dy, w, mask = _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x,
                                                      stride_dy, N, mean, r, HAS_WEIGHT)
                g = dy * w[None, :]
                sum_g += g
                sum_xg += x_hat * g
            c1 = tl.sum(sum_g, axis=1) / N
            c2 = tl.sum(sum_xg, axis=1) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                x_hat, dy, w, mask = _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x,
                                                      stride_dy, N, mean, r, HAS_WEIGHT)
                dx = r[:, None] * (dy * w[None, :] - c1[:, None] - x_hat * c2[:, None])
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                if HAS_WEIGHT:
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + tl.sum(dy * x_hat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db = tl.load(db_row + cols, mask=col_mask, other=0.0)
                    tl.store(db_row + cols, db + tl.sum(dy, axis=0), mask=col_mask)

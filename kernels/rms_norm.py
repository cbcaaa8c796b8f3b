"""RMSNorm in Triton: forward (optionally fused with a residual add) and backward.

Each row x ∈ R^N of the (M, N) input is normalized by its root mean square:

    r  = rsqrt(mean(x², -1) + eps)          float32, saved for the backward pass
    x̂  = x · r
    y  = s ⊙ x̂,   s = offset + w            (s = 1 without a weight)

Two casting conventions (see normtools.core.reference):

    "llama":  y = s ⊙ x̂.to(x.dtype)    x̂ is rounded to the input dtype before the multiply
    "gemma":  y = s ⊙ x̂                multiply in float32; y is rounded once when stored

Backward. With g = s ⊙ dy, and using ∂r/∂x = −r³ x / N:

    dx = r · g − x · r³ · Σ(x ⊙ g) / N
       = r · (g − x̂ · mean(x̂ ⊙ g))
    dw = Σ_rows dy ⊙ x̂

Fused residual (the pre-norm hot path): x = x_in + residual is rounded to the input dtype,
stored as the second output, and normalized. Its gradient is the sum of the gradient through
the norm and the gradient of the stored sum, and it flows unchanged to x_in and residual.

Layout. Rows are addressed through their real row stride (the last dimension has unit stride).
When a row fits in one block of BLOCK_N columns, a program reads it once (SINGLE_PASS) and
handles BLOCK_M rows at a time; longer rows are processed in a loop over BLOCK_N-wide chunks.

Determinism. dw is reduced in two steps with no atomics: each program of the persistent
backward grid accumulates its rows into its own float32 row of DW_PARTIAL (written even when
the program received no rows); the launcher sums that (programs, N) buffer over programs.

All arithmetic is float32: values are upcast right after tl.load and downcast before tl.store.
"""

import triton
import triton.language as tl


@triton.jit
def _load_x(X, RES, SUM, x_offsets, res_offsets, sum_offsets, mask,
            HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """Load a tile of x as float32; with a residual, x = (x_in + residual) rounded to the input
    dtype, stored to SUM when STORE_SUM."""
    x = tl.load(X + x_offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + res_offsets, mask=mask, other=0.0).to(tl.float32)
        x_sum = (x + res).to(SUM.dtype.element_ty)
        if STORE_SUM:
            tl.store(SUM + sum_offsets, x_sum, mask=mask)
        x = x_sum.to(tl.float32)
    return x


@triton.jit
def _scale(W, cols, col_mask, offset, HAS_WEIGHT: tl.constexpr):
    """s = offset + w in float32 for a chunk of columns (1 without a weight)."""
    if HAS_WEIGHT:
        s = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        s = tl.full(cols.shape, 1.0, tl.float32)
    return s


@triton.jit
def _normalize_store(Y, y_offsets, mask, x, r, s, X_DTYPE: tl.constexpr, LLAMA_CAST: tl.constexpr):
    """y = s ⊙ x̂ with x̂ = x · r, rounded as the casting convention says, stored to Y."""
    x_hat = x * r[:, None]
    if LLAMA_CAST:
        x_hat = x_hat.to(X_DTYPE).to(tl.float32)
    y = x_hat * s[None, :]
    tl.store(Y + y_offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_fwd(
    X, RES, Y, SUM, W, RSTD,                # pointers; RES/SUM/W unused without residual/weight
    stride_x, stride_res, stride_y, stride_sum,   # row strides (elements)
    M, N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    """One program normalizes BLOCK_M consecutive rows."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # 64-bit offsets: M · stride may exceed 2³¹
    x_rows = rows[:, None] * stride_x
    res_rows = rows[:, None] * stride_res
    y_rows = rows[:, None] * stride_y
    sum_rows = rows[:, None] * stride_sum
    X_DTYPE = X.dtype.element_ty

    if SINGLE_PASS:
        # The whole row is in registers: read it once, reduce, normalize, write.
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_x(X, RES, SUM, x_rows + cols[None, :], res_rows + cols[None, :],
                    sum_rows + cols[None, :], mask, HAS_RESIDUAL, True)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        tl.store(RSTD + rows, r, mask=row_mask)
        s = _scale(W, cols, col_mask, offset, HAS_WEIGHT)
        _normalize_store(Y, y_rows + cols[None, :], mask, x, r, s, X_DTYPE, LLAMA_CAST)
    else:
        # Pass 1: sum of squares over the row, chunk by chunk (the residual sum is stored here).
        sum_sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            x = _load_x(X, RES, SUM, x_rows + cols[None, :], res_rows + cols[None, :],
                        sum_rows + cols[None, :], mask, HAS_RESIDUAL, True)
            sum_sq += x * x
        r = tl.math.rsqrt(tl.sum(sum_sq, axis=1) / N + eps)
        tl.store(RSTD + rows, r, mask=row_mask)
        # Pass 2: read the row again (recomputing x_in + residual) and write y.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_x(X, RES, SUM, x_rows + cols[None, :], res_rows + cols[None, :],
                        sum_rows + cols[None, :], mask, HAS_RESIDUAL, False)
            s = _scale(W, cols, col_mask, offset, HAS_WEIGHT)
            _normalize_store(Y, y_rows + cols[None, :], mask, x, r, s, X_DTYPE, LLAMA_CAST)


@triton.jit
def _dx_store(DX, DSUM, dx_offsets, dsum_offsets, mask, dx, HAS_DSUM: tl.constexpr):
    """Store dx, adding the gradient of the fused residual sum when there is one."""
    if HAS_DSUM:
        dx += tl.load(DSUM + dsum_offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + dx_offsets, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x, stride_dy, N, offset,
                     HAS_WEIGHT: tl.constexpr):
    """x and dy (float32) of a (BLOCK_M, BLOCK_N) chunk of a long row, the scale s of its
    columns, and the chunk's mask: what both passes of the chunked backward read."""
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _scale(W, cols, col_mask, offset, HAS_WEIGHT)
    return x, dy, s, mask


@triton.jit
def rms_norm_bwd(
    DY, X, W, RSTD, DSUM, DX, DW_PARTIAL,   # DW_PARTIAL: (programs, N) float32
    stride_dy, stride_x, stride_dsum, stride_dx,
    M, N, offset, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_DSUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    """Persistent program pid handles rows [pid · rows_per_program, +rows_per_program) in
    blocks of BLOCK_M rows and writes its partial dw row DW_PARTIAL[pid]."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * N

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        s = _scale(W, cols, col_mask, offset, HAS_WEIGHT)
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block_start in range(row_start, row_end, BLOCK_M):
            rows = block_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_hat = x * r[:, None]
            g = dy * s[None, :]
            c = tl.sum(x_hat * g, axis=1) / N                      # mean(x̂ ⊙ g)
            dx = r[:, None] * (g - x_hat * c[:, None])
            _dx_store(DX, DSUM, rows[:, None] * stride_dx + cols[None, :],
                      rows[:, None] * stride_dsum + cols[None, :], mask, dx, HAS_DSUM)
            dw_acc += dy * x_hat
        if HAS_WEIGHT:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # Long rows: zero this program's partial row, then for each block of rows make one pass
        # for c = mean(x̂ ⊙ g) and a second pass for dx and the dw contribution. The partial row
        # is read and written only by this program, always with the same block shape.
        if HAS_WEIGHT:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                tl.store(dw_row + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
        for block_start in range(row_start, row_end, BLOCK_M):
            rows = block_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows = rows.to(tl.int64)
            r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            dot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                x, dy, s, mask = _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x,
                                                  stride_dy, N, offset, HAS_WEIGHT)
                dot += x * r[:, None] * dy * s[None, :]
            c = tl.sum(dot, axis=1) / N                            # mean(x̂ ⊙ g)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                x, dy, s, mask = _load_grad_chunk(X, DY, W, rows, row_mask, cols, stride_x,
                                                  stride_dy, N, offset, HAS_WEIGHT)
                x_hat = x * r[:, None]
                dx = r[:, None] * (dy * s[None, :] - x_hat * c[:, None])
                _dx_store(DX, DSUM, rows[:, None] * stride_dx + cols[None, :],
                          rows[:, None] * stride_dsum + cols[None, :], mask, dx, HAS_DSUM)
                if HAS_WEIGHT:
                    dw = tl.load(dw_row + cols, mask=cols < N, other=0.0)
                    tl.store(dw_row + cols, dw + tl.sum(dy * x_hat, axis=0), mask=cols < N)

"""Sum of per-program partial rows: the last step of every weight gradient.

launched by: normtools.core.launcher (sum_partials), after every backward kernel.

The backward kernels accumulate dw (and db) of the rows each program handled into that
program's own float32 partial row; this kernel adds them up and writes the weight's dtype:

    OUT[o, j] = Σ_i PARTIAL[i, o, j]        PARTIAL: (n_partials, n_out, N) float32, rows of
                                            N contiguous, partial i at i · stride_partial

(o: which parameter, or which head's weight row; i: which program). One launch replaces a
float32 sum and a cast (two launches), with a fixed reduction order: BLOCK_P lanes over i in
ascending blocks, then a tree over the lanes, so the result depends only on n_partials and
BLOCK_P, never on timing.
"""

import triton
import triton.language as tl


@triton.jit
def sum_partials(PARTIAL, OUT, n_partials, n_out, N, stride_partial,
                 BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (column block, o) sums BLOCK_N columns of output row o over all partials."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o = tl.program_id(1).to(tl.int64)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        i = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (i < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + i[:, None] * stride_partial + o * N + cols[None, :], mask=mask,
                       other=0.0, eviction_policy="evict_first")
    tl.store(OUT + o * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)

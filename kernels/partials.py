"""Sum of per-program partial rows: the last step of every weight gradient.

launched by: normtools.core.launcher (sum_partials), after every backward kernel.

The backward kernels accumulate dw (and db) of the rows each program handled into that
program's own float32 partial row; this kernel adds them up and writes the weight's dtype:

    OUT[j] = Σ_i PARTIAL[i · stride_partial + j]     j < size: the values of one weight (or
                                                     of every head's weight row, or w and b),
                                                     i < n_partials: the programs' partials

One launch sums up to two such tensors (A and B: q's and k's weights, or w and b, each in its
own dtype): the first programs_a programs sum A, the rest B, each BLOCK_N consecutive values
of its tensor (a launch of one tensor passes it as B too, with no program past programs_a).
The launcher sizes BLOCK_N so that the grid fills the GPU (launch_plans.partials_plan). The
sum and the cast are one launch, with a fixed reduction order: BLOCK_P lanes over i in
ascending blocks, then a tree over the lanes, so the result depends only on n_partials and
BLOCK_P, never on timing.
"""

import triton
import triton.language as tl


@triton.jit
def sum_partials(PARTIAL_A, OUT_A, n_partials_a, size_a, stride_a, programs_a,
                 PARTIAL_B, OUT_B, n_partials_b, size_b, stride_b,
                 BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid < programs_a sums values [pid · BLOCK_N, +BLOCK_N) of A, program pid ≥
    programs_a those of B from (pid − programs_a) · BLOCK_N (a launch of A alone has no such
    program)."""
    pid = tl.program_id(0)
    if pid < programs_a:
        _sum_block(PARTIAL_A, OUT_A, n_partials_a, size_a, stride_a, pid, BLOCK_P, BLOCK_N)
    else:
        _sum_block(PARTIAL_B, OUT_B, n_partials_b, size_b, stride_b, pid - programs_a,
                   BLOCK_P, BLOCK_N)


@triton.jit
def _sum_block(PARTIAL, OUT, n_partials, size, stride_partial, block,
               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[j] = Σ_i PARTIAL[i · stride_partial + j] for the BLOCK_N values j of ``block``."""
    cols = block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < size
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        i = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (i < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + i[:, None] * stride_partial + cols[None, :], mask=mask,
                       other=0.0, eviction_policy="evict_first")
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)

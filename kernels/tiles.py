"""Small tile helpers shared by the kernels of kernels/ (``@triton.jit`` functions called from
the kernels of rms_norm.py, layer_norm.py, qk_norm.py and qk_norm_rope.py).

launched by: none of its own; each kernel module imports these by name, so that Triton's
interpreter finds them in the kernel's namespace (normtools.core._triton_interpreter).

* ``row_block``: the BLOCK_M row indices of a block (int64) and their mask.
* ``load_param``: a chunk of a per-column parameter in float32, s = offset + p, or a constant
  when the op has no such parameter.
* ``load_grad_tile``: x and dy of a (BLOCK_M, BLOCK_N) tile of a backward, in float32.
"""

import triton
import triton.language as tl


@triton.jit
def row_block(block_start, row_end, BLOCK_M: tl.constexpr):
    """The BLOCK_M row indices from block_start (int64: row · stride may pass 2³¹), and their
    mask (rows < row_end)."""
    rows = block_start + tl.arange(0, BLOCK_M)
    return rows.to(tl.int64), rows < row_end


@triton.jit
def load_param(P, cols, col_mask, offset, ABSENT: tl.constexpr, HAS_PARAM: tl.constexpr):
    """offset + P[cols] in float32 (masked lanes: offset), or ABSENT everywhere when the op
    has no such parameter. ``cols`` may be any offsets tensor; an offset of −0.0 returns P
    exactly (x + −0 = x for every x, signed zeros included). Every program reads the
    parameter: evict_last."""
    if HAS_PARAM:
        p = offset + tl.load(P + cols, mask=col_mask, other=0.0,
                             eviction_policy="evict_last").to(tl.float32)
    else:
        p = tl.full(cols.shape, ABSENT, tl.float32)
    return p


@triton.jit
def load_grad_tile(X, DY, rows, cols, mask, stride_x, stride_dy, EVICTION: tl.constexpr):
    """x and dy (float32) of the (BLOCK_M, BLOCK_N) tile at X + rows · stride_x + cols and
    DY + rows · stride_dy + cols (0 in masked lanes)."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy=EVICTION).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                 eviction_policy=EVICTION).to(tl.float32)
    return x, dy

"""The weight gradients' last launch (kernels/partials.py) and the interpreter's reductions
(issue 31: merged and wider weight-gradient launches; one exchange for LayerNorm's c1, c2).

* ``launcher.sum_partials`` sums one or two tensors of float32 partial rows in one launch,
  each into its own dtype, against float64 sums: on the CPU plan and on an H200's (many
  programs, the boundary between the two tensors inside the grid), strided partial rows and
  empty partials included.
* Every backward with weights ends in exactly one such launch (LayerNorm's w and b, QK-Norm's
  and the fused QK-Norm + RoPE's q and k weights), and on an H200's plan a 4096-value
  gradient is summed by at least four times the 32 programs of 128-value blocks.
* The interpreter runs ``tl.reduce`` with a combine function of the kernel's on whole arrays
  (normtools.core._triton_interpreter); its result is compared with Triton's own
  element-by-element loop for a combine whose result depends on the order.
"""

import pytest
import torch
import triton
import triton.language as tl

from normtools.core import _triton_interpreter, launch_hooks, launch_plans, launcher
from normtools.measure.spills import OPS
from normtools.measure.triton_runs import op_inputs, op_shape, run_on_triton


def _partials(n_partials, shape, seed, stride_pad=0):
    """float32 partial rows (n_partials, *shape), each row contiguous, rows ``stride_pad``
    values apart beyond their length."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.Size(shape).numel()
    store = torch.randn(n_partials, size + stride_pad, generator=gen)
    return store[:, :size].view(n_partials, *shape)


@pytest.mark.parametrize("cuda_plan", [False, True], ids=["cpu-plan", "h200-plan"])
@pytest.mark.parametrize("case", [
    [(5, (300,), torch.float32)],
    [(33, (4, 100), torch.bfloat16), (7, (1000,), torch.float32)],
    [(132, (8, 64), torch.float16), (0, (64,), torch.bfloat16)],
    [(70, (129,), torch.float32), (3, (2, 129), torch.bfloat16)],
], ids=["one", "two-dtypes", "one-empty", "odd-sizes"])
def test_sums_against_float64(case, cuda_plan):
    gradients = [(_partials(p, shape, seed, stride_pad=seed * 3), dtype)
                 for seed, (p, shape, dtype) in enumerate(case)]
    if cuda_plan:
        with launch_hooks.planning_for_cuda():
            outs = launcher.sum_partials(*gradients)
    else:
        outs = launcher.sum_partials(*gradients)
    for (partial, dtype), out in zip(gradients, outs):
        assert out.dtype == dtype and out.shape == partial.shape[1:]
        expected = partial.double().sum(0)
        assert torch.allclose(out.double(), expected, rtol=torch.finfo(dtype).eps, atol=1e-5)


def test_more_than_two_gradients_is_refused():
    gradients = [(_partials(2, (8,), seed), torch.float32) for seed in range(3)]
    with pytest.raises(ValueError, match="one or two"):
        launcher.sum_partials(*gradients)


@pytest.mark.parametrize("op", [op for op in OPS if op != "add_rms_norm_fwd_bwd"])
def test_one_weight_gradient_launch_per_backward(op):
    """Each backward sums all of its weight gradients in one launch, and on an H200's plan
    that launch has at least as many programs as 32-value blocks give its weights."""
    inputs = op_inputs(op, op_shape(op, 2048, 64), torch.bfloat16)
    with (launch_hooks.planning_for_cuda(),
          launch_hooks.recording_launches() as launches):
        run_on_triton(op, inputs)
    sums = [launch for launch in launches if launch.kernel.fn.__name__ == "sum_partials"]
    assert len(sums) == 1, [launch.kernel.fn.__name__ for launch in launches]
    (launch,) = sums
    has_b = launch.kwargs["programs_a"] < launch.grid[0]
    values = launch.kwargs["size_a"] + (launch.kwargs["size_b"] if has_b else 0)
    narrow_blocks = triton.cdiv(values, launch_plans.PARTIALS_BLOCK_N[0])
    assert launch.grid[0] >= min(narrow_blocks, launch_plans.DEFAULT_SM_COUNT)


def test_h200_plan_widens_a_4096_value_gradient():
    plan = launch_plans.partials_plan([4096], 132)
    assert sum(plan.programs) == 128 and plan.block_n == 32      # 128-value blocks: 32
    assert launch_plans.partials_plan([131072], 132).block_n == 128


# ----------------------------------------------------------------------------- reductions

@triton.jit
def _compose(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2) as maps v -> a v + b: (a1 a2, b1 a2 + b2). Associative, and the
    order matters."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _reduce_maps(A, B, OUT_A, OUT_B, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    a = tl.load(A + rows * COLS + cols)
    b = tl.load(B + rows * COLS + cols)
    ra, rb = tl.reduce((a, b), AXIS, _compose)
    out = tl.arange(0, COLS if AXIS == 0 else ROWS)
    tl.store(OUT_A + out, ra)
    tl.store(OUT_B + out, rb)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("rows, cols", [(4, 32), (16, 8), (2, 64)])
def test_interpreter_reduces_like_tritons_own_loop(axis, rows, cols, monkeypatch):
    """The pairwise reduction gives what Triton's interpreter computes element by element (its
    own generic_reduce), for maps whose composition depends on the order; exact (small
    integers in float64)."""
    gen = torch.Generator().manual_seed(rows * cols + axis)
    a = (torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1).double()
    b = torch.randint(-3, 4, (rows, cols), generator=gen).double()

    def run():
        n = cols if axis == 0 else rows
        out_a, out_b = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        launcher.kernel_for(_reduce_maps, a.device)[(1,)](a, b, out_a, out_b, ROWS=rows,
                                                          COLS=cols, AXIS=axis)
        return out_a, out_b

    pairwise = run()
    monkeypatch.setattr(_triton_interpreter, "_pairwise_generic_reduce",
                        _triton_interpreter._TRITON_GENERIC_REDUCE)
    elementwise = run()
    for got, expected in zip(pairwise, elementwise):
        assert torch.equal(got, expected)
    # and the order matters for these maps: composing them backwards differs somewhere
    reversed_b = torch.zeros_like(b.select(axis, 0))
    for i in reversed(range(b.shape[axis])):
        reversed_b = reversed_b * a.select(axis, i) + b.select(axis, i)
    assert not torch.equal(reversed_b, elementwise[1])

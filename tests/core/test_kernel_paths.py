"""Kernel paths that the default CPU shapes never reach, forced on CPU.

* Issue 15.17: the chunked backward across several programs, some of them idle: their
  partial dw rows must be written (zeros), and the cross-program sum must be right. Every
  float32 buffer is allocated full of NaN, so a row that no program writes cannot pass.
* Issue 15.18: what the CPU determinism tests prove. Triton's interpreter runs the programs of
  a grid one at a time, in order, so running twice and comparing can never fail. What can
  break determinism is a result that depends on the order programs run in (atomics, a buffer
  shared between programs); here the grid is also run in reverse order and dw must be the
  same bits. Bits may change with the number of programs (another partition of the rows);
  there dw must still match float64.
* Issue 15.2: 64-bit offsets in kernels/qk_norm.py, checked without 8 GB: the interpreter runs
  the forward with T · H past 2³¹ but touching no memory (``counting_bytes(touch_memory=
  False)``), and the addresses it computes must be the exact 64-bit ones.
"""

import collections
import itertools
import numpy as np
import pytest
import torch
import triton.runtime.interpreter as triton_interpreter

import normtools
from normtools._kernels import qk_norm as _qk
from normtools.core import launch_hooks, launch_plans, launcher
from normtools.measure import bytes_counter as kt


@pytest.fixture
def small_cpu_tiles(monkeypatch):
    """Chunks of 16 float32 values, one row per block and 6 persistent programs on CPU."""
    monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16)
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", 6)


def _grads(op, m, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g, dtype=torch.float64)
    w = (1 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64))
    b = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    out = {}
    for backend in ("triton", "float64"):
        xs, ws, bs = (t.clone().to(dtype if backend == "triton" else torch.float64)
                      .requires_grad_(True) for t in (x, w, b))
        if op == "rms_norm":
            y = (normtools.rms_norm(xs, ws, backend="triton") if backend == "triton" else
                 xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * ws)
            y.backward(dy.to(y.dtype))
            out[backend] = (xs.grad, ws.grad)
        else:
            y = (normtools.layer_norm(xs, ws, bs, backend="triton") if backend == "triton" else
                 torch.nn.functional.layer_norm(xs, (n,), ws, bs, 1e-5))
            y.backward(dy.to(y.dtype))
            out[backend] = (xs.grad, ws.grad, bs.grad)
    return out


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_chunked_backward_over_several_programs(op, small_cpu_tiles, nan_filled_float32):
    """M = 7 rows of N = 40 (three 16-wide chunks) with 6 programs allowed: 4 programs of 2
    rows (the last gets 1; 6 programs of 2 would leave two without rows). dx, dw (and db)
    against float64."""
    plan = launcher.plan_for(f"{op}_bwd", torch.float32, 7, 40, "cpu")
    assert not plan.single_pass and (plan.programs, plan.rows_per_program) == (4, 2)
    got = _grads(op, 7, 40)
    for a, ref in zip(got["triton"], got["float64"]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("n, ctas_fwd, ctas_bwd", [(32768, 2, 4), (131072, 8, 16)])
def test_cluster_plan_runs_the_single_pass_code(op, n, ctas_fwd, ctas_bwd):
    """An H200's plan for a long row: forward and backward one block of the whole row, each
    program a cluster of CTAs (which the interpreter runs as one program). Run with that plan
    on CPU, M = 3 rows: dx, dw (and db) against float64 through the single-pass code."""
    with launch_hooks.planning_for_cuda():
        fwd = launcher.plan_for(f"{op}_fwd", torch.float32, 3, n, "cpu")
        bwd = launcher.plan_for(f"{op}_bwd", torch.float32, 3, n, "cpu")
        got = _grads(op, 3, n)
    assert (fwd.single_pass, fwd.block_n, fwd.num_ctas) == (True, n, ctas_fwd)
    assert (bwd.single_pass, bwd.block_n, bwd.num_ctas) == (True, n, ctas_bwd)
    for a, ref in zip(got["triton"], got["float64"]):
        torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd",
                                    "layer_norm_bwd", "qk_norm_fwd", "qk_norm_bwd"])
def test_clusters_only_from_sm_90(kernel):
    """A row past one CTA's registers (forward 16384, backward 8192 values) is one block on a
    cluster from sm_90 on, up to 131072 values, within the GPU's SMs; before sm_90, and past
    131072, it is chunked on single CTAs."""
    one_cta = 16384 if kernel.endswith("_fwd") else 8192
    for n in (2 * one_cta, 131072, 262144):
        for capability in (75, 80, 86, 89, 90, 100):
            plan = launch_plans.launch_plan(kernel, torch.bfloat16, 4096, n, "cuda", 132,
                                       capability=capability)
            clustered = capability >= 90 and n <= 131072
            assert plan.single_pass == clustered, (n, capability)
            assert (plan.num_ctas > 1) == clustered
            assert plan.programs * plan.num_ctas <= 132
            if clustered:
                assert plan.block_n // (plan.num_ctas * plan.num_warps * 32) <= 32


def _reverse_program_order(monkeypatch):
    """Make the interpreter run each grid's programs last to first."""
    builder = triton_interpreter.interpreter_builder
    set_grid_idx = type(builder).set_grid_idx

    def reversed_idx(self, x, y, z):
        gx, gy, gz = self.grid_dim
        set_grid_idx(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

    monkeypatch.setattr(type(builder), "set_grid_idx", reversed_idx)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "qk_norm"])
@pytest.mark.parametrize("chunked", [False, True])
def test_weight_grads_do_not_depend_on_program_order(op, chunked, monkeypatch):
    """Same plan, programs run in order and in reverse: dw bit for bit the same."""
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", 5)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 64)
    if chunked:
        monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64)

    def weight_grads():
        g = torch.Generator().manual_seed(1)
        if op == "qk_norm":
            q = torch.randn(12, 4 * 32, generator=g)
            k = torch.randn(12, 2 * 32, generator=g)
            qw = torch.ones(4 * 32, requires_grad=True)
            kw = torch.ones(2 * 32, requires_grad=True)
            qo, ko = normtools.qk_norm(q, k, qw, kw, head_dim=32, scope="per_layer",
                                       backend="triton")
            torch.autograd.backward([qo, ko], [q.flip(0), k.flip(0)])
            return qw.grad, kw.grad
        x = torch.randn(13, 40, generator=g)
        w = torch.ones(40, requires_grad=True)
        y = (normtools.rms_norm(x, w, backend="triton") if op == "rms_norm" else
             normtools.layer_norm(x, w, backend="triton"))
        y.backward(x.flip(0))
        return (w.grad,)

    in_order = weight_grads()
    _reverse_program_order(monkeypatch)
    reversed_ = weight_grads()
    assert all(torch.equal(a, b) for a, b in zip(in_order, reversed_))


@pytest.mark.parametrize("programs", [1, 2, 3, 7])
def test_weight_grad_with_any_program_count(programs, monkeypatch):
    """Another number of programs partitions the rows differently (other bits, same math):
    dw within float32 rounding of float64."""
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", programs)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 64)
    got = _grads("rms_norm", 13, 24, seed=programs)
    torch.testing.assert_close(got["triton"][1].double(), got["float64"][1], rtol=1e-5,
                               atol=1e-5)


def test_qk_norm_offsets_are_64_bit():
    """qk_norm_fwd with T = 2³⁰ tokens and 4 q head slots: program 3 (head 3) stores the inverse
    RMS of token t at Q_RSTD + 3 · 2³⁰ + t (12 GiB in), which int32 arithmetic would wrap.
    Nothing is read or written (dry interpreter run), so no memory is needed."""
    n_tokens, heads, d = 2**30, 4, 16
    q, k = torch.zeros(2, heads * d), torch.zeros(2, d)
    w = torch.ones(d)
    rstd = torch.zeros(4)
    trace = []
    with kt.counting_bytes(touch_memory=False, trace=trace):
        launcher.kernel_for(_qk.qk_norm_fwd, "cpu")[(heads,)](
            q, k, w, w, q, k, rstd, rstd,
            n_tokens, 2, 2, heads, 1, 1, 1, heads,
            q.stride(0), k.stride(0), q.stride(0), k.stride(0), 1e-6, 0.0,
            NQ=d, NK=d, BLOCK_M=2, BLOCK_NQ=d, BLOCK_NK=d, QW_PER_HEAD=False, KW_PER_HEAD=False,
            ROUND_XHAT=True, NUM_STAGES=1, PAIRED=False)
    rstd_stores = [a.addresses for a in trace if a.kind == "store" and a.itemsize == 4
                   and a.addresses.size == 2]
    offsets = sorted(int(o) for a in rstd_stores for o in (a - rstd.data_ptr()) // 4)
    expected = sorted(h * n_tokens + t for h in range(heads) for t in range(2))
    assert offsets == expected
    assert max(offsets) > 2**31
    assert np.all(np.concatenate(rstd_stores) >= rstd.data_ptr())


@pytest.mark.parametrize("kernel", launch_plans.KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_plans_cover_every_row_once(kernel, dtype):
    """For row lengths across the table, a few M, and the tensors of a row op, per-head
    QK-Norm (32 + 8 head slots) and per-layer QK-Norm (q rows 4x k's): the programs of each
    slot cover rows [0, M) with none left without rows, a chunk never exceeds the table's
    width, and the grid holds at most one program per SM (per cluster), unless there are
    more slots than that."""
    limit = launch_plans.PROGRAMS_PER_SM * 132
    for n in (1, 100, 1024, 5000, 8192, 16384, 16385, 131072):
        for m in (1, 7, 4096, 100003):
            for tensors in (((1, 1),), ((32, 1), (8, 1)), ((1, 4), (1, 1))):
                plan = launch_plans.launch_plan(kernel, dtype, m, n, "cuda", 132, tensors)
                config = launch_plans.cuda_row_config(kernel, dtype.itemsize, n)
                assert config.reason and len(plan.shares) == len(tensors)
                for share, (slots, _) in zip(plan.shares, tensors):
                    assert share.slots == slots
                    assert share.groups * share.rows_per_program >= m
                    assert (share.groups - 1) * share.rows_per_program < m   # none without rows
                assert plan.programs == sum(share.programs for share in plan.shares)
                assert plan.rows_per_program == plan.shares[0].rows_per_program
                assert plan.single_pass == (n <= plan.block_n)
                if config.block_n is not None:
                    assert plan.block_n <= config.block_n
                assert plan.num_ctas == config.num_ctas
                assert plan.programs <= max(limit // plan.num_ctas,
                                            sum(slots for slots, _ in tensors))


def _grid_work(m, tensors, shares, paired):
    """(work of each grid program, times each (tensor, unit, row) is covered): program p of a
    tensor covers the units of slot p % slots over the rows of token group p // slots; the
    grid runs the tensors' programs one after another, or, ``paired``, program p of each
    tensor in grid program p."""
    work, covered = collections.Counter(), collections.Counter()
    offset = 0
    for tensor, ((slots, unit_work), share) in enumerate(zip(tensors, shares)):
        h, r = share.units_per_slot, share.rows_per_program
        for p in range(share.programs):
            slot, group = p % share.slots, p // share.slots
            units = range(slot * h, min((slot + 1) * h, slots))
            rows = range(group * r, min((group + 1) * r, m))
            covered.update((tensor, u, row) for u in units for row in rows)
            work[p if paired else offset + p] += len(units) * len(rows) * unit_work
        offset += share.programs
    return [work[g] for g in range(max(work) + 1)], covered


@pytest.mark.parametrize("group_heads", [False, True])
def test_paired_plans_take_the_shorter_of_split_and_pair(group_heads):
    """``launch_plan`` with ``pair_tensors``: every (tensor, unit, row) is covered once, the grid
    is one wave (unless the slots alone are more), and its longest grid program is the shorter
    of the split's (``share_programs``, times its waves) and of a grid of ceil(m / limit)-token
    programs that each take every unit of q and k (a paired plan: as many programs per tensor
    as the grid); a split that is as short stays."""
    limit = 132
    for tensors in (((1, 64), (1, 8)), ((1, 48), (1, 8)), ((32, 1), (8, 1)), ((64, 1), (8, 1)),
                    ((1, 32), (1, 32)), ((200, 1), (8, 1))):
        for m in (1, 7, 768, 2944):
            plan = launch_plans.launch_plan("qk_norm_fwd", torch.bfloat16, m, 128, "cuda", limit,
                                            tensors, group_heads=group_heads, pair_tensors=True)
            work, covered = _grid_work(m, tensors, plan.shares, plan.paired)
            assert set(covered.values()) == {1} and len(covered) == m * sum(
                slots for slots, _ in tensors), (tensors, m)
            assert plan.programs == len(work)
            if plan.paired:
                assert {share.programs for share in plan.shares} == {plan.programs}
            assert plan.programs <= max(limit, sum(slots for slots, _ in tensors))
            split = launch_plans.share_programs(limit, m, tensors, group_heads)
            split_work = _grid_work(m, tensors, split, False)[0]
            split_longest = max(split_work) * -(-len(split_work) // limit)
            paired_longest = -(-m // min(limit, m)) * sum(s * w for s, w in tensors)
            waves = -(-plan.programs // limit)
            assert max(work) * waves == min(split_longest, paired_longest), (tensors, m)
            assert plan.paired == (paired_longest < split_longest), (tensors, m)


def _best_split(limit, m, tensors):
    """(longest program, programs) of the best split, every split of at most ``limit``
    programs enumerated (one program per slot when the slots alone exceed it)."""
    best = None
    for groups in itertools.product(*[range(1, max(1, min(m, limit)) + 1) for _ in tensors]):
        programs = sum(slots * g for (slots, _), g in zip(tensors, groups))
        if programs > limit and any(g > 1 for g in groups):
            continue
        time = max(work * -(-m // g) for (_, work), g in zip(tensors, groups))
        best = min(best or (time, programs), (time, programs))
    return best


def _longest(tensors, shares):
    return max(work * share.rows_per_program for (_, work), share in zip(tensors, shares))


@pytest.mark.parametrize("limit", [4, 18, 132])
def test_share_programs_is_the_shortest_split(limit):
    """Against every split of at most ``limit`` programs, enumerated: the longest program
    (work of a row x rows per program) is the shortest possible, with the fewest programs
    that reach it; q and k with equal or unequal work per row, a row op, more slots than
    programs."""
    cases = [((1, 1),), ((1, 32), (1, 8)), ((1, 48), (1, 8)), ((32, 1), (8, 1)),
             ((4, 1), (2, 1)), ((1, 3), (1, 2)), ((2, 16), (1, 16)), ((64, 1), (8, 1)),
             ((200, 1), (8, 1))]
    for tensors in cases:
        for m in (1, 5, 12, 100, 531, 8192):
            shares = launch_plans.share_programs(limit, m, tensors)
            got = (_longest(tensors, shares), sum(s.programs for s in shares))
            assert got == _best_split(limit, m, tensors), (tensors, m)


@pytest.mark.parametrize("limit", [18, 132])
def test_grouped_heads_take_the_best_slot_size(limit):
    """With ``group_heads`` (per-head QK-Norm: Hq and Hk heads of equal work), the longest
    program (times the waves, where a slot per head is more than ``limit`` programs) is the
    shortest over every power of two of heads per slot, each split enumerated;
    every tensor's slots cover its heads; few tokens get a slot per head, many tokens several
    heads per slot."""
    for hq, hk in ((32, 8), (64, 8), (40, 8), (4, 2), (128, 16)):
        for m in (1, 3, 64, 1000, 8192):
            shares = launch_plans.share_programs(limit, m, ((hq, 1), (hk, 1)), True)
            heads = shares[0].units_per_slot
            assert shares[1].units_per_slot == heads
            grouped = tuple((-(-h // heads), min(heads, h)) for h in (hq, hk))
            assert [s.slots for s in shares] == [slots for slots, _ in grouped]
            options = []
            size = 1
            while size < 2 * max(hq, hk):
                time, programs = _best_split(limit, m, tuple((-(-h // size), min(size, h))
                                                             for h in (hq, hk)))
                options.append(time * -(-programs // limit))      # a second wave doubles it
                size *= 2
            programs = sum(share.programs for share in shares)
            assert _longest(grouped, shares) * -(-programs // limit) == min(options), (hq, hk, m)
    assert launch_plans.share_programs(132, 1, ((64, 1), (8, 1)), True)[0].units_per_slot == 1
    assert launch_plans.share_programs(132, 8192, ((64, 1), (8, 1)), True)[0].units_per_slot > 1

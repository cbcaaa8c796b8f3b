"""normtools.measure.bytes_counter: the bytes counter, against byte counts made by hand.

Toy kernels whose traffic is known exactly (masked copies, a re-read, a 2-D tile), one real op
counted by hand from its launch plan, and the ratios of the single-pass paths at the CUDA
plan. On CPU the kernels run under Triton's interpreter, which the counter instruments.
"""

import functools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import triton
import triton.language as tl

import normtools
from normtools.core import launch_hooks, launch_plans, launcher
from normtools.measure import bytes_counter as kt


@triton.jit
def _masked_copy(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask, eviction_policy="evict_first"), mask=mask)


@triton.jit
def _read_twice(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    b = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Y + tl.program_id(0), tl.sum(a * b, axis=0))


@triton.jit
def _tile_rows(X, Y, m, n, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    x = tl.load(X + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    tl.store(Y + rows, tl.sum(x, axis=1), mask=rows < m)


def _run(kernel, grid, *args, **kwargs):
    with kt.counting_bytes() as counts:
        launcher.kernel_for(kernel, "cpu")[grid](*args, **kwargs)
    return counts[kernel.fn.__name__]


def test_masked_lanes_only():
    """100 float32 values copied by 2 programs of 64 lanes: 28 lanes are masked off."""
    x, y = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    got = _run(_masked_copy, (2,), x, y, 100, BLOCK=64)
    assert dict(got.loads) == {"evict_first": 400} and got.touched == 800
    assert got.unique == 800 and got.launches == 1
    assert torch.equal(y, x)                                  # the copy really ran


def test_rereads_count_twice_and_unique_once():
    """bf16: 40 values read twice by each of 3 programs, one float32 stored per program."""
    x, y = torch.ones(40, dtype=torch.bfloat16), torch.zeros(3)
    got = _run(_read_twice, (3,), x, y, 40, BLOCK=64)
    assert got.loads["evict_last"] == 3 * 80 and sum(got.loads.values()) == 3 * 160
    assert sum(got.stores.values()) == 3 * 4
    assert got.unique == 80 + 12                                # x once, the 3 outputs


def test_distinct_bytes_against_a_set_of_bytes():
    """Random overlapping accesses of 2- and 4-byte elements (strided, repeated, adjacent):
    the union of their byte runs has as many bytes as a Python set of every byte address."""
    rng = np.random.default_rng(0)
    runs, every_byte = [], set()
    for _ in range(50):
        size = int(rng.choice([2, 4]))
        start, count, step = int(rng.integers(0, 400)), int(rng.integers(0, 30)), int(
            rng.choice([1, 1, 2, 3]))
        addresses = (start + size * step * np.arange(count)).astype(np.uint64)
        addresses = np.concatenate([addresses, addresses[: count // 3]])   # repeats
        rng.shuffle(addresses)
        runs.append(kt._byte_runs(addresses, size))
        every_byte |= {int(a) + b for a in addresses for b in range(size)}
    assert kt._distinct_bytes(runs) == len(every_byte)


def test_strided_tile():
    """A (5 of 8) x (33 of 64) tile of a row-strided float16 matrix, row sums stored."""
    x, y = torch.ones(5, 100, dtype=torch.float16), torch.zeros(5)
    got = _run(_tile_rows, (1,), x, y, 5, 33, 100, BLOCK_M=8, BLOCK_N=64)
    assert sum(got.loads.values()) == 5 * 33 * 2 and sum(got.stores.values()) == 5 * 4
    assert torch.equal(y, torch.full((5,), 33.0))


def test_dry_run_touches_no_memory():
    """touch_memory=False: addresses are traced, nothing is read or written."""
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    trace = []
    with kt.counting_bytes(touch_memory=False, trace=trace):
        launcher.kernel_for(_masked_copy, "cpu")[(1,)](x, y, 10, BLOCK=16)
    assert torch.equal(y, torch.zeros(10))
    (load, a, size_a, *_), (store, b, size_b, *_) = trace
    assert (load, store, size_a, size_b) == ("load", "store", 4, 4)
    assert np.array_equal(a - x.data_ptr(), 4 * np.arange(10))
    assert np.array_equal(b - y.data_ptr(), 4 * np.arange(10))


def test_rms_norm_forward_counted_by_hand():
    """rms_norm, float32, M = 4, N = 64 with the CUDA plan of a 1-SM GPU: one program of
    BLOCK_M = 4 rows reads x and w once and writes y and rstd."""
    x, w = torch.randn(4, 64), torch.randn(64)
    with launch_hooks.planning_for_cuda(1), kt.counting_bytes() as counts:
        normtools.rms_norm(x, w, backend="triton")
    got = counts["rms_norm_fwd"]
    assert sum(got.loads.values()) == 4 * 64 * 4 + 64 * 4
    assert sum(got.stores.values()) == 4 * 64 * 4 + 4 * 4


def test_counter_sees_the_cuda_plan():
    """Inside planning_for_cuda a CPU launch gets the CUDA grid. rms_norm, bf16, M = 8 rows
    of N = 8192: the CPU packs all rows into one 65536-value tile (one program, w read once);
    a 2-SM GPU's plan gives two rows per 16384-value block and a persistent grid of one
    program per SM (w read twice)."""
    x, w = torch.randn(8, 8192, dtype=torch.bfloat16), torch.ones(8192, dtype=torch.bfloat16)
    with kt.counting_bytes() as cpu:
        normtools.rms_norm(x, w, backend="triton")
    with launch_hooks.planning_for_cuda(2), kt.counting_bytes() as cuda:
        normtools.rms_norm(x, w, backend="triton")
    act, row = 8 * 8192 * 2, 8192 * 2
    assert sum(cpu["rms_norm_fwd"].loads.values()) == act + row
    assert sum(cuda["rms_norm_fwd"].loads.values()) == act + 2 * row


def test_minimum_bytes_of_the_backward_ops():
    """The minimum of the backward ops, by bench.bytes_moved's rule: 5A + 5W for LayerNorm
    forward+backward; 5(Q + K) + 3(Wq + Wk) for QK-Norm forward+backward."""
    from normtools.measure import bench
    assert bench.bytes_moved("layer_norm_fwd_bwd", {"M": 8, "N": 16}, torch.bfloat16) == (
        5 * 8 * 16 * 2 + 5 * 16 * 2)
    shape = {"T": 8, "Hq": 4, "Hk": 2, "D": 16}
    q, k, wq = 8 * 4 * 16 * 2, 8 * 2 * 16 * 2, 16 * 2
    assert bench.bytes_moved("qk_norm_per_head_fwd_bwd", shape, torch.bfloat16) == (
        5 * (q + k) + 3 * 2 * wq)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_single_pass_ratios_at_the_cuda_plan(op):
    """N = 2048, bf16, M = 4096 on an H200's plan: at most 5 % above the minimum (the weight
    is read once per program of the persistent grid, not once per row)."""
    result = kt.case_traffic(op, {"M": 4096, "N": 2048})
    assert 1.0 <= result["ratio"] <= 1.05, result


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_fwd_bwd", "add_rms_norm", "layer_norm",
                                "layer_norm_fwd_bwd"])
def test_one_more_row_costs_its_minimum(op):
    """What a row op touches beyond the minimum is paid per program (the weights read once
    per program, the backward's partial rows), not per row: from M = 32 to 64 rows per SM
    (N = 1024, bf16, an H200's plan: one program per SM either way) the bytes touched grow by
    at most 0.25 % more than the minimum does. The float32 statistics a forward saves for its
    backward (4-8 bytes a row, against 4-10 bytes a column) are that much; a row read twice
    would add 20 % or more. So the ratio falls to 1 as M grows: the cases over 1.05x at
    M = 4096 are per-program costs."""
    sms = launch_plans.DEFAULT_SM_COUNT
    small, large = (kt.case_traffic(op, {"M": rows * sms, "N": 1024}, l2_bytes=None)
                    for rows in (32, 64))
    marginal = (large["touched"] - small["touched"]) / (large["minimum"] - small["minimum"])
    assert 1.0 <= marginal <= 1.0025, marginal
    assert large["ratio"] < small["ratio"]


@pytest.mark.parametrize("op, m, n", [("rms_norm", 512, 131072), ("layer_norm", 512, 131072),
                                      ("add_rms_norm", 512, 32768),
                                      ("rms_norm_fwd_bwd", 2048, 32768)])
def test_long_rows_read_once_on_clusters(op, m, n):
    """Long rows, bf16: on an H200's plan (sm_90: clusters of 2-8 CTAs forward, 4 backward
    at N = 32768) the row is read once, within 5 % of the minimum; on an A100's plan (sm_80,
    108 SMs, no clusters) the same case is chunked and touches at least 1.25x. What a
    program adds once (the weight read, the backward's float32 partial row) weighs more at
    small M: forward+backward runs at M = 2048 (at 512 it is 9 % above the minimum)."""
    shape = {"M": m, "N": n}
    h200 = kt.case_traffic(op, shape, l2_bytes=None)
    a100 = kt.case_traffic(op, shape, **{**kt.GPUS["a100"], "l2_bytes": None})
    assert 1.0 <= h200["ratio"] <= 1.05, h200
    assert a100["ratio"] >= 1.25, a100


def test_qk_norm_rope_minimum_counted_by_hand():
    """bench.bytes_moved of the fused QK-Norm + RoPE, bf16, T = 5 tokens, 4 q and 2 k heads of
    D = 8: q 5·4·8·2 = 320 B, k 160 B, per-head weights 2·8·2 = 32 B (per layer 6·8·2 = 96 B),
    cos and sin 2·5·8·2 = 160 B (once per position, shared by q and k). Forward: q, k read and
    written, weights and tables read; forward+backward: 5(q + k) + 3 weights + 2 tables."""
    from normtools.measure import bench
    shape = {"T": 5, "Hq": 4, "Hk": 2, "D": 8}
    assert bench.bytes_moved("qk_norm_rope_per_head", shape, torch.bfloat16) == (
        2 * 320 + 2 * 160 + 32 + 160)
    assert bench.bytes_moved("qk_norm_rope_per_layer", shape, torch.bfloat16) == (
        2 * 320 + 2 * 160 + 96 + 160)
    assert bench.bytes_moved("qk_norm_rope_per_head_fwd_bwd", shape, torch.bfloat16) == (
        5 * 320 + 5 * 160 + 3 * 32 + 2 * 160)
    assert bench.bytes_moved("qk_norm_rope_per_layer_fwd_bwd", shape, torch.bfloat16) == (
        5 * 320 + 5 * 160 + 3 * 96 + 2 * 160)


@pytest.mark.parametrize("scope", ["per_head", "per_layer"])
def test_qk_norm_rope_minimum_matches_the_tensors(scope):
    """The same minimum from the tensors that normtools.qk_norm_rope takes and returns
    (make_inputs' inputs, the outputs, and for the backward the gradients autograd returns)."""
    from normtools.measure import bench
    shape, d = {"T": 6, "Hq": 4, "Hk": 2, "D": 8}, 8
    t = bench.make_inputs(f"qk_norm_rope_{scope}_fwd_bwd", shape, torch.bfloat16, "cpu")
    assert t["cos"].shape == t["sin"].shape == (6, 8) and t["dq_out"].shape == t["q"].shape
    assert torch.allclose(t["cos"][3].float(), torch.cos(3 / 10000 ** (
        torch.arange(8) % 4 * 2 / 8.0)), atol=4e-3)                  # position 3's table
    outs = normtools.qk_norm_rope(t["q"], t["k"], t["q_w"], t["k_w"], t["cos"], t["sin"],
                                  head_dim=d, scope=scope, backend="torch")
    grads = torch.autograd.grad(outs, (t["q"], t["k"], t["q_w"], t["k_w"]),
                                (t["dq_out"], t["dk_out"]))
    nbytes = lambda *ts: sum(x.nbytes for x in ts)
    reads = nbytes(t["q"], t["k"], t["q_w"], t["k_w"], t["cos"], t["sin"])
    forward = reads + nbytes(*outs)
    backward = reads + nbytes(t["dq_out"], t["dk_out"], *grads)
    assert bench.bytes_moved(f"qk_norm_rope_{scope}", shape, torch.bfloat16) == forward
    assert bench.bytes_moved(f"qk_norm_rope_{scope}_fwd_bwd", shape,
                             torch.bfloat16) == forward + backward


def test_qk_norm_rope_forward_counted_by_hand():
    """qk_norm_rope per head, bf16, T = 4 tokens, 2 q heads and 1 k head of D = 8, with the
    CUDA plan of a 1-SM GPU: one q program and one k program. Each reads its tensor once
    (q 4·2·8·2 = 128 B, k 64 B), its shared (D,) weight once per head lane of its tile (16 B
    per head: 48 B) and the tokens' cos and sin (2·4·8·2 = 128 B, so 256 B for the two
    programs); it writes its output and a float32 inverse RMS per (token, head) (4·3·4 = 48 B
    in all)."""
    from normtools.measure import bench
    t = bench.make_inputs("qk_norm_rope_per_head", {"T": 4, "Hq": 2, "Hk": 1, "D": 8},
                          torch.bfloat16, "cpu")
    with launch_hooks.planning_for_cuda(1), kt.counting_bytes() as counts:
        normtools.qk_norm_rope(t["q"], t["k"], t["q_w"], t["k_w"], t["cos"], t["sin"],
                               head_dim=8, backend="triton")
    got = counts["qk_norm_rope_fwd"]
    assert got.launches == 1
    assert sum(got.loads.values()) == 128 + 64 + 3 * 16 + 2 * 128
    assert got.loads["evict_last"] == 3 * 16 + 2 * 128            # weights and tables
    assert sum(got.stores.values()) == 128 + 64 + 48


@functools.cache
def _h200_traffic(op, shape_items):
    """``case_traffic`` of ``op`` at the shape of ``shape_items`` on an H200's plan, counted
    once per test process (two tests read the fused op's count, a minute of the interpreter)."""
    return kt.case_traffic(op, dict(shape_items))


@pytest.mark.parametrize("op", ["qk_norm_rope_per_head", "qk_norm_rope_per_layer_fwd_bwd"])
def test_qk_norm_rope_ratios_at_the_cuda_plan(op):
    """T = 4096 tokens of 32 q and 8 k heads of 128, bf16, an H200's plan: within 5 % of the
    minimum (q, k and the tables read once per token; what is left: the tables read by the q
    and by the k programs, the weights once per program, the float32 partials)."""
    result = _h200_traffic(op, (("T", 4096), ("Hq", 32), ("Hk", 8), ("D", 128)))
    assert 1.0 <= result["ratio"] <= 1.05, result


COMMITTED = Path(__file__).resolve().parents[2] / "book" / "data" / "kernels" / "kernel_traffic.csv"


def test_committed_table_covers_every_case():
    """The table chapter 4b shows (python -m normtools.measure.bytes_counter --csv ...) has
    every op of the counter, every row length for the row ops."""
    table = pd.read_csv(COMMITTED)
    expected = {(op, n) for op in kt.OPS if not op.startswith("qk_norm")
                for n in kt.ROW_LENGTHS}
    got = {(r.op, r.N) for r in table.itertuples() if not r.op.startswith("qk_norm")}
    assert got == expected
    assert set(table["op"]) == set(kt.OPS)


def test_committed_a100_table_covers_the_long_rows():
    """The A100 table chapter 4b shows (python -m normtools.measure.bytes_counter --gpu a100
    ...): the row ops at N = 16K ... 128K, and the chunked ones read their rows twice."""
    table = pd.read_csv(COMMITTED.with_name("kernel_traffic_a100.csv"))
    row_ops = [op for op in kt.OPS if not op.startswith("qk_norm")]
    assert {(r.op, r.N) for r in table.itertuples()} == {
        (op, n) for op in row_ops for n in kt.ROW_LENGTHS if n >= 16384}
    assert (table[table["N"] >= 32768]["ratio"] >= 1.25).all()


@pytest.mark.parametrize("op, shape", [
    ("rms_norm_fwd_bwd", {"M": 4096, "N": 2048}),
    ("add_rms_norm", {"M": 4096, "N": 32768}),
    ("qk_norm_rope_per_layer_fwd_bwd", {"T": 4096, "Hq": 32, "Hk": 8, "D": 128}),
])
def test_committed_table_matches_a_recount(op, shape):
    """A recount of some committed rows gives the same bytes, touched and modelled."""
    table = pd.read_csv(COMMITTED)
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    stored = table[(table["op"] == op) & (table["shape"] == label)].iloc[0]
    live = _h200_traffic(op, tuple(shape.items()))
    for key in ("touched", "unique", "minimum", "dram", "dram_no_hints", "launches"):
        assert live[key] == pytest.approx(stored[key], rel=1e-9), key

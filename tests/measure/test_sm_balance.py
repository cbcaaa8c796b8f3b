"""normtools.measure.sm_balance: the SM-time table of the kernels' launches, recounted.

The recount does not use the model: it records the launches the launcher really makes (the
grid and the arguments, through ``launch_hooks.recording_launches`` on an H200's plan), walks
each program's token range and heads as the kernel's own docstring lays them out
(kernels/rms_norm.py, qk_norm.py, qk_norm_rope.py), and computes the SM-time efficiency of one
wave from first principles: every program on its own SMs at once, so the time is the longest
program's, Σ work / (SMs × max work / CTAs). The committed tables
(``python -m normtools.measure.sm_balance --no-compile --csv ...``) must equal the recount and a
regeneration; a compile of one case for sm_90a checks that its real residency keeps one wave.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from normtools.core import launch_hooks
from normtools.measure import sm_balance as sb
from normtools.measure.triton_runs import op_inputs, run_on_triton

DATA = Path(__file__).resolve().parents[2] / "book" / "data" / "kernels"
COMMITTED = {"h200": DATA / "sm_balance.csv", "a100": DATA / "sm_balance_a100.csv"}


def _committed_row(gpu, op, kernel, dtype, shape):
    table = pd.read_csv(COMMITTED[gpu])
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    hit = table[(table["op"] == op) & (table["kernel"] == kernel) & (table["dtype"] == dtype)
                & (table["shape"] == label)]
    assert len(hit) == 1, (op, kernel, dtype, label)
    return hit.iloc[0]


def _recorded_work(launch, head_dim):
    """Work (rows × heads) of every grid program of a recorded launch, from its grid and
    arguments and the kernels' documented program layout (QK-Norm and QK-Norm + RoPE: the q
    programs, then the k programs; PAIRED, grid program p runs q program p and k program
    p)."""
    kw, programs = launch.kwargs, launch.grid[0]
    name = launch.kernel.fn.__name__
    if name.startswith(("rms_norm", "layer_norm")):
        rows, per = kw["M"], kw["rows_per_program"]
        return [max(0, min(per, rows - p * per)) for p in range(programs)]
    tokens, n_q = kw["n_tokens"], kw["n_q_programs"]
    n_k = n_q if kw["PAIRED"] else programs - n_q
    per_program = (kw["q_tokens_per_program"], kw["k_tokens_per_program"])

    def token_rows(group, per):
        return max(0, min(per, tokens - group * per))

    if name.startswith("qk_norm_rope"):
        # slot s of a tensor: its tiles [s · tiles_per_slot, (s + 1) · tiles_per_slot) of
        # BLOCK_H heads each, so heads [s · span, (s + 1) · span), span = tiles_per_slot ·
        # BLOCK_H; all heads per layer
        tensors = ((kw["q_slots"], kw["BLOCK_HQ"] * kw["q_tiles_per_slot"], kw["Q_HEADS"]),
                   (kw["k_slots"], kw["BLOCK_HK"] * kw["k_tiles_per_slot"], kw["K_HEADS"]))
        heads = [[h if kw["PER_LAYER"] else min(span, h - s * span) for s in range(slots)]
                 for slots, span, h in tensors]
    else:
        # slot s of a tensor: heads [s · per_slot, (s + 1) · per_slot) of its H_rows; a
        # per-layer row (H_rows = 1) holds N / head_dim heads
        heads = [[min(per_slot, rows - s * per_slot) * (n // head_dim)
                  for s in range(-(-rows // per_slot))]
                 for rows, per_slot, n in ((kw["q_heads"], kw["q_heads_per_slot"], kw["NQ"]),
                                           (kw["k_heads"], kw["k_heads_per_slot"], kw["NK"]))]
    work = [0] * programs
    for p in range(n_q + n_k):
        tensor, index = (0, p) if p < n_q else (1, p - n_q)
        slot_heads = heads[tensor]
        work[p % programs] += (token_rows(index // len(slot_heads), per_program[tensor])
                               * slot_heads[index % len(slot_heads)])
    return work


@pytest.mark.parametrize("op, shape", [
    ("rms_norm", {"M": 8192, "N": 8192}),                            # a real prefill shape
    ("rms_norm", {"M": 1024, "N": 65536}),                           # clusters of 4
    # paired: a grid program runs the q and the k program of its tokens
    ("qk_norm_per_head", {"T": 8192, "Hq": 32, "Hk": 8, "D": 128}),
    ("qk_norm_per_head", {"T": 64, "Hq": 32, "Hk": 8, "D": 128}),    # few tokens: slots of heads
    ("qk_norm_per_layer", {"T": 8192, "Hq": 48, "Hk": 8, "D": 128}),  # q rows 6x k rows
    ("qk_norm_rope_per_head", {"T": 8192, "Hq": 32, "Hk": 8, "D": 128}),
    # the backward's q heads in 8 tiles of 8: a program takes several tiles
    ("qk_norm_rope_per_head_fwd_bwd", {"T": 1472, "Hq": 64, "Hk": 8, "D": 256}),
])
def test_committed_rows_match_a_recount_of_the_launched_grid(op, shape):
    """Programs, CTAs, one wave and sm_efficiency of committed H200 rows (bfloat16) of every
    main kernel of the op against the grid the launcher launches, recounted."""
    gpu = sb.GPUS["h200"]
    with (launch_hooks.planning_for_cuda(gpu.sm_count, gpu.capability),
          launch_hooks.recording_launches() as launches):
        run_on_triton(op, op_inputs(op, shape, torch.bfloat16))
    for kernel in sb.kernels_of(op):
        launch = next(x for x in launches if x.kernel.fn.__name__ == kernel)
        work, ctas = _recorded_work(launch, shape.get("D")), launch.kwargs.get("num_ctas", 1)
        stored = _committed_row("h200", op, kernel, "bfloat16", shape)
        assert stored["programs"] == len(work) and stored["ctas"] == ctas, kernel
        assert len(work) * ctas <= gpu.sm_count          # one wave at one CTA per SM
        assert stored["waves"] == 1
        recount = sum(work) / (gpu.sm_count * max(work) / ctas)
        assert stored["sm_efficiency"] == pytest.approx(recount, rel=1e-12), kernel


def test_committed_tables_equal_a_regeneration_without_compiling():
    """Every committed row's grid and sm_efficiency, regenerated (a sample of cases of both
    GPUs' tables)."""
    for gpu, path in COMMITTED.items():
        table = pd.read_csv(path)
        sample = table.iloc[::37]
        for row in sample.itertuples():
            shape = dict((k, int(v)) for k, v in (part.split("=") for part in row.shape.split()))
            live = sb.case_balance(row.op, shape, getattr(torch, row.dtype), sb.GPUS[gpu])
            got = next(r for r in live if r["kernel"] == row.kernel)
            for key in ("programs", "ctas", "warps", "n", "m"):
                assert got[key] == getattr(row, key), (gpu, row.op, row.shape, key)
            for key in ("sm_efficiency", "token_bound"):
                assert got[key] == pytest.approx(getattr(row, key), rel=1e-12), key


REGENERATE = r"""
import json, torch
from normtools.measure import sm_balance as sb
shape = {"T": 8192, "Hq": 32, "Hk": 8, "D": 128}
rows = sb.case_balance("qk_norm_rope_per_head_fwd_bwd", shape, torch.bfloat16, sb.GPUS["h200"],
                       compile=True)
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_compiled_residency_keeps_committed_rows_to_one_wave():
    """The rows of the fused QK-Norm + RoPE forward and backward (Qwen 3's prefill shape),
    compiled for sm_90a (in a process without TRITON_INTERPRET, which cannot compile): the
    same grid and sm_efficiency as committed; the compiled kernel's registers and shared
    memory hold at least one CTA, no more than the committed bound, and keep one wave."""
    pytest.importorskip("triton.backends.nvidia")
    shape = {"T": 8192, "Hq": 32, "Hk": 8, "D": 128}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", REGENERATE], capture_output=True, text=True,
                          env=env, check=True)
    for live in json.loads(done.stdout.strip().splitlines()[-1]):
        stored = _committed_row("h200", "qk_norm_rope_per_head_fwd_bwd", live["kernel"],
                                "bfloat16", shape)
        assert live["resident_from"] == "compile" and live["registers"] > 0
        assert 1 <= live["resident"] <= stored["resident"]
        for key in ("programs", "ctas", "waves"):
            assert live[key] == stored[key], key
        assert live["sm_efficiency"] == pytest.approx(stored["sm_efficiency"], rel=1e-12)


def test_sm_time_of_a_second_wave():
    """160 equal programs on 132 SMs: 28 SMs run two, so the time is two programs' and the
    efficiency 160 / (2 · 132); 132 equal programs: 1; a cluster of 4 per program: 33 slots."""
    assert sb.sm_time([1] * 160, 1, 132) == 2
    assert sb.sm_time([1] * 132, 1, 132) == 1
    assert sb.sm_time([4] * 33, 4, 132) == 1
    assert sb.sm_time([4] * 34, 4, 132) == 2


def test_resident_ctas_bounds():
    """16 warps: 4 CTAs by warps; 128 registers a thread fill an SM's 65536 with one; 129
    (allocated as 136) leave none; shared memory of 100 KB (+ 1 KB) fits twice in 228 KB."""
    h200 = sb.GPUS["h200"]
    assert sb.resident_ctas(h200, 16) == 4
    assert sb.resident_ctas(h200, 16, registers=128) == 1
    assert sb.resident_ctas(h200, 16, registers=129) == 0
    assert sb.resident_ctas(h200, 4, registers=32, shared=100 * 1024) == 2


@pytest.mark.parametrize("gpu", ["h200", "a100"])
def test_committed_launches_meet_the_target_or_their_whole_token_bound(gpu):
    """Every committed launch of M >= 4 x SMs rows runs one wave, and reaches the target
    efficiency or the best that a grid of whole tokens can (token_bound, recomputed here for
    a row op as M / (SMs x ceil(M / SMs)) from the table's own columns); none of a row op
    beats that bound (it is one)."""
    table = pd.read_csv(COMMITTED[gpu])
    sms = sb.GPUS[gpu].sm_count
    large = table[table["m"] >= sb.TARGET_ROWS_PER_SM * sms]
    assert (large["waves"] == 1).all()
    rows = table[~table["op"].str.startswith("qk_norm") & (table["ctas"] == 1)]
    bound = rows["m"] / (sms * -(-rows["m"] // sms))
    assert (rows["token_bound"] - bound).abs().max() < 1e-12
    assert (rows["sm_efficiency"] <= rows["token_bound"] + 1e-12).all()
    short = large[large["sm_efficiency"] < sb.TARGET_EFFICIENCY]
    below = short[short["sm_efficiency"] < short["token_bound"] - 1e-12]
    assert below.empty, below[["op", "kernel", "dtype", "shape", "sm_efficiency", "token_bound"]]

"""normtools.measure.spills: registers and spills of the launcher's configurations, ahead of time.

How this measures: the op runs on CPU tensors with the CUDA launch plan, its launches are
recorded (not run), specialized by Triton's own binder, compiled by ``triton.compile`` for
GPUTarget("cuda", cc, 32) to PTX, and assembled by the bundled ``ptxas-blackwell -v``, whose
report gives registers and spill bytes (see the module docstring). Compiling needs a process
without TRITON_INTERPRET, so the checks run in a subprocess.

Compiling every configuration (op x dtype x N x direction x cc) takes minutes, so this test
samples: the backward at N = 16384 in bf16 (which spilled 392 B for RMSNorm and 932 B for
LayerNorm on one CTA; on sm_90 now a cluster of 2), the largest clusters (N = 131072: forward
on 8 CTAs, backward on 16), per-layer QK-Norm, at sm_90; rms_norm at N = 32768 (a cluster on
sm_90, chunks before) and the fused QK-Norm + RoPE per layer (N = 4096 in one tile; N = 65536
in tiles, whose 4096-wide backward tiles spilled 8 B) also for sm_80 and sm_75 (Colab's T4),
and its float16 backward at N = 16384 at sm_90 (4 B of spill in 8 warps).
The same compiles count the cluster exchanges of each reduction (LayerNorm's backward packs
its two sums into one). ``python -m normtools.measure.spills`` prints the full table.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("triton.backends.nvidia")

COMMITTED = Path(__file__).resolve().parents[2] / "book" / "data" / "kernels" / "spills.csv"

SCRIPT = r"""
import json, sys, torch, triton, triton.language as tl
from normtools.measure import spills
from normtools.core import launch_hooks, launcher

@triton.jit
def must_spill(X, Y, BLOCK: tl.constexpr):
    # 8192 float32 values live across a reduction in one warp: 256 per thread > 255 registers
    x = tl.load(X + tl.arange(0, BLOCK))
    tl.store(Y + tl.arange(0, BLOCK), x / tl.sum(x, axis=0))

x = torch.zeros(8192)
with launch_hooks.recording_launches() as toy:
    launcher.kernel_for(must_spill, "cuda")[(1,)](x, x, BLOCK=8192, num_warps=1)
out = {"toy": spills.compile_report(toy[0], 90)}
table = spills.spill_table(ops=("rms_norm_fwd_bwd", "layer_norm_fwd_bwd"),
                           dtypes=(torch.bfloat16,), ns=(16384, 131072), archs=(90,))
table = [table, spills.spill_table(ops=("rms_norm_fwd_bwd",), dtypes=(torch.bfloat16,),
                                   ns=(32768,), archs=(90, 80, 75)),
         spills.spill_table(ops=("qk_norm_per_layer_fwd_bwd",), dtypes=(torch.bfloat16,),
                            ns=(4096,), archs=(90,)),
         spills.spill_table(ops=("qk_norm_rope_per_layer_fwd_bwd",), dtypes=(torch.bfloat16,),
                            ns=(4096, 65536), archs=(90, 80, 75)),
         spills.spill_table(ops=("qk_norm_rope_per_layer_fwd_bwd",), dtypes=(torch.float16,),
                            ns=(16384,), archs=(90,))]
out["rows"] = [row for t in table for row in t.to_dict("records")]
# the prefetch: cp.async loads in the forwards' loops when they prefetch, none by default
# (QK-Norm and QK-Norm + RoPE per head, head_dim 128)
out["cp_async"] = {
    stages: {kernel: [spills.compiled_ptx(launch, 90).count("cp.async")
                      for launch in spills.record_launches(op, torch.bfloat16, n, m=4096,
                                                           stages=stages)
                      if launch.kernel.fn.__name__ == kernel]
             for op, kernel, n in (("rms_norm_fwd_bwd", "rms_norm_fwd", 4096),
                                   ("qk_norm_per_head", "qk_norm_fwd", 128),
                                   ("qk_norm_rope_per_head", "qk_norm_rope_fwd", 128))}
    for stages in (1, 2)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    script = tmp_path_factory.mktemp("spills") / "measure.py"   # @triton.jit needs a file
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_measurement_sees_a_spill(report):
    """A kernel that cannot fit in registers is reported with spill bytes."""
    toy = report["toy"]
    assert toy["spill_stores"] > 0 and toy["spill_loads"] > 0 and toy["registers"] >= 200


def test_no_spills_at_sm90(report):
    rows = [r for r in report["rows"] if r["cc"] == 90]
    kernels = {(r["op"], r["kernel"]) for r in rows}
    assert {("rms_norm_fwd_bwd", "rms_norm_bwd"), ("layer_norm_fwd_bwd", "layer_norm_bwd"),
            ("rms_norm_fwd_bwd", "sum_partials"),
            ("qk_norm_per_layer_fwd_bwd", "qk_norm_bwd"),
            ("qk_norm_rope_per_layer_fwd_bwd", "qk_norm_rope_fwd"),
            ("qk_norm_rope_per_layer_fwd_bwd", "qk_norm_rope_bwd")} <= kernels
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["stack"]]
    assert not spilled, spilled


def test_clusters_compile_at_sm90_only(report):
    """sm_90 compiles the long rows as clusters (16384 backward on 2 CTAs, 131072 forward on 8
    and backward on 16); sm_80 and sm_75 get the chunked kernels, no cluster."""
    clusters = {(r["kernel"], r["N"], r["config"].rsplit(" ", 1)[-1]) for r in report["rows"]
                if r["cc"] == 90 and "ctas=" in r["config"]}
    for kernel in ("rms_norm", "layer_norm"):
        assert {(f"{kernel}_bwd", 16384, "ctas=2"), (f"{kernel}_fwd", 131072, "ctas=8"),
                (f"{kernel}_bwd", 131072, "ctas=16")} <= clusters
    assert ("rms_norm_fwd", 32768, "ctas=2") in clusters
    older = [r for r in report["rows"] if r["cc"] < 90 and "ctas=" in r["config"]]
    assert not older, older
    chunked = {r["kernel"] for r in report["rows"]
               if r["cc"] == 80 and r["N"] == 32768 and "SINGLE_PASS=0" in r["config"]}
    assert chunked == {"rms_norm_fwd", "rms_norm_bwd"}


def test_cluster_reductions_exchange_once_per_value(report):
    """On a cluster a reduction exchanges each of its values across the CTAs behind a cluster
    barrier. LayerNorm's backward packs c1 and c2 in one value (one exchange per row, two
    before), its forward needs two (mean, then the squared deviations), RMSNorm's one;
    off a cluster there is none."""
    exchanges = {}
    for r in report["rows"]:
        if r["kernel"] != "sum_partials":
            exchanges.setdefault((r["kernel"], "ctas=" in r["config"]), set()).add(
                r["cluster_exchanges"])
    assert exchanges[("layer_norm_bwd", True)] == {1}
    assert exchanges[("layer_norm_fwd", True)] == {2}
    assert exchanges[("rms_norm_bwd", True)] == exchanges[("rms_norm_fwd", True)] == {1}
    assert all(counts == {0} for (_, cluster), counts in exchanges.items() if not cluster)


def test_prefetch_compiles_to_async_copies(report):
    """A prefetching plan's loop loads ahead with cp.async, the default plan's does not (the
    RMSNorm, QK-Norm and QK-Norm + RoPE forwards); at sm_90 the report has the row norms'
    kernels compiled both ways (none spills: above), and the committed table every kernel
    of launch_plans.PREFETCH_KERNELS, with no stage-2 row below sm_90."""
    from normtools.core import launch_plans

    for kernel, counts in report["cp_async"]["1"].items():
        assert counts == [0], kernel
    for kernel, counts in report["cp_async"]["2"].items():
        assert len(counts) == 1 and counts[0] > 0, kernel
    prefetching = {(r["kernel"], r["N"]) for r in report["rows"]
                   if r["cc"] == 90 and "stages=2" in r["config"]}
    for kernel in ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd"):
        assert {(kernel, 16384), (kernel, 131072)} <= prefetching
    assert not [r for r in report["rows"] if r["cc"] < 90 and "stages=" in r["config"]]
    committed = pd.read_csv(COMMITTED)
    staged = committed[committed["config"].str.contains("stages=2")]
    assert set(staged["kernel"]) == set(launch_plans.PREFETCH_KERNELS)
    assert (staged["cc"] == 90).all()


def test_compiles_for_sm80_and_sm75(report):
    """Every kernel of rms_norm forward+backward at N = 32768 and of the fused QK-Norm + RoPE
    per layer (a row in one tile, and one read in tiles) compiles for A100 and T4."""
    for cc in (80, 75):
        got = {r["kernel"] for r in report["rows"] if r["cc"] == cc}
        assert got == {"rms_norm_fwd", "rms_norm_bwd", "sum_partials", "qk_norm_rope_fwd",
                       "qk_norm_rope_bwd"}, (cc, got)


def test_qk_launches_compile_paired_too(report):
    """Every QK-Norm and QK-Norm + RoPE launch is compiled a second time paired (the kernels'
    PAIRED, which a launch plan sets where launch_plans.pair_programs balances better), at
    every compute capability, and the row kernels are not."""
    configs = {(r["op"], r["N"], r["kernel"], r["config"], r["cc"]) for r in report["rows"]}
    qk = {c for c in configs if c[2].startswith("qk_norm") and not c[3].endswith(" paired")}
    assert {cc for *_, cc in qk} == {90, 80, 75}
    assert {(op, n, kernel, config + " paired", cc) for op, n, kernel, config, cc in qk} <= configs
    assert not [c for c in configs if c[3].endswith(" paired") and not c[2].startswith("qk")]


def test_committed_table_matches_the_compiles(report):
    """The table chapter 4b shows (python -m normtools.measure.spills --csv ...) has every
    configuration compiled here with the same registers and spill bytes."""
    committed = pd.read_csv(COMMITTED)
    key = ["op", "dtype", "N", "kernel", "config", "cc"]
    compiled = pd.DataFrame(report["rows"])
    merged = compiled.merge(committed, on=key, how="left", suffixes=("", "_committed"))
    assert merged["registers_committed"].notna().all(), merged[merged.isna().any(axis=1)]
    for column in ("registers", "stack", "spill_stores", "spill_loads", "cluster_exchanges"):
        assert (merged[column] == merged[f"{column}_committed"]).all(), column

"""The cases of a GPU run of the benchmark (bench.cases): synthetic and real-shape cases, budgets and
estimates, peers timing at once, the chunked-plan backend, Liger called as its benchmark does."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import normtools
from normtools.measure import bench
from normtools.measure.bench import timing

REPO = Path(__file__).resolve().parents[2]
QK_SHAPE = {"T": 5, "Hq": 4, "Hk": 2, "D": 8}

from normtools.measure.bench import cases as bench_cases



def test_synthetic_cases_move_at_least_256_mib_and_no_more_rows_than_needed():
    dtype = torch.bfloat16
    plan = bench_cases.gpu_run_cases(dtype)
    synthetic = [c for c in plan if c.phase != "real shapes"]
    assert synthetic
    for c in synthetic:
        moved = bench.bytes_moved(c.op, c.shape, dtype)
        assert moved >= 2**28, c
        key = "T" if c.op in bench.QK_OPS else "M"
        smaller = {**c.shape, key: c.shape[key] - 64}
        assert bench.bytes_moved(c.op, smaller, dtype) < 2**28, c   # M scaled, not padded
    first = [c for c in plan if c.phase == "first pass"]
    assert plan[:len(first)] == first   # the first pass runs first
    assert {(c.op, c.shape.get("N")) for c in first if c.op != "qk_norm_per_head"} == {
        (op, n) for op in ("rms_norm", "rms_norm_fwd_bwd") for n in (2048, 8192, 32768, 131072)}
    assert any(c.op == "qk_norm_per_head" for c in first)
    # the sweep does not repeat a first-pass case
    keys = [(c.op, tuple(c.shape.items())) for c in synthetic]
    assert len(keys) == len(set(keys))


def _norm_weight_shapes(model):
    """{module name suffix: weight shape} of layer 0's norms, read off the transformers model."""
    shapes = {}
    for name, p in model.named_parameters():
        if ".layers.0." in name and "norm" in name:
            shapes[name.split(".layers.0.")[1]] = tuple(p.shape)
    return shapes


def test_real_shape_cases_are_the_bundled_models_layouts():
    """Each model's real-shape cases against the norm weights of its own transformers model
    (meta device): the block norm's N, and QK-Norm's head_dim (per head) or heads · head_dim
    (per layer)."""
    from normtools import cards

    plan = bench_cases.real_shape_cases(prefill_tokens=8192, decode_batch=64)
    for name in cards.bundled_configs():
        model = cards.build_model(cards.load_bundled_config(name), device="meta")
        weights = _norm_weight_shapes(model)
        mine = [c for c in plan if name in c.models]
        hidden = weights["input_layernorm.weight"] if "input_layernorm.weight" in weights \
            else weights["post_attention_layernorm.weight"]
        for c in mine:
            if c.op in bench.ROW_OPS:
                assert (c.shape["N"],) == hidden, (name, c)
            else:
                q_norm, k_norm = weights["self_attn.q_norm.weight"], weights["self_attn.k_norm.weight"]
                if "per_head" in c.op:   # QK-Norm, alone or fused with RoPE
                    assert (c.shape["D"],) == q_norm == k_norm, (name, c)
                else:
                    assert (c.shape["Hq"] * c.shape["D"],) == q_norm, (name, c)
                    assert (c.shape["Hk"] * c.shape["D"],) == k_norm, (name, c)
        qk = {c.op for c in mine} & set(bench.QK_OPS)
        assert bool(qk) == ("self_attn.q_norm.weight" in weights), name
        regimes = {(c.regime, c.cache, c.batch, c.tokens_per_sequence) for c in mine}
        assert regimes == {("prefill", "rotated", 1, 8192), ("decode", "warm", 64, 1),
                           ("decode", "rotated", 64, 1)}, name
        assert {c.shape.get("M", c.shape.get("T")) for c in mine} == {8192, 64}


def test_budget_is_all_or_nothing_per_case_and_conditions_per_row(monkeypatch):
    from normtools.measure.bench import sweep

    plan = [bench_cases.Case("first pass", "rms_norm", {"M": 32, "N": 64}),
            bench_cases.Case("real shapes", "rms_norm", {"M": 8, "N": 64}, cache="warm",
                             regime="decode", models=("m",), batch=8, tokens_per_sequence=1),
            bench_cases.Case("sweep", "layer_norm", {"M": 16, "N": 64})]
    fake = {0: 1.0, 1: 100.0, 2: 0.5}   # the second case cannot fit a 10 s budget
    monkeypatch.setattr(sweep, "estimate_seconds",
                        lambda cases, *a, **k: [(c, fake[i]) for i, c in enumerate(cases)])
    data = bench.run_sweep("cpu", torch.float32, cases=plan, warmup=1, reps=3, budget_s=10.0,
                           backends=["normtools-torch", "torch-F"], log=lambda msg: None)
    rows = data["results"]
    assert len(rows) == 6 and len({tuple(r) for r in rows}) == 1
    by_case = {}
    for r in rows:
        by_case.setdefault((r["phase"], r["op"]), set()).add(r["status"])
    assert by_case == {("first pass", "rms_norm"): {"ok"}, ("real shapes", "rms_norm"): {"skipped"},
                       ("sweep", "layer_norm"): {"ok"}}
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert all("budget" in r["reason"] for r in skipped)
    warm = [r for r in rows if r["cache"] == "warm"]
    assert {r["regime"] for r in warm} == {"decode"} and warm[0]["models"] == ["m"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(r["first_call_s"] is not None and r["first_call_s"] >= 0 for r in ok)
    assert all(r["n_buffer_sets"] >= 4 for r in ok)   # rotated cases
    assert data["conditions"]["concurrency"] == "one process, one stream"


def test_warm_cases_call_one_input_set():
    plan = [bench_cases.Case("real shapes", "rms_norm", {"M": 8, "N": 64}, cache="warm")]
    data = bench.run_sweep("cpu", torch.float32, cases=plan, warmup=1, reps=3,
                           backends=["torch-F"], log=lambda msg: None)
    (row,) = data["results"]
    assert row["status"] == "ok" and row["n_buffer_sets"] == 1 and row["cache"] == "warm"


def test_estimate_and_plan_rows_follow_the_budget():
    plan = bench_cases.first_pass_cases(torch.bfloat16)
    backends = ["normtools-triton", "torch-compile"]
    est = bench_cases.estimate_seconds(plan, backends, warmup=10, reps=300)
    assert [c for c, _ in est] == plan and all(s > 0 for _, s in est)
    assert est[0][1] > est[1][1]   # the first compile of each backend costs more
    rows = bench_cases.plan_rows(plan, backends, warmup=10, reps=300, budget_s=est[0][1] + 1e-9)
    assert [r["runs"] for r in rows][:2] == [True, False]
    assert rows[0]["MiB"] >= 256


def test_commit_from_the_environment(monkeypatch):
    from normtools.core import sysinfo

    monkeypatch.setenv("NORMTOOLS_COMMIT", "0123abc")
    assert sysinfo.run_conditions("cpu")["normtools_commit"] == "0123abc"


def test_liger_is_called_as_its_benchmark_does(monkeypatch):
    """in_place=True (Liger's default, which its benchmark uses) for RMSNorm and fused add."""
    import types

    from normtools.measure.bench import backends

    calls = []
    functional = types.SimpleNamespace(
        liger_rms_norm=lambda x, w, eps, in_place: calls.append(("rms", in_place)) or x,
        liger_layer_norm=lambda x, w, b, eps: x,
        liger_fused_add_rms_norm=lambda x, r, w, eps, in_place: calls.append(("add", in_place)) or x)
    monkeypatch.setattr(backends, "import_module", lambda name: functional)
    monkeypatch.setattr(backends.util, "find_spec", lambda name: object())
    ops = backends._liger_ops("cuda", head_dim=4)
    t = {"x": torch.ones(2, 4), "residual": torch.ones(2, 4), "w": torch.ones(4)}
    ops["rms_norm"](t)
    ops["add_rms_norm"](t)
    assert calls == [("rms", True), ("add", True)]
    # no fused QK-Norm + RoPE in Liger: skipped with that reason, not composed behind its name
    for op in ("qk_norm_rope_per_head", "qk_norm_rope_per_layer_fwd_bwd"):
        with pytest.raises(backends.Unavailable, match="no fused QK-Norm \\+ RoPE"):
            backends.backend_fn(op, "liger", "cuda", QK_SHAPE)


@pytest.mark.parametrize("op", bench.shapes.QK_ROPE_OPS)
def test_qk_norm_rope_backends_compute_transformers_rope_after_the_norm(op):
    """torch-F's composition (F.rms_norm, then the rotation) and normtools against an
    independent float64 QK-Norm + apply_rotary_pos_emb, forward and gradients."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    t = bench.make_inputs(op, QK_SHAPE, torch.float32, "cpu")
    d, per_head = QK_SHAPE["D"], "per_head" in op

    def expected(t64):
        def norm(x, w):
            rows = x.view(x.shape[0], -1, d) if per_head else x
            rms = rows.pow(2).mean(-1, keepdim=True).add(bench.shapes.RMS_EPS).rsqrt()
            return (rows * rms).view(x.shape) * (w.repeat(x.shape[1] // d) if per_head else w)
        q, k = norm(t64["q"], t64["q_w"]), norm(t64["k"], t64["k_w"])
        heads = lambda x: x.view(x.shape[0], -1, d).transpose(0, 1)[None]   # (1, H, T, D)
        qr, kr = apply_rotary_pos_emb(heads(q), heads(k), t64["cos"][None], t64["sin"][None])
        flat = lambda x: x[0].transpose(0, 1).reshape(x.shape[2], -1)
        return flat(qr), flat(kr)

    t64 = {name: v.detach().double().requires_grad_(v.requires_grad) for name, v in t.items()}
    want = expected(t64)
    if op.endswith("_fwd_bwd"):
        want = torch.autograd.grad(want, [t64[n] for n in ("q", "k", "q_w", "k_w")],
                                   (t64["dq_out"], t64["dk_out"]))
    for backend in ("normtools-torch", "torch-F", "normtools-triton"):
        got = bench.backend_fn(op, backend, "cpu", QK_SHAPE)(t)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def _fake_liger_wheel(folder):
    """A minimal pure-Python wheel named liger_kernel (the real one is carried, not committed)."""
    import zipfile

    wheel = folder / "liger_kernel-0.0.1-py3-none-any.whl"
    files = {"liger_kernel/__init__.py": "", "liger_kernel/transformers/__init__.py": "",
             "liger_kernel/transformers/functional.py": "def liger_rms_norm(*a, **k):\n    pass\n",
             "liger_kernel-0.0.1.dist-info/METADATA":
                 "Metadata-Version: 2.1\nName: liger_kernel\nVersion: 0.0.1\n",
             "liger_kernel-0.0.1.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "liger_kernel-0.0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("liger_kernel-0.0.1.dist-info/RECORD", record)
    return wheel


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of the script")
def test_gpu_check_dry_run_walks_every_step(tmp_path):
    """--dry-run on the CPU: Liger installed from a wheel without the network, the test files
    collected with nbformat made unimportable, the cluster pass's plan (every cluster
    configuration, the repeats and the occupancy query within its budget), the sweep plan with
    every synthetic case ≥ 256 MiB and a time estimate within the budget, and the output files
    named."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_IMPORT": "shim",
           "GPU_CHECK_TESTS": "tests/measure/test_bench.py tests/measure/test_parity.py",
           "LIGER_WHEEL": str(_fake_liger_wheel(tmp_path)), "NORMTOOLS_COMMIT": "feedbee"}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "liger_kernel imports: liger_kernel.transformers.functional" in log
    assert "| commit feedbee" in log
    collect = (out / "pytest-collect.log").read_text()
    assert re.search(r"\d+/\d+ tests collected", collect) and "error" not in collect.lower()
    cluster = (out / "cluster-check-plan.txt").read_text()
    assert "cluster configurations (14, launch_plans.CUDA_ROW_CONFIGS)" in cluster
    assert "row lengths N: 8193, 16384, 16385, 32768, 32769, 65536, 65537, 131072" in cluster
    assert "rows M: 1, 7, 133, 4096; dtypes: bfloat16, float32" in cluster
    assert "clusters 8 / 16" in cluster and "chunks 8192 / 4096" in cluster
    cases, repeats = re.search(r"budget 90 s, by the estimate: (\d+) of 256 cases and "
                               r"(\d+) of 8 repeats start", cluster).groups()
    assert int(cases) >= 8 and int(repeats) == 8, cluster[-800:]
    assert "cuOccupancyMaxActiveClusters for cluster sizes 2, 4, 8, 16" in cluster
    plan = (out / "bench-plan.txt").read_text()
    smallest = float(re.search(r"smallest synthetic case: ([\d.]+) MiB", plan).group(1))
    assert smallest >= 256
    assert "first pass" in plan and "real shapes" in plan and "decode" in plan
    total, budget, started = re.search(
        r"estimated total (\d+) s; budget (\d+) s: (\d+) of \d+ cases start", plan).groups()
    assert int(started) > 0
    # within the bench's budget: the whole first pass, and real shapes of both regimes,
    # QK-Norm + RoPE among them
    first = re.search(r"first pass: (\d+) of (\d+) start", plan)
    assert first and first.group(1) == first.group(2), plan[-800:]
    real = re.search(r"real shapes: (\d+) of \d+ start, prefill (\d+) of \d+, "
                     r"decode (\d+) of \d+, qk_norm_rope (\d+) of \d+", plan)
    assert real and all(int(n) > 0 for n in real.groups()), plan[-800:]
    for name in ("pytest-gpu.xml", "cluster-check.json", "bench-h200.json", "model-h200.json",
                 "summary.md"):
        assert name in log
    assert "full-width stack: 4 layers, hidden 4096" in log
    assert "--processes 2" in log and "bench-h200-2proc.json" in log
    # the stages' limits add up within the script's, which stays under 8 minutes
    stages = re.search(r"estimated: tests ≤ (\d+) s \+ cluster pass ≤ (\d+) s \+ bench ≤ "
                       r"(\d+) s \+ model ≤ (\d+) s \(script limit (\d+) s\)", log)
    assert stages, log[-2000:]
    *parts, limit = map(int, stages.groups())
    assert sum(parts) <= limit <= 480 and int(budget) == parts[2]


def test_two_processes_time_each_case_at_once():
    """processes=2: a peer process times the same case over the same window; the row records
    both p50s, their aggregate bandwidth and how much the two timing windows overlapped."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread per process (the peer takes the sweep's count)
    plan = [bench_cases.Case("real shapes", "rms_norm", {"M": 64, "N": 1024}, cache="warm",
                             regime="decode", batch=64, tokens_per_sequence=1),
            bench_cases.Case("sweep", "qk_norm_per_head", {"T": 16, "Hq": 8, "Hk": 2, "D": 64},
                             cache="warm")]
    try:
        data = bench.run_sweep("cpu", torch.float32, cases=plan, warmup=5, reps=200,
                               quick=True, backends=["normtools-torch", "torch-F"],
                               processes=2, log=lambda msg: None)
    finally:
        torch.set_num_threads(threads)
    c = data["conditions"]
    assert c["processes"] == 2 and c["concurrency"].startswith("2 processes at once")
    rows = data["results"]
    assert len(rows) == 4 and len({tuple(r) for r in rows}) == 1
    for r in rows:
        assert r["status"] == "ok", r
        assert r["processes"] == 2 and len(r["peer_p50_us"]) == 1 and r["peer_p50_us"][0] > 0
        assert r["aggregate_gbs_p50"] == pytest.approx(
            r["bytes"] / (r["p50_us"] * 1e3) + r["bytes"] / (r["peer_p50_us"][0] * 1e3))
    # the barrier starts both timings together: the windows overlap for most of the case
    assert max(r["overlap"] for r in rows) > 0.5, [r["overlap"] for r in rows]
    # one process: no peers, the aggregate is the process's own bandwidth
    single = bench.run_sweep("cpu", torch.float32, cases=plan[:1], warmup=1, reps=3,
                             quick=True, backends=["torch-F"], log=lambda msg: None)
    (row,) = single["results"]
    assert single["conditions"]["processes"] == 1 and row["processes"] == 1
    assert row["peer_p50_us"] is None and row["aggregate_gbs_p50"] == row["gbs_p50"]


def test_a_failing_or_exited_peer_is_an_error_and_the_next_case_runs():
    from normtools.measure.bench.peers import Peers

    peers = Peers(1, cache_bytes=2**20)
    try:
        # the peer cannot build this case: it breaks the barrier, the caller gets its reason
        bad = ("softmax", "torch-F", {"M": 4, "N": 8}, torch.float32, "cpu", "warm", 1, 3, None)
        with pytest.raises(RuntimeError, match="peer 1: ValueError: unknown op 'softmax'"):
            peers.time_together(bad, lambda: pytest.fail("timed although a peer failed"))
        # the barrier is usable again
        good = ("rms_norm", "torch-F", {"M": 4, "N": 8}, torch.float32, "cpu", "warm", 1, 3, None)
        times, _, peer_times, overlap = peers.time_together(
            good, lambda: timing.time_calls([lambda: time.sleep(0.001)], "cpu", 1, 3))
        assert len(times) == 3 and len(peer_times) == 1 and len(peer_times[0]) == 3
        assert 0.0 <= overlap <= 1.0
        peers.workers[0].terminate()
        peers.workers[0].join()
        with pytest.raises(RuntimeError, match="have exited"):
            peers.time_together(good, lambda: None)
    finally:
        peers.close()


def test_chunked_plan_backend_reads_long_rows_twice():
    """normtools-triton-chunks' wrapper: every launch of the call, backward included, gets
    the plan of a GPU without clusters. Counted on CPU (the interpreter, CUDA plans of 132
    SMs): rms_norm forward+backward at N = 32768 reads x once in the forward and x and dy
    once in the backward on the sm_90 plan; on the chunked one x again in the forward, and x,
    dy and (for g = w ⊙ dy in both passes) w again in the backward, once per program; the
    gradients agree."""
    from normtools.core import launch_hooks, launch_plans
    from normtools.measure import bytes_counter
    from normtools.measure.bench import backends

    shape = {"M": 4, "N": 32768}
    assert backends.clusters_matter("rms_norm_fwd_bwd", shape)
    assert not backends.clusters_matter("rms_norm_fwd_bwd", {"M": 4, "N": 8192})
    t = bench.make_inputs("rms_norm_fwd_bwd", shape, torch.float32, "cpu")

    def fwd_bwd(inputs):
        y = normtools.rms_norm(inputs["x"], inputs["w"], 1e-6, backend="triton")
        return torch.autograd.grad(y, (inputs["x"], inputs["w"]), inputs["dy"])

    with launch_hooks.planning_for_cuda(), bytes_counter.counting_bytes() as on_clusters:
        expected = fwd_bwd(t)
    with bytes_counter.counting_bytes() as chunked:
        got = backends.on_chunked_plan(fwd_bwd, 132)(t)
    row = shape["M"] * shape["N"] * 4
    programs = launch_plans.launch_plan("rms_norm_bwd", torch.float32, 4, 32768,
                                        capability=80).programs
    weight = shape["N"] * 4
    for kernel, reread in (("rms_norm_fwd", row), ("rms_norm_bwd", 2 * row + programs * weight)):
        extra = sum(chunked[kernel].loads.values()) - sum(on_clusters[kernel].loads.values())
        assert reread <= extra < reread * 1.01, kernel
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, shape, kernels", [
    ("rms_norm_fwd_bwd", {"M": 64, "N": 512}, ("rms_norm_fwd", "rms_norm_bwd", "sum_partials")),
    ("qk_norm_per_head", {"T": 64, "Hq": 4, "Hk": 2, "D": 64}, ("qk_norm_fwd",)),
    # q's row is two tiles of the backward's plan: a program's tiles are whole heads
    ("qk_norm_rope_per_head_fwd_bwd", {"T": 16, "Hq": 64, "Hk": 8, "D": 256},
     ("qk_norm_rope_fwd", "qk_norm_rope_bwd", "sum_partials")),
])
def test_prefetch_backend_prefetches_every_single_pass_launch(op, shape, kernels):
    """normtools-triton-prefetch's wrapper: on the sm_90 plan every single-pass launch of the
    call (row norms, QK-Norm, the fused QK-Norm + RoPE), backward included, gets
    NUM_STAGES = 2 (1 without the wrapper, and for the weight-gradient sum), and the results
    (the gradients for *_fwd_bwd) are those of the default plan (the interpreter runs the loop
    the same way)."""
    from normtools.core import launch_hooks
    from normtools.measure.bench import backends

    t = bench.make_inputs(op, shape, torch.float32, "cpu")
    fn = backends.backend_fn(op, "normtools-triton", "cpu", shape)
    stages = {}
    for wrap in (lambda fn: fn, backends.on_prefetching_plan):
        with launch_hooks.planning_for_cuda(), launch_hooks.recording_launches() as launches:
            wrap(fn)(t)
        stages[wrap] = {launch.kernel.fn.__name__: launch.kwargs.get("NUM_STAGES")
                        for launch in launches}
    plain, prefetching = stages.values()
    for got_stages, want in ((plain, 1), (prefetching, 2)):
        assert got_stages == {k: None if k == "sum_partials" else want for k in kernels}
    with launch_hooks.planning_for_cuda():
        expected = fn(t)
        got = backends.on_prefetching_plan(fn)(t)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_prefetch_matters_where_a_program_has_several_row_blocks():
    """The prefetch backend is timed where an sm_90 program loops over more than one row
    block: many rows or tokens, not one block's worth, nor a per_layer fused row longer than
    a tile (read in two passes, it never prefetches)."""
    from normtools.measure.bench import backends

    assert backends.prefetch_matters("rms_norm_fwd_bwd", {"M": 4096, "N": 4096})
    assert not backends.prefetch_matters("rms_norm_fwd_bwd", {"M": 64, "N": 4096})  # a block
    qk = {"T": 4096, "Hq": 8, "Hk": 2, "D": 128}
    assert backends.prefetch_matters("qk_norm_per_head", qk)
    assert backends.prefetch_matters("qk_norm_rope_per_head", qk)
    assert not backends.prefetch_matters("qk_norm_rope_per_head", dict(qk, T=64))
    # q's row past the forward's and the backward's tiles: per head whole heads, per layer
    # two passes
    long_row = {"T": 4096, "Hq": 128, "Hk": 8, "D": 256}
    assert backends.prefetch_matters("qk_norm_rope_per_head_fwd_bwd", long_row)
    assert not backends.prefetch_matters("qk_norm_rope_per_layer_fwd_bwd", long_row)


def test_estimate_leaves_out_rows_a_backend_skips():
    """The chunked-plan backend adds estimated time to a long row only, the prefetching one
    to a row op whose programs have several row blocks; Liger none to the fused QK-Norm +
    RoPE it does not offer."""
    long_row, short_row = (bench.Case("sweep", "rms_norm", {"M": 64, "N": n})
                           for n in (32768, 4096))
    rope = bench.Case("sweep", "qk_norm_rope_per_head", {"T": 64, "Hq": 4, "Hk": 2, "D": 64})

    def seconds(case, backends):
        return bench.estimate_seconds([case], backends, warmup=1, reps=10)[0][1]

    ours = ["normtools-triton"]
    assert seconds(long_row, ours + ["normtools-triton-chunks"]) > seconds(long_row, ours)
    assert seconds(short_row, ours + ["normtools-triton-chunks"]) == seconds(short_row, ours)
    many_rows = bench.Case("sweep", "rms_norm", {"M": 4096, "N": 4096})
    assert seconds(many_rows, ours + ["normtools-triton-prefetch"]) > seconds(many_rows, ours)
    assert seconds(short_row, ours + ["normtools-triton-prefetch"]) == seconds(short_row, ours)
    assert seconds(rope, ours + ["normtools-triton-prefetch"]) == seconds(rope, ours)
    assert seconds(rope, ours + ["liger"]) == seconds(rope, ours)

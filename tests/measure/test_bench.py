"""normtools.measure.bench: the bytes model against the tensors themselves, the timer, the sweep's JSON,
the loader and the targets report, the CLI and bench/gpu_check.sh (CPU smoke run)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import normtools
from normtools.measure import bench
from normtools.measure.bench import timing
from normtools.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
ROW_SHAPE = {"M": 6, "N": 40}
QK_SHAPE = {"T": 5, "Hq": 4, "Hk": 2, "D": 8}


def _nbytes(*tensors):
    return sum(t.nbytes for t in tensors)


def _traffic_from_tensors(op, t):
    """Bytes read and written, counted from the tensors normtools itself takes and returns."""
    if op == "rms_norm":
        y = normtools.rms_norm(t["x"], t["w"], backend="torch")
        return _nbytes(t["x"], t["w"], y)
    if op == "rms_norm_fwd_bwd":
        y = normtools.rms_norm(t["x"], t["w"], backend="torch")
        dx, dw = torch.autograd.grad(y, (t["x"], t["w"]), t["dy"])
        forward = _nbytes(t["x"], t["w"], y)
        backward = _nbytes(t["x"], t["dy"], t["w"], dx, dw)
        return forward + backward
    if op == "add_rms_norm":
        normed, summed = normtools.add_rms_norm(t["x"], t["residual"], t["w"], backend="torch")
        return _nbytes(t["x"], t["residual"], t["w"], normed, summed)
    if op == "layer_norm":
        y = normtools.layer_norm(t["x"], t["w"], t["b"], backend="torch")
        return _nbytes(t["x"], t["w"], t["b"], y)
    if op.startswith("qk_norm_rope_"):
        scope = "per_head" if "per_head" in op else "per_layer"
        inputs = (t["q"], t["k"], t["q_w"], t["k_w"], t["cos"], t["sin"])
        q_out, k_out = normtools.qk_norm_rope(*inputs, head_dim=QK_SHAPE["D"], scope=scope,
                                              backend="torch")
        forward = _nbytes(*inputs, q_out, k_out)
        if not op.endswith("_fwd_bwd"):
            return forward
        grads = torch.autograd.grad((q_out, k_out), (t["q"], t["k"], t["q_w"], t["k_w"]),
                                    (t["dq_out"], t["dk_out"]))
        return forward + _nbytes(*inputs, t["dq_out"], t["dk_out"], *grads)
    scope = op.removeprefix("qk_norm_")
    q_out, k_out = normtools.qk_norm(t["q"], t["k"], t["q_w"], t["k_w"], head_dim=QK_SHAPE["D"],
                                     scope=scope, backend="torch")
    return _nbytes(t["q"], t["k"], t["q_w"], t["k_w"], q_out, k_out)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("op", bench.OPS)
def test_bytes_model_matches_the_tensors(op, dtype):
    shape = QK_SHAPE if op in bench.QK_OPS else ROW_SHAPE
    inputs = bench.make_inputs(op, shape, dtype, "cpu")
    assert bench.bytes_moved(op, shape, dtype) == _traffic_from_tensors(op, inputs)


def test_make_inputs_shapes_and_unknown_op():
    t = bench.make_inputs("qk_norm_per_layer", QK_SHAPE, torch.float32, "cpu")
    assert t["q"].shape == (5, 32) and t["k"].shape == (5, 16)
    assert t["q_w"].shape == (32,) and t["k_w"].shape == (16,)
    assert all(bool((v != 0).all()) for v in t.values())
    with pytest.raises(ValueError, match="unknown op"):
        bench.make_inputs("softmax", ROW_SHAPE, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown op"):
        bench.bytes_moved("softmax", ROW_SHAPE, torch.float32)


@pytest.mark.parametrize("set_bytes, cache, budget, expected", [
    (2**20, 32 * 2**20, 2**30, 64),      # 64 sets of 1 MiB = 2× a 32 MiB cache
    (100 * 2**20, 32 * 2**20, 2**30, 4),  # large sets: never fewer than 4
    (300 * 2**20, 32 * 2**20, 2**30, 3),  # ... unless the memory budget says so
    (2**30, 32 * 2**20, 2**30, 2),        # and never fewer than 2
    (64, 32 * 2**20, 2**30, 256),         # tiny sets: capped
])
def test_n_buffer_sets(set_bytes, cache, budget, expected):
    assert bench.n_buffer_sets(set_bytes, cache, budget) == expected


def test_time_calls_rotates_and_measures_wall_clock():
    order = []

    def make(i):
        def call():
            order.append(i)
            time.sleep(0.002)
        return call

    times, per_sample = bench.time_calls([make(i) for i in range(3)], "cpu", warmup=2, reps=7)
    assert per_sample == 1 and len(times) == 7
    assert order == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert min(times) >= 2000.0            # µs: at least the sleep
    assert sorted(times)[3] < 2000.0 + 100_000
    for timer in ("events", "do_bench", "sundial"):
        with pytest.raises(ValueError, match="does not apply"):
            bench.time_calls([make(0)], "cpu", warmup=0, reps=1, timer=timer)


def test_rotating_calls_keep_outputs_in_distinct_buffers():
    sets = [{"x": torch.full((256, 256), float(i))} for i in range(5)]
    seen = []

    def fn(t):
        y = t["x"] + 1
        seen.append((int(t["x"][0, 0]), y.data_ptr()))
        return y

    calls = bench.rotating_calls(fn, sets)
    for k in range(10):
        calls[k % 5]()
    assert [i for i, _ in seen] == [k % 5 for k in range(10)]
    # the five outputs of one rotation are alive at once, so they sit in five buffers
    assert len({ptr for _, ptr in seen[5:]}) == 5


class _WallClockEvent:
    """Stands in for torch.cuda.Event: records the host clock (the CUDA timing logic on CPU)."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # ms, as CUDA events


def test_cuda_timer_logic_with_a_wall_clock_stand_in(monkeypatch):
    """Grouping, batching and rotation of the CUDA timer, run on the host clock."""
    monkeypatch.setattr(torch.cuda, "Event", _WallClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: time.sleep(cycles / 1e9), raising=False)
    monkeypatch.setattr(timing, "_SLEEP_CYCLES_PER_US", None)
    order = []

    def make(i, seconds):
        def call():
            order.append(i)
            if seconds:
                time.sleep(seconds)
        return call

    slow = [make(i, 0.001) for i in range(4)]      # 1 ms per call: one call per sample
    times, group = bench.time_calls(slow, "cuda", warmup=2, reps=5)
    assert group == 1 and len(times) == 5 and min(times) >= 1000.0
    assert order == [0, 1] + [0, 1, 2, 3] * 2 + [0, 1, 2, 3, 0]
    order.clear()
    fast = [make(i, 0) for i in range(3)]          # far below 20 µs: calls are grouped
    times, group = bench.time_calls(fast, "cuda", warmup=1, reps=4)
    assert group > 1 and len(times) == 4
    assert order[-4 * group:] == [k % 3 for k in range(4 * group)]


def test_summarize_percentiles():
    # 1..100: linear interpolation between closest ranks
    stats = bench.summarize(list(range(1, 101)))
    assert stats["p50_us"] == pytest.approx(50.5)
    assert stats["p95_us"] == pytest.approx(95.05)
    assert stats["p99_us"] == pytest.approx(99.01)
    assert stats["mean_us"] == pytest.approx(50.5) and stats["min_us"] == 1


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cpu-quick.json"
    data = bench.run_sweep("cpu", torch.float32, quick=True,
                           backends=["normtools-torch", "torch-F", "liger"], out_path=out,
                           log=lambda msg: None)
    return data, out


def test_sweep_json_schema_and_arithmetic(quick_results):
    data, out = quick_results
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    c = data["conditions"]
    for key in ("device", "dtype", "warmup", "reps", "rotate_buffers", "timer", "versions",
                "cpu_model", "torch_threads", "python"):
        assert key in c
    assert c["device"] == "cpu" and c["dtype"] == "float32"
    assert data["copy_bandwidth_gbs"] > 0
    rows = data["results"]
    assert len({tuple(r) for r in rows}) == 1   # every row has the same keys
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, b) for op in bench.OPS for b in ("normtools-torch", "torch-F", "liger")}
    for r in rows:
        if r["backend"] == "liger":
            assert r["status"] == "skipped" and "CUDA" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["p50_us"] <= r["p95_us"] <= r["p99_us"]
        assert r["gbs_p50"] == pytest.approx(r["bytes"] / (r["p50_us"] * 1e3))
        assert r["pct_of_copy_bw"] == pytest.approx(100 * r["gbs_p50"] / data["copy_bandwidth_gbs"])
        assert r["n_buffer_sets"] >= 4
    # torch.nn.functional computes the same function as the reference (checked on the output)
    diffs = [r["max_abs_diff"] for r in rows if r["backend"] == "torch-F"]
    assert len(diffs) == len(bench.OPS) and max(diffs) < 1e-4


def test_sweep_defaults_skip_triton_on_cpu_and_honour_the_budget():
    reason = bench.default_backends("cpu")["normtools-triton"]
    assert "interpreter" in reason
    assert bench.default_backends("cuda")["normtools-triton"] is None
    data = bench.run_sweep("cpu", torch.float32, ops=["rms_norm"], quick=True,
                           backends=["normtools-torch", "torch-F"], budget_s=0.0,
                           log=lambda msg: None)
    (first, second) = data["results"]
    # a budget of 0 s: no case starts, each is recorded as skipped
    assert first["status"] == second["status"] == "skipped"
    assert "budget" in first["reason"]
    with pytest.raises(ValueError, match="unknown backends"):
        bench.run_sweep("cpu", ops=["rms_norm"], quick=True, backends=["cudnn"])
    with pytest.raises(ValueError, match="unknown ops"):
        bench.run_sweep("cpu", ops=["softmax"], quick=True, backends=["torch-F"])


def test_torch_compile_backend_is_timed_or_skipped_with_reason():
    data = bench.run_sweep("cpu", torch.float32, ops=["rms_norm"], quick=True,
                           backends=["normtools-torch", "torch-compile"], log=lambda msg: None)
    compiled = data["results"][1]
    assert compiled["backend"] == "torch-compile"
    if compiled["status"] == "ok":
        assert compiled["max_abs_diff"] < 1e-5
    else:
        assert compiled["status"] == "skipped" and compiled["reason"]


def test_load_results(quick_results, tmp_path):
    data, out = quick_results
    frame, conditions = bench.load_results(out.parent)
    assert len(frame) == len(data["results"])
    assert set(frame["source"]) == {out.name}
    assert conditions[out.name]["copy_bandwidth_gbs"] == data["copy_bandwidth_gbs"]
    ok = frame[frame["status"] == "ok"]
    assert set(ok["shape"]) == {"M=64 N=256", "T=16 Hq=4 Hk=2 D=64"}
    assert set(ok["N"].dropna()) == {256}
    empty, none = bench.load_results(tmp_path / "missing")
    assert empty.empty and none == {}


def _row(op, backend, shape, p50, pct=50.0, status="ok"):
    return {"op": op, "backend": backend, "shape": shape, "p50_us": p50, "pct_of_copy_bw": pct,
            "status": status, "reason": "" if status == "ok" else "not installed"}


def test_targets_report_on_hand_made_results(tmp_path):
    small, big = {"M": 4096, "N": 1024}, {"M": 4096, "N": 4096}
    head = {"T": 8192, "Hq": 32, "Hk": 8, "D": 128}
    data = {"conditions": {"device": "cuda"}, "results": [
        _row("rms_norm", "normtools-triton", small, 10.0, pct=50.0),   # N < 2048: no bw target
        _row("rms_norm", "torch-compile", small, 12.0),
        _row("rms_norm", "normtools-triton", big, 20.0, pct=95.0),
        _row("rms_norm", "torch-compile", big, 18.0),
        _row("rms_norm", "liger", big, None, status="skipped"),
        _row("qk_norm_per_head", "normtools-triton", head, 30.0, pct=79.0),
        _row("qk_norm_per_head", "torch-compile", head, 60.0),
    ]}
    report = {(r["target"], r["op"], r["shape"]): r for r in bench.targets_report(data)}
    bw = "% of copy bandwidth ≥ 90"
    assert (bw, "rms_norm", "M=4096 N=1024") not in report
    assert report[(bw, "rms_norm", "M=4096 N=4096")]["passed"] is True
    qk = report[("% of copy bandwidth ≥ 80", "qk_norm_per_head", "T=8192 Hq=32 Hk=8 D=128")]
    assert qk["passed"] is False and qk["measured"] == 79.0
    vs_compile = "speedup vs torch-compile ≥ 1.0"
    assert report[(vs_compile, "rms_norm", "M=4096 N=1024")]["measured"] == pytest.approx(1.2)
    slower = report[(vs_compile, "rms_norm", "M=4096 N=4096")]
    assert slower["passed"] is False and slower["measured"] == pytest.approx(0.9)
    assert report[(vs_compile, "qk_norm_per_head", "T=8192 Hq=32 Hk=8 D=128")]["passed"] is True
    liger = report[("speedup vs liger ≥ 1.0", "rms_norm", "M=4096 N=4096")]
    assert liger["passed"] is None and "not installed" in liger["note"]
    assert len(report) == 6
    stored = tmp_path / "gpu.json"
    stored.write_text(json.dumps(data))
    assert bench.targets_report(stored) == bench.targets_report(data)
    summary = bench.markdown_summary({**data, "copy_bandwidth_gbs": 4000.0, "conditions": {
        "device": "cuda", "python": "3.12", "dtype": "bfloat16", "warmup": 10, "reps": 100,
        "utc": "now", "gpu": {"name": "NVIDIA H200"}}})
    assert "NVIDIA H200" in summary
    assert "3 passed, 2 missed, 1 without data" in summary


def test_cli_and_module_entry_points(quick_results, tmp_path):
    out, summary = tmp_path / "r.json", tmp_path / "s.md"
    assert cli_main(["bench", "--device", "cpu", "--quick", "--ops", "layer_norm",
                     "--backends", "torch-F", "--threads", "1", "--out", str(out),
                     "--summary", str(summary)]) == 0
    data = json.loads(out.read_text())
    assert [r["op"] for r in data["results"]] == ["layer_norm"]
    assert data["conditions"]["torch_threads"] == 1
    assert "| layer_norm | M=64 N=256 |" in summary.read_text()
    assert cli_main(["bench", "--device", "cpu", "--quick", "--timer", "do_bench"]) == 2
    report = subprocess.run([sys.executable, "-m", "normtools.measure.bench", "--report",
                             str(quick_results[1])], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "| qk_norm_per_head | T=16 Hq=4 Hk=2 D=64 |" in report.stdout


def test_gpu_check_script_syntax():
    script = str(REPO / "bench" / "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", script], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run of the script")
def test_gpu_check_script_quick_on_cpu_with_symlink_tree(tmp_path):
    """The script end to end on CPU, making normtools importable without installing it."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "GPU_CHECK_IMPORT": "shim",
           "GPU_CHECK_TESTS": "tests/measure/test_bench.py"}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--quick"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "normtools from /" in run.stdout and str(REPO) + "/normtools" not in run.stdout
    for name in ("pytest-gpu.xml", "bench-quick.json", "summary.md", "bench.log",
                 "bench-quick-2proc.json"):
        assert (tmp_path / name).is_file(), name
    # pytest collected this file's GPU tests and skipped them (no CUDA here)
    junit = (tmp_path / "pytest-gpu.xml").read_text()
    assert re.search(r'errors="0" failures="0" skipped="[1-9]', junit), junit
    data = json.loads((tmp_path / "bench-quick.json").read_text())
    assert any(r["status"] == "ok" for r in data["results"])
    # the concurrency stage: two processes timed each case at once
    two = json.loads((tmp_path / "bench-quick-2proc.json").read_text())
    assert two["conditions"]["processes"] == 2
    ok = [r for r in two["results"] if r["status"] == "ok"]
    assert ok and all(len(r["peer_p50_us"]) == 1 for r in ok)


@pytest.mark.gpu
def test_quick_sweep_on_cuda_triton_rows():
    # torch.compile is left to the sweep itself: its compiles would dominate this test
    data = bench.run_sweep("cuda", torch.bfloat16, quick=True, log=lambda msg: None,
                           backends=["normtools-torch", "normtools-triton", "torch-F", "liger"])
    assert data["conditions"]["gpu"]["name"]
    assert data["copy_bandwidth_gbs"] > 100
    for r in data["results"]:
        if r["backend"] == "normtools-triton":
            assert r["status"] == "ok", r
            assert r["max_abs_diff"] < 0.1, r   # bf16 outputs of O(1): one rounding apart
            assert r["calls_per_sample"] >= 1
        assert r["status"] != "error", r
    assert bench.targets_report(data)


@pytest.mark.gpu
def test_events_timer_agrees_with_do_bench_on_a_large_copy():
    """Where launch overhead does not matter (a 512 MiB copy), both timers see the same time."""
    events, _ = bench.copy_bandwidth("cuda", nbytes=2**29, timer="events")
    triton_timer, _ = bench.copy_bandwidth("cuda", nbytes=2**29, timer="do_bench")
    assert events == pytest.approx(triton_timer, rel=0.25)


# ----------------------------------------------------------------- the cases of a GPU run

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
    collected with nbformat made unimportable, the plan with every synthetic case ≥ 256 MiB and
    a time estimate within the budget, and the output files named."""
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
    for name in ("pytest-gpu.xml", "bench-h200.json", "model-h200.json", "summary.md"):
        assert name in log
    assert "full-width stack: 4 layers, hidden 4096" in log
    assert "--processes 2" in log and "bench-h200-2proc.json" in log
    # the stages' limits add up within the script's, which stays under 8 minutes
    stages = re.search(r"estimated: tests ≤ (\d+) s \+ bench ≤ (\d+) s \+ model ≤ (\d+) s "
                       r"\(script limit (\d+) s\)", log)
    assert stages, log[-2000:]
    *parts, limit = map(int, stages.groups())
    assert sum(parts) <= limit <= 480 and int(budget) == parts[1]


def test_targets_report_keeps_warm_and_rotated_decode_apart():
    decode = {"M": 64, "N": 4096}
    def row(backend, p50, cache, pct=10.0):
        return {**_row("rms_norm", backend, decode, p50, pct=pct), "phase": "real shapes",
                "regime": "decode", "cache": cache}
    data = {"conditions": {"device": "cuda"}, "results": [
        row("normtools-triton", 5.0, "warm"), row("torch-compile", 4.0, "warm"),
        row("normtools-triton", 6.0, "rotated"), row("torch-compile", 9.0, "rotated")]}
    report = {r["shape"]: r for r in bench.targets_report(data)}
    assert set(report) == {"M=64 N=4096, decode, warm", "M=64 N=4096, decode, rotated"}
    assert report["M=64 N=4096, decode, warm"]["passed"] is False
    assert report["M=64 N=4096, decode, rotated"]["passed"] is True
    # no bandwidth target on a launch-bound real shape
    assert all(r["target"].startswith("speedup") for r in report.values())


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


def test_estimate_leaves_out_rows_a_backend_skips():
    """The chunked-plan backend adds estimated time to a long row only; Liger none to the
    fused QK-Norm + RoPE it does not offer."""
    long_row, short_row = (bench.Case("sweep", "rms_norm", {"M": 64, "N": n})
                           for n in (32768, 4096))
    rope = bench.Case("sweep", "qk_norm_rope_per_head", {"T": 64, "Hq": 4, "Hk": 2, "D": 64})

    def seconds(case, backends):
        return bench.estimate_seconds([case], backends, warmup=1, reps=10)[0][1]

    ours = ["normtools-triton"]
    assert seconds(long_row, ours + ["normtools-triton-chunks"]) > seconds(long_row, ours)
    assert seconds(short_row, ours + ["normtools-triton-chunks"]) == seconds(short_row, ours)
    assert seconds(rope, ours + ["liger"]) == seconds(rope, ours)

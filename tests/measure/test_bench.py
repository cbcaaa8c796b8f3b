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
from normtools.measure.bench.results import read_results
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
    complete = {**data, "copy_bandwidth_gbs": 4000.0, "conditions": {
        "device": "cuda", "python": "3.12", "dtype": "bfloat16", "warmup": 10, "reps": 100,
        "utc": "now", "gpu": {"name": "NVIDIA H200"}}}
    stored = tmp_path / "gpu.json"
    stored.write_text(json.dumps(complete))
    assert bench.targets_report(stored) == bench.targets_report(data)
    summary = bench.markdown_summary(complete)
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
    for name in ("pytest-gpu.xml", "cluster-check-quick.json", "bench-quick.json", "summary.md",
                 "bench.log", "bench-quick-2proc.json"):
        assert (tmp_path / name).is_file(), name
    # the cluster pass ran under the interpreter: one case, two repeats, no mismatch
    cluster = json.loads((tmp_path / "cluster-check-quick.json").read_text())
    assert len(cluster["cases"]) == 1 and len(cluster["repeats"]) == 1
    assert cluster["failures"] == 0
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


@pytest.fixture
def no_timing(monkeypatch):
    """The sweep and the CPU table replaced by stand-ins that fail: nothing may be timed."""
    from normtools.measure.bench import cli, cpu_table

    def ran(*args, **kwargs):
        raise AssertionError("timed something")

    monkeypatch.setattr(cli, "run_sweep", ran)
    monkeypatch.setattr(cpu_table, "run_cpu_table", ran)


@pytest.mark.parametrize("argv, named", [
    (["--warmup", "-1"], "--warmup"), (["--reps", "0"], "--reps"), (["--reps", "-3"], "--reps"),
    (["--budget-s", "-1"], "--budget-s"), (["--budget-s", "nan"], "--budget-s"),
    (["--budget-s", "inf"], "--budget-s"), (["--budget-s", "0"], "--budget-s"),
    (["--cases", "gpu-run", "--phases", "bogus"], "--phases"),
    (["--phases", "sweep"], "--phases"),
    (["--report", "{results}", "--cpu-table"], "--cpu-table"),
    (["--report", "{results}", "--device", "cpu", "--dtype", "float16", "--ops", "layer_norm"],
     "--device, --dtype, --ops"),
    (["--report", "{results}", "--warmup", "0"], "--warmup"),
    (["--report", "{results}", "--dry-run"], "--dry-run"),
    (["--cpu-table", "--quick", "--device", "cpu", "--dtype", "float16", "--ops", "layer_norm",
      "--backends", "liger", "--timer", "wall", "--processes", "4"],
     "--device, --dtype, --ops, --backends, --timer, --processes"),
    (["--cpu-table", "--dry-run"], "--dry-run"),
    (["--dry-run", "--device", "cpu", "--timer", "events"], "timer 'events' does not apply to cpu"),
    (["--device", "cpu", "--timer", "events"], "timer 'events' does not apply to cpu"),
    (["--device", "meta"], "--device"), (["--device", "mps"], "--device"),
    (["--device", "cpu", "--summary", "{dir}"], "--summary"),
    (["--device", "cpu", "--out", "{dir}"], "--out"),
    (["--device", "cpu", "--out", "{file}/r.json"], "--out"),
    (["--cpu-table", "--out", "{dir}"], "--out"),
])
def test_cli_refuses_bad_options_before_any_work(no_timing, capsys, tmp_path, argv, named):
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "file").write_text("")
    paths = {"results": tmp_path / "results.json", "dir": tmp_path, "file": tmp_path / "file"}
    argv = [arg.format(**paths) for arg in argv]
    assert cli_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normtools bench: error: ") and named in err
    assert len(err.strip().splitlines()) == 1


def test_cpu_table_gets_the_counts_given_and_its_own_defaults(monkeypatch, tmp_path):
    from normtools.measure.bench import cpu_table

    seen = []
    monkeypatch.setattr(cpu_table, "run_cpu_table", lambda cases, **kwargs: seen.append(kwargs))
    monkeypatch.setattr(cpu_table, "cpu_table_markdown", lambda table: "")
    assert cli_main(["bench", "--cpu-table", "--quick", "--warmup", "0", "--reps", "7",
                     "--threads", "2"]) == 0
    assert cli_main(["bench", "--cpu-table", "--quick"]) == 0
    given, defaults = seen
    assert (given["warmup"], given["reps"], given["threads"]) == (0, 7, 2)
    assert not {"warmup", "reps", "threads"} & set(defaults)  # run_cpu_table's own defaults


def test_dry_run_shows_the_counts_the_run_uses(quick_results, capsys):
    conditions = quick_results[0]["conditions"]  # a real run: --device cpu --quick
    assert cli_main(["bench", "--dry-run", "--device", "cpu", "--quick"]) == 0
    assert f"{conditions['warmup']} warm-up + {conditions['reps']} samples" \
        in capsys.readouterr().out
    warmup, reps = timing._DEFAULT_REPS["cpu"]  # what run_sweep uses without --quick
    assert cli_main(["bench", "--dry-run", "--device", "cpu", "--ops", "rms_norm"]) == 0
    assert f"{warmup} warm-up + {reps} samples" in capsys.readouterr().out
    assert cli_main(["bench", "--dry-run", "--device", "cpu", "--warmup", "0"]) == 0
    assert f"0 warm-up + {reps} samples" in capsys.readouterr().out


@pytest.mark.parametrize("where, key", [(None, "copy_bandwidth_gbs"), ("conditions", "device"),
                                        ("row", "status"), ("row", "shape"), ("ok row", "p50_us")])
def test_report_names_the_key_a_results_file_lacks(quick_results, tmp_path, capsys, where, key):
    data = json.loads(quick_results[1].read_text())
    ok_row = next(row for row in data["results"] if row["status"] == "ok")
    part = {None: data, "conditions": data["conditions"], "row": data["results"][-1],
            "ok row": ok_row}[where]
    del part[key]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .* lacks {key}"):
        read_results(path)
    assert cli_main(["bench", "--report", str(path)]) == 2
    assert f"lacks {key}" in capsys.readouterr().err


def test_report_on_a_file_of_empty_parts_names_the_file(tmp_path, capsys):
    path = tmp_path / "empty-parts.json"
    path.write_text(json.dumps({"conditions": {}, "results": [{}]}))
    assert cli_main(["bench", "--report", str(path)]) == 2
    assert f"{path}: not a normtools bench results file (the file lacks copy_bandwidth_gbs)" \
        in capsys.readouterr().err

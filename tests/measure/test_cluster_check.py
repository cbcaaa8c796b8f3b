"""The GPU run's cluster pass (normtools.measure.cluster_check), on CPU: a tiny pass under
Triton's interpreter on the forced sm_90 cluster plan and the chunked plan, that it fails on a
wrong float64 reference and on a run that changes a bit, and that its row lengths reach every
cluster configuration of the launch table (the occupancy query's ctypes structures are
tested beside the query, normtools.core.occupancy, in tests/core/test_occupancy.py)."""

import json

import pytest
import torch
import triton

from normtools.core import launch_plans
from normtools.measure import cluster_check

TINY = ["--device", "cpu", "--ops", "rms_norm", "--dtypes", "float32", "--ns", "16385",
        "--ms", "1"]


def test_tiny_pass_runs_the_cluster_and_the_chunked_plan(tmp_path, capsys):
    """N = 16,385, one row: forward on a cluster of 2 CTAs, backward of 4, against the chunked
    plan (no clusters) and float64; two repeats bitwise equal."""
    out = tmp_path / "cluster.json"
    assert cluster_check.main(TINY + ["--repeats", "2", "--repeat-rows", "1",
                                      "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (case,) = data["cases"]
    assert [p["num_ctas"] for p in case["plans"]["cluster"]] == [2, 4]
    assert [p["num_ctas"] for p in case["plans"]["chunked"]] == [1, 1]
    assert {c["output"] for c in case["checks"]} == {"y", "dx", "dw"}
    assert case["ok"] and all(c["ok"] for c in case["checks"])
    (repeat,) = data["repeats"]
    assert repeat["ok"] and repeat["repeats"] == 2 and repeat["differing_runs"] == 0
    assert data["failures"] == 0 and data["conditions"]["triton"] == triton.__version__
    assert "cluster check: 1 of 1 cases pass" in capsys.readouterr().out


def test_pass_fails_on_a_wrong_reference(tmp_path, monkeypatch, capsys):
    """A float64 reference 0.1 % off (far outside float32's 1e-5): the pass exits 1 and names
    the mismatch."""
    right = cluster_check.FLOAT64_OPS["rms_norm"]
    monkeypatch.setitem(cluster_check.FLOAT64_OPS, "rms_norm",
                        lambda dtype: lambda x, w: 1.001 * right(dtype)(x, w))
    out = tmp_path / "cluster.json"
    assert cluster_check.main(TINY + ["--repeats", "1", "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["failures"] == 1 and not data["cases"][0]["ok"]
    assert "MISMATCH case rms_norm" in capsys.readouterr().out


def test_repeats_fail_when_a_run_changes_a_bit(monkeypatch):
    """The bitwise repeat check sees one changed bit in one output of one run."""
    names, make = cluster_check.NORMTOOLS_OPS["rms_norm"]
    calls = []

    def flaky(backend):
        fn = make(backend)

        def call(x, w):
            calls.append(backend)
            y = fn(x, w)
            if len(calls) == 2:    # the second run: y one ulp up (its gradient unchanged)
                up = torch.nextafter(y.detach(), torch.full_like(y, float("inf")))
                y = y + (up - y.detach())
            return y
        return call

    monkeypatch.setitem(cluster_check.NORMTOOLS_OPS, "rms_norm", (names, flaky))
    record = cluster_check.check_repeats("rms_norm", torch.float32, 16385, 1, 3,
                                         cluster_check._Target("cpu"))
    assert not record["ok"] and record["first_differing"] == [1]


def test_row_lengths_reach_every_cluster_configuration():
    """Every cluster row of the launch table, forward and backward, in both element sizes,
    is launched by the pass at the lowest and the highest N of its range."""
    for config in cluster_check.cluster_configs():
        dtype = torch.bfloat16 if config["element_bytes"] == 2 else torch.float32
        for family in ("rms_norm", "layer_norm", "qk_norm"):
            kernel = f"{family}_{config['direction']}"
            reached = {n: launch_plans.launch_plan(kernel, dtype, 133, n).num_ctas
                       for n in cluster_check.ROW_LENGTHS
                       if config["n_lowest"] <= n <= config["n_highest"]}
            assert set(reached) == {config["n_lowest"], config["n_highest"]}, (kernel, config)
            assert set(reached.values()) == {config["num_ctas"]}, (kernel, reached)
    assert {c["num_ctas"] for c in cluster_check.cluster_configs()} == {2, 4, 8, 16}
    assert min(cluster_check.ROW_LENGTHS) <= 16385 and max(cluster_check.ROW_LENGTHS) == 131072


@pytest.mark.gpu
def test_tiny_pass_on_cuda_with_the_occupancy_query(tmp_path):
    """On an sm_90 GPU: the tiny pass compiled, and the occupancy query answers for the
    compiled cluster kernels (clusters of 2 and 4 CTAs)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    out = tmp_path / "cluster.json"
    assert cluster_check.main(["--device", "cuda", "--ops", "rms_norm", "--dtypes", "bfloat16",
                               "--ns", "16385", "--ms", "7", "--repeats", "20",
                               "--out", str(out)]) == 0
    occupancy = json.loads(out.read_text())["occupancy"]
    assert {row["num_ctas"] for row in occupancy} >= {2, 4}
    assert all(row["max_active_clusters"] > 0 for row in occupancy)

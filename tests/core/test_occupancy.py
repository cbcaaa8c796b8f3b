"""Cluster grids sized from the occupancy query (issue 31, second waves).

On CPU: the ctypes structures of the query against gcc's layout of Triton's cuda.h; the launch
plan with a resident limit is one wave and still gives every row to exactly one program
(recounted by walking the programs' row ranges); the launcher's re-plan with the query
replaced by a fake (32 clusters of 4 on an H200's 132 SMs → 32 programs) and with a query
that fails (the table's grid and one warning). On an sm_90 GPU: the real query after a real
launch caps the next plan."""

import contextlib
import ctypes
import shutil
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch
import triton

import normtools
from normtools._kernels import layer_norm as layer_norm_kernels
from normtools._kernels import qk_norm as qk_norm_kernels
from normtools._kernels import rms_norm as rms_norm_kernels
from normtools.core import launch_plans, launcher, occupancy

H200_SMS = 132
needs_cluster_triton = pytest.mark.skipif(
    launch_plans.TRITON_VERSION < launch_plans.CLUSTER_MIN_TRITON,
    reason="cluster plans need Triton >= 3.9")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")
def test_occupancy_structures_have_the_driver_api_layout(tmp_path):
    """ctypes' LaunchConfig and LaunchAttribute against CUlaunchConfig and CUlaunchAttribute as
    gcc lays them out from Triton's copy of cuda.h (sizes and field offsets), and the enum
    values the query passes."""
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    source = tmp_path / "layout.c"
    source.write_text(r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu\n", sizeof(CUlaunchConfig), sizeof(CUlaunchAttribute),
         offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
         offsetof(CUlaunchAttribute, value));
  printf("%d %d %d\n", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
         (int)CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
         (int)CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED);
  return 0;
}
""")
    binary = tmp_path / "layout"
    subprocess.run(["gcc", "-I", str(include), str(source), "-o", str(binary)], check=True)
    sizes, enums = subprocess.run([str(binary)], capture_output=True, text=True,
                                  check=True).stdout.splitlines()
    config, attribute = occupancy.LaunchConfig, occupancy.LaunchAttribute
    assert list(map(int, sizes.split())) == [
        ctypes.sizeof(config), ctypes.sizeof(attribute), config.sharedMemBytes.offset,
        config.hStream.offset, config.attrs.offset, config.numAttrs.offset,
        attribute.cluster_x.offset]
    assert list(map(int, enums.split())) == [
        occupancy.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        occupancy.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        occupancy.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED]


def _rows_of_programs(plan, m):
    """Walk the persistent grid as the kernels do: program p of a tensor's share takes slot
    p mod slots and rows [g · rows_per_program, (g + 1) · rows_per_program) ∩ [0, m), g =
    p // slots. Returns, per tensor and slot, how many programs took each row."""
    taken = []
    for share in plan.shares:
        per_slot = [[0] * m for _ in range(share.slots)]
        for p in range(share.programs):
            slot, group = p % share.slots, p // share.slots
            for row in range(group * share.rows_per_program,
                             min((group + 1) * share.rows_per_program, m)):
                per_slot[slot][row] += 1
        taken += per_slot
    return taken


@needs_cluster_triton
@pytest.mark.parametrize("kernel,dtype,n,tensors,num_ctas", [
    ("rms_norm_fwd", torch.bfloat16, 65536, ((1, 1),), 4),
    ("layer_norm_bwd", torch.float32, 65536, ((1, 1),), 8),
    ("qk_norm_fwd", torch.bfloat16, 32768, ((1, 1), (1, 1)), 2)])
@pytest.mark.parametrize("resident", [1, 5, 16, 32])
@pytest.mark.parametrize("m", [1, 7, 133, 4096])
def test_resident_limit_gives_one_wave_over_every_row(kernel, dtype, n, tensors, num_ctas,
                                                      resident, m):
    """With the GPU holding ``resident`` clusters: the grid has at most that many programs (or
    one per slot when there are more slots), its longest program is as short as that many
    programs allow (ceil(m / (resident / tensors)) rows), and every row of every slot is
    taken by exactly one program."""
    table = launch_plans.launch_plan(kernel, dtype, m, n, "cuda", H200_SMS, tensors)
    plan = launch_plans.launch_plan(kernel, dtype, m, n, "cuda", H200_SMS, tensors,
                                    resident_limit=resident)
    assert table.num_ctas == plan.num_ctas == num_ctas
    assert table.programs <= H200_SMS // num_ctas     # the table's own one wave
    assert (plan.block_m, plan.block_n, plan.num_warps) == (table.block_m, table.block_n,
                                                            table.num_warps)
    assert plan.programs <= max(resident, len(tensors))
    per_tensor = max(1, resident // len(tensors))
    assert {share.rows_per_program for share in plan.shares} == {-(-m // min(m, per_tensor))}
    assert all(count == 1 for per_slot in _rows_of_programs(plan, m) for count in per_slot)


def test_the_table_kernel_names_are_the_kernels_function_names():
    """plan_for's key (a name of launch_plans.KERNELS) and the launch's (the @triton.jit
    function's name) must agree for a recorded occupancy to reach the plan."""
    modules = {"rms_norm": rms_norm_kernels, "layer_norm": layer_norm_kernels,
               "qk_norm": qk_norm_kernels}
    for name in ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
                 "qk_norm_fwd", "qk_norm_bwd"):
        assert getattr(modules[name.rsplit("_", 1)[0]], name).fn.__name__ == name


class _FakeJitKernel:
    """Stands for a @triton.jit kernel on CUDA: a launch records its grid and returns a
    'compiled kernel' with cluster PTX and the metadata the occupancy query reads."""

    def __init__(self, name, num_ctas, num_warps):
        self.fn = types.SimpleNamespace(__name__=name)
        self.grids, self.num_ctas, self.num_warps = [], num_ctas, num_warps

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(grid)
            return types.SimpleNamespace(
                asm={"ptx": "barrier.cluster.arrive; mapa.shared::cluster.u32"},
                metadata=types.SimpleNamespace(num_ctas=self.num_ctas,
                                               num_warps=self.num_warps, shared=0))
        return launch


@pytest.fixture
def fresh_launcher(monkeypatch):
    """The launcher on a fake H200 (cuda:0, 132 SMs, sm_90) with empty occupancy records and
    no CUDA device guard."""
    monkeypatch.setattr(launcher, "cuda_sm_count_and_capability", lambda device: (H200_SMS, 90))
    monkeypatch.setattr(launcher, "_RESIDENT_CLUSTERS", {})
    monkeypatch.setattr(launcher, "_CHECKED_CLUSTER_KERNELS", set())
    monkeypatch.setattr(launcher, "_OCCUPANCY_FAILED", [])
    monkeypatch.setattr(launcher.torch.cuda, "device", lambda device: contextlib.nullcontext())
    return launcher


def _launch(kernel, plan):
    return launcher._DeviceGuardedKernel(kernel, torch.device("cuda:0"))[(plan.programs,)](
        num_warps=plan.num_warps, num_ctas=plan.num_ctas)


@needs_cluster_triton
def test_launcher_caps_a_cluster_grid_at_the_resident_clusters(fresh_launcher, monkeypatch):
    """The query says 32 clusters of 4 CTAs fit at once: after the first launch (the table's
    33 programs: 132 SMs // 4), every plan of that kernel has 32 programs, each taking
    128 of the 4,096 rows; the query is asked once per compiled kernel; another kernel keeps
    its plan."""
    asked = []
    monkeypatch.setattr(occupancy, "resident_clusters", lambda compiled: asked.append(1) or 32)
    plan = fresh_launcher.plan_for("rms_norm_fwd", torch.bfloat16, 4096, 65536, "cuda:0")
    assert (plan.num_ctas, plan.programs) == (4, 33)
    kernel = _FakeJitKernel("rms_norm_fwd", 4, plan.num_warps)
    _launch(kernel, plan)
    replanned = fresh_launcher.plan_for("rms_norm_fwd", torch.bfloat16, 4096, 65536, "cuda:0")
    assert (replanned.num_ctas, replanned.programs, replanned.rows_per_program) == (4, 32, 128)
    assert kernel.grids == [(33,)] and len(asked) == 1
    backward = fresh_launcher.plan_for("rms_norm_bwd", torch.bfloat16, 4096, 65536, "cuda:0")
    assert backward.programs == H200_SMS // backward.num_ctas
    # the CPU interpreter's plan never asks
    assert fresh_launcher.plan_for("rms_norm_fwd", torch.bfloat16, 4096, 65536,
                                   "cpu").programs == launch_plans.CPU_PROGRAMS


@needs_cluster_triton
def test_launcher_keeps_the_table_grid_and_warns_once_when_the_query_fails(fresh_launcher,
                                                                           monkeypatch):
    """No libcuda: two compiled cluster kernels launch, the query fails for both, one warning
    is given, and the plans keep the table's grid."""
    def no_driver(compiled):
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(occupancy, "resident_clusters", no_driver)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kernel_name in ("rms_norm_fwd", "layer_norm_fwd"):
            plan = fresh_launcher.plan_for(kernel_name, torch.bfloat16, 4096, 65536, "cuda:0")
            _launch(_FakeJitKernel(kernel_name, plan.num_ctas, plan.num_warps), plan)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "occupancy query" in messages[0], messages
    again = fresh_launcher.plan_for("rms_norm_fwd", torch.bfloat16, 4096, 65536, "cuda:0")
    assert again.programs == H200_SMS // again.num_ctas


@pytest.mark.gpu
def test_real_query_caps_the_next_plan_on_sm90():
    """On an sm_90 GPU: RMSNorm at N = 65,536 in bfloat16 (clusters of 4 CTAs) launches, the
    driver's answer for the compiled kernel is recorded, the next plan has at most that many
    programs, and the output is bitwise the first launch's (rows are independent) and matches
    the torch backend."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    x = torch.randn(4096, 65536, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(65536, device="cuda", dtype=torch.bfloat16) + 0.5
    y = normtools.rms_norm(x, w, backend="triton")
    plan = launcher.plan_for("rms_norm_fwd", x.dtype, 4096, 65536, x.device)
    key = ("rms_norm_fwd", torch.cuda.current_device(), plan.num_ctas, plan.num_warps)
    resident = launcher._RESIDENT_CLUSTERS[key]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 0 < resident <= sms // plan.num_ctas
    assert plan.num_ctas == 4 and plan.programs <= resident
    y_again = normtools.rms_norm(x, w, backend="triton")
    ref = normtools.rms_norm(x, w, backend="torch")
    assert torch.equal(y, y_again)
    torch.testing.assert_close(y_again.float(), ref.float(), rtol=2e-2, atol=2e-2)

"""Every Triton launch on CUDA tensors runs inside ``torch.cuda.device(tensor.device)``.

Triton launches on the current CUDA device; a tensor on another GPU would be read by a launch
on the wrong one. On CPU the guard is checked by faking the CUDA side: ``torch.cuda.device`` is
replaced by a recorder and each op's compiled kernel by a stand-in that notes which device
guard is active when it is launched. The GPU test launches on a second GPU while the first is
current.
"""

import contextlib

import pytest
import torch

import normtools
from normtools.core import launcher
from normtools.core import ops as ops_module
from normtools.core import qk as qk_module


class FakeCudaGuard:
    """Stands in for ``torch.cuda.device``: records the device of every guard entered and
    which one is active."""

    def __init__(self):
        self.entered, self.active = [], []

    @contextlib.contextmanager
    def __call__(self, device):
        self.entered.append(torch.device(device))
        self.active.append(torch.device(device))
        try:
            yield
        finally:
            self.active.pop()


def test_kernel_for_enters_the_guard_of_the_tensors_device(monkeypatch):
    guard = FakeCudaGuard()
    monkeypatch.setattr(torch.cuda, "device", guard)
    launched_under = []

    class CompiledKernel:                      # a compiled @triton.jit kernel, as far as
        def __getitem__(self, grid):           # kernel_for can tell
            return lambda *args, **kwargs: launched_under.append(list(guard.active))

    for index in (1, 0, 3):
        launcher.kernel_for(CompiledKernel(), torch.device("cuda", index))[(4,)](1, 2, X=3)
    assert launched_under == [[torch.device("cuda", 1)], [torch.device("cuda", 0)],
                              [torch.device("cuda", 3)]]
    assert guard.active == []


def test_cpu_launches_enter_no_cuda_guard(monkeypatch):
    guard = FakeCudaGuard()
    monkeypatch.setattr(torch.cuda, "device", guard)
    x = torch.randn(3, 16)
    normtools.rms_norm(x, torch.ones(16), backend="triton")
    assert guard.entered == []


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "qk_norm"])
def test_every_op_launches_through_the_guard(op, monkeypatch):
    """Every launch of every op (forward and backward) goes through ``kernel_for`` with the
    device of its input, so the guard covers it: recorded by a kernel_for that records."""
    seen = []
    real = launcher.kernel_for

    def recording(kernel, device):
        seen.append((getattr(kernel, "__name__", None) or kernel.fn.__name__,
                     torch.device(device)))
        return real(kernel, device)

    for module in (ops_module, qk_module, launcher):
        if hasattr(module, "kernel_for"):
            monkeypatch.setattr(module, "kernel_for", recording)
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    if op == "rms_norm":
        y = normtools.rms_norm(x, w, backend="triton")
    elif op == "add_rms_norm":
        y = sum(normtools.add_rms_norm(x, torch.randn(4, 16), w, backend="triton"))
    elif op == "layer_norm":
        y = normtools.layer_norm(x, w, torch.zeros(16), backend="triton")
    else:
        y = sum(o.sum() for o in normtools.qk_norm(x.view(4, 2, 8), x.view(4, 2, 8), w[:8],
                                                   w[:8], head_dim=8, backend="triton"))
    y.sum().backward()
    names = [name for name, _ in seen]
    assert any(name.endswith("_fwd") for name in names) and any(
        name.endswith("_bwd") for name in names), names
    assert all(device == x.device for _, device in seen)


@pytest.mark.gpu
def test_launch_on_a_gpu_that_is_not_current():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    x = torch.randn(64, 256, device="cuda:1")
    w = torch.rand(256, device="cuda:1") + 0.5
    y = normtools.rms_norm(x, w, backend="triton")
    ref = normtools.rms_norm(x.cpu(), w.cpu(), backend="torch")
    assert y.device == x.device
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-5, atol=1e-5)

"""Test-wide settings: offline Hugging Face, a fixed thread count, GPU skips.

Triton kernels run under the interpreter for CPU tensors whenever a test asks for
``backend="triton"`` (normtools.core.launcher does that without TRITON_INTERPRET); ``backend="auto"``
stays on the PyTorch reference on CPU, so tests that do not target the kernels stay fast.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("NORMBOOK_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (compiled Triton kernels)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run much faster on one thread than on two (no spin-waiting on a busy machine);
    the thread count is restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def nan_filled_float32(monkeypatch):
    """torch.empty returns NaN-filled float32 tensors: unwritten partial rows show."""
    empty = torch.empty

    def poisoned(*size, **kwargs):
        out = empty(*size, **kwargs)
        if out.dtype == torch.float32:
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", poisoned)

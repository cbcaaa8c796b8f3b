"""Test-wide settings: Triton's interpreter on CPU-only machines, a fixed thread count, GPU skips."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
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

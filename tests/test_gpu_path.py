"""The chapters' GPU path, checked on a CPU: the compute dtype on a GPU without bfloat16 (a faked
T4) and with it (a faked H100)."""

import contextlib

import pytest
import torch

from normtools.core import precision
from normtools.lab import train


class FakeGPU:
    """torch.cuda's answers for one GPU, as torch 2.13 gives them: ``is_bf16_supported`` counts
    emulation unless ``including_emulation=False`` (a T4 can create bfloat16 tensors)."""

    def __init__(self, name, capability):
        self.name, self.capability = name, capability

    def install(self, monkeypatch):
        native = self.capability >= (8, 0)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True: native or including_emulation)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: self.capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(precision, "_REPORTED", set())


T4, H100 = FakeGPU("Tesla T4", (7, 5)), FakeGPU("NVIDIA H100 80GB HBM3", (9, 0))


def test_cpu_computes_in_bfloat16(capsys):
    assert precision.compute_dtype("cpu") == torch.bfloat16
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("fallback", [torch.float16, torch.float32])
def test_gpu_without_bfloat16_falls_back_with_one_line(monkeypatch, capsys, fallback):
    T4.install(monkeypatch)
    assert not precision.has_bf16_arithmetic("cuda:0")
    assert precision.compute_dtype("cuda:0", fallback) == fallback
    assert precision.compute_dtype("cuda:0", fallback) == fallback   # printed once only
    lines = capsys.readouterr().out.splitlines()
    name = str(fallback).removeprefix("torch.")
    assert lines == [f"Tesla T4 (sm_75): no bfloat16 arithmetic, using {name} "
                     f"({precision.FALLBACK_REASONS[fallback]})"]
    assert len(lines[0]) <= 100


def test_gpu_with_bfloat16_keeps_it_silently(monkeypatch, capsys):
    H100.install(monkeypatch)
    assert precision.compute_dtype("cuda", torch.float32) == torch.bfloat16
    assert capsys.readouterr().out == ""


def test_fallback_must_be_a_float_of_the_book():
    with pytest.raises(ValueError, match="torch.float16 or torch.float32"):
        precision.compute_dtype("cpu", torch.float64)


@pytest.mark.parametrize("gpu, expected", [(T4, "fp32"), (H100, "bf16")])
def test_training_autocast_follows_the_compute_dtype(monkeypatch, capsys, gpu, expected):
    gpu.install(monkeypatch)
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: (device_type, dtype))
    chosen, _ = train.autocast_for("auto", torch.device("cuda"))
    assert chosen == expected
    assert ("no bfloat16 arithmetic, using float32" in capsys.readouterr().out) == (gpu is T4)

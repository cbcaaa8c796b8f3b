"""The compute dtype of a device: bfloat16 where it does bfloat16 arithmetic, else a fallback.

bfloat16 arithmetic needs a GPU of compute capability 8.0 or more (Ampere and later). On an
older GPU, such as Colab's free T4 (sm_75), torch can still store bfloat16 tensors and emulate
some ops, so ``torch.cuda.is_bf16_supported()`` answers True there (its default counts
emulation); only ``is_bf16_supported(including_emulation=False)`` asks for the hardware. A
chapter, a training run or a benchmark that wants bfloat16 on a device asks
:func:`compute_dtype`, which returns bfloat16 where the device has it (a CPU: torch's CPU
kernels compute bfloat16 ops in float32 and round, so the numbers are bfloat16's) and otherwise
the caller's fallback, printing once per process one line that names the GPU and the fallback.

Which fallback keeps a chapter's point (``FALLBACK_REASONS``):

* ``torch.float16`` for kernels, parity and step times: the same 2 bytes per element, so the
  bytes moved, the bandwidth figures and the "within a few ulps" checks keep their meaning
  (float16's ulps are finer: 10 fraction bits instead of 7, and its range ends at 65504).
* ``torch.float32`` for training: float16 autocast needs loss scaling and has a different
  overflow point, so a stability result would no longer be bfloat16's; float32 is the
  reference the bfloat16 runs are compared with.
"""

import torch

__all__ = ["FALLBACK_REASONS", "compute_dtype", "has_bf16_arithmetic"]

FALLBACK_REASONS = {
    torch.float16: "2 bytes per element, like bfloat16",
    torch.float32: "float16 training would need loss scaling",
}
_REPORTED = set()   # the fallback lines already printed in this process


def has_bf16_arithmetic(device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (not emulated): a CPU, or a CUDA GPU of
    compute capability ≥ 8.0 (``torch.cuda.is_bf16_supported(including_emulation=False)``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def compute_dtype(device, fallback: torch.dtype = torch.float16, why: str | None = None,
                  *, quiet: bool = False) -> torch.dtype:
    """bfloat16 on a ``device`` with bfloat16 arithmetic, else ``fallback`` (float16 or float32).

    On a fallback, prints once per process a line such as ``Tesla T4 (sm_75): no bfloat16
    arithmetic, using float16 (2 bytes per element, like bfloat16)``; ``why`` replaces the
    reason in brackets (default ``FALLBACK_REASONS[fallback]``), ``quiet`` the print.
    """
    if fallback not in FALLBACK_REASONS:
        raise ValueError(f"fallback must be torch.float16 or torch.float32, got {fallback}")
    device = torch.device(device)
    if has_bf16_arithmetic(device):
        return torch.bfloat16
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    else:
        name = f"device {device}"
    line = (f"{name}: no bfloat16 arithmetic, using {str(fallback).removeprefix('torch.')} "
            f"({why or FALLBACK_REASONS[fallback]})")
    if not quiet and line not in _REPORTED:
        _REPORTED.add(line)
        print(line, flush=True)
    return fallback

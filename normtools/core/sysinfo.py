"""What a run ran on: the machine, the accelerator and the software versions.

Every record of the conditions of a run comes from here, in the lowest layer that reports
them, so that the lab, the measurements and the book all read them the same way:

* ``run_conditions()`` — a flat, JSON-ready dict stored next to every benchmark result, so that
  a number can always be traced back to the device, driver and library versions that produced
  it (``normtools.measure``);
* ``study_machine()`` — the short record a committed study of the stability lab keeps
  (``normtools.lab.studies``);
* ``environment_versions()`` — the versions a chapter's conditions cell shows
  (``normtools.book``).

Nothing here raises: a fact that cannot be read is recorded as ``None`` (or, in
``environment_versions``, as ``"not installed"``).
"""

import datetime
import os
import platform
import shutil
import subprocess
from importlib import metadata

import torch

__all__ = ["package_versions", "cpu_model", "cuda_device", "nvidia_driver_version",
           "cpu_cache_bytes", "source_commit", "run_conditions", "study_machine",
           "environment_versions", "REPORTED_PACKAGES"]

_PACKAGES = ("normtools", "torch", "triton", "transformers", "liger-kernel", "numpy")
#: The packages whose versions a chapter's conditions cell reports (the lock pins them all).
REPORTED_PACKAGES = ("torch", "triton", "transformers", "numpy", "pandas", "matplotlib")


def package_versions(names=_PACKAGES):
    """Installed distribution versions, read from package metadata (nothing is imported).

    Returns {name: version or None when not installed}.
    """
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_cache_bytes():
    """Size in bytes of the CPU's last-level cache (Linux sysfs, cpu0), or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = {}
    try:
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "level"), encoding="utf-8") as f:
                    level = int(f.read())
                with open(os.path.join(base, entry, "size"), encoding="utf-8") as f:
                    size = f.read().strip()
                units = {"K": 2**10, "M": 2**20, "G": 2**30}
                sizes[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        return None
    return sizes[max(sizes)] if sizes else None


def nvidia_driver_version():
    """The NVIDIA driver version as ``nvidia-smi`` reports it (e.g. "580.159.03"), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def source_commit():
    """The git commit (short hash, "+dirty" when the tree has changes) of the normtools source
    tree, or None when it is not a git checkout.

    ``NORMTOOLS_COMMIT``, when set, is returned as it is: a copy of the tree without its ``.git``
    (what a lent GPU machine receives) is told its commit by whoever copied it.
    """
    if os.environ.get("NORMTOOLS_COMMIT"):
        return os.environ["NORMTOOLS_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=20, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cuda_device(index=0):
    """Properties of CUDA device ``index``: name, memory, multiprocessors, L2, capability.

    Returns None when no CUDA device is visible.
    """
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "total_memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "compute_capability": f"{props.major}.{props.minor}",
    }


def run_conditions(device="cpu"):
    """Everything needed to interpret a timing taken on ``device`` ("cpu" or "cuda").

    Keys: utc time, python, platform, cpu model, logical CPU count, last-level cache, torch
    intra-op threads, the 1/5/15-minute load average (other work on the machine), package
    versions, the normtools git commit, CUDA runtime version (torch.version.cuda), NVIDIA driver
    version, the CUDA device's properties (None on CPU) and whether Triton's interpreter is on.
    """
    is_cuda = torch.device(device).type == "cuda"
    return {
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cuda" if is_cuda else "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_cache_bytes": cpu_cache_bytes(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": package_versions(),
        "normtools_commit": source_commit(),
        "cuda_runtime": torch.version.cuda,
        "nvidia_driver": nvidia_driver_version() if is_cuda else None,
        "gpu": cuda_device() if is_cuda else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }


def study_machine():
    """The machine a committed study of the stability lab ran on: the torch, numpy and normtools
    versions, python, the CPU architecture (``platform.processor()``, else
    ``platform.machine()``), logical CPUs, torch intra-op threads, ATen's CPU capability and
    how normtools differentiated RMSNorm (``ops.RMS_NORM_BACKWARD``)."""
    from normtools.core import ops

    return {**package_versions(("torch", "numpy", "normtools")),
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rms_norm_backward": ops.RMS_NORM_BACKWARD}


def environment_versions(packages=REPORTED_PACKAGES):
    """Installed versions of ``packages`` plus ``python``, e.g. ``{"python": "3.11.7", "torch": ...}``.

    Read from the installed distributions' metadata (:func:`package_versions`: nothing is
    imported); a package that is not installed is reported as ``"not installed"``.
    """
    versions = package_versions(packages)
    return {"python": platform.python_version(),
            **{name: "not installed" if v is None else v for name, v in versions.items()}}

"""Registers and register spills of every kernel configuration the launcher picks, on CPU.

How it measures (no GPU needed):

1. Record the launches. Each op runs on small CPU tensors inside
   ``normtools.core.launch_hooks.planning_for_cuda`` (the CUDA launch plan of each compute
   capability: block sizes, chunking, warps, clusters from sm_90, grid) and
   ``recording_launches`` (each ``kernel[grid](*args, **kwargs)`` is recorded, not run). M is
   small; the kernel's constexprs, warps and CTAs depend on N, the dtype and the capability.
2. Specialize as a launch would: Triton's own binder (``create_function_from_signature``)
   and ``JITFunction._pack_args`` turn the recorded arguments into the signature, constexprs
   and divisibility attributes that a CUDA launch of the same arguments compiles.
3. Compile ahead of time with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc,
   32))`` to PTX, for each compute capability (90: H100/H200, 80: A100, 75: T4, Colab's free
   GPU).
4. Count the cluster exchanges in the PTX (``ld.shared::cluster``, one per value a
   reduction sends across a cluster), assemble the PTX with Triton's bundled ``ptxas-blackwell
   -v --gpu-name sm_XX`` (sm_90a for 90; it reads Triton 3.9's PTX, the older bundled
   ``ptxas`` does not) and read its report: "Used R registers" and "S bytes stack frame, A
   bytes spill stores, B bytes spill loads".

``spill_table()`` returns one row per (op, dtype, N, kernel configuration, cc). Needs
TRITON_INTERPRET unset (an interpreted kernel cannot be compiled); compiling takes about two
seconds per configuration, so tests sample configurations and ``python -m
normtools.measure.spills`` prints the full table.
"""

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import tempfile

import pandas as pd
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from normtools.core import launch_hooks, launch_plans
from normtools.measure.triton_runs import op_inputs, op_shape, run_on_triton

_ARCHS = (90, 80, 75)
ROW_LENGTHS = tuple(2**p for p in range(10, 18))        # N = 1K ... 128K
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The ops whose launches are compiled; QK-Norm at Hq = 32, Hk = 8 heads of head_dim N / 32 per
# layer (per_layer row of N) and of head_dim 64 / 128 / 256 per head.
OPS = ("rms_norm_fwd_bwd", "add_rms_norm_fwd_bwd", "layer_norm_fwd_bwd",
       "qk_norm_per_head_fwd_bwd", "qk_norm_per_layer_fwd_bwd",
       "qk_norm_rope_per_head_fwd_bwd", "qk_norm_rope_per_layer_fwd_bwd")
_QK_HEAD_DIMS = (64, 128, 256)
# Prefetch stage counts compiled at sm_90 besides the default 1 (launch_plans.PREFETCH_KERNELS;
# the other kernels ignore it, and their rows are not repeated)
PREFETCH_STAGES = (2,)
# The PTX instruction by which a CTA reads another CTA's shared memory in a cluster: one per
# value a reduction exchanges across the cluster (Triton 3.9 puts each behind its own cluster
# barrier), so its count is the number of exchanges a row's reductions cost.
CLUSTER_EXCHANGE = "ld.shared::cluster"
_REPORT = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                     r".*?Used (\d+) registers", re.S)


def _ptxas_path():
    """Triton's bundled ptxas that reads its PTX (``ptxas-blackwell``, CUDA 13)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "ptxas-blackwell")


def record_launches(op, dtype, n, m=64, capability=launch_plans.DEFAULT_CAPABILITY, stages=1):
    """The kernel launches of ``op`` (forward and backward for *_fwd_bwd) at row length ``n``
    (``triton_runs.op_shape``: QK per head, head_dim n with 32 q and 8 k heads; per layer, 32 q
    heads of n / 32) with the CUDA launch plan of a GPU of compute capability ``capability``
    (clusters from 90 on), prefetching ``stages`` (``launch_hooks.prefetching``): a list of
    ``launch_hooks.RecordedLaunch``."""
    inputs = op_inputs(op, op_shape(op, n, m), dtype)
    with (launch_hooks.planning_for_cuda(capability=capability),
          launch_hooks.prefetching(stages),
          launch_hooks.recording_launches() as launches):
        run_on_triton(op, inputs)
    return launches


def _specialize(launch, cc):
    """(signature, constexprs, attrs, options) that a CUDA launch of the recorded arguments
    compiles, from Triton's own binder."""
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", cc, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs,
                                                              bound_args, specialization,
                                                              options)
    return signature, constexprs, attrs, options


def compile_report(launch, cc):
    """Compile one recorded launch for compute capability ``cc``; ptxas's report as a dict:
    registers, stack, spill_stores, spill_loads (bytes), and the PTX's cluster_exchanges
    (CLUSTER_EXCHANGE instructions: 0 off a cluster)."""
    signature, constexprs, attrs, options = _specialize(launch, cc)
    key = (launch.kernel.fn.__name__, cc, repr(sorted(signature.items())),
           repr(sorted((k, repr(v)) for k, v in constexprs.items())), repr(sorted(attrs.items())),
           options.num_warps, options.num_ctas)
    return _compile_cached(key, launch.kernel, signature, constexprs, attrs, options, cc)


@functools.lru_cache(maxsize=None)
def _ptxas_report(ptx, cc):
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([_ptxas_path(), "-v", "--gpu-name", arch, src, "-o", out],
                              capture_output=True, text=True, check=True)
    stack, stores, loads, registers = map(int, _REPORT.search(done.stderr).groups())
    return {"registers": registers, "stack": stack, "spill_stores": stores,
            "spill_loads": loads}


_COMPILED = {}


def compiled_ptx(launch, cc):
    """The PTX of one recorded launch compiled for compute capability ``cc``."""
    signature, constexprs, attrs, options = _specialize(launch, cc)
    return _compile_ptx(launch.kernel, signature, constexprs, attrs, options, cc)


def _compile_ptx(kernel, signature, constexprs, attrs, options, cc):
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32),
                          options=options.__dict__).asm["ptx"]


def _compile_cached(key, kernel, signature, constexprs, attrs, options, cc):
    if key not in _COMPILED:
        ptx = _compile_ptx(kernel, signature, constexprs, attrs, options, cc)
        _COMPILED[key] = {**_ptxas_report(ptx, cc),
                          "cluster_exchanges": ptx.count(CLUSTER_EXCHANGE)}
    return _COMPILED[key]


def pairing_variants(launch):
    """The launch, or for a kernel that can pair tensors (QK-Norm's and QK-Norm + RoPE's:
    their PAIRED constexpr, ``launch_plans.pair_programs``) the launch unpaired and paired:
    the block sizes and warps do not depend on the pairing, so either kernel, which a plan of
    these sizes may launch at another row count, compiles from the same arguments."""
    if "PAIRED" not in launch.kwargs:
        return [launch]
    return [dataclasses.replace(launch, kwargs={**launch.kwargs, "PAIRED": paired})
            for paired in (False, True)]


def _constexpr_summary(launch):
    """The launch's block sizes and flags, e.g. "BLOCK_M=1 BLOCK_N=8192 SINGLE_PASS=1 w=16"."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_NQ", "BLOCK_NK", "BLOCK_HQ", "BLOCK_HK", "BLOCK_P",
             "SINGLE_PASS")
    parts = [f"{k}={int(v)}" for k, v in launch.kwargs.items() if k in names]
    ctas, stages = launch.kwargs.get("num_ctas", 1), launch.kwargs.get("NUM_STAGES", 1)
    return " ".join(parts + [f"warps={launch.kwargs.get('num_warps', 4)}"]
                    + ([f"ctas={ctas}"] if ctas > 1 else [])
                    + ([f"stages={stages}"] if stages > 1 else [])
                    + (["paired"] if launch.kwargs.get("PAIRED") else []))


def spill_table(ops=OPS, dtypes=DTYPES, ns=ROW_LENGTHS, archs=_ARCHS, qk_head_dims=_QK_HEAD_DIMS,
                prefetch=PREFETCH_STAGES):
    """Registers and spill bytes of every launch the launcher picks, one row per (op, dtype,
    N, kernel, config, cc), with the plan of each cc (sm_90's clusters, older GPUs' chunks).
    N is the row length (QK per head: head_dim). At sm_90 the plans are compiled once more for
    each stage count in ``prefetch`` (``launch_hooks.prefetching``; config "stages=s" where
    a kernel prefetches); the QK kernels' launches are compiled paired too
    (``pairing_variants``; config "paired"). See the module docstring for how it is
    measured."""
    rows = []
    for op in ops:
        for dtype in dtypes:
            lengths = qk_head_dims if "per_head" in op else ns
            for n in lengths:
                for cc, stages in [(cc, s) for cc in archs
                                   for s in ((1, *prefetch) if cc >= 90 else (1,))]:
                    for recorded in record_launches(op, dtype, n, capability=cc,
                                                    stages=stages):
                        for launch in pairing_variants(recorded):
                            rows.append({"op": op, "dtype": str(dtype).removeprefix("torch."),
                                         "N": n, "kernel": launch.kernel.fn.__name__,
                                         "config": _constexpr_summary(launch), "cc": cc,
                                         **compile_report(launch, cc)})
    return pd.DataFrame(rows).drop_duplicates(ignore_index=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument("--arch", type=int, action="append", help="compute capability "
                        "(repeatable; default 90, 80, 75)")
    args = parser.parse_args(argv)
    table = spill_table(archs=tuple(args.arch or _ARCHS))
    if args.csv:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(table.to_string(index=False))
    spilled = table[(table.spill_stores > 0) | (table.spill_loads > 0)]
    print(f"{len(table)} configurations, {len(spilled)} with spills")


if __name__ == "__main__":
    main()

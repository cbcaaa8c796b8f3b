"""SM time of the Triton kernels' launches: how evenly a launch's programs keep the SMs busy.

For every op, dtype and shape of a GPU run (``bench.cases.gpu_run_cases``: the first pass, the
bundled models' real shapes and the sweep) and every main launch of the op (the forward, and
the backward for *_fwd_bwd; the weight-gradient sums of ``kernels/partials.py`` are left out),
on the launch plan of a GPU (``GPUS``: an H200's, an A100's):

    programs      the launch's grid (``launch_plans.launch_plan`` via the launchers'
                  ``launch_shape`` for QK-Norm and QK-Norm + RoPE)
    ctas          CTAs per program (a thread-block cluster when > 1)
    work_p        useful work of grid program p, counted as the kernel does: the sum, over
                  the programs of the plan's shares it runs (one, or program p of q and of k
                  when the plan pairs them, ``launch_plans.pair_programs``), of rows × heads,
                  i.e. the rows of the program's token range that exist (rows_per_program,
                  fewer in the last group, none past the end) times the heads of one row (1
                  for a row op, the heads of its slot for per-head QK-Norm, Hq or Hk for a
                  per-layer q or k row, the heads of its tiles for a fused QK-Norm + RoPE
                  slot)
    resident      CTAs of the kernel one SM holds at once (``resident_ctas``)
    waves         ceil(programs / (cluster_slots × resident)), cluster_slots = SMs // ctas
    sm_efficiency Σ_p work_p / (SMs × T),  T = max over SMs of the SM's time
    token_bound   the sm_efficiency of the best grid of whole tokens: programs each over a
                  range of tokens with all the heads of q (or of k) of each, one per cluster
                  slot, split between q and k by ``launch_plans.share_programs``, or each
                  over a range of tokens with all their heads of q and of k
                  (``launch_plans.pair_programs``), whichever is better (a row op on one CTA
                  per program: M / (SMs × ceil(M / SMs))). No grid that keeps a
                  token's row in one program does better: a launch below it loses SM time to
                  its layout, one at it only to whole rows, and one above it splits a token's
                  heads between programs (per-head QK-Norm and the fused QK-Norm + RoPE per
                  head, whose slots are heads or tiles of heads).

An SM's time is the work it is given divided by ctas (a cluster's CTAs each hold 1/ctas of
every row): the programs go, in launch order, to the least-loaded of the SMs // ctas cluster
slots (how the block scheduler hands the next program to the first slot that frees up). The
kernels are bound by memory, so an SM's time is its work whatever the number of programs it
holds at once. One wave of equal programs on every SM gives 1; 160 equal programs on 132 SMs
give 160 / (132 × 2) = 0.61 (28 SMs run two).

Resident CTAs per SM: with ``compile=True`` each distinct kernel configuration is compiled for
the GPU (``normtools.measure.spills``' binder and ptxas; Triton 3.9 compiles for sm_90a without
a GPU) at M' = min(M, 256) rows (the same block sizes, warps and CTAs; the integer arguments'
specialization may differ) and its registers (ptxas) and shared memory (Triton's metadata)
bound the CTAs: ``resident_from`` = "compile". Without it the bound is the warps alone
(``resident_from`` = "warps": an upper bound). What this leaves out: the GPC placement of
clusters (clusters of 4 or more must fit a GPC; the occupancy query of the GPU run says how
many are resident, and from a cluster kernel's second launch on a device the launcher caps
its grid at that count: ``launch_plan``'s ``resident_limit``, so a GPU's cluster grids may
have fewer programs than these), launch latency, and the tail of a persistent program's loop.

``python -m normtools.measure.sm_balance --no-compile --csv book/data/kernels/sm_balance.csv``
writes the committed H200 table, ``--gpu a100 --no-compile --csv
book/data/kernels/sm_balance_a100.csv`` the A100's (resident from the warps); without
``--no-compile`` every configuration is compiled (seconds each, a few hundred per GPU).
"""

import argparse
import dataclasses
import heapq

import pandas as pd
import torch
import triton

from normtools.core import launch_hooks, launch_plans
from normtools.measure.bench.cases import gpu_run_cases
from normtools.measure.bench.shapes import rows_and_length, shape_label
from normtools.measure.triton_runs import kernels_of, launch_of, op_inputs, run_on_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_COMPILE_ROWS = 256     # rows of a compiled surrogate launch: ≥ every plan's BLOCK_M


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What bounds the CTAs an SM holds (NVIDIA's CUDA occupancy tables): SMs, compute
    capability, 32-bit registers, warps, CTAs and shared memory bytes per SM, and the shared
    memory the driver reserves per CTA."""

    sm_count: int
    capability: int
    registers: int = 65536
    max_warps: int = 64
    max_ctas: int = 32
    shared_bytes: int = 228 * 1024
    reserved_shared: int = 1024


GPUS = {"h200": Gpu(launch_plans.DEFAULT_SM_COUNT, launch_plans.DEFAULT_CAPABILITY),
        "a100": Gpu(108, 80, shared_bytes=164 * 1024)}


def _token_rows(group, tokens_per_program, n_tokens):
    """Rows of the token group ``group`` of ``tokens_per_program`` tokens out of n_tokens."""
    return max(0, min(tokens_per_program, n_tokens - group * tokens_per_program))


def program_work(kernel, op, shape, dtype, gpu):
    """(plan, [work_p]) of ``kernel``'s launch for ``op`` at ``shape`` on ``gpu``'s plan:
    work_p = rows × heads of program p in launch order (see the module docstring)."""
    with launch_hooks.planning_for_cuda(gpu.sm_count, gpu.capability):
        plan, heads = launch_of(kernel, op, shape, dtype)
    rows = shape["T"] if "T" in shape else shape["M"]
    work = []
    for share, slot_heads in zip(plan.shares, heads):
        # the programs of one tensor: program p → slot p % slots, token group p // slots
        work += [_token_rows(p // share.slots, share.rows_per_program, rows)
                 * slot_heads[p % share.slots] for p in range(share.programs)]
    if plan.paired:     # grid program p runs program p of q and of k
        half = len(work) // 2
        work = [q + k for q, k in zip(work[:half], work[half:])]
    return plan, work


def token_bound(kernel, op, shape, gpu, ctas):
    """The sm_efficiency of the best grid of whole tokens (see the module docstring)."""
    if kernel.startswith("qk_norm"):
        m, tensors = shape["T"], ((1, shape["Hq"]), (1, shape["Hk"]))
    else:
        m, tensors = shape["M"], ((1, 1),)
    shares, paired = launch_plans.balanced_shares(max(1, gpu.sm_count // ctas), m, tensors,
                                                  pair_tensors=len(tensors) > 1)
    longest = max(launch_plans.program_costs(m, tensors, shares, paired))
    return m * sum(work for _, work in tensors) / (gpu.sm_count * longest / ctas)


def sm_time(work, ctas, sm_count):
    """The longest SM time of programs of ``work`` (launch order) of ``ctas`` CTAs each, handed
    to the least-loaded of sm_count // ctas cluster slots: max load / ctas."""
    slots = [(0, index) for index in range(max(1, sm_count // ctas))]
    for w in work:
        load, index = heapq.heappop(slots)
        heapq.heappush(slots, (load + w, index))
    return max(load for load, _ in slots) / ctas


def resident_ctas(gpu, num_warps, registers=None, shared=None):
    """CTAs of ``num_warps`` warps one SM of ``gpu`` holds: bounded by its warps and CTA slots,
    and, when given, by registers per thread (allocated per warp in units of 256) and the
    CTA's shared memory bytes (plus the driver's reserve)."""
    bounds = [gpu.max_warps // num_warps, gpu.max_ctas]
    if registers is not None:
        per_warp = triton.cdiv(registers * 32, 256) * 256
        bounds.append(gpu.registers // (per_warp * num_warps))
    if shared is not None:
        bounds.append(gpu.shared_bytes // (shared + gpu.reserved_shared))
    return max(0, min(bounds))


def compiled_resources(op, shape, dtype, gpu):
    """{kernel name: (registers, shared bytes)} of ``op``'s main launches compiled for ``gpu``
    at M' = min(M, _COMPILE_ROWS) rows (``normtools.measure.spills``; needs TRITON_INTERPRET
    unset)."""
    from normtools.measure import spills

    key = "T" if "T" in shape else "M"
    small = dict(shape, **{key: min(shape[key], _COMPILE_ROWS)})
    with (launch_hooks.planning_for_cuda(gpu.sm_count, gpu.capability),
          launch_hooks.recording_launches() as launches):
        run_on_triton(op, op_inputs(op, small, dtype))
    wanted = kernels_of(op)
    return {launch.kernel.fn.__name__: _compiled(launch, gpu.capability, spills)
            for launch in launches if launch.kernel.fn.__name__ in wanted}


_COMPILED = {}


def _compiled(launch, cc, spills):
    signature, constexprs, attrs, options = spills._specialize(launch, cc)
    key = (launch.kernel.fn.__name__, cc, repr(sorted(signature.items())),
           repr(sorted((k, repr(v)) for k, v in constexprs.items())),
           options.num_warps, options.num_ctas)
    if key not in _COMPILED:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", cc, 32), options=options.__dict__)
        _COMPILED[key] = (spills._ptxas_report(compiled.asm["ptx"], cc)["registers"],
                          compiled.metadata.shared)
    return _COMPILED[key]


def case_balance(op, shape, dtype, gpu, compile=False):
    """The table's rows of one case: one per main kernel of ``op`` (see the module
    docstring)."""
    resources = compiled_resources(op, shape, dtype, gpu) if compile else {}
    m, n = rows_and_length(op, shape)
    rows = []
    for kernel in kernels_of(op):
        plan, work = program_work(kernel, op, shape, dtype, gpu)
        registers, shared = resources.get(kernel, (None, None))
        resident = resident_ctas(gpu, plan.num_warps, registers, shared)
        cluster_slots = max(1, gpu.sm_count // plan.num_ctas)
        rows.append({
            "gpu": next(name for name, g in GPUS.items() if g == gpu), "op": op,
            "kernel": kernel, "dtype": str(dtype).removeprefix("torch."),
            "shape": shape_label(shape), "n": n, "m": m, "programs": plan.programs,
            "ctas": plan.num_ctas, "warps": plan.num_warps, "registers": registers,
            "shared": shared, "resident": resident,
            "resident_from": "compile" if registers is not None else "warps",
            "waves": triton.cdiv(plan.programs, cluster_slots * max(resident, 1)),
            "sm_efficiency": sum(work) / (gpu.sm_count * sm_time(work, plan.num_ctas,
                                                                 gpu.sm_count)),
            "token_bound": token_bound(kernel, op, shape, gpu, plan.num_ctas)})
    return rows


def balance_cases(dtype):
    """The distinct (op, shape) of a GPU run in ``dtype`` (warm and rotated inputs share a
    shape)."""
    seen, cases = set(), []
    for case in gpu_run_cases(dtype):
        key = (case.op, shape_label(case.shape))
        if key not in seen:
            seen.add(key)
            cases.append((case.op, dict(case.shape)))
    return cases


def sm_balance(gpu="h200", dtypes=DTYPES, compile=False):
    """The SM-time table of every case of a GPU run in each of ``dtypes`` on ``gpu``'s plan
    (a name of GPUS): a DataFrame with gpu, op, kernel, dtype, shape, n, m, programs, ctas,
    warps, registers, shared, resident, resident_from, waves, sm_efficiency, token_bound."""
    rows = []
    for dtype in dtypes:
        for op, shape in balance_cases(dtype):
            rows += case_balance(op, shape, dtype, GPUS[gpu], compile)
    return pd.DataFrame(rows)


#: The target of issue 31: one wave and at least this SM-time efficiency, for launches of at
#: least TARGET_ROWS_PER_SM rows per SM.
TARGET_EFFICIENCY = 0.95
TARGET_ROWS_PER_SM = 4


def meets_target(table):
    """Rows with M ≥ TARGET_ROWS_PER_SM × the SMs, and which of them run one wave at
    sm_efficiency ≥ TARGET_EFFICIENCY: (rows, meeting)."""
    sms = table["gpu"].map({name: g.sm_count for name, g in GPUS.items()})
    large = table[table["m"] >= TARGET_ROWS_PER_SM * sms]
    return large, large[(large["waves"] == 1) & (large["sm_efficiency"] >= TARGET_EFFICIENCY)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                        help="the GPU whose launch plan is modelled (default h200)")
    parser.add_argument("--no-compile", action="store_true",
                        help="bound resident CTAs by warps only (no compile)")
    args = parser.parse_args(argv)
    table = sm_balance(args.gpu, compile=not args.no_compile)
    if args.csv:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(table.round(3).to_string(index=False))
    large, meeting = meets_target(table)
    print(f"{len(meeting)} of {len(large)} launches with M >= 4 x SMs run one wave at "
          f"sm_efficiency >= 0.95")


if __name__ == "__main__":
    main()

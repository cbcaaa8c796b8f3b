"""Launch plans: the block sizes, warps and grid of every launch of a row-wise kernel.

``CUDA_ROW_CONFIGS`` is the tuning, written out row by row as QuACK writes its per-N tables:
each row's numbers sit next to the reason they were chosen. ``launch_plan`` turns the row for a
kernel, a dtype and an (M, N) matrix into a ``LaunchPlan``; it is pure (it reads no device), so
the real launch (``normtools.core.launcher.plan_for``) and the ahead-of-time tools
(``normtools.measure.spills``, ``normtools.measure.bytes_counter``) see the same plans.

Clusters (``num_ctas`` > 1, sm_90) need a Triton whose cluster path was checked:
``CLUSTER_MIN_TRITON`` = 3.9, the release these plans were checked on (Triton 3.8 ends a
cluster kernel without the cluster barrier, so a CTA may exit while another still reads its
shared memory; earlier releases cannot split the reduced axis across CTAs). On an older
Triton the long rows take the chunked row of the table instead. The launcher also checks, at
the first compile of a cluster kernel on CUDA, that its PTX carries the cluster instructions
(``launcher.check_cluster_ptx``). The chunked kernels order their global read-after-write
with a CTA-scope barrier (``tl.debug_barrier``), correct only within one CTA: a chunked plan
never spans a cluster (``launch_plan`` raises if a table row asks for one).

Launch options pinned at every launch (``launch_options(num_warps)``, passed by
``launcher.kernel_for``; Triton's interpreter ignores them):

* ``enable_fp_fusion=True``, Triton 3.9's default, written out because the default changes in
  a later Triton. With it a multiply followed by an add may be contracted into one FMA (today
  the float32 RoPE rotation is); pinning it keeps the results of every kernel as they were
  checked.
* ``maxnreg`` = the registers a thread may have with one CTA per SM (65536 / (32 x
  num_warps), at most 255). The grids are one program per SM, so occupancy beyond one CTA
  buys nothing; left to itself, ptxas aims at two 16-warp CTAs per SM, caps a thread at 64
  registers and spills (per-head QK-Norm's float32 backward at head_dim 64: 44 B at sm_90,
  none at 85 registers with the cap lifted).
"""

import dataclasses
import functools
from typing import Optional

import torch
import triton

# CPU launch knobs (the interpreter pays ~1 ms per program instance, so CPU tiles are large;
# tests shrink these to force chunking and many programs on CPU). CUDA plans come from
# CUDA_ROW_CONFIGS below.
MAX_CHUNK_BYTES = 32768         # a CPU row chunk: 8192 fp32 or 16384 bf16 values
TILE_ELEMENTS = {"cpu": 65536}  # values in one CPU program's tile of short rows
CPU_PROGRAMS = 4                # persistent backward grid on CPU
# Persistent grids on CUDA: programs per SM. One: every backward program adds a float32
# partial row (written, then read by kernels/partials.py) and every forward program reads the
# weight, so at M = 4096 rows two per SM cost RMSNorm forward+backward 8 % above the minimum
# bytes and LayerNorm 15 %, one per SM 4 % and 7.5 % (normtools.measure.bytes_counter); the
# short-row tiles below are 16 warps, so that one program still keeps 16 warps on its SM.
PROGRAMS_PER_SM = 1
# The GPU that plans are made for when no GPU is present (H200, the benchmark target): its
# SMs and compute capability (sm_90).
DEFAULT_SM_COUNT = 132
DEFAULT_CAPABILITY = 90
# Cluster plans only on a Triton at least this new (see the module docstring); the installed
# release, read by cuda_row_config at every call (tests replace it).
CLUSTER_MIN_TRITON = (3, 9)
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
# 32-bit registers of one SM (sm_75 to sm_90), and the most one thread may have.
SM_REGISTERS = 65536
MAX_THREAD_REGISTERS = 255

# The kernels whose single-pass persistent loop over row (token) blocks can prefetch: with
# num_stages = s, tl.range(..., num_stages=s) loads the next s − 1 blocks with cp.async into
# shared memory while the current one is reduced (compiled for sm_90 with no spill; a tile of
# 16384 values takes 32 KB of shared memory per stage after the first in bfloat16, 64 KB in
# float32). Off by default (num_stages = 1):
# whether it pays is for the GPU run to measure (launch_hooks.prefetching). Not QK-Norm's
# backward: with a second stage its per-head float32 tile (32 tokens of a head of 256) spills
# 32 B at sm_90, and the GPU run times no QK-Norm backward to A/B it.
PREFETCH_KERNELS = ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
                    "qk_norm_fwd", "qk_norm_rope_fwd", "qk_norm_rope_bwd")

KERNELS = ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
           "qk_norm_fwd", "qk_norm_bwd", "qk_norm_rope_fwd", "qk_norm_rope_bwd")


def launch_options(num_warps):
    """The compile options of every launch of ``num_warps`` warps (see the module
    docstring)."""
    return {"enable_fp_fusion": True,
            "maxnreg": min(MAX_THREAD_REGISTERS, SM_REGISTERS // (32 * num_warps))}


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """How a row of up to ``n_max`` elements is launched on CUDA: ``block_n`` columns per tile
    (None: the whole row, next_power_of_2(N), read once), ``num_warps``, ``tile`` values per
    program (short rows are packed tile // BLOCK_N to a program), and ``num_ctas``, the CTAs of
    a thread-block cluster that one program spans, on GPUs of compute capability
    ``min_capability`` or newer (clusters need sm_90).

    A cluster keeps a row too long for one SM's registers on chip: Triton lays the
    (1, BLOCK_N) block across the cluster's CTAs, one SM each, and reduces across them through
    distributed shared memory (``barrier.cluster``, ``mapa``), so the kernel's source does not
    change and its row is still read once."""

    n_max: int
    block_n: Optional[int]
    num_warps: int
    tile: int
    reason: str
    num_ctas: int = 1
    min_capability: int = 0


_WHOLE_ROW = None    # block_n of a row read whole: next_power_of_2(N) columns
_ANY_N = 1 << 62     # n_max of the last row of a table: every longer row

# CUDA_ROW_CONFIGS[(direction, element bytes)]: one row per range of N, first match wins
# (direction "fwd" / "bwd"; "rope_fwd" / "rope_bwd" for the fused QK-Norm + RoPE kernels).
# Checked ahead of time by normtools.measure.spills (0 B of spill at sm_90 for every row, and
# every row compiles for sm_75 and sm_80) and normtools.measure.bytes_counter (bytes touched).
#
# Forward clusters: 16 warps x 32 values per thread = 16384 values per CTA; backward (x and
# dy): 8192. Clusters of 2-8 CTAs are portable; 16 is not, and Triton's launcher allows it.
# The fused QK-Norm + RoPE kernels (kernels/qk_norm_rope.py) tile the heads of a token: their
# row is q's Hq · 2 · next_power_of_2(head_dim / 2) values, cut into whole heads, so they take
# no clusters; backward rows past 8192 use tiles of 2048 (16 warps for 2-byte values, 8 for
# float32).
CUDA_ROW_CONFIGS = {
    ("fwd", 2): (
        RowConfig(8192, _WHOLE_ROW, 16, 16384,
                  "rows up to 8192 packed in 16384-value tiles, 16 warps (one program per SM), "
                  "32 values per thread"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row per block, 32 values per thread (<= 128 regs)"),
        RowConfig(32768, _WHOLE_ROW, 16, 32768,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 2 CTAs "
                  "(sm_90+), read once", num_ctas=2, min_capability=90),
        RowConfig(65536, _WHOLE_ROW, 16, 65536,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 4 CTAs "
                  "(sm_90+), read once", num_ctas=4, min_capability=90),
        RowConfig(131072, _WHOLE_ROW, 16, 131072,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 8 CTAs "
                  "(sm_90+), read once", num_ctas=8, min_capability=90),
        RowConfig(_ANY_N, 8192, 16, 8192,
                  "before sm_90, or past a cluster of 8: a whole row spills (32768 in 32 warps: "
                  "40-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("fwd", 4): (
        RowConfig(8192, _WHOLE_ROW, 16, 16384,
                  "rows up to 8192 packed in 16384-value tiles, 16 warps (one program per SM), "
                  "32 values per thread"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row per block, 32 values per thread (<= 128 regs)"),
        RowConfig(32768, _WHOLE_ROW, 16, 32768,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 2 CTAs "
                  "(sm_90+), read once", num_ctas=2, min_capability=90),
        RowConfig(65536, _WHOLE_ROW, 16, 65536,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 4 CTAs "
                  "(sm_90+), read once", num_ctas=4, min_capability=90),
        RowConfig(131072, _WHOLE_ROW, 16, 131072,
                  "one row, 32 values per thread in each CTA's 16 warps on a cluster of 8 CTAs "
                  "(sm_90+), read once", num_ctas=8, min_capability=90),
        RowConfig(_ANY_N, 8192, 16, 8192,
                  "before sm_90, or past a cluster of 8: a whole row spills (32768 in 32 warps: "
                  "72-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("bwd", 2): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 packed in 8192-value tiles, 16 warps (one program per SM): "
                  "x and dy 2 x 16 values per thread"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 2 CTAs (sm_90+), read once", num_ctas=2, min_capability=90),
        RowConfig(32768, _WHOLE_ROW, 16, 32768,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 4 CTAs (sm_90+), read once", num_ctas=4, min_capability=90),
        RowConfig(65536, _WHOLE_ROW, 16, 65536,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 8 CTAs (sm_90+), read once", num_ctas=8, min_capability=90),
        RowConfig(131072, _WHOLE_ROW, 16, 131072,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 16 CTAs (sm_90+), read once", num_ctas=16, min_capability=90),
        RowConfig(_ANY_N, 4096, 16, 4096,
                  "before sm_90, or past a cluster of 16: a whole row spills (16384 at sm_90: "
                  "164 B RMSNorm, 292 B LayerNorm in 16 warps, 104 / 216 B in 32), chunks of "
                  "4096"),
    ),
    ("bwd", 4): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 packed in 8192-value tiles, 16 warps (one program per SM): "
                  "x and dy 2 x 16 values per thread"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 2 CTAs (sm_90+), read once", num_ctas=2, min_capability=90),
        RowConfig(32768, _WHOLE_ROW, 16, 32768,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 4 CTAs (sm_90+), read once", num_ctas=4, min_capability=90),
        RowConfig(65536, _WHOLE_ROW, 16, 65536,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 8 CTAs (sm_90+), read once", num_ctas=8, min_capability=90),
        RowConfig(131072, _WHOLE_ROW, 16, 131072,
                  "one row, x and dy 2 x 16 values per thread in each CTA's 16 warps on a "
                  "cluster of 16 CTAs (sm_90+), read once", num_ctas=16, min_capability=90),
        RowConfig(_ANY_N, 2048, 8, 2048,
                  "before sm_90, or past a cluster of 16: x, dy and dw of a whole row spill; "
                  "QK-Norm's chunked kernel spills 4 B with chunks of 4096: chunks of 2048"),
    ),
    ("rope_fwd", 2): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 in 8192-value tiles, 16 warps (16384-value tiles spill 40 B "
                  "at sm_90 in float32, 32 heads of 32)"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row per block, 32 values per thread (<= 128 regs)"),
        RowConfig(_ANY_N, 8192, 16, 8192,
                  "before sm_90, or past a cluster of 8: a whole row spills (32768 in 32 warps: "
                  "40-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("rope_fwd", 4): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 in 8192-value tiles, 16 warps (16384-value tiles spill 40 B "
                  "at sm_90 in float32, 32 heads of 32)"),
        RowConfig(16384, _WHOLE_ROW, 16, 16384,
                  "one row per block, 32 values per thread (<= 128 regs)"),
        RowConfig(_ANY_N, 8192, 16, 8192,
                  "before sm_90, or past a cluster of 8: a whole row spills (32768 in 32 warps: "
                  "72-208 B at sm_90), chunks of 8192, two passes"),
    ),
    ("rope_bwd", 2): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 packed in 8192-value tiles, 16 warps (one program per SM): "
                  "x and dy 2 x 16 values per thread"),
        RowConfig(_ANY_N, 2048, 16, 2048,
                  "per_layer rows past a tile, read twice; at sm_90 tiles of 4096 in 16 warps "
                  "spill 8 B (N = 65536: 2 heads of 2048), of 2048 in 8 warps 4 B in float16 "
                  "(N = 16384): tiles of 2048 in 16 warps"),
    ),
    ("rope_bwd", 4): (
        RowConfig(8192, _WHOLE_ROW, 16, 8192,
                  "rows up to 8192 packed in 8192-value tiles, 16 warps (one program per SM): "
                  "x and dy 2 x 16 values per thread"),
        RowConfig(_ANY_N, 2048, 8, 2048,
                  "per_layer rows past a tile, read twice: tiles of 2048 in 8 warps, the "
                  "float32 chunks of the norms' backward"),
    ),
}


@dataclasses.dataclass(frozen=True)
class Share:
    """One tensor's programs in a launch: ``slots`` independent row sets, each of
    ``units_per_slot`` of the units ``share_programs`` was given (per-head QK-Norm: heads; the
    fused QK-Norm + RoPE per head: tiles of heads; one for a row op), ``groups`` programs per
    slot, each over ``rows_per_program`` consecutive rows of its slot (the last program of a
    slot may get fewer)."""

    slots: int
    groups: int
    rows_per_program: int
    units_per_slot: int = 1

    @property
    def programs(self):
        return self.slots * self.groups


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One launch of a row-wise kernel over an (M, N) matrix: BLOCK_M rows x BLOCK_N columns
    per tile, ``num_warps`` per CTA, a persistent grid of ``programs`` of ``num_ctas`` CTAs
    each (a cluster when > 1), and the reason the configuration was picked. ``shares``: the
    grid's programs per tensor, in launch order (one Share for a row op; q's, then k's for
    QK-Norm); ``rows_per_program`` is the first tensor's. ``programs`` is the grid: the
    shares' programs, one after another, or with ``paired`` (``pair_programs``) the programs
    of one tensor, grid program p running program p of every tensor. ``single_pass``: the
    values normalized together (the row, or one head of the fused QK-Norm + RoPE per head)
    fit one tile, the kernels' SINGLE_PASS. ``num_stages``: the kernels' NUM_STAGES, row
    blocks in flight in the single-pass loop (1: no prefetch)."""

    block_m: int
    block_n: int
    num_warps: int
    programs: int
    rows_per_program: int
    single_pass: bool
    reason: str
    num_ctas: int = 1
    shares: tuple = ()
    num_stages: int = 1
    paired: bool = False


@dataclasses.dataclass(frozen=True)
class PartialsPlan:
    """One launch of ``kernels/partials.py``: ``block_n`` output values per program,
    ``block_p`` partial rows per step, ``programs`` per summed tensor (in launch order)."""

    block_n: int
    block_p: int
    programs: tuple
    num_warps: int = 4


# kernels/partials.py on CUDA: column blocks of 32 float32 values (one 128-byte line per
# partial row) to 128, and 32 partial rows per step (a (32, 128) tile: 32 values per thread
# in 4 warps).
PARTIALS_BLOCK_N = (32, 128)
PARTIALS_BLOCK_P = 32


def partials_plan(sizes, n_partials, device_type="cuda", sm_count=DEFAULT_SM_COUNT):
    """The launch that sums the float32 partial rows of up to two weight gradients of
    ``sizes`` values each (from at most ``n_partials`` partial rows).

    On CUDA the column block is the widest power of two in PARTIALS_BLOCK_N whose grid still
    has a program for every SM, else the narrowest: a weight gradient is small (N = 4096
    values: 2 MB of partials from 132 programs), and 128-value blocks left it 32 programs on
    132 SMs; 32-value blocks give it 128. On CPU one tile holds up to TILE_ELEMENTS values, so
    that a gradient is a few programs of the interpreter."""
    block_p = min(triton.next_power_of_2(max(n_partials, 1)), PARTIALS_BLOCK_P)
    if device_type == "cuda":
        narrow, block_n = PARTIALS_BLOCK_N
        while block_n > narrow and sum(triton.cdiv(size, block_n) for size in sizes) < sm_count:
            block_n //= 2
    else:
        block_n = min(triton.next_power_of_2(max(max(sizes), 1)),
                      TILE_ELEMENTS["cpu"] // block_p)
    return PartialsPlan(block_n, block_p, tuple(triton.cdiv(size, block_n) for size in sizes))


def cuda_row_config(kernel, element_size, n, capability=DEFAULT_CAPABILITY):
    """The CUDA_ROW_CONFIGS row for ``kernel`` ("..._fwd" / "..._bwd"), a row of n elements
    and a GPU of compute capability ``capability`` (e.g. 90 for sm_90); cluster rows only
    when the installed Triton is at least CLUSTER_MIN_TRITON."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    direction = ("rope_" if kernel.startswith("qk_norm_rope") else "") + kernel.rsplit("_", 1)[1]
    table = CUDA_ROW_CONFIGS[direction, 4 if element_size >= 4 else 2]
    clusters = TRITON_VERSION >= CLUSTER_MIN_TRITON
    return next(config for config in table
                if n <= config.n_max and capability >= config.min_capability
                and (clusters or config.num_ctas == 1))


@functools.lru_cache(maxsize=4096)
def share_programs(limit, m, tensors, group_heads=False):
    """Split a persistent grid of at most ``limit`` programs over the tensors of one launch.

    ``tensors``: per tensor (slots, work), ``work`` the cost of one row of a slot (QK-Norm:
    the heads it holds; the kernels are bound by memory, so a row's time is its bytes). Tensor
    i gets g_i programs per slot, each over r_i = ceil(m / g_i) rows, so its longest program
    costs work_i · r_i. The split is the one whose longest program is shortest,

        t* = min { t : Σ_i slots_i · g_i(t) <= limit },   g_i(t) = ceil(m / floor(t / work_i)),

    with the fewest programs for that t (each g_i(t) is the least that meets t). Equal q and
    k programs instead (the same tokens each) left the k programs idle for most of the launch
    when k has fewer heads (Hq = 32, Hk = 8: about 0.6 of the SM time used). With more slots
    than ``limit``, every slot gets one program.

    ``group_heads``: the slots are units of heads that a program may take several of, one
    after another (per-head QK-Norm: a unit is a head; the fused QK-Norm + RoPE per head: a
    tile of heads). Each power of two h of units per slot (up to every unit of the tensor in
    one slot) is split as above, with ceil(slots_i / h) slots of min(h, slots_i) · work_i; the
    h whose longest program is shortest wins (times the waves, where one program per slot is
    already more than ``limit``), ties to the larger h (fewer programs). Few rows: a slot per
    unit, the heads are the parallelism. Many rows: several units per slot (often every
    head), so that 72 head slots do not leave 60 of 132 SMs idle, nor 9 tile slots of 14
    programs each 6.

    Returns a tuple of Share (``units_per_slot``: h), one per tensor."""
    if group_heads:
        options, units = [], 1
        while True:
            grouped = tuple((-(-slots // units), min(units, slots) * work)
                            for slots, work in tensors)
            shares = share_programs(limit, m, grouped)
            longest = max(work * share.rows_per_program
                          for (_, work), share in zip(grouped, shares))
            waves = -(-sum(share.programs for share in shares) // limit)
            options.append((longest * waves, -units, shares))
            if units >= max(slots for slots, _ in tensors):
                break
            units *= 2
        _, minus_units, shares = min(options, key=lambda option: option[:2])
        return tuple(dataclasses.replace(share, units_per_slot=-minus_units) for share in shares)
    m = max(m, 1)

    def groups_at(t):
        return [-(-m // (t // work)) for _, work in tensors]

    def fits(t):
        return sum(slots * g for (slots, _), g in zip(tensors, groups_at(t))) <= limit

    # fits(t) only grows with t, so t* is found by bisection (a launch plans this on the hot
    # path); t = max work · m is one program per slot
    low, high = max(work for _, work in tensors), max(work for _, work in tensors) * m
    if not fits(high):
        return tuple(Share(slots, 1, m) for slots, _ in tensors)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle + 1, high)
    return tuple(Share(slots, g, -(-m // g)) for (slots, _), g in zip(tensors, groups_at(high)))


def pair_programs(limit, m, tensors):
    """The shares of a launch whose tensors are paired: every unit of a tensor in one slot,
    the same g = ceil(m / r) programs per tensor over r = ceil(m / min(limit, m)) rows each,
    and a grid of g programs, grid program p running program p of every tensor (the QK
    kernels' PAIRED: the q and the k heads of its tokens). Its longest program costs
    r · Σ_i slots_i · work_i: a token's q and k together are the unit of work, finer than q's
    row alone (T = 768, Hq = 64, Hk = 8 on 132 SMs: q's programs alone take 7 tokens, so the
    split of ``share_programs`` uses 0.935 of the SM time; paired, 6 tokens, 0.97)."""
    m = max(m, 1)
    rows = -(-m // min(limit, m))
    return tuple(Share(1, -(-m // rows), rows, slots) for slots, _ in tensors)


def program_costs(m, tensors, shares, paired=False):
    """The work of each grid program of a launch over m rows (``tensors``: per tensor (slots,
    work of a row of a slot), as ``share_programs`` takes them): program p of a tensor covers
    the units of slot p % slots over the rows of token group p // slots; the grid runs the
    tensors' programs one after another, or, ``paired``, program p of every tensor in grid
    program p."""
    per_tensor = []
    for (slots, work), share in zip(tensors, shares):
        h, rows = share.units_per_slot, share.rows_per_program
        per_tensor.append([work * min(h, slots - (p % share.slots) * h)
                           * max(0, min(rows, m - (p // share.slots) * rows))
                           for p in range(share.programs)])
    if paired:
        return [sum(costs) for costs in zip(*per_tensor)]
    return [cost for costs in per_tensor for cost in costs]


@functools.lru_cache(maxsize=4096)
def balanced_shares(limit, m, tensors, group_heads=False, pair_tensors=False):
    """(shares, paired): ``share_programs``' split of at most ``limit`` programs over m rows,
    or, with ``pair_tensors``, ``pair_programs``' plan where its longest program
    (``program_costs``) is shorter than the split's times the split's waves (ties keep the
    split). Cached: a launch plans this on the hot path."""
    shares = share_programs(limit, m, tensors, group_heads)
    if pair_tensors:
        pairs = pair_programs(limit, m, tensors)
        split_cost = (max(program_costs(m, tensors, shares))
                      * -(-sum(share.programs for share in shares) // limit))
        if max(program_costs(m, tensors, pairs, paired=True)) < split_cost:
            return pairs, True
    return shares, False


def launch_plan(kernel, dtype, m, n, device_type="cuda", sm_count=DEFAULT_SM_COUNT,
                tensors=((1, 1),), capability=DEFAULT_CAPABILITY, resident_limit=None,
                group_heads=False, fixed_rows=None, prefetch_stages=1, pair_tensors=False,
                norm_length=None):
    """The plan for ``kernel`` over an (m, n) matrix of ``dtype`` on ``device_type``: pure (it
    reads no device), so that the real launch and the ahead-of-time tools (bytes counter,
    spill report, SM-time model) use the same block sizes and grid.

    Grids are persistent and one wave: at most limit = PROGRAMS_PER_SM x ``sm_count`` //
    ``num_ctas`` programs (a program of a cluster plan is ``num_ctas`` CTAs; rounding up
    instead gave per-head QK-Norm's 40 slots 160 programs on 132 SMs, 28 of them a second
    wave), shared among ``tensors`` (per tensor: (slots, work of a row of a slot); one
    tensor of one slot for a row op, q's and k's head slots for QK-Norm) by
    ``share_programs`` (``group_heads``: a program may take several slots of heads), so that
    the longest program is as short as the limit allows. A program loops over its
    ``rows_per_program`` rows, BLOCK_M at a time (the last block masked), so the weight is
    read once per program, not once per row. On CUDA rows are
    handed out one by one, not in whole BLOCK_M blocks (whole blocks of 8 float32 rows of
    2048 left M = 6592 at 0.89 of the SM time); on CPU in whole blocks.

    ``fixed_rows``: per tensor (rows_per_program, units_per_slot) to keep instead of
    splitting the limit, with ceil(m / rows_per_program) programs per slot (how the bytes
    counter runs a few programs of a real plan: ``launch_hooks.replaying_rows``).

    ``pair_tensors``: the kernel can run a program of each tensor in one grid program (the QK
    kernels' PAIRED); ``pair_programs``' plan (``paired``) replaces the split when its longest
    program is shorter (``balanced_shares``). A ``fixed_rows`` plan is never paired.

    ``norm_length``: the values the kernel normalizes together (default n, the row; one head
    for the fused QK-Norm + RoPE per head, which cuts q's row of n values into tiles of whole
    heads). The plan is ``single_pass`` when they fit one tile, norm_length <= BLOCK_N: the
    kernel reads each value once.

    ``prefetch_stages`` (CUDA only): ``num_stages`` of a single-pass plan of a kernel of
    PREFETCH_KERNELS (every other plan: 1).

    ``resident_limit`` (CUDA only): the programs the GPU holds at once, when known, replacing
    the computed limit: limit = max(1, ``resident_limit``). A cluster of 4 or more CTAs must
    fit one GPC (14-18 SMs on an H100/H200), so fewer than ``sm_count`` // ``num_ctas``
    clusters may be resident; the launcher passes the count that the driver's occupancy query
    gives for the compiled kernel (``normtools.core.occupancy``, ``launcher.plan_for``). The
    plan stays pure: the count is an argument.

    CUDA: the CUDA_ROW_CONFIGS row for (direction, element size, n, ``capability``). CPU
    (Triton's interpreter): BLOCK_N = next_power_of_2(n) up to MAX_CHUNK_BYTES / element size,
    TILE_ELEMENTS["cpu"] values per tile, CPU_PROGRAMS programs in a persistent grid.
    """
    element_size = torch.empty(0, dtype=dtype).element_size()
    whole_row, paired = triton.next_power_of_2(max(n, 1)), False
    if device_type == "cuda":
        config = cuda_row_config(kernel, element_size, n, capability)
        block_n = whole_row if config.block_n is None else min(config.block_n, whole_row)
        tile, num_warps, reason = config.tile, config.num_warps, config.reason
        num_ctas = config.num_ctas
        limit = max(1, PROGRAMS_PER_SM * sm_count // num_ctas if resident_limit is None
                    else resident_limit)
    else:
        block_n = min(whole_row, MAX_CHUNK_BYTES // element_size)
        tile, num_warps, limit, num_ctas = TILE_ELEMENTS["cpu"], 4, CPU_PROGRAMS, 1
        reason = "CPU interpreter: large tiles (about 1 ms per program)"
    if n > block_n and num_ctas > 1:
        raise ValueError(f"{kernel}: a chunked plan (N = {n} in chunks of {block_n}) on a "
                         f"cluster of {num_ctas} CTAs; the chunked kernels' barrier is CTA-scope")
    block_m = max(1, min(tile // block_n, triton.next_power_of_2(max(m, 1))))
    # CUDA hands out rows; the interpreter runs programs one after another, so on CPU whole
    # BLOCK_M blocks (the fewest, fullest programs)
    unit = 1 if device_type == "cuda" else block_m
    if fixed_rows is not None:
        shares = tuple(Share(triton.cdiv(slots, units), triton.cdiv(max(m, 1), rows), rows, units)
                       for (slots, _), (rows, units) in zip(tensors, fixed_rows))
    else:
        shares, paired = balanced_shares(limit, triton.cdiv(m, unit), tuple(tensors),
                                         group_heads, pair_tensors)
        shares = tuple(dataclasses.replace(share, rows_per_program=share.rows_per_program * unit)
                       for share in shares)
    single_pass = (n if norm_length is None else norm_length) <= block_n
    prefetches = device_type == "cuda" and single_pass and kernel in PREFETCH_KERNELS
    programs = shares[0].programs if paired else sum(share.programs for share in shares)
    return LaunchPlan(block_m, block_n, num_warps, programs, shares[0].rows_per_program,
                      single_pass, reason, num_ctas, shares, prefetch_stages if prefetches else 1,
                      paired)

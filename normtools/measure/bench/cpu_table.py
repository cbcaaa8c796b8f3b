"""The CPU table: normtools' plain-PyTorch path against the module it reproduces, in one run.

On CPU ``backend="auto"`` is the torch path: what a notebook, a training run on CPU and a
model after ``normtools.patch`` execute. This table times it against the Hugging Face module
it reproduces, per op, shape and dtype, with the contenders (``CONTENDERS``)

* "normtools-torch": ``normtools.<op>(..., backend="torch")``;
* "hf-module": the transformers modules: ``LlamaRMSNorm`` (rms_norm; add_rms_norm is
  ``x + residual`` then the norm), ``CohereLayerNorm`` (layer_norm without a bias: the float32
  LayerNorm that ``normtools.LayerNorm`` reproduces and ``normtools.patch`` replaces; a
  ``torch.nn.LayerNorm`` runs ``F.layer_norm``, the torch-F column), QK-Norm as
  ``Qwen3RMSNorm`` on each head (per_head) and ``MiniMaxM2RMSNorm`` on the whole projection
  (per_layer), the q norm and the k norm, and for QK-Norm + RoPE then transformers'
  ``apply_rotary_pos_emb`` (Llama's) with the (T, D) tables broadcast over the heads;
* "torch-F": ``torch.nn.functional.rms_norm`` / ``layer_norm`` in the same composition
  (``backends._torch_f_ops``);
* "torch-compile": ``torch.compile`` of the hf-module composition (``dynamic=False``), one
  compile per case, before timing (its first call; the seconds it took are the row's
  ``first_call_s`` and their sum is the conditions' ``torch_compile_s``).

Every op is timed forward (under ``torch.no_grad()``) and forward + backward (``_fwd_bwd``:
the gradients of ⟨outputs, dy⟩ to every input and weight). The contenders of one case run
interleaved, one call each per round in a random order (``time_interleaved``), on one input
set (warm caches), so that a machine shared with other work slows them alike; the ratio of each
p50 to hf-module's p50 is the result.
Run conditions (threads, torch version, the machine's load) are recorded with the rows.

On glibc the run first keeps freed blocks of up to ``HELD_BLOCK_BYTES`` in the heap
(:func:`hold_freed_memory`): otherwise a block of a few MiB is unmapped when freed and the next
allocation pays the page faults of fresh pages, a cost that lands on whichever contender
allocates next (at 256 × 4096, the same composition of ops timed twice in one round differed
by up to 2×, and whole cells by 2.7×, from run to run).
"""

import ctypes
import os
import time
from functools import partial

import numpy as np
import torch
from torch import nn

from normtools.core import sysinfo
from normtools.measure.bench.backends import _torch_f_ops, allow_recompiles
from normtools.measure.bench.shapes import LAYER_EPS, RMS_EPS, make_inputs

__all__ = ["CONTENDERS", "CPU_OPS", "cpu_cases", "run_cpu_table", "cpu_table_markdown",
           "missing_cells"]

CONTENDERS = ("normtools-torch", "hf-module", "torch-F", "torch-compile")
_FORWARD_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "qk_norm_per_head",
                "qk_norm_per_layer", "qk_norm_rope_per_head", "qk_norm_rope_per_layer")
CPU_OPS = tuple(op + suffix for op in _FORWARD_OPS for suffix in ("", "_fwd_bwd"))
DTYPES = (torch.float32, torch.bfloat16)

# Rows M × N: the three (a small, a decode-like and a large one), the bench's CPU grid,
# and the lab's "cpu" TinyLM (batch 8 × 32 positions, width 64). QK: T tokens, heads, head dim:
# the bench's CPU shape and the lab's (4 heads of 16).
ROW_SHAPES = ({"M": 64, "N": 256}, {"M": 8, "N": 4096}, {"M": 256, "N": 1024},
              {"M": 256, "N": 4096}, {"M": 512, "N": 4096}, {"M": 256, "N": 64})
QK_SHAPES = ({"T": 256, "Hq": 8, "Hk": 2, "D": 128}, {"T": 256, "Hq": 4, "Hk": 4, "D": 16},
             {"T": 16, "Hq": 4, "Hk": 2, "D": 64})


def cpu_cases(quick=False):
    """[(op, shape, dtype)] of the table: every op × its shapes × float32 and bfloat16
    (``quick``: the first shape of each kind only)."""
    rows, qk = (ROW_SHAPES[:1], QK_SHAPES[-1:]) if quick else (ROW_SHAPES, QK_SHAPES)
    return [(op, shape, dtype) for op in CPU_OPS for shape in (qk if op.startswith("qk") else rows)
            for dtype in DTYPES]


# ------------------------------------------------------------------------------ contenders

def _hf_modules(t, head_dim):
    """The transformers modules of a case, their weights the case's weight tensors."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def with_weight(module, **params):
        for name, value in params.items():
            setattr(module, name, value)   # the case's nn.Parameter itself
        return module

    if "q" in t:
        kind = Qwen3RMSNorm if t["q_w"].numel() == head_dim else MiniMaxM2RMSNorm
        return {"q_norm": with_weight(kind(t["q_w"].numel(), eps=RMS_EPS), weight=t["q_w"]),
                "k_norm": with_weight(kind(t["k_w"].numel(), eps=RMS_EPS), weight=t["k_w"])}
    n = t["x"].shape[-1]
    if "b" in t:
        return {"norm": with_weight(CohereLayerNorm(n, eps=LAYER_EPS), weight=t["w"])}
    return {"norm": with_weight(LlamaRMSNorm(n, eps=RMS_EPS), weight=t["w"])}


def _hf_forward(op, modules, head_dim):
    """fn(t) -> output(s): the transformers composition of ``op`` (forward)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def per_head(norm, x):
        return norm(x.view(x.shape[0], -1, head_dim)).view(x.shape)

    def qk(t):
        if "per_head" in op:
            return per_head(modules["q_norm"], t["q"]), per_head(modules["k_norm"], t["k"])
        return modules["q_norm"](t["q"]), modules["k_norm"](t["k"])

    def qk_rope(t):
        q, k = qk(t)
        heads = (q.view(q.shape[0], -1, head_dim), k.view(k.shape[0], -1, head_dim))
        q_out, k_out = apply_rotary_pos_emb(*heads, t["cos"], t["sin"], unsqueeze_dim=1)
        return q_out.view(q.shape), k_out.view(k.shape)

    def add_rms(t):
        summed = t["x"] + t["residual"]
        return modules["norm"](summed), summed

    if op.startswith("qk_norm_rope"):
        return qk_rope
    if op.startswith("qk_norm"):
        return qk
    if op == "add_rms_norm":
        return add_rms
    return lambda t: modules["norm"](t["x"])


def _normtools_forward(op, head_dim):
    from normtools.core import ops, qk, rope

    scope = "per_head" if "per_head" in op else "per_layer"
    if op.startswith("qk_norm_rope"):
        return lambda t: rope.qk_norm_rope(t["q"], t["k"], t["q_w"], t["k_w"], t["cos"],
                                           t["sin"], RMS_EPS, head_dim=head_dim,
                                           scope=scope, backend="torch")
    if op.startswith("qk_norm"):
        return lambda t: qk.qk_norm(t["q"], t["k"], t["q_w"], t["k_w"], RMS_EPS,
                                    head_dim=head_dim, scope=scope, backend="torch")
    return {"rms_norm": lambda t: ops.rms_norm(t["x"], t["w"], RMS_EPS, backend="torch"),
            "add_rms_norm": lambda t: ops.add_rms_norm(t["x"], t["residual"], t["w"],
                                                       RMS_EPS, backend="torch"),
            "layer_norm": lambda t: ops.layer_norm(t["x"], t["w"], t["b"], LAYER_EPS,
                                                   backend="torch")}[op]


def _compiled(fn):
    """``torch.compile(fn, dynamic=False)``; every case's closure shares its code object with
    the others of its op, so Dynamo's recompile limit is raised first (``allow_recompiles``),
    else past the limit a case would run eagerly under the torch-compile name."""
    allow_recompiles()
    return torch.compile(fn, dynamic=False)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _case_inputs(op, shape, dtype):
    """The input tensors of a case (``shapes.make_inputs`` of the forward op; layer_norm's bias
    None, as Cohere's); for a ``_fwd_bwd`` op every input and weight requires grad."""
    forward = op.removesuffix("_fwd_bwd")
    t = make_inputs(forward, shape, dtype, "cpu")
    if "b" in t:
        t["b"] = None
    backward = op.endswith("_fwd_bwd")
    for name in ("w", "q_w", "k_w"):    # parameters, shared with the transformers modules
        if name in t:
            t[name] = nn.Parameter(t[name].detach(), requires_grad=backward)
    leaves = [name for name in ("x", "residual", "w", "q", "k", "q_w", "k_w") if name in t]
    if backward:
        for name in leaves:
            t[name].requires_grad_(True)
    return t, [t[name] for name in leaves]


def contender_calls(op, shape, dtype, contenders=CONTENDERS):
    """{contender: zero-argument call} for one case, all on the same input tensors."""
    t, leaves = _case_inputs(op, shape, dtype)
    head_dim = shape.get("D")
    forward = op.removesuffix("_fwd_bwd")
    hf = _hf_forward(forward, _hf_modules(t, head_dim), head_dim)
    builders = {"normtools-torch": lambda: _normtools_forward(forward, head_dim),
                "hf-module": lambda: hf,
                "torch-F": lambda: _torch_f_ops(head_dim)[forward],
                "torch-compile": lambda: _compiled(hf)}
    with torch.no_grad():
        outs = _as_tuple(hf(t))
    gen = torch.Generator().manual_seed(1)
    dys = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]

    def fwd(fn):
        with torch.no_grad():
            return fn(t)

    def fwd_bwd(fn):
        return torch.autograd.grad(_as_tuple(fn(t)), leaves, dys, allow_unused=True)

    run = fwd_bwd if op.endswith("_fwd_bwd") else fwd
    return {name: partial(run, builders[name]()) for name in contenders}


# ------------------------------------------------------------------------------------ timing

def time_interleaved(calls, reps, warmup=3, min_total_s=None, seed=0):
    """{name: [µs per call]}: ``warmup`` rounds, then ``reps`` rounds of one call of each
    contender (``time.perf_counter_ns``), in a new random order every round (``seed``); with
    ``min_total_s``, more rounds until the timed rounds last that long (at most 10 × reps).

    The order is shuffled because a call is slower after some contenders than after others: in
    the fixed order the first contender always followed the last one's call (torch.compile's
    graph, which leaves other code and data in the caches). At the small shapes that decided
    the ratio: normtools' RMSNorm, bfloat16 64 × 256, read 1.23× the HF module's p50 called
    first in every round, 0.89× called second and 1.00× shuffled (one thread, this 2-core
    machine, 400 rounds each)."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    names = list(calls)
    order = np.random.default_rng(seed)
    times = {name: [] for name in calls}
    start, rounds = time.perf_counter(), 0
    while rounds < reps or (min_total_s and time.perf_counter() - start < min_total_s
                            and rounds < 10 * reps):
        for index in order.permutation(len(names)):
            call = calls[names[index]]
            t0 = time.perf_counter_ns()
            call()
            times[names[index]].append((time.perf_counter_ns() - t0) / 1e3)
        rounds += 1
    return times


#: glibc's mmap and trim thresholds during a CPU table: 32 MiB, glibc's largest mmap threshold
#: on 64-bit (a 256 × 4096 float32 row block is 4 MiB).
HELD_BLOCK_BYTES = 32 << 20


def hold_freed_memory(nbytes: int = HELD_BLOCK_BYTES) -> dict | None:
    """Make glibc keep freed blocks of up to ``nbytes`` in the heap instead of unmapping them
    (``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)``), so that every contender
    reuses warm pages. Returns the settings made, or None where there is no glibc or it refuses
    them (they stay in force for the rest of the process)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3              # glibc's malloc.h
    if libc.mallopt(m_mmap_threshold, nbytes) != 1 or libc.mallopt(m_trim_threshold, nbytes) != 1:
        return None
    return {"M_MMAP_THRESHOLD": nbytes, "M_TRIM_THRESHOLD": nbytes}


def run_cpu_table(cases=None, contenders=CONTENDERS, reps=50, warmup=3, min_total_s=0.5,
                  threads=1, progress=None):
    """Time every case of ``cases`` (default ``cpu_cases()``) for every contender, interleaved.

    Returns {"conditions": ..., "rows": [one per (op, shape, dtype, contender)]}; a row has
    p50/p95/p99 in µs, the number of samples, ``ratio_to_hf`` (its p50 over hf-module's) and
    ``first_call_s`` (the untimed first call: torch.compile's compile), or ``status`` "error"
    and the reason when a contender fails (torch.compile without a C++ compiler, say)."""
    torch.set_num_threads(threads)
    allocator = hold_freed_memory()
    load_at_start = list(os.getloadavg())
    rows = []
    for op, shape, dtype in cases if cases is not None else cpu_cases():
        label = " ".join(f"{k}={v}" for k, v in shape.items())
        dtype_name = str(dtype).removeprefix("torch.")
        calls, errors, first_call_s = {}, {}, {}
        for name, call in contender_calls(op, shape, dtype, contenders).items():
            try:
                start = time.perf_counter()
                call()
                first_call_s[name] = time.perf_counter() - start
                calls[name] = call
            except Exception as exc:   # recorded in the row, the others still run
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        times = time_interleaved(calls, reps, warmup, min_total_s)
        hf_p50 = float(np.percentile(times["hf-module"], 50)) if "hf-module" in times else None
        for name in contenders:
            row = {"op": op, "shape": label, "dtype": dtype_name, "contender": name}
            if name in errors:
                row.update(status="error", reason=errors[name])
            else:
                p50, p95, p99 = (float(v) for v in np.percentile(times[name], [50, 95, 99]))
                row.update(status="ok", p50_us=p50, p95_us=p95, p99_us=p99,
                           samples=len(times[name]),
                           ratio_to_hf=p50 / hf_p50 if hf_p50 else None,
                           first_call_s=first_call_s[name])
            rows.append(row)
        if progress:
            progress(rows[-len(contenders):])
    conditions = _conditions(threads, reps, warmup, min_total_s)
    conditions["load_average_at_start"] = load_at_start
    conditions["malloc"] = allocator or "system default (no glibc mallopt)"
    conditions["torch_compile_s"] = sum(r.get("first_call_s", 0.0) for r in rows
                                        if r["contender"] == "torch-compile")
    return {"conditions": conditions, "rows": rows}


def _conditions(threads, reps, warmup, min_total_s):
    """``sysinfo.run_conditions`` (time, CPU model and count, load average, versions, commit)
    and the table's own: threads, samples, OMP_WAIT_POLICY and the method."""
    return {**sysinfo.run_conditions("cpu"), "torch": torch.__version__, "threads": threads,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "reps": reps, "warmup": warmup, "min_total_s": min_total_s,
            "method": "contenders interleaved one call each per round, in a seeded random "
                      "order each round, one warm input set, "
                      "time.perf_counter_ns per call; each contender's first call untimed "
                      "(torch.compile compiles there)"}


def missing_cells(table, cases=None, contenders=CONTENDERS):
    """The (op, shape, dtype, contender) cells of ``cases`` that ``table`` has no row for."""
    have = {(r["op"], r["shape"], r["dtype"], r["contender"]) for r in table["rows"]}
    want = [(op, " ".join(f"{k}={v}" for k, v in shape.items()),
             str(dtype).removeprefix("torch."), name)
            for op, shape, dtype in (cases if cases is not None else cpu_cases())
            for name in contenders]
    return [cell for cell in want if cell not in have]


def cpu_table_markdown(table):
    """One line per (op, shape, dtype): each contender's p50 (p95, p99) in µs and its ratio to
    hf-module."""
    by_case = {}
    for r in table["rows"]:
        by_case.setdefault((r["op"], r["shape"], r["dtype"]), {})[r["contender"]] = r
    names = list(dict.fromkeys(r["contender"] for r in table["rows"]))
    lines = ["| op | shape | dtype | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for (op, shape, dtype), row in by_case.items():
        cells = []
        for name in names:
            r = row.get(name)
            if r is None or r["status"] != "ok":
                cells.append("error" if r else "-")
            else:
                cells.append(f"{r['p50_us']:.0f} ({r['p95_us']:.0f}, {r['p99_us']:.0f}) "
                             f"x{r['ratio_to_hf']:.2f}")
        lines.append(f"| {op} | {shape} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""normtools.measure.bench.cpu_table: the CPU table is complete (every op × shape × dtype ×
contender has its row), a dropped row is seen, and the contenders of a case compute the same
thing (normtools' torch path equals the transformers module bit for bit). No timing is
asserted: the table is a benchmark, its numbers belong to the run."""

import subprocess
import sys

import pytest
import torch

from normtools.measure.bench import cpu_table

QUICK = cpu_table.cpu_cases(quick=True)
TIMED = ("normtools-torch", "hf-module", "torch-F")   # torch.compile: one compile per case


def test_the_grid_covers_every_op_shape_and_dtype():
    cases = cpu_table.cpu_cases()
    assert {op for op, _, _ in cases} == set(cpu_table.CPU_OPS)
    assert len(cpu_table.CPU_OPS) == 14 and all(f"{op}_fwd_bwd" in cpu_table.CPU_OPS
                                                for op in cpu_table.CPU_OPS
                                                if not op.endswith("_fwd_bwd"))
    for op in cpu_table.CPU_OPS:
        shapes = cpu_table.QK_SHAPES if op.startswith("qk") else cpu_table.ROW_SHAPES
        assert sorted((str(s), str(d)) for o, s, d in cases if o == op) == sorted(
            (str(s), str(d)) for s in shapes for d in cpu_table.DTYPES)


def test_the_table_is_complete_and_a_missing_row_is_seen():
    table = cpu_table.run_cpu_table(QUICK, TIMED, reps=1, warmup=0, min_total_s=0)
    assert cpu_table.missing_cells(table, QUICK, TIMED) == []
    assert len(table["rows"]) == len(QUICK) * len(TIMED)
    for row in table["rows"]:
        assert row["status"] == "ok", row
        assert row["p50_us"] > 0 and row["p95_us"] >= row["p50_us"] and row["p99_us"] >= row["p95_us"]
        if row["contender"] == "hf-module":
            assert row["ratio_to_hf"] == 1.0
    assert {"threads", "torch", "load_average", "method"} <= set(table["conditions"])
    first = table["rows"][0]
    dropped = dict(table, rows=table["rows"][1:])
    assert cpu_table.missing_cells(dropped, QUICK, TIMED) == [
        (first["op"], first["shape"], first["dtype"], first["contender"])]
    lines = cpu_table.cpu_table_markdown(table).splitlines()
    assert len(lines) == 2 + len(QUICK) and all(name in lines[0] for name in TIMED)


def test_normtools_torch_computes_the_hf_module_in_every_quick_case():
    """Forward: the same bits. Forward + backward: the same gradients to float32 / bfloat16
    round-off (autograd of the module's operations, which rounds its bfloat16 products, against
    normtools' float32 backward; in bfloat16 relative to the tensor's largest value, since a
    weight gradient summed over rows of both signs has elements near zero)."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
    for op, shape, dtype in QUICK:
        calls = cpu_table.contender_calls(op, shape, dtype, ("normtools-torch", "hf-module"))
        got, want = calls["normtools-torch"](), calls["hf-module"]()
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple)
                                                                  else (want,))
        assert len(got) == len(want), op
        for a, b in zip(got, want):
            assert (a is None) == (b is None), (op, shape, dtype)
            if a is None:           # an input the op does not read
                continue
            assert a.dtype == b.dtype, (op, shape, dtype)
            if op.endswith("_fwd_bwd"):
                atol = tolerance[dtype] * (float(b.abs().max()) if dtype == torch.bfloat16 else 1)
                torch.testing.assert_close(a, b, rtol=tolerance[dtype], atol=atol)
            else:
                assert torch.equal(a, b), (op, shape, dtype)


def test_torch_compile_contender_computes_the_hf_module():
    op, shape, dtype = QUICK[0]
    calls = cpu_table.contender_calls(op, shape, dtype, ("torch-compile", "hf-module"))
    torch.testing.assert_close(calls["torch-compile"](), calls["hf-module"](), rtol=1e-5,
                               atol=1e-5)


def _chapter_grid():
    """book/data/kernels/make_cpu_table.py, the script that writes chapter 4b's table."""
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).parents[2] / "book" / "data" / "kernels"
                              / "make_cpu_table.py"))


def test_the_chapter_grid_covers_the_bench_and_the_lab_shapes():
    """The chapter's table has normtools bench's CPU shapes, the lab's "cpu" TinyLM's rows and
    QK heads (derived here from normtools.lab.grid) and every contender, torch.compile too."""
    from normtools.lab.grid import STABILITY_SIZES
    from normtools.measure.bench.shapes import default_shapes

    script = _chapter_grid()
    shapes = script["SHAPES"]
    bench = default_shapes("cpu")
    for op_shapes in bench.values():
        assert all(shape in shapes for shape in op_shapes)
    lab = STABILITY_SIZES["cpu"]
    tokens = lab["batch_size"] * lab["model"]["max_seq_len"]
    width, heads = lab["model"]["width"], lab["model"]["heads"]
    assert {"M": tokens, "N": width} in shapes
    assert {"T": tokens, "Hq": heads, "Hk": heads, "D": width // heads} in shapes
    assert set(script["CONTENDERS"]) == set(cpu_table.CONTENDERS)
    cases = script["grid_cases"]()
    assert {op for op, _, _ in cases} == set(cpu_table.CPU_OPS)
    assert all(case in cpu_table.cpu_cases() for case in cases)


def test_the_committed_chapter_table_is_complete():
    """book/data/kernels/cpu_table.json has a row for every case × contender of the script
    that writes it (rerun the script after changing its grid)."""
    import json
    from pathlib import Path

    script = _chapter_grid()
    path = Path(__file__).parents[2] / "book" / "data" / "kernels" / "cpu_table.json"
    table = json.loads(path.read_text(encoding="utf-8"))
    assert cpu_table.missing_cells(table, script["grid_cases"](), script["CONTENDERS"]) == []




_HEAP_BYTES_KEPT_AFTER_A_FREED_BLOCK = """
import ctypes, sys
import torch
from normtools.measure.bench import cpu_table
if sys.argv[1] == "hold":
    assert cpu_table.hold_freed_memory() is not None
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
block = torch.empty(8 << 20, dtype=torch.uint8)   # 8 MiB, touched, then freed
block.fill_(1)
del block
print(libc.mallinfo2().fordblks)                 # free bytes glibc keeps in its heap
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_held_memory_keeps_a_freed_block_in_the_heap():
    """After ``hold_freed_memory`` a freed 8 MiB block stays in glibc's heap, ready for the next
    allocation without page faults (mallinfo2's free heap bytes: at least 8 MiB); with glibc's
    defaults it is a mapping of its own, returned to the kernel when freed, and the next
    allocation faults its pages in again: the cost that landed on whichever contender of a
    table allocated next."""
    def heap_free_bytes(mode):
        out = subprocess.run([sys.executable, "-c", _HEAP_BYTES_KEPT_AFTER_A_FREED_BLOCK, mode],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[-1])

    if heap_free_bytes("default") >= 8 << 20:
        pytest.skip("this C library already keeps the block: nothing to hold")
    assert heap_free_bytes("hold") >= 8 << 20


def test_every_contender_takes_every_position_in_the_rounds():
    """time_interleaved shuffles the order of each round (seeded): each contender is timed once a
    round, comes first in some rounds and last in others, and the same seed gives the same order."""
    def orders(seed):
        seen = []
        calls = {name: (lambda name=name: seen.append(name)) for name in "abcd"}
        times = cpu_table.time_interleaved(calls, reps=40, warmup=0, seed=seed)
        assert {name: len(t) for name, t in times.items()} == dict.fromkeys("abcd", 40)
        return [seen[i:i + 4] for i in range(0, len(seen), 4)]

    rounds = orders(0)
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert {r[0] for r in rounds} == set("abcd") and {r[-1] for r in rounds} == set("abcd")
    assert orders(0) == rounds and orders(1) != rounds

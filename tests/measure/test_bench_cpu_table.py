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
    round-off (autograd of the module's operations against normtools' backward)."""
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
                torch.testing.assert_close(a, b, rtol=tolerance[dtype], atol=tolerance[dtype])
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



_PAGE_FAULTS_OF_A_REPEATED_STEP = """
import resource, sys
import torch
from normtools.measure.bench import cpu_table
if sys.argv[1] == "hold":
    assert cpu_table.hold_freed_memory() is not None
x = torch.randn(256, 4096)
faults = []
for _ in range(6):                   # RMSNorm's float32 temporaries of a 256 x 4096 block, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = x * 2.0; z = y.pow(2).mean(-1, keepdim=True); w = y * torch.rsqrt(z); del y, z, w
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))               # after the first step: its pages could be reused
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and getrusage page faults")
def test_held_memory_spares_the_page_faults_of_a_repeated_step():
    """After ``hold_freed_memory`` a step that allocates and frees 4 MiB blocks reuses the pages
    its first run mapped (the kernel's minor-fault count over the later steps: measured 0-3,072
    here), where with glibc's defaults every later step faults again (measured 5,000-9,000: the
    cost that would land on whichever contender of a table allocates next). The kernel may
    still reclaim an idle page now and then, so the check is a halving, not zero."""
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _PAGE_FAULTS_OF_A_REPEATED_STEP, mode],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[-1])

    default = faults("default")
    if default == 0:
        pytest.skip("this C library already reuses the blocks: nothing to hold")
    assert faults("hold") <= default / 2

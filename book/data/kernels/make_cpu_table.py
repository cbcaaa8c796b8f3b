"""Writes cpu_table.json beside this file: the CPU table that chapter 4b renders.

The chapter's grid of ``normtools bench --cpu-table`` (normtools.measure.bench.cpu_table): the
shapes of ``normtools bench``'s CPU sweep (256 × 1024 and 256 × 4096 rows, QK-Norm T = 256 with
8 + 2 heads of 128), of a reader's notebook (64 × 256) and of the lab's "cpu" TinyLM
(normtools.lab.grid: batch 8 × 32 positions, width 64, 4 heads of 16, so 256 × 64 rows and
QK-Norm T = 256 with 4 + 4 heads of 16), every op forward and forward + backward, float32 and
bfloat16, all four contenders interleaved on one thread. torch.compile compiles the HF
composition once per case before its timing (the compile seconds are in the conditions and in
each torch-compile row's ``first_call_s``). Run from the repository root:

    PYTHONHASHSEED=0 OMP_WAIT_POLICY=PASSIVE .venv/bin/python book/data/kernels/make_cpu_table.py

(``--out PATH`` writes elsewhere). It prints its expected time first; the run takes about that
long on one free core.
"""

import argparse
import json
import time
from pathlib import Path

from normtools.measure.bench import cpu_table

ROW_SHAPES = (cpu_table.ROW_SHAPES[0],    # 64 × 256: a reader's notebook
              cpu_table.ROW_SHAPES[2],    # 256 × 1024: normtools bench's CPU sweep
              cpu_table.ROW_SHAPES[3],    # 256 × 4096: normtools bench's CPU sweep
              cpu_table.ROW_SHAPES[5])    # 256 × 64: the lab's TinyLM
QK_SHAPES = (cpu_table.QK_SHAPES[0],      # T=256, 8 + 2 heads of 128: normtools bench
             cpu_table.QK_SHAPES[1])      # T=256, 4 + 4 heads of 16: the lab's TinyLM
SHAPES = ROW_SHAPES + QK_SHAPES
CONTENDERS = cpu_table.CONTENDERS
REPS, MIN_TOTAL_S = 100, 0.6
# Expected seconds per case on one free core (torch 2.13): a torch.compile of the case and the
# timed rounds (MIN_TOTAL_S, more at 256 × 4096 where 4 × REPS calls take longer). Measured on
# the 2-core machine at load 8.7 (issue 35): compiles of 6-15 s (forward and forward +
# backward alike, the first one longest); on a free core compiles take about half that (and
# far less with Inductor's cache warm). REPS and MIN_TOTAL_S: at 40 calls and 0.2 s single
# cells moved by ±10 % from run to run on a free core, as much as the target's margin.
EXPECTED_COMPILE_S = {"forward": 4.0, "fwd_bwd": 8.0}
EXPECTED_TIMING_S = 1.5


def grid_cases():
    """The (op, shape, dtype) cases of the chapter's table: ``cpu_table.cpu_cases()`` at
    ``SHAPES``."""
    return [case for case in cpu_table.cpu_cases() if case[1] in SHAPES]


def expected_seconds(cases):
    """The run's expected wall time (``EXPECTED_COMPILE_S`` and ``EXPECTED_TIMING_S`` a case)."""
    return sum(EXPECTED_COMPILE_S["fwd_bwd" if op.endswith("_fwd_bwd") else "forward"]
               + EXPECTED_TIMING_S for op, _, _ in cases)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("cpu_table.json")))
    args = parser.parse_args()
    cases = grid_cases()
    print(f"{len(cases)} cases x {len(CONTENDERS)} contenders: expected "
          f"{expected_seconds(cases) / 60:.0f} min", flush=True)
    start = time.perf_counter()
    table = cpu_table.run_cpu_table(cases, CONTENDERS, reps=REPS, min_total_s=MIN_TOTAL_S,
                                    threads=1)
    table["conditions"]["grid"] = {"shapes": list(SHAPES), "contenders": list(CONTENDERS),
                                   "script": "book/data/kernels/make_cpu_table.py"}
    table["conditions"]["wall_s"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(cpu_table.cpu_table_markdown(table))
    print(f"took {table['conditions']['wall_s'] / 60:.1f} min, of which torch.compile "
          f"{table['conditions']['torch_compile_s'] / 60:.1f} min")

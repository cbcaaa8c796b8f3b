"""Writes cpu_table.json beside this file: the CPU table that chapter 4b renders.

The chapter's grid of ``normtools bench --cpu-table`` (normtools.measure.bench.cpu_table):
the shapes a reader's notebook and the lab use (64 × 256 and 256 × 1024 rows, the lab's
QK-Norm shape T = 256, 4 + 4 heads of 16), every op forward and forward + backward, float32 and
bfloat16, contenders interleaved on one thread. torch.compile is left out here (one compile
per case; the full command times it). Run from the repository root:

    PYTHONHASHSEED=0 OMP_WAIT_POLICY=PASSIVE .venv/bin/python book/data/kernels/make_cpu_table.py
"""

import json
from pathlib import Path

from normtools.measure.bench import cpu_table

SHAPES = (cpu_table.ROW_SHAPES[0], cpu_table.ROW_SHAPES[2], cpu_table.QK_SHAPES[1])
CONTENDERS = ("normtools-torch", "hf-module", "torch-F")

if __name__ == "__main__":
    cases = [case for case in cpu_table.cpu_cases() if case[1] in SHAPES]
    table = cpu_table.run_cpu_table(cases, CONTENDERS, reps=40, min_total_s=0.2, threads=1)
    table["conditions"]["grid"] = {"shapes": list(SHAPES), "contenders": list(CONTENDERS),
                                   "script": "book/data/kernels/make_cpu_table.py"}
    out = Path(__file__).with_name("cpu_table.json")
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(cpu_table.cpu_table_markdown(table))

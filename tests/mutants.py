"""Mutation check: does the test suite see realistic one-line bugs?

Each mutant is one textual edit of one file and the tests that must catch it. For each, the
repository's tracked files are copied to a temporary folder, the edit is applied there (never
in the working tree) and those tests run; a mutant is caught when they fail.

    .venv/bin/python tests/mutants.py            # every mutant
    .venv/bin/python tests/mutants.py spike      # mutants whose name contains "spike"

Exit code 1 when a mutant survives. CI does not run this by default (it takes minutes).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, original text, mutated text, tests that must fail)
MUTANTS = {
    "spike threshold 7 -> 6 sigma": (
        "normtools/lab/train.py", "OLMO2_SPIKE_K = 1000, 7.0", "OLMO2_SPIKE_K = 1000, 6.0",
        ["tests/test_hardening_lab.py"]),
    "weight check relaxed to the last dimension": (
        "normtools/core/validate.py", "if param.shape != (n,):", "if param.shape[-1] != n:",
        ["tests/test_hardening_library.py", "-k", "one_dimensional"]),
    "eps check back to > 0": (
        "normtools/core/validate.py", "if not SMALLEST_EPS <= eps < math.inf:", "if not 0 < eps < math.inf:",
        ["tests/test_hardening_library.py", "-k", "eps"]),
    "shard_columns without its width check": (
        "normtools/core/tp.py", "    if x.shape[-1] != num_heads * head_dim:", "    if False:",
        ["tests/test_hardening_library.py", "-k", "shard_columns"]),
    "patch copies the parameters again": (
        "normtools/cards/patching.py", "    new.weight = weight\n",
        "    new.weight = type(weight)(weight.detach().clone())\n",
        ["tests/test_hardening_patch.py"]),
}


def run(name, file, original, mutated, tests) -> bool:
    """True when ``tests`` fail on the mutant."""
    with tempfile.TemporaryDirectory(prefix="normtools-mutant-") as tmp:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        for f in files:
            if (ROOT / f).is_file():
                (Path(tmp) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, Path(tmp) / f)
        target = Path(tmp) / file
        text = target.read_text()
        if text.count(original) != 1:
            raise SystemExit(f"{name}: {original!r} is not exactly once in {file}; update the mutant")
        target.write_text(text.replace(original, mutated))
        env = {**os.environ, "PYTHONPATH": tmp, "PYTHONHASHSEED": "0"}
        result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
                                 *tests], cwd=tmp, env=env, capture_output=True, text=True)
        return result.returncode != 0


def main(selection=()):
    survivors = []
    for name, (file, original, mutated, tests) in MUTANTS.items():
        if selection and not any(s in name for s in selection):
            continue
        caught = run(name, file, original, mutated, tests)
        print(f"{'caught' if caught else 'NOT CAUGHT'}: {name} ({file})", flush=True)
        survivors += [] if caught else [name]
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

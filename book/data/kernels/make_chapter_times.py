"""Writes chapter_times.json beside this file: every chapter executed before and after issue 35.

Each version is a detached git worktree of its commit (``--before``, default a12648d, the last
commit before the torch path lost its custom op; ``--after``, default HEAD); its own chapters
(book/*.ipynb) run with its own ``normtools.book.build execute`` (papermill, default
parameters, one chapter at a time), importing normtools from that worktree. Chapter by chapter
the versions alternate, the first of each pair swapping every chapter, so warm caches
(Inductor's, the page cache) favour neither. A chapter that fails in a version is recorded with
its error (a12648d's chapter 4a names ``studies.CHECK_TOLERANCE``, which its normtools lacks).
Run from the repository root on a quiet machine (about 8 minutes on 2 cores):

    PYTHONHASHSEED=0 OMP_WAIT_POLICY=PASSIVE .venv/bin/python book/data/kernels/make_chapter_times.py
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def run_chapter(tree, chapter, folder, label):
    """The timing record of ``chapter`` executed in ``tree``, or its error's last line."""
    times = Path(folder) / f"{label}-{chapter}.json"
    done = subprocess.run([sys.executable, "-m", "normtools.book.build", "execute",
                           f"book/{chapter}", str(Path(folder) / label / chapter), "--times",
                           str(times)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"error": errors[-1].strip() if errors else f"exit {done.returncode}"}
    (record,) = json.loads(times.read_text()).values()
    return {key: record[key] for key in ("wall_s", "kernel_cpu_s", "load_1min")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="a12648d")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--out", default=str(Path(__file__).with_name("chapter_times.json")))
    args = parser.parse_args()
    commits = {"before": git("rev-parse", args.before), "after": git("rev-parse", args.after)}
    load_at_start, rows = os.getloadavg(), []
    with tempfile.TemporaryDirectory() as folder:
        trees = {label: Path(folder) / "trees" / label for label in commits}
        for label, commit in commits.items():
            git("worktree", "add", "--detach", "-q", str(trees[label]), commit)
        try:
            chapters = sorted({p.name for p in (trees["before"] / "book").glob("*.ipynb")}
                              & {p.name for p in (trees["after"] / "book").glob("*.ipynb")})
            for i, chapter in enumerate(chapters):
                for label in list(commits)[::1 if i % 2 == 0 else -1]:
                    rows.append({"chapter": chapter, "version": label,
                                 "commit": commits[label][:7],
                                 **run_chapter(trees[label], chapter, folder, label)})
                    print(rows[-1], flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    import torch

    conditions = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "cpu_count": os.cpu_count(), "torch": torch.__version__,
                  "load_average_at_start": load_at_start, "load_average": os.getloadavg(),
                  "command": "python book/data/kernels/make_chapter_times.py"}
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1)
                              + "\n")


if __name__ == "__main__":
    main()

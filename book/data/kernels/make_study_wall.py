"""Writes study_wall.json beside this file: one committed study trained whole, before and after
issue 35, and on the path it was committed from.

Three versions train the same study (``--study``, default precision: its cells, seeds and
size as committed), each in a detached git worktree of its commit, in processes held to the
committed machine's numeric path (``reproduce.numeric_path_environment``: its ATen CPU
capability and oneDNN cap, one thread):

* before: ``--before`` (default a12648d, the last commit before the torch path lost its
  custom op);
* after: ``--after`` (default HEAD) with its default RMSNorm backward (analytic);
* after, autograd: the same commit with ``NORMTOOLS_RMS_NORM_BACKWARD=autograd``, the path the
  committed studies were trained on: its final losses must equal the committed ones, which
  checks that the three trained what was committed.

The versions alternate, ``--runs-per-turn`` runs each per turn (``normtools lab run ...
--max-runs``, which resumes its file), so a change in the machine's load falls on all three.
A study's time is the sum of its runs' training seconds (as each run records them). Everything
lives under ``--work`` (default build/study_wall), so a killed job resumes where it stopped;
rerun the same command. Run from the repository root (about 25 minutes on a free core):

    PYTHONHASHSEED=0 OMP_WAIT_POLICY=PASSIVE .venv/bin/python book/data/kernels/make_study_wall.py
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from normtools.lab.reproduce import numeric_path_environment  # noqa: E402


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def versions(before, after):
    """label -> (commit, extra environment)."""
    after_commit = git("rev-parse", after)
    return {"before": (git("rev-parse", before), {}),
            "after": (after_commit, {"NORMTOOLS_RMS_NORM_BACKWARD": "analytic"}),
            "after, autograd": (after_commit, {"NORMTOOLS_RMS_NORM_BACKWARD": "autograd"})}


def worktree(work, commit):
    """A detached worktree of ``commit`` under ``work`` (made once, reused on resume)."""
    tree = work / "trees" / commit[:12]
    if not tree.exists():
        git("worktree", "add", "--detach", "-q", str(tree), commit)
    return tree


def summary(document, committed):
    """Training seconds and final losses of a finished study document against the committed
    one; ``run_seconds`` and ``final_losses`` in the committed document's run order."""
    key = lambda run: (run["variant"], float(run["lr"]), int(run["seed"]))
    runs = {key(run): run for run in document["runs"]}
    ordered = [runs[key(run)] for run in committed["runs"]]
    same = [a == b or (math.isnan(a) and math.isnan(b))      # a diverged run's loss is NaN
            for a, b in ((run["final_loss"], mine["final_loss"])
                         for run, mine in zip(committed["runs"], ordered))]
    return {"runs": len(ordered), "train_seconds": round(sum(run["seconds"] for run in ordered), 1),
            "diverged_runs": sum(bool(run["diverged"]) for run in ordered),
            "final_losses_equal_to_committed": sum(same),
            "run_seconds": [round(run["seconds"], 2) for run in ordered],
            "final_losses": [run["final_loss"] for run in ordered]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="precision")
    parser.add_argument("--before", default="a12648d")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--runs-per-turn", type=int, default=4)
    parser.add_argument("--work", default=str(ROOT / "build" / "study_wall"))
    parser.add_argument("--out", default=str(Path(__file__).with_name("study_wall.json")))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    committed_file = ROOT / "book" / "data" / "studies" / f"{args.study}.json"
    committed = json.loads(committed_file.read_text())
    machine = committed["conditions"]["machine"]
    seeds = len(committed["conditions"]["seeds"])
    assert committed["conditions"]["seeds"] == list(range(seeds)), "seeds 0..S-1 expected"
    plan = versions(args.before, args.after)
    outs = {label: work / f"{args.study}-{label.replace(', ', '-')}-{commit[:12]}.json"
            for label, (commit, _) in plan.items()}
    turns_file = work / f"{args.study}-turns.jsonl"     # one line a turn, kept across resumes

    def complete(path):
        return path.exists() and json.loads(path.read_text()).get("complete", False)

    while not all(complete(path) for path in outs.values()):
        for label, (commit, extra) in plan.items():
            if complete(outs[label]):
                continue
            tree = worktree(work, commit)
            env = {**os.environ, "PYTHONPATH": str(tree), **numeric_path_environment(machine),
                   **extra}
            subprocess.run([sys.executable, "-m", "normtools", "lab", "run", args.study,
                            "--size", committed["size"], "--seeds", str(seeds), "--threads",
                            str(machine["torch_threads"]), "--max-runs",
                            str(args.runs_per_turn), "--out", str(outs[label])],
                           cwd=tree, env=env, check=True,
                           stdout=subprocess.DEVNULL)
            runs = len(json.loads(outs[label].read_text())["runs"])
            with turns_file.open("a") as turns:
                turns.write(json.dumps({"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "version": label, "runs": runs,
                                        "load_average": os.getloadavg()}) + "\n")
            print(label, runs, "runs", flush=True)
    import torch

    rows = [{"version": label, "commit": commit[:7],
             "rms_norm_backward": extra.get("NORMTOOLS_RMS_NORM_BACKWARD", "n/a"),
             **summary(json.loads(outs[label].read_text()), committed)}
            for label, (commit, extra) in plan.items()]
    turns = [json.loads(line) for line in turns_file.read_text().splitlines()]
    one_minute_loads = [turn["load_average"][0] for turn in turns]
    conditions = {"utc": turns[-1]["utc"], "first_turn_utc": turns[0]["utc"], "turns": len(turns),
                  "study": args.study, "size": committed["size"], "seeds": seeds,
                  "committed_train_seconds": round(sum(r["seconds"] for r in committed["runs"]), 1),
                  "committed_machine": machine, "cpu_count": os.cpu_count(),
                  "torch": torch.__version__, "torch_threads": machine["torch_threads"],
                  "numeric_path_environment": numeric_path_environment(machine),
                  "runs_per_turn": args.runs_per_turn,
                  "load_average_1min_after_turns": [min(one_minute_loads),
                                                    max(one_minute_loads)],
                  "command": "python book/data/kernels/make_study_wall.py"}
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1)
                              + "\n")
    for row in rows:
        print(row)
    for commit in {commit for commit, _ in plan.values()}:
        if (work / "trees" / commit[:12]).exists():
            git("worktree", "remove", "--force", str(work / "trees" / commit[:12]))


if __name__ == "__main__":
    main()

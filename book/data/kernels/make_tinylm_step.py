"""Writes tinylm_step.json beside this file: the lab's TinyLM training step on the torch path,
before and after issue 35, and one run of a committed study on either RMSNorm backward.

The step: timed in one run on one thread, the two code versions alternating round by round.
Each version is a detached git worktree of its commit in a temporary folder (``--before``,
default a12648d, the last commit before 9c9c7d0; ``--after``, default HEAD); a child process per
round and version imports normtools from that worktree, builds the lab's "cpu" TinyLM
(normtools.lab.grid.STABILITY_SIZES) in four configurations and times ``--steps`` AdamW
training steps each (forward, backward, optimizer step; the first five untimed).

The study run: ``normtools lab rerun`` of the committed ``--study``'s check configuration (its
training seconds, as the study records them) in the ``--after`` worktree, alternating round by
round between ``NORMTOOLS_RMS_NORM_BACKWARD=autograd`` (the path the committed studies were
trained on) and ``analytic`` (the default since issue 35). Run from the repository root (about
ten minutes on a free core):

    PYTHONHASHSEED=0 OMP_WAIT_POLICY=PASSIVE .venv/bin/python book/data/kernels/make_tinylm_step.py
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"pre, RMSNorm": {}, "pre, RMSNorm, QK-Norm per head": {"qk_norm": "per_head"},
           "pre, RMSNorm, QK-Norm per layer": {"qk_norm": "per_layer"},
           "pre, LayerNorm": {"norm": "layer"}}
WARMUP_STEPS = 5
RMS_NORM_BACKWARDS = ("autograd", "analytic")


def time_steps(steps: int) -> dict:
    """Child: config -> per-step seconds of the TinyLM in the importable normtools."""
    import torch

    from normtools.lab.data import load_corpus
    from normtools.lab.grid import STABILITY_SIZES
    from normtools.lab.tinylm import TinyLM, TinyLMConfig
    from normtools.lab.train import _make_optimizer, loss_terms

    torch.set_num_threads(1)
    size, data = STABILITY_SIZES["cpu"], load_corpus()
    out = {}
    for name, extra in CONFIGS.items():
        torch.manual_seed(0)
        model = TinyLM(TinyLMConfig(**size["model"], **extra))
        optimizer = _make_optimizer(model, 3e-3)
        generator = torch.Generator().manual_seed(0)
        seconds = []
        for _ in range(steps + WARMUP_STEPS):
            batch = data.get_batch("train", size["batch_size"], size["model"]["max_seq_len"],
                                   generator, "cpu")
            start = time.perf_counter()
            loss, _ = loss_terms(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
        out[name] = seconds[WARMUP_STEPS:]
    return out


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="a12648d")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--study", default="precision")
    parser.add_argument("--study-rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("tinylm_step.json")))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        json.dump(time_steps(args.steps), sys.stdout)
        return
    root = Path(__file__).resolve().parents[3]
    commits = {label: subprocess.run(["git", "rev-parse", ref], cwd=root, capture_output=True,
                                     text=True, check=True).stdout.strip()
               for label, ref in (("before", args.before), ("after", args.after))}
    steps = {label: {name: [] for name in CONFIGS} for label in commits}
    study_file = Path("book") / "data" / "studies" / f"{args.study}.json"   # in each worktree
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        trees = {label: Path(folder) / label for label in commits}
        for label, commit in commits.items():
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[label]), commit],
                           cwd=root, check=True)
        study_seconds = {backward: [] for backward in RMS_NORM_BACKWARDS}
        try:
            for _ in range(args.study_rounds):
                for backward in RMS_NORM_BACKWARDS:
                    env = {**os.environ, "PYTHONPATH": str(trees["after"]),
                           "NORMTOOLS_RMS_NORM_BACKWARD": backward}
                    result = subprocess.run([sys.executable, "-m", "normtools", "lab", "rerun",
                                             str(study_file), "--json", "--threads", "1"],
                                            cwd=trees["after"], env=env, capture_output=True,
                                            text=True, check=True)
                    rerun = json.loads(result.stdout)
                    study_seconds[backward].append(rerun["record"]["seconds"])
                    configuration = rerun["chosen"]
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    result = subprocess.run([sys.executable, __file__, "--child", "--steps",
                                             str(args.steps)], cwd=tree, env=env,
                                            capture_output=True, text=True, check=True)
                    for name, seconds in json.loads(result.stdout).items():
                        steps[label][name] += seconds
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root)
    import torch

    rows = [{"config": name, "version": label, "commit": commits[label][:7],
             **{f"p{q}_ms": round(1e3 * percentile(steps[label][name], q), 2) for q in (50, 95, 99)},
             "steps": len(steps[label][name])}
            for name in CONFIGS for label in commits]
    study = json.loads((root / study_file).read_text())
    study_runs = [{"study": args.study, "rms_norm_backward": backward,
                   "configuration": configuration,
                   "run_seconds": seconds, "median_s": sorted(seconds)[len(seconds) // 2],
                   "runs_in_study": study["conditions"]["n_runs"]}
                  for backward, seconds in study_seconds.items()]
    conditions = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": 1,
                  "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": WARMUP_STEPS,
                  "model": "normtools.lab.grid.STABILITY_SIZES['cpu'] (width 64, depth 4, 4 heads, "
                           "batch 8 x 32 bytes), AdamW, float32",
                  "load_average_at_start": load_at_start, "load_average": os.getloadavg(),
                  "command": "python book/data/kernels/make_tinylm_step.py"}
    Path(args.out).write_text(json.dumps({"conditions": conditions, "rows": rows,
                                          "study_runs": study_runs}, indent=1) + "\n")
    for row in rows + study_runs:
        print(row)


if __name__ == "__main__":
    main()

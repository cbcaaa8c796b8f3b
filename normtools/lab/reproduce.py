"""The reproducibility check of a committed study: one committed seed of one configuration
trained again (:func:`rerun`; :func:`rerun_on_committed_path` in a fresh process held to the
committed machine's CPU kernels, where the run repeats exactly) and compared with the committed
run (:func:`compare_rerun`, up to float tolerance). It checks the code and the machine, not a
claim: a re-run of a committed seed is not a new observation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from normtools.lab import studies, study_files
from normtools.lab.data import load_corpus

#: Relative tolerance of :func:`compare_rerun`'s reproducibility check, per metric: a re-run of
#: a committed seed on the torch backend, on the committed CPU kernels and thread count
#: (:func:`rerun_on_committed_path`), reproduces its losses up to float rounding. Chaotic
#: quantities (peak logits) are not checked: a rounding difference grows along the run.
REPRODUCTION_RTOL = {"initial_loss": 1e-4, "final_loss": 1e-3}


def committed_run(document: dict, variant: str | None = None, lr: float | None = None,
                  seed: int | None = None) -> dict:
    """The configuration (variant, lr, seed) a rerun of the study ``document`` trains: its
    ``check`` configuration with ``variant``, ``lr`` and ``seed`` in place of its own;
    ``ValueError`` (with the variants, lrs and seeds the document has runs of) unless the
    document has a run of it, as :func:`compare_rerun` needs."""
    study = studies.get_study(document["study"])
    chosen = {**study.check, **{k: v for k, v in (("variant", variant), ("lr", lr), ("seed", seed))
                                if v is not None}}
    runs = [studies._run_key(r) for r in document["runs"]]
    if not any(v == chosen["variant"] and np.isclose(r, chosen["lr"]) and s == chosen["seed"]
               for v, r, s in runs):
        variants, lrs, seeds = (sorted(set(column)) for column in zip(*runs)) if runs else ([],) * 3
        raise ValueError(f"the committed {document['study']} study has no run of {chosen}; it has "
                         f"runs of variants {variants}, lrs {lrs}, seeds {seeds}")
    return chosen


def rerun(document: dict, variant: str | None = None, lr: float | None = None,
          seed: int | None = None, data=None) -> tuple[dict, dict]:
    """Train one committed seed of one configuration of a study again (:func:`committed_run`,
    checked before training), on the study's numeric path (torch backend, float32 evaluation of
    the whole split); returns (the configuration chosen, the re-run's JSON record)."""
    study = studies.get_study(document["study"])
    chosen = committed_run(document, variant, lr, seed)
    cell = {**study.variants[chosen["variant"]], "lr": chosen["lr"], "seed": chosen["seed"],
            "variant": chosen["variant"]}
    settings = study.settings(document["size"])
    return chosen, studies.run_record(study, cell, data or load_corpus(), settings,
                                      studies.provenance()["commit"])


#: oneDNN's instruction-set cap (``ONEDNN_MAX_CPU_ISA``) that goes with ATen's CPU capability:
#: oneDNN picks its own kernels (bfloat16 matmuls, for one) by what the CPU offers, whatever ATen
#: was told. A capability not listed leaves oneDNN uncapped.
_ONEDNN_ISA = {"DEFAULT": "SSE41", "AVX2": "AVX2"}


def numeric_path_environment(machine: dict) -> dict:
    """Environment variables that hold a fresh process to the numeric path of ``machine`` (a
    committed study's ``conditions["machine"]``): ``ATEN_CPU_CAPABILITY`` (ATen's vectorized
    kernels: DEFAULT, AVX2, AVX512 sum in other orders), ``ONEDNN_MAX_CPU_ISA`` and
    ``NORMTOOLS_RMS_NORM_BACKWARD`` (a study recorded before normtools kept it trained on
    "autograd"). All are read once, when the process first dispatches or imports normtools, so
    they need a new process; a CPU without the capability runs its fallback
    (:func:`rerun_on_committed_path` reports which ran)."""
    capability = machine["aten_cpu_capability"]
    env = {"ATEN_CPU_CAPABILITY": capability.lower(),
           "NORMTOOLS_RMS_NORM_BACKWARD": machine.get("rms_norm_backward", "autograd")}
    if capability in _ONEDNN_ISA:
        env["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_ISA[capability]
    return env


def rerun_on_committed_path(path: str | Path, variant: str | None = None, lr: float | None = None,
                            seed: int | None = None) -> tuple[dict, dict, str]:
    """:func:`rerun` of the committed study at ``path`` in a fresh Python process held to the
    committed machine's numeric path (:func:`numeric_path_environment`, its torch thread count).

    A training run is chaotic in the last bits: trained on another CPU path (an AVX-512 machine
    for a study committed on AVX2) a seed's final loss moves by about 1 %, past any float
    tolerance, while on the committed path it is reproduced exactly. Returns (the configuration
    chosen, the re-run's record, the ATen capability the process ran with: the committed one
    unless this CPU lacks it). The study and the configuration are checked
    (:func:`study_files.read_study`, :func:`committed_run`) before the process starts; if it fails
    all the same, ``RuntimeError`` with the last line of its message."""
    path = Path(path)
    document = study_files.read_study(path)
    committed_run(document, variant, lr, seed)
    machine = document["conditions"]["machine"]
    argv = [sys.executable, "-m", "normtools", "lab", "rerun", str(path), "--json",
            "--threads", str(machine["torch_threads"])]
    for flag, value in (("--variant", variant), ("--lr", lr), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    env = {**os.environ, **numeric_path_environment(machine)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"the rerun process exited with code {done.returncode}: {last[0]}")
    out = json.loads(done.stdout)
    return out["chosen"], out["record"], out["aten_cpu_capability"]


def compare_rerun(document: dict, chosen: dict, record: dict,
                  metrics=tuple(REPRODUCTION_RTOL)) -> "pandas.DataFrame":
    """The reproducibility check: one row per metric with the committed value of the same run
    (``chosen``: variant, lr, seed), the re-run's value, their relative difference and
    ``reproduced``: whether it is within :data:`REPRODUCTION_RTOL`. It checks the code and the
    machine, not the claim: a re-run of a committed seed is not a new observation."""
    import pandas as pd

    _, table = studies.study_table(document)
    same = table[(table["variant"] == chosen["variant"]) & np.isclose(table["lr"], chosen["lr"])
                 & (table["seed"] == chosen["seed"])]
    if same.empty:
        raise ValueError(f"the committed study has no run of {chosen}")
    rows = []
    for metric in metrics:
        committed, value = float(same[metric].iloc[0]), float(record[metric])
        rtol = REPRODUCTION_RTOL.get(metric, 1e-3)
        rows.append({"metric": metric, "committed": committed, "rerun": value,
                     "relative_difference": abs(value - committed) / abs(committed),
                     "rtol": rtol,
                     "reproduced": bool(np.isclose(value, committed, rtol=rtol, atol=0))})
    return pd.DataFrame(rows)

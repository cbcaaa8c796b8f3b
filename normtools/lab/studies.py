"""Committed studies: the runs of the stability chapter (4a) and of chapter 7 ("Related") that
exceed a chapter's 2-minute budget.

A study is a set of TinyLM training runs (variants × learning rates × seeds) at one ``size``
of :data:`normtools.lab.grid.STABILITY_SIZES`. :func:`run_study` (``normtools lab run STUDY``)
trains it and writes one JSON file (default ``book/data/studies/STUDY.json``) with the conditions (model,
steps, batch, seeds, optimizer, precision, versions, machine, threads, wall time) and one record
per run: the cell, the summary of :func:`normtools.lab.grid.summarize`, the last step's
per-layer values and the per-step curves of :data:`_CURVES`. The statistics' settings
(:data:`normtools.lab.verdicts.DEFAULT_THRESHOLDS` and the study's own) are fixed in the
:class:`Study` before it runs and recorded in the file, with the commit that produced each run
(:func:`provenance`: ``git rev-parse HEAD`` and whether ``normtools/`` had uncommitted changes).

A study is **resumable**: each run is appended to the file as it finishes (an atomic rewrite),
running the command again skips the runs the file already holds, and ``complete`` says whether
every run is in. Losses are evaluated on the whole validation split in float32
(:func:`normtools.lab.train.evaluate` with ``"all"``), whatever the training precision, and every
norm runs on the torch backend (``backend="torch"``, whatever ``TRITON_INTERPRET`` says).

The chapter renders that file with :func:`load_study`; :mod:`normtools.lab.reproduce` trains
one committed seed again and compares it (a reproducibility check, not evidence: the evidence
is the paired comparison over the seeds, :mod:`normtools.lab.verdicts`), and
:mod:`normtools.lab.study_cli` is the ``normtools lab`` command.

``size="gpu"`` runs the same study at the larger settings (write it to another file).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from normtools.core import sysinfo
from normtools.lab import grid, train
from normtools.lab.data import CORPUS_SHA256, load_corpus
from normtools.lab.designs import DESIGNS, TRAINED_DESIGNS
from normtools.lab.study_files import read_study
from normtools.lab.tinylm import TinyLMConfig
from normtools.lab.verdicts import DEFAULT_THRESHOLDS

#: Per-step records kept in the JSON (rounded to 4 significant digits).
_CURVES = ("loss", "grad_norm", "logit_max", "log_z")

#: Every study's norms run on this backend (the torch reference path: a rerun reproduces).
STUDY_BACKEND = "torch"


@dataclass(frozen=True)
class Study:
    """One study: ``variants`` (label → cell fields) × ``lrs`` × ``seeds``, trained for
    ``steps`` steps (default: the size's), with the spike score's ``spike_window``/``spike_k``."""

    name: str
    question: str
    variants: dict
    lrs: tuple | None = None          # None: the size's sweep learning rates
    seeds: tuple = (0, 1, 2)
    steps: int | None = None          # None: the size's steps
    spike_window: int = 1000
    spike_k: float = 7.0
    check: dict = field(default_factory=dict)  # the configuration rerun trains by default
    top_lrs: dict = field(default_factory=dict)  # variant → k: it runs at the k highest lrs only
    thresholds: dict = field(default_factory=dict)   # over DEFAULT_THRESHOLDS, fixed before the run

    def all_thresholds(self) -> dict:
        """:data:`normtools.lab.verdicts.DEFAULT_THRESHOLDS` with this study's own on top."""
        return {**DEFAULT_THRESHOLDS, **self.thresholds}

    def settings(self, size: str = "cpu", size_settings: dict | None = None) -> dict:
        """The settings of ``size`` (``size_settings``, default ``grid.STABILITY_SIZES[size]``)
        with this study's steps and learning rates."""
        settings = dict(grid.STABILITY_SIZES[size] if size_settings is None else size_settings)
        settings["steps"] = self.steps or settings["steps"]
        settings["lrs"] = tuple(self.lrs or settings["sweep_lrs"])
        return settings

    def cells(self, size: str = "cpu", size_settings: dict | None = None) -> list[dict]:
        """Every run of the study: one cell per variant, learning rate and seed, seed by seed
        (a partial study holds whole seeds of every variant: its runs pair up)."""
        lrs = self.settings(size, size_settings)["lrs"]
        return [{**fields_, "lr": lr, "seed": seed, "variant": label} for seed in self.seeds
                for label, fields_ in self.variants.items()
                for lr in self.variant_lrs(lrs).get(label, lrs)]

    def variant_lrs(self, lrs) -> dict:
        """variant → its learning rates, for the variants of ``top_lrs``: the k highest of
        ``lrs`` (the size's grid), so a control at the top of the sweep follows every size."""
        return {label: tuple(sorted(lrs)[-k:]) for label, k in self.top_lrs.items()}


_BASE = {"placement": "pre", "qk_norm": "none"}
#: The spike studies' arms: OLMo 2's two changes (post-sublayer norms, per-layer QK-Norm) alone and
#: together, against Pre-LN.
_SPIKE_VARIANTS = {"pre, none": _BASE, "pre, per_head": {**_BASE, "qk_norm": "per_head"},
                   "post_sublayer, none": {"placement": "post_sublayer", "qk_norm": "none"},
                   "post_sublayer, per_layer": {"placement": "post_sublayer", "qk_norm": "per_layer"}}
#: Wortsman et al.'s independent weight decay: p ← p·(1 − λ·η_t/η) with λ = 1e-4 (their value).
_INDEPENDENT_WD = {"independent_weight_decay": True, "weight_decay": 1e-4}
#: Unit-RMS embeddings and a width-scaled std 1/√width for every other matrix (width 64 of the
#: "cpu" size), against GPT-2's 0.02 everywhere: the initialization OLMo 2 §3.4.2 uses.
_UNIT_EMBED = {"embed_std": 1.0, "init_std": 64 ** -0.5}

STUDIES = {
    "lr_sweep": Study(
        "lr_sweep",
        "Wortsman et al. 2023: logit growth with the learning rate, the LR sensitivity, and "
        "three remedies on the same runs (QK-Norm, attention soft-capping, z-loss), with "
        "independent weight decay; QK-Norm with weight decay on its gains; no clipping at the "
        "two highest learning rates.",
        {"no QK-Norm": {**_BASE, **_INDEPENDENT_WD},
         "QK-Norm": {**_BASE, **_INDEPENDENT_WD, "qk_norm": "per_head"},
         "QK-Norm, decayed gains": {**_BASE, **_INDEPENDENT_WD, "qk_norm": "per_head",
                                    "qk_gain_weight_decay": True},
         "soft-cap 50": {**_BASE, **_INDEPENDENT_WD, "attn_softcap": 50.0},
         "z-loss 1e-4": {**_BASE, **_INDEPENDENT_WD, "z_loss_coef": 1e-4},
         "no QK-Norm, no clip": {**_BASE, **_INDEPENDENT_WD, "grad_clip": None}},
        top_lrs={"no QK-Norm, no clip": 2},
        seeds=tuple(range(10)),
        thresholds={"logit_ratio": 10.0},
        check={"variant": "no QK-Norm", "lr": 1e-1, "seed": 0}),
    "placements": Study(
        "placements",
        "Per-layer gradient norm, residual RMS and attention logits at the high learning rate, "
        "per placement, with and without QK-Norm, and OLMo 2's combination; the Post-LN-family "
        "runs again with unit-RMS embeddings and width-scaled init.",
        {**{f"{p}, {q}": {"placement": p, "qk_norm": q}
            for p, q in [(p, q) for p in ("pre", "sandwich", "post_sublayer")
                         for q in ("none", "per_head")] + [("post_sublayer", "per_layer")]},
         **{f"{p}, {q}, unit-RMS emb": {"placement": p, "qk_norm": q, **_UNIT_EMBED}
            for p, q in (("sandwich", "none"), ("post_sublayer", "none"),
                         ("post_sublayer", "per_layer"))}},
        lrs=(1e-1,), seeds=tuple(range(10)),
        thresholds={"logit_ratio": 10.0},
        check={"variant": "sandwich, none", "lr": 1e-1, "seed": 0}),
    "spikes": Study(
        "spikes",
        "OLMo 2's spike score, adapted to short runs (window 50, 7σ, percent of scored steps), "
        "and the count of clipped steps after warm-up; OLMo 2's two changes alone and together.",
        _SPIKE_VARIANTS,
        lrs=(1e-1,), steps=400, spike_window=50, spike_k=7.0, seeds=tuple(range(10)),
        check={"variant": "pre, none", "lr": 1e-1, "seed": 0}),
    "spikes_long": Study(
        "spikes_long",
        "The spike study at OLMo 2's own window (1,000 values, 7σ) over 2,000 steps.",
        _SPIKE_VARIANTS,
        lrs=(1e-1,), steps=2000, spike_window=1000, spike_k=7.0, seeds=tuple(range(10)),
        check={"variant": "pre, none", "lr": 1e-1, "seed": 0}),
    "precision": Study(
        "precision",
        "bfloat16 autocast against float32, with and without QK-Norm, at the high learning rate "
        "(every loss evaluated in float32).",
        {"fp32, no QK-Norm": {**_BASE, "precision": "fp32"},
         "fp32, QK-Norm": {**_BASE, "qk_norm": "per_head", "precision": "fp32"},
         "bf16, no QK-Norm": {**_BASE, "precision": "bf16"},
         "bf16, QK-Norm": {**_BASE, "qk_norm": "per_head", "precision": "bf16"}},
        lrs=(1e-1,), seeds=tuple(range(10)),
        check={"variant": "bf16, QK-Norm", "lr": 1e-1, "seed": 0}),
    "related": Study(
        "related",
        "Chapter 7: every trained design of normtools.lab.designs (DeepNorm, Admin, Mix-LN, "
        "LayerNorm Scaling, nGPT, DyT against Pre-LN and Post-LN) over six peak learning rates, "
        "each design compared at its own best; Post-LN again with unit-RMS embeddings; spike "
        "score adapted as in 4a.",
        {**{name: DESIGNS[name] for name in TRAINED_DESIGNS},
         "Post-LN, unit-RMS emb": {**DESIGNS["Post-LN"], **_UNIT_EMBED}},
        # 1e-3 added after the first five: Pre-LN's best was 3e-3, the lowest, so the sweep did
        # not bracket it (its runs trained in a process of their own, merged into the file)
        lrs=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1), steps=300, spike_window=50, spike_k=7.0,
        seeds=tuple(range(10)),
        check={"variant": "Pre-LN", "lr": 1e-2, "seed": 0}),
}


@dataclass(frozen=True)
class InitProbe:
    """A committed probe at initialization, no training: :func:`normtools.lab.probes.init_gradients`
    of every variant (TinyLM keyword arguments over ``model``), placement, depth and seed, on one
    validation batch of ``batch_size`` sequences (drawn with generator seed 0)."""

    name: str
    question: str
    model: dict
    variants: dict
    depths: tuple
    placements: tuple = ("post", "pre")
    seeds: tuple = tuple(range(10))
    batch_size: int = 8

    def units(self) -> list[tuple[str, int]]:
        """(variant, depth): the pieces written one at a time (the probe is resumable)."""
        return [(v, d) for v in self.variants for d in self.depths]


_XIONG_WIDTH = 256
INIT_PROBES = {
    "xiong_wide": InitProbe(
        "xiong_wide",
        "Xiong et al. 2020 at initialization, at width 256 over 10 seeds: the last layer's "
        "‖∂L/∂W²‖ against the depth and per layer, Post-LN against Pre-LN (LayerNorm, 1/√width "
        "init); the same with the original ReLU FFN (d_ff = 4d), Glorot init and unit-variance "
        "embeddings.",
        dict(width=_XIONG_WIDTH, heads=4, max_seq_len=64),
        {"SwiGLU, 1/√d init": {"norm": "layer", "init_std": _XIONG_WIDTH ** -0.5},
         "ReLU FFN, Glorot, unit embeddings": {"norm": "layer", "mlp": "relu",
                                               "init_scheme": "xavier", "embed_std": 1.0}},
        depths=(6, 12, 24, 48)),
}


def run_init_probe(name: str, out: str | Path | None = None) -> dict:
    """Run init probe ``name`` of :data:`INIT_PROBES` and return its JSON document: ``probe``,
    ``question``, ``provenance``, ``conditions``, ``complete`` and ``rows`` (one per variant,
    placement, depth, seed and layer: ``w2_grad_norm``, ``residual_rms``, ``loss``). With
    ``out`` it is resumable like a study: the (variant, depth) pieces already in the file are
    kept, and the file is rewritten atomically after each new piece."""
    from normtools.lab import probes

    if name not in INIT_PROBES:
        raise ValueError(f"unknown init probe {name!r}; expected one of {', '.join(INIT_PROBES)}")
    probe = INIT_PROBES[name]
    document = {
        "study": probe.name, "question": probe.question, "provenance": provenance(),
        "conditions": {"model": probe.model, "variants": probe.variants, "depths": list(probe.depths),
                       "placements": list(probe.placements), "seeds": list(probe.seeds),
                       "batch": f"{probe.batch_size} validation sequences of "
                                f"{probe.model['max_seq_len']} bytes, generator seed 0",
                       "corpus_sha256": CORPUS_SHA256, "machine": sysinfo.study_machine(),
                       "torch_threads": torch.get_num_threads(), "wall_seconds": 0,
                       "command": f"normtools lab probe {probe.name}"},
        "complete": False, "runs": []}
    if out is not None and Path(out).exists():
        existing = read_study(out, probe=True)
        if existing["study"] != name or existing["conditions"]["model"] != probe.model:
            raise ValueError(f"{out} holds another probe: move it away or pass another --out")
        document.update(runs=existing["runs"], provenance=existing["provenance"])
        document["conditions"]["wall_seconds"] = existing["conditions"]["wall_seconds"]
    data = load_corpus()
    batch = data.get_batch("val", probe.batch_size, probe.model["max_seq_len"],
                           torch.Generator().manual_seed(0))
    done = {(r["variant"], r["depth"]) for r in document["runs"]}
    for variant, depth in probe.units():
        if (variant, depth) in done:
            continue
        start = time.perf_counter()
        table = probes.init_gradients(batch, probe.placements, (depth,), probe.seeds,
                                      **probe.model, **probe.variants[variant])
        document["runs"] += [{"variant": variant, **{k: _round(v.item() if hasattr(v, "item") else v, 6)
                                                     for k, v in row.items()}}
                             for row in table.to_dict("records")]
        document["conditions"]["wall_seconds"] += round(time.perf_counter() - start)
        document["complete"] = len({(r["variant"], r["depth"]) for r in document["runs"]}) == len(probe.units())
        if out is not None:
            _write_study(document, out, force=True)
    return document


def provenance(root: Path | None = None) -> dict:
    """The code a run comes from: ``commit`` (``git rev-parse HEAD``), ``dirty`` (whether
    ``git status --porcelain normtools`` lists uncommitted changes to the package) and those
    ``dirty_paths``; ``commit`` None outside a git checkout."""
    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "normtools"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "dirty_paths": []}
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(paths), "dirty_paths": paths}


def _round(v, digits: int = 4):
    if isinstance(v, float) and math.isfinite(v) and v != 0.0:
        return float(f"{v:.{digits}g}")
    return v


def run_record(study: Study, cell: dict, data, settings: dict, commit: str | None,
                device="cpu") -> dict:
    """Train one ``cell`` of ``study`` (with its ``variant`` label) at ``settings``
    (:meth:`Study.settings`) on the torch backend, evaluated on the whole validation split in
    float32, and return its JSON record with ``commit`` (the code the process imported, taken
    when it started: a commit made while a long study runs is not the runs' code) and
    ``seconds``."""
    base_config = TinyLMConfig(**{**settings["model"], "backend": STUDY_BACKEND})
    label = cell["variant"]
    run_cell = {k: v for k, v in cell.items() if k != "variant"}
    start = time.perf_counter()
    run = grid.run_cell(run_cell, data, base_config, steps=settings["steps"],
                        batch_size=settings["batch_size"], device=device,
                        probe_batch_size=settings["probe_batch_size"], eval_batches="all")
    row = grid.summarize([run], study.spike_window, study.spike_k).iloc[0].to_dict()
    last = run.records.iloc[-1]
    depth = run.config.depth
    return {
        "variant": label,
        **{k: _round(v.item() if hasattr(v, "item") else v) for k, v in row.items()},
        "layers": {metric: [_round(float(last[f"{metric}_{i}"])) for i in range(depth)]
                   for metric in ("grad_norm", "act_rms", "logit_max")},
        "curves": {c: [_round(float(v)) for v in run.records[c]] for c in _CURVES},
        "commit": commit,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _run_key(record: dict) -> tuple:
    return record["variant"], float(record["lr"]), int(record["seed"])


def new_document(name: str, size: str = "cpu", seeds=None, device="cpu",
                 size_settings: dict | None = None) -> dict:
    """The JSON document of study ``name`` before any run: ``study``, ``question``, ``size``,
    ``thresholds``, ``provenance``, ``conditions``, ``complete`` (False) and ``runs`` ([])."""
    study = _study_with_seeds(name, seeds)
    settings = study.settings(size, size_settings)
    suffix = "" if seeds is None else f" --seeds {len(study.seeds)}"
    return {
        "study": study.name, "question": study.question, "size": size,
        "thresholds": study.all_thresholds(),
        "provenance": provenance(),
        "conditions": {
            "model": TinyLMConfig(**{**settings["model"], "backend": STUDY_BACKEND}).__dict__,
            "steps": settings["steps"], "batch_size": settings["batch_size"],
            "tokens_per_step": settings["batch_size"] * settings["model"]["max_seq_len"],
            "lrs": list(settings["lrs"]),
            "variant_lrs": {k: list(v) for k, v in study.variant_lrs(settings["lrs"]).items()},
            "seeds": list(study.seeds), "n_runs": len(study.cells(size, size_settings)),
            "variants": study.variants,
            "optimizer": "AdamW β=(0.9, 0.95), weight decay 0.1 on matrices (unless the variant "
                         "sets weight_decay / independent_weight_decay / qk_gain_weight_decay), "
                         "clip 1.0 (unless grad_clip), warm-up 10 % of the steps, cosine to 0.1·lr",
            "evaluation": "whole validation split, float32, consecutive windows of max_seq_len",
            "spike_score": {"window": study.spike_window, "k": study.spike_k, "unit": "percent"},
            "corpus_sha256": CORPUS_SHA256,
            "device": str(device), "machine": sysinfo.study_machine(),
            "wall_seconds": 0,
            "command": f"normtools lab run {study.name} --size {size}{suffix}",
        },
        "complete": False,
        "runs": [],
    }


def _study_with_seeds(name: str, seeds=None) -> Study:
    study = get_study(name)
    if seeds is not None:
        study = Study(**{**study.__dict__, "seeds": tuple(int(s) for s in seeds)})
    return study


def run_study(name: str, size: str = "cpu", seeds=None, device="cpu",
              size_settings: dict | None = None, out: str | Path | None = None,
              max_runs: int | None = None, shard: tuple[int, int] | None = None) -> dict:
    """Train study ``name`` at ``size`` (``seeds`` overrides the study's) and return its JSON
    document (:func:`new_document` with the runs). ``size_settings`` replaces
    ``grid.STABILITY_SIZES[size]`` (a chapter passes its shrunk gpu settings).

    With ``out``, the study is resumable: the runs already in the file at ``out`` (same study,
    size, model, steps and seeds; ``ValueError`` otherwise) are kept and skipped, and the file is
    rewritten atomically after every new run; ``complete`` becomes True when every run is in.
    ``max_runs`` stops after that many new runs (the file stays incomplete).

    ``shard=(i, k)`` trains only the seeds at positions i, i + k, i + 2k, ... of the study's
    seeds (whole seeds, so a shard's runs pair up by themselves): k processes, each with its own
    ``out``, train the study together, and :func:`merge_studies` joins their files."""
    study = _study_with_seeds(name, seeds)
    settings = study.settings(size, size_settings)
    document = new_document(name, size, seeds, device, size_settings)
    if out is not None and Path(out).exists():
        existing = read_study(out)
        for key in ("study", "size"):
            if existing[key] != document[key]:
                raise ValueError(f"{out} holds {key}={existing[key]!r}, not {document[key]!r}")
        # the model compared as a TinyLMConfig: a field added since keeps its default
        same = {"model": TinyLMConfig(**existing["conditions"]["model"])
                == TinyLMConfig(**document["conditions"]["model"]),
                **{key: existing["conditions"].get(key) == document["conditions"][key]
                   for key in ("steps", "batch_size")}}
        for key, equal in same.items():
            if not equal:
                raise ValueError(f"{out} was run with other {key}: move it away or pass another --out")
        document["runs"] = [r for r in existing["runs"]]
        document["conditions"]["wall_seconds"] = existing["conditions"].get("wall_seconds", 0)
        document["provenance"] = existing.get("provenance", document["provenance"])
    commit = provenance()["commit"]
    done = {_run_key(r) for r in document["runs"]}
    shard_seeds = study.seeds if shard is None else study.seeds[shard[0]::shard[1]]
    todo = [c for c in study.cells(size, size_settings)
            if _run_key(c) not in done and c["seed"] in shard_seeds]
    data = load_corpus()
    for i, cell in enumerate(todo):
        if max_runs is not None and i >= max_runs:
            break
        record = run_record(study, cell, data, settings, commit, device)
        document["runs"].append(record)
        document["conditions"]["wall_seconds"] += round(record["seconds"])
        _update_budget(document)
        if out is not None:
            _write_study(document, out, force=True)
    document["complete"] = len(document["runs"]) >= document["conditions"]["n_runs"]
    return document


def _update_budget(document: dict) -> None:
    """Set the document's ``budget`` (runs × the measured seconds per run, on this machine) and
    ``complete`` (every run in) from its runs."""
    conditions = document["conditions"]
    seconds = [r["seconds"] for r in document["runs"] if "seconds" in r]
    if seconds:
        conditions["budget"] = (
            f"{conditions['n_runs']} runs × {np.mean(seconds):.0f} s per run (mean of "
            f"{len(seconds)}) = {conditions['n_runs'] * np.mean(seconds) / 3600:.1f} h")
    document["complete"] = len(document["runs"]) >= conditions["n_runs"]


#: Conditions that differ between the files of one study trained in parts (shards, resumed
#: sessions): the time each part took. Everything else must agree for runs to be merged.
_PER_PART_CONDITIONS = ("wall_seconds", "budget")


def merge_studies(paths, out: str | Path | None = None) -> dict:
    """One study document from the files at ``paths`` (the shards of ``run_study(...,
    shard=...)``, or parts trained elsewhere): the union of their runs in the study's cell
    order, the wall seconds summed, the provenance of the first file. ``ValueError`` unless every
    file holds the same study, size, thresholds and conditions (model, steps, seeds, machine:
    the numeric path a rerun needs) and a run present in two files is the same record in both
    (whatever its seconds), and every run is a cell of the study; ``ValueError`` too for a file
    given twice (its wall seconds would count twice) and one that is not a study
    (:func:`read_study`). With ``out``, the document is written there."""
    if not paths:
        raise ValueError("no study files to merge")
    given = {}
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in given:
            spelled = "" if given[resolved] == path else f" (also as {given[resolved]})"
            raise ValueError(f"{path} is given twice{spelled}: give each part once, or its wall "
                             f"seconds count twice")
        given[resolved] = path
    documents = [read_study(p) for p in paths]
    first = documents[0]

    def fixed(document):
        return {"study": document["study"], "size": document["size"],
                "thresholds": document["thresholds"],
                **{f"conditions.{k}": v for k, v in document["conditions"].items()
                   if k not in _PER_PART_CONDITIONS}}

    for path, document in zip(paths, documents):
        theirs, ours = fixed(document), fixed(first)
        differing = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        if differing:
            raise ValueError(f"{path} differs from {paths[0]} in {', '.join(differing)}")
    runs = {}
    for path, document in zip(paths, documents):
        for record in document["runs"]:
            key = _run_key(record)
            without_time = {k: v for k, v in record.items() if k != "seconds"}
            if key in runs and {k: v for k, v in runs[key].items() if k != "seconds"} != without_time:
                raise ValueError(f"run {key} differs between the files (found again in {path})")
            runs.setdefault(key, record)
    study = _study_with_seeds(first["study"], first["conditions"]["seeds"])
    order = {_run_key(c): i for i, c in enumerate(study.cells(first["size"]))}
    strays = [key for key in runs if key not in order]
    if strays:
        raise ValueError(f"runs {strays} (variant, lr, seed) are not cells of the "
                         f"{first['study']} study at size {first['size']!r} with seeds "
                         f"{first['conditions']['seeds']}")
    merged = {**first, "conditions": dict(first["conditions"]),
              "runs": sorted(runs.values(), key=lambda r: order[_run_key(r)])}
    merged["conditions"]["wall_seconds"] = sum(d["conditions"].get("wall_seconds", 0) for d in documents)
    _update_budget(merged)
    if out is not None:
        _write_study(merged, out)
    return merged


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; expected one of {', '.join(STUDIES)}")
    return STUDIES[name]


def _write_study(document: dict, path: str | Path, force: bool = False) -> Path:
    """Write a study document as JSON (indented, keys in order), atomically: a temporary file in
    the same folder, then a rename. ``ValueError`` for a document without runs, and, unless
    ``force``, for one with fewer runs than the study already at ``path`` (a committed result)."""
    path = Path(path)
    if not document["runs"]:
        raise ValueError(f"{document['study']}: no runs to write")
    if path.exists() and not force:
        try:
            existing = len(json.loads(path.read_text())["runs"])
        except (ValueError, KeyError, TypeError, RecursionError):
            existing = 0  # not a study: nothing to keep
        if len(document["runs"]) < existing:
            raise ValueError(f"{path} holds {existing} runs; this study has {len(document['runs'])}. "
                             f"Move it away, or pass --out to write elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    temporary.replace(path)
    return path


def load_study(path: str | Path) -> tuple[dict, "pandas.DataFrame"]:
    """(document, runs table): the JSON document (:func:`read_study`) and one row per run (its
    scalar fields; the per-layer values and curves stay in ``document["runs"]``, in the same
    order)."""
    return study_table(read_study(path))


def load_init_probe(path: str | Path) -> tuple[dict, "pandas.DataFrame"]:
    """(document, rows table) of a committed init probe (:func:`run_init_probe`)."""
    import pandas as pd

    document = read_study(path, probe=True)
    return document, pd.DataFrame(document["runs"])


def study_table(document: dict):
    """(document, runs table) of an already loaded document (see :func:`load_study`). The table
    has one row per run, its scalar fields, and ``clipped_steps``: the steps after warm-up that
    gradient clipping rescaled (:func:`normtools.lab.train.clipped_steps` of the run's gradient
    norm curve at its variant's clip; NaN for a run without clipping or without the curve)."""
    import pandas as pd

    conditions = document["conditions"]
    warmup = train.default_warmup(conditions["steps"])
    rows = []
    for run in document["runs"]:
        row = {k: v for k, v in run.items() if k not in ("layers", "curves")}
        clip = conditions["variants"].get(run["variant"], {}).get("grad_clip", 1.0)
        curve = run.get("curves", {}).get("grad_norm")
        row["clipped_steps"] = (train.clipped_steps(curve, clip, warmup)
                                if clip is not None and curve is not None else np.nan)
        rows.append(row)
    return document, pd.DataFrame(rows)


def median_range(table, metrics, by, fmt: str = "{:.3g}") -> "pandas.DataFrame":
    """:func:`normtools.lab.grid.over_seeds` of ``table`` as text: per group of ``by``
    (the index), ``n_seeds`` and one column per metric, "median [min, max]" with ``fmt``."""
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    stats = grid.over_seeds(table, metrics, by=list(by))
    out = stats[list(by) + ["n_seeds"]].copy()
    for m in metrics:
        out[m] = [f"{fmt.format(a)} [{fmt.format(b)}, {fmt.format(c)}]"
                  for a, b, c in zip(stats[f"{m}_median"], stats[f"{m}_min"], stats[f"{m}_max"])]
    return out.set_index(list(by))


def seed_curves(document: dict, curve: str, **match) -> np.ndarray:
    """The per-step ``curve`` of every committed run whose fields equal ``match`` (e.g.
    ``variant="QK-Norm", lr=0.1``), one row per run (seed), NaN-padded to the longest."""
    rows = [run["curves"][curve] for run in document["runs"]
            if all(run.get(k) == v or (isinstance(v, float) and np.isclose(run.get(k, np.nan), v))
                   for k, v in match.items())]
    if not rows:
        raise ValueError(f"no committed run matches {match}")
    width = max(len(r) for r in rows)
    return np.array([list(r) + [np.nan] * (width - len(r)) for r in rows], dtype=float)

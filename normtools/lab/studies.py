"""Committed studies: the runs of the stability chapter (4a) and of chapter 7 ("Related") that
exceed a chapter's 2-minute budget.

A study is a set of TinyLM training runs (variants × learning rates × seeds) at one ``size``
of :data:`normtools.lab.grid.STABILITY_SIZES`. ``normtools lab run STUDY`` trains it and
writes one JSON file (default ``book/data/studies/STUDY.json``) with the conditions (model,
steps, batch, seeds, optimizer, precision, versions, machine, threads, wall time) and one record
per run: the cell, the summary of :func:`normtools.lab.grid.summarize`, the last step's
per-layer values and the per-step curves of :data:`_CURVES`. The chapter renders that file with
:func:`load_study`; :func:`rerun` trains one seed of one configuration again and
:func:`compare_rerun` says whether each of its numbers falls within the range the committed seeds
span.

``size="gpu"`` runs the same study at the larger settings (write it to another file).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from normtools.core import sysinfo
from normtools.core.command_line import device_name, positive_int
from normtools.lab import grid
from normtools.lab.data import CORPUS_SHA256, load_corpus
from normtools.lab.designs import DESIGNS, TRAINED_DESIGNS
from normtools.lab.tinylm import TinyLMConfig

#: Per-step records kept in the JSON (rounded to 4 significant digits).
_CURVES = ("loss", "grad_norm", "logit_max", "log_z")

#: Where ``normtools lab run`` writes a study by default (relative to the repository root).
_DEFAULT_DIR = Path("book") / "data" / "studies"

#: Relative widening of the committed [min, max] range in :func:`compare_rerun`, per metric:
#: losses are reproducible to a few parts in a thousand; the peak logit of a chaotic run is not.
CHECK_TOLERANCE = {"final_loss": 0.02, "logit_max_peak": 0.5, "attn_entropy": 0.25}


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

    def settings(self, size: str = "cpu", size_settings: dict | None = None) -> dict:
        """The settings of ``size`` (``size_settings``, default ``grid.STABILITY_SIZES[size]``)
        with this study's steps and learning rates."""
        settings = dict(grid.STABILITY_SIZES[size] if size_settings is None else size_settings)
        settings["steps"] = self.steps or settings["steps"]
        settings["lrs"] = tuple(self.lrs or settings["sweep_lrs"])
        return settings

    def cells(self, size: str = "cpu", size_settings: dict | None = None) -> list[dict]:
        """Every run of the study: one cell per variant, learning rate and seed."""
        lrs = self.settings(size, size_settings)["lrs"]
        return [{**fields_, "lr": lr, "seed": seed, "variant": label}
                for label, fields_ in self.variants.items() for lr in lrs for seed in self.seeds]


_BASE = {"placement": "pre", "qk_norm": "none"}

STUDIES = {
    "lr_sweep": Study(
        "lr_sweep",
        "Wortsman et al. 2023: logit growth with the learning rate, the LR sensitivity, and "
        "three remedies on the same runs (QK-Norm, attention soft-capping, z-loss).",
        {"no QK-Norm": _BASE,
         "QK-Norm": {**_BASE, "qk_norm": "per_head"},
         "soft-cap 50": {**_BASE, "attn_softcap": 50.0},
         "z-loss 1e-4": {**_BASE, "z_loss_coef": 1e-4}},
        check={"variant": "no QK-Norm", "lr": 1e-1, "seed": 0}),
    "placements": Study(
        "placements",
        "Per-layer gradient norm, residual RMS and attention logits at the high learning rate, "
        "per placement, with and without QK-Norm, and OLMo 2's combination.",
        {f"{p}, {q}": {"placement": p, "qk_norm": q}
         for p, q in [(p, q) for p in ("pre", "sandwich", "post_sublayer")
                      for q in ("none", "per_head")] + [("post_sublayer", "per_layer")]},
        lrs=(1e-1,),
        check={"variant": "sandwich, none", "lr": 1e-1, "seed": 0}),
    "spikes": Study(
        "spikes",
        "OLMo 2's spike score, adapted to short runs (window 50, 7σ, percent of scored steps).",
        {"pre, none": _BASE, "pre, per_head": {**_BASE, "qk_norm": "per_head"},
         "post_sublayer, per_layer": {"placement": "post_sublayer", "qk_norm": "per_layer"}},
        lrs=(1e-1,), steps=400, spike_window=50, spike_k=7.0,
        check={"variant": "pre, none", "lr": 1e-1, "seed": 0}),
    "precision": Study(
        "precision",
        "bfloat16 autocast against float32, with and without QK-Norm, at the high learning rate.",
        {"fp32, no QK-Norm": {**_BASE, "precision": "fp32"},
         "fp32, QK-Norm": {**_BASE, "qk_norm": "per_head", "precision": "fp32"},
         "bf16, no QK-Norm": {**_BASE, "precision": "bf16"},
         "bf16, QK-Norm": {**_BASE, "qk_norm": "per_head", "precision": "bf16"}},
        lrs=(1e-1,),
        check={"variant": "bf16, QK-Norm", "lr": 1e-1, "seed": 0}),
    "related": Study(
        "related",
        "Chapter 7: every trained design of normtools.lab.designs (DeepNorm, Admin, Mix-LN, "
        "LayerNorm Scaling, nGPT, DyT against Pre-LN and Post-LN) at a normal and a high learning "
        "rate, five times longer than the chapter's live runs; spike score adapted as in 4a.",
        {name: DESIGNS[name] for name in TRAINED_DESIGNS},
        lrs=(1e-2, 1e-1), steps=300, spike_window=50, spike_k=7.0,
        check={"variant": "Pre-LN", "lr": 1e-2, "seed": 0}),
}


def _round(v, digits: int = 4):
    if isinstance(v, float) and math.isfinite(v) and v != 0.0:
        return float(f"{v:.{digits}g}")
    return v


def _run_records(study: Study, cells: list[dict], data, settings: dict, device="cpu") -> list[dict]:
    """Train ``cells`` (cells of ``study``, each with its ``variant`` label) at ``settings``
    (:meth:`Study.settings`) and return one JSON record per run."""
    base_config = TinyLMConfig(**settings["model"])
    records = []
    for cell in cells:
        label = cell["variant"]
        run_cell = {k: v for k, v in cell.items() if k != "variant"}
        run = grid.run_cell(run_cell, data, base_config, steps=settings["steps"],
                                   batch_size=settings["batch_size"], device=device,
                                   probe_batch_size=settings["probe_batch_size"], eval_batches=4)
        row = grid.summarize([run], study.spike_window, study.spike_k).iloc[0].to_dict()
        last = run.records.iloc[-1]
        depth = run.config.depth
        records.append({
            "variant": label,
            **{k: _round(v.item() if hasattr(v, "item") else v) for k, v in row.items()},
            "layers": {metric: [_round(float(last[f"{metric}_{i}"])) for i in range(depth)]
                       for metric in ("grad_norm", "act_rms", "logit_max")},
            "curves": {c: [_round(float(v)) for v in run.records[c]] for c in _CURVES},
        })
    return records


def run_study(name: str, size: str = "cpu", seeds=None, device="cpu",
              size_settings: dict | None = None) -> dict:
    """Train study ``name`` at ``size`` (``seeds`` overrides the study's) and return its JSON
    document: ``study``, ``question``, ``size``, ``conditions`` and ``runs``. ``size_settings``
    replaces ``grid.STABILITY_SIZES[size]`` (a chapter passes its shrunk gpu settings)."""
    study = _get_study(name)
    if seeds is not None:
        study = Study(**{**study.__dict__, "seeds": tuple(int(s) for s in seeds)})
    settings = study.settings(size, size_settings)
    start = time.perf_counter()
    runs = _run_records(study, study.cells(size, size_settings), load_corpus(), settings, device)
    return {
        "study": study.name, "question": study.question, "size": size,
        "conditions": {
            "model": TinyLMConfig(**settings["model"]).__dict__,
            "steps": settings["steps"], "batch_size": settings["batch_size"],
            "tokens_per_step": settings["batch_size"] * settings["model"]["max_seq_len"],
            "lrs": list(settings["lrs"]), "seeds": list(study.seeds),
            "variants": study.variants,
            "optimizer": "AdamW β=(0.9, 0.95), weight decay 0.1 on matrices, clip 1.0, "
                         "warm-up 10 % of the steps, cosine to 0.1·lr",
            "spike_score": {"window": study.spike_window, "k": study.spike_k, "unit": "percent"},
            "corpus_sha256": CORPUS_SHA256,
            "device": str(device), "machine": sysinfo.study_machine(),
            "wall_seconds": round(time.perf_counter() - start),
            "command": f"normtools lab run {study.name} --size {size}",
        },
        "runs": runs,
    }


def _get_study(name: str) -> Study:
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
                             f"Pass --force to replace it, or --out to write elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    temporary.replace(path)
    return path


def load_study(path: str | Path) -> tuple[dict, "pandas.DataFrame"]:
    """(document, runs table): the JSON document and one row per run (its scalar fields; the
    per-layer values and curves stay in ``document["runs"]``, in the same order)."""
    return study_table(json.loads(Path(path).read_text()))


def rerun(document: dict, variant: str | None = None, lr: float | None = None,
          seed: int | None = None, data=None) -> tuple[dict, dict]:
    """Train one seed of one configuration of a committed study again (default: the study's
    ``check`` configuration); returns (the configuration chosen, the re-run's JSON record)."""
    study = _get_study(document["study"])
    chosen = {**study.check, **{k: v for k, v in (("variant", variant), ("lr", lr), ("seed", seed))
                                if v is not None}}
    cell = {**study.variants[chosen["variant"]], "lr": chosen["lr"], "seed": chosen["seed"],
            "variant": chosen["variant"]}
    settings = study.settings(document["size"])
    return chosen, _run_records(study, [cell], data or load_corpus(), settings)[0]


def compare_rerun(document: dict, chosen: dict, record: dict,
                  metrics=tuple(CHECK_TOLERANCE)) -> "pandas.DataFrame":
    """One row per metric: the committed median, min and max over the seeds of the ``chosen``
    configuration, the re-run's value, and ``within``: whether it lies in
    [min / (1 + tol), max · (1 + tol)], tol from :data:`CHECK_TOLERANCE`."""
    import pandas as pd

    _, table = study_table(document)
    same = table[(table["variant"] == chosen["variant"]) & np.isclose(table["lr"], chosen["lr"])]
    if same.empty:
        raise ValueError(f"the committed study has no runs of {chosen}")
    rows = []
    for metric in metrics:
        values = same[metric].to_numpy(dtype=float)
        tol = CHECK_TOLERANCE.get(metric, 0.05)
        lo, hi = values.min(), values.max()
        value = float(record[metric])
        rows.append({"metric": metric, "committed_median": float(np.median(values)),
                     "committed_min": lo, "committed_max": hi, "n_seeds": len(values),
                     "rerun": value, "within": bool(lo / (1 + tol) <= value <= hi * (1 + tol))})
    return pd.DataFrame(rows)


def study_table(document: dict):
    """(document, runs table) of an already loaded document (see :func:`load_study`)."""
    import pandas as pd

    table = pd.DataFrame([{k: v for k, v in run.items() if k not in ("layers", "curves")}
                          for run in document["runs"]])
    return document, table


def add_cli(subparsers):
    """Register ``normtools lab run STUDY`` and ``normtools lab list``."""
    parser = subparsers.add_parser("lab", help="the stability lab's committed studies",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="lab_command", required=True)
    run = commands.add_parser("run", help="train a study and write its JSON")
    run.add_argument("study", choices=sorted(STUDIES))
    run.add_argument("--size", default="cpu", choices=sorted(grid.STABILITY_SIZES))
    run.add_argument("--seeds", type=positive_int, default=None,
                     help="number of seeds S, trained as seeds 0 to S-1 (default: the study's)")
    run.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    run.add_argument("--force", action="store_true",
                     help="replace an existing study file even with fewer runs")
    run.add_argument("--device", default="cpu", type=device_name)
    run.add_argument("--out", default=None, help="output path (default book/data/studies/STUDY.json"
                                                 " for size cpu, STUDY-SIZE.json otherwise)")
    run.set_defaults(func=_run_cli)
    listing = commands.add_parser("list", help="the studies and what each asks")
    listing.set_defaults(func=_list_cli)
    return parser


def _run_cli(args) -> int:
    torch.set_num_threads(args.threads)
    seeds = range(args.seeds) if args.seeds is not None else None
    document = run_study(args.study, args.size, seeds, args.device)
    suffix = "" if args.size == "cpu" else f"-{args.size}"
    path = _write_study(document, args.out or _DEFAULT_DIR / f"{args.study}{suffix}.json",
                        force=args.force)
    print(f"{args.study}: {len(document['runs'])} runs in "
          f"{document['conditions']['wall_seconds']} s -> {path}")
    return 0


def _list_cli(args) -> int:
    for name, study in STUDIES.items():
        print(f"{name}: {study.question}")
    return 0


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

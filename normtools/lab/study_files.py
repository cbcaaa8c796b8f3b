"""Study files: what a committed study's (or init probe's) JSON document must hold, and the
reader that checks it (:func:`read_study`), used wherever the lab opens one
(:mod:`normtools.lab.studies`, :mod:`normtools.lab.reproduce`, ``normtools lab``)."""

from __future__ import annotations

import json
from pathlib import Path


#: What :func:`read_study` requires of a study document: the fields of the document and of its
#: sections (a dotted path), with their types, and those of each of its runs.
_STUDY_SCHEMA = {"sections": {"": {"study": str, "size": str, "thresholds": dict,
                                   "conditions": dict, "runs": list},
                              "conditions": {"model": dict, "steps": int, "seeds": list,
                                             "n_runs": int, "variants": dict, "machine": dict},
                              "conditions.machine": {"aten_cpu_capability": str,
                                                     "torch_threads": int}},
                 "run": {"variant": str, "lr": (int, float), "seed": int}}
#: The same of an init probe's document (:func:`run_init_probe`).
_PROBE_SCHEMA = {"sections": {"": {"study": str, "conditions": dict, "runs": list},
                              "conditions": {"model": dict}},
                 "run": {"variant": str, "depth": int}}


def read_study(path: str | Path, probe: bool = False) -> dict:
    """The study document (with ``probe``, the init probe document) in the JSON file at
    ``path``; ``ValueError`` naming the file unless it is JSON holding every field the lab reads,
    of its type (:data:`_STUDY_SCHEMA`, :data:`_PROBE_SCHEMA`)."""
    path = Path(path)
    kind, schema = ("an init probe", _PROBE_SCHEMA) if probe else ("a study", _STUDY_SCHEMA)
    try:
        document = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # ValueError: JSON and Unicode errors
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not {kind}: it holds a JSON {type(document).__name__}, "
                         f"not an object")
    wrong = []
    for section, fields in schema["sections"].items():  # a section missing is its parent's fault
        holder = document
        for key in filter(None, section.split(".")):
            holder = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(holder, dict):
            wrong += [f"{section}.{key} ({_type_names(kind_)})".lstrip(".")
                      for key, kind_ in fields.items() if not isinstance(holder.get(key), kind_)]
    if isinstance(document.get("runs"), list):
        wrong += [f"runs[{i}] (an object with {', '.join(schema['run'])})"
                  for i, run in enumerate(document["runs"])
                  if not (isinstance(run, dict) and all(isinstance(run.get(key), kind_)
                                                        for key, kind_ in schema["run"].items()))][:3]
    if wrong:
        raise ValueError(f"{path} is not {kind}: it lacks or mistypes {', '.join(wrong)}")
    return document


def _type_names(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__

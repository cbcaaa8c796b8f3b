"""Results I/O: writing a sweep's JSON as it runs, reading committed result files back."""

import json
from pathlib import Path

from normtools.measure.bench.shapes import shape_label


def _write_json(data, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------------- reading results

_SHAPE_KEYS = ("M", "N", "T", "Hq", "Hk", "D")


RESULTS_KEYS = {"conditions": dict, "results": list}
# The keys the report and load_results read: of the file, its conditions, every row, an ok row.
REQUIRED_KEYS = {"file": ("copy_bandwidth_gbs",),
                 "conditions": ("device", "python", "dtype", "warmup", "reps", "utc"),
                 "row": ("op", "backend", "shape", "status", "reason"),
                 "ok row": ("p50_us", "pct_of_copy_bw")}


def read_results(path) -> dict:
    """The results file ``path`` written by ``normtools bench``; ``ValueError`` for a file that
    is not JSON, lacks a key of ``RESULTS_KEYS`` or one of ``REQUIRED_KEYS`` (``OSError`` for
    one that cannot be read)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({str(e)[:200] or type(e).__name__})") from None
    if not (isinstance(data, dict) and all(isinstance(data.get(k), t) for k, t in RESULTS_KEYS.items())
            and all(isinstance(row, dict) for row in data["results"])):
        raise ValueError(f"{path}: not a normtools bench results file (a JSON object with "
                         f"conditions and a list of results)")
    parts = [("file", "the file", data), ("conditions", "conditions", data["conditions"])]
    for i, row in enumerate(data["results"]):
        parts.append(("row", f"results[{i}]", row))
        if row.get("status") == "ok":
            parts.append(("ok row", f"results[{i}] (status ok)", row))
    for kind, where, part in parts:
        missing = [key for key in REQUIRED_KEYS[kind] if key not in part]
        if missing:
            raise ValueError(f"{path}: not a normtools bench results file ({where} lacks "
                             f"{', '.join(missing)})")
    return data


def load_results(path):
    """Load one results JSON file, or every ``*.json`` in a directory, for the book.

    Returns (frame, conditions): a pandas DataFrame with one row per result (columns of the
    JSON rows, ``shape`` as a label "M=4096 N=2048", the shape's numbers as columns M, N, T, Hq,
    Hk, D, and ``source``, the file's name) and {source: conditions, with
    ``copy_bandwidth_gbs`` added}. A missing or empty directory gives an empty frame and {}.
    """
    import pandas as pd

    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else ([path] if path.exists() else [])
    rows, conditions = [], {}
    for file in files:
        data = read_results(file)
        conditions[file.name] = {**data["conditions"],
                                 "copy_bandwidth_gbs": data["copy_bandwidth_gbs"]}
        for row in data["results"]:
            numbers = {k: row["shape"].get(k) for k in _SHAPE_KEYS}
            rows.append({**row, **numbers, "shape": shape_label(row["shape"]),
                         "source": file.name})
    columns = ["source", "op", "backend", "dtype", "shape", *_SHAPE_KEYS, "status", "reason",
               "p50_us", "p95_us", "p99_us", "mean_us", "gbs_p50", "pct_of_copy_bw", "bytes"]
    frame = pd.DataFrame(rows)
    if frame.empty:
        frame = pd.DataFrame(columns=columns)
    return frame, conditions

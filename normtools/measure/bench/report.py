"""The report: the performance targets checked against a sweep, and its Markdown summary."""

from pathlib import Path

from normtools.measure.bench.shapes import BACKENDS, shape_label
from normtools.measure.bench.results import read_results

# (op, minimum N or None, minimum % of copy bandwidth) for normtools-triton: the targets.
BANDWIDTH_TARGETS = (("rms_norm", 2048, 90.0), ("rms_norm_fwd_bwd", 2048, 80.0),
                     ("qk_norm_per_head", None, 80.0))
SPEEDUP_BASELINES = ("torch-compile", "liger")


def _case_label(row):
    """The shape, plus the regime and cache state of a real-shape row: "M=64 N=4096, decode,
    warm" (a decode shape is timed twice, with warm and with rotated inputs)."""
    label = shape_label(row["shape"])
    if row.get("regime"):
        label += f", {row['regime']}, {row.get('cache') or 'rotated'}"
    return label


def targets_report(data):
    """The issue's performance targets checked on a results dict (``run_sweep``'s output) or
    on the path of a results JSON file.

    * % of copy bandwidth of normtools-triton (``BANDWIDTH_TARGETS``): rms_norm ≥ 90 % for
      N ≥ 2048, rms_norm_fwd_bwd ≥ 80 % for N ≥ 2048, qk_norm_per_head ≥ 80 %;
      on the synthetic cases (a real shape's decode step is launch-bound by nature);
    * speedup = p50(baseline) / p50(normtools-triton) ≥ 1.0 against torch-compile and liger, on
      every op and shape where both ran, real shapes included (``_case_label``).

    Returns a list of rows {target, op, shape, measured, threshold, passed}; ``passed`` is None
    when the needed measurement is missing (backend skipped or failed), with the reason in
    ``note``. Meant for a CUDA results file; on CPU the numbers are not the issue's targets.
    """
    if isinstance(data, (str, Path)):
        data = read_results(data)
    ok = {}
    for row in data["results"]:
        ok[(row["op"], _case_label(row), row["backend"])] = row
    report = []
    cases = {(row["op"], _case_label(row)): row for row in data["results"]}
    for (op, label), case in cases.items():
        shape, synthetic = case["shape"], case.get("phase") != "real shapes"
        ours = ok.get((op, label, "normtools-triton"))
        ours_ok = ours is not None and ours["status"] == "ok"
        note = "" if ours_ok else ("normtools-triton: " + (ours["reason"] if ours else "not run"))
        for target_op, min_n, threshold in BANDWIDTH_TARGETS:
            if synthetic and op == target_op and (min_n is None or shape.get("N", 0) >= min_n):
                report.append({"target": f"% of copy bandwidth ≥ {threshold:g}", "op": op,
                               "shape": label, "threshold": threshold,
                               "measured": ours["pct_of_copy_bw"] if ours_ok else None,
                               "passed": (ours["pct_of_copy_bw"] >= threshold) if ours_ok else None,
                               "note": note})
        for baseline in SPEEDUP_BASELINES:
            other = ok.get((op, label, baseline))
            if other is None:
                continue
            if other["status"] != "ok" or not ours_ok:
                missing = note or f"{baseline}: {other['reason']}"
                report.append({"target": f"speedup vs {baseline} ≥ 1.0", "op": op, "shape": label,
                               "threshold": 1.0, "measured": None, "passed": None,
                               "note": missing})
                continue
            speedup = other["p50_us"] / ours["p50_us"]
            report.append({"target": f"speedup vs {baseline} ≥ 1.0", "op": op, "shape": label,
                           "threshold": 1.0, "measured": speedup, "passed": speedup >= 1.0,
                           "note": ""})
    return report


def _fmt(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_summary(data):
    """A short Markdown report of a results dict: conditions, a p50 table, the targets."""
    c = data["conditions"]
    gpu = c.get("gpu") or {}
    versions = c.get("versions", {})
    lines = [
        "# normtools bench",
        "",
        f"- device: {gpu.get('name') or c.get('cpu_model')} ({c['device']}); driver "
        f"{c.get('nvidia_driver') or '–'}; CUDA {c.get('cuda_runtime') or '–'}",
        f"- torch {versions.get('torch')}, triton {versions.get('triton')}, "
        f"liger-kernel {versions.get('liger-kernel') or 'not installed'}; python {c['python']}",
        f"- dtype {c['dtype']}, warm-up {c['warmup']} samples, {c['reps']} samples; "
        f"{c['utc']}",
        f"- copy bandwidth: {data['copy_bandwidth_gbs']:.1f} GB/s",
        "",
    ]
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in data["results"])]
    lines += ["p50 µs per call (% of the copy bandwidth):", "",
              "| op | shape | " + " | ".join(backends) + " |",
              "|---|---|" + "---|" * len(backends)]
    cases = {}
    for row in data["results"]:
        cases.setdefault((row["op"], _case_label(row)), {})[row["backend"]] = row
    for (op, label), by_backend in cases.items():
        cells = []
        for b in backends:
            row = by_backend.get(b)
            if row is None:
                cells.append("–")
            elif row["status"] == "ok":
                cells.append(f"{row['p50_us']:.1f} ({row['pct_of_copy_bw']:.0f}%)")
            else:
                cells.append(row["status"])
        lines.append(f"| {op} | {label} | " + " | ".join(cells) + " |")
    if c["device"] != "cuda":
        lines += ["", "Targets: defined for a CUDA run (H200, bfloat16); not evaluated on a CPU "
                      "run."]
        return "\n".join(lines) + "\n"
    report = targets_report(data)
    failed = [r for r in report if r["passed"] is False]
    missing = [r for r in report if r["passed"] is None]
    lines += ["", f"## Targets: {sum(r['passed'] is True for r in report)} passed, "
                  f"{len(failed)} missed, {len(missing)} without data", ""]
    if failed or missing:
        lines += ["| target | op | shape | measured | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['op']} | {r['shape']} | {_fmt(r['measured'], 2)} | "
                  f"{r['note']} |" for r in failed + missing]
    return "\n".join(lines) + "\n"

"""Execute the book's chapters headless and keep stored notebooks free of volatile metadata.

Used by the Makefile (``python -m normtools.book.build execute|strip ...``):

* ``execute SRC DST``: run one chapter with papermill (its default parameters, one kernel, a
  per-cell timeout) and write the executed copy, stripped, to DST. A cell that raises makes the
  command exit non-zero.
* ``strip NB...``: remove timestamps, durations and execution counts' volatile metadata in place.
* ``lock FILE``: write the locked environment (``make lock``), see :func:`lock_text`.
"""

import argparse
import fcntl
import importlib.metadata
import json
import os
import platform
import sysconfig
import re
import resource
import sys
import time
from pathlib import Path

# Keys whose values change at every execution (timestamps, durations, papermill's status).
_VOLATILE_NOTEBOOK_KEYS = ("papermill",)
_VOLATILE_CELL_KEYS = ("papermill", "execution", "ExecuteTime")


def _merge_streams(outputs: list) -> list:
    """Join consecutive stream outputs of the same name (stdout, stderr) into one output.

    Kernels split one print into several stream messages at arbitrary points, which makes
    needless diffs; nbval coalesces streams the same way before comparing.
    """
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (output.get("output_type") == "stream" and previous is not None
                and previous.get("output_type") == "stream" and previous.get("name") == output.get("name")):
            text = "".join(previous["text"]) + "".join(output["text"])
            previous["text"] = text.splitlines(keepends=True)
        else:
            merged.append(output)
    return merged


def strip_volatile_metadata(notebook: dict) -> dict:
    """Return ``notebook`` without execution timestamps, durations or papermill status, with
    consecutive stream outputs merged.

    Cell outputs are kept: they are what nbval checks and what the book shows.
    """
    for key in _VOLATILE_NOTEBOOK_KEYS:
        notebook.get("metadata", {}).pop(key, None)
    for cell in notebook.get("cells", []):
        for key in _VOLATILE_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"] = _merge_streams(cell.get("outputs", []))
            for output in cell["outputs"]:
                output.get("metadata", {}).pop("execution", None)
    return notebook


def strip_file(path: Path) -> bool:
    """Strip one notebook file in place; return whether it changed."""
    text = path.read_text()
    stripped = json.dumps(strip_volatile_metadata(json.loads(text)), indent=1, ensure_ascii=False) + "\n"
    if stripped != text:
        path.write_text(stripped)
        return True
    return False


#: Each chapter's time budget with its default parameters on 2 CPU cores (issue 14.5).
CHAPTER_BUDGET_S = 120.0


def execute(source: Path, destination: Path, *, kernel: str = "python3", cell_timeout: int = 600,
            cwd: Path | None = None, times: Path | None = None,
            parameters: dict | None = None, side_by_side: int = 1) -> dict:
    """Run ``source`` with papermill (default parameters, or ``parameters`` injected after its
    ``parameters`` cell) and write it, stripped, to ``destination``.

    Prints and returns the run's timing: wall seconds, the kernel's CPU seconds, the 1-minute
    load average when it ended (a load above the core count means other work shared the machine,
    so the wall time says little about the chapter) and ``side_by_side``, how many chapters the
    caller executes at once (``make book`` runs two). With ``times``, the record is also stored
    in that JSON file under the chapter's path (under a lock: chapters executed side by side
    write the same file), for the time-budget test.
    """
    import papermill

    destination.parent.mkdir(parents=True, exist_ok=True)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    papermill.execute_notebook(
        str(source), str(destination), parameters=parameters or {}, kernel_name=kernel,
        execution_timeout=cell_timeout,
        cwd=str(cwd or source.parent), progress_bar=False, log_output=False,
    )
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    strip_file(destination)
    record = {
        "wall_s": round(wall, 1),
        "kernel_cpu_s": round(children.ru_utime + children.ru_stime
                              - children_before.ru_utime - children_before.ru_stime, 1),
        "load_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "side_by_side": side_by_side,
    }
    print(f"{source}: executed in {wall:.0f} s (kernel CPU {record['kernel_cpu_s']:.0f} s, "
          f"load {record['load_1min']:.1f} on {record['cpus']} cores)")
    if times is not None:
        times.parent.mkdir(parents=True, exist_ok=True)
        with open(times.with_name(times.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = json.loads(times.read_text()) if times.exists() else {}
            table[source.as_posix()] = record
            times.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return record


def over_budget(times: dict, budget_s: float = CHAPTER_BUDGET_S) -> tuple[dict, dict]:
    """Split the timing records of :func:`execute` into chapters over ``budget_s`` and chapters
    not judged.

    A chapter executed alone is judged by its wall seconds, unless the 1-minute load exceeded
    the core count by more than one (other work on the machine; a chapter's own threads account
    for up to its thread count): then it is not judged. A chapter executed side by side with
    others (``side_by_side`` > 1) shares the cores by design, so its kernel's CPU seconds are
    judged instead: on an idle machine the chapter takes at least that long on one thread (the
    chapters' CPU seconds run at 0.9-1.0 of their wall seconds alone).

    Returns ``(over, not_judged)``, each mapping a chapter to the seconds judged (or not).
    """
    over, not_judged = {}, {}
    for chapter, record in times.items():
        if record.get("side_by_side", 1) > 1:
            if record["kernel_cpu_s"] > budget_s:
                over[chapter] = record["kernel_cpu_s"]
        elif record["load_1min"] > record["cpus"] + 1:
            not_judged[chapter] = record["wall_s"]
        elif record["wall_s"] > budget_s:
            over[chapter] = record["wall_s"]
    return over, not_judged


# The project itself is installed from the working tree, never from the lock.
_UNLOCKED_DISTRIBUTIONS = ("normtools",)


def _canonical(name: str) -> str:
    """PEP 503 normalized distribution name (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_text() -> str:
    """The lock: ``name==version`` for every distribution of the running environment, sorted.

    ``pip install -c`` reads it as constraints, so it pins whatever is installed without adding
    anything. Local version labels are dropped (``torch==2.13.0+cpu`` is written ``torch==2.13.0``):
    that one line then selects the CPU build where the Makefile installs it first (no CUDA) and the
    CUDA build elsewhere. The header records the Python and platform the lock was made on.
    """
    versions = {}
    # Only what is installed in the environment's site-packages: once setuptools is imported it
    # appends its own vendored packages (autocommand, jaraco.*, ...) to sys.path, which pip freeze
    # does not list.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in importlib.metadata.distributions(path=site):
        name = dist.metadata["Name"]
        if name and _canonical(name) not in _UNLOCKED_DISTRIBUTIONS:
            versions.setdefault(_canonical(name), f"{name}=={dist.version.split('+')[0]}")
    header = [
        "# normbook's locked environment: the exact version of every package in the virtual environment",
        "# the stored outputs were made with. Regenerate with `make lock`; `make setup` installs with",
        "# `pip install -c` this file. Versions carry no local label (+cpu, +cu128): the same line fits the",
        "# CPU and the CUDA build of torch. pyproject.toml keeps ranges for library users.",
        f"# python: {platform.python_version_tuple()[0]}.{platform.python_version_tuple()[1]}",
        f"# platform: {platform.system().lower()} {platform.machine()}",
    ]
    return "\n".join(header + [versions[key] for key in sorted(versions)]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normtools.book.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("execute", help="execute one chapter with papermill")
    run.add_argument("source", type=Path)
    run.add_argument("destination", type=Path)
    run.add_argument("--kernel", default="python3")
    run.add_argument("--cell-timeout", type=int, default=600)
    run.add_argument("--times", type=Path, help="JSON file that collects each chapter's timing")
    run.add_argument("--side-by-side", type=int, default=1,
                     help="how many chapters are executed at once (recorded with the timing)")
    strip = sub.add_parser("strip", help="strip volatile metadata in place")
    strip.add_argument("notebooks", nargs="+", type=Path)
    lock = sub.add_parser("lock", help="write the locked environment (name==version per package)")
    lock.add_argument("output", type=Path)
    args = parser.parse_args(argv)
    if args.command == "execute":
        execute(args.source, args.destination, kernel=args.kernel, cell_timeout=args.cell_timeout,
                times=args.times, side_by_side=args.side_by_side)
    elif args.command == "lock":
        args.output.write_text(lock_text())
        print(f"wrote {args.output}")
    else:
        for path in args.notebooks:
            if strip_file(path):
                print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

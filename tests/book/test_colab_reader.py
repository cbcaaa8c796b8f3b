"""A new Colab reader, end to end (issue 29): a fresh virtual environment holding what a Colab
runtime has before the first cell (torch, at the lock's version, from its own installer; ipykernel)
and then only what the Colab edition's setup cell installs (`pip install CLONE[hf,book]`, not
editable, nothing from the `test` extra); `google.colab` importable, so the setup cell takes its
Colab branch; then every chapter of `colab/book/` executed with papermill: the first, which
installs, alone, then the others two at a time. A chapter that fails fails the test.

The clone the setup cell makes comes from this repository's committed HEAD (git's `insteadOf`),
and pip reaches only the package index, as on Colab. It takes about 6-8 minutes on 2 cores, so it
is CI's own step (`make colab-reader`, NORMBOOK_COLAB_READER=1) rather than part of `make test`.
Executed chapters and the times go to `_build/colab_reader/`.
"""

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EDITION = sorted((ROOT / "colab" / "book").glob("*.ipynb"))
LOCK = ROOT / "constraints.txt"
REPORT = ROOT / "_build" / "colab_reader"
COLAB_STUB = 'import sys, types; sys.modules.setdefault("google.colab", types.ModuleType("google.colab"))\n'

pytestmark = pytest.mark.skipif(not os.environ.get("NORMBOOK_COLAB_READER"),
                                reason="CI's own step: make colab-reader (NORMBOOK_COLAB_READER=1)")


def _project(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock_versions():
    pins = (line.split("==") for line in LOCK.read_text().splitlines() if line[:1].isalnum())
    return {_project(name): version.strip() for name, version in pins}


def _venv_packages(python):
    """name -> version of every distribution in the venv."""
    code = ("import json; from importlib import metadata; "
            "print(json.dumps({d.metadata['Name']: d.version for d in metadata.distributions()}))")
    out = subprocess.run([str(python), "-c", code], cwd=python.parent, capture_output=True, text=True,
                         check=True).stdout                   # not this checkout's normtools.egg-info
    return {_project(name): value for name, value in json.loads(out).items()}


def _colab_runtime(tmp_path):
    """A venv with what Colab has before the setup cell: torch (Colab's own; here the lock's
    build, as `make setup` installs it) and a Jupyter kernel, `google.colab` importable."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    torch_pin = next(line for line in LOCK.read_text().splitlines() if line.startswith("torch=="))
    index = ["--extra-index-url", os.environ["TORCH_INDEX"]] if os.environ.get("TORCH_INDEX") else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(LOCK), *index, torch_pin, "ipykernel"],
                   check=True, timeout=600)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "google_colab_stub.pth").write_text(COLAB_STUB)
    return python


def _execute_chapter(chapter, cwd):
    """Run one Colab chapter with papermill (its own process, the reader's kernel) into REPORT:
    (wall seconds, None or the error it stopped with)."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "papermill", str(chapter), str(REPORT / chapter.name),
                          "-k", "colab-reader", "--cwd", str(cwd), "--execution-timeout", "900",
                          "--no-progress-bar"], capture_output=True, text=True)
    failure = None
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        failure = "\n".join(lines[-12:]) or f"papermill exited with {run.returncode}"
    return round(time.perf_counter() - start, 1), failure


def test_a_new_colab_reader_runs_every_chapter(tmp_path, monkeypatch):
    assert [p.stem for p in EDITION][:1] == ["01_definition"] and len(EDITION) >= 9
    repository = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    started = time.perf_counter()
    python = _colab_runtime(tmp_path)
    before = _venv_packages(python)
    assert "normtools" not in before and "transformers" not in before
    runtime_seconds = time.perf_counter() - started

    clone = tmp_path / "content" / "normbook"
    clone.parent.mkdir()
    kernels = tmp_path / "jupyter" / "kernels" / "colab-reader"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "language": "python", "display_name": "Colab reader",
        "env": {"NORMBOOK_CLONE": str(clone), "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": f"url.file://{ROOT}.insteadOf", "GIT_CONFIG_VALUE_0": repository}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    REPORT.mkdir(parents=True, exist_ok=True)

    # The first chapter clones and installs; the others, which find both done, run two at a time
    # (each in its own papermill process and kernel), as a reader with two notebooks open would.
    first, rest = EDITION[0], EDITION[1:]
    results = {first: _execute_chapter(first, clone.parent)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results.update(zip(rest, pool.map(partial(_execute_chapter, cwd=clone.parent), rest)))
    seconds = {chapter.stem: result[0] for chapter, result in results.items()}
    failures = {chapter.name: result[1] for chapter, result in results.items() if result[1]}
    cells = json.loads((REPORT / EDITION[0].name).read_text())["cells"]
    setup_output = "".join("".join(o.get("text", [])) for o in next(c for c in cells if c["cell_type"] == "code")["outputs"])
    versions = next((line for line in setup_output.splitlines() if line.startswith("Python ")), None)
    report = {"runtime_seconds": round(runtime_seconds, 1), "chapter_seconds": seconds,
              "total_seconds": round(time.perf_counter() - started, 1), "versions": versions, "failures": failures}
    (REPORT / "times.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    assert not failures, "chapters that fail for a new Colab reader:\n" + "\n".join(
        f"{name}: {why}" for name, why in failures.items())
    # the setup cell printed the versions the chapter ran with: normtools from the clone, this torch
    after = _venv_packages(python)
    assert versions and f"normtools {after['normtools']}" in versions and f"torch {before['torch']}" in versions
    where = subprocess.run([str(python), "-c", "import normtools; print(normtools.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(python.parent.parent)) and "site-packages" in where, where   # not editable
    assert (clone / ".git").is_dir()
    # nothing Colab had was replaced (torch above all); everything the setup cell brought is at the
    # lock's version
    assert {name: after.get(name) for name in before} == before
    lock = _lock_versions()
    off_lock = {name: (version, lock.get(name)) for name, version in after.items()
                if name not in before and name != "normtools" and lock.get(name) != version}
    assert not off_lock, f"installed at other versions than the lock's (installed, lock): {off_lock}"
    for extra_only in ("hypothesis", "playwright", "pytest-xdist"):              # the test extra
        assert extra_only not in after, f"{extra_only} (test extra) is in the reader's venv"

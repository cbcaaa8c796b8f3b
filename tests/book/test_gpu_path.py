"""The chapters' GPU path, checked on a CPU.

* The compute dtype on a GPU without bfloat16 arithmetic (a faked T4) and with it (a faked H100):
  core.precision, training's precision="auto", the benchmarks' defaults.
* The chapters' sizes (normtools.book.sizes): the cpu ones never shrunk, the gpu ones divided by
  gpu_shrink within their floors, models still buildable.
* Every chapter with a gpu_shrink parameter executed at size="gpu", gpu_shrink=64 on the CPU
  (two at a time in two processes, into a temporary folder): it runs to the end. About 125 s for
  the eight chapters alone on 2 cores (chapter 4a's live studies 90 s of it), about 230 s beside
  the other worker of `make test`; a chapter with a size but no gpu_shrink parameter fails.
"""

import contextlib
import copy
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path

import pytest
import torch

from normtools.book import sizes
from normtools.core import precision
from normtools.lab import designs, grid, train


class FakeGPU:
    """torch.cuda's answers for one GPU, as torch 2.13 gives them: ``is_bf16_supported`` counts
    emulation unless ``including_emulation=False`` (a T4 can create bfloat16 tensors)."""

    def __init__(self, name, capability):
        self.name, self.capability = name, capability

    def install(self, monkeypatch):
        native = self.capability >= (8, 0)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True: native or including_emulation)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: self.capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(precision, "_REPORTED", set())


T4, H100 = FakeGPU("Tesla T4", (7, 5)), FakeGPU("NVIDIA H100 80GB HBM3", (9, 0))


def test_cpu_computes_in_bfloat16(capsys):
    assert precision.compute_dtype("cpu") == torch.bfloat16
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("fallback", [torch.float16, torch.float32])
def test_gpu_without_bfloat16_falls_back_with_one_line(monkeypatch, capsys, fallback):
    T4.install(monkeypatch)
    assert not precision.has_bf16_arithmetic("cuda:0")
    assert precision.compute_dtype("cuda:0", fallback) == fallback
    assert precision.compute_dtype("cuda:0", fallback) == fallback   # printed once only
    lines = capsys.readouterr().out.splitlines()
    name = str(fallback).removeprefix("torch.")
    assert lines == [f"Tesla T4 (sm_75): no bfloat16 arithmetic, using {name} "
                     f"({precision.FALLBACK_REASONS[fallback]})"]
    assert len(lines[0]) <= 100


def test_gpu_with_bfloat16_keeps_it_silently(monkeypatch, capsys):
    H100.install(monkeypatch)
    assert precision.compute_dtype("cuda", torch.float32) == torch.bfloat16
    assert capsys.readouterr().out == ""


def test_fallback_must_be_a_float_of_the_book():
    with pytest.raises(ValueError, match="torch.float16 or torch.float32"):
        precision.compute_dtype("cpu", torch.float64)


@pytest.mark.parametrize("gpu, expected", [(T4, "fp32"), (H100, "bf16")])
def test_training_autocast_follows_the_compute_dtype(monkeypatch, capsys, gpu, expected):
    gpu.install(monkeypatch)
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: (device_type, dtype))
    chosen, _ = train.autocast_for("auto", torch.device("cuda"))
    assert chosen == expected
    assert ("no bfloat16 arithmetic, using float32" in capsys.readouterr().out) == (gpu is T4)


# ------------------------------------------------------------------------- the chapters' sizes

SHRINKS = (2, 3, 16, 64, 10_000)


def _leaves(settings, floors, path=()):
    """(path, gpu value, floor) of every shrinkable size."""
    for key, floor in floors.items():
        if isinstance(floor, dict):
            yield from _leaves(settings[key], floor, path + (key,))
        else:
            yield path + (key,), settings[key], floor


def _get(settings, path):
    for key in path:
        settings = settings[key]
    return settings


@pytest.mark.parametrize("chapter", sorted(sizes.CHAPTER_SIZES))
def test_cpu_sizes_are_never_shrunk_and_shrink_1_keeps_the_gpu_ones(chapter):
    assert sizes.chapter_settings(chapter, "cpu", 64) == sizes.CHAPTER_SIZES[chapter]["cpu"]
    assert sizes.chapter_settings(chapter, "gpu", 1) == sizes.CHAPTER_SIZES[chapter]["gpu"]
    with pytest.raises(ValueError, match="positive integer"):
        sizes.chapter_settings(chapter, "gpu", 0)


def _tables():
    yield from ((c, sizes.CHAPTER_SIZES[c]["gpu"], sizes.SHRINK_FLOORS[c])
                for c in sizes.CHAPTER_SIZES)
    yield "stability", grid.STABILITY_SIZES["gpu"], sizes.SHRINK_FLOORS["stability"]
    yield "related", designs.RELATED_SIZES["gpu"], sizes.SHRINK_FLOORS["related"]


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("kind, gpu, floors", list(_tables()), ids=lambda v: str(v)[:12])
def test_shrunk_sizes_divide_by_the_shrink_within_their_floors(kind, gpu, floors, shrink):
    shrunk = sizes.shrink(gpu, floors, shrink)
    for path, value, floor in _leaves(gpu, floors):
        new = _get(shrunk, path)
        assert floor <= new <= value and new % floor == 0, (path, new)
        if value // shrink >= floor:       # not at the floor: within one floor of value / k
            assert value / shrink - floor - 1 < new <= value / shrink, (path, new)
        else:
            assert new == floor, (path, new)
    unshrunk = {path for path, _, _ in _leaves(gpu, floors)}
    assert all(_get(shrunk, p) == _get(gpu, p) for p in _all_paths(gpu) if p not in unshrunk)


def _all_paths(settings, path=()):
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _all_paths(value, path + (key,))
        else:
            yield path + (key,)


@pytest.mark.parametrize("shrink", SHRINKS)
def test_shrunk_models_stay_buildable(shrink):
    """Widths that their head counts divide, even head dims (RoPE), nothing below 1."""
    flow = sizes.chapter_settings("02", "gpu", shrink)
    assert flow["width"] % flow["heads"] == 0 and (flow["width"] // flow["heads"]) % 2 == 0
    assert (flow["hf_hidden"] // 4) % 2 == 0   # the chapter's HF models: head_dim hidden / 4
    stability = sizes.settings_at(grid.STABILITY_SIZES, "stability", "gpu", shrink)
    for model in (stability["model"], {**stability["xiong"]["model"]}):
        assert model["width"] % model["heads"] == 0
        assert (model["width"] // model["heads"]) % 2 == 0
    rel = sizes.settings_at(designs.RELATED_SIZES, "related", "gpu", shrink)
    for model in (rel["model"], rel["probe_model"]):
        assert model["width"] % model["heads"] == 0
    examples = sizes.chapter_settings("05", "gpu", shrink)
    assert min(v for v in examples["model"].values()) >= 2
    assert examples["batch"] >= 1 and examples["seq_len"] >= 8


def test_settings_at_returns_a_copy_and_leaves_the_table_as_it_is():
    table = {"cpu": {"steps": 100, "batch_size": 8}, "gpu": {"steps": 1000, "batch_size": 32}}
    before = copy.deepcopy(table)
    assert sizes.settings_at(table, "06", "cpu", 64) == table["cpu"]
    assert sizes.settings_at(table, "06", "gpu", 1) == table["gpu"]
    shrunk = sizes.settings_at(grid.STABILITY_SIZES, "stability", "gpu", 64)
    assert shrunk["steps"] == 10   # 1000 / 64 is under the floor of 10 steps
    shrunk["model"]["width"] = -1
    assert table == before and set(grid.STABILITY_SIZES) == {"test", "cpu", "gpu"}
    assert grid.STABILITY_SIZES["gpu"]["model"]["width"] == 512
    with pytest.raises(ValueError, match="'cpu' or 'gpu'"):
        sizes.settings_at(table, "06", "test")
    with pytest.raises(KeyError, match="do not have"):
        sizes.shrink(table["gpu"], {"width": 8}, 2)


# ------------------------------------------------------------- every chapter's size="gpu" path

BOOK = Path(__file__).resolve().parents[2] / "book"
GPU_SHRINK = 64
#: Parameters besides size="gpu", gpu_shrink and threads=1: chapter 4a trains its studies live
#: at the gpu size, over one seed here.
EXTRA_PARAMETERS = {"04a_profiling_stability": {"n_seeds": 1}}


def _parameters_source(path):
    cells = json.loads(path.read_text())["cells"]
    return next("".join(c["source"]) for c in cells
                if "parameters" in c.get("metadata", {}).get("tags", []))


#: Every chapter with a size parameter, the longest first (they run two at a time).
CHAPTERS = sorted((p.stem for p in BOOK.glob("[0-9]*.ipynb")
                   if "size = " in _parameters_source(p)),
                  key=lambda s: (not s.startswith(("04a", "04b", "07", "02")), s))


def _execute_at_gpu_size(chapter, out):
    """One chapter executed at size="gpu" into the folder ``out``: (chapter, (the executed
    notebook's path or the error's text, seconds)). Runs in a process of its own: papermill
    changes the working directory for a run, and threads would share it (two chapters at once
    left this process in book/)."""
    from normtools.book import build

    start = time.perf_counter()
    destination = Path(out) / f"{chapter}.ipynb"
    try:
        build.execute(BOOK / f"{chapter}.ipynb", destination, cell_timeout=300,
                      parameters={"size": "gpu", "gpu_shrink": GPU_SHRINK, "threads": 1,
                                  **EXTRA_PARAMETERS.get(chapter, {})})
        result = destination
    except Exception as exc:   # reported by the chapter's test
        result = f"{type(exc).__name__}: {exc}"
    return chapter, (result, time.perf_counter() - start)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    """Each chapter with a size parameter executed with size="gpu", gpu_shrink=64 and
    one thread, two chapters at a time in two processes, into a temporary folder (never into
    book/): {chapter: (executed notebook path or the error's text, seconds)}. This process's
    working directory is the same afterwards."""
    out = tmp_path_factory.mktemp("gpu_path")
    cwd = os.getcwd()
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = dict(pool.map(_execute_at_gpu_size, CHAPTERS, repeat(out)))
    print(f"\nsize='gpu' path of {len(runs)} chapters in {time.perf_counter() - start:.0f} s "
          f"(load {os.getloadavg()[0]:.1f}): "
          + ", ".join(f"{c} {s:.0f} s" for c, (_, s) in runs.items()))
    assert os.getcwd() == cwd
    return runs


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs_to_the_end_at_the_shrunk_gpu_size(gpu_runs, chapter):
    assert "gpu_shrink" in _parameters_source(BOOK / f"{chapter}.ipynb"), (
        f"{chapter} has a size but no gpu_shrink parameter (see normtools.book.sizes)")
    result, _ = gpu_runs[chapter]
    if isinstance(result, str):
        pytest.fail(f"{chapter} at size='gpu', gpu_shrink={GPU_SHRINK}: {result}")
    cells = [c for c in json.loads(result.read_text())["cells"] if c["cell_type"] == "code"]
    injected = [c for c in cells if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1 and "gpu_shrink = 64" in "".join(injected[0]["source"])
    assert all(c["execution_count"] is not None for c in cells), "a cell did not run"
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors


@pytest.mark.parametrize("gpu, expected", [(T4, torch.float16), (H100, torch.bfloat16)])
def test_benchmarks_default_to_the_compute_dtype(monkeypatch, capsys, gpu, expected):
    """``normtools bench`` and the model benchmark on CUDA without --dtype: bfloat16, or on a T4
    float16 with the fallback line (the measurements themselves are stubbed out)."""
    from normtools.measure import model_bench
    from normtools.measure.bench import cli

    gpu.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}

    def fake_sweep(device, dtype, **kwargs):
        seen["bench"] = dtype
        return {}

    monkeypatch.setattr(cli, "run_sweep", fake_sweep)
    monkeypatch.setattr(cli, "markdown_summary", lambda data: "")
    assert cli.main(["--device", "cuda", "--ops", "rms_norm"]) == 0
    assert seen["bench"] == str(expected).removeprefix("torch.")

    def fake_steps(config, *, dtype, **kwargs):
        seen["model"] = dtype
        return {"rows": [], "conditions": {}}

    monkeypatch.setattr(model_bench, "model_step_times", fake_steps)
    monkeypatch.setattr(model_bench, "speedups", lambda result: {})
    assert model_bench.main(["--device", "cuda", "--size", "tiny"]) == 0
    assert seen["model"] == expected
    assert ("no bfloat16 arithmetic, using float16" in capsys.readouterr().out) == (gpu is T4)

"""Committed studies (normtools.lab.studies): each committed JSON holds every run its study
defines, under the corpus the lab uses now, with its thresholds and provenance, and one
committed seed of one configuration of each, trained again here on the study's numeric path
(torch backend), reproduces its losses up to float tolerance. A file committed before issue 28's
definitions (3 seeds, 4-batch evaluation, no provenance) is reported as an expected failure
naming the command that replaces it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from normtools import cli
from normtools.lab import probes, reproduce, studies
from normtools.lab.data import CORPUS_SHA256, load_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STUDY_DIR = Path(__file__).resolve().parents[2] / "book" / "data" / "studies"


def committed(name):
    path = STUDY_DIR / f"{name}.json"
    if not path.exists():
        pytest.xfail(f"{name}: not committed yet (run `normtools lab run {name}`, resumable)")
    document = json.loads(path.read_text())
    if "provenance" not in document:
        pytest.xfail(f"{name}.json predates issue 28 (no provenance, 4-batch evaluation): "
                     f"rerun `normtools lab run {name}`")
    return document


@pytest.mark.parametrize("name", sorted(studies.STUDIES))
def test_committed_study_is_complete(name):
    document = committed(name)
    study = studies.STUDIES[name]
    conditions = document["conditions"]
    assert document["study"] == name and document["size"] == "cpu" and document["complete"]
    assert document["thresholds"] == study.all_thresholds()
    assert len(document["provenance"]["commit"]) == 40
    assert conditions["corpus_sha256"] == CORPUS_SHA256
    assert conditions["model"]["backend"] == studies.STUDY_BACKEND
    expected = {(c["variant"], c["lr"], c["seed"]) for c in study.cells("cpu")}
    got = {(r["variant"], r["lr"], r["seed"]) for r in document["runs"]}
    assert got == expected and len(document["runs"]) == len(expected)
    assert len(conditions["seeds"]) >= 10
    for run in document["runs"]:
        assert len(run["curves"]["loss"]) == conditions["steps"] or run["diverged"]


@pytest.mark.parametrize("name", sorted(studies.STUDIES))
def test_committed_study_rerun_reproduces_its_losses(name):
    """On the committed machine's numeric path (ATen's CPU capability, oneDNN's ISA, threads):
    on another path a chaotic run drifts past float tolerance, so there is nothing to check."""
    document = committed(name)
    chosen, record, capability = reproduce.rerun_on_committed_path(STUDY_DIR / f"{name}.json")
    committed_on = document["conditions"]["machine"]["aten_cpu_capability"]
    if capability != committed_on:
        pytest.skip(f"this CPU cannot run {name}'s committed path (ATen {committed_on}; got {capability})")
    check = reproduce.compare_rerun(document, chosen, record)
    assert check["reproduced"].all(), check.to_string()


def test_the_study_wall_time_trained_the_committed_study():
    """book/data/kernels/study_wall.json (chapter 4b: a whole study before and after issue 35)
    holds every run of the committed study it names in each version, and the version on the
    committed path (RMSNorm backward "autograd", the committed machine's numeric path) ends
    every run at the committed final loss: the timed studies trained what was committed."""
    wall = json.loads((STUDY_DIR.parent / "kernels" / "study_wall.json").read_text())
    document = committed(wall["conditions"]["study"])
    rows = {row["version"]: row for row in wall["rows"]}
    assert set(rows) == {"before", "after", "after, autograd"}
    n_runs = len(document["runs"])
    for row in rows.values():
        assert row["runs"] == len(row["run_seconds"]) == len(row["final_losses"]) == n_runs
        assert row["train_seconds"] == pytest.approx(sum(row["run_seconds"]), abs=0.5)
    committed_losses = [run["final_loss"] for run in document["runs"]]
    np.testing.assert_array_equal(rows["after, autograd"]["final_losses"], committed_losses)
    assert rows["after, autograd"]["final_losses_equal_to_committed"] == n_runs


def test_numeric_path_environment_names_atens_and_onednns_paths():
    """ATen's capability as its variable spells it; oneDNN capped to the same ISA where one
    matches; normtools' RMSNorm backward as recorded, "autograd" for a study recorded before
    (the rerun test above is what shows the pinning reproduces a committed seed)."""
    env = reproduce.numeric_path_environment
    before = {"NORMTOOLS_RMS_NORM_BACKWARD": "autograd"}     # studies that predate the record
    assert env({"aten_cpu_capability": "AVX2"}) == {
        "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", **before}
    assert env({"aten_cpu_capability": "DEFAULT"}) == {
        "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", **before}
    assert env({"aten_cpu_capability": "AVX512", "rms_norm_backward": "analytic"}) == {
        "ATEN_CPU_CAPABILITY": "avx512", "NORMTOOLS_RMS_NORM_BACKWARD": "analytic"}


def test_cli_writes_and_resumes_a_study(tmp_path):
    out = tmp_path / "precision.json"
    argv = ["lab", "run", "precision", "--size", "test", "--seeds", "1", "--out", str(out)]
    assert cli.main(argv + ["--max-runs", "2"]) == 0
    assert json.loads(out.read_text())["complete"] is False
    assert cli.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["size"] == "test" and document["conditions"]["seeds"] == [0]
    assert document["complete"] and len(document["runs"]) == len(studies.STUDIES["precision"].variants)
    _, table = studies.load_study(out)
    assert set(table["variant"]) == set(studies.STUDIES["precision"].variants)


def test_shards_merge_into_the_study_trained_whole(tmp_path):
    """Two shards (whole seeds each) merged give the runs of one unsharded process, in its
    order; a part from another size, a run that differs between parts, or a run outside the
    study's cells is refused."""
    base = ["lab", "run", "precision", "--size", "test", "--seeds", "2"]
    whole, parts = tmp_path / "whole.json", [tmp_path / f"part{i}.json" for i in range(2)]
    assert cli.main(base + ["--out", str(whole)]) == 0
    for i, part in enumerate(parts):
        assert cli.main(base + ["--shard", f"{i}/2", "--out", str(part)]) == 0
        assert {r["seed"] for r in json.loads(part.read_text())["runs"]} == {i}
    merged = tmp_path / "merged.json"
    assert cli.main(["lab", "merge", str(merged), *map(str, parts)]) == 0
    strip = lambda doc: [{k: v for k, v in r.items() if k != "seconds"} for r in doc["runs"]]
    expected, got = json.loads(whole.read_text()), json.loads(merged.read_text())
    assert got["complete"] and strip(got) == strip(expected)
    assert got["conditions"]["wall_seconds"] == sum(json.loads(p.read_text())["conditions"]["wall_seconds"]
                                                    for p in parts)
    tampered = json.loads(parts[1].read_text())
    tampered["runs"][0]["final_loss"] += 1.0
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="differs between the files"):
        studies.merge_studies([whole, tmp_path / "tampered.json"])
    other = {**tampered, "size": "cpu"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="in size"):
        studies.merge_studies([parts[0], tmp_path / "other.json"])
    stray = json.loads(parts[1].read_text())
    stray["runs"][0]["lr"] = 123.0                 # no cell of the study has this learning rate
    (tmp_path / "stray.json").write_text(json.dumps(stray))
    with pytest.raises(ValueError, match="not cells of the precision study"):
        studies.merge_studies([parts[0], tmp_path / "stray.json"])


@pytest.mark.parametrize("name", sorted(studies.INIT_PROBES))
def test_committed_init_probe_is_complete_and_reproduces(name):
    """Every (variant, placement, depth, seed, layer) of the probe is in the committed file, with
    its provenance; one seed at the smallest depth, probed again here, gives the same gradients
    and residual RMS up to float tolerance (a reproducibility check)."""
    path = STUDY_DIR / f"{name}.json"
    if not path.exists():
        pytest.xfail(f"{name}: not committed yet (run `normtools lab probe {name}`, resumable)")
    probe = studies.INIT_PROBES[name]
    document, rows = studies.load_init_probe(path)
    assert document["complete"] and len(document["provenance"]["commit"]) == 40
    assert document["conditions"]["model"] == probe.model
    assert document["conditions"]["corpus_sha256"] == CORPUS_SHA256
    expected = {(v, p, d, s, layer) for v in probe.variants for p in probe.placements
                for d in probe.depths for s in probe.seeds for layer in range(d)}
    got = set(zip(rows["variant"], rows["placement"], rows["depth"], rows["seed"], rows["layer"]))
    assert got == expected and len(rows) == len(expected)
    variant, depth = next(iter(probe.variants)), min(probe.depths)
    batch = load_corpus().get_batch("val", probe.batch_size, probe.model["max_seq_len"],
                                    torch.Generator().manual_seed(0))
    again = probes.init_gradients(batch, probe.placements, (depth,), (0,), **probe.model,
                                  **probe.variants[variant])
    committed_rows = rows[(rows["variant"] == variant) & (rows["depth"] == depth) & (rows["seed"] == 0)]
    merged = again.merge(committed_rows, on=["placement", "layer"], suffixes=("", "_committed"))
    assert len(merged) == len(again) == 2 * depth
    for column in ("w2_grad_norm", "residual_rms"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_committed"], rtol=1e-4)

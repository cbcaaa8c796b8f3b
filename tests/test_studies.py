"""Committed studies (normtools.lab.studies): each committed JSON holds every run its study
defines, under the corpus the lab uses now, and one seed of one configuration of each, trained
again here, falls within the range its committed seeds span."""

import copy
import json
from pathlib import Path

import pytest

from normtools import cli
from normtools.lab import studies
from normtools.lab.data import CORPUS_SHA256

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STUDY_DIR = Path(__file__).resolve().parents[1] / "book" / "data" / "studies"


def committed(name):
    return json.loads((STUDY_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(studies.STUDIES))
def test_committed_study_is_complete(name):
    document = committed(name)
    study = studies.STUDIES[name]
    conditions = document["conditions"]
    assert document["study"] == name and document["size"] == "cpu"
    assert conditions["corpus_sha256"] == CORPUS_SHA256
    assert conditions["command"] == f"normtools lab run {name} --size cpu"
    expected = {(c["variant"], c["lr"], c["seed"]) for c in study.cells("cpu")}
    got = {(r["variant"], r["lr"], r["seed"]) for r in document["runs"]}
    assert got == expected and len(document["runs"]) == len(expected)
    assert len(conditions["seeds"]) >= 3
    for run in document["runs"]:
        assert len(run["curves"]["loss"]) == conditions["steps"] or run["diverged"]


@pytest.fixture(scope="module")
def reruns():
    """One re-run per study, trained once for the tests that compare it."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = studies.rerun(committed(name))
        return cache[name]
    return get


@pytest.mark.parametrize("name", sorted(studies.STUDIES))
def test_committed_study_rerun_falls_within_its_range(name, reruns):
    check = studies.compare_rerun(committed(name), *reruns(name))
    assert check["within"].all(), check.to_string()


def test_compare_rerun_fails_outside_the_range(reruns):
    tampered = copy.deepcopy(committed("lr_sweep"))
    chosen, record = reruns("lr_sweep")
    for run in tampered["runs"]:
        if run["variant"] == chosen["variant"] and run["lr"] == chosen["lr"]:
            run["final_loss"] *= 1.5
    check = studies.compare_rerun(tampered, chosen, record, metrics=("final_loss",))
    assert not check["within"].any()


def test_cli_writes_a_study(tmp_path):
    out = tmp_path / "sweep.json"
    assert cli.main(["lab", "run", "lr_sweep", "--size", "test", "--seeds", "1", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["size"] == "test" and document["conditions"]["seeds"] == [0]
    assert len(document["runs"]) == len(studies.STUDIES["lr_sweep"].cells("test")) // 3
    _, table = studies.load_study(out)
    assert set(table["variant"]) == set(studies.STUDIES["lr_sweep"].variants)

"""The README's code runs as printed, and its Gemma claim holds against transformers' module."""

import re
from pathlib import Path

import torch

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_python_example_runs_and_matches_gemma3():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    code = re.findall(r"```python\n(.*?)```", README, flags=re.S)[0]   # "normtools in a few lines"
    namespace = {}
    exec(code, namespace)
    x = namespace["x"]
    assert torch.equal(namespace["y"], Gemma3RMSNorm(x.shape[-1], eps=1e-6)(x))
    assert namespace["qn"].shape == namespace["q"].shape and namespace["kn"].shape == namespace["k"].shape


def test_readme_gives_the_two_commands_first():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "book"], ["make", "test"]]


def test_every_make_target_the_readme_names_exists():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", README)) | set(re.findall(r"^make ([a-z][\w-]*)", README, re.M))
    assert {"book", "test", "lock", "nbval-perturbed", "notebooks"} <= named
    assert named <= targets, named - targets


def test_readme_says_how_the_numbers_are_reproduced():
    section = README.split("## Reproducing the numbers", 1)[1].split("\n## ", 1)[0]
    for term in ("Compared", "Not compared", "constraints.txt", "make lock", "ATEN_CPU_CAPABILITY"):
        assert term in section, term

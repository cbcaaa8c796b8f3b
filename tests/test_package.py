"""The package surface: every advertised public name resolves, and `import normtools` stays light."""

import subprocess
import sys

import normtools


def test_every_public_name_resolves():
    for name in normtools.__all__:
        assert getattr(normtools, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        normtools.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_pull_transformers_or_triton():
    code = "import sys, normtools; print('transformers' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_wheel_ships_the_corpus_and_the_model_configs(tmp_path):
    """Package data reaches users: build the wheel from a copy of the sources, offline, and read it."""
    import hashlib
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("normtools", "kernels"):
        shutil.copytree(root / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("normtools-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        corpus = archive.read("normtools/lab/corpus/tinyshakespeare.txt")
    assert hashlib.sha256(corpus).hexdigest() == (
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")
    assert "normtools/lab/corpus/SOURCE.md" in names
    assert any(n.startswith("normtools/cards/configs/") and n.endswith(".json") for n in names)
    assert "normtools/_kernels/rms_norm.py" in names

"""The package surface: every advertised public name resolves, and `import normtools` stays light."""

import re
import subprocess
import sys
from pathlib import Path

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



README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_first_example():
    """The Python block of the README's section "normtools in a few lines" (later blocks are
    sketches inside a larger program, e.g. a torchtitan plan)."""
    section = README.read_text().split("## normtools in a few lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def _readme_dotted_names():
    """Every ``normtools.x.y`` the README names (the underscore package of kernels left out)."""
    names = set(re.findall(r"\bnormtools(?:\.[A-Za-z]\w*)+", README.read_text()))
    return sorted(name for name in names if "._" not in name)


def test_readme_names_import_as_a_user_writes_them():
    """In a fresh interpreter, each public name the README shows resolves as a user writes it:
    a module with ``import normtools.tp`` (so ``from normtools.tp import qk_norm`` works too),
    anything else with ``from normtools.lab.tinylm import TinyLM``, ``normtools.rms_norm``."""
    names = _readme_dotted_names()
    assert {"normtools.tp", "normtools.tp.qk_norm", "normtools.rms_norm"} <= set(names)
    lines = ["import inspect", "import normtools"]
    for name in names:
        parent, _, last = name.rpartition(".")
        lines.append(f"try:\n    import {name}\nexcept ModuleNotFoundError as error:\n"
                     f"    assert error.name == {name!r}, error\n"
                     f"    from {parent} import {last}\n"
                     f"    assert not inspect.ismodule({last}), '{name}: import fails'\n"
                     f"assert {name} is not None")
    result = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_readme_code_runs():
    """The README's first Python example runs as printed (on CPU: the reference backend)."""
    result = subprocess.run([sys.executable, "-c", _readme_first_example()], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr

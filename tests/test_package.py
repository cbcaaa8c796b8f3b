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


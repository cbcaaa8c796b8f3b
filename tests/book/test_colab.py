"""The Colab edition (colab/book): in sync with the stored chapters, no raw role in any markdown
cell, roles resolved to the right facts, included files and diagrams present, and its setup
cell installing normtools from a clone in a fresh virtual environment."""

import base64
import json
import os
import re
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path

import pytest
import yaml

from normtools.book import colab

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
EDITION = ROOT / "colab" / "book"
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())


def _markdown(path):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("colab")
    book = colab.read_book(ROOT)
    failures = {}
    for path in CHAPTERS:
        try:
            (out / path.name).write_text(json.dumps(colab.edition_notebook(path, book), indent=1,
                                                    ensure_ascii=False) + "\n", encoding="utf-8")
        except (KeyError, ValueError) as error:
            failures[path.name] = error
    return out, failures


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_the_edition_is_in_sync_with_the_stored_chapter(path, regenerated):
    out, failures = regenerated
    assert path.name not in failures, f"{path.name} cannot be converted: {failures.get(path.name)}"
    stored = EDITION / path.name
    assert stored.exists(), f"no colab/book/{path.name}: run `make colab`"
    assert stored.read_text() == (out / path.name).read_text(), f"colab/book/{path.name} is stale: run `make colab`"
    assert {p.name for p in EDITION.glob("*.ipynb")} <= {p.name for p in CHAPTERS}, "an edition without chapter"


@pytest.mark.parametrize("path", sorted(EDITION.glob("*.ipynb")), ids=lambda p: p.name)
def test_no_markdown_cell_of_the_edition_has_an_unresolved_role(path):
    left = [(i, role) for i, text in enumerate(_markdown(path)) for role in colab.unresolved_roles(text)]
    assert not left, f"{path.name}: {left[:5]}"
    for text in _markdown(path):
        assert "```{" not in text and ":::{" not in text and not re.search(r"^\([\w-]+\)=\s*$", text, re.M)


def test_unresolved_roles_sees_roles_but_not_code():
    text = "See {doc}`x` and ``{term}`shown as code` ``.\n```python\nprint('{ref}`y`')\n```\n"
    assert colab.unresolved_roles(text) == ["{doc}`x`"]


def test_roles_resolve_to_the_book_facts():
    book = colab.Book(root=ROOT, html_url="https://o.github.io/r/", repository_url="https://github.com/o/r",
                      titles={"book/02_flow": "2. Flow"}, labels={"ch2-step3": ("book/02_flow", "Step 3")},
                      citations={"ba": ("Ba et al.", "2016", "https://arxiv.org/abs/1607.06450"),
                                 "zs": ("Zhang and Sennrich", "2019", None)},
                      terms={"rmsnorm": "RMSNorm", "pre-ln": "Pre-LN"})
    text = ("{glue:text}`n` of {cite:p}`ba,zs`; {cite:t}`ba` in {doc}`02_flow`, "
            "{ref}`the step <ch2-step3>`, {term}`rmsnorm`, {term}`pre-norm <Pre-LN>`")
    assert colab.resolve_roles(text, doc="book/01_definition", glue={"n": "42"}, book=book) == (
        "42 of ([Ba et al. 2016](https://arxiv.org/abs/1607.06450); Zhang and Sennrich 2019); "
        "[Ba et al. (2016)](https://arxiv.org/abs/1607.06450) in [2. Flow](https://o.github.io/r/book/02_flow.html), "
        "[the step](https://o.github.io/r/book/02_flow.html#ch2-step3), "
        "[rmsnorm](https://o.github.io/r/book/06_glossary.html#term-RMSNorm), "       # Sphinx's ids keep the
        "[pre-norm](https://o.github.io/r/book/06_glossary.html#term-Pre-LN)")        # glossary's case
    assert colab.resolve_roles("{glue:text}`x:.2f`", doc="book/x", glue={"x": "3.14159"}, book=book) == "3.14"
    with pytest.raises(KeyError, match="no glued value"):
        colab.resolve_roles("{glue:text}`missing`", doc="book/x", glue={}, book=book)
    with pytest.raises(KeyError, match="unknown label"):
        colab.resolve_roles("{ref}`nowhere`", doc="book/x", glue={}, book=book)
    with pytest.raises(KeyError, match="no glossary term"):
        colab.resolve_roles("{term}`nothing`", doc="book/x", glue={}, book=book)


def test_html_book_is_the_repository_github_pages():
    assert colab.html_book_url("https://github.com/normbook/normbook") == "https://normbook.github.io/normbook/"
    with pytest.raises(ValueError):
        colab.html_book_url("https://gitlab.com/a/b")


def test_real_citations_read_from_references_bib():
    citations = colab.read_book(ROOT).citations
    # from references.bib by hand: Ba, Kiros, Hinton (2016); Zhang, Sennrich (2019)
    assert citations["ba2016layernorm"][:2] == ("Ba et al.", "2016")
    assert citations["zhang2019rmsnorm"][:2] == ("Zhang and Sennrich", "2019")


def test_glued_values_reach_the_edition_prose():
    """Every {glue:text} of a chapter becomes the value that chapter stored for it."""
    checked = 0
    for path in CHAPTERS:
        edition = EDITION / path.name
        if not edition.exists():
            continue
        glue = colab._glue_values(json.loads(path.read_text()))
        source, converted = _markdown(path), _markdown(edition)
        for before, after in zip(source, converted):
            names = re.findall(r"\{glue:text\}`([\w]+)`", before)
            for name in names:
                assert name in glue, f"{path.name}: {name} is not glued (stored before it was executed?)"
                assert glue[name] in after, f"{path.name}: {name} = {glue[name]!r} not in the edition"
                checked += 1
    assert checked > 50


def test_included_kernel_sources_are_inlined_verbatim():
    text = "\n".join(_markdown(EDITION / "04b_profiling_kernels.ipynb"))
    for kernel in ("rms_norm.py", "layer_norm.py", "qk_norm.py"):
        assert (ROOT / "kernels" / kernel).read_text().strip() in text, kernel
    assert "<details>" in text and "{literalinclude}" not in text


def test_diagrams_are_attached_svg_images():
    from normtools.book.diagrams import svg_size

    count = 0
    for path in sorted(EDITION.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for name in re.findall(r"\(attachment:([\w.-]+)\)", "".join(cell["source"])):
                svg = base64.b64decode(cell["attachments"][name]["image/svg+xml"]).decode()
                xml.dom.minidom.parseString(svg)                           # a valid SVG file
                width, height = svg_size(svg)
                assert f'width="{width:g}" height="{height:g}"' in svg, name
                count += 1
    source_count = sum(text.count("```mermaid") for p in CHAPTERS for text in _markdown(p))
    assert count == source_count > 0


def test_cells_the_html_book_hides_are_folded_and_parameters_stay_open():
    folded = 0
    for path in CHAPTERS:
        edition = EDITION / path.name
        if not edition.exists():
            continue
        source = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        converted = [c for c in json.loads(edition.read_text())["cells"] if c["cell_type"] == "code"]
        assert len(source) == len(converted)
        for before, after in zip(source[1:], converted[1:]):
            tags = set(before["metadata"].get("tags", []))
            hidden = bool(tags & {"remove-cell", "remove-input", "hide-input", "hide-cell"}) and "parameters" not in tags
            assert (after["metadata"].get("cellView") == "form") == hidden, (path.name, before["id"])
            assert after["source"][hidden:] == before["source"]
            folded += hidden
    assert folded > 10


def test_launch_buttons_and_readme_point_to_the_edition():
    assert CONFIG["repository"]["path_to_book"] == "colab"
    assert "colab/book/" in (ROOT / "README.md").read_text()


# ----------------------------------------------------------------- the setup cell, for real

def _dependencies_without_normtools(target: Path) -> Path:
    """A folder of links to the project venv's installed packages, normtools left out: what a
    Colab runtime provides before the setup cell runs (torch, numpy, transformers, ...)."""
    import site

    packages = Path(next(p for p in site.getsitepackages() if p.endswith("site-packages")))
    target.mkdir()
    for entry in packages.iterdir():
        if "normtools" in entry.name.lower() or entry.suffix == ".pth":
            continue
        (target / entry.name).symlink_to(entry)
    return target


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_setup_cell_installs_normtools_from_a_clone_in_a_fresh_venv(tmp_path):
    """The edition's first cell, as on Colab (google.colab importable), in a new venv that has
    the dependencies but not normtools: it clones the repository (git redirected to this clone's
    committed HEAD, so nothing comes from the network), pip-installs it (no index), and the
    chapter then runs on the installed package."""
    chapter = EDITION / "06_glossary.ipynb"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    deps = _dependencies_without_normtools(tmp_path / "deps")
    Path(site_packages, "colab_runtime.pth").write_text(f"{deps}\n")
    kernels = tmp_path / "jupyter" / "kernels" / "fresh"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f",
                                                              "{connection_file}"], "language": "python",
                                                     "display_name": "fresh venv"}))
    notebook = json.loads(chapter.read_text())
    fake_colab = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "id": "fake-colab",
                  "source": "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')"}
    where = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "id": "where",
             "source": "import normtools, os\nprint(normtools.__file__)\nprint(os.getcwd())"}
    notebook["cells"] = [fake_colab] + notebook["cells"] + [where]
    (tmp_path / "edition.ipynb").write_text(json.dumps(notebook))
    clone = tmp_path / "clone"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))},
           "NORMBOOK_CLONE": str(clone), "JUPYTER_PATH": str(tmp_path / "jupyter"),
           "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
           "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": f"url.file://{ROOT}.insteadOf",
           "GIT_CONFIG_VALUE_0": CONFIG["repository"]["url"]}
    run = ("import nbformat, nbclient; nb = nbformat.read('edition.ipynb', as_version=4); "
           "nbclient.NotebookClient(nb, kernel_name='fresh', timeout=150).execute(); "
           "print(''.join(o['text'] for o in nb.cells[-1].outputs if o.get('name') == 'stdout'))")
    result = subprocess.run([str(python), "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=170)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    module_file, cwd = result.stdout.strip().splitlines()[-2:]
    assert module_file.startswith(str(venv)), module_file                  # the installed copy
    assert cwd == str(clone / "book")
    assert (clone / ".git").is_dir()

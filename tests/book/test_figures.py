"""nbval does not compare images, so a changed figure must show in a compared text output: every
code cell of a stored chapter that draws a figure also prints (or displays) a text summary of
the data it draws, in an output that nbval compares (the cell is not excluded from comparison)."""

from pathlib import Path

import nbformat
import pytest

BOOK = Path(__file__).resolve().parents[2] / "book"
CHAPTERS = sorted(BOOK.glob("*.ipynb"))
UNCOMPARED_TAGS = {"nbval-ignore-output", "nbval-skip"}


def compared_text(output) -> bool:
    """Whether ``output`` carries text other than a figure's own repr ("<Figure size ...>")."""
    if output.get("output_type") == "stream":
        return bool(output.get("text", "").strip())
    data = output.get("data", {})
    if "image/png" in data or "image/svg+xml" in data:
        return False
    return any(k in data for k in ("text/plain", "text/html", "text/latex", "text/markdown"))


def figure_cells_without_text(path):
    nb = nbformat.read(path, as_version=4)
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        if not any("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
                   for o in outputs):
            continue
        tags = set(cell.metadata.get("tags", []))
        if tags & UNCOMPARED_TAGS or not any(compared_text(o) for o in outputs):
            missing.append(f"{path.name} cell {i}: {cell.source.splitlines()[0][:70]}")
    return missing


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_figure_cell_prints_a_compared_summary(path):
    missing = figure_cells_without_text(path)
    assert not missing, ("cells that draw a figure without a compared text summary of its "
                         "data:\n" + "\n".join(missing))


def test_the_check_sees_a_bare_figure(tmp_path):
    cell = nbformat.v4.new_code_cell("plt.plot([1, 2]); plt.show()")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 640x480 with 1 Axes>"})]
    path = tmp_path / "bare.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert figure_cells_without_text(path) != []
    cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text="max 2.0\n"))
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert figure_cells_without_text(path) == []

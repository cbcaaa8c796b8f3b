"""The book teaches before it tells (issue 36): exercises ask before they answer, and the core
chapters open with their question and close with what to remember.

Conventions, over every chapter notebook book/*.ipynb:

* An exercise section is a markdown heading ``## Exercises``; it runs to the next heading of
  level 1 or 2. Its wording asks the reader to predict first ("predict").
* An answer is a code cell tagged ``solution`` and ``hide-cell``: the whole cell, code and
  output, is collapsed and opens on a click. ``hide-input`` would leave the answer printed under
  the question, and ``remove-*`` would take it out of the page.
* Inside an exercise section, no code cell shows an output by default: every code cell with an
  output is an answer (tagged as above).
* The table of contents puts the learner's path first (1, 2, 3, 5, the atlas), then the
  "going deeper" chapters (4a, 4b, 7).
* Each core chapter (the learner's path: 1, 2, 3 and 5) opens, right after its title, with a
  question (a sentence ending in "?") and has a ``## What to remember`` section after which come
  only exercises or collapsed "Going deeper" material.
"""

import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("*.ipynb"))
CORE_CHAPTERS = ("01_definition", "02_flow", "03_solution", "05_examples")
SOLUTION_TAG, COLLAPSED_TAG = "solution", "hide-cell"
REMOVED_OUTPUT_TAGS = {"remove-cell", "remove-output"}  # plumbing, e.g. glue
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)


def _tags(cell) -> set[str]:
    return set(cell.metadata.get("tags", []))


def _headings(cell) -> list[tuple[int, str]]:
    """(level, title) of the markdown headings of ``cell``, outside fenced blocks."""
    if cell.cell_type != "markdown":
        return []
    text = re.sub(r"(`{3,}|:{3,}).*?\1", "", cell.source, flags=re.S)
    return [(len(m.group(1)), m.group(2)) for m in _HEADING.finditer(text)]


def exercise_sections(nb) -> list[list[int]]:
    """The cell indices of each exercise section (its heading cell first)."""
    sections, current = [], None
    for i, cell in enumerate(nb.cells):
        top = [title for level, title in _headings(cell) if level <= 2]
        if top:
            current = [i] if top[-1].lower().startswith("exercises") else None
            if current is not None:
                sections.append(current)
            continue
        if current is not None:
            current.append(i)
    return sections


def answer_problems(nb) -> list[str]:
    """Where an answer is not collapsed, or an output shows under an exercise question."""
    problems = []
    for i, cell in enumerate(nb.cells):
        tags = _tags(cell)
        if SOLUTION_TAG in tags and COLLAPSED_TAG not in tags:
            problems.append(f"cell {i}: an answer not tagged {COLLAPSED_TAG!r} (tags {sorted(tags)})")
        if SOLUTION_TAG in tags and tags & {"remove-cell", "remove-input", "remove-output"}:
            problems.append(f"cell {i}: an answer removed from the page (tags {sorted(tags)})")
    for section in exercise_sections(nb):
        cells = [nb.cells[i] for i in section]
        if "predict" not in "\n".join(c.source for c in cells if c.cell_type == "markdown").lower():
            problems.append(f"cell {section[0]}: exercises that do not ask the reader to predict first")
        for i in section:
            cell = nb.cells[i]
            if cell.cell_type != "code" or not cell.get("outputs"):
                continue
            tags = _tags(cell)
            if not tags & REMOVED_OUTPUT_TAGS and not {SOLUTION_TAG, COLLAPSED_TAG} <= tags:
                problems.append(f"cell {i}: an output shown under an exercise, not an answer tagged "
                                f"{SOLUTION_TAG!r} + {COLLAPSED_TAG!r} ({cell.source.splitlines()[0][:60]})")
    return problems


def opening_and_closing_problems(nb) -> list[str]:
    """Whether the chapter opens with a question after its title and ends with what to remember."""
    problems = []
    markdown = [c for c in nb.cells if c.cell_type == "markdown"]
    if not markdown or not markdown[0].source.lstrip().startswith("# "):
        return ["the first markdown cell is not the chapter's title"]
    after_title = markdown[0].source.lstrip().split("\n", 1)[1:] or [""]
    opening = after_title[0].strip() or (markdown[1].source.strip() if len(markdown) > 1 else "")
    first_paragraphs = "\n\n".join(opening.split("\n\n")[:2])
    if "?" not in first_paragraphs:
        problems.append("the text after the title does not open with a question")
    top = [title for c in nb.cells for level, title in _headings(c) if level == 2]
    if "What to remember" not in top:
        problems.append("no '## What to remember' section")
    else:
        after = top[top.index("What to remember") + 1:]
        late = [t for t in after if not t.lower().startswith(("exercises", "going deeper"))]
        if late:
            problems.append(f"sections after 'What to remember' other than exercises: {late}")
    return problems


WITH_EXERCISES = [p for p in CHAPTERS if exercise_sections(nbformat.read(p, as_version=4))]


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.stem)
def test_exercises_ask_first_and_no_answer_shows_by_default(path):
    problems = answer_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("stem", CORE_CHAPTERS)
def test_core_chapter_opens_with_its_question_and_ends_with_what_to_remember(stem):
    problems = opening_and_closing_problems(nbformat.read(BOOK / f"{stem}.ipynb", as_version=4))
    assert not problems, f"{stem}:\n" + "\n".join(problems)


def test_the_table_of_contents_puts_the_learners_path_first():
    parts = yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"]
    order = [[c["file"].removeprefix("book/") for c in part["chapters"]] for part in parts]
    assert order[0] == [*CORE_CHAPTERS, "atlas"]
    assert order[1] == ["04a_profiling_stability", "04b_profiling_kernels", "07_related"]
    assert parts[1]["caption"] == "Going deeper"


# ---------------------------------------------------------------- the checks can fail

def _notebook(*cells):
    return nbformat.v4.new_notebook(cells=list(cells))


def _answer(tags):
    cell = nbformat.v4.new_code_cell("print(42)", metadata={"tags": tags})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    return cell


def test_the_answer_check_sees_a_printed_answer():
    question = nbformat.v4.new_markdown_cell("## Exercises\n\n1. Predict the answer first.")
    assert answer_problems(_notebook(question, _answer(["solution", "hide-cell"]))) == []
    for tags in (["hide-input"], ["solution", "hide-input"], [], ["solution", "remove-cell"]):
        assert answer_problems(_notebook(question, _answer(tags))) != [], tags
    assert answer_problems(_notebook(_answer(["solution"]))) != []          # outside a section too
    unasked = nbformat.v4.new_markdown_cell("## Exercises\n\n1. Compute the answer.")
    assert answer_problems(_notebook(unasked, _answer(["solution", "hide-cell"]))) != []
    after = nbformat.v4.new_markdown_cell("## Going further")
    assert answer_problems(_notebook(question, _answer(["solution", "hide-cell"]), after, _answer([]))) == []


def test_the_opening_check_wants_a_question_and_a_summary():
    title = "# 1. A chapter\n\n"
    summary = nbformat.v4.new_markdown_cell("## What to remember\n\n- one thing")
    exercises = nbformat.v4.new_markdown_cell("## Exercises")
    asked = nbformat.v4.new_markdown_cell(title + "**The question.** Why does it work?")
    told = nbformat.v4.new_markdown_cell(title + "This chapter shows how it works.")
    assert opening_and_closing_problems(_notebook(asked, summary, exercises)) == []
    assert opening_and_closing_problems(_notebook(nbformat.v4.new_markdown_cell("# 1. A chapter"),
                                                  nbformat.v4.new_markdown_cell("Why?"), summary)) == []
    assert opening_and_closing_problems(_notebook(told, summary)) != []
    assert opening_and_closing_problems(_notebook(asked)) != []
    later = nbformat.v4.new_markdown_cell("## One more section")
    assert opening_and_closing_problems(_notebook(asked, summary, later)) != []

"""The book's prose: no number typed by hand, and every cross-reference names what its target holds.

Numbers in the text come from cells (``{glue:text}``); a digit left in a markdown cell or page is
a number typed by hand, unless it is one of the allowed kinds below: a year, a chapter, section,
figure or step number, a citation, math, code, a label, a model or dtype name ("OLMo 2",
"Qwen3-8B", "bfloat16"), list numbering, or a direct quotation of a source. Cross-references:
every ``{ref}`` label exists, every ``{doc}`` target exists, and each glossary entry's chapter
mentions the term. Names: every `normtools.…` name in the prose exists in the package.
"""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"

# Multi-word model names whose number is part of the name (one-word names such as Qwen3-8B,
# GPT-2 or bfloat16 are letters with digits attached, allowed by the last pattern below).
MODEL_NAMES = ("OLMo 2", "Llama 3", "Llama 2", "Gemma 2 and 3", "Gemma 2", "Gemma 3", "Phi 2",
               "Command R", "Command A", "Qwen 3", "Triton 3", "Llama 4", "Gemma 4")

_REMOVED = [
    re.compile(r"```[^\n]*\n.*?```", re.S),                 # fenced blocks: code, mermaid, directives
    re.compile(r"\$\$.*?\$\$", re.S),                       # display math
    re.compile(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.S),  # amsmath environments
    re.compile(r"(?<!\\)\$[^$\n]+(?<!\\)\$"),               # inline math
    re.compile(r"\{[\w:-]+\}`[^`]*`"),                      # MyST roles: glue, cite, doc, ref, term
    re.compile(r"``[^`]+``|`[^`\n]+`"),                     # inline code
    re.compile(r"^\(([\w-]+)\)=\s*$", re.M),                # labels
    re.compile(r"\]\([^)]*\)"),                             # link targets
    re.compile(r"<[^>\n]+>"),                               # HTML tags
    re.compile(r"“[^”]{0,400}”|\"[^\"]{0,400}\""),            # direct quotations of a source
    re.compile(r"^#+\s+\d+[a-z]?\.", re.M),                 # chapter numbers in titles
    re.compile(r"^\s*\d+\.\s", re.M),                       # numbered lists
    re.compile(r"\b(?:1[89]|20)\d\d[a-z]?\b"),              # years
    re.compile(r"(?i)\b(?:chapters?|sections?|§|figures?|fig\.|tables?|steps?|eq\.|equations?|"
               r"items?|issues?|appendix)\s*\d+[a-z]?(?:\.\d+)*(?:\s*(?:and|to|,)\s*\d+[a-z]?)*"),
    re.compile(r"§\s*\d+(?:\.\d+)*"),
    re.compile(r"\b[A-Za-z][\w.]*[-‑]?\d[\w.-]*"),  # names with digits attached: M2, L6-v2, fp16
]


def prose_sources():
    """(file name, cell index or None, markdown text) for every markdown cell and page."""
    for path in sorted(BOOK.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown":
                yield path.name, i, cell.source
    for path in sorted(BOOK.glob("*.md")):
        yield path.name, None, path.read_text()


def typed_numbers(text: str) -> list[str]:
    """The snippets of ``text`` (with context) that hold a digit outside the allowed kinds."""
    for name in sorted(MODEL_NAMES, key=len, reverse=True):
        text = text.replace(name, " ")
    for pattern in _REMOVED:
        text = pattern.sub(" ", text)
    return [text[max(0, m.start() - 30):m.end() + 30].replace("\n", " ").strip()
            for m in re.finditer(r"\d+(?:[.,]\d+)*", text)]


def test_typed_numbers_detects_and_allows():
    assert typed_numbers("the 230-billion-parameter model") != []
    assert typed_numbers("outputs off by up to 4.54 on rows") != []
    assert typed_numbers("needs several seeds (3 of them)") != []
    assert typed_numbers("eps 1e-6 in the text") != []
    allowed = ("OLMo 2 {cite:p}`olmo2024olmo2` (2024), Qwen3-8B and GPT-2 in bfloat16, "
               "chapter 4a, §3.3.2, Figure 7, $2^{-8}$, {glue:text}`ch1_x`, `eps=1e-6`, "
               "Gemma 2 and 3, MiniMax-M2, all-MiniLM-L6-v2, \"reduce the score from 0.108 to 0.069\"\n1. first step\n"
               "(ch1-cost)=\n## Step 2: read")
    assert typed_numbers(allowed) == []


def test_no_number_is_typed_in_the_prose():
    offenders = []
    for name, cell, text in prose_sources():
        for snippet in typed_numbers(text):
            where = f"{name} cell {cell}" if cell is not None else name
            offenders.append(f"{where}: ...{snippet}...")
    assert not offenders, ("numbers typed by hand in the prose (glue them from a cell, or extend "
                           "the allow-list in tests/book/test_prose.py if it is a name):\n"
                           + "\n".join(offenders))


# ---------------------------------------------------------------------------- cross-references

def _chapter_texts():
    texts = {}
    for name, _, text in prose_sources():
        texts.setdefault(Path(name).stem, []).append(text)
    return {k: "\n".join(v) for k, v in texts.items()}


def _labels(text):
    return re.findall(r"^\(([\w-]+)\)=\s*$", text, re.M)


def test_every_ref_names_a_label_that_exists_once():
    texts = _chapter_texts()
    defined = {}
    for chapter, text in texts.items():
        for label in _labels(text):
            defined.setdefault(label, []).append(chapter)
    duplicates = {k: v for k, v in defined.items() if len(v) > 1}
    assert not duplicates, f"labels defined more than once: {duplicates}"
    missing = []
    for chapter, text in texts.items():
        for target in re.findall(r"\{ref\}`([^`]+)`", text):
            label = re.sub(r"^.*<(.+)>$", r"\1", target).strip()
            if label not in defined:
                missing.append(f"{chapter}: {{ref}}`{target}`")
    assert not missing, "references to labels that no chapter defines:\n" + "\n".join(missing)


def test_every_doc_link_names_an_existing_chapter():
    texts = _chapter_texts()
    missing = [f"{chapter}: {{doc}}`{target}`" for chapter, text in texts.items()
               for target in re.findall(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`", text)
               if not any((BOOK / f"{target.strip()}{ext}").exists() for ext in (".ipynb", ".md"))]
    assert not missing, "links to chapters that do not exist:\n" + "\n".join(missing)


def _mentions(text: str, term: str) -> bool:
    """Whether ``text`` mentions ``term`` (case-insensitive; hyphens, spaces and plurals alike)."""
    words = re.split(r"[-\s]+", term.strip())
    pattern = r"[-\s]+".join(re.escape(w) for w in words)
    return re.search(rf"(?i)(?<![\w]){pattern}(?:s|es)?(?![\w])", text) is not None


def test_each_glossary_entry_points_to_a_chapter_that_mentions_it():
    """"See chapter X" must send the reader to a chapter that uses the term (its prose or code)."""
    from normtools.book.glossary import TERMS

    texts = {}
    for path in BOOK.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        texts[path.stem] = "\n".join(c.source for c in nb.cells)
    for path in BOOK.glob("*.md"):
        texts[path.stem] = path.read_text()
    wrong = [f"{t.term!r} points to {t.chapter}, which never mentions it" for t in TERMS
             if not _mentions(texts.get(t.chapter, ""), t.term)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, term, expected", [
    ("the pre-norm block", "pre-norm", True), ("two pre norms", "pre-norm", True),
    ("prenormal", "pre-norm", False), ("DyT layers", "DyT", True), ("nothing here", "nGPT", False)])
def test_mentions(text, term, expected):
    assert _mentions(text, term) is expected


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_normtools_name_in_the_prose_exists():
    """A name such as `normtools.lab.probes.depth_profile` in the text must be importable, so
    that a reader who types it finds it (module moves leave stale names behind)."""
    stale = []
    for name, cell, text in prose_sources():
        for dotted in re.findall(r"`(normtools(?:\.\w+)+)(?:\([^`]*\))?`", text):
            if not _resolves(dotted):
                where = f"{name} cell {cell}" if cell is not None else name
                stale.append(f"{where}: {dotted}")
    assert not stale, "names in the prose that normtools does not have:\n" + "\n".join(stale)


# ---------------------------------------------------------------------------- repository paths

# What the prose names under these roots is another code base's file (vLLM's, read for chapter 3)
EXTERNAL_ROOTS = ("vllm",)
# Written by the build, absent from a fresh clone
BUILD_OUTPUTS = ("_build",)
_PATH = re.compile(r"(?<![\w./:-])(?:\.\./)?[\w.-]+(?:/[\w.*-]+)*/?")
_FILE_SUFFIX = re.compile(r"\.(?:py|md|json|csv|sh|cfg|ya?ml|toml|ipynb|txt|svg|png)$")


def repository_paths(text: str, top_level: set) -> list[str]:
    """The paths ``text`` names in this repository: a slash-separated name whose first part is a
    top-level entry of the repository, or (a path into another folder) one that ends in a file
    suffix and is not under one of ``EXTERNAL_ROOTS``. ``../`` paths are relative to ``book/``, as
    the chapters' ``literalinclude`` directives read them. Ratios and units such as ``Hd/2`` or
    ``TB/s``, and the host of a URL, are not paths."""
    paths = []
    for match in _PATH.finditer(text):
        path = match.group(0).rstrip(".")
        if "/" not in path.removeprefix("../"):
            continue
        first = path.removeprefix("../").split("/", 1)[0]
        if first in BUILD_OUTPUTS or first in EXTERNAL_ROOTS:
            continue
        if first in top_level or _FILE_SUFFIX.search(path):
            paths.append(path)
    return paths


def _exists(path: str) -> bool:
    base = BOOK if path.startswith("../") else ROOT
    return (base / path).exists()


def test_repository_paths_are_found_and_ratios_are_not():
    top = {"normtools", "kernels", "bench", "book"}
    text = ("(`normtools/configs/SOURCES.md` names each file), `bench/results/`, "
            "```{literalinclude} ../kernels/rms_norm.py```, `configs/SOURCES.md`, "
            "q[:, :Hd/2], 1.2 TB/s, `vllm/model_executor/models/minimax_m2.py`, "
            "<https://github.com/huggingface/transformers>, `_build/html/index.html`, `kernels/`, "
            "key/value heads")
    assert repository_paths(text, top) == [
        "normtools/configs/SOURCES.md", "bench/results/", "../kernels/rms_norm.py",
        "configs/SOURCES.md", "kernels/"]
    assert not _exists("normtools/configs/SOURCES.md")
    assert _exists("../kernels/rms_norm.py") and _exists("bench/")


def test_every_repository_path_in_the_prose_exists():
    """A file or folder of this repository named in the text (`bench/results/`,
    `normtools/cards/configs/SOURCES.md`) must be where the text says: a layout change that moves
    it leaves the reader looking for a path that is gone."""
    top_level = {p.name for p in ROOT.iterdir()}
    sources = [(name, cell, text) for name, cell, text in prose_sources()]
    sources.append(("README.md", None, (ROOT / "README.md").read_text()))
    missing = []
    for name, cell, text in sources:
        for path in repository_paths(text, top_level):
            if not _exists(path):
                where = f"{name} cell {cell}" if cell is not None else name
                missing.append(f"{where}: {path}")
    assert not missing, "paths named in the prose that the repository does not have:\n" + \
        "\n".join(missing)

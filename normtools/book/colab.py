"""The Colab edition: every executed chapter as a notebook that reads in Colab or Jupyter like the
HTML book, written from the stored chapters (``python -m normtools.book.colab``, part of
``make notebooks``) into ``colab/book/``. Never edit it by hand; regenerate it.

Jupyter and Colab render plain Markdown, so the edition resolves what only Sphinx understands:

* ``{glue:text}`key``` → the value the chapter glued (its stored ``glue`` output);
* ``{cite:p}`a,b``` → "(Author Year; Author Year)", ``{cite:t}`a``` → "Author (Year)", each
  linked to the paper (its ``url``, ``doi`` or arXiv id in ``book/references.bib``);
* ``{doc}``, ``{ref}`` and ``{term}`` → links into the HTML book (GitHub Pages of the repository
  in ``_config.yml``), with the target's title as text when none is given;
* ``{literalinclude}`` → the included file (or its ``:pyobject:``) as a code block;
  ``{admonition}`` → a blockquote, or ``<details>`` for ``:class: dropdown``; ``{glossary}`` → a list;
* a ``mermaid`` diagram → its SVG from ``book/_diagrams`` as a cell attachment (an image);
* the first code cell (the chapter's Colab setup) → :data:`SETUP_CELL`, which clones the
  repository and installs normtools from it on Colab (at the lock's versions, Colab's torch and
  triton kept) and everywhere prints the versions the chapter runs with.

Code cells and their outputs are kept as executed; those the HTML book hides (setup, glue
bookkeeping, exercise solutions) are folded in Colab behind a ``#@title``.
"""

from __future__ import annotations

import argparse
import ast
import base64
import copy
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from normtools.book.diagrams import book_diagram_sources, render_svgs, standalone_svg

ROOT = Path(__file__).resolve().parents[2]

#: The edition's first cell. On Colab it clones the repository and installs normtools with the
#: ``hf`` and ``book`` extras at the lock's versions (``constraints.txt``), except for torch, triton
#: and what they require: Colab's own builds stay, pinned as installed, so pip can never replace
#: them. Everywhere it prints the versions the chapter runs with. ``NORMBOOK_CLONE`` moves the
#: clone (the tests use it).
SETUP_CELL = '''# Colab setup: clone the repository, install normtools from it at the book's versions, print them.
import os, re, subprocess, sys
from importlib import metadata

REPOSITORY_URL = "{repository}"
CLONE = os.environ.get("NORMBOOK_CLONE", "/content/normbook")


def project(requirement):
    """The normalized project name a requirement or a lock line starts with."""
    return re.sub(r"[-_.]+", "-", re.match(r"\\s*([\\w.-]+)", requirement).group(1)).lower()


if "google.colab" in sys.modules:
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--depth", "1", REPOSITORY_URL, CLONE], check=True)
        # the lock's versions, but Colab's torch and triton (and what they require) stay as installed
        installed = {{project(d.metadata["Name"]): d for d in metadata.distributions()}}
        kept = {{name: installed[name] for name in ("torch", "triton") if name in installed}}
        theirs = {{project(r) for d in kept.values() for r in d.requires or [] if "extra ==" not in r}}
        with open(os.path.join(CLONE, "constraints.txt")) as lock:
            pins = [line for line in lock if line[0].isalnum() and project(line) not in kept.keys() | theirs]
        pins += [f"{{name}}=={{d.version}}\\n" for name, d in kept.items()]
        constraints = os.path.join(CLONE, "colab-constraints.txt")
        with open(constraints, "w") as out:
            out.writelines(pins)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", constraints, CLONE + "[hf,book]"],
                       check=True)
    os.chdir(os.path.join(CLONE, "book"))
print(f"Python {{sys.version.split()[0]}}",
      *(f"{{name}} {{metadata.version(name)}}" for name in ("normtools", "torch", "triton", "transformers")), sep=", ")'''

ROLE = re.compile(r"\{([a-z][\w:-]*)\}`([^`]*)`")
_EXPLICIT = re.compile(r"^(.*?)\s*<([^<>]+)>$", re.S)
_FENCE_OPEN = re.compile(r"^(\s*)(`{3,}|~{3,}|:{3,})\s*(\{[\w:-]+\}|[\w+-]*)\s*(.*?)\s*$")


def html_book_url(repository_url: str) -> str:
    """GitHub Pages address of a GitHub repository: ``github.com/OWNER/REPO`` → ``OWNER.github.io/REPO/``."""
    parts = urlsplit(repository_url)
    owner, repo = parts.path.strip("/").split("/")[:2]
    if parts.netloc != "github.com":
        raise ValueError(f"not a GitHub repository URL: {repository_url}")
    return f"https://{owner.lower()}.github.io/{repo}/"


@dataclass
class Book:
    """What resolving a chapter needs to know about the whole book."""

    root: Path
    html_url: str
    repository_url: str
    titles: dict = field(default_factory=dict)      # doc name (book/02_flow) -> first heading
    labels: dict = field(default_factory=dict)      # label -> (doc name, heading)
    citations: dict = field(default_factory=dict)   # key -> (authors, year, url)
    diagrams: dict = field(default_factory=dict)    # mermaid source -> SVG
    terms: dict = field(default_factory=dict)       # glossary term, lower case -> as the glossary writes it


def _markdown_texts(path: Path) -> list[str]:
    if path.suffix == ".md":
        return [path.read_text(encoding="utf-8")]
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def _plain(latex: str, backend=[]) -> str:
    """A BibTeX field as plain text (accents decoded, braces dropped)."""
    from pybtex.plugin import find_plugin
    from pybtex.richtext import Text

    if not backend:                                 # finding the plugin scans entry points: once
        backend.append(find_plugin("pybtex.backends", "text")())
    return Text.from_latex(latex).render(backend[0]).strip()


def _read_citations(bib: Path) -> dict:
    from pybtex.database import parse_file

    citations = {}
    for key, entry in parse_file(str(bib)).entries.items():
        people = entry.persons.get("author") or entry.persons.get("editor") or []
        last = [_plain(" ".join(p.prelast_names + p.last_names)) for p in people[:2]]
        authors = (last[0] if len(people) == 1 else f"{last[0]} and {last[1]}" if len(people) == 2
                   else f"{last[0]} et al." if people else _plain(entry.fields.get("title", key)))
        fields = entry.fields
        url = fields.get("url") or (f"https://doi.org/{fields['doi']}" if "doi" in fields else None)
        if url is None and "eprint" in fields:
            url = f"https://arxiv.org/abs/{fields['eprint']}"
        citations[key] = (authors, fields.get("year", "n.d."), url)
    return citations


def read_book(root: Path = ROOT) -> Book:
    """Titles, labels, citations and rendered diagrams of the book under ``root``."""
    import yaml

    config = yaml.safe_load((root / "_config.yml").read_text())
    repository = config["repository"]["url"]
    book = Book(root=root, html_url=html_book_url(repository), repository_url=repository)
    sources = sorted((root / "book").glob("*.md")) + sorted((root / "book").glob("*.ipynb"))
    for path in sources:
        doc = f"book/{path.stem}"
        text = "\n\n".join(_markdown_texts(path))
        title = re.search(r"^#\s+(.+?)\s*$", text, re.M)
        book.titles[doc] = title.group(1) if title else path.stem
        for match in re.finditer(r"^\(([\w-]+)\)=\s*\n+#+\s+(.+?)\s*$", text, re.M):
            book.labels[match.group(1)] = (doc, match.group(2))
        for match in re.finditer(r"^```\{glossary\}[^\n]*\n(.*?)^```\s*$", text, re.M | re.S):
            for term, _ in _glossary_entries(_options(match.group(1).split("\n"))[1]):
                book.terms[term.lower()] = term
    book.citations = _read_citations(root / "book" / "references.bib")
    mermaid_js = root / "book" / "_static" / "vendor" / "mermaid" / "mermaid.min.js"
    book.diagrams = render_svgs(book_diagram_sources(root / "book"), root / "book" / "_diagrams", mermaid_js)
    return book


# ------------------------------------------------------------------------------ roles

def _glue_values(notebook: dict) -> dict:
    """name -> text of every value the chapter glued (myst-nb's stored display outputs)."""
    values = {}
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            scrap = output.get("metadata", {}).get("scrapbook")
            if scrap:
                text = "".join(output["data"].get(scrap.get("mime_prefix", "") + "text/plain", ""))
                try:
                    value = ast.literal_eval(text)
                    values[scrap["name"]] = value if isinstance(value, str) else text
                except (ValueError, SyntaxError):
                    values[scrap["name"]] = text
    return values


def _target(content: str) -> tuple[str | None, str]:
    """``text <target>`` → (text, target); ``target`` → (None, target)."""
    match = _EXPLICIT.match(content.strip())
    return (match.group(1).strip(), match.group(2).strip()) if match else (None, content.strip())


def _doc_name(target: str, here: str) -> str:
    """A {doc} target relative to the document ``here`` (``book/01_definition``), as ``book/NAME``."""
    parts = (here.rsplit("/", 1)[0] + "/" + target).split("/") if not target.startswith("/") else target[1:].split("/")
    resolved = []
    for part in parts:
        if part == "..":
            resolved.pop()
        elif part not in ("", "."):
            resolved.append(part)
    return "/".join(resolved).removesuffix(".ipynb").removesuffix(".md")


def _citation(keys: str, kind: str, book: Book) -> str:
    cited = []
    for key in (k.strip() for k in keys.split(",")):
        if key not in book.citations:
            raise KeyError(f"citation key {key!r} is not in references.bib")
        authors, year, url = book.citations[key]
        if kind in ("cite:t", "cite:ts"):
            cited.append(f"[{authors} ({year})]({url})" if url else f"{authors} ({year})")
        else:
            cited.append(f"[{authors} {year}]({url})" if url else f"{authors} {year}")
    return ", ".join(cited) if kind in ("cite:t", "cite:ts") else "(" + "; ".join(cited) + ")"


def _term_anchor(term: str) -> str:
    """The id Sphinx gives a glossary term in the HTML book (case kept: ``term-QK-Norm``)."""
    from sphinx.util.nodes import _make_id

    return _make_id("term-" + term)


def resolve_roles(text: str, *, doc: str, glue: dict, book: Book) -> str:
    """Replace every role of a Markdown text (outside code) by plain Markdown."""
    def replace(match):
        role, content = match.groups()
        if role in ("glue", "glue:text", "glue:md"):
            name, _, spec = (part.strip() for part in content.partition(":"))
            if name not in glue:
                raise KeyError(f"{doc}: no glued value {name!r}")
            return format(float(glue[name]), spec) if spec else glue[name]   # myst-nb's `name:.2f`
        if role.startswith("cite"):
            return _citation(content, role, book)
        if role == "math":
            return f"${content}$"
        text, target = _target(content)
        if role == "doc":
            name = _doc_name(target, doc)
            return f"[{text or book.titles[name]}]({book.html_url}{name}.html)"
        if role == "ref":
            if target not in book.labels:
                raise KeyError(f"{doc}: unknown label {target!r}")
            name, heading = book.labels[target]
            return f"[{text or heading}]({book.html_url}{name}.html#{target})"
        if role == "term":                          # Sphinx finds a term in any case; its id keeps the glossary's
            if target.lower() not in book.terms:
                raise KeyError(f"{doc}: no glossary term {target!r}")
            anchor = _term_anchor(book.terms[target.lower()])
            return f"[{text or target}]({book.html_url}book/06_glossary.html#{anchor})"
        return match.group(0)

    return ROLE.sub(replace, text)


def unresolved_roles(text: str) -> list[str]:
    """Roles left in a Markdown text outside code spans and fenced code (the edition has none)."""
    prose = re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.M | re.S)
    prose = re.sub(r"``.+?``", "", prose)          # a role shown as code; one backtick cannot hold one
    return [m.group(0) for m in ROLE.finditer(prose)]


# ------------------------------------------------------------------------- directives

def _options(body: list[str]) -> tuple[dict, list[str]]:
    options, rest = {}, list(body)
    while rest and re.match(r"^\s*:[\w-]+:", rest[0]):
        name, _, value = rest.pop(0).strip()[1:].partition(":")
        options[name] = value.strip()
    while rest and not rest[0].strip():
        rest.pop(0)
    return options, rest


def _literal_include(argument: str, options: dict, base: Path) -> str:
    path = (base / argument).resolve()
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if "pyobject" in options:
        node = next((n for n in ast.parse(text).body if getattr(n, "name", None) == options["pyobject"]), None)
        if node is None:
            raise ValueError(f"{argument} has no top-level {options['pyobject']!r}")
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        lines = lines[start - 1:node.end_lineno]
    if "lines" in options:
        first, _, last = options["lines"].partition("-")
        lines = lines[int(first) - 1:int(last) if last else int(first)]
    if "start-after" in options:
        lines = lines[next(i for i, l in enumerate(lines) if options["start-after"] in l) + 1:]
    if "end-before" in options:
        lines = lines[:next(i for i, l in enumerate(lines) if options["end-before"] in l)]
    fence = "````" if any(l.startswith("```") for l in lines) else "```"
    return f"{fence}{options.get('language', '')}\n" + "\n".join(lines) + f"\n{fence}"


def _glossary_entries(body: list[str]) -> list[list]:
    """[term, definition lines] of each entry of a glossary directive's body (options removed)."""
    entries, current = [], None
    for line in body:
        if line.strip() and not line.startswith((" ", "\t")):
            current = [line.strip(), []]
            entries.append(current)
        elif current is not None:
            current[1].append(line.strip())
    return entries


def _glossary(options: dict, body: list[str], resolve) -> str:
    entries = _glossary_entries(body)
    if "sorted" in options:
        entries.sort(key=lambda e: e[0].lower())
    items = [f'- <a id="{_term_anchor(term)}"></a>**{term}**: ' + resolve(" ".join(l for l in text if l))
             for term, text in entries]
    return "\n".join(items)


@dataclass
class _Context:
    doc: str
    base: Path
    glue: dict
    book: Book
    attachments: dict


def _transform(lines: list[str], ctx: _Context) -> list[str]:
    """Markdown lines with directives expanded and roles resolved (fenced code kept verbatim)."""
    out, prose, i = [], [], 0

    def flush():
        if prose:
            text = "\n".join(l for l in prose if not re.match(r"^\([\w-]+\)=\s*$", l))
            out.extend(resolve_roles(text, doc=ctx.doc, glue=ctx.glue, book=ctx.book).split("\n"))
            prose.clear()

    while i < len(lines):
        opening = _FENCE_OPEN.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, name, argument = opening.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence)) and lines[j].strip().strip(fence[0]) == ""),
                   len(lines))
        body = lines[i + 1:end]
        flush()
        out.extend(_directive(name.strip("{}") if name.startswith("{") else None, name, argument, fence, body, ctx))
        i = end + 1
    flush()
    return out


def _directive(directive, name, argument, fence, body, ctx: _Context) -> list[str]:
    if directive is None and name != "mermaid":                   # plain code: verbatim
        return [f"{fence}{name}{(' ' + argument) if argument else ''}", *body, fence]
    options, content = _options(body)
    if directive == "mermaid" or name == "mermaid":
        source = "\n".join(content).strip()
        svg = standalone_svg(ctx.book.diagrams[source])
        key = re.search(r'id="(mermaid-[0-9a-f]+)"', svg).group(1)
        ctx.attachments[f"{key}.svg"] = {"image/svg+xml": base64.b64encode(svg.encode()).decode()}
        return [f"![{options.get('alt') or options.get('caption') or 'diagram'}](attachment:{key}.svg)"]
    if directive == "literalinclude":
        return _literal_include(argument, options, ctx.base).split("\n")
    if directive == "include":
        included = (ctx.base / argument).read_text(encoding="utf-8").split("\n")
        return _transform(included, ctx)
    if directive == "glossary":
        return _glossary(options, content, lambda t: resolve_roles(t, doc=ctx.doc, glue=ctx.glue, book=ctx.book)
                         ).split("\n")
    inner = _transform(content, ctx)
    title = resolve_roles(argument or directive.capitalize(), doc=ctx.doc, glue=ctx.glue, book=ctx.book)
    if "dropdown" in options.get("class", "").split():
        return ["<details>", f"<summary>{title}</summary>", "", *inner, "", "</details>"]
    return [f"> **{title}**", ">", *[f"> {l}" if l else ">" for l in inner]]


# --------------------------------------------------------------------------- notebooks

#: Cell tags that hide a cell's code in the HTML book; the edition folds those cells in Colab.
HIDDEN_TAGS = {"remove-cell", "remove-input", "hide-input", "hide-cell"}


def _fold(cell: dict) -> None:
    """Fold a code cell the HTML book hides: Colab shows a cell with a ``#@title`` line in form
    view as its title only (a click shows the code); elsewhere the line is a comment. The title
    is the cell's leading comment, or "Show code"."""
    lines = "".join(cell["source"]).split("\n")
    title = re.split(r"[.:;]", lines[0].lstrip("# "))[0].strip() if lines[0].startswith("#") else ""
    cell["source"] = [f"#@title {title or 'Show code'}\n"] + cell["source"]
    cell["metadata"]["cellView"] = "form"


def edition_notebook(path: Path, book: Book) -> dict:
    """The Colab edition of one executed chapter."""
    notebook = copy.deepcopy(json.loads(path.read_text(encoding="utf-8")))
    doc = f"book/{path.stem}"
    glue = _glue_values(notebook)
    first_code = True
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            ctx = _Context(doc=doc, base=path.parent, glue=glue, book=book, attachments={})
            text = "\n".join(_transform("".join(cell["source"]).split("\n"), ctx))
            cell["source"] = text.splitlines(keepends=True)
            if ctx.attachments:
                cell["attachments"] = ctx.attachments
        elif cell["cell_type"] == "code" and first_code:
            first_code = False
            cell["source"] = SETUP_CELL.format(repository=book.repository_url).splitlines(keepends=True)
            cell["outputs"], cell["execution_count"] = [], None
            _fold(cell)
        elif (cell["cell_type"] == "code" and HIDDEN_TAGS & set(tags := cell["metadata"].get("tags", []))
              and "parameters" not in tags):                          # readers change parameters
            _fold(cell)
    notebook["metadata"]["colab"] = {"name": path.name, "provenance": []}
    return notebook


def write_edition(root: Path = ROOT, out: Path | None = None, chapters: list[Path] | None = None) -> list[Path]:
    """Write the edition of ``chapters`` (default: every chapter of ``root/book``, and then the
    editions of chapters that no longer exist are deleted) to ``out`` (default ``root/colab/book``)."""
    out = out or root / "colab" / "book"
    out.mkdir(parents=True, exist_ok=True)
    book = read_book(root)
    written, failed = [], {}
    for path in chapters or sorted((root / "book").glob("*.ipynb")):
        try:
            edition = edition_notebook(path, book)
        except (KeyError, ValueError) as error:        # e.g. a chapter stored before it was executed
            failed[path.name] = error
            continue
        target = out / path.name
        target.write_text(json.dumps(edition, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(target)
    if not chapters:
        names = {p.name for p in (root / "book").glob("*.ipynb")}
        for stale in out.glob("*.ipynb"):
            if stale.name not in names:
                stale.unlink()
    if failed:
        raise ValueError("no edition for " + "; ".join(f"{name}: {error}" for name, error in failed.items()))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normtools.book.colab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    parser.add_argument("--out", type=Path, help="folder for the edition (default: ROOT/colab/book)")
    parser.add_argument("chapters", nargs="*", type=Path, help="only these chapters (default: all)")
    args = parser.parse_args(argv)
    try:
        written = write_edition(args.root, args.out, args.chapters)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

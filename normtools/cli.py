"""Command line: ``normtools card|diff|bench|lab ...`` (also ``python -m normtools``).

Every failure ends the same way: one line ``normtools COMMAND: error: ...`` on stderr (at most
``MAX_ERROR_CHARS`` characters) and exit code 2; never a traceback. Output that the terminal's
encoding cannot hold degrades to ASCII spellings (x̂ -> x_hat, ≥ -> >=) instead of crashing.
"""

import argparse
import codecs
import os
import sys
import unicodedata
from importlib import import_module

# Each subcommand lives next to the code it drives; the module exposes
# ``add_cli(subparsers)``, which registers its parser and sets ``func`` (args -> exit code).
_COMMAND_MODULES = ("normtools.cards.cli", "normtools.measure.bench", "normtools.lab.studies")


MAX_ERROR_CHARS = 500
# Bad input: the project's errors are ValueErrors (SpecError, SafetensorsHeaderError, PatchError,
# JSON and Unicode errors), a file that cannot be read is an OSError, a nesting too deep for the
# JSON parser a RecursionError. Anything else is a bug, reported as one line too (set
# NORMTOOLS_TRACEBACK=1 to see its traceback).
BAD_INPUT = (ValueError, OSError, RecursionError)


class CommandLineError(Exception):
    """Bad arguments: raised by the parser instead of printing its usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CommandLineError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="normtools", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        import_module(name).add_cli(subparsers)
    return parser


def one_line(text, limit=MAX_ERROR_CHARS) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 25] + f" ... ({len(line)} characters)"


def main(argv=None) -> int:
    """Run one command; returns its exit code (2 for bad input, 1 for a bug, 130 on Ctrl-C)."""
    for stream in (sys.stdout, sys.stderr):
        degrade_to_ascii(stream)
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = " ".join(["normtools", *[a for a in argv if not a.startswith("-")][:1]])
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as exit:  # --help, or a command that exits on its own
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 2)
    except KeyboardInterrupt:
        print("normtools: interrupted", file=sys.stderr)
        return 130
    except (CommandLineError, *BAD_INPUT) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, unless asked for the traceback
        if os.environ.get("NORMTOOLS_TRACEBACK"):
            raise
        print(f"{prog}: internal error: {one_line(f'{type(e).__name__}: {e}')} "
              "(NORMTOOLS_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1


# ASCII spellings of the characters normtools prints, for a terminal that cannot encode them
# (Windows writes redirected output as cp1252); any other character becomes \uXXXX.
ASCII_SPELLINGS = {"\u0302": "_hat", "≥": ">=", "≤": "<=", "≈": "~", "→": "->", "×": "x", "·": "*",
                   "–": "-", "—": "-", "−": "-", "⊙": "*", "√": "sqrt", "²": "^2", "σ": "sigma",
                   "β": "beta", "γ": "gamma", "ε": "eps", "µ": "u", "μ": "u", "Σ": "sum"}


def _ascii_spelling(error):
    bad = error.object[error.start:error.end]
    spelled = "".join(ASCII_SPELLINGS.get(ch) or unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
                      or f"\\u{ord(ch):04x}" for ch in bad)
    return spelled, error.end


codecs.register_error("normtools-ascii", _ascii_spelling)


def degrade_to_ascii(stream) -> None:
    """Let ``stream`` write what its encoding cannot hold as ASCII spellings (``ASCII_SPELLINGS``)."""
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="normtools-ascii")


if __name__ == "__main__":
    sys.exit(main())

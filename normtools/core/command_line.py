"""The command line's one error path, shared by ``normtools`` and ``python -m
normtools.measure.bench``: :func:`run_command` parses the arguments and runs the command, and
every failure ends the same way, one line ``PROG: error: ...`` on stderr (at most
``MAX_ERROR_CHARS`` characters) and exit code 2, never a traceback. Output that the terminal's
encoding cannot hold degrades to ASCII spellings (x̂ -> x_hat, ≥ -> >=) instead of crashing.
"""

import argparse
import codecs
import os
import sys
import unicodedata

MAX_ERROR_CHARS = 500
# Bad input: normtools' errors are ValueErrors (SpecError, SafetensorsHeaderError, PatchError),
# as are JSON and Unicode errors; a file that cannot be read is an OSError; nesting too deep to
# parse a RecursionError. Anything else is a bug, reported on one line too, with exit code 1
# (NORMTOOLS_TRACEBACK=1 shows its traceback).
BAD_INPUT = (ValueError, OSError, RecursionError)


class CommandLineError(Exception):
    """Bad arguments: what :class:`Parser` raises instead of printing its usage and exiting."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` (and, through ``add_subparsers``, its subparsers) whose argument
    errors reach :func:`run_command` as :class:`CommandLineError`."""

    def error(self, message):
        raise CommandLineError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 1 (a count of seeds, threads, processes)."""
    value = int(text)
    if value < 1:
        raise ValueError(f"{text} is not a positive integer")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 0 (a count of warm-up samples)."""
    value = int(text)
    if value < 0:
        raise ValueError(f"{text} is negative")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (a time budget in seconds)."""
    value = float(text)
    if not (0 < value < float("inf")):
        raise ValueError(f"{text} is not a positive finite number")
    return value


def device_name(text: str) -> str:
    """An argparse ``type``: "auto" or a device torch knows (cpu, cuda, cuda:N, ...)."""
    import torch

    if text != "auto":
        try:
            torch.device(text)
        except RuntimeError:
            raise ValueError(f"{text} is not a torch device") from None
    return text


def one_line(text, limit=MAX_ERROR_CHARS) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 25] + f" ... ({len(line)} characters)"


def run_command(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``parser`` and return ``args.func(args)``:
    the exit code; 2 for bad arguments or input, 1 for a bug, 130 on Ctrl-C."""
    for stream in (sys.stdout, sys.stderr):
        degrade_to_ascii(stream)
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = " ".join([parser.prog, *[a for a in argv if not a.startswith("-")][:1]]) \
        if parser._subparsers else parser.prog
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as exit:  # --help
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
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
    spelled = "".join(
        ASCII_SPELLINGS.get(ch)
        or unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
        or f"\\u{ord(ch):04x}"
        for ch in error.object[error.start:error.end])
    return spelled, error.end


codecs.register_error("normtools-ascii", _ascii_spelling)


def degrade_to_ascii(stream) -> None:
    """Let ``stream`` write what its encoding cannot hold as ASCII spellings (``ASCII_SPELLINGS``)."""
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="normtools-ascii")

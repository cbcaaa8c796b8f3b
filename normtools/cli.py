"""Command line: ``normtools card|diff|bench|lab ...`` (also ``python -m normtools``).

Every failure ends in one line on stderr and a non-zero exit code, never a traceback; output
degrades to ASCII where the terminal's encoding cannot hold it (``normtools.core.command_line``).
"""

import sys
from importlib import import_module

from normtools.core.command_line import Parser, run_command

# Each subcommand lives next to the code it drives; the module exposes
# ``add_cli(subparsers)``, which registers its parser and sets ``func`` (args -> exit code).
# Errors propagate to run_command, the one error path.
_COMMAND_MODULES = ("normtools.cards.cli", "normtools.measure.bench", "normtools.lab.study_cli")


def build_parser() -> Parser:
    parser = Parser(prog="normtools", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        import_module(name).add_cli(subparsers)
    return parser


def main(argv=None) -> int:
    """Run one ``normtools`` command; returns its exit code (2 for bad input)."""
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

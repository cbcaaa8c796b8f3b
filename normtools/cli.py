"""Command line: ``normtools card|diff|bench|lab ...`` (also ``python -m normtools``)."""

import argparse
import sys
from importlib import import_module

# Each subcommand lives next to the code it drives; the module exposes
# ``add_cli(subparsers)``, which registers its parser and sets ``func`` (args -> exit code).
_COMMAND_MODULES = ("normtools.cards.cli", "normtools.measure.bench", "normtools.lab.studies")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normtools", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        import_module(name).add_cli(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

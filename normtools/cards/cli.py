"""``normtools card`` and ``normtools diff``."""

import json
import sys

from normtools.cards.params import count_parameters
from normtools.cards.render import card, diff_table
from normtools.cards.safetensors_header import SafetensorsHeaderError
from normtools.cards.sources import bundled_configs, load
from normtools.cards.types import SpecError, diff


def _run_card(args) -> int:
    spec, config = load(args.source)
    if args.json:
        print(json.dumps({"spec": spec.to_dict(), "parameters": count_parameters(config)}, indent=2))
    else:
        print(card(spec, count_parameters(config)))
    return 0


def _run_diff(args) -> int:
    a, _ = load(args.a)
    b, _ = load(args.b)
    if args.json:
        print(json.dumps({k: list(v) for k, v in diff(a, b).items()}, indent=2))
    else:
        print(diff_table(a, b, (args.a, args.b)) if diff(a, b) else "no differences")
    return 0


def _reporting_errors(run):
    """Run a command; bad input prints one line on stderr and exits with code 2."""
    def wrapper(args) -> int:
        try:
            return run(args)
        except (SpecError, SafetensorsHeaderError, OSError) as e:
            print(f"normtools {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    return wrapper


def add_cli(subparsers) -> None:
    """Register ``normtools card`` and ``normtools diff``."""
    card_parser = subparsers.add_parser(
        "card", help="print a model's norm card",
        description="Print the norm card of a checkpoint directory, a config.json or a bundled config "
                    f"({', '.join(bundled_configs())}).")
    card_parser.add_argument("source", metavar="PATH_OR_CONFIG")
    card_parser.add_argument("--json", action="store_true", help="print the spec and counts as JSON")
    card_parser.set_defaults(func=_reporting_errors(_run_card))
    diff_parser = subparsers.add_parser("diff", help="print every norm-spec field that differs")
    diff_parser.add_argument("a", metavar="A")
    diff_parser.add_argument("b", metavar="B")
    diff_parser.add_argument("--json", action="store_true", help="print {field: [A, B]} as JSON")
    diff_parser.set_defaults(func=_reporting_errors(_run_diff))

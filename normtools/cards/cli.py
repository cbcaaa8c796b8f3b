"""``normtools card``, ``normtools diff`` and ``normtools atlas``. Errors propagate to
``normtools.cli.main``, the command line's one error path."""

import json
import sys
from pathlib import Path

from normtools.cards import atlas
from normtools.cards.params import count_parameters
from normtools.cards.render import card, diff_table
from normtools.cards.sources import bundled_configs, load
from normtools.cards.types import SpecError, diff
from normtools.core.command_line import CommandLineError


def _load_any(source):
    """(spec, config dict or None): a checkpoint, config.json or bundled config, else an atlas
    family (a model type of transformers, probed; no parameter counts)."""
    try:
        return load(source)
    except SpecError as not_a_file:
        if Path(source).exists():
            raise
        committed = atlas.load_atlas()
        if source in committed["families"] or source in committed["not_probed"]:
            return atlas.atlas_spec(source, committed), None
        raise SpecError(f"{not_a_file} or an atlas family (normtools atlas)") from None


def _run_card(args) -> int:
    spec, config = _load_any(args.source)
    counts = count_parameters(config) if config is not None else None
    if args.json:
        print(json.dumps({"spec": spec.to_dict(), "parameters": counts}, indent=2))
    else:
        print(card(spec, counts))
    return 0


def _run_diff(args) -> int:
    a, _ = _load_any(args.a)
    b, _ = _load_any(args.b)
    if args.json:
        print(json.dumps({k: list(v) for k, v in diff(a, b).items()}, indent=2))
    else:
        print(diff_table(a, b, (args.a, args.b)) if diff(a, b) else "no differences")
    return 0


def _check_atlas_flags(args) -> None:
    """:class:`CommandLineError` for flags that ask for two different things (only --refresh and
    --reprobe go together) or a --reprobe name that is not a causal-LM model type."""
    given = [flag for flag, on in (("--json", args.json), ("--compare", args.compare is not None),
                                   ("--refresh", args.refresh), ("--reprobe", args.reprobe is not None)) if on]
    if len(given) > 1 and given != ["--refresh", "--reprobe"]:
        raise CommandLineError(f"{' and '.join(given)} cannot be combined (only --refresh with --reprobe)")
    unknown = sorted(set(args.reprobe) - set(atlas.causal_lm_model_types())) if args.reprobe else ()
    if unknown:
        from transformers import __version__

        raise CommandLineError(f"--reprobe: {', '.join(unknown)}: not a causal-LM model type of "
                               f"transformers {__version__}")


def _check_same_probe(committed: dict) -> None:
    """:class:`CommandLineError` unless ``committed`` was probed by the installed transformers and
    probe version: re-probed families written into it must not mix versions."""
    from transformers import __version__

    if (committed["transformers"], committed["probe_version"]) != (__version__, atlas.PROBE_VERSION):
        raise CommandLineError(
            f"--refresh --reprobe: the atlas is of transformers {committed['transformers']} (probe "
            f"v{committed['probe_version']}), not the installed {__version__} (probe v{atlas.PROBE_VERSION}); "
            "re-probe every family with --refresh alone")


def _run_atlas(args) -> int:
    _check_atlas_flags(args)
    committed = atlas.load_atlas(args.atlas)
    if args.compare is not None:
        other = atlas.load_atlas(args.compare)
        print(json.dumps(atlas.compare_atlases(committed, other), indent=2))
        return 0
    if args.refresh or args.reprobe is not None:
        types = args.reprobe or None
        if args.refresh and types:
            _check_same_probe(committed)
        fresh = atlas.build_atlas(types, progress=lambda t, result: print(f"{t}: {result}", file=sys.stderr))
        compared = committed
        if types:  # compare only what was re-probed
            compared = {**committed, "families": {t: r for t, r in committed["families"].items() if t in types},
                        "not_probed": {t: r for t, r in committed["not_probed"].items() if t in types}}
        changes = atlas.compare_atlases(compared, fresh)
        print(json.dumps({"transformers": [committed["transformers"], fresh["transformers"]],
                          "probe_version": [committed["probe_version"], fresh["probe_version"]], **changes}, indent=2))
        if args.refresh:
            if types:  # replace only the re-probed rows: each type is in one of fresh's two lists
                fresh = {**fresh, **{key: {**{t: r for t, r in committed[key].items() if t not in types}, **fresh[key]}
                                     for key in ("families", "not_probed")}}
            atlas.save_atlas(fresh, args.atlas)
            print(f"atlas: {len(fresh['families'])} families probed, {len(fresh['not_probed'])} listed "
                  "with a reason", file=sys.stderr)
            return 0
        return 1 if any(changes.values()) else 0
    if args.json:
        print(json.dumps(committed, indent=1, sort_keys=True))
        return 0
    rows = atlas.atlas_rows(committed)
    print(f"# norm atlas of transformers {committed['transformers']} (probe v{committed['probe_version']}): "
          f"{len(rows)} families probed, {len(committed['not_probed'])} not\n")
    if rows:
        header = list(rows[0])
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    print("\n| not probed | reason |\n|---|---|")
    for t, reason in sorted(committed["not_probed"].items()):
        print(f"| {t} | {reason.replace('|', '/')} |")
    return 0


def add_cli(subparsers) -> None:
    """Register ``normtools card`` and ``normtools diff``."""
    card_parser = subparsers.add_parser(
        "card", help="print a model's norm card",
        description="Print the norm card of a checkpoint directory, a config.json or a bundled config "
                    f"({', '.join(bundled_configs())}).")
    card_parser.add_argument("source", metavar="PATH_OR_CONFIG")
    card_parser.add_argument("--json", action="store_true", help="print the spec and counts as JSON")
    card_parser.set_defaults(func=_run_card)
    diff_parser = subparsers.add_parser("diff", help="print every norm-spec field that differs")
    diff_parser.add_argument("a", metavar="A")
    diff_parser.add_argument("b", metavar="B")
    diff_parser.add_argument("--json", action="store_true", help="print {field: [A, B]} as JSON")
    diff_parser.set_defaults(func=_run_diff)
    atlas_parser = subparsers.add_parser(
        "atlas", help="the norm atlas of every causal-LM family of transformers",
        description="Print the committed atlas (probed from the running transformers code), "
                    "re-probe it, or compare two atlases.")
    atlas_parser.add_argument("--json", action="store_true", help="print the whole atlas as JSON")
    atlas_parser.add_argument("--refresh", action="store_true",
                              help="re-probe every family and rewrite the atlas file (a few minutes); with --reprobe "
                                   "MODEL_TYPE...: re-probe those and replace only their rows")
    atlas_parser.add_argument("--reprobe", nargs="*", metavar="MODEL_TYPE",
                              help="re-probe these families (none given: all) and print what changed "
                                   "against the atlas file; exit code 1 if anything did (0 with --refresh)")
    atlas_parser.add_argument("--compare", metavar="OTHER_JSON", help="print what changed from the atlas to OTHER_JSON")
    atlas_parser.add_argument("--atlas", metavar="PATH", help="the atlas file (default: the committed one)")
    atlas_parser.set_defaults(func=_run_atlas)

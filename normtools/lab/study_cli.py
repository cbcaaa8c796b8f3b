"""``normtools lab``: train a committed study (``run``, ``--shard`` for parts), join its parts
(``merge``), run a committed probe at initialization (``probe``), check one committed seed again
(``rerun``) and list the studies (``list``); the work is in :mod:`normtools.lab.studies` and
:mod:`normtools.lab.reproduce`.
"""

import json
from pathlib import Path

import torch

from normtools.core.command_line import device_name, positive_int
from normtools.lab import grid, reproduce, studies, study_files

#: Where ``normtools lab run`` writes a study by default (relative to the repository root).
_DEFAULT_DIR = Path("book") / "data" / "studies"

def add_cli(subparsers):
    """Register ``normtools lab run STUDY``, ``lab probe PROBE``, ``lab rerun FILE``,
    ``lab merge OUT PARTS...`` and ``lab list``."""
    parser = subparsers.add_parser("lab", help="the stability lab's committed studies",
                                   description=studies.__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="lab_command", required=True)
    run = commands.add_parser("run", help="train a study and write its JSON")
    run.add_argument("study", choices=sorted(studies.STUDIES))
    run.add_argument("--size", default="cpu", choices=sorted(grid.STABILITY_SIZES))
    run.add_argument("--seeds", type=positive_int, default=None,
                     help="number of seeds S, trained as seeds 0 to S-1 (default: the study's)")
    run.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    run.add_argument("--max-runs", type=positive_int, default=None,
                     help="stop after this many new runs (rerun the command to resume)")
    run.add_argument("--shard", type=_shard, default=None, metavar="I/K",
                     help="train only seeds I, I+K, I+2K, ... of the study's (0 <= I < K), into "
                          "its own --out; 'normtools lab merge' joins the K files")
    run.add_argument("--device", default="cpu", type=device_name)
    run.add_argument("--out", default=None, help="output path (default book/data/studies/STUDY.json"
                                                 " for size cpu, STUDY-SIZE.json otherwise)")
    run.set_defaults(func=_run_cli)
    probe = commands.add_parser("probe", help="run a committed probe at initialization (no training)")
    probe.add_argument("probe", choices=sorted(studies.INIT_PROBES))
    probe.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    probe.add_argument("--out", default=None, help="output path (default book/data/studies/PROBE.json)")
    probe.set_defaults(func=_probe_cli)
    again = commands.add_parser("rerun", help="train one committed seed again and compare (a "
                                              "reproducibility check)")
    again.add_argument("file", help="a committed study, e.g. book/data/studies/placements.json")
    again.add_argument("--variant", default=None, help="default: the study's check configuration")
    again.add_argument("--lr", type=float, default=None)
    again.add_argument("--seed", type=int, default=None)
    again.add_argument("--threads", type=positive_int, default=1,
                       help="with --json: torch CPU threads (default 1)")
    again.add_argument("--json", action="store_true",
                       help="train in this process and print the configuration, the record and the "
                            "CPU capability as JSON (without it: in a process on the committed path)")
    again.set_defaults(func=_rerun_cli)
    merge = commands.add_parser("merge", help="join the files of one study trained in parts")
    merge.add_argument("out", help="the study file to write, e.g. book/data/studies/related.json")
    merge.add_argument("parts", nargs="+", help="the files of the parts (shards)")
    merge.set_defaults(func=_merge_cli)
    listing = commands.add_parser("list", help="the studies and what each asks")
    listing.set_defaults(func=_list_cli)
    return parser


def _run_cli(args) -> int:
    device = _training_device(args.device)
    torch.set_num_threads(args.threads)
    seeds = range(args.seeds) if args.seeds is not None else None
    suffix = "" if args.size == "cpu" else f"-{args.size}"
    path = Path(args.out or _DEFAULT_DIR / f"{args.study}{suffix}.json")
    document = studies.run_study(args.study, args.size, seeds, device, out=path, max_runs=args.max_runs,
                         shard=args.shard)
    state = "complete" if document["complete"] else "incomplete (rerun the command to resume)"
    print(f"{args.study}: {len(document['runs'])} of {document['conditions']['n_runs']} runs, "
          f"{document['conditions']['wall_seconds']} s of training -> {path}, {state}")
    return 0


def _probe_cli(args) -> int:
    torch.set_num_threads(args.threads)
    path = Path(args.out or _DEFAULT_DIR / f"{args.probe}.json")
    document = studies.run_init_probe(args.probe, out=path)
    print(f"{args.probe}: {len(document['runs'])} rows, {document['conditions']['wall_seconds']} s -> "
          f"{path}, {'complete' if document['complete'] else 'incomplete (rerun to resume)'}")
    return 0


def _training_device(name: str) -> str:
    """The device ``--device NAME`` trains on ("auto": cuda when available, else cpu);
    ``ValueError`` for one that cannot hold and compute a tensor here (cuda without a GPU,
    meta), before any training starts."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    try:
        torch.ones(1, device=device).add(1).item()
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        raise ValueError(f"--device {name} cannot train here: {e}") from None
    return device


def _shard(text: str) -> tuple[int, int]:
    """An argparse ``type``: "I/K" with 0 <= I < K."""
    index, _, count = text.partition("/")
    index, count = int(index), int(count)
    if not 0 <= index < count:
        raise ValueError(f"{text}: expected I/K with 0 <= I < K")
    return index, count


def _merge_cli(args) -> int:
    document = studies.merge_studies(args.parts, out=args.out)
    state = "complete" if document["complete"] else "incomplete"
    print(f"{document['study']}: {len(document['runs'])} of {document['conditions']['n_runs']} runs "
          f"from {len(args.parts)} files -> {args.out}, {state}")
    return 0


def _rerun_cli(args) -> int:
    """``--json``: train here and print (the process the parent pinned). Otherwise train in a
    process held to the committed numeric path and print the comparison."""
    document = study_files.read_study(args.file)
    if args.json:
        torch.set_num_threads(args.threads)
        chosen, record = reproduce.rerun(document, args.variant, args.lr, args.seed)
        print(json.dumps({"chosen": chosen, "record": record,
                          "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}))
        return 0
    chosen, record, capability = reproduce.rerun_on_committed_path(args.file, args.variant, args.lr,
                                                                   args.seed)
    machine = document["conditions"]["machine"]
    print(f"{document['study']}: {chosen}, on ATen {capability} with {machine['torch_threads']} "
          f"thread(s) (committed on {machine['aten_cpu_capability']})")
    print(reproduce.compare_rerun(document, chosen, record).to_string(index=False))
    return 0


def _list_cli(args) -> int:
    for name, study in studies.STUDIES.items():
        print(f"{name}: {study.question}")
    return 0

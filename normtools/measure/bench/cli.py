"""``normtools bench`` and ``python -m normtools.measure.bench``."""

import os
from pathlib import Path

import torch

from normtools.core.command_line import (CommandLineError, Parser, device_name,
                                         nonnegative_int, positive_float, positive_int,
                                         run_command)
from normtools.core.precision import compute_dtype
from normtools.measure.bench.cases import PHASES, gpu_run_cases, plan_rows
from normtools.measure.bench.shapes import _DTYPES, BACKENDS, OPS
from normtools.measure.bench.backends import default_backends
from normtools.measure.bench.report import markdown_summary
from normtools.measure.bench.results import read_results
from normtools.measure.bench.sweep import run_sweep
from normtools.measure.bench.timing import TIMERS, sample_counts, timer_for

# --------------------------------------------------------------------------------------- CLI

_DESCRIPTION = ("Time the normalization ops on every backend over a sweep of shapes; write the "
                "results, the copy bandwidth and the run conditions as JSON.")
# Every option's dest (all default to None or False, so that a given one can be told apart),
# and the options that --report and --cpu-table take: any other given with them is refused.
_OPTIONS = ("device", "dtype", "ops", "backends", "quick", "cases", "phases", "dry_run", "warmup",
            "reps", "timer", "threads", "processes", "budget_s", "out", "summary", "report",
            "cpu_table")
_MODE_OPTIONS = {"report": {"report", "summary"},
                 "cpu_table": {"cpu_table", "quick", "reps", "warmup", "threads", "out", "summary"}}


def bench_device(text: str) -> str:
    """An argparse ``type``: "auto", or a cpu or cuda device (the devices bench can time)."""
    if text != "auto" and torch.device(device_name(text)).type not in ("cpu", "cuda"):
        raise ValueError(f"{text} is not a cpu or cuda device")
    return text


def _add_arguments(parser):
    parser.add_argument("--device", type=bench_device,
                        help="cpu, cuda, cuda:N or auto (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="activation and weight dtype (default: bfloat16 on CUDA, float16 "
                             "on a GPU without bfloat16 arithmetic, float32 on CPU)")
    parser.add_argument("--ops", nargs="+", choices=OPS, metavar="OP",
                        help=f"ops to time (default: all): {', '.join(OPS)}")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, metavar="BACKEND",
                        help=f"backends to run (default: all that apply to the device): "
                             f"{', '.join(BACKENDS)}")
    parser.add_argument("--quick", action="store_true", help="one tiny shape per op, 3 samples")
    parser.add_argument("--cases", choices=("default", "gpu-run"),
                        help="default (the default): the device's default shapes; gpu-run: a "
                             "first pass of the target ops, the bundled models' real shapes "
                             "(prefill and decode), then the full sweep, each synthetic case "
                             "≥ 256 MiB")
    parser.add_argument("--phases", nargs="+", choices=PHASES, metavar="PHASE",
                        help="with --cases gpu-run: which of 'first pass', 'real shapes', "
                             "'sweep' to run (default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (cases, bytes, estimated time against --budget-s) "
                             "and exit; times nothing")
    parser.add_argument("--warmup", type=nonnegative_int, help="warm-up samples")
    parser.add_argument("--reps", type=positive_int, help="timed samples")
    parser.add_argument("--timer", choices=sorted(TIMERS),
                        help="events (CUDA default), do_bench (CUDA, Triton's timer, for a "
                             "cross-check) or wall (CPU)")
    parser.add_argument("--threads", type=positive_int,
                        help="torch intra-op threads for the run (recorded in the conditions)")
    parser.add_argument("--processes", type=positive_int,
                        help="time each case in this many processes at once (concurrency; "
                             "recorded in the conditions and rows, default 1)")
    parser.add_argument("--budget-s", type=positive_float,
                        help="start no new case after this many seconds")
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--summary", help="write the Markdown summary here")
    parser.add_argument("--report", metavar="RESULTS_JSON",
                        help="only print the Markdown summary of an existing results file")
    parser.add_argument("--cpu-table", action="store_true",
                        help="the CPU table instead of the sweep: normtools' torch path against "
                             "the HF module, F.rms_norm and torch.compile, interleaved, every op "
                             "forward and forward+backward, float32 and bfloat16 (--quick: one "
                             "shape per kind; --reps, --warmup, --threads (default 1), --out, "
                             "--summary apply)")


def _option(dest):
    """The option's spelling on the command line: "budget_s" -> "--budget-s"."""
    return "--" + dest.replace("_", "-")


def _check_output_path(dest, path):
    """Refuse an ``--out`` or ``--summary`` path that cannot be written, before any work."""
    path = Path(path)
    if path.is_dir():
        raise CommandLineError(f"{_option(dest)} {path}: is a directory")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise CommandLineError(f"{_option(dest)} {path}: {parent} is not a writable directory")


def _check_options(args):
    """Refuse options that do not fit together and output paths that cannot be written."""
    for mode, takes in _MODE_OPTIONS.items():
        if getattr(args, mode):
            unused = [_option(o) for o in _OPTIONS if o not in takes
                      and getattr(args, o) is not None and getattr(args, o) is not False]
            if unused:
                raise CommandLineError(f"{_option(mode)} does not take {', '.join(unused)}")
    if args.phases and args.cases != "gpu-run":
        raise CommandLineError("--phases needs --cases gpu-run")
    for dest in ("out", "summary"):
        if getattr(args, dest):
            _check_output_path(dest, getattr(args, dest))


def _dry_run(args, device, dtype):
    """The plan of a run, printed as a table; the estimate assumes an H200 on CUDA."""
    cases = gpu_run_cases(_DTYPES[dtype], ops=args.ops or OPS, phases=args.phases or PHASES) \
        if args.cases == "gpu-run" else None
    if cases is None:
        from normtools.measure.bench.cases import Case
        from normtools.measure.bench.shapes import default_shapes
        shapes = default_shapes(device, args.quick)
        cases = [Case("sweep", op, shape) for op in args.ops or OPS for shape in shapes[op]]
    backends = args.backends or [b for b, why in default_backends(device).items() if why is None]
    warmup, reps = sample_counts(device, args.quick, args.warmup, args.reps)   # run_sweep's
    rows = plan_rows(cases, backends, warmup=warmup, reps=reps, budget_s=args.budget_s,
                     dtype=_DTYPES[dtype])
    print(f"dry run: {len(rows)} cases on {device} ({dtype}), backends {', '.join(backends)}; "
          f"{warmup} warm-up + {reps} samples each")
    print(f"{'phase':<12} {'op':<18} {'shape':<26} {'cache':<7} {'regime':<7} {'MiB':>7} "
          f"{'est s':>6} {'runs':>5}")
    for r in rows:
        print(f"{r['phase']:<12} {r['op']:<18} {r['shape']:<26} {r['cache']:<7} "
              f"{r['regime']:<7} {r['MiB']:7.1f} {r['estimate_s']:6.1f} {'yes' if r['runs'] else 'no':>5}")
    synthetic = [r for r in rows if r["phase"] != "real shapes"]
    print(f"smallest synthetic case: {min((r['MiB'] for r in synthetic), default=0):.1f} MiB")
    total = sum(r["estimate_s"] for r in rows)
    fitting = sum(r["runs"] for r in rows)
    budget = "no budget" if args.budget_s is None else f"budget {args.budget_s:.0f} s"
    print(f"estimated total {total:.0f} s; {budget}: {fitting} of {len(rows)} cases start")
    for phase in dict.fromkeys(r["phase"] for r in rows):
        mine = [r for r in rows if r["phase"] == phase]
        parts = [f"{phase}: {sum(r['runs'] for r in mine)} of {len(mine)} start"]
        for regime in dict.fromkeys(r["regime"] for r in mine if r["regime"] != "-"):
            of = [r for r in mine if r["regime"] == regime]
            parts.append(f"{regime} {sum(r['runs'] for r in of)} of {len(of)}")
        rope = [r for r in mine if r["op"].startswith("qk_norm_rope")]
        if rope:
            parts.append(f"qk_norm_rope {sum(r['runs'] for r in rope)} of {len(rope)}")
        print("  " + ", ".join(parts))
    print(f"would write: {args.out or '(no results file)'}, {args.summary or '(no summary)'}")
    return 0


def run_cli(args):
    """Entry point of ``normtools bench``; returns the exit code."""
    _check_options(args)
    if args.dry_run:
        device = "cuda" if args.device in (None, "auto") else args.device
        timer_for(device, args.timer)     # ValueError: a timer the device cannot use
        is_cuda = torch.device(device).type == "cuda"
        return _dry_run(args, device, args.dtype or ("bfloat16" if is_cuda else "float32"))
    if args.report:
        text = markdown_summary(read_results(args.report))
    elif args.cpu_table:
        text = _cpu_table(args)
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") \
            if args.device in (None, "auto") else args.device
        timer_for(device, args.timer)     # ValueError: a timer the device cannot use
        is_cuda = torch.device(device).type == "cuda"
        if is_cuda and not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible")
        if not is_cuda and args.backends and "normtools-triton" in args.backends:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        # bfloat16 on a GPU with bfloat16 arithmetic; a T4 falls back to float16 (with a line)
        dtype = args.dtype or (str(compute_dtype(device)).removeprefix("torch.") if is_cuda
                               else "float32")
        if args.threads:
            torch.set_num_threads(args.threads)
        ops = args.ops or OPS
        cases = gpu_run_cases(_DTYPES[dtype], ops=ops, phases=args.phases or PHASES) \
            if args.cases == "gpu-run" else None
        data = run_sweep(device, dtype, ops=ops, backends=args.backends, cases=cases,
                         warmup=args.warmup, reps=args.reps, quick=args.quick,
                         timer=args.timer, budget_s=args.budget_s, out_path=args.out,
                         processes=args.processes or 1)  # ValueError: options that do not fit
        text = markdown_summary(data)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(text, encoding="utf-8")
    print(text)
    return 0


def _cpu_table(args):
    """Run ``cpu_table.run_cpu_table``, write its JSON to ``--out``; return its Markdown."""
    import json

    from normtools.measure.bench import cpu_table

    given = {name: value for name, value in
             (("reps", args.reps), ("warmup", args.warmup), ("threads", args.threads))
             if value is not None}  # the others: run_cpu_table's defaults
    table = cpu_table.run_cpu_table(cpu_table.cpu_cases(args.quick), **given,
                                    min_total_s=0.0 if args.quick else 0.5)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(table, indent=1), encoding="utf-8")
    return cpu_table.cpu_table_markdown(table)


def add_cli(subparsers):
    """Register the ``bench`` subcommand of the ``normtools`` command line."""
    parser = subparsers.add_parser("bench", help="time the norm ops on every backend (JSON)",
                                   description=_DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run_cli)
    return parser


def main(argv=None):
    """``python -m normtools.measure.bench``: the same options as ``normtools bench``."""
    parser = Parser(prog="python -m normtools.measure.bench", description=_DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run_cli)
    return run_command(parser, argv)

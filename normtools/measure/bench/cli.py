"""``normtools bench`` and ``python -m normtools.measure.bench``."""

import os
from pathlib import Path

import torch

from normtools.core.command_line import Parser, device_name, positive_int, run_command
from normtools.core.precision import compute_dtype
from normtools.measure.bench.cases import gpu_run_cases, plan_rows
from normtools.measure.bench.shapes import _DTYPES, BACKENDS, OPS
from normtools.measure.bench.backends import default_backends
from normtools.measure.bench.report import markdown_summary
from normtools.measure.bench.results import read_results
from normtools.measure.bench.sweep import run_sweep
from normtools.measure.bench.timing import TIMERS

# --------------------------------------------------------------------------------------- CLI

_DESCRIPTION = ("Time the normalization ops on every backend over a sweep of shapes; write the "
                "results, the copy bandwidth and the run conditions as JSON.")


def _add_arguments(parser):
    parser.add_argument("--device", default="auto", type=device_name,
                        help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="activation and weight dtype (default: bfloat16 on CUDA, float16 "
                             "on a GPU without bfloat16 arithmetic, float32 on CPU)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"ops to time (default: all): {', '.join(OPS)}")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, metavar="BACKEND",
                        help=f"backends to run (default: all that apply to the device): "
                             f"{', '.join(BACKENDS)}")
    parser.add_argument("--quick", action="store_true", help="one tiny shape per op, 3 samples")
    parser.add_argument("--cases", choices=("default", "gpu-run"), default="default",
                        help="default: the device's default shapes; gpu-run: a first pass of "
                             "the target ops, the bundled models' real shapes (prefill and "
                             "decode), then the full sweep, each synthetic case ≥ 256 MiB")
    parser.add_argument("--phases", nargs="+", metavar="PHASE",
                        default=["first pass", "real shapes", "sweep"],
                        help="with --cases gpu-run: which of 'first pass', 'real shapes', "
                             "'sweep' to run")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (cases, bytes, estimated time against --budget-s) "
                             "and exit; times nothing")
    parser.add_argument("--warmup", type=int, help="warm-up samples")
    parser.add_argument("--reps", type=int, help="timed samples")
    parser.add_argument("--timer", choices=sorted(TIMERS),
                        help="events (CUDA default), do_bench (CUDA, Triton's timer, for a "
                             "cross-check) or wall (CPU)")
    parser.add_argument("--threads", type=positive_int,
                        help="torch intra-op threads for the run (recorded in the conditions)")
    parser.add_argument("--processes", type=positive_int, default=1,
                        help="time each case in this many processes at once (concurrency; "
                             "recorded in the conditions and rows, default 1)")
    parser.add_argument("--budget-s", type=float,
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


def _dry_run(args, device, dtype):
    """The plan of a run, printed as a table; the estimate assumes an H200 on CUDA."""
    cases = gpu_run_cases(_DTYPES[dtype], ops=args.ops, phases=args.phases) \
        if args.cases == "gpu-run" else None
    if cases is None:
        from normtools.measure.bench.cases import Case
        from normtools.measure.bench.shapes import default_shapes
        shapes = default_shapes(device, args.quick)
        cases = [Case("sweep", op, shape) for op in args.ops for shape in shapes[op]]
    backends = args.backends or [b for b, why in default_backends(device).items() if why is None]
    warmup, reps = (args.warmup or 10, args.reps or 300)
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
    if args.dry_run:
        device = "cuda" if args.device == "auto" else args.device
        is_cuda = torch.device(device).type == "cuda"
        return _dry_run(args, device, args.dtype or ("bfloat16" if is_cuda else "float32"))
    if args.report:
        text = markdown_summary(read_results(args.report))
    elif args.cpu_table:
        text = _cpu_table(args)
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
            else args.device
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
        cases = gpu_run_cases(_DTYPES[dtype], ops=args.ops, phases=args.phases) \
            if args.cases == "gpu-run" else None
        data = run_sweep(device, dtype, ops=args.ops, backends=args.backends, cases=cases,
                         warmup=args.warmup, reps=args.reps, quick=args.quick,
                         timer=args.timer, budget_s=args.budget_s, out_path=args.out,
                         processes=args.processes)  # ValueError: options that do not fit together
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

    table = cpu_table.run_cpu_table(cpu_table.cpu_cases(args.quick), reps=args.reps or 50,
                                    warmup=args.warmup or 3, threads=args.threads or 1,
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

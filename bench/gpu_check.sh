#!/usr/bin/env bash
# One command for a lent GPU (H200), one run, every number: the GPU-marked kernel and bench
# tests, the cluster pass (normtools.measure.cluster_check: every thread-block cluster
# configuration of the launch table against float64, the torch backend and the chunked plan,
# bfloat16 and float32, N 8,193 to 131,072, M 133, 7, 1, 4,096; repeated 200 times at the
# largest N, compared bitwise; the occupancy query for every cluster size), the benchmark (a
# first pass of the target ops, the bundled models' real shapes in prefill and decode, QK-Norm +
# RoPE included, then the full sweep) and the model-level benchmark (a full-width layer stack
# before and after normtools.patch). Installs nothing from the network. At most ~8 minutes.
#
#   bench/gpu_check.sh                the real check (needs CUDA)
#   bench/gpu_check.sh --dry-run      on any machine: walks every step without timing anything
#                                     (the Liger install into a temporary folder, the test
#                                     selection collected with nbformat blocked, the cluster
#                                     pass's configurations, shapes, launches and time estimate,
#                                     the sweep plan with each case's bytes and the time
#                                     estimate, the outputs)
#   bench/gpu_check.sh --quick        the same steps on a tiny sweep (the cluster pass: RMSNorm,
#                                     float32, N 16,385, one row); without CUDA on the CPU,
#                                     under Triton's interpreter (a smoke test of this script)
#   bench/gpu_check.sh --commit SHA   the normtools commit to record (or NORMTOOLS_COMMIT=SHA):
#                                     a copied tree has no .git to ask
#
# Writes under $OUT (default bench/out): pytest-gpu.xml (junit, also after a timeout),
# pytest-gpu.log, cluster-check.json (cluster-check-quick.json with --quick), cluster-check.log,
# bench-h200.json (bench-quick.json with --quick), bench.log,
# model-h200.json (model-quick.json), model.log, bench-h200-2proc.json (two processes per
# case, with the time left), concurrency.log, nvidia-smi.txt and summary.md.
# Environment:
#   OUT              output folder
#   PYTHON           interpreter (default: python3, else python)
#   LIGER_WHEEL      the Liger-Kernel wheel (default: the newest bench/wheels/liger_kernel-*.whl;
#                    the folder is git-ignored and carried with the tree, see bench/README.md)
#   GPU_CHECK_TESTS  test files to run (default: the kernel and bench test files that exist)
#   GPU_CHECK_IMPORT how normtools is made importable: auto (default: use it if it already
#                    imports, else pip install -e --no-deps --no-build-isolation, else a
#                    symlink tree), pip, or shim (the symlink tree, no install)
set -euo pipefail

QUICK=0
DRY=0
COMMIT="${NORMTOOLS_COMMIT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --dry-run) DRY=1 ;;
    --commit) COMMIT="${2:?--commit needs a value}"; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/bench/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
case "$PY" in /*) ;; */*) PY="$PWD/$PY" ;; esac    # Python runs from another directory
TOTAL_S=470          # the whole script, with margin under 8 minutes
TEST_S=120           # pytest, then SIGINT (junit is still written), KILL 20 s later
MODEL_S=70           # the model-level benchmark
CHECK_S=90           # the cluster pass, taken from the bench's share (it had about 220 s): by
                     # its estimate the longest rows of every cluster configuration in bfloat16
                     # and float32 and the repeats start; its JSON records what did not
# The bench gets the rest (about 130 s): by the plan's estimate the whole first pass and part
# of the real shapes (RMSNorm and QK-Norm, with and without RoPE, decode first;
# cases.REAL_SHAPE_ORDER) start; the full sweep starts only if time is left. The dry run prints
# how many cases of each phase and regime start.
START=$SECONDS
RUN_DIR="$REPO"      # where Python runs (the shim's root when the shim is used)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "$COMMIT" ]; then export NORMTOOLS_COMMIT="$COMMIT"; fi

left() { echo $((TOTAL_S - (SECONDS - START))); }
py() { (cd "$RUN_DIR" && "$PY" "$@"); }
importable() { py -c 'import normtools._kernels, normtools.measure.bench' >/dev/null 2>&1; }
has_module() { py -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# A tree $WORK/shim/normtools whose entries link to the repository's normtools/, plus _kernels
# linking to kernels/: the layout that pyproject's package-dir mapping installs. Python runs
# from there so that this tree, not the repository's normtools/, is the one imported.
make_shim() {
  mkdir -p "$WORK/shim/normtools"
  for entry in "$REPO"/normtools/*; do
    case "$(basename "$entry")" in __pycache__|_kernels) ;; *) ln -s "$entry" "$WORK/shim/normtools/" ;; esac
  done
  ln -s "$REPO/kernels" "$WORK/shim/normtools/_kernels"
  RUN_DIR="$WORK/shim"
}

echo "== gpu_check: python $PY, output $OUT$([ "$DRY" = 1 ] && echo ', dry run')"
case "${GPU_CHECK_IMPORT:-auto}" in
  shim) make_shim ;;
  pip) (cd "$REPO" && timeout 120 "$PY" -m pip install -q -e . --no-deps --no-build-isolation) ;;
  auto)
    if ! importable; then
      if [ "$DRY" = 1 ]; then
        make_shim
      else
        (cd "$REPO" && timeout 120 "$PY" -m pip install -q -e . --no-deps --no-build-isolation) \
          || echo "gpu_check: editable install failed; using a symlink tree" >&2
        importable || make_shim
      fi
    fi ;;
  *) echo "gpu_check: GPU_CHECK_IMPORT must be auto, pip or shim" >&2; exit 2 ;;
esac

# 0. Liger-Kernel, pure Python, from the wheel carried with the tree: installed into a
#    temporary folder on PYTHONPATH (the machine's environment is left as it was).
WHEEL="${LIGER_WHEEL:-$(ls -1 "$REPO"/bench/wheels/liger_kernel-*.whl 2>/dev/null | sort -V | tail -n 1 || true)}"
status=0
if [ -n "$WHEEL" ] && [ -f "$WHEEL" ]; then
  echo "== Liger-Kernel from $WHEEL"
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$WORK/liger" "$WHEEL"
  export PYTHONPATH="$WORK/liger${PYTHONPATH:+:$PYTHONPATH}"
  py -c 'import liger_kernel.transformers.functional as f; print("liger_kernel imports:", f.__name__)'
else
  echo "gpu_check: no Liger-Kernel wheel (bench/wheels/liger_kernel-*.whl or LIGER_WHEEL);" \
    "every Liger row will be 'skipped'" >&2
  if [ "$DRY" = 1 ]; then status=1; fi
fi

INFO="$(py -c 'import normtools, normtools._kernels, torch
from normtools.core import sysinfo
cuda = torch.cuda.is_available()
print("normtools from", normtools.__file__, "| commit", sysinfo.source_commit())
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if cuda else "cpu")
print(int(cuda))')"
echo "$INFO" | head -n 2
HAS_CUDA="$(echo "$INFO" | tail -n 1)"
if [ "$HAS_CUDA" != 1 ] && [ "$QUICK" != 1 ] && [ "$DRY" != 1 ]; then
  echo "gpu_check: no CUDA device visible (use --dry-run or --quick on a CPU)" >&2
  exit 2
fi
if [ -z "${NORMTOOLS_COMMIT:-}" ] && [ ! -d "$REPO/.git" ]; then
  echo "gpu_check: no .git and no --commit: the results will not name their commit" >&2
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit \
    --format=csv > "$OUT/nvidia-smi.txt" 2>&1 || true
  cat "$OUT/nvidia-smi.txt"
fi

# 1. The GPU-marked tests of the kernel and bench test files only (the book's tests import
#    nbformat, which that machine lacks), with xdist and a per-test timeout when present.
#    SIGINT at the end of the stage: pytest stops and still writes its junit XML.
if [ -n "${GPU_CHECK_TESTS:-}" ]; then
  read -r -a TEST_FILES <<< "$GPU_CHECK_TESTS"
else
  TEST_FILES=()
  for f in core/test_rms_norm core/test_layer_norm core/test_qk_norm core/test_qk_norm_rope \
           core/test_kernel_paths core/test_hf_parity_norms core/test_hf_parity_qk \
           measure/test_bytes_counter measure/test_spills measure/test_bench \
           measure/test_model_bench measure/test_parity measure/test_cluster_check \
           core/test_occupancy core/test_kernel_hardening; do
    if [ -f "$REPO/tests/$f.py" ]; then TEST_FILES+=("tests/$f.py"); fi
  done
fi
SELECTED=()
for f in "${TEST_FILES[@]}"; do
  if grep -Eq '^\s*(import|from)\s+(nbformat|nbval|nbclient)' "$REPO/$f"; then
    echo "gpu_check: leaving out $f (imports nbformat/nbval/nbclient)" >&2
  else
    SELECTED+=("$REPO/$f")
  fi
done
PYTEST_ARGS=(-m gpu -q -p no:cacheprovider -p no:nbval --rootdir "$REPO" -o "junit_family=xunit2")
if has_module xdist; then PYTEST_ARGS+=(-n 4); else echo "gpu_check: no pytest-xdist: one process" >&2; fi
if has_module pytest_timeout; then PYTEST_ARGS+=(--timeout 90); else echo "gpu_check: no pytest-timeout" >&2; fi
echo "== pytest ${#SELECTED[@]} files ($(left) s left): ${SELECTED[*]#"$REPO"/}"
if [ "$DRY" = 1 ]; then
  # Collect them as the GPU machine would: nbformat and Liger's absence simulated by a module
  # that raises ImportError (Liger is imported lazily by the bench, so collection must not need it).
  mkdir -p "$WORK/block/nbformat"
  echo 'raise ImportError("nbformat is not installed on the GPU machine")' \
    > "$WORK/block/nbformat/__init__.py"
  collect_rc=0
  (cd "$RUN_DIR" && PYTHONPATH="$WORK/block:${PYTHONPATH:-}" timeout 240 "$PY" -m pytest \
    "${SELECTED[@]}" -m gpu --collect-only -q -p no:cacheprovider -p no:nbval \
    --rootdir "$REPO") > "$OUT/pytest-collect.log" 2>&1 || collect_rc=$?
  tail -n 3 "$OUT/pytest-collect.log"
  if [ "$collect_rc" != 0 ]; then
    echo "gpu_check: collection failed (exit $collect_rc), see $OUT/pytest-collect.log" >&2
    status=1
  fi
  echo "would run: timeout -s INT -k 20 $TEST_S pytest ${PYTEST_ARGS[*]} --junitxml $OUT/pytest-gpu.xml"
else
  test_rc=0
  (cd "$RUN_DIR" && timeout -s INT -k 20 "$TEST_S" "$PY" -m pytest "${SELECTED[@]}" \
    "${PYTEST_ARGS[@]}" --junitxml "$OUT/pytest-gpu.xml") 2>&1 \
    | tee "$OUT/pytest-gpu.log" || test_rc=$?
  if [ "$test_rc" != 0 ]; then
    echo "gpu_check: pytest exit code $test_rc (1: failures, 2: interrupted at the time limit," \
      "5: no GPU test collected, 124/137: killed)" >&2
    status=1
  fi
fi

# 1b. The cluster pass (normtools.measure.cluster_check), before the sweep: every cluster
#    configuration against float64, the torch backend and the chunked plan, the repeats at the
#    largest N (bitwise) and the occupancy query per cluster size. Its JSON is rewritten after
#    every case; a case starts only if its estimate fits CHECK_S. Exit 1: a mismatch.
if [ "$QUICK" = 1 ]; then
  CHECK_RESULTS="$OUT/cluster-check-quick.json"
  CHECK_ARGS=(--ops rms_norm --dtypes float32 --ns 16385 --ms 1 --repeats 2 --repeat-rows 1)
  if [ "$HAS_CUDA" != 1 ]; then CHECK_ARGS+=(--device cpu); fi
else
  CHECK_RESULTS="$OUT/cluster-check.json"
  CHECK_ARGS=(--device cuda)
fi
echo "== cluster pass (budget ${CHECK_S} s, $(left) s left)"
if [ "$DRY" = 1 ]; then
  py -m normtools.measure.cluster_check --dry-run --budget-s "$CHECK_S" --out "$CHECK_RESULTS" \
    | tee "$OUT/cluster-check-plan.txt" || status=1
else
  check_rc=0
  (cd "$RUN_DIR" && timeout $((CHECK_S + 30)) "$PY" -m normtools.measure.cluster_check \
    "${CHECK_ARGS[@]}" --budget-s "$CHECK_S" --out "$CHECK_RESULTS") 2>&1 \
    | tee "$OUT/cluster-check.log" || check_rc=$?
  if [ "$check_rc" != 0 ]; then
    echo "gpu_check: cluster pass exit code $check_rc (1: a mismatch, 2: no cluster plans" \
      "here, 124: timed out)" >&2
    status=1
  fi
fi

# 2. The benchmark. The JSON is rewritten after every row, so a timeout keeps what ran; a case
#    starts only if its estimate fits the budget, and then runs on every backend.
if [ "$QUICK" = 1 ]; then
  RESULTS="$OUT/bench-quick.json"
  MODEL_RESULTS="$OUT/model-quick.json"
  BENCH_ARGS=(--quick)
  MODEL_ARGS=(--size tiny --reps 5 --warmup 1)
  CONC_RESULTS="$OUT/bench-quick-2proc.json"
  CONC_ARGS=(--quick --ops rms_norm)
  if [ "$HAS_CUDA" != 1 ]; then
    BENCH_ARGS+=(--backends normtools-torch torch-F liger)
    CONC_ARGS+=(--backends normtools-torch torch-F --threads 1)
  fi
else
  RESULTS="$OUT/bench-h200.json"
  MODEL_RESULTS="$OUT/model-h200.json"
  BENCH_ARGS=(--device cuda --dtype bfloat16 --cases gpu-run)
  MODEL_ARGS=(--device cuda --size full-width --config qwen3-8b --layers 4)
  CONC_RESULTS="$OUT/bench-h200-2proc.json"
  # RMSNorm at the real shapes (decode first in each model: serving runs several processes)
  CONC_ARGS=(--device cuda --dtype bfloat16 --cases gpu-run --phases "real shapes"
             --ops rms_norm --backends normtools-triton torch-F)
fi
budget=$(( $(left) - MODEL_S - 40 ))
if [ "$DRY" = 1 ]; then budget=$(( TOTAL_S - TEST_S - CHECK_S - MODEL_S - 60 )); fi
if [ "$budget" -lt 30 ]; then budget=30; fi
echo "== bench (budget ${budget} s)"
if [ "$DRY" = 1 ]; then
  py -m normtools.measure.bench --dry-run --device cuda --dtype bfloat16 --cases gpu-run \
    --budget-s "$budget" --out "$RESULTS" --summary "$OUT/summary.md" | tee "$OUT/bench-plan.txt"
else
  bench_rc=0
  (cd "$RUN_DIR" && timeout $((budget + 60)) "$PY" -m normtools.measure.bench "${BENCH_ARGS[@]}" \
    --budget-s "$budget" --out "$RESULTS" --summary "$OUT/summary.md") 2>&1 \
    | tee "$OUT/bench.log" || bench_rc=$?
  if [ "$bench_rc" != 0 ]; then
    echo "gpu_check: bench exit code $bench_rc (124: timed out); summarizing what ran" >&2
    status=1
    if [ -f "$RESULTS" ]; then
      py -m normtools.measure.bench --report "$RESULTS" --summary "$OUT/summary.md" > /dev/null || true
    fi
  fi
fi

# 3. The model-level benchmark: forward and forward+backward step of a real transformers model,
#    before and after normtools.patch.
echo "== model benchmark ($(left) s left)"
if [ "$DRY" = 1 ]; then
  echo "would run: timeout $MODEL_S python -m normtools.measure.model_bench" \
    "--device cuda --size full-width --config qwen3-8b --layers 4 --out $MODEL_RESULTS"
  py -c 'from normtools.measure import model_bench
from normtools import cards
c = model_bench.full_width_config("qwen3-8b", 4)
m = cards.build_model(c, device="meta")
print("full-width stack:", m.config.num_hidden_layers, "layers, hidden", m.config.hidden_size,
      "|", sum(p.numel() for p in m.parameters()) / 1e9, "B parameters")'
else
  model_rc=0
  (cd "$RUN_DIR" && timeout "$MODEL_S" "$PY" -m normtools.measure.model_bench "${MODEL_ARGS[@]}" \
    --out "$MODEL_RESULTS") 2>&1 | tee "$OUT/model.log" || model_rc=$?
  if [ "$model_rc" != 0 ]; then
    echo "gpu_check: model benchmark exit code $model_rc (124: timed out)" >&2
    status=1
  fi
fi

# 4. Concurrency, with the time that is left: two processes time each case at once
#    (normtools.measure.bench.peers), at most CONC_S seconds.
CONC_S=30
if [ "$DRY" = 1 ]; then
  echo "== concurrency: if ≥ $((CONC_S + 10)) s are left, would run: python -m" \
    "normtools.measure.bench --processes 2 ${CONC_ARGS[*]} --budget-s $CONC_S" \
    "--out $CONC_RESULTS"
elif [ "$(left)" -ge $((CONC_S + 10)) ]; then
  echo "== concurrency: 2 processes per case ($(left) s left)"
  conc_rc=0
  (cd "$RUN_DIR" && timeout $((CONC_S + 30)) "$PY" -m normtools.measure.bench "${CONC_ARGS[@]}" \
    --processes 2 --budget-s "$CONC_S" --out "$CONC_RESULTS") > "$OUT/concurrency.log" 2>&1 \
    || conc_rc=$?
  tail -n 5 "$OUT/concurrency.log"
  if [ "$conc_rc" != 0 ]; then
    echo "gpu_check: concurrency run exit code $conc_rc (124: timed out)" >&2
    status=1
  fi
else
  echo "gpu_check: $(left) s left, no concurrency run" >&2
fi

echo "== done in $((SECONDS - START)) s; outputs in $OUT:"
if [ "$DRY" = 1 ]; then
  echo "would write: pytest-gpu.xml pytest-gpu.log $(basename "$CHECK_RESULTS")" \
    "cluster-check.log $(basename "$RESULTS") bench.log" \
    "$(basename "$MODEL_RESULTS") model.log $(basename "$CONC_RESULTS") concurrency.log" \
    "nvidia-smi.txt summary.md"
  echo "estimated: tests ≤ ${TEST_S} s + cluster pass ≤ ${CHECK_S} s + bench ≤ ${budget} s" \
    "+ model ≤ ${MODEL_S} s (script limit ${TOTAL_S} s)"
fi
ls -l "$OUT"
exit "$status"

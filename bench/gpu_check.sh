#!/usr/bin/env bash
# One command for a lent GPU (H200): the GPU-marked tests of the compiled kernels against the
# reference, then the benchmark sweep. Installs nothing from the network. At most ~8 minutes.
#
#   bench/gpu_check.sh            the real check (needs CUDA)
#   bench/gpu_check.sh --quick    the same steps on a tiny sweep; on a machine without CUDA it
#                                 runs on the CPU (a smoke test of this script)
#
# Writes under $OUT (default bench/out): pytest-gpu.xml (junit), pytest-gpu.log,
# bench-h200.json (bench-quick.json with --quick), bench.log and summary.md (a short table and
# the targets report). Environment:
#   OUT              output folder
#   PYTHON           interpreter (default: python3, else python)
#   GPU_CHECK_TESTS  what pytest collects (default: the repository's tests/)
#   GPU_CHECK_IMPORT how normtools is made importable: auto (default: use it if it already
#                    imports, else pip install -e --no-deps --no-build-isolation, else a
#                    symlink tree), pip, or shim (the symlink tree, no install)
set -euo pipefail

QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg" >&2; exit 2 ;;
  esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/bench/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
case "$PY" in /*) ;; */*) PY="$PWD/$PY" ;; esac    # Python runs from another directory
TESTS="${GPU_CHECK_TESTS:-$REPO/tests}"
case "$TESTS" in /*) ;; *) TESTS="$PWD/$TESTS" ;; esac
TOTAL_S=470          # the whole script, with margin under 8 minutes
START=$SECONDS
RUN_DIR="$REPO"      # where Python runs (the shim's root when the shim is used)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

left() { echo $((TOTAL_S - (SECONDS - START))); }
py() { (cd "$RUN_DIR" && "$PY" "$@"); }
importable() { py -c 'import normtools._kernels, normtools.measure.bench' >/dev/null 2>&1; }

# A tree $SHIM/normtools whose entries link to the repository's normtools/, plus _kernels
# linking to kernels/: the layout that pyproject's package-dir mapping installs. Python runs
# from $SHIM so that this tree, not the repository's normtools/, is the one imported.
make_shim() {
  SHIM="$(mktemp -d)"
  trap 'rm -rf "$SHIM"' EXIT
  mkdir "$SHIM/normtools"
  for entry in "$REPO"/normtools/*; do
    [ "$(basename "$entry")" = __pycache__ ] || ln -s "$entry" "$SHIM/normtools/"
  done
  ln -s "$REPO/kernels" "$SHIM/normtools/_kernels"
  RUN_DIR="$SHIM"
}

echo "== gpu_check: python $PY, output $OUT"
case "${GPU_CHECK_IMPORT:-auto}" in
  shim) make_shim ;;
  pip) (cd "$REPO" && timeout 120 "$PY" -m pip install -q -e . --no-deps --no-build-isolation) ;;
  auto)
    if ! importable; then
      (cd "$REPO" && timeout 120 "$PY" -m pip install -q -e . --no-deps --no-build-isolation) \
        || echo "gpu_check: editable install failed; using a symlink tree" >&2
      importable || make_shim
    fi ;;
  *) echo "gpu_check: GPU_CHECK_IMPORT must be auto, pip or shim" >&2; exit 2 ;;
esac
INFO="$(py -c 'import normtools, normtools._kernels, torch
cuda = torch.cuda.is_available()
print("normtools from", normtools.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if cuda else "cpu")
print(int(cuda))')"
echo "$INFO" | head -n 2
HAS_CUDA="$(echo "$INFO" | tail -n 1)"
if [ "$HAS_CUDA" != 1 ] && [ "$QUICK" != 1 ]; then
  echo "gpu_check: no CUDA device visible (use --quick for a CPU smoke run)" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
fi

# 1. GPU-marked tests: the compiled kernels against the float64 / PyTorch reference. A test
#    file that cannot be imported there (a package missing on that machine) must not stop the
#    others: --continue-on-collection-errors.
status=0
echo "== pytest -m gpu ($(left) s left)"
test_rc=0
(cd "$RUN_DIR" && timeout 200 "$PY" -m pytest "$TESTS" -m gpu -q -p no:cacheprovider \
  --rootdir "$REPO" --continue-on-collection-errors --junitxml "$OUT/pytest-gpu.xml") 2>&1 \
  | tee "$OUT/pytest-gpu.log" || test_rc=$?
if [ "$test_rc" != 0 ]; then
  echo "gpu_check: pytest exit code $test_rc (1: failures, 5: no GPU test collected, 124: timed" \
    "out)" >&2
  status=1
fi

# 2. The sweep. The JSON is rewritten after every case, so a timeout keeps what ran; the bench
#    itself starts no new case once its budget is spent.
if [ "$QUICK" = 1 ]; then
  RESULTS="$OUT/bench-quick.json"
  BENCH_ARGS=(--quick)
  if [ "$HAS_CUDA" != 1 ]; then BENCH_ARGS+=(--backends normtools-torch torch-F liger); fi
else
  RESULTS="$OUT/bench-h200.json"
  BENCH_ARGS=(--device cuda --dtype bfloat16)
fi
budget=$(( $(left) - 60 ))
if [ "$budget" -lt 30 ]; then budget=30; fi
echo "== bench (budget ${budget} s)"
bench_rc=0
(cd "$RUN_DIR" && timeout $((budget + 45)) "$PY" -m normtools.measure.bench "${BENCH_ARGS[@]}" \
  --budget-s "$budget" --out "$RESULTS" --summary "$OUT/summary.md") 2>&1 \
  | tee "$OUT/bench.log" || bench_rc=$?
if [ "$bench_rc" != 0 ]; then
  echo "gpu_check: bench exit code $bench_rc (124: timed out); summarizing what ran" >&2
  status=1
  if [ -f "$RESULTS" ]; then
    py -m normtools.measure.bench --report "$RESULTS" --summary "$OUT/summary.md" > /dev/null || true
  fi
fi

echo "== done in $((SECONDS - START)) s; outputs in $OUT:"
ls -l "$OUT"
exit "$status"

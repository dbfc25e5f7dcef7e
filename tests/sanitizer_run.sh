#!/usr/bin/env bash
# compute-sanitizer over each kernel family's GPU tests (valid and invalid inputs: the tests
# marked gpu include every family's bad-index and bad-offset cases), memcheck and racecheck,
# one summary line per family and tool. Run on the GPU machine from the repository root:
#
#   tests/sanitizer_run.sh                       # every family, both tools
#   tests/sanitizer_run.sh rows collection       # some families
#   TOOLS=memcheck tests/sanitizer_run.sh tt     # one tool
#
# Exit status: 0 when every run reports zero errors and its tests pass, 1 otherwise. Logs go
# to $OUT_DIR (default sanitizer-logs/). racecheck is slow (it checks every shared-memory
# access): run the families one by one if a command has a time limit.
#
# CuPy's memory pools are switched off inside the run (each array its own allocation), so an
# access past an array's end is past an allocation's end, where memcheck sees it; inside a
# pool block it would land in a neighbour and go unseen. torch's caching allocator likewise.
set -uo pipefail
cd "$(dirname "$0")/.."

declare -A FAMILY=(
  [kernels]="tests/core/test_kernels.py"
  [rows]="tests/core/test_rows.py tests/core/test_batch.py"
  [table]="tests/core/test_table.py tests/core/test_table_cache.py tests/core/test_table_sums.py"
  [optim]="tests/core/test_optim.py"
  [tt]="tests/core/test_tt.py tests/core/test_tt_kernels.py tests/core/test_tt_reduce_split.py"
  [collection]="tests/core/test_collection.py tests/torch/test_collection_torch.py"
  [reliability]="tests/core/test_reliability_fuzz.py tests/core/test_reliability_nonfinite.py tests/core/test_reliability_determinism.py"
)
ORDER=(kernels rows table optim tt collection reliability)
families=("$@")
[ ${#families[@]} -eq 0 ] && families=("${ORDER[@]}")
read -r -a tools <<< "${TOOLS:-memcheck racecheck}"
OUT_DIR=${OUT_DIR:-sanitizer-logs}
mkdir -p "$OUT_DIR"

SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$SANITIZER" ]; then
  echo "compute-sanitizer not found (set SANITIZER=/path/to/compute-sanitizer)" >&2
  exit 1
fi

# pytest inside a Python that turns the pools off first.
RUNNER='
import sys
import cupy
cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)
import pytest
# CUDA-graph captures need the torch caching allocator (a plain cudaMalloc is refused while a
# stream captures), which is off here: they run in the plain GPU suite instead.
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider",
                      "-k", "not cuda_graph and not replayed", *sys.argv[1:]]))
'

status=0
printf "%-12s %-10s %8s %8s  %s\n" family tool errors pytest log
for family in "${families[@]}"; do
  files=${FAMILY[$family]:-}
  if [ -z "$files" ]; then
    echo "unknown family '$family'; known: ${ORDER[*]}" >&2
    exit 1
  fi
  for tool in "${tools[@]}"; do
    log="$OUT_DIR/$family.$tool.log"
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check no --check-device-heap yes)
    [ "$tool" = racecheck ] && extra=(--racecheck-report analysis)
    # shellcheck disable=SC2086
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
      "$SANITIZER" --tool "$tool" "${extra[@]}" --log-file "$log.sanitizer" \
      python3 -c "$RUNNER" $files > "$log" 2>&1
    rc=$?
    errors=$(grep -ho "ERROR SUMMARY: [0-9]*" "$log.sanitizer" "$log" 2>/dev/null \
             | awk '{s += $3} END {print s + 0}')
    if ! grep -q "ERROR SUMMARY" "$log.sanitizer" "$log" 2>/dev/null; then
      errors="?"
    fi
    printf "%-12s %-10s %8s %8s  %s\n" "$family" "$tool" "$errors" "rc=$rc" "$log"
    if [ "$errors" != 0 ] || [ $rc -ne 0 ]; then
      status=1
    fi
  done
done
exit $status

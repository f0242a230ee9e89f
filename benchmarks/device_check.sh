#!/usr/bin/env bash
# The device check: everything that needs a GPU, in one call (stage limits add up to under 10 minutes).
#   OUT=/some/dir bash benchmarks/device_check.sh
# Builds ffn_ext for the local GPU (sm_90 on an H200) against the machine's torch, checks the SASS, runs the CUDA
# tests (the >2**31-element ones too), compute-sanitizer memcheck and racecheck over every op and dtype, and the
# benchmarks' GPU quick mode. Every stage has its own time limit and log under $OUT; the summary is printed last
# and written to $OUT/summary.txt; all logs and benchmark outputs go into $OUT/device_check.tgz (the device tool
# returns at most 8 files). Exit status: number of failed stages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ffn_ext_device}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PY=${PYTHON:-python3}
failed=0
: >"$LOGS/summary.txt"
note() { echo "$*" | tee -a "$LOGS/summary.txt"; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local line; line=$(grep -E "passed|failed|error|SUMMARY|ERROR SUMMARY" "$LOGS/$name.log" | tail -n 1)
  [ $rc -eq 0 ] || failed=$((failed + 1))
  note "$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$line")"
  save
}
save() {  # after every stage, so that a call cut short still returns what ran
  cp "$LOGS/summary.txt" "$OUT/summary.txt"
  tar czf "$OUT/device_check.tgz" -C "$LOGS" .
}

note "ffn_ext device check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOGS/summary.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOGS/summary.txt"

stage build 150 $PY -m pip install -v --no-build-isolation --no-deps -e .
$PY -c "import ffn_ext; print(ffn_ext.build_summary())" | tee -a "$LOGS/summary.txt"

# SASS of the sm_90 build: 128-bit vector path, no local memory (same test CI runs on the sm_80/sm_90 build).
stage sass 30 $PY -m pytest -q tests/test_sass.py

# All CUDA tests, the large (>2**31 elements) ones included.
FFN_EXT_RUN_LARGE=1 stage cuda_tests 130 $PY -m pytest -q -m cuda -p no:cacheprovider --durations=15

# compute-sanitizer over every op, dtype and layout (small shapes).
if command -v compute-sanitizer >/dev/null; then
  stage memcheck 50 compute-sanitizer --tool memcheck --error-exitcode 1 $PY tests/cuda_sanitize_cases.py
  stage racecheck 50 compute-sanitizer --tool racecheck --error-exitcode 1 $PY tests/cuda_sanitize_cases.py
else
  note "compute-sanitizer not found: memcheck/racecheck NOT run"; failed=$((failed + 1))
fi

# Benchmarks, GPU quick mode (tables, JSON, plots under $OUT/bench).
stage bench_ops 120 $PY benchmarks/bench_ops.py --quick --device cuda --out "$LOGS/bench"
stage bench_ffn 45 $PY benchmarks/bench_ffn.py --quick --device cuda --out "$LOGS/bench"

note "failed stages: $failed"
save
echo "----- tail of the op benchmark -----"; tail -n 45 "$LOGS/bench_ops.log" 2>/dev/null
echo "----- summary -----"; cat "$LOGS/summary.txt"
exit $failed

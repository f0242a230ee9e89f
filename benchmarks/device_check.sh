#!/usr/bin/env bash
# The device check: everything that needs a GPU. Since the clamped SwiGLU and the interleaved layout (88 kernels per
# architecture, about 1600 CUDA tests, 3968 sanitizer calls) it no longer fits one 10-minute call; run it as two
# calls back to back on the same warm machine (the build stays), each under 10 minutes of stage limits:
#   OUT=/some/dir STAGES="build model cuda_tests" bash benchmarks/device_check.sh                 # limits 570 s
#   OUT=/some/dir STAGES="quant_tests bench_quant fp8_mlp bench_ops host ncu memcheck bench_ffn racecheck" bash benchmarks/device_check.sh   # 520 s
#   OUT=/some/dir STAGES="ffn_layer ffn_long nccl sass" bash benchmarks/device_check.sh   # FFN layer targets, NCCL, SASS: 510 s
# The whole-model stage (model, 90 s) took the first call's place of the sass stage, a report on the build that uses
# no GPU (CI checks the SASS itself: tests/test_sass.py), which moved to the third call; the build stays on the warm
# machine between calls.
# With less device time than both need, measure first: STAGES="build quant_tests bench_quant fp8_mlp bench_ops
# memcheck" (570 s of limits: one call): the quantizing kernels and the FP8 MLP's GEMMs (never run on a GPU) first.
#   OUT=/some/dir bash benchmarks/device_check.sh       # everything in one call: only with a longer per-call limit
# Builds ffn_ext for the local GPU (sm_90 on an H200) against the machine's torch, runs the CUDA tests (the
# >2**31-element ones too), the benchmarks' GPU quick mode, and compute-sanitizer memcheck and racecheck over every
# op and dtype. Every op list comes from the op table (ffn_ext/table.py): the 22 ops of gelu, gelu_tanh and silu
# (geglu, geglu_tanh, swiglu, swiglu_clamped, packed forms), 88 rows_kernels per architecture with the interleaved
# layout's (48 before the clamped SwiGLU: the build and the CUDA tests are not yet timed with them). (The SASS
# checks run in CI on the sm_80/sm_90 build: tests/test_sass.py; the sass stage here reports the device build's
# instruction budgets and spills.)
# Every stage has its own time limit and log under $OUT; the summary is printed last
# and written to $OUT/summary.txt; all logs and benchmark outputs go into $OUT/device_check.tgz (the device tool
# returns at most 8 files). Exit status: number of failed stages. STAGES="build cuda_tests ..." runs only those
# (default: all of build sass model cuda_tests bench_ops host ncu memcheck bench_ffn racecheck ffn_layer ffn_long nccl).
# STAGE_LIMITS=off runs the stages without their time limits: the limits keep a device call under its 10 minutes,
# while the test suite's run of the sass stage (tests/test_benchmarks_smoke.py) must not fail on a loaded machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ffn_ext_device}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
export PATH="$CUDA_HOME/bin:$PATH" MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PY=${PYTHON:-python3}
failed=0
: >"$LOGS/summary.txt"
note() { echo "$*" | tee -a "$LOGS/summary.txt"; }
STAGES=${STAGES:-build sass model quant_tests bench_quant fp8_mlp cuda_tests bench_ops host ncu memcheck bench_ffn racecheck ffn_layer ffn_long nccl}
wanted() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  wanted "$name" || { note "$(printf '%-12s skipped (STAGES)' "$name")"; return; }
  local t0=$(date +%s)
  if [ "${STAGE_LIMITS:-on}" = off ]; then
    "$@" >"$LOGS/$name.log" 2>&1
  else
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  fi
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

# The commit, and a hash of the sources as they are (the device tool's copy of .git can be older than its files).
src_hash=$(find csrc ffn_ext -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
note "ffn_ext device check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo '+dirty'), sources sha256 $src_hash"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOGS/summary.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOGS/summary.txt"

# 48 kernels per architecture since the op table (24 before): nvcc on kernels.cu for sm_90 took 1.35x as long on a
# 2-core CPU (77 s against 57 s), and the whole build took 50 s on the H200 machine with 24. 88 kernels now (one
# translation unit, one architecture here, so nvcc's --threads does not help): 180 s, not yet timed.
# The build makes _C (the schemas) and the CUDA kernels' library, ffn_ext/lib/libffn_ext_cuda.so, both on torch's
# stable ABI; `import ffn_ext` loads the library when torch's CUDA major is the build's. Its glue (stream, device
# guard, allocation, checks) first runs on a GPU here: if the library did not load, every CUDA test below would run
# PyTorch's ops instead, so that fails the build stage, loudly.
stage build 180 $PY -m pip install -v --no-build-isolation --no-deps -e .
$PY -c "import ffn_ext, sys; print(ffn_ext.build_summary()); ffn_ext.has_cuda_kernels() or sys.exit('CUDA kernels not loaded')" \
  | tee -a "$LOGS/summary.txt" || { note "build        the CUDA library did not load: see build_summary above"; failed=$((failed + 1)); }
# The instruction count per element that the bandwidth prediction rests on, from the SASS just built (no GPU use),
# then registers and any spills, and the kernels over budget: a report that fails only when it cannot read the
# binary. Most of its time is cuobjdump's single-threaded dump of the sm_90 SASS, so its limit leaves about twice
# what a loaded 2-core CPU takes.
stage sass 90 $PY benchmarks/sass_budget.py

# A whole Hugging Face model's training step (forward, loss, backward, AdamW), bf16, 2 layers at real widths, 4096
# tokens: Llama-3-8B, Qwen3-30B-A3B (128 experts), GPT-OSS-20B (32 experts), Gemma-3-4B; unpatched against
# ffn_ext's patch, recompute, token_chunk and experts_implementation="ffn_ext": tokens/s, peak allocated, saved bytes,
# the loss after 7 steps. Then, inside its own --budget-s, torch.compile of Llama unpatched and patched, and Liger
# where liger_kernel is installed; what the budget leaves out is listed as not run. Not yet timed: the eager rows
# are expected to take 30-60 s, a compile about 45 s. The JSON is rewritten after every variant, so a stage cut at
# its limit keeps what ran. Needs transformers on the machine.
if $PY -c "import transformers" 2>/dev/null || ! wanted model; then
  stage model 90 $PY benchmarks/bench_model.py --quick --device cuda --budget-s 75 \
    --out "$LOGS/bench_model" --json "$OUT/model.json"
else
  note "$(printf '%-12s transformers is not installed: the whole-model benchmark NOT run' model)"; failed=$((failed + 1))
fi

# All CUDA tests, the large (>2**31 elements) ones included: 525 took 97 s; about 1600 now (2026-12-01), 300 s.
# The quantizing kernels (csrc/cuda/quant_kernels.cuh, in four quant_part<i>.cu: 135 kernels, the group, row and
# tensor kernels, none run on a GPU when written): their CUDA tests against quant.py's reference (bit for bit; every recipe, so the row kernel and both
# tensor launches), then swiglu_quant against swiglu + quantize and torch.compile of it at the decode shape and
# 4096 x 14336, bf16, for group-128, row, dynamic and static tensor scaling. Not yet timed: 60 s and 90 s. With
# them the FP8 activation cache's kernels (csrc/cache_kernel.h: <gated>_cache, <gated>_cached_backward, none run on a
# GPU when written) against their ATen formula, and the MLPs' saved_dtype on CUDA.
stage quant_tests 60 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_quant.py tests/test_cache_ops.py \
  tests/test_saved_dtype.py
stage bench_quant 90 $PY benchmarks/bench_quant.py --quick --device cuda
# The FP8 MLP (ffn_ext.quantize_fp8): recipe="row" and "block" against bf16 at 64 tokens, and the block recipe's
# sm_90 path (F.scaled_mm BlockWise1x128 x BlockWise128x128: its arguments were only checked with F.scaled_mm mocked)
# against the same module's float32 emulation: exits 1 when they differ by more than 1e-2 (relative, in norm). Not
# yet timed: 60 s (the CPU run takes 15 s).
stage fp8_mlp 60 $PY benchmarks/bench_fp8_mlp.py --device cuda --check

FFN_EXT_RUN_LARGE=1 stage cuda_tests 300 $PY -m pytest -q -m cuda -p no:cacheprovider --durations=15

# Benchmarks, GPU quick mode, bf16 (the dtype of the targets): tables, JSON, plots under bench/. Every op of the
# table, 9 (gelu, gelu_tanh, silu, geglu, geglu_tanh, swiglu and the packed three), then swiglu_packed interleaved and
# the clamped SwiGLU (GPT-OSS's parameters) separate, packed and packed interleaved: 13 ops at 16x4864, 2^20, 2^24 and
# 2^28, plus two MoE shapes (GPT-OSS-20B 4096 tokens x top-4 x 2880, clamped interleaved; Qwen3-30B-A3B 4096 x top-8
# x 768, swiglu_packed), against ATen eager, torch.compile, Liger (swiglu and geglu_tanh, when liger_kernel is
# installed), vLLM's swigluoai_and_mul and TransformerEngine's ClampedSwiGLU (when installed). 45 s measured with 4
# ops (24 s in the timing loop, most of it torch.compile's 24 compiles, 4 s in timed calls): about 534 cases and 78
# compiles now, 100-110 s expected. 135 s: 15 s from memcheck, 5 s each from ncu and bench_ffn.
stage bench_ops 135 $PY benchmarks/bench_ops.py --quick --dtypes bf16 --device cuda --no-progress --out "$LOGS/bench"

# Host time per call at the decode size, layer by layer (Python API, torch.ops, ATen's binding): where the
# microseconds go when a call costs more host time than GPU time.
stage host 20 $PY benchmarks/host_overhead.py --device cuda --out "$LOGS/bench"

# Nsight Compute on one call of each kernel (ours and ATen's), bf16 2**26: memory- or issue-bound? 21 kernels
# and the clamped SwiGLU's interleaved forward and backward (11 before: 12 s measured, about 5 s of it starting up).
if command -v ncu >/dev/null || ! wanted ncu; then
  stage ncu 30 ncu --clock-control none --section SpeedOfLight \
    --metrics smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    -k 'regex:rows_kernel|vectorized_elementwise|unrolled_elementwise' $PY benchmarks/ncu_cases.py
else
  note "ncu not found: kernel profile NOT run"
fi

# compute-sanitizer over every op of the table, dtype and layout (small shapes, packed ops in both layouts): 3968
# op calls, 3.2x the 1224 that took 5-7 s under memcheck: 45 s. racecheck covers shared memory, which these
# kernels do not use; it runs because it is cheap and would catch a future change that does.
if command -v compute-sanitizer >/dev/null || ! wanted memcheck; then
  stage memcheck 45 compute-sanitizer --tool memcheck --error-exitcode 1 $PY tests/cuda_sanitize_cases.py
else
  note "compute-sanitizer not found: memcheck/racecheck NOT run"; failed=$((failed + 1))
fi
# SwiGLU at Qwen2.5-0.5B and Llama-7B widths, tanh GeGLU at Gemma-2-2B's (ffn_ext.GeGLUFFN when the package has
# it): 3 models x 3 implementations (10.6 s in the timing loop and 27 s in all with 2 models).
stage bench_ffn 40 $PY benchmarks/bench_ffn.py --quick --device cuda --no-progress --out "$LOGS/bench"
# The 2-rank DTensor / TP / FSDP2 checks on NCCL (CI runs them on gloo): only with 2 or more GPUs.
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ] || ! wanted nccl; then
  FFN_EXT_DIST_BACKEND=nccl stage nccl 60 $PY -m pytest -q tests/test_distributed.py -k two_gloo_ranks
else
  note "$(printf '%-12s skipped: the NCCL checks need 2 GPUs, this machine has fewer' nccl)"
fi
# The FFN layer's targets (unmeasured): SwiGLUFFN and its fused_gate_up / recompute / token_chunk variants
# next to eager, torch.compile and Liger (where installed) at Llama-7B and Llama-3-8B widths, decode to 16k tokens;
# then peak memory only at 32k-128k tokens with token_chunk=8192 (eager at 128k: about 26 GB). Not yet timed.
ffn_layer() {  # the gated FFNs, then the classic FFN (768 -> 3072 and 1024 -> 4096, GELU erf/tanh, 512-16k tokens)
  $PY benchmarks/bench_ffn.py --quick --variants --models llama-7b,llama-3-8b \
    --tokens 16,4096,16384 --dtypes bf16 --device cuda --no-progress --out "$LOGS/bench_ffn_layer" || return
  $PY benchmarks/bench_ffn.py --quick --classic --variants --device cuda --no-progress \
    --out "$LOGS/bench_ffn_classic"
}
export -f ffn_layer; export PY LOGS  # `timeout` runs commands, not shell functions: bash -c runs this one
stage ffn_layer 240 bash -c ffn_layer
stage ffn_long 120 $PY benchmarks/bench_ffn.py --quick --variants --memory-only --no-compile --models llama-3-8b \
  --tokens 32768,65536,131072 --token-chunk 8192 --dtypes bf16 --device cuda --no-progress --out "$LOGS/bench_ffn_long"
if command -v compute-sanitizer >/dev/null || ! wanted racecheck; then
  stage racecheck 40 compute-sanitizer --tool racecheck --error-exitcode 1 $PY tests/cuda_sanitize_cases.py
fi

note "failed stages: $failed"
save
echo "----- tail of the op benchmark (its targets) -----"; tail -n 56 "$LOGS/bench_ops.log" 2>/dev/null
echo "----- summary -----"; cat "$LOGS/summary.txt"
exit $failed

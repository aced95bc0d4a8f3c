#!/bin/bash
# One GPU-machine call: the contract suite on CUDA and the CUDA kernel-path suite, a warm-start
# check, compute-sanitizer memcheck over both, kernel timings and whole-model step timings
# (random weights). Full logs under
# $OUT; a short table is printed last.
#   source .devkit/env.sh && bash scripts/run_gpu_suite.sh [tests|cache|sanitizer|probe|bench|model ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${*:-tests cache sanitizer probe bench model}
export ATLAS_KERNEL_CACHE=/tmp/atlas-kernel-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
: > "$OUT/summary.txt"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'passed|failed|error|ERROR SUMMARY' "$OUT/$name.log" | tail -n 1 | cut -c1-100)" >> "$OUT/summary.txt"; }
for s in $STEPS; do case $s in
  tests) ATLAS_ERROR_LOG=$OUT/errors.txt step tests 420 python3 -m pytest tests/contract tests/gpu -m gpu -q -rfE -p no:cacheprovider --tb=short ;;
  cache) step cache 60 python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')
from atlas.adapters.cuda import CudaGpuBackend
for start in ('cold', 'warm'):
    import tempfile, os
    backend = CudaGpuBackend(kernel_cache_dir='/tmp/atlas-cache-check')
    backend.runtime.kernels.wait()
    print(start, 'start:', backend.runtime.kernels.compiler.stats.describe())
    backend.close()
print('passed')" ;;
  sanitizer) step sanitizer 360 compute-sanitizer --tool memcheck --print-limit 30 \
      python3 -m pytest tests/contract tests/gpu -m gpu -q -p no:cacheprovider --tb=line -x \
      -k "not warm_start and not too_large and not oom" ;;
  probe) step probe 60 compute-sanitizer --tool memcheck --print-limit 3 python3 scripts/sanitizer_probe.py ;;
  bench) step bench 150 python3 benchmarks/cuda/bench_kernels.py ;;
  model) step model 240 python3 benchmarks/cuda/bench_model_step.py ;;
esac; done
echo "--- tail of failures"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" 2>/dev/null | cut -c1-220 | head -40
echo "--- largest relative L2 error per test (bf16 bound 1e-2)"
sort -k2,2 -k1,1gr "$OUT/errors.txt" 2>/dev/null | awk '!seen[$2]++' | sed 's#tests/gpu/##' | cut -c1-150
echo "--- bench"; cat "$OUT/bench.log" 2>/dev/null | tail -34
echo "--- model"; cat "$OUT/model.log" 2>/dev/null | tail -14
echo "---"; cat "$OUT/summary.txt"

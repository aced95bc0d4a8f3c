#!/bin/bash
# One GPU-machine call for the MoE, recurrent and attention-variant kinds (model-families issue,
# part 3), most important first, each step time-boxed (about 10 minutes in all on an H200):
#   contract   the contract suite on CUDA for the dense, attention, moe and recurrent kinds
#   kinds      the CUDA paths of those kinds against the mock / float64 (tests/gpu/test_cuda_{moe,recurrent}.py,
#              the attention `_x` kernels), and Qwen3-Next (hybrid), Gemma 3 and GPT-OSS models on
#              them against transformers within its own bf16 error (test_cuda_recurrent_hybrid.py,
#              test_cuda_family_layers.py)
#   sanitizer  compute-sanitizer memcheck over a subset of those
#   bench      benchmarks/bench_kinds.py: MoE / GDN layers against their byte rooflines, 8k prefill
#              against transformers' own modules, sinks attention against plain
#   llama      the dense 8B figures (benchmarks/gpu_bench.sh quick), to compare with today's
# Full logs under $OUT; a short table is printed last.
#   source .devkit/env.sh && bash tests/gpu/run_kinds.sh [contract kinds sanitizer bench llama]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${*:-contract kinds sanitizer bench}
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
: > "$OUT/summary.txt"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'passed|failed|error|ERROR SUMMARY' "$OUT/$name.log" | tail -n 1 | cut -c1-100)" >> "$OUT/summary.txt"; }
PYTEST="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --tb=short"
# Compile every module once (NVRTC, cached under ATLAS_KERNEL_CACHE) before the timed steps.
python3 -c "from atlas.adapters.cuda import CudaGpuBackend; CudaGpuBackend().close()" > "$OUT/compile.log" 2>&1
for s in $STEPS; do case $s in
  contract) ATLAS_ERROR_LOG=$OUT/errors.txt step contract 150 $PYTEST tests/contract ;;
  kinds) ATLAS_ERROR_LOG=$OUT/errors.txt step kinds 200 $PYTEST -s tests/gpu/test_cuda_moe.py \
           tests/gpu/test_cuda_recurrent.py tests/gpu/test_cuda_recurrent_hybrid.py tests/gpu/test_cuda_family_layers.py \
           tests/gpu/test_cuda_attention_ops.py -k "moe or recurrent or family or extras or head_dim_256" ;;
  sanitizer) step sanitizer 150 compute-sanitizer --tool memcheck --print-limit 20 $PYTEST -x \
           tests/gpu/test_cuda_moe.py tests/gpu/test_cuda_recurrent.py tests/gpu/test_cuda_attention_ops.py \
           -k "(match_the_mock and (1-2048 or 65-512 or 150-320 or odd)) or (extras and gpt_oss)" ;;
  bench) step bench 200 python3 benchmarks/bench_kinds.py moe gdn sinks prefill ;;
  llama) step llama 300 python3 -m atlas.app.cli bench --random llama-3.1-8b --device cuda --batch-sizes 1,64 \
           --prefill-lens 512 --output-len 16 ;;
esac; done
echo "--- failures"; grep -hE "^(FAILED|ERROR)" "$OUT"/*.log 2>/dev/null | cut -c1-220 | head -30
echo "--- model error"; grep -h "atlas .* transformers-bf16" "$OUT/kinds.log" 2>/dev/null | head -6
echo "--- largest relative L2 error per test (bf16 bound 1e-2)"
sort -k2,2 -k1,1gr "$OUT/errors.txt" 2>/dev/null | awk '!seen[$2]++' | sed 's#tests/gpu/##' | cut -c1-150 | head -30
echo "--- sanitizer"; grep -E "ERROR SUMMARY|Invalid|out of bounds" "$OUT/sanitizer.log" 2>/dev/null | head -8
echo "--- bench"; tail -n 12 "$OUT/bench.log" 2>/dev/null
echo "--- llama"; grep -vE "^(loading|writing)|INFO|^\s*$" "$OUT/llama.log" 2>/dev/null | tail -n 10
echo "---"; cat "$OUT/summary.txt"

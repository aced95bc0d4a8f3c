#!/bin/bash
# FP8 weights on one Hopper GPU, in one command: the FP8 GPU tests (each path against the exact
# dequantization, the graph replay, the 8B / 1B cuts against transformers on the dequantized
# weights, the dense kind's contract cases), then Llama-3.1-8B in bf16 and in FP8 on the same
# machine (batch 1 and 64, 8192-token prefill), then the table. Logs and JSON in $OUT.
#   bash benchmarks/fp8_gpu_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
export ATLAS_ERROR_LOG="$OUT/fp8-errors.txt"
cd "$(dirname "$0")/.."
t0=$SECONDS
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_cuda_fp8_weights.py \
  tests/gpu/test_models.py tests/contract/test_dense_kind.py -k "fp8_weights or fp8_checkpoints or fp8_batch or quantized" -s \
  > "$OUT/fp8-tests.log" 2>&1
echo "=== FP8 GPU tests rc=$? $((SECONDS - t0))s"
grep -E "passed|failed|error|atlas error" "$OUT/fp8-tests.log" | tail -n 12
bash benchmarks/gpu_bench.sh llama8b-fp8w
echo "=== FP8 weights against bf16 (same GPU, bf16 KV cache in both)"
python3 benchmarks/fp8_table.py "$OUT/llama8b-bf16.json" "$OUT/llama8b-fp8w.json" \
  $( [ -f "$OUT/llama8b-fp8w-fp8kv.json" ] && echo "$OUT/llama8b-fp8w-fp8kv.json" )

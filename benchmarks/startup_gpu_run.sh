#!/bin/bash
# Issue 29 section 5, cold and warm start of the Llama-3.1-8B-shape checkpoint, on one GPU (~4-6 min):
#   source .devkit/env.sh && bash benchmarks/startup_gpu_run.sh [main bulk-off reads-off few-graphs]
# (no argument runs all three; STARTS overrides main's starts, default cold,nvrtc,warm)
# Prints a phase table per start (atlas bench startup); logs in $OUT.
#   main:        cold (empty kernel cache, packaged cubins asked for), nvrtc (empty cache, cubins off), warm
#   bulk-off:    cold and warm with the driver's pageable weight copies (ATLAS_CUDA_DISABLE=bulk_upload)
#   reads-off:   warm with the ring copying out of the map instead of preadv (ATLAS_CUDA_DISABLE=file_reads)
#   few-graphs:  cold and warm capturing decode graphs up to batch 8 only (--max-batch-size 8)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ATLAS="python3 -m atlas.app.cli"
LLAMA=$HOME/.cache/atlas/bench/llama-3.1-8b
SERVE="--max-seq-len 8192"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "^Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
python3 -m atlas.adapters.cuda.prebuild --check | tee -a "$OUT/gpu.txt"
t0=$SECONDS
timeout 240 python3 -c "
from atlas.app.bench.random_model import write_random_model
write_random_model('llama-3.1-8b', '$LLAMA')" 2>&1 | tail -n 1
echo "=== checkpoint ready in $((SECONDS - t0)) s: $(du -sh "$LLAMA" | cut -f1)"
cat "$LLAMA"/*.safetensors > /dev/null  # in the page cache, as the docs' figures assume
run() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t))s"; grep -vE "^starting atlas serve" "$OUT/$name.log" | tail -n 60; }
RUNS=${*:-main bulk-off few-graphs}
want() { [[ " $RUNS " == *" $1 "* ]]; }
want main && run main 300 $ATLAS bench startup "$LLAMA" --device cuda --serve-args "$SERVE" \
  --starts "${STARTS:-cold,nvrtc,warm}"
want bulk-off && run bulk-off 100 env ATLAS_CUDA_DISABLE=bulk_upload $ATLAS bench startup "$LLAMA" --device cuda \
  --serve-args "$SERVE" --starts cold,warm
want reads-off && run reads-off 100 env ATLAS_CUDA_DISABLE=file_reads $ATLAS bench startup "$LLAMA" --device cuda \
  --serve-args "$SERVE" --starts cold,warm
want few-graphs && run few-graphs 100 $ATLAS bench startup "$LLAMA" --device cuda --serve-args "$SERVE --max-batch-size 8" \
  --starts cold,warm
echo "=== total $((SECONDS - t0)) s"

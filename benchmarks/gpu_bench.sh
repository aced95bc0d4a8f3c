#!/bin/bash
# The speed issue's measurements on a GPU machine, one step per argument; logs and JSON in $OUT.
#   source .devkit/env.sh && bash benchmarks/gpu_bench.sh [quick llama8b llama8b-fp8 llama8b-fp8w smollm2 startup serve]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
ATLAS="python3 -m atlas.app.cli"
LLAMA=$HOME/.cache/atlas/bench/llama-3.1-8b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -vE "^(loading|writing)|INFO|^\s*$" "$OUT/$name.log" | tail -n 25; }
for step in ${*:-quick llama8b}; do case $step in
  quick) run quick 300 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 1,64 --prefill-lens 512 \
           --output-len 16 ;;
  llama8b) run llama8b 560 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 1,8,32,64,128 \
           --reference hf --json "$OUT/llama8b.json" --plot "$OUT/llama8b.png" ;;
  # the same run over an FP8 (E4M3) KV cache: half the KV bytes a step reads
  llama8b-fp8) run llama8b-fp8 560 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 1,8,32,64,128 \
           --kv-cache-dtype fp8 --reference hf --json "$OUT/llama8b-fp8.json" --plot "$OUT/llama8b-fp8.png" ;;
  # FP8 weights (E4M3 per channel, the random checkpoint written as compressed-tensors) beside the
  # bf16 run, both over a bf16 KV cache (FP8_KV=1 adds the FP8 weights over an FP8 cache)
  llama8b-fp8w) run llama8b-bf16 400 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 1,64 \
           --prefill-lens 8192 --json "$OUT/llama8b-bf16.json"
         run llama8b-fp8w 400 $ATLAS bench --random llama-3.1-8b --quantization fp8 --device cuda \
           --batch-sizes 1,64 --prefill-lens 8192 --json "$OUT/llama8b-fp8w.json"
         if [ "${FP8_KV:-0}" = 1 ]; then
           run llama8b-fp8w-fp8kv 400 $ATLAS bench --random llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \
             --device cuda --batch-sizes 1,64 --prefill-lens 8192 --json "$OUT/llama8b-fp8w-fp8kv.json"
         fi ;;
  smollm2) run smollm2 200 $ATLAS bench --random smollm2-135m --device cuda --batch-sizes 1,16,64 \
           --output-len 256 --json "$OUT/smollm2.json" ;;
  startup) run startup 400 $ATLAS bench startup "$LLAMA" --device cuda --serve-args "--max-seq-len 8192" ;;
  # The HTTP run's streams grow from 512 to 1536 tokens (mean context 1024): the engine figure it is
  # compared with decodes at that mean context too.
  serve) run engine64 200 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 64 --prefill-lens 8 \
           --context 1024 --output-len 64
         $ATLAS serve "$LLAMA" --device cuda --port 8899 --max-seq-len 4096 --max-num-seqs 64 > "$OUT/server.log" 2>&1 &
         server=$!
         for _ in $(seq 300); do curl -sf http://127.0.0.1:8899/health > /dev/null && break; sleep 1; done
         # one wave of 64 long streams: steady-state decode behind HTTP, comparable with engine64
         run serve 300 $ATLAS bench serve --url http://127.0.0.1:8899 --concurrency 64 --num-prompts 64 \
           --input-len 512 --output-len 1024
         # four waves of short requests: prefill of each wave interleaved with the decodes
         run serve-waves 300 $ATLAS bench serve --url http://127.0.0.1:8899 --concurrency 64 --num-prompts 256 \
           --input-len 512 --output-len 128
         kill $server ;;
esac; done

#!/bin/bash
# Issue 29 section 5: why the Llama-3.1-8B's first decode step traps (CUDA_ERROR_ILLEGAL_INSTRUCTION)
# with the packaged cubins and not with NVRTC's. One GPU, about 3-4 minutes:
#   source .devkit/env.sh && bash scripts/packaged_cubins_bisect.sh
# Logs in $OUT. Steps, each in its own process (a trap poisons the context); read top to bottom:
#   packaged    decode attention at the 8B and SmolLM2 heads, every module packaged
#   nvrtc       the same with attention_decode from NVRTC (the rest packaged)
#   nvcc-here   the same with attention_decode built by this machine's nvcc (and whether that
#               cubin is byte-identical to the shipped one)
#   sanitizer   compute-sanitizer memcheck over the packaged 8B prefill and first decode step
#   8b-decode-only  atlas bench of the random 8B, batch 1, with only attention_decode packaged
#               (NVRTC compiles the other modules, ~66 s); FULL=1 adds 8b-all-but-decode, the converse,
#               and 8b-packaged-no-pdl, every module packaged without programmatic launches (is
#               the trap the kernel before attention's, reported at attention's launch?)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=$(mktemp -d)  # NVRTC compiles once across the steps, never from an older cache
export CUDA_LAUNCH_BLOCKING=1
PROBE="python3 scripts/packaged_cubins_probe.py"
ALL_BUT_DECODE=allreduce,attention_prefill,attention_prefill_x,dense_variants,elementwise,fp8_quantize,gated_delta,gemv,gemv_fp8,moe,norm,rope_cache,sampling
t0=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -n 2
  python3 -c "from atlas.adapters.cuda.compiler import nvrtc_version; print('NVRTC', nvrtc_version())"
  python3 -m atlas.adapters.cuda.prebuild --check; } 2>&1 | tee "$OUT/env.txt"
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t))s"; grep -vE "^\s*$" "$OUT/$name.log" | tail -n 14; }
step packaged 60 env ATLAS_PACKAGED_CUBINS=1 $PROBE
step nvrtc 90 env ATLAS_PACKAGED_CUBINS=1 ATLAS_PACKAGED_CUBINS_SKIP=attention_decode $PROBE
step nvcc-here 120 env ATLAS_PACKAGED_CUBINS=1 $PROBE --nvcc-here "$OUT/nvcc-here"
step sanitizer 120 env ATLAS_PACKAGED_CUBINS=1 compute-sanitizer --tool memcheck --print-limit 10 $PROBE --quick
BENCH="python3 -m atlas.app.cli bench --random llama-3.1-8b --device cuda --batch-sizes 1 --output-len 8"
step 8b-decode-only 200 env ATLAS_PACKAGED_CUBINS=1 ATLAS_PACKAGED_CUBINS_SKIP=$ALL_BUT_DECODE $BENCH
if [ "${FULL:-0}" = 1 ]; then
  step 8b-all-but-decode 150 env ATLAS_PACKAGED_CUBINS=1 ATLAS_PACKAGED_CUBINS_SKIP=attention_decode $BENCH
  step 8b-packaged-no-pdl 150 env ATLAS_PACKAGED_CUBINS=1 ATLAS_CUDA_DISABLE=pdl $BENCH
fi
echo "=== total $((SECONDS - t0)) s"

#!/bin/bash
# One GPU-machine call for the model-level checks: random real configs against transformers,
# the engine on CUDA (graphs and overlapped steps against eager), and the CUDA op suite.
#   source .devkit/env.sh && bash scripts/run_model_checks.sh [models ops smolprep smollm2 e2e]
# smolprep joins the SmolLM2 GGUF carried in pieces (.smol1/part .smol2/part .smol3/part, as
# `split -n 3` cut it) and imports it into Atlas's cache, where `smollm2` then resolves.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${*:-models ops}
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
: > "$OUT/summary.txt"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -n 1 | cut -c1-110)" >> "$OUT/summary.txt"; }
for s in $STEPS; do case $s in
  models) step models 400 python3 -m pytest tests/gpu/test_models.py -m gpu -q -s -rfE -p no:cacheprovider --tb=short -k "not smollm2" ;;
  ops) step ops 330 python3 -m pytest tests/gpu -m gpu -q -rfE -p no:cacheprovider --tb=short --ignore=tests/gpu/test_models.py ;;
  smolprep) cat .smol1/part .smol2/part .smol3/part > /tmp/smollm2.gguf && md5sum /tmp/smollm2.gguf | tee -a "$OUT/summary.txt"
    step smolprep 120 python3 -m atlas.app.cli import-gguf /tmp/smollm2.gguf "$HOME/.cache/atlas/models/smollm2" ;;
  e2e) export ATLAS_E2E_DEVICE=cuda; step e2e 400 python3 -m pytest tests/e2e -q -rfE -p no:cacheprovider --tb=short ;;
  smollm2) step smollm2 400 python3 -m pytest tests/gpu/test_models.py -m gpu -q -s -rfE -p no:cacheprovider --tb=short -k smollm2 ;;
esac; done
echo "--- failures"; grep -hE "^(FAILED|ERROR)|Error|error:" "$OUT"/*.log 2>/dev/null | cut -c1-240 | head -30
echo "--- model errors"; grep -h "atlas .* transformers-bf16\|cuda .* tokens" "$OUT"/*.log 2>/dev/null | head -20
echo "---"; cat "$OUT/summary.txt"

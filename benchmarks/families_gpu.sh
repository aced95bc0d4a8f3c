#!/bin/bash
# Issue 30 (model families on layer kinds) on one H200 or H100 in one command of about nine
# minutes. Steps run most important first, each time-boxed and all within BUDGET seconds (a step
# that would start with under 20 s left is skipped); logs and JSON in $OUT, one table last
# (benchmarks/families_table.py).
#   families  the four families' real configs cut to a few layers on CUDA against transformers:
#             prefill, decode, batched decode, chunked prefill (tests/gpu/test_models.py)
#   doctor    atlas doctor on CUDA for Qwen3-MoE, Qwen3-Next, Gemma 3, GPT-OSS (test_doctor_cuda.py)
#   contract  the contract suite on CUDA (tests/contract)
#   moe       atlas bench --random qwen3-30b-a3b: batch 1 and 64 against the bytes they read, 8k prefill
#             against transformers (its own random draw of the same shapes, --reference hf-random)
#   dense     atlas bench --random llama-3.1-8b: batch 1 and 64, 8k prefill (docs/benchmarks.md's figures)
#   next      as moe, for Qwen3-Next at full width, 36 layers on an H200 (20 on an H100): batch 1
#   kinds     the MoE and recurrent kinds' own GPU tests against the mock, with what time is left
#   source .devkit/env.sh && bash benchmarks/families_gpu.sh [steps...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
export ATLAS_OUTCOMES_LOG="$OUT/outcomes.txt" PYTHONPATH="$(pwd)/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${BUDGET:-545}
START=$SECONDS
ATLAS="python3 -m atlas.app.cli"
PYTEST="python3 -m pytest -m gpu -p pytest_outcomes -p no:cacheprovider -q -s --tb=short"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MEMORY_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
NEXT=qwen3-next-20l; [ "${MEMORY_MIB:-0}" -ge 120000 ] && NEXT=qwen3-next-36l
: > "$OUT/steps.txt"; : > "$OUT/outcomes.txt"

step() {  # step NAME LIMIT COMMAND...: at most LIMIT seconds, and never past the budget
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then echo "$name skipped 0" >> "$OUT/steps.txt"; echo "=== $name skipped"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name $rc $((SECONDS - t0))" >> "$OUT/steps.txt"
  echo "=== $name rc=$rc $((SECONDS - t0))s (limit ${limit}s)"
}

bench() {  # bench NAME LIMIT CONFIG FLAGS...
  local name=$1 limit=$2 config=$3; shift 3
  step "$name" "$limit" $ATLAS bench --random "$config" --device cuda --prefill-lens 8192 --json "$OUT/$name.json" "$@"
}

for s in ${*:-families doctor contract moe dense next kinds}; do case $s in
  families) step families 230 $PYTEST tests/gpu/test_models.py -k families_prefill_decode_and_chunk ;;
  doctor) step doctor 90 $PYTEST tests/gpu/test_doctor_cuda.py -k "qwen3_moe or qwen3_next or gemma3 or gpt_oss" ;;
  contract) step contract 90 $PYTEST tests/contract ;;
  moe) bench moe 200 qwen3-30b-a3b --batch-sizes 1,64 --reference hf-random --reference-batch-sizes "" ;;
  dense) bench dense 150 llama-3.1-8b --batch-sizes 1,64 ;;
  next) bench next 300 "$NEXT" --batch-sizes 1 --max-num-seqs 8 --reference hf-random --reference-batch-sizes "" ;;
  kinds) step kinds 120 $PYTEST -x tests/gpu/test_cuda_moe.py tests/gpu/test_cuda_recurrent.py ;;
  *) echo "unknown step $s (families doctor contract moe dense next kinds)" ;;
esac; done
echo "--- failures"; grep -hE "^(FAILED|ERROR)|Error:|error:" "$OUT"/{families,doctor,contract,kinds}.log 2>/dev/null | cut -c1-200 | head -20
for name in moe next dense; do
  [ -f "$OUT/$name.json" ] || { echo "--- $name: no figures"; tail -n 5 "$OUT/$name.log" 2>/dev/null; }
done
python3 benchmarks/families_table.py "$OUT"

#!/bin/bash
# Tensor and expert parallelism on a 2- or 4-GPU machine: the issue's checks and figures, most
# important first, each step time-boxed (about 9 minutes in all); logs and JSON in $OUT, a
# short table last.
#   source .devkit/env.sh && bash benchmarks/tp.sh     2 GPUs: check llama8b allreduce table
#                                                      4 GPUs: check llama70b allreduce table
#   bash benchmarks/tp.sh qwen3moe table               (once the CUDA MoE kernels have landed)
# Steps: check (tests/gpu/test_parallel_models.py: vs transformers, graphs = eager bits; TP=2
#   and EP=2 on 2 GPUs, TP=4 on 4), llama8b (8B batch 1, TP=2 vs TP=1), llama70b (70B shape,
#   TP=4, batch 1 vs the per-rank roofline), allreduce (decode-size all-reduce, P2P vs NCCL),
#   qwen3moe (Qwen3-30B-A3B, expert parallel 2 vs one GPU, batch 64), table.
# Random weights are generated as each rank loads its part (no checkpoint files are written).
set -uo pipefail
OUT=${OUT:-/tmp/out/tp}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
export NCCL_NVLS_ENABLE=0
ATLAS="python3 -m atlas.app.cli"
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -vE "INFO|^\s*$" "$OUT/$name.log" | tail -n 12; }
# decode at batch 1 (or 64), one graph size, a short prefill: the figures in seconds, not minutes
bench() { local name=$1 limit=$2 model=$3 batch=$4; shift 4
  run "$name" "$limit" $ATLAS bench --random "$model" --device cuda --batch-sizes "$batch" --max-num-seqs "$batch" \
    --max-batch-size "$batch" --prefill-lens 128 --max-seq-len 1024 --output-len 48 --json "$OUT/$name.json" "$@"; }
DEFAULT="check llama8b allreduce table"
[ "$GPUS" -ge 4 ] && DEFAULT="check llama70b allreduce table"
for step in ${*:-$DEFAULT}; do case $step in
  check) filter="tp2 or ep2"; [ "$GPUS" -ge 4 ] && filter="tp4 or ep4"
         run check 240 python3 -m pytest tests/gpu/test_parallel_models.py -m gpu -q -s -k "$filter" ;;
  llama8b) bench llama8b-tp1 120 llama-3.1-8b 1
           bench llama8b-tp2 150 llama-3.1-8b 1 --tensor-parallel-size 2 ;;
  llama70b) bench llama70b-tp4 270 llama-3.1-70b 1 --tensor-parallel-size 4 ;;
  allreduce) run allreduce 60 python3 benchmarks/allreduce.py --world-size "$GPUS" --skip-checks ;;
  qwen3moe) bench qwen3moe-ep2 240 qwen3-30b-a3b 64 --tensor-parallel-size 2 --enable-expert-parallel
            bench qwen3moe-tp1 200 qwen3-30b-a3b 64 --gpu-memory-utilization 0.95 ;;
  table) python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def decode(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text())["decode"][0] if path.exists() else None
def ratio(a, b):
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if a and b else "n/a"
rows = []
tp1, tp2 = decode("llama8b-tp1"), decode("llama8b-tp2")
rows.append(("8B batch 1, TP=2 / TP=1 tokens/s (>= 1.6x)", ratio(tp2, tp1),
             f"{tp1['tokens_per_s']:.0f} -> {tp2['tokens_per_s']:.0f} tok/s" if tp1 and tp2 else ""))
big = decode("llama70b-tp4")
rows.append(("70B shape TP=4 batch 1, of the per-rank roofline (>= 75%)",
             f"{100 * big['roofline_fraction']:.1f}%" if big else "n/a",
             f"{big['tokens_per_s']:.1f} tok/s, collectives {big['collective_ms']:.3f} ms/step" if big else ""))
ep2, one = decode("qwen3moe-ep2"), decode("qwen3moe-tp1")
rows.append(("Qwen3-30B-A3B batch 64, EP=2 / one GPU (>= 1.6x)", ratio(ep2, one), ""))
if tp2:
    rows.append(("8B TP=2 collectives per decode step", f"{tp2['collective_ms']:.3f} ms", ""))
for name, value, note in rows:
    print(f"{name:<58} {value:>9}  {note}")
log = out / "allreduce.log"
if log.exists():
    print("all-reduce at decode sizes (us; P2P vs NCCL), from allreduce.log:")
    print("\n".join(line for line in log.read_text().splitlines() if "INFO" not in line)[-1500:])
EOF
  ;;
  *) echo "unknown step $step" ;;
esac; done

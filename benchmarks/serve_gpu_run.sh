#!/bin/bash
# Issue 29's serving bars ("What must hold" 1 and 2) on one GPU, in one command (~5-8 minutes):
# `atlas serve` on the random Llama-3.1-8B checkpoint, five `atlas bench serve` runs against it,
# the server restarted once with --no-prefix-caching, then one table with the ratios
# (benchmarks/serve_table.py). Logs, JSON and PNGs in $OUT.
#   source .devkit/env.sh && bash benchmarks/serve_gpu_run.sh
# Every size is a variable, so the same script runs small on the CPU to check its plumbing:
#   DEVICE=mock MODEL=smollm2 NUM=8 CONC=4 MIXED_IN=16:64 MIXED_OUT=4:16 FIXED_IN=40 FIXED_OUT=10 \
#     PREFIX=128 PREFIX_OUT=4 CHATS=2 TURNS=3 CHAT_IN=8:24 CHAT_OUT=4:8 SERVE_ARGS="--kv-cache-gb 0.5" \
#     bash benchmarks/serve_gpu_run.sh
# Arguments (or RUNS) pick the runs (mixed fixed prefix-on chat prefix-off; default all):
# `bash benchmarks/serve_gpu_run.sh prefix-on prefix-off` gives only the shared-prefix pair
# (~2 minutes). STEP_TRACE=1 makes each server write its engine steps to
# $OUT/<server>.steps.jsonl (ATLAS_STEP_TRACE; read them with benchmarks/step_trace_table.py).
# SETTLE=15 lets each server idle 15 s once ready, as a server up for a while has: it captures
# the decode graphs it deferred (the larger buckets, the shared-prefix variants) in that time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
ATLAS="python3 -m atlas.app.cli"
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-$HOME/.cache/atlas/bench/llama-3.1-8b}
PORT=${PORT:-8899}; URL=http://127.0.0.1:$PORT
NUM=${NUM:-256}; CONC=${CONC:-64}
MIXED_IN=${MIXED_IN:-16:900}; MIXED_OUT=${MIXED_OUT:-16:256}
FIXED_IN=${FIXED_IN:-512}; FIXED_OUT=${FIXED_OUT:-128}
PREFIX=${PREFIX:-2048}; SUFFIX=${SUFFIX:-32}; PREFIX_OUT=${PREFIX_OUT:-128}
CHATS=${CHATS:-32}; TURNS=${TURNS:-10}; CHAT_IN=${CHAT_IN:-16:128}; CHAT_OUT=${CHAT_OUT:-16:128}
SERVE_ARGS=${SERVE_ARGS:-"--max-seq-len 4096 --max-num-seqs $CONC"}
RUNS=${*:-${RUNS:-mixed fixed prefix-on chat prefix-off}}
SETTLE=${SETTLE:-0}  # seconds a ready server idles before the runs (its deferred graphs get captured)
t0=$SECONDS

device_name=$DEVICE
if [ "$DEVICE" = cuda ]; then
  device_name=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)
  echo "$device_name" | tee "$OUT/gpu.txt"
fi
# the folder `atlas bench --random llama-3.1-8b` writes, its weights generated as they load
if [ "$MODEL" = "$HOME/.cache/atlas/bench/llama-3.1-8b" ]; then
  python3 -c "from atlas.app.bench.random_model import write_random_model as w
w('llama-3.1-8b', '$MODEL', files=False)"
fi

server=
start_server() {  # $1: log name; the rest: extra serve flags
  local name=$1; shift
  ${STEP_TRACE:+env ATLAS_STEP_TRACE=$OUT/$name.steps.jsonl} $ATLAS serve "$MODEL" --device "$DEVICE" --port "$PORT" --shutdown-timeout 0 $SERVE_ARGS "$@" \
    > "$OUT/$name.log" 2>&1 &
  server=$!
  for _ in $(seq 400); do
    curl -sf "$URL/health" > /dev/null && { echo "=== $name ready at $((SECONDS - t0))s"; sleep "$SETTLE"; return 0; }
    kill -0 "$server" 2> /dev/null || break
    sleep 1
  done
  echo "=== $name did not come up; its log:"; tail -n 20 "$OUT/$name.log"; stop_server; return 1
}
stop_server() { [ -n "$server" ] && kill "$server" 2> /dev/null && wait "$server" 2> /dev/null; server=; }
trap stop_server EXIT

python3 -c "import matplotlib" 2> /dev/null && PLOT=1 || { PLOT=; echo "no matplotlib: no PNGs"; }
wanted() { [[ " $RUNS " == *" $1 "* ]]; }
bench() {  # $1: run name (its JSON is $OUT/$1.json); the rest: bench serve flags; skipped unless in $RUNS
  local name=$1 t=$SECONDS; shift
  wanted "$name" || return 0
  timeout 150 $ATLAS bench serve --url "$URL" --json-file "$OUT/$name.json" \
    ${PLOT:+--plot "$OUT/$name.png"} "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  echo "=== $name rc=$? $((SECONDS - t))s"; grep -E "^(throughput|TTFT|prefix cache)" "$OUT/$name.txt"
  grep -E "error|Error" "$OUT/$name.err" | tail -n 3
}

# Each run draws its texts from a seed of its own: the server's prefix cache keeps the earlier runs'
# blocks, and runs of one seed would open with the same words.
if { wanted mixed || wanted fixed || wanted prefix-on || wanted chat; } && start_server serve; then
  # Not measured: a short mixed run first, so that cuBLASLt's one-time tuning of the prefill
  # token buckets (stored on disk for later starts; decode buckets are tuned at startup) is not
  # inside the measured runs. On a fresh machine it cost the first mixed run ~11% (H200).
  RUNS="$RUNS warmup" bench warmup --seed 9 --num-prompts "$CONC" --concurrency "$CONC" \
    --input-len "$MIXED_IN" --output-len 16 --temperature 0.8
  bench mixed --seed 1 --num-prompts "$NUM" --concurrency "$CONC" \
    --input-len "$MIXED_IN" --output-len "$MIXED_OUT" --temperature 0.8
  bench fixed --seed 2 --num-prompts "$NUM" --concurrency "$CONC" \
    --input-len "$FIXED_IN" --output-len "$FIXED_OUT" --temperature 0.8
  bench prefix-on --seed 3 --num-prompts "$NUM" --concurrency "$CONC" \
    --shared-prefix-len "$PREFIX" --num-prefixes 1 --input-len "$SUFFIX" --output-len "$PREFIX_OUT"
  bench chat --seed 4 --endpoint chat --num-turns "$TURNS" --num-prompts $((CHATS * TURNS)) \
    --concurrency "$CHATS" --input-len "$CHAT_IN" --output-len "$CHAT_OUT"
  stop_server
fi
if wanted prefix-off && start_server serve-no-cache --no-prefix-caching; then
  bench prefix-off --seed 3 --num-prompts "$NUM" --concurrency "$CONC" \
    --shared-prefix-len "$PREFIX" --num-prefixes 1 --input-len "$SUFFIX" --output-len "$PREFIX_OUT"
  stop_server
fi
echo "=== issue 29 serving bars ($device_name, $((SECONDS - t0))s in all)"
python3 benchmarks/serve_table.py "$OUT"

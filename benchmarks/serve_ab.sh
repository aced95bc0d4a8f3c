#!/bin/bash
# Interleaved A/B of `atlas serve` variants under issue 29's serving runs, in one command on one
# machine (the host's speed drifts over minutes, so variants alternate round by round):
#
#   source .devkit/env.sh && ROUNDS=2 RUNS="prefix-on mixed" bash benchmarks/serve_ab.sh \
#       "cap::" "old::--max-admitted-tokens 2048" "nosplit:ATLAS_CUDA_DISABLE=prefill_split:"
#
# Each argument is NAME:ENV:FLAGS (ENV one VAR=value or empty; FLAGS added to the server's, no
# colons). Every round starts one server per variant in turn through benchmarks/serve_gpu_run.sh
# (its warm-up run first, then RUNS among mixed fixed prefix-on chat prefix-off), and prints one
# line per variant and run: output tok/s, TTFT p50 / p99, TPOT p50. Logs in $OUT/<round>-<name>/.
# The sizes are serve_gpu_run.sh's variables, so the same command runs small on the mock.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}
RUNS=${RUNS:-prefix-on mixed}
BASE=${SERVE_ARGS:-"--max-seq-len 4096 --max-num-seqs ${CONC:-64}"}
[ $# -ge 1 ] || { echo "usage: bash benchmarks/serve_ab.sh NAME:ENV:FLAGS ..." >&2; exit 2; }

python3 -c "from atlas.app.bench.structured import host_loop_ms; print(f'host loop {host_loop_ms():.1f} ms')"
printf "%-6s %-12s %-10s %10s %9s %9s %9s\n" round variant run "out tok/s" "TTFT p50" "TTFT p99" "TPOT p50"
for round in $(seq "$ROUNDS"); do
  for variant in "$@"; do
    IFS=: read -r name env flags <<< "$variant"
    dir="$OUT/$round-$name"; mkdir -p "$dir"
    env ${env:+"$env"} OUT="$dir" SERVE_ARGS="$BASE $flags" RUNS="$RUNS" bash benchmarks/serve_gpu_run.sh \
      > "$dir/run.log" 2>&1
    for run in $RUNS; do
      printf "%-6s %-12s %-10s " "$round" "$name" "$run"
      if [ -f "$dir/$run.txt" ]; then
        awk '/^throughput/{t=$2} /^TTFT/{p50=$3; p99=$5} /^TPOT/{tp=$3}
             END{printf "%10.1f %9.1f %9.1f %9.2f\n", t, p50, p99, tp}' "$dir/$run.txt"
      else
        echo "no result (see $dir/run.log)"
      fi
    done
  done
done
python3 -c "from atlas.app.bench.structured import host_loop_ms; print(f'host loop {host_loop_ms():.1f} ms')"

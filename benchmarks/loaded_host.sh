#!/bin/bash
# Run a command while $LOOPS (default 16) low-priority busy loops keep the host's cores busy: a
# stand-in for the slowed GPU hosts on which a host-bound loop (json_schema decode of a small
# model) loses rounds (docs/lab/structured-output.md, session 5). The engine's threads still win
# the cores (nice 19 against 0); every wake-up lands on a busy one.
#   LOOPS=16 bash benchmarks/loaded_host.sh atlas bench smollm2 --device cuda --batch-sizes 16 \
#       --json-schema benchmarks/records.schema.json
set -u
pids=()
for _ in $(seq "${LOOPS:-16}"); do
  nice -n 19 python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
"$@"

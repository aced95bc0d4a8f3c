#!/bin/bash
# Speculative decoding and structured output on one H200 (or H100): the issues' figures, most
# important first, each step time-boxed (about 7 minutes in all); logs and JSON in $OUT, a short
# table last.
#   source .devkit/env.sh && bash benchmarks/spec_masks.sh          ngram verify8b json table
#   bash benchmarks/spec_masks.sh check                             the GPU tests of both (3 minutes)
# Steps:
#   ngram     real SmolLM2 at batch 1 over the 24 shipped edit-and-repeat prompts, plain and with
#             n-gram drafts (k = 32) in one run: tokens/s of each, speed-up (issue 31: >= 2x),
#             acceptance length, identical outputs
#   ngram-inv the same at k = 7 with --batch-invariant (CUDA computes a verify row of a step of up to
#             8 rows as a one-row step would):
#             the outputs must be identical; plain and speculative both pay its batch-1 cost
#   verify8b  Llama-3.1-8B shape (random weights) at batch 1: a k = 4 verify step's device time
#             against a plain decode step's at the same context (issue 31: <= 1.15x)
#   json      real SmolLM2 at batch 1 and 16: json_schema decode against free decode in one run
#             (issue 28: >= 90% at batch 16); the schema's names have a maxLength, which costs
#             llguidance ~0.4 ms a mask on SmolLM2's vocabulary
#   json-unbounded   the same without maxLength (masks of ~10 us)
#   json-loaded   the json step at batch 16 with $LOOPS (default 16) nice-19 busy loops on the host
#             (benchmarks/loaded_host.sh): the slowed-host case the json line fails on
#   json8b    the Llama-3.1-8B shape (random weights) speaking SmolLM2's tokenizer
#             (benchmarks/with_tokenizer.py), batch 16, the maxLength schema
#   ngram-steps   the same prompts, plain and n-gram, every step timed: wall against device ms per
#             step of each kind (benchmarks/spec_steps.py; where a speculative step's time goes)
#   check     tests/gpu/test_cuda_masks_and_speculation.py
# SmolLM2 is read from $SMOLLM2 (default ~/.cache/atlas/models/smollm2, as `atlas pull smollm2`
# leaves it).
set -uo pipefail
OUT=${OUT:-/tmp/out/spec_masks}; mkdir -p "$OUT"
export ATLAS_KERNEL_CACHE=${ATLAS_KERNEL_CACHE:-/tmp/atlas-kernel-cache}
export ATLAS_SMOLLM2_DIR=${SMOLLM2:-$HOME/.cache/atlas/models/smollm2}
ATLAS="python3 -m atlas.app.cli"
NGRAM='{"method": "ngram", "num_speculative_tokens": 32}'  # the speed-up's k (docs/benchmarks.md)
NGRAM4='{"method": "ngram", "num_speculative_tokens": 4}'  # the verify step's k (issue 31)
NGRAM7='{"method": "ngram", "num_speculative_tokens": 7}'  # --batch-invariant covers steps of up to 8 rows
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -vE "^(loading|writing)|INFO|^\s*$" "$OUT/$name.log" | tail -n 12; }
smollm2() {
  if [ ! -f "$ATLAS_SMOLLM2_DIR/config.json" ]; then
    echo "=== $1 skipped: no SmolLM2 at $ATLAS_SMOLLM2_DIR (set SMOLLM2=/path/to/the/folder)"; return 1; fi; }
for step in ${*:-ngram verify8b json table}; do case $step in
  ngram) smollm2 ngram && run ngram 150 $ATLAS bench "$ATLAS_SMOLLM2_DIR" --device cuda --batch-sizes 1 \
           --output-len 256 --prefill-lens 512 --speculative-config "$NGRAM" --json "$OUT/ngram.json" ;;
  ngram-inv) smollm2 ngram-inv && run ngram-inv 150 $ATLAS bench "$ATLAS_SMOLLM2_DIR" --device cuda --batch-sizes 1 \
           --output-len 256 --prefill-lens 512 --batch-invariant --speculative-config "$NGRAM7" \
           --json "$OUT/ngram-inv.json" ;;
  verify8b) run verify8b 240 $ATLAS bench --random llama-3.1-8b --device cuda --batch-sizes 1 --max-num-seqs 1 \
           --max-batch-size 1 --output-len 24 --prefill-lens 512 --max-seq-len 2048 \
           --speculative-config "$NGRAM4" --json "$OUT/verify8b.json" ;;
  json) smollm2 json && run json 120 $ATLAS bench "$ATLAS_SMOLLM2_DIR" --device cuda --batch-sizes 1,16 \
           --output-len 256 --prefill-lens 512 --rounds 5 --json-schema benchmarks/records.schema.json \
           --json "$OUT/json.json" ;;
  json-loaded) smollm2 json-loaded && run json-loaded 120 bash benchmarks/loaded_host.sh $ATLAS bench "$ATLAS_SMOLLM2_DIR" \
           --device cuda --batch-sizes 16 --output-len 256 --prefill-lens 512 --rounds 5 \
           --json-schema benchmarks/records.schema.json --json "$OUT/json-loaded.json" ;;
  json-unbounded) smollm2 json-unbounded && run json-unbounded 120 $ATLAS bench "$ATLAS_SMOLLM2_DIR" --device cuda \
           --batch-sizes 1,16 --output-len 256 --prefill-lens 512 --rounds 5 \
           --json-schema benchmarks/records-unbounded.schema.json \
           --json "$OUT/json-unbounded.json" ;;
  json8b) smollm2 json8b && python3 benchmarks/with_tokenizer.py llama-3.1-8b "$ATLAS_SMOLLM2_DIR" /tmp/llama8b-smollm2-tokenizer \
           && run json8b 200 $ATLAS bench /tmp/llama8b-smollm2-tokenizer --device cuda --batch-sizes 16 --output-len 128 \
           --prefill-lens 512 --json-schema benchmarks/records.schema.json --json "$OUT/json8b.json" ;;
  ngram-steps) smollm2 ngram-steps && run ngram-steps 200 python3 benchmarks/spec_steps.py "$ATLAS_SMOLLM2_DIR" ;;
  check) run check 240 python3 -m pytest tests/gpu/test_cuda_masks_and_speculation.py -m gpu -q -s ;;
  table) python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
rows = []
ngram = load("ngram")
if ngram:
    row = ngram["speculative"][0]
    rows.append(("SmolLM2 batch 1, n-gram k=32 / plain tokens/s (>= 2x)", f"{row['speedup']:.2f}x",
                 f"{row['plain_tokens_per_s']:.0f} -> {row['speculative_tokens_per_s']:.0f} tok/s, acceptance length "
                 f"{row['mean_acceptance_length']:.2f}, {row['prompts']} prompts, "
                 f"identical: {row['identical_outputs']}, undrafted tokens "
                 f"{row.get('undrafted_tokens', '?')} of {row['output_tokens']}"))
invariant = load("ngram-inv")
if invariant:
    row = invariant["speculative"][0]
    rows.append(("SmolLM2 batch 1, n-gram k=7, --batch-invariant", f"{row['speedup']:.2f}x",
                 f"{row['plain_tokens_per_s']:.0f} -> {row['speculative_tokens_per_s']:.0f} tok/s, acceptance length "
                 f"{row['mean_acceptance_length']:.2f}, identical: {row['identical_outputs']}"))
verify = load("verify8b")
if verify and verify.get("verify_over_decode"):
    rows.append(("8B batch 1, k=4 verify step / decode step (<= 1.15x)", f"{verify['verify_over_decode']:.3f}x",
                 f"{verify['verify_step_ms']:.3f} ms vs {verify['decode_step_ms']:.3f} ms"))
for name, label in (("json", "SmolLM2, records"), ("json-unbounded", "SmolLM2, records without maxLength"),
                    ("json8b", "8B shape + SmolLM2 tokenizer, records"),
                    ("json-loaded", "SmolLM2, records, loaded host")):
    structured = load(name)
    for row in structured["structured"] if structured else ():
        target = " (>= 90%)" if row["batch"] == 16 else ""
        host = row.get("host_loop_ms") or [None] * len(row.get("ratios", ()))
        rounds = (" (rounds" + (", host loop ms" if any(host) else "") + ": " + ", ".join(f"{100 * r:.1f}" + (f" @{ms:.0f}" if ms else "")
                  for r, ms in zip(row["ratios"], host)) + ")") if "ratios" in row else ""
        rows.append((f"{label} b{row['batch']}, json / free{target}", f"{100 * row['ratio']:.1f}%",
                     f"{row['free_tokens_per_s']:.0f} free, {row['json_schema_tokens_per_s']:.0f} json tok/s{rounds}"))
for name, value, note in rows:
    print(f"{name:<58} {value:>9}  {note}")
EOF
  ;;
  *) echo "unknown step $step (ngram ngram-steps verify8b json json-unbounded json8b check table)"; exit 2 ;;
esac; done

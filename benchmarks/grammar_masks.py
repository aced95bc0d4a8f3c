"""Host cost of structured output per decode step: batched json_schema masks and accepts.

Runs `--batch` sequences under one JSON schema through `fill_batch_bitmask` (llguidance's
thread pool) and `TokenConstraint.accept`, drawing each token among the allowed ones, and
prints one JSON line with the mean and p90 milliseconds per step of each. To hide behind the
device, fill + accept must stay under the decode step time of the same batch (`atlas bench`).

    python benchmarks/grammar_masks.py --model ~/.cache/atlas/models/smollm2 --batch 16 --steps 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from atlas.adapters.grammar.llguidance import LlguidanceCompiler
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.domain.constraints import TokenConstraint, fill_batch_bitmask
from atlas.domain.token_mask import allowed_bits, bitmask_width
from atlas.ports.grammar import JsonSchema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("~/.cache/atlas/models/smollm2").expanduser())
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="llguidance threads (default: its own)")
    args = parser.parse_args()

    tokenizer = HfTokenizer.from_folder(args.model)
    vocab_size = tokenizer.vocab_size
    compiler = LlguidanceCompiler((args.model / "tokenizer.json").read_text(), vocab_size, tokenizer.eos_token_ids,
                                  tokenizer.token_id, num_threads=args.threads)
    grammar = compiler.compile(JsonSchema(SCHEMA), "response_format")
    constraints: list[TokenConstraint | None] = [TokenConstraint(grammar.new_matcher()) for _ in range(args.batch)]
    bitmask = np.zeros((args.batch, bitmask_width(vocab_size)), dtype=np.int32)
    rng = np.random.default_rng(0)
    fill_ms, accept_ms = [], []
    for _ in range(args.steps):
        if not any(constraints):
            constraints = [TokenConstraint(grammar.new_matcher()) for _ in range(args.batch)]
        started = time.perf_counter()
        fill_batch_bitmask(constraints, bitmask, compiler)
        fill_ms.append((time.perf_counter() - started) * 1e3)
        allowed = allowed_bits(bitmask, vocab_size)
        started = time.perf_counter()
        for row, constraint in enumerate(constraints):
            if constraint is None:
                continue
            token_id = int(rng.choice(np.flatnonzero(allowed[row])))
            if token_id in tokenizer.eos_token_ids:
                constraints[row] = None
            else:
                constraint.accept(token_id)
        accept_ms.append((time.perf_counter() - started) * 1e3)
    print(json.dumps({
        "batch": args.batch, "steps": args.steps, "vocab_size": vocab_size,
        "fill_ms_mean": round(float(np.mean(fill_ms)), 3), "fill_ms_p90": round(float(np.percentile(fill_ms, 90)), 3),
        "accept_ms_mean": round(float(np.mean(accept_ms)), 3),
        "accept_ms_p90": round(float(np.percentile(accept_ms, 90)), 3),
    }))


if __name__ == "__main__":
    main()

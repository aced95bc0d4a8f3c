"""`atlas bench MODEL`: decode tokens/s at given batch sizes, measured on the engine (no HTTP).

Each batch runs `batch` sequences with random prompts of `input_len` tokens that ignore eos and
generate `output_len` tokens. Prefill is excluded: timing starts once every sequence has its
first token, so the figure is steady-state decode throughput.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from atlas.app.builder import LoadedEngine, build_engine
from atlas.app.settings import EngineSettings
from atlas.domain.requests import Request, SamplingParams


def measure_decode(engine: LoadedEngine, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    """One batch; returns tokens/s, step time and counts."""
    core = engine.core
    rng = np.random.default_rng(seed)
    vocab = min(engine.config.vocab_size, engine.tokenizer.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for index in range(batch_size):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, size=input_len))
        core.add_request(Request(f"bench-{batch_size}-{index}", prompt, params, seed=index))
    produced = {}
    while len(produced) < batch_size:  # prefill until every sequence has its first token
        for output in core.step():
            produced[output.seq_id] = output.num_output_tokens
    num_steps = 0
    num_tokens = 0
    started_s = time.perf_counter()
    while core.has_unfinished:
        outputs = core.step()
        num_steps += 1
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
    elapsed_s = time.perf_counter() - started_s
    return {
        "batch": batch_size,
        "decode_steps": num_steps,
        "tokens": num_tokens,
        "seconds": elapsed_s,
        "tokens_per_s": num_tokens / elapsed_s if elapsed_s else 0.0,
        "step_ms": 1000 * elapsed_s / max(num_steps, 1),
    }


def run_decode_bench(settings: EngineSettings, batch_sizes: list[int], input_len: int, output_len: int) -> int:
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("--batch-sizes needs positive integers, e.g. 1,16")
    engine = build_engine(settings)
    print(f"model {engine.model_dir} on {engine.backend.name} ({engine.backend.capabilities.device_name})",
          file=sys.stderr)
    measure_decode(engine, 1, 8, 4)  # warm up: first-touch allocations, lazy conversions
    rows = []
    for batch_size in batch_sizes:
        print(f"measuring batch {batch_size} ...", file=sys.stderr)
        rows.append(measure_decode(engine, batch_size, input_len, output_len))
    print(f"{'batch':>6} {'decode tok/s':>13} {'step ms':>9} {'steps':>6}")
    for row in rows:
        print(f"{row['batch']:>6} {row['tokens_per_s']:>13.1f} {row['step_ms']:>9.2f} {row['decode_steps']:>6}")
    return 0

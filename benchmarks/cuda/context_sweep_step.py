"""Device time of the captured decode step by context length (not a test; prints a table).

Run: python benchmarks/cuda/context_sweep_step.py [context ...]   (default: 512 513 514 520 528 529)

The Llama-3.1-8B step of bench_model_step.py (random weights) at batch 1 and 64, every sequence
at the same context, two rounds. Decode attention takes its keys in tiles of 16, so a context
just past a multiple of 16 adds a tile holding a few keys; this shows what such a ragged tile
costs a step against the bytes it adds (`atlas bench` centres its timed contexts on 512, so half
of its steps have one).
"""

from __future__ import annotations

import sys

import numpy as np
from bench_model_step import Events, RandomFill, capture_decode_step, llama_8b_with_kv

from atlas.adapters.cuda import CudaGpuBackend

BATCHES = (1, 64)


def main(argv: list[str]) -> int:
    contexts = [int(a) for a in argv] or [512, 513, 514, 520, 528, 529]
    backend = CudaGpuBackend()
    events = Events(backend)
    fill = RandomFill(backend, np.random.default_rng(0), 0.02)
    model, kv = llama_8b_with_kv(backend, fill, max(BATCHES), max(contexts) + 16)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(2):
        for batch in BATCHES:
            for context in contexts:
                graph = capture_decode_step(backend, model, kv, batch, context)
                times.setdefault((batch, context), []).append(events.median_us(graph.replay, repeats=20))
                del graph
    print("step us, two rounds")
    print(f"{'context':<8}" + "".join(f"{c:>12}" for c in contexts))
    for batch in BATCHES:
        cells = ["/".join(f"{t:.0f}" for t in times[(batch, c)]) for c in contexts]
        print(f"{f'b{batch}':<8}" + "".join(f"{cell:>12}" for cell in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

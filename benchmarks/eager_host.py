"""How long the host takes to enqueue an eager (prefill or mixed) step, against the device.

Decode steps replay CUDA graphs; a step with a prompt chunk in it runs eagerly: Python walks
every layer and launches each kernel and cuBLASLt product itself. When that walk takes longer
than the device's work, the device waits on the host, and a slower host CPU makes the engine
slower. This script measures one eager step at a time on a real model:

    python3 benchmarks/eager_host.py ~/.cache/atlas/bench/llama-3.1-8b --shapes 1x300,16x32,64x32

For each shape (prompts x tokens, all admitted in one step, one output token each) it prints
`enqueue`: the wall time of the `EngineCore.step` call that builds and launches the step (the
device synchronised before it, so nothing else is queued), and `after`: how long the device
still ran once that call returned. `after` near zero means the step is host bound: its kernels
finished as fast as Python launched them. Prompts are random token ids (a seed each), so the
prefix cache does not shorten them; the first two steps of each shape are not reported (cuBLASLt
plans, first launches).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from atlas.app.llm import LLM
from atlas.domain.requests import Request, SamplingParams

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (atlas bench --random writes them)")
    parser.add_argument("--shapes", default="1x300,16x32,4x128,64x32",
                        help="prompts x tokens per step, comma-separated (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per shape (default 5)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or mock to check the script")
    args = parser.parse_args()
    shapes = [tuple(int(part) for part in shape.split("x")) for shape in args.shapes.split(",")]
    longest = max(length for _, length in shapes)
    llm = LLM(args.model, device=args.device, show_progress=False, max_seq_len=max(2048, 2 * longest),
              max_num_seqs=max(64, max(count for count, _ in shapes)))
    core, backend, vocab_size = llm.engine.core, llm.engine.backend, llm.engine.config.vocab_size
    if backend is None:
        parser.error("the model must run in this process (no --tensor-parallel-size)")
    counter = 0

    def prompt(length: int) -> tuple[int, ...]:
        nonlocal counter
        counter += 1
        return tuple(int(i) for i in np.random.default_rng(counter).integers(0, vocab_size, length))

    def step(count: int, length: int) -> tuple[float, float]:
        for _ in range(count):
            core.add_request(Request(request_id=f"eager-{counter}", prompt_token_ids=prompt(length), seed=counter,
                                     sampling=SamplingParams(max_tokens=1, temperature=0.0)))
        backend.synchronize()
        start = time.perf_counter()
        core.step()
        enqueued = time.perf_counter()
        backend.synchronize()
        done = time.perf_counter()
        while core.has_unfinished:
            core.step()
        return (enqueued - start) * 1e3, (done - enqueued) * 1e3

    print(f"{'prompts x tokens':>16}  {'enqueue ms (median)':>19}  {'after ms (median)':>17}  "
          "each step: enqueue / after")
    for count, length in shapes:
        for _ in range(2):
            step(count, length)
        rows = [step(count, length) for _ in range(args.repeats)]
        each = "  ".join(f"{enqueue:.2f} / {after:.2f}" for enqueue, after in rows)
        print(f"{f'{count} x {length}':>16}  {statistics.median(r[0] for r in rows):19.2f}  "
              f"{statistics.median(r[1] for r in rows):17.2f}  {each}")
    llm.close()


if __name__ == "__main__":
    main()

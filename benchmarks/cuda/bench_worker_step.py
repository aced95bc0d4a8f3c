"""Where a batch-1 decode step's time goes between the captured graph and the worker's step.

Run: python benchmarks/cuda/bench_worker_step.py [smollm2-135m | llama-3.1-8b] [gpu memory utilization, 0.9] [max_seq_len, 2048]

Builds the engine as `atlas bench` does (a random-weight checkpoint of the real config), runs one
sequence to a 512-token context, records a decode step, then times (device time: each variant
enqueued back to back, one sync at the end):

  graph      the decode graph alone (token gather, forward, sampling)
  +inputs    the staged input copy, then the graph
  submit     the worker's whole step (stage, copy, graph, id download)
  host       the host time of one `submit` call (the engine must stay below the device)
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from atlas.app.builder import build_engine
from atlas.app.settings import EngineSettings
from atlas.domain.requests import Request, SamplingParams

REPEATS = 200


def _timed(fn, sync) -> float:
    fn()
    sync()
    started = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    sync()
    return (time.perf_counter() - started) / REPEATS * 1e6


def main(name: str, memory_utilization: float, max_seq_len: int) -> None:
    from atlas.app.bench.random_model import write_random_model
    from atlas.app.model_store import atlas_home

    folder = write_random_model(name, atlas_home() / "bench" / name)
    engine = build_engine(
        EngineSettings(
            model=str(folder),
            device="cuda",
            max_seq_len=max_seq_len,
            max_num_seqs=8,
            gpu_memory_utilization=memory_utilization,
        )
    )
    core, worker, backend = engine.core, engine.core.executor, engine.backend
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, size=512))
    core.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True), seed=0))
    recorded = []
    original = worker.submit
    worker.submit = lambda batch, before_launch=None: (recorded.append(batch), original(batch, before_launch))[1]
    for _ in range(8):
        core.step()
    del worker.submit
    batch = recorded[-1]
    assert batch.num_tokens == 1, batch
    graph, _ = worker._graphs[1]
    buffers = worker.buffers
    sync = backend.synchronize

    from atlas.domain.sampling import pack_rows
    from atlas.domain.step_inputs import build_step_inputs, pad_decode_inputs

    packed = pack_rows([seq.sampling for seq in batch.sequences])
    layout = worker.cache_layout
    inputs = pad_decode_inputs(build_step_inputs(batch, layout, buffers.max_seqs), 1, layout, buffers.max_seqs)

    def with_inputs() -> None:
        buffers.stage_inputs(inputs)
        buffers.stage_sampling(packed)
        buffers.send()
        graph.replay()

    pending = []

    def submit() -> None:
        pending.append(worker.submit(batch))
        if len(pending) > 16:
            pending.pop(0).result()

    def finish() -> None:
        while pending:
            pending.pop(0).result()
        sync()

    results = {
        "graph": _timed(graph.replay, sync),
        "+inputs": _timed(with_inputs, sync),
        "submit": _timed(submit, finish),
    }
    host = []
    for _ in range(50):
        started = time.perf_counter()
        step = worker.submit(batch)
        host.append((time.perf_counter() - started) * 1e6)
        step.result()
    results["host"] = statistics.median(host)
    blocks = worker.caches[0].spec.num_blocks
    print(
        f"{name} on {backend.capabilities.device_name}, batch 1, 512-token context, {blocks} KV blocks, max_seq_len {max_seq_len} ({REPEATS} steps each)"
    )
    for key, value in results.items():
        print(f"  {key:8s} {value:8.1f} us")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m",
        float(sys.argv[2]) if len(sys.argv) > 2 else 0.9,
        int(sys.argv[3]) if len(sys.argv) > 3 else 2048,
    )

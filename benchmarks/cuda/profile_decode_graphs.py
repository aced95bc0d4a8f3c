"""Kernel by kernel: the worker's batch-1 decode graph against bench_model_step.py's (not a test).

Run under Nsight Compute, which then times every kernel node of one replay of each graph:

  ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv \
      python3 benchmarks/cuda/profile_decode_graphs.py [smollm2-135m] > kernels.csv
  python3 benchmarks/cuda/profile_decode_graphs.py --report kernels.csv

Without ncu it prints both graphs' device time by events, in the same process (the worker's
graph came out ~30 us slower than the bench's forward + sampling; this finds which kernels).
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import numpy as np
from cuda.bindings import runtime as cudart

from atlas.app.builder import build_engine
from atlas.app.settings import EngineSettings
from atlas.domain.requests import Request, SamplingParams


def _graphs(name: str):
    from bench_model_step import SMOLLM2, Events, RandomFill, build_model, greedy_params, step_inputs

    from atlas.app.bench.random_model import write_random_model
    from atlas.app.model_store import atlas_home
    from atlas.domain.models.config import ModelConfig
    from atlas.ports.gpu import DType
    from atlas.ports.kernels.attention import KvCacheSpec

    folder = write_random_model(name, atlas_home() / "bench" / name)
    settings = EngineSettings(
        model=str(folder), device="cuda", max_seq_len=2048, max_num_seqs=8, gpu_memory_utilization=0.3
    )
    engine = build_engine(settings)
    core, worker, backend = engine.core, engine.core.executor, engine.backend
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, size=512))
    core.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True), seed=0))
    for _ in range(8):
        core.step()
    worker_graph, _ = worker._graphs[1]

    fill = RandomFill(backend, np.random.default_rng(1), 0.05)
    model = build_model(backend, fill, SMOLLM2, 1024)
    config = ModelConfig.from_dict(SMOLLM2)
    workspace = model.allocate_workspace(1, 1)
    params, out_ids = greedy_params(backend, 1), backend.empty((1,), DType.I32)
    graphs = {"worker": worker_graph}
    spec = KvCacheSpec(config.num_layers, 64, 16, config.num_kv_heads, config.head_dim, DType.BF16)
    kv = backend.attention.allocate_cache(spec)
    fill.fill_bytes(kv.base_address, spec.total_bytes)
    alive = [engine, model, workspace, params, out_ids, kv]
    # the bench's step (512-token context, captured for it), then the worker's context (520 after
    # its 8 steps) and capture length (2048: the graph's split count covers it)
    for context, captured_for in ((512, 512), (520, 520), (512, 2048), (520, 2048)):
        step, _ = step_inputs(backend, model, [context], [1])
        step = dataclasses.replace(step, metadata=(dataclasses.replace(step.metadata[0], max_seq_len=captured_for),))

        def forward(step=step) -> None:
            backend.sampling.sample(model.forward(step, (kv,), workspace, 1), params, out_ids)

        forward()
        backend.synchronize()
        graphs[f"bench, ctx {context} of {captured_for}"] = backend.capture(forward)
        alive.append(step)  # the graph holds its inputs' addresses, not the tensors
    return backend, Events(backend), graphs, alive


def main(name: str) -> None:
    backend, events, graphs, _alive = _graphs(name)
    for label, graph in graphs.items():
        graph.replay()
        print(f"{label:24s} graph {events.median_us(graph.replay, repeats=20):8.1f} us (events, 20 replays)")
    backend.synchronize()
    cudart.cudaProfilerStart()
    for label in ("worker", "bench, ctx 512 of 512"):
        graphs[label].replay()
        backend.synchronize()
    cudart.cudaProfilerStop()


def report(path: str) -> None:
    """Per kernel name: count and summed ns in the first graph (worker) and the second (bench)."""
    from profile_model_step import kernel_times

    rows = kernel_times(path, with_grid=False)
    # the worker's graph ends with its sample kernel; the bench graph follows
    first_sample = next(i for i, (_, kernel, _) in enumerate(rows) if kernel.startswith("sample_"))
    parts = {"worker": rows[: first_sample + 1], "bench": rows[first_sample + 1 :]}
    totals = {label: collections.defaultdict(lambda: [0, 0.0]) for label in parts}
    for label, part in parts.items():
        for _, kernel, ns in part:
            totals[label][kernel][0] += 1
            totals[label][kernel][1] += ns
    names = sorted(set(totals["worker"]) | set(totals["bench"]))
    print(f"{'kernel':48s} {'worker n':>8s} {'us':>9s} {'bench n':>8s} {'us':>9s}")
    for kernel in names:
        w, b = totals["worker"].get(kernel, [0, 0.0]), totals["bench"].get(kernel, [0, 0.0])
        print(f"{kernel[:48]:48s} {w[0]:8d} {w[1] / 1e3:9.1f} {b[0]:8d} {b[1] / 1e3:9.1f}")
    for label, part in parts.items():
        print(f"{label}: {len(part)} kernels, {sum(ns for *_, ns in part) / 1e3:.1f} us summed")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")

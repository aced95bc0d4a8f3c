"""Kernel by kernel: where one decode step of bench_model_step.py's graphs spends its time (not a test).

Each argument is model:batch:context (model smollm2 or llama8b). Under Nsight Compute every kernel
node of one replay of each graph is timed:

  ncu --profile-from-start off --graph-profiling node --clock-control none \
      --metrics gpu__time_duration.sum --csv \
      python3 benchmarks/cuda/profile_model_step.py llama8b:1:512 llama8b:64:512 > kernels.csv
  python3 benchmarks/cuda/profile_model_step.py --report kernels.csv

Kernels run one at a time under ncu (no overlap of one's tail with the next one's launch), so the
per-kernel sums exceed the graph's event time; the graph times printed first (outside the
profiled range) are the real ones.
"""

from __future__ import annotations

import collections
import csv
import sys

import numpy as np
from cuda.bindings import runtime as cudart

MODELS = {"smollm2": ("SMOLLM2", 0.05), "llama8b": ("LLAMA_8B", 0.02)}


def main(specs: list[str]) -> None:
    import bench_model_step as bench

    from atlas.adapters.cuda import CudaGpuBackend
    from atlas.domain.models.config import ModelConfig
    from atlas.ports.gpu import DType
    from atlas.ports.kernels.attention import KvCacheSpec

    backend = CudaGpuBackend()
    events = bench.Events(backend)
    parsed = [(name, int(batch), int(context)) for name, batch, context in (s.split(":") for s in specs)]
    graphs = []
    for name in dict.fromkeys(name for name, _, _ in parsed):
        config_name, scale = MODELS[name]
        fill = bench.RandomFill(backend, np.random.default_rng(0), scale)
        model = bench.build_model(backend, fill, getattr(bench, config_name), 8192)
        config = ModelConfig.from_dict(getattr(bench, config_name))
        wanted = [(batch, context) for n, batch, context in parsed if n == name]
        blocks = sum(batch * -(-context // bench._BLOCK_SIZE) for batch, context in wanted) + 64
        spec = KvCacheSpec(
            config.num_layers, blocks, bench._BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16
        )
        kv = backend.attention.allocate_cache(spec)
        fill.fill_bytes(kv.base_address, spec.total_bytes)
        for batch, context in wanted:
            step, _ = bench.step_inputs(backend, model, [context] * batch, [1] * batch)
            workspace = model.allocate_workspace(batch, batch)
            params, out_ids = bench.greedy_params(backend, batch), backend.empty((batch,), DType.I32)

            def forward(step=step, workspace=workspace, params=params, out_ids=out_ids, model=model, kv=kv) -> None:
                backend.sampling.sample(model.forward(step, (kv,), workspace, step.metadata[0].num_seqs), params, out_ids)

            forward()
            backend.synchronize()
            graph = backend.capture(forward)
            graph.replay()
            label = f"{name} b{batch} ctx{context}"
            print(f"{label:24s} graph {events.median_us(graph.replay, repeats=20):8.1f} us (events, 20 replays)")
            # a graph holds raw addresses: its inputs and workspace must outlive it, or later
            # uploads reuse their memory and its replay reads (and writes) someone else's
            graphs.append((graph, (step, workspace, params, out_ids)))
    backend.synchronize()
    cudart.cudaProfilerStart()
    for graph, _ in graphs:
        graph.replay()
        backend.synchronize()
    cudart.cudaProfilerStop()


def kernel_times(path: str, with_grid: bool) -> list[tuple[int, str, float]]:
    """(id, kernel name [and grid], ns) of every kernel in an ncu --csv duration file, in launch order."""
    rows = []
    with open(path, newline="") as handle:
        lines = [line for line in handle if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            kernel = row["Kernel Name"].split("(")[0]
            if with_grid:
                kernel += f" {row.get('Grid Size', '')}"
            rows.append((int(row["ID"]), kernel, float(row["Metric Value"].replace(",", ""))))
    return sorted(rows)


def report(path: str) -> None:
    """Per graph (each ends with its sample kernel), per kernel name and grid: count, summed and mean us."""
    rows = kernel_times(path, with_grid=True)
    part: list[tuple[int, str, float]] = []
    index = 0
    for row in rows:
        part.append(row)
        if row[1].startswith("sample_"):
            _print_graph(index, part)
            part, index = [], index + 1


def _print_graph(index: int, part: list[tuple[int, str, float]]) -> None:
    totals = collections.defaultdict(lambda: [0, 0.0])
    for _, kernel, ns in part:
        totals[kernel][0] += 1
        totals[kernel][1] += ns
    print(f"graph {index}: {len(part)} kernels, {sum(ns for *_, ns in part) / 1e3:.1f} us summed")
    print(f"  {'kernel grid':72s} {'n':>5s} {'us':>9s} {'us each':>8s}")
    for kernel, (count, ns) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"  {kernel[:72]:72s} {count:5d} {ns / 1e3:9.1f} {ns / 1e3 / count:8.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2])
    else:
        main(sys.argv[1:] or ["llama8b:1:512", "llama8b:64:512"])

"""Where one decode step's time goes, kernel by kernel, with the overlap left in (not a test).

Run: python benchmarks/cuda/timeline_model_step.py [batch ...] [skinny]   (default: 1 64; `skinny`:
the batch sizes above 8 again with the `skinny_gemm` feature on)

ncu (profile_model_step.py) runs kernels one at a time, and ablate_model_step.py learns a kind's
cost by leaving it out. Here CUPTI, through torch.profiler, records every kernel of a few
replays of bench_model_step.py's Llama-3.1-8B graph (random weights, 512-token contexts) as the
graph runs them, programmatic launch's overlap included. Per kind of kernel it prints the count,
the sum of durations, and the wall time the kind adds to the step: for each kernel, its end less
the later of its start and every earlier kernel's end (a kernel launched early that waits in
griddepcontrol.wait shows a long duration but adds only its tail). The GEMMs are named by their
place in the layer (qkv, o, gate_up, down, then the LM head).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from bench_model_step import LLAMA_8B, Events, RandomFill, capture_decode_step, llama_8b_with_kv

from atlas.adapters.cuda import CudaGpuBackend
from atlas.domain.models.config import ModelConfig

_GEMMS = ("qkv", "o", "gate_up", "down")
_KINDS = ("attention_decode", "rope", "add_rmsnorm", "rmsnorm", "act_mul", "add_into", "gather", "sample", "gemv")
_REPLAYS = 5  # the first is left out


def _kind(name: str) -> str:
    if name.startswith(("nvjet", "sm90_", "gemm_skinny")) or "cutlass" in name:
        return "GEMM"
    if "splitKreduce" in name:
        return "cuBLASLt split-K reduce"
    return next((kind for kind in _KINDS if kind in name), name[:40])


def _kernels(graph, backend) -> list[dict]:
    """The kernel records of _REPLAYS replays, in start order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(_REPLAYS):
            graph.replay()
        backend.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _table(kernels: list[dict], num_layers: int) -> tuple[dict, float]:
    """Per kind: [count, duration, wall, overlap] summed over the replays after the first (us),
    and the mean wall time of a step."""
    per_step = len(kernels) // _REPLAYS
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    walls = []
    for replay in range(1, _REPLAYS):
        step = kernels[replay * per_step : (replay + 1) * per_step]
        horizon = step[0]["ts"]
        walls.append(step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"])
        gemm = 0
        for kernel in step:
            kind = _kind(kernel["name"])
            if kind == "GEMM":
                kind = "GEMM LM head" if gemm == 4 * num_layers else f"GEMM {_GEMMS[gemm % 4]}"
                gemm += 1
            start, end = kernel["ts"], kernel["ts"] + kernel["dur"]
            row = totals[kind]
            row[0] += 1
            row[1] += kernel["dur"]
            row[2] += max(0.0, end - max(start, horizon))
            row[3] += max(0.0, horizon - start)
            horizon = max(horizon, end)
    count = _REPLAYS - 1
    return {kind: [value / count for value in row] for kind, row in totals.items()}, float(np.mean(walls))


def main(argv: list[str]) -> int:
    batches = [int(b) for b in argv if b.isdigit()] or [1, 64]
    runs = [(b, False) for b in batches] + ([(b, True) for b in batches if b > 8] if "skinny" in argv else [])
    backend = CudaGpuBackend()
    rt = backend.runtime
    features = rt.features
    events = Events(backend)
    fill = RandomFill(backend, np.random.default_rng(0), 0.02)
    model, kv = llama_8b_with_kv(backend, fill, max(batches))
    config = ModelConfig.from_dict(LLAMA_8B)
    torch.cuda.init()
    for batch, skinny in runs:
        rt.features = dataclasses.replace(features, skinny_gemm=skinny)
        graph = capture_decode_step(backend, model, kv, batch, 512)
        event_us = events.median_us(graph.replay, repeats=20)
        table, wall = _table(_kernels(graph, backend), config.num_layers)
        print(
            f"batch {batch}{' (skinny_gemm)' if skinny else ''}: step {event_us:.0f} us by events, "
            f"{wall:.0f} us first kernel start to last kernel end under CUPTI"
        )
        print(f"  {'kind':<26}{'count':>6}{'sum us':>9}{'wall us':>9}{'overlap':>9}{'us each':>9}")
        for kind, (count, duration, added, overlap) in sorted(table.items(), key=lambda item: -item[1][2]):
            print(f"  {kind:<26}{count:>6.0f}{duration:>9.1f}{added:>9.1f}{overlap:>9.1f}{duration / count:>9.2f}")
    rt.features = features
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where an `atlas bench` decode step spends its time, kernel by kernel (not a test).

    python3 benchmarks/cuda/timeline_bench.py --random qwen3-30b-a3b --device cuda --batch-sizes 1

takes `atlas bench`'s own arguments and runs it unchanged, but each batch size's device replay
(`replay_device_time`: one recorded decode step submitted back to back) is followed by a few more
replays under CUPTI (torch.profiler). Per kernel name it prints the launches a step, the summed
duration, and the wall time the kernel adds to the step: its end less the later of its start and
every earlier kernel's end, so a kernel launched early that waits in griddepcontrol.wait counts
only its tail. timeline_model_step.py does the same for a hand-built Llama graph.
With `--quantization fp8` a `--random` config is written as a per-channel FP8 checkpoint first
(experts included: the MoE step then runs the `_fp8` expert kernels).

TIMELINE_PATCH='{"atlas.adapters.cuda.ops_attention:MIN_TOKENS_PER_SPLIT": {"mma": 128, "simt": 128}}'
sets module attributes first, for an A/B of a tuning constant without editing it (keys that are
numbers become ints and lists tuples, as the tables are written).
TIMELINE_SEQUENCE=FIRST:COUNT also lists COUNT kernels of the last replayed step from its FIRST
kernel on, each with its start and end (us from the first one's start): where a layer's kernels
wait for each other.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from atlas.app.bench import measure
from atlas.app.cli import main as atlas_main

_REPLAYS = 6


def _kernels(run) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _table(kernels: list[dict], steps: int) -> None:
    if not kernels:
        print("  no kernels recorded (no CUDA device?)")
        return
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    horizon = kernels[0]["ts"] if kernels else 0.0
    for kernel in kernels:
        start, end = kernel["ts"], kernel["ts"] + kernel["dur"]
        row = totals[kernel["name"][:60]]
        row[0] += 1
        row[1] += kernel["dur"]
        row[2] += max(0.0, end - max(start, horizon))
        horizon = max(horizon, end)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / steps if kernels else 0.0
    added = sum(row[2] for row in totals.values()) / steps
    print(f"  {len(kernels) / steps:.0f} kernels a step, {span:.1f} us first start to last end a step, "
          f"{added:.1f} us of it busy")
    print(f"  {'kernel':<60}{'count':>7}{'sum us':>9}{'wall us':>9}{'us each':>9}")
    for name, (count, duration, wall) in sorted(totals.items(), key=lambda item: -item[1][2]):
        print(f"  {name:<60}{count / steps:>7.0f}{duration / steps:>9.1f}{wall / steps:>9.1f}{duration / count:>9.2f}")


def _sequence(kernels: list[dict], steps: int, spec: str) -> None:
    if not spec or not kernels:
        return
    first, count = (int(part) for part in spec.split(":"))
    step = kernels[len(kernels) // steps * (steps - 1):][first:first + count]
    if not step:
        return
    origin = step[0]["ts"]
    print(f"  {'kernel':<60}{'start':>9}{'end':>9}{'dur':>8}")
    for kernel in step:
        start = kernel["ts"] - origin
        print(f"  {kernel['name'][:60]:<60}{start:>9.2f}{start + kernel['dur']:>9.2f}{kernel['dur']:>8.2f}")


def _patch_value(value):
    """JSON's form of a tuning table as the modules write it: keys that are numbers become ints
    (`DECODE_MMA_SHAPES` is keyed by head dim), lists become tuples."""
    if isinstance(value, dict):
        return {int(key) if key.lstrip("-").isdigit() else key: _patch_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_patch_value(item) for item in value)
    return value


def _patch() -> None:
    for target, value in json.loads(os.environ.get("TIMELINE_PATCH", "{}")).items():
        module, name = target.split(":")
        value = _patch_value(value)
        setattr(importlib.import_module(module), name, value)
        print(f"patched {target} = {value!r}", file=sys.stderr)


def main(argv: list[str]) -> int:
    _patch()
    original = measure.replay_device_time

    def profiled(engine, batch, repeats: int = 30) -> float:
        seconds = original(engine, batch, repeats)
        worker = engine.core.executor

        def replays() -> None:
            pending = [worker.submit(batch) for _ in range(_REPLAYS)]
            pending[-1].result()

        kernels = _kernels(replays)
        print(f"batch {len(batch.sequences)} ({batch.num_tokens} tokens): {seconds * 1e6:.1f} us a step by replay",
              file=sys.stderr)
        _table(kernels, _REPLAYS)
        _sequence(kernels, _REPLAYS, os.environ.get("TIMELINE_SEQUENCE", ""))
        return seconds

    measure.replay_device_time = profiled
    return atlas_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The host's share of a decode step, phase by phase, with no GPU.

A decode step of a small model on a GPU is host bound when Python's work per step (schedule,
step inputs, commit, outputs) outlasts the device's step: the engine overlaps one step, so
host work hides only while it is shorter. This script isolates that work: a tiny random Llama
(1 layer, hidden 32) on the mock backend with graphs emulated, so the worker takes the CUDA
path (padding to a bucket, one staged copy, forward and sampler graph replays). During the
timed steps the graph replays do nothing by default (`--device none`), so the host's work runs
alone as it does next to a GPU; `--device mock` runs the mock's math, timed apart as `device`
and left out of the host total.

Each phase's time is its own (time spent in the phases it calls is subtracted), in
microseconds per step, over the timed steps of every repeat; the table gives each phase's
median over the repeats. Times are the thread's CPU time by default (`--clock cpu`), which
other processes on a busy machine do not inflate as they do wall time (`--clock wall`):

    python benchmarks/host_step.py --batch-sizes 16,64 --steps 200 --repeats 5
    python benchmarks/host_step.py --batch-sizes 64 --profile   # cProfile's top functions too

Phases: `schedule` (the scheduler's plan and its ScheduledBatch; with `--rows`, `rows`: each
sequence's ScheduledSequence with its sampling rows and tables, timed apart at ~1 us a sequence
of timer overhead that inflates `schedule` + `rows`), `submit` (the worker's own work), `pack`
(sampling rows into arrays), `inputs` (build_step_inputs and graph padding), `stage`
(into the host arena and the one copy), `sample` (enqueueing the sampler, the id download),
`readback` (ids to a StepResult), `commit` (resolve, stop checks, outputs), `engine` (the
core's own work), then the front end's: `detokenize` (SequenceText per output, as
`LLM.generate` and the HTTP side do) and `stats` (the engine actor's stats after each step).
`core` sums the engine core's phases (what `atlas bench`'s host gap measures on a GPU);
`host` adds the front end's.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# One BLAS thread: the tiny model's math needs no more, and idle BLAS threads spinning on a
# small machine would steal time from the host work measured here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from atlas.adapters.mock import backend as mock_backend  # noqa: E402
from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.adapters.mock.sampler import MockSampling  # noqa: E402
from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model  # noqa: E402
from atlas.app.builder import OneDevice, build_engine  # noqa: E402
from atlas.app.settings import EngineSettings  # noqa: E402
from atlas.domain import engine, scheduler, step_plan, worker  # noqa: E402
from atlas.domain.models.model import Model  # noqa: E402
from atlas.domain.requests import Request, SamplingParams  # noqa: E402
from atlas.domain.step_buffers import StepBuffers  # noqa: E402
from atlas.domain.text.sequence_text import SequenceText  # noqa: E402

CORE_PHASES = ("schedule", "rows", "submit", "pack", "inputs", "stage", "sample", "readback", "commit", "engine")
FRONT_PHASES = ("detokenize", "stats")
DEVICE = "device"


class PhaseClock:
    """Exclusive time per phase: a wrapped call's time minus its wrapped callees'."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)
        stack, totals, clock = self._stack, self.totals, self.clock

        def timed(*args, **kwargs):
            started = clock()
            stack.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = clock() - started
                totals[phase] += elapsed - stack.pop()
                if stack:
                    stack[-1] += elapsed

        setattr(owner, name, timed)
        self._restore.append(lambda: setattr(owner, name, original))

    def time(self, phase: str, fn: Callable[[], object]) -> object:
        started = self.clock()
        self._stack.append(0.0)
        try:
            return fn()
        finally:
            elapsed = self.clock() - started
            self.totals[phase] += elapsed - self._stack.pop()

    def reset(self) -> None:
        self.totals.clear()

    def unwrap(self) -> None:
        for restore in reversed(self._restore):
            restore()


class DeviceSwitch:
    """Graph replays that run the mock's math, or (off) do nothing: the host's phases then
    run alone, as next to a GPU, where the device's work neither takes the CPU nor evicts
    the host's data from its caches. The sampled ids stay those of the last real step."""

    def __init__(self) -> None:
        self.on = True
        self._replay = mock_backend._MockGraph.replay
        switch = self

        def replay(graph) -> None:
            if switch.on:
                switch._replay(graph)

        mock_backend._MockGraph.replay = replay


class EmulatedGraphs(OneDevice):
    """The whole model on the mock, reporting graph support so the worker takes the CUDA path."""

    def make_backend(self, settings, config):
        return MockGpuBackend(emulate_graphs=True)


def instrument(clock: PhaseClock, core: engine.EngineCore, rows: bool) -> None:
    clock.wrap(scheduler.Scheduler, "schedule", "schedule")
    if rows:
        clock.wrap(step_plan, "scheduled_sequence", "rows")
    clock.wrap(worker.Worker, "submit", "submit")
    clock.wrap(worker.Worker if hasattr(worker.Worker, "_pack") else worker, "_pack", "pack")  # a method since hostgap
    clock.wrap(worker, "build_step_inputs", "inputs")
    clock.wrap(worker, "pad_decode_inputs", "inputs")
    for name in ("stage_inputs", "stage_sampling", "send"):
        clock.wrap(StepBuffers, name, "stage")
    clock.wrap(worker.Worker, "_sample", "sample")
    clock.wrap(worker.PendingStep, "result", "readback")
    clock.wrap(scheduler.Scheduler, "commit", "commit")
    clock.wrap(mock_backend._MockGraph, "replay", DEVICE)
    clock.wrap(Model, "forward", DEVICE)
    clock.wrap(MockSampling, "sample", DEVICE)
    clock.wrap(StepBuffers, "gather_tokens", DEVICE)


def run_batch(core: engine.EngineCore, tokenizer, clock: PhaseClock, device: DeviceSwitch, batch: int,
              args: argparse.Namespace, repeat: int) -> tuple[dict[str, float], float]:
    """Decode `batch` sequences for `args.steps` timed steps; µs per step of each phase, and
    the wall µs per step."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.steps + 64,
                            ignore_eos=True)
    texts: dict[str, SequenceText] = {}
    for index in range(batch):
        prompt = tuple((7 * index + 13 * position + repeat) % 500 + 10 for position in range(args.context))
        request = Request(f"r{repeat}-{batch}-{index}", prompt, params, seed=index)
        core.add_request(request)
        texts[request.request_id] = SequenceText(tokenizer, prompt, params)
    while core.scheduler.num_waiting or any(seq.num_uncomputed_tokens > 1 for seq in core.scheduler._running):
        core.step()
    for _ in range(3):  # steady decode: both steps in flight are decodes
        _front_end(core, texts, core.step())
    clock.reset()
    device.on = args.device == "mock"
    started = time.perf_counter()
    for _ in range(args.steps):
        outputs = clock.time("engine", core.step)
        clock.time("detokenize", lambda: _front_end(core, texts, outputs))
        clock.time("stats", core.stats)
    wall = (time.perf_counter() - started) / args.steps
    device.on = True
    totals = {phase: 1e6 * seconds / args.steps for phase, seconds in clock.totals.items()}
    for request_id in texts:
        core.abort(request_id)
    while core.has_unfinished:
        core.step()
    return totals, 1e6 * wall


def _front_end(core: engine.EngineCore, texts: dict[str, SequenceText], outputs) -> None:
    for output in outputs:
        texts[output.seq_id].apply(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", choices=("none", "mock"), default="none",
                        help="during the timed steps, graph replays do nothing (none, the default: the host alone, "
                        "as next to a GPU) or run the mock's math (mock)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="the thread's CPU time (default) or wall time")
    parser.add_argument("--rows", action="store_true",
                        help="time each sequence's ScheduledSequence apart (`rows`), at ~1 us of timer overhead each")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = parser.parse_args(argv)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    folder = Path(tempfile.gettempdir()) / "atlas-host-step-model"
    if not (folder / "config.json").exists():
        write_tiny_model(folder, shape=TinyModelShape(hidden_size=32, intermediate_size=64, num_layers=1))
    settings = EngineSettings(model=str(folder), device="mock", max_num_seqs=max(batch_sizes),
                              max_seq_len=args.context + args.steps + 128, kv_cache_gb=0.25)
    loaded = build_engine(settings, show_progress=False, placement=EmulatedGraphs())
    core = loaded.core
    clock = PhaseClock(time.thread_time if args.clock == "cpu" else time.perf_counter)
    device = DeviceSwitch()
    instrument(clock, core, args.rows)
    rows = []
    for batch in batch_sizes:
        runs = [run_batch(core, loaded.tokenizer, clock, device, batch, args, repeat) for repeat in range(args.repeats)]
        phases = {phase: statistics.median(run[0].get(phase, 0.0) for run in runs)
                  for phase in (*CORE_PHASES, *FRONT_PHASES, DEVICE)}
        walls = [run[1] for run in runs]
        core_us = [sum(run[0].get(p, 0.0) for p in CORE_PHASES) for run in runs]
        host_us = [c + sum(run[0].get(p, 0.0) for p in FRONT_PHASES) for c, run in zip(core_us, runs)]
        rows.append((batch, phases, statistics.median(core_us), statistics.median(host_us), min(core_us),
                     max(core_us), statistics.median(walls)))
    _print(rows)
    if args.profile:
        clock.unwrap()
        profiler = cProfile.Profile()
        profiler.enable()
        run_batch(core, loaded.tokenizer, clock, device, batch_sizes[-1], args, args.repeats)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(r"atlas/(domain|app)|numpy|builtins|tokenizers", 45)
    return 0


def _print(rows) -> None:
    print(f"µs per decode step, median of the repeats (phases exclusive; '{DEVICE}': the mock's math, not host; "
          f"'wall': the loop's wall time per step)")
    print(f"{'phase':>12}" + "".join(f"{f'batch {batch}':>12}" for batch, *_ in rows))
    for phase in (*CORE_PHASES, *FRONT_PHASES, DEVICE):
        print(f"{phase:>12}" + "".join(f"{phases[phase]:>12.1f}" for _, phases, *_ in rows))
    print(f"{'core':>12}" + "".join(f"{core:>12.1f}" for _, _, core, *_ in rows))
    print(f"{'core range':>12}" + "".join(f"{f'{low:.0f}-{high:.0f}':>12}" for *_, low, high, _ in rows))
    print(f"{'host':>12}" + "".join(f"{host:>12.1f}" for _, _, _, host, *_ in rows))
    print(f"{'wall':>12}" + "".join(f"{wall:>12.1f}" for *_, wall in rows))


if __name__ == "__main__":
    raise SystemExit(main())

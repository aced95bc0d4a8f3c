"""The host work a batch-1 n-gram step exposes beside an emulated device, with no GPU (issue 31).

    python benchmarks/spec_host.py [--drafts 16] [--repeats 5] [--profile]

`benchmarks/spec_steps.py` on a GPU found a speculative run's verify steps ~0.30 ms and its
steps without drafts ~0.06 ms slower than the device alone (a step that verifies drafts, or
follows one, commits the step before it first, so its host work does not overlap the device).
This script runs the same loop on the mock with the device emulated: a random model of one
layer with SmolLM2's vocabulary, graphs emulated (the worker takes the CUDA path), every
replay and sampling a no-op, and a device clock: a step launched at t finishes at
max(t, the previous step's end) + its time (`--decode-ms`, `--verify-ms`: an H200's SmolLM2
steps), and reading its ids waits (spinning) until then. The sampled ids are an oracle's:
SmolLM2's greedy outputs for the 24 edit-and-repeat prompts (`--scripts`, a JSON list of
{"prompt": ids, "output": ids}; written once by running the real SmolLM2 on the mock when
missing), so drafts are accepted as the real model would accept them.

Every `core.step()` of a decode or verify step is timed, as spec_steps.py does; per kind of step
the table gives the mean wall ms, the emulated device ms, and `other`: wall minus device, the
host work the device did not hide. Runs alternate plain and n-gram in one process (`--repeats`
pairs); figures are medians over the repeats. `--profile`: cProfile of one n-gram run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from atlas.adapters.mock import backend as mock_backend  # noqa: E402
from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.adapters.mock.sampler import MockSampling  # noqa: E402
from atlas.app.bench.random_model import write_random_model  # noqa: E402
from atlas.app.builder import OneDevice, build_engine  # noqa: E402
from atlas.app.settings import EngineSettings  # noqa: E402
from atlas.domain import worker as worker_module  # noqa: E402
from atlas.domain.batch import ScheduledBatch  # noqa: E402
from atlas.domain.requests import Request, SamplingParams  # noqa: E402
from host_step import PhaseClock  # noqa: E402  (benchmarks/, this script's folder)

SMOLLM2 = Path(os.environ.get("ATLAS_SMOLLM2_DIR", "~/.cache/atlas/models/smollm2")).expanduser()
MODEL_CONFIG = {  # SmolLM2's vocabulary and special ids, one small layer
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2, "torch_dtype": "bfloat16",
}


class EmulatedGraphs(OneDevice):
    def make_backend(self, settings, config):
        return MockGpuBackend(emulate_graphs=True)


class Device:
    """The emulated device: a clock of when the launched steps end, and the oracle's ids."""

    def __init__(self, scripts: dict[str, tuple[int, ...]], decode_s: float, verify_s: float,
                 prefill_s: float) -> None:
        self.scripts = scripts  # request id -> prompt + output
        self.decode_s, self.verify_s, self.prefill_s = decode_s, verify_s, prefill_s
        self.ready = 0.0  # when the last launched step ends
        self.batch: ScheduledBatch | None = None  # the step being submitted
        self.idle: dict[str, list[float]] = {"plain": [], "drafts": [], "prefill": []}  # gaps before launches
        self.returned = 0.0  # when the last step's ids were read
        self.phases = Phases()

    def oracle_ids(self, batch: ScheduledBatch) -> list[int]:
        ids: list[int] = []
        for seq in batch.sequences:
            if seq.sampling is None:
                continue
            script = self.scripts[seq.seq_id]
            first = seq.start_position + len(seq.token_ids) - 1 - seq.num_draft_tokens
            for position in range(first, first + 1 + seq.num_draft_tokens):
                ids.append(script[position + 1] if position + 1 < len(script) else 2)  # past the script: eos
        return ids

    def launch(self, batch: ScheduledBatch) -> None:
        now = time.perf_counter()
        num_tokens = batch.num_tokens
        kind = "plain" if num_tokens == 1 else "drafts" if num_tokens == batch.num_sampled else "prefill"
        seconds = {"plain": self.decode_s, "drafts": self.verify_s, "prefill": self.prefill_s}[kind]
        if self.ready:
            self.idle[kind].append(max(0.0, now - self.ready))
            if self.returned >= self.ready - 1e-9 and now > self.ready:  # commit first: all of it exposed
                self.phases.launched(kind, now - self.returned)
        self.ready = max(now, self.ready) + seconds


class Phases(PhaseClock):
    """Exclusive wall time of wrapped calls since the last download wait returned (what a step
    launched after a commit exposes), summed per kind of step launched."""

    def __init__(self) -> None:
        super().__init__(time.perf_counter)
        self.by_kind: dict[str, list[dict[str, float]]] = {"plain": [], "drafts": [], "prefill": []}

    def launched(self, kind: str, since_ready: float) -> None:
        step = dict(self.totals)
        step["total"] = since_ready
        self.by_kind[kind].append(step)
        self.reset()


class TimedDownload:
    """A download that completes when the emulated device has run every step launched before it."""

    def __init__(self, array: np.ndarray, device: Device) -> None:
        self._array, self.device, self.ready = array, device, device.ready

    def wait(self) -> np.ndarray:
        started = time.perf_counter()
        while (now := time.perf_counter()) < self.ready:
            pass
        stack = self.device.phases._stack
        if stack:  # the device's time is no phase's
            stack[-1] += now - started
        if self.device.returned < self.ready:
            self.device.returned = now
            self.device.phases.reset()
        return self._array


def instrument(phases: Phases, coarse: bool = False) -> None:
    from atlas.domain import engine, scheduler, step_plan
    from atlas.domain.speculative import policy
    from atlas.domain.step_buffers import StepBuffers

    if coarse:
        for owner, name, phase in ((scheduler.Scheduler, "commit", "commit"),
                                   (scheduler.Scheduler, "schedule", "schedule"),
                                   (worker_module.Worker, "submit", "submit"),
                                   (worker_module.PendingStep, "result", "readback")):
            phases.wrap(owner, name, phase)
        return
    for owner, name, phase in (
        (engine.EngineCore, "step", "engine"), (engine.EngineCore, "_commit_oldest", "engine"),
        (scheduler.Scheduler, "commit", "commit"), (scheduler, "verify_drafts", "commit"),
        (scheduler.Scheduler, "schedule", "schedule"), (step_plan, "scheduled_sequence", "rows"),
        (policy.NgramSpeculation, "needs_final_tokens", "ngram"), (policy.NgramSpeculation, "propose", "ngram"),
        (worker_module.Worker, "submit", "submit"), (worker_module, "decode_rows", "submit"),
        (worker_module.Worker, "_pack", "pack"), (worker_module, "build_step_inputs", "inputs"),
        (worker_module, "pad_decode_inputs", "inputs"), (StepBuffers, "stage_inputs", "stage"),
        (StepBuffers, "stage_sampling", "stage"), (StepBuffers, "send", "stage"),
        (worker_module.Worker, "_sample", "sample"), (worker_module.PendingStep, "result", "readback"),
    ):
        phases.wrap(owner, name, phase)


def emulate(core, device: Device) -> None:
    """Replays and sampling do nothing; each submit writes the oracle's ids where the sampler
    would and starts the device clock; downloads wait for it."""
    mock_backend._MockGraph.replay = lambda graph: None
    MockSampling.sample = lambda self, *args, **kwargs: None
    worker = core.executor
    backend = worker.backend
    original_submit = worker_module.Worker.submit

    original_forward = worker_module.Worker._forward

    def submit(self, batch, before_launch=None):
        ids = device.oracle_ids(batch)
        self.buffers.sampled_ids.data[: len(ids)] = ids
        device.batch = batch
        return original_submit(self, batch, before_launch)

    def forward(self, *args, **kwargs):
        logits = original_forward(self, *args, **kwargs)
        device.launch(device.batch)  # the forward's graph (or last kernel) was just enqueued
        return logits

    def begin_download(src):
        return TimedDownload(src.data.copy(), device)

    worker_module.Worker._forward = forward
    worker_module.Worker.submit = submit
    backend.begin_download = begin_download


def run(core, device: Device, prompts: list[tuple[int, ...]], max_tokens: int, tag: str) -> dict:
    core.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    walls: dict[str, list[float]] = {"plain": [], "drafts": []}
    outputs: dict[str, list[int]] = {}
    for gaps in device.idle.values():
        gaps.clear()
    began = time.perf_counter()
    for index, prompt in enumerate(prompts):
        request_id = f"{tag}-{index}"
        device.scripts[request_id] = device.scripts[f"script-{index}"]
        outputs[request_id] = []
        core.add_request(Request(request_id, prompt, params, seed=index))
        while core.has_unfinished:
            started = time.perf_counter()
            step_outputs = core.step()
            wall = time.perf_counter() - started
            for output in step_outputs:
                outputs[output.seq_id].extend(output.new_token_ids)
            batch = core.newest_batch
            if batch is None or batch.num_tokens != batch.num_sampled:
                continue  # a prefill chunk, or the last commit with nothing enqueued
            kind = "drafts" if batch.num_tokens > len(batch.sequences) else "plain"
            walls[kind].append(wall)
    seconds = time.perf_counter() - began
    report = {"seconds": seconds, "outputs": [outputs[f"{tag}-{index}"] for index in range(len(prompts))]}
    for kind, times in walls.items():
        gaps = device.idle[kind]
        if times and gaps:
            report[kind] = (len(gaps), 1e3 * statistics.fmean(times), 1e3 * statistics.fmean(gaps),
                            1e3 * statistics.median(gaps))
    return report


def write_scripts(path: Path, max_tokens: int) -> None:
    """SmolLM2's greedy outputs on the mock for the shipped prompts (about a minute on 2 cores)."""
    from atlas.app.bench.speculative import _token_ids, load_prompts
    from atlas.app.llm import LLM

    llm = LLM(str(SMOLLM2), device="mock", max_num_seqs=24, show_progress=False, kv_cache_gb=2)
    prompts = [_token_ids(llm.engine, text) for text in load_prompts(None)]
    results = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    llm.close()
    path.write_text(json.dumps([{"prompt": list(p), "output": list(r.outputs[0].token_ids)}
                                for p, r in zip(prompts, results)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-ms", type=float, default=0.475)
    parser.add_argument("--verify-ms", type=float, default=0.851)
    parser.add_argument("--prefill-ms", type=float, default=2.0)
    parser.add_argument("--scripts", default=str(Path(tempfile.gettempdir()) / "atlas-spec-host" / "scripts.json"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--coarse", action="store_true", help="with --phases: only commit, schedule, submit")
    parser.add_argument("--phases", action="store_true",
                        help="also time the host's phases of the steps launched after a commit (timers add ~1 us each)")
    args = parser.parse_args(argv)
    scripts_path = Path(args.scripts)
    if not scripts_path.exists():
        scripts_path.parent.mkdir(parents=True, exist_ok=True)
        write_scripts(scripts_path, args.max_tokens)
    scripts = json.loads(scripts_path.read_text())
    prompts = [tuple(s["prompt"]) for s in scripts]
    device = Device({f"script-{i}": tuple(s["prompt"] + s["output"]) for i, s in enumerate(scripts)},
                    args.decode_ms / 1e3, args.verify_ms / 1e3, args.prefill_ms / 1e3)
    folder = write_random_model(MODEL_CONFIG, Path(tempfile.gettempdir()) / "atlas-spec-host" / "model",
                                progress=False)
    engines = {}
    for tag, config in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": args.drafts})):
        settings = EngineSettings(model=str(folder), device="mock", max_num_seqs=1, max_batch_size=1,
                                  max_seq_len=2048, kv_cache_gb=0.25,
                                  speculative_config=json.dumps(config) if config else None)
        engines[tag] = build_engine(settings, show_progress=False, placement=EmulatedGraphs()).core
    if args.phases:
        instrument(device.phases, args.coarse)
    emulate(engines["plain"], device)
    for core in engines.values():
        core.executor.backend.begin_download = engines["plain"].executor.backend.begin_download
        run(core, device, prompts[:2], 16, "warm")
    reports: dict[str, list[dict]] = {"plain": [], "ngram": []}
    for repeat in range(args.repeats):
        for tag, core in engines.items():
            reports[tag].append(run(core, device, prompts, args.max_tokens, f"{tag}{repeat}"))
    expected = [list(s["output"]) for s in scripts]
    for tag, runs in reports.items():
        for report in runs:
            if report["outputs"] != expected:
                print(f"{tag}: outputs differ from the oracle's")
    device_ms = {"plain": args.decode_ms, "drafts": args.verify_ms}
    print("per kind of step launched: the wall ms of core.step() calls that enqueue one, and the device's idle ms "
          "before its launch (host work not hidden), mean and p50; medians of the repeats")
    print(f"{'run':>6} {'tok/s':>8} {'kind':>7} {'steps':>6} {'wall ms':>8} {'device ms':>9} {'idle ms':>8} "
          f"{'idle p50':>8} {'idle total ms':>13}")
    num_tokens = sum(len(output) for output in expected)
    for tag, runs in reports.items():
        rate = statistics.median(num_tokens / report["seconds"] for report in runs)
        for kind in ("plain", "drafts"):
            rows = [report[kind] for report in runs if kind in report]
            if not rows:
                continue
            wall, idle, p50 = (statistics.median(row[i] for row in rows) for i in (1, 2, 3))
            total = statistics.median(row[0] * row[2] for row in rows)
            print(f"{tag:>6} {rate:>8.1f} {kind:>7} {rows[0][0]:>6} {wall:>8.3f} {device_ms[kind]:>9.3f} {idle:>8.3f} "
                  f"{p50:>8.3f} {total:>13.1f}")
    if args.phases:
        print("us per step launched after a commit, by phase (exclusive; 'other': the rest, the bench loop's included)")
        for kind, steps in device.phases.by_kind.items():
            if not steps or kind == "prefill":
                continue
            names = sorted({name for step in steps for name in step} - {"total"})
            means = {name: 1e6 * sum(step.get(name, 0.0) for step in steps) / len(steps) for name in names}
            total = 1e6 * statistics.fmean(step["total"] for step in steps)
            cells = " ".join(f"{name} {value:.1f}" for name, value in means.items())
            rest = total - sum(means.values())
            print(f"{kind:>7} ({len(steps)} steps): total {total:.1f} = {cells} other {rest:.1f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run(engines["ngram"], device, prompts, args.max_tokens, "profile")
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The host's cost of structured output in the engine's step loop, with an emulated device.

`atlas bench MODEL --json-schema FILE` on a GPU compares json_schema decode with free decode;
for a small model the step is host bound, so what structured output adds to the host's work
per step decides the ratio. This script runs the real engine core (scheduler, constraints,
llguidance masks on the mask thread) of a real model's tokenizer over an emulated device: an
in-order queue whose forward and sampling take fixed times (`--forward-us`, `--sample-us`) and
whose sampled ids are the next tokens of pre-walked documents of the schema (the same documents
for both loops, so only the constraint work differs). Closed loop at `--batch`, finished
sequences replaced, as `atlas bench` does:

    python benchmarks/host_masks.py --schema benchmarks/records-unbounded.schema.json --batch 16
    python benchmarks/host_masks.py --grammar-process off,on --forward-us 840   # both, alternated

`--grammar-process` runs the loops with the grammar state in the engine's process (off: the mask
thread) and in a helper process (on), an engine each, alternated repeat by repeat. The emulated
step copies masks it did not fill in place into its own rows, as `StepBuffers.stage_mask` does.
Prints each loop's microseconds per step and tokens/s and their ratio (json / free). Compare only
runs back to back on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.app.builder import build_engine  # noqa: E402
from atlas.app.settings import EngineSettings  # noqa: E402
from atlas.domain.batch import ScheduledBatch, StepResult  # noqa: E402
from atlas.domain.requests import OutputConstraint, Request, SamplingParams  # noqa: E402
from atlas.domain.token_mask import allowed_bits, bitmask_width  # noqa: E402
from atlas.ports.grammar import JsonSchema  # noqa: E402


class EmulatedDevice:
    """An in-order device queue: each op starts when the one before ended (or when enqueued)."""

    def __init__(self, forward_s: float, sample_s: float, mask_rows: np.ndarray) -> None:
        self.forward_s, self.sample_s = forward_s, sample_s
        self.mask_rows = mask_rows  # the page-locked rows a masked sampler uploads from
        self.free_at = 0.0

    def enqueue(self, seconds: float) -> float:
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return self.free_at


class EmulatedStep:
    def __init__(self, device: EmulatedDevice, batch: ScheduledBatch, token_ids: tuple[int, ...]) -> None:
        self._device, self._batch, self._token_ids = device, batch, token_ids
        self._done_at: float | None = None
        device.enqueue(device.forward_s)
        if not batch.awaits_masks:
            self.sample(None)

    @property
    def awaits_masks(self) -> bool:
        return self._done_at is None

    def sample(self, bitmask: np.ndarray | None) -> None:
        if bitmask is not None:  # stage_mask: masks filled elsewhere are copied into the upload's rows
            rows = self._device.mask_rows
            if bitmask.ctypes.data != rows.ctypes.data:
                np.copyto(rows[: bitmask.shape[0]], bitmask)
        self._done_at = self._device.enqueue(self._device.sample_s)

    def result(self) -> StepResult:
        assert self._done_at is not None
        while (left := self._done_at - time.perf_counter()) > 0:
            time.sleep(left)  # a device sync releases the GIL
        return StepResult(self._batch.step_id, self._token_ids)


class EmulatedExecutor:
    """Samples each sequence's next token from its document (then end-of-sequence forever)."""

    def __init__(self, device: EmulatedDevice, documents: dict[str, list[int]], eos: int) -> None:
        self.device, self.documents, self.eos = device, documents, eos
        self.position: dict[str, int] = {}

    def submit(self, batch: ScheduledBatch, before_launch=None) -> EmulatedStep:
        if before_launch is not None:
            before_launch()
        token_ids = []
        for seq in batch.sequences:
            for _ in range(len(seq.sampling_rows)):
                document = self.documents[seq.seq_id]
                index = self.position.get(seq.seq_id, 0)
                token_ids.append(document[index] if index < len(document) else self.eos)
                self.position[seq.seq_id] = index + 1
        return EmulatedStep(self.device, batch, tuple(token_ids))

    def mask_rows(self) -> np.ndarray:
        return self.device.mask_rows

    def execute(self, batch: ScheduledBatch) -> StepResult:
        step = self.submit(batch)
        if step.awaits_masks:
            step.sample(None)
        return step.result()


def walk_documents(grammar, vocab_size: int, eos_ids: frozenset[int], count: int, length: int,
                   rng: np.random.Generator) -> list[list[int]]:
    """`count` token streams of the grammar, each token drawn among the allowed ones (end of
    sequence only once nothing else is allowed), cut at `length` tokens."""
    documents = []
    row = np.zeros(bitmask_width(vocab_size), np.int32)
    for _ in range(count):
        matcher, tokens = grammar.new_matcher(), []
        while len(tokens) < length:
            matcher.fill_bitmask(row)
            allowed = np.flatnonzero(allowed_bits(row[None], vocab_size)[0])
            choices = [t for t in allowed.tolist() if t not in eos_ids] or allowed.tolist()
            token = int(rng.choice(choices))
            tokens.append(token)
            if token in eos_ids or not matcher.accept_token(token):
                break
        documents.append(tokens)
    return documents


def closed_loop(engine, documents: list[list[int]], batch: int, steps: int, constraint, tag: str) -> float:
    """Seconds per step over `steps` steps of `batch` sequences, each replaced when it ends."""
    core = engine.core
    executor: EmulatedExecutor = core.executor
    prompt = (1, 2, 3, 4, 5, 6, 7, 8)
    live: set[str] = set()
    counter = iter(range(1 << 30))

    def start() -> None:
        index = next(counter)
        request_id = f"{tag}{index}"
        executor.documents[request_id] = documents[index % len(documents)]
        params = SamplingParams(temperature=1.0, max_tokens=4096)
        core.add_request(Request(request_id, prompt, params, seed=index, constraint=constraint))
        live.add(request_id)

    for _ in range(batch):
        start()
    for _ in range(5):
        core.step()
    began = time.perf_counter()
    for _ in range(steps):
        for output in core.step():
            if output.finish_reason is not None:
                live.discard(output.seq_id)
                start()
    seconds = time.perf_counter() - began
    for request_id in list(live):
        core.abort(request_id)
    while core.has_unfinished:
        core.step()
    return seconds / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path("~/.cache/atlas/models/smollm2").expanduser()))
    parser.add_argument("--schema", default="benchmarks/records-unbounded.schema.json")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-us", type=float, default=300.0)
    parser.add_argument("--sample-us", type=float, default=30.0)
    parser.add_argument("--grammar-process", default="off",
                        help="off, on, or both in turn (off,on): the grammar state in a helper process")
    args = parser.parse_args()

    modes = args.grammar_process.split(",")
    engines = {mode: build_engine(EngineSettings(model=args.model, device="mock", max_num_seqs=max(args.batch, 8),
                                                 grammar_process=mode), show_progress=False) for mode in modes}
    first = engines[modes[0]].core
    constraint = OutputConstraint(JsonSchema(json.loads(Path(args.schema).read_text())), "schema")
    grammar = first.grammars.compiled(constraint.grammar, constraint.grammar_field)
    eos = min(first.eos_token_ids)
    documents = walk_documents(grammar, first.vocab_size, first.eos_token_ids, 64, 400, np.random.default_rng(0))
    for engine in engines.values():
        rows = np.zeros((max(args.batch, 8), bitmask_width(first.vocab_size)), np.int32)
        device = EmulatedDevice(args.forward_us * 1e-6, args.sample_us * 1e-6, rows)
        engine.core.executor = EmulatedExecutor(device, {}, eos)
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    try:
        for repeat in range(args.repeats):
            for mode, engine in engines.items():
                json_s = closed_loop(engine, documents, args.batch, args.steps, constraint, f"j{mode}{repeat}-")
                free_s = closed_loop(engine, documents, args.batch, args.steps, None, f"f{mode}{repeat}-")
                results[mode].append((json_s, free_s))
                print(f"repeat {repeat} grammar process {mode}: json {json_s * 1e6:7.1f} us/step, "
                      f"free {free_s * 1e6:7.1f} us/step, json / free tokens/s {free_s / json_s:.3f}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    for mode, rows in results.items():
        ratios = sorted(free / json_ for json_, free in rows)
        json_us = sorted(json_ * 1e6 for json_, _ in rows)
        free_us = sorted(free * 1e6 for _, free in rows)
        middle = len(rows) // 2
        print(f"grammar process {mode}: median json {json_us[middle]:.1f} us/step, free {free_us[middle]:.1f}, "
              f"json / free {ratios[middle]:.3f} (batch {args.batch}, forward {args.forward_us:.0f} us)")


if __name__ == "__main__":
    main()

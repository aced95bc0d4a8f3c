"""`atlas bench MODEL --json-schema FILE`: structured-output decode against free decode.

The same batch runs in pairs in one process on one loaded engine, `rounds` times: every
sequence under the JSON schema (token masks from llguidance, filled while the device runs each
forward), then every sequence free, each as a closed loop of `batch` sequences sampled at
temperature 1 where a sequence that finishes is replaced at once, timed over the same number of
engine steps. The free loop's k-th sequence ignores end-of-sequence and stops at the length
the constrained loop's k-th document had, so both loops replace (and prefill) the same
sequences at the same steps and the host's mask work is the only difference. The figures are
tokens/s of each (medians over the rounds) and the median of the rounds' paired ratios (a
small model's step is host-bound, so one round can catch the host busy).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from atlas.app.builder import LoadedEngine
from atlas.app.chat_features import GrammarUnavailable
from atlas.domain.requests import OutputConstraint, Request, SamplingParams
from atlas.domain.token_mask import bitmask_width
from atlas.ports.grammar import GrammarError, JsonSchema
from atlas.ports.tokenizer import ChatTemplateError

_WARMUP_STEPS = 3  # after every first token: masked sampler graphs captured, llguidance warm


@dataclass(frozen=True, slots=True)
class LoopResult:
    batch: int
    steps: int
    num_tokens: int  # generated in the timed steps
    seconds: float
    num_replaced: int  # sequences that finished inside the window and were replaced
    lengths: dict[int, int]  # the k-th sequence started -> its output tokens, for those that finished

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def json_schema_constraint(engine: LoadedEngine, path: str) -> OutputConstraint:
    """Requests' constraint under the schema in `path`, compiled once through the engine's
    grammar cache; ValueError naming --json-schema when the file is unreadable, the schema
    cannot be compiled, or the model's tokenizer cannot spell JSON."""
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--json-schema {path}: {error}") from None
    unusable = (f"--json-schema: llguidance cannot use {engine.model_dir}'s tokenizer to spell JSON (a --random "
                "checkpoint's is a placeholder); use a model with its real tokenizer")
    constraint = OutputConstraint(JsonSchema(schema), "schema")
    grammars = engine.core.grammars
    if grammars is None:
        raise ValueError(unusable)
    try:
        grammar = grammars.compiled(constraint.grammar, constraint.grammar_field)
    except GrammarUnavailable:
        raise ValueError(unusable) from None
    except GrammarError as error:
        raise ValueError(f"--json-schema {path}: {error}") from None
    first = np.zeros(bitmask_width(engine.config.vocab_size), dtype=np.int32)
    grammar.new_matcher().fill_bitmask(first)
    if not first.any():
        raise ValueError(unusable)
    return constraint


def schema_prompt(engine: LoadedEngine, path: str) -> tuple[int, ...]:
    """A request for a document of the schema, through the chat template when the model has one."""
    text = f"Write one JSON document that follows this JSON schema:\n{Path(path).read_text()}"
    tokenizer = engine.tokenizer
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tuple(tokenizer.encode(rendered, add_special_tokens=False))
    except ChatTemplateError:  # no chat template
        return tuple(tokenizer.encode(text))


def measure_closed_loop(engine: LoadedEngine, prompt: tuple[int, ...], batch: int, steps: int,
                        constraint: OutputConstraint | None, tag: str,
                        lengths: dict[int, int] | None = None) -> LoopResult:
    """`batch` sequences (under `constraint`, None: free), replaced as they finish, over
    `steps` timed engine steps after every one has its first token. `lengths`: the k-th
    sequence stops after lengths[k] tokens (another loop's `LoopResult.lengths`)."""
    core = engine.core
    # Free sequences ignore end-of-sequence: a model that stops early would otherwise fill the
    # free loop's window with its replacements' prefills (seen: 2 of 16 at SmolLM2 batch 16, the
    # ratio 1.63), and the figure is of decode steps; they stop where `lengths` says instead.
    params = SamplingParams(temperature=1.0, max_tokens=4 * steps + 64, ignore_eos=constraint is None)
    live: dict[str, int] = {}  # request -> its index
    produced: dict[str, int] = {}
    finished_lengths: dict[int, int] = {}
    counter = iter(range(1 << 62))

    def start() -> None:
        index = next(counter)
        request_id = f"{tag}-{batch}-{index}"
        length = (lengths or {}).get(index)
        sampling = params if length is None else msgspec.structs.replace(params, max_tokens=length)
        core.add_request(Request(request_id, prompt, sampling, seed=index, constraint=constraint))
        live[request_id] = index
        produced[request_id] = 0

    def step() -> tuple[int, int]:
        outputs = core.step()
        for output in outputs:
            produced[output.seq_id] += len(output.new_token_ids)
        finished = [o.seq_id for o in outputs if o.finish_reason is not None]
        for seq_id in finished:
            finished_lengths[live.pop(seq_id)] = produced.pop(seq_id)
            start()
        return sum(len(o.new_token_ids) for o in outputs), len(finished)

    try:
        for _ in range(batch):
            start()
        started_ids: set[str] = set()
        while not live.keys() <= started_ids:  # prefill until every sequence has its first token
            outputs = core.step()
            for output in outputs:
                produced[output.seq_id] += len(output.new_token_ids)
            started_ids.update(o.seq_id for o in outputs if o.new_token_ids)
        for _ in range(_WARMUP_STEPS):
            step()
        num_tokens = num_replaced = 0
        began = time.perf_counter()
        for _ in range(steps):
            tokens, replaced = step()
            num_tokens += tokens
            num_replaced += replaced
        seconds = time.perf_counter() - began
    finally:
        for request_id in list(live):
            core.abort(request_id)
        while core.has_unfinished:
            core.step()
    return LoopResult(batch, steps, num_tokens, seconds, num_replaced, finished_lengths)


def host_loop_ms() -> float:
    """Milliseconds a fixed Python loop takes now: the host's single-thread speed at that
    moment. A small model's json loop is host bound and its free loop is not, so the ratio
    follows this figure (26-32 ms against 47-55 ms seen on one shared GPU machine within a
    run; docs/lab/structured-output.md)."""
    began = time.perf_counter()
    total = 0
    for i in range(300_000):
        total += i * 3 % 7
    return (time.perf_counter() - began) * 1e3


def run_structured_bench(engine: LoadedEngine, schema_path: str, batch_sizes: list[int], steps: int,
                         rounds: int = 3) -> dict:
    """Both loops at each batch size, `rounds` pairs each; prints a table and returns the
    figures. Raises ValueError for fewer than one round."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1 (got {rounds})")
    constraint = json_schema_constraint(engine, schema_path)
    prompt = schema_prompt(engine, schema_path)
    rows = []
    for batch in batch_sizes:
        print(f"json_schema against free decode at batch {batch}, {rounds} rounds ...", file=sys.stderr)
        pairs = []
        resampled_before = engine.core.num_resampled_tokens
        host_ms = []
        for index in range(rounds):
            host_ms.append(host_loop_ms())
            constrained = measure_closed_loop(engine, prompt, batch, steps, constraint, f"json{index}")
            free = measure_closed_loop(engine, prompt, batch, steps, None, f"free{index}", constrained.lengths)
            pairs.append((constrained, free))
        ratios = [constrained.tokens_per_s / free.tokens_per_s for constrained, free in pairs]
        rows.append({
            "batch": batch, "steps": steps, "rounds": rounds,
            "free_tokens_per_s": statistics.median(free.tokens_per_s for _, free in pairs),
            "json_schema_tokens_per_s": statistics.median(constrained.tokens_per_s for constrained, _ in pairs),
            "ratio": statistics.median(ratios), "ratios": ratios, "host_loop_ms": host_ms,
            "free_replaced": sum(free.num_replaced for _, free in pairs),
            "json_schema_replaced": sum(constrained.num_replaced for constrained, _ in pairs),
            # tokens the schema refused under its superset's mask, drawn again (rounds' warm-ups included)
            "json_schema_resampled": engine.core.num_resampled_tokens - resampled_before,
        })
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'json/free':>9} {'replaced':>9} {'resampled':>9}")
    for row in rows:
        print(f"{row['batch']:>5} {row['free_tokens_per_s']:>11.1f} {row['json_schema_tokens_per_s']:>11.1f} "
              f"{100 * row['ratio']:>8.1f}% {row['free_replaced']:>4}/{row['json_schema_replaced']:<4} "
              f"{row['json_schema_resampled']:>9}")
        if rounds > 1:
            rounds_and_host = zip(row["ratios"], row["host_loop_ms"])
            each = ", ".join(f"{100 * ratio:.1f}% ({ms:.0f} ms)" for ratio, ms in rounds_and_host)
            print(f"      json/free of each round (the host loop before it): {each} (median above)")
    return {"json_schema": schema_path, "model_dir": str(engine.model_dir), "structured": rows}

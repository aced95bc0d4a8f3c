"""`atlas bench MODEL --speculative-config JSON`: speculative decoding against the plain engine.

One loaded engine runs the same prompts at each batch size, greedy, in one process: with its
speculation policy switched off (the plain engine) and on, in `rounds` alternating pairs. Each
run is a closed loop of `batch` concurrent requests over the prompt set (the next prompt starts
when one finishes); the figures are output tokens/s of each (medians over the rounds), the
speed-up (the median of the rounds' paired ratios: a small model's step is host-bound, and one
pair on one machine gave 1.05x where the next gave 1.28x), the mean acceptance length (tokens a
verifying sequence-step yields: accepted drafts + 1) and acceptance by draft position, and
whether the outputs were identical in every round (they must be: drafts are verified against
the target's own draws). Then the device time of one verify step with k drafts at batch 1 against one plain
decode step at the same context, both replayed back to back (`verify_over`).

The default prompts (package data) are 24 edit-and-repeat requests: rewrite this code with a
name changed, correct this paragraph, repeat this list in capitals. Their answers copy the
prompt, which is where n-gram drafts are accepted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import msgspec

from atlas.app.bench.measure import replay_device_time
from atlas.app.builder import LoadedEngine
from atlas.domain.batch import ScheduledBatch
from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.policy import NoSpeculation
from atlas.ports.tokenizer import ChatTemplateError

_WARMUP_PROMPTS = 2
_WARMUP_TOKENS = 16  # a warm-up pass over every prompt: its prompt step and first decode steps


@dataclass(frozen=True, slots=True)
class LoopRun:
    outputs: dict[int, tuple[int, ...]]  # prompt index -> generated tokens
    seconds: float
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    accepted_by_position: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs.values())

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def undrafted_tokens(self) -> int:
        """Tokens of steps that verified no drafts (each gives one): the share speculation
        cannot speed up, whatever a verify step costs."""
        return self.num_tokens - self.accepted_tokens - self.verify_steps


def load_prompts(path: str | None) -> list[str]:
    """The prompt set: a JSON list of strings in `path`, else the shipped edit-and-repeat set.
    Raises ValueError naming --prompts for a file that is not such a list."""
    if path is None:
        return json.loads(resources.files("atlas.app.bench").joinpath("data/edit_prompts.json").read_text())
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--prompts {path}: {error}") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--prompts {path}: expected a JSON list of prompt strings")
    return prompts


def _token_ids(engine: LoadedEngine, text: str) -> tuple[int, ...]:
    tokenizer = engine.tokenizer
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tuple(tokenizer.encode(rendered, add_special_tokens=False))
    except ChatTemplateError:
        return tuple(tokenizer.encode(text))


def run_loop(engine: LoadedEngine, prompts: list[tuple[int, ...]], batch: int, max_tokens: int, tag: str,
             recorded: list[ScheduledBatch] | None = None) -> LoopRun:
    """Every prompt greedy to `max_tokens` (or eos), `batch` at a time; `recorded` collects the
    batches submitted."""
    core = engine.core
    worker = core.executor
    stats_before = core.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: dict[int, list[int]] = {}
    queue = list(range(len(prompts)))
    owner: dict[str, int] = {}

    def start() -> None:
        index = queue.pop(0)
        request_id = f"{tag}-{batch}-{index}"
        owner[request_id] = index
        outputs[index] = []
        core.add_request(Request(request_id, prompts[index], params, seed=index))

    if recorded is not None:
        original_submit = worker.submit

        def recording_submit(step_batch: ScheduledBatch, before_launch=None):
            recorded.append(step_batch)
            return original_submit(step_batch, before_launch)

        worker.submit = recording_submit
    core.reset_prefix_cache()  # each run computes its prompts: no run reuses another's
    began = time.perf_counter()
    try:
        for _ in range(min(batch, len(queue))):
            start()
        while core.has_unfinished:
            for output in core.step():
                outputs[owner[output.seq_id]].extend(output.new_token_ids)
                if output.finish_reason is not None and queue:
                    start()
    finally:
        if recorded is not None:
            del worker.submit
    seconds = time.perf_counter() - began
    stats = core.stats()
    by_position = tuple(
        after - (stats_before.spec_accepted_by_position[j] if j < len(stats_before.spec_accepted_by_position) else 0)
        for j, after in enumerate(stats.spec_accepted_by_position)
    )
    return LoopRun(
        {index: tuple(tokens) for index, tokens in outputs.items()}, seconds,
        stats.num_spec_draft_tokens - stats_before.num_spec_draft_tokens,
        stats.num_spec_accepted_tokens - stats_before.num_spec_accepted_tokens,
        stats.num_spec_verify_steps - stats_before.num_spec_verify_steps,
        by_position,
    )


def run_speculative_bench(engine: LoadedEngine, prompts_path: str | None, batch_sizes: list[int],
                          max_tokens: int, rounds: int = 3) -> dict:
    """Plain against speculative at each batch size, `rounds` pairs each; prints a table and
    returns the figures. Raises ValueError for fewer than one round."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1 (got {rounds})")
    scheduler = engine.core.scheduler
    policy = scheduler.speculation
    config = engine.settings.speculative
    prompts = [_token_ids(engine, text) for text in load_prompts(prompts_path)]
    rows = []
    decode_steps: list[ScheduledBatch] = []
    try:
        run_loop(engine, prompts[:_WARMUP_PROMPTS], 1, max_tokens, "warmup")  # compile, tune, capture
        # every prompt's token bucket captured (prefill graphs are captured on first use) and the
        # batch-1 decode steps recorded, outside the timed rounds: a first round that captured
        # or recorded in its plain run only would show a speed-up the engine does not have
        scheduler.speculation = NoSpeculation()
        run_loop(engine, prompts, 1, _WARMUP_TOKENS, "warmup-plain", decode_steps)
        scheduler.speculation = policy
        run_loop(engine, prompts, 1, _WARMUP_TOKENS, "warmup-spec")
        for batch in batch_sizes:
            print(f"plain and speculative decoding at batch {batch}, {rounds} rounds ...", file=sys.stderr)
            pairs = []
            for index in range(rounds):
                scheduler.speculation = NoSpeculation()
                plain = run_loop(engine, prompts, batch, max_tokens, f"plain{index}")
                scheduler.speculation = policy
                pairs.append((plain, run_loop(engine, prompts, batch, max_tokens, f"spec{index}")))
            rows.append(_row(batch, len(prompts), pairs))
    finally:
        scheduler.speculation = policy
    report = {"speculative_config": engine.settings.speculative_config, "model_dir": str(engine.model_dir),
              "batch_invariant": engine.settings.batch_invariant,
              "speculative": rows, **_verify_step_cost(engine, decode_steps, config.num_speculative_tokens)}
    _print(report)
    return report


def _row(batch: int, num_prompts: int, pairs: list[tuple[LoopRun, LoopRun]]) -> dict:
    """One batch size's figures from its (plain, speculative) rounds."""
    plain_rates = [plain.num_tokens / plain.seconds for plain, _ in pairs]
    spec_rates = [spec.num_tokens / spec.seconds for _, spec in pairs]
    speedups = [spec_rate / plain_rate for plain_rate, spec_rate in zip(plain_rates, spec_rates, strict=True)]
    spec = pairs[0][1]  # greedy: every round drafts and accepts the same
    return {
        "batch": batch, "prompts": num_prompts, "output_tokens": spec.num_tokens, "rounds": len(pairs),
        "plain_tokens_per_s": statistics.median(plain_rates),
        "speculative_tokens_per_s": statistics.median(spec_rates),
        "speedup": statistics.median(speedups), "speedups": speedups,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "verify_steps": spec.verify_steps, "undrafted_tokens": spec.undrafted_tokens,
        "acceptance_rate": spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0,
        "accepted_by_position": list(spec.accepted_by_position),
        "identical_outputs": all(spec_run.outputs == plain.outputs == pairs[0][0].outputs for plain, spec_run in pairs),
    }


def _verify_step_cost(engine: LoadedEngine, decode_steps: list[ScheduledBatch], num_drafts: int) -> dict:
    """Device time of a batch-1 verify step with `num_drafts` drafts against a batch-1 decode
    step recorded in the plain run, both replayed back to back (`verify_over`: the verify step
    in the decode step's place)."""
    decode = next((b for b in decode_steps if len(b.sequences) == 1 and b.num_tokens == 1), None)
    if decode is None:
        return {"verify_step_ms": None, "decode_step_ms": None, "verify_over_decode": None}
    first = msgspec.structs.replace(decode.sequences[0], token_ids=(0,), placeholder_row=None)
    decode = replace(decode, sequences=(first,))
    decode_s, verify_s = replay_device_time(engine, decode), replay_device_time(engine, verify_over(decode, num_drafts))
    return {"verify_step_ms": 1e3 * verify_s, "decode_step_ms": 1e3 * decode_s,
            "verify_over_decode": verify_s / decode_s}


def verify_over(decode: ScheduledBatch, num_drafts: int) -> ScheduledBatch:
    """A verify step of `num_drafts` drafts that reads what `decode` (one sequence, one token at
    position P) reads: it computes positions P - k .. P over the same block table, so its rows
    attend to contexts as long as the decode's, and it needs no page the decode does not hold.
    It overwrites the K/V of P - k .. P - 1, so it is for timing only (the bench's runs reset
    the prefix cache before each)."""
    [seq] = decode.sequences
    if seq.start_position < num_drafts or seq.sampling is None:
        raise ValueError(f"a decode at position {seq.start_position} has no room for {num_drafts} drafts before it")
    verify = msgspec.structs.replace(
        seq, token_ids=(0,) * (1 + num_drafts), start_position=seq.start_position - num_drafts, placeholder_row=None,
        num_draft_tokens=num_drafts, draft_rows=(seq.sampling,) * num_drafts)
    return replace(decode, sequences=(verify,))


def _print(report: dict) -> None:
    mode = ", --batch-invariant" if report.get("batch_invariant") else ""
    print(f"speculative decoding {report['speculative_config']}{mode} against the plain engine, greedy")
    print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>8} {'accept len':>10} {'identical':>9}")
    for row in report["speculative"]:
        print(f"{row['batch']:>5} {row['plain_tokens_per_s']:>12.1f} {row['speculative_tokens_per_s']:>11.1f} "
              f"{row['speedup']:>7.2f}x {row['mean_acceptance_length']:>10.2f} "
              f"{'yes' if row['identical_outputs'] else 'NO':>9}")
        if row["rounds"] > 1:
            print(f"      speed-up of each round: {', '.join(f'{x:.2f}x' for x in row['speedups'])} (median above)")
        print(f"      drafts accepted by position: {row['accepted_by_position']} "
              f"({100 * row['acceptance_rate']:.1f}% of drafts)")
        undrafted = row["undrafted_tokens"] / row["output_tokens"] if row["output_tokens"] else 0.0
        print(f"      {row['verify_steps']} verify steps; {row['undrafted_tokens']} tokens ({100 * undrafted:.0f}%) "
              f"from steps without drafts")
    if report["verify_over_decode"] is not None:
        print(f"batch-1 verify step {report['verify_step_ms']:.3f} ms, decode step {report['decode_step_ms']:.3f} ms: "
              f"{report['verify_over_decode']:.2f}x")

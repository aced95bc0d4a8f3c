"""Where a batch-1 speculative step's wall time goes beside its device time (issue 31: n-gram >= 2x):

    python3 benchmarks/spec_steps.py MODEL [--device cuda] [--drafts 4] [--max-tokens 256]

Runs the edit-and-repeat prompts that `atlas bench --speculative-config` uses, one at a time,
greedy, once plain and once with n-gram drafts, timing every `core.step()` call. With drafts a
step commits the step before it first (the next drafts need its tokens), so the device idles
through the host's work. Prints per run: the steps with and without drafts, their mean and
p50 wall milliseconds, the tokens a step, tokens/s, and, for the recorded decode and verify
steps replayed back to back, the device milliseconds of each: wall minus device is what the
host and the synchronisation add per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's atlas

from atlas.app.bench.measure import replay_device_time  # noqa: E402
from atlas.app.bench.speculative import _token_ids, load_prompts  # noqa: E402
from atlas.app.llm import LLM  # noqa: E402
from atlas.domain.requests import Request, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[tuple[int, ...]], max_tokens: int, tag: str) -> dict:
    core = llm.engine.core
    core.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    walls: dict[str, list[float]] = {"drafts": [], "plain": []}
    tokens = {"drafts": 0, "plain": 0}
    examples: dict[str, object] = {}
    began = time.perf_counter()
    for index, prompt in enumerate(prompts):
        core.add_request(Request(f"{tag}-{index}", prompt, params, seed=index))
        while core.has_unfinished:
            started = time.perf_counter()
            outputs = core.step()
            wall = time.perf_counter() - started
            batch = core.newest_batch
            if batch is None or batch.num_tokens != sum(1 + s.num_draft_tokens for s in batch.sequences):
                continue  # a prefill chunk, or the last commit with nothing enqueued
            kind = "drafts" if any(s.num_draft_tokens for s in batch.sequences) else "plain"
            walls[kind].append(wall)
            tokens[kind] += sum(len(output.new_token_ids) for output in outputs)
            examples.setdefault(kind, batch)
    seconds = time.perf_counter() - began
    # what the timed steps leave: each request's prefill step(s) and the loop around them
    rest_ms = 1e3 * (seconds - sum(sum(times) for times in walls.values())) / len(prompts)
    report = {"seconds": seconds, "tokens": sum(tokens.values()), "rest_ms": rest_ms}
    for kind, times in walls.items():
        if times:
            report[kind] = {"steps": len(times), "mean_ms": 1e3 * statistics.fmean(times),
                            "p50_ms": 1e3 * statistics.median(times),
                            "device_ms": 1e3 * replay_device_time(llm.engine, examples[kind])}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", default=None, help="a JSON list of prompt strings (default: the shipped set)")
    args = parser.parse_args()
    reports = {}
    for tag, config in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": args.drafts})):
        llm = LLM(args.model, device=args.device, max_num_seqs=1, max_batch_size=1, show_progress=False, kv_cache_gb=4,
                  speculative_config=json.dumps(config) if config else None)
        prompts = [_token_ids(llm.engine, text) for text in load_prompts(args.prompts)]
        run(llm, prompts[:2], 16, f"warm-{tag}")
        reports[tag] = run(llm, prompts, args.max_tokens, tag)
        llm.close()
    rates = {tag: report["tokens"] / report["seconds"] for tag, report in reports.items()}
    print(f"{'run':>6} {'tok/s':>8} {'kind':>7} {'steps':>6} {'mean ms':>8} {'p50 ms':>7} {'device ms':>9} "
          f"{'other ms':>8}")
    for tag, report in reports.items():
        for kind in ("plain", "drafts"):
            if kind in report:
                row = report[kind]
                print(f"{tag:>6} {rates[tag]:>8.1f} {kind:>7} {row['steps']:>6} {row['mean_ms']:>8.3f} "
                      f"{row['p50_ms']:>7.3f} {row['device_ms']:>9.3f} {row['mean_ms'] - row['device_ms']:>8.3f}")
    print("ms a request outside the timed steps (its prefill, mostly): "
          + ", ".join(f"{tag} {report['rest_ms']:.2f}" for tag, report in reports.items()))
    print(f"speed-up {rates['ngram'] / rates['plain']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

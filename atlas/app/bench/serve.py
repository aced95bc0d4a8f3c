"""`atlas bench serve`: load-test any OpenAI-compatible server with streamed requests.

    atlas bench serve --url http://127.0.0.1:8888 --num-prompts 256 --concurrency 64 \\
        --input-len 16:900 --output-len 16:256 --temperature 0.8 --request-rate 20

Requests (workload.py) have lengths drawn from ranges, exact in tokens where the server has
`/tokenize` (Atlas, vLLM; otherwise words are counted as tokens and the report says so); may
open with one of `--num-prefixes` shared prefixes of `--shared-prefix-len` tokens; and may be
conversations of `--num-turns` turns, each turn re-sending the history with the reply it got.
Conversations start as a Poisson process of `--request-rate` per second (default: all at once);
at most `--concurrency` requests are in flight. Every request asks for exactly its output
length (`ignore_eos`, a vLLM extension; `--no-ignore-eos` for servers that reject it).

Reported (serve_report.py): throughput; TTFT, TPOT and ITL at p50, p90 and p99; goodput under
`--slo-ttft` / `--slo-tpot`; the reusable prompt tokens and the server's prefix-cache hits,
from /metrics and from usage.prompt_tokens_details.cached_tokens. `--json-file` saves the
summary and every request; `--plot` draws a PNG (needs matplotlib: the `bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

from atlas.app.bench.prefix_reuse import PrefixCacheCounts, prefix_cache_counts, reusable_tokens
from atlas.app.bench.serve_client import Endpoint, ServerTokenizer, StreamResult, fetch, get_json, stream_request
from atlas.app.bench.serve_report import RequestRecord, Slo, check_plotting, plot, print_summary, summarize
from atlas.app.bench.workload import (
    Conversation,
    LengthRange,
    PromptTokenizer,
    WordTokenizer,
    Workload,
    WorkloadSpec,
    build_workload,
)
from atlas.app.progress import Progress

UNSENT = "not sent: an earlier turn of its conversation failed"


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8888", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model id to request (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests in total, every turn counted "
                        "(default 256)")
    parser.add_argument("--input-len", default="32", help="tokens of each request's own text, N or LOW:HIGH "
                        "(uniform); the shared prefix comes on top, the BOS or chat template too (default 32)")
    parser.add_argument("--output-len", default="128", help="tokens generated per request, N or LOW:HIGH (default 128)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="conversations started per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="tokens of a prefix shared by the requests of each group (default 0: none)")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="distinct shared prefixes; conversation i opens with prefix i mod K (default 1)")
    parser.add_argument("--num-turns", type=int, default=1, help="turns of each chat conversation; every turn "
                        "re-sends the history with the replies (default 1; more needs --endpoint chat)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy); "
                        "each request also sends a seed drawn from --seed")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="goodput counts requests "
                        "whose TTFT is at most MS milliseconds")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="goodput counts requests "
                        "whose TPOT is at most MS milliseconds")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (for servers that reject vLLM's extensions)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every length, prompt and arrival (default 0)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--json-file", default=None, metavar="PATH", help="write the summary and every request "
                        "to this JSON file")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write latency distributions and output "
                        "tokens/s over time to this PNG (needs matplotlib)")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The flags' workload; ValueError naming the flag for anything out of range."""
    for flag, value in (("--concurrency", args.concurrency), ("--num-prompts", args.num_prompts),
                        ("--num-turns", args.num_turns), ("--num-prefixes", args.num_prefixes)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1 (got {value})")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be 0 (none) or more (got {args.shared_prefix_len})")
    if args.num_prefixes > 1 and not args.shared_prefix_len:
        raise ValueError("--num-prefixes needs --shared-prefix-len N (the prefixes' length in tokens)")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, or inf for all at once (got {args.request_rate})")
    if args.num_turns > 1 and args.endpoint != "chat":
        raise ValueError("--num-turns above 1 needs --endpoint chat (conversations are chat messages)")
    if args.num_prompts % args.num_turns:
        raise ValueError(f"--num-prompts ({args.num_prompts}) must be a multiple of --num-turns ({args.num_turns}): "
                         "it counts every turn of every conversation")
    for flag, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot), ("--temperature", args.temperature)):
        if value is not None and not value >= 0:
            raise ValueError(f"{flag} must not be negative (got {value})")
    return WorkloadSpec(
        num_conversations=args.num_prompts // args.num_turns, num_turns=args.num_turns,
        input_len=LengthRange.parse(args.input_len, "--input-len"),
        output_len=LengthRange.parse(args.output_len, "--output-len"),
        shared_prefix_len=args.shared_prefix_len, num_prefixes=args.num_prefixes,
        request_rate=args.request_rate, seed=args.seed,
    )


def run_serve_bench(args: argparse.Namespace) -> int:
    spec = workload_spec(args)
    if args.plot:
        check_plotting()
    try:
        summary, records = asyncio.run(run_load(args, spec))
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot benchmark {args.url}: {type(error).__name__}: {error} "
                         "(is the server running? pass --model when it has no /v1/models)") from None
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    if args.json_file:
        with open(args.json_file, "w") as file:
            json.dump({"summary": summary, "requests": [r.row() for r in records]}, file, indent=1)
            file.write("\n")
    if args.plot:
        plot(summary, records, args.plot)
    return 0 if summary["completed"] else 1


async def run_load(args: argparse.Namespace, spec: WorkloadSpec) -> tuple[dict, list[RequestRecord]]:
    """Prepare the requests, send them, and return the summary and every request's record."""
    endpoint = Endpoint(args.url, args.api_key)
    model = args.model or (await get_json(endpoint, "/v1/models"))["data"][0]["id"]
    server_tokenizer = await ServerTokenizer.probe(endpoint, model)
    tokenizer: PromptTokenizer = server_tokenizer or WordTokenizer()
    if server_tokenizer is not None:
        _check_fits(spec, server_tokenizer.max_model_len)
    log(f"preparing {spec.num_conversations * spec.num_turns} prompts "
        f"({'exact lengths from /tokenize' if tokenizer.exact else 'no /tokenize: one word counted as one token'})")
    workload = await build_workload(spec, tokenizer, Progress("bench serve: prompts ready").update)
    metrics_before = await _prefix_cache_counts(endpoint)
    load = _Load(args, endpoint, model, total=spec.num_conversations * spec.num_turns)
    started_s = time.perf_counter()
    await asyncio.gather(*(load.converse(c, started_s) for c in workload.conversations))
    duration_s = time.perf_counter() - started_s
    metrics_after = await _prefix_cache_counts(endpoint)
    prefix_cache = metrics_after.minus(metrics_before) if metrics_after else None
    records = sorted(load.records, key=lambda r: r.sent_s)
    await _count_reusable(records, tokenizer)
    run = _run_settings(args, spec, model, workload, tokenizer.exact)
    return summarize(records, duration_s, run, Slo(args.slo_ttft, args.slo_tpot), prefix_cache), records


async def _count_reusable(records: list[RequestRecord], tokenizer: PromptTokenizer) -> None:
    """Fill each completed request's reusable_tokens, in the order they were sent (after the
    run, so the timed load carries no tokenizing)."""
    log("counting the reusable prompt tokens ...")
    done = [record for record in records if record.result.ok]
    prompt_ids = await asyncio.gather(*(tokenizer.encode_prompt(r.prompt, r.messages) for r in done))
    for record, shared in zip(done, reusable_tokens(prompt_ids), strict=True):
        record.reusable_tokens = shared


class _Load:
    """Sends the conversations under the concurrency limit and keeps what each request saw."""

    def __init__(self, args: argparse.Namespace, endpoint: Endpoint, model: str, total: int) -> None:
        self._args = args
        self._endpoint = endpoint
        self._model = model
        self._path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        self._slots = asyncio.Semaphore(args.concurrency)
        self._progress = Progress("bench serve: requests done")
        self._total = total
        self.records: list[RequestRecord] = []

    async def converse(self, conversation: Conversation, started_s: float) -> None:
        await asyncio.sleep(max(0.0, started_s + conversation.arrival_s - time.perf_counter()))
        history: list[dict] = []
        for index, turn in enumerate(conversation.turns):
            messages = [*history, {"role": "user", "content": turn.text}] if self._args.endpoint == "chat" else None
            prompt = turn.text if messages is None else None
            body = self._body(prompt, messages, turn.output_len, turn.seed)
            async with self._slots:
                sent_s = time.perf_counter() - started_s
                result = await stream_request(self._endpoint, self._path, body, keep_text=len(conversation.turns) > 1)
            self._add(RequestRecord(conversation.idx, index, turn.input_len, turn.num_tokens, turn.output_len,
                                    sent_s, result, prompt, messages))
            if not result.ok:
                for later, unsent in enumerate(conversation.turns[index + 1 :], index + 1):
                    self._add(RequestRecord(conversation.idx, later, unsent.input_len, unsent.num_tokens,
                                            unsent.output_len, sent_s, StreamResult(False, UNSENT)))
                return
            history = [*messages, {"role": "assistant", "content": result.text}] if messages else []

    def _add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self._progress.update(len(self.records), self._total)

    def _body(self, prompt: str | None, messages: list[dict] | None, output_len: int, seed: int) -> bytes:
        body: dict = {"model": self._model, "max_tokens": output_len, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": self._args.temperature, "seed": seed}
        if not self._args.no_ignore_eos:
            body["ignore_eos"] = True
        if messages is not None:
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        return json.dumps(body).encode()


def _check_fits(spec: WorkloadSpec, max_model_len: int | None) -> None:
    """A first turn longer than the server's context fails every time: say so before sending."""
    if not max_model_len:
        return
    longest = spec.shared_prefix_len + spec.input_len.high + spec.output_len.high
    if longest > max_model_len:
        raise ValueError(f"the longest request ({spec.shared_prefix_len} + {spec.input_len.high} prompt + "
                         f"{spec.output_len.high} output tokens) exceeds the server's max_model_len {max_model_len}; "
                         "lower --input-len, --output-len or --shared-prefix-len")
    if spec.num_turns * longest > max_model_len:
        log(f"warning: {spec.num_turns} turns can reach {spec.num_turns * longest} tokens of history, past the "
            f"server's max_model_len {max_model_len}: such turns will fail")


async def _prefix_cache_counts(endpoint: Endpoint) -> PrefixCacheCounts | None:
    status, body = await fetch(endpoint, "GET", "/metrics")
    return prefix_cache_counts(body.decode("utf-8", "replace")) if status == 200 else None


def _run_settings(args: argparse.Namespace, spec: WorkloadSpec, model: str, workload: Workload, exact: bool) -> dict:
    turns = workload.turns
    inexact = sum(not turn.exact for turn in turns)
    if not exact:
        lengths = "approximate: the server has no /tokenize, so one word was counted as one token"
    elif inexact:
        lengths = f"exact from /tokenize except {inexact} of {len(turns)} texts (see text_tokens in --json-file)"
    else:
        lengths = "exact from /tokenize"
    return {
        "model": model, "url": args.url, "endpoint": args.endpoint, "concurrency": args.concurrency,
        "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
        "input_len": str(spec.input_len), "output_len": str(spec.output_len), "temperature": args.temperature,
        "shared_prefix_len": spec.shared_prefix_len, "num_prefixes": spec.num_prefixes if spec.shared_prefix_len else 0,
        "shared_prefix_tokens": workload.prefix_lens, "num_turns": spec.num_turns, "seed": spec.seed,
        "ignore_eos": not args.no_ignore_eos, "prompt_lengths": lengths, "exact_lengths": exact and not inexact,
        "mean_text_tokens": sum(turn.num_tokens for turn in turns) / len(turns),
    }


def log(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)

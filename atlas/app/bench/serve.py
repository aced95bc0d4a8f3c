"""`atlas bench serve`: load-test any OpenAI-compatible server with streamed requests.

    atlas bench serve --url http://127.0.0.1:8888 --concurrency 64 --num-prompts 512 \\
        --input-len 32 --output-len 128

`--concurrency` clients each send one streamed request at a time until `--num-prompts` have
been sent. Prompts are random common words, about one token each (the prompt tokens the
server counted are reported). Every request asks for exactly `--output-len` tokens
(`ignore_eos`, a vLLM extension; `--no-ignore-eos` for servers that reject it).

Reported per request and summarised as mean, p50 and p99:
    TTFT  time to the first chunk with text
    TPOT  (latency - TTFT) / (output tokens - 1): the average time per token after the first
    ITL   the gaps between successive chunks with text (a chunk may carry several tokens)
and overall output tokens/s = every completion token / wall time of the run.

The client is a small HTTP/1.1 reader on asyncio streams (chunked or length-delimited bodies,
SSE events split on blank lines), so on a small machine it costs the server little CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by word but "
    "what some we can out other were all there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line turn cause much mean before move right boy old"
).split()


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8888", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model id to request (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight at once (default 64)")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests in total (default 256)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt words, about one token each (default 32)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (for servers that reject vLLM's extensions)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


class _Endpoint:
    """Where and how to send: parsed URL, headers, TLS."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http://HOST[:PORT] or https://... (got {url!r})")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        self.api_key = api_key

    def request_bytes(self, method: str, path: str, body: bytes = b"") -> bytes:
        lines = [f"{method} {self.base_path}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Accept: text/event-stream, application/json", "Connection: close"]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        if self.api_key:
            lines.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _open(endpoint: _Endpoint, method: str, path: str, body: bytes = b""):
    """Send a request; returns (status, headers, reader, writer) once the headers are read."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=endpoint.ssl, limit=1 << 20)
    writer.write(endpoint.request_bytes(method, path, body))
    status_line = await reader.readline()
    if not status_line:
        writer.close()
        raise ConnectionError("the server closed the connection without answering")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader, writer


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body as it arrives, de-chunked."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(1 << 16):
            yield data


async def _get_json(endpoint: _Endpoint, path: str) -> dict:
    status, headers, reader, writer = await _open(endpoint, "GET", path)
    try:
        body = b"".join([piece async for piece in _body_pieces(reader, headers)])
    finally:
        writer.close()
    if status != 200:
        raise ValueError(f"GET {path} answered {status}: {body[:300]!r}")
    return json.loads(body)


class _StreamChunk(msgspec.Struct):
    choices: list[dict] = []
    usage: dict | None = None


def _has_text(choice: dict) -> bool:
    if "text" in choice:
        return bool(choice["text"])
    return bool((choice.get("delta") or {}).get("content"))


async def _one_request(endpoint: _Endpoint, path: str, body: bytes) -> RequestResult:
    started_s = time.perf_counter()
    decode = msgspec.json.Decoder(_StreamChunk).decode
    try:
        status, headers, reader, writer = await _open(endpoint, "POST", path, body)
    except (OSError, ValueError, IndexError) as error:
        return RequestResult(False, f"connect: {error}")
    result = RequestResult(True)
    last_text_s: float | None = None
    pending = b""
    try:
        if status != 200:
            text = b"".join([piece async for piece in _body_pieces(reader, headers)])
            return RequestResult(False, f"HTTP {status}: {text[:200].decode('utf-8', 'replace')}")
        async for piece in _body_pieces(reader, headers):
            now = time.perf_counter()
            pending += piece.replace(b"\r\n", b"\n")  # SSE allows CRLF line ends
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = decode(event[6:])
                if chunk.usage:
                    result.prompt_tokens = chunk.usage.get("prompt_tokens", 0)
                    result.output_tokens = chunk.usage.get("completion_tokens", 0)
                if any(_has_text(choice) for choice in chunk.choices):
                    if last_text_s is None:
                        result.ttft_s = now - started_s
                    else:
                        result.itl_s.append(now - last_text_s)
                    last_text_s = now
    except (OSError, ValueError, asyncio.IncompleteReadError, msgspec.DecodeError) as error:
        return RequestResult(False, f"stream: {error}")
    finally:
        writer.close()
    result.latency_s = time.perf_counter() - started_s
    if last_text_s is None:
        return RequestResult(False, "the stream carried no text")
    return result


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def _payload(args: argparse.Namespace, model: str, rng: random.Random) -> bytes:
    prompt = " ".join(rng.choice(WORDS) for _ in range(args.input_len))
    body: dict = {"model": model, "max_tokens": args.output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0.0}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


async def run_load(args: argparse.Namespace) -> dict:
    """Run the load and return the summary (the figures printed by the command)."""
    endpoint = _Endpoint(args.url, args.api_key)
    model = args.model or (await _get_json(endpoint, "/v1/models"))["data"][0]["id"]
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    rng = random.Random(args.seed)
    payloads = [_payload(args, model, rng) for _ in range(args.num_prompts)]
    results: list[RequestResult] = []
    queue = iter(payloads)

    async def client() -> None:
        for body in queue:
            results.append(await _one_request(endpoint, path, body))

    started_s = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(args.concurrency, args.num_prompts))))
    duration_s = time.perf_counter() - started_s
    return summarize(results, duration_s, model, args)


def summarize(results: list[RequestResult], duration_s: float, model: str, args: argparse.Namespace) -> dict:
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [gap for r in done for gap in r.itl_s]
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "model": model, "endpoint": args.endpoint, "concurrency": args.concurrency,
        "num_prompts": len(results), "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration_s, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s if duration_s else 0.0,
        "requests_per_s": len(done) / duration_s if duration_s else 0.0,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in done) / max(len(done), 1),
        "first_error": next((r.error for r in results if not r.ok), None),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        summary[f"{name}_mean_ms"] = 1000 * sum(values) / len(values) if values else 0.0
        summary[f"{name}_p50_ms"] = 1000 * _percentile(values, 0.50)
        summary[f"{name}_p99_ms"] = 1000 * _percentile(values, 0.99)
    return summary


def print_summary(summary: dict) -> None:
    print(f"model {summary['model']} ({summary['endpoint']}), concurrency {summary['concurrency']}")
    print(f"requests      {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.2f} s "
          f"({summary['requests_per_s']:.2f} req/s); mean prompt {summary['mean_prompt_tokens']:.1f} tokens")
    print(f"output        {summary['output_tokens']} tokens, {summary['output_tokens_per_s']:.1f} tokens/s")
    print(f"{'':14}{'mean':>10}{'p50':>10}{'p99':>10}  (ms)")
    for name in ("ttft", "tpot", "itl"):
        print(f"{name.upper():14}{summary[f'{name}_mean_ms']:>10.2f}{summary[f'{name}_p50_ms']:>10.2f}"
              f"{summary[f'{name}_p99_ms']:>10.2f}")
    if summary["first_error"]:
        print(f"first error: {summary['first_error']}", file=sys.stderr)


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--concurrency, --num-prompts, --input-len and --output-len must be positive")
    try:
        summary = asyncio.run(run_load(args))
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot benchmark {args.url}: {type(error).__name__}: {error} "
                         "(is the server running? pass --model when it has no /v1/models)") from None
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0 if summary["completed"] else 1

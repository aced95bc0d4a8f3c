"""`atlas bench serve` against the live server (and a stand-in for a vLLM-like one): every
request completes, lengths are exact, and the figures add up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.e2e


def bench(url: str, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "atlas.app.cli", "bench", "serve", "--url", url, *flags],
                            capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def saved(path) -> tuple[dict, list[dict]]:
    document = json.loads(path.read_text())
    return document["summary"], sorted(document["requests"], key=lambda r: (r["conversation"], r["turn"]))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_reports_every_request(server, endpoint):
    result = bench(server.url, "--endpoint", endpoint, "--concurrency", "8", "--num-prompts", "20",
                   "--input-len", "8", "--output-len", "16", "--json")
    summary = json.loads(result.stdout)
    assert summary["model"] == "tiny" and summary["completed"] == 20 and summary["failed"] == 0
    assert summary["output_tokens"] == 20 * 16
    assert summary["exact_lengths"] and summary["mean_text_tokens"] == 8
    # the tiny tokenizer adds no BOS; the chat template wraps the 8 tokens
    assert summary["mean_prompt_tokens"] == 8 if endpoint == "completions" else summary["mean_prompt_tokens"] > 8
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p90_ms"] <= summary["ttft_p99_ms"]
    assert summary["tpot_mean_ms"] > 0 and summary["itl_p50_ms"] >= 0
    assert summary["output_tokens_per_s"] == pytest.approx(summary["output_tokens"] / summary["duration_s"])
    assert summary["prefix_cache_source"] in ("atlas", "n/a")


def test_ranged_lengths_poisson_arrivals_and_sampling_are_exact_and_reproducible(server, tmp_path):
    flags = ("--concurrency", "4", "--num-prompts", "16", "--input-len", "4:40", "--output-len", "2:12",
             "--request-rate", "100", "--temperature", "0.8", "--seed", "7", "--slo-ttft", "60000", "--slo-tpot", "60000")
    bench(server.url, *flags, "--json-file", str(tmp_path / "a.json"))
    bench(server.url, *flags, "--json-file", str(tmp_path / "b.json"))
    summary, rows = saved(tmp_path / "a.json")
    _, again = saved(tmp_path / "b.json")
    assert summary["completed"] == 16 and summary["prompt_lengths"] == "exact from /tokenize"
    assert summary["request_rate"] == 100 and summary["input_len"] == "4:40"
    assert all(r["prompt_tokens"] == r["input_len"] and r["output_tokens"] == r["output_len"] for r in rows)
    assert len({r["input_len"] for r in rows}) > 5 and all(4 <= r["input_len"] <= 40 for r in rows)
    assert len({r["output_len"] for r in rows}) > 3
    assert summary["good_requests"] == 16 and summary["goodput_requests_per_s"] == pytest.approx(summary["requests_per_s"])
    assert [(r["input_len"], r["output_len"]) for r in rows] == [(r["input_len"], r["output_len"]) for r in again]
    assert sorted(r["sent_s"] for r in rows)[-1] > 0.02  # arrivals spread out: 16 at 100/s take ~0.15 s


def test_shared_prefixes_are_counted_as_reusable_after_the_first_of_each_group(server, tmp_path):
    bench(server.url, "--concurrency", "4", "--num-prompts", "10", "--shared-prefix-len", "60", "--num-prefixes", "2",
          "--input-len", "6", "--output-len", "3", "--json-file", str(tmp_path / "run.json"))
    summary, rows = saved(tmp_path / "run.json")
    assert summary["shared_prefix_tokens"] == [60, 60] and summary["exact_lengths"]
    assert all(r["prompt_tokens"] == 66 for r in rows)
    by_time = sorted(rows, key=lambda r: r["sent_s"])
    first_of_group = {}
    for row in by_time:
        first_of_group.setdefault(row["conversation"] % 2, row["conversation"])
    for row in rows:
        if row["conversation"] in first_of_group.values():
            assert row["reusable_tokens"] < 60
        else:  # the prefix, and perhaps a word or two of an earlier suffix
            assert 60 <= row["reusable_tokens"] < 66
    assert summary["reusable_tokens"] == sum(r["reusable_tokens"] for r in rows) >= 8 * 60


def test_multi_turn_chat_resends_the_history_and_the_prefix_cache_hits_it(server, tmp_path):
    """Each turn is sent once the previous reply has ended, so every full block of the previous
    prompt is in the server's prefix cache (16-token blocks, a KV pool far larger than the run)."""
    bench(server.url, "--endpoint", "chat", "--concurrency", "3", "--num-prompts", "12", "--num-turns", "4",
          "--input-len", "5:15", "--output-len", "3:6", "--json-file", str(tmp_path / "run.json"),
          "--plot", str(tmp_path / "run.png"))
    summary, rows = saved(tmp_path / "run.json")
    assert summary["completed"] == 12 and summary["num_turns"] == 4
    resent = 0
    for earlier, later in zip(rows, rows[1:]):
        if later["conversation"] != earlier["conversation"]:
            continue
        assert later["turn"] == earlier["turn"] + 1
        # the whole earlier prompt opens the later one; the reply (re-tokenized from its text,
        # so not necessarily its output_tokens) and the new message follow
        assert later["reusable_tokens"] == earlier["prompt_tokens"]
        assert later["prompt_tokens"] > earlier["prompt_tokens"] + later["input_len"]
        assert later["cached_tokens"] >= earlier["prompt_tokens"] // 16 * 16
        resent += earlier["output_tokens"]
    assert summary["resent_reply_tokens"] == resent > 0
    assert summary["prefix_cache_source"] == "atlas"
    assert summary["prefix_cache_hits"] >= summary["usage_cached_tokens"] == sum(r["cached_tokens"] for r in rows) > 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_counts_failures_from_a_rejecting_server(server):
    result = bench(server.url, "--model", "not-served", "--concurrency", "2", "--num-prompts", "3",
                   "--output-len", "4", "--json", check=False)
    summary = json.loads(result.stdout)
    assert result.returncode == 1 and summary["failed"] == 3 and "404" in summary["first_error"]


class VllmLikeServer:
    """A stand-in for another OpenAI-compatible server: no /tokenize, vLLM's prefix-cache
    counters at /metrics, usage.prompt_tokens_details.cached_tokens, 5 chunks per stream.
    Each completion adds its prompt words to the queries counter and 4 to the hits."""

    def __init__(self) -> None:
        self.queries = 1000
        self.hits = 100
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, path, _ = (await reader.readline()).decode().split()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length)) if length else {}
        if path == "/v1/models":
            writer.write(_response(json.dumps({"data": [{"id": "other"}]})))
        elif path == "/metrics":
            writer.write(_response(f'vllm:prefix_cache_queries_total{{engine="0"}} {self.queries}.0\n'
                                   f'vllm:prefix_cache_hits_total{{engine="0"}} {self.hits}.0\n'))
        elif path == "/v1/completions":
            prompt_tokens = len(body["prompt"].split())
            self.queries += prompt_tokens
            self.hits += 4
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            for _ in range(5):
                writer.write(b'data: {"choices": [{"text": " word"}]}\n\n')
                await writer.drain()
                await asyncio.sleep(0.002)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        else:
            writer.write(_response('{"detail": "Not Found"}', "404 Not Found"))
        await writer.drain()
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _response(text: str, status: str = "200 OK") -> bytes:
    data = text.encode()
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


def test_a_server_without_tokenize_gets_approximate_lengths_and_its_vllm_counters_are_read():
    other = VllmLikeServer()
    try:
        result = bench(other.url, "--concurrency", "3", "--num-prompts", "6", "--input-len", "10:20",
                       "--shared-prefix-len", "30", "--output-len", "5", "--no-ignore-eos", "--json")
    finally:
        other.stop()
    summary = json.loads(result.stdout)
    assert summary["completed"] == 6 and summary["prompt_lengths"].startswith("approximate")
    assert not summary["exact_lengths"] and summary["model"] == "other"
    assert summary["prefix_cache_source"] == "vllm"
    assert summary["prefix_cache_queries"] == summary["prompt_tokens"] and summary["prefix_cache_hits"] == 6 * 4
    assert summary["usage_cached_tokens"] == 6 * 4
    assert summary["reusable_tokens"] >= 5 * 30  # counted in words, the prefix's after the first
    assert summary["prefix_cache_hits_of_reusable"] == pytest.approx(24 / summary["reusable_tokens"])


def test_requests_longer_than_the_server_context_are_refused_before_sending(server):
    result = bench(server.url, "--input-len", "300:400", "--output-len", "200", check=False)
    assert result.returncode == 2 and "max_model_len 512" in result.stderr and "--input-len" in result.stderr
    assert result.stdout == ""

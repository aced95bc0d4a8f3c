"""`atlas bench serve` against the live server: every request completes and the figures add up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_reports_every_request(server, endpoint):
    result = subprocess.run(
        [sys.executable, "-m", "atlas.app.cli", "bench", "serve", "--url", server.url, "--endpoint", endpoint,
         "--concurrency", "8", "--num-prompts", "20", "--input-len", "8", "--output-len", "16", "--json"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["model"] == "tiny" and summary["completed"] == 20 and summary["failed"] == 0
    assert summary["output_tokens"] == 20 * 16
    assert summary["mean_prompt_tokens"] >= 8
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert summary["tpot_mean_ms"] > 0 and summary["itl_p50_ms"] >= 0
    assert summary["output_tokens_per_s"] == pytest.approx(summary["output_tokens"] / summary["duration_s"])


def test_bench_serve_counts_failures_from_a_rejecting_server(server):
    result = subprocess.run(
        [sys.executable, "-m", "atlas.app.cli", "bench", "serve", "--url", server.url, "--model", "not-served",
         "--concurrency", "2", "--num-prompts", "3", "--output-len", "4", "--json"],
        capture_output=True, text=True, timeout=300)
    summary = json.loads(result.stdout)
    assert result.returncode == 1 and summary["failed"] == 3 and "404" in summary["first_error"]

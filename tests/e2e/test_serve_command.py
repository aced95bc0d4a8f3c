"""The `atlas serve` command's startup checks, the bare `hypercorn atlas.app:serve` form,
the engine in the API process (--single-process), and --dump."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import LiveServer, free_port, server_environment, tiny_server_args

pytestmark = pytest.mark.e2e


def atlas(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atlas.app.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env or server_environment())


def test_an_unknown_flag_names_the_closest_one(tiny_model):
    result = atlas("serve", str(tiny_model), "--max-seq-lenn", "64")
    assert result.returncode == 2
    assert "did you mean '--max-seq-len'" in result.stderr


def test_require_auth_without_tokens_is_a_startup_error_naming_the_flags(tiny_model):
    result = atlas("serve", str(tiny_model), "--device", "mock", "--require-auth")
    assert result.returncode == 2
    assert "--auth-token" in result.stderr and "--auth-tokens-file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_generation_config_override_is_a_startup_error(tiny_model):
    result = atlas("serve", str(tiny_model), "--device", "mock", "--override-generation-config", '{"top_p": 3}')
    assert result.returncode == 2 and "top_p" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_model_is_a_one_line_error(tmp_path):
    result = atlas("serve", str(tmp_path / "no-such-model"), "--device", "mock")
    assert result.returncode == 2
    assert result.stderr.startswith("atlas: error:") and "Traceback" not in result.stderr


def test_bench_startup_reports_a_server_that_exits_before_answering(tmp_path):
    result = atlas("bench", "startup", str(tmp_path / "absent"), "--device", "mock")
    assert result.returncode == 2
    assert "atlas serve exited with" in result.stderr and "not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_bare_hypercorn_serves_the_model_named_by_environment(tiny_model, tmp_path):
    port = free_port()
    env = server_environment(ATLAS_MODEL=str(tiny_model), ATLAS_DEVICE="mock", ATLAS_KV_CACHE_GB="0.25",
                             ATLAS_MAX_SEQ_LEN="256", ATLAS_MODEL_NAME="env-tiny")
    live = LiveServer([], tmp_path / "hypercorn.log", env=env, port=port,
                      command=[sys.executable, "-m", "hypercorn", "atlas.app:serve", "--bind", f"127.0.0.1:{port}"])
    try:
        live.wait_ready()
        client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["env-tiny"]
        answer = client.chat.completions.create(model="env-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        assert client.models.retrieve("env-tiny").max_model_len == 256
    finally:
        live.stop()


def test_single_process_mode_and_dump(tiny_model, tmp_path):
    dump = tmp_path / "dump.jsonl"
    live = LiveServer(tiny_server_args(tiny_model, "--single-process", "--dump", str(dump)), tmp_path / "s.log")
    try:
        live.wait_ready()
        client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
        whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0.0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="The sea", max_tokens=5, temperature=0.0, stream=True) if c.choices)
        bad = httpx.post(live.v1 + "/chat/completions", json={"messages": []}, timeout=30)
        assert bad.status_code == 400
    finally:
        assert live.stop() == 0
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [(r["endpoint"], r["stream"], r["status"]) for r in records] == [
        ("chat", False, 200), ("completions", True, 200), ("chat", False, 400)]
    assert records[2]["request"] == {"messages": []} and records[2]["response"]["error"]["param"] == "messages"
    assert records[0]["request"]["messages"] == [{"role": "user", "content": "hi"}]
    assert records[0]["response"]["choices"][0]["message"]["content"] == whole.choices[0].message.content
    assert records[1]["response"]["choices"][0]["text"] == streamed
    assert records[1]["response"]["usage"]["completion_tokens"] == 5


def test_bench_startup_tables_where_each_start_spent_its_seconds(tiny_model):
    """Both processes' phases arrive in one table per start, in the order they ended."""
    result = atlas("bench", "startup", str(tiny_model), "--device", "mock", "--starts", "cold,warm",
                   "--serve-args", "--kv-cache-gb 0.25 --max-seq-len 64 --max-num-seqs 4")
    assert result.returncode == 0, result.stderr[-2000:]
    tables = result.stdout.split("start: first token after")[1:]
    assert len(tables) == 2
    for table in tables:
        names = [line.split()[0] for line in table.splitlines()[2:] if line.startswith("  ")]
        for phase in ("api", "engine", "model", "backend", "weights", "memory", "graphs", "http", "first"):
            assert phase in names, (phase, table)
        assert names.index("weights") < names.index("graphs") < names.index("first")
    assert "no graphs (eager)" in result.stdout  # the mock captures none


def test_bench_startup_refuses_a_warm_start_with_nothing_to_warm_it(tiny_model):
    result = atlas("bench", "startup", str(tiny_model), "--device", "mock", "--starts", "warm")
    assert result.returncode == 2 and "--starts" in result.stderr and "Traceback" not in result.stderr

"""The real model over HTTP: the README's request answers "Paris" on the mock backend.

Skipped unless SmolLM2 has been pulled (`atlas pull smollm2`)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest
from conftest import DEVICE, LiveServer

from atlas.app.model_store import is_model_folder, models_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    if not is_model_folder(models_dir() / "smollm2"):
        pytest.skip("SmolLM2 is not pulled (atlas pull smollm2)")
    live = LiveServer(["smollm2", "--device", DEVICE, "--max-seq-len", "1024", "--kv-cache-gb", "0.25"],
                      tmp_path_factory.mktemp("smollm2") / "server.log")
    yield live.wait_ready(timeout_s=300)
    live.stop()


def test_the_readme_request_answers_paris(smollm2_server):
    url = smollm2_server.url + "/v1/chat/completions"
    if shutil.which("curl"):
        output = subprocess.run(["curl", "-s", url, "-d", json.dumps(QUESTION)], capture_output=True, text=True,
                                timeout=300).stdout
        answer = json.loads(output)
    else:
        answer = httpx.post(url, content=json.dumps(QUESTION), timeout=300,
                            headers={"Content-Type": "application/x-www-form-urlencoded"}).json()
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_streaming_through_the_sdk_answers_paris(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.v1, api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(stream=True, max_tokens=40, **QUESTION)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text

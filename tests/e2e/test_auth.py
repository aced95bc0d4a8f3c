"""--require-auth: API routes need a configured token (a bearer token, or Anthropic's x-api-key);
health and metrics stay open."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from conftest import LiveServer, tiny_server_args

pytestmark = pytest.mark.e2e

PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [5]}),
    ("POST", "/v1/responses", {"input": "x", "max_output_tokens": 2}),
]
WRONG = [None, "Bearer wrong", "Bearer flag-token-x", "Basic flag-token", "Bearer", "flag-token"]


@pytest.fixture(scope="module")
def auth_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    tokens_file = folder / "tokens.txt"
    tokens_file.write_text("# team tokens\nfile-token-1\n\nfile-token-2\n")
    live = LiveServer(tiny_server_args(tiny_model, "--require-auth", "--auth-token", "flag-token",
                                       "--auth-tokens-file", str(tokens_file)), folder / "server.log")
    yield live.wait_ready()
    live.stop()


@pytest.mark.parametrize("method,path,body", PROTECTED)
@pytest.mark.parametrize("authorization", WRONG)
def test_missing_or_wrong_tokens_get_401(auth_server, method, path, body, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = httpx.request(method, auth_server.url + path, json=body, headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("token", ["flag-token", "file-token-1", "file-token-2"])
@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_configured_tokens_get_200(auth_server, token, method, path, body):
    response = httpx.request(method, auth_server.url + path, json=body, timeout=30,
                             headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/health", "/health/live", "/metrics"])
def test_health_and_metrics_stay_open(auth_server, path):
    assert httpx.get(auth_server.url + path, timeout=30).status_code == 200


def test_the_openai_sdk_authenticates_with_its_api_key(auth_server):
    good = openai.OpenAI(base_url=auth_server.v1, api_key="file-token-2", max_retries=0)
    answer = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.choices[0].message.content is not None
    bad = openai.OpenAI(base_url=auth_server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_anthropic_sdk_authenticates_with_x_api_key(auth_server):
    good = anthropic.Anthropic(base_url=auth_server.url, api_key="flag-token", max_retries=0)
    answer = good.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert answer.content[0].type == "text"
    bad = anthropic.Anthropic(base_url=auth_server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        bad.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "authentication_error"

"""The live server driven by the real `anthropic` SDK: messages, streams, token counts."""

from __future__ import annotations

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me about the weather on the hills."}]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_message_counts_its_prompt_and_output_tokens(client):
    message = client.messages.create(model="tiny", max_tokens=12, messages=MESSAGES, system="Be brief.")
    assert message.id.startswith("msg_") and message.model == "tiny" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model="tiny", messages=MESSAGES, system="Be brief.")
    assert message.usage.input_tokens == counted.input_tokens > 0
    assert 0 < message.usage.output_tokens <= 12


def test_the_stream_has_anthropics_events_and_the_same_text(client):
    # Greedy: the served model's default. temperature and top_k are still accepted (older SDKs and
    # Claude Code send them; this SDK only through extra_body).
    kwargs = dict(model="tiny", max_tokens=16, messages=MESSAGES, extra_body={"temperature": 0.0, "top_k": 1})
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_stop_sequences_end_the_message(client):
    whole = client.messages.create(model="tiny", max_tokens=30, messages=MESSAGES)
    text = whole.content[0].text
    word = text.split()[len(text.split()) // 2]
    stopped = client.messages.create(model="tiny", max_tokens=30, messages=MESSAGES, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(stopped.content[0].text) and word not in stopped.content[0].text


def test_bad_requests_are_anthropic_errors(client, server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="tiny", max_tokens=5, messages=MESSAGES, extra_body={"temperature": 1.5})
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    response = httpx.post(server.url + "/v1/messages", json={"messages": MESSAGES}, timeout=30)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "max_tokens" in response.json()["error"]["message"]

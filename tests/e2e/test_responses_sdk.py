"""The live server driven by the openai SDK's `responses`: text, streams, the store."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_text_streamed_and_not(client):
    kwargs = dict(model="tiny", input="Tell me about the weather.", max_output_tokens=16, temperature=0.0)
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    final = events[-1].response  # response.incomplete at max_output_tokens, as OpenAI's streams end
    assert events[-1].type == f"response.{whole.status}" and final.status == whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="Count to three.", max_output_tokens=8, temperature=0.0)
    second = client.responses.create(model="tiny", input="Again.", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0.0)
    alone = client.responses.create(model="tiny", input="Again.", max_output_tokens=8, temperature=0.0, store=False)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)

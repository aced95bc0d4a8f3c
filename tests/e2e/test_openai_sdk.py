"""The live server driven by the real `openai` SDK: sync, async and streaming."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me about the weather on the hills."}]
FIXED_LENGTH = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def prompt_token_count(server, messages) -> int:
    response = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
    assert response.status_code == 200
    return response.json()["count"]


def test_non_streamed_chat_counts_prompt_and_output_tokens(server, client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.7,
                                              seed=3, extra_body=FIXED_LENGTH)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == "tiny"
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == prompt_token_count(server, MESSAGES)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_stream_has_one_role_chunk_and_one_finish_chunk_per_choice_with_stable_ids(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=9, n=2, temperature=1.0, seed=11, logprobs=True,
        stream=True, stream_options={"include_usage": True}, extra_body=FIXED_LENGTH,
    )
    chunks = list(stream)
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    per_choice = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1
        per_choice[chunk.choices[0].index].append(chunk.choices[0])
    num_tokens = 0
    for choices in per_choice.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices].count("length") == 1
        assert [c.finish_reason is not None for c in choices][-1]  # the finish chunk comes last
        num_tokens += sum(len(c.logprobs.content) for c in choices if c.logprobs is not None)
    assert num_tokens == 18 == usage_chunks[0].usage.completion_tokens


def test_streamed_text_equals_the_non_streamed_text_for_the_same_seed(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.9, seed=77)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole and len(whole) > 10


def test_n_three_gives_three_distinct_choices(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=15, n=3, temperature=1.2,
                                              seed=5, extra_body=FIXED_LENGTH)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) >= 2
    assert response.usage.completion_tokens == 45


def test_seeds_reproduce_and_different_seeds_differ(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=1.0,
                                         seed=seed, extra_body=FIXED_LENGTH).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_exactly(client, stream):
    base = dict(model="tiny", prompt="The capital of Italy", max_tokens=40, temperature=0.0, extra_body=FIXED_LENGTH)
    full = client.completions.create(**base).choices[0].text
    cut = next(k for k in range(6, len(full) - 4) if full.find(full[k:k + 3]) == k and full[k:k + 3].strip())
    stop = full[cut:cut + 3]

    def run(**extra) -> tuple[str, str | None]:
        body = dict(base, stop=[stop, "zzzz-never"], extra_body=dict(FIXED_LENGTH, **extra))
        if not stream:
            choice = client.completions.create(**body).choices[0]
            return choice.text, choice.finish_reason
        chunks = [c for c in client.completions.create(stream=True, **body) if c.choices]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert len(finishes) == 1
        return "".join(c.choices[0].text for c in chunks), finishes[0]

    assert run() == (full[:cut], "stop")
    assert run(include_stop_str_in_output=True) == (full[:cut + 3], "stop")


def test_logprobs_cover_every_token_with_sorted_alternatives(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0,
                                              logprobs=True, top_logprobs=3, extra_body=FIXED_LENGTH)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 8
    assert "".join(item.token for item in content) == response.choices[0].message.content
    for item in content:
        tops = [top.logprob for top in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.top_logprobs[0].token == item.token and item.logprob <= 0.0  # greedy picks the top one
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_completions_take_token_ids_echo_and_several_prompts(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0.0)
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0.0,
                                        echo=True)
    assert by_text.choices[0].text == "Once upon a time" + by_ids.choices[0].text
    several = client.completions.create(model="tiny", prompt=["The sea", "A small model"], n=2, max_tokens=5,
                                        temperature=0.0, extra_body=FIXED_LENGTH)
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text != several.choices[2].text
    assert several.usage.completion_tokens == 20


def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


def test_async_client_streams_concurrently(server):
    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)

        async def one(seed: int) -> tuple[str, int]:
            stream = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed, stream=True,
                stream_options={"include_usage": True}, extra_body=FIXED_LENGTH)
            text, usage = [], 0
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                else:
                    usage = chunk.usage.completion_tokens
            return "".join(text), usage

        try:
            return await asyncio.gather(*(one(seed) for seed in range(12)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(usage == 16 and text for text, usage in results)
    assert len({text for text, _ in results}) > 6


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    messages = [{"role": "user", "content": "Say it again: the prefix cache keeps every full block of this prompt."}]
    before = server.metrics()
    answers = [
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body=FIXED_LENGTH)
        for _ in range(2)
    ]
    first, again = answers
    prompt_tokens = first.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    # every full 16-token block but the one holding the last prompt token, which must be computed
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    after = server.metrics()
    hits = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert after["atlas_prefix_cache_hits_total"] - before["atlas_prefix_cache_hits_total"] == hits
    assert after["atlas_prefix_cache_queries_total"] - before["atlas_prefix_cache_queries_total"] == 2 * prompt_tokens

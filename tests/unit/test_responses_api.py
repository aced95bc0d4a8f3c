"""POST /v1/responses, GET and DELETE /v1/responses/{id} through the real openai SDK, on scripted
output: text, the stream the SDK assembles, function calls, previous_response_id, the store."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.chat_templates import TOOL_TEMPLATES
from helpers.model_folders import with_chat_template
from helpers.scripted_engine import serving

from atlas.adapters.http import HttpConfig
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.chat_features import chat_features
from atlas.ports.grammar import ForcedToolCalls, FunctionTool, JsonSchema

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather by city", "parameters": WEATHER_SCHEMA}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT_CALL = f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n{CALL}"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    folder = with_chat_template(tiny, tmp_path_factory.mktemp("qwen3") / "model", TOOL_TEMPLATES["qwen3"],
                                think_tags=True)
    tokenizer = HfTokenizer.from_folder(folder)
    return tokenizer, chat_features(tokenizer, folder, tokenizer.vocab_size)


def prompt(served, tokenizer, index: int = -1) -> str:
    return tokenizer.decode(served.engine.submitted[index].prompt_token_ids, skip_special_tokens=False)


@pytest.mark.anyio
async def test_text_in_text_out_with_instructions(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "It is sunny.") as served:
        response = await served.openai.responses.create(model="tiny", input="Weather?", instructions="Be brief.",
                                                         max_output_tokens=50, metadata={"k": "v"})
        text = prompt(served, tokenizer)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "It is sunny." and [item.type for item in response.output] == ["message"]
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"} and response.store
    assert response.usage.output_tokens == len(tokenizer.encode("It is sunny.", add_special_tokens=False)) + 1
    assert response.usage.input_tokens + response.usage.output_tokens == response.usage.total_tokens
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>")


@pytest.mark.anyio
async def test_the_stream_assembles_into_the_same_items_as_the_body(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, THINK_TEXT_CALL) as served:
        whole = await served.openai.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS)
        async with served.openai.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
    for response in (whole, final):
        reasoning, message, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user wants weather."
        assert message.type == "message" and message.content[0].text == "Let me check."
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                      {"city": "Paris"})
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert response.output_text == "Let me check." and response.status == "completed"
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    for expected in ("response.reasoning_text.delta", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"):
        assert expected in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Let me check."
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in final.output]


@pytest.mark.anyio
async def test_a_function_call_round_trip_through_previous_response_id(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, CALL) as served:
        first = await served.openai.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS)
        [call] = first.output
        second = await served.openai.responses.create(
            model="tiny", previous_response_id=first.id, tools=TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
        text = prompt(served, tokenizer)
        fetched = await served.openai.responses.retrieve(first.id)
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert second.previous_response_id == first.id
    assert text.count("Weather in Paris?") == 1
    assert text.index("Weather in Paris?") < text.index('"arguments": {"city": "Paris"}') < text.index("21 C")
    assert fetched.id == first.id and fetched.output[0].call_id == call.call_id


@pytest.mark.anyio
async def test_input_items_replay_a_conversation_without_the_store(qwen3):
    tokenizer, features = qwen3
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Use the tool."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "21 C"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And Rome?"}]}]
    async with serving(tokenizer, features, "Warmer.") as served:
        response = await served.openai.responses.create(model="tiny", input=items, tools=TOOLS, store=False)
        text = prompt(served, tokenizer)
        with pytest.raises(openai.NotFoundError):
            await served.openai.responses.retrieve(response.id)
    assert not response.store and response.output_text == "Warmer."
    assert text.index('{"name": "get_weather", "arguments": {"city": "Paris"}}') < text.index("21 C") < text.index(
        "And Rome?")


@pytest.mark.anyio
async def test_delete_forgets_a_response_and_unknown_ids_are_named(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "Hi.") as served:
        response = await served.openai.responses.create(model="tiny", input="Hello")
        deleted = await served.http.delete(f"/v1/responses/{response.id}")
        again = await served.http.delete(f"/v1/responses/{response.id}")
        missing = await served.http.get(f"/v1/responses/{response.id}")
        with pytest.raises(openai.BadRequestError) as raised:
            await served.openai.responses.create(model="tiny", input="Hello", previous_response_id=response.id)
    assert deleted.json() == {"id": response.id, "deleted": True, "object": "response"}
    assert again.status_code == missing.status_code == 404
    assert raised.value.body["param"] == "previous_response_id"


@pytest.mark.anyio
async def test_the_store_is_bounded_and_drops_the_least_recently_used(qwen3):
    tokenizer, features = qwen3
    config = HttpConfig(max_stored_responses=2)
    async with serving(tokenizer, features, "Hi.", config) as served:
        ids = [(await served.openai.responses.create(model="tiny", input=f"Hello {i}")).id for i in range(3)]
        kept = [(await served.http.get(f"/v1/responses/{response_id}")).status_code for response_id in ids]
    assert kept == [404, 200, 200]
    async with serving(tokenizer, features, "Hi.", HttpConfig(max_stored_responses=0)) as served:
        response = await served.openai.responses.create(model="tiny", input="Hello")
        assert not response.store
        assert (await served.http.get(f"/v1/responses/{response.id}")).status_code == 404


@pytest.mark.anyio
async def test_prompt_tokens_from_the_prefix_cache_are_counted_as_cached(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "Hi.", cached_tokens=8) as served:
        response = await served.openai.responses.create(model="tiny", input="Hello")
    assert response.usage.input_tokens_details.cached_tokens == 8 and response.usage.input_tokens > 8


@pytest.mark.anyio
async def test_max_output_tokens_makes_it_incomplete(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "It is sunny and warm today.") as served:
        response = await served.openai.responses.create(model="tiny", input="Weather?", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


@pytest.mark.anyio
async def test_forced_calls_json_schema_and_effort_reach_the_engine(qwen3):
    tokenizer, features = qwen3
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    async with serving(tokenizer, features, CALL) as served:
        await served.openai.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice="required")
        await served.openai.responses.create(model="tiny", input="Weather?", tools=TOOLS,
                                             tool_choice={"type": "function", "name": "get_weather"})
        await served.openai.responses.create(model="tiny", input="Name?", reasoning={"effort": "minimal"},
                                             text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
        required, named, structured = (request.constraint for request in served.engine.submitted)
    weather = FunctionTool("get_weather", WEATHER_SCHEMA, "Weather by city")
    assert required.grammar == ForcedToolCalls("hermes", (weather,), parallel=True)
    assert named.grammar == ForcedToolCalls("hermes", (weather,))
    assert structured.grammar == JsonSchema(schema) and structured.grammar_field == "text.format.schema"
    assert structured.thinking_budget == 256


@pytest.mark.anyio
@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "image input is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "call_id"),
    ({"input": [{"content": "no role"}]}, "input[0].role", "role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", ""),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": "x", "temperature": 3}, "temperature", ""),
    ({"input": "x", "unknown": 1}, "unknown", "unknown field"),
    ({"input": []}, "input", "length >= 1"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}]}, "input",
     "no message to answer"),
    ({"input": [{"role": "developer", "content": "Be brief."}]}, "input", "no message to answer"),
])
async def test_bad_requests_are_400s_naming_the_field(qwen3, body, param, words):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "x") as served:
        response = await served.http.post("/v1/responses", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error

"""SmolLM2 on the mock through the openai and anthropic SDKs: forced tool calls, structured
output, thinking budgets, reasoning, and the Responses API.

The engine applies each request's token masks (`Request.constraint`). SmolLM2's template
ignores tools, so every call here is forced by the grammar (the hermes markup); a Qwen3-style
copy of the folder (`<think>` and `</think>` as single tokens, the block opened by the prompt) is
the reasoning model.

Skipped unless SmolLM2 has been pulled (`atlas pull smollm2`).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from conftest import DEVICE, LiveServer
from helpers.chat_templates import QWEN3_THINKING
from helpers.json_schema_check import schema_errors
from helpers.model_folders import with_chat_template

from atlas.app.model_store import is_model_folder, models_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                            "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
SERVER_FLAGS = ["--device", DEVICE, "--max-seq-len", "1024", "--kv-cache-gb", "0.25", "--seed", "7"]


def _smollm2_folder():
    folder = models_dir() / "smollm2"
    if not is_model_folder(folder):
        pytest.skip("SmolLM2 is not pulled (atlas pull smollm2)")
    return folder


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    _smollm2_folder()
    live = LiveServer(["smollm2", *SERVER_FLAGS], tmp_path_factory.mktemp("smollm2") / "server.log")
    yield live.wait_ready(timeout_s=300)
    live.stop()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """SmolLM2 as a reasoning model: a Qwen3-thinking template that opens the <think> block."""
    folder = with_chat_template(_smollm2_folder(), tmp_path_factory.mktemp("thinker") / "smollm2-thinking",
                                QWEN3_THINKING, think_tags=True)
    live = LiveServer([str(folder), "--model-name", "thinker", *SERVER_FLAGS],
                      tmp_path_factory.mktemp("thinker-logs") / "server.log")
    yield live.wait_ready(timeout_s=300)
    live.stop()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert schema_errors(arguments, SCHEMAS[call.function.name]) == [], call.function.arguments


def test_responses_text_stream_and_a_previous_response_id_round_trip(smollm2):
    client = openai_client(smollm2)
    first = client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=40)
    assert "Paris" in first.output_text
    events = list(client.responses.create(model="smollm2", input="What is the capital of France?",
                                          max_output_tokens=40, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text
    second = client.responses.create(model="smollm2", input="And the capital of Italy?", max_output_tokens=40,
                                     previous_response_id=first.id)
    assert second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_reasoning_template_splits_the_block_from_the_answer(thinker):
    response = openai_client(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=24)
    message = response.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and reasoning == message.model_extra["reasoning"]
    assert "</think>" not in (message.content or "")


def test_tool_choice_auto_on_a_template_that_ignores_tools_is_a_400(smollm2):
    client = openai_client(smollm2)
    with pytest.raises(openai.BadRequestError) as auto:
        client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=40)
    assert "ignores tools" in auto.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_calls_whose_arguments_follow_the_schema(smollm2, stream):
    client = openai_client(smollm2)
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=1.0, seed=11)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        return
    with client.chat.completions.stream(**kwargs) as assembled:
        final = assembled.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_calls_that_tool(smollm2, stream):
    client = openai_client(smollm2)
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=12,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        with client.chat.completions.stream(**kwargs) as assembled:
            calls = assembled.get_final_completion().choices[0].message.tool_calls
    else:
        calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"]
    assert_valid_calls(calls)


@pytest.mark.parametrize("response_format,schema", [
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, PERSON),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_eight_samples_at_temperature_one_are_valid_json(smollm2, response_format, schema):
    response = openai_client(smollm2).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": 'Give a person as a JSON object with the keys "name" '
                                                                 'and "age".'}],
        response_format=response_format, n=8, temperature=1.0, max_tokens=256, seed=5)
    assert len(response.choices) == 8
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert schema_errors(json.loads(choice.message.content), schema) == []


def test_a_stream_with_n_and_a_stop_string_keeps_the_grammar(smollm2):
    stream = openai_client(smollm2).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a person as JSON."}], stream=True, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=1.0, max_tokens=256, seed=6, stop=["\n\n"])
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts.values():
        assert schema_errors(json.loads(text), PERSON) == []


def test_the_responses_api_forces_a_function_call_and_takes_its_output_back(smollm2):
    client = openai_client(smollm2)
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    first = client.responses.create(model="smollm2", input="Weather in Paris?", tools=tools, tool_choice="required",
                                    max_output_tokens=200, temperature=1.0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(schema_errors(json.loads(c.arguments), SCHEMAS[c.name]) == [] for c in calls)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C, sunny"} for c in calls]
    # no tools this turn: SmolLM2's template ignores them, so only a forced call may name them
    second = client.responses.create(model="smollm2", input=outputs, previous_response_id=first.id,
                                     max_output_tokens=40)
    assert second.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_choice_any_is_a_tool_use_block(smollm2, stream):
    client = anthropic_client(smollm2)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    # one call: SmolLM2, never trained on tool calls, repeats a call it may repeat until max_tokens
    kwargs = dict(model="smollm2", max_tokens=200, messages=ASK, tools=tools,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    assert all(schema_errors(use.input, SCHEMAS[use.name]) == [] for use in uses)


def _num_tokens(server, text: str) -> int:
    return httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                      timeout=60).json()["count"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_stops_at_its_budget_then_the_model_answers(thinker, stream):
    client = anthropic_client(thinker)
    kwargs = dict(model="thinker", max_tokens=80, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                  thinking={"type": "enabled", "budget_tokens": 16})
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    thinking, text = message.content[0], message.content[-1]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert _num_tokens(thinker, thinking.thinking) <= 16 + 2  # the block's padding newlines decode into it
    assert text.type == "text" and text.text


def test_reasoning_effort_and_a_grammar_after_the_block(thinker):
    response = openai_client(thinker).chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "Give a person as JSON."}], max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"thinking_token_budget": 24})
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert schema_errors(json.loads(message.content), PERSON) == []

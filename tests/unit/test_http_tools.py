"""Tool calls and reasoning on /v1/chat/completions, through the real openai SDK, on scripted output.

The scripted engine "writes" exactly what a model of each family writes (its markup rendered
by the family's own template), so the parsing, the OpenAI shapes and the SDK's own assembly
of streamed tool calls are tested with no model in the loop. Forced calls and structured
output are checked up to the engine boundary here (the request's constraint); that a grammar
really constrains sampling is tests/e2e/test_constrained_generation.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import openai
import pytest
from helpers.chat_templates import TOOL_TEMPLATES
from helpers.model_folders import with_chat_template
from helpers.scripted_engine import serving

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.chat_features import chat_features
from atlas.ports.grammar import Choice, ForcedToolCalls, FunctionTool, Grammar, JsonObject, JsonSchema, Regex

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                            "parameters": WEATHER_SCHEMA}}]
ARGUMENTS = {"city": "Paris", "days": 2}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_MESSAGE = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]}
END_OF_TURN = ("<|im_end|>\n", "<|eot_id|>", "</s>", "<|im_end|>")  # the last: the tiny model's eos
MARKUP = ("<tool_call", "</tool_call", "<function=", "[TOOL_CALLS]", '"name"', "<think>", "</think>")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@dataclasses.dataclass
class Model:
    tokenizer: HfTokenizer
    features: object


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory) -> dict[str, Model]:
    """The tiny model under each family's template (Qwen3's with single-token <think> tags),
    and under its own ChatML template, which ignores tools."""
    result = {}
    for family, template in {**TOOL_TEMPLATES, "plain": None}.items():
        folder = tiny if template is None else with_chat_template(
            tiny, tmp_path_factory.mktemp(family) / "model", template, think_tags=family == "qwen3")
        tokenizer = HfTokenizer.from_folder(folder)
        features = chat_features(tokenizer, folder, tokenizer.vocab_size)
        result[family] = Model(tokenizer, features)
    return result


def rendered_call(tokenizer: HfTokenizer) -> str:
    """What the family's template writes for an assistant tool call: what its models write."""
    prefix = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tools=TOOLS)
    full = tokenizer.apply_chat_template([*USER, CALL_MESSAGE], add_generation_prompt=False, tools=TOOLS)
    turn = full[len(prefix):]
    for marker in END_OF_TURN:
        turn = turn.removesuffix(marker)
    return turn


def prompt_of(engine, tokenizer: HfTokenizer, index: int = 0) -> str:
    return tokenizer.decode(engine.submitted[index].prompt_token_ids, skip_special_tokens=False)


PARSED_FAMILIES = ["hermes", "qwen3_coder", "llama3_json", "mistral"]


@pytest.mark.anyio
@pytest.mark.parametrize("family", PARSED_FAMILIES)
async def test_auto_tool_calls_are_parsed_for_every_parser(models, family):
    model = models[family]
    async with serving(model.tokenizer, model.features, rendered_call(model.tokenizer)) as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == ARGUMENTS


@pytest.mark.anyio
@pytest.mark.parametrize("family", PARSED_FAMILIES)
async def test_streamed_tool_calls_send_id_and_name_once_then_the_arguments_in_pieces(models, family):
    model = models[family]
    async with serving(model.tokenizer, model.features, rendered_call(model.tokenizer)) as served:
        client = served.openai
        stream = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
        async with client.chat.completions.stream(model="tiny", messages=USER, tools=TOOLS) as assembled:
            final = await assembled.get_final_completion()
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == ARGUMENTS
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert not any(marker in content for marker in MARKUP), content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    [call] = final.choices[0].message.tool_calls  # the SDK assembles the pieces into one call
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS


@pytest.mark.anyio
async def test_text_before_a_call_is_content_and_the_markup_never_is(models):
    model = models["hermes"]
    script = "Let me check that.\n" + rendered_call(model.tokenizer).lstrip("\n")
    async with serving(model.tokenizer, model.features, script) as served:
        client = served.openai
        message = (await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)).choices[0].message
        stream = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True)
        content = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert message.content == content == "Let me check that."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


@pytest.mark.anyio
async def test_a_call_written_while_thinking_is_not_a_call(models):
    model = models["qwen3"]
    script = f"<think>\nMaybe I should write{rendered_call(model.tokenizer)}\n</think>\n\nIt is sunny in Paris."
    async with serving(model.tokenizer, model.features, script) as served:
        client = served.openai
        response = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
        stream = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
    message = response.choices[0].message
    assert message.tool_calls is None and response.choices[0].finish_reason == "stop"
    assert message.content == "It is sunny in Paris."
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] and "<tool_call>" in extra["reasoning_content"]
    assert extra["reasoning_content"].startswith("Maybe I should write")
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert streamed == extra["reasoning_content"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is sunny in Paris."
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


@pytest.mark.anyio
async def test_unparsable_markup_comes_back_as_content(models):
    model = models["hermes"]
    script = "<tool_call>\nnot a call at all\n</tool_call>"
    async with serving(model.tokenizer, model.features, script) as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
    assert response.choices[0].message.content == script and response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.anyio
async def test_parallel_tool_calls_false_keeps_the_first_call(models):
    model = models["hermes"]
    second = rendered_call(model.tokenizer).replace("Paris", "Rome")
    async with serving(model.tokenizer, model.features, rendered_call(model.tokenizer) + second) as served:
        client = served.openai
        both = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
        first = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, parallel_tool_calls=False)
        stream = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True,
                                                      parallel_tool_calls=False)
        streamed = [call for chunk in [c async for c in stream] for call in chunk.choices[0].delta.tool_calls or []]
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    assert [json.loads(c.function.arguments)["city"] for c in first.choices[0].message.tool_calls] == ["Paris"]
    assert {d.index for d in streamed} == {0}


@pytest.mark.anyio
async def test_tool_choice_none_shows_no_tools_and_reads_no_calls(models):
    model = models["hermes"]
    script = rendered_call(model.tokenizer)
    async with serving(model.tokenizer, model.features, script) as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none")
    assert "get_weather" not in prompt_of(served.engine, model.tokenizer)
    assert response.choices[0].message.tool_calls is None and response.choices[0].message.content == script


@pytest.mark.anyio
async def test_assistant_tool_calls_and_tool_results_render_for_the_next_turn(models):
    model = models["hermes"]
    result = {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'}
    async with serving(model.tokenizer, model.features, "It is 21 degrees.") as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=[*USER, CALL_MESSAGE, result],
                                                           tools=TOOLS)
    prompt = prompt_of(served.engine, model.tokenizer)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert response.choices[0].message.content == "It is 21 degrees."


@pytest.mark.anyio
async def test_a_template_that_ignores_tools_is_a_400_unless_a_grammar_forces_the_call(models):
    model = models["plain"]
    assert not model.tokenizer.renders_tools and model.features.tool_call_parser is None
    forced_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    async with serving(model.tokenizer, model.features, forced_text) as served:
        client = served.openai
        with pytest.raises(openai.BadRequestError) as auto:
            await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
        required = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required")
        named = await client.chat.completions.create(
            model="tiny", messages=USER, tools=[*TOOLS, {"type": "function", "function": {"name": "now"}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2)
        with pytest.raises(openai.BadRequestError) as unknown:
            await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "ignores tools" in auto.value.body["message"] and auto.value.body["param"] == "tools"
    assert auto.value.body["code"] == "unsupported_feature"
    weather = FunctionTool("get_weather", WEATHER_SCHEMA, "Weather by city")
    assert served.engine.submitted[0].constraint.grammar == ForcedToolCalls("hermes", (weather,), parallel=True)
    assert served.engine.submitted[0].constraint.grammar_field == "tools"
    assert [r.constraint.grammar for r in served.engine.submitted[1:]] == [ForcedToolCalls("hermes", (weather,))] * 2
    for response in (required, named):
        assert response.choices[0].finish_reason == "tool_calls"
        assert json.loads(response.choices[0].message.tool_calls[0].function.arguments) == ARGUMENTS
    assert unknown.value.body["param"] == "tool_choice"


JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.anyio
@pytest.mark.parametrize("fields,spec,field", [
    ({"response_format": {"type": "json_object"}}, JsonObject(), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA,
                                                                 "strict": True}}},
     JsonSchema(JSON_SCHEMA, strict=True), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": JSON_SCHEMA}}, JsonSchema(JSON_SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(JSON_SCHEMA)}}, JsonSchema(JSON_SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, Regex("[0-9]{3}"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Choice(("yes", "no")), "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, Grammar('start: "a"+'), "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, JsonObject(), "structured_outputs.json_object"),
])
async def test_structured_output_fields_become_every_choices_constraint(models, fields, spec, field):
    model = models["plain"]
    async with serving(model.tokenizer, model.features, '{"name": "Ada"}') as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, n=2, extra_body=fields)
    assert [c.message.content for c in response.choices] == ['{"name": "Ada"}'] * 2
    constraints = [request.constraint for request in served.engine.submitted]
    assert len(constraints) == 2 and constraints[0] == constraints[1]
    assert constraints[0].grammar == spec and constraints[0].grammar_field == field
    assert constraints[0].thinking_budget is None and constraints[0].reasoning is None


@pytest.mark.anyio
@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", ""),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format",
     "send one"),
])
async def test_invalid_constraints_are_400s_naming_the_field(models, fields, param, words):
    model = models["plain"]
    async with serving(model.tokenizer, model.features, "{}") as served:
        with pytest.raises(openai.BadRequestError) as raised:
            await served.openai.chat.completions.create(model="tiny", messages=USER, extra_body=fields)
    assert raised.value.body["param"] == param and words in raised.value.body["message"]
    assert not served.engine.submitted


@pytest.mark.anyio
async def test_reasoning_is_split_from_the_answer_streamed_and_not(models):
    model = models["qwen3"]
    script = "<think>\nThe user asks about France.\n</think>\n\nParis."
    async with serving(model.tokenizer, model.features, script) as served:
        client = served.openai
        message = (await client.chat.completions.create(model="tiny", messages=USER)).choices[0].message
        stream = await client.chat.completions.create(model="tiny", messages=USER, stream=True)
        deltas = [chunk.choices[0].delta async for chunk in stream]
    assert message.content == "Paris." and message.model_extra["reasoning_content"] == "The user asks about France."
    assert message.model_extra["reasoning"] == "The user asks about France."
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user asks about France." and "".join(d.content or "" for d in deltas) == "Paris."
    for delta in deltas:
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")


@pytest.mark.anyio
async def test_enable_thinking_false_reaches_the_template_and_the_output_is_all_content(models):
    model = models["qwen3"]
    async with serving(model.tokenizer, model.features, "Paris.") as served:
        response = await served.openai.chat.completions.create(
            model="tiny", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_of(served.engine, model.tokenizer).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert response.choices[0].message.content == "Paris." and "reasoning_content" not in response.choices[0].message.model_extra


@pytest.mark.anyio
@pytest.mark.parametrize("fields,budget", [
    ({"thinking_token_budget": 64}, 64),
    ({"reasoning_effort": "low"}, 1024),
    ({"reasoning_effort": "none"}, 0),
    ({"thinking_token_budget": 5, "reasoning_effort": "high"}, 5),
])
async def test_thinking_budgets_reach_the_engine_with_the_reasoning_markers(models, fields, budget):
    model = models["qwen3"]
    think, end_think = model.tokenizer.token_id("<think>"), model.tokenizer.token_id("</think>")
    async with serving(model.tokenizer, model.features, "<think>\nHm.\n</think>\n\nParis.") as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, extra_body=fields)
    constraint = served.engine.submitted[0].constraint
    assert constraint.thinking_budget == budget and constraint.grammar is None
    assert (constraint.reasoning.start_token_id, constraint.reasoning.end_token_id) == (think, end_think)
    assert not constraint.starts_in_reasoning  # Qwen3's prompt opens no block: the model does
    assert response.choices[0].message.content == "Paris."


@pytest.mark.anyio
async def test_a_budget_on_a_model_that_does_not_reason_changes_nothing(models):
    model = models["plain"]
    async with serving(model.tokenizer, model.features, "Paris.") as served:
        response = await served.openai.chat.completions.create(model="tiny", messages=USER, reasoning_effort="high")
    assert served.engine.submitted[0].constraint is None and response.choices[0].message.content == "Paris."


@pytest.mark.anyio
async def test_a_grammar_on_a_reasoning_model_starts_after_the_block_unless_thinking_is_off(models):
    model = models["qwen3"]
    async with serving(model.tokenizer, model.features, "{}") as served:
        client = served.openai
        await client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"})
        await client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                         "thinking_token_budget": 8})
    thinking, not_thinking = (request.constraint for request in served.engine.submitted)
    assert thinking.grammar == JsonObject() and thinking.reasoning is not None and thinking.thinking_budget is None
    assert not_thinking.reasoning is None and not_thinking.thinking_budget is None

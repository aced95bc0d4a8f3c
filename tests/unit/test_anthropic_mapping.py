"""Anthropic Messages <-> the internal chat turn, as plain functions: messages, tools, thinking,
output blocks and stop reasons."""

from __future__ import annotations

import random

import msgspec
import pytest

from atlas.adapters.http.anthropic_mapping import (
    anthropic_turn,
    content_blocks,
    requested_sampling,
    stop_reason,
    tool_input,
)
from atlas.adapters.http.anthropic_schemas import MessagesRequest, TextOut, ThinkingOut, ToolUseOut
from atlas.adapters.http.chat_choices import ChatChoices
from atlas.adapters.http.chat_turn import OutputReading, ToolChoice
from atlas.adapters.http.choices import ChoiceUpdate
from atlas.adapters.http.errors import ApiError
from atlas.domain.text.reasoning import reasoning_tags
from atlas.ports.grammar import FunctionTool, JsonSchema

USER = {"role": "user", "content": "Weather?"}
TOOL = {"name": "get_weather", "input_schema": {"type": "object"}, "description": "Weather"}


def request(**fields) -> MessagesRequest:
    return msgspec.convert({"max_tokens": 10, "messages": [USER], **fields}, MessagesRequest)


def test_system_blocks_become_one_system_message_and_user_text_blocks_join():
    turn = anthropic_turn(request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use metric units."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                               {"type": "text", "text": "In Paris."}]}]))
    assert turn.messages == [{"role": "system", "content": "Be brief.\nUse metric units."},
                             {"role": "user", "content": "Weather?\nIn Paris."}]


def test_tool_results_come_before_the_users_text_and_assistant_blocks_map_to_one_message():
    turn = anthropic_turn(request(messages=[
        USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "25"},
                                                                          {"type": "text", "text": "C"}],
             "is_error": False},
            {"type": "text", "text": "Which is warmer?"}]}]))
    assistant, first, second, user = turn.messages[1:]
    assert assistant == {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    assert first == {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"}
    assert second == {"role": "tool", "tool_call_id": "toolu_2", "content": "25\nC"}
    assert user == {"role": "user", "content": "Which is warmer?"}


@pytest.mark.parametrize("blocks,field,words", [
    ([{"type": "image", "source": {}}], "messages[0].content[0]", "image blocks are not supported"),
    ([{"type": "text", "text": "x"}, {"type": "document", "source": {}}], "messages[0].content[1]", "document"),
    ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "messages[0].content[0]", "cannot appear"),
])
def test_blocks_a_text_model_cannot_take_are_400s_naming_the_block(blocks, field, words):
    with pytest.raises(ApiError) as raised:
        anthropic_turn(request(messages=[{"role": "user", "content": blocks}]))
    assert raised.value.detail.param == field and words in raised.value.detail.message


@pytest.mark.parametrize("messages,field", [
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([USER, {"role": "assistant", "content": []}, USER], "messages[1].content"),
])
def test_an_empty_message_is_a_400_naming_it(messages, field):
    with pytest.raises(ApiError) as raised:
        anthropic_turn(request(messages=messages))
    assert raised.value.detail.param == field and "is empty" in raised.value.detail.message


def test_a_final_assistant_message_may_be_empty_or_start_the_reply():
    for prefill in ("", [], "The answer is"):
        turn = anthropic_turn(request(messages=[USER, {"role": "assistant", "content": prefill}]))
        assert turn.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize("choice,mode,named,parallel", [
    (None, ToolChoice.AUTO, None, True),
    ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice.AUTO, None, False),
    ({"type": "any"}, ToolChoice.REQUIRED, None, True),
    ({"type": "tool", "name": "get_weather"}, ToolChoice.NAMED, "get_weather", True),
    ({"type": "none"}, ToolChoice.NONE, None, True),
])
def test_tool_choices_map_to_the_internal_modes(choice, mode, named, parallel):
    fields = {"tools": [TOOL]} | ({"tool_choice": choice} if choice else {})
    tools = anthropic_turn(request(**fields)).tools
    assert (tools.choice, tools.named, tools.parallel) == (mode, named, parallel)
    assert tools.tools == (FunctionTool("get_weather", {"type": "object"}, "Weather"),)


def test_thinking_enabled_is_a_budget_and_enable_thinking_disabled_turns_it_off():
    enabled = anthropic_turn(request(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert enabled.thinking_budget.tokens == 2048 and enabled.thinking_budget.field == "thinking.budget_tokens"
    assert enabled.template_kwargs == {"enable_thinking": True}
    disabled = anthropic_turn(request(thinking={"type": "disabled"}))
    assert disabled.thinking_budget is None and disabled.template_kwargs == {"enable_thinking": False}
    assert anthropic_turn(request()).template_kwargs == {}
    adaptive = anthropic_turn(request(thinking={"type": "adaptive", "display": "summarized"}))
    assert adaptive.thinking_budget is None and adaptive.template_kwargs == {"enable_thinking": True}


def test_a_thinking_budget_must_leave_room_below_max_tokens():
    below = requested_sampling(request(max_tokens=11, thinking={"type": "enabled", "budget_tokens": 10}))
    assert below.max_tokens == 11
    for budget in (10, 500):
        with pytest.raises(ApiError) as error:
            requested_sampling(request(max_tokens=10, thinking={"type": "enabled", "budget_tokens": budget}))
        assert error.value.detail.param == "thinking.budget_tokens" and "max_tokens (10)" in str(error.value)


def test_output_config_gives_an_effort_budget_and_a_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    turn = anthropic_turn(request(output_config={"effort": "medium", "format": {"type": "json_schema",
                                                                                 "schema": schema}}))
    assert (turn.thinking_budget.tokens, turn.thinking_budget.field) == (4096, "output_config.effort")
    assert turn.structured.spec == JsonSchema(schema) and turn.structured.field == "output_config.format.schema"
    assert anthropic_turn(request(output_config={"effort": "max"})).thinking_budget is None
    both = anthropic_turn(request(output_config={"effort": "low"}, thinking={"type": "enabled", "budget_tokens": 50}))
    assert both.thinking_budget.tokens == 50


def finished(text: str, finish: str = "stop", stop: str | int | None = None, tools=True) -> ChatChoices:
    reading = OutputReading(reasoning_tags("qwen3"), False, "hermes" if tools else None,
                            (FunctionTool("get_weather"),))
    choices = ChatChoices(1, reading, random.Random(0))
    choices.apply(ChoiceUpdate(0, text, 5, (), finish, stop))
    return choices


def test_output_blocks_are_thinking_then_text_then_tool_uses():
    choices = finished('<think>\nHm.\n</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris"}}\n</tool_call>')
    thinking, text, use = content_blocks(choices, 0)
    assert isinstance(thinking, ThinkingOut) and thinking.thinking == "Hm." and len(thinking.signature) == 64
    assert text == TextOut("Sure.")
    assert isinstance(use, ToolUseOut) and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    assert stop_reason(choices, 0) == ("tool_use", None)


def test_a_call_cut_off_before_its_arguments_close_is_text_not_a_broken_tool_use():
    choices = finished('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', finish="length")
    assert content_blocks(choices, 0) == [TextOut('{"city": "Par')]
    assert stop_reason(choices, 0) == ("max_tokens", None)
    assert tool_input('{"a": 1}') == {"a": 1} and tool_input("[1]") is None and tool_input("") == {}


def test_stop_reasons():
    assert stop_reason(finished("Hi."), 0) == ("end_turn", None)
    assert stop_reason(finished("Hi.", stop="END"), 0) == ("stop_sequence", "END")
    assert stop_reason(finished("Hi.", finish="abort"), 0) == ("end_turn", None)
    assert content_blocks(finished(""), 0) == [TextOut("")]

"""Responses API items <-> chat messages, and the bounded response store, as plain functions."""

from __future__ import annotations

import random

import msgspec
import pytest

from atlas.adapters.http.chat_choices import ChatChoices
from atlas.adapters.http.chat_turn import OutputReading, ToolChoice
from atlas.adapters.http.choices import ChoiceUpdate
from atlas.adapters.http.errors import ApiError
from atlas.adapters.http.response_store import ResponseStore, StoredResponse
from atlas.adapters.http.responses_api_schemas import ResponsesRequest
from atlas.adapters.http.responses_items import input_messages, output_message, responses_turn
from atlas.domain.text.reasoning import reasoning_tags
from atlas.ports.grammar import FunctionTool, JsonObject


def items(*values) -> list:
    return msgspec.convert({"input": list(values)}, ResponsesRequest).input


def test_a_string_is_one_user_message_and_developer_is_system():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert input_messages(items({"role": "developer", "content": "Be brief."},
                                {"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]})) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_calls_join_the_assistant_message_they_follow_and_reasoning_the_next_one():
    messages = input_messages(items(
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call", "call_id": "c3", "name": "g", "arguments": "{}"},
    ))
    assert messages[1] == {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
                           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                                          {"id": "c2", "type": "function",
                                           "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert messages[2:4] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                             {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert messages[4] == {"role": "assistant", "content": "",
                           "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}


def test_instructions_come_first_then_the_conversation_and_the_turns_options():
    request = msgspec.convert({"input": "Hi", "instructions": "Be brief.", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
        "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}}}, ResponsesRequest)
    turn = responses_turn(request, [{"role": "user", "content": "Hi"}])
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (turn.tools.choice, turn.tools.parallel, turn.tools.tools) == (
        ToolChoice.REQUIRED, False, (FunctionTool("f", {"type": "object"}),))
    assert turn.structured.spec == JsonObject() and turn.messages_field == "input"


@pytest.mark.parametrize("value,param", [
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[0].name"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0]"),
])
def test_items_a_text_model_cannot_take_are_400s_naming_the_item(value, param):
    with pytest.raises(ApiError) as raised:
        input_messages(items(value))
    assert raised.value.detail.param == param


def test_the_output_continues_the_conversation_as_one_assistant_message():
    choices = ChatChoices(1, OutputReading(reasoning_tags("qwen3"), False, "hermes", (FunctionTool("f"),)),
                          random.Random(0))
    choices.apply(ChoiceUpdate(0, '<think>\nHm.\n</think>\n\nOK.\n<tool_call>\n{"name": "f", "arguments": {}}\n'
                                  '</tool_call>', 9, (), "stop", None))
    [call] = choices.tool_calls(0)
    assert output_message(choices, 0) == {"role": "assistant", "content": "OK.", "reasoning_content": "Hm.",
                                          "tool_calls": [{"id": call.id, "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]}


def stored(size: int) -> StoredResponse:
    return StoredResponse(b"x" * size, ())


def test_the_store_drops_the_least_recently_used_by_entries_and_by_bytes():
    store = ResponseStore(max_entries=3, max_bytes=1000)
    for name in ("a", "b", "c"):
        assert store.put(name, stored(100))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("d", stored(100))
    assert store.get("b") is None and [store.get(n) is not None for n in ("a", "c", "d")] == [True] * 3
    store.put("e", stored(800))  # 300 + 802 bytes > 1000: the least recently used go until it fits
    assert len(store) == 2 and store.get("e") is not None and store.num_bytes <= 1000
    assert not store.put("huge", stored(5000)) and store.get("huge") is None
    assert store.delete("e") and not store.delete("e")
    assert store.num_bytes == sum(s.num_bytes for s in (store.get(n) for n in ("a", "c", "d")) if s is not None)


def test_a_store_of_size_zero_keeps_nothing():
    store = ResponseStore(0, 1000)
    assert not store.enabled and not store.put("a", stored(1)) and len(store) == 0

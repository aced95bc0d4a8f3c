"""Tool-call parsers on scripted model outputs: every chunking gives the non-streamed parse.

Each case is text a model of that family writes (markup as its chat template renders it) and
the content and calls it must parse into. Each is streamed split at every point and one
character at a time; the deltas must follow OpenAI's shape (id and name once, in the first
delta of a call, then argument pieces) and concatenate to `parse_tool_calls` of the whole text.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from atlas.domain.text.tool_calls import create_tool_call_parser, detect_tool_call_parser, parse_tool_calls
from atlas.ports.grammar import FunctionTool

WEATHER = FunctionTool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city"],
    },
)
RUN = FunctionTool(
    "run_python",
    {"type": "object", "properties": {"code": {"type": "string"}, "options": {"type": "object"}}},
)
TOOLS = (WEATHER, RUN)


@dataclass(frozen=True)
class Case:
    name: str
    parser: str
    text: str
    content: str
    calls: tuple[tuple[str, dict | str], ...]  # (name, arguments as a dict, or the raw text when broken)


def _hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


CASES = [
    # --- hermes (Qwen2.5 / Qwen3 / Hermes) ---
    Case("one call", "hermes", _hermes('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'),
         "", (("get_weather", {"city": "Paris", "days": 3}),)),
    Case("parallel calls after text", "hermes",
         "I'll check both cities.\n\n"
         + _hermes('{"name": "get_weather", "arguments": {"city": "Paris"}}') + "\n"
         + _hermes('{"name": "get_weather", "arguments": {"city": "Rome"}}'),
         "I'll check both cities.", (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}))),
    Case("text after the call", "hermes",
         _hermes('{"name": "get_weather", "arguments": {"city": "Oslo"}}') + "\n\nLet me know if you need more.",
         "Let me know if you need more.", (("get_weather", {"city": "Oslo"}),)),
    Case("braces, quotes and tags inside strings", "hermes",
         _hermes('{"name": "run_python", "arguments": {"code": "print(\\"}\\")\\n# </tool_call> {", '
                 '"options": {"timeout": [1, {"x": 2}]}}}'),
         "", (("run_python", {"code": 'print("}")\n# </tool_call> {', "options": {"timeout": [1, {"x": 2}]}}),)),
    Case("unicode arguments", "hermes", _hermes('{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧"}}'),
         "", (("get_weather", {"city": "Zürich 東京 🌧"}),)),
    Case("arguments before name", "hermes", _hermes('{"arguments": {"city": "Lima"}, "name": "get_weather"}'),
         "", (("get_weather", {"city": "Lima"}),)),
    Case("arguments as a JSON string", "hermes",
         _hermes('{"name": "get_weather", "arguments": "{\\"city\\": \\"Kyiv\\"}"}'),
         "", (("get_weather", {"city": "Kyiv"}),)),
    Case("a doubled closing brace", "hermes", _hermes('{"name": "get_weather", "arguments": {"city": "Baku"}}}'),
         "", (("get_weather", {"city": "Baku"}),)),
    Case("two objects in one block", "hermes",
         _hermes('{"name": "get_weather", "arguments": {"city": "A"}}\n{"name": "get_weather", "arguments": {}}'),
         "", (("get_weather", {"city": "A"}), ("get_weather", {}))),
    Case("plain answer", "hermes", "The weather is sunny.\n  ", "The weather is sunny.\n  ", ()),
    Case("the tag named in prose", "hermes", "Wrap calls in a <tool_call> tag.", "Wrap calls in a <tool_call> tag.",
         ()),
    Case("unquoted name is content", "hermes",
         "Calling:\n" + _hermes('{"name": get_weather, "arguments": {}}'),
         "Calling:\n" + _hermes('{"name": get_weather, "arguments": {}}'), ()),
    Case("single quotes are content", "hermes", _hermes("{'name': 'get_weather', 'arguments': {}}"),
         _hermes("{'name': 'get_weather', 'arguments': {}}"), ()),
    Case("an unclosed header is content", "hermes", '<tool_call>\n{"name": "get_wea',
         '<tool_call>\n{"name": "get_wea', ()),
    Case("cut off in the arguments", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         "", (("get_weather", '{"city": "Par'),)),
    # --- qwen3_coder ---
    Case("xml call with typed parameters", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>",
         "", (("get_weather", {"city": "New York", "days": 3, "metric": True}),)),
    Case("xml multi-line string and object", "qwen3_coder",
         "Running it.\n<tool_call>\n<function=run_python>\n<parameter=code>\nfor i in range(3):\n    print(\"<\", i)\n\n"
         "</parameter>\n<parameter=options>\n{\"timeout\": 5}\n</parameter>\n</function>\n</tool_call>",
         "Running it.", (("run_python", {"code": 'for i in range(3):\n    print("<", i)\n', "options": {"timeout": 5}}),)),
    Case("xml parallel calls, no parameters, unknown tool", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=list_files>\n<parameter=path>\n42\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=now>\n</function>\n</tool_call>",
         "", (("get_weather", {"city": "Rome"}), ("list_files", {"path": "42"}), ("now", {}))),
    Case("xml without the wrapper", "qwen3_coder",
         "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
         "", (("get_weather", {"city": "Paris"}),)),
    Case("xml unconvertible integer stays text", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
         "", (("get_weather", {"days": "three"}),)),
    Case("xml block without a function is content", "qwen3_coder", "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
         "<tool_call>\nget_weather(city=Paris)\n</tool_call>", ()),
    # --- llama3_json ---
    Case("llama call", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
         "", (("get_weather", {"city": "Paris"}),)),
    Case("llama python tag and two calls", "llama3_json",
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_weather", "parameters": {"city": "Lyon", "days": 2}}',
         "", (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "days": 2}))),
    Case("llama plain answer", "llama3_json", "It is 21 degrees in Paris.", "It is 21 degrees in Paris.", ()),
    Case("llama JSON answer that is no call", "llama3_json", '{"name": "John", "age": 30}',
         '{"name": "John", "age": 30}', ()),
    Case("llama malformed", "llama3_json", '{"name": "get_weather", parameters: {}}',
         '{"name": "get_weather", parameters: {}}', ()),
    # --- mistral ---
    Case("mistral v3 list", "mistral",
         '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_weather", "arguments": {"city": "Nice"}}]',
         "", (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice"}))),
    Case("mistral v11 names", "mistral",
         'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]run_python[CALL_ID]a1b2c3d4e'
         '[ARGS]{"code": "1+1"}',
         "Sure.", (("get_weather", {"city": "Paris"}), ("run_python", {"code": "1+1"}))),
    Case("mistral plain answer", "mistral", "No tools needed [really].", "No tools needed [really].", ()),
    Case("mistral bad name is content", "mistral", "[TOOL_CALLS]get weather[ARGS]{}",
         "[TOOL_CALLS]get weather[ARGS]{}", ()),
]



def _stream(case: Case, chunks: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call from the deltas, checking their OpenAI shape."""
    parser = create_tool_call_parser(case.parser, TOOLS, random.Random(0))
    content = ""
    calls: list[list[str]] = []
    deltas = [parser.push(chunk) for chunk in chunks] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            if call.index == len(calls):
                assert call.id is not None and call.name is not None, "a call's first delta names it"
                calls.append([call.id, call.name, call.arguments])
            else:
                assert call.index == len(calls) - 1, "calls arrive in order"
                assert call.id is None and call.name is None, "id and name are sent once"
                calls[-1][2] += call.arguments
    return content, [tuple(call) for call in calls]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}: {case.name}")
def test_the_whole_output_parses_into_the_expected_content_and_calls(case: Case) -> None:
    result = parse_tool_calls(case.parser, case.text, TOOLS, random.Random(0))
    assert result.content == case.content
    assert [call.name for call in result.tool_calls] == [name for name, _ in case.calls]
    for call, (_, arguments) in zip(result.tool_calls, case.calls):
        if isinstance(arguments, dict):
            assert json.loads(call.arguments) == arguments
        else:
            assert call.arguments == arguments


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}: {case.name}")
def test_every_split_and_one_char_chunks_give_the_non_streamed_parse(case: Case) -> None:
    result = parse_tool_calls(case.parser, case.text, TOOLS, random.Random(0))
    expected = (result.content, [(call.id, call.name, call.arguments) for call in result.tool_calls])
    for split_idx in range(len(case.text) + 1):
        assert _stream(case, [case.text[:split_idx], case.text[split_idx:]]) == expected, split_idx
    assert _stream(case, list(case.text)) == expected


def test_arguments_stream_in_pieces_before_the_call_closes() -> None:
    parser = create_tool_call_parser("hermes", TOOLS, random.Random(0))
    first = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == ""
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "get_weather", '{"city": "Pa')]
    assert first.tool_calls[0].id.startswith("call_") and len(first.tool_calls[0].id) == 29
    second = parser.push('ris"}}\n</tool_call>')
    assert [(d.index, d.id, d.arguments) for d in second.tool_calls] == [(0, None, 'ris"}')]


def test_content_is_released_while_a_marker_prefix_is_held() -> None:
    parser = create_tool_call_parser("hermes", TOOLS, random.Random(0))
    assert parser.push("Checking <tool").content == "Checking"
    assert parser.push("box now.").content == " <toolbox now."


def test_mistral_ids_are_nine_characters_and_others_are_openai_style() -> None:
    mistral = parse_tool_calls("mistral", '[TOOL_CALLS]f[ARGS]{}', TOOLS, random.Random(1))
    assert len(mistral.tool_calls[0].id) == 9 and mistral.tool_calls[0].id.isalnum()
    hermes = parse_tool_calls("hermes", _hermes('{"name": "f", "arguments": {}}'), TOOLS, random.Random(1))
    assert hermes.tool_calls[0].id.startswith("call_")


def test_unknown_parser_names_the_flag_and_choices() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser.*hermes, qwen3_coder, llama3_json, mistral"):
        parse_tool_calls("xml", "", TOOLS, random.Random(0))


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}{{ '\\n</tool_call>' }}", "hermes"),
        ("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>", "qwen3_coder"),
        ("[TOOL_CALLS] {{ calls | tojson }}", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_the_parser_is_detected_from_the_template(template: str, parser: str | None) -> None:
    assert detect_tool_call_parser(template) == parser

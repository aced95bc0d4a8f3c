"""Tools through chat templates: definitions reach the prompt, assistant tool calls render in
the family's markup (arguments as an object, not a quoted string), and the parser detected from
the same template reads that markup back into the same calls."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers
from helpers.chat_templates import TOOL_TEMPLATES

from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.domain.text.reasoning import detect_reasoning_parser, output_starts_in_reasoning, reasoning_tags
from atlas.domain.text.tool_calls import detect_tool_call_parser, parse_tool_calls
from atlas.ports.grammar import FunctionTool

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                            "parameters": WEATHER_SCHEMA}}]
USER = {"role": "user", "content": "Weather in Paris?"}
ARGUMENTS = {"city": "Paris", "days": 2}
ASSISTANT = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}},
]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'}
END_OF_TURN = ("<|im_end|>\n", "<|eot_id|>", "</s>")
EXPECTED_PARSER = {"hermes": "hermes", "qwen3": "hermes", "qwen3_coder": "qwen3_coder", "llama3_json": "llama3_json",
                   "mistral": "mistral"}


def _tokenizer(template: str) -> HfTokenizer:
    return HfTokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), {"bos_token": "<s>", "eos_token": "</s>"},
                       {"default": template})


@pytest.mark.parametrize("family", TOOL_TEMPLATES)
def test_a_rendered_tool_call_parses_back_into_the_same_call(family: str) -> None:
    template = TOOL_TEMPLATES[family]
    tokenizer = _tokenizer(template)
    prefix = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tools=TOOLS)
    full = tokenizer.apply_chat_template([USER, ASSISTANT], add_generation_prompt=False, tools=TOOLS)
    assert full.startswith(prefix)
    turn = full[len(prefix):]
    for marker in END_OF_TURN:
        turn = turn.removesuffix(marker)
    parser = detect_tool_call_parser(template)
    assert parser == EXPECTED_PARSER[family]
    tools = [FunctionTool("get_weather", WEATHER_SCHEMA)]
    result = parse_tool_calls(parser, turn, tools, random.Random(0))
    assert result.content == ""
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize("family", TOOL_TEMPLATES)
def test_tool_definitions_and_results_reach_the_prompt(family: str) -> None:
    tokenizer = _tokenizer(TOOL_TEMPLATES[family])
    prompt = tokenizer.apply_chat_template([USER, ASSISTANT, TOOL_RESULT], tools=TOOLS)
    assert "Weather by city" in prompt and '{"temp": 21}' in prompt
    assert '\\"city\\"' not in prompt, "arguments must render as an object, not a JSON string"
    assert tokenizer.renders_tools


def test_a_template_that_ignores_tools_says_so() -> None:
    tokenizer = _tokenizer(SMOLLM2)
    assert not tokenizer.renders_tools
    assert detect_tool_call_parser(SMOLLM2) is None and detect_reasoning_parser(SMOLLM2) is None


def test_arguments_that_are_not_a_json_object_pass_unchanged() -> None:
    tokenizer = _tokenizer(TOOL_TEMPLATES["hermes"])
    broken = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}
    assert '"arguments": "not json"' in tokenizer.apply_chat_template([USER, broken], tools=TOOLS)
    assert broken["tool_calls"][0]["function"]["arguments"] == "not json", "the caller's message is not modified"


def test_qwen3_thinking_switch_and_detection() -> None:
    template = TOOL_TEMPLATES["qwen3"]
    tokenizer = _tokenizer(template)
    assert detect_reasoning_parser(template) == "qwen3"
    tags = reasoning_tags("qwen3")
    thinking = tokenizer.apply_chat_template([USER])
    not_thinking = tokenizer.apply_chat_template([USER], enable_thinking=False)
    assert not_thinking.endswith("<think>\n\n</think>\n\n")
    assert not output_starts_in_reasoning(tags, thinking) and not output_starts_in_reasoning(tags, not_thinking)

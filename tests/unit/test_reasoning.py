"""The reasoning split on Qwen3- and DeepSeek-R1-style outputs, streamed at every split point,
and composed with the tool-call parser (a call drafted while thinking is not a call)."""

from __future__ import annotations

import random

import pytest

from atlas.domain.text.chat_output import ChatOutputParser
from atlas.domain.text.reasoning import (
    ReasoningSplitter,
    detect_reasoning_parser,
    output_starts_in_reasoning,
    reasoning_tags,
    split_reasoning,
)
from atlas.domain.text.tool_calls import create_tool_call_parser

QWEN3 = reasoning_tags("qwen3")
R1 = reasoning_tags("deepseek_r1")

CASES = [
    # (name, tags, starts in reasoning, text, reasoning, content)
    ("qwen3 opens the block itself", QWEN3, False,
     "<think>\nThe user greets me.\n\nI should reply.\n</think>\n\nHello!", "The user greets me.\n\nI should reply.",
     "Hello!"),
    ("template opened the block", QWEN3, True, "\nLet me think.\n</think>\n\nParis.", "Let me think.", "Paris."),
    ("thinking switched off", QWEN3, False, "Paris is the capital.\n", "", "Paris is the capital.\n"),
    ("a later <think> is content", QWEN3, False, "Tags like <think> appear.", "", "Tags like <think> appear."),
    ("leading whitespace before the block", QWEN3, False, "\n\n<think>x</think>y", "x", "y"),
    ("never closed", R1, True, "Step 1.\nStep 2.\n", "Step 1.\nStep 2.", ""),
    ("never closed, partial end tag", R1, True, "Step 1.\n</thi", "Step 1.\n</thi", ""),
    ("r1 writes no opening tag", R1, True, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    ("r1 writes the opening tag anyway", R1, True, "<think>\nHmm.\n</think>\n4", "Hmm.", "4"),
    ("empty block", QWEN3, False, "<think>\n\n</think>\n\nHi", "", "Hi"),
    ("content keeps inner newlines", QWEN3, True, "a</think>\n\nline 1\n\nline 2\n", "a", "line 1\n\nline 2\n"),
]


def _stream(tags, starts, chunks):
    splitter = ReasoningSplitter(tags, starts)
    deltas = [splitter.push(chunk) for chunk in chunks] + [splitter.flush()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_the_split_is_the_same_however_the_text_is_chunked(case) -> None:
    _, tags, starts, text, reasoning, content = case
    assert split_reasoning(tags, text, starts) == (reasoning, content)
    for split_idx in range(len(text) + 1):
        assert _stream(tags, starts, [text[:split_idx], text[split_idx:]]) == (reasoning, content), split_idx
    assert _stream(tags, starts, list(text)) == (reasoning, content)


def test_no_half_tag_is_emitted() -> None:
    splitter = ReasoningSplitter(QWEN3, starts_in_reasoning=True)
    assert splitter.push("I think</th").reasoning == "I think"
    delta = splitter.push("ink>The answer")
    assert (delta.reasoning, delta.content) == ("", "The answer")
    assert not splitter.in_reasoning


@pytest.mark.parametrize(
    ("prompt", "enable_thinking", "tags", "expected"),
    [
        ("<|im_start|>assistant\n", True, QWEN3, False),  # Qwen3: the model opens the block
        ("<|im_start|>assistant\n<think>\n", True, QWEN3, True),  # Qwen3 thinking-2507 template
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True, QWEN3, False),  # enable_thinking=False rendered
        ("<｜Assistant｜>", True, R1, True),  # R1 output is reasoning until </think>
        ("<｜Assistant｜><think>\n", False, R1, False),
        ("<think>old</think> <｜Assistant｜></think>", True, R1, False),  # DeepSeek V3.1 non-thinking
    ],
)
def test_where_the_output_starts(prompt, enable_thinking, tags, expected) -> None:
    assert output_starts_in_reasoning(tags, prompt, enable_thinking) is expected


def test_detection_from_the_template() -> None:
    assert detect_reasoning_parser("{{ '<think>\\n' }}{{ reasoning }}{{ '</think>' }}") == "qwen3"
    assert detect_reasoning_parser("<｜Assistant｜>{{ '<think>\\n' }}...</think>") == "deepseek_r1"
    assert detect_reasoning_parser("{{ messages }}") is None


def test_unknown_parser_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser.*qwen3, deepseek_r1"):
        reasoning_tags("o1")


def test_a_call_written_while_thinking_is_not_a_call() -> None:
    text = (
        '<think>\nMaybe <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>? No.\n</think>\n\n'
        'Searching.\n<tool_call>\n{"name": "search", "arguments": {"q": "y"}}\n</tool_call>'
    )
    for split_idx in range(len(text) + 1):
        parser = ChatOutputParser(
            ReasoningSplitter(QWEN3, starts_in_reasoning=False),
            create_tool_call_parser("hermes", (), random.Random(0)),
        )
        deltas = [parser.push(text[:split_idx]), parser.push(text[split_idx:]), parser.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls]
        assert reasoning == 'Maybe <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>? No.'
        assert content == "Searching."
        assert calls[0].name == "search" and "".join(c.arguments for c in calls) == '{"q": "y"}'

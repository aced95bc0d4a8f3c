"""Splitting a reasoning model's `<think>...</think>` block from its answer, as text streams in.

Reasoning models write their chain of thought inside a tagged block before the answer:

    <think>\\nThe user wants ...\\n</think>\\n\\nParis is the capital.
            '---- reasoning ---'              '----- content -----'

The block may already be open when generation starts: DeepSeek-R1's template and Qwen3's
"thinking" templates end the prompt with `<think>\\n`, so the output begins inside it. With
`enable_thinking=False` Qwen3's template writes an empty closed block into the prompt and the
output is all content. `ReasoningSplitter` takes where the output starts (`output_starts_in_reasoning`
decides it from the rendered prompt) and splits streamed text incrementally:

- a tag split across chunks ("</th" + "ink>") is held back, never emitted half;
- the newlines that pad the block are dropped (those after `<think>` and before `</think>`,
  and those between `</think>` and the answer), as the templates strip them when they render
  `reasoning_content` back; so the concatenated deltas equal `split_reasoning` of the whole text;
- a model that repeats the `<think>` its template already wrote has it dropped;
- only a block at the very start of the output (after whitespace) is reasoning; a `<think>`
  later in the answer is content;
- a block never closed (max_tokens, budget) leaves everything in reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    """The markup of one reasoning format and where its output starts by default."""

    name: str
    start: str
    end: str
    # DeepSeek-R1 models may omit the opening tag their template already wrote, so their output
    # is reasoning until `</think>` even when the prompt shows no open block; Qwen3 only thinks
    # inside a block it opened (or its template opened).
    starts_in_reasoning_by_default: bool


_TAGS = {
    "qwen3": ReasoningTags("qwen3", "<think>", "</think>", starts_in_reasoning_by_default=False),
    "deepseek_r1": ReasoningTags("deepseek_r1", "<think>", "</think>", starts_in_reasoning_by_default=True),
}


def reasoning_tags(parser: str) -> ReasoningTags:
    """The tags of `--reasoning-parser` `parser`; raises ValueError naming the choices."""
    try:
        return _TAGS[parser]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser: unknown parser {parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
        ) from None


def detect_reasoning_parser(chat_template: str) -> str | None:
    """The reasoning parser a chat template implies, or None when it writes no `<think>` block.

    DeepSeek's templates are told apart by their full-width role markers (`<｜Assistant｜>`).
    """
    if "<think>" not in chat_template or "</think>" not in chat_template:
        return None
    if "<｜Assistant｜>" in chat_template:
        return "deepseek_r1"
    return "qwen3"


def output_starts_in_reasoning(tags: ReasoningTags, prompt: str, enable_thinking: bool = True) -> bool:
    """Whether generation after `prompt` begins inside the reasoning block.

    True when the prompt's last tag is an open `<think>` (the template opened the block); False
    when the prompt ends with a closed block (thinking switched off) or `enable_thinking` is
    False; else the format's default.
    """
    if not enable_thinking:
        return False
    last_start = prompt.rfind(tags.start)
    last_end = prompt.rfind(tags.end)
    if last_start > last_end:
        return True
    if last_end >= 0 and prompt.rstrip().endswith(tags.end):
        return False
    return tags.starts_in_reasoning_by_default


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one chunk adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


class _Phase(Enum):
    BEFORE_OUTPUT = "before_output"  # nothing but whitespace seen: a `<think>` may still open a block
    REASONING = "reasoning"
    CONTENT = "content"

    @property
    def is_reasoning(self) -> bool:
        return self is _Phase.REASONING


class ReasoningSplitter:
    """Splits one sequence's streamed text into reasoning and content (see the module doc)."""

    __slots__ = ("_tags", "_phase", "_held", "_at_block_start", "_after_block")

    def __init__(self, tags: ReasoningTags, starts_in_reasoning: bool) -> None:
        self._tags = tags
        self._phase = _Phase.REASONING if starts_in_reasoning else _Phase.BEFORE_OUTPUT
        self._held = ""  # text not yet attributed: a partial tag, or padding newlines
        self._at_block_start = starts_in_reasoning  # drop the newlines right after `<think>`
        self._after_block = False  # drop the whitespace between `</think>` and the answer

    @property
    def in_reasoning(self) -> bool:
        """True while text goes to the reasoning (the block is open)."""
        return self._phase.is_reasoning

    def push(self, text: str) -> ReasoningDelta:
        """Feed the next chunk; return what is certain now."""
        buffer = self._held + text
        self._held = ""
        reasoning_parts: list[str] = []
        content_parts: list[str] = []
        while buffer:
            if self._phase is _Phase.BEFORE_OUTPUT:
                buffer = self._before_output(buffer)
            elif self._phase is _Phase.REASONING:
                buffer = self._reasoning(buffer, reasoning_parts)
            else:
                if self._after_block:
                    buffer = buffer.lstrip()
                    if not buffer:
                        break
                    self._after_block = False
                content_parts.append(buffer)
                buffer = ""
        return ReasoningDelta("".join(reasoning_parts), "".join(content_parts))

    def flush(self) -> ReasoningDelta:
        """At the end of the text: release what was held (a partial tag is text after all)."""
        held, self._held = self._held, ""
        if not held:
            return ReasoningDelta()
        if self._phase is _Phase.REASONING:
            # Newlines alone are the padding of a block the model never closed.
            return ReasoningDelta(reasoning=held if held.strip("\n") else "")
        return ReasoningDelta(content=held)

    def _before_output(self, buffer: str) -> str:
        stripped = buffer.lstrip()
        if not stripped:
            self._held = buffer
            return ""
        if stripped.startswith(self._tags.start):
            self._phase = _Phase.REASONING
            self._at_block_start = True
            return stripped[len(self._tags.start) :]
        if self._tags.start.startswith(stripped):
            self._held = buffer  # maybe the opening tag, split across chunks
            return ""
        self._phase = _Phase.CONTENT
        return buffer

    def _reasoning(self, buffer: str, parts: list[str]) -> str:
        if self._at_block_start:
            buffer = buffer.lstrip("\n")
            if buffer.startswith(self._tags.start):  # the model repeats the tag its template wrote
                buffer = buffer[len(self._tags.start) :].lstrip("\n")
            if self._tags.start.startswith(buffer):
                self._held = buffer  # empty, or maybe that tag, split across chunks
                return ""
            self._at_block_start = False
        end_idx = buffer.find(self._tags.end)
        if end_idx >= 0:
            parts.append(buffer[:end_idx].rstrip("\n"))
            self._phase = _Phase.CONTENT
            self._after_block = True
            return buffer[end_idx + len(self._tags.end) :]
        # Hold a tail that may be the start of `</think>`, and newlines that may pad it.
        num_held = _partial_tag_length(buffer, self._tags.end)
        body = buffer[: len(buffer) - num_held]
        num_newlines = len(body) - len(body.rstrip("\n"))
        keep = len(body) - num_newlines
        parts.append(buffer[:keep])
        self._held = buffer[keep:]
        return ""


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(tags: ReasoningTags, text: str, starts_in_reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole output: what the streamed deltas concatenate to."""
    splitter = ReasoningSplitter(tags, starts_in_reasoning)
    first = splitter.push(text)
    last = splitter.flush()
    return first.reasoning + last.reasoning, first.content + last.content

"""One assistant turn, whichever API asked for it: tools, structured output, reasoning, prompt.

The chat APIs (OpenAI chat completions, Anthropic messages, OpenAI responses) map their bodies
to a `ChatTurn`; `prepare_turn` checks it against the served model's `ChatFeatures`, renders
the chat template, tokenizes, and validates the constraint once (a bad schema is a 400 naming
the client's field). The result says what to submit (`PreparedTurn.constraint`, which every
sequence of the request carries to the engine) and how to read the output back
(`OutputReading`: the reasoning split, then the tool-call parser on the answer).

    tool_choice    template gets tools   output parsed for calls   grammar
    none           no                    no                        -
    auto           yes (400 if ignored)  the model's parser        -
    required       yes                   the forced markup         one or more calls (any tool)
    named          yes                   the forced markup         one call of that tool
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from atlas.adapters.http.engine_client import ChatFeatures, ServedModel
from atlas.adapters.http.errors import bad_request, excerpt
from atlas.adapters.http.params import check_prompt_fits
from atlas.adapters.http.prompts import render_messages, tokenize
from atlas.domain.requests import OutputConstraint, SamplingParams
from atlas.domain.text.chat_output import ChatOutputParser
from atlas.domain.text.reasoning import ReasoningSplitter, ReasoningTags, output_starts_in_reasoning
from atlas.domain.text.tool_calls import create_tool_call_parser, tool_call_parser_class
from atlas.ports.grammar import ConstraintSpec, ForcedToolCalls, FunctionTool, GrammarError

UNSUPPORTED = "unsupported_feature"  # the error code of a 400 for what this server cannot do


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"  # one or more calls, any of the tools
    NAMED = "named"  # one call of the named tool

    @property
    def is_forced(self) -> bool:
        return self in (ToolChoice.REQUIRED, ToolChoice.NAMED)


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    """The request's tools and what it asks of them; `field` and `choice_field` are the
    client's names for them (for 400s)."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    named: str | None = None  # with ToolChoice.NAMED
    parallel: bool = True
    field: str = "tools"
    choice_field: str = "tool_choice"

    @property
    def definitions(self) -> list[dict[str, Any]]:
        """The tools in OpenAI's form, as chat templates take them."""
        no_arguments = {"type": "object", "properties": {}}
        return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                  "parameters": tool.parameters or no_arguments}}
                for tool in self.tools]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the answer must follow, and the client's field it came from."""

    spec: ConstraintSpec
    field: str


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    tokens: int
    field: str


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """What to generate: template-ready messages and what the request asks beyond text."""

    messages: list[dict[str, Any]]
    tools: ToolsRequest | None = None
    structured: StructuredOutput | None = None
    thinking_budget: ThinkingBudget | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    messages_field: str = "messages"

    @property
    def enable_thinking(self) -> bool:
        return self.template_kwargs.get("enable_thinking") is not False


@dataclass(frozen=True, slots=True)
class OutputReading:
    """How one choice's text is read back: the reasoning split, then tool calls in the answer."""

    reasoning: ReasoningTags | None = None
    starts_in_reasoning: bool = False
    tool_call_parser: str | None = None
    tools: tuple[FunctionTool, ...] = ()
    parallel_tool_calls: bool = True

    def parser(self, rng: random.Random) -> ChatOutputParser | None:
        """A fresh parser for one choice (`rng` draws its call ids), or None for plain text."""
        if self.reasoning is None and self.tool_call_parser is None:
            return None
        splitter = ReasoningSplitter(self.reasoning, self.starts_in_reasoning) if self.reasoning else None
        calls = create_tool_call_parser(self.tool_call_parser, self.tools, rng) if self.tool_call_parser else None
        return ChatOutputParser(splitter, calls)


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    prompt_ids: list[int]
    constraint: OutputConstraint | None
    reading: OutputReading

    def sampling(self, params: SamplingParams, min_tokens_field: str = "min_tokens") -> SamplingParams:
        """`params` as this turn needs them: special tokens kept when the tool-call markup is
        made of them (mistral's [TOOL_CALLS]). 400 for min_tokens with a grammar (it would
        forbid the end of sequence where the grammar allows nothing else)."""
        if self.constraint is not None and self.constraint.grammar is not None and params.min_tokens:
            raise bad_request(min_tokens_field, f"{min_tokens_field} cannot be combined with structured output "
                                                f"or a forced tool call")
        parser = self.reading.tool_call_parser
        if parser is not None and tool_call_parser_class(parser).needs_special_tokens and params.skip_special_tokens:
            return msgspec.structs.replace(params, skip_special_tokens=False)
        return params


async def prepare_turn(model: ServedModel, turn: ChatTurn) -> PreparedTurn:
    """Check `turn` against the model, render and tokenize its prompt, validate its constraint.

    Raises ApiError(400) naming the client's field: tools the template cannot show, a parser
    the model lacks, an invalid schema, a constraint this server cannot apply, a prompt that
    leaves no room.
    """
    features = model.chat
    tools = turn.tools
    parser, template_tools = _tool_parsing(model, tools)
    spec = _grammar(features, turn.structured, tools)
    if spec is not None:
        await _validate(features, spec)
    prompt = await render_messages(model.tokenizer, turn.messages, template_tools, turn.add_generation_prompt,
                                   turn.template_kwargs, turn.messages_field)
    prompt_ids = await tokenize(model.tokenizer, prompt, add_special_tokens=False)
    if not prompt_ids:
        raise bad_request(turn.messages_field, "the rendered prompt is empty")
    check_prompt_fits(len(prompt_ids), model.max_model_len, turn.messages_field)
    tags = features.reasoning
    starts_in_reasoning = tags is not None and output_starts_in_reasoning(tags, prompt, turn.enable_thinking)
    constraint = _constraint(features, turn, spec, starts_in_reasoning)
    reading = OutputReading(
        reasoning=tags,
        starts_in_reasoning=starts_in_reasoning,
        tool_call_parser=parser,
        tools=tools.tools if tools is not None else (),
        parallel_tool_calls=tools.parallel if tools is not None else True,
    )
    return PreparedTurn(prompt_ids, constraint, reading)


def _constraint(features: ChatFeatures, turn: ChatTurn, spec: StructuredOutput | None,
                starts_in_reasoning: bool) -> OutputConstraint | None:
    """What the engine must enforce: the grammar (after the reasoning block, when the model
    may open one) and the thinking budget; None when neither applies."""
    budget = _budget(features, turn.thinking_budget) if turn.enable_thinking else None
    if spec is None and budget is None:
        return None
    markers = features.reasoning_markers if features.reasoning is not None and turn.enable_thinking else None
    if spec is not None and starts_in_reasoning and markers is None:
        raise bad_request(spec.field, "this model's reasoning tags are not single tokens, so a grammar cannot start "
                                      "after its reasoning block; send chat_template_kwargs.enable_thinking false",
                          code=UNSUPPORTED)
    return OutputConstraint(
        grammar=spec.spec if spec is not None else None,
        grammar_field=spec.field if spec is not None else "",
        reasoning=markers,  # with thinking off the grammar starts at the first token: no block may open
        starts_in_reasoning=starts_in_reasoning and markers is not None,
        thinking_budget=budget,
    )


async def count_prompt_tokens(model: ServedModel, turn: ChatTurn) -> int:
    """The prompt's token count as `prepare_turn` would render it (nothing else is checked)."""
    tools = turn.tools
    template_tools = tools.definitions if tools is not None and tools.choice is not ToolChoice.NONE else None
    prompt = await render_messages(model.tokenizer, turn.messages, template_tools, turn.add_generation_prompt,
                                   turn.template_kwargs, turn.messages_field)
    return len(await tokenize(model.tokenizer, prompt, add_special_tokens=False))


def _tool_parsing(model: ServedModel, tools: ToolsRequest | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(the parser that reads calls, the tool definitions the template gets); 400s naming the
    field for a named tool that is not among the tools, a template that ignores tools, or no parser."""
    if tools is None or not tools.tools:
        if tools is not None and tools.choice.is_forced:
            raise bad_request(tools.choice_field, f"{tools.choice_field} forces a tool call but the request has no "
                                                  f"{tools.field}")
        return None, None
    if tools.choice is ToolChoice.NONE:
        return None, None  # the model is not shown tools it may not call
    names = [tool.name for tool in tools.tools]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise bad_request(tools.field, f"{tools.field} has two tools named {excerpt(duplicate)}")
    features = model.chat
    if tools.choice is ToolChoice.NAMED and tools.named not in names:
        raise bad_request(tools.choice_field, f"{tools.choice_field} names the tool {excerpt(tools.named)}, which "
                                              f"is not in {tools.field}")
    if tools.choice.is_forced:
        markup = features.forced_tool_markup
        if markup is None:
            raise bad_request(tools.choice_field, "forcing a tool call needs a tool-call parser; this server runs "
                                                  "with --tool-call-parser none", code=UNSUPPORTED)
        return markup, tools.definitions
    if not model.tokenizer.renders_tools:
        raise bad_request(tools.field, f"this model's chat template ignores {tools.field}, so the model would not "
                                       f"see them; force a call ({tools.choice_field} 'required' or a named tool: "
                                       f"a grammar writes it) or serve a model whose template renders tools",
                          code=UNSUPPORTED)
    if features.tool_calls_off:
        return None, tools.definitions  # the operator turned parsing off: calls come back as text
    if features.tool_call_parser is None:
        raise bad_request(tools.field, "this model's chat template writes no tool-call markup Atlas knows; start "
                                       "the server with --tool-call-parser (hermes, qwen3_coder, llama3_json, "
                                       "mistral)", code=UNSUPPORTED)
    return features.tool_call_parser, tools.definitions


def _grammar(features: ChatFeatures, structured: StructuredOutput | None,
             tools: ToolsRequest | None) -> StructuredOutput | None:
    if tools is None or not tools.tools or not tools.choice.is_forced:
        return structured
    if structured is not None:
        raise bad_request(structured.field, f"{structured.field} and a forced tool call both constrain the output; "
                                            f"send one of them")
    chosen = tools.tools
    if tools.choice is ToolChoice.NAMED:
        chosen = tuple(tool for tool in tools.tools if tool.name == tools.named)
    parallel = tools.parallel and tools.choice is ToolChoice.REQUIRED
    markup = features.forced_tool_markup
    assert markup is not None  # checked by _tool_parsing
    return StructuredOutput(ForcedToolCalls(markup, chosen, parallel), tools.field)


async def _validate(features: ChatFeatures, structured: StructuredOutput) -> None:
    compiler = features.grammar
    if compiler is None:
        raise bad_request(structured.field, "structured output is unavailable for this model: its tokenizer could "
                                            "not be loaded into the grammar engine", code=UNSUPPORTED)
    try:
        await anyio.to_thread.run_sync(compiler.compile, structured.spec, structured.field)
    except GrammarError as error:
        raise bad_request(error.field, f"{error.field}: {_cut(str(error).split(': ', 1)[-1])}") from None


def _budget(features: ChatFeatures, budget: ThinkingBudget | None) -> int | None:
    """The budget to keep, or None: a model that does not reason has no block to cap."""
    if budget is None or features.reasoning is None:
        return None
    if features.reasoning_markers is None:
        raise bad_request(budget.field, "this model's reasoning tags are not single tokens, so a thinking budget "
                                        "cannot be kept", code=UNSUPPORTED)
    return budget.tokens


def _cut(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


"""How long a model may think: reasoning markers in token ids, and budgets from each API.

A thinking budget caps the tokens inside the `<think>` block. At the budget the engine writes
the end of the block itself (the text the template writes there, "\\n</think>\\n\\n" for Qwen3
and DeepSeek-R1) and the model goes on to answer. The budget comes from one of:

    thinking_token_budget (Atlas, vLLM-style)    the number, >= 0
    Anthropic thinking.budget_tokens             the number (Anthropic asks >= 1024)
    OpenAI reasoning_effort                      none 0, minimal 256, low 1024, medium 4096,
                                                 high 16384 tokens

The effort levels follow the ratios OpenAI's o-series show in practice (each level about 4x
the one below); "none" skips thinking altogether. No field: no budget (the model decides).
"""

from __future__ import annotations

from atlas.domain.requests import ParameterError, ReasoningMarkers
from atlas.ports.tokenizer import Tokenizer

REASONING_EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def reasoning_markers(
    tokenizer: Tokenizer, start_tag: str = "<think>", end_tag: str = "</think>", forced_end: str = "\n</think>\n\n"
) -> ReasoningMarkers | None:
    """The markers of a model whose tags are single tokens, else None (no budget can be kept)."""
    start_ids = tokenizer.encode(start_tag, add_special_tokens=False)
    end_ids = tokenizer.encode(end_tag, add_special_tokens=False)
    if len(start_ids) != 1 or len(end_ids) != 1:
        return None
    forced = tuple(tokenizer.encode(forced_end, add_special_tokens=False))
    if end_ids[0] not in forced:
        return None
    return ReasoningMarkers(start_ids[0], end_ids[0], forced)


def thinking_budget_tokens(
    thinking_token_budget: int | None = None,
    anthropic_budget_tokens: int | None = None,
    reasoning_effort: str | None = None,
) -> int | None:
    """The budget a request asks for (the first field given, in the order above), or None.

    Raises ParameterError naming the field for a negative number or an unknown effort.
    """
    for field, value in (("thinking_token_budget", thinking_token_budget),
                         ("thinking.budget_tokens", anthropic_budget_tokens)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ParameterError(field, f"must be a non-negative integer (got {value!r})")
        return value
    if reasoning_effort is None:
        return None
    if reasoning_effort not in REASONING_EFFORT_BUDGETS:
        raise ParameterError(
            "reasoning_effort", f"unknown effort {reasoning_effort!r}; use one of {', '.join(REASONING_EFFORT_BUDGETS)}"
        )
    return REASONING_EFFORT_BUDGETS[reasoning_effort]

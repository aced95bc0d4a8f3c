"""Prompts from requests: chat messages through the template, completion prompts, token ids.

Long texts are tokenized in a worker thread so one big prompt does not stall every other
stream on the event loop; short ones (the common case) are cheaper to do inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.schemas import ChatMessage
from atlas.ports.tokenizer import ChatTemplateError, Tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")
TEXT_PART_TYPES = ("text", "input_text")
_INLINE_TOKENIZE_CHARS = 16_384
_MAX_PROMPTS = 256


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content flattened to text, `developer` as
    `system`. 400 naming the message for an empty list, an unknown role or non-text content."""
    if not messages:
        raise bad_request("messages", "messages must contain at least one message")
    result = []
    for idx, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{idx}].role", f"unknown role {message.role!r}; use one of {', '.join(ROLES)}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_idx, part in enumerate(content):
                if part.type not in TEXT_PART_TYPES or part.text is None:
                    raise bad_request(
                        f"messages[{idx}].content[{part_idx}]",
                        f"content part type {part.type!r} is not supported; this model takes text only",
                    )
                texts.append(part.text)
            content = "".join(texts)
        if content is None and not message.tool_calls:
            raise bad_request(f"messages[{idx}].content", "a message needs content (or tool_calls)")
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        result.append(item)
    return result


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text; 400 naming `messages` when the template rejects the conversation."""
    try:
        return tokenizer.apply_chat_template(
            message_dicts(messages), add_generation_prompt=add_generation_prompt, tools=tools,
            **(template_kwargs or {}),
        )
    except ChatTemplateError as error:
        raise bad_request("messages", str(error)) from None
    except TypeError as error:  # a chat_template_kwargs key that collides with a template argument
        raise bad_request("chat_template_kwargs", f"chat_template_kwargs cannot be applied: {error}") from None
    except RecursionError:
        raise bad_request("messages", "the messages or tools are nested too deeply to render") from None


async def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await anyio.to_thread.run_sync(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(param, f"token id {token_id} is outside the vocabulary (ids are 0..{vocab_size - 1})")


async def completion_prompts(
    tokenizer: Tokenizer, prompt: str | list[Any], add_special_tokens: bool, vocab_size: int
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, from a string, a list of strings, a list of token
    ids or a list of such lists; 400 naming `prompt` for anything else."""
    if isinstance(prompt, str):
        return [(prompt, await tokenize(tokenizer, prompt, add_special_tokens))]
    if not prompt:
        raise bad_request("prompt", "prompt must not be empty")
    if len(prompt) > _MAX_PROMPTS and not all(_is_token_id(item) for item in prompt):
        raise bad_request("prompt", f"at most {_MAX_PROMPTS} prompts per request (got {len(prompt)})")
    if all(_is_token_id(item) for item in prompt):
        check_token_ids(prompt, vocab_size, "prompt")
        return [(None, list(prompt))]
    if all(isinstance(item, str) for item in prompt):
        return [(text, await tokenize(tokenizer, text, add_special_tokens)) for text in prompt]
    if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in prompt):
        for ids in prompt:
            check_token_ids(ids, vocab_size, "prompt")
        return [(None, list(ids)) for ids in prompt]
    raise bad_request(
        "prompt", "prompt must be a string, a list of strings, a list of token ids or a list of non-empty "
                  "token id lists",
    )


def _is_token_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)

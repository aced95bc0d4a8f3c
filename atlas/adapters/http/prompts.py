"""Prompts from requests: chat messages through the template, completion prompts, token ids.

Long texts are tokenized, and long conversations rendered, in a worker thread so one big
prompt does not stall every other stream on the event loop; short ones (the common case) are
cheaper to do inline. The thread encodes every text that is waiting at once through the
tokenizer's batch call (`Tokenizer.encode_batch`: the tokenizers library's parallel encode,
GIL released). One text at a time in threads would not help: its single-text encode holds the
GIL, so 64 threads run one after another and slow the loop besides (an H100 host spent 108 ms
p50 tokenizing a shared-prefix wave of 64 prompts of 2,080 words that way). Where the process
has cores to spare, texts of a few thousand characters go to the batch too, so a wave's
prompts tokenize side by side; on a 2-core machine the library's threads only compete with
the engine and the loop, so they stay inline there (docs/lab/serving-gpu.md).
"""
from __future__ import annotations

import asyncio
import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any

import anyio

from atlas.adapters.http.errors import bad_request, excerpt
from atlas.adapters.http.schemas import MAX_PROMPTS, ChatMessage
from atlas.ports.tokenizer import ChatTemplateError, Tokenizer

TEXT_PART_TYPES = ("text", "input_text")
# Template variables the server sets; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
_INLINE_TOKENIZE_CHARS = 16_384
_INLINE_TOKENIZE_CHARS_SPARE_CORES = 2_048  # ~0.3 ms of tokenizing: well above a thread hop's cost
_SPARE_CORES = 4  # the loop, the engine process, a client on the same host, and one more
_INLINE_RENDER_MESSAGES = 64


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content flattened to text, `developer` as
    `system`. 400 naming the message for non-text content (the schema checks roles and sizes)."""
    result = []
    for idx, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_idx, part in enumerate(content):
                where = f"messages[{idx}].content[{part_idx}]"
                if part.type not in TEXT_PART_TYPES:
                    raise bad_request(where, f"content part type {excerpt(part.type)} is not supported; this model "
                                             f"takes text only")
                if part.text is None:
                    raise bad_request(f"{where}.text", f"a {excerpt(part.type)} content part needs its text")
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
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning:
            item["reasoning_content"] = reasoning  # reasoning templates (Qwen3) may render it back
        result.append(item)
    return result


async def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text of OpenAI chat messages (see `render_messages`)."""
    return await render_messages(tokenizer, message_dicts(messages), tools, add_generation_prompt, template_kwargs)


async def render_messages(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    messages_field: str = "messages",
) -> str:
    """The prompt text of template-ready message dicts; 400 naming `messages_field` when the
    template rejects the conversation, or `chat_template_kwargs` for a key the server sets itself."""
    kwargs = template_kwargs or {}
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad_request("chat_template_kwargs", f"chat_template_kwargs cannot set '{key}': "
                                                      f"send it as the request's own field")

    def render() -> str:
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tools=list(tools) if tools else None, **kwargs)
        except ChatTemplateError as error:
            raise bad_request(messages_field, str(error)) from None
        except TypeError:  # a key that is one of the Python method's own parameters
            raise bad_request("chat_template_kwargs", "chat_template_kwargs has a key the chat template "
                                                      "cannot take as a variable") from None
        except RecursionError:
            raise bad_request(messages_field, "the messages or tools are nested too deeply to render") from None

    num_chars = sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages)
    if len(messages) <= _INLINE_RENDER_MESSAGES and num_chars <= _INLINE_TOKENIZE_CHARS and not tools:
        return render()
    return await anyio.to_thread.run_sync(render)


@functools.cache
def _inline_tokenize_chars() -> int:
    """The longest text tokenized on the event loop itself."""
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return _INLINE_TOKENIZE_CHARS_SPARE_CORES if num_cores >= _SPARE_CORES else _INLINE_TOKENIZE_CHARS


async def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _inline_tokenize_chars():
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    encoder = _batch_encoders.get(tokenizer)
    if encoder is None:
        encoder = _batch_encoders[tokenizer] = BatchEncoder(tokenizer)
    return await encoder.encode(text, add_special_tokens)


class BatchEncoder:
    """Texts to tokenize off the event loop, encoded together: each `encode` joins the texts
    waiting, and one worker thread at a time runs `encode_batch` over all of them (grouped
    by `add_special_tokens`). A lone text costs one thread hop; a wave arriving together is
    encoded in parallel. A failing batch fails each of its texts' `encode` with the error."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._waiting: list[tuple[str, bool, asyncio.Future[list[int]]]] = []
        self._draining = False

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._waiting.append((text, add_special_tokens, future))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                for flag in (True, False):
                    group = [(text, future) for text, add_special, future in batch if add_special is flag]
                    if group:
                        await self._encode_group(group, flag)
        finally:
            self._draining = False

    async def _encode_group(self, group: list[tuple[str, asyncio.Future[list[int]]]], add_special_tokens: bool) -> None:
        texts = [text for text, _ in group]
        try:
            ids = await anyio.to_thread.run_sync(lambda: self._tokenizer.encode_batch(texts, add_special_tokens))
        except Exception as error:  # every waiting request hears of it; the next batch starts clean
            for _, future in group:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), token_ids in zip(group, ids):
            if not future.done():  # its request may have been cancelled meanwhile
                future.set_result(token_ids)


_batch_encoders: weakref.WeakKeyDictionary[Tokenizer, BatchEncoder] = weakref.WeakKeyDictionary()


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 naming `param` for an id outside the vocabulary (min/max first: one pass in C)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise bad_request(param, f"token id {excerpt(bad)} is outside the vocabulary (ids are 0..{vocab_size - 1})")


async def completion_prompts(
    tokenizer: Tokenizer, prompt: str | list[Any], add_special_tokens: bool, vocab_size: int
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, from a string, a list of strings, a list of token
    ids or a list of such lists; 400 naming `prompt` for anything else."""
    if isinstance(prompt, str):
        return [(prompt, await tokenize(tokenizer, prompt, add_special_tokens))]
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


def count_prompts(prompt: str | list[Any]) -> int:
    """How many prompts `prompt` holds, before anything is tokenized; 400 above MAX_PROMPTS."""
    if isinstance(prompt, str) or all(_is_token_id(item) for item in prompt):
        return 1
    if len(prompt) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request (got {len(prompt)})")
    return len(prompt)


def _is_token_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)

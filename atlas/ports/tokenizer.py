"""The tokenizer port: text <-> token ids and chat-template rendering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template rejected them)."""


class Tokenizer(Protocol):
    """A model's tokenizer and chat template.

    `decode` of a partial sequence may end in an incomplete UTF-8 character, shown as U+FFFD;
    `atlas.domain.text.IncrementalDetokenizer` holds such tails back when streaming.
    """

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (may be below the model's embedding rows)."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (from tokenizer_config and generation_config)."""
        ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in order; may run them in parallel and without the GIL (so a
        worker thread can call it while the event loop goes on)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_text(self, token_id: int) -> str:
        """The token's raw vocabulary string, as logprobs report it."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; raises ChatTemplateError saying why it cannot.

        `tools` are OpenAI tool definitions; assistant messages may carry OpenAI `tool_calls`
        (arguments as a JSON string) and `role: tool` messages the results.
        """
        ...

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template puts `tools` into the prompt (False: a tools request cannot
        be rendered faithfully unless a grammar forces the call)."""
        ...

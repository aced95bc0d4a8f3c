"""Streaming token ids to text without ever emitting half a character.

Byte-level BPE splits a multi-byte character across tokens ("日" = e6 97 a5 may arrive as
three tokens), SentencePiece decoders drop the leading space of the first token they see, and
skipped special tokens decode to nothing. Decoding each token alone gets all three wrong;
decoding the whole sequence every step costs O(length) per token. The detokenizer decodes a
short window instead and emits the difference:

    ids      ... c0 c1 r0 r1 | n0 n1        (c: context, r: read, n: new)
                 ^0           ^read_idx
    read_text = decode(ids[0:read_idx])     already emitted (after the context's text)
    full_text = decode(ids[0:])
    emit full_text[len(read_text):] unless it ends in U+FFFD (an unfinished character)

The tokens before the new ones give the decoder the context it needs (the leading space of
"▁world" after "Hello" survives because "Hello" is decoded with it). After an emission,
full_text is the next read_text, so a token costs one decode. Once the window holds
_SLIDE_AT tokens it slides: the tokens of the last emission become the context, older ones
are dropped, and their text is decoded once more. The window starts where an emission ended
(never inside a character: a byte-fallback run decoded from its middle would be all U+FFFD),
and its size, hence memory and the cost of each push, is bounded by the window, not by the
sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from atlas.ports.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded before the first output token, so the first one gets its context.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A character is at most 4 bytes, so a real unfinished one spans at most 4 byte tokens. A
# longer run ending in U+FFFD (bytes that can never form text) is released as replacement
# characters, which bounds the window when a model emits junk bytes.
_MAX_PENDING_TOKENS = 16
# The window slides once it holds this many tokens. Decoding costs a fixed ~0.5 us a call plus
# a little per token: a short window and an extra decode every few tokens cost least.
_SLIDE_AT = 6


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text chunks as they arrive.

    The concatenation of every `push` and the final `flush` equals
    `decode(prompt + output)[len(decode(prompt)):]` for a prompt that ends on a character
    boundary (any prompt encoded from text), and no chunk ends inside a character.
    """

    __slots__ = ("_tokenizer", "_skip_special_tokens", "_window_ids", "_read_idx", "_read_text")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._window_ids: list[int] = context_ids
        self._read_idx = len(context_ids)
        self._read_text = self._decode(context_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they make printable now (may be "").

        Text is held back while the decoded tail ends in U+FFFD (an unfinished character
        waiting for its next bytes).
        """
        if not token_ids:
            return ""  # nothing new: what is held back stays held back
        window = self._window_ids
        window.extend(token_ids)
        full_text = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
        if full_text.endswith(REPLACEMENT_CHAR) and len(window) - self._read_idx <= _MAX_PENDING_TOKENS:
            return ""
        return self._advance(full_text)

    def flush(self) -> str:
        """The text still held back, at the end of the sequence.

        A tail that never became a whole character comes out as U+FFFD, as `decode` gives it.
        """
        if self._read_idx == len(self._window_ids):
            return ""
        return self._advance(self._decode(self._window_ids))

    def _advance(self, full_text: str) -> str:
        new_text = full_text[len(self._read_text) :]
        window = self._window_ids
        if len(window) < _SLIDE_AT:
            self._read_text = full_text
        else:  # the tokens just read become the context; older ones are no longer needed
            del window[: self._read_idx]
            self._read_text = self._decode(window)
        self._read_idx = len(window)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

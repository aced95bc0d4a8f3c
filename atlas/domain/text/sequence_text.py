"""A sequence's text as the engine's outputs arrive: incremental detokenizing, then stop strings.

The engine deals in token ids only. `SequenceText` turns one sequence's outputs into text
deltas; text that may still become a stop string is held back. When a stop string completes,
the delta says so and the caller aborts the engine request.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from atlas.domain.batch import SequenceOutput, TokenLogprobs
from atlas.domain.requests import FinishReason, SamplingParams
from atlas.domain.text.detokenizer import IncrementalDetokenizer
from atlas.domain.text.stop_strings import StopStringMatcher
from atlas.ports.tokenizer import Tokenizer


class TextDelta(msgspec.Struct, frozen=True):
    """What one engine output adds to a sequence's text (a Struct: one per sequence per step)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    logprobs: tuple[TokenLogprobs, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    stopped_by_text: bool = False  # a stop string ended it: the caller must abort the engine request


class SequenceText:
    """Text state of one sequence: detokenizer, stop strings, what has been emitted."""

    __slots__ = ("_detokenizer", "_stops", "_params", "_finished", "_last_token_id", "_eos_ids")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._params = params
        self._finished = False
        self._last_token_id: int | None = None
        self._eos_ids = tokenizer.eos_token_ids

    @property
    def finished(self) -> bool:
        return self._finished

    def apply(self, output: SequenceOutput) -> TextDelta:
        """Turn an engine output into a text delta (empty once finished)."""
        if self._finished:
            return TextDelta("", (), None, None, (), output.num_prompt_tokens, output.num_output_tokens)
        token_ids = output.new_token_ids
        if output.finish_reason is None and self._stops is None:  # most steps: new tokens' text only
            if token_ids:
                self._last_token_id = token_ids[-1]
            return TextDelta(self._detokenizer.push(token_ids), token_ids, None, None, output.logprobs,
                             output.num_prompt_tokens, output.num_output_tokens)
        text_ids = token_ids
        if token_ids and output.finish_reason is FinishReason.STOP and token_ids[-1] in self._eos_ids:
            text_ids = token_ids[:-1]  # the end of sequence is never text (kept special tokens or not)
        finish_reason = output.finish_reason
        text, num_kept, stop = self._text(text_ids, finish_reason is not None)
        num_dropped = len(token_ids) - num_kept if num_kept is not None else 0
        token_ids = token_ids[: len(token_ids) - num_dropped]
        if token_ids:
            self._last_token_id = token_ids[-1]
        stop_reason: str | int | None = None
        stopped_by_text = False
        if stop is not None:
            stopped_by_text = finish_reason is None
            finish_reason, stop_reason = FinishReason.STOP, stop
        if stop_reason is None and finish_reason is FinishReason.STOP:
            last = self._last_token_id
            if last is not None and last not in self._eos_ids:
                stop_reason = last
        self._finished = finish_reason is not None
        return TextDelta(
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=output.logprobs[: len(token_ids)],
            num_prompt_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens - num_dropped,
            stopped_by_text=stopped_by_text,
        )

    def _text(self, token_ids: tuple[int, ...], is_last: bool) -> tuple[str, int | None, str | None]:
        """(text to emit, how many tokens to keep or None for all, the stop string that ended it).

        With stop strings, several tokens (a verify step's accepted drafts) go through one at a
        time: a stop the second of five completes keeps two, where plain decoding would have
        stopped. One completed by the final flush (text held back at the end) keeps them all."""
        stops = self._stops
        if stops is None:
            text = self._detokenizer.push(token_ids)
            return (text + self._detokenizer.flush() if is_last else text), None, None
        parts = []
        for num_pushed in range(1, len(token_ids) + 1):
            match = stops.push(self._detokenizer.push(token_ids[num_pushed - 1 : num_pushed]))
            parts.append(match.text)
            if match.is_stopped:
                return "".join(parts), num_pushed, match.stop
        if is_last:
            match = stops.push(self._detokenizer.flush())
            parts.append(match.text)
            if match.is_stopped:
                return "".join(parts), None, match.stop
            parts.append(stops.flush())
        return "".join(parts), None, None

    def abort(self) -> TextDelta:
        """Finish with ABORT (client gone, timeout), releasing nothing further."""
        self._finished = True
        return TextDelta("", (), FinishReason.ABORT, None, (), 0, 0)

"""Front-end work around the engine: fan-out of `n`, seeds, incremental text and stop strings.

The engine deals in token ids only. Each sequence's `SequenceText` turns its outputs into text
deltas: detokenize incrementally, then hold back text that may become a stop string. When a
stop string completes, the delta says so and the caller aborts the engine request.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from atlas.domain.batch import SequenceOutput, TokenLogprobs
from atlas.domain.requests import FinishReason, Request, SamplingParams
from atlas.domain.text.detokenizer import IncrementalDetokenizer
from atlas.domain.text.stop_strings import StopStringMatcher
from atlas.ports.tokenizer import Tokenizer

_SEED_STRIDE = 0x9E3779B97F4A7C15
_UINT64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one engine output adds to a sequence's text."""

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
        if output.new_token_ids:
            self._last_token_id = output.new_token_ids[-1]
        text = self._detokenizer.push(output.new_token_ids)
        finish_reason = output.finish_reason
        if finish_reason is not None:
            text += self._detokenizer.flush()
        stop_reason: str | int | None = None
        stopped_by_text = False
        if self._stops is not None:
            match = self._stops.push(text)
            text = match.text
            if match.is_stopped:
                stopped_by_text = finish_reason is None
                finish_reason, stop_reason = FinishReason.STOP, match.stop
            elif finish_reason is not None:
                text += self._stops.flush()
        if stop_reason is None and finish_reason is FinishReason.STOP:
            last = self._last_token_id
            if last is not None and last not in self._eos_ids:
                stop_reason = last
        self._finished = finish_reason is not None
        return TextDelta(
            text=text,
            token_ids=output.new_token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=output.logprobs,
            num_prompt_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens,
            stopped_by_text=stopped_by_text,
        )

    def abort(self) -> TextDelta:
        """Finish with ABORT (client gone, timeout), releasing nothing further."""
        self._finished = True
        return TextDelta("", (), FinishReason.ABORT, None, (), 0, 0)


class SeedSource:
    """Seeds for requests that bring none: fresh random ones, or a reproducible series."""

    def __init__(self, base_seed: int | None) -> None:
        self._counter = itertools.count() if base_seed is not None else None
        self._base = base_seed

    def next(self) -> int:
        if self._counter is None or self._base is None:
            return secrets.randbits(64)
        return (self._base + next(self._counter) * _SEED_STRIDE) & _UINT64


def fan_out(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    seeds: SeedSource,
    arrival_s: float = 0.0,
) -> list[Request]:
    """The engine requests for `params.n` choices: ids `request_id` (n=1) or `request_id-i`.

    Choice i of a seeded request uses seed + i * stride, so every choice differs and the whole
    response reproduces.
    """
    base_seed = params.seed if params.seed is not None else seeds.next()
    single = msgspec.structs.replace(params, n=1) if params.n != 1 else params
    prompt = tuple(prompt_token_ids)
    if params.n == 1:
        return [Request(request_id, prompt, single, base_seed & _UINT64, arrival_s)]
    return [
        Request(f"{request_id}-{index}", prompt, single, (base_seed + index * _SEED_STRIDE) & _UINT64, arrival_s)
        for index in range(params.n)
    ]

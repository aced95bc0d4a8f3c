"""Per-choice bookkeeping shared by the chat and completions endpoints.

`ChoiceResults` accumulates whole choices (from `Generation`'s `ChoiceUpdate`s) for
non-streamed answers and for `--dump`; `collect` runs a non-streamed request into one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

from atlas.adapters.http.generation import ChoiceUpdate, Generation
from atlas.domain.batch import TokenLogprobs


class ChoiceResults:
    """The full text, logprobs and finish of every choice of a request."""

    def __init__(self, num_choices: int, with_logprobs: bool) -> None:
        self._parts: list[list[str]] = [[] for _ in range(num_choices)]
        self.logprobs: list[list[TokenLogprobs]] | None = (
            [[] for _ in range(num_choices)] if with_logprobs else None
        )
        self.finish_reasons: list[str | None] = [None] * num_choices
        self.stop_reasons: list[str | int | None] = [None] * num_choices

    def add(self, update: ChoiceUpdate) -> None:
        if update.text:
            self._parts[update.index].append(update.text)
        if self.logprobs is not None and update.logprobs:
            self.logprobs[update.index].extend(update.logprobs)
        if update.finish_reason is not None:
            self.finish_reasons[update.index] = update.finish_reason
            self.stop_reasons[update.index] = update.stop_reason

    def text(self, index: int) -> str:
        parts = self._parts[index]
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @property
    def num_choices(self) -> int:
        return len(self._parts)


async def collect(
    generation: Generation, results: ChoiceResults, on_update: Callable[[ChoiceUpdate], object] | None = None
) -> None:
    """Run a non-streamed request to its end, folding every delta into `results` (and handing
    each update to `on_update`, which parses chat choices)."""
    async with aclosing(generation.batches()) as batches:
        async for batch in batches:
            for update in batch:
                results.add(update)
                if on_update is not None:
                    on_update(update)

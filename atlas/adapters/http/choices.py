"""Per-choice bookkeeping shared by the chat and completions endpoints.

`merge_batch` folds the deltas of one batch into one update per choice (a stream chunk each);
`ChoiceResults` accumulates whole choices for non-streamed answers and for `--dump`;
`collect` runs a non-streamed request into one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

from atlas.adapters.http.generation import ChoiceDelta, Generation
from atlas.domain.batch import TokenLogprobs


@dataclass(slots=True)
class ChoiceUpdate:
    """What one batch adds to one choice."""

    index: int
    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | int | None


def merge_batch(batch: list[ChoiceDelta]) -> list[ChoiceUpdate]:
    """One update per choice, in order of first appearance; a choice whose deltas carry
    nothing (no text, tokens or finish) is left out."""
    updates: dict[int, ChoiceUpdate] = {}
    for item in batch:
        delta = item.delta
        update = updates.get(item.index)
        finish = delta.finish_reason.value if delta.finish_reason is not None else None
        if update is None:
            updates[item.index] = ChoiceUpdate(
                item.index, delta.text, len(delta.token_ids), delta.logprobs, finish, delta.stop_reason
            )
            continue
        update.text += delta.text
        update.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            update.logprobs = update.logprobs + delta.logprobs
        if finish is not None:
            update.finish_reason, update.stop_reason = finish, delta.stop_reason
    return [u for u in updates.values() if u.text or u.num_tokens or u.finish_reason is not None]


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
            for update in merge_batch(batch):
                results.add(update)
                if on_update is not None:
                    on_update(update)

"""Draft-model proposals: a small model sharing the target's tokenizer drafts k tokens greedily.

The draft model runs on the target's backend, in the target's process, through a second
`Worker` (its own step buffers, workspace and decode graphs) over its own KV cache: its own
device caches and its own `BlockPool`, here. The proposer keeps, per sequence, the tokens whose
K/V that cache holds (positions 0 .. len - 1) and their blocks; it never shares a block with the
target's cache manager, so neither can leak into the other.

One round, for the sequences a step drafts for (n final tokens, the last not yet computed by
the target) and the ones still catching up:

    draft cache holds   t0 .. t(m-1)                       (m <= n; what matched last time)
    forward 0           t(m) .. t(n-1)   one chunk a sequence, greedy row at t(n-1) -> d0
    forward j (1..k-1)  d(j-1) at n-1+j  one decode row a sequence               -> dj
    draft cache holds   t0 .. t(n-1) d0 .. d(k-2)

After verification the final tokens are t0 .. t(n-1) d0 .. d(a-1) t' (a accepted): the next
round keeps the longest prefix of the cached tokens that is still final, n + min(a, k - 1),
frees the blocks past it, and feeds the 1 or 2 tokens that follow. Nothing needs to be told
how verification went: the comparison with the final tokens covers rejection, a stop that cut
the step short, drafts the scheduler truncated or dropped, and a sequence that never ran.

A sequence still prefilling (or resumed from the prefix cache) catches up in the same forward
0 as far as the target has computed it, within the draft worker's token budget: the draft's
prefill follows the target's chunks a step behind, and never costs a step more tokens than
the target's own step. Drafts are greedy (the draft's argmax, after the request's logit bias):
point-mass proposals, verified by `accept_matching`, so a seeded sampled row yields exactly
the tokens plain decoding yields (`verify`'s module docstring).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Protocol

from atlas.domain.batch import ScheduledBatch, ScheduledSequence, StepResult
from atlas.domain.speculative.draft_pages import DraftCache, RoundDrafter, common_prefix
from atlas.domain.speculative.ngram import TokenHistory


class StepRunner(Protocol):
    """What runs the draft model's steps: `atlas.domain.worker.Worker.execute` over the draft
    model, or a fake in tests. The same plain data as the target's executor takes."""

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step to completion: the sampled ids of its sampling rows, in batch order."""
        ...


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One running sequence's share of a round.

    `num_computed`: how far the target's cache reaches (the draft catches up that far);
    `max_drafts`: how many drafts to propose (0: the sequence only catches up), for a sequence
    whose every final token but the last is computed; `bias`: its logit bias as (ids, values).
    """

    seq_id: str
    history: TokenHistory
    num_computed: int
    max_drafts: int
    bias: tuple[tuple[int, ...], tuple[float, ...]] = ((), ())


@dataclass(slots=True)
class _Row:
    state: DraftCache  # the tokens whose K/V the draft cache holds
    request: DraftRequest
    stop: int  # forward 0 computes the cached tokens up to here
    drafts: list[int] = field(default_factory=list)

    @property
    def max_drafts(self) -> int:
        return self.request.max_drafts


class DraftModelProposer(RoundDrafter):
    """Per-sequence draft caches over one block pool, and the rounds that draft with them."""

    def __init__(self, runner: StepRunner, num_blocks: int, block_size: int, max_num_tokens: int,
                 vocab_size: int) -> None:
        """See `RoundDrafter`; `vocab_size` is the smaller of the two models' (a logit bias past
        the draft's is dropped too)."""
        super().__init__(runner, num_blocks, block_size, max_num_tokens, vocab_size, "draft")

    @property
    def runner(self) -> StepRunner:
        """What runs the draft model's steps (its worker)."""
        return self._runner

    @property
    def num_sequences(self) -> int:
        """Sequences whose tokens the draft cache holds."""
        return len(self._pages.caches)

    def draft(self, requests: SequenceOf[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Run one round (module docstring): catch every request up, then draft up to
        `max_drafts` tokens for those caught up. Returns the drafts by sequence id (a sequence
        left without blocks or budget gets none; that only costs speed)."""
        return self._round(requests)

    def _catch_up_span(self, request: DraftRequest) -> tuple[DraftCache, int, int]:
        """The cache holds tokens: those still final stay, and the catch-up reaches the last
        final token when drafting (its logits give the first draft, so it is fed again)."""
        state = self._pages.cache(request.seq_id)
        num_final = request.history.num_final_tokens
        valid = _still_final(state, request.history)
        if request.max_drafts:
            return state, min(valid, num_final - 1), num_final
        return state, valid, min(request.num_computed, num_final)

    def _new_row(self, state: DraftCache, request: DraftRequest, stop: int) -> _Row:
        return _Row(state, request, stop)

    def _kept_entries(self, row: _Row) -> int:
        return len(row.state.token_ids)  # frees the blocks of drafts never fed (a cut)

    def _run_catch_up(self, rows: list[_Row]) -> list[_Row]:
        """Forward 0: every row's catch-up chunk; returns the rows that drafted d0."""
        sequences = []
        for row in rows:
            state, request = row.state, row.request
            start = len(state.token_ids)
            token_ids = request.history.tokens_slice(start, row.stop)
            state.token_ids.extend(token_ids)
            sequences.append(self._scheduled(row, tuple(token_ids), start, sampled=request.max_drafts > 0))
        if not sequences:
            return []
        drafting = [row for row in rows if row.request.max_drafts > 0]
        self._sample(sequences, drafting)
        return [row for row in drafting if row.drafts]

    def _run_decode(self, rows: list[_Row]) -> None:
        """Forward j: each row's newest draft at its position, sampling the next."""
        sequences = self._feed_newest_drafts(rows)
        self._sample(sequences, rows)

    def _sample(self, sequences: list[ScheduledSequence], rows: list[_Row]) -> None:
        result = self._runner.execute(self._batch(sequences))
        for row, token_id in zip(rows, result.token_ids, strict=True):
            if 0 <= token_id < self._vocab_size:  # an id the target lacks is never accepted
                row.drafts.append(token_id)
            else:
                row.request = DraftRequest(row.request.seq_id, row.request.history, row.request.num_computed, 0)



def _still_final(state: DraftCache, history: TokenHistory) -> int:
    """How many of the cached tokens are still the sequence's final tokens (a prefix)."""
    start = state.num_final
    stop = min(len(state.token_ids), history.num_final_tokens)
    if stop <= start:
        return stop
    final = history.tokens_slice(start, stop)
    return start + common_prefix(state.token_ids[start:stop], final)

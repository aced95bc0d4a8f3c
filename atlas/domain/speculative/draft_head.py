"""Draft-head proposals (MTP, EAGLE-3): a small head fed the target's hidden states drafts k tokens
greedily.

A draft head (the MTP layers a checkpoint carries, or an EAGLE-3 head) is a layer or two run on
the target's backend through a second `Worker` over its own KV cache, like a draft model
(`draft_model`), but each of its tokens comes with a hidden state: entry p of its cache pairs
the target's hidden state at position p (`h_p`, the layers the target worker keeps) with the
token after it, and its row predicts the token after that:

    target computed    t0 .. t(n-2)                  h0 .. h(n-2) kept by `observe`
    head cache holds   entries 0 .. m-1              entry p = (h_p, t(p+1)) at position p
    forward 0          entries m .. n-2, one chunk a sequence, from the target's h; row n-2 -> d0
    forward j (1..k-1) entry n-2+j = (g, d(j-1)), g the head's own output of the row before -> dj

The drafts' entries are made from the head's own hidden states, never the target's, so a round
ends by dropping them: the cache holds only target-fed entries, each pairing final tokens, and
the next round keeps those still final (a rewound token aside: all of them), feeds what the
target computed since and drafts again. As with the draft model, nothing needs to be told how
verification went.

The target's hidden states arrive with each step it commits (`observe`, rows of every token the
step computed); a sequence keeps those of the positions its head has not fed yet, and drops
them as it feeds them. Positions the target computed without the head seeing them (a prefix
cache hit, steps that did not speculate) are fed a zero hidden state: their drafts get worse,
never the output, which verification decides.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from atlas.domain.batch import ScheduledBatch, ScheduledSequence, StepResult
from atlas.domain.speculative.draft_model import DraftRequest
from atlas.domain.speculative.draft_pages import DraftCache, RoundDrafter, common_prefix


class HeadRunner(Protocol):
    """What runs a draft head's steps (`atlas.domain.models.draft_heads.HeadWorker`, or a fake)."""

    @property
    def target_width(self) -> int:
        """Width of the target's hidden-state rows the head takes (H for MTP, 3 H for EAGLE-3)."""
        ...

    def execute(self, batch: ScheduledBatch, hidden_states: np.ndarray, from_target: bool) -> StepResult:
        """Run one step: token i of the batch is paired with row i of `hidden_states`, float32
        [num_tokens, target_width] from the target (`from_target`), else [num_tokens, H], the
        head's own outputs. Returns the sampled ids as target token ids, and in `hidden_states`
        the head's own output [num_tokens, H] of every token."""
        ...


@dataclass(slots=True)
class _TargetRows:
    """The target's hidden states of positions start .. start + len(rows) - 1."""

    start: int
    rows: np.ndarray


@dataclass(slots=True)
class _Row:
    state: DraftCache  # token_ids[p]: entry p's token, t(p + 1)
    request: DraftRequest
    stop: int  # entries once forward 0 has run
    drafts: list[int] = field(default_factory=list)
    hidden: np.ndarray | None = None  # the head's output at the row that sampled the newest draft

    @property
    def max_drafts(self) -> int:
        return self.request.max_drafts


class DraftHeadProposer(RoundDrafter):
    """Per-sequence head caches over one block pool, the target's hidden states they still need,
    and the rounds that draft with them."""

    def __init__(self, runner: HeadRunner, num_blocks: int, block_size: int, max_num_tokens: int,
                 vocab_size: int) -> None:
        """See `RoundDrafter`; `vocab_size` is the target's."""
        super().__init__(runner, num_blocks, block_size, max_num_tokens, vocab_size, "head")
        self._target: dict[str, _TargetRows] = {}

    @property
    def runner(self) -> HeadRunner:
        return self._runner

    @property
    def num_sequences(self) -> int:
        """Sequences whose entries the head cache holds, or whose hidden states wait."""
        return len(self._pages.caches.keys() | self._target.keys())

    def observe(self, batch: ScheduledBatch, hidden_states: np.ndarray) -> None:
        """Keep the target's hidden states of a step being committed: `hidden_states` [num_tokens,
        target_width], the batch's tokens in order. A row overwrites what was kept at its
        position and drops what was kept after it (computed again, it follows other tokens)."""
        row = 0
        for seq in batch.sequences:
            rows = hidden_states[row : row + seq.num_tokens]
            row += seq.num_tokens
            kept = self._target.get(seq.seq_id)
            start = seq.start_position
            if kept is None or start < kept.start or start > kept.start + len(kept.rows):
                self._target[seq.seq_id] = _TargetRows(start, rows.copy())  # a gap: the positions before are lost
            else:
                kept.rows = np.concatenate([kept.rows[: start - kept.start], rows])

    def draft(self, requests: SequenceOf[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Run one round (module docstring) over the running sequences (`requests`, oldest first;
        hidden states kept for any other sequence are dropped): catch every one up, then draft up
        to `max_drafts` tokens for those caught up. Returns the drafts by sequence id."""
        running = {request.seq_id for request in requests}
        for seq_id in [seq_id for seq_id in self._target if seq_id not in running]:
            del self._target[seq_id]
        return self._round(requests)

    def forget(self, seq_id: str) -> None:
        """Free a sequence's head blocks and hidden states; a no-op for one never seen."""
        self._target.pop(seq_id, None)
        super().forget(seq_id)

    def _catch_up_span(self, request: DraftRequest) -> tuple[DraftCache, int, int] | None:
        """Entry p needs h_p (computed by the target) and t(p + 1) (final): the entries still
        valid stay, and when drafting the last one is fed again (its output gives d0)."""
        goal = min(request.num_computed, request.history.num_final_tokens - 1)
        if goal < 1:
            return None
        state = self._pages.cache(request.seq_id)
        return state, min(_still_final(state, request), goal - 1 if request.max_drafts else goal), goal

    def _new_row(self, state: DraftCache, request: DraftRequest, stop: int) -> _Row:
        return _Row(state, request, stop)

    def _kept_entries(self, row: _Row) -> int:
        return row.stop  # the drafts' entries, fed the head's own hidden states, go

    def _run_catch_up(self, rows: list[_Row]) -> list[_Row]:
        """Forward 0: every row's catch-up chunk, from the target's hidden states; returns the
        rows that drafted d0."""
        sequences, hidden = [], []
        for row in rows:
            state, request = row.state, row.request
            start = len(state.token_ids)
            token_ids = request.history.tokens_slice(start + 1, row.stop + 1)
            hidden.append(self._target_rows(request.seq_id, start, row.stop))
            state.token_ids.extend(token_ids)
            sequences.append(self._scheduled(row, tuple(token_ids), start, sampled=request.max_drafts > 0))
        if not sequences:
            return []
        drafting = [row for row in rows if row.request.max_drafts > 0]
        self._sample(sequences, drafting, np.concatenate(hidden), from_target=True)
        return [row for row in drafting if row.drafts]

    def _run_decode(self, rows: list[_Row]) -> None:
        """Forward j: each row's newest draft with the head's own output before it."""
        sequences = self._feed_newest_drafts(rows)
        hidden = np.stack([row.hidden for row in rows])  # type: ignore[misc]
        self._sample(sequences, rows, hidden, from_target=False)

    def _sample(self, sequences: list[ScheduledSequence], rows: list[_Row], hidden: np.ndarray,
                from_target: bool) -> None:
        result = self._runner.execute(self._batch(sequences), hidden, from_target)
        outputs = result.hidden_states
        # the head's output at each sampled row: the last token of its sequence's chunk
        last_rows = np.cumsum([seq.num_tokens for seq in sequences]) - 1
        sampled_rows = [int(last) for seq, last in zip(sequences, last_rows, strict=True) if seq.sampling is not None]
        for row, token_id, index in zip(rows, result.token_ids, sampled_rows, strict=True):
            if 0 <= token_id < self._vocab_size:  # an id the target lacks is never accepted
                row.drafts.append(token_id)
                row.hidden = outputs[index] if outputs is not None else None
            else:
                row.request = DraftRequest(row.request.seq_id, row.request.history, row.request.num_computed, 0)

    def _target_rows(self, seq_id: str, start: int, stop: int) -> np.ndarray:
        """The target's hidden states of positions start .. stop - 1 (zeros where none was kept),
        dropping those kept before `stop`: the head has fed them."""
        out = np.zeros((stop - start, self._runner.target_width), np.float32)
        kept = self._target.get(seq_id)
        if kept is None:
            return out
        low, high = max(start, kept.start), min(stop, kept.start + len(kept.rows))
        if low < high:
            out[low - start : high - start] = kept.rows[low - kept.start : high - kept.start]
        if stop >= kept.start + len(kept.rows):
            del self._target[seq_id]
        elif stop > kept.start:
            kept.rows, kept.start = kept.rows[stop - kept.start :], stop
        return out



def _still_final(state: DraftCache, request: DraftRequest) -> int:
    """How many entries pair tokens that are still the sequence's final tokens, and hidden states
    the target still holds computed (a prefix)."""
    stop = min(len(state.token_ids), request.history.num_final_tokens - 1, request.num_computed)
    start = min(state.num_final, stop)
    if stop <= start:
        return stop
    final = request.history.tokens_slice(start + 1, stop + 1)
    return start + common_prefix(state.token_ids[start:stop], final)

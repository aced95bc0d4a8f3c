"""What the draft-model and draft-head proposers share: per-sequence caches over one block pool,
the greedy sampling row of a draft, the round's decode forwards, and the proposers' common
skeleton (`RoundDrafter`).

A drafter's cache holds, per sequence, the tokens (or head entries) whose K/V it has written,
in order, and the blocks they need; `num_final` of them were final tokens when written, so stay
valid for good. A round rolls a sequence back to what is still valid (`truncate`), reserves the
blocks of what it feeds (`grow`, which changes nothing when the pool is short) and frees the
blocks past what it keeps at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from typing import Protocol

import msgspec

from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.cache.block_pool import BlockPool

_GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


@dataclass(slots=True)
class DraftCache:
    """One sequence's share of a drafter's cache."""

    token_ids: list[int] = field(default_factory=list)  # what each written position holds, in order
    block_ids: list[int] = field(default_factory=list)
    num_final: int = 0  # token_ids[:num_final] were final when written, so are for good


class DraftPages:
    """Every sequence's `DraftCache` over one `BlockPool`; `what` names the blocks in errors
    ("draft", "head")."""

    def __init__(self, num_blocks: int, block_size: int, what: str) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.caches: dict[str, DraftCache] = {}
        self._what = what

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def cache(self, seq_id: str) -> DraftCache:
        """`seq_id`'s cache, empty the first time."""
        return self.caches.setdefault(seq_id, DraftCache())

    def grow(self, cache: DraftCache, num_positions: int) -> bool:
        """Blocks for `num_positions` positions; False (changing nothing) when the pool is short."""
        missing = BlockPool.blocks_needed(num_positions, self.pool.block_size) - len(cache.block_ids)
        if missing <= 0:
            return True
        reservation = self.pool.reserve(missing)
        if reservation is None:
            return False
        cache.block_ids.extend(self.pool.commit(reservation))
        return True

    def reserve_round(self, cache: DraftCache, chunk_end: int, max_drafts: int) -> int | None:
        """Blocks for a round that writes positions up to `chunk_end` (its catch-up chunk), then
        drafts d0 .. d(max_drafts - 2) (the last draft is never fed). Returns the drafts granted:
        `max_drafts`, 0 when only the chunk fits, None when not even the chunk does (nothing
        changed)."""
        if max_drafts and self.grow(cache, chunk_end + max_drafts - 1):
            return max_drafts
        return 0 if self.grow(cache, chunk_end) else None

    def truncate(self, cache: DraftCache, num_positions: int) -> None:
        """Keep the first `num_positions` positions and the blocks they need; free the rest."""
        del cache.token_ids[num_positions:]
        cache.num_final = min(cache.num_final, num_positions)
        keep = BlockPool.blocks_needed(num_positions, self.pool.block_size)
        if len(cache.block_ids) > keep:
            self.pool.free(cache.block_ids[keep:])
            del cache.block_ids[keep:]

    def forget(self, seq_id: str) -> None:
        """Free a sequence's blocks (finished, aborted or preempted); a no-op for one never seen."""
        cache = self.caches.pop(seq_id, None)
        if cache is not None:
            self.pool.free(cache.block_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool disagrees with the sequences' blocks, or a sequence
        holds blocks past its positions."""
        self.pool.check_invariants()
        held = sum(len(cache.block_ids) for cache in self.caches.values())
        if held != self.pool.num_used_blocks:
            raise AssertionError(f"sequences hold {held} {self._what} blocks, the pool has "
                                 f"{self.pool.num_used_blocks} used")
        for seq_id, cache in self.caches.items():
            if len(cache.block_ids) != BlockPool.blocks_needed(len(cache.token_ids), self.pool.block_size):
                raise AssertionError(f"{seq_id}: {len(cache.block_ids)} {self._what} blocks for "
                                     f"{len(cache.token_ids)} positions")


def greedy_sampling(bias: tuple[tuple[int, ...], tuple[float, ...]], vocab_size: int) -> SamplingRow:
    """A draft's sampling row: the argmax after the request's logit bias, less the ids past
    `vocab_size` (the drafter's vocabulary)."""
    kept = [(i, v) for i, v in zip(*bias, strict=True) if i < vocab_size]
    if not kept:
        return _GREEDY
    ids, values = zip(*kept, strict=True)
    return msgspec.structs.replace(_GREEDY, bias_token_ids=ids, bias_values=values)


def common_prefix(cached: SequenceOf[int], final: SequenceOf[int]) -> int:
    """How many leading tokens of `cached` equal `final`'s (a cache's entries still valid)."""
    matched = 0
    for cached_id, final_id in zip(cached, final):
        if cached_id != final_id:
            break
        matched += 1
    return matched


class _Drafting(Protocol):
    @property
    def drafts(self) -> list[int]: ...

    @property
    def max_drafts(self) -> int: ...


def run_decode_forwards(drafting: SequenceOf[_Drafting], run_decode: Callable[[list], None]) -> None:
    """Forwards 1 .. k - 1 of a round: each time, the rows that drafted at the last forward and
    want more feed their newest draft (`run_decode(rows)` appends the next to each row)."""
    rows = list(drafting)
    for offset in range(1, max((row.max_drafts for row in rows), default=0)):
        rows = [row for row in rows if len(row.drafts) == offset and row.max_drafts > offset]
        if not rows:
            break
        run_decode(rows)


class RoundDrafter:
    """The skeleton of a proposer that drafts in rounds through a second worker: its pages, its
    step budget and vocabulary, and the step ids of the batches it runs. Subclasses plan and run
    the rounds."""

    def __init__(self, runner, num_blocks: int, block_size: int, max_num_tokens: int, vocab_size: int,
                 what: str) -> None:
        """`num_blocks` blocks of `block_size` tokens (the drafter's worker's cache holds them,
        plus the scratch block); `max_num_tokens`: that worker's step size; `vocab_size`: the
        ids a draft may take (one past the target's is never accepted, so drafting stops
        there); `what` names the blocks in errors. Raises ValueError for a step size below 1."""
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be at least 1 (got {max_num_tokens})")
        self._runner = runner
        self._pages = DraftPages(num_blocks, block_size, what)
        self._max_num_tokens = max_num_tokens
        self._vocab_size = vocab_size
        self._next_step_id = 0

    @property
    def num_free_blocks(self) -> int:
        return self._pages.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self._pages.pool.num_blocks

    def forget(self, seq_id: str) -> None:
        """Free a sequence's blocks (finished, aborted or preempted); a no-op for one never seen."""
        self._pages.forget(seq_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool disagrees with the sequences' blocks, or a sequence
        holds blocks past its positions."""
        self._pages.check_invariants()

    def _round(self, requests) -> dict[str, tuple[int, ...]]:
        """One round: plan every request's catch-up (`_catch_up_span`), run forward 0
        (`_run_catch_up`) and the decode forwards (`_run_decode`), then keep each row's entries
        up to `_kept_entries` as the next round's start. Returns the drafts by sequence id (a
        sequence left without blocks or budget gets none; that only costs speed)."""
        rows = self._plan_catch_up(requests)
        run_decode_forwards(self._run_catch_up(rows), self._run_decode)
        for row in rows:
            self._pages.truncate(row.state, self._kept_entries(row))
            row.state.num_final = row.stop
        return {row.request.seq_id: tuple(row.drafts) for row in rows if row.drafts}

    def _plan_catch_up(self, requests) -> list:
        """Roll each state back to what is still valid and reserve the blocks of its catch-up
        chunk (and of its drafts, when the chunk reaches its goal and it drafts), oldest first
        within the token budget."""
        budget = self._max_num_tokens
        rows = []
        for request in requests:
            if budget == 0:
                break
            span = self._catch_up_span(request)
            if span is None:
                continue
            state, valid, goal = span
            self._pages.truncate(state, valid)
            num_new = min(goal - valid, budget)
            if num_new <= 0:
                continue
            reaches_end = valid + num_new == goal  # drafts follow the last final token only
            granted = self._pages.reserve_round(state, valid + num_new, request.max_drafts if reaches_end else 0)
            if granted is None:
                continue
            rows.append(self._new_row(state, replace(request, max_drafts=granted), valid + num_new))
            budget -= num_new
        return rows

    def _catch_up_span(self, request) -> tuple[DraftCache, int, int] | None:
        """A request's cache, how much of it is still valid, and how far its catch-up goes (the
        end of its entries when it drafts); None: nothing to do this round."""
        raise NotImplementedError

    def _new_row(self, state: DraftCache, request, stop: int):
        """The round's row of a request whose catch-up ends at entry `stop`."""
        raise NotImplementedError

    def _kept_entries(self, row) -> int:
        """How many of a row's entries stay cached after the round."""
        raise NotImplementedError

    def _feed_newest_drafts(self, rows: list) -> list[ScheduledSequence]:
        """A decode forward's sequences: each row's newest draft at its next entry, sampled."""
        sequences = []
        for row in rows:
            start = len(row.state.token_ids)
            row.state.token_ids.append(row.drafts[-1])
            sequences.append(self._scheduled(row, (row.drafts[-1],), start, sampled=True))
        return sequences

    def _scheduled(self, row, token_ids: tuple[int, ...], start: int, sampled: bool) -> ScheduledSequence:
        """A row's chunk of `token_ids` from entry `start` (its last one sampled greedily when
        `sampled`)."""
        sampling = greedy_sampling(row.request.bias, self._vocab_size) if sampled else None
        return ScheduledSequence(row.request.seq_id, token_ids, start, tuple(row.state.block_ids), sampling)

    def _batch(self, sequences: list[ScheduledSequence]) -> ScheduledBatch:
        """The next step of the drafter's worker."""
        batch = ScheduledBatch(self._next_step_id, tuple(sequences), self._pages.block_size)
        self._next_step_id += 1
        return batch

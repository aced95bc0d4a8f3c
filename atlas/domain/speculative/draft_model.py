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

import msgspec

from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence, StepResult
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.speculative.ngram import TokenHistory

_GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


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
class _DraftState:
    token_ids: list[int] = field(default_factory=list)  # whose K/V the draft cache holds, in order
    block_ids: list[int] = field(default_factory=list)
    num_final: int = 0  # token_ids[:num_final] were final tokens when drafted, so are for good


@dataclass(slots=True)
class _Row:
    state: _DraftState
    request: DraftRequest
    stop: int  # forward 0 computes the cached tokens up to here
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Per-sequence draft caches over one block pool, and the rounds that draft with them."""

    def __init__(self, runner: StepRunner, num_blocks: int, block_size: int, max_num_tokens: int,
                 vocab_size: int) -> None:
        """`num_blocks` blocks of `block_size` tokens (the draft worker's caches hold them, plus
        the scratch block); `max_num_tokens`: the draft worker's step size; `vocab_size`: the
        smaller of the two models' (a draft id past the target's is never accepted, so drafting
        stops there; a logit bias past the draft's is dropped)."""
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be at least 1 (got {max_num_tokens})")
        self._runner = runner
        self._pool = BlockPool(num_blocks, block_size)
        self._max_num_tokens = max_num_tokens
        self._vocab_size = vocab_size
        self._states: dict[str, _DraftState] = {}
        self._next_step_id = 0

    @property
    def runner(self) -> StepRunner:
        """What runs the draft model's steps (its worker)."""
        return self._runner

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_sequences(self) -> int:
        """Sequences whose tokens the draft cache holds."""
        return len(self._states)

    def draft(self, requests: SequenceOf[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Run one round (module docstring): catch every request up, then draft up to
        `max_drafts` tokens for those caught up. Returns the drafts by sequence id (a sequence
        left without blocks or budget gets none; that only costs speed)."""
        rows = self._plan_catch_up(requests)
        drafting = self._run_catch_up(rows)
        for offset in range(1, max((row.request.max_drafts for row in drafting), default=0)):
            drafting = [row for row in drafting if len(row.drafts) == offset and row.request.max_drafts > offset]
            if not drafting:
                break
            self._run_decode(drafting)
        for row in rows:
            self._truncate(row.state, len(row.state.token_ids))  # blocks of drafts never fed (a cut)
            row.state.num_final = row.stop
        return {row.request.seq_id: tuple(row.drafts) for row in rows if row.drafts}

    def forget(self, seq_id: str) -> None:
        """Free a sequence's draft blocks (finished, aborted or preempted); a no-op for one
        never seen."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self._pool.free(state.block_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool disagrees with the sequences' blocks, or a
        sequence holds blocks past its tokens."""
        self._pool.check_invariants()
        held = sum(len(state.block_ids) for state in self._states.values())
        if held != self._pool.num_used_blocks:
            raise AssertionError(f"sequences hold {held} draft blocks, the pool has {self._pool.num_used_blocks} used")
        for seq_id, state in self._states.items():
            if len(state.block_ids) != BlockPool.blocks_needed(len(state.token_ids), self._pool.block_size):
                raise AssertionError(f"{seq_id}: {len(state.block_ids)} draft blocks for {len(state.token_ids)} tokens")

    def _plan_catch_up(self, requests: SequenceOf[DraftRequest]) -> list[_Row]:
        """Roll each state back to its still-final tokens and reserve the blocks of its catch-up
        chunk (and of its drafts, when it drafts), oldest first within the token budget."""
        budget = self._max_num_tokens
        rows = []
        for request in requests:
            if budget == 0:
                break
            state = self._states.setdefault(request.seq_id, _DraftState())
            num_final = request.history.num_final_tokens
            valid = _still_final(state, request.history)
            if request.max_drafts:
                valid = min(valid, num_final - 1)  # the last final token's logits give the first draft
            self._truncate(state, valid)
            goal = num_final if request.max_drafts else min(request.num_computed, num_final)
            num_new = min(goal - valid, budget)
            if num_new <= 0:
                continue
            drafts = request.max_drafts > 0 and valid + num_new == num_final
            # positions written: the chunk, then drafts d0 .. d(k-2) (the last draft is never fed)
            extent = valid + num_new + (request.max_drafts - 1 if drafts else 0)
            if not self._grow(state, extent):
                if not drafts or not self._grow(state, valid + num_new):
                    continue
                drafts = False
            rows.append(_Row(state, DraftRequest(request.seq_id, request.history, request.num_computed,
                                                 request.max_drafts if drafts else 0, request.bias), valid + num_new))
            budget -= num_new
        return rows

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
        sequences = []
        for row in rows:
            start = len(row.state.token_ids)
            row.state.token_ids.append(row.drafts[-1])
            sequences.append(self._scheduled(row, (row.drafts[-1],), start, sampled=True))
        self._sample(sequences, rows)

    def _sample(self, sequences: list[ScheduledSequence], rows: list[_Row]) -> None:
        batch = ScheduledBatch(self._next_step_id, tuple(sequences), self._pool.block_size)
        self._next_step_id += 1
        result = self._runner.execute(batch)
        for row, token_id in zip(rows, result.token_ids, strict=True):
            if 0 <= token_id < self._vocab_size:  # an id the target lacks is never accepted
                row.drafts.append(token_id)
            else:
                row.request = DraftRequest(row.request.seq_id, row.request.history, row.request.num_computed, 0)

    def _scheduled(self, row: _Row, token_ids: tuple[int, ...], start: int, sampled: bool) -> ScheduledSequence:
        sampling = None
        if sampled:
            sampling = _GREEDY
            bias = [(i, v) for i, v in zip(*row.request.bias, strict=True) if i < self._vocab_size]
            if bias:
                ids, values = zip(*bias, strict=True)
                sampling = msgspec.structs.replace(_GREEDY, bias_token_ids=ids, bias_values=values)
        return ScheduledSequence(row.request.seq_id, token_ids, start, tuple(row.state.block_ids), sampling)

    def _grow(self, state: _DraftState, num_positions: int) -> bool:
        """Blocks for `num_positions` positions; False (changing nothing) when the pool is short."""
        missing = BlockPool.blocks_needed(num_positions, self._pool.block_size) - len(state.block_ids)
        if missing <= 0:
            return True
        reservation = self._pool.reserve(missing)
        if reservation is None:
            return False
        state.block_ids.extend(self._pool.commit(reservation))
        return True

    def _truncate(self, state: _DraftState, num_tokens: int) -> None:
        """Keep the first `num_tokens` cached tokens and the blocks they need; free the rest."""
        del state.token_ids[num_tokens:]
        state.num_final = min(state.num_final, num_tokens)
        keep = BlockPool.blocks_needed(num_tokens, self._pool.block_size)
        if len(state.block_ids) > keep:
            self._pool.free(state.block_ids[keep:])
            del state.block_ids[keep:]


def _still_final(state: _DraftState, history: TokenHistory) -> int:
    """How many of the cached tokens are still the sequence's final tokens (a prefix)."""
    start = state.num_final
    stop = min(len(state.token_ids), history.num_final_tokens)
    if stop <= start:
        return stop
    final = history.tokens_slice(start, stop)
    matched = 0
    for cached, token_id in zip(state.token_ids[start:stop], final):
        if cached != token_id:
            break
        matched += 1
    return start + matched

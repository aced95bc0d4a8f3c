"""A fake worker and helpers for scheduler scenario tests (block size 4, a handful of blocks).

The fake worker is a greedy "model" whose next token is a hash of the context, read back through
paged caches of token slots addressed by the batch's block tables (one cache per KV group; a
sliding-window group's layers see only the window) and through recurrent-state slots that
accumulate every token a sequence computed. Any correct schedule (chunked, batched, preempted,
recomputed, served from the prefix cache) therefore yields the reference's tokens, and a wrong
block table, position, hit or slot yields different ones.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence as SequenceList
from dataclasses import dataclass, field

from atlas.domain.batch import BlockTable, ScheduledBatch, ScheduledSequence, StepResult
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.groups import KvGroup
from atlas.domain.cache.manager import CacheManager
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape
from atlas.domain.requests import FinishReason, Request, SamplingParams
from atlas.domain.scheduler import Scheduler, SchedulerConfig
from atlas.domain.scheduling_policy import SchedulingPolicy
from atlas.domain.sequence import Sequence
from atlas.domain.speculative.policy import SpeculationPolicy

BLOCK_SIZE = 4
VOCAB_SIZE = 50
EOS_ID = 3
NO_EOS: frozenset[int] = frozenset()
FULL_ATTENTION = CacheGroupSpec(KvShape(num_kv_heads=1, head_dim=8))  # the scheduler reads only the kind


def full_attention_cache(pool: BlockPool, prefix_caching: bool = True) -> CacheManager:
    """One full-attention KV group over `pool` (a model of one group of every layer)."""
    return CacheManager.build([KvGroup(FULL_ATTENTION, pool)], prefix_caching)


def greedy_next_token(context: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


def visible_context(tokens: SequenceList[int], windows: SequenceList[int | None], num_states: int) -> tuple[int, ...]:
    """What the fake model reads to sample after `tokens`: every KV group's view (all of them,
    or a sliding window's last tokens), then every recurrent state (all of them)."""
    views = [tuple(tokens) if window is None else tuple(tokens[-window:]) for window in windows]
    views += [tuple(tokens)] * num_states
    return tuple(itertools.chain.from_iterable(views))


class PagedFakeWorker:
    """Writes each scheduled token into its slot in every group; samples by reading back."""

    def __init__(self, num_blocks: int, windows: SequenceList[int | None] = (None,), num_state_slots: int = 0) -> None:
        self.windows = tuple(windows)
        self.slots: list[list[int | None]] = [[None] * (num_blocks * BLOCK_SIZE) for _ in self.windows]
        self.states: list[tuple[int, ...] | None] = [None] * num_state_slots  # tokens a slot absorbed
        self.last_sampled: tuple[int, ...] = ()  # like the device's sampled-ids buffer

    def execute(self, batch: ScheduledBatch) -> StepResult:
        sampled = []
        for scheduled in batch.sequences:
            token_ids = list(scheduled.token_ids)
            if scheduled.placeholder_row is not None:  # sampled by the previous step, not known to the host
                token_ids[-1] = self.last_sampled[scheduled.placeholder_row]
            assert min(token_ids) >= 0
            tables = scheduled.block_tables
            views = [self._write_and_read(group, table, scheduled, token_ids) for group, table in enumerate(tables)]
            first_row = len(token_ids) - 1 - scheduled.num_draft_tokens  # the token of the first sampling row
            befores = []
            for group, slot in enumerate(scheduled.state_slots):
                state = () if scheduled.start_position == 0 else self.states[slot]
                assert state is not None and len(state) == scheduled.start_position, "a state slot lost its sequence"
                befores.append(state)
                self.states[slot] = state + tuple(token_ids)
                views.append(self.states[slot])
                # a verify chunk: the states after its tokens but the last, as the kind writes them
                for row, snapshot in enumerate(scheduled.state_snapshots[group] if scheduled.state_snapshots else ()):
                    assert snapshot not in scheduled.state_slots
                    self.states[snapshot] = state + tuple(token_ids[: first_row + row + 1])
            if scheduled.sampling is not None and scheduled.num_draft_tokens:
                # a row per position of the verify chunk, each reading every group's view up to it
                assert len(scheduled.state_snapshots) == len(scheduled.state_slots)
                for row in range(1 + scheduled.num_draft_tokens):
                    end = scheduled.context_len - scheduled.num_draft_tokens + row
                    row_views = [self._read(group, table, end) for group, table in enumerate(tables)]
                    row_views += [state + tuple(token_ids[: first_row + row + 1]) for state in befores]
                    sampled.append(greedy_next_token(tuple(itertools.chain.from_iterable(row_views))))
            elif scheduled.sampling is not None:
                assert scheduled.sampling.is_greedy
                sampled.append(greedy_next_token(tuple(itertools.chain.from_iterable(views))))
        self.last_sampled = tuple(sampled)
        return StepResult(step_id=batch.step_id, token_ids=tuple(sampled))

    def _write_and_read(
        self, group: int, table: BlockTable, scheduled: ScheduledSequence, token_ids: list[int]
    ) -> tuple[int, ...]:
        window, slots, context_len = self.windows[group], self.slots[group], scheduled.context_len
        assert table.first_block_idx + len(table.block_ids) == BlockPool.blocks_needed(context_len, BLOCK_SIZE)
        first_read = 0 if window is None else max(0, scheduled.start_position - window + 1)
        assert table.first_block_idx <= first_read // BLOCK_SIZE, "a block the step reads was released"
        for offset, token_id in enumerate(token_ids):
            slots[self._slot(table, scheduled.start_position + offset)] = token_id
        return self._read(group, table, context_len)

    def _read(self, group: int, table: BlockTable, end: int) -> tuple[int, ...]:
        """What group `group` shows a row whose context is positions [0, end)."""
        window, slots = self.windows[group], self.slots[group]
        visible = range(0 if window is None else max(0, end - window), end)
        return tuple(slots[self._slot(table, p)] for p in visible)  # type: ignore[misc]

    @staticmethod
    def _slot(table: BlockTable, position: int) -> int:
        return table.block_ids[position // BLOCK_SIZE - table.first_block_idx] * BLOCK_SIZE + position % BLOCK_SIZE


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


def make_seq(
    seq_id: str,
    prompt: SequenceList[int],
    max_tokens: int | None = None,
    max_model_len: int = 64,
    eos_token_ids: frozenset[int] = frozenset({EOS_ID}),
    priority: int = 0,
    **sampling: object,
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
    request = Request(request_id=seq_id, prompt_token_ids=tuple(prompt), sampling=params, seed=7, priority=priority)
    max_total_tokens = max_model_len if max_tokens is None else min(max_model_len, len(prompt) + max_tokens)
    return Sequence(request, max_total_tokens=max_total_tokens, eos_token_ids=eos_token_ids)


def make_scheduler(
    num_blocks: int,
    budget: int,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    policy: SchedulingPolicy | None = None,
    prefix_caching: bool = False,
    max_admitted_tokens: int | None = None,
) -> tuple[Scheduler, BlockPool, PagedFakeWorker]:
    """One full-attention group over `num_blocks` blocks; without prefix caching unless asked,
    so block ids are the pool's order alone."""
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    scheduler = scheduler_over(full_attention_cache(pool, prefix_caching), budget, max_num_seqs, max_model_len, policy,
                               max_admitted_tokens=max_admitted_tokens)
    return scheduler, pool, PagedFakeWorker(num_blocks)


def scheduler_over(
    cache: CacheManager, budget: int, max_num_seqs: int = 8, max_model_len: int = 64,
    policy: SchedulingPolicy | None = None, speculation: SpeculationPolicy | None = None,
    max_admitted_tokens: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=BLOCK_SIZE,
        max_admitted_tokens=max_admitted_tokens,
    )
    return Scheduler(config, cache, policy, speculation)


def step(scheduler: Scheduler, worker: PagedFakeWorker) -> tuple[ScheduledBatch, list]:
    batch = scheduler.schedule()
    scheduler.check_invariants()
    outputs = scheduler.commit(batch, worker.execute(batch)) if not batch.is_empty else []
    scheduler.check_invariants()
    return batch, outputs


def run_to_completion(
    scheduler: Scheduler,
    worker: PagedFakeWorker,
    on_batch: Callable[[ScheduledBatch], None] = lambda batch: None,
    max_steps: int = 400,
) -> dict[str, Finished]:
    """Step until every sequence finished; then every block is free or cached-evictable."""
    finished: dict[str, Finished] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            break
        batch, outputs = step(scheduler, worker)
        assert not batch.is_empty, "unfinished sequences but nothing scheduled: livelock"
        on_batch(batch)
        for output in outputs:
            record = finished.setdefault(output.seq_id, Finished())
            record.token_ids.extend(output.new_token_ids)
            record.finish_reason = output.finish_reason
    assert not scheduler.has_unfinished, f"not done after {max_steps} steps"
    stats = scheduler.cache.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    return finished


def greedy_reference(
    prompt: SequenceList[int], num_tokens: int, windows: SequenceList[int | None] = (None,), num_states: int = 0
) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(greedy_next_token(visible_context(context, windows, num_states)))
    return context[len(prompt) :]


def batch_shape(batch: ScheduledBatch) -> list[tuple[str, int, int, tuple[int, ...], bool]]:
    return [(s.seq_id, s.start_position, s.num_tokens, s.block_ids, s.sampling is not None) for s in batch.sequences]

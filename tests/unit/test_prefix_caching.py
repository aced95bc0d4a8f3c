"""Scenario tests of the scheduler with the prefix cache and cache groups (block size 4, a
handful of blocks): exact block ids, hits, eviction order, and every block back at the end.

The fake worker (tests/helpers/scheduling.py) reads every token it samples from through the
batch's block tables, so a hit on the wrong blocks, a block reused while still read, or a
released sliding-window block that was still needed changes the tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from helpers.scheduling import (
    BLOCK_SIZE,
    FULL_ATTENTION,
    NO_EOS,
    VOCAB_SIZE,
    PagedFakeWorker,
    batch_shape,
    greedy_reference,
    make_scheduler,
    make_seq,
    run_to_completion,
    scheduler_over,
    step,
)

from atlas.domain.batch import BlockTable, ScheduledBatch, StepResult
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.groups import KvGroup, StateSlotGroup
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, StateShape
from atlas.domain.cache.manager import CacheManager
from atlas.domain.requests import FinishReason
from atlas.domain.scheduler import Scheduler
from atlas.domain.sequence import Sequence

PREFIX = [5, 9, 14, 22, 31, 8, 17, 40]  # two full blocks


def cached_scheduler(num_blocks: int = 8, budget: int = 16, **kwargs):
    return make_scheduler(num_blocks=num_blocks, budget=budget, prefix_caching=True, **kwargs)


def finish_all(scheduler: Scheduler, worker: PagedFakeWorker) -> None:
    run_to_completion(scheduler, worker)


def test_a_request_sharing_a_prefix_hits_its_full_blocks_and_computes_only_the_rest() -> None:
    scheduler, pool, worker = cached_scheduler()
    a = make_seq("a", [*PREFIX, 1, 2], max_tokens=2, eos_token_ids=NO_EOS)
    scheduler.add(a)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 0, 10, (0, 1, 2), True)]
    b = make_seq("b", [*PREFIX, 40, 41, 42], max_tokens=3, eos_token_ids=NO_EOS)
    scheduler.add(b)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 10, 1, (0, 1, 2), True), ("b", 8, 3, (0, 1, 3), True)]
    assert batch.sequences[1].token_ids == (40, 41, 42)
    assert [pool.ref_count(block) for block in (0, 1, 2, 3)] == [2, 2, 0, 1]  # b and the cache; a finished
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    finish_all(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 3))
    stats = scheduler.cache.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (21, 8)
    # a's partial third block went back to the pool; b's third block (its own 40 41 42 + one
    # output token) joined the cache under the shared two
    assert stats.num_blocks_cached == 3 and pool.num_free_blocks == 5
    assert scheduler.cache.reset_prefix_cache() == 3 and pool.num_free_blocks == 8


def test_a_hit_costs_only_its_new_tokens_in_the_step_budget() -> None:
    scheduler, _, worker = cached_scheduler(budget=4)
    prompt = list(range(20, 32))
    scheduler.add(make_seq("a", prompt, max_tokens=8, eos_token_ids=NO_EOS))
    shapes = [batch_shape(step(scheduler, worker)[0]) for _ in range(3)]
    assert shapes == [[("a", 0, 4, (0,), False)], [("a", 4, 4, (0, 1), False)], [("a", 8, 4, (0, 1, 2), True)]]
    scheduler.add(make_seq("b", [*prompt, 60, 61], max_tokens=2, eos_token_ids=NO_EOS))
    batch, _ = step(scheduler, worker)
    # the 14-token prompt runs in one step of a 4-token budget: 12 tokens come from the cache
    assert batch_shape(batch) == [("a", 12, 1, (0, 1, 2, 3), True), ("b", 12, 2, (0, 1, 2, 4), True)]
    finish_all(scheduler, worker)


def test_the_forks_of_one_prompt_wait_one_step_then_share_its_blocks() -> None:
    scheduler, pool, worker = cached_scheduler()
    prompt = [*PREFIX, 2]
    forks = [make_seq(f"f{i}", prompt, max_tokens=3, eos_token_ids=NO_EOS) for i in range(3)]
    for fork in forks:
        scheduler.add(fork)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("f0", 0, 9, (0, 1, 2), True)]  # f1 would reuse blocks this step computes
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [
        ("f0", 9, 1, (0, 1, 2), True), ("f1", 8, 1, (0, 1, 3), True), ("f2", 8, 1, (0, 1, 4), True)
    ]
    assert pool.ref_count(0) == pool.ref_count(1) == 4 and pool.num_free_blocks == 3
    finish_all(scheduler, worker)
    expected = tuple(greedy_reference(prompt, 3))
    assert [fork.output_token_ids for fork in forks] == [expected] * 3
    assert [fork.num_cached_tokens for fork in forks] == [0, 8, 8]


def test_a_finished_request_leaves_prompt_and_output_blocks_for_the_next_turn() -> None:
    """Multi-turn chat: the next prompt is the conversation so far plus a new message. The
    first turn's last block is partial; the full ones before it are still reused."""
    scheduler, pool, worker = cached_scheduler()
    first = make_seq("turn1", [1, 2, 3, 4, 5], max_tokens=6, eos_token_ids=NO_EOS)
    scheduler.add(first)
    finish_all(scheduler, worker)
    # 11 tokens, 10 computed (the last sampled one never is): blocks 0 and 1 full, block 2 partial
    assert scheduler.cache.stats().num_blocks_cached == 2 and pool.num_free_blocks == 6
    conversation = [*first.token_ids, 30, 31, 32]
    second = make_seq("turn2", conversation, max_tokens=2, eos_token_ids=NO_EOS)
    scheduler.add(second)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("turn2", 8, 6, (0, 1, 3, 4), True)]
    assert second.num_cached_tokens == 8
    finish_all(scheduler, worker)
    assert second.output_token_ids == tuple(greedy_reference(conversation, 2))


def test_a_prompt_cached_in_full_still_computes_its_last_block_to_sample() -> None:
    scheduler, pool, worker = cached_scheduler()
    scheduler.add(make_seq("a", PREFIX, max_tokens=1, eos_token_ids=NO_EOS))
    scheduler.add(make_seq("b", PREFIX, max_tokens=2, eos_token_ids=NO_EOS))
    assert batch_shape(step(scheduler, worker)[0]) == [("a", 0, 8, (0, 1), True)]
    batch, _ = step(scheduler, worker)
    # the hit stops one block short: the prompt's last token must be computed to sample
    assert batch_shape(batch) == [("b", 4, 4, (0, 2), True)]
    # b's page 2 repeats the cached page 1: the cache keeps its own, which b pins while it runs
    assert [pool.ref_count(block) for block in (0, 1, 2)] == [2, 1, 1]
    assert scheduler.cache.stats().num_blocks_cached == 0
    finish_all(scheduler, worker)
    assert scheduler.cache.stats().num_blocks_cached == 2 and pool.num_free_blocks == 6


def test_a_preempted_sequence_resumes_from_the_blocks_the_cache_still_holds() -> None:
    scheduler, pool, worker = cached_scheduler(num_blocks=4)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3, eos_token_ids=NO_EOS)
    b = make_seq("b", [8, 9, 10, 11, 12, 13, 14], max_tokens=6, eos_token_ids=NO_EOS)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, worker)
    scheduler.add(make_seq("c", [15, 16], max_tokens=2, eos_token_ids=NO_EOS))
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 7, 1, (0, 1), True), ("b", 7, 1, (2, 3), True)]
    # a's position 8 needs a block: b is preempted, its two full blocks stay cached, and the
    # deepest (page 3) is evicted for a
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 8, 1, (0, 1, 3), True)]
    assert b.num_preemptions == 1 and b.cache.is_empty and a.finish_reason is FinishReason.LENGTH
    # b resumes from its cached first block; its second was evicted, so positions 4..8 are
    # recomputed into page 3 (a's partial block, freed) and page 1 (a's cached block 1, the
    # least recently released); c takes page 0, the last evictable one
    batch = scheduler.schedule()
    assert batch_shape(batch) == [("b", 4, 5, (2, 3, 1), True), ("c", 0, 2, (0,), True)]
    scheduler.commit(batch, worker.execute(batch))
    finish_all(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 6))
    assert b.num_cached_tokens == 0  # the usage reports the first admission's hit, not a resume's
    assert scheduler.cache.stats().num_hit_tokens == 0


def test_eviction_takes_the_least_recently_released_prefix_first() -> None:
    scheduler, pool, worker = cached_scheduler(num_blocks=6)
    for seq_id, prompt in (("x", [1, 2, 3, 4, 5, 6, 7, 8]), ("y", [11, 12, 13, 14, 15, 16, 17, 18])):
        scheduler.add(make_seq(seq_id, prompt, max_tokens=1, eos_token_ids=NO_EOS))
        finish_all(scheduler, worker)
    assert pool.num_free_blocks == 2 and scheduler.cache.stats().num_blocks_cached == 4
    scheduler.add(make_seq("z", list(range(21, 34)), max_tokens=1, eos_token_ids=NO_EOS))
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("z", 0, 13, (4, 5, 1, 0), True)]  # x's blocks, its last first
    y_again = make_seq("y2", [11, 12, 13, 14, 15, 16, 17, 18, 19], max_tokens=1, eos_token_ids=NO_EOS)
    scheduler.add(y_again)
    finish_all(scheduler, worker)
    assert y_again.num_cached_tokens == 8


def test_abort_leaves_the_computed_blocks_cached_and_reset_returns_every_block() -> None:
    scheduler, pool, worker = cached_scheduler(budget=8)
    prompt = list(range(30, 42))
    a = make_seq("a", prompt, eos_token_ids=NO_EOS)
    scheduler.add(a)
    step(scheduler, worker)
    batch = scheduler.schedule()  # computes 8..11: the third block is cached as it is scheduled
    result = worker.execute(batch)
    assert scheduler.abort("a").finish_reason is FinishReason.ABORT
    scheduler.check_invariants()
    assert scheduler.commit(batch, result) == []
    stats = scheduler.cache.stats()
    assert (stats.num_blocks_free, stats.num_blocks_cached, pool.num_free_blocks) == (8, 3, 5)
    b = make_seq("b", [*prompt, 1], max_tokens=1, eos_token_ids=NO_EOS)
    scheduler.add(b)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("b", 12, 1, (0, 1, 2, 3), True)]
    assert scheduler.cache.reset_prefix_cache() == 3
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    scheduler.check_invariants()


def test_without_prefix_caching_nothing_is_kept_or_hit() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=8, budget=32)
    for index in range(3):
        scheduler.add(make_seq(f"s{index}", [*PREFIX, index], max_tokens=2, eos_token_ids=NO_EOS))
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch)[1] == ("s1", 0, 9, (3, 4, 5), True)  # no waiting for s0's blocks
    finish_all(scheduler, worker)
    stats = scheduler.cache.stats()
    assert (stats.num_hit_tokens, stats.num_blocks_cached, pool.num_free_blocks) == (0, 0, 8)


def shared_prefix_workload(rng: random.Random, count: int, max_model_len: int) -> list[Sequence]:
    """Prompts drawn from a few shared stems (some a whole block longer than others) plus a
    random tail, and some repeating an earlier prompt exactly."""
    stems = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.choice([4, 8, 9, 12]))] for _ in range(3)]
    sequences = []
    for index in range(count):
        if sequences and rng.random() < 0.2:
            prompt = list(rng.choice(sequences).request.prompt_token_ids)
        else:
            prompt = rng.choice(stems) + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 6))]
        sequences.append(make_seq(f"s{index}", prompt, max_tokens=rng.randint(1, 14), max_model_len=max_model_len))
    return sequences


def run_random_workload(
    rng: random.Random,
    scheduler: Scheduler,
    worker: PagedFakeWorker,
    sequences: list[Sequence],
    pipelined: bool,
    observe: Callable[[ScheduledBatch], None] = lambda batch: None,
) -> None:
    """Arrivals over time, a few aborts, steps overlapped by one when `pipelined`; the cache's
    invariants after every schedule, commit and abort."""
    arrivals = list(sequences)
    to_abort = {seq.seq_id for seq in rng.sample(sequences, 3)}
    in_flight: list[tuple[ScheduledBatch, StepResult]] = []
    for _ in range(2000):
        if not arrivals and not scheduler.has_unfinished and not in_flight:
            break
        while arrivals and rng.random() < 0.5:
            scheduler.add(arrivals.pop(0))
        batch = scheduler.schedule()
        scheduler.check_invariants()
        observe(batch)
        if not batch.is_empty:
            in_flight.append((batch, worker.execute(batch)))
            for scheduled in batch.sequences:
                if scheduled.seq_id in to_abort and rng.random() < 0.3:
                    to_abort.discard(scheduled.seq_id)
                    assert scheduler.abort(scheduled.seq_id).finish_reason is FinishReason.ABORT
                    scheduler.check_invariants()
        while in_flight and (len(in_flight) > 1 or not pipelined or batch.is_empty):
            scheduler.commit(*in_flight.pop(0))
            scheduler.check_invariants()
    assert not arrivals and not scheduler.has_unfinished, "livelock"


def assert_reference_tokens(sequences: list[Sequence], windows=(None,), num_states: int = 0) -> None:
    for seq in sequences:
        continuation = greedy_reference(
            seq.request.prompt_token_ids, seq.max_total_tokens - seq.num_prompt_tokens, windows, num_states
        )
        if seq.finish_reason is FinishReason.ABORT:
            assert list(seq.output_token_ids) == continuation[: seq.num_output_tokens]
            continue
        if 3 in continuation:  # EOS_ID
            continuation = continuation[: continuation.index(3) + 1]
        assert list(seq.output_token_ids) == continuation


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("seed", range(8))
def test_random_shared_prefix_workloads_match_the_reference_and_return_every_block(seed: int, pipelined: bool) -> None:
    rng = random.Random(seed)
    num_blocks = rng.randint(10, 16)
    scheduler, pool, worker = cached_scheduler(
        num_blocks=num_blocks, budget=rng.randint(3, 12), max_num_seqs=rng.randint(2, 5), max_model_len=40
    )
    sequences = shared_prefix_workload(rng, 14, max_model_len=40)
    run_random_workload(rng, scheduler, worker, sequences, pipelined)
    assert_reference_tokens(sequences)
    stats = scheduler.cache.stats()
    assert stats.num_hit_tokens > 0 and stats.num_blocks_free == num_blocks
    assert scheduler.cache.reset_prefix_cache() == stats.num_blocks_cached
    assert pool.num_free_blocks == num_blocks


SLIDING = CacheGroupSpec(KvShape(1, 8, sliding_window=6))


def windowed_scheduler(full_blocks: int, window_blocks: int, prefix_caching: bool, budget: int = 8, **kwargs):
    full, window = BlockPool(full_blocks, BLOCK_SIZE), BlockPool(window_blocks, BLOCK_SIZE)
    cache = CacheManager.build([KvGroup(FULL_ATTENTION, full), KvGroup(SLIDING, window)], prefix_caching)
    worker = PagedFakeWorker(max(full_blocks, window_blocks), windows=(None, SLIDING.window))
    return scheduler_over(cache, budget, **kwargs), full, window, worker


def test_a_sliding_window_group_releases_the_blocks_that_left_the_window() -> None:
    scheduler, full, window, worker = windowed_scheduler(8, 4, prefix_caching=False)
    prompt = list(range(10, 20))
    seq = make_seq("a", prompt, max_tokens=6, eos_token_ids=NO_EOS)
    scheduler.add(seq)
    tables = []
    while scheduler.has_unfinished:
        batch, _ = step(scheduler, worker)
        tables.append(batch.sequences[0].kv_block_tables)
    # window 6: the token at position p reads positions p - 5 .. p; the prompt takes two steps
    assert [t[1] for t in tables] == [
        BlockTable((0, 1)), BlockTable((0, 1, 2)), BlockTable((1, 2), 1), BlockTable((1, 2), 1),
        BlockTable((1, 2, 3), 1), BlockTable((2, 3), 2), BlockTable((2, 3), 2),
    ]
    assert [t[0] for t in tables][-1] == BlockTable((0, 1, 2, 3))
    assert batch.sequences[0].block_ids == (0, 1, 2, 3)
    assert seq.output_token_ids == tuple(greedy_reference(prompt, 6, windows=(None, 6)))
    assert full.num_free_blocks == 8 and window.num_free_blocks == 4


def test_a_sliding_window_hit_needs_only_the_window_before_it_cached() -> None:
    scheduler, full, window, worker = windowed_scheduler(12, 5, prefix_caching=True)
    prompt = list(range(10, 22))
    scheduler.add(make_seq("a", prompt, max_tokens=1, eos_token_ids=NO_EOS))
    finish_all(scheduler, worker)
    b = make_seq("b", [*prompt, 7, 8], max_tokens=2, eos_token_ids=NO_EOS)
    scheduler.add(b)
    batch, _ = step(scheduler, worker)
    # position 12 reads 7 .. 12: the window group takes over only a's blocks 1 and 2
    assert batch_shape(batch) == [("b", 12, 2, (0, 1, 2, 3), True)]
    assert batch.sequences[0].kv_block_tables[1] == BlockTable((1, 2, 3), 1)
    finish_all(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 2, windows=(None, 6)))

    scheduler.cache.reset_prefix_cache()
    scheduler.add(make_seq("a2", prompt, max_tokens=1, eos_token_ids=NO_EOS))
    finish_all(scheduler, worker)
    # e's second chunk holds 4 window pages with 2 free: a2's first two blocks' pages go
    scheduler.add(make_seq("e", list(range(50, 63)), max_tokens=1, eos_token_ids=NO_EOS))
    finish_all(scheduler, worker)
    d = make_seq("d", [*prompt, 7, 8], max_tokens=1, eos_token_ids=NO_EOS)
    scheduler.add(d)
    batch, _ = step(scheduler, worker)
    # the full group still holds a2's three blocks, but position 12 would attend to block 1,
    # whose window page is gone: d computes from the start
    assert batch.sequences[0].start_position == 0
    finish_all(scheduler, worker)
    assert d.output_token_ids == tuple(greedy_reference(d.request.prompt_token_ids, 1, windows=(None, 6)))


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_over_full_and_sliding_window_groups_match_the_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    scheduler, full, window, worker = windowed_scheduler(
        rng.randint(10, 16), rng.randint(6, 10), prefix_caching=True, budget=rng.randint(3, 12),
        max_num_seqs=rng.randint(2, 5), max_model_len=40,
    )
    sequences = shared_prefix_workload(rng, 14, max_model_len=40)
    run_random_workload(rng, scheduler, worker, sequences, pipelined=bool(seed % 2))
    assert_reference_tokens(sequences, windows=(None, SLIDING.window))
    assert scheduler.cache.stats().num_hit_tokens > 0
    scheduler.cache.reset_prefix_cache()
    assert full.num_free_blocks == full.num_blocks and window.num_free_blocks == window.num_blocks


STATE = CacheGroupSpec(StateShape(conv_dim=8, conv_kernel=4, num_heads=1, key_dim=4, value_dim=4))


@pytest.mark.parametrize("seed", range(3))
def test_a_recurrent_state_group_gives_each_running_sequence_its_own_slot(seed: int) -> None:
    """A hybrid model (full attention + recurrent layers): one slot per running sequence bounds
    how many run at once; without state snapshots no hit could be served, so the prefix cache
    is off and keeps nothing."""
    rng = random.Random(200 + seed)
    full, slots = BlockPool(16, BLOCK_SIZE), BlockPool(3, 1)
    cache = CacheManager.build([KvGroup(FULL_ATTENTION, full), StateSlotGroup(STATE, slots)], prefix_caching=True)
    scheduler = scheduler_over(cache, budget=rng.randint(3, 12), max_num_seqs=5, max_model_len=40)
    worker = PagedFakeWorker(16, num_state_slots=3)
    sequences = shared_prefix_workload(rng, 12, max_model_len=40)
    running: list[int] = []

    def observe(batch: ScheduledBatch) -> None:
        running.append(scheduler.num_running)
        assert all(len(s.state_slots) == 1 and len(s.kv_block_tables) == 1 for s in batch.sequences)

    run_random_workload(rng, scheduler, worker, sequences, pipelined=bool(seed % 2), observe=observe)
    assert_reference_tokens(sequences, num_states=1)
    stats = scheduler.cache.stats()
    assert max(running) == 3 and stats.num_hit_tokens == 0 and stats.num_blocks_cached == 0
    assert slots.num_free_blocks == 3 and full.num_free_blocks == 16


def test_cache_groups_that_cannot_serve_a_step_are_refused_at_construction() -> None:
    window = KvGroup(SLIDING, BlockPool(4, BLOCK_SIZE))
    cache = CacheManager.build([KvGroup(FULL_ATTENTION, BlockPool(8, BLOCK_SIZE)), window], prefix_caching=True)
    scheduler_over(cache, budget=8)  # 5 positions before the step and 8 in it touch at most 4 blocks
    with pytest.raises(ValueError, match=r"group 1 \(sliding_window\) has 4 pages, but one sequence computing 9"):
        scheduler_over(cache, budget=9)
    with pytest.raises(ValueError, match="at least one KV group"):
        CacheManager.build([StateSlotGroup(STATE, BlockPool(2, 1))], prefix_caching=True)
    with pytest.raises(ValueError, match="share one block size"):
        CacheManager.build([KvGroup(FULL_ATTENTION, BlockPool(8, 4)), KvGroup(SLIDING, BlockPool(8, 8))], True)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        KvShape(1, 8, sliding_window=1)

"""Scenario tests of the scheduler with tiny numbers (block size 4, a handful of blocks), without
the prefix cache (tests/unit/test_prefix_caching.py tells its stories).

The fake worker (tests/helpers/scheduling.py) is a greedy "model" whose next token is a hash of
the whole context, read back through a paged cache of token slots addressed by the batch's block
tables. Any correct schedule (chunked, batched, preempted and recomputed) therefore yields the
same tokens, and a wrong block table, position or recompute yields different ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence as SequenceList

import pytest
from helpers.scheduling import (
    BLOCK_SIZE,
    EOS_ID,
    NO_EOS,
    VOCAB_SIZE,
    Finished,
    PagedFakeWorker,
    batch_shape,
    full_attention_cache,
    greedy_next_token,
    greedy_reference,
    make_scheduler,
    make_seq,
    run_to_completion,
    step,
)

from atlas.domain.batch import ScheduledBatch, StepResult, TokenLogprobs
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.requests import FinishReason, ParameterError, SequenceStatus
from atlas.domain.sampling import sampling_row
from atlas.domain import scheduler as scheduler_module
from atlas.domain.scheduler import BURST_SEQUENCES, BURST_STEPS, Scheduler, SchedulerConfig
from atlas.domain.scheduling_policy import FifoPolicy, PriorityPolicy
from atlas.domain.sequence import Sequence


PROMPTS = {
    "a": [5, 9, 14, 22, 31, 8, 17],
    "b": [40, 41, 2, 6, 19],
    "c": [11, 12, 13, 14, 15, 16, 18, 20, 21],
    "d": [7, 26],
    "e": [33, 34, 35, 36, 37, 38],
    "f": [1, 3, 4],  # its eighth greedy token is EOS_ID
}


def test_prefill_and_decodes_are_mixed_in_one_batch() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=16, budget=8)
    a = make_seq("a", [21, 22, 23], eos_token_ids=NO_EOS)
    scheduler.add(a)
    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 0, 3, (0,), True)]
    assert batch.sequences[0].token_ids == (21, 22, 23)
    first_token = greedy_next_token((21, 22, 23))
    assert [o.new_token_ids for o in outputs] == [(first_token,)]

    scheduler.add(make_seq("b", [30, 31, 32, 33, 34, 35], eos_token_ids=NO_EOS))
    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 3, 1, (0,), True), ("b", 0, 6, (1, 2), True)]
    assert batch.sequences[0].token_ids == (first_token,)
    assert batch.num_tokens == 7 and batch.num_sampled == 2
    assert [(o.seq_id, o.num_output_tokens) for o in outputs] == [("a", 2), ("b", 1)]

    batch, _ = step(scheduler, worker)
    # a decodes position 4, its first in a new block; b decodes position 6, still in block 2.
    assert batch_shape(batch) == [("a", 4, 1, (0, 3), True), ("b", 6, 1, (1, 2), True)]
    assert a.output_token_ids == tuple(greedy_reference([21, 22, 23], 3))
    assert pool.num_free_blocks == 12


def test_prompt_longer_than_the_budget_is_prefilled_in_chunks() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=8, budget=4)
    prompt = list(range(20, 30))
    seq = make_seq("long", prompt, eos_token_ids=NO_EOS, min_tokens=2, logprobs=1)
    scheduler.add(seq)

    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("long", 0, 4, (0,), False)]
    assert batch.sequences[0].token_ids == (20, 21, 22, 23) and outputs == []
    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("long", 4, 4, (0, 1), False)]
    assert batch.sequences[0].token_ids == (24, 25, 26, 27) and outputs == []
    assert seq.num_computed_tokens == 8 and seq.num_output_tokens == 0

    expected_row = sampling_row(seq)  # taken before the step: scheduling advances the sequence
    batch = scheduler.schedule()
    assert batch_shape(batch) == [("long", 8, 2, (0, 1, 2), True)]
    assert batch.sequences[0].token_ids == (28, 29)
    assert batch.sequences[0].sampling == expected_row
    assert batch.sequences[0].sampling.bias_token_ids == ()  # no eos ids to ban
    outputs = scheduler.commit(batch, worker.execute(batch))
    assert [o.new_token_ids for o in outputs] == [(greedy_next_token(tuple(prompt)),)]

    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("long", 10, 1, (0, 1, 2), True)]
    assert pool.num_free_blocks == 5


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=8, budget=4)
    scheduler.add(make_seq("a", [1, 2], eos_token_ids=NO_EOS))
    step(scheduler, worker)
    prompt_b = [50 + i for i in range(9)]
    b = make_seq("b", prompt_b, eos_token_ids=NO_EOS)
    scheduler.add(b)
    shapes = [batch_shape(step(scheduler, worker)[0]) for _ in range(4)]
    assert shapes == [
        [("a", 2, 1, (0,), True), ("b", 0, 3, (1,), False)],
        [("a", 3, 1, (0,), True), ("b", 3, 3, (1, 2), False)],
        [("a", 4, 1, (0, 3), True), ("b", 6, 3, (1, 2, 4), True)],
        [("a", 5, 1, (0, 3), True), ("b", 9, 1, (1, 2, 4), True)],
    ]
    assert b.output_token_ids == tuple(greedy_reference(prompt_b, 2))


def test_max_num_batched_tokens_bounds_every_batch() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=32, budget=5)
    for seq_id, prompt in PROMPTS.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=4))
    sizes: list[int] = []
    finished = run_to_completion(scheduler, worker, on_batch=lambda batch: sizes.append(batch.num_tokens))
    assert max(sizes) == 5
    # Without preemption each token is computed once, except the last sampled one, never fed back.
    num_outputs = sum(len(record.token_ids) for record in finished.values())
    assert sum(sizes) == sum(len(p) for p in PROMPTS.values()) + num_outputs - len(PROMPTS)


def test_a_burst_of_short_prompts_is_admitted_over_several_steps() -> None:
    """Once a step's admitted sequences hold max_admitted_tokens and number BURST_SEQUENCES (and
    a BURST_STEPS-th of the queue), the rest wait a step; a few long prompts are not split."""
    scheduler, _, worker = make_scheduler(num_blocks=256, budget=128, max_num_seqs=64, max_admitted_tokens=2)
    for idx in range(BURST_SEQUENCES + 3):
        scheduler.add(make_seq(f"s{idx}", [10 + idx, 20 + idx], eos_token_ids=NO_EOS, max_tokens=8))
    first, _ = step(scheduler, worker)
    assert [(s.seq_id, len(s.token_ids)) for s in first.sequences] == [(f"s{i}", 2) for i in range(BURST_SEQUENCES)]
    assert scheduler.num_waiting == 3
    second, _ = step(scheduler, worker)  # the first ones decode and do not count against the cap
    assert [(s.seq_id, len(s.token_ids)) for s in second.sequences] == [
        *((f"s{i}", 1) for i in range(BURST_SEQUENCES)),
        *((f"s{i}", 2) for i in range(BURST_SEQUENCES, BURST_SEQUENCES + 3)),
    ]

    # each step admits at least a BURST_STEPS-th of a long queue
    burst = 10 * BURST_SEQUENCES * BURST_STEPS
    scheduler, _, worker = make_scheduler(num_blocks=512, budget=1024, max_num_seqs=burst, max_admitted_tokens=2)
    for idx in range(burst):
        scheduler.add(make_seq(f"b{idx}", [10, idx % 50 + 1], eos_token_ids=NO_EOS, max_tokens=8))
    while scheduler.num_waiting:
        waiting = scheduler.num_waiting
        batch, _ = step(scheduler, worker)
        admitted = sum(len(s.token_ids) == 2 for s in batch.sequences)
        assert admitted == min(waiting, max(BURST_SEQUENCES, -(-waiting // BURST_STEPS)))

    scheduler, _, worker = make_scheduler(num_blocks=128, budget=64, max_num_seqs=32, max_admitted_tokens=2)
    for idx in range(3):
        scheduler.add(make_seq(f"long{idx}", list(range(30, 44)), eos_token_ids=NO_EOS))
    batch, _ = step(scheduler, worker)
    assert [(s.seq_id, len(s.token_ids)) for s in batch.sequences] == [("long0", 14), ("long1", 14), ("long2", 14)]


def unconstrained_run(max_tokens: int) -> dict[str, Finished]:
    scheduler, _, worker = make_scheduler(num_blocks=64, budget=64)
    for seq_id, prompt in PROMPTS.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=max_tokens))
    return run_to_completion(scheduler, worker)


def test_preemption_under_block_pressure_gives_the_unconstrained_tokens() -> None:
    reference = unconstrained_run(max_tokens=14)
    for seq_id, prompt in PROMPTS.items():
        expected = greedy_reference(prompt, 14)
        if EOS_ID in expected:
            expected = expected[: expected.index(EOS_ID) + 1]
        assert reference[seq_id].token_ids == expected
    assert reference["f"] == Finished(greedy_reference(PROMPTS["f"], 8), FinishReason.STOP)

    scheduler, pool, worker = make_scheduler(num_blocks=8, budget=6, max_num_seqs=4)
    sequences = [make_seq(seq_id, prompt, max_tokens=14) for seq_id, prompt in PROMPTS.items()]
    for seq in sequences:
        scheduler.add(seq)
    constrained = run_to_completion(scheduler, worker)

    assert sum(seq.num_preemptions for seq in sequences) > 0
    assert constrained == reference
    assert pool.num_free_blocks == 8


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=4, budget=16)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3, eos_token_ids=NO_EOS)
    b = make_seq("b", [8, 9, 10, 11, 12, 13, 14], max_tokens=6, eos_token_ids=NO_EOS)
    c = make_seq("c", [15, 16], max_tokens=2, eos_token_ids=NO_EOS)
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 0, 7, (0, 1), True), ("b", 0, 7, (2, 3), True)]
    scheduler.add(c)  # no block left for it
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 7, 1, (0, 1), True), ("b", 7, 1, (2, 3), True)]
    assert scheduler.num_waiting == 1

    # a's position 8 needs a third block: b, the newest running sequence, gives back both of its.
    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 8, 1, (0, 1, 2), True)]
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
    assert b.num_output_tokens == 2 and b.cache.is_empty
    assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH]  # a is done: 3 tokens
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 2)

    # b went ahead of c; it recomputes prompt + output in the blocks freed in that order.
    b_output = b.output_token_ids
    batch = scheduler.schedule()
    assert batch_shape(batch) == [("b", 0, 9, (3, 0, 1), True), ("c", 0, 2, (2,), True)]
    assert batch.sequences[0].token_ids == (8, 9, 10, 11, 12, 13, 14) + b_output
    scheduler.commit(batch, worker.execute(batch))
    run_to_completion(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 6))
    assert c.output_token_ids == tuple(greedy_reference([15, 16], 2))
    assert (b.finish_reason, c.finish_reason) == (FinishReason.LENGTH, FinishReason.LENGTH)
    assert pool.num_free_blocks == 4


def test_a_sequence_that_is_the_newest_preempts_itself_and_the_older_one_runs() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=4, budget=16)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=2, eos_token_ids=NO_EOS)
    b = make_seq("b", [8, 9, 10, 11, 12, 13, 14, 15], max_tokens=4, eos_token_ids=NO_EOS)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, worker)
    # a decodes within its two blocks; b's position 8 needs a third and it is the only candidate.
    batch, outputs = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 7, 1, (0, 1), True)]
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert [(o.seq_id, o.finish_reason) for o in outputs] == [("a", FinishReason.LENGTH)]
    run_to_completion(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 4))


def test_a_step_that_preempted_admits_nobody_so_the_victim_does_not_bounce_back() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=4, budget=5)
    a = make_seq("a", [1, 2, 3, 4], max_tokens=6, eos_token_ids=NO_EOS)
    b = make_seq("b", [5, 6, 7, 8, 9, 10, 11, 12], max_tokens=3, eos_token_ids=NO_EOS)
    scheduler.add(a)
    step(scheduler, worker)
    scheduler.add(b)
    shapes = [batch_shape(step(scheduler, worker)[0]) for _ in range(3)]
    assert shapes == [
        [("a", 4, 1, (0, 1), True), ("b", 0, 4, (2,), False)],
        [("a", 5, 1, (0, 1), True), ("b", 4, 4, (2, 3), True)],
        # b's position 8 needs a third block; b preempts itself. A 4-token chunk of its recompute
        # would fit in the 2 blocks it freed, but re-admitting it now would only thrash.
        [("a", 6, 1, (0, 1), True)],
    ]
    assert b.num_preemptions == 1 and scheduler.num_waiting == 1
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 7, 1, (0, 1), True), ("b", 0, 4, (2,), False)]
    run_to_completion(scheduler, worker)
    assert b.output_token_ids == tuple(greedy_reference(b.request.prompt_token_ids, 3))
    assert a.output_token_ids == tuple(greedy_reference(a.request.prompt_token_ids, 6))


def test_max_num_seqs_is_respected_and_tokens_are_unchanged() -> None:
    reference = unconstrained_run(max_tokens=6)
    scheduler, _, worker = make_scheduler(num_blocks=32, budget=32, max_num_seqs=2)
    for seq_id, prompt in PROMPTS.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=6))
    running_counts: list[int] = []

    def observe(batch: ScheduledBatch) -> None:
        assert len(batch.sequences) <= 2
        running_counts.append(scheduler.num_running)

    assert run_to_completion(scheduler, worker, on_batch=observe) == reference
    assert max(running_counts) == 2


def test_abort_while_waiting_mid_prefill_and_mid_decode_returns_every_block() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=8, budget=4, max_num_seqs=2)
    a = make_seq("a", [1, 2, 3], eos_token_ids=NO_EOS)
    b = make_seq("b", list(range(10, 22)), eos_token_ids=NO_EOS)
    c = make_seq("c", [30, 31], eos_token_ids=NO_EOS)
    scheduler.add(a)
    step(scheduler, worker)
    step(scheduler, worker)
    scheduler.add(b)
    scheduler.add(c)
    batch, _ = step(scheduler, worker)
    assert batch_shape(batch) == [("a", 4, 1, (0, 1), True), ("b", 0, 3, (2,), False)]
    assert (scheduler.num_running, scheduler.num_waiting, pool.num_free_blocks) == (2, 1, 5)

    out_c = scheduler.abort("c")
    assert (out_c.seq_id, out_c.new_token_ids, out_c.finish_reason) == ("c", (), FinishReason.ABORT)
    assert c.status is SequenceStatus.FINISHED and scheduler.num_waiting == 0
    scheduler.check_invariants()

    out_b = scheduler.abort("b")
    assert out_b.finish_reason is FinishReason.ABORT and out_b.num_output_tokens == 0
    assert b.num_computed_tokens == 3 and pool.num_free_blocks == 6
    scheduler.check_invariants()

    out_a = scheduler.abort("a")
    assert out_a.finish_reason is FinishReason.ABORT and out_a.num_output_tokens == 3
    assert pool.num_free_blocks == 8 and not scheduler.has_unfinished
    scheduler.check_invariants()

    assert scheduler.abort("a") is None and scheduler.abort("nobody") is None
    assert scheduler.schedule().is_empty


def test_abort_between_schedule_and_commit_is_skipped_silently() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=8, budget=8)
    a = make_seq("a", [1, 2, 3], eos_token_ids=NO_EOS)
    b = make_seq("b", [4, 5, 6], eos_token_ids=NO_EOS)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, worker)
    c = make_seq("c", list(range(40, 52)), eos_token_ids=NO_EOS)
    scheduler.add(c)
    batch = scheduler.schedule()
    assert batch_shape(batch) == [("a", 3, 1, (0,), True), ("b", 3, 1, (1,), True), ("c", 0, 6, (2, 3), False)]
    result = worker.execute(batch)

    assert scheduler.abort("a").finish_reason is FinishReason.ABORT
    assert scheduler.abort("c").finish_reason is FinishReason.ABORT
    scheduler.check_invariants()
    outputs = scheduler.commit(batch, result)
    scheduler.check_invariants()

    # result.token_ids[1] is b's even though a, sampled first, is gone.
    assert [(o.seq_id, o.new_token_ids) for o in outputs] == [("b", (result.token_ids[1],))]
    assert a.num_output_tokens == 1 and a.num_computed_tokens == 4  # the step advanced it; its token is void
    assert b.output_token_ids == tuple(greedy_reference([4, 5, 6], 2))
    assert pool.num_free_blocks == 7 and pool.ref_count(1) == 1


def test_every_block_returns_after_completion() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=12, budget=7, max_num_seqs=3)
    for seq_id, prompt in PROMPTS.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=9))
    used_during_run: list[int] = []
    run_to_completion(scheduler, worker, on_batch=lambda _: used_during_run.append(pool.num_used_blocks))
    assert max(used_during_run) > 0
    assert pool.num_free_blocks == 12 and pool.num_used_blocks == 0
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)


def test_length_at_max_tokens_and_at_max_model_len() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=16, budget=16, max_model_len=12)
    scheduler.add(make_seq("short", [1, 2, 3], max_tokens=3, max_model_len=12, eos_token_ids=NO_EOS))
    scheduler.add(make_seq("capped", [4, 5, 6, 7, 8], max_tokens=100, max_model_len=12, eos_token_ids=NO_EOS))
    scheduler.add(make_seq("open", [9, 10], max_model_len=12, eos_token_ids=NO_EOS))
    finished = run_to_completion(scheduler, worker)
    assert finished["short"] == Finished(greedy_reference([1, 2, 3], 3), FinishReason.LENGTH)
    assert finished["capped"] == Finished(greedy_reference([4, 5, 6, 7, 8], 7), FinishReason.LENGTH)
    assert finished["open"] == Finished(greedy_reference([9, 10], 10), FinishReason.LENGTH)


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    prompt = [12, 44, 7]
    continuation = greedy_reference(prompt, 8)
    eos_id = continuation[3]
    stop_id = continuation[5]
    num_to_eos = continuation.index(eos_id) + 1
    num_to_stop = continuation.index(stop_id) + 1
    assert num_to_eos > 1 and num_to_stop > 1
    scheduler, _, worker = make_scheduler(num_blocks=16, budget=16)
    scheduler.add(make_seq("eos", prompt, max_tokens=20, eos_token_ids=frozenset({eos_id})))
    scheduler.add(make_seq("stop", prompt, max_tokens=20, eos_token_ids=NO_EOS, stop_token_ids=(stop_id,)))
    scheduler.add(make_seq("ignore", prompt, max_tokens=8, eos_token_ids=frozenset({eos_id}), ignore_eos=True))
    finished = run_to_completion(scheduler, worker)
    assert finished["eos"] == Finished(continuation[:num_to_eos], FinishReason.STOP)
    assert finished["stop"] == Finished(continuation[:num_to_stop], FinishReason.STOP)
    assert finished["ignore"] == Finished(continuation, FinishReason.LENGTH)


def test_a_prompt_that_leaves_no_room_is_a_parameter_error_naming_both_numbers() -> None:
    scheduler, pool, _ = make_scheduler(num_blocks=16, budget=16, max_model_len=16)
    with pytest.raises(ParameterError, match="20 tokens but max_model_len is 16") as caught:
        scheduler.add(make_seq("big", list(range(1, 21)), max_tokens=1, max_model_len=64))
    assert caught.value.field == "prompt"
    with pytest.raises(ParameterError, match="16 tokens but max_model_len is 16"):
        scheduler.add(make_seq("exact", list(range(1, 17)), max_tokens=1, max_model_len=64))
    assert not scheduler.has_unfinished and pool.num_free_blocks == 16
    scheduler.add(make_seq("fits", list(range(1, 16)), max_model_len=16))
    assert scheduler.num_waiting == 1


def test_a_prompt_larger_than_the_whole_pool_is_a_parameter_error() -> None:
    scheduler, _, _ = make_scheduler(num_blocks=2, budget=16)
    message = "9 tokens, which need 3 KV blocks of 4 tokens.*only 2 blocks \\(8 tokens\\)"
    with pytest.raises(ParameterError, match=message):
        scheduler.add(make_seq("big", list(range(1, 10))))
    assert not scheduler.has_unfinished


def test_a_sequence_outgrowing_the_whole_pool_ends_by_length_instead_of_livelocking() -> None:
    scheduler, pool, worker = make_scheduler(num_blocks=3, budget=16)
    prompt = [2, 4, 6, 8, 10]
    scheduler.add(make_seq("grows", prompt, eos_token_ids=NO_EOS))
    scheduler.add(make_seq("small", [1, 9], max_tokens=2, eos_token_ids=NO_EOS))
    finished = run_to_completion(scheduler, worker)
    # 3 blocks of 4 hold 12 positions: the 13th token can be sampled, never computed.
    assert finished["grows"] == Finished(greedy_reference(prompt, 8), FinishReason.LENGTH)
    assert finished["small"] == Finished(greedy_reference([1, 9], 2), FinishReason.LENGTH)
    assert pool.num_free_blocks == 3


def test_logprobs_from_the_result_reach_the_output() -> None:
    scheduler, _, _ = make_scheduler(num_blocks=8, budget=8)
    scheduler.add(make_seq("a", [1, 2], logprobs=1))
    scheduler.add(make_seq("b", [3, 4]))
    batch = scheduler.schedule()
    logprobs_a = TokenLogprobs(token_id=17, logprob=-0.25, top=((17, -0.25),))
    result = StepResult(step_id=batch.step_id, token_ids=(17, 18), logprobs=(logprobs_a, None))
    outputs = scheduler.commit(batch, result)
    assert [(o.seq_id, o.new_token_ids, o.logprobs) for o in outputs] == [("a", (17,), (logprobs_a,)), ("b", (18,), ())]
    scheduler.check_invariants()


def test_commit_and_schedule_refuse_out_of_order_calls() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=8, budget=8)
    scheduler.add(make_seq("a", [1, 2, 3]))
    idle = scheduler.schedule()
    assert not idle.is_empty
    ahead = scheduler.schedule()  # one step may be prepared while another is in flight
    assert ahead.sequences[0].placeholder_row == 0
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="samples 1 tokens but the result has 2"):
        scheduler.commit(idle, StepResult(step_id=idle.step_id, token_ids=(1, 2)))
    with pytest.raises(ValueError, match="result of step"):
        scheduler.commit(idle, StepResult(step_id=idle.step_id + 1, token_ids=(1,)))
    stale = ScheduledBatch(step_id=idle.step_id + 5, sequences=idle.sequences, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="not the oldest in flight"):
        scheduler.commit(stale, worker.execute(stale))
    with pytest.raises(ValueError, match="not the oldest in flight"):
        scheduler.commit(ahead, StepResult(step_id=ahead.step_id, token_ids=(1,)))
    scheduler.check_invariants()
    outputs = scheduler.commit(idle, worker.execute(idle))
    assert [o.num_output_tokens for o in outputs] == [1]
    with pytest.raises(ValueError, match="not the oldest in flight"):
        scheduler.commit(idle, worker.execute(idle))
    assert [o.num_output_tokens for o in scheduler.commit(ahead, worker.execute(ahead))] == [2]


def test_nothing_to_do_gives_an_empty_batch_that_needs_no_commit() -> None:
    scheduler, _, _ = make_scheduler(num_blocks=8, budget=8)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert first.is_empty and second.is_empty and second.block_size == BLOCK_SIZE
    assert not scheduler.has_unfinished


class ShortestPromptFirst:
    """A policy that admits short prompts first and preempts like fifo."""

    def check(self, seq: Sequence) -> None:
        pass

    def admission_order(self, waiting: Collection[Sequence]) -> Iterable[Sequence]:
        return sorted(waiting, key=lambda seq: seq.num_prompt_tokens)

    def choose_victim(self, candidates: SequenceList[Sequence], requester: Sequence) -> Sequence:
        return candidates[-1]


def test_a_policy_object_decides_the_admission_order() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=16, budget=32, max_num_seqs=2, policy=ShortestPromptFirst())
    for seq_id in ("c", "d", "b", "e"):
        scheduler.add(make_seq(seq_id, PROMPTS[seq_id], max_tokens=2))
    batch, _ = step(scheduler, worker)
    assert [s.seq_id for s in batch.sequences] == ["d", "b"]


class PreemptsAStranger:
    def check(self, seq: Sequence) -> None:
        pass

    def admission_order(self, waiting: Collection[Sequence]) -> Iterable[Sequence]:
        return iter(waiting)

    def choose_victim(self, candidates: SequenceList[Sequence], requester: Sequence) -> Sequence:
        return make_seq("stranger", [1])


def test_a_policy_naming_a_victim_outside_the_candidates_is_refused() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=2, budget=16, policy=PreemptsAStranger())
    scheduler.add(make_seq("a", [1, 2, 3, 4], eos_token_ids=NO_EOS))
    scheduler.add(make_seq("b", [5, 6, 7, 8], eos_token_ids=NO_EOS))
    step(scheduler, worker)
    with pytest.raises(ValueError, match="'stranger', which is not a preemption candidate"):
        scheduler.schedule()


def test_add_refuses_engine_mistakes() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=8, budget=8, max_model_len=32)
    seq = make_seq("a", [1, 2, 3], max_model_len=32)
    scheduler.add(seq)
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add(make_seq("a", [1, 2, 3], max_model_len=32))
    with pytest.raises(ValueError, match="max_total_tokens 64"):
        scheduler.add(make_seq("too-long", [1, 2, 3], max_model_len=64))
    step(scheduler, worker)
    scheduler.abort("a")
    with pytest.raises(ValueError, match="already started"):
        scheduler.add(seq)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=32, block_size=16), full_attention_cache(BlockPool(8, block_size=4)))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=32, max_num_batched_tokens=0)


def expected_greedy_run(seq: Sequence) -> Finished:
    """What an unconstrained run produces for `seq`: greedy tokens up to eos or its length limit."""
    continuation = greedy_reference(seq.request.prompt_token_ids, seq.max_total_tokens - seq.num_prompt_tokens)
    if EOS_ID in continuation:
        return Finished(continuation[: continuation.index(EOS_ID) + 1], FinishReason.STOP)
    return Finished(continuation, FinishReason.LENGTH)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_arrivals_and_aborts_match_the_reference(
    seed: int, pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipelined: step N+1 is scheduled (and run) before step N is committed, as the engine does."""
    rng = random.Random(seed)
    monkeypatch.setattr(scheduler_module, "BURST_SEQUENCES", rng.choice([1, 2, 8]))
    num_blocks = rng.randint(10, 16)  # at least max_model_len slots
    scheduler, pool, worker = make_scheduler(
        num_blocks=num_blocks, budget=rng.randint(3, 12), max_num_seqs=rng.randint(2, 5), max_model_len=40,
        max_admitted_tokens=rng.choice([None, 1, 4]),
    )
    sequences = [
        make_seq(
            f"s{idx}",
            [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 14))],
            max_tokens=rng.randint(1, 20),
            max_model_len=40,
        )
        for idx in range(10)
    ]
    arrivals = list(sequences)
    to_abort = {seq.seq_id for seq in rng.sample(sequences, 3)}
    in_flight: list[tuple[ScheduledBatch, StepResult]] = []
    for _ in range(1000):
        if not arrivals and not scheduler.has_unfinished and not in_flight:
            break
        if arrivals and rng.random() < 0.5:
            scheduler.add(arrivals.pop(0))
        batch = scheduler.schedule()
        scheduler.check_invariants()
        if not batch.is_empty:
            in_flight.append((batch, worker.execute(batch)))
            for scheduled in batch.sequences:
                if scheduled.seq_id in to_abort and rng.random() < 0.3:
                    to_abort.discard(scheduled.seq_id)
                    assert scheduler.abort(scheduled.seq_id).finish_reason is FinishReason.ABORT
        while in_flight and (len(in_flight) > 1 or not pipelined or batch.is_empty):
            scheduler.commit(*in_flight.pop(0))
            scheduler.check_invariants()
    assert not arrivals and not scheduler.has_unfinished, "livelock"
    assert scheduler.cache.stats().num_blocks_free == num_blocks

    for seq in sequences:
        expected = expected_greedy_run(seq)
        if seq.finish_reason is FinishReason.ABORT:
            assert list(seq.output_token_ids) == expected.token_ids[: seq.num_output_tokens]
        else:
            assert Finished(list(seq.output_token_ids), seq.finish_reason) == expected


def test_the_priority_policy_admits_lower_values_first_and_equals_in_arrival_order() -> None:
    scheduler, _, worker = make_scheduler(num_blocks=16, budget=32, max_num_seqs=2, policy=PriorityPolicy())
    for seq_id, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        scheduler.add(make_seq(seq_id, PROMPTS["b"], max_tokens=1, priority=priority))
    admitted = [[s.seq_id for s in step(scheduler, worker)[0].sequences] for _ in range(3)]
    assert admitted == [["d", "b"], ["e", "a"], ["c"]]


def test_under_pressure_the_priority_policy_preempts_the_least_urgent_not_the_newest() -> None:
    def third_step(policy, priority_a: int):
        scheduler, _, worker = make_scheduler(num_blocks=4, budget=16, policy=policy)
        a = make_seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3, eos_token_ids=NO_EOS, priority=priority_a)
        b = make_seq("b", [8, 9, 10, 11, 12, 13, 14], max_tokens=3, eos_token_ids=NO_EOS)
        scheduler.add(a)
        step(scheduler, worker)
        scheduler.add(b)
        step(scheduler, worker)
        batch, _ = step(scheduler, worker)  # a's position 8 needs a third block; there is none
        return batch_shape(batch), a.num_preemptions, b.num_preemptions

    assert third_step(PriorityPolicy(), 2) == ([("b", 7, 1, (2, 3), True)], 1, 0)  # a (2) yields to b (0)
    assert third_step(FifoPolicy(), 0) == ([("a", 8, 1, (0, 1, 2), True)], 0, 1)  # fifo: the newest, b
    with pytest.raises(ParameterError, match="--scheduling-policy priority") as caught:
        third_step(FifoPolicy(), 2)
    assert caught.value.field == "priority"


def test_the_priority_policy_resumes_a_preempted_urgent_sequence_before_earlier_arrivals() -> None:
    policy = PriorityPolicy()
    low = [make_seq(f"low{i}", [i], priority=1) for i in range(3)]
    urgent = make_seq("urgent", [9], priority=0)
    urgent.num_preemptions = 1  # as if preempted: it waits at the queue's front, yet by priority
    order = [seq.seq_id for seq in policy.admission_order([urgent, *low])]
    assert order == ["urgent", "low0", "low1", "low2"]
    assert policy.choose_victim([urgent, *low], urgent) is low[2]
    assert policy.choose_victim([urgent], urgent) is urgent


def _overlapped_run(scheduler: Scheduler, worker: PagedFakeWorker, refuse: Callable[[str, int], bool]):
    """The engine's overlap: step N+1 is scheduled before step N commits; before each commit,
    `refuse(seq_id, num_output_tokens)` picks the sequences whose token step N sampled is taken
    back (`Scheduler.resample`). Returns {seq id: output tokens} and how many were taken back."""
    outputs: dict[str, list[int]] = {}
    in_flight: list[tuple[ScheduledBatch, StepResult]] = []
    num_resampled = 0
    while True:
        batch = scheduler.schedule()
        scheduler.check_invariants()
        if not batch.is_empty:
            in_flight.append((batch, worker.execute(batch)))
        if in_flight and (len(in_flight) > 1 or batch.is_empty):
            oldest, result = in_flight.pop(0)
            for scheduled in oldest.sequences:
                seq = scheduler._live.get(scheduled.seq_id)
                if scheduled.sampling is not None and seq is not None and refuse(seq.seq_id, seq.num_output_tokens):
                    num_resampled += scheduler.resample(seq.seq_id, oldest.step_id)
                    scheduler.check_invariants()
            for output in scheduler.commit(oldest, result):
                outputs.setdefault(output.seq_id, []).extend(output.new_token_ids)
            scheduler.check_invariants()
        if batch.is_empty and not in_flight:
            return outputs, num_resampled


def test_resample_takes_back_a_token_in_flight_at_any_position_and_the_output_is_unchanged() -> None:
    """Taking back the oldest step's token (and the next step's) rewinds the sequence by its
    last token across page boundaries, with the prefix cache on and a neighbour running: the
    invariants hold after every call, every block comes back, and since the fake model is
    deterministic the outputs are the plain run's."""
    prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7]}
    plain_scheduler, _, plain_worker = make_scheduler(num_blocks=24, budget=16, prefix_caching=True)
    for seq_id, prompt in prompts.items():
        plain_scheduler.add(make_seq(seq_id, prompt, max_tokens=14, eos_token_ids=NO_EOS))
    plain, _ = _overlapped_run(plain_scheduler, plain_worker, lambda seq_id, n: False)

    scheduler, pool, worker = make_scheduler(num_blocks=24, budget=16, prefix_caching=True)
    for seq_id, prompt in prompts.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=14, eos_token_ids=NO_EOS))
    seen: set[tuple[str, int]] = set()

    def refuse(seq_id: str, num_output: int) -> bool:  # each position of a's once, b's every third
        key = (seq_id, num_output)
        if key in seen or (seq_id == "b" and num_output % 3):
            return False
        seen.add(key)
        return True

    taken_back, num_resampled = _overlapped_run(scheduler, worker, refuse)
    assert taken_back == plain and num_resampled > 10
    assert pool.num_free_blocks + scheduler.cache.stats().num_blocks_cached == 24


def test_resample_refuses_what_it_cannot_take_back() -> None:
    """No token in flight, the first output token (its recompute would rewrite the prompt's
    last position), a step that is not the sequence's oldest in flight, and a block of one
    token already in the prefix cache: nothing changes."""
    scheduler, _, worker = make_scheduler(num_blocks=16, budget=16)
    seq = make_seq("a", [1, 2, 3], max_tokens=8, eos_token_ids=NO_EOS)
    scheduler.add(seq)
    assert not scheduler.resample("a", 0)  # waiting: nothing in flight
    batch = scheduler.schedule()
    assert not scheduler.resample("a", batch.step_id)  # the first output token
    scheduler.commit(batch, worker.execute(batch))
    batch = scheduler.schedule()
    assert not scheduler.resample("a", batch.step_id + 1) and not scheduler.resample("nobody", batch.step_id)
    assert scheduler.resample("a", batch.step_id)
    scheduler.check_invariants()

    pool = BlockPool(num_blocks=32, block_size=1)
    one_token_blocks = Scheduler(SchedulerConfig(64, 4, 16, 1), full_attention_cache(pool, prefix_caching=True))
    seq = make_seq("a", [1, 2, 3], max_tokens=8, eos_token_ids=NO_EOS)
    one_token_blocks.add(seq)
    for _ in range(3):  # the fake worker's pages are of 4 tokens: sample 5 each time instead
        batch = one_token_blocks.schedule()
        one_token_blocks.commit(batch, StepResult(batch.step_id, (5,) * batch.num_sampled))
    batch = one_token_blocks.schedule()
    assert not one_token_blocks.cache.trims_only_fresh_pages(seq, seq.num_resolved_tokens - 1)
    assert not one_token_blocks.resample("a", batch.step_id)  # its last token's block is cached
    one_token_blocks.check_invariants()
    assert not one_token_blocks.cache.can_recompute_last_token  # so the engine keeps exact masks

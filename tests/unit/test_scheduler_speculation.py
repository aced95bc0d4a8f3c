"""Speculative drafts in the scheduler, with the fake paged worker (block size 4): drafts are
reserved without preempting, verified row by row, and what is rejected gives its pages back;
only final tokens reach the prefix cache.

The proposer here is scripted: it drafts the fake model's true next tokens (from the greedy
reference), except where told to draft wrong ones, so every acceptance count is known.
"""

from __future__ import annotations

import pytest
from helpers.scheduling import (
    BLOCK_SIZE,
    FULL_ATTENTION,
    NO_EOS,
    VOCAB_SIZE,
    PagedFakeWorker,
    full_attention_cache,
    greedy_reference,
    make_seq,
    run_to_completion,
    scheduler_over,
    step,
)

from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.groups import KvGroup, StateSlotGroup
from atlas.domain.cache.manager import CacheManager
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, StateShape


class ScriptedProposer:
    """Drafts up to `num_drafts` tokens: each sequence's reference next tokens, from the
    `wrong_from`-th draft on shifted to a wrong id."""

    def __init__(self, prompts: dict[str, list[int]], num_tokens: int, num_drafts: int, wrong_from: int | None = None,
                 windows=(None,), num_states=0):
        self.prompt_lens = {seq_id: len(prompt) for seq_id, prompt in prompts.items()}
        self.references = {seq_id: greedy_reference(p, num_tokens + num_drafts + 1, windows, num_states)
                           for seq_id, p in prompts.items()}
        self.num_drafts = num_drafts
        self.wrong_from = wrong_from
        self.forgotten: list[str] = []

    def is_active(self, num_running: int) -> bool:
        return True

    def needs_final_tokens(self, running) -> bool:
        return True

    def prepare(self, running) -> None:
        pass

    def propose(self, seq_id, history, max_drafts):
        num_output = history.num_final_tokens - self.prompt_lens[seq_id]
        drafts = self.references[seq_id][num_output : num_output + min(self.num_drafts, max_drafts)]
        if self.wrong_from is not None:
            drafts = drafts[: self.wrong_from] + [(t + 1) % VOCAB_SIZE for t in drafts[self.wrong_from :]]
        return tuple(drafts)

    def observe(self, batch, result) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        self.forgotten.append(seq_id)


def scripted(prompts: dict[str, list[int]], num_tokens: int, num_drafts: int, **kwargs) -> ScriptedProposer:
    return ScriptedProposer(prompts, num_tokens, num_drafts, **kwargs)


def setup(num_blocks: int, proposer, budget: int = 32, prefix_caching: bool = False):
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    scheduler = scheduler_over(full_attention_cache(pool, prefix_caching), budget, speculation=proposer)
    return scheduler, pool, PagedFakeWorker(num_blocks)


def test_rejected_drafts_give_their_pages_back_and_accepted_ones_keep_theirs() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 7 tokens: blocks 0 and 1, the first output token at position 7
    proposer = scripted({"a": prompt}, 12, num_drafts=4, wrong_from=0)
    scheduler, pool, worker = setup(8, proposer)
    seq = make_seq("a", prompt, max_tokens=12)
    scheduler.add(seq)
    step(scheduler, worker)  # the prompt: one sampled token
    assert seq.cache.groups[0].block_ids == (0, 1) and seq.num_tokens == 8
    batch = scheduler.schedule()  # the token at 7 and four drafts at 8..11: a third block
    [verify] = batch.sequences
    assert verify.num_tokens == 5 and verify.num_draft_tokens == 4 and len(verify.sampling_rows) == 5
    assert verify.block_ids == (0, 1, 2) and [r.counter for r in verify.sampling_rows] == [1, 2, 3, 4, 5]
    [output] = scheduler.commit(batch, worker.execute(batch))
    scheduler.check_invariants()
    # every draft wrong: the target's own token at 8, computed up to 7, block 2 back in the pool
    assert len(output.new_token_ids) == 1 and seq.num_computed_tokens == 8 and seq.num_tokens == 9
    assert seq.cache.groups[0].block_ids == (0, 1) and pool.num_free_blocks == 6
    assert scheduler.spec_stats.num_draft_tokens == 4 and scheduler.spec_stats.num_accepted_tokens == 0


def test_accepted_drafts_advance_several_tokens_a_step_with_the_reference_tokens() -> None:
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [21, 22, 23]}
    proposer = scripted(prompts, 20, num_drafts=3)
    scheduler, pool, worker = setup(16, proposer)
    for seq_id, prompt in prompts.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=20))
    steps = []
    finished = run_to_completion(scheduler, worker, on_batch=steps.append)
    for seq_id, prompt in prompts.items():
        assert finished[seq_id].token_ids == greedy_reference(prompt, 20)
    # the prompts, then four tokens a step, the last step drafting only 2: max_tokens leaves room for 3
    assert len(steps) == 6 and [s.num_draft_tokens for s in steps[-1].sequences] == [2, 2]
    stats = scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 2 * (4 * 3 + 2)
    assert stats.accepted_by_position == [10, 10, 8] and stats.mean_acceptance_length == 3.8
    assert sorted(proposer.forgotten) == ["a", "b"]


def test_a_stop_inside_the_accepted_drafts_cuts_the_output_there() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    reference = greedy_reference(prompt, 12)
    stop_token = reference[3]  # an accepted draft of the first verify step
    proposer = scripted({"a": prompt}, 12, num_drafts=4)
    scheduler, _, worker = setup(8, proposer)
    scheduler.add(make_seq("a", prompt, max_tokens=12, stop_token_ids=(stop_token,)))
    finished = run_to_completion(scheduler, worker)
    expected = reference[: reference.index(stop_token) + 1]
    assert finished["a"].token_ids == expected and finished["a"].finish_reason.value == "stop"


def test_drafts_without_free_pages_are_dropped_rather_than_paid_for_by_preemption() -> None:
    """A full pool: each sequence's next token fits its last block, its drafts would need a new
    one. The step decodes both without drafts and preempts nobody."""
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 10, 11, 12, 13, 14, 15]}
    proposer = scripted(prompts, 8, num_drafts=4)
    scheduler, pool, worker = setup(4, proposer)
    seqs = [make_seq(seq_id, prompt, max_tokens=8) for seq_id, prompt in prompts.items()]
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler, worker)  # both prompts: blocks [0, 1] and [2, 3], the pool is full
    batch, outputs = step(scheduler, worker)
    assert [(s.num_tokens, s.num_draft_tokens) for s in batch.sequences] == [(1, 0), (1, 0)]
    assert len(outputs) == 2 and all(seq.num_preemptions == 0 for seq in seqs)
    assert scheduler.spec_stats.num_draft_tokens == 0


def test_only_final_tokens_reach_the_prefix_cache() -> None:
    """A block enters the cache once its tokens are final, never while it holds drafts (each
    step's invariant check also compares every cached node's key with the tokens); a second
    request with the same prompt and answer hits what the first left."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    proposer = scripted({"a": prompt, "b": prompt}, 12, num_drafts=4, wrong_from=2)
    scheduler, pool, worker = setup(16, proposer, prefix_caching=True)
    seq = make_seq("a", prompt, max_tokens=12)
    scheduler.add(seq)
    step(scheduler, worker)
    batch = scheduler.schedule()  # final tokens 0..7, drafts at 8..11
    assert len(seq.cache.nodes) == 2 and seq.num_draft_tokens == 4
    scheduler.commit(batch, worker.execute(batch))  # two drafts kept: final tokens 0..10
    scheduler.check_invariants()
    assert len(seq.cache.nodes) == 2 and seq.num_resolved_tokens == 11
    while scheduler.has_unfinished:
        step(scheduler, worker)
        assert 4 * len(seq.cache.nodes) <= seq.num_resolved_tokens
    assert seq.token_ids[7:] == tuple(greedy_reference(prompt, 12))
    again = make_seq("b", list(seq.token_ids[:16]) + [1], max_tokens=1)
    scheduler.add(again)
    step(scheduler, worker)
    assert again.num_cached_tokens == 16


def test_a_sliding_window_group_keeps_what_rejected_drafts_leave_it_to_read() -> None:
    """Window 6 beside a full-attention group: the window's blocks are released only up to what
    a step from the first draft on reads, so after every rejection the next step still finds
    its window, and the tokens are the windowed reference's."""
    window = CacheGroupSpec(KvShape(1, 8, sliding_window=6))
    prompts = {"a": list(range(10, 21)), "b": [30, 31, 32]}
    proposer = scripted(prompts, 16, num_drafts=3, wrong_from=1, windows=(None, 6))
    full_pool, window_pool = BlockPool(16, BLOCK_SIZE), BlockPool(8, BLOCK_SIZE)
    cache = CacheManager.build([KvGroup(FULL_ATTENTION, full_pool), KvGroup(window, window_pool)], False)
    scheduler = scheduler_over(cache, 16, speculation=proposer)
    for seq_id, prompt in prompts.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=16, eos_token_ids=NO_EOS))
    finished = run_to_completion(scheduler, PagedFakeWorker(16, windows=(None, 6)))
    for seq_id, prompt in prompts.items():
        assert finished[seq_id].token_ids == greedy_reference(prompt, 16, windows=(None, 6))
    stats = scheduler.spec_stats
    assert stats.num_verify_steps > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert full_pool.num_free_blocks == 16 and window_pool.num_free_blocks == 8


STATE = CacheGroupSpec(StateShape(conv_dim=8, conv_kernel=4, num_heads=1, key_dim=4, value_dim=4))


def hybrid_setup(prompts, num_drafts, wrong_from, num_slots, num_tokens=12, budget=32):
    proposer = scripted(prompts, num_tokens, num_drafts, wrong_from=wrong_from, num_states=1)
    full_pool, slot_pool = BlockPool(16, BLOCK_SIZE), BlockPool(num_slots, 1)
    cache = CacheManager.build([KvGroup(FULL_ATTENTION, full_pool), StateSlotGroup(STATE, slot_pool)], False)
    scheduler = scheduler_over(cache, budget, speculation=proposer)
    return scheduler, full_pool, slot_pool, PagedFakeWorker(16, num_state_slots=num_slots)


def test_a_recurrent_state_keeps_the_snapshot_after_the_last_accepted_draft() -> None:
    """Slot pool of 8: the sequence holds slot 0; verifying 3 drafts (the second wrong) takes
    snapshot slots 1 2 3 for the states after its last token, d0 and d1. One draft accepted:
    the state after it (snapshot 2) becomes the sequence's slot; 0, 1 and 3 go back."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    scheduler, _, slot_pool, worker = hybrid_setup({"a": prompt}, 3, wrong_from=1, num_slots=8)
    seq = make_seq("a", prompt, max_tokens=12, eos_token_ids=NO_EOS)
    scheduler.add(seq)
    step(scheduler, worker)
    assert seq.cache.groups[1].block_ids == (0,)
    batch = scheduler.schedule()
    scheduler.check_invariants()
    [verify] = batch.sequences
    assert verify.state_slots == (0,) and verify.state_snapshots == ((1, 2, 3),) and slot_pool.num_free_blocks == 4
    [output] = scheduler.commit(batch, worker.execute(batch))
    scheduler.check_invariants()
    assert len(output.new_token_ids) == 2 and seq.num_computed_tokens == 9
    assert seq.cache.groups[1].block_ids == (2,) and slot_pool.num_free_blocks == 7
    batch = scheduler.schedule()  # the next verify continues from slot 2's state
    assert batch.sequences[0].state_slots == (2,)
    scheduler.commit(batch, worker.execute(batch))
    scheduler.check_invariants()


def test_every_draft_accepted_keeps_the_slot_and_frees_the_snapshots() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    scheduler, _, slot_pool, worker = hybrid_setup({"a": prompt}, 3, wrong_from=None, num_slots=4)
    seq = make_seq("a", prompt, max_tokens=12, eos_token_ids=NO_EOS)
    scheduler.add(seq)
    step(scheduler, worker)
    batch, [output] = step(scheduler, worker)
    assert batch.sequences[0].state_snapshots == ((1, 2, 3),) and len(output.new_token_ids) == 4
    assert seq.cache.groups[1].block_ids == (0,) and slot_pool.num_free_blocks == 3


def test_drafts_wait_for_snapshot_slots_rather_than_preempting() -> None:
    """Three sequences over 5 slots: each holds one, so two are left for snapshots, and a
    sequence drafting 3 needs 3: nobody drafts, nobody is preempted."""
    prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12, 13]}
    scheduler, _, slot_pool, worker = hybrid_setup(prompts, 3, wrong_from=None, num_slots=5)
    for seq_id, prompt in prompts.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=12, eos_token_ids=NO_EOS))
    step(scheduler, worker)
    batch, _ = step(scheduler, worker)
    assert not any(s.num_draft_tokens for s in batch.sequences) and scheduler.spec_stats.num_verify_steps == 0


@pytest.mark.parametrize("wrong_from", [None, 0, 1, 2])
@pytest.mark.parametrize("budget", [32, 5])
def test_a_hybrid_cache_speculates_to_the_reference_tokens_and_every_slot_comes_back(wrong_from, budget) -> None:
    """Full attention beside recurrent state, 3 sequences, drafts of 3 right up to `wrong_from`:
    the tokens are the reference's (the fake state absorbs exactly the kept tokens, or a slot
    loses its sequence), with chunked prompts too (budget 5); every block and slot comes back."""
    prompts = {"a": list(range(10, 21)), "b": [30, 31, 32], "c": [40, 41, 42, 43, 44, 45]}
    scheduler, full_pool, slot_pool, worker = hybrid_setup(prompts, 3, wrong_from, num_slots=12, num_tokens=14,
                                                            budget=budget)
    for seq_id, prompt in prompts.items():
        scheduler.add(make_seq(seq_id, prompt, max_tokens=14, eos_token_ids=NO_EOS))
    finished = run_to_completion(scheduler, worker)
    for seq_id, prompt in prompts.items():
        assert finished[seq_id].token_ids == greedy_reference(prompt, 14, num_states=1)
    stats = scheduler.spec_stats
    assert stats.num_verify_steps > 0
    if wrong_from is None:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert full_pool.num_free_blocks == 16 and slot_pool.num_free_blocks == 12

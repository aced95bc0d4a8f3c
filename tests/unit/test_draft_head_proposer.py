"""The draft-head proposer's rounds with tiny numbers (block size 4, 8 blocks) over a fake runner:
which tokens and hidden states each head forward is fed, at which positions, over which blocks,
and how the cache follows verification and comes back whole.

The fake target's hidden state at position p is the row [p, 0] (+1000 in the second column for
the head's own outputs), so each assertion reads which position a row came from."""

from __future__ import annotations

import numpy as np
from test_draft_model_proposer import History

from atlas.domain.batch import ScheduledBatch, ScheduledSequence, StepResult
from atlas.domain.speculative.draft_head import DraftHeadProposer
from atlas.domain.speculative.draft_model import DraftRequest

VOCAB_SIZE = 100


class CountingHead:
    """Samples last token + 1 for every sampling row; its own output at a token is [position,
    1000]. Records each batch as [(seq_id, token_ids, start, block_ids, samples)] and the hidden
    rows it was fed."""

    target_width = 2

    def __init__(self):
        self.batches, self.hidden, self.from_target = [], [], []

    def execute(self, batch: ScheduledBatch, hidden_states: np.ndarray, from_target: bool) -> StepResult:
        self.batches.append([(s.seq_id, s.token_ids, s.start_position, s.block_ids, s.sampling is not None)
                             for s in batch.sequences])
        self.hidden.append(hidden_states.tolist())
        self.from_target.append(from_target)
        outputs = [[s.start_position + i, 1000] for s in batch.sequences for i in range(s.num_tokens)]
        return StepResult(batch.step_id, tuple(s.token_ids[-1] + 1 for s in batch.sequences if s.sampling is not None),
                          hidden_states=np.array(outputs, np.float32))


def target_step(seq_id, start, num_tokens):
    """A committed target step of `num_tokens` tokens at `start`, and its hidden rows [p, 0]."""
    seq = ScheduledSequence(seq_id, (0,) * num_tokens, start, (), None)
    return ScheduledBatch(0, (seq,), 4), np.array([[p, 0] for p in range(start, start + num_tokens)], np.float32)


def proposer(num_blocks=8, max_num_tokens=64):
    runner = CountingHead()
    return DraftHeadProposer(runner, num_blocks, 4, max_num_tokens, VOCAB_SIZE), runner


def test_a_first_round_pairs_each_hidden_state_with_the_token_after_it_then_decodes_on_its_own_output():
    drafts, runner = proposer()
    history = History([10, 11, 12, 13, 14, 15])  # 15 was sampled: the target computed 10 .. 14
    drafts.observe(*target_step("a", 0, 5))
    assert drafts.draft([DraftRequest("a", history, 5, 3)]) == {"a": (16, 17, 18)}
    assert runner.batches == [
        [("a", (11, 12, 13, 14, 15), 0, (0, 1), True)],  # entries 0..4, then d0 and d1 at 5, 6
        [("a", (16,), 5, (0, 1), True)],
        [("a", (17,), 6, (0, 1), True)],
    ]
    assert runner.hidden == [[[p, 0] for p in range(5)], [[4, 1000]], [[5, 1000]]]
    assert runner.from_target == [True, False, False]
    assert drafts.num_free_blocks == 6  # the drafts' entries are gone: entries 0..4 in two blocks
    drafts.check_invariants()


def test_the_next_round_feeds_the_accepted_tokens_with_the_targets_hidden_states_of_the_verify_step():
    drafts, runner = proposer()
    history = History([10, 11, 12, 13, 14, 15])
    drafts.observe(*target_step("a", 0, 5))
    drafts.draft([DraftRequest("a", history, 5, 3)])
    # the verify step computed 15 16 17 18 at 5..8; 16 and 17 accepted, then 30
    drafts.observe(*target_step("a", 5, 4))
    history.token_ids += [16, 17, 30]
    runner.batches.clear()
    runner.hidden.clear()
    assert drafts.draft([DraftRequest("a", history, 8, 2)]) == {"a": (31, 32)}
    assert runner.batches == [
        [("a", (16, 17, 30), 5, (0, 1, 2), True)],  # entries 5..7: h5 h6 h7 with the tokens after them, d1 at 8
        [("a", (31,), 8, (0, 1, 2), True)],
    ]
    assert runner.hidden == [[[5, 0], [6, 0], [7, 0]], [[7, 1000]]]
    drafts.check_invariants()


def test_a_prefilling_sequence_follows_the_target_a_step_behind_and_drafts_once_caught_up():
    drafts, runner = proposer()
    history = History(list(range(20, 32)))  # a 12-token prompt, computed in chunks of 5
    drafts.observe(*target_step("a", 0, 5))
    assert drafts.draft([DraftRequest("a", history, 5, 0)]) == {}
    assert runner.batches[-1] == [("a", (21, 22, 23, 24, 25), 0, (0, 1), False)]
    drafts.observe(*target_step("a", 5, 5))
    drafts.observe(*target_step("a", 10, 2))
    history.token_ids.append(40)  # the last chunk sampled 40
    assert drafts.draft([DraftRequest("a", history, 12, 2)]) == {"a": (41, 42)}
    assert runner.batches[-2] == [("a", tuple(range(26, 32)) + (40,), 5, (0, 1, 2, 3), True)]  # d1 at 12
    assert runner.hidden[-2] == [[p, 0] for p in range(5, 12)]
    drafts.check_invariants()


def test_positions_the_head_never_saw_are_fed_zero_hidden_states():
    drafts, runner = proposer()
    history = History([10, 11, 12, 13, 14, 15])
    drafts.observe(*target_step("a", 3, 2))  # 0..2 came from the prefix cache
    drafts.draft([DraftRequest("a", history, 5, 1)])
    assert runner.hidden[0] == [[0, 0], [0, 0], [0, 0], [3, 0], [4, 0]]


def test_forgetting_returns_every_block_and_hidden_state_and_others_are_dropped_by_the_next_round():
    drafts, runner = proposer()
    for seq_id in ("a", "b"):
        drafts.observe(*target_step(seq_id, 0, 5))
    drafts.draft([DraftRequest(seq_id, History([1, 2, 3, 4, 5, 6]), 5, 2) for seq_id in ("a", "b")])
    assert drafts.num_free_blocks == 4 and drafts.num_sequences == 2
    drafts.forget("a")
    drafts.observe(*target_step("c", 0, 3))  # a sequence aborted after its step was scheduled
    drafts.draft([])
    drafts.forget("b")
    assert drafts.num_free_blocks == 8 and drafts.num_sequences == 0
    drafts.check_invariants()


def test_a_pool_too_small_leaves_a_sequence_undrafted_and_its_hidden_states_kept():
    drafts, runner = proposer(num_blocks=2)
    drafts.observe(*target_step("a", 0, 5))
    drafts.observe(*target_step("b", 0, 5))
    requests = [DraftRequest(seq_id, History([1, 2, 3, 4, 5, 6]), 5, 2) for seq_id in ("a", "b")]
    assert set(drafts.draft(requests)) == {"a"}
    drafts.forget("a")
    assert set(drafts.draft(requests[1:])) == {"b"}
    assert runner.hidden[-2] == [[p, 0] for p in range(5)]

"""The draft-model proposer's rounds with tiny numbers (block size 4, 8 blocks) over a fake runner
whose "model" drafts last token + 1: which tokens each draft forward computes, at which
positions, over which blocks, and how the cache follows verification and comes back whole."""

from __future__ import annotations

from atlas.domain.batch import ScheduledBatch, StepResult
from atlas.domain.speculative.draft_model import DraftModelProposer, DraftRequest

VOCAB_SIZE = 100


class History:
    """A sequence's final tokens (`TokenHistory`)."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)

    @property
    def num_final_tokens(self):
        return len(self.token_ids)

    def tokens_slice(self, start, stop):
        return self.token_ids[start:stop]


class CountingRunner:
    """Samples last token + 1 for every sampling row; records each batch as
    [(seq_id, token_ids, start, block_ids, samples)]."""

    def __init__(self):
        self.batches = []

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.batches.append([(s.seq_id, s.token_ids, s.start_position, s.block_ids, s.sampling is not None)
                             for s in batch.sequences])
        return StepResult(batch.step_id, tuple(s.token_ids[-1] + 1
                                               for s in batch.sequences if s.sampling is not None))


def proposer(num_blocks=8, max_num_tokens=64):
    runner = CountingRunner()
    return DraftModelProposer(runner, num_blocks, 4, max_num_tokens, VOCAB_SIZE), runner


def test_a_first_round_prefills_the_final_tokens_then_decodes_k_minus_one_drafts():
    drafts, runner = proposer()
    history = History([10, 11, 12, 13, 14, 15])
    assert drafts.draft([DraftRequest("a", history, 5, 3)]) == {"a": (16, 17, 18)}
    assert runner.batches == [
        [("a", (10, 11, 12, 13, 14, 15), 0, (0, 1), True)],  # positions 0..5, then d0 and d1 at 6, 7
        [("a", (16,), 6, (0, 1), True)],
        [("a", (17,), 7, (0, 1), True)],
    ]
    assert drafts.num_free_blocks == 6
    drafts.check_invariants()


def test_the_next_round_keeps_the_accepted_drafts_and_feeds_what_follows():
    drafts, runner = proposer()
    history = History([10, 11, 12, 13, 14, 15])
    drafts.draft([DraftRequest("a", history, 5, 3)])
    history.token_ids += [16, 40]  # d0 accepted, d1 rejected: the target's 40 follows
    runner.batches.clear()
    assert drafts.draft([DraftRequest("a", history, 7, 3)]) == {"a": (41, 42, 43)}
    # the round's blocks are reserved before its first forward: positions up to 9 need block 2
    assert runner.batches == [[("a", (40,), 7, (0, 1, 2), True)], [("a", (41,), 8, (0, 1, 2), True)],
                              [("a", (42,), 9, (0, 1, 2), True)]]
    history.token_ids += [41, 42, 43, 44]  # every draft accepted, the bonus 44: d2 was never fed
    runner.batches.clear()
    assert drafts.draft([DraftRequest("a", history, 11, 1)]) == {"a": (45,)}
    assert runner.batches == [[("a", (43, 44), 10, (0, 1, 2), True)]]
    assert drafts.num_free_blocks == 5
    drafts.check_invariants()


def test_a_rejected_first_draft_rolls_back_to_the_final_tokens_and_frees_the_blocks_past_them():
    drafts, runner = proposer()
    history = History([1, 2, 3, 4, 5, 6, 7])
    drafts.draft([DraftRequest("a", history, 6, 4)])  # writes positions 0..9: blocks 0, 1, 2
    assert drafts.num_free_blocks == 5
    history.token_ids.append(50)
    runner.batches.clear()
    drafts.draft([DraftRequest("a", history, 7, 0)])  # only catching up: nothing to feed, no drafts
    assert runner.batches == [] and drafts.num_free_blocks == 6  # 8 positions: blocks 0, 1
    drafts.check_invariants()


def test_drafts_nobody_verified_are_computed_again_next_round():
    drafts, runner = proposer()
    history = History([1, 2, 3, 4, 5])
    drafts.draft([DraftRequest("a", history, 4, 2)])
    runner.batches.clear()
    assert drafts.draft([DraftRequest("a", history, 4, 2)]) == {"a": (6, 7)}  # the step dropped them
    # rolled back to 4 tokens (block 1 freed, to the back of the free list), then grown again
    assert runner.batches == [[("a", (5,), 4, (0, 2), True)], [("a", (6,), 5, (0, 2), True)]]


def test_prefilling_sequences_follow_the_target_within_the_token_budget_oldest_first():
    drafts, runner = proposer(max_num_tokens=10)
    a, b = History(range(20, 32)), History(range(40, 52))
    assert drafts.draft([DraftRequest("a", a, 8, 0), DraftRequest("b", b, 8, 0)]) == {}
    assert runner.batches == [[("a", tuple(range(20, 28)), 0, (0, 1), False), ("b", (40, 41), 0, (2,), False)]]
    runner.batches.clear()
    drafts.draft([DraftRequest("a", a, 11, 0), DraftRequest("b", b, 8, 0)])
    assert runner.batches == [[("a", (28, 29, 30), 8, (0, 1, 3), False), ("b", tuple(range(42, 48)), 2, (2, 4),
                                                                           False)]]
    drafts.check_invariants()


def test_a_pool_too_small_for_the_drafts_catches_up_without_them_and_forget_returns_everything():
    drafts, runner = proposer(num_blocks=3)
    a, b = History(range(8)), History(range(10, 14))
    # a: 8 tokens + 2 drafts fed need 3 blocks; b then has none: it waits
    assert drafts.draft([DraftRequest("a", a, 7, 3), DraftRequest("b", b, 3, 3)]) == {"a": (8, 9, 10)}
    assert [entry[0] for entry in runner.batches[0]] == ["a"]
    drafts.forget("a")
    runner.batches.clear()
    # b's 4 tokens and 2 fed drafts need 2 blocks of the 3
    assert drafts.draft([DraftRequest("b", b, 3, 3)]) == {"b": (14, 15, 16)}
    drafts.forget("b")
    drafts.forget("never-seen")
    assert drafts.num_free_blocks == drafts.num_blocks == 3 and drafts.num_sequences == 0
    drafts.check_invariants()


def test_a_draft_outside_the_targets_vocabulary_ends_the_drafts_there():
    drafts, _ = proposer()
    assert drafts.draft([DraftRequest("a", History([96, 97]), 1, 4)]) == {"a": (98, 99)}  # 100 is no token
    drafts.check_invariants()

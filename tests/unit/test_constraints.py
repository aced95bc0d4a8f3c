"""Token constraints: the reasoning phase and its budget, then the grammar, as masks.

A fake grammar accepts one fixed token sequence, so every mask is known exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.residue_grammar import ResidueGrammar

from atlas.domain.constraints import ConstraintViolation, TokenConstraint, fill_batch_bitmask
from atlas.domain.reasoning_budget import ReasoningMarkers
from atlas.domain.token_mask import allowed_bits, bitmask_width

VOCAB = 70
EOS = 0
THINK, END_THINK, NEWLINE, BLANK_LINE = 60, 61, 10, 11
MARKERS = ReasoningMarkers(THINK, END_THINK, (NEWLINE, END_THINK, BLANK_LINE))


class SequenceGrammar:
    """A GrammarMatcher that accepts exactly `token_ids`, then end-of-sequence."""

    def __init__(self, token_ids: list[int], position: int = 0) -> None:
        self.token_ids = token_ids
        self.position = position
        self.broken = False

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        bitmask_row[:] = 0
        allowed = EOS if self.is_finished else self.token_ids[self.position]
        bitmask_row.view(np.uint32)[allowed >> 5] |= np.uint32(1 << (allowed & 31))

    def accept_token(self, token_id: int) -> bool:
        if self.is_finished or token_id != self.token_ids[self.position]:
            self.broken = True
            return False
        self.position += 1
        return True

    def allows(self, token_id: int) -> bool:
        return not self.is_finished and token_id == self.token_ids[self.position]

    def try_accept_token(self, token_id: int) -> bool:
        return self.allows(token_id) and self.accept_token(token_id)

    superset = None

    def rollback(self, num_tokens: int) -> None:
        assert num_tokens <= self.position
        self.position -= num_tokens

    def fork(self) -> SequenceGrammar:
        return SequenceGrammar(self.token_ids, self.position)

    @property
    def is_accepting(self) -> bool:
        return self.position == len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.is_accepting or self.broken


def allowed(constraint: TokenConstraint) -> list[int] | None:
    """The ids the constraint allows next, or None for any."""
    row = np.zeros(bitmask_width(VOCAB), dtype=np.int32)
    if not constraint.mask_for_next(row):
        return None
    return np.flatnonzero(allowed_bits(row, VOCAB)).tolist()


def test_a_grammar_alone_masks_every_token_and_rejects_others() -> None:
    constraint = TokenConstraint(SequenceGrammar([5, 6]))
    assert allowed(constraint) == [5]
    constraint.accept(5)
    assert allowed(constraint) == [6]
    with pytest.raises(ConstraintViolation):
        constraint.accept(7)


def test_the_budget_forces_the_end_of_reasoning_then_the_grammar_starts() -> None:
    constraint = TokenConstraint(SequenceGrammar([5, 6]), MARKERS, starts_in_reasoning=True, thinking_budget=3)
    for token_id in (20, 21, 22):
        assert constraint.in_reasoning and allowed(constraint) is None
        constraint.accept(token_id)
    for forced in (NEWLINE, END_THINK, BLANK_LINE):
        assert allowed(constraint) == [forced]
        constraint.accept(forced)
    assert not constraint.in_reasoning
    assert allowed(constraint) == [5]
    constraint.accept(5)
    constraint.accept(6)
    assert allowed(constraint) == [EOS] and constraint.grammar_finished


def test_a_zero_budget_closes_the_block_at_once() -> None:
    constraint = TokenConstraint(None, MARKERS, starts_in_reasoning=True, thinking_budget=0)
    assert allowed(constraint) == [NEWLINE]


def test_without_a_grammar_the_answer_after_the_budget_is_free() -> None:
    constraint = TokenConstraint(None, MARKERS, starts_in_reasoning=True, thinking_budget=1)
    constraint.accept(20)
    for forced in MARKERS.forced_end_token_ids:
        assert allowed(constraint) == [forced]
        constraint.accept(forced)
    assert allowed(constraint) is None


def test_a_natural_end_forces_only_the_padding_before_a_grammar() -> None:
    constraint = TokenConstraint(SequenceGrammar([5]), MARKERS, starts_in_reasoning=True, thinking_budget=100)
    constraint.accept(20)
    constraint.accept(END_THINK)
    assert not constraint.in_reasoning
    assert allowed(constraint) == [BLANK_LINE]
    constraint.accept(BLANK_LINE)
    assert allowed(constraint) == [5]
    free = TokenConstraint(None, MARKERS, starts_in_reasoning=True)
    free.accept(END_THINK)
    assert allowed(free) is None


def test_the_first_token_may_open_a_block_or_start_the_answer() -> None:
    thinking = TokenConstraint(SequenceGrammar([5]), MARKERS, thinking_budget=1)
    assert allowed(thinking) == [5, THINK]
    thinking.accept(THINK)
    assert thinking.in_reasoning and allowed(thinking) is None
    thinking.accept(20)
    assert allowed(thinking) == [NEWLINE]
    answering = TokenConstraint(SequenceGrammar([5, 6]), MARKERS)
    answering.accept(5)
    assert allowed(answering) == [6] and not answering.in_reasoning


def test_rollback_crosses_phases_and_rewinds_the_grammar() -> None:
    grammar = SequenceGrammar([5, 6])
    constraint = TokenConstraint(grammar, MARKERS, starts_in_reasoning=True, thinking_budget=1)
    masks = []
    for token_id in (20, NEWLINE, END_THINK, BLANK_LINE, 5):
        masks.append(allowed(constraint))
        constraint.accept(token_id)
    constraint.rollback(3)  # back to before END_THINK
    assert allowed(constraint) == masks[2] == [END_THINK] and grammar.position == 0
    constraint.rollback(2)
    assert allowed(constraint) is None and constraint.in_reasoning
    with pytest.raises(ValueError, match="rollback"):
        constraint.rollback(1)


def test_rollback_is_bounded_by_the_history_it_keeps() -> None:
    constraint = TokenConstraint(None, MARKERS, starts_in_reasoning=True, max_rollback_tokens=2)
    for token_id in (20, 21, 22):
        constraint.accept(token_id)
    with pytest.raises(ValueError, match="2 can be"):
        constraint.rollback(3)
    constraint.rollback(2)


def test_a_token_against_the_forced_end_is_a_violation() -> None:
    constraint = TokenConstraint(None, MARKERS, starts_in_reasoning=True, thinking_budget=0)
    with pytest.raises(ConstraintViolation, match="forces 10"):
        constraint.accept(20)


def test_a_batch_fills_every_row() -> None:
    forced = TokenConstraint(None, MARKERS, starts_in_reasoning=True, thinking_budget=0)
    opening = TokenConstraint(SequenceGrammar([7]), MARKERS)
    free = TokenConstraint(None, MARKERS, starts_in_reasoning=True)
    bitmask = np.zeros((5, bitmask_width(VOCAB)), dtype=np.int32)
    assert fill_batch_bitmask([None, forced, opening, free], bitmask, compiler=None)
    bits = allowed_bits(bitmask, VOCAB)
    assert bits[0].all() and bits[3].all()
    assert np.flatnonzero(bits[1]).tolist() == [NEWLINE]
    assert np.flatnonzero(bits[2]).tolist() == [7, THINK]
    assert not bits[4].any(), "rows past the constraints are left alone"
    assert not fill_batch_bitmask([None, free], bitmask, compiler=None)


def test_the_batch_uses_the_compilers_parallel_fill() -> None:
    calls = []

    class Compiler:
        vocab_size = VOCAB

        def fill_bitmasks(self, rows, bitmask):
            calls.append([row for _, row in rows])
            for matcher, row in rows:
                matcher.fill_bitmask(bitmask[row])

    bitmask = np.zeros((3, bitmask_width(VOCAB)), dtype=np.int32)
    constraints = [TokenConstraint(SequenceGrammar([3])), None, TokenConstraint(SequenceGrammar([4]), MARKERS)]
    fill_batch_bitmask(constraints, bitmask, Compiler())
    assert calls == [[0, 2]]
    assert np.flatnonzero(allowed_bits(bitmask[2], VOCAB)).tolist() == [4, THINK]


def test_a_loosely_sampled_token_the_grammar_refuses_is_not_accepted_and_the_position_goes_exact() -> None:
    grammar = ResidueGrammar(9, loose=True)  # position i: ids below 90 that are i mod 3; superset: any
    constraint = TokenConstraint(grammar, loose_masks=True)
    assert constraint.next_token_rule().matcher is grammar  # the first token is always exact
    assert constraint.accept_sampled(3)
    assert constraint.next_token_rule().matcher is grammar.superset
    assert not constraint.accept_sampled(6)  # 6 is 0 mod 3, position 1 wants 1 mod 3
    assert grammar.position == 1 and not grammar.broken
    assert constraint.next_token_rule().matcher is grammar  # the redraw is masked exactly
    assert constraint.accept_sampled(4)
    assert grammar.position == 2 and constraint.next_token_rule().matcher is grammar.superset
    with pytest.raises(ConstraintViolation):
        TokenConstraint(ResidueGrammar(9), loose_masks=True).accept_sampled(4)  # an exact mask forbade it

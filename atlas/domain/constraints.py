"""Per-sequence token constraints: a reasoning phase with its budget, then a grammar.

A constrained sequence goes through up to four phases, one token at a time:

    OPENING ──<think>──> REASONING ──budget──> CLOSING ──forced end──> ANSWER (grammar)
       │                     │                    ^                      ^
       │                     └──</think>──────────┘ (the padding after   │
       │                                             the tag, if a       │
       │                                             grammar follows)    │
       └──────────────────── any other first token ──────────────────────┘
    (starts in REASONING when the template opened the block; in ANSWER when thinking is off)

OPENING is the first token only: the model may open a reasoning block (the grammar's mask
plus the start token) or begin the answer. REASONING is free text counted against the budget,
except that it may not end the output (`end_token_ids`): the block is closed by the model or
by the budget, so the answer (and its grammar) always follows. CLOSING forces a fixed token
sequence through a one-bit mask. ANSWER follows the grammar, or is free without one.

The engine drives it per step, with the mask computation off the device's critical path:

    step N+1's forward is enqueued (its sampling waits)
    step N's tokens are committed:           constraint.accept(token)
    while the device runs N+1's forward:     fill_step_bitmask(rows, bitmask [R, W])
    the sampler of step N+1 applies the uploaded bitmask

Rows that need no mask are all ones, and the fill says whether any row needed one, so a step
with no constrained row ships no mask at all. A sequence verifying speculative drafts has one
row per position: row j holds the mask after drafts[:j], found by accepting the drafts in turn
and rolling them back; a draft its row forbids can never be accepted, so the rows after it
are all ones.

Loose masks. A grammar whose matcher has a `superset` (a looser grammar whose masks cost far
less, as a JSON schema without its string length bounds) may be sampled under the superset's
mask. The engine then checks the sampled token (`admits`) before committing it: allowed, it is
accepted as usual; refused, the position is sampled again under the exact mask (the engine
recomputes the sequence's last token, `Scheduler.resample`). The sampler's draw is a
Gumbel-max race whose scores are fixed by (seed, position, token) (`atlas.ports.kernels.
sampling`), so the token it picks under a mask is the best-scoring one the mask allows: if
the superset's winner is allowed it is also the exact mask's winner, and if not, the redraw at
the same position under the exact mask picks that winner. Either way the row gets the very
token exact masking gives, greedy or sampled, provided no top-p, top-k or min-p cut (which
depends on the mask) comes before the race. The first token of a grammar is always sampled
under the exact mask (its recompute would rewrite the prompt's last position).

A request carries its constraint as plain data (`Request.constraint`); the engine turns it into
a `TokenConstraint` per sequence through a `GrammarCache` (`atlas.domain.request_constraints`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from atlas.domain.requests import ReasoningMarkers
from atlas.domain.token_mask import ALL_ALLOWED, allow, allow_only, forbid, is_allowed
from atlas.ports.grammar import GrammarCompiler, GrammarLimitError, GrammarMatcher

DEFAULT_MAX_ROLLBACK_TOKENS = 64


class ConstraintViolation(ValueError):
    """A token the constraint did not allow was accepted (a sampler that ignored the mask)."""


class GrammarGaveUp(ConstraintViolation):
    """The grammar engine gave up on the request's grammar while it advanced (GrammarLimitError:
    a resource limit ran out on a grammar that compiled). Not the engine's fault: the request
    ends with an error naming its grammar, as for an invalid one."""


class _Phase(Enum):
    OPENING = "opening"
    REASONING = "reasoning"
    CLOSING = "closing"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class _State:
    phase: _Phase
    num_reasoning_tokens: int = 0
    forced_token_ids: tuple[int, ...] = ()
    num_forced: int = 0


@dataclass(frozen=True, slots=True)
class ForcedToken:
    """The next token is fixed."""

    token_id: int


@dataclass(frozen=True, slots=True)
class GrammarTokens:
    """The next token is one the grammar allows, or one of `extra_token_ids`."""

    matcher: GrammarMatcher
    extra_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AnyTokenBut:
    """The next token is any but `token_ids` (end-of-sequence inside a reasoning block)."""

    token_ids: frozenset[int]


NextTokenRule = ForcedToken | GrammarTokens | AnyTokenBut | None  # None: any token


class TokenConstraint:
    """What one sequence may sample next, advanced token by token (see the module doc).

    `thinking_budget` None means no limit; 0 ends a block as soon as it opens.
    `end_token_ids` (end-of-sequence) may not be sampled inside the block. Up to
    `max_rollback_tokens` accepted tokens can be rolled back (rejected speculative drafts).
    `loose_masks` lets the grammar's rows be masked by its matcher's superset (module doc).
    """

    __slots__ = ("_grammar", "_markers", "_budget", "_end_ids", "_state", "_history", "_loose", "_exact_next",
                 "_num_grammar_tokens", "_rule", "_gave_up")

    def __init__(
        self,
        grammar: GrammarMatcher | None,
        markers: ReasoningMarkers | None = None,
        starts_in_reasoning: bool = False,
        thinking_budget: int | None = None,
        end_token_ids: frozenset[int] = frozenset(),
        max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS,
        loose_masks: bool = False,
    ) -> None:
        if thinking_budget is not None and thinking_budget < 0:
            raise ValueError(f"thinking_budget: must be >= 0 (got {thinking_budget})")
        self._grammar = grammar
        self._loose = loose_masks and grammar is not None
        self._exact_next = False  # a loosely sampled token was refused: this position goes exact
        self._gave_up = False  # the grammar engine gave up on the matcher (GrammarGaveUp raised)
        self._num_grammar_tokens = 0
        self._rule: GrammarTokens | None = None  # the answer's rule, kept while it masks with the same matcher
        self._markers = markers
        self._budget = thinking_budget
        self._end_ids = frozenset(end_token_ids)
        self._history: deque[tuple[_State, bool]] = deque(maxlen=max_rollback_tokens)
        if markers is None:
            self._state = _State(_Phase.ANSWER)
        elif starts_in_reasoning:
            self._state = self._checked_budget(_State(_Phase.REASONING))
        else:
            self._state = _State(_Phase.OPENING)

    @property
    def in_reasoning(self) -> bool:
        """True while the reasoning block is open (its end tag not yet accepted)."""
        state = self._state
        if state.phase is _Phase.CLOSING:
            assert self._markers is not None
            return self._markers.end_token_id in state.forced_token_ids[state.num_forced :]
        return state.phase is _Phase.REASONING

    @property
    def grammar_finished(self) -> bool:
        """True when a grammar is complete: only end-of-sequence may follow."""
        return self._state.phase is _Phase.ANSWER and self._grammar is not None and self._grammar.is_finished

    def next_token_rule(self) -> NextTokenRule:
        """What the next token must satisfy."""
        state = self._state
        if state.phase is _Phase.ANSWER:  # every step of a grammar's rows: no new rule object
            if self._grammar is None:
                return None
            matcher = self._mask_grammar()
            rule = self._rule
            if rule is None or rule.matcher is not matcher:
                rule = self._rule = GrammarTokens(matcher)
            return rule
        if state.phase is _Phase.CLOSING:
            return ForcedToken(state.forced_token_ids[state.num_forced])
        if state.phase is _Phase.REASONING:
            return AnyTokenBut(self._end_ids) if self._end_ids else None
        if self._grammar is None:
            return None
        assert self._markers is not None  # OPENING
        return GrammarTokens(self._grammar, (self._markers.start_token_id,))

    @property
    def may_sample_loosely(self) -> bool:
        """True when some token of this sequence may be masked by the grammar's superset."""
        return self._loose and self._grammar is not None and self._grammar.superset is not None

    def admits(self, token_id: int) -> bool:
        """Whether the token sampled under the current mask may be accepted: always under an
        exact mask; under a superset's, when the grammar allows it. A refused token is not
        accepted, and the next mask of this position is the exact one (module doc)."""
        grammar = self._grammar
        if self._state.phase is not _Phase.ANSWER or grammar is None or self._mask_grammar() is grammar:
            return True
        if self._gave_up:  # not sampled again: its accept ends the request (GrammarGaveUp)
            return True
        if grammar.allows(token_id):
            return True
        self._exact_next = True
        return False

    def accept_sampled(self, token_id: int) -> bool:
        """`admits` then `accept` in one call, for a step's sampled token: False, accepting
        nothing, when the grammar refuses a token sampled under its superset's mask; raises
        ConstraintViolation as `accept` does. The answer's tokens take one matcher call
        (`try_accept_token`): a step runs this for each of its rows before its next masks."""
        state, grammar = self._state, self._grammar
        if state.phase is not _Phase.ANSWER or grammar is None:
            self.accept(token_id)
            return True
        try:
            accepted = grammar.try_accept_token(token_id)
        except GrammarLimitError as error:
            raise self._give_up(error) from None
        if not accepted:
            if self._mask_grammar() is grammar:  # sampled under the exact mask
                raise ConstraintViolation(f"token {token_id} is not allowed by the request's grammar")
            self._exact_next = True
            return False
        self._num_grammar_tokens += 1
        self._history.append((state, True))
        self._exact_next = False
        return True

    def _mask_grammar(self) -> GrammarMatcher:
        grammar = self._grammar
        assert grammar is not None
        if not self._loose or self._exact_next or self._num_grammar_tokens == 0:
            return grammar
        superset = grammar.superset
        return grammar if superset is None else superset

    def mask_for_next(self, bitmask_row: np.ndarray) -> bool:
        """Write the allowed next tokens into `bitmask_row` (int32 [ceil(V / 32)]).

        Returns False, leaving the row untouched, when any token may follow.
        """
        rule = self.next_token_rule()
        if rule is None:
            return False
        if isinstance(rule, ForcedToken):
            allow_only(bitmask_row, (rule.token_id,))
        elif isinstance(rule, AnyTokenBut):
            bitmask_row[:] = ALL_ALLOWED
            forbid(bitmask_row, rule.token_ids)
        else:
            rule.matcher.fill_bitmask(bitmask_row)
            allow(bitmask_row, rule.extra_token_ids)
        return True

    def accept(self, token_id: int) -> None:
        """Advance past the sampled `token_id`.

        Raises ConstraintViolation when the token was not allowed (the state is unchanged,
        except a grammar that rejected the token stays broken).
        """
        before = self._state
        if before.phase is _Phase.ANSWER:  # the common case first
            self._history.append((before, self._answer(token_id)))
            self._exact_next = False
            return
        consumed_by_grammar = False
        if before.phase is _Phase.OPENING:
            assert self._markers is not None
            if token_id == self._markers.start_token_id:
                self._state = self._checked_budget(_State(_Phase.REASONING))
            else:
                consumed_by_grammar = self._answer(token_id)
                self._state = _State(_Phase.ANSWER)
        elif before.phase is _Phase.REASONING:
            self._state = self._reasoning(before, token_id)
        elif before.phase is _Phase.CLOSING:
            expected = before.forced_token_ids[before.num_forced]
            if token_id != expected:
                raise ConstraintViolation(f"token {token_id} sampled where the reasoning end forces {expected}")
            num_forced = before.num_forced + 1
            done = num_forced == len(before.forced_token_ids)
            self._state = _State(_Phase.ANSWER) if done else replace(before, num_forced=num_forced)
        self._history.append((before, consumed_by_grammar))
        self._exact_next = False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts; ValueError past what the history keeps."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"rollback: {num_tokens} tokens asked back, {len(self._history)} can be")
        num_grammar_tokens = 0
        for _ in range(num_tokens):
            state, consumed_by_grammar = self._history.pop()
            num_grammar_tokens += consumed_by_grammar
            self._state = state
        if num_grammar_tokens:
            assert self._grammar is not None
            if not self._gave_up:  # a matcher given up on takes nothing back; the request ends
                self._grammar.rollback(num_grammar_tokens)
            self._num_grammar_tokens -= num_grammar_tokens

    def _reasoning(self, state: _State, token_id: int) -> _State:
        assert self._markers is not None
        if token_id in self._end_ids:
            raise ConstraintViolation(f"token {token_id} ends the output inside the reasoning block")
        if token_id == self._markers.end_token_id:
            padding = self._markers.after_end_token_ids
            if self._grammar is not None and padding:  # the answer's grammar starts where the template's does
                return _State(_Phase.CLOSING, state.num_reasoning_tokens, padding)
            return _State(_Phase.ANSWER, state.num_reasoning_tokens)
        return self._checked_budget(replace(state, num_reasoning_tokens=state.num_reasoning_tokens + 1))

    def _checked_budget(self, state: _State) -> _State:
        """CLOSING with the forced end once the reasoning has used its budget."""
        if self._budget is None or state.num_reasoning_tokens < self._budget:
            return state
        assert self._markers is not None
        return _State(_Phase.CLOSING, state.num_reasoning_tokens, self._markers.forced_end_token_ids)

    def _give_up(self, error: GrammarLimitError) -> GrammarGaveUp:
        """The grammar engine gave up on the matcher: it is not sampled again nor rolled back,
        and the violation to raise ends the request (GrammarGaveUp)."""
        self._gave_up = True
        return GrammarGaveUp(str(error))

    def _answer(self, token_id: int) -> bool:
        if self._grammar is None:
            return False
        try:
            accepted = self._grammar.accept_token(token_id)
        except GrammarLimitError as error:
            raise self._give_up(error) from None
        if not accepted:
            raise ConstraintViolation(f"token {token_id} is not allowed by the request's grammar")
        self._num_grammar_tokens += 1
        return True


@dataclass(slots=True)
class GrammarRows:
    """The grammar rows of a batch's masks, left to fill (`plan_batch_bitmask`)."""

    rows: list[tuple[GrammarMatcher, int]]
    extras: list[tuple[int, tuple[int, ...]]]  # (row, tokens allowed besides the grammar's)
    any_constrained: bool

    def fill(self, bitmask: np.ndarray, compiler: GrammarCompiler | None) -> bool:
        """Fill the grammar rows (in parallel through `compiler`, else one by one), then allow
        the extras; returns whether any row of the batch is constrained. Native work: a
        mask thread runs this outside the GIL but for the loop over the extras."""
        if self.rows:
            if compiler is not None:
                compiler.fill_bitmasks(self.rows, bitmask)
            else:
                for matcher, row in self.rows:
                    matcher.fill_bitmask(bitmask[row])
        for row, token_ids in self.extras:  # after the fill, which overwrites whole rows
            allow(bitmask[row], token_ids)
        return self.any_constrained


def plan_batch_bitmask(
    constraints: Sequence[TokenConstraint | None], bitmask: np.ndarray, rows: Sequence[int] | None = None
) -> GrammarRows:
    """Write every row of `bitmask` that needs no grammar (all ones for unconstrained rows, a
    forced token, all but end-of-sequence) and return the grammar rows left to fill: rows[i]
    (None: row i) for constraints[i]."""
    grammar = GrammarRows([], [], False)
    for index, constraint in enumerate(constraints):
        row = index if rows is None else rows[index]
        rule = constraint.next_token_rule() if constraint is not None else None
        if rule is None:
            bitmask[row] = ALL_ALLOWED
            continue
        grammar.any_constrained = True
        if isinstance(rule, ForcedToken):
            allow_only(bitmask[row], (rule.token_id,))
        elif isinstance(rule, AnyTokenBut):
            bitmask[row] = ALL_ALLOWED
            forbid(bitmask[row], rule.token_ids)
        else:
            grammar.rows.append((rule.matcher, row))
            if rule.extra_token_ids:
                grammar.extras.append((row, rule.extra_token_ids))
    return grammar


def fill_batch_bitmask(
    constraints: Sequence[TokenConstraint | None],
    bitmask: np.ndarray,
    compiler: GrammarCompiler | None,
    rows: Sequence[int] | None = None,
) -> bool:
    """Fill row rows[i] of `bitmask` (int32 [R, W]) for constraints[i] (rows None: row i).

    Unconstrained rows (None, or no rule now) become all ones. Grammar rows are filled in one
    `compiler.fill_bitmasks` call (in parallel); without a compiler, one by one. Returns True
    when any row is constrained, False when the sampler can skip the mask.
    """
    return plan_batch_bitmask(constraints, bitmask, rows).fill(bitmask, compiler)


def fill_step_bitmask(
    rows: Sequence[tuple[TokenConstraint | None, Sequence[int]]], bitmask: np.ndarray, compiler: GrammarCompiler | None
) -> bool:
    """Fill a step's masks: entry i is a sampling sequence's (constraint or None, drafts) and
    takes 1 + len(drafts) consecutive rows of `bitmask` (int32 [R, W]), in order.

        entry    a (no drafts)   b (drafts x0 x1)              c (None, drafts y0)
        rows     0               1          2        3          4     5
        mask     a's next        b's next   after x0 after x1   ones  ones

    Row j of an entry is the mask after its drafts[:j], filled a round per draft position (each
    round in one parallel fill), accepting draft j when row j allows it; a forbidden draft
    leaves the entry's later rows all ones (nothing after it can be accepted). Every draft
    accepted here is rolled back before returning. Returns whether any row is constrained.
    """
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([1 + len(drafts) for _, drafts in rows], out=starts[1:])
    num_accepted = [0] * len(rows)
    live = [constraint is not None for constraint, _ in rows]
    any_constrained = False
    try:
        for position in range(1 + max((len(drafts) for _, drafts in rows), default=0)):
            round_rows, round_constraints, entries = [], [], []
            for index, (constraint, drafts) in enumerate(rows):
                if position > len(drafts):
                    continue
                row = int(starts[index]) + position
                if not live[index]:
                    bitmask[row] = ALL_ALLOWED
                    continue
                round_rows.append(row)
                round_constraints.append(constraint)
                entries.append(index)
            if not round_rows:
                continue
            any_constrained |= fill_batch_bitmask(round_constraints, bitmask, compiler, round_rows)
            for index, row in zip(entries, round_rows):
                constraint, drafts = rows[index]
                if position == len(drafts):
                    continue
                if not is_allowed(bitmask[row], drafts[position]):
                    live[index] = False
                    continue
                try:
                    constraint.accept(drafts[position])  # type: ignore[union-attr]
                except GrammarGaveUp:  # the commit's accept ends the request; no later row counts
                    live[index] = False
                    continue
                num_accepted[index] += 1
    finally:
        for (constraint, _), count in zip(rows, num_accepted):
            if count:
                constraint.rollback(count)  # type: ignore[union-attr]
    return any_constrained

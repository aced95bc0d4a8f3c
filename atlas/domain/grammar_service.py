"""The grammar side of constrained sampling as a service of plain-data commands, so that it can
run in a helper process beside the engine (`atlas.domain.served_constraints` drives it).

The service owns each constrained sequence's `TokenConstraint` (its llguidance matchers, the
reasoning phases, the superset/exact bookkeeping) under an integer handle the engine picks, and
does the grammar's work of a step: the sampled ids' accepts and the next step's masks. The
engine keeps what is the scheduler's (which step a sequence's token is void in, resampling,
aborting). Every argument and result is plain data (ints, tuples, `AcceptVerdict`), so a
transport can carry them between processes; the matchers never leave the service.

A step without drafts takes one command, `accept_rows` with the next step's fill plan: accept
the rows (try semantics: a token a superset's mask let through and the grammar refuses stops
there, nothing accepted for it), answer, then fill the next masks. The engine reads the answer
(a few bytes) as soon as it is written and does its own work while the masks fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from atlas.domain.constraints import (
    ConstraintViolation,
    GrammarGaveUp,
    TokenConstraint,
    fill_step_bitmask,
    plan_batch_bitmask,
)
from atlas.domain.request_constraints import GrammarCache, token_constraint
from atlas.domain.requests import OutputConstraint
from atlas.domain.token_mask import ALL_ALLOWED

NO_ROW = -1  # a row without a constraint handle (unconstrained, or its token void)


class Violation(msgspec.Struct, frozen=True):
    """A token a constraint does not allow (`ConstraintViolation`); `gave_up`: the grammar
    engine gave up on the grammar (`GrammarGaveUp`), the request's fault, not the engine's."""

    message: str
    gave_up: bool = False

    @classmethod
    def of(cls, violation: ConstraintViolation) -> Violation:
        return cls(str(violation), isinstance(violation, GrammarGaveUp))


class AcceptVerdict(msgspec.Struct, frozen=True):
    """What `accept_rows` made of a step's sampled ids. `refused_row`: the first row whose token
    the grammar refused under its superset's mask (rows before it accepted, it and those after
    untouched; no fill started); `violation`: a row broke its constraint, and every accept of
    the command was rolled back (no fill started). Neither: every row accepted, fill started."""

    refused_row: int | None = None
    violation: Violation | None = None

    @property
    def all_accepted(self) -> bool:
        return self.refused_row is None and self.violation is None


class GrammarWorker(Protocol):
    """The grammar service as the engine reaches it: in this process (`InlineGrammarWorker`) or
    in a helper process (`atlas.adapters.grammar.process`). Calls are answered in order. A
    worker that is gone raises GrammarWorkerDied from any call."""

    def add(self, handle: int, constraint: OutputConstraint, loose: bool) -> bool:
        """`GrammarService.add`: raises GrammarError (naming the field) for a grammar that does
        not compile."""
        ...

    def forget(self, handle: int) -> None: ...

    def accept_rows(self, handles: Sequence[int], token_ids: Sequence[int],
                    fill_handles: Sequence[int] | None) -> AcceptVerdict:
        """`GrammarService.accept_rows`, then (all accepted and `fill_handles` given) the fill
        of those rows' masks starts: `masks` waits for it. Returns once the verdict is known."""
        ...

    def start_fill(self, fill_handles: Sequence[int]) -> None:
        """Start filling a step's masks, a row per handle (`GrammarService.fill`)."""
        ...

    def start_fill_drafts(self, rows: Sequence[tuple[int, tuple[int, ...]]], num_rows: int) -> None:
        """Start filling a verify step's `num_rows` masks (`GrammarService.fill_drafts`)."""
        ...

    def masks(self) -> np.ndarray | None:
        """The masks of the fill started last (int32 [R, W], valid until the next fill starts),
        or None when no row was constrained; raises what the fill raised."""
        ...

    def admits(self, handles: Sequence[int], token_ids: Sequence[int]) -> tuple[bool, ...]: ...

    def advance(self, rows: Sequence[tuple[int, tuple[int, ...], bool]]) -> tuple[Violation | None, ...]: ...

    def resample(self, handle: int) -> None: ...

    def close(self) -> None:
        """Stop the worker; later calls raise GrammarWorkerDied."""
        ...


class GrammarWorkerDied(RuntimeError):
    """The grammar worker (a helper process) is gone: its constraints are lost."""


class GrammarService:
    """The live constraints by handle and the grammar's work of each step (module doc).

    `grammars` compiles requests' grammars (None: a request with a grammar is refused, as
    `token_constraint` does); `num_words` is a mask row's width (ceil(V / 32))."""

    def __init__(self, grammars: GrammarCache | None, eos_token_ids: frozenset[int], num_words: int) -> None:
        self._grammars = grammars
        self._eos_token_ids = eos_token_ids
        self._num_words = num_words
        self._constraints: dict[int, TokenConstraint] = {}
        self._exact: dict[int, np.ndarray] = {}  # handle -> the exact mask of a refused row's position

    def add(self, handle: int, constraint: OutputConstraint, loose: bool) -> bool:
        """Compile `constraint` for the sequence `handle` (replacing any it had); `loose` allows
        its grammar's superset masks. Returns whether the sequence may sample loosely. Raises
        GrammarError naming the field for an invalid grammar, ValueError without a compiler."""
        made = token_constraint(constraint, self._grammars, self._eos_token_ids, loose_masks=loose)
        assert made is not None
        self._constraints[handle] = made
        self._exact.pop(handle, None)
        return made.may_sample_loosely

    def forget(self, handle: int) -> None:
        """The sequence finished or was aborted (a no-op for an unknown handle)."""
        self._constraints.pop(handle, None)
        self._exact.pop(handle, None)

    def accept_rows(self, handles: Sequence[int], token_ids: Sequence[int]) -> AcceptVerdict:
        """Accept token_ids[i] into handles[i]'s constraint (NO_ROW skipped) in order, until a
        token the grammar refuses under its superset's mask (`AcceptVerdict.refused_row`); a
        token that breaks its constraint rolls back every accept of this call."""
        constraints = self._constraints
        accepted: list[TokenConstraint] = []
        try:
            for row, handle in enumerate(handles):
                if handle == NO_ROW:
                    continue
                constraint = constraints[handle]
                if not constraint.accept_sampled(token_ids[row]):
                    return AcceptVerdict(refused_row=row)
                accepted.append(constraint)
        except ConstraintViolation as violation:
            for constraint in accepted:
                constraint.rollback(1)
            return AcceptVerdict(violation=Violation.of(violation))
        return AcceptVerdict()

    def fill(self, handles: Sequence[int], bitmask: np.ndarray) -> bool:
        """Fill bitmask[i] (int32 [len(handles), W]) with the next-token mask of handles[i]'s
        constraint (all ones for NO_ROW or a constraint that allows anything now); a row whose
        loose token was refused takes its exact mask kept by `resample`. Returns whether any
        row is constrained (False: the sampler may skip the mask)."""
        constraints, exact = self._constraints, self._exact
        rows = [constraints.get(handle) if handle != NO_ROW else None for handle in handles]
        kept: list[tuple[int, np.ndarray]] = []
        if exact:
            for index, handle in enumerate(handles):
                if rows[index] is not None and handle in exact:
                    kept.append((index, exact.pop(handle)))
                    rows[index] = None
        grammar = plan_batch_bitmask(rows, bitmask)
        compiler = self._grammars.compiler if self._grammars is not None else None
        any_constrained = grammar.fill(bitmask, compiler)
        for index, row in kept:
            bitmask[index] = row
        return any_constrained or bool(kept)

    def fill_drafts(self, rows: Sequence[tuple[int, tuple[int, ...]]], bitmask: np.ndarray) -> bool:
        """Fill a verify step's masks: rows[i] is a sampling sequence's (handle or NO_ROW, its
        drafts), taking 1 + len(drafts) rows of `bitmask` (`fill_step_bitmask`)."""
        constraints = self._constraints
        entries = [(constraints.get(handle) if handle != NO_ROW else None, drafts) for handle, drafts in rows]
        compiler = self._grammars.compiler if self._grammars is not None else None
        return fill_step_bitmask(entries, bitmask, compiler)

    def admits(self, handles: Sequence[int], token_ids: Sequence[int]) -> tuple[bool, ...]:
        """`TokenConstraint.admits` of each row (a refused one's next mask is the exact one)."""
        return tuple(self._constraints[handle].admits(token_id) for handle, token_id in zip(handles, token_ids))

    def advance(self, rows: Sequence[tuple[int, tuple[int, ...], bool]]) -> tuple[Violation | None, ...]:
        """For each (handle, tokens, undo_first): roll back one token first when `undo_first`
        (an early accept the commit did not keep), then accept the tokens; a token the
        constraint forbids stops that row with its Violation (the engine ends the request).
        Unknown handles are skipped (None)."""
        verdicts: list[Violation | None] = []
        for handle, token_ids, undo_first in rows:
            constraint = self._constraints.get(handle)
            verdict = None
            if constraint is not None:
                if undo_first:
                    constraint.rollback(1)
                try:
                    for token_id in token_ids:
                        constraint.accept(token_id)
                except ConstraintViolation as violation:
                    verdict = Violation.of(violation)
            verdicts.append(verdict)
        return tuple(verdicts)

    def resample(self, handle: int) -> None:
        """The sequence samples its refused token's position again: keep its exact mask for the
        next fill that has its row (computed now, off the engine's chain in a helper process)."""
        constraint = self._constraints.get(handle)
        if constraint is None:
            return
        row = np.empty(self._num_words, dtype=np.int32)
        if not constraint.mask_for_next(row):
            row[:] = ALL_ALLOWED  # any token (not reached: a refused row is a grammar's)
        self._exact[handle] = row


class InlineGrammarWorker:
    """The service in the engine's own process, each command run when it is given (a fill
    too): the same commands as the helper process, for tests and for engines without one."""

    def __init__(self, service: GrammarService, num_words: int) -> None:
        self._service = service
        self._bitmask = np.empty((0, num_words), dtype=np.int32)  # grown on demand
        self._masks: np.ndarray | None = None  # of the last fill
        self._closed = False

    def _check(self) -> GrammarService:
        if self._closed:
            raise GrammarWorkerDied("the grammar worker was closed")
        return self._service

    def _rows(self, num_rows: int) -> np.ndarray:
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.empty((max(num_rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]), np.int32)
        return self._bitmask[:num_rows]

    def add(self, handle: int, constraint: OutputConstraint, loose: bool) -> bool:
        return self._check().add(handle, constraint, loose)

    def forget(self, handle: int) -> None:
        self._check().forget(handle)

    def accept_rows(self, handles: Sequence[int], token_ids: Sequence[int],
                    fill_handles: Sequence[int] | None) -> AcceptVerdict:
        verdict = self._check().accept_rows(handles, token_ids)
        if verdict.all_accepted and fill_handles is not None:
            self.start_fill(fill_handles)
        return verdict

    def start_fill(self, fill_handles: Sequence[int]) -> None:
        bitmask = self._rows(len(fill_handles))
        self._masks = bitmask if self._check().fill(fill_handles, bitmask) else None

    def start_fill_drafts(self, rows: Sequence[tuple[int, tuple[int, ...]]], num_rows: int) -> None:
        bitmask = self._rows(num_rows)
        self._masks = bitmask if self._check().fill_drafts(rows, bitmask) else None

    def masks(self) -> np.ndarray | None:
        self._check()
        return self._masks

    def admits(self, handles: Sequence[int], token_ids: Sequence[int]) -> tuple[bool, ...]:
        return self._check().admits(handles, token_ids)

    def advance(self, rows: Sequence[tuple[int, tuple[int, ...], bool]]) -> tuple[Violation | None, ...]:
        return self._check().advance(rows)

    def resample(self, handle: int) -> None:
        self._check().resample(handle)

    def close(self) -> None:
        self._closed = True

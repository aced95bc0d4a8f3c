"""The engine's constrained sampling: token constraints advanced past each step's ids, and
the masks of the step in flight filled on a helper thread (`EngineCore` holds one).

Token constraints (structured output, thinking budgets) keep the overlap: a step with a
constrained sampling row is submitted with `awaits_masks`, so the device runs its forward
while the previous step's sampled ids are read and each constraint advanced past them. The
masks are then filled on a helper thread (llguidance computes them in native code without
the GIL) while this thread commits the previous step in the scheduler, returns the outputs
and, at the next `step`, schedules the step after and builds its inputs; the step samples
just before that one is launched behind it:

    step k:    schedule N+1, submit N+1 (forward only); the mask thread reads N's ids,
               accepts them into the constraints, starts filling N+1's masks; commit N
    step k+1:  schedule N+2, build and stage N+2's inputs, wait for N+1's masks and sample
               N+1, launch N+2; the mask thread reads N+1's ids, ...

The mask thread waits for the ids itself (the device's wait lets the GIL go), so it runs as
soon as they land while this thread waits only for the accepts; it plans each row's rule
(forced tokens, all-but-end rows, which grammar rows to fill) and spends the fill in
llguidance's native code. A small model's step is short, so the fill must hide behind the
host's own work as well as the device's. Nothing changes a constraint while its fill runs: the
ids are accepted before the fill starts, and a sequence whose committed tokens turn out
otherwise (preempted after it was scheduled, or a step verifying drafts, which takes the
accept after the commit) waits for the fill. A token its constraint forbids (only a sampler
that ignored the mask could draw one) ends that request with an error.

A row sampled under its grammar's superset mask (`atlas.domain.constraints`, loose masks) is
checked before its step commits: a token the grammar refuses is dropped with the step in
flight after it, and the sequence's last token is computed again so that a later step samples
the position under the exact mask (`Scheduler.resample`, on this thread: the mask thread
hands such a row back; that row loses two steps):

    step N samples t under S        commit N: t refused -> resample(seq): t and N+1's token void
    step N+1 (in flight) computes t  its row's mask: none (its token is void), commit N+1 skips it
    step N+2 computes the last token again and samples under the exact mask
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from atlas.domain.batch import ScheduledBatch, ScheduledSequence, SequenceOutput, StepResult
from atlas.domain.constraints import (
    ConstraintViolation,
    GrammarGaveUp,
    TokenConstraint,
    fill_step_bitmask,
    plan_batch_bitmask,
)
from atlas.domain.handoff import Handoff, HandoffThread
from atlas.domain.request_constraints import GrammarCache, token_constraint
from atlas.domain.requests import FinishReason, ParameterError, Request
from atlas.domain.scheduler import Scheduler
from atlas.domain.speculative.policy import NoSpeculation
from atlas.domain.token_mask import ALL_ALLOWED, bitmask_width
from atlas.ports.grammar import GrammarError

if TYPE_CHECKING:
    from atlas.domain.engine import PendingResult


@dataclass(frozen=True, slots=True)
class _EarlyAccepts:
    """What the mask thread made of a step's sampled ids (`ConstrainedSampling.accept_early`)."""

    result: StepResult
    # sequence -> the token accepted into its constraint; None: not one id a row, nothing done
    accepted: dict[str, int] | None
    refused_row: int | None = None  # the first row whose token the grammar refused: left to the engine
    violation: ConstraintViolation | None = None  # a row broke its constraint; nothing stays accepted


class ConstrainedSampling:
    """The constraints of the live constrained sequences and the masks of the step in flight.
    Engine-thread only, but for the mask thread's work this class hands it (`accept_early`,
    `start_masks`); `in_flight` is the engine's deque of steps in flight, oldest first."""

    def __init__(
        self,
        scheduler: Scheduler,
        in_flight: deque[tuple[ScheduledBatch, PendingResult]],
        vocab_size: int,
        eos_token_ids: frozenset[int],
        grammars: GrammarCache | None,
        mask_rows: Callable[[], np.ndarray | None] | None = None,
    ) -> None:
        """`mask_rows`: where the executor takes a step's masks from (`Worker.mask_rows`), to
        fill them in place; None: a buffer of this object's own, copied by the executor."""
        self._scheduler = scheduler
        self._mask_rows = mask_rows
        self._in_flight = in_flight
        self._eos_token_ids = eos_token_ids
        self._grammars = grammars
        self._constraints: dict[str, TokenConstraint] = {}  # of the live constrained sequences
        self._fields: dict[str, str] = {}  # sequence -> the request field its grammar came from
        self._bitmask = np.empty((0, bitmask_width(vocab_size)), dtype=np.int32)  # grown on demand
        self._masks: Handoff[np.ndarray | None] | None = None  # of the last step in flight, filling
        self._mask_thread: HandoffThread | None = None  # started by the first constrained step
        self._loose: set[str] = set()  # sequences whose constraint may sample under a superset's mask
        self._void: dict[str, int] = {}  # sequence -> the step in flight whose token for it is void
        # A refused row's exact mask, filled on a thread of its own while the step in flight
        # runs (its token there is void): the step after takes it without waiting on llguidance.
        self._exact_masks: dict[str, Future[np.ndarray]] = {}
        self._exact_thread: ThreadPoolExecutor | None = None
        self.num_resampled_tokens = 0  # loosely sampled tokens the grammar refused

    def add(self, request_id: str, constraint: TokenConstraint, field: str = "") -> None:
        """`request_id` (queued) samples under `constraint` (from `constraint_for`), whose
        grammar came from the request's `field`."""
        self._constraints[request_id] = constraint
        if field:
            self._fields[request_id] = field
        if constraint.may_sample_loosely:
            self._loose.add(request_id)

    def forget(self, request_id: str) -> None:
        """`request_id` finished or was aborted (a no-op for one without a constraint)."""
        self._constraints.pop(request_id, None)
        self._fields.pop(request_id, None)
        self._loose.discard(request_id)
        self._exact_masks.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._constraints

    @property
    def has_ended(self) -> bool:
        """Whether requests were ended outside a commit (never here: the constraints live in
        this process; `ServedConstrainedSampling` loses them with its worker)."""
        return False

    def take_ended(self) -> list[SequenceOutput]:
        """The outputs of requests ended outside a commit (`has_ended`): none here."""
        return []

    @property
    def filling(self) -> bool:
        """Whether the masks of the last step in flight are being filled (or are ready)."""
        return self._masks is not None

    def close(self) -> None:
        """Stop the mask threads (a later constrained step starts them again)."""
        if self._mask_thread is not None:
            self._mask_thread.close()
        if self._exact_thread is not None:
            self._exact_thread.shutdown(wait=True)
        self._mask_thread = self._exact_thread = None

    def take_result(self, batch: ScheduledBatch, pending: PendingResult) -> tuple[StepResult, dict[str, int] | None]:
        """The result of `batch` (the oldest step, leaving the deque) before the scheduler
        commits it, with its ids accepted early where they can be (`accept_early`; the ids
        so taken, else None) and its loosely sampled rows' refusals resampled."""
        taken = self.accept_early(batch, pending)  # checks the loose rows' tokens too
        if taken is None:
            result, early = pending.result(), None
        else:
            result, early = taken.result, taken.accepted
            if taken.violation is not None:  # the loose rows' tokens are left to check
                self._resample_refused(batch, result)
            elif taken.refused_row is not None:
                early = self._accept_after_refusal(batch, result, taken.accepted or {}, taken.refused_row)
        if early is None and self._loose:
            self._resample_refused(batch, result)
        return result, early

    def after_commit(self, batch: ScheduledBatch, outputs: list[SequenceOutput],
                     early: dict[str, int] | None) -> list[SequenceOutput]:
        """`batch` committed with `outputs`: its void tokens are done with and the constraints
        advance past the outputs' tokens (a forbidden one ends its request with an error)."""
        if self._void:
            self._void = {seq_id: step for seq_id, step in self._void.items() if step > batch.step_id}
        if self._constraints or early:
            outputs = self._advance_constraints(outputs, early or {})
        return outputs

    def constraint_for(self, request: Request) -> TokenConstraint | None:
        constraint = request.constraint
        if constraint is None:
            return None
        if constraint.grammar is not None and self._grammars is None:
            raise ParameterError(constraint.grammar_field, "structured output is unavailable: this engine has no "
                                                           "grammar compiler for its model's tokenizer")
        sampling = request.sampling
        # The sampler's race picks the exact mask's token under a superset's mask only when
        # nothing before the race depends on the mask: greedy or temperature alone (a top-p,
        # top-k or min-p cut is of the masked distribution), and no logprobs (a superset's).
        plain = sampling.temperature == 0 or (sampling.top_p >= 1 and sampling.top_k <= 0 and sampling.min_p <= 0)
        # A refusal computes the last position again, and drafts would be checked against a
        # superset's mask (taking its word for the grammar's): neither may be in the way.
        scheduler = self._scheduler
        loose = (plain and sampling.logprobs is None and scheduler.cache.can_recompute_last_token
                 and isinstance(scheduler.speculation, NoSpeculation))
        try:
            return token_constraint(constraint, self._grammars, self._eos_token_ids, loose_masks=loose)
        except GrammarError as error:
            raise ParameterError(error.field, str(error).removeprefix(f"{error.field}: ")) from None

    def awaits_masks(self, batch: ScheduledBatch) -> bool:
        constraints = self._constraints
        return bool(constraints) and any(s.sampling is not None and s.seq_id in constraints for s in batch.sequences)

    def _resample_refused(self, batch: ScheduledBatch, result: StepResult, done: Collection[str] = ()) -> None:
        """Before `batch` commits: each row it sampled under a superset's mask whose token the
        grammar refuses has its sequence sample that position again (`_resample`), except the
        sequences in `done` (resampled already). A refusal the scheduler cannot take back is
        left to the commit's path, which ends the request."""
        sampled = [s for s in batch.sequences if s.sampling is not None]
        if len(sampled) != len(result.token_ids):  # drafts: exact masks only
            return
        newest = self._in_flight[-1][0].step_id if self._in_flight else batch.step_id
        constraints, void = self._constraints, self._void
        for seq, token_id in zip(sampled, result.token_ids):
            constraint = constraints.get(seq.seq_id)
            if (constraint is None or void.get(seq.seq_id) == batch.step_id or seq.seq_id in done
                    or constraint.admits(token_id)):
                continue
            self._resample(seq.seq_id, constraint, batch.step_id, newest)

    def _resample(self, seq_id: str, constraint: TokenConstraint, step_id: int, newest: int) -> bool:
        """Have `seq_id`, whose token of step `step_id` its grammar refused, sample that position
        again (`Scheduler.resample`): its token in the step in flight after (`newest`) is void
        (no mask is filled for it, and that step's commit skips it), and its exact mask is
        filled on a thread of its own meanwhile. False when the scheduler cannot take it back."""
        if not self._scheduler.resample(seq_id, step_id):
            return False
        self._void[seq_id] = newest
        self.num_resampled_tokens += 1
        if self._exact_thread is None:
            self._exact_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-exact-masks")
        self._exact_masks[seq_id] = self._exact_thread.submit(_exact_mask, constraint, self._bitmask.shape[1])
        return True

    def accept_early(self, batch: ScheduledBatch, pending: PendingResult) -> _EarlyAccepts | None:
        """Accept the sampled ids of `batch` (being committed) into their constraints before
        the scheduler's commit, and start the next step's masks, so llguidance's fill runs
        beside the commit's Python instead of after it. Only when the step in flight after it
        waits for masks not yet started, and `batch` verified no drafts (its ids are then the
        tokens the commit appends, one a sequence); None otherwise.

        The mask thread waits for the ids itself (the device's wait lets the GIL go), accepts
        them, plans the masks and starts their fill: the chain from the ids to the fill holds
        one thread wake-up (the ids') instead of three (the ids', then the handoff's two), and
        this thread waits only for the accepts. A token sampled under a superset's mask that
        the grammar refuses is handed back with the rows after it (`_accept_after_refusal`:
        the scheduler is this thread's); a token that breaks a constraint comes back with
        every accept rolled back (the commit's path then ends that request). The ids' wait
        raises here, as `pending.result()` does."""
        newest = self._early_target(batch)
        if newest is None:
            return None
        sampled = [s for s in batch.sequences if s.sampling is not None]
        handed: Handoff[_EarlyAccepts] = Handoff()

        def accept_then_fill() -> np.ndarray | None:
            accepted: dict[str, int] = {}
            try:
                result = pending.result()
                if len(result.token_ids) != len(sampled):  # not one id a row (not reached)
                    handed.set_result(_EarlyAccepts(result, None))
                    return None
                row = self._accept_rows(sampled, result.token_ids, accepted, 0)
                if row < len(sampled):
                    handed.set_result(_EarlyAccepts(result, accepted, refused_row=row))
                    return None
                fill = self._plan_fill(newest)
            except ConstraintViolation as violation:
                for seq_id in accepted:
                    self._constraints[seq_id].rollback(1)
                handed.set_result(_EarlyAccepts(result, {}, violation=violation))
                return None
            except BaseException as error:  # noqa: BLE001 - raised where the engine waits for the ids
                handed.set_exception(error)
                return None
            handed.set_result(_EarlyAccepts(result, accepted))
            return fill()  # llguidance's fill lets the GIL go

        if self._mask_thread is None:
            self._mask_thread = HandoffThread("atlas-masks")
        masks = self._mask_thread.post(accept_then_fill)
        early = handed.result()
        if early.accepted is not None and early.refused_row is None and early.violation is None:
            self._masks = masks  # filling
        return early

    def _early_target(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step in flight whose masks the early accepts of `batch` start; None when they do
        not apply (`accept_early`)."""
        if not (self._constraints and self._in_flight and self._masks is None):
            return None
        newest = self._in_flight[-1][0]
        if not newest.awaits_masks or batch.num_sampled != sum([s.sampling is not None for s in batch.sequences]):
            return None
        return newest

    def _accept_rows(self, sampled: list[ScheduledSequence], token_ids: tuple[int, ...], accepted: dict[str, int],
                     row: int) -> int:
        """Accept the sampled ids from `row` on into their constraints (those void or without
        one skipped), recording them in `accepted`, until a token the grammar refuses under a
        superset's mask; returns that row (len(sampled): none). Raises ConstraintViolation."""
        constraints, void = self._constraints, self._void
        for row in range(row, len(sampled)):
            seq_id = sampled[row].seq_id
            constraint = constraints.get(seq_id)
            if constraint is None or seq_id in void:  # void: sampled again later
                continue
            token_id = token_ids[row]
            if not constraint.accept_sampled(token_id):
                return row
            accepted[seq_id] = token_id
        return len(sampled)

    def _accept_after_refusal(self, batch: ScheduledBatch, result: StepResult, accepted: dict[str, int],
                              row: int) -> dict[str, int]:
        """Go on with `accept_early` from `row`, whose token the grammar refused: that sequence
        samples the position again (`_resample`), as does every later refused one, the other
        rows are accepted into `accepted`, and the next step's masks start filling. Returns
        `accepted`; {} when a sampled id broke a constraint (every accept rolled back)."""
        newest, constraints = self._in_flight[-1][0], self._constraints
        sampled = [s for s in batch.sequences if s.sampling is not None]
        token_ids = result.token_ids
        resampled: list[str] = []
        try:
            while row < len(sampled):
                seq_id, token_id = sampled[row].seq_id, token_ids[row]
                constraint = constraints[seq_id]
                if self._resample(seq_id, constraint, batch.step_id, newest.step_id):
                    resampled.append(seq_id)
                else:
                    constraint.accept(token_id)  # raises: the grammar refused it
                row = self._accept_rows(sampled, token_ids, accepted, row + 1)
        except ConstraintViolation:  # undo the others; the commit's path ends the request
            for accepted_id in accepted:
                constraints[accepted_id].rollback(1)
            self._resample_refused(batch, result, resampled)  # the rows after this one
            return {}
        self.start_masks(newest)
        return accepted

    def _advance_constraints(self, outputs: list[SequenceOutput], early: dict[str, int]) -> list[SequenceOutput]:
        """Advance the constraints past the outputs' tokens, those `accept_early` took aside.
        A sequence whose committed tokens are not the one taken early (preempted after it was
        scheduled: it samples again later) is corrected once the fill in flight is done, and
        the masks are filled again."""
        stale = False
        for index, output in enumerate(outputs):
            token_id = early.pop(output.seq_id, None)
            if token_id is None:
                outputs[index] = self._advance_constraint(output)
            elif output.new_token_ids != (token_id,):
                stale = self._undo_early(output.seq_id) or stale
                outputs[index] = self._advance_constraint(output)
        for seq_id in early:  # no output: aborted, or preempted after schedule()
            stale = self._undo_early(seq_id) or stale
        if stale:
            self._masks = None
            self.start_masks(self._in_flight[-1][0])
        return outputs

    def _undo_early(self, seq_id: str) -> bool:
        """Roll back the token `accept_early` gave a live constraint (after the fill in flight
        is done: nothing changes a constraint while one runs); whether one was rolled back."""
        constraint = self._constraints.get(seq_id)
        if constraint is None:
            return False
        if self._masks is not None:
            self._masks.exception()  # waits; an error is raised where the step samples
        constraint.rollback(1)
        return True

    def _advance_constraint(self, output: SequenceOutput) -> SequenceOutput:
        """Accept `output`'s new tokens into its sequence's constraint; a forbidden one ends the
        request with an error instead."""
        constraint = self._constraints.get(output.seq_id)
        if constraint is None:
            return output
        try:
            for token_id in output.new_token_ids:
                constraint.accept(token_id)
        except ConstraintViolation as violation:
            self._scheduler.abort(output.seq_id)
            if isinstance(violation, GrammarGaveUp):  # the request's grammar: a 400, not the engine's failure
                field = self._fields.get(output.seq_id, "grammar")
                return msgspec.structs.replace(
                    output, new_token_ids=(), logprobs=(), finish_reason=FinishReason.ABORT, error_field=field,
                    error=f"{field}: the grammar engine gave up on this grammar while matching it ({violation}); "
                          "simplify it (a pattern under a large length bound or repeat count is the usual cause)")
            return msgspec.structs.replace(
                output, new_token_ids=(), logprobs=(), finish_reason=FinishReason.ABORT,
                error=f"the engine sampled a token the request's constraint forbids: {violation}")
        return output

    def start_masks(self, batch: ScheduledBatch) -> None:
        """Start filling the masks of `batch` (the last step in flight) on the mask thread: its
        sampling rows' masks after every committed token, or None when no row is constrained
        (the sequences finished meanwhile, or reason freely)."""
        fill = self._plan_fill(batch)
        if self._mask_thread is None:
            self._mask_thread = HandoffThread("atlas-masks")
        # returns once the thread runs the fill (it holds the GIL; llguidance's fill lets it go at
        # once), else the fill would start when this thread next blocks
        self._masks = self._mask_thread.submit(fill)

    def _plan_fill(self, batch: ScheduledBatch) -> Callable[[], np.ndarray | None]:
        """The fill of `batch`'s masks (`start_masks`), its rows' rules planned here: the
        function leaves only llguidance's fill (and any refused row's exact mask) to run."""
        sampled = [s for s in batch.sequences if s.sampling is not None]
        num_rows = batch.num_sampled
        bitmask = self._fill_target(num_rows)
        compiler = self._grammars.compiler if self._grammars is not None else None
        if num_rows == len(sampled):  # no drafts: the rules here, only llguidance's fill on the thread
            void, step_id, exact = self._void, batch.step_id, self._exact_masks
            constraints = [None if void.get(s.seq_id) == step_id else self._constraints.get(s.seq_id) for s in sampled]
            filled: list[tuple[int, Future[np.ndarray]]] = []  # rows whose exact mask is on its way
            if exact:
                for index, seq in enumerate(sampled):
                    if constraints[index] is not None and seq.seq_id in exact:
                        filled.append((index, exact.pop(seq.seq_id)))
                        constraints[index] = None
            grammar = plan_batch_bitmask(constraints, bitmask)

            def fill() -> np.ndarray | None:
                for index, future in filled:
                    bitmask[index] = future.result()
                return bitmask if grammar.fill(bitmask, compiler) or filled else None
        else:
            rows = [(self._constraints.get(s.seq_id), s.token_ids[len(s.token_ids) - s.num_draft_tokens :])
                    for s in sampled]

            def fill() -> np.ndarray | None:
                return bitmask if fill_step_bitmask(rows, bitmask, compiler) else None

        return fill

    def _fill_target(self, num_rows: int) -> np.ndarray:
        """Where a step's `num_rows` masks are filled: the executor's rows when it offers
        enough of them, else this object's buffer. Either is free again: one fill at a time,
        and the executor's only after the last upload from it ran."""
        width = self._bitmask.shape[1]
        rows = self._mask_rows() if self._mask_rows is not None else None
        if rows is not None and rows.shape[0] >= num_rows and rows.shape[1] == width and rows.dtype == np.int32:
            return rows[:num_rows]
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.empty((max(num_rows, 2 * self._bitmask.shape[0]), width), np.int32)
        return self._bitmask[:num_rows]

    def sample_in_flight(self) -> None:
        """Sample the last step in flight with its masks once they are filled (a no-op when no
        fill is pending); an error the fill raised is raised here."""
        masks, self._masks = self._masks, None
        if masks is not None:
            self._in_flight[-1][1].sample(masks.result())


def _exact_mask(constraint: TokenConstraint, num_words: int) -> np.ndarray:
    """The exact mask of a constraint whose loosely sampled token was refused (one row)."""
    row = np.empty(num_words, dtype=np.int32)
    if not constraint.mask_for_next(row):
        row[:] = ALL_ALLOWED  # any token (not reached: a refused row is a grammar's)
    return row

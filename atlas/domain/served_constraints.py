"""The engine's constrained sampling with the grammar state in a `GrammarWorker` (a helper
process, `atlas.adapters.grammar.process`): the same contract as `ConstrainedSampling`, which
keeps the matchers in this process and fills on a thread.

In one process the accepts, the masks' fill and the engine's own Python (commit, schedule,
input build, launch) share one GIL, and every handover between threads is a futex wake-up; a
json step at batch 16 chains them all (docs/lab/host-gap.md). Here the grammar's Python runs
in another process, on another core, and the two meet through shared memory:

    engine: step N's ids land -> accept_rows(N's rows, N's ids, N+1's rows)  -- waits for the verdict
    worker:                      accept each row, answer, then fill N+1's masks
    engine: (verdict) commit N, return; schedule N+2, build its inputs -> masks() -> sample N+1

The engine keeps the scheduler's side: which step a sequence's token is void in (a refused
loose token is sampled again, `Scheduler.resample`), aborting a request whose token breaks its
constraint. A worker that dies ends every constrained request with an error (a fresh one
starts for the next constrained request); unconstrained requests run on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from atlas.domain.batch import ScheduledBatch, ScheduledSequence, SequenceOutput, StepResult
from atlas.domain.grammar_service import NO_ROW, GrammarWorker, GrammarWorkerDied, Violation
from atlas.domain.requests import FinishReason, ParameterError, Request, SamplingParams
from atlas.domain.scheduler import Scheduler
from atlas.domain.speculative.policy import NoSpeculation
from atlas.ports.grammar import GrammarError

if TYPE_CHECKING:
    from atlas.domain.engine import PendingResult


@dataclass(frozen=True, slots=True)
class ServedConstraint:
    """A request's constraint, compiled in the worker under `handle`."""

    handle: int
    loose: bool  # may sample under its grammar's superset's masks


class ServedConstrainedSampling:
    """The live constrained sequences' handles and the masks of the step in flight, the grammar
    work done by a `GrammarWorker` that `start_worker` makes (on the first constrained request,
    and again after one died). Engine-thread only; `in_flight` is the engine's deque of steps in
    flight, oldest first."""

    def __init__(self, scheduler: Scheduler, in_flight: deque[tuple[ScheduledBatch, PendingResult]],
                 start_worker: Callable[[], GrammarWorker]) -> None:
        self._scheduler = scheduler
        self._in_flight = in_flight
        self._start_worker = start_worker
        self._worker: GrammarWorker | None = None
        self._handles: dict[str, int] = {}  # of the live constrained sequences
        self._fields: dict[str, str] = {}  # sequence -> the request field its grammar came from
        self._loose: set[str] = set()  # sequences that may sample under a superset's mask
        self._void: dict[str, int] = {}  # sequence -> the step in flight whose token for it is void
        self._filling = False  # the worker fills the masks of the last step in flight
        self._next_handle = 0
        self._ended: list[SequenceOutput] = []  # requests ended by the worker's death, to publish
        self.num_resampled_tokens = 0  # loosely sampled tokens the grammar refused

    def constraint_for(self, request: Request) -> ServedConstraint | None:
        """Compile the request's constraint in the worker; None without one. Raises
        ParameterError naming the field for a grammar that does not compile, or when the worker
        died compiling it."""
        constraint = request.constraint
        if constraint is None:
            return None
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        try:
            if self._worker is None:
                self._worker = self._start_worker()
            loose = self._worker.add(handle, constraint, self._may_be_loose(request.sampling))
        except GrammarError as error:
            raise ParameterError(error.field, str(error).removeprefix(f"{error.field}: ")) from None
        except GrammarWorkerDied as error:
            self._lose_worker(error)
            raise ParameterError(constraint.grammar_field or "constraint",
                                 f"the grammar process stopped while compiling this request's constraint ({error})"
                                 ) from None
        return ServedConstraint(handle, loose)

    def _may_be_loose(self, sampling: SamplingParams) -> bool:
        """Whether a request so sampled may take a superset's masks (`ConstrainedSampling.constraint_for`)."""
        plain = sampling.temperature == 0 or (sampling.top_p >= 1 and sampling.top_k <= 0 and sampling.min_p <= 0)
        scheduler = self._scheduler
        return (plain and sampling.logprobs is None and scheduler.cache.can_recompute_last_token
                and isinstance(scheduler.speculation, NoSpeculation))

    def add(self, request_id: str, constraint: ServedConstraint, field: str = "") -> None:
        """`request_id` (queued) samples under `constraint` (from `constraint_for`), whose
        grammar came from the request's `field`."""
        self._handles[request_id] = constraint.handle
        if field:
            self._fields[request_id] = field
        if constraint.loose:
            self._loose.add(request_id)

    def forget(self, request_id: str) -> None:
        """`request_id` finished or was aborted (a no-op for one without a constraint)."""
        handle = self._handles.pop(request_id, None)
        self._fields.pop(request_id, None)
        self._loose.discard(request_id)
        if handle is not None and self._worker is not None:
            self._worker.forget(handle)

    def has(self, request_id: str) -> bool:
        return request_id in self._handles

    @property
    def has_ended(self) -> bool:
        """Whether a dead worker ended requests whose outputs `take_ended` has not taken yet."""
        return bool(self._ended)

    def take_ended(self) -> list[SequenceOutput]:
        """The final outputs (ABORT, with an error) of the requests a dead worker ended."""
        ended, self._ended = self._ended, []
        return ended

    @property
    def filling(self) -> bool:
        """Whether the masks of the last step in flight are being filled (or are ready)."""
        return self._filling

    def close(self) -> None:
        """Stop the worker (a later constrained request starts another)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def awaits_masks(self, batch: ScheduledBatch) -> bool:
        handles = self._handles
        return bool(handles) and any(s.sampling is not None and s.seq_id in handles for s in batch.sequences)

    def take_result(self, batch: ScheduledBatch, pending: PendingResult) -> tuple[StepResult, dict[str, int] | None]:
        """The result of `batch` (the oldest step, leaving the deque) before the scheduler
        commits it, with its ids accepted early where they can be (the ids so taken, else None)
        and its loosely sampled rows' refusals resampled; the next step's masks start filling."""
        newest = self._early_target(batch)
        result = pending.result()
        early: dict[str, int] | None = None
        try:
            if newest is not None:
                early = self._accept_early(batch, result, newest)
            if early is None and self._loose:
                self._resample_refused(batch, result)
        except GrammarWorkerDied as error:
            self._lose_worker(error)
            early = None
        return result, early

    def _early_target(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step in flight whose masks the early accepts of `batch` start: one awaiting
        masks, when `batch` verified no drafts (its ids are then the tokens the commit appends)."""
        if not (self._handles and self._in_flight and not self._filling and self._worker is not None):
            return None
        newest = self._in_flight[-1][0]
        if not newest.awaits_masks or batch.num_sampled != sum([s.sampling is not None for s in batch.sequences]):
            return None
        return newest

    def _accept_early(self, batch: ScheduledBatch, result: StepResult,
                      newest: ScheduledBatch) -> dict[str, int] | None:
        """Accept `batch`'s ids in the worker, which then fills `newest`'s masks; the ids taken
        ({} when one broke a constraint: the commit's path ends that request)."""
        sampled = [s for s in batch.sequences if s.sampling is not None]
        if len(result.token_ids) != len(sampled) or newest.num_sampled != sum(
                [s.sampling is not None for s in newest.sequences]):
            return None
        assert self._worker is not None
        handles = self._accept_handles(sampled)
        verdict = self._worker.accept_rows(handles, result.token_ids, self._fill_handles(newest))
        if verdict.violation is not None:
            self._resample_refused(batch, result)
            return {}
        row = len(sampled) if verdict.refused_row is None else verdict.refused_row
        early = {sampled[i].seq_id: result.token_ids[i] for i in range(row) if handles[i] != NO_ROW}
        if verdict.refused_row is None:
            self._filling = True
            return early
        return self._accept_after_refusal(batch, result, sampled, handles, early, row)

    def _accept_handles(self, sampled: list[ScheduledSequence]) -> list[int]:
        """Each sampled row's handle, NO_ROW for rows without a constraint or whose token is void."""
        handles, void = self._handles, self._void
        return [NO_ROW if s.seq_id in void else handles.get(s.seq_id, NO_ROW) for s in sampled]

    def _fill_handles(self, batch: ScheduledBatch) -> list[int]:
        """The handles of `batch`'s sampling rows (no drafts), NO_ROW where its token is void."""
        handles, void, step_id = self._handles, self._void, batch.step_id
        return [NO_ROW if void.get(s.seq_id) == step_id else handles.get(s.seq_id, NO_ROW)
                for s in batch.sequences if s.sampling is not None]

    def _accept_after_refusal(self, batch: ScheduledBatch, result: StepResult, sampled: list[ScheduledSequence],
                              handles: list[int], early: dict[str, int], row: int) -> dict[str, int]:
        """Go on from `row`, whose token the grammar refused: that sequence samples the position
        again, as does every later refused one, the other rows are accepted into `early`, and the
        next step's masks start. {} when a token broke a constraint (every accept undone)."""
        worker, newest = self._worker, self._in_flight[-1][0]
        assert worker is not None
        token_ids = result.token_ids
        resampled: list[str] = []
        while row < len(sampled):
            seq_id = sampled[row].seq_id
            if self._resample(seq_id, batch.step_id, newest.step_id):
                resampled.append(seq_id)
            else:  # the scheduler cannot take it back: accepting it fails the request at the commit
                undo = [(handles[i], (), True) for i in range(row) if sampled[i].seq_id in early]
                worker.advance(undo)
                self._resample_refused(batch, result, resampled)
                return {}
            rest = worker.accept_rows(handles[row + 1:], token_ids[row + 1:], None)
            if rest.violation is not None:
                undo = [(handles[i], (), True) for i in range(row) if sampled[i].seq_id in early]
                worker.advance(undo)
                self._resample_refused(batch, result, resampled)
                return {}
            end = len(sampled) if rest.refused_row is None else row + 1 + rest.refused_row
            early.update((sampled[i].seq_id, token_ids[i]) for i in range(row + 1, end) if handles[i] != NO_ROW)
            row = end
        self.start_masks(newest)
        return early

    def _resample_refused(self, batch: ScheduledBatch, result: StepResult, done: Collection[str] = ()) -> None:
        """Before `batch` commits: each row it sampled under a superset's mask whose token the
        grammar refuses samples that position again, but those in `done`; a refusal the
        scheduler cannot take back is left to the commit's path, which ends the request."""
        sampled = [s for s in batch.sequences if s.sampling is not None]
        if len(sampled) != len(result.token_ids) or self._worker is None:  # drafts: exact masks only
            return
        rows = [(seq.seq_id, token_id) for seq, token_id in zip(sampled, result.token_ids)
                if seq.seq_id in self._loose and self._void.get(seq.seq_id) != batch.step_id and seq.seq_id not in done]
        if not rows:
            return
        admitted = self._worker.admits([self._handles[seq_id] for seq_id, _ in rows], [t for _, t in rows])
        newest = self._in_flight[-1][0].step_id if self._in_flight else batch.step_id
        for (seq_id, _), admits in zip(rows, admitted):
            if not admits:
                self._resample(seq_id, batch.step_id, newest)

    def _resample(self, seq_id: str, step_id: int, newest: int) -> bool:
        """Have `seq_id`, whose token of step `step_id` its grammar refused, sample it again:
        its token in the step in flight (`newest`) is void, and the worker keeps its exact mask
        for the step after. False when the scheduler cannot take it back."""
        if not self._scheduler.resample(seq_id, step_id):
            return False
        self._void[seq_id] = newest
        self.num_resampled_tokens += 1
        assert self._worker is not None
        self._worker.resample(self._handles[seq_id])
        return True

    def after_commit(self, batch: ScheduledBatch, outputs: list[SequenceOutput],
                     early: dict[str, int] | None) -> list[SequenceOutput]:
        """`batch` committed with `outputs`: its void tokens are done with and the constraints
        advance past the outputs' tokens (a forbidden one ends its request with an error)."""
        if self._void:
            self._void = {seq_id: step for seq_id, step in self._void.items() if step > batch.step_id}
        if self._handles or early:
            try:
                outputs = self._advance(outputs, early or {})
            except GrammarWorkerDied as error:
                self._lose_worker(error)
        return outputs

    def _advance(self, outputs: list[SequenceOutput], early: dict[str, int]) -> list[SequenceOutput]:
        """Advance the constraints past the outputs' tokens but those `early` took; an early
        token the commit did not keep (preempted after it was scheduled) is rolled back first,
        and the masks filling are then filled again."""
        rows: list[tuple[int, tuple[int, ...], bool]] = []
        indices: list[int | None] = []  # the output of each row (None: an undone token without one)
        handles = self._handles
        stale = False
        for index, output in enumerate(outputs):
            handle = handles.get(output.seq_id)
            token_id = early.pop(output.seq_id, None)
            if handle is None or (token_id is not None and output.new_token_ids == (token_id,)):
                continue
            stale = stale or token_id is not None
            rows.append((handle, output.new_token_ids, token_id is not None))
            indices.append(index)
        for seq_id in early:  # no output: aborted, or preempted after schedule()
            if seq_id in handles:
                stale = True
                rows.append((handles[seq_id], (), True))
                indices.append(None)
        if not rows:
            return outputs
        assert self._worker is not None
        verdicts = self._worker.advance(rows)
        for index, verdict in zip(indices, verdicts):
            if index is not None and verdict is not None:
                outputs[index] = self._failed_output(outputs[index], verdict)
        if stale and self._filling:
            self.start_masks(self._in_flight[-1][0])
        return outputs

    def _failed_output(self, output: SequenceOutput, violation: Violation) -> SequenceOutput:
        """End `output`'s request for a token its constraint forbids (`ConstrainedSampling`'s words)."""
        self._scheduler.abort(output.seq_id)
        if violation.gave_up:  # the request's grammar: a 400, not the engine's failure
            field = self._fields.get(output.seq_id, "grammar")
            return msgspec.structs.replace(
                output, new_token_ids=(), logprobs=(), finish_reason=FinishReason.ABORT, error_field=field,
                error=f"{field}: the grammar engine gave up on this grammar while matching it ({violation.message}); "
                      "simplify it (a pattern under a large length bound or repeat count is the usual cause)")
        return msgspec.structs.replace(
            output, new_token_ids=(), logprobs=(), finish_reason=FinishReason.ABORT,
            error=f"the engine sampled a token the request's constraint forbids: {violation.message}")

    def start_masks(self, batch: ScheduledBatch) -> None:
        """Start filling the masks of `batch` (the last step in flight) in the worker."""
        worker = self._worker
        if worker is None:  # died: the step samples freely (its constrained requests are ended)
            self._filling = True
            return
        try:
            sampled = [s for s in batch.sequences if s.sampling is not None]
            if batch.num_sampled == len(sampled):
                worker.start_fill(self._fill_handles(batch))
            else:
                handles = self._handles
                rows = [(handles.get(s.seq_id, NO_ROW), tuple(s.token_ids[len(s.token_ids) - s.num_draft_tokens:]))
                        for s in sampled]
                worker.start_fill_drafts(rows, batch.num_sampled)
        except GrammarWorkerDied as error:
            self._lose_worker(error)
        self._filling = True

    def sample_in_flight(self) -> None:
        """Sample the last step in flight with its masks once they are filled (a no-op when no
        fill is pending); an error the fill raised is raised here. With the worker gone the
        step samples without masks (its constrained requests are ended)."""
        if not self._filling:
            return
        self._filling = False
        masks = None
        if self._worker is not None:
            try:
                masks = self._worker.masks()
            except GrammarWorkerDied as error:
                self._lose_worker(error)
        self._in_flight[-1][1].sample(masks)

    def _lose_worker(self, error: GrammarWorkerDied) -> None:
        """The worker is gone: end every constrained request with an error (`take_ended`); the
        next constrained request starts a fresh worker."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        message = (f"the grammar process stopped ({error}); this request's constraint was lost with it. "
                   "Retry the request")
        for seq_id in list(self._handles):
            output = self._scheduler.abort(seq_id)
            if output is not None:
                self._ended.append(msgspec.structs.replace(output, error=message))
            self._handles.pop(seq_id)
            self._fields.pop(seq_id, None)
            self._loose.discard(seq_id)
        self._void.clear()

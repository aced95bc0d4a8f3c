"""The scheduler's bookkeeping of one step: the plan being built, the record of a step in
flight, and the plain data each becomes (`ScheduledSequence` for the worker, `SequenceOutput`
for the front end), with the check that a result belongs to the step it is committed against.
"""

from __future__ import annotations

import msgspec

from atlas.domain.batch import (
    ScheduledBatch,
    ScheduledSequence,
    SequenceOutput,
    StepResult,
    TokenLogprobs,
)
from atlas.domain.cache.manager import StepTables
from atlas.domain.sampling import sampling_row, sampling_rows
from atlas.domain.sequence import PLACEHOLDER_TOKEN, PendingToken, Sequence


class InFlightStep(msgspec.Struct, frozen=True):
    """A step scheduled and not committed yet: `sequences[i]` is the live sequence behind the
    batch's `scheduled[i]`."""

    step_id: int
    sequences: tuple[Sequence, ...]
    scheduled: tuple[ScheduledSequence, ...]
    num_rows: int  # sampling rows: the result's token ids
    # Some sequence's next step needs this step's tokens on the host: its penalty context, or
    # how many drafts it keeps (`Scheduler.needs_commit_first`).
    needs_host_tokens: bool


class StepPlan:
    """The step being built: each sequence's share as the worker will see it, in order, and
    the budget left.

    Adding a sequence takes its view for the step and advances it at once, as if the step had
    run: its computed count moves past the step's tokens, and a sequence that samples awaits
    its token as a pending placeholder (row `num_rows` of the step's samples). Nothing else in
    the step reads a sequence already added: preemption takes victims only among those not
    added yet.
    """

    __slots__ = ("step_id", "budget_left", "sequences", "scheduled", "num_rows", "num_preempted", "needs_host_tokens")

    def __init__(self, step_id: int, budget: int) -> None:
        self.step_id = step_id
        self.budget_left = budget
        self.sequences: list[Sequence] = []
        self.scheduled: list[ScheduledSequence] = []
        self.num_rows = 0  # sampling rows so far
        self.num_preempted = 0
        self.needs_host_tokens = False

    def add(self, seq: Sequence, num_tokens: int, tables: StepTables) -> None:
        """Schedule `num_tokens` of `seq` from its computed count on, over its cache `tables`
        (`CacheManager.step_tables`), and advance it."""
        scheduled = scheduled_sequence(seq, num_tokens, tables)
        seq.mark_computed(num_tokens)
        if scheduled.sampling is not None:
            seq.append_pending(PendingToken(self.step_id, self.num_rows))
            self.num_rows += 1 + scheduled.num_draft_tokens
            if scheduled.num_draft_tokens or seq.has_penalties:
                self.needs_host_tokens = True
        self.sequences.append(seq)
        self.scheduled.append(scheduled)
        self.budget_left -= num_tokens

    def in_flight(self) -> InFlightStep:
        """The record `Scheduler.commit` checks the step's result against."""
        return InFlightStep(
            self.step_id, tuple(self.sequences), tuple(self.scheduled), self.num_rows, self.needs_host_tokens
        )


def scheduled_sequence(seq: Sequence, num_tokens: int, tables: StepTables) -> ScheduledSequence:
    """The step's view of `num_tokens` of `seq` from its computed count on, over its cache
    `tables`; it samples when they reach its last token."""
    start = seq.num_computed_tokens
    end = start + num_tokens
    samples = end == seq.num_tokens
    token_ids = seq.token_tuple(start, end)
    placeholder_row = None
    if token_ids[-1] == PLACEHOLDER_TOKEN:
        # only the newest placeholder can be computed: the previous step samples it
        pending = seq.pending
        assert len(pending) == 1 and samples
        placeholder_row = pending[0].sample_row
    num_drafts = seq.num_draft_tokens
    if not samples:  # a prefill chunk short of the last token
        row, draft_rows = None, ()
    elif num_drafts:
        rows = sampling_rows(seq)
        row, draft_rows = rows[0], rows[1:]
    else:
        row, draft_rows = sampling_row(seq), ()
    block_ids, kv_block_tables, state_slots, state_snapshots = tables
    # positional, as ScheduledSequence lists its fields: one is built per sequence per step
    return ScheduledSequence(
        seq.seq_id, token_ids, start, block_ids, row, placeholder_row, kv_block_tables, state_slots, num_drafts,
        draft_rows, state_snapshots,
    )


def check_result(in_flight: InFlightStep | None, batch: ScheduledBatch, result: StepResult) -> InFlightStep:
    """`in_flight` (the oldest step in flight), once `batch` and `result` are known to be its.
    Raises ValueError naming the mismatch otherwise."""
    if in_flight is None or batch.step_id != in_flight.step_id or len(batch.sequences) != len(in_flight.sequences):
        pending = "none" if in_flight is None else f"step {in_flight.step_id}"
        raise ValueError(f"batch of step {batch.step_id} is not the oldest in flight ({pending})")
    if result.step_id != batch.step_id:
        raise ValueError(f"result of step {result.step_id} committed against batch of step {batch.step_id}")
    if len(result.token_ids) != in_flight.num_rows:
        raise ValueError(
            f"step {batch.step_id} samples {in_flight.num_rows} tokens but the result has {len(result.token_ids)}"
        )
    if result.logprobs is not None and len(result.logprobs) != len(result.token_ids):
        raise ValueError(f"step {batch.step_id}: {len(result.logprobs)} logprobs for {len(result.token_ids)} tokens")
    return in_flight


def sequence_output(
    seq: Sequence, new_token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]
) -> SequenceOutput:
    num_prompt_tokens = seq.num_prompt_tokens
    return SequenceOutput(  # positional: a step builds one per sequence (fields: seq_id, ...)
        seq.seq_id, new_token_ids, seq.finish_reason, num_prompt_tokens, seq.num_resolved_tokens - num_prompt_tokens,
        logprobs, seq.num_cached_tokens,
    )

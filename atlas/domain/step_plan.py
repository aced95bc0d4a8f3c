"""The scheduler's bookkeeping of one step: the plan being built, the record of a step in
flight, and the plain data each becomes (`ScheduledSequence` for the worker, `SequenceOutput`
for the front end), with the check that a result belongs to the step it is committed against.
"""

from __future__ import annotations

import msgspec

from atlas.domain.batch import (
    BlockTable,
    ScheduledBatch,
    ScheduledSequence,
    SequenceOutput,
    StepResult,
    TokenLogprobs,
)
from atlas.domain.sampling import sampling_rows
from atlas.domain.sequence import PLACEHOLDER_TOKEN, Sequence


class Planned(msgspec.Struct, frozen=True):
    """One sequence's share of a step: `num_tokens` from `num_computed_tokens` on, the last
    `num_drafts` of them drafts to verify."""

    seq: Sequence
    num_tokens: int
    samples: bool
    num_drafts: int

    @property
    def num_rows(self) -> int:
        """Rows the step samples for it."""
        return 1 + self.num_drafts if self.samples else 0

    @property
    def needs_host_token(self) -> bool:
        """Whether the sequence's next step needs this step's tokens on the host: its penalty
        context, or how many drafts it keeps."""
        return self.samples and (self.num_drafts > 0 or self.seq.sampling.has_penalties)


class InFlightStep(msgspec.Struct, frozen=True):
    step_id: int
    planned: tuple[Planned, ...]


class StepPlan:
    """The step being built: what is scheduled so far and the budget left."""

    __slots__ = ("budget_left", "planned", "num_preempted")

    def __init__(self, budget: int) -> None:
        self.budget_left = budget
        self.planned: list[Planned] = []
        self.num_preempted = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        samples = seq.num_computed_tokens + num_tokens == seq.num_tokens
        self.planned.append(Planned(seq, num_tokens, samples, seq.num_draft_tokens))
        self.budget_left -= num_tokens


def scheduled_sequence(
    planned: Planned, tables: tuple[tuple[int, ...], tuple[BlockTable, ...], tuple[int, ...]]
) -> ScheduledSequence:
    """The step's view of `planned` (its cache `tables` from `CacheManager.step_tables`), taken
    before the step advances the sequence."""
    seq = planned.seq
    start = seq.num_computed_tokens
    token_ids = tuple(seq.tokens_slice(start, start + planned.num_tokens))
    placeholder_row = None
    if token_ids[-1] == PLACEHOLDER_TOKEN:
        # only the newest placeholder can be computed: the previous step samples it
        pending = seq.pending
        assert len(pending) == 1 and start + planned.num_tokens == seq.num_tokens
        placeholder_row = pending[-1].sample_row
    block_ids, kv_block_tables, state_slots = tables
    rows = sampling_rows(seq) if planned.samples else ()
    return ScheduledSequence(
        seq_id=seq.seq_id,
        token_ids=token_ids,
        start_position=start,
        block_ids=block_ids,
        sampling=rows[0] if rows else None,
        placeholder_row=placeholder_row,
        kv_block_tables=kv_block_tables,
        state_slots=state_slots,
        num_draft_tokens=planned.num_drafts,
        draft_rows=rows[1:],
    )


def check_result(in_flight: InFlightStep | None, batch: ScheduledBatch, result: StepResult) -> InFlightStep:
    """`in_flight` (the oldest step in flight), once `batch` and `result` are known to be its.
    Raises ValueError naming the mismatch otherwise."""
    if in_flight is None or batch.step_id != in_flight.step_id or len(batch.sequences) != len(in_flight.planned):
        pending = "none" if in_flight is None else f"step {in_flight.step_id}"
        raise ValueError(f"batch of step {batch.step_id} is not the oldest in flight ({pending})")
    if result.step_id != batch.step_id:
        raise ValueError(f"result of step {result.step_id} committed against batch of step {batch.step_id}")
    if len(result.token_ids) != batch.num_sampled:
        raise ValueError(
            f"step {batch.step_id} samples {batch.num_sampled} tokens but the result has {len(result.token_ids)}"
        )
    if result.logprobs is not None and len(result.logprobs) != len(result.token_ids):
        raise ValueError(f"step {batch.step_id}: {len(result.logprobs)} logprobs for {len(result.token_ids)} tokens")
    return in_flight


def sequence_output(
    seq: Sequence, new_token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]
) -> SequenceOutput:
    return SequenceOutput(
        seq_id=seq.seq_id,
        new_token_ids=new_token_ids,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_resolved_tokens - seq.num_prompt_tokens,
        logprobs=logprobs,
        num_cached_tokens=seq.num_cached_tokens,
    )

"""Plain data crossing from the scheduler to the worker and back.

`ScheduledBatch` says which tokens to compute this step and which sequences sample;
`StepResult` carries only the sampled ids (and logprobs when asked). No live domain object
crosses: the worker never calls back into the scheduler.

The types built once per sequence per step (`SamplingRow`, `BlockTable`, `ScheduledSequence`,
`TokenLogprobs`, `SequenceOutput`) are frozen msgspec Structs: at batch 64 a step builds hundreds of them, and a
Struct is built about ten times faster than a frozen dataclass (`msgspec.structs.replace`
derives one from another).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from atlas.domain.requests import FinishReason


class SamplingRow(msgspec.Struct, frozen=True):
    """Everything the device needs to draw the next token of one sequence."""

    temperature: float
    top_k: int  # 0 = off
    top_p: float
    min_p: float
    seed: int  # 64-bit, unsigned
    counter: int  # tokens sampled so far: the position in the seed's random stream
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_token_ids: tuple[int, ...] = ()  # distinct ids in prompt + output
    penalty_output_counts: tuple[int, ...] = ()  # their counts in the output
    bias_token_ids: tuple[int, ...] = ()  # logit_bias, and eos bans before min_tokens
    bias_values: tuple[float, ...] = ()
    num_logprobs: int | None = None  # None: no logprobs; 0: only the sampled token's

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.penalty_token_ids) and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


class BlockTable(msgspec.Struct, frozen=True):
    """One KV cache group's pages of one sequence. Position p lives in page
    `block_ids[p // block_size - first_block_idx]`; blocks before `first_block_idx` left a
    sliding window and are no longer held (always 0 in a full-attention group).

        block_size 4, first_block_idx 2, block_ids (7, 3)
        positions  0 .. 7 | 8 9 10 11 | 12 13
        page       (none) | 7         | 3
    """

    block_ids: tuple[int, ...]
    first_block_idx: int = 0


class ScheduledSequence(msgspec.Struct, frozen=True):
    """One sequence's share of a step: compute `token_ids` at positions start_position..

    A model with one full-attention cache group (every model before cache groups) needs only
    `block_ids`. A model with several groups (sliding-window layers, recurrent layers) gets one
    table per KV group in `kv_block_tables` and one slot per recurrent group in `state_slots`,
    in the order of the model's group specs; `block_ids` is then its first KV group's pages.

    A sequence verifying speculative drafts computes its last token and `num_draft_tokens`
    drafts (the tail of `token_ids`) and samples a row at each of those positions: `sampling`
    for the first, `draft_rows` for the others (`sampling_rows` lists them all). With recurrent
    groups it also names `state_snapshots`, where the states after those tokens go.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]  # the (first KV group's) block table, covering every position computed
    sampling: SamplingRow | None  # None: a prefill chunk that does not reach the last token
    # The last token is a placeholder (PLACEHOLDER_TOKEN) sampled by the previous step, still
    # on the device: its id is that step's sampled id of this row.
    placeholder_row: int | None = None
    kv_block_tables: tuple[BlockTable, ...] = ()  # every KV group's; () for a lone full-attention group
    state_slots: tuple[int, ...] = ()  # every recurrent-state group's slot
    num_draft_tokens: int = 0
    draft_rows: tuple[SamplingRow, ...] = ()  # one per draft: the rows after `sampling`
    # A verifying sequence's snapshot slots per recurrent-state group (() otherwise): slot j of
    # a group receives the state after sampling row j's token, the sequence's own slot the
    # state after its last (`RecurrentMetadata.snapshot_slots`).
    state_snapshots: tuple[tuple[int, ...], ...] = ()

    def decode_row(self, offset: int, sampling: SamplingRow) -> ScheduledSequence:
        """Token `offset` of this chunk alone, at its position, over the same tables, sampled
        with `sampling` (a verify chunk's rows, see `worker.decode_rows`)."""
        return ScheduledSequence(
            seq_id=self.seq_id,
            token_ids=(self.token_ids[offset],),
            start_position=self.start_position + offset,
            block_ids=self.block_ids,
            sampling=sampling,
            kv_block_tables=self.kv_block_tables,
            state_slots=self.state_slots,
        )

    @property
    def sampling_rows(self) -> tuple[SamplingRow, ...]:
        """Every row this sequence samples this step, in order (none for a prefill chunk)."""
        return () if self.sampling is None else (self.sampling, *self.draft_rows)

    @property
    def block_tables(self) -> tuple[BlockTable, ...]:
        """One table per KV cache group, whatever the number of groups."""
        return self.kv_block_tables or (BlockTable(self.block_ids),)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step: sequences in order, prefill chunks and decodes mixed.

    `awaits_masks`: some sampling row follows a token constraint whose mask depends on tokens
    the host commits after submitting this step; the worker samples once it gets the masks.
    """

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    block_size: int
    awaits_masks: bool = False

    @property
    def num_tokens(self) -> int:
        return sum([len(s.token_ids) for s in self.sequences])  # a list: faster than a generator

    @property
    def num_sampled(self) -> int:
        """Rows the step samples: one per sampling sequence, plus one per draft."""
        return sum([1 + s.num_draft_tokens for s in self.sequences if s.sampling is not None])

    @property
    def is_empty(self) -> bool:
        return not self.sequences


class TokenLogprobs(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled ids, one per sampling row (`ScheduledSequence.sampling_rows`), in the batch's order.

    `hidden_states`: with a worker that keeps layer outputs (`WorkerConfig.keep_hidden_layers`),
    float32 [num_tokens, len(kept) * H]: every token of the step in batch order, each kept
    layer's output side by side (what speculative draft heads are fed); else None.
    """

    step_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    hidden_states: np.ndarray | None = None


class SequenceOutput(msgspec.Struct, frozen=True):
    """What one step changed for one sequence, published to its request's stream."""

    seq_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # Set when the engine ended the sequence on an error (a sampled token its constraint
    # forbids); the finish reason is then ABORT and the request failed. `error_field` names the
    # request field at fault when the request caused it (its grammar was too much for the
    # grammar engine): a 400, not the engine's failure.
    error: str | None = None
    error_field: str | None = None

"""Host-side arrays describing one step, built from a `ScheduledBatch`.

These are what the worker copies into its persistent device buffers. Building them is pure
numpy so it is tested without a device; see `AttentionMetadata` for the layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from atlas.domain.batch import ScheduledBatch


@dataclass(frozen=True, slots=True)
class HostStepInputs:
    token_ids: np.ndarray  # [N] i32
    positions: np.ndarray  # [N] i32
    slot_mapping: np.ndarray  # [N] i32
    query_start_loc: np.ndarray  # [S + 1] i32
    seq_lens: np.ndarray  # [S] i32
    block_tables: np.ndarray  # [S, W] i32, rows padded with the scratch block
    sample_indices: np.ndarray  # [R] i32: the last token row of each sampling sequence
    token_gather: np.ndarray  # [N] i32: where each token id comes from (see StepBuffers)
    has_placeholders: bool  # some token ids are the previous step's samples, on the device
    max_query_len: int
    max_seq_len: int

    @classmethod
    def empty(cls, table_width: int) -> HostStepInputs:
        """A step with no sequences (padded into a graph's warm-up inputs)."""
        none = np.zeros(0, np.int32)
        return cls(
            token_ids=none, positions=none, slot_mapping=none, query_start_loc=np.zeros(1, np.int32),
            seq_lens=none, block_tables=np.zeros((0, table_width), np.int32), sample_indices=none,
            token_gather=none, has_placeholders=False, max_query_len=1, max_seq_len=1,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_sample_rows(self) -> int:
        return int(self.sample_indices.shape[0])


def build_step_inputs(
    batch: ScheduledBatch, table_width: int, scratch_block: int, num_sample_slots: int
) -> HostStepInputs:
    """Flatten a batch into varlen arrays.

    Token i's id is read from row `token_gather[i]` of the token source: the previous step's
    sampled ids occupy rows [0, num_sample_slots), this step's host tokens follow.

    Raises ValueError when a sequence's block table is wider than `table_width` or does not
    cover the positions it computes (a scheduler bug that must never reach a kernel).
    """
    block_size = batch.block_size
    sequences = batch.sequences
    num_seqs = len(sequences)
    # One pass of Python over the sequences per field, then numpy: at 64 or more sequences a
    # step this builds every few milliseconds, the host's per-sequence work is what shows.
    query_lens = np.fromiter((len(seq.token_ids) for seq in sequences), np.int32, num_seqs)
    starts = np.fromiter((seq.start_position for seq in sequences), np.int32, num_seqs)
    num_blocks = np.fromiter((len(seq.block_ids) for seq in sequences), np.int32, num_seqs)
    seq_lens = starts + query_lens
    for index in np.flatnonzero((num_blocks > table_width) | (num_blocks * block_size < seq_lens)):
        seq = sequences[index]
        if len(seq.block_ids) > table_width:
            raise ValueError(f"sequence {seq.seq_id!r} has {len(seq.block_ids)} blocks, more than {table_width}")
        raise ValueError(f"sequence {seq.seq_id!r}: {len(seq.block_ids)} blocks cannot hold {seq.context_len} tokens")
    query_start = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    block_tables = np.full((num_seqs, table_width), scratch_block, np.int32)
    # a row-major boolean mask takes the concatenated tables in order
    block_tables[np.arange(table_width) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(seq.block_ids for seq in sequences), np.int32, int(num_blocks.sum())
    )
    token_seq = np.repeat(np.arange(num_seqs), query_lens)  # the sequence of each token row
    positions = (np.arange(num_tokens) + np.repeat(starts - query_start[:-1], query_lens)).astype(np.int32)
    slot_mapping = block_tables[token_seq, positions // block_size] * block_size + positions % block_size
    samples = np.fromiter((seq.sampling is not None for seq in sequences), bool, num_seqs)
    token_gather = np.arange(num_sample_slots, num_sample_slots + num_tokens, dtype=np.int32)
    placeholder_rows = np.fromiter(
        (-1 if seq.placeholder_row is None else seq.placeholder_row for seq in sequences), np.int32, num_seqs
    )
    placeholders = placeholder_rows >= 0  # last token rows sampled by the previous step, on the device
    token_gather[query_start[1:][placeholders] - 1] = placeholder_rows[placeholders]
    return HostStepInputs(
        token_ids=np.fromiter(itertools.chain.from_iterable(seq.token_ids for seq in sequences), np.int32, num_tokens),
        positions=positions,
        slot_mapping=slot_mapping.astype(np.int32),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_indices=query_start[1:][samples] - 1,
        token_gather=token_gather,
        has_placeholders=bool(placeholders.any()),
        max_query_len=int(query_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
    )


def pad_decode_inputs(
    inputs: HostStepInputs, num_seqs: int, scratch_block: int, block_size: int, num_sample_slots: int
) -> HostStepInputs:
    """Pad a decode-only step (one token per sequence) to `num_seqs` rows for a captured graph.

    Padding rows compute one token at position 0 of the scratch block and are sampled into
    rows nobody reads; real rows keep their indices.
    """
    extra = num_seqs - inputs.num_seqs
    if extra < 0 or inputs.num_tokens != inputs.num_seqs:
        raise ValueError("only decode steps (one token per sequence) can be padded")
    width = inputs.block_tables.shape[1]
    scratch_slot = scratch_block * block_size
    padded_gather = np.concatenate(
        [inputs.token_gather, num_sample_slots + np.arange(inputs.num_tokens, num_seqs, dtype=np.int32)]
    )
    return HostStepInputs(
        token_ids=np.concatenate([inputs.token_ids, np.zeros(extra, np.int32)]),
        positions=np.concatenate([inputs.positions, np.zeros(extra, np.int32)]),
        slot_mapping=np.concatenate([inputs.slot_mapping, np.full(extra, scratch_slot, np.int32)]),
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
        seq_lens=np.concatenate([inputs.seq_lens, np.ones(extra, np.int32)]),
        block_tables=np.concatenate([inputs.block_tables, np.full((extra, width), scratch_block, np.int32)]),
        sample_indices=np.arange(num_seqs, dtype=np.int32),
        token_gather=padded_gather,
        has_placeholders=inputs.has_placeholders,
        max_query_len=1,
        max_seq_len=inputs.max_seq_len,
    )

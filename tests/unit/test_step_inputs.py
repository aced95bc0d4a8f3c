"""build_step_inputs against a per-sequence loop that spells out what each array holds."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.sequence import PLACEHOLDER_TOKEN
from atlas.domain.step_inputs import build_step_inputs

BLOCK_SIZE = 16
TABLE_WIDTH = 16
SCRATCH_BLOCK = 999
SAMPLE_SLOTS = 8
ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def expected_inputs(batch: ScheduledBatch) -> dict[str, np.ndarray]:
    """Sequence by sequence: token i of sequence s sits at position start + i, in the slot its
    block table gives that position; sampling sequences sample their last token row."""
    token_ids, positions, slots, seq_lens, samples, tables = [], [], [], [], [], []
    gather = []
    row = 0
    query_start = [0]
    for seq in batch.sequences:
        table = list(seq.block_ids) + [SCRATCH_BLOCK] * (TABLE_WIDTH - len(seq.block_ids))
        tables.append(table)
        for i, token in enumerate(seq.token_ids):
            position = seq.start_position + i
            token_ids.append(token)
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            last = i == len(seq.token_ids) - 1
            gather.append(seq.placeholder_row if last and seq.placeholder_row is not None else SAMPLE_SLOTS + row)
            row += 1
        query_start.append(row)
        seq_lens.append(seq.start_position + len(seq.token_ids))
        if seq.sampling is not None:
            samples.append(row - 1)
    return {
        "token_ids": np.array(token_ids, np.int32),
        "positions": np.array(positions, np.int32),
        "slot_mapping": np.array(slots, np.int32),
        "query_start_loc": np.array(query_start, np.int32),
        "seq_lens": np.array(seq_lens, np.int32),
        "block_tables": np.array(tables, np.int32).reshape(len(tables), TABLE_WIDTH),
        "sample_indices": np.array(samples, np.int32),
        "token_gather": np.array(gather, np.int32),
    }


def random_batch(rng: np.random.Generator, num_seqs: int) -> ScheduledBatch:
    """Prefill chunks, whole prompts and decode rows (some a placeholder), in shuffled blocks."""
    free_blocks = list(rng.permutation(500))
    sequences = []
    for index in range(num_seqs):
        start = int(rng.integers(0, 150))
        num_tokens = 1 if rng.random() < 0.6 else int(rng.integers(2, 40))
        blocks = -(-(start + num_tokens) // BLOCK_SIZE) + int(rng.integers(0, 2))
        placeholder = num_tokens == 1 and rng.random() < 0.5
        tokens = tuple(int(t) for t in rng.integers(0, 1000, num_tokens))
        if placeholder:
            tokens = (*tokens[:-1], PLACEHOLDER_TOKEN)
        sequences.append(
            ScheduledSequence(
                seq_id=f"s{index}",
                token_ids=tokens,
                start_position=start,
                block_ids=tuple(int(free_blocks.pop()) for _ in range(blocks)),
                sampling=ROW if num_tokens == 1 or rng.random() < 0.5 else None,
                placeholder_row=int(rng.integers(0, SAMPLE_SLOTS)) if placeholder else None,
            )
        )
    return ScheduledBatch(step_id=1, sequences=tuple(sequences), block_size=BLOCK_SIZE)


@pytest.mark.parametrize("num_seqs", [0, 1, 7, 64])
def test_the_arrays_are_the_per_sequence_definition(num_seqs):
    rng = np.random.default_rng(num_seqs)
    for _ in range(5):
        batch = random_batch(rng, num_seqs)
        inputs = build_step_inputs(batch, TABLE_WIDTH, SCRATCH_BLOCK, SAMPLE_SLOTS)
        for name, expected in expected_inputs(batch).items():
            actual = getattr(inputs, name)
            assert actual.dtype == np.int32, name
            np.testing.assert_array_equal(actual, expected, err_msg=name)
        assert inputs.has_placeholders == any(s.placeholder_row is not None for s in batch.sequences)
        assert inputs.max_query_len == max((s.num_tokens for s in batch.sequences), default=0)
        assert inputs.max_seq_len == max((s.context_len for s in batch.sequences), default=0)


def test_a_table_too_wide_or_too_short_is_named():
    fine = ScheduledSequence("fine", (5,), 20, (1, 2), ROW)
    wide = ScheduledSequence("wide", (5,), 20, tuple(range(TABLE_WIDTH + 1)), ROW)
    short = ScheduledSequence("short", (5, 6), 31, (3, 4), ROW)  # positions 31 and 32 need 3 blocks
    with pytest.raises(ValueError, match="'wide' has 17 blocks, more than 16"):
        build_step_inputs(ScheduledBatch(1, (fine, wide, short), BLOCK_SIZE), TABLE_WIDTH, SCRATCH_BLOCK, 1)
    with pytest.raises(ValueError, match="'short': 2 blocks cannot hold 33 tokens"):
        build_step_inputs(ScheduledBatch(1, (fine, short), BLOCK_SIZE), TABLE_WIDTH, SCRATCH_BLOCK, 1)

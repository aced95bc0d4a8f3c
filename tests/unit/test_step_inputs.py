"""build_step_inputs against a per-sequence loop that spells out what each array holds."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.sequence import PLACEHOLDER_TOKEN
from atlas.domain.step_inputs import (
    CacheLayout,
    HostStepInputs,
    TableRows,
    build_step_inputs,
    pad_decode_inputs,
    state_chunks,
)

BLOCK_SIZE = 16
TABLE_WIDTH = 16
SCRATCH_BLOCK = 999
SAMPLE_SLOTS = 8
ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
ONE_GROUP = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK,))
WINDOW = 20  # the second KV group of HYBRID is a sliding window of this many tokens
HYBRID = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK, 777), state_scratch_slots=(128, 129))


def expected_inputs(batch: ScheduledBatch, layout: CacheLayout) -> dict[str, np.ndarray]:
    """Sequence by sequence: token i of sequence s sits at position start + i, in the slot each
    group's block table gives that position (block b at index b, the group's scratch block
    where none is held); sampling sequences sample their last token row."""
    token_ids, positions, seq_lens, samples, tables = [], [], [], [], []
    slots: list[list[int]] = [[] for _ in layout.kv_scratch_blocks]
    gather = []
    row = 0
    query_start = [0]
    for seq in batch.sequences:
        rows = []
        for group, table in enumerate(seq.block_tables):
            entries = [layout.kv_scratch_blocks[group]] * TABLE_WIDTH
            entries[table.first_block_idx : table.first_block_idx + len(table.block_ids)] = table.block_ids
            rows.append(entries)
        tables.append(rows)
        for i, token in enumerate(seq.token_ids):
            position = seq.start_position + i
            token_ids.append(token)
            positions.append(position)
            for group, entries in enumerate(rows):
                slots[group].append(entries[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            last = i == len(seq.token_ids) - 1
            gather.append(seq.placeholder_row if last and seq.placeholder_row is not None else SAMPLE_SLOTS + row)
            row += 1
        query_start.append(row)
        seq_lens.append(seq.start_position + len(seq.token_ids))
        if seq.sampling is not None:
            samples.append(row - 1)
    num_seqs = len(batch.sequences)
    return {
        "token_ids": np.array(token_ids, np.int32),
        "positions": np.array(positions, np.int32),
        "slot_mapping": np.array(slots, np.int32).reshape(layout.num_kv_groups, len(token_ids)),
        "query_start_loc": np.array(query_start, np.int32),
        "seq_lens": np.array(seq_lens, np.int32),
        "block_tables": np.array(tables, np.int32).reshape(num_seqs, layout.num_kv_groups, TABLE_WIDTH),
        "state_slots": np.array([s.state_slots for s in batch.sequences], np.int32).reshape(
            num_seqs, layout.num_state_groups).T,
        "sample_indices": np.array(samples, np.int32),
        "token_gather": np.array(gather, np.int32),
    }


def random_batch(rng: np.random.Generator, num_seqs: int, layout: CacheLayout = ONE_GROUP) -> ScheduledBatch:
    """Prefill chunks, whole prompts and decode rows (some a placeholder), in shuffled blocks;
    for HYBRID also a sliding-window table that released the blocks before its window, and
    state slots."""
    free_blocks = list(rng.permutation(2000))
    free_slots = list(rng.permutation(128))
    sequences = []
    for index in range(num_seqs):
        start = int(rng.integers(0, 150))
        num_tokens = 1 if rng.random() < 0.6 else int(rng.integers(2, 40))
        blocks = -(-(start + num_tokens) // BLOCK_SIZE) + int(rng.integers(0, 2))
        placeholder = num_tokens == 1 and rng.random() < 0.5
        tokens = tuple(int(t) for t in rng.integers(0, 1000, num_tokens))
        if placeholder:
            tokens = (*tokens[:-1], PLACEHOLDER_TOKEN)
        block_ids = tuple(int(free_blocks.pop()) for _ in range(blocks))
        tables: tuple[BlockTable, ...] = ()
        state_slots: tuple[int, ...] = ()
        if layout is HYBRID:
            first = max(0, start - WINDOW + 1) // BLOCK_SIZE
            tables = (BlockTable(block_ids), BlockTable(tuple(int(free_blocks.pop()) for _ in range(blocks - first)), first))
            state_slots = (int(free_slots.pop()), int(free_slots.pop()))
        sequences.append(
            ScheduledSequence(
                seq_id=f"s{index}",
                token_ids=tokens,
                start_position=start,
                block_ids=block_ids,
                sampling=ROW if num_tokens == 1 or rng.random() < 0.5 else None,
                placeholder_row=int(rng.integers(0, SAMPLE_SLOTS)) if placeholder else None,
                kv_block_tables=tables,
                state_slots=state_slots,
            )
        )
    return ScheduledBatch(step_id=1, sequences=tuple(sequences), block_size=BLOCK_SIZE)


@pytest.mark.parametrize("layout", [ONE_GROUP, HYBRID], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("num_seqs", [0, 1, 7, 64])
def test_the_arrays_are_the_per_sequence_definition(num_seqs, layout):
    rng = np.random.default_rng(num_seqs)
    for _ in range(5):
        batch = random_batch(rng, num_seqs, layout)
        inputs = build_step_inputs(batch, layout, SAMPLE_SLOTS)
        for name, expected in expected_inputs(batch, layout).items():
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
        build_step_inputs(ScheduledBatch(1, (fine, wide, short), BLOCK_SIZE), ONE_GROUP, 1)
    with pytest.raises(ValueError, match="'short': 2 blocks cannot hold 33 tokens"):
        build_step_inputs(ScheduledBatch(1, (fine, short), BLOCK_SIZE), ONE_GROUP, 1)
    with pytest.raises(ValueError, match="'fine' carries 1 block tables and 0 state slots for 2 KV and 2 recurrent"):
        build_step_inputs(ScheduledBatch(1, (fine,), BLOCK_SIZE), HYBRID, 1)


def test_padding_rows_write_and_read_only_each_groups_scratch_page():
    rng = np.random.default_rng(5)
    decodes = [s for s in random_batch(rng, 12, HYBRID).sequences if s.num_tokens == 1][:3]
    inputs = build_step_inputs(ScheduledBatch(1, tuple(decodes), BLOCK_SIZE), HYBRID, SAMPLE_SLOTS)
    padded = pad_decode_inputs(inputs, 5, HYBRID, SAMPLE_SLOTS)
    real = len(decodes)
    np.testing.assert_array_equal(padded.slot_mapping[:, :real], inputs.slot_mapping)
    assert padded.slot_mapping[:, real:].tolist() == [[SCRATCH_BLOCK * BLOCK_SIZE] * 2, [777 * BLOCK_SIZE] * 2]
    assert (padded.block_tables[real:, 0] == SCRATCH_BLOCK).all() and (padded.block_tables[real:, 1] == 777).all()
    assert padded.state_slots[:, real:].tolist() == [[128, 128], [129, 129]]
    # a padding row is one token of a fresh sequence: a recurrent layer starts it from zero state
    assert padded.seq_lens[real:].tolist() == [1, 1] and padded.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    empty = pad_decode_inputs(HostStepInputs.empty(HYBRID), 2, HYBRID, SAMPLE_SLOTS)
    assert empty.block_tables.shape == (2, 2, TABLE_WIDTH) and empty.state_slots.shape == (2, 2)


def test_kept_table_rows_equal_tables_built_afresh_as_sequences_grow_leave_join_and_move():
    """`TableRows` rewrites only rows whose block ids are another tuple than the one the row
    was written from; whatever the batch does between steps, the tables must be the ones a
    fresh build gives."""
    rng = np.random.default_rng(7)
    rows = TableRows(12, ONE_GROUP)
    free_blocks = iter(rng.permutation(5000).tolist())
    tables = {f"s{index}": tuple(next(free_blocks) for _ in range(1 + index % 5)) for index in range(20)}
    ids: list[str] = []
    for step in range(80):
        if step % 8 == 0:  # another batch: sequences left, joined and moved
            ids = [str(seq_id) for seq_id in rng.choice(sorted(tables), size=int(rng.integers(0, 13)), replace=False)]
        elif step % 8 == 4 and ids:  # one left, the rest moved up a row
            ids.pop(int(rng.integers(0, len(ids))))
        for seq_id in ids:  # otherwise the same sequences in the same order, as in steady decode
            if rng.random() < 0.15 and len(tables[seq_id]) < TABLE_WIDTH:
                tables[seq_id] += (next(free_blocks),)  # a page taken: a new tuple
            elif rng.random() < 0.05:
                tables[seq_id] = tables[seq_id][:1]  # rolled back
        batch = ScheduledBatch(step, tuple(
            ScheduledSequence(seq_id, (1,), BLOCK_SIZE * len(tables[seq_id]) - 1, tables[seq_id], ROW) for seq_id in ids
        ), BLOCK_SIZE)
        kept = build_step_inputs(batch, ONE_GROUP, SAMPLE_SLOTS, rows)
        afresh = build_step_inputs(batch, ONE_GROUP, SAMPLE_SLOTS)
        np.testing.assert_array_equal(kept.block_tables, afresh.block_tables)
        np.testing.assert_array_equal(kept.slot_mapping, afresh.slot_mapping)


def test_kept_table_rows_still_check_every_table():
    rows = TableRows(4, ONE_GROUP)
    fine = ScheduledSequence("fine", (5,), 20, (1, 2), ROW)
    build_step_inputs(ScheduledBatch(1, (fine,), BLOCK_SIZE), ONE_GROUP, 1, rows)
    short = ScheduledSequence("short", (5, 6), 31, (3, 4), ROW)
    with pytest.raises(ValueError, match="'short': 2 blocks cannot hold 33 tokens"):
        build_step_inputs(ScheduledBatch(2, (fine, short), BLOCK_SIZE), ONE_GROUP, 1, rows)
    with pytest.raises(ValueError, match="lone full-attention"):
        TableRows(4, HYBRID)


def test_a_full_bucket_pads_to_itself():
    """A decode step whose every row samples, padded to its own size, is already what the
    graph reads: one token row per sequence, each sampled in order."""
    rng = np.random.default_rng(11)
    decodes = tuple(s for s in random_batch(rng, 16, HYBRID).sequences if s.num_tokens == 1)
    inputs = build_step_inputs(ScheduledBatch(1, decodes, BLOCK_SIZE), HYBRID, SAMPLE_SLOTS)
    padded = pad_decode_inputs(inputs, len(decodes), HYBRID, SAMPLE_SLOTS)
    assert padded.query_start_loc.tolist() == list(range(len(decodes) + 1))
    assert padded.sample_indices.tolist() == list(range(len(decodes)))
    for name, expected in expected_inputs(ScheduledBatch(1, decodes, BLOCK_SIZE), HYBRID).items():
        np.testing.assert_array_equal(getattr(padded, name), expected, err_msg=name)


def test_the_recurrent_groups_see_each_verify_chunk_whole_with_its_snapshot_slots():
    """A prefill chunk of 5 and a verify chunk of the last token and 2 drafts: attention's rows
    split the verify chunk into 3 decode rows; the state chunks keep 2 sequences, the verify
    one naming its 2 snapshot slots per recurrent group (width 3: the last column unused)."""
    layout = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK,), state_scratch_slots=(128, 129), snapshot_width=3)
    prefill = ScheduledSequence("a", (1, 2, 3, 4, 5), 0, (0,), None, kv_block_tables=(BlockTable((0,)),),
                                state_slots=(4, 14))
    verify = ScheduledSequence("b", (7, 8, 9), 10, (1,), ROW, kv_block_tables=(BlockTable((1,)),), state_slots=(5, 15),
                               num_draft_tokens=2, draft_rows=(ROW, ROW), state_snapshots=((6, 7), (16, 17)))
    chunks = state_chunks(ScheduledBatch(3, (prefill, verify), BLOCK_SIZE), layout)
    assert chunks.query_start_loc.tolist() == [0, 5, 8] and chunks.seq_lens.tolist() == [5, 13]
    assert chunks.state_slots.tolist() == [[4, 5], [14, 15]] and chunks.max_query_len == 5
    assert chunks.snapshot_slots.tolist() == [[[-1, -1, -1], [6, 7, -1]], [[-1, -1, -1], [16, 17, -1]]]
    narrow = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK,), state_scratch_slots=(128, 129), snapshot_width=1)
    with pytest.raises(ValueError, match=r"'b' verifies 2 drafts with snapshot slots \[2, 2\]"):
        state_chunks(ScheduledBatch(3, (prefill, verify), BLOCK_SIZE), narrow)


def test_one_sequence_alone_builds_what_the_general_path_builds_as_its_rows_and_tables_change():
    """A batch of one sequence (a decode, or a verify chunk as `decode_rows` splits it) takes a
    shorter path through kept table rows: every array must be the general path's, whatever
    steps of several sequences ran on the same rows in between."""
    from atlas.domain.worker import decode_rows

    rng = np.random.default_rng(11)
    rows = TableRows(24, ONE_GROUP)
    block_ids = (5, 9, 2)
    start = 30
    for step in range(60):
        if rng.random() < 0.3 and len(block_ids) < TABLE_WIDTH:
            block_ids += (int(rng.integers(10, 900)),)  # a page taken: a new tuple
        room = len(block_ids) * BLOCK_SIZE - start
        num_drafts = int(rng.integers(0, min(room, 17)))
        tokens = tuple(int(t) for t in rng.integers(0, 1000, 1 + num_drafts))
        rows_of = (ROW,) * num_drafts
        chunk = ScheduledSequence("s", tokens, start, block_ids, ROW, num_draft_tokens=num_drafts, draft_rows=rows_of)
        batch = ScheduledBatch(step, (chunk,), BLOCK_SIZE)
        if step % 7 == 3:  # other sequences on the same rows
            batch = random_batch(rng, int(rng.integers(1, 20)))
        batch = decode_rows(batch)
        kept = build_step_inputs(batch, ONE_GROUP, SAMPLE_SLOTS, rows)
        afresh = build_step_inputs(batch, ONE_GROUP, SAMPLE_SLOTS)
        for name, expected in expected_inputs(batch, ONE_GROUP).items():
            np.testing.assert_array_equal(getattr(kept, name), expected, err_msg=name)
            assert getattr(kept, name).dtype == getattr(afresh, name).dtype, name
        assert (kept.has_placeholders, kept.max_query_len, kept.max_seq_len) == (
            afresh.has_placeholders, afresh.max_query_len, afresh.max_seq_len)
        if afresh.num_tokens == afresh.num_seqs:  # padded to a graph's rows as the worker pads them
            bucket = afresh.num_seqs + int(rng.integers(0, 5))
            padded = build_step_inputs(batch, ONE_GROUP, SAMPLE_SLOTS, rows, bucket)
            expected = pad_decode_inputs(afresh, bucket, ONE_GROUP, SAMPLE_SLOTS)
            assert pad_decode_inputs(padded, bucket, ONE_GROUP, SAMPLE_SLOTS) is padded or step % 7 == 3
            for name in HostStepInputs.__dataclass_fields__:
                actual, wanted = getattr(padded, name), getattr(expected, name)
                if isinstance(wanted, np.ndarray):
                    np.testing.assert_array_equal(actual, wanted, err_msg=name)
                    assert actual.dtype == wanted.dtype, name
                else:
                    assert actual == wanted, name
        start = min(start + 1 + int(rng.integers(0, num_drafts + 1)), len(block_ids) * BLOCK_SIZE - 1)


def test_a_lone_verify_step_padded_on_the_short_path_keeps_its_shared_prefix():
    """17 rows of one sequence over 40 pages read a prefix together (cascade attention): padded
    to a graph's 24 rows on the short path, the arrays and the prefix are those the general path
    and `pad_decode_inputs` give."""
    from atlas.domain.worker import decode_rows

    layout = CacheLayout(BLOCK_SIZE, 64, (SCRATCH_BLOCK,), kv_token_bytes=(1 << 16,))
    block_ids = tuple(range(100, 140))
    chunk = ScheduledSequence("s", tuple(range(17)), 600, block_ids, ROW, num_draft_tokens=16, draft_rows=(ROW,) * 16)
    batch = decode_rows(ScheduledBatch(1, (chunk,), BLOCK_SIZE))
    padded = build_step_inputs(batch, layout, SAMPLE_SLOTS, TableRows(32, layout), 24)
    expected = pad_decode_inputs(build_step_inputs(batch, layout, SAMPLE_SLOTS), 24, layout, SAMPLE_SLOTS)
    assert padded.shared_prefix is not None and padded.shared_prefix[0, 0] >= 256
    for name in HostStepInputs.__dataclass_fields__:
        actual, wanted = getattr(padded, name), getattr(expected, name)
        if isinstance(wanted, np.ndarray):
            np.testing.assert_array_equal(actual, wanted, err_msg=name)
        else:
            assert actual == wanted, name


def test_steady_decode_continued_on_kept_rows_builds_what_the_general_path_builds():
    """A decode step of the last step's sequences, one position further, takes a shorter path
    through `TableRows` (`_continued_decode`): whatever the batch does between steps (pages
    taken or replaced, rows crossing into a block, sequences joining or leaving, a prefill chunk,
    rows committed on the host instead of placeholders, a sequence preempted back), every array,
    the shared prefix included, must be the general path's."""
    rng = np.random.default_rng(5)
    layout = CacheLayout(BLOCK_SIZE, 64, (SCRATCH_BLOCK,), kv_token_bytes=(1 << 16,))
    rows = TableRows(24, layout)
    free_blocks = iter(rng.permutation(np.arange(100, 20000)).tolist())
    prefix = tuple(next(free_blocks) for _ in range(20))  # a shared system prompt of 320 tokens
    starts: dict[str, int] = {}
    tables: dict[str, tuple[int, ...]] = {}

    def join(seq_id: str) -> None:
        opening = prefix if rng.random() < 0.85 else ()
        starts[seq_id] = len(opening) * BLOCK_SIZE + int(rng.integers(0, 3 * BLOCK_SIZE))
        tables[seq_id] = opening + tuple(next(free_blocks) for _ in range(starts[seq_id] // BLOCK_SIZE + 1
                                                                           - len(opening)))

    ids = [f"s{index}" for index in range(14)]
    for seq_id in ids:
        join(seq_id)
    continued = 0
    for step in range(400):
        event = rng.random()
        extra = ()
        if event < 0.03 and len(ids) < 20:  # a sequence joins
            ids.append(f"s{step}x")
            join(ids[-1])
        elif event < 0.06 and len(ids) > 1:  # one leaves, the rest move up
            ids.pop(int(rng.integers(0, len(ids))))
        elif event < 0.08:  # a prefill chunk beside the decode rows
            extra = (ScheduledSequence("p", (1, 2, 3), 0, (next(free_blocks),), None),)
        elif event < 0.10:  # a sequence preempted back a few positions
            seq_id = ids[int(rng.integers(0, len(ids)))]
            starts[seq_id] = max(0, starts[seq_id] - int(rng.integers(1, 20)))
        elif event < 0.16:  # a shared page of one sequence replaced (a copy on write): no block opened
            sharing = [seq_id for seq_id in ids if tables[seq_id][:1] == prefix[:1]]
            if sharing:
                seq_id = sharing[int(rng.integers(0, len(sharing)))]
                tables[seq_id] = (next(free_blocks),) + tables[seq_id][1:]
        host_tokens = rng.random() < 0.1  # committed first (penalties): real ids, no placeholders
        sequences = []
        for row, seq_id in enumerate(ids):
            start = starts[seq_id]
            if start // BLOCK_SIZE >= len(tables[seq_id]):
                tables[seq_id] += (next(free_blocks),)  # the step's token opens a block: a new tuple
            placeholder = None if host_tokens else row
            token = int(rng.integers(0, 1000)) if host_tokens else PLACEHOLDER_TOKEN
            sequences.append(ScheduledSequence(seq_id, (token,), start, tables[seq_id], ROW, placeholder))
        batch = ScheduledBatch(step, (*sequences, *extra), BLOCK_SIZE)
        took = rows.last_decode is not None and not extra
        kept = build_step_inputs(batch, layout, SAMPLE_SLOTS, rows)
        afresh = build_step_inputs(batch, layout, SAMPLE_SLOTS)
        continued += took and rows.last_decode is not None
        for name in HostStepInputs.__dataclass_fields__:
            actual, wanted = getattr(kept, name), getattr(afresh, name)
            if isinstance(wanted, np.ndarray):
                np.testing.assert_array_equal(actual, wanted, err_msg=f"step {step}: {name}")
                assert actual.dtype == wanted.dtype, name
            else:
                assert actual == wanted, f"step {step}: {name}"
        for seq_id in ids:
            starts[seq_id] += 1
    assert continued > 250  # most steps took the short path
    assert rows.last_decode is not None


def test_a_continued_decode_still_refuses_a_table_that_does_not_hold_its_context():
    rows = TableRows(4, ONE_GROUP)
    build_step_inputs(ScheduledBatch(1, (ScheduledSequence("a", (5,), 14, (1,), ROW),), BLOCK_SIZE), ONE_GROUP, 1, rows)
    build_step_inputs(ScheduledBatch(2, (ScheduledSequence("a", (5,), 15, (1,), ROW),), BLOCK_SIZE), ONE_GROUP, 1, rows)
    with pytest.raises(ValueError, match="'a': 1 blocks cannot hold 17 tokens"):
        build_step_inputs(ScheduledBatch(3, (ScheduledSequence("a", (5,), 16, (1,), ROW),), BLOCK_SIZE), ONE_GROUP, 1,
                          rows)


def test_continued_verify_rows_whose_newest_tokens_open_blocks_keep_the_general_paths_shared_prefix():
    """Rows of one sequence read the same pages (a verify chunk split by `decode_rows`): the
    prefix they share ends at each row's newest full block, so when a row's newest token opens
    a block the prefix may change with no table changing. Two such sequences of 9 rows, each
    row one position further every step, across several block boundaries."""
    layout = CacheLayout(BLOCK_SIZE, 64, (SCRATCH_BLOCK,), kv_token_bytes=(1 << 16,))
    rows = TableRows(24, layout)
    tables = {"a": tuple(range(100, 119)), "b": tuple(range(200, 219))}
    starts = {"a": 17 * BLOCK_SIZE - 12, "b": 17 * BLOCK_SIZE - 3}
    shared_lengths = set()
    for step in range(40):
        sequences = []
        for seq_id in ("a", "b"):
            last = starts[seq_id] + 8
            if last // BLOCK_SIZE >= len(tables[seq_id]):
                tables[seq_id] += (tables[seq_id][-1] + 1,)
            sequences += [ScheduledSequence(seq_id, (7,), starts[seq_id] + offset, tables[seq_id], ROW)
                          for offset in range(9)]
        batch = ScheduledBatch(step, tuple(sequences), BLOCK_SIZE)
        kept = build_step_inputs(batch, layout, SAMPLE_SLOTS, rows)
        afresh = build_step_inputs(batch, layout, SAMPLE_SLOTS)
        assert afresh.shared_prefix is not None
        shared_lengths.add(int(afresh.shared_prefix[0, 0]))
        np.testing.assert_array_equal(kept.shared_prefix, afresh.shared_prefix, err_msg=f"step {step}")
        np.testing.assert_array_equal(kept.slot_mapping, afresh.slot_mapping, err_msg=f"step {step}")
        starts = {seq_id: start + 1 for seq_id, start in starts.items()}
    assert rows.last_decode is not None and len(shared_lengths) > 2

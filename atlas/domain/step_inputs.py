"""Host-side arrays describing one step, built from a `ScheduledBatch`.

These are what the worker copies into its persistent device buffers. Building them is pure
numpy so it is tested without a device; see `AttentionMetadata` for the layout of each KV
group's slots and table, and `RecurrentMetadata` for the state slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from atlas.domain.batch import ScheduledBatch, ScheduledSequence

# What `build_step_inputs` reads of each sequence in its one pass: query length, start,
# placeholder row (-1: none), samples, block ids.
_NUM_SEQUENCE_NUMBERS = 5


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """How the worker addresses a model's caches in a step: one block table per KV group,
    `table_width` blocks of `block_size` tokens (block i holds positions i * block_size ..),
    and one state slot per recurrent group; each group's scratch page (`device_caches`) is what
    padding rows and table entries without a block use."""

    block_size: int
    table_width: int
    kv_scratch_blocks: tuple[int, ...]  # per KV group, in the model's order of groups
    state_scratch_slots: tuple[int, ...] = ()  # per recurrent-state group
    snapshot_width: int = 0  # snapshot slots a verifying sequence names per recurrent group (its drafts)
    # per KV group, the K and V bytes of one token in one layer (empty: unknown)
    kv_token_bytes: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_scratch_blocks)

    @property
    def num_state_groups(self) -> int:
        return len(self.state_scratch_slots)


@dataclass(frozen=True, slots=True)
class HostStepInputs:
    """A step's arrays. Per KV group g: `slot_mapping[g]` and `block_tables[:, g]` (rows padded
    with the group's scratch block, as are the entries of blocks that left a sliding window);
    per recurrent group r: `state_slots[r]`."""

    token_ids: np.ndarray  # [N] i32
    positions: np.ndarray  # [N] i32
    slot_mapping: np.ndarray  # [G, N] i32
    query_start_loc: np.ndarray  # [S + 1] i32
    seq_lens: np.ndarray  # [S] i32
    block_tables: np.ndarray  # [S, G, W] i32
    state_slots: np.ndarray  # [R, S] i32
    sample_indices: np.ndarray  # [R] i32: the last token row of each sampling sequence
    token_gather: np.ndarray  # [N] i32: where each token id comes from (see StepBuffers)
    has_placeholders: bool  # some token ids are the previous step's samples, on the device
    max_query_len: int
    max_seq_len: int
    # a step verifying drafts of a model with recurrent groups: their own view (`StateChunks`);
    # None: they see the step's sequences as attention does
    chunks: StateChunks | None = None
    # [G, 2 + S] i32 per KV group: the prefix its decode rows share (`shared_prefix`); None: none
    shared_prefix: np.ndarray | None = None

    def shared_prefix_len(self, group: int) -> int:
        """Tokens of KV group `group` that its sharing decode rows read from the same pages (0:
        no such prefix this step)."""
        return 0 if self.shared_prefix is None else int(self.shared_prefix[group, 0])

    @classmethod
    def empty(cls, layout: CacheLayout) -> HostStepInputs:
        """A step with no sequences (padded into a graph's warm-up inputs)."""
        none = np.zeros(0, np.int32)
        return cls(
            token_ids=none, positions=none, slot_mapping=np.zeros((layout.num_kv_groups, 0), np.int32),
            query_start_loc=np.zeros(1, np.int32), seq_lens=none,
            block_tables=np.zeros((0, layout.num_kv_groups, layout.table_width), np.int32),
            state_slots=np.zeros((layout.num_state_groups, 0), np.int32), sample_indices=none,
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
    batch: ScheduledBatch,
    layout: CacheLayout,
    num_sample_slots: int,
    rows: TableRows | None = None,
    num_padded: int | None = None,
) -> HostStepInputs:
    """Flatten a batch into varlen arrays.

    Token i's id is read from row `token_gather[i]` of the token source: the previous step's
    sampled ids occupy rows [0, num_sample_slots), this step's host tokens follow. With
    `rows` (a lone full-attention group), the block tables are rows of its buffer, rewritten
    only where they changed since the last step built with it, and valid until the next.
    `num_padded` (a decode graph's rows, at least the step's): a lone sequence's decode or
    verify rows may come already padded to it, as `pad_decode_inputs` pads them; pad the result
    anyway (a padded step passes through unchanged).

    Raises ValueError when a sequence carries another number of block tables or state slots
    than the layout's groups, or a block table is wider than `table_width` or does not cover
    the positions it computes (a scheduler bug that must never reach a kernel).
    """
    block_size = layout.block_size
    sequences = batch.sequences
    if rows is not None:
        lone = _one_sequence_rows(sequences, layout, num_sample_slots, rows, num_padded)
        if lone is None:
            continued = _continued_decode(sequences, layout, num_sample_slots, rows)
            if continued is not None:
                return continued
        rows.last_decode = None  # whatever this step is, the next does not continue it
        if lone is not None:
            return lone
    num_seqs = len(sequences)
    # One pass of Python over the sequences gathers their numbers, then numpy: at batch 64 a
    # step builds these every millisecond or two, and each pass over the batch costs more
    # than the arithmetic. (A list comprehension, then one fromiter: faster than a generator.)
    numbers = np.fromiter(
        itertools.chain.from_iterable([
            (len(seq.token_ids), seq.start_position, -1 if seq.placeholder_row is None else seq.placeholder_row,
             seq.sampling is not None, len(seq.block_ids))
            for seq in sequences
        ]),
        np.int32,
        _NUM_SEQUENCE_NUMBERS * num_seqs,
    ).reshape(num_seqs, _NUM_SEQUENCE_NUMBERS).T
    query_lens, starts, placeholder_rows, samples, num_block_ids = numbers
    lone = _check_groups(sequences, layout)
    seq_lens = starts + query_lens
    if (query_lens == 1).all():  # a decode step: token row i is sequence i's one token
        query_start = np.arange(num_seqs + 1, dtype=np.int32)
        token_seq, positions = query_start[:-1], starts.copy()
    else:
        query_start = np.zeros(num_seqs + 1, np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        token_seq = np.repeat(np.arange(num_seqs), query_lens)  # the sequence of each token row
        positions = (np.arange(query_start[-1]) + np.repeat(starts - query_start[:-1], query_lens)).astype(np.int32)
    num_tokens = int(query_start[-1])
    slot_mapping = np.empty((layout.num_kv_groups, num_tokens), np.int32)
    if lone and rows is not None:
        _check_coverage(sequences, num_block_ids, seq_lens, layout)
        block_tables = rows.fill(sequences, num_block_ids)
    else:
        block_tables = np.empty((num_seqs, layout.num_kv_groups, layout.table_width), np.int32)
        for group in range(layout.num_kv_groups):
            held, firsts, counts = _group_tables(sequences, group, num_block_ids if lone else None)
            _check_coverage(sequences, firsts + counts, seq_lens, layout)
            _write_tables(block_tables[:, group], held, firsts, counts, layout.kv_scratch_blocks[group])
    for group in range(layout.num_kv_groups):
        table = block_tables[:, group]
        slot_mapping[group] = table[token_seq, positions // block_size] * block_size + positions % block_size
    shared = shared_prefixes(block_tables, query_lens, seq_lens, layout)
    token_gather = np.arange(num_sample_slots, num_sample_slots + num_tokens, dtype=np.int32)
    placeholders = placeholder_rows >= 0  # last token rows sampled by the previous step, on the device
    token_gather[query_start[1:][placeholders] - 1] = placeholder_rows[placeholders]
    if lone and rows is not None and num_seqs and num_tokens == num_seqs and samples.all():  # the next may continue it
        rows.last_decode = _DecodeRun([seq.seq_id for seq in sequences], seq_lens.tolist(), shared)
    return HostStepInputs(
        token_ids=np.fromiter(itertools.chain.from_iterable([seq.token_ids for seq in sequences]), np.int32, num_tokens),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=block_tables,
        state_slots=_state_slots(sequences, layout),
        sample_indices=query_start[1:][samples != 0] - 1,
        token_gather=token_gather,
        has_placeholders=bool(placeholders.any()),
        max_query_len=int(query_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        shared_prefix=shared,
    )


@dataclass(slots=True)
class _DecodeRun:
    """The last step built on a `TableRows` when it was a decode step of one full-attention
    group, every row sampled: what the next step needs to take `_continued_decode`."""

    seq_ids: list[str]  # its sequences, row by row
    next_starts: list[int]  # the positions they compute next (its seq_lens)
    shared_prefix: np.ndarray | None  # as built for it


# `_continued_decode` gathers these of each row in one pass: start, placeholder row (-1: none),
# first token id, whether the row continues the last step's (one sampled token of the lone
# group, at the next position), block ids.
_NUM_DECODE_NUMBERS = 5


def _continued_decode(
    sequences: Sequence[ScheduledSequence], layout: CacheLayout, num_sample_slots: int, rows: TableRows
) -> HostStepInputs | None:
    """`build_step_inputs` of a decode step that continues the last one built on `rows`
    (`rows.last_decode`): the same sequences in the same rows, each computing the position
    after the last step's, one sampled token and the lone group's block ids. Steady decode is
    such a step nearly every time, and its arrays follow from the last ones in about twenty
    numpy calls: the kept tables rewrite only rows whose pages changed, and the shared prefix
    is the last step's unless a row's table changed or its newest token opened a block. None
    for any other step, and for tables that do not cover the rows (the general path raises)."""
    last = rows.last_decode
    if last is None or not sequences or [seq.seq_id for seq in sequences] != last.seq_ids:
        return None
    num_seqs = len(sequences)
    numbers = np.fromiter(
        itertools.chain.from_iterable([
            (seq.start_position, -1 if seq.placeholder_row is None else seq.placeholder_row,
             seq.token_ids[0] if seq.token_ids else 0,
             seq.start_position == start and len(seq.token_ids) == 1 and seq.sampling is not None
             and not (seq.kv_block_tables or seq.state_slots),
             len(seq.block_ids))
            for seq, start in zip(sequences, last.next_starts)
        ]),
        np.int32,
        _NUM_DECODE_NUMBERS * num_seqs,
    ).reshape(num_seqs, _NUM_DECODE_NUMBERS).T
    starts, placeholder_rows, token_ids, continues, counts = numbers
    if not continues.all():
        return None
    block_size = layout.block_size
    seq_lens = starts + 1
    if ((counts > layout.table_width) | (counts * block_size < seq_lens)).any():
        return None
    block_tables = rows.fill(sequences, counts)
    positions = starts.copy()
    offsets = positions % block_size
    slot_mapping = (block_tables[:, 0][rows.row_numbers[:num_seqs], positions // block_size] * block_size
                    + offsets)[None]
    if rows.num_rewritten or not offsets.all():  # a table changed, or a newest token opened a block
        shared = shared_prefixes(block_tables, np.ones(num_seqs, np.int32), seq_lens, layout)
    else:
        shared = last.shared_prefix
    placeholders = placeholder_rows >= 0
    rows.last_decode = _DecodeRun(last.seq_ids, seq_lens.tolist(), shared)
    token_gather = np.where(placeholders, placeholder_rows, rows.row_numbers[:num_seqs] + num_sample_slots)
    return _sampled_decode_rows(token_ids.copy(), positions, slot_mapping, seq_lens, block_tables, token_gather,
                                bool(placeholders.any()), int(seq_lens.max()), shared)


def _sampled_decode_rows(
    token_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
    block_tables: np.ndarray, token_gather: np.ndarray, has_placeholders: bool, max_seq_len: int,
    shared_prefix: np.ndarray | None,
) -> HostStepInputs:
    """A step of one token row a sequence, each sampled, over a lone full-attention group
    (the short paths: `_continued_decode`, `_one_sequence_rows`)."""
    num_rows = len(positions)
    return HostStepInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=np.arange(num_rows + 1, dtype=np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        state_slots=np.zeros((0, num_rows), np.int32),
        sample_indices=np.arange(num_rows, dtype=np.int32),
        token_gather=token_gather,
        has_placeholders=has_placeholders,
        max_query_len=1,
        max_seq_len=max_seq_len,
        shared_prefix=shared_prefix,
    )


def _one_sequence_rows(
    sequences: Sequence[ScheduledSequence],
    layout: CacheLayout,
    num_sample_slots: int,
    rows: TableRows,
    num_padded: int | None,
) -> HostStepInputs | None:
    """`build_step_inputs` of a step whose rows are consecutive single tokens of one sequence
    over one block table, each sampled and none a placeholder: a batch-1 decode step, or a
    sequence verifying drafts (`worker.decode_rows`) alone; padded to `num_padded` rows as
    `pad_decode_inputs` would pad it. The same arrays from a handful of numpy calls: this runs
    between a verify step's result and the next launch, where the device waits for it. None
    for any other step (or a table that does not cover the rows: the general path raises)."""
    first = sequences[0] if sequences else None
    if first is None or first.kv_block_tables or first.state_slots or layout.num_state_groups:
        return None
    seq_id, block_ids, start = first.seq_id, first.block_ids, first.start_position
    for offset, seq in enumerate(sequences):
        if (seq.block_ids is not block_ids or seq.start_position != start + offset or len(seq.token_ids) != 1
                or seq.sampling is None or seq.placeholder_row is not None or seq.seq_id != seq_id):
            return None
    num_rows = len(sequences)
    block_size, num_blocks = layout.block_size, len(block_ids)
    if num_blocks > layout.table_width or num_blocks * block_size < start + num_rows:
        return None
    total = max(num_rows, num_padded or 0)  # padding rows: position 0 of the scratch page
    positions = np.zeros(total, np.int32)
    positions[:num_rows] = np.arange(start, start + num_rows, dtype=np.int32)
    seq_lens = positions + 1
    block_tables = rows.fill_one(block_ids, num_rows, total)
    first_block, last_block = start // block_size, (start + num_rows - 1) // block_size
    pages = np.array(block_ids[first_block : last_block + 1], np.int32)
    slot_mapping = np.full((1, total), layout.kv_scratch_blocks[0] * block_size, np.int32)
    slot_mapping[0, :num_rows] = pages[positions[:num_rows] // block_size - first_block] * block_size
    slot_mapping[0, :num_rows] += positions[:num_rows] % block_size
    token_ids = np.zeros(total, np.int32)
    token_ids[:num_rows] = [seq.token_ids[0] for seq in sequences]
    shared = shared_prefixes(block_tables[:num_rows], np.ones(num_rows, np.int32), seq_lens[:num_rows], layout)
    return _sampled_decode_rows(
        token_ids, positions, slot_mapping, seq_lens, block_tables,
        np.arange(num_sample_slots, num_sample_slots + total, dtype=np.int32), False, start + num_rows,
        None if shared is None else np.pad(shared, ((0, 0), (0, total - num_rows))),
    )


# A step's decode rows read a shared prefix together (cascade attention) when at least
# SHARED_PREFIX_MIN_ROWS of them open with the same SHARED_PREFIX_MIN_TOKENS or more (vLLM's
# thresholds for its cascade attention), and reading it once saves at least
# SHARED_PREFIX_MIN_SAVED_BYTES a layer (where the layout knows a token's bytes): below them the
# extra kernel a layer costs more than it saves (a launch is a few microseconds, about what 8 MB
# take at 3 TB/s; a small model's verify step of 17 rows over 600 tokens saves ~7 MB).
SHARED_PREFIX_MIN_ROWS = 8
SHARED_PREFIX_MIN_TOKENS = 256
SHARED_PREFIX_MIN_SAVED_BYTES = 8 << 20


def shared_prefixes(
    block_tables: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, layout: CacheLayout
) -> np.ndarray | None:
    """Per KV group, the prefix that decode rows of the step read from the same pages, as
    [G, 2 + S] i32: (prefix length in tokens, anchor row, then 1 for each row that shares it);
    None when no group has one.

    A row's shareable blocks are the full ones before its newest token's (nothing writes them
    this step). The anchor is, of the decode rows whose first block is the one most of them
    open with (the smallest id of a tie; never the scratch block), the first with the most
    shareable blocks; a row shares the anchor's leading blocks up to its first differing entry
    (a scratch entry, as a sliding window leaves, never counts) and its own shareable blocks.
    The length L is the one that saves the most page reads, (rows sharing L - 1) x L, among
    lengths of at least SHARED_PREFIX_MIN_TOKENS that SHARED_PREFIX_MIN_ROWS rows share and that
    save SHARED_PREFIX_MIN_SAVED_BYTES a layer (`layout.kv_token_bytes`); rows sharing more than
    L share L.
    """
    decode = np.flatnonzero(query_lens == 1)
    if len(decode) < SHARED_PREFIX_MIN_ROWS:
        return None
    block_size = layout.block_size
    caps = (seq_lens[decode] - 1) // block_size  # full blocks before each row's newest token
    min_blocks = -(-SHARED_PREFIX_MIN_TOKENS // block_size)
    if np.count_nonzero(caps >= min_blocks) < SHARED_PREFIX_MIN_ROWS:
        return None
    if layout.kv_token_bytes:  # what every row sharing every full page would save, at most
        most = (len(decode) - 1) * int(caps.max()) * block_size * max(layout.kv_token_bytes)
        if most < SHARED_PREFIX_MIN_SAVED_BYTES:
            return None
    result = np.zeros((layout.num_kv_groups, 2 + len(seq_lens)), np.int32)
    found = False
    for group in range(layout.num_kv_groups):
        scratch = layout.kv_scratch_blocks[group]
        firsts = block_tables[decode, group, 0]
        opened, counts = np.unique(firsts[(firsts != scratch) & (caps > 0)], return_counts=True)
        if not len(opened) or counts.max() < SHARED_PREFIX_MIN_ROWS:
            continue
        anchor = int(np.argmax(np.where(firsts == opened[np.argmax(counts)], caps, -1)))
        width = int(caps[anchor])
        tables = block_tables[decode, group, :width]
        same = (tables == tables[anchor]) & (tables != scratch)
        leads = np.where(same.all(axis=1), width, np.argmin(same, axis=1))
        leads = np.minimum(leads, caps)
        ranked = np.sort(leads)[::-1]
        sharers = np.arange(1, len(ranked) + 1)
        saving = np.where((sharers >= SHARED_PREFIX_MIN_ROWS) & (ranked >= min_blocks), (sharers - 1) * ranked, 0)
        if layout.kv_token_bytes:
            saved_bytes = saving.astype(np.int64) * block_size * layout.kv_token_bytes[group]
            saving = np.where(saved_bytes >= SHARED_PREFIX_MIN_SAVED_BYTES, saving, 0)
        best = int(np.argmax(saving))
        if saving[best] <= 0:
            continue
        length = int(ranked[best])
        result[group, 0] = length * block_size
        result[group, 1] = decode[anchor]
        result[group, 2 + decode[leads >= length]] = 1
        found = True
    return result if found else None


@dataclass(frozen=True, slots=True)
class StateChunks:
    """How the recurrent groups see a step that verifies drafts. Attention runs each verify
    chunk as single-token decode rows (`worker.decode_rows`); a recurrent state cannot, since
    each token's state follows from the one before, so here every sequence of the unsplit batch
    is one chunk continuing from its slot, over the same token rows:

        unsplit batch    a: prefill of 5        b: t d0 d1 (verify, snapshots 8 3)
        attention rows   [a a a a a]            [t] [d0] [d1]          5 sequences
        state chunks     [a a a a a]            [t d0 d1]              2 sequences
        snapshot_slots   [-1 -1]                [8 3]                  states after t, d0

    Per recurrent group r: `state_slots[r]` and `snapshot_slots[r]` (`RecurrentMetadata`)."""

    query_start_loc: np.ndarray  # [S + 1] i32
    seq_lens: np.ndarray  # [S] i32
    state_slots: np.ndarray  # [R, S] i32
    snapshot_slots: np.ndarray  # [R, S, W] i32, -1 = none
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def state_chunks(batch: ScheduledBatch, layout: CacheLayout) -> StateChunks:
    """The recurrent groups' view of `batch` (before its verify chunks are split into rows):
    a chunk per sequence, each verifying one naming its snapshot slots from its first sampling
    row's token on. Raises ValueError when a verifying sequence names another number of
    snapshot slots than its drafts in some group, or more than the layout's width."""
    sequences = batch.sequences
    num_seqs, width = len(sequences), layout.snapshot_width
    query_lens = np.fromiter([seq.num_tokens for seq in sequences], np.int32, num_seqs)
    starts = np.fromiter([seq.start_position for seq in sequences], np.int32, num_seqs)
    query_start = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    snapshots = np.full((layout.num_state_groups, num_seqs, width), -1, np.int32)
    for index, seq in enumerate(sequences):
        if not seq.num_draft_tokens:
            continue
        first = seq.num_tokens - 1 - seq.num_draft_tokens  # the token of its first sampling row
        named = [len(slots) for slots in seq.state_snapshots]
        if named != [seq.num_draft_tokens] * layout.num_state_groups or first + seq.num_draft_tokens > width:
            raise ValueError(
                f"sequence {seq.seq_id!r} verifies {seq.num_draft_tokens} drafts with snapshot slots {named} for "
                f"{layout.num_state_groups} recurrent groups of snapshot width {width}"
            )
        for group, slots in enumerate(seq.state_snapshots):
            snapshots[group, index, first : first + len(slots)] = slots
    return StateChunks(
        query_start_loc=query_start,
        seq_lens=starts + query_lens,
        state_slots=_state_slots(sequences, layout),
        snapshot_slots=snapshots,
        max_query_len=int(query_lens.max()) if num_seqs else 0,
    )


def warm_up_inputs(num_tokens: int, layout: CacheLayout, num_sample_slots: int, max_seq_len: int) -> HostStepInputs:
    """A prefill of `num_tokens` tokens (token id 0) that touches no sequence's cache: for a
    forward that only prepares the kernels of its size (`Worker.warm_up`).

    The tokens form sequences of at most `max_seq_len` from position 0, every table entry and
    every slot in each group's scratch page (slot = position % block size, so the page's slots
    are all written before attention reads them), a fresh state slot per recurrent group. The
    first min(`num_tokens`, `num_sample_slots`) rows are sampled, so the LM head runs at the
    sizes decode steps give it. Raises ValueError for a size below 1.
    """
    if num_tokens < 1 or max_seq_len < 1:
        raise ValueError(f"warm_up_inputs: {num_tokens} tokens in sequences of {max_seq_len}")
    seq_lens = np.full(-(-num_tokens // max_seq_len), max_seq_len, np.int32)
    seq_lens[-1] = num_tokens - max_seq_len * (len(seq_lens) - 1)
    query_start = np.zeros(len(seq_lens) + 1, np.int32)
    np.cumsum(seq_lens, out=query_start[1:])
    positions = (np.arange(num_tokens) - np.repeat(query_start[:-1], seq_lens)).astype(np.int32)
    scratch = np.asarray(layout.kv_scratch_blocks, np.int32)
    return HostStepInputs(
        token_ids=np.zeros(num_tokens, np.int32),
        positions=positions,
        slot_mapping=(scratch[:, None] * layout.block_size + positions % layout.block_size).astype(np.int32),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=np.broadcast_to(scratch[None, :, None], (len(seq_lens), len(scratch), layout.table_width)),
        state_slots=np.broadcast_to(
            np.asarray(layout.state_scratch_slots, np.int32)[:, None], (layout.num_state_groups, len(seq_lens))
        ),
        sample_indices=np.arange(min(num_tokens, num_sample_slots), dtype=np.int32),
        token_gather=np.arange(num_sample_slots, num_sample_slots + num_tokens, dtype=np.int32),
        has_placeholders=False,
        max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )


def _check_groups(sequences: Sequence[ScheduledSequence], layout: CacheLayout) -> bool:
    """Whether the batch's tables are `block_ids` alone (a lone full-attention group, with no
    `kv_block_tables`). Raises ValueError unless every sequence carries a table per KV group
    and a slot per recurrent group."""
    lone_group = layout.num_kv_groups == 1 and layout.num_state_groups == 0
    if lone_group and not any([seq.kv_block_tables or seq.state_slots for seq in sequences]):
        return True  # most models: every sequence's table is its block ids
    num_seqs = len(sequences)
    num_tables = np.fromiter([len(seq.kv_block_tables) for seq in sequences], np.int32, num_seqs)
    num_slots = np.fromiter([len(seq.state_slots) for seq in sequences], np.int32, num_seqs)
    fits = (num_tables == layout.num_kv_groups) & (num_slots == layout.num_state_groups)
    if layout.num_kv_groups == 1:
        fits |= (num_tables == 0) & (num_slots == layout.num_state_groups)
    if not fits.all():
        seq = sequences[int(np.flatnonzero(~fits)[0])]
        raise ValueError(
            f"sequence {seq.seq_id!r} carries {len(seq.block_tables)} block tables and {len(seq.state_slots)} "
            f"state slots for {layout.num_kv_groups} KV and {layout.num_state_groups} recurrent groups"
        )
    return not num_tables.any()


def _group_tables(
    sequences: Sequence[ScheduledSequence], group: int, lone_counts: np.ndarray | None
) -> tuple[Sequence[tuple[int, ...]], np.ndarray, np.ndarray]:
    """KV group `group`'s table of each sequence: its block ids, first block index and count.
    `lone_counts`: each sequence's number of `block_ids` when they are its only table (a lone
    full-attention group), else None."""
    num_seqs = len(sequences)
    if lone_counts is not None:
        return [seq.block_ids for seq in sequences], np.zeros(num_seqs, np.int32), lone_counts
    tables = [seq.block_tables[group] for seq in sequences]
    held = [t.block_ids for t in tables]
    firsts = np.fromiter((t.first_block_idx for t in tables), np.int32, num_seqs)
    return held, firsts, np.fromiter((len(ids) for ids in held), np.int32, num_seqs)


def _check_coverage(
    sequences: Sequence[ScheduledSequence], covered: np.ndarray, seq_lens: np.ndarray, layout: CacheLayout
) -> None:
    """Raises ValueError naming the first sequence whose table (blocks 0 .. `covered` - 1) is
    wider than `table_width` or does not hold its context."""
    for index in np.flatnonzero((covered > layout.table_width) | (covered * layout.block_size < seq_lens)):
        seq = sequences[index]
        if covered[index] > layout.table_width:
            raise ValueError(f"sequence {seq.seq_id!r} has {covered[index]} blocks, more than {layout.table_width}")
        raise ValueError(f"sequence {seq.seq_id!r}: {covered[index]} blocks cannot hold {seq.context_len} tokens")


def _write_tables(
    table: np.ndarray, held: Sequence[tuple[int, ...]], firsts: np.ndarray, counts: np.ndarray, scratch: int
) -> None:
    """Write each sequence's table into `table` [S, W]: entry i is block i's page, `scratch`
    where the sequence holds none (released from a sliding window, or past its last block).
    The tables must fit the width (`_check_coverage`).

        first_block_idx 2, block_ids (7, 3), scratch 99:   [99 99 7 3 99 99 ...]
    """
    table[...] = scratch
    columns = np.arange(table.shape[1], dtype=np.int32)  # (int32 against int32: no promotion per element)
    held_entries = (columns < (firsts + counts)[:, None]) & (columns >= firsts[:, None])
    # a row-major boolean mask takes the concatenated tables in order
    table[held_entries] = np.fromiter(itertools.chain.from_iterable(held), np.int32, int(counts.sum()))


class TableRows:
    """The block tables of a model with one full-attention cache group, kept from step to step
    so that a step rewrites only the rows that changed.

    Row i holds the table of the last step's sequence i. The cache manager rebinds a
    sequence's `block_ids` tuple whenever its pages change, so a row whose sequence now brings
    the very tuple the row was written from is still right, whoever that sequence is; in steady
    decode only the sequences that just took a page change. When many rows changed (sequences
    left or joined, and the rest moved up) the whole table is written at once instead.

    It also remembers the last decode step built on it (`last_decode`), so that the next one,
    when it only continues it, takes `_continued_decode`.
    """

    def __init__(self, max_seqs: int, layout: CacheLayout) -> None:
        """Rows for steps of up to `max_seqs` sequences. Raises ValueError unless `layout` has
        one KV group and no recurrent one."""
        if layout.num_kv_groups != 1 or layout.num_state_groups:
            raise ValueError("TableRows serves a lone full-attention cache group")
        self._scratch = layout.kv_scratch_blocks[0]
        self._table = np.full((max_seqs, 1, layout.table_width), self._scratch, np.int32)
        self._written_from: list[tuple[int, ...] | None] = [None] * max_seqs  # each row's block ids
        self.row_numbers = np.arange(max_seqs, dtype=np.int32)
        self.num_rewritten = 0  # rows the last `fill` rewrote
        self.last_decode: _DecodeRun | None = None  # see `_continued_decode`

    def fill(self, sequences: Sequence[ScheduledSequence], counts: np.ndarray) -> np.ndarray:
        """The tables [S, 1, W] of `sequences` (`counts`: their numbers of block ids, each
        already checked to fit the width), as a view of the buffer."""
        written_from, num_seqs = self._written_from, len(sequences)
        stale = [index for index in range(num_seqs) if written_from[index] is not sequences[index].block_ids]
        self.num_rewritten = len(stale)
        table = self._table[:num_seqs, 0]
        if 4 * len(stale) > num_seqs:  # one vectorised write beats a numpy call a row
            held = [seq.block_ids for seq in sequences]
            _write_tables(table, held, np.zeros(num_seqs, np.int32), counts, self._scratch)
            written_from[:num_seqs] = held
        else:
            for index in stale:
                block_ids = sequences[index].block_ids
                table[index, len(block_ids) :] = self._scratch
                table[index, : len(block_ids)] = block_ids
                written_from[index] = block_ids
        return self._table[:num_seqs]

    def fill_one(self, block_ids: tuple[int, ...], num_rows: int, num_padded: int | None = None) -> np.ndarray:
        """The tables [max(num_rows, num_padded), 1, W] of `num_rows` rows that all read
        `block_ids` (one sequence's decode rows; it fits the width), then padding rows that
        read only the scratch block, as a view of the buffer."""
        written_from, scratch = self._written_from, _SCRATCH_ROW
        total = max(num_rows, num_padded or 0)
        if any([written_from[index] is not block_ids for index in range(num_rows)]):
            table = self._table[:num_rows, 0]
            table[:, len(block_ids) :] = self._scratch
            table[:, : len(block_ids)] = block_ids
            written_from[:num_rows] = [block_ids] * num_rows
        if any([written_from[index] is not scratch for index in range(num_rows, total)]):
            self._table[num_rows:total, 0] = self._scratch
            written_from[num_rows:total] = [scratch] * (total - num_rows)
        return self._table[:total]


# `TableRows`' mark of a padding row: it reads only the scratch block, as the row of a sequence
# holding no block does (the empty tuple is one object)
_SCRATCH_ROW: tuple[int, ...] = ()


def _state_slots(sequences: Sequence[ScheduledSequence], layout: CacheLayout) -> np.ndarray:
    """[R, S]: each sequence's slot in every recurrent-state group."""
    num_groups, num_seqs = layout.num_state_groups, len(sequences)
    if num_groups == 0:
        return np.zeros((0, num_seqs), np.int32)
    slots = np.fromiter(itertools.chain.from_iterable(seq.state_slots for seq in sequences), np.int32)
    return np.ascontiguousarray(slots.reshape(num_seqs, num_groups).T)


def piece_buckets(max_tokens: int) -> tuple[int, ...]:
    """The token counts a worker captures its layers' pieces for, up to `max_tokens`: every 16
    up to 128, then every 64 (a step pads to the next one: at most 63 rows of waste)."""
    small = range(16, min(max_tokens, 128) + 1, 16)
    return tuple(small) + tuple(range(192, max_tokens + 1, 64))


def pad_prefill_inputs(
    inputs: HostStepInputs, num_tokens: int, layout: CacheLayout, num_sample_slots: int
) -> HostStepInputs:
    """Pad a step's token rows to `num_tokens` for its layers' captured pieces
    (`Model.capture_layers`). Padding tokens are id 0 at position 0 whose K/V go to each KV
    group's scratch page; they belong to no sequence, so everything per sequence (the tables,
    the query starts, the sampled rows) stays as it is and attention never reads them. Steps of
    models with recurrent groups, and steps verifying drafts for them, are not padded."""
    extra = num_tokens - inputs.num_tokens
    if extra < 0:
        raise ValueError(f"pad_prefill_inputs: {inputs.num_tokens} tokens do not fit {num_tokens}")
    if layout.num_state_groups or inputs.chunks is not None:
        raise ValueError("pad_prefill_inputs: recurrent groups read every token row of their sequences")
    if extra == 0:
        return inputs
    scratch_slots = np.asarray(layout.kv_scratch_blocks, np.int32)[:, None] * layout.block_size
    return replace(
        inputs,
        token_ids=np.concatenate([inputs.token_ids, np.zeros(extra, np.int32)]),
        positions=np.concatenate([inputs.positions, np.zeros(extra, np.int32)]),
        slot_mapping=np.concatenate(
            [inputs.slot_mapping, np.broadcast_to(scratch_slots, (layout.num_kv_groups, extra))], axis=1
        ),
        token_gather=np.concatenate(
            [inputs.token_gather, num_sample_slots + np.arange(inputs.num_tokens, num_tokens, dtype=np.int32)]
        ),
    )


def pad_decode_inputs(
    inputs: HostStepInputs, num_seqs: int, layout: CacheLayout, num_sample_slots: int
) -> HostStepInputs:
    """Pad a decode-only step (one token per sequence) to `num_seqs` rows for a captured graph.

    Padding rows compute one token at position 0 of each group's scratch page (a fresh
    sequence, so a recurrent layer reads no state) and are sampled into rows nobody reads;
    real rows keep their indices.
    """
    extra = num_seqs - inputs.num_seqs
    if extra < 0 or inputs.num_tokens != inputs.num_seqs:
        raise ValueError("only decode steps (one token per sequence) can be padded")
    if extra == 0 and inputs.num_sample_rows == num_seqs:
        return inputs  # a full bucket: its rows are already the graph's (every row samples, in order)
    scratch_blocks = np.asarray(layout.kv_scratch_blocks, np.int32)
    padded_gather = np.concatenate(
        [inputs.token_gather, num_sample_slots + np.arange(inputs.num_tokens, num_seqs, dtype=np.int32)]
    )
    padding_tables = np.broadcast_to(scratch_blocks[None, :, None], (extra, layout.num_kv_groups, layout.table_width))
    padding_slots = np.broadcast_to(scratch_blocks[:, None] * layout.block_size, (layout.num_kv_groups, extra))
    padding_states = np.broadcast_to(
        np.asarray(layout.state_scratch_slots, np.int32)[:, None], (layout.num_state_groups, extra)
    )
    return HostStepInputs(
        token_ids=np.concatenate([inputs.token_ids, np.zeros(extra, np.int32)]),
        positions=np.concatenate([inputs.positions, np.zeros(extra, np.int32)]),
        slot_mapping=np.concatenate([inputs.slot_mapping, padding_slots], axis=1),
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
        seq_lens=np.concatenate([inputs.seq_lens, np.ones(extra, np.int32)]),
        block_tables=np.concatenate([inputs.block_tables, padding_tables]),
        state_slots=np.concatenate([inputs.state_slots, padding_states], axis=1),
        sample_indices=np.arange(num_seqs, dtype=np.int32),
        token_gather=padded_gather,
        has_placeholders=inputs.has_placeholders,
        max_query_len=1,
        max_seq_len=inputs.max_seq_len,
        shared_prefix=None
        if inputs.shared_prefix is None
        else np.pad(inputs.shared_prefix, ((0, 0), (0, extra))),
    )

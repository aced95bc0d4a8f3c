"""StepBuffers on the mock: one int32 arena, sent by one copy, read back through the views the
model and the sampler get (floats and 64-bit values included, as bitcasts of its words)."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.sampler import sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.sampling import pack_rows
from atlas.domain.step_buffers import StepBuffers
from atlas.domain.batch import BlockTable, ScheduledBatch, ScheduledSequence
from atlas.domain.step_inputs import CacheLayout, HostStepInputs, build_step_inputs, pad_decode_inputs
from atlas.ports.gpu import NUMPY_DTYPES, DType

SCRATCH_BLOCK, BLOCK_SIZE, TABLE_WIDTH = 7, 4, 3
LAYOUT = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK,))
SEED_ABOVE_INT64 = 2**64 - 12345  # stored as a negative int64 bit pattern

ROWS = [
    SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, counter=0),
    SamplingRow(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=SEED_ABOVE_INT64,
        counter=2**40 + 3,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        penalty_token_ids=(3, 9, 11),
        penalty_output_counts=(0, 2, 1),
    ),
    SamplingRow(
        temperature=1.2,
        top_k=0,
        top_p=0.8,
        min_p=0.0,
        seed=2**63,
        counter=17,
        bias_token_ids=(4, 20),
        bias_values=(5.0, float("-inf")),
    ),
]


def decode_inputs(num_seqs: int, max_seqs: int) -> HostStepInputs:
    return pad_decode_inputs(HostStepInputs.empty(LAYOUT), num_seqs, LAYOUT, max_seqs)


def buffers_with(backend: MockGpuBackend, max_seqs: int = 5, max_tokens: int = 9) -> StepBuffers:
    """Buffers with a decode step of min(3, max_seqs) padding rows staged."""
    buffers = StepBuffers(backend, max_tokens, max_seqs, LAYOUT)
    buffers.stage_inputs(decode_inputs(min(len(ROWS), max_seqs), max_seqs))
    return buffers


@pytest.mark.parametrize("max_seqs, max_tokens", [(5, 9), (4, 9), (5, 8), (1, 1), (6, 3)])
def test_staged_sampling_reads_back_through_the_arena_views(max_seqs, max_tokens):
    backend = MockGpuBackend()
    buffers = buffers_with(backend, max_seqs, max_tokens)
    packed = pack_rows(ROWS[:max_seqs])
    buffers.stage_sampling(packed)
    buffers.send()
    tensors = buffers.sampling_tensors(packed)
    for name in (
        "temperature", "top_k", "top_p", "min_p", "seeds", "counters",
        "repetition_penalty", "presence_penalty", "frequency_penalty",
        "penalty_offsets", "penalty_token_ids", "penalty_output_counts",
        "bias_offsets", "bias_token_ids", "bias_values",
    ):  # fmt: skip
        got, expected = getattr(tensors, name), getattr(packed, name)
        assert NUMPY_DTYPES[got.dtype] == expected.dtype, name
        np.testing.assert_array_equal(backend.download(got), expected, err_msg=name)
    assert (tensors.all_greedy, tensors.any_penalties, tensors.any_bias) == (
        packed.all_greedy,
        packed.any_penalties,
        packed.any_bias,
    )
    # uint64 seeds survive the int64 words, and the i64 views are 8-byte aligned in memory
    assert backend.download(tensors.seeds).view(np.uint64).tolist() == [row.seed for row in ROWS[:max_seqs]]
    assert tensors.seeds.data.ctypes.data % 8 == 0 and tensors.counters.data.ctypes.data % 8 == 0


class _CountingMirrors:
    """Wraps a backend's host mirrors to count `wait_uploaded` and `upload` calls in order."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self.calls: list[tuple[int, str]] = []
        made = backend.host_mirror

        def host_mirror(tensor):
            mirror, index, calls = made(tensor), self.count, self.calls
            self.count += 1

            class Counted:
                array = mirror.array

                def upload(self, start: int, stop: int) -> None:
                    calls.append((index, "upload"))
                    mirror.upload(start, stop)

                def wait_uploaded(self) -> None:
                    calls.append((index, "wait"))
                    mirror.wait_uploaded()

            return Counted()

        self.count = 0
        backend.host_mirror = host_mirror


def test_send_is_one_copy_that_leaves_the_sampled_ids_alone():
    backend = MockGpuBackend()
    mirrors = _CountingMirrors(backend)
    buffers = buffers_with(backend)
    previous_samples = np.array([41, 42, 43, 44, 45], np.int32)
    backend.copy_from_host(buffers.sampled_ids, previous_samples)  # as the last step's `sample` left them
    copies = []
    original = backend.copy_from_host
    backend.copy_from_host = lambda dst, array: (copies.append(dst.shape), original(dst, array))[1]
    mirrors.calls.clear()

    buffers.stage_sampling(pack_rows(ROWS))
    buffers.send()
    assert not copies and [call for call in mirrors.calls if call[1] == "upload"] == [(0, "upload")]
    np.testing.assert_array_equal(backend.download(buffers.sampled_ids), previous_samples)
    meta = buffers.metadata(0, len(ROWS), len(ROWS), 1, 1)
    assert backend.download(meta.slot_mapping).tolist() == [SCRATCH_BLOCK * BLOCK_SIZE] * len(ROWS)
    assert backend.download(meta.block_tables).tolist() == [[SCRATCH_BLOCK] * TABLE_WIDTH] * len(ROWS)


def test_sampling_from_the_arena_views_equals_the_reference(rng):
    backend = MockGpuBackend()
    buffers = buffers_with(backend)
    packed = pack_rows(ROWS)
    buffers.stage_sampling(packed)
    buffers.send()
    logits = rng.standard_normal((len(ROWS), 30)).astype(np.float32) * 3
    out = buffers.sampled_ids.rows(0, len(ROWS))
    backend.sampling.sample(backend.upload(logits), buffers.sampling_tensors(packed), out)
    expected = sample_rows(logits, packed, None).token_ids
    np.testing.assert_array_equal(backend.download(out), expected)
    assert backend.download(out)[2] == 4  # the +5 bias on token 4 wins at this temperature


def test_graph_sampling_views_cover_the_rows_without_penalties_or_bias(rng):
    """The sampler a graph bakes in reads every row's temperature, filters and stream; it skips
    penalties and bias even where rows have them (those steps sample again eagerly)."""
    backend = MockGpuBackend()
    buffers = buffers_with(backend)
    packed = pack_rows(ROWS)
    buffers.stage_sampling(packed)
    buffers.send()
    tensors = buffers.graph_sampling_tensors(len(ROWS))
    assert not (tensors.all_greedy or tensors.any_penalties or tensors.any_bias)
    assert tensors.penalty_token_ids.shape == tensors.bias_token_ids.shape == (0,)
    np.testing.assert_array_equal(backend.download(tensors.temperature), packed.temperature)
    np.testing.assert_array_equal(backend.download(tensors.counters), packed.counters)

    logits = rng.standard_normal((len(ROWS), 30)).astype(np.float32) * 3
    out = backend.empty((len(ROWS),), DType.I32)
    backend.sampling.sample(backend.upload(logits), tensors, out)
    plain = pack_rows(
        [SamplingRow(row.temperature, row.top_k, row.top_p, row.min_p, row.seed, row.counter) for row in ROWS]
    )
    np.testing.assert_array_equal(backend.download(out), sample_rows(logits, plain, None).token_ids)


def test_masks_go_to_their_own_buffer_and_padding_rows_allow_every_token():
    backend = MockGpuBackend()
    buffers = StepBuffers(backend, max_tokens=9, max_seqs=5, caches=LAYOUT, mask_words=2)
    assert (buffers.token_mask.data == -1).all()  # every row starts all allowed
    masks = np.array([[1, 0], [0, 1 << 3]], dtype=np.int32)
    buffers.stage_mask(masks, 4)  # two real rows padded to a graph's four
    assert (buffers.token_mask.data == -1).all()  # staged on the host side only
    buffers.upload_mask(4)
    np.testing.assert_array_equal(buffers.token_mask.data[:4], [[1, 0], [0, 8], [-1, -1], [-1, -1]])
    masked = buffers.graph_sampling_tensors(4, masked=True)
    assert masked.token_mask.shape == (4, 2) and buffers.graph_sampling_tensors(4).token_mask is None
    with pytest.raises(ValueError, match=r"expected int32 \[R, 2\]"):
        buffers.stage_mask(np.zeros((2, 3), np.int32), 2)
    with pytest.raises(ValueError, match="padded to 6, at most 5"):
        buffers.stage_mask(masks, 6)


def test_host_sides_are_written_only_once_their_last_upload_has_run():
    """The arena's two host sides take steps in turn, and each step waits for its side's last
    copy (two steps back) before writing it; the masks' side waits for its last upload too."""
    backend = MockGpuBackend()
    mirrors = _CountingMirrors(backend)
    buffers = StepBuffers(backend, max_tokens=9, max_seqs=5, caches=LAYOUT, mask_words=2)
    arena_a, arena_b, masks = 0, 1, 2
    inputs = build_step_inputs(ScheduledBatch(1, (ScheduledSequence("a", (1,), 1, (4,), ROWS[0]),), BLOCK_SIZE),
                               LAYOUT, buffers.max_seqs)
    for _ in range(3):
        buffers.stage_inputs(inputs)
        buffers.stage_sampling(pack_rows([ROWS[0]]))
        buffers.send()
    buffers.stage_mask(np.ones((3, 2), np.int32), 3)
    buffers.upload_mask(3)
    buffers.stage_mask(np.ones((1, 2), np.int32), 1)
    assert mirrors.calls == [
        (arena_a, "wait"), (arena_a, "upload"), (arena_b, "wait"), (arena_b, "upload"),
        (arena_a, "wait"), (arena_a, "upload"), (masks, "wait"), (masks, "upload"), (masks, "wait"),
    ]
    np.testing.assert_array_equal(buffers.token_mask.data[:3], 1)
    assert (buffers.token_mask.data[3:] == -1).all()


def test_each_groups_table_slots_and_state_slots_read_back_through_its_views():
    """Two KV groups (the second a sliding window that released block 0) and a recurrent group:
    one copy, and each group's views give exactly its own rows."""
    layout = CacheLayout(BLOCK_SIZE, TABLE_WIDTH, (SCRATCH_BLOCK, 9), state_scratch_slots=(5,))
    backend = MockGpuBackend()
    buffers = StepBuffers(backend, 8, 4, layout)
    sequences = (
        ScheduledSequence("a", (1, 2, 3), 6, (4, 2, 6), None, kv_block_tables=(BlockTable((4, 2, 6)), BlockTable((3, 1), 1)),
                          state_slots=(2,)),
        ScheduledSequence("b", (7,), 2, (0,), ROWS[0], kv_block_tables=(BlockTable((0,)), BlockTable((8,))),
                          state_slots=(0,)),
    )
    inputs = build_step_inputs(ScheduledBatch(3, sequences, BLOCK_SIZE), layout, buffers.max_seqs)
    buffers.stage_inputs(inputs)
    buffers.send()
    full, window = (buffers.metadata(group, 4, 2, 3, 9) for group in (0, 1))
    assert backend.download(full.block_tables)[:, :TABLE_WIDTH].tolist() == [[4, 2, 6], [0, SCRATCH_BLOCK, SCRATCH_BLOCK]]
    assert backend.download(window.block_tables)[:, :TABLE_WIDTH].tolist() == [[9, 3, 1], [8, 9, 9]]
    # positions 6 7 8 | 2: blocks 1 1 2 | 0 of each group's table
    assert backend.download(full.slot_mapping).tolist() == [2 * 4 + 2, 2 * 4 + 3, 6 * 4 + 0, 0 * 4 + 2]
    assert backend.download(window.slot_mapping).tolist() == [3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0, 8 * 4 + 2]
    state = buffers.recurrent_metadata(0, 4, 2, 3)
    assert backend.download(state.state_slots).tolist() == [2, 0]
    assert backend.download(state.seq_lens).tolist() == [9, 3]
    assert backend.download(state.query_start_loc).tolist() == [0, 3, 4]

"""The device protocol: memory, copies, asynchronous downloads, row gathers, graphs."""

from __future__ import annotations

import numpy as np
import pytest
from kind_references import bf16

from atlas.ports.gpu import DType


def test_upload_download_round_trip_every_dtype(harness, rng):
    backend = harness.backend
    for dtype, values in (
        (DType.BF16, bf16(rng.standard_normal((7, 33)))),
        (DType.F32, rng.standard_normal((5, 9)).astype(np.float32)),
        (DType.I32, rng.integers(-(2**31), 2**31 - 1, (11,), dtype=np.int32)),
        (DType.I64, rng.integers(-(2**62), 2**62, (4, 3), dtype=np.int64)),
        (DType.U8, rng.integers(0, 255, (300,), dtype=np.uint8)),
    ):
        tensor = backend.upload(values, dtype)
        assert tensor.shape == values.shape and tensor.dtype is dtype
        np.testing.assert_array_equal(np.asarray(harness.fetch(tensor), dtype=values.dtype), values)


def test_copy_from_host_into_a_rows_view_leaves_the_other_rows(harness, rng):
    backend = harness.backend
    tensor = backend.upload(np.zeros((6, 4), np.float32))
    rows = rng.standard_normal((2, 4)).astype(np.float32)
    backend.copy_from_host(tensor.rows(3, 5), rows)
    result = harness.fetch(tensor)
    np.testing.assert_array_equal(result[3:5], rows)
    assert not result[:3].any() and not result[5:].any()
    with pytest.raises(ValueError):
        backend.copy_from_host(tensor.rows(0, 1), rows)


def test_a_begun_download_keeps_the_values_of_its_time(harness, rng):
    """Work enqueued after `begin_download` may overwrite the tensor without changing the copy."""
    backend = harness.backend
    values = rng.integers(0, 100, 8, dtype=np.int32)
    tensor = backend.upload(values)
    pending = backend.begin_download(tensor)
    backend.copy_from_host(tensor, values + 1000)
    np.testing.assert_array_equal(pending.wait(), values)
    np.testing.assert_array_equal(pending.wait(), values)


@pytest.mark.parametrize("dtype, width", [(DType.F32, 77), (DType.BF16, 576), (DType.I32, 1)])
def test_gather_rows(harness, rng, dtype, width):
    backend = harness.backend
    x = rng.standard_normal((50, width)).astype(np.float32) * 100
    indices = rng.integers(0, 50, 13, dtype=np.int32)
    out = harness.poisoned((13, width), dtype)
    backend.gather_rows(backend.upload(x, dtype), backend.upload(indices), out)
    expected = np.asarray(harness.fetch(backend.upload(x, dtype)))[indices]
    np.testing.assert_array_equal(harness.fetch(out), expected)


def test_a_graph_replays_on_the_buffers_new_contents(harness, rng):
    backend = harness.backend
    source = backend.upload(rng.standard_normal((8, 16)).astype(np.float32))
    indices = backend.upload(np.arange(8, dtype=np.int32)[::-1].copy())
    out = backend.upload(np.zeros((8, 16), np.float32))
    graph = backend.capture(lambda: backend.gather_rows(source, indices, out))
    for _ in range(2):
        values = rng.standard_normal((8, 16)).astype(np.float32)
        backend.copy_from_host(source, values)
        graph.replay()
        np.testing.assert_array_equal(harness.fetch(out), values[::-1])
    backend.synchronize()


def test_a_host_mirror_uploads_its_rows_eagerly_and_in_a_graph(harness, rng):
    """`host_mirror`: zeroed host rows the tensor's shape; `upload(start, stop)` copies those
    rows on the stream, a graph holding an upload copies what the rows hold at each replay, and
    after `wait_uploaded` the rows may change without changing what was copied."""
    backend = harness.backend
    tensor = backend.upload(np.full((6, 5), 7, np.int32))
    mirror = backend.host_mirror(tensor)
    assert mirror.array.shape == (6, 5) and mirror.array.dtype == np.int32 and not mirror.array.any()
    mirror.wait_uploaded()  # nothing outstanding: at once
    first = rng.integers(-100, 100, (6, 5), dtype=np.int32)
    mirror.array[:] = first
    mirror.upload(1, 3)
    mirror.wait_uploaded()
    mirror.array[:] = 0  # the copy has run: it keeps the rows of its time
    result = harness.fetch(tensor)
    np.testing.assert_array_equal(result[1:3], first[1:3])
    assert (result[0] == 7).all() and (result[3:] == 7).all()
    out = backend.upload(np.zeros((4, 5), np.int32))
    indices = backend.upload(np.arange(4, dtype=np.int32)[::-1].copy())

    def step() -> None:
        mirror.upload(0, 4)
        backend.gather_rows(tensor, indices, out)

    graph = backend.capture(step)
    for _ in range(3):
        mirror.wait_uploaded()  # the last replay's copy has run: the rows may change
        values = rng.integers(-100, 100, (4, 5), dtype=np.int32)
        mirror.array[:4] = values
        graph.replay()
        np.testing.assert_array_equal(harness.fetch(out), values[::-1])
    with pytest.raises(ValueError):
        mirror.upload(2, 7)


def test_pieces_replay_in_order_with_their_cuts_between(harness, rng):
    """Each piece replays on the buffers' new contents; each cut's call runs between its
    pieces with the replay's argument and may enqueue work the next piece reads."""
    backend = harness.backend
    source = backend.upload(rng.standard_normal((8, 16)).astype(np.float32))
    reverse = backend.upload(np.arange(8, dtype=np.int32)[::-1].copy())
    middle = backend.upload(np.zeros((8, 16), np.float32))
    out = backend.upload(np.zeros((8, 16), np.float32))
    seen: list[object] = []

    def between(rows: object) -> None:  # eager: picks the rows the second piece gathers from
        seen.append(rows)
        backend.copy_from_host(middle, np.asarray(harness.fetch(middle))[np.asarray(rows)])

    def run(cut):
        backend.gather_rows(source, reverse, middle)
        cut(between)
        backend.gather_rows(middle, reverse, out)

    pieces = backend.capture_pieces(run)
    assert seen == []  # capturing runs no cut
    for shift in (1, 3):
        values = rng.standard_normal((8, 16)).astype(np.float32)
        backend.copy_from_host(source, values)
        order = np.roll(np.arange(8), shift)
        pieces.replay(order)
        np.testing.assert_array_equal(harness.fetch(out), values[::-1][order][::-1])
    assert [list(rows) for rows in seen] == [list(np.roll(np.arange(8), 1)), list(np.roll(np.arange(8), 3))]
    backend.synchronize()


def test_memory_info_and_an_allocation_too_large(harness):
    free, total = harness.backend.memory_info()
    assert 0 < free <= total
    with pytest.raises(MemoryError):
        harness.backend.empty((total // 4 + 1, 8), DType.F32)

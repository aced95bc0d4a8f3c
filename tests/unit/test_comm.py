"""The CommBackend port on the mock's N ranks and on LocalComm: every collective for several
world sizes, dtypes and shapes, the reference sum, argument errors, and failing peers."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.comm import reference
from atlas.adapters.comm.harness import RankFailed, run_ranks
from atlas.adapters.comm.local import LocalComm
from atlas.adapters.comm.mock import MockComm, copy_mock_tensor, new_mock_comm_id
from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.comm import CommError
from atlas.ports.gpu import NUMPY_DTYPES, DType

BF16 = ml_dtypes.bfloat16
DTYPES = (DType.BF16, DType.F32, DType.I32)
WORLD_SIZES = (1, 2, 3, 4)


def tensor(array: np.ndarray, dtype: DType) -> MockTensor:
    return MockTensor(np.asarray(array).astype(NUMPY_DTYPES[dtype]), dtype)


def rank_input(rank: int, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Distinct small integers per rank and element: sums are exact in every dtype, so the
    expected values below can be computed in float64 without any rounding question."""
    values = (np.arange(int(np.prod(shape))).reshape(shape) * 7 + 13 * rank) % 61 - 30
    return values.astype(NUMPY_DTYPES[dtype])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6,), (4, 8), (8, 3, 5)])
def test_every_collective_gives_every_rank_the_expected_values(world_size, dtype, shape):
    rows = shape[0] * world_size
    full_shape = (rows, *shape[1:])

    def body(comm: MockComm) -> dict[str, np.ndarray]:
        rank = comm.rank
        reduced = tensor(rank_input(rank, shape, dtype), dtype)
        comm.all_reduce(reduced)
        gathered = tensor(np.zeros((rows, *shape[1:])), dtype)
        comm.all_gather(tensor(rank_input(rank, shape, dtype), dtype), gathered)
        scattered = tensor(np.zeros(shape), dtype)
        comm.reduce_scatter(tensor(rank_input(rank, full_shape, dtype), dtype), scattered)
        exchanged = tensor(np.zeros(full_shape), dtype)
        comm.all_to_all(tensor(rank_input(rank, full_shape, dtype), dtype), exchanged)
        comm.barrier()
        return {"all_reduce": reduced.data, "all_gather": gathered.data,
                "reduce_scatter": scattered.data, "all_to_all": exchanged.data}

    results = run_ranks(world_size, body)

    total = sum(rank_input(r, shape, dtype).astype(np.float64) for r in range(world_size))
    gathered = np.concatenate([rank_input(r, shape, dtype) for r in range(world_size)])
    full_total = sum(rank_input(r, full_shape, dtype).astype(np.float64) for r in range(world_size))
    n = shape[0]
    for rank, result in enumerate(results):
        assert result["all_reduce"].dtype == NUMPY_DTYPES[dtype]
        np.testing.assert_array_equal(result["all_reduce"].astype(np.float64), total)
        np.testing.assert_array_equal(result["all_gather"], gathered)
        np.testing.assert_array_equal(result["reduce_scatter"].astype(np.float64), full_total[rank * n:(rank + 1) * n])
        expected = np.concatenate([rank_input(sender, full_shape, dtype)[rank * n:(rank + 1) * n]
                                   for sender in range(world_size)])
        np.testing.assert_array_equal(result["all_to_all"], expected)


def test_the_sum_runs_in_rank_order_in_f32():
    # 1e8 + 1 rounds back to 1e8 in f32 (its spacing there is 8), so rank order gives 0, while
    # any order that adds -1e8 first would give 1.
    values = [1e8, 1.0, -1e8]

    def body(comm):
        x = tensor(np.full(4, values[comm.rank]), DType.F32)
        comm.all_reduce(x)
        return x.data

    for result in run_ranks(3, body):
        np.testing.assert_array_equal(result, np.zeros(4, np.float32))


def test_bf16_is_accumulated_in_f32_and_rounded_once():
    # 1 + 2^-8 is a tie in bf16 and rounds to 1: rounding after each add would lose both
    # halves; f32 accumulation keeps 1 + 2^-7, which bf16 holds exactly.
    values = [1.0, 2.0**-8, 2.0**-8]

    def body(comm):
        x = tensor(np.full(3, values[comm.rank]), DType.BF16)
        comm.all_reduce(x)
        return x.data

    for result in run_ranks(3, body):
        assert result.dtype == BF16
        np.testing.assert_array_equal(result.astype(np.float32), np.full(3, 1 + 2.0**-7, np.float32))


def test_i32_sums_wrap_like_twos_complement():
    def body(comm):
        x = tensor(np.array([2**31 - 1, -(2**31)]), DType.I32)
        comm.all_reduce(x)
        return x.data

    for result in run_ranks(2, body):
        np.testing.assert_array_equal(result, np.array([-2, 0], np.int32))


def test_every_rank_gets_the_same_bits_for_random_bf16():
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((16, 32)).astype(BF16) for _ in range(4)]

    def body(comm):
        x = MockTensor(inputs[comm.rank].copy(), DType.BF16)
        comm.all_reduce(x)
        return x.data

    results = run_ranks(4, body)
    expected = reference.reference_sum(inputs)
    for result in results:
        assert result.tobytes() == expected.tobytes()
    exact = sum(array.astype(np.float64) for array in inputs)
    np.testing.assert_allclose(expected.astype(np.float64), exact, rtol=2**-7, atol=1e-6)


def test_views_are_written_in_place():
    def body(comm):
        base = tensor(np.zeros((4, 2)), DType.F32)
        comm.all_gather(tensor(np.full((1, 2), comm.rank + 1), DType.F32), base.rows(1, 3))
        return base.data

    for result in run_ranks(2, body):
        np.testing.assert_array_equal(result, [[0, 0], [1, 1], [2, 2], [0, 0]])


def test_collectives_captured_in_a_mock_graph_run_on_every_replay():
    def body(comm):
        backend = MockGpuBackend()
        x = tensor(np.zeros(4), DType.F32)
        graph = backend.capture(lambda: comm.all_reduce(x))
        seen = []
        for step in range(3):
            x.data[...] = step * 10 + comm.rank
            graph.replay()
            seen.append(x.data.copy())
        return seen

    for seen in run_ranks(2, body):
        for step, values in enumerate(seen):
            np.testing.assert_array_equal(values, np.full(4, 2 * step * 10 + 1, np.float32))


# -- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.all_reduce(tensor(np.zeros(4), DType.U8)), "all_reduce: tensor is u8"),
        (lambda c: c.all_gather(tensor(np.zeros((2, 3)), DType.F32), tensor(np.zeros((2, 3)), DType.F32)),
         r"all_gather: out must be \[4, 3\] f32; got \[2, 3\] f32"),
        (lambda c: c.all_gather(tensor(np.zeros((2, 3)), DType.F32), tensor(np.zeros((4, 3)), DType.BF16)),
         r"all_gather: out must be \[4, 3\] f32; got \[4, 3\] bf16"),
        (lambda c: c.reduce_scatter(tensor(np.zeros((3, 2)), DType.F32), tensor(np.zeros((1, 2)), DType.F32)),
         r"reduce_scatter: src must be \[2, 2\] f32; got \[3, 2\] f32"),
        (lambda c: c.reduce_scatter(tensor(np.zeros((4,)), DType.U8), tensor(np.zeros((2,)), DType.U8)),
         "reduce_scatter: src is u8"),
        (lambda c: c.all_to_all(tensor(np.zeros((3, 2)), DType.F32), tensor(np.zeros((3, 2)), DType.F32)),
         "all_to_all: src has 3 rows, which do not split into 2 equal chunks"),
        (lambda c: c.all_to_all(tensor(np.zeros((4, 2)), DType.F32), tensor(np.zeros((4, 3)), DType.F32)),
         r"all_to_all: out must be \[4, 2\] f32; got \[4, 3\] f32"),
        (lambda c: c.all_gather(tensor(np.zeros(()), DType.F32), tensor(np.zeros(2), DType.F32)),
         "all_gather: a scalar has no rows"),
    ],
)
def test_a_misshapen_argument_is_a_value_error_naming_it_on_every_backend(call, message):
    def body(comm):
        with pytest.raises(ValueError, match=message):
            call(comm)
        comm.barrier()  # nothing was sent: the group is still in step
        return True

    assert run_ranks(2, body) == [True, True]


def test_a_tensor_of_another_backend_is_refused():
    class Foreign:
        shape, dtype = (4,), DType.F32

    def body(comm):
        with pytest.raises(TypeError, match="MockComm works on the mock backend's tensors; got Foreign"):
            comm.all_reduce(Foreign())
        return True

    assert run_ranks(2, body) == [True, True]


# -- failures ----------------------------------------------------------------------------------


def test_ranks_that_call_different_collectives_all_fail_naming_the_odd_one():
    def body(comm):
        x = tensor(np.ones((4, 2)), DType.F32)
        with pytest.raises(CommError) as caught:
            if comm.rank == 2:
                comm.all_gather(x.rows(0, 1), x)
            else:
                comm.all_reduce(x)
        return caught.value.rank, str(caught.value)

    for rank, message in run_ranks(4, body):
        assert rank == 2
        assert "rank 0 made collective #0 (all_reduce of [4, 2] f32), rank 2 collective #0 (all_gather of [1, 2] f32)" in message


def test_a_rank_that_skips_a_collective_is_named():
    def body(comm):
        x = tensor(np.ones(2), DType.F32)
        with pytest.raises(CommError) as caught:
            if comm.rank != 1:
                comm.all_reduce(x)
            comm.barrier()
        return caught.value.rank, str(caught.value)

    for rank, message in run_ranks(3, body):
        assert rank == 1
        assert "rank 0 made collective #0 (all_reduce of [2] f32), rank 1 collective #0 (barrier)" in message


def test_a_rank_that_raises_stops_the_others_and_is_reported_as_the_cause():
    def body(comm):
        x = tensor(np.ones(2), DType.F32)
        comm.all_reduce(x)
        if comm.rank == 2:
            raise RuntimeError("boom")
        comm.all_reduce(x)

    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 failed: RuntimeError: boom") as caught:
        run_ranks(4, body, timeout_s=20)
    assert caught.value.rank == 2 and isinstance(caught.value.__cause__, RuntimeError)
    assert time.monotonic() - started < 10  # fails at once, not at the timeout


def test_the_peers_of_a_failed_rank_see_a_comm_error_naming_it_and_stay_failed():
    seen: dict[int, tuple[int | None, str, str]] = {}

    def body(comm):
        x = tensor(np.ones(2), DType.F32)
        if comm.rank == 1:
            raise RuntimeError("rank 1 is gone")
        with pytest.raises(CommError) as first:
            comm.all_reduce(x)
        with pytest.raises(CommError) as later:
            comm.barrier()
        seen[comm.rank] = (first.value.rank, str(first.value), str(later.value))

    with pytest.raises(RankFailed):
        run_ranks(3, body)
    assert sorted(seen) == [0, 2]
    for culprit, message, later in seen.values():
        assert culprit == 1 and "rank 1 left during collective #0 (all_reduce of [2] f32)" in message
        assert later == message


def test_a_silent_rank_is_named_after_the_timeout():
    release = threading.Event()
    messages: dict[int, str] = {}

    def body(comm):
        x = tensor(np.ones(2), DType.F32)
        if comm.rank == 1:
            release.wait(10)
            return
        with pytest.raises(CommError) as caught:
            comm.all_reduce(x)
        messages[comm.rank] = str(caught.value)
        release.set()

    run_ranks(3, body, timeout_s=10, comm_timeout_s=0.5)
    assert "rank 1 did not join collective #0 (all_reduce of [2] f32) within 0.5 s" in messages[0]
    assert "rank 1 did not join" in messages[2]


def test_the_harness_gives_up_on_a_rank_that_never_returns():
    release = threading.Event()

    def body(comm):
        if comm.rank == 1:
            release.wait(10)

    with pytest.raises(TimeoutError, match="rank 1 still running after 0.3 s"):
        run_ranks(2, body, timeout_s=0.3)
    release.set()


def test_a_group_missing_a_rank_does_not_form():
    comm_id = new_mock_comm_id()
    with pytest.raises(CommError, match="ranks 1, 2 did not join the group") as caught:
        MockComm.connect(comm_id, 0, 3, timeout_s=0.3)
    assert caught.value.rank == 1
    with pytest.raises(CommError, match="rank 0 did not open the group"):
        MockComm.connect(new_mock_comm_id(), 1, 2, timeout_s=0.2)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        MockComm.connect(comm_id, 2, 2)


def test_ranks_that_disagree_on_the_world_size_do_not_form_a_group():
    comm_id = new_mock_comm_id()
    errors: list[str] = []

    def join(rank, world_size):
        try:
            MockComm.connect(comm_id, rank, world_size, timeout_s=2).close()
        except CommError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=join, args=(0, 2)), threading.Thread(target=join, args=(1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(errors) == 2
    assert all("rank 1 joined a world of 3, rank 0 one of 2" in error for error in errors)


def test_a_closed_communicator_refuses_collectives():
    def body(comm):
        comm.barrier()
        comm.close()
        with pytest.raises(CommError, match="closed"):
            comm.barrier()
        return True

    assert run_ranks(2, body) == [True, True]


# -- one rank ----------------------------------------------------------------------------------


def test_local_comm_is_the_identity_with_copies_and_the_same_checks():
    comm = LocalComm(copy_mock_tensor)
    assert (comm.rank, comm.world_size) == (0, 1)
    x = tensor(np.arange(6).reshape(3, 2), DType.BF16)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x.data.astype(np.float32), np.arange(6).reshape(3, 2))
    for collective in (comm.all_gather, comm.reduce_scatter, comm.all_to_all):
        out = tensor(np.zeros((3, 2)), DType.BF16)
        collective(x, out)
        np.testing.assert_array_equal(out.data, x.data)
    with pytest.raises(ValueError, match="all_gather: out must be"):
        comm.all_gather(x, tensor(np.zeros((6, 2)), DType.BF16))
    with pytest.raises(ValueError, match="all_reduce: tensor is u8"):
        comm.all_reduce(tensor(np.zeros(2), DType.U8))
    comm.barrier()
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(x)


def test_the_reference_functions_match_their_definitions():
    inputs = [np.arange(8, dtype=np.int32).reshape(4, 2) + 100 * rank for rank in range(2)]
    np.testing.assert_array_equal(reference.all_gather(inputs)[1], np.concatenate(inputs))
    np.testing.assert_array_equal(reference.reduce_scatter(inputs)[1], (inputs[0] + inputs[1])[2:])
    np.testing.assert_array_equal(reference.all_to_all(inputs)[0], np.concatenate([inputs[0][:2], inputs[1][:2]]))
    np.testing.assert_array_equal(reference.all_to_all(inputs)[1], np.concatenate([inputs[0][2:], inputs[1][2:]]))

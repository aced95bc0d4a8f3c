"""Run a function on N mock ranks (one thread each) and collect what each returns.

    results = run_ranks(4, lambda comm: shard_and_compute(comm))   # [rank 0's, ..., rank 3's]

Made for tests of tensor- and expert-parallel logic: each rank gets its own `MockComm`, so the
ranks share nothing but the bytes of their collectives. A failure in any rank stops them all
and surfaces as `RankFailed` naming the rank where it started; nothing can hang past
`timeout_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from atlas.adapters.comm.mock import MockComm, name_ranks, new_mock_comm_id
from atlas.ports.comm import CommError

T = TypeVar("T")


class RankFailed(Exception):
    """Rank `rank` raised `error` (also the `__cause__`): the first failure of the group, the
    others' `CommError`s being its consequences."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}")
        self.rank = rank
        self.error = error


def run_ranks(
    world_size: int, fn: Callable[[MockComm], T], timeout_s: float = 30.0, comm_timeout_s: float | None = None
) -> list[T]:
    """fn(comm) on `world_size` ranks at once; their return values in rank order.

    Raises RankFailed for the failure that came first, preferring one that is not a
    CommError (a CommError is what the other ranks see when one fails). Raises TimeoutError
    naming the ranks still running after `timeout_s` (their collectives are woken with
    CommError; a rank blocked outside collectives is left behind as a daemon thread).
    `comm_timeout_s` (default `timeout_s`) bounds each collective's wait for a silent peer.
    """
    comm_id = new_mock_comm_id()
    results: list[T | None] = [None] * world_size
    failures: dict[int, tuple[float, BaseException]] = {}
    comms: list[MockComm | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        comm = None
        try:
            comm = MockComm.connect(comm_id, rank, world_size, timeout_s=comm_timeout_s or timeout_s)
            comms[rank] = comm
            results[rank] = fn(comm)
        except BaseException as error:  # noqa: BLE001 - reported to the caller as RankFailed
            failures[rank] = (time.monotonic(), error)
        finally:
            if comm is not None:
                comm.close()  # the others' collectives now fail at once instead of waiting

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"mock-rank-{rank}", daemon=True)
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if running:
        for comm in comms:
            if comm is not None:
                comm.abort()
        raise TimeoutError(f"{name_ranks(running)} still running after {timeout_s:g} s")
    if failures:
        rank, error = _first_cause(failures)
        raise RankFailed(rank, error) from error
    return results  # type: ignore[return-value]


def _first_cause(failures: dict[int, tuple[float, BaseException]]) -> tuple[int, BaseException]:
    causes = {rank: entry for rank, entry in failures.items() if not isinstance(entry[1], CommError)}
    pool = causes or failures
    rank = min(pool, key=lambda r: (pool[r][0], r))
    return rank, pool[rank][1]

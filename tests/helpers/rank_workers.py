"""Rank workers for the launcher tests: numpy ranks joined by MockComm, in real processes.

Each factory is a top-level function (pickled by reference) taking the RankContext first; the
tests bind their options with functools.partial.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from atlas.adapters.comm.mock import MockComm
from atlas.adapters.mock.tensor import MockTensor
from atlas.app.ranks import RankContext
from atlas.ports.gpu import DType

HIDDEN = 8
WIDTH = 24  # splits over 2, 3 or 4 ranks


def mlp_weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((HIDDEN, WIDTH)).astype(np.float32), rng.standard_normal((WIDTH, HIDDEN)).astype(np.float32)


def mlp_reference(x: np.ndarray, seed: int = 0) -> np.ndarray:
    w1, w2 = mlp_weights(seed)
    return np.maximum(x @ w1, 0) @ w2


class TensorParallelMlp:
    """y = relu(x W1) W2 split over the ranks: rank r holds columns r of W1 and the matching rows
    of W2, so its relu(x W1_r) W2_r is a partial sum that an all-reduce completes.

    `crash_rank` raises at step `crash_step`; `stall_rank` sleeps through it instead."""

    def __init__(self, context: RankContext, comm_timeout_s: float = 30.0, crash_rank: int | None = None,
                 stall_rank: int | None = None, at_step: int = 0) -> None:
        self.rank = context.rank
        w1, w2 = mlp_weights()
        shard = WIDTH // context.world_size
        columns = slice(self.rank * shard, (self.rank + 1) * shard)
        self.w1, self.w2 = w1[:, columns], w2[columns, :]
        self.comm = MockComm.connect(context.comm_id, context.rank, context.world_size, timeout_s=comm_timeout_s)
        self.crash_rank, self.stall_rank, self.at_step = crash_rank, stall_rank, at_step
        self.steps = 0

    def loaded(self) -> bytes:
        return str(self.rank).encode()

    def step(self, body: bytes) -> bytes:
        if self.steps == self.at_step and self.rank == self.crash_rank:
            raise RuntimeError(f"rank {self.rank} broke at step {self.steps}")
        if self.steps == self.at_step and self.rank == self.stall_rank:
            time.sleep(60)
        self.steps += 1
        x = np.frombuffer(body, np.float32).reshape(-1, HIDDEN)
        partial = MockTensor(np.maximum(x @ self.w1, 0) @ self.w2, DType.F32)
        self.comm.all_reduce(partial)
        return partial.data.tobytes()

    def close(self) -> None:
        self.comm.close()


def tensor_parallel_mlp(context: RankContext, **options) -> TensorParallelMlp:
    return TensorParallelMlp(context, **options)


class Sleeper:
    """Starts a grandchild process that sleeps, and reports its own and the grandchild's pid."""

    def __init__(self, context: RankContext) -> None:
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def loaded(self) -> bytes:
        return b""

    def step(self, body: bytes) -> bytes:
        if body == b"hang":
            time.sleep(120)
        return f"{os.getpid()} {self.child.pid}".encode()

    def close(self) -> None:
        pass


def sleeper(context: RankContext) -> Sleeper:
    return Sleeper(context)


def refuse_to_load(context: RankContext, rank: int) -> Sleeper:
    if context.rank == rank:
        raise ValueError("the model does not fit (try --kv-cache-gb 1)")
    return Sleeper(context)

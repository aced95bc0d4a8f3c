"""The vocabulary split over tensor-parallel ranks: each holds 1/t of the embedding rows and of
the LM head (`sharding.vocab_part`).

Embedding: a masked lookup, then an all-reduce. A token id is mapped to the rank's local row,
or to the zero row after its rows when another rank holds it (one `gather_rows` through a
[V] table), so exactly one rank contributes each token's row and the sum is exact.

Logits: each rank computes its [R, V/t] columns, an all-gather stacks them rank-major, and a
row gather puts each sampled row's columns side by side (nothing to reorder for one row):

    gathered [t*R, V/t]: rank 0's R rows | rank 1's R rows | ...     (all_gather)
    logits   [R, V] viewed as [R*t, V/t]: row i*t + k = gathered row k*R + i   (gather_rows)

Every rank then holds the same full logits, bit for bit, and samples the same tokens with the
counter-based sampler: the sampled ids stay on every rank's device for the next step's token
gather, and rank 0 alone reports them (the driver checks that the ranks agree).
"""

from __future__ import annotations

import numpy as np

from atlas.domain.parallel import RankPlacement
from atlas.ports.comm import CommBackend
from atlas.ports.gpu import DType, GpuBackend, Tensor, leading_block
from atlas.ports.kernels.dense import Vocab


class ParallelVocab:
    """`VocabEnds` of one rank, for steps of up to `max_tokens` tokens and `max_rows` sampled rows."""

    def __init__(
        self,
        backend: GpuBackend,
        vocab: Vocab,
        vocab_size: int,
        placement: RankPlacement,
        comm: CommBackend,
        max_tokens: int,
        max_rows: int,
    ) -> None:
        self.vocab = vocab  # the rank's prepared rows: [V/t (+ the zero row), H]
        self.comm = comm
        self.world_size = placement.tensor_parallel
        start, stop = placement.split(vocab_size)
        self.local_size = stop - start
        local_ids = np.full(vocab_size, self.local_size, np.int32)  # elsewhere: the zero row
        local_ids[start:stop] = np.arange(self.local_size, dtype=np.int32)
        self._local_of = backend.upload(local_ids.reshape(vocab_size, 1))
        self._ids = backend.empty((max_tokens, 1), DType.I32)
        self._local_logits = backend.empty((max_rows * self.local_size,), DType.F32)
        self._gathered = backend.empty((self.world_size * max_rows * self.local_size,), DType.F32)
        self._order = backend.upload(_row_orders(self.world_size, max_rows))
        self.max_rows = max_rows

    def embed(self, backend: GpuBackend, token_ids: Tensor, out: Tensor) -> None:
        num_tokens = token_ids.shape[0]
        ids = self._ids.rows(0, num_tokens)
        backend.gather_rows(self._local_of, token_ids, ids)
        backend.dense.embed(ids.view(num_tokens), self.vocab, out)
        self.comm.all_reduce(out)

    def logits(self, backend: GpuBackend, hidden: Tensor, out: Tensor) -> None:
        rows, world, width = hidden.shape[0], self.world_size, self.local_size
        if rows > self.max_rows:
            raise ValueError(f"hidden: {rows} rows, more than the {self.max_rows} this vocabulary was sized for")
        local = leading_block(self._local_logits, rows, width)
        backend.dense.logits(hidden, self.vocab, local)
        if rows == 1:  # [t, V/t] is [1, V] already
            self.comm.all_gather(local, out.view(world, width))
            return
        gathered = leading_block(self._gathered, world * rows, width)
        self.comm.all_gather(local, gathered)
        first = world * rows * (rows - 1) // 2  # the orders of 1 .. rows - 1 rows come first
        backend.gather_rows(gathered, self._order.rows(first, first + world * rows), out.view(rows * world, width))


def _row_orders(world_size: int, max_rows: int) -> np.ndarray:
    """For each row count r = 1 .. max_rows, in turn, the gather order of `logits` for r rows:
    entry i*t + k is k*r + i (row i's columns from rank k)."""
    orders = []
    for rows in range(1, max_rows + 1):
        i, k = np.divmod(np.arange(rows * world_size), world_size)
        orders.append(k * rows + i)
    return np.concatenate(orders).astype(np.int32)

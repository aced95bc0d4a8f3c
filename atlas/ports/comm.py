"""The collective-communication port: what the ranks of one model say to each other.

A model run over several devices (tensor or expert parallelism) has one rank per device, each
its own process with its own `CommBackend`. Collectives work on the backend's device tensors:

    all_reduce      x = sum over ranks of x                       (in place)
    all_gather      out = [src of rank 0; src of rank 1; ...]      along dimension 0
    reduce_scatter  out = rows [r*n, (r+1)*n) of (sum over ranks of src), n = out rows
    all_to_all      out chunk i = rank i's src chunk r             equal chunks along dimension 0

Contract of every implementation (LocalComm, the mock's N ranks, NcclComm):

- Order. Every rank makes the same collectives in the same order with the same shapes and
  dtypes. A collective is enqueued on the stream the device's ops run on, after everything the
  rank enqueued before it, and returns once enqueued: its result is visible to later ops at
  once and to the host after the device's `synchronize`/`download`. (The mock runs it there
  and then.)
- Graph capture. A collective made while the device captures a graph is captured with it and
  runs again on every replay, on the same tensors, with no host work; every rank must capture
  and replay the same graphs in the same order.
- Arguments. Tensors are dense; `src` and `out` do not overlap, except that all_gather's `src`
  may be `out`'s own rows and reduce_scatter's `out` may be `src`'s own rows (rank r's chunk).
  A shape or dtype that does not fit raises `ValueError` naming the argument before anything is
  enqueued (the checks below). Such an error is the caller's bug: the peers wait for a
  collective this rank will not make, so the caller must stop the rank (which the peers see
  as a peer failure).
- Sums. all_reduce and reduce_scatter sum bf16, f16, f32, i32 and i64. The reference sum,
  which LocalComm, the mock and the custom CUDA all-reduce compute bit for bit, is: in rank
  order 0, 1, ..., N-1, accumulated in f32 for the float types and rounded once to the tensor's
  dtype (round to nearest even), wrapping two's complement for the integer types. NCCL sums in
  an order of its own (and bf16 may be rounded between its hops), so it agrees to within
  rounding. Every rank receives the same bits, whatever the backend.
- Failure. A peer that dies, stops, or makes a different collective makes this rank's pending
  or next collective raise `CommError` (naming the peer where the backend can tell), within
  the backend's timeout, never hang for ever; after that every call raises `CommError`. Device
  backends may only notice at the next synchronize; the process that launched the ranks sees
  a rank exit at once and stops the others.
"""

from __future__ import annotations

import math
from typing import Protocol

from atlas.ports.gpu import DType, Tensor

REDUCE_DTYPES = frozenset({DType.BF16, DType.F16, DType.F32, DType.I32, DType.I64})


class CommError(RuntimeError):
    """A collective could not complete: a peer failed, left, timed out or disagreed.

    `rank` is the peer at fault when known (None when the backend cannot tell which)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CommBackend(Protocol):
    """Collectives over the device tensors of `world_size` ranks; see the module docstring."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: Tensor) -> None:
        """tensor = sum over ranks of tensor, in place (the reference sum, see above).
        ValueError for a dtype that cannot be summed."""
        ...

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        """out = every rank's `src` concatenated along dimension 0 in rank order.
        out is [world_size * src rows, ...] of src's dtype, else ValueError."""
        ...

    def reduce_scatter(self, src: Tensor, out: Tensor) -> None:
        """out = rank r's chunk of (sum over ranks of src): rows [r*n, (r+1)*n), n = out rows.
        src is [world_size * n, ...] of out's dtype, else ValueError."""
        ...

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        """Rank r's out chunk i = rank i's src chunk r, chunks being world_size equal row ranges.
        src and out have one shape and dtype, rows a multiple of world_size, else ValueError."""
        ...

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (the mock) or enqueue a point that no
        rank's stream passes before every rank's stream reaches it (device backends)."""
        ...

    def close(self) -> None:
        """Release the communicator; every rank calls it. Later collectives raise CommError."""
        ...


# -- the argument checks every backend makes, so they all fail alike ------------------------


def check_all_reduce(tensor: Tensor) -> None:
    """ValueError unless `tensor` has a dtype collectives can sum."""
    _check_summable("all_reduce", "tensor", tensor)


def check_all_gather(src: Tensor, out: Tensor, world_size: int) -> None:
    """ValueError unless out is [world_size * src rows, *src.shape[1:]] of src's dtype."""
    _check_rows("all_gather", src)
    expected = (world_size * src.shape[0], *src.shape[1:])
    _check_like("all_gather", "out", out, expected, src.dtype)


def check_reduce_scatter(src: Tensor, out: Tensor, world_size: int) -> None:
    """ValueError unless src is [world_size * out rows, *out.shape[1:]] of out's summable dtype."""
    _check_summable("reduce_scatter", "src", src)
    _check_rows("reduce_scatter", out)
    expected = (world_size * out.shape[0], *out.shape[1:])
    _check_like("reduce_scatter", "src", src, expected, out.dtype)


def check_all_to_all(src: Tensor, out: Tensor, world_size: int) -> None:
    """ValueError unless src and out share shape and dtype and their rows split in world_size."""
    _check_rows("all_to_all", src)
    if src.shape[0] % world_size:
        raise ValueError(
            f"all_to_all: src has {src.shape[0]} rows, which do not split into {world_size} equal chunks"
        )
    _check_like("all_to_all", "out", out, src.shape, src.dtype)


def _check_summable(op: str, name: str, tensor: Tensor) -> None:
    if tensor.dtype not in REDUCE_DTYPES:
        summable = ", ".join(sorted(dtype.value for dtype in REDUCE_DTYPES))
        raise ValueError(f"{op}: {name} is {tensor.dtype.value}, which collectives do not sum ({summable} they do)")


def _check_rows(op: str, tensor: Tensor) -> None:
    if not tensor.shape:
        raise ValueError(f"{op}: a scalar has no rows to split or concatenate")


def _check_like(op: str, name: str, tensor: Tensor, shape: tuple[int, ...], dtype: DType) -> None:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype is not dtype:
        raise ValueError(
            f"{op}: {name} must be {list(shape)} {dtype.value}; got {list(tensor.shape)} {tensor.dtype.value}"
        )


def num_bytes(tensor: Tensor) -> int:
    """The size of a dense tensor's data."""
    return math.prod(tensor.shape) * tensor.dtype.itemsize

"""N ranks of the mock backend, each in its own thread or process, joined by Unix sockets.

Every rank sends its part of a collective to rank 0, which checks that all ranks called the
same collective (number, op, shape, dtype), computes every rank's result with the numpy
reference (`reference.py`: rank order, f32 accumulation) and sends each rank its own:

    rank 1 --Contribution(seq, op, dtype, shape, bytes)--> rank 0 <-- ... -- rank N-1
    rank 1 <--Delivery(bytes) | Abort(message, rank)------ rank 0 --- ... -> rank N-1

Nothing is shared but bytes on sockets, so threads behave as separate processes would: a rank
that writes into another's tensor, or that skips, reorders or reshapes a collective, fails the
same way it would on GPUs, except that here it fails at once with a message instead of hanging.
A rank that dies or closes makes every other rank's collective raise `CommError` naming it; a
rank that falls silent does after `timeout_s`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import numpy as np

from atlas.adapters.comm import reference
from atlas.adapters.comm.links import (
    Abort,
    Contribution,
    Delivery,
    Hello,
    Link,
    Welcome,
    is_path,
    new_address,
    receive_from_each,
)
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.comm import (
    CommError,
    check_all_gather,
    check_all_reduce,
    check_all_to_all,
    check_reduce_scatter,
)
from atlas.ports.gpu import NUMPY_DTYPES, DType, Tensor

DEFAULT_TIMEOUT_S = 60.0
_GONE_GRACE_S = 1.0

_RESULTS: dict[str, Callable[[list[np.ndarray]], list[np.ndarray]]] = {
    "all_reduce": reference.all_reduce,
    "all_gather": reference.all_gather,
    "reduce_scatter": reference.reduce_scatter,
    "all_to_all": reference.all_to_all,
    "barrier": lambda inputs: inputs,
}


def new_mock_comm_id() -> bytes:
    """An id for a new group (the analogue of NCCL's unique id): made once, given to every
    rank's `MockComm.connect`."""
    return new_address()


def copy_mock_tensor(src: Tensor, dst: Tensor) -> None:
    """dst = src for the mock's tensors (LocalComm's copy on the mock backend)."""
    _array(dst)[...] = _array(src).reshape(_array(dst).shape)


class MockComm:
    """A `CommBackend` over MockTensors; see the module docstring. Thread-safe only in the
    sense the port asks: one thread drives each rank (`abort` may come from any thread)."""

    def __init__(self, rank: int, world_size: int, links: dict[int, Link], timeout_s: float) -> None:
        self._rank = rank
        self._world_size = world_size
        self._links = links  # rank 0: every peer by rank; other ranks: {0: link to rank 0}
        self._timeout_s = timeout_s
        self._seq = 0
        self._failure: CommError | None = None

    @classmethod
    def connect(cls, comm_id: bytes, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> MockComm:
        """Join group `comm_id` as `rank` of `world_size`; returns once every rank has joined.
        Raises CommError naming the ranks missing after `timeout_s`, ValueError for a bad rank."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            links = _accept_peers(comm_id, world_size, deadline)
        else:
            links = {0: _join(comm_id, rank, world_size, deadline)}
        return cls(rank, world_size, links, timeout_s)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor) -> None:
        check_all_reduce(tensor)
        self._run("all_reduce", tensor, tensor)

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        check_all_gather(src, out, self._world_size)
        self._run("all_gather", src, out)

    def reduce_scatter(self, src: Tensor, out: Tensor) -> None:
        check_reduce_scatter(src, out, self._world_size)
        self._run("reduce_scatter", src, out)

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        check_all_to_all(src, out, self._world_size)
        self._run("all_to_all", src, out)

    def barrier(self) -> None:
        self._exchange("barrier", np.zeros(0, np.uint8))

    def close(self) -> None:
        if self._failure is None:
            self._failure = CommError(f"rank {self._rank}: the communicator is closed")
        for link in self._links.values():
            link.close()

    def abort(self) -> None:
        """Wake this rank out of any collective it is blocked in (it raises CommError); for a
        harness stopping a rank from another thread. `close` must still follow."""
        for link in self._links.values():
            link.shutdown()

    # -- the exchange --------------------------------------------------------------------
    def _run(self, op: str, src: Tensor, out: Tensor) -> None:
        source, target = _array(src), _array(out)
        target[...] = self._exchange(op, source).reshape(target.shape)

    def _exchange(self, op: str, array: np.ndarray) -> np.ndarray:
        if self._failure is not None:
            raise self._failure
        seq, self._seq = self._seq, self._seq + 1
        own = Contribution(seq, op, _dtype_name(array), list(array.shape), np.ascontiguousarray(array).tobytes())
        deadline = time.monotonic() + self._timeout_s
        try:
            if self._rank == 0:
                return self._combine(own, array, deadline)
            return self._delegate(own, array.dtype, deadline)
        except CommError as error:
            self._failure = error
            self._close_links()
            raise

    def _delegate(self, own: Contribution, dtype: np.dtype, deadline: float) -> np.ndarray:
        """Rank > 0: send our part to rank 0, wait for our result."""
        hub = self._links[0]
        deadline += _GONE_GRACE_S  # rank 0 times out first and tells us which peer it missed
        try:
            hub.send(own)
        except OSError:
            # rank 0 has closed; read the reason it may have sent first (a closed socket gives
            # its buffered bytes, then the end of the stream, without waiting)
            deadline = time.monotonic() + _GONE_GRACE_S
        try:
            reply = hub.receive(deadline)
        except TimeoutError:
            raise CommError(
                f"rank {self._rank}: rank 0 gave no result for {_describe(own)} within {self._timeout_s:g} s", 0
            ) from None
        if isinstance(reply, Abort):
            raise CommError(f"rank {self._rank}: {reply.message}", reply.rank)
        if not isinstance(reply, Delivery):
            raise CommError(f"rank {self._rank}: rank 0 left during {_describe(own)}", 0)
        return np.frombuffer(reply.data, dtype=dtype).copy()

    def _combine(self, own: Contribution, array: np.ndarray, deadline: float) -> np.ndarray:
        """Rank 0: collect every part, check they agree, hand out every rank's result."""
        messages, ended, silent = receive_from_each(self._links, deadline)
        if ended:
            self._abort_peers(f"rank {ended[0]} left during {_describe(own)}", ended[0])
        if silent:
            self._abort_peers(
                f"{name_ranks(silent)} did not join {_describe(own)} within {self._timeout_s:g} s",
                silent[0],
            )
        parts = [own] + [messages[rank] for rank in range(1, self._world_size)]
        for rank, part in enumerate(parts):
            if not isinstance(part, Contribution) or _signature(part) != _signature(own):
                theirs = _describe(part) if isinstance(part, Contribution) else type(part).__name__
                self._abort_peers(f"ranks disagree: rank 0 made {_describe(own)}, rank {rank} {theirs}", rank)
        inputs = [array] + [
            np.frombuffer(part.data, dtype=array.dtype).reshape(part.shape) for part in parts[1:]
        ]
        results = _RESULTS[own.op](inputs)
        for rank in range(1, self._world_size):
            try:
                self._links[rank].send(Delivery(np.ascontiguousarray(results[rank]).tobytes()))
            except OSError:
                self._abort_peers(f"rank {rank} left during {_describe(own)}", rank)
        return results[0]

    def _abort_peers(self, message: str, culprit: int | None) -> None:
        for link in self._links.values():
            try:
                link.send(Abort(message, culprit))
            except OSError:
                pass
        raise CommError(f"rank 0: {message}", culprit)

    def _close_links(self) -> None:
        for link in self._links.values():
            link.close()


# -- forming the group ---------------------------------------------------------------------


def _accept_peers(comm_id: bytes, world_size: int, deadline: float) -> dict[int, Link]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    links: dict[int, Link] = {}
    try:
        listener.bind(comm_id)
        listener.listen(world_size)
        while len(links) < world_size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, world_size)) - set(links))
                raise CommError(f"rank 0: {name_ranks(missing)} did not join the group", missing[0])
            listener.settimeout(remaining)
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            link = Link(sock)
            try:
                hello = link.receive(deadline)
            except TimeoutError:
                hello = None
            if not isinstance(hello, Hello):
                link.close()
                continue
            problem = _bad_hello(hello, world_size, links)
            if problem:
                link.send(Abort(problem, hello.rank))
                link.close()
                raise CommError(f"rank 0: {problem}", hello.rank)
            links[hello.rank] = link
        for link in links.values():
            link.send(Welcome())
        return links
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        listener.close()
        if is_path(comm_id):
            try:
                os.unlink(comm_id)
            except FileNotFoundError:
                pass


def _bad_hello(hello: Hello, world_size: int, links: dict[int, Link]) -> str | None:
    if hello.world_size != world_size:
        return f"rank {hello.rank} joined a world of {hello.world_size}, rank 0 one of {world_size}"
    if not 0 < hello.rank < world_size:
        return f"rank {hello.rank} is outside a world of {world_size}"
    if hello.rank in links:
        return f"two processes joined as rank {hello.rank}"
    return None


def _join(comm_id: bytes, rank: int, world_size: int, deadline: float) -> Link:
    link = Link.connect(comm_id, deadline)
    if link is None:
        raise CommError(f"rank {rank}: rank 0 did not open the group", 0)
    try:
        link.send(Hello(rank, world_size))
        reply = link.receive(deadline)
    except TimeoutError:
        reply = None
    except OSError:
        reply = None
    if isinstance(reply, Welcome):
        return link
    link.close()
    if isinstance(reply, Abort):
        raise CommError(f"rank {rank}: {reply.message}", reply.rank)
    raise CommError(f"rank {rank}: the group did not form (rank 0 left or another rank did not join)", None)


# -- helpers -------------------------------------------------------------------------------


def name_ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 1, 2' for messages."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _array(tensor: Tensor) -> np.ndarray:
    if not isinstance(tensor, MockTensor):
        raise TypeError(f"MockComm works on the mock backend's tensors; got {type(tensor).__name__}")
    return tensor.data


def _dtype_name(array: np.ndarray) -> str:
    for dtype, np_dtype in NUMPY_DTYPES.items():
        if array.dtype == np_dtype:
            return dtype.value
    raise TypeError(f"no port dtype for {array.dtype}")


def _signature(part: Contribution) -> tuple:
    return part.seq, part.op, part.dtype, tuple(part.shape)


def _describe(part: Contribution) -> str:
    if part.op == "barrier":
        return f"collective #{part.seq} (barrier)"
    return f"collective #{part.seq} ({part.op} of {part.shape} {DType(part.dtype).value})"

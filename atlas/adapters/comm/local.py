"""One rank: every collective is the identity (a copy where the output is another tensor)."""

from __future__ import annotations

from collections.abc import Callable

from atlas.ports.comm import CommError, check_all_gather, check_all_reduce, check_all_to_all, check_reduce_scatter
from atlas.ports.gpu import Tensor


class LocalComm:
    """The `CommBackend` of a model on one device.

    `copy(src, dst)` is the device's own copy, enqueued on its stream (the mock's
    `copy_mock_tensor`; on CUDA a device-to-device copy on the backend's stream), so a result is
    ordered with the ops around it exactly as a real collective's would be.
    """

    def __init__(self, copy: Callable[[Tensor, Tensor], None]) -> None:
        self._copy = copy
        self._closed = False

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(self, tensor: Tensor) -> None:
        self._check_open()
        check_all_reduce(tensor)

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        self._check_open()
        check_all_gather(src, out, 1)
        self._copy(src, out)

    def reduce_scatter(self, src: Tensor, out: Tensor) -> None:
        self._check_open()
        check_reduce_scatter(src, out, 1)
        self._copy(src, out)

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        self._check_open()
        check_all_to_all(src, out, 1)
        self._copy(src, out)

    def barrier(self) -> None:
        self._check_open()

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CommError("rank 0: the communicator is closed")

"""The collective-communication port for tensor-parallel ranks."""

from __future__ import annotations

from typing import Protocol

from atlas.ports.gpu import Tensor


class CommBackend(Protocol):
    """Collectives over the backend tensors of `world_size` ranks.

    Every rank calls each collective in the same order; one rank (`LocalComm`) makes them the
    identity. A failed peer raises RuntimeError naming the rank.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: Tensor) -> None:
        """Sum `tensor` across ranks, in place."""
        ...

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        """out = concatenation of every rank's `src` along dimension 0, rank order."""
        ...

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        """Rank r's out chunk i = rank i's src chunk r (equal chunks along dimension 0)."""
        ...

    def barrier(self) -> None: ...

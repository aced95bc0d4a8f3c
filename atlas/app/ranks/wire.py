"""What the driver and its ranks say to each other, and what a rank's plug-in is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank's factory is told: who it is, which device is its, and the communicator
    id to join, made by the driver (`nccl_unique_id()` or `new_mock_comm_id()`)."""

    rank: int
    world_size: int
    device_ordinal: int
    comm_id: bytes


class RankWorker(Protocol):
    def loaded(self) -> bytes:
        """What the rank tells the driver once the factory returned (how many KV blocks fit,
        say); `RankGroup.start` returns every rank's."""
        ...

    def step(self, body: bytes) -> bytes:
        """Run one step given the driver's message; the reply goes back to the driver when it
        asked for one (`RankGroup.submit`), and is dropped otherwise (`RankGroup.send`)."""
        ...

    def close(self) -> None:
        """Release the device and the communicator (the driver is stopping the group)."""
        ...


RankFactory = Callable[[RankContext], RankWorker]


class StartRank(msgspec.Struct, tag=True):
    rank: int
    world_size: int
    device_ordinal: int
    comm_id: bytes
    factory: bytes  # pickled RankFactory
    sys_path: list[str]


class Step(msgspec.Struct, tag=True):
    body: bytes
    reply: bool = True  # False: the driver does not wait for this step's StepDone


class Stop(msgspec.Struct, tag=True):
    pass


class RankReady(msgspec.Struct, tag=True):
    body: bytes = b""  # RankWorker.loaded()


class StepDone(msgspec.Struct, tag=True):
    body: bytes


class RankFailed(msgspec.Struct, tag=True):
    message: str
    is_user_error: bool  # a ValueError/MemoryError at load that names the fix
    culprit: int | None  # the peer a CommError named, if any


ToRank = StartRank | Step | Stop
FromRank = RankReady | StepDone | RankFailed

"""What a front end receives from the engine besides sequence outputs: failures and health.

Plain data shared by the engine's transports (in this process, or over a socket from the
engine's own process) and the front ends that read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from atlas.domain.batch import SequenceOutput


class EngineFailure(msgspec.Struct, tag=True):
    """Delivered on a request's stream when the engine could not run it."""

    message: str
    is_user_error: bool = False  # a ParameterError: the request was invalid (a 400, not a 500)
    field: str | None = None


StreamItem = SequenceOutput | EngineFailure


@dataclass(frozen=True, slots=True)
class EngineHealth:
    ready: bool
    progressing: bool  # False when work is pending but no step finished within the stall limit
    detail: str

    @property
    def is_healthy(self) -> bool:
        return self.ready and self.progressing

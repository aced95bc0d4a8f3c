"""The engine actor: owns the engine core and runs its step loop for async front ends.

Front ends (the HTTP app, the async Python API) talk to it only through messages: `submit`
puts an `AddRequest` in the inbox and returns the request's output stream; `abort` puts an
`AbortRequest`. The loop applies commands between steps only, so the scheduler has a single
writer, and runs each blocking step in a worker thread so the event loop stays free for I/O.

    front end --AddRequest/AbortRequest--> inbox --> [apply; step in thread; publish] --> streams
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from atlas.domain.batch import SequenceOutput
from atlas.domain.engine import EngineCore, EngineStats
from atlas.domain.requests import ParameterError, Request

log = logging.getLogger("atlas.engine")


class AddRequest(msgspec.Struct, tag=True):
    request: Request


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = AddRequest | AbortRequest | Shutdown


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


class EngineActor:
    """Runs `EngineCore` steps off the event loop and fans outputs out to per-request streams."""

    def __init__(self, core: EngineCore, stall_timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self._core = core
        self._clock = clock
        self._stall_timeout_s = stall_timeout_s
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Command](math.inf)
        self._streams: dict[str, ObjectSendStream[StreamItem]] = {}
        self._running = False
        self._failed: str | None = None
        self._busy_since_s: float | None = None  # when the current step started
        self._stats = core.stats()

    # -- front-end side -------------------------------------------------------------------
    def submit(self, request: Request) -> ObjectReceiveStream[StreamItem]:
        """Queue `request`; its outputs (or one EngineFailure) arrive on the returned stream."""
        send, receive = anyio.create_memory_object_stream[StreamItem](math.inf)
        if self._failed is not None:
            send.send_nowait(EngineFailure(f"the engine stopped: {self._failed}"))
            send.close()
            return receive
        self._streams[request.request_id] = send
        self._inbox_send.send_nowait(AddRequest(request))
        return receive

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Safe to call twice."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()
            self._inbox_send.send_nowait(AbortRequest(request_id))

    def shutdown(self) -> None:
        self._inbox_send.send_nowait(Shutdown())

    def stats(self) -> EngineStats:
        return self._stats

    def health(self) -> EngineHealth:
        if self._failed is not None:
            return EngineHealth(False, False, f"engine failed: {self._failed}")
        if not self._running:
            return EngineHealth(False, False, "engine not running")
        busy_since = self._busy_since_s
        if busy_since is not None and self._clock() - busy_since > self._stall_timeout_s:
            return EngineHealth(True, False, f"no step finished for {self._clock() - busy_since:.0f}s")
        return EngineHealth(True, True, "ok")

    # -- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        """The actor's loop; run it in a task group for the engine's lifetime."""
        self._running = True
        try:
            while True:
                if not self._core.has_unfinished:
                    command = await self._inbox.receive()
                    if not self._apply(command):
                        return
                if not self._drain_inbox():
                    return
                if self._core.has_unfinished:
                    await self._step()
        finally:
            self._running = False

    def _drain_inbox(self) -> bool:
        while True:
            try:
                command = self._inbox.receive_nowait()
            except anyio.WouldBlock:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: Command) -> bool:
        if isinstance(command, Shutdown):
            self._fail_all("the server is shutting down")
            return False
        if isinstance(command, AbortRequest):
            self._core.abort(command.request_id)
            return True
        request = command.request
        if request.request_id not in self._streams:
            return True  # aborted before it was added
        try:
            self._core.add_request(request)
        except ParameterError as error:
            self._deliver_failure(request.request_id, EngineFailure(str(error), True, error.field))
        return True

    async def _step(self) -> None:
        self._busy_since_s = self._clock()
        try:
            outputs = await anyio.to_thread.run_sync(self._core.step)
        except Exception as error:  # a device fault: fail every request, stop serving
            log.exception("engine step failed")
            self._failed = f"{type(error).__name__}: {error}"
            self._fail_all(self._failed)
            raise
        finally:
            self._busy_since_s = None
        self._stats = self._core.stats()
        for output in outputs:
            stream = self._streams.get(output.seq_id)
            if stream is None:
                continue
            stream.send_nowait(output)
            if output.finish_reason is not None:
                self._streams.pop(output.seq_id).close()

    def _deliver_failure(self, request_id: str, failure: EngineFailure) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.send_nowait(failure)
            stream.close()

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._streams):
            self._deliver_failure(request_id, EngineFailure(message))

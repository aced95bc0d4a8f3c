"""The engine actor: owns the engine core and runs its step loop for async front ends.

Front ends (the HTTP app, the async Python API) talk to it only through messages: `submit`
puts an `AddRequest` per sequence in the inbox and returns one output stream for all of them;
`abort` puts `AbortRequest`s. The loop applies commands between steps only, so the scheduler
has a single writer, and runs each blocking step in a worker thread so the event loop stays
free for I/O.

    front end --AddRequest/AbortRequest--> inbox --> [apply; step in thread; route] --> streams

`EngineProcess` (engine_process.py) offers the same interface with the core in another
process; both route outputs through `OutputRouter`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec

from atlas.domain.batch import SequenceOutput
from atlas.domain.engine import EngineCore, EngineStats
from atlas.domain.engine_events import EngineFailure, EngineHealth, StreamItem
from atlas.domain.requests import ParameterError, Request

log = logging.getLogger("atlas.engine")

DEFAULT_STALL_TIMEOUT_S = 120.0


class AddRequest(msgspec.Struct, tag=True):
    request: Request


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = AddRequest | AbortRequest | Shutdown


class OutputStream:
    """One front-end request's outputs in order, from the router (one event loop) to its reader.

    What `anyio.create_memory_object_stream` offers a single reader, at a fraction of the cost
    per item: the reader takes everything queued at once (`take`) and waits (`wait`) on one
    future, with no cancel scope: a timeout is a timer on the loop, and `wake()` ends a wait
    early. Every output of every running request passes here, 64 streams x hundreds of steps
    a second under load, so this sits on the API process's hottest path.

    `receive()` raises anyio.EndOfStream once the router has ended the stream and the queue is
    empty; `receive_nowait()` raises anyio.WouldBlock when nothing is queued yet. After the
    reader's `close()`, the router's `put` returns False (the reader is gone).
    """

    __slots__ = ("_items", "_ended", "_reader_closed", "_waiter")

    def __init__(self) -> None:
        self._items: list[StreamItem] = []
        self._ended = False
        self._reader_closed = False
        self._waiter: asyncio.Future[None] | None = None

    # -- the router's side ----------------------------------------------------------------
    def put(self, item: StreamItem) -> bool:
        """Queue `item`; False (and nothing queued) when the reader has closed the stream."""
        if self._reader_closed:
            return False
        self._items.append(item)
        waiter = self._waiter  # _wake(), inlined: every output of every stream comes here
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        return True

    def end(self) -> None:
        """No more items: the reader gets EndOfStream after those queued."""
        self._ended = True
        self._wake()

    def _wake(self, woken: bool = True) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(woken)

    # -- the reader's side ----------------------------------------------------------------
    def take(self) -> list[StreamItem]:
        """Every queued item, oldest first; [] when none is."""
        items = self._items
        if items:
            self._items = []
        return items

    @property
    def at_end(self) -> bool:
        """Nothing is queued and nothing more will be: the router ended the stream (or the
        reader closed it)."""
        return not self._items and (self._ended or self._reader_closed)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Return once an item is queued or the stream is at its end (at once if either holds
        already) or `wake()` is called: True; or after `timeout_s`: False."""
        if self._items or self._ended or self._reader_closed:
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(max(timeout_s, 0.0), self._wake, False)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def wake(self) -> None:
        """End the reader's `wait` now (nothing is queued)."""
        self._wake()

    def receive_nowait(self) -> StreamItem:
        if self._items:
            return self._items.pop(0)
        if self._ended or self._reader_closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> StreamItem:
        while not (self._items or self._ended or self._reader_closed):
            await self.wait()
        return self.receive_nowait()

    def close(self) -> None:
        """The reader stops reading; queued items are dropped."""
        self._reader_closed = True
        self._items = []

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> StreamItem:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


def ended_stream(item: StreamItem) -> OutputStream:
    """A stream holding only `item` (a request refused before it reached the engine)."""
    stream = OutputStream()
    stream.put(item)
    stream.end()
    return stream


class _Route:
    """The stream shared by the sequences of one front-end request, open while any runs."""

    __slots__ = ("stream", "num_open")

    def __init__(self, stream: OutputStream, num_open: int) -> None:
        self.stream = stream
        self.num_open = num_open


class OutputRouter:
    """Maps sequence ids to the stream of the front-end request that owns them.

    One request's sequences (the `n` choices) share a stream; it closes when the last of them
    finishes, fails or is aborted, so a consumer's `async for` ends exactly then.
    """

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._routes

    def open(self, seq_ids: Sequence[str]) -> OutputStream:
        """A stream for `seq_ids`. Raises ValueError when one of them is already routed."""
        duplicates = [seq_id for seq_id in seq_ids if seq_id in self._routes]
        if duplicates or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"request id {(duplicates or list(seq_ids))[0]!r} is already in use")
        stream = OutputStream()
        route = _Route(stream, len(seq_ids))
        for seq_id in seq_ids:
            self._routes[seq_id] = route
        return stream

    def deliver(self, outputs: Iterable[SequenceOutput]) -> list[str]:
        """Send each output to its stream; an output for an unknown id is dropped (aborted). An
        output with an `error` ends its request with an EngineFailure instead.

        Returns the ids whose consumer closed its stream without aborting them, and the siblings
        of a failed sequence: they are no longer routed, and the caller must abort them in the
        engine.
        """
        routes = self._routes
        orphans = []
        for output in outputs:
            route = routes.get(output.seq_id)
            if route is None:
                continue
            if output.error is not None:
                failure = EngineFailure(output.error, output.error_field is not None, output.error_field)
                orphans.extend(self.fail(output.seq_id, failure))
                continue
            if not route.stream.put(output):
                orphans.extend(seq_id for seq_id, r in list(routes.items()) if r is route)
                for seq_id in orphans:
                    if routes.get(seq_id) is route:
                        self._release(seq_id, route)
                continue
            if output.finish_reason is not None:
                self._release(output.seq_id, route)
        return orphans

    def fail(self, seq_id: str, failure: EngineFailure) -> list[str]:
        """End `seq_id`'s request with `failure`; returns its siblings still routed (to abort)."""
        route = self._routes.get(seq_id)
        if route is None:
            return []
        siblings = [other for other, r in self._routes.items() if r is route and other != seq_id]
        route.stream.put(failure)  # dropped when nobody is listening any more
        for other in (seq_id, *siblings):
            self._release(other, route)
        return siblings

    def close(self, seq_ids: Iterable[str]) -> list[str]:
        """Stop routing `seq_ids` (an abort); returns those that were still routed."""
        closed = []
        for seq_id in seq_ids:
            route = self._routes.get(seq_id)
            if route is not None:
                self._release(seq_id, route)
                closed.append(seq_id)
        return closed

    def fail_all(self, message: str) -> None:
        for seq_id in list(self._routes):
            self.fail(seq_id, EngineFailure(message))

    def _release(self, seq_id: str, route: _Route) -> None:
        del self._routes[seq_id]
        route.num_open -= 1
        if route.num_open == 0:
            route.stream.end()


class EngineActor:
    """Runs `EngineCore` steps off the event loop and routes outputs to per-request streams."""

    def __init__(
        self,
        core: EngineCore,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._core = core
        self._clock = clock
        self._stall_timeout_s = stall_timeout_s
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Command](math.inf)
        self._router = OutputRouter()
        self._running = False
        self._failed: str | None = None
        self._busy_since_s: float | None = None  # when the current step started
        self._stats = core.stats()
        self._token: anyio.lowlevel.EventLoopToken | None = None  # of the loop `run` runs on

    # -- front-end side -------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> OutputStream:
        """Queue `requests` (one front-end request's sequences); their outputs, or one
        EngineFailure, arrive on the returned stream, which closes when all have finished.

        Raises ValueError when a request id is already running.
        """
        if self._failed is not None:
            return ended_stream(EngineFailure(f"the engine stopped: {self._failed}"))
        receive = self._router.open([request.request_id for request in requests])
        for request in requests:
            self._inbox_send.send_nowait(AddRequest(request))
        return receive

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests; their blocks are freed before the next step. Safe to call twice."""
        for request_id in self._router.close(request_ids):
            self._inbox_send.send_nowait(AbortRequest(request_id))

    def shutdown(self) -> None:
        self._inbox_send.send_nowait(Shutdown())

    def fail_from_thread(self, message: str) -> None:
        """Stop the actor from another thread: what runs the engine's steps failed outside a
        step (a rank process died). Health reports `message` at once; every request fails and
        `run` raises. Does nothing once the loop has gone."""
        self._failed = message
        if self._token is not None:
            try:
                anyio.from_thread.run_sync(self._inbox_send.send_nowait, Shutdown(), token=self._token)
            except (RuntimeError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the loop or the inbox is gone: nothing left to stop

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
        """The actor's loop; run it in a task group for the engine's lifetime.

        Returns after `shutdown`; re-raises a step's exception after failing every request.
        """
        self._running = True
        self._token = anyio.lowlevel.current_token()
        try:
            while True:
                if not self._core.has_unfinished:
                    command = await self._inbox.receive()
                    if not self._apply(command):
                        return self._raise_failure()
                if not self._drain_inbox():
                    return self._raise_failure()
                if self._core.has_unfinished:
                    await self._step()
                else:
                    self._stats = self._core.stats()  # aborts freed blocks without a step
        finally:
            self._running = False
            self._token = None

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise RuntimeError(self._failed)

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
            self._router.fail_all(self._failed or "the server is shutting down")
            return False
        if isinstance(command, AbortRequest):
            self._core.abort(command.request_id)
            return True
        request = command.request
        if request.request_id not in self._router:
            return True  # aborted before it was added
        try:
            self._core.add_request(request)
        except ParameterError as error:
            failure = EngineFailure(str(error), True, error.field)
            for sibling in self._router.fail(request.request_id, failure):
                self._core.abort(sibling)
        return True

    async def _step(self) -> None:
        self._busy_since_s = self._clock()
        try:
            outputs = await anyio.to_thread.run_sync(self._core.step)
        except Exception as error:  # a device fault: fail every request, stop serving
            log.exception("engine step failed")
            self._failed = f"{type(error).__name__}: {error}"
            self._router.fail_all(self._failed)
            raise
        finally:
            self._busy_since_s = None
        self._stats = self._core.stats()
        for orphan in self._router.deliver(outputs):
            self._core.abort(orphan)

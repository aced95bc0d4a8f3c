"""The engine core in its own process, so HTTP work never holds the GIL the step loop needs.

The API process spawns `python -m atlas.app.engine_process FD` with one end of a socket pair
and talks to it in the frames of `engine_protocol`. `EngineProcess` is the API side (the
`EngineClient` the HTTP layer uses); `EngineLoop` and `child_main` are the engine side.

The engine loop is synchronous: it blocks on the socket only while it has no work, reads
whatever commands have arrived between steps, and publishes one frame per step with every
sequence's outputs. Either side closing the socket ends the other: the engine exits on EOF,
and the API fails every open request when the engine's frames stop.
"""

from __future__ import annotations

import time

_STARTED_S = time.perf_counter()  # before the imports: the engine process's start phase counts them

import asyncio
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence

import anyio
import msgspec

from atlas.app.engine_actor import (
    DEFAULT_STALL_TIMEOUT_S,
    AbortRequest,
    AddRequest,
    Command,
    OutputRouter,
    OutputStream,
    Shutdown,
    ended_stream,
)
from atlas.domain.engine_events import EngineFailure, EngineHealth
from atlas.app.engine_protocol import (
    Commands,
    Crashed,
    FrameBuffer,
    FromEngine,
    LoadFailed,
    Ready,
    RequestFailure,
    Start,
    StepOutputs,
    ToEngine,
    frame,
)
from atlas.app.engine_spawn import PRELOAD_CUDA_FLAG, spawn_engine, start_cuda_preload, take_early
from atlas.app.settings import EngineSettings
from atlas.app.step_trace import StepTrace
from atlas.app.long_running import freeze_startup_objects
from atlas.domain.engine import EngineCore, EngineStats
from atlas.domain.requests import ParameterError, Request
from atlas.ports.startup import report_phase

log = logging.getLogger("atlas.engine")

_RECEIVE_BYTES = 1 << 20
# Idle work (a deferred decode graph, tens of ms; more while cuBLASLt times a new bucket) starts
# only after this long with no work and no command, so it rarely lands in front of a request:
# a benchmark's next wave, or a client's next turn, comes within milliseconds of the last
# stream's end.
_IDLE_WORK_AFTER_S = 0.5
# A server busy from its start never has that quiet: after this long, the pieces are done
# between steps (the pipeline drained first), one every spacing, each a pause of tens of ms.
_FORCE_IDLE_WORK_AFTER_S = 10.0
_FORCED_IDLE_WORK_SPACING_S = 1.0
_EXIT_WAIT_S = 10.0


class EngineLoop:
    """The engine process's side: apply commands between steps, publish one frame per step."""

    def __init__(self, core: EngineCore, sock: socket.socket, frames: FrameBuffer,
                 idle_work: Callable[[], bool] = lambda: False) -> None:
        self._core = core
        self._idle_work = idle_work  # one piece of startup work left, for when nothing runs
        self._has_idle_work = True
        self._sock = sock
        self._frames = frames  # may hold bytes that arrived with Start
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(ToEngine)
        self._send_lock = threading.Lock()  # `fail` may come from a rank watcher's thread

    def send(self, message: FromEngine) -> None:
        data = frame(self._encode(message))
        with self._send_lock:
            self._sock.sendall(data)

    def fail(self, message: str) -> None:
        """Report that the engine cannot go on (its ranks failed while it waited for commands)
        and end `run`: the API process then fails every request and stops."""
        try:
            self.send(Crashed(message))
            self._sock.shutdown(socket.SHUT_RD)  # wakes `run` from its wait for commands
        except OSError:
            pass  # the API process is gone already

    def run(self) -> None:
        """Until Shutdown or EOF; a step's exception is reported as Crashed and re-raised."""
        core = self._core
        trace = StepTrace.from_environment(core)
        try:
            self._run(core, trace)
        finally:
            if trace is not None:
                trace.close()

    def _run(self, core: EngineCore, trace: StepTrace | None) -> None:
        busy_s = time.monotonic()  # when the engine last had work or a command
        forced_s = busy_s + _FORCE_IDLE_WORK_AFTER_S  # when busy steps give way to idle work
        while True:
            if self._has_idle_work and core.has_unfinished and time.monotonic() >= forced_s:
                # never quiet since startup: drain the pipeline and do a piece between steps
                try:
                    drained = core.drain()
                except Exception as error:
                    self.send(Crashed(f"{type(error).__name__}: {error}"))
                    raise
                self.send(StepOutputs(drained, [], core.stats()))
                self._do_idle_work()
                forced_s = time.monotonic() + _FORCED_IDLE_WORK_SPACING_S
            idle = not core.has_unfinished
            quiet = _IDLE_WORK_AFTER_S - (time.monotonic() - busy_s)
            wait = None if not self._has_idle_work else max(quiet, 0.0)  # None: until a command
            commands = self._receive(block=idle, timeout=wait)
            if commands is None:
                return
            if commands or not idle:
                busy_s = time.monotonic()
            elif self._has_idle_work and quiet <= 0:
                self._do_idle_work()
                continue
            failures: list[RequestFailure] = []
            for command in commands:
                if isinstance(command, Shutdown):
                    return
                self._apply(command, failures)
            if core.has_unfinished:
                try:
                    outputs = core.step() if trace is None else trace.step(len(commands))
                except Exception as error:
                    self.send(Crashed(f"{type(error).__name__}: {error}"))
                    raise
                self.send(StepOutputs(outputs, failures, core.stats()))
            elif commands:
                self.send(StepOutputs([], failures, core.stats()))

    def _do_idle_work(self) -> None:
        """One piece of the startup's leftover work (nothing may be in flight); a failure is
        reported as Crashed and re-raised, as a step's is."""
        try:
            self._has_idle_work = self._idle_work()
        except Exception as error:
            self.send(Crashed(f"{type(error).__name__}: {error}"))
            raise

    def _apply(self, command: Command, failures: list[RequestFailure]) -> None:
        if isinstance(command, AbortRequest):
            self._core.abort(command.request_id)
            return
        request = command.request
        try:
            self._core.add_request(request)
        except ParameterError as error:
            failures.append(RequestFailure(request.request_id, EngineFailure(str(error), True, error.field)))

    def _receive(self, block: bool, timeout: float | None = None) -> list[Command] | None:
        """Commands that have arrived (waiting for at least one frame when `block`, at most
        `timeout` seconds when given); None at EOF."""
        commands: list[Command] = []
        if block and timeout is not None:
            readable, _, _ = select.select([self._sock], [], [], timeout)
            block = bool(readable)  # a frame is there to read, or nothing came: do not wait
        while True:
            try:
                data = self._sock.recv(_RECEIVE_BYTES, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return commands
            if not data:
                return None
            for body in self._frames.feed(data):
                message = self._decoder.decode(body)
                if isinstance(message, Commands):
                    commands.extend(message.commands)
            if commands:
                block = False  # got work: take what else is queued without waiting


class EngineStopped(RuntimeError):
    """The engine process crashed or exited while serving."""


class _Connection(asyncio.Protocol):
    """The API process's end of the socket, as an asyncio protocol: each frame is handed to
    `on_message` in the callback that read it, and `write` goes to the socket at once, so a
    request reaches the engine, and an output its stream, without waiting for a pump task's
    turn on a busy event loop (each turn costs a whole round of the other streams' work)."""

    def __init__(self, on_message: Callable[[FromEngine], None], on_lost: Callable[[str | None], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._frames = FrameBuffer()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            messages = [self._decoder.decode(body) for body in self._frames.feed(data)]
        except (ValueError, msgspec.DecodeError) as error:
            self._lose(f"the engine sent a corrupt frame: {error}")
            return
        for message in messages:
            self._on_message(message)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, error: Exception | None) -> None:
        self._on_lost(None if error is None else str(error))

    def _lose(self, reason: str) -> None:
        self._on_lost(reason)
        self.transport.abort()


class EngineProcess:
    """The API side: `EngineClient` over the socket, plus spawning and stopping the process.

    `start()` spawns the process and waits for the model to load (raising ValueError with the
    engine's message when loading fails); `run()` then serves until `shutdown()` (returns) or
    the engine dies (fails every open request, raises EngineStopped). Commands are written as
    they are made and outputs routed as their frames arrive (`_Connection`); `run` only waits.
    """

    def __init__(
        self,
        settings: EngineSettings,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._router = OutputRouter()
        self._encode = msgspec.msgpack.Encoder().encode
        self._process: subprocess.Popen | None = None
        self._connection: _Connection | None = None
        self._loaded: asyncio.Future[Ready | LoadFailed] | None = None
        self._lost = anyio.Event()  # the socket closed (EOF, an error, or the engine crashed)
        self._stats: EngineStats | None = None
        self._ready: Ready | None = None
        self._failed: str | None = None
        self._stopping = False
        self._last_progress_s = clock()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> Ready:
        spawned = take_early() or spawn_engine()  # `atlas serve` may have spawned it before its imports
        self._process = spawned.process
        loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()
        _, self._connection = await loop.create_unix_connection(
            lambda: _Connection(self._on_message, self._on_lost), sock=spawned.sock)
        self._write(Start(self._settings))
        loaded = await self._loaded
        if isinstance(loaded, LoadFailed):
            await self.close()
            raise (ValueError if loaded.is_user_error else RuntimeError)(loaded.message)
        self._ready, self._stats = loaded, loaded.stats
        self._last_progress_s = self._clock()
        return self._ready

    async def run(self) -> None:
        try:
            await self._lost.wait()
            if self._failed is not None:
                raise EngineStopped(self._failed)
        finally:
            await self.close()

    def shutdown(self) -> None:
        self._stopping = True
        self._write(Commands([Shutdown()]))

    # -- EngineClient -------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> OutputStream:
        if self._failed is not None:
            return ended_stream(EngineFailure(f"the engine stopped: {self._failed}"))
        if not len(self._router):
            self._last_progress_s = self._clock()  # idle until now: the stall clock starts here
        stream = self._router.open([request.request_id for request in requests])
        self._write(Commands([AddRequest(request) for request in requests]))
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        closed = self._router.close(request_ids)
        if closed:
            self._write(Commands([AbortRequest(request_id) for request_id in closed]))

    def stats(self) -> EngineStats | None:
        return self._stats

    def health(self) -> EngineHealth:
        if self._failed is not None:
            return EngineHealth(False, False, f"engine failed: {self._failed}")
        if self._ready is None:
            return EngineHealth(False, False, "loading the model")
        waited_s = self._clock() - self._last_progress_s
        if len(self._router) and waited_s > self._stall_timeout_s:
            return EngineHealth(True, False, f"no step finished for {waited_s:.0f}s")
        return EngineHealth(True, True, "ok")

    # -- the socket ---------------------------------------------------------------------
    def _write(self, message: ToEngine) -> None:
        """Send now (the transport buffers what the socket cannot take yet); nothing once the
        socket is gone, where every request has failed already."""
        transport = self._connection.transport if self._connection is not None else None
        if transport is not None and not transport.is_closing():
            transport.write(frame(self._encode(message)))

    def _on_message(self, message: FromEngine) -> None:
        if isinstance(message, StepOutputs):
            self._apply(message)
        elif isinstance(message, (Ready, LoadFailed)):
            if self._loaded is not None and not self._loaded.done():
                self._loaded.set_result(message)
        elif isinstance(message, Crashed):
            self._fail(message.message)
            self._connection.transport.abort()

    def _on_lost(self, reason: str | None) -> None:
        if self._loaded is not None and not self._loaded.done():
            detail = f": {reason}" if reason else ""
            self._loaded.set_result(LoadFailed(f"the engine process exited while loading{detail}", False))
        if self._failed is None:
            if self._stopping:
                self._router.fail_all("the server is shutting down")
            else:
                self._fail(reason or "the engine process exited unexpectedly")
        self._lost.set()

    def _apply(self, message: StepOutputs) -> None:
        self._stats = message.stats
        self._last_progress_s = self._clock()
        for failure in message.failures:
            self.abort(self._router.fail(failure.request_id, failure.failure))
        orphans = self._router.deliver(message.outputs)
        if orphans:
            self._write(Commands([AbortRequest(orphan) for orphan in orphans]))

    def _fail(self, message: str) -> None:
        self._failed = message
        self._router.fail_all(message)

    async def close(self) -> None:
        """Close the socket and wait for the process to exit (killing it after a grace period)."""
        if self._connection is not None and self._connection.transport is not None:
            self._connection.transport.close()
        process = self._process
        if process is None:
            return
        try:
            await anyio.to_thread.run_sync(process.wait, _EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit; killing it")
            process.kill()
            await anyio.to_thread.run_sync(process.wait)


def child_main(fd: int, preload_cuda: bool = False) -> int:
    """The engine process: read Start, load the model, serve commands until told to stop.
    Before Start it imports the builder (and, with `preload_cuda`, the CUDA libraries when the
    cuda extra and a GPU are there: on a thread, beside the builder's import), while the API
    process does its own imports (engine_spawn.py)."""
    # The API process decides when the engine stops: Ctrl-C in a terminal (and a service
    # manager's SIGTERM to the whole group) reaches this process too, and the engine must keep
    # stepping while the API drains its requests. It exits on Shutdown, or on EOF when the API
    # process is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    sock = socket.socket(fileno=fd)
    preload = start_cuda_preload() if preload_cuda else None
    from atlas.app.builder import build_engine

    if preload is not None:
        preload.join()
        from atlas.adapters import cuda

        if cuda.available():
            from atlas.adapters.cuda import backend  # noqa: F401 - the libraries' import, before Start
    frames = FrameBuffer()
    decoder = msgspec.msgpack.Decoder(ToEngine)
    encode = msgspec.msgpack.Encoder().encode
    start: Start | None = None
    while start is None:
        data = sock.recv(_RECEIVE_BYTES)
        if not data:
            return 0
        for body in frames.feed(data):
            message = decoder.decode(body)
            if isinstance(message, Start):
                start = message
    report_phase("engine process", time.perf_counter() - _STARTED_S, "interpreter, imports, settings")
    started = time.perf_counter()
    try:
        engine = build_engine(start.settings, show_progress=True, defer_graphs=True)
    except (ValueError, MemoryError) as error:
        sock.sendall(frame(encode(LoadFailed(str(error), True))))
        return 2
    except Exception as error:
        traceback.print_exc()
        sock.sendall(frame(encode(LoadFailed(f"{type(error).__name__}: {error}", False))))
        return 1
    report_phase("engine ready", time.perf_counter() - started, "the model built")
    freeze_startup_objects()
    try:
        sock.sendall(frame(encode(Ready(str(engine.model_dir), engine.max_model_len, engine.config.vocab_size,
                                        engine.core.stats()))))
        loop = EngineLoop(engine.core, sock, frames, engine.idle_work)
        engine.watch(loop.fail)
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the API process went away
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1]), PRELOAD_CUDA_FLAG in sys.argv[2:]))

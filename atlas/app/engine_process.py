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

import logging
import math
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence

import anyio
import anyio.abc
import msgspec
from anyio.abc import ObjectReceiveStream

from atlas.app.engine_actor import (
    DEFAULT_STALL_TIMEOUT_S,
    AbortRequest,
    AddRequest,
    Command,
    OutputRouter,
    Shutdown,
)
from atlas.domain.engine_events import EngineFailure, EngineHealth, StreamItem
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
        while True:
            idle = not core.has_unfinished
            commands = self._receive(block=idle and not self._has_idle_work)
            if commands is None:
                return
            if idle and not commands and self._has_idle_work:
                try:
                    self._has_idle_work = self._idle_work()  # nothing in flight: e.g. a deferred graph
                except Exception as error:
                    self.send(Crashed(f"{type(error).__name__}: {error}"))
                    raise
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

    def _apply(self, command: Command, failures: list[RequestFailure]) -> None:
        if isinstance(command, AbortRequest):
            self._core.abort(command.request_id)
            return
        request = command.request
        try:
            self._core.add_request(request)
        except ParameterError as error:
            failures.append(RequestFailure(request.request_id, EngineFailure(str(error), True, error.field)))

    def _receive(self, block: bool) -> list[Command] | None:
        """Commands that have arrived (waiting for at least one frame when `block`); None at EOF."""
        commands: list[Command] = []
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


class EngineProcess:
    """The API side: `EngineClient` over the socket, plus spawning and stopping the process.

    `start()` spawns the process and waits for the model to load (raising ValueError with the
    engine's message when loading fails); `run()` then pumps frames both ways until `shutdown()`
    (returns) or the engine dies (fails every open request, raises EngineStopped).
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
        self._outbox_send, self._outbox = anyio.create_memory_object_stream[Command](math.inf)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._frames = FrameBuffer()
        self._process: subprocess.Popen | None = None
        self._stream: anyio.abc.SocketStream | None = None
        self._stats: EngineStats | None = None
        self._ready: Ready | None = None
        self._failed: str | None = None
        self._stopping = False
        self._last_progress_s = clock()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> Ready:
        spawned = take_early() or spawn_engine()  # `atlas serve` may have spawned it before its imports
        self._process = spawned.process
        self._stream = await anyio.abc.SocketStream.from_socket(spawned.sock)
        await self._stream.send(frame(self._encode(Start(self._settings))))
        while self._ready is None:
            for message in await self._receive_messages():
                if isinstance(message, LoadFailed):
                    await self.close()
                    raise (ValueError if message.is_user_error else RuntimeError)(message.message)
                if isinstance(message, Ready):
                    self._ready, self._stats = message, message.stats
        self._last_progress_s = self._clock()
        return self._ready

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._write_commands)
                await self._read_outputs()
                group.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            stopped = group.subgroup(EngineStopped)
            if stopped is None:
                raise
            raise stopped.exceptions[0] from None
        finally:
            await self.close()

    def shutdown(self) -> None:
        self._stopping = True
        self._outbox_send.send_nowait(Shutdown())

    # -- EngineClient -------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> ObjectReceiveStream[StreamItem]:
        if self._failed is not None:
            send, receive = anyio.create_memory_object_stream[StreamItem](1)
            send.send_nowait(EngineFailure(f"the engine stopped: {self._failed}"))
            send.close()
            return receive
        if not len(self._router):
            self._last_progress_s = self._clock()  # idle until now: the stall clock starts here
        receive = self._router.open([request.request_id for request in requests])
        for request in requests:
            self._outbox_send.send_nowait(AddRequest(request))
        return receive

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in self._router.close(request_ids):
            self._outbox_send.send_nowait(AbortRequest(request_id))

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

    # -- pumps --------------------------------------------------------------------------
    async def _write_commands(self) -> None:
        while True:
            commands = [await self._outbox.receive()]
            while True:
                try:
                    commands.append(self._outbox.receive_nowait())
                except anyio.WouldBlock:
                    break
            await self._stream.send(frame(self._encode(Commands(commands))))

    async def _read_outputs(self) -> None:
        try:
            while True:
                for message in await self._receive_messages():
                    if isinstance(message, StepOutputs):
                        self._apply(message)
                    elif isinstance(message, Crashed):
                        raise EngineStopped(message.message)
        except anyio.EndOfStream:
            if self._stopping:
                self._router.fail_all("the server is shutting down")
                return
            self._fail("the engine process exited unexpectedly")
            raise EngineStopped(self._failed) from None
        except (EngineStopped, OSError, anyio.BrokenResourceError) as error:
            self._fail(str(error))
            raise EngineStopped(self._failed) from None

    def _apply(self, message: StepOutputs) -> None:
        self._stats = message.stats
        self._last_progress_s = self._clock()
        for failure in message.failures:
            self.abort(self._router.fail(failure.request_id, failure.failure))
        orphans = self._router.deliver(message.outputs)
        for orphan in orphans:
            self._outbox_send.send_nowait(AbortRequest(orphan))

    async def _receive_messages(self) -> list[FromEngine]:
        while True:
            bodies = self._frames.feed(await self._stream.receive(_RECEIVE_BYTES))
            if bodies:
                return [self._decoder.decode(body) for body in bodies]

    def _fail(self, message: str) -> None:
        self._failed = message
        self._router.fail_all(message)

    async def close(self) -> None:
        """Close the socket and wait for the process to exit (killing it after a grace period)."""
        if self._stream is not None:
            await self._stream.aclose()
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

"""The driver's side: spawn the rank processes, broadcast steps, notice failures, stop them all."""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec

from atlas.adapters.comm.mock import name_ranks
from atlas.app.engine_protocol import FrameBuffer, frame
from atlas.app.ranks.wire import FromRank, RankFactory, RankFailed, RankReady, StartRank, Step, StepDone, Stop

log = logging.getLogger("atlas.ranks")

_RECEIVE_BYTES = 1 << 20
_STOP_GRACE_S = 10.0  # a rank's close may be collective (NCCL's destroy)


class RankFailure(RuntimeError):
    """A rank failed, died or stopped answering; `rank` is the one at fault (the dead or
    failing one, or the peer its communicator named; None when several fell silent at once)."""

    def __init__(self, rank: int | None, message: str, is_user_error: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.is_user_error = is_user_error


class RankGroup:
    """The driver's side: `world_size` rank processes running `factory`'s workers.

    `start()` spawns them, waits until each has loaded (raising RankFailure; with
    is_user_error for a ValueError/MemoryError of the factory) and returns each rank's
    `loaded()` bytes; `step(body)` sends one message to every rank and returns each rank's reply
    in rank order (`submit` + `collect` for a step left in flight; `send` for a message whose
    reply is not wanted); `close()` stops them all and leaves no process behind.
    `step_timeout_s` (None: no limit) bounds a step, for ranks that hang without dying.
    """

    def __init__(
        self,
        world_size: int,
        factory: RankFactory,
        comm_id: bytes,
        devices: Sequence[int] | None = None,
        environment: Mapping[str, str] | None = None,
        step_timeout_s: float | None = None,
        on_failure: Callable[[RankFailure], None] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1 (got {world_size})")
        self._world_size = world_size
        self._factory = pickle.dumps(factory)
        self._comm_id = comm_id
        self._devices = list(devices) if devices is not None else list(range(world_size))
        if len(self._devices) != world_size:
            raise ValueError(f"{len(self._devices)} devices for {world_size} ranks")
        self._environment = dict(environment or {})
        self._step_timeout_s = step_timeout_s
        self._on_failure = on_failure
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(FromRank)
        self._processes: list[subprocess.Popen] = []
        self._sockets: list[socket.socket] = []
        self._frames: list[FrameBuffer] = []
        self._process_group: int | None = None
        self._lock = threading.Lock()
        self._failure: RankFailure | None = None
        self._stopping = False
        self._in_flight = False

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    @property
    def failure(self) -> RankFailure | None:
        return self._failure

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> list[bytes]:
        environment = _rank_environment(self._environment)
        for rank in range(self._world_size):
            try:
                self._spawn(rank, environment)
                start = StartRank(rank, self._world_size, self._devices[rank], self._comm_id, self._factory,
                                  list(sys.path))
                self._sockets[rank].sendall(frame(self._encode(start)))
            except OSError as error:  # an earlier rank died (its group is gone), or fork failed
                self.check()
                self._fail(rank, f"rank {rank} could not be started: {error}")
        return [ready.body for ready in self._await_replies(RankReady, "load", None)]

    def _spawn(self, rank: int, environment: dict[str, str]) -> None:
        parent, child = socket.socketpair()
        command = [sys.executable, "-m", "atlas.app.ranks", str(child.fileno())]
        process = subprocess.Popen(
            command,
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=environment,
            process_group=self._process_group or 0,  # every rank in the first one's group
        )
        child.close()
        if self._process_group is None:
            self._process_group = process.pid
        self._processes.append(process)
        self._sockets.append(parent)
        self._frames.append(FrameBuffer())
        threading.Thread(target=self._watch, args=(rank, process), name=f"rank-{rank}-watch", daemon=True).start()

    def close(self) -> None:
        """Stop every rank: Stop, a grace period to exit, then SIGKILL to the whole group."""
        with self._lock:
            self._stopping = True
        for sock in self._sockets:
            try:
                sock.sendall(frame(self._encode(Stop())))
            except OSError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not stop; killing the group", process.pid)
        self._kill_group()
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> RankGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------------------
    def step(self, body: bytes) -> list[bytes]:
        self.submit(body)
        return self.collect()

    def submit(self, body: bytes) -> None:
        """Send `body` to every rank (one encoding, the same bytes to each); `collect` waits
        for their replies."""
        if self._in_flight:
            raise RuntimeError("submit: the previous step has not been collected")
        self._broadcast(Step(body))
        self._in_flight = True

    def send(self, body: bytes) -> None:
        """Send `body` to every rank without waiting for a reply (a rank that fails on it is
        reported by the next `collect` or `check`)."""
        self._broadcast(Step(body, reply=False))

    def watch(self, on_failure: Callable[[RankFailure], None]) -> None:
        """Call `on_failure` (from the thread that notices: a rank's watcher, or a waiting
        caller) once the group fails; at once if it already has."""
        with self._lock:
            self._on_failure = on_failure
            failure = self._failure
        if failure is not None:
            on_failure(failure)

    def _broadcast(self, step: Step) -> None:
        self.check()
        message = frame(self._encode(step))
        for rank, sock in enumerate(self._sockets):
            try:
                sock.sendall(message)
            except OSError:
                self._fail(rank, f"rank {rank} is gone (its socket closed)")

    def collect(self) -> list[bytes]:
        """Every rank's reply to the step in flight, in rank order; RankFailure otherwise."""
        if not self._in_flight:
            raise RuntimeError("collect: no step in flight")
        self._in_flight = False
        replies = self._await_replies(StepDone, "step", self._step_timeout_s)
        return [reply.body for reply in replies]

    def check(self) -> None:
        """Raise the group's RankFailure if a rank has failed (e.g. died while idle)."""
        if self._failure is not None:
            raise self._failure

    # -- waiting on ranks --------------------------------------------------------------------
    def _await_replies(self, kind: type, what: str, timeout_s: float | None) -> list:
        """One `kind` message from every rank; any other outcome fails the group."""
        replies: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for rank, sock in enumerate(self._sockets):
                selector.register(sock, selectors.EVENT_READ, rank)
            while len(replies) < self._world_size:
                self.check()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    silent = [rank for rank in range(self._world_size) if rank not in replies]
                    self._fail(silent[0] if len(silent) == 1 else None,
                               f"{name_ranks(silent)} did not finish the {what} within {timeout_s:g} s")
                for key, _ in selector.select(remaining):
                    rank = key.data
                    for message in self._read(rank):
                        if isinstance(message, RankFailed):
                            culprit = rank if message.culprit is None else message.culprit
                            self._fail(culprit, f"rank {rank}: {message.message}", message.is_user_error)
                        if not isinstance(message, kind) or rank in replies:
                            self._fail(rank, f"rank {rank} answered the {what} with {type(message).__name__}")
                        replies[rank] = message
                        selector.unregister(self._sockets[rank])
        return [replies[rank] for rank in range(self._world_size)]

    def _read(self, rank: int) -> list[FromRank]:
        try:
            data = self._sockets[rank].recv(_RECEIVE_BYTES)
        except OSError:
            data = b""
        if not data:
            self.check()  # the watcher may already know why
            self._fail(rank, f"rank {rank} closed its connection ({_exit_status(self._processes[rank])})")
        return [self._decoder.decode(body) for body in self._frames[rank].feed(data)]

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        returncode = process.wait()
        with self._lock:
            if self._stopping or self._failure is not None:
                return
        try:
            self._fail(rank, f"rank {rank} {_describe_exit(returncode)}")
        except RankFailure:
            pass

    def _fail(self, rank: int | None, message: str, is_user_error: bool = False) -> None:
        """Record the first failure, kill the group, wake any waiting reader; always raises."""
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = RankFailure(rank, message, is_user_error)
                self._stopping = True
        if first:
            log.error("%s; stopping every rank", message)
            self._kill_group()
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                on_failure = self._on_failure
            if on_failure is not None:
                on_failure(self._failure)
        raise self._failure

    def _kill_group(self) -> None:
        if self._process_group is not None:
            try:
                os.killpg(self._process_group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # every member has exited already
        for process in self._processes:
            process.wait()


def _rank_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: the driver's, `extra`, NVLink multicast (NVLS) off in NCCL
    (multicast objects are not used on these hosts), and `atlas` importable from its folder."""
    import atlas

    root = str(Path(atlas.__file__).resolve().parent.parent)
    environment = {**os.environ, **extra, "NCCL_NVLS_ENABLE": "0"}
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    return environment


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _exit_status(process: subprocess.Popen) -> str:
    try:
        returncode = process.wait(0.5)
    except subprocess.TimeoutExpired:
        return "still running"
    return _describe_exit(returncode)

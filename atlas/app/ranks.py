"""Rank processes: one worker process per device, driven by the engine core.

The driver (the engine core) spawns `python -m atlas.app.ranks FD` once per rank, all in one
process group, each with one end of a socket pair, and talks to them in the frames of
`engine_protocol` (4-byte length + msgpack):

    driver -> rank:  StartRank(rank, world, device, comm id, worker factory)   once
                     Step(body)     every step: one message, encoded once, the same bytes to all
                     Stop
    rank -> driver:  RankReady | RankFailed(message, is_user_error, culprit)   after loading
                     StepDone(body) | RankFailed(...)                           after each step

What a rank does is a plug-in: `factory(RankContext) -> RankWorker` runs once in the rank
(load weights, build its device, join the communicator whose id the driver made) and
`worker.step(body) -> bytes` runs each step; the factory travels pickled (a top-level function
or a `functools.partial` of one), importable in the rank because the rank takes the driver's
`sys.path`.

Health. A rank that raises reports it and waits to be stopped, so its message is never lost;
a rank that dies is seen by a watcher thread at once. Either way the driver kills the whole
group (SIGKILL to the process group, which takes anything the ranks started too), calls
`on_failure`, and raises `RankFailure` naming the rank at fault from `start`, `collect` and
`check` from then on. No wait of the driver outlives a dead rank. Ranks die with the driver
too (Linux's parent-death signal, bound to the thread that called `start`, so call it from a
thread that lives as long as the group), and a rank whose driver closes its socket exits.
"""

from __future__ import annotations

import ctypes
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
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from atlas.adapters.comm.mock import name_ranks
from atlas.app.engine_protocol import FrameBuffer, frame
from atlas.ports.comm import CommError

log = logging.getLogger("atlas.ranks")

_RECEIVE_BYTES = 1 << 20
_STOP_GRACE_S = 10.0  # a rank's close may be collective (NCCL's destroy)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank's factory is told: who it is, which device is its, and the communicator
    id to join (from the driver's `new_comm_id`: NCCL's unique id, or the mock's address)."""

    rank: int
    world_size: int
    device_ordinal: int
    comm_id: bytes


class RankWorker(Protocol):
    def step(self, body: bytes) -> bytes:
        """Run one step given the driver's message; the reply goes back to the driver."""
        ...

    def close(self) -> None:
        """Release the device and the communicator (the driver is stopping the group)."""
        ...


RankFactory = Callable[[RankContext], RankWorker]


# -- the wire ---------------------------------------------------------------------------------


class StartRank(msgspec.Struct, tag=True):
    rank: int
    world_size: int
    device_ordinal: int
    comm_id: bytes
    factory: bytes  # pickled RankFactory
    sys_path: list[str]


class Step(msgspec.Struct, tag=True):
    body: bytes


class Stop(msgspec.Struct, tag=True):
    pass


class RankReady(msgspec.Struct, tag=True):
    pass


class StepDone(msgspec.Struct, tag=True):
    body: bytes


class RankFailed(msgspec.Struct, tag=True):
    message: str
    is_user_error: bool  # a ValueError/MemoryError at load that names the fix
    culprit: int | None  # the peer a CommError named, if any


ToRank = StartRank | Step | Stop
FromRank = RankReady | StepDone | RankFailed


class RankFailure(RuntimeError):
    """A rank failed, died or stopped answering; `rank` is the one at fault (the dead or
    failing one, or the peer its communicator named; None when several fell silent at once)."""

    def __init__(self, rank: int | None, message: str, is_user_error: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.is_user_error = is_user_error


# -- the driver -------------------------------------------------------------------------------


class RankGroup:
    """The driver's side: `world_size` rank processes running `factory`'s workers.

    `start()` spawns them and waits until each has loaded (raising RankFailure; with
    is_user_error for a ValueError/MemoryError of the factory); `step(body)` sends one message
    to every rank and returns each rank's reply in rank order (`submit` + `collect` for a step
    left in flight); `close()` stops them all and leaves no process behind.
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
    def start(self) -> None:
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
        self._await_replies(RankReady, "load", None)

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
        """Send `body` to every rank (one encoding, the same bytes to each)."""
        self.check()
        if self._in_flight:
            raise RuntimeError("submit: the previous step has not been collected")
        message = frame(self._encode(Step(body)))
        for rank, sock in enumerate(self._sockets):
            try:
                sock.sendall(message)
            except OSError:
                self._fail(rank, f"rank {rank} is gone (its socket closed)")
        self._in_flight = True

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
            if self._on_failure is not None:
                self._on_failure(self._failure)
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


# -- the rank ---------------------------------------------------------------------------------


class _DriverLink:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._frames = FrameBuffer()
        self._pending: list[bytes] = []
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(ToRank)

    def receive(self) -> ToRank | None:
        """The next message from the driver; None once it has closed the connection."""
        while not self._pending:
            try:
                data = self._sock.recv(_RECEIVE_BYTES)
            except OSError:
                return None
            if not data:
                return None
            self._pending.extend(self._frames.feed(data))
        return self._decoder.decode(self._pending.pop(0))

    def send(self, message: FromRank) -> None:
        self._sock.sendall(frame(self._encode(message)))

    def fail_and_wait(self, message: str, is_user_error: bool, culprit: int | None) -> None:
        """Report a failure, then wait for the driver to stop the group, so the report is read
        before this process's exit is noticed."""
        try:
            self.send(RankFailed(message, is_user_error, culprit))
            while self.receive() is not None:
                pass
        except OSError:
            pass


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that spawned it exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the driver died before the request took effect
        os._exit(1)


def child_main(fd: int) -> int:
    """A rank: read StartRank, build the worker, run steps until Stop or the driver goes."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    link = _DriverLink(socket.socket(fileno=fd))
    start = link.receive()
    if not isinstance(start, StartRank):
        return 0
    sys.path[:0] = [entry for entry in start.sys_path if entry not in sys.path]
    context = RankContext(start.rank, start.world_size, start.device_ordinal, start.comm_id)
    try:
        worker: RankWorker = pickle.loads(start.factory)(context)
    except (ValueError, MemoryError) as error:
        link.fail_and_wait(str(error), True, None)
        return 2
    except Exception as error:
        traceback.print_exc()
        link.fail_and_wait(f"{type(error).__name__}: {error}", False, _culprit(error))
        return 1
    try:
        link.send(RankReady())
        while True:
            message = link.receive()
            if message is None or isinstance(message, Stop):
                return 0
            if isinstance(message, Step):
                try:
                    reply = worker.step(message.body)
                except Exception as error:
                    traceback.print_exc()
                    link.fail_and_wait(f"{type(error).__name__}: {error}", False, _culprit(error))
                    return 1
                link.send(StepDone(reply))
    except OSError:
        return 0  # the driver went away
    finally:
        worker.close()


def _culprit(error: BaseException) -> int | None:
    return error.rank if isinstance(error, CommError) else None


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))

"""A rank process: `python -m atlas.app.ranks FD`, FD one end of the driver's socket pair."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import traceback

import msgspec

from atlas.app.engine_protocol import FrameBuffer, frame
from atlas.app.ranks.wire import (
    FromRank,
    RankContext,
    RankFailed,
    RankReady,
    RankWorker,
    StartRank,
    Step,
    StepDone,
    Stop,
    ToRank,
)
from atlas.ports.comm import CommError

_RECEIVE_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1


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
        link.send(RankReady(worker.loaded()))
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
                if message.reply:
                    link.send(StepDone(reply))
    except OSError:
        return 0  # the driver went away
    finally:
        worker.close()


def _culprit(error: BaseException) -> int | None:
    return error.rank if isinstance(error, CommError) else None


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))

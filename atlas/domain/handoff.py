"""A worker thread that the engine hands a job and its GIL in one go, through raw locks.

The mask fill of a constrained step (engine.py) is Python for a few microseconds and then
llguidance's native fill, which lets the GIL go. Started from the engine thread, the job must
reach that native part at once: otherwise it waits for the GIL until the engine thread next
blocks, hundreds of microseconds of Python later. `submit` therefore posts the job and blocks
until the thread has started it (the GIL passes to it), and the job's native part gives the GIL
back.

`post` hands over a job without waiting for it to start: for a job that blocks first (on the
device, where the GIL is let go) the thread takes the GIL only once it can run, and the poster
waits for the job's own signal instead (a `Handoff` the job completes part-way, `set_result`).

`concurrent.futures` does the same with more Python on both sides (a Future and a condition per
job, the queue's work item, an Event for the start): each of its waits and notifications is a
Python-level condition built on a fresh lock, where `_thread` locks are one C call each.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """The outcome of one job: `result` (its value, or its exception raised) and `exception`
    wait for it."""

    __slots__ = ("_done", "_finished", "_value", "_error")

    def __init__(self) -> None:
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self._finished = False
        self._value: T | None = None
        self._error: BaseException | None = None

    def set_result(self, value: T) -> None:
        """Complete the outcome with `value` (once; only its producer calls this)."""
        self._value = value
        self._done.release()

    def set_exception(self, error: BaseException) -> None:
        """Complete the outcome with `error`, raised by `result` (once)."""
        self._error = error
        self._done.release()

    def _wait(self) -> None:
        if not self._finished:
            self._done.acquire()
            self._finished = True

    def result(self) -> T:
        self._wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        self._wait()
        return self._error


class HandoffThread:
    """One daemon thread running one job at a time. Only one thread may submit."""

    def __init__(self, name: str) -> None:
        self._posted = _thread.allocate_lock()
        self._posted.acquire()
        self._started = _thread.allocate_lock()
        self._started.acquire()
        self._job: tuple[Callable[[], object], Handoff, bool] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], T]) -> Handoff[T]:
        """Run `job` on the thread; returns once the thread has started it."""
        outcome = self._post(job, True)
        self._started.acquire()  # blocks: the GIL goes to the thread, which starts the job
        return outcome

    def post(self, job: Callable[[], T]) -> Handoff[T]:
        """Run `job` on the thread once the job before it is done; returns at once. Each job
        must be submitted or posted only after the one before has started (its own signal)."""
        return self._post(job, False)

    def _post(self, job: Callable[[], T], announce_start: bool) -> Handoff[T]:
        if not self._thread.is_alive():
            raise RuntimeError("the handoff thread is closed")
        outcome: Handoff[T] = Handoff()
        self._job = (job, outcome, announce_start)
        self._posted.release()
        return outcome

    def close(self) -> None:
        """Stop the thread once its job (if any) is done; submitting afterwards raises."""
        if self._thread.is_alive():
            self._job = None
            self._posted.release()
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._posted.acquire()
            posted, self._job = self._job, None
            if posted is None:
                return
            job, outcome, announce_start = posted
            if announce_start:  # a submit waits for it; a post does not
                self._started.release()
            try:
                value = job()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the outcome
                outcome.set_exception(error)
            else:
                outcome.set_result(value)

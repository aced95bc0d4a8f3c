"""A `GrammarWorker` in a helper process: the grammar's Python beside the engine's, on another core.

One shared-memory segment carries everything; the engine posts one command at a time and the
helper answers in order. Words of the control block (int64):

    CMD     the engine's command count, bumped once a command's arguments are written
    ANSWER  the helper's: set to the command's count once its answer is written
    FILL    the helper's: set to the count of the command whose masks are written
    ASLEEP  1 while the helper sleeps on the wake-up semaphore (no command for ~1 ms)

    segment: [control 16 x i64][accept handles, tokens, fill handles: 3 x rows i32][forgets i32]
             [payload: pickled rare commands and answers][masks: rows x W i32]

A step's command (`accept_rows`) goes in the i32 arrays; the helper accepts, answers (the
verdict in two words), then fills the masks and bumps FILL. Rare commands (compile, admits,
advance, resample, a verify step's fill) are pickled into the payload. Handles the engine
forgot ride along with the next command, so a finished request costs no round trip.

Waits: the engine spins on ANSWER or FILL (no futex wake-up on its chain) for a few
milliseconds, then polls while watching the helper's process sentinel, so a dead helper raises
GrammarWorkerDied instead of hanging. The helper spins on CMD for ~1 ms after each command,
then sleeps on a semaphore the engine posts when it sees ASLEEP (a 20 ms timeout covers the
race between the two flags): an idle server burns no core. The words are plain stores, ordered
by x86's total store order (a store is seen after the stores before it).

The helper is started with `spawn` (the engine may hold CUDA state: never fork it) and builds
its own grammar compiler from a picklable factory; it exits when its parent does.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import pickle
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from atlas.domain.grammar_service import AcceptVerdict, GrammarService, GrammarWorkerDied, Violation
from atlas.domain.request_constraints import GrammarCache
from atlas.domain.requests import OutputConstraint
from atlas.ports.grammar import GrammarError

PAYLOAD_BYTES = 16 << 20  # a pickled compile command: the largest schema a request may carry
MAX_FORGETS = 4096
ENGINE_SPIN_S = 0.004  # the engine spins this long on an answer before it polls
HELPER_SPIN_S = 0.001  # the helper spins this long on CMD after a command before it sleeps
HELPER_SLEEP_S = 0.02
POLL_S = 0.0002
START_TIMEOUT_S = 120.0

(CMD, ANSWER, FILL, ASLEEP, CODE, NUM_ACCEPT, NUM_FILL, PAYLOAD_LEN, VERDICT, REFUSED_ROW, FILLED, NUM_FORGETS,
 READY, FILL_ERROR_LEN) = range(14)
NUM_WORDS = 16


class Code(IntEnum):
    ACCEPT = 1  # accept rows (i32 arrays), then fill when NUM_FILL >= 0
    FILL = 2  # fill rows (i32 array)
    PICKLED = 3  # a rare command in the payload
    CLOSE = 4


class Verdict(IntEnum):
    ACCEPTED = 0
    REFUSED = 1
    VIOLATION = 2  # the Violation pickled in the payload


class Filled(IntEnum):
    NONE = 0  # no row constrained
    MASKS = 1
    ERROR = 2  # the error's text in the fill's own region (FILL_ERROR_LEN bytes)


class Rare(IntEnum):
    ADD = 1
    ADMITS = 2
    ADVANCE = 3
    RESAMPLE = 4
    FILL_DRAFTS = 5


class _Layout:
    """Numpy views of the shared segment (same layout on both sides)."""

    def __init__(self, buffer: memoryview, max_rows: int, num_words: int) -> None:
        offset = 0

        def take(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal offset
            offset = (offset + 63) // 64 * 64
            array = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            offset += array.nbytes
            return array

        self.words = take(np.int64, (NUM_WORDS,))
        self.accept_handles = take(np.int32, (max_rows,))
        self.accept_tokens = take(np.int32, (max_rows,))
        self.fill_handles = take(np.int32, (max_rows,))
        self.forgets = take(np.int32, (MAX_FORGETS,))
        self.payload = take(np.uint8, (PAYLOAD_BYTES,))
        self.fill_error = take(np.uint8, (1 << 16,))
        self.masks = take(np.int32, (max_rows, num_words))


def _size(max_rows: int, num_words: int) -> int:
    """The segment's bytes for `_Layout`."""
    total = 0
    for nbytes in (NUM_WORDS * 8, max_rows * 4, max_rows * 4, max_rows * 4, MAX_FORGETS * 4, PAYLOAD_BYTES, 1 << 16,
                   max_rows * num_words * 4):
        total = (total + 63) // 64 * 64 + nbytes
    return total


def _write_bytes(region: np.ndarray, data: bytes) -> int:
    if len(data) > region.nbytes:
        raise ValueError(f"a grammar command of {len(data)} bytes exceeds the channel's {region.nbytes}")
    region[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return len(data)


class GrammarProcess:
    """The engine's side: a `GrammarWorker` whose service runs in a spawned helper process.

    `grammars` builds the helper's grammar cache there (picklable: a module-level function or a
    partial of one); `max_rows` bounds a step's mask rows; `num_words` is ceil(V / 32). The
    helper starts now and is waited for by the first command. Engine-thread only."""

    def __init__(self, grammars: Callable[[], GrammarCache | None], eos_token_ids: frozenset[int], max_rows: int,
                 num_words: int) -> None:
        self._max_rows = max_rows
        self._shm = SharedMemory(create=True, size=_size(max_rows, num_words))
        self._view = _Layout(self._shm.buf, max_rows, num_words)
        self._view.words[:] = 0
        context = multiprocessing.get_context("spawn")
        self._wake = context.Semaphore(0)
        self._process = context.Process(
            target=_serve, name="atlas-grammar",
            args=(self._shm.name, max_rows, num_words, grammars, eos_token_ids, self._wake), daemon=True)
        with _main_module_hidden():
            self._process.start()
        self._count = 0  # commands posted
        self._fill_count = 0  # the command whose masks `masks` returns
        self._fill_rows = 0
        self._forgets: list[int] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._shm, self._process)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- the GrammarWorker port ----------------------------------------------------------------

    def add(self, handle: int, constraint: OutputConstraint, loose: bool) -> bool:
        return self._rare(Rare.ADD, (handle, constraint, loose))

    def forget(self, handle: int) -> None:
        if not self._closed:
            self._forgets.append(handle)  # sent with the next command

    def accept_rows(self, handles: Sequence[int], token_ids: Sequence[int],
                    fill_handles: Sequence[int] | None) -> AcceptVerdict:
        view = self._begin()
        num = len(handles)
        self._check_rows(num)
        view.accept_handles[:num] = handles
        view.accept_tokens[:num] = token_ids
        words = view.words
        words[NUM_ACCEPT] = num
        if fill_handles is None:
            words[NUM_FILL] = -1
        else:
            self._check_rows(len(fill_handles))
            view.fill_handles[: len(fill_handles)] = fill_handles
            words[NUM_FILL] = len(fill_handles)
        count = self._post(Code.ACCEPT)
        self._wait(ANSWER, count)
        verdict = int(words[VERDICT])
        if verdict == Verdict.ACCEPTED:
            if fill_handles is not None:
                self._fill_count, self._fill_rows = count, len(fill_handles)
            return AcceptVerdict()
        if verdict == Verdict.REFUSED:
            return AcceptVerdict(refused_row=int(words[REFUSED_ROW]))
        return AcceptVerdict(violation=self._answer())

    def start_fill(self, fill_handles: Sequence[int]) -> None:
        view = self._begin()
        self._check_rows(len(fill_handles))
        view.fill_handles[: len(fill_handles)] = fill_handles
        view.words[NUM_FILL] = len(fill_handles)
        self._fill_count, self._fill_rows = self._post(Code.FILL), len(fill_handles)

    def start_fill_drafts(self, rows: Sequence[tuple[int, tuple[int, ...]]], num_rows: int) -> None:
        self._check_rows(num_rows)
        self._rare(Rare.FILL_DRAFTS, (tuple(rows), num_rows))
        self._fill_count, self._fill_rows = self._count, num_rows

    def masks(self) -> np.ndarray | None:
        if self._closed:
            raise GrammarWorkerDied("the grammar process was closed")
        self._wait(FILL, self._fill_count)
        view = self._view
        filled = int(view.words[FILLED])
        if filled == Filled.ERROR:
            length = int(view.words[FILL_ERROR_LEN])
            raise RuntimeError(f"the grammar process failed to fill a step's masks: "
                               f"{bytes(view.fill_error[:length]).decode(errors='replace')}")
        return view.masks[: self._fill_rows] if filled == Filled.MASKS else None

    def admits(self, handles: Sequence[int], token_ids: Sequence[int]) -> tuple[bool, ...]:
        return self._rare(Rare.ADMITS, (tuple(handles), tuple(token_ids)))

    def advance(self, rows: Sequence[tuple[int, tuple[int, ...], bool]]) -> tuple[Violation | None, ...]:
        return self._rare(Rare.ADVANCE, tuple(rows))

    def resample(self, handle: int) -> None:
        self._rare(Rare.RESAMPLE, handle)

    def close(self) -> None:
        """Stop the helper (joined; killed if it does not stop) and unlink the segment."""
        if self._closed:
            return
        self._closed = True
        if self._process.is_alive():
            try:
                self._wait(ANSWER, self._count, timeout_s=5.0)
                self._post(Code.CLOSE)
                self._process.join(2.0)
            except GrammarWorkerDied:
                pass
        self._finalizer()

    # -- the channel ---------------------------------------------------------------------------

    def _check_rows(self, num_rows: int) -> None:
        if num_rows > self._max_rows:
            raise ValueError(f"a step of {num_rows} mask rows; the grammar process holds {self._max_rows}")

    def _begin(self) -> _Layout:
        """The command slot once the helper has answered the last command."""
        if self._closed:
            raise GrammarWorkerDied("the grammar process was closed")
        self._wait(ANSWER, self._count)
        return self._view

    def _post(self, code: Code) -> int:
        words, forgets = self._view.words, self._forgets
        num_forgets = min(len(forgets), MAX_FORGETS)
        if num_forgets:
            self._view.forgets[:num_forgets] = forgets[:num_forgets]
            del forgets[:num_forgets]
        words[NUM_FORGETS] = num_forgets
        words[CODE] = code
        self._count += 1
        words[CMD] = self._count  # last: the helper reads the arguments after seeing it
        if words[ASLEEP]:
            self._wake.release()
        return self._count

    def _rare(self, command: Rare, args: object) -> Any:
        view = self._begin()
        view.words[PAYLOAD_LEN] = _write_bytes(view.payload, pickle.dumps((command, args), pickle.HIGHEST_PROTOCOL))
        count = self._post(Code.PICKLED)
        self._wait(ANSWER, count)
        ok, value = self._answer()
        if ok:
            return value
        kind, *details = value
        if kind == "grammar":
            raise GrammarError(*details)
        if kind == "value":
            raise ValueError(*details)
        raise RuntimeError(f"the grammar process failed: {details[0]}")

    def _answer(self) -> Any:
        view = self._view
        return pickle.loads(bytes(view.payload[: int(view.words[PAYLOAD_LEN])]))

    def _wait(self, word: int, count: int, timeout_s: float | None = None) -> None:
        """Until the helper's `word` reaches `count`: spin, then poll watching its sentinel.
        GrammarWorkerDied when it exits first (or `timeout_s` passes)."""
        words = self._view.words
        if words[word] >= count:
            return
        clock = time.perf_counter
        deadline = clock() + ENGINE_SPIN_S
        while words[word] < count:
            if clock() > deadline:
                break
        else:
            return
        sentinel = self._process.sentinel
        limit = clock() + (timeout_s if timeout_s is not None else START_TIMEOUT_S if not words[READY] else 1e9)
        while words[word] < count:
            if multiprocessing.connection.wait([sentinel], POLL_S):
                if words[word] >= count:
                    return
                self._closed = True
                self._finalizer()
                raise GrammarWorkerDied(f"the grammar process exited (code {self._process.exitcode})")
            if clock() > limit:
                self._closed = True
                self._finalizer()
                raise GrammarWorkerDied("the grammar process did not answer")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a process starts: `spawn` runs the parent's `__main__` again in the child before
    its target, so a script that builds an `atlas.LLM` at top level, without an `if __name__ ==
    "__main__"` guard, would load its model a second time in the helper (and fail there). The
    helper needs nothing from `__main__` (its target and arguments live in atlas' modules), so
    the main module's name and path are hidden from multiprocessing's preparation data while
    the child is started, and the child imports only what its target needs."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _release(shm: SharedMemory, process: multiprocessing.process.BaseProcess) -> None:
    """Kill the helper if it still runs and unlink the segment (once: from `close`, or when the
    engine side is collected or exits without it)."""
    if process.is_alive():
        process.kill()
    process.join(5.0)
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
    try:
        shm.close()
    except BufferError:  # the engine side's views are still alive: the mapping goes with them
        pass


# -- the helper process ----------------------------------------------------------------------


def _serve(name: str, max_rows: int, num_words: int, grammars: Callable[[], GrammarCache | None],
           eos_token_ids: frozenset[int], wake: Any) -> None:
    """The helper process: attach the segment, build the service, serve until CLOSE or the
    parent's end."""
    shm = SharedMemory(name=name)
    try:
        _loop(GrammarService(grammars(), eos_token_ids, num_words), _Layout(shm.buf, max_rows, num_words), wake)
    finally:
        try:
            shm.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass


def _loop(service: GrammarService, view: _Layout, wake: Any) -> None:
    """Wait for a command (spinning ~1 ms, then asleep on `wake`), run it, answer; returns on
    CLOSE or once the parent process is gone."""
    words = view.words
    parent = multiprocessing.parent_process()
    words[READY] = 1
    seen = 0
    clock = time.perf_counter
    while True:
        deadline = clock() + HELPER_SPIN_S
        while words[CMD] == seen:
            if clock() > deadline:
                words[ASLEEP] = 1
                if words[CMD] == seen:
                    wake.acquire(timeout=HELPER_SLEEP_S)
                words[ASLEEP] = 0
                if parent is not None and not parent.is_alive():
                    return
                deadline = clock() + HELPER_SPIN_S
        seen = int(words[CMD])
        for handle in view.forgets[: int(words[NUM_FORGETS])].tolist():
            service.forget(handle)
        code = int(words[CODE])
        if code == Code.CLOSE:
            words[ANSWER] = seen
            return
        if code == Code.ACCEPT:
            _accept(service, view, seen)
        elif code == Code.FILL:
            handles = view.fill_handles[: int(words[NUM_FILL])].tolist()
            words[ANSWER] = seen
            _fill(view, seen, functools.partial(service.fill, handles, view.masks[: len(handles)]))
        else:
            _rare(service, view, seen)


def _accept(service: GrammarService, view: _Layout, count: int) -> None:
    words = view.words
    num = int(words[NUM_ACCEPT])
    verdict = service.accept_rows(view.accept_handles[:num].tolist(), view.accept_tokens[:num].tolist())
    num_fill = int(words[NUM_FILL])
    handles = view.fill_handles[:num_fill].tolist() if num_fill >= 0 else None
    if verdict.violation is not None:
        words[VERDICT] = Verdict.VIOLATION
        words[PAYLOAD_LEN] = _write_bytes(view.payload, pickle.dumps(verdict.violation))
    elif verdict.refused_row is not None:
        words[VERDICT] = Verdict.REFUSED
        words[REFUSED_ROW] = verdict.refused_row
    else:
        words[VERDICT] = Verdict.ACCEPTED
    words[ANSWER] = count
    if verdict.all_accepted and handles is not None:
        _fill(view, count, functools.partial(service.fill, handles, view.masks[: len(handles)]))


def _fill(view: _Layout, count: int, fill: Callable[[], bool]) -> None:
    words = view.words
    try:
        words[FILLED] = Filled.MASKS if fill() else Filled.NONE
    except Exception:  # noqa: BLE001 - raised where the engine takes the masks
        words[FILL_ERROR_LEN] = _write_bytes(view.fill_error, traceback.format_exc()[-(1 << 15):].encode())
        words[FILLED] = Filled.ERROR
    words[FILL] = count


def _rare(service: GrammarService, view: _Layout, count: int) -> None:
    words = view.words
    command, args = pickle.loads(bytes(view.payload[: int(words[PAYLOAD_LEN])]))
    after: Callable[[], None] | None = None
    try:
        if command == Rare.ADD:
            value: object = service.add(*args)
        elif command == Rare.ADMITS:
            value = service.admits(*args)
        elif command == Rare.ADVANCE:
            value = service.advance(args)
        elif command == Rare.RESAMPLE:  # answered at once; the exact mask is computed after
            value = None
            after = functools.partial(service.resample, args)
        else:  # FILL_DRAFTS
            rows, num_rows = args
            value = None
            after = functools.partial(_fill, view, count,
                                      functools.partial(service.fill_drafts, rows, view.masks[:num_rows]))
        answer: tuple[bool, object] = (True, value)
    except GrammarError as error:
        answer = (False, ("grammar", error.field, str(error).removeprefix(f"{error.field}: ")))
    except ValueError as error:
        answer = (False, ("value", str(error)))
    except Exception as error:  # noqa: BLE001 - answered to the engine, which raises it
        answer = (False, ("other", f"{type(error).__name__}: {error}"))
    words[PAYLOAD_LEN] = _write_bytes(view.payload, pickle.dumps(answer, pickle.HIGHEST_PROTOCOL))
    words[ANSWER] = count
    if after is not None:
        after()

"""Choosing among cuBLASLt's algorithms by timing them: the winners' store and the timer.

cuBLASLt's heuristic ranks algorithms by a model; its first pick is often not the fastest on the
device at hand (8192^3 bf16 on an H200: 675-701 TFLOP/s first pick, ~790 for the best). The GEMM
wrapper (cublaslt.py) times its candidates once per shape and keeps the fastest. A winner also
serves every shape of the same token bucket (next power of two of N) and weight shape, so steps
of varying N do not re-time: a winner is the algorithm struct itself, reused where the new
shape's candidate list holds the same struct.

Winners are kept per process and, when a folder is given, in a JSON file named by device and
cuBLASLt version next to the kernel cache, so a restart (and a graph captured before any eager
call) starts with them. A stored winner that the heuristic no longer offers is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import check

log = logging.getLogger("atlas.cuda")

_TIMED_RUNS = 3
_EAGER_ENOUGH_S = 200e-6  # launch latency is a few percent of a run this long
_GRAPH_RUNS = 20


def token_bucket(num_tokens: int) -> int:
    """The power of two >= `num_tokens` (at least 16): shapes in one bucket share a winner."""
    bucket = 16
    while bucket < num_tokens:
        bucket *= 2
    return bucket


@dataclass(slots=True)
class TuningStats:
    """What choosing algorithms cost so far: shapes planned, shapes that took a stored winner,
    shapes whose candidates were timed and the seconds that took (the startup log's)."""

    num_plans: int = 0
    num_stored: int = 0
    num_timed: int = 0
    timing_s: float = 0.0
    num_heuristics: int = 0  # shapes that queried the heuristic (a bucket's first, or refused)
    num_derived: int = 0  # shapes that reused their token bucket's chosen algorithm

    @staticmethod
    def describe(stats: Iterable[TuningStats]) -> str:
        """One line over several GEMM wrappers' stats ("" when none planned a shape)."""
        total = TuningStats()
        for part in stats:
            total.num_plans += part.num_plans
            total.num_stored += part.num_stored
            total.num_timed += part.num_timed
            total.timing_s += part.timing_s
            total.num_heuristics += part.num_heuristics
            total.num_derived += part.num_derived
        if not total.num_plans:
            return ""
        return (f"cuBLASLt {total.num_plans} shapes: {total.num_timed} timed in {total.timing_s:.2f} s, "
                f"{total.num_stored} from stored winners, {total.num_derived} from their bucket's first")


class GemmTuningStore:
    """Winning algorithm structs (raw bytes) by (bucket, M, K, dtypes, bias) key.

    `path` None keeps them in memory only. A file that cannot be read or written is logged
    once and otherwise ignored: tuning is an optimisation, never a failure.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._winners: dict[str, bytes] = {}
        if path is not None:
            self._load(path)

    @staticmethod
    def file_for(folder: Path, device_name: str, library_version: int) -> Path:
        """The store's file in `folder` for one device model and cuBLASLt version."""
        slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "gpu"
        return folder / f"cublaslt-{slug}-{library_version}.json"

    def get(self, key: str) -> bytes | None:
        return self._winners.get(key)

    def put(self, key: str, algorithm: bytes) -> None:
        """Record a winner and rewrite the file (atomically: temporary name, then rename)."""
        self.put_many({key: algorithm})

    def put_many(self, entries: dict[str, bytes]) -> None:
        """Record several entries (winners, or a warm-up's markers: empty bytes) and rewrite
        the file once."""
        self._winners.update(entries)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                json.dump({k: v.hex() for k, v in sorted(self._winners.items())}, file, indent=0)
            os.replace(temporary, self.path)
        except OSError as error:
            log.warning("cuBLASLt tuning: cannot write %s (%s); winners stay in memory", self.path, error)
            self.path = None

    def _load(self, path: Path) -> None:
        try:
            stored = json.loads(path.read_text())
            self._winners = {str(k): bytes.fromhex(v) for k, v in stored.items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as error:
            log.warning("cuBLASLt tuning: ignoring unreadable %s (%s)", path, error)


class CandidateTimer:
    """Device time of enqueued work on one stream, by events (synchronises the stream).

    A run shorter than `_EAGER_ENOUGH_S` is timed as a graph of `_GRAPH_RUNS` back-to-back runs:
    launched one by one from Python, a few-microsecond GEMM would be timed together with the host's
    enqueue latency, which then decides the race (seen: a 17 us algorithm chosen over an 8 us one).
    """

    def __init__(self, stream_handle: int) -> None:
        self._stream = stream_handle
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        self._start = check("cuEventCreate", cu.cuEventCreate(flags))
        self._stop = check("cuEventCreate", cu.cuEventCreate(flags))
        self._evict_time: float | None = None

    def seconds(self, run: Callable[[], None], evict: Callable[[], None] | None = None) -> float:
        """Median seconds of one `run` after a warm-up; `run` must only enqueue work. `evict`
        (enqueue-only too) runs before every timed `run` and its own time is taken out: the L2
        eviction of a product whose weight would otherwise stay in the L2 from run to run."""
        run()
        single = self._elapsed(run, evict)
        if single >= _EAGER_ENOUGH_S:
            return statistics.median([single] + [self._elapsed(run, evict) for _ in range(_TIMED_RUNS - 1)])
        if evict is None:
            return self._graph_seconds(run)

        def evicted_run() -> None:
            evict()
            run()

        return max(self._graph_seconds(evicted_run) - self._evict_seconds(evict), 0.0)

    def _evict_seconds(self, evict: Callable[[], None]) -> float:
        """`evict`'s own time in the graphs `seconds` times (measured once a timer)."""
        if self._evict_time is None:
            self._evict_time = self._graph_seconds(evict)
        return self._evict_time

    def _graph_seconds(self, run: Callable[[], None]) -> float:
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        check("cuStreamBeginCapture", cu.cuStreamBeginCapture(self._stream, mode))
        try:
            for _ in range(_GRAPH_RUNS):
                run()
        finally:  # end the capture even when a run fails, so the stream stays usable
            graph = check("cuStreamEndCapture", cu.cuStreamEndCapture(self._stream))
        try:
            executable = check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))
            try:

                def replay() -> None:
                    check("cuGraphLaunch", cu.cuGraphLaunch(executable, self._stream))

                replay()
                samples = [self._elapsed(replay) for _ in range(_TIMED_RUNS)]
            finally:
                cu.cuGraphExecDestroy(executable)
        finally:
            cu.cuGraphDestroy(graph)
        return statistics.median(samples) / _GRAPH_RUNS

    def _elapsed(self, run: Callable[[], None], evict: Callable[[], None] | None = None) -> float:
        if evict is not None:
            evict()
        check("cuEventRecord", cu.cuEventRecord(self._start, self._stream))
        run()
        check("cuEventRecord", cu.cuEventRecord(self._stop, self._stream))
        check("cuEventSynchronize", cu.cuEventSynchronize(self._stop))
        return check("cuEventElapsedTime", cu.cuEventElapsedTime(self._start, self._stop)) * 1e-3

    def close(self) -> None:
        for event in (self._start, self._stop):
            cu.cuEventDestroy(event)

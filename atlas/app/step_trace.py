"""An opt-in trace of the engine process's steps, to see where serving time goes.

`ATLAS_STEP_TRACE=FILE` makes the engine process append one JSON line per step to FILE: when
the step call began (seconds since the trace opened), how long it took (the call enqueues a
step and commits the one before, so on a GPU it waits for the device), the commands applied
before it, and the batch it enqueued (sequences, tokens, decodes, prefill tokens), then the
outputs it committed and the queue lengths. Gaps between one step's end and the next one's
start are the engine process's idle time or its command handling. Off unless set: a line per
step costs a few microseconds.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO

from atlas.domain.engine import EngineCore

TRACE_ENVIRONMENT = "ATLAS_STEP_TRACE"
_FLUSH_EVERY = 256


class StepTrace:
    """Records `core.step()` calls; `close` writes what is left."""

    def __init__(self, core: EngineCore, file: IO[str]) -> None:
        self._core = core
        self._file = file
        self._origin = time.perf_counter()
        self._lines: list[str] = []

    @classmethod
    def from_environment(cls, core: EngineCore) -> StepTrace | None:
        path = os.environ.get(TRACE_ENVIRONMENT)
        return cls(core, open(path, "a", encoding="utf-8")) if path else None

    def step(self, num_commands: int):
        core = self._core
        start = time.perf_counter()
        outputs = core.step()
        end = time.perf_counter()
        batch = core.newest_batch
        sequences = batch.sequences if batch is not None else ()
        decodes = sum(1 for s in sequences if s.start_position > 0 and len(s.token_ids) == 1 + s.num_draft_tokens)
        tokens = sum(len(s.token_ids) for s in sequences)
        stats = core.scheduler
        self._lines.append(json.dumps({
            "t": round(start - self._origin, 6), "dt": round(end - start, 6), "commands": num_commands,
            "seqs": len(sequences), "tokens": tokens, "decodes": decodes,
            "outputs": len(outputs), "running": stats.num_running, "waiting": stats.num_waiting,
        }))
        if len(self._lines) >= _FLUSH_EVERY:
            self.flush()
        return outputs

    def flush(self) -> None:
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()

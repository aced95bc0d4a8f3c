"""What a process that serves one engine until it exits does once the engine is built."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now (the model, its weights' handles, the engine) out of the
    cyclic collector's reach: a full collection otherwise walks them all, 18-49 ms seen at
    batch 64 (docs/lab/host-gap.md), stalling ~15 device steps of a small model. Garbage made
    later is collected as usual; the frozen objects are freed by reference counting only. For
    the engine process and `atlas bench`, not for processes that build engine after engine
    (tests, `atlas.LLM` in a notebook), whose cycles would then never be collected."""
    gc.collect()
    gc.freeze()

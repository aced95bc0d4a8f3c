"""Benchmarks are commands that print figures (never timed tests).

Each benchmark loads lazily, so the CLI (which registers `bench serve`'s flags at start-up)
does not import numpy and the engine just to parse arguments.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_decode_bench"]


def __getattr__(name: str) -> Any:
    if name == "run_decode_bench":
        from atlas.app.bench.decode import run_decode_bench

        return run_decode_bench
    raise AttributeError(f"module 'atlas.app.bench' has no attribute {name!r}")

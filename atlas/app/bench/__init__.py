"""Benchmarks are commands that print figures (never timed tests)."""

from atlas.app.bench.decode import run_decode_bench

__all__ = ["run_decode_bench"]

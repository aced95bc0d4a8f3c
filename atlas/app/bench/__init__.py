"""Benchmarks are commands that print figures (never timed tests).

Modules load lazily: the CLI registers the benchmarks' flags at start-up without importing
numpy or the engine.
"""

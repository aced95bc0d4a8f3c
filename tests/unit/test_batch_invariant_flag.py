"""`--batch-invariant` reaches the engine's settings (the CUDA backend acts on it; its bitwise
checks are tests/gpu/test_cuda_batch_invariant.py), and the mock builds with it unchanged."""

from __future__ import annotations

import argparse

from atlas.app.arguments import add_engine_arguments, engine_settings
from atlas.app.backends import make_backend


def _settings(*argv: str):
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_arguments(parser)
    return engine_settings(parser.parse_args(["some-model", *argv]))


def test_the_flag_is_off_by_default_and_on_when_given(monkeypatch) -> None:
    monkeypatch.delenv("ATLAS_BATCH_INVARIANT", raising=False)
    assert _settings().batch_invariant is False
    assert _settings("--batch-invariant").batch_invariant is True


def test_the_environment_turns_it_on_as_it_does_every_engine_flag(monkeypatch) -> None:
    monkeypatch.setenv("ATLAS_BATCH_INVARIANT", "1")
    assert _settings().batch_invariant is True


def test_the_mock_backend_takes_the_flag() -> None:
    backend = make_backend("mock", "llama", "auto", batch_invariant=True)
    assert backend.name == "mock"

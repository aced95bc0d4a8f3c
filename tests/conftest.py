"""Shared fixtures. `tests/` is on sys.path, so tests import `fakes` and `helpers` directly."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)

"""Fakes implementing the ports, for tests that need no files."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


class DictWeights:
    """A `WeightSource` over an in-memory {name: array} mapping."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self._tensors = dict(tensors)

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        return self._tensors[name]

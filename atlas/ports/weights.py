"""The checkpoint port: tensors by name from a model folder."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np


class WeightError(ValueError):
    """A checkpoint that cannot be read: names the file and what is wrong with it."""


class WeightSource(Protocol):
    """Read-only access to the tensors of one checkpoint (Hugging Face names).

    Implementations map files lazily: `get` returns a host view (zero-copy where the format
    allows) and raises `WeightError` naming the file when it is corrupt or truncated, and
    `KeyError` naming the tensor when it is absent.
    """

    def names(self) -> Iterable[str]:
        """Every tensor name in the checkpoint."""
        ...

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 arrives as ml_dtypes.bfloat16)."""
        ...

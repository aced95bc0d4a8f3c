"""The collectives in numpy: what every rank receives, given every rank's input in rank order.

These functions define the reference sum of `atlas.ports.comm` (rank order, f32 accumulation
for floats, one rounding to the dtype; wrapping integers). The mock communicator computes its
results with them, and the GPU checks compare the custom all-reduce with them bit for bit.
"""

from __future__ import annotations

import numpy as np


def reference_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """The sum of `arrays` (one per rank, rank order) in their common dtype.

    Floats: accumulated in float32 in rank order, then rounded once (float32 stays exact
    IEEE single adds in that order). Integers: numpy's wrapping adds in the same dtype.
    """
    dtype = arrays[0].dtype
    if np.issubdtype(dtype, np.integer):
        total = arrays[0].copy()
        for array in arrays[1:]:
            total += array
        return total
    total = arrays[0].astype(np.float32)
    for array in arrays[1:]:
        total += array.astype(np.float32)
    return total.astype(dtype)


def all_reduce(inputs: list[np.ndarray]) -> list[np.ndarray]:
    total = reference_sum(inputs)
    return [total.copy() for _ in inputs]


def all_gather(inputs: list[np.ndarray]) -> list[np.ndarray]:
    gathered = np.concatenate(inputs, axis=0)
    return [gathered.copy() for _ in inputs]


def reduce_scatter(inputs: list[np.ndarray]) -> list[np.ndarray]:
    return [chunk.copy() for chunk in np.split(reference_sum(inputs), len(inputs), axis=0)]


def all_to_all(inputs: list[np.ndarray]) -> list[np.ndarray]:
    world_size = len(inputs)
    chunks = [np.split(array, world_size, axis=0) for array in inputs]  # chunks[sender][receiver]
    return [np.concatenate([chunks[sender][receiver] for sender in range(world_size)], axis=0)
            for receiver in range(world_size)]

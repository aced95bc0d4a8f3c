"""Checkpoint tensors read in parts: a rank reads only the rows and columns it holds.

A rank loads the whole model's description through the family loader, as one device would,
but over `DeferredWeights`: each tensor arrives as a `Deferred` (the source's own view, a
zero-copy memory map for safetensors, not yet touched) and `CheckpointReader.stacked` keeps
deferred parts as a `RowStack` instead of concatenating them. The sharding pass then reads each
layer's part with `read_part`, so only those bytes are read from the files and copied:

    q_proj [Hq D, H] --.
    k_proj [Hkv D, H] -+- RowStack [(Hq + 2 Hkv) D, H] -- read_part(rows of rank r's heads)
    v_proj [Hkv D, H] -'                                    -> [(Hq + 2 Hkv) D / t, H] array

Rows of a row-major memory map are contiguous pages; a column part is a strided read, which
touches only the pages holding it once a row spans several pages (any real model's matrix).
A loader that computes on a deferred tensor with numpy (`1 + w`, a reshape) gets a plain
array: `np.asarray` reads it whole, which is correct, only not partial.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from atlas.ports.weights import WeightSource

Range = tuple[int, int]  # [start, stop)
PartSpec = Sequence[Sequence[Range] | None]  # per dimension: the ranges to keep, in order (None: all)


class LazyArray(NDArrayOperatorsMixin):
    """An array not read yet. `np.asarray` (and numpy's operators) read it whole;
    `read_part` reads a part."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def part(self, spec: PartSpec) -> np.ndarray:
        """The part `spec` selects, as a new array (see `read_part`)."""
        raise NotImplementedError

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        whole = self.part([None] * self.ndim)
        return whole if dtype is None else whole.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):  # noqa: ANN001 - numpy's protocol
        if method != "__call__":
            return NotImplemented
        return ufunc(*[np.asarray(value) if isinstance(value, LazyArray) else value for value in inputs], **kwargs)

    def __getitem__(self, index):  # noqa: ANN001 - numpy's indexing
        return np.asarray(self)[index]

    def astype(self, dtype: np.dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def reshape(self, *shape: int) -> np.ndarray:
        return np.asarray(self).reshape(*shape)

    @property
    def T(self) -> np.ndarray:  # noqa: N802 - numpy's name
        return np.asarray(self).T


class Deferred(LazyArray):
    """One checkpoint tensor: the source's view of it, copied only in the parts asked for."""

    def __init__(self, view: np.ndarray) -> None:
        self.view = view
        self.shape = tuple(view.shape)
        self.dtype = view.dtype

    def part(self, spec: PartSpec) -> np.ndarray:
        return _gather(self.view, _full_spec(spec, self.shape))


class RowStack(LazyArray):
    """Arrays (deferred or not) concatenated along dimension 0, read part by part; a backend
    that uploads row blocks (`row_blocks`) copies each part straight to its rows."""

    def __init__(self, parts: Sequence[np.ndarray | LazyArray]) -> None:
        first = parts[0]
        if any(tuple(part.shape[1:]) != tuple(first.shape[1:]) or part.dtype != first.dtype for part in parts):
            raise ValueError("stacked tensors differ in dtype or in their dimensions after the first")
        self.parts = tuple(parts)
        self.shape = (sum(int(part.shape[0]) for part in parts), *first.shape[1:])
        self.dtype = np.dtype(first.dtype)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        whole = np.concatenate([np.asarray(part) for part in self.parts], axis=0)  # one copy, not a part's two
        return whole if dtype is None else whole.astype(dtype)

    def part(self, spec: PartSpec) -> np.ndarray:
        spec = _full_spec(spec, self.shape)
        pieces = []
        for start, stop in spec[0]:
            offset = 0
            for part in self.parts:
                rows = int(part.shape[0])
                low, high = max(start, offset), min(stop, offset + rows)
                if low < high:
                    pieces.append(read_part(part, [[(low - offset, high - offset)], *spec[1:]]))
                offset += rows
        return np.concatenate(pieces, axis=0)


class LeadingStack(LazyArray):
    """Arrays (deferred or not) of one shape stacked along a new leading dimension (the experts
    of an MoE layer), read part by part: an expert-parallel rank reads only its experts."""

    def __init__(self, parts: Sequence[np.ndarray | LazyArray]) -> None:
        first = parts[0]
        if any(tuple(part.shape) != tuple(first.shape) or part.dtype != first.dtype for part in parts):
            raise ValueError("stacked tensors differ in shape or dtype")
        self.parts = tuple(parts)
        self.shape = (len(parts), *first.shape)
        self.dtype = np.dtype(first.dtype)

    def part(self, spec: PartSpec) -> np.ndarray:
        spec = _full_spec(spec, self.shape)
        chosen = [self.parts[index] for start, stop in spec[0] for index in range(start, stop)]
        return np.stack([read_part(part, spec[1:]) for part in chosen])


def read_part(array: np.ndarray | LazyArray, spec: PartSpec) -> np.ndarray:
    """A new array of the ranges `spec` keeps along each dimension, concatenated in order:

        read_part(w, [[(0, 2), (6, 8)], None])   # rows 0, 1, 6, 7 of every column
        read_part(w, [None, [(4, 8)]])           # columns 4..7 of every row

    Deferred tensors read only those elements. Ranges must lie within the shape (ValueError)."""
    if isinstance(array, LazyArray):
        return array.part(spec)
    return _gather(np.asarray(array), _full_spec(spec, tuple(array.shape)))


def concatenate_rows(parts: Sequence[np.ndarray | LazyArray], lazy: bool = False) -> np.ndarray | RowStack:
    """np.concatenate along dimension 0, or a `RowStack` when a part is deferred (not read) or
    `lazy` asks to leave the parts where they are (memory-mapped) for `row_blocks`; one part
    that is read comes back as it is (no copy: a checkpoint's view keeps its file extent)."""
    if any(isinstance(part, LazyArray) for part in parts):
        return RowStack(parts)
    if len(parts) == 1:
        return parts[0]
    if lazy:
        return RowStack(parts)
    return np.concatenate(parts, axis=0)


def row_blocks(array: np.ndarray | LazyArray) -> list[np.ndarray]:
    """Arrays whose concatenation along dimension 0 is `array`: a `RowStack`'s parts (theirs in
    turn), read whole; anything else as itself. A row-major matrix's row blocks lie end to end
    in its memory, so a backend copies each block to its offset and the host never holds the
    concatenation:

        RowStack(q [Hq D, H], k [Hkv D, H], v [Hkv D, H]) -> device bytes | q | k | v |
    """
    if isinstance(array, RowStack):
        return [block for part in array.parts for block in row_blocks(part)]
    return [np.asarray(array)]


def stack_leading(parts: Sequence[np.ndarray | LazyArray]) -> np.ndarray | LeadingStack:
    """np.stack along a new dimension 0, or a `LeadingStack` when a part is deferred."""
    if any(isinstance(part, LazyArray) for part in parts):
        return LeadingStack(parts)
    return np.stack(parts)


class DeferredWeights:
    """A `WeightSource` whose tensors arrive deferred (see the module docstring)."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def names(self) -> Iterable[str]:
        return self.source.names()

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def get(self, name: str) -> Deferred:
        return Deferred(self.source.get(name))


def _full_spec(spec: PartSpec, shape: tuple[int, ...]) -> list[list[Range]]:
    if len(spec) > len(shape):
        raise ValueError(f"a part of {len(spec)} dimensions of an array of shape {list(shape)}")
    full = []
    for size, ranges in zip(shape, [*spec, *[None] * (len(shape) - len(spec))]):
        ranges = [(0, size)] if ranges is None else [(int(a), int(b)) for a, b in ranges]
        if any(not 0 <= a <= b <= size for a, b in ranges):
            raise ValueError(f"ranges {ranges} outside a dimension of {size}")
        full.append(ranges)
    return full


def _gather(array: np.ndarray, spec: list[list[Range]]) -> np.ndarray:
    """Copy the selected elements: views for dimensions of one range, one concatenation per
    dimension of several (so a memory map is read only where selected)."""
    several = next((dim for dim, ranges in enumerate(spec) if len(ranges) > 1), None)
    if several is None:
        return np.array(array[tuple(slice(a, b) for (a, b), in spec)])
    pieces = [_gather(array, [*spec[:several], [piece], *spec[several + 1:]]) for piece in spec[several]]
    return np.concatenate(pieces, axis=several)

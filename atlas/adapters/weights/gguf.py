"""GGUF files: our own reader (header, metadata, tensor table) and numpy dequantisation.

File layout (little-endian, version 2 and 3):

    "GGUF" | u32 version | u64 num_tensors | u64 num_kv
    num_kv x      (string key, u32 value_type, value)        metadata
    num_tensors x (string name, u32 num_dims, u64 dims[num_dims], u32 ggml_type, u64 offset)
    zero padding up to `general.alignment` (default 32)
    data region: tensor bytes at data_start + offset, each offset aligned

A string is u64 length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
`dims` are ggml's ne[]: dims[0] is the innermost (contiguous) axis, so the numpy shape is
`dims` reversed. Quantized types pack `block_elems` consecutive values of a row into one
`block_bytes` block; the block math below follows ggml's `dequantize_row_*` reference code.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from atlas.adapters.weights.gguf_quants import BLOCK_DEQUANTIZERS
from atlas.ports.weights import WeightError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT_BYTES = 32


class GgufError(WeightError):
    """A GGUF file that cannot be read or holds something Atlas cannot convert."""


class GgufImportError(GgufError):
    """A readable GGUF file holding a model the importer cannot convert; says what and what to use instead."""


class GgmlType(IntEnum):
    """ggml tensor types (ggml.h `enum ggml_type`); ids 4, 5 and 31-33 were retired upstream."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


PLAIN_DTYPES: dict[GgmlType, np.dtype] = {
    GgmlType.F32: np.dtype("<f4"),
    GgmlType.F16: np.dtype("<f2"),
    GgmlType.BF16: np.dtype(ml_dtypes.bfloat16),
    GgmlType.F64: np.dtype("<f8"),
    GgmlType.I8: np.dtype(np.int8),
    GgmlType.I16: np.dtype("<i2"),
    GgmlType.I32: np.dtype("<i4"),
    GgmlType.I64: np.dtype("<i8"),
}


def type_name(ggml_type: int) -> str:
    """ggml's name for a type id ("Q4_K"), or "type N" for ids this reader does not know."""
    try:
        return GgmlType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    """One tensor-table entry; `offset_bytes` is absolute within the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml ne[], innermost first
    offset_bytes: int
    num_bytes: int | None  # None for a type Atlas cannot read (its block size is unknown)

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major) shape: dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def num_elements(self) -> int:
        """Values in the tensor (the product of its dims)."""
        return math.prod(self.dims)


# Metadata value types (gguf.h `enum gguf_type`) -> struct format for the scalar ones.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_DTYPES = {code: np.dtype(fmt) for code, fmt in _SCALAR_FORMATS.items()}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Bounds-checked sequential reads over the mapped file."""

    __slots__ = ("path", "buffer", "offset_bytes")

    def __init__(self, path: Path, buffer: memoryview) -> None:
        self.path = path
        self.buffer = buffer
        self.offset_bytes = 0

    def take(self, num_bytes: int, what: str) -> memoryview:
        end = self.offset_bytes + num_bytes
        if num_bytes < 0 or end > len(self.buffer):
            raise GgufError(
                f"{self.path}: truncated while reading {what} at byte {self.offset_bytes} "
                f"(file is {len(self.buffer)} bytes); re-download the GGUF file"
            )
        view = self.buffer[self.offset_bytes : end]
        self.offset_bytes = end
        return view

    def scalar(self, value_type: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        raw = self.take(self.u64(what), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{self.path}: {what} is not valid UTF-8; the file is corrupt") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(value_type, what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            element_type, count = self.u32(what), self.u64(what)
            if element_type in _SCALAR_DTYPES:
                dtype = _SCALAR_DTYPES[element_type]
                return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype).tolist()
            return [self.value(element_type, what) for _ in range(count)]
        raise GgufError(f"{self.path}: {what} has unknown value type {value_type}; the file is corrupt")


class GgufFile:
    """A parsed GGUF file: `metadata` (key -> Python value) and `tensors` (name -> info).

    Tensor bytes stay in a read-only mmap until `raw`/`dequantize` asks for them. Raises
    GgufError naming the file for a bad magic, an unsupported version, truncation, or a tensor
    whose bytes lie outside the file.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as handle:
                self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GgufError(f"{self.path}: cannot be opened as a GGUF file ({exc})") from None
        cursor = _Cursor(self.path, memoryview(self._mmap))
        self.version = self._read_preamble(cursor)
        num_tensors, num_kv = cursor.u64("the tensor count"), cursor.u64("the metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string("a metadata key")
            self.metadata[key] = cursor.value(cursor.u32(f"the type of {key!r}"), f"metadata {key!r}")
        self.alignment_bytes = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT_BYTES))
        if self.alignment_bytes <= 0 or self.alignment_bytes & (self.alignment_bytes - 1):
            raise GgufError(
                f"{self.path}: general.alignment {self.alignment_bytes} is not a power of two; the file is corrupt"
            )
        infos = [self._read_tensor_info(cursor) for _ in range(num_tensors)]
        self.data_start = cursor.offset_bytes + (-cursor.offset_bytes % self.alignment_bytes)
        self.tensors: dict[str, GgufTensorInfo] = {}
        for name, ggml_type, dims, relative_offset in infos:
            self.tensors[name] = self._locate(name, ggml_type, dims, relative_offset)

    def _read_preamble(self, cursor: _Cursor) -> int:
        magic = bytes(cursor.take(4, "the magic"))
        if magic != MAGIC:
            raise GgufError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
        version = cursor.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            detail = "a big-endian file" if swapped in SUPPORTED_VERSIONS else f"version {version}"
            raise GgufError(
                f"{self.path}: {detail} is not supported (Atlas reads little-endian GGUF versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert it with a current llama.cpp"
            )
        return version

    @staticmethod
    def _read_tensor_info(cursor: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
        name = cursor.string("a tensor name")
        num_dims = cursor.u32(f"the rank of {name!r}")
        dims = tuple(cursor.u64(f"the dims of {name!r}") for _ in range(num_dims))
        ggml_type = cursor.u32(f"the type of {name!r}")
        return name, ggml_type, dims, cursor.u64(f"the offset of {name!r}")

    def _locate(self, name: str, ggml_type: int, dims: tuple[int, ...], relative_offset: int) -> GgufTensorInfo:
        if relative_offset % self.alignment_bytes:
            raise GgufError(
                f"{self.path}: tensor {name!r} starts at unaligned offset {relative_offset}; the file is corrupt"
            )
        layout = block_layout(ggml_type)
        if layout is not None and dims and dims[0] % layout[0]:
            raise GgufError(
                f"{self.path}: tensor {name!r} rows of {dims[0]} values are not whole {type_name(ggml_type)} blocks "
                f"of {layout[0]}; the file is corrupt"
            )
        num_bytes = tensor_num_bytes(ggml_type, dims)
        offset = self.data_start + relative_offset
        if num_bytes is not None and offset + num_bytes > len(self._mmap):
            raise GgufError(
                f"{self.path}: tensor {name!r} ends {offset + num_bytes - len(self._mmap)} bytes past the end "
                "of the file; the download is truncated, re-download the GGUF file"
            )
        return GgufTensorInfo(name, ggml_type, dims, offset, num_bytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, [rows, row_bytes] with rows = prod(shape[:-1])."""
        info = self._info(name)
        num_bytes = info.num_bytes
        if num_bytes is None:
            raise _unsupported(info.ggml_type, name, self.path)
        num_rows = math.prod(info.dims[1:])
        buffer = np.frombuffer(self._mmap, dtype=np.uint8, count=num_bytes, offset=info.offset_bytes)
        return buffer.reshape(num_rows, num_bytes // max(num_rows, 1))

    def dequantize(self, name: str, row_start: int = 0, row_stop: int | None = None) -> np.ndarray:
        """Rows [row_start, row_stop) of the tensor as float32, in numpy shape.

        Rows index the tensor flattened to 2-D [prod(shape[:-1]), shape[-1]]; without a row
        range the full tensor comes back in its own shape. Raises GgufError naming the type when
        it is not one Atlas can dequantise.
        """
        info = self._info(name)
        rows = self.raw(name)[row_start:row_stop]
        values = dequantize_rows(rows, info.ggml_type, info.dims[0] if info.dims else 1, name=name, path=self.path)
        if row_start == 0 and row_stop is None:
            return values.reshape(info.shape)
        return values

    def _info(self, name: str) -> GgufTensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"tensor {name!r} is not in {self.path}")
        if info.num_bytes is None:
            raise _unsupported(info.ggml_type, name, self.path)
        return info

    def close(self) -> None:
        """Release the mapping (arrays returned by `raw` must no longer be in use)."""
        self._mmap.close()

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _unsupported(ggml_type: int, name: str, path: Path | None) -> GgufError:
    where = f"{path}: " if path else ""
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    return GgufError(
        f"{where}tensor {name!r} is stored as {type_name(ggml_type)}, which Atlas cannot dequantise "
        f"(supported: {supported}); use a GGUF quantised with one of those"
    )


SUPPORTED_TYPES = tuple(PLAIN_DTYPES) + tuple(GgmlType[name] for name in BLOCK_DEQUANTIZERS)


def block_layout(ggml_type: int) -> tuple[int, int] | None:
    """(values per block, bytes per block) for a type Atlas reads, else None."""
    if ggml_type in PLAIN_DTYPES:
        return 1, PLAIN_DTYPES[GgmlType(ggml_type)].itemsize
    name = type_name(ggml_type)
    if name in BLOCK_DEQUANTIZERS:
        block_elems, block_bytes, _ = BLOCK_DEQUANTIZERS[name]
        return block_elems, block_bytes
    return None


def tensor_num_bytes(ggml_type: int, dims: tuple[int, ...]) -> int | None:
    """Stored size of a tensor, or None when the type is unknown to Atlas."""
    layout = block_layout(ggml_type)
    if layout is None:
        return None
    block_elems, block_bytes = layout
    return math.prod(dims) // block_elems * block_bytes


def dequantize_rows(
    rows: np.ndarray, ggml_type: int, row_elems: int, name: str = "tensor", path: Path | None = None
) -> np.ndarray:
    """Decode [num_rows, row_bytes] stored bytes of `ggml_type` into float32 [num_rows, row_elems]."""
    num_rows = rows.shape[0]
    if ggml_type in PLAIN_DTYPES:
        dtype = PLAIN_DTYPES[GgmlType(ggml_type)]
        return np.ascontiguousarray(rows).view(dtype).astype(np.float32).reshape(num_rows, row_elems)
    entry = BLOCK_DEQUANTIZERS.get(type_name(ggml_type))
    if entry is None:
        raise _unsupported(ggml_type, name, path)
    block_elems, block_bytes, decode = entry
    if row_elems % block_elems:
        raise GgufError(f"{path}: tensor {name!r} rows of {row_elems} are not whole {type_name(ggml_type)} blocks")
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)
    return decode(blocks).reshape(num_rows, row_elems)

"""Safetensors checkpoints: our own reader (mmap, sharded index) and writer (no torch).

File layout (all integers little-endian):

    +----------------+---------------------------+--------------------------------+
    | u64 header_len | JSON header (header_len)  | raw tensor bytes (data region) |
    +----------------+---------------------------+--------------------------------+
    0                8                           8 + header_len             file end

The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, with
offsets relative to the start of the data region, plus an optional "__metadata__" of
string -> string. Tensors are views into one read-only `np.memmap` per file, so `get` copies
nothing; bf16 arrives as `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from atlas.ports.weights import WeightError

INDEX_FILENAME = "model.safetensors.index.json"
FIX_HINT = "re-download or re-import the model"
# Headers of real checkpoints are at most a few MB; anything larger is a corrupt length field.
MAX_HEADER_BYTES = 100 * 1024 * 1024
HEADER_ALIGNMENT_BYTES = 8

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives: absolute byte range [begin_bytes, end_bytes) in `path`."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path
    begin_bytes: int
    end_bytes: int


def _corrupt(path: Path, what: str) -> WeightError:
    return WeightError(f"{path}: {what}; the file is corrupt or truncated, {FIX_HINT}")


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate one file's header against its size.

    Returns (entries by name, metadata). Raises WeightError naming the file when the length
    field, the JSON, a dtype, a shape or an offset is inconsistent, or when the data region is
    shorter than the header promises (a truncated download).
    """
    try:
        file_bytes = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"only {file_bytes} bytes, too short for a safetensors header")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > min(MAX_HEADER_BYTES, file_bytes - 8):
                raise _corrupt(path, f"header length {header_bytes} exceeds the file size {file_bytes}")
            raw_header = handle.read(header_bytes)
    except OSError as exc:
        raise WeightError(f"{path}: cannot be read ({exc.strerror}); {FIX_HINT}") from None
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_bytes
    entries = {name: _entry(path, name, spec, data_start) for name, spec in header.items()}
    _check_layout(path, entries, file_bytes)
    return entries, {str(k): str(v) for k, v in metadata.items()}


def _entry(path: Path, name: str, spec: object, data_start: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _corrupt(path, f"tensor {name!r} has a malformed header entry")
    dtype = DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise WeightError(
            f"{path}: tensor {name!r} has dtype {spec.get('dtype')!r}, which Atlas cannot read "
            f"(supported: {', '.join(DTYPES)})"
        )
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _corrupt(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise _corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected_bytes = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != expected_bytes:
        raise _corrupt(
            path,
            f"tensor {name!r} spans {end - begin} bytes but shape {shape} of {spec['dtype']} needs {expected_bytes}",
        )
    return TensorEntry(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_layout(path: Path, entries: Mapping[str, TensorEntry], file_bytes: int) -> None:
    """Tensors must not overlap and must fit in the bytes actually present on disk."""
    previous: TensorEntry | None = None
    for entry in sorted(entries.values(), key=lambda e: (e.begin_bytes, e.end_bytes)):
        if previous is not None and entry.begin_bytes < previous.end_bytes:
            raise _corrupt(path, f"tensors {previous.name!r} and {entry.name!r} overlap")
        previous = entry
    last_end = max((e.end_bytes for e in entries.values()), default=0)
    if last_end > file_bytes:
        raise _corrupt(path, f"the data region ends {last_end - file_bytes} bytes before the header says it should")


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightError(f"{index_path}: unreadable index ({exc!r}); {FIX_HINT}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightError(f"{index_path}: 'weight_map' must map tensor names to file names; {FIX_HINT}")
    return weight_map


class SafetensorsFile:
    """One .safetensors file: validated header plus a lazily opened read-only memmap."""

    __slots__ = ("path", "entries", "metadata", "_memmap")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries, self.metadata = read_header(path)
        self._memmap: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        """A zero-copy read-only view of tensor `name` (KeyError when absent)."""
        entry = self.entries[name]
        if entry.begin_bytes == entry.end_bytes:
            return np.empty(entry.shape, dtype=entry.dtype)
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._memmap[entry.begin_bytes : entry.end_bytes]
        return raw.view(entry.dtype).reshape(entry.shape)

    def close(self) -> None:
        """Drop the memmap; views handed out earlier keep the mapping alive until freed."""
        self._memmap = None


class SafetensorsWeights:
    """The `WeightSource` over a model folder: one file, several, or a sharded index.

    Every header is read and validated at construction, so a corrupt or truncated file fails
    at load time with a WeightError naming it, never halfway through a forward pass.
    """

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise WeightError(f"{self.folder}: not a folder; pass a model folder holding .safetensors files")
        index_path = self.folder / INDEX_FILENAME
        weight_map = _read_index(index_path) if index_path.exists() else None
        self._files: dict[Path, SafetensorsFile] = {}
        self._file_of: dict[str, SafetensorsFile] = {}
        for path in self._shard_paths(weight_map):
            shard = SafetensorsFile(path)
            self._files[path] = shard
            for name in shard.entries:
                if name in self._file_of:
                    raise WeightError(
                        f"{self.folder}: tensor {name!r} appears in both {self._file_of[name].path.name} "
                        f"and {path.name}; {FIX_HINT}"
                    )
                self._file_of[name] = shard
        for name, file_name in (weight_map or {}).items():
            holder = self._file_of.get(name)
            if holder is None or holder.path.name != file_name:
                raise WeightError(f"{index_path}: tensor {name!r} is not in {file_name}; {FIX_HINT}")

    def _shard_paths(self, weight_map: Mapping[str, str] | None) -> list[Path]:
        if weight_map is not None:
            shard_names = sorted(set(weight_map.values()))
            missing = [name for name in shard_names if not (self.folder / name).is_file()]
            if missing:
                index_path = self.folder / INDEX_FILENAME
                raise WeightError(f"{index_path}: shard(s) {', '.join(missing)} are missing; {FIX_HINT}")
            return [self.folder / name for name in shard_names]
        paths = sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise WeightError(
                f"{self.folder}: no .safetensors files; {FIX_HINT} (a GGUF file needs `atlas import-gguf FILE OUT_DIR`)"
            )
        return paths

    def names(self) -> Iterable[str]:
        """Every tensor name, over all files."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._file_of[name].entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of `name` without reading its data (KeyError when absent)."""
        return self._entry(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype of `name` (KeyError when absent)."""
        return self._entry(name).dtype

    def get(self, name: str) -> np.ndarray:
        """A zero-copy read-only view of `name` in its stored dtype (KeyError when absent)."""
        self._entry(name)
        return self._file_of[name].get(name)

    def metadata(self) -> dict[str, str]:
        """The `__metadata__` of every file, merged (later shards win on conflicts)."""
        merged: dict[str, str] = {}
        for shard in self._files.values():
            merged.update(shard.metadata)
        return merged

    def total_bytes(self) -> int:
        """Bytes of tensor data over all files."""
        return sum(e.end_bytes - e.begin_bytes for f in self._files.values() for e in f.entries.values())

    def close(self) -> None:
        """Drop every file's mapping (views already handed out stay valid while referenced)."""
        for shard in self._files.values():
            shard.close()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor to be written: its name, storage dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes the tensor occupies in the file."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _little_endian(dtype: np.dtype) -> np.dtype:
    """The format stores little-endian values; a big-endian array is byte-swapped on write."""
    return np.dtype(dtype).newbyteorder("<")


class SafetensorsWriter:
    """Streams tensors into one file whose header is fixed up front from `specs`.

    Tensors must then be written in the order of `specs`, each matching its dtype and shape,
    so a whole checkpoint never has to sit in memory at once. `close` raises ValueError when a
    tensor is missing; the file is only complete after `close`.
    """

    def __init__(
        self, path: Path | str, specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self._specs = list(specs)
        self._next_idx = 0
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset_bytes = 0
        for spec in self._specs:
            dtype_name = _DTYPE_NAMES.get(_little_endian(spec.dtype))
            if dtype_name is None:
                raise ValueError(f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors name")
            header[spec.name] = {
                "dtype": dtype_name,
                "shape": list(spec.shape),
                "data_offsets": [offset_bytes, offset_bytes + spec.num_bytes],
            }
            offset_bytes += spec.num_bytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces so the data region starts 8-byte aligned (zero-copy views stay aligned).
        encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT_BYTES)
        self._handle = self.path.open("wb")
        self._handle.write(struct.pack("<Q", len(encoded)))
        self._handle.write(encoded)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the next tensor; ValueError when it is out of order or mismatched."""
        if self._next_idx >= len(self._specs):
            raise ValueError(f"tensor {name!r} was not declared when the writer was created")
        spec = self._specs[self._next_idx]
        dtype = _little_endian(array.dtype)
        if name != spec.name or dtype != _little_endian(spec.dtype) or tuple(array.shape) != tuple(spec.shape):
            raise ValueError(
                f"expected tensor {spec.name!r} {np.dtype(spec.dtype)} {tuple(spec.shape)}, "
                f"got {name!r} {array.dtype} {tuple(array.shape)}"
            )
        contiguous = np.ascontiguousarray(array, dtype=dtype)
        self._handle.write(contiguous.reshape(-1).view(np.uint8).data)
        self._next_idx += 1

    def close(self) -> None:
        """Finish the file; ValueError when a declared tensor was never written."""
        if self._handle.closed:
            return
        self._handle.close()
        if self._next_idx != len(self._specs):
            missing = [spec.name for spec in self._specs[self._next_idx :]]
            raise ValueError(f"{self.path}: {len(missing)} declared tensor(s) never written, first {missing[0]!r}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self._handle.close()


def write_safetensors(
    path: Path | str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (name -> array, dtype kept) to one .safetensors file at `path`."""
    specs = [TensorSpec(name, array.dtype, tuple(array.shape)) for name, array in tensors.items()]
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name, array in tensors.items():
            writer.write(name, array)


def plan_shards(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        if shards[-1] and shard_bytes + spec.num_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += spec.num_bytes
    return [shard for shard in shards if shard]


def shard_filenames(num_shards: int) -> list[str]:
    """HF's names: model.safetensors for one file, model-00001-of-0000N.safetensors for several."""
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{idx:05d}-of-{num_shards:05d}.safetensors" for idx in range(1, num_shards + 1)]


def write_index(folder: Path, shards: list[list[TensorSpec]], filenames: list[str]) -> None:
    """Write model.safetensors.index.json mapping every tensor to its shard file."""
    weight_map = {spec.name: filename for shard, filename in zip(shards, filenames, strict=True) for spec in shard}
    total_bytes = sum(spec.num_bytes for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")

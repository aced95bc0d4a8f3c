"""The hardware port: a small device protocol plus one kernel protocol per layer kind.

A backend is a `Device` (memory, copies, graphs) that also implements some of the kernel kinds
of `atlas/ports/kernels/` (dense, attention, MoE, recurrent, sampling) and lists them in
`Capabilities.kinds`. A model declares the kinds its layers need; loading it on a backend that
lacks one fails before any weight is read (`require_kinds`), naming the kind.

Conventions for every member of every protocol:
- Outputs are caller-provided tensors written in full; members never allocate on the hot path
  (a backend's own intermediates live in workspaces it keeps).
- Tensors are dense and row-major. `Tensor.rows(a, b)` and `Tensor.view(...)` give views that
  share memory, so a workspace sized for the largest step serves every smaller one.
- Shapes are given in comments as `[rows, cols]`; `N` is the number of tokens in the step,
  `R` the number of rows to sample, `H` the hidden size, `V` the vocabulary size.
- Work is enqueued in order on one stream. A download's `wait` and `synchronize` wait for it.
- A member given inconsistent shapes or dtypes raises `ValueError` naming the argument.
- Weights reach a kind through its `prepare` members, as host arrays, once, at load; what comes
  back is the backend's opaque prepared form (norms folded, layouts changed, quantized...).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from atlas.ports.kernels.attention import AttentionKernels
    from atlas.ports.kernels.dense import DenseKernels
    from atlas.ports.kernels.moe import MoeKernels
    from atlas.ports.kernels.recurrent import RecurrentKernels
    from atlas.ports.kernels.sampling import SamplingKernels


class DType(enum.Enum):
    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    FP8_E4M3 = "fp8_e4m3"  # OCP E4M3 (max 448, no infinities): quantized KV caches

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.BF16, DType.F16, DType.F32)

    @property
    def is_quantized(self) -> bool:
        """Stored values that stand for value * scale (the scale kept beside them)."""
        return self is DType.FP8_E4M3


_ITEMSIZE = {
    DType.BF16: 2, DType.F16: 2, DType.F32: 4, DType.I32: 4, DType.I64: 8, DType.U8: 1, DType.FP8_E4M3: 1,
}

# How each dtype looks on the host: what `upload` takes and `download` returns.
NUMPY_DTYPES: dict[DType, np.dtype] = {
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F16: np.dtype(np.float16),
    DType.F32: np.dtype(np.float32),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
    DType.FP8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
}


def dtype_of(array: np.ndarray) -> DType:
    """The port dtype of a host array; `ValueError` for one no backend holds."""
    for dtype, np_dtype in NUMPY_DTYPES.items():
        if array.dtype == np_dtype:
            return dtype
    raise ValueError(f"no backend dtype for numpy dtype {array.dtype}")


def bitcast_last_dim(shape: tuple[int, ...], source: DType, target: DType) -> int:
    """The last dimension of a tensor of `shape` and `source` read as `target` (see
    `Tensor.bitcast`); raises ValueError when the bytes do not divide."""
    if not shape:
        raise ValueError("cannot bitcast a scalar")
    row_bytes = shape[-1] * source.itemsize
    if row_bytes % target.itemsize:
        raise ValueError(f"cannot bitcast {list(shape)} {source.value} to {target.value}")
    return row_bytes // target.itemsize


@runtime_checkable
class Tensor(Protocol):
    """A dense, row-major array owned by a backend."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> DType: ...

    def view(self, *shape: int) -> Tensor:
        """The same memory with another shape of equal element count."""
        ...

    def rows(self, start: int, stop: int) -> Tensor:
        """Rows [start, stop) along dimension 0, sharing memory."""
        ...

    def bitcast(self, dtype: DType) -> Tensor:
        """The same bytes as another dtype; the last dimension scales by the itemsize ratio (a
        [2n] i32 tensor is [n] i64). For word arenas: one copy can carry ints and floats."""
        ...


def leading_block(buffer: Tensor, num_rows: int, num_columns: int) -> Tensor:
    """A dense [num_rows, num_columns] view over the start of `buffer`'s memory (a workspace
    sized for its widest user serves narrower ones)."""
    total = 1
    for size in buffer.shape:
        total *= size
    if num_rows * num_columns > total:
        raise ValueError(f"buffer: {list(buffer.shape)} cannot hold [{num_rows}, {num_columns}]")
    return buffer.view(total).rows(0, num_rows * num_columns).view(num_rows, num_columns)


class Kind(enum.Enum):
    """The kernel protocols of `atlas/ports/kernels/`, one per kind of layer work."""

    DENSE = "dense"  # embedding, projections with their norms and gated activations, logits
    ATTENTION = "attention"  # the paged KV cache, q/k/v with RoPE into it, attention over it
    MOE = "moe"  # routing and the grouped experts
    RECURRENT = "recurrent"  # per-sequence state slots, causal conv1d, the gated delta rule
    SAMPLING = "sampling"  # one token per row of logits


@dataclass(frozen=True, slots=True)
class Capabilities:
    activation_dtype: DType  # what the model keeps activations in (f32 on the mock, bf16 on GPUs)
    kv_dtypes: tuple[DType, ...]  # the KV cache dtypes the attention kind stores and reads
    kinds: frozenset[Kind]  # the kernel protocols this backend implements
    supports_graphs: bool  # replay is cheaper than eager launches
    device_name: str
    # the recurrent kind writes the states after a step's inner tokens into the snapshot slots
    # a step names (`RecurrentMetadata.snapshot_slots`): speculation on a model with recurrent layers
    state_snapshots: bool = False
    # `capture_pieces` replays a forward's pieces with eager calls between them faster than the
    # forward's own launches: the worker then captures steps with prompt tokens per token bucket
    piecewise_graphs: bool = False
    # with piecewise graphs: a step of one sequence computing two or more tokens over a context
    # of at most this many keys launches its attention sized by its token bucket alone (the
    # kernels read the lengths on the device), so the worker captures such steps' layers whole,
    # attention inside (0: never)
    whole_prompt_keys: int = 0


class MissingKindError(ValueError):
    """A model needs a kernel kind the backend does not implement."""


class UnsupportedError(ValueError):
    """A kind's `prepare` was given data its backend cannot run (an activation, a weight format,
    sinks, a head dim); the message names the field."""


def require_kinds(backend: Device, needed: Iterable[Kind], what: str) -> None:
    """Raise `MissingKindError` naming each kind of `needed` that `backend` lacks (`what`: the
    model that needs them)."""
    have = backend.capabilities.kinds
    missing = [kind for kind in Kind if kind in set(needed) and kind not in have]
    if missing:
        names = ", ".join(kind.value for kind in missing)
        supported = ", ".join(kind.value for kind in Kind if kind in have) or "none"
        raise MissingKindError(
            f"{what} needs the {names} kernels, which the {backend.name} backend does not implement "
            f"(it has: {supported})"
        )


class PendingDownload(Protocol):
    def wait(self) -> np.ndarray:
        """Block until the copy has landed; return it (the same array on every call)."""
        ...


class HostMirror(Protocol):
    """Host memory the shape of a device tensor, copied into it on the stream (`Device.host_mirror`).
    Page-locked where the backend has such memory: the copy then needs no staging, and a graph
    can hold it. The copy reads the host rows when it runs, not when it is enqueued."""

    @property
    def array(self) -> np.ndarray:
        """The host side: the tensor's shape, its numpy dtype. Write it, then `upload`."""
        ...

    def upload(self, start: int, stop: int) -> None:
        """Enqueue the copy of `array`'s rows start..stop (along the first axis) into the
        tensor's. Capturable: a graph's replay copies what those rows hold at that moment."""
        ...

    def wait_uploaded(self) -> None:
        """Block until every copy enqueued so far (a replayed graph's too) has run: the rows
        may then change. Returns at once when nothing is outstanding."""
        ...


class Graph(Protocol):
    def replay(self) -> None:
        """Run the captured work again, reading the current contents of its buffers."""
        ...


class PiecewiseGraph(Protocol):
    def replay(self, arg: Any) -> None:
        """Run the captured pieces again in order, calling each cut's function with `arg`
        between them (see `Device.capture_pieces`)."""
        ...


class Device(Protocol):
    """Memory, copies and graphs of one accelerator."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def empty(self, shape: Sequence[int], dtype: DType) -> Tensor:
        """An uninitialised tensor. Raises `MemoryError` naming the bytes asked and free."""
        ...

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> Tensor:
        """A new tensor holding `array`, converted to `dtype` (default: the array's own)."""
        ...

    def copy_from_host(self, dst: Tensor, array: np.ndarray) -> None:
        """Write `array` (same element count, converted to dst's dtype) into `dst`.

        Ordered with the work on the stream; `array` may be reused as soon as this returns.
        """
        ...

    def host_mirror(self, dst: Tensor) -> HostMirror:
        """A `HostMirror` of `dst` (zeroed), for a buffer the host rewrites every step."""
        ...

    def begin_download(self, src: Tensor) -> PendingDownload:
        """Start copying `src` to the host once all work enqueued before has run (bf16 comes
        back as ml_dtypes.bfloat16).

        Returns at once; work enqueued later may overwrite `src` without changing the copy. This
        is how the worker reads step N's token ids while step N+1 is already queued.
        """
        ...

    def memory_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) the backend can still allocate from."""
        ...

    def gather_rows(self, x: Tensor, indices: Tensor, out: Tensor) -> None:
        """out[r] = x[indices[r]] on the device, any element type (enqueued; capturable).
        x [M, W], indices [R] i32 in [0, M), out [R, W] of x's dtype."""
        ...

    def capture(self, fn: Callable[[], None]) -> Graph:
        """Record the work `fn` enqueues so `replay` reruns it on the buffers' new contents.

        `fn` may only enqueue work on tensors that outlive the graph; it must not download,
        upload or allocate. Backends without graphs run `fn` on every replay.
        """
        ...

    def capture_pieces(self, fn: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> PiecewiseGraph:
        """Capture `fn(cut)` as pieces: the work enqueued before each `cut(call)` and after the
        last is a piece of its own, and `replay(arg)` replays the pieces in order with each cut's
        `call(arg)` run eagerly between them (what a graph cannot hold: work sized by the step's
        host-side metadata, such as prefill attention). `fn` obeys `capture`'s rules outside its
        cuts; each `call` may enqueue anything. Backends without graphs run `fn` with its cuts'
        calls on every replay.
        """
        ...

    def synchronize(self) -> None:
        """Wait until all enqueued work has finished."""
        ...

    def setup_summary(self) -> str:
        """The one-time work the steps run so far did besides their own, for the startup log
        (CUDA: how many GEMM shapes had their algorithms timed, in how many seconds); "" when
        there was none."""
        ...

    def unprepared_token_counts(self, key: str, token_counts: Sequence[int]) -> tuple[int, ...] | None:
        """Of the step sizes `token_counts` (tokens in one step), those whose first eager step
        may still prepare something slow (CUDA: time GEMM algorithms): the sizes no
        `record_prepared` under `key` recorded, in this process or (CUDA: in the store of tuned
        algorithms) an earlier one. `key` names a set of products (a hash of the model's
        config). None when the backend prepares nothing lazily: no warm-up is worth running.
        `Worker.warm_up` runs a forward of each at startup, so live traffic never waits."""
        ...

    def record_prepared(self, key: str, token_counts: Sequence[int]) -> None:
        """Remember that forwards of `token_counts` ran over the products `key` names."""
        ...


class GpuBackend(Device, Protocol):
    """A device with its kernel kinds. Each property returns that kind's kernels; reaching one
    that `capabilities.kinds` does not list raises `MissingKindError` (models check first, with
    `require_kinds`)."""

    @property
    def dense(self) -> DenseKernels: ...

    @property
    def attention(self) -> AttentionKernels: ...

    @property
    def moe(self) -> MoeKernels: ...

    @property
    def recurrent(self) -> RecurrentKernels: ...

    @property
    def sampling(self) -> SamplingKernels: ...

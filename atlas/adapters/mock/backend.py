"""MockGpuBackend: the device port and every kernel kind in numpy, with real math.

Compute is float32. Storage follows each tensor's dtype (bf16 through ml_dtypes), so the mock
can run a model in float32 activations (the reference mode, default) or in bf16 activations
(rounding its intermediates like a GPU). It is the reference the CUDA adapter is tested against,
and it runs real models on a laptop CPU. For tests it injects faults: make a member raise, cap
allocations.

The kinds live beside this module (dense.py, attention.py, moe.py, recurrent.py, sampler.py);
they allocate through the backend, so its memory cap covers weights and caches.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from atlas.adapters.mock.attention import MockAttention
from atlas.adapters.mock.dense import MockDense
from atlas.adapters.mock.moe import MockMoe
from atlas.adapters.mock.recurrent import MockRecurrent
from atlas.adapters.mock.sampler import MockSampling
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.gpu import NUMPY_DTYPES, Capabilities, DType, Kind, dtype_of


class _CompletedDownload:
    """Work runs synchronously on the mock, so a download is complete when it starts."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def wait(self) -> np.ndarray:
        return self._array


# CUDA's bound (ops_attention.WHOLE_PROMPT_MAX_KEYS), so that the worker takes the same paths here
WHOLE_PROMPT_KEYS = 1023


class _MockGraph:
    """No graphs on a CPU: replay re-runs the captured function on the buffers' contents."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class _MockPieces:
    """Replay re-runs the captured function, each cut's call taking the replay's argument."""

    def __init__(self, fn: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> None:
        self._fn = fn

    def replay(self, arg: Any) -> None:
        self._fn(lambda call: call(arg))


class MockGpuBackend:
    """The numpy backend. `memory_bytes` caps what it may allocate (default: 80% of free RAM)."""

    def __init__(
        self,
        activation_dtype: DType = DType.F32,
        memory_bytes: int | None = None,
        emulate_graphs: bool = False,
        emulate_pieces: bool = False,
        whole_prompt_keys: int = WHOLE_PROMPT_KEYS,
    ) -> None:
        """`emulate_graphs` reports graph support so the worker's graph path (padding, capture,
        replay over persistent buffers) runs on the CPU; replay re-runs the captured function.
        `emulate_pieces` does the same for steps with prompt tokens (`Capabilities.piecewise_graphs`:
        token rows padded to a bucket, the layers' pieces captured and replayed), and captures a
        lone sequence's prompt steps over at most `whole_prompt_keys` keys whole
        (`Capabilities.whole_prompt_keys`; the mock's attention reads the lengths from the
        buffers, as CUDA's kernels do)."""
        self._activation_dtype = activation_dtype
        self._emulate_graphs = emulate_graphs
        self._emulate_pieces = emulate_pieces
        self._whole_prompt_keys = whole_prompt_keys if emulate_pieces else 0
        self._total_bytes = memory_bytes if memory_bytes is not None else _default_memory_bytes()
        self._allocated_bytes = 0
        self._faults: dict[str, Exception] = {}
        self._dense = MockDense(self)
        self._attention = MockAttention(self)
        self._moe = MockMoe(self)
        self._recurrent = MockRecurrent(self)
        self._sampling = MockSampling(self)

    # -- identity -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "mock"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            activation_dtype=self._activation_dtype,
            kv_dtypes=(DType.F32, DType.BF16, DType.F16, DType.FP8_E4M3),
            kinds=frozenset(Kind),
            supports_graphs=self._emulate_graphs,
            piecewise_graphs=self._emulate_pieces,
            whole_prompt_keys=self._whole_prompt_keys,
            device_name=f"numpy on {os.cpu_count()} CPU cores",
            state_snapshots=True,
        )

    @property
    def dense(self) -> MockDense:
        return self._dense

    @property
    def attention(self) -> MockAttention:
        return self._attention

    @property
    def moe(self) -> MockMoe:
        return self._moe

    @property
    def recurrent(self) -> MockRecurrent:
        return self._recurrent

    @property
    def sampling(self) -> MockSampling:
        return self._sampling

    # -- fault injection (tests) --------------------------------------------------------
    def inject_fault(self, member: str, error: Exception) -> None:
        """Make every later call of `member` (a device member, or a kind's as "dense.project")
        raise `error`."""
        self._faults[member] = error

    def clear_faults(self) -> None:
        self._faults.clear()

    def limit_memory(self, total_bytes: int) -> None:
        """Cap total allocations (tests of the startup memory check and of OOM handling)."""
        self._total_bytes = total_bytes

    def enter(self, member: str) -> None:
        """Called by every member first: raises an injected fault."""
        error = self._faults.get(member)
        if error is not None:
            raise error

    # -- memory -------------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: DType, what: str = "tensor") -> np.ndarray:
        """An array counted against the memory cap until it is garbage; `MemoryError` naming
        `what`, the bytes asked and the bytes free."""
        self.enter("empty")
        num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        free_bytes = self._total_bytes - self._allocated_bytes
        if num_bytes > free_bytes:
            raise MemoryError(
                f"mock backend: cannot allocate {num_bytes / 2**20:.1f} MiB for {what} {tuple(shape)} {dtype.value}; "
                f"{free_bytes / 2**20:.1f} MiB free of {self._total_bytes / 2**20:.1f} MiB"
            )
        array = np.empty(tuple(shape), NUMPY_DTYPES[dtype])
        self._allocated_bytes += num_bytes
        weakref.finalize(array, self._release, num_bytes)
        return array

    def count(self, owner: object, num_bytes: int) -> None:
        """Count `num_bytes` against the cap while `owner` (an array the caller made) lives."""
        self._allocated_bytes += num_bytes
        weakref.finalize(owner, self._release, num_bytes)

    def _release(self, num_bytes: int) -> None:
        self._allocated_bytes -= num_bytes

    def free_bytes(self) -> int:
        return self._total_bytes - self._allocated_bytes

    def empty(self, shape: Sequence[int], dtype: DType) -> MockTensor:
        return MockTensor(self.allocate(shape, dtype), dtype)

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> MockTensor:
        target = dtype or dtype_of(array)
        tensor = self.empty(array.shape, target)
        tensor.data[...] = array
        return tensor

    def copy_from_host(self, dst: MockTensor, array: np.ndarray) -> None:
        self.enter("copy_from_host")
        if array.size != dst.data.size:
            raise ValueError(f"copy_from_host: {array.size} elements into a tensor of {dst.data.size}")
        dst.data[...] = np.asarray(array).reshape(dst.data.shape)

    def host_mirror(self, dst: MockTensor) -> _MockMirror:
        return _MockMirror(self, dst)

    def download(self, src: MockTensor) -> np.ndarray:
        """A host copy of `src` at once (tests; the port's copy is `begin_download`)."""
        self.enter("download")
        return src.data.copy()

    def begin_download(self, src: MockTensor) -> _CompletedDownload:
        self.enter("download")
        return _CompletedDownload(src.data.copy())

    def fill(self, dst: MockTensor, value: float) -> None:
        """Set every element of `dst` to `value` (tests poison outputs with NaN)."""
        dst.data[...] = value

    def memory_info(self) -> tuple[int, int]:
        return self.free_bytes(), self._total_bytes

    def gather_rows(self, x: MockTensor, indices: MockTensor, out: MockTensor) -> None:
        self.enter("gather_rows")
        ids = indices.data
        if ids.size and (ids.min() < 0 or ids.max() >= x.shape[0]):
            raise ValueError(f"indices: a row outside [0, {x.shape[0]})")
        if out.shape != (ids.shape[0], *x.shape[1:]):
            raise ValueError(f"out: shape {list(out.shape)} is not [{ids.shape[0]}, {list(x.shape[1:])}]")
        out.data[...] = x.data[ids]

    # -- execution ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> _MockGraph:
        return _MockGraph(fn)

    def capture_pieces(self, fn: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> _MockPieces:
        return _MockPieces(fn)

    def synchronize(self) -> None:
        self.enter("synchronize")

    def setup_summary(self) -> str:
        return ""  # numpy needs no tuning

    def unprepared_token_counts(self, key: str, token_counts: Sequence[int]) -> None:
        return None  # numpy prepares nothing per size

    def record_prepared(self, key: str, token_counts: Sequence[int]) -> None:
        pass


def _default_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.8)
    except OSError:
        pass
    return 8 * 2**30


class _MockMirror:
    """`HostMirror` over a mock tensor: a numpy array whose rows `upload` copies in."""

    __slots__ = ("array", "_backend", "_tensor")

    def __init__(self, backend: MockGpuBackend, tensor: MockTensor) -> None:
        self._backend, self._tensor = backend, tensor
        self.array = np.zeros(tensor.data.shape, tensor.data.dtype)

    def upload(self, start: int, stop: int) -> None:
        self._backend.enter("copy_from_host")
        if not 0 <= start <= stop <= self.array.shape[0]:
            raise ValueError(f"upload: rows {start}..{stop} of a mirror of {self.array.shape[0]}")
        self._tensor.data[start:stop] = self.array[start:stop]

    def wait_uploaded(self) -> None:
        """Copies run at once here."""

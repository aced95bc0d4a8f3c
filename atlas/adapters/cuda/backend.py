"""CudaGpuBackend: the device port and the dense, attention and sampling kinds on an NVIDIA GPU
through cuda-python.

Every kernel is one of ours (kernels/, compiled by NVRTC through the registry) or a cuBLASLt
call, enqueued on one stream; `download` and `synchronize` are the only waits. Activations and
the KV cache are bf16 (or an FP8 cache); weights bf16 [out, in], or FP8 (E4M3 with per-channel or
128 x 128 block scales, Hopper); accumulation fp32. The kinds live beside this module (dense.py,
attention.py, moe.py, recurrent.py, ops_sampling.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda import checks, graphs, ops_dense
from atlas.adapters.cuda.attention import CudaAttention
from atlas.adapters.cuda.dense import CudaDense
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.gemm_tuning import TuningStats
from atlas.adapters.cuda.kv_cache import CudaKvCache
from atlas.adapters.cuda.memory import CompletedCopy, PendingCopy, PinnedMirror, PoolStats
from atlas.adapters.cuda.ops_attention import WHOLE_PROMPT_MAX_KEYS
from atlas.adapters.cuda.moe import CudaMoe
from atlas.adapters.cuda.ops_fp8 import Fp8LinearOp
from atlas.adapters.cuda.ops_sampling import CudaSampling
from atlas.adapters.cuda.recurrent import CudaRecurrent
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.domain.models.shard_reads import row_blocks
from atlas.ports.gpu import NUMPY_DTYPES, Capabilities, DType, Kind, dtype_of

KINDS = frozenset({Kind.DENSE, Kind.ATTENTION, Kind.MOE, Kind.RECURRENT, Kind.SAMPLING})


class CudaGpuBackend:
    """One NVIDIA GPU. `model_hint` (an HF model_type) and `quant` pick tuned kernels;
    `batch_invariant` makes a token row's bits independent of its step's rows (see
    `CudaFeatures.batch_invariant`)."""

    def __init__(
        self,
        device_ordinal: int = 0,
        kernel_cache_dir: Path | str | None = None,
        model_hint: str | None = None,
        quant: str = "bf16",
        batch_invariant: bool = False,
    ) -> None:
        cache_dir = Path(kernel_cache_dir) if kernel_cache_dir is not None else None
        self._rt = CudaRuntime(device_ordinal, cache_dir, model_hint, quant)
        if batch_invariant:
            self._rt.features = dataclasses.replace(self._rt.features, batch_invariant=True)
        self._linear = ops_dense.LinearOp(self._rt)
        self._fp8 = Fp8LinearOp(self._rt)
        self._init_kinds(DType.BF16)

    def _init_kinds(self, activation_dtype: DType) -> None:
        kv_dtypes = (DType.BF16, DType.FP8_E4M3) if self._fp8_cache_ok() else (DType.BF16,)
        self._capabilities = Capabilities(
            activation_dtype=activation_dtype,
            kv_dtypes=kv_dtypes,
            kinds=KINDS,
            supports_graphs=True,
            device_name=self._rt.device_name,
            state_snapshots=True,  # gated_delta.cu writes the states after a chunk's named tokens
            piecewise_graphs=self._rt.features.piecewise_graphs and not self._rt.features.batch_invariant,
            whole_prompt_keys=WHOLE_PROMPT_MAX_KEYS if self._rt.features.whole_prompts else 0,
        )
        self._dense = CudaDense(self._rt, self._linear, self._fp8, self.upload)
        self._attention = CudaAttention(self._rt, self._linear, self._dense, kv_dtypes, self.upload)
        self._sampling = CudaSampling(self._rt)
        self._moe = CudaMoe(self._rt, self._linear, self.upload)
        self._recurrent = CudaRecurrent(self._rt, self.upload)

    def _fp8_cache_ok(self) -> bool:
        """E4M3 conversions exist from sm_89, and only the tensor-core decode kernel reads FP8."""
        return self._rt.compute_capability >= (8, 9) and self._rt.features.mma_decode

    # -- identity -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "cuda"

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def dense(self) -> CudaDense:
        return self._dense

    @property
    def attention(self) -> CudaAttention:
        return self._attention

    @property
    def sampling(self) -> CudaSampling:
        return self._sampling

    @property
    def moe(self) -> CudaMoe:
        return self._moe

    @property
    def recurrent(self) -> CudaRecurrent:
        return self._recurrent

    @property
    def runtime(self) -> CudaRuntime:
        """The device context (kernel stats, pool, stream) for tests and benchmarks."""
        return self._rt

    def memory_stats(self) -> PoolStats:
        return self._rt.pool.stats()

    def close(self) -> None:
        """Release the cached memory, staging buffers and cuBLASLt handle."""
        self._linear.close()
        self._fp8.close()
        self._rt.close()

    # -- memory -------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: DType) -> CudaTensor:
        self._rt.ensure_current()
        self._rt.forbid_in_capture("empty")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape: {list(shape)} has a negative dimension")
        allocation = self._rt.pool.allocate(math.prod(shape) * dtype.itemsize)
        return CudaTensor(allocation.address, shape, dtype, allocation)

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> CudaTensor:
        target = dtype or dtype_of(np.asarray(array))
        tensor = self.empty(np.shape(array), target)
        self.copy_from_host(tensor, array)
        return tensor

    def copy_from_host(self, dst: CudaTensor, array: np.ndarray) -> None:
        """A fused projection's `RowStack` goes up block by block, never concatenated here.
        Read from a checkpoint's files, the copy is only queued on return; it reaches the
        stream before the next op on it (`CudaRuntime.stream`)."""
        self._rt.ensure_current()
        self._rt.forbid_in_capture("copy_from_host")
        checks.tensor(dst, "dst")
        blocks = [np.ascontiguousarray(block, dtype=NUMPY_DTYPES[dst.dtype]) for block in row_blocks(array)]
        num_elements = sum(block.size for block in blocks)
        if num_elements != dst.num_elements:
            raise ValueError(f"copy_from_host: {num_elements} elements into a tensor of {dst.num_elements}")
        self._rt.staging.upload_pieces(dst.address, blocks)

    def host_mirror(self, dst: CudaTensor) -> PinnedMirror:
        checks.tensor(dst, "dst")
        return self._rt.host_mirror(dst.address, dst.shape, NUMPY_DTYPES[dst.dtype])

    def download(self, src: CudaTensor) -> np.ndarray:
        """A host copy of `src` after all enqueued work (tests and benchmarks; the port's copy
        is `begin_download`)."""
        self._rt.ensure_current()
        self._rt.forbid_in_capture("download")
        checks.tensor(src, "src")
        out = np.empty(src.shape, dtype=NUMPY_DTYPES[src.dtype])
        self._rt.staging.download(src.address, out)
        return out

    def begin_download(self, src: CudaTensor) -> PendingCopy | CompletedCopy:
        self._rt.ensure_current()
        self._rt.forbid_in_capture("begin_download")
        checks.tensor(src, "src")
        self._rt.staging.flush()  # `downloads` holds the raw stream handle
        return self._rt.downloads.begin(src.address, src.shape, NUMPY_DTYPES[src.dtype])

    def fill(self, dst: CudaTensor, value: float) -> None:
        """Set every element of `dst` to `value` (tests poison outputs and caches with NaN)."""
        self._rt.ensure_current()
        checks.tensor(dst, "dst")
        count = dst.num_elements
        if count == 0:
            return
        stream = self._rt.stream_handle
        if dst.dtype in (DType.BF16, DType.F16):
            bits = int(np.array([value], dtype=NUMPY_DTYPES[dst.dtype]).view(np.uint16)[0])
            check("cuMemsetD16Async", cu.cuMemsetD16Async(dst.address, bits, count, stream))
        elif dst.dtype is DType.F32:
            bits = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
            check("cuMemsetD32Async", cu.cuMemsetD32Async(dst.address, bits, count, stream))
        elif dst.dtype is DType.FP8_E4M3:  # NaN is 0x7f; values past 448 are refused by the cast
            byte = int(np.array([value], dtype=NUMPY_DTYPES[dst.dtype]).view(np.uint8)[0])
            check("cuMemsetD8Async", cu.cuMemsetD8Async(dst.address, byte, count, stream))
        else:
            if not math.isfinite(value) or value != int(value):
                raise ValueError(f"fill: {value} is not an integer for a {dst.dtype.value} tensor")
            pattern = np.array([int(value)], dtype=NUMPY_DTYPES[dst.dtype])
            if dst.dtype is DType.U8:
                byte = int(pattern.view(np.uint8)[0])
                check("cuMemsetD8Async", cu.cuMemsetD8Async(dst.address, byte, count, stream))
            elif dst.dtype is DType.I32:
                word = int(pattern.view(np.uint32)[0])
                check("cuMemsetD32Async", cu.cuMemsetD32Async(dst.address, word, count, stream))
            else:
                wide = np.uint64(pattern.view(np.uint64)[0])
                blocks = int(min(-(-count // 256), self._rt.num_sms * 8))
                self._rt.launch("elementwise", "fill_u64", (blocks,), 256, dst.address, np.int64(count), wide)

    def memory_info(self) -> tuple[int, int]:
        return self._rt.memory_info()

    def kv_to_host(self, kv: CudaKvCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of one layer as [num_blocks, block_size, num_kv_heads, head_dim] (tests)."""
        self._rt.ensure_current()
        spec = kv.spec
        planes = []
        for address in (kv.key_plane(layer), kv.value_plane(layer)):
            raw = np.empty(spec.num_blocks * kv.page_bytes // spec.dtype.itemsize, dtype=NUMPY_DTYPES[spec.dtype])
            self._rt.staging.download(address, raw)
            planes.append(np.ascontiguousarray(kv.plane_to_slots(raw)))
        return planes[0], planes[1]

    def kv_from_host(self, kv: CudaKvCache, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store one layer's K and V from slot-major [num_slots, num_kv_heads, head_dim] arrays
        (converted to the cache's dtype) into the head-major pages (tests)."""
        self._rt.ensure_current()
        spec = kv.spec
        for address, slots in ((kv.key_plane(layer), keys), (kv.value_plane(layer), values)):
            pages = np.asarray(slots).reshape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
            host = np.ascontiguousarray(pages.transpose(0, 2, 1, 3), dtype=NUMPY_DTYPES[spec.dtype])
            self._rt.staging.upload(address, host.reshape(-1))

    def gather_rows(self, x: CudaTensor, indices: CudaTensor, out: CudaTensor) -> None:
        ops_dense.gather_rows(self._rt, x, indices, out, "gather_rows")

    # -- execution ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> graphs.CudaGraph:
        return graphs.capture(self._rt, fn)

    def capture_pieces(self, fn: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> graphs.CudaPieces:
        return graphs.capture_pieces(self._rt, fn)

    def synchronize(self) -> None:
        self._rt.synchronize()

    def setup_summary(self) -> str:
        return TuningStats.describe([self._linear.tuning_stats, self._fp8.tuning_stats])

    def unprepared_token_counts(self, key: str, token_counts: Sequence[int]) -> tuple[int, ...] | None:
        """Of the step sizes, those whose warm-up under `key` the cuBLASLt store has no record
        of; None with tuning off (nothing is timed lazily)."""
        store = self._linear.gemm.tuning if self._linear.gemm is not None else None
        if store is None:
            return None
        return tuple(n for n in token_counts if store.get(f"warm-up {key} {n}") is None)

    def record_prepared(self, key: str, token_counts: Sequence[int]) -> None:
        store = self._linear.gemm.tuning if self._linear.gemm is not None else None
        if store is not None:
            store.put_many({f"warm-up {key} {n}": b"" for n in token_counts})

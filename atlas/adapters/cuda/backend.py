"""CudaGpuBackend: the GPU port on an NVIDIA device through cuda-python.

Every op is one of our kernels (kernels/, compiled by NVRTC through the registry) or a
cuBLASLt call, enqueued on one stream; `download` and `synchronize` are the only waits.
Activations and the KV cache are bf16; weights bf16 [out, in]; accumulation fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda import checks, graphs, ops_attention, ops_dense, ops_sampling
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.kv_cache import CudaKvCache
from atlas.adapters.cuda.memory import PendingCopy, PoolStats
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import (
    NUMPY_DTYPES,
    Activation,
    AttentionMetadata,
    Capabilities,
    DType,
    HeadLayout,
    KvCacheSpec,
    LogprobsOut,
    SamplingTensors,
    dtype_of,
)


class CudaGpuBackend:
    """One NVIDIA GPU. `model_hint` (an HF model_type) and `quant` pick tuned kernels."""

    def __init__(
        self,
        device_ordinal: int = 0,
        kernel_cache_dir: Path | str | None = None,
        model_hint: str | None = None,
        quant: str = "bf16",
    ) -> None:
        cache_dir = Path(kernel_cache_dir) if kernel_cache_dir is not None else None
        self._rt = CudaRuntime(device_ordinal, cache_dir, model_hint, quant)
        self._linear = ops_dense.LinearOp(self._rt)
        self._capabilities = Capabilities(
            activation_dtype=DType.BF16,
            kv_dtypes=(DType.BF16, DType.FP8_E4M3) if self._fp8_cache_ok() else (DType.BF16,),
            supports_graphs=True,
            device_name=self._rt.device_name,
        )

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
    def runtime(self) -> CudaRuntime:
        """The device context (kernel stats, pool, stream) for tests and benchmarks."""
        return self._rt

    def memory_stats(self) -> PoolStats:
        return self._rt.pool.stats()

    def close(self) -> None:
        """Release the cached memory, staging buffers and cuBLASLt handle."""
        self._linear.close()
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
        self._rt.ensure_current()
        self._rt.forbid_in_capture("copy_from_host")
        checks.tensor(dst, "dst")
        host = np.ascontiguousarray(np.asarray(array), dtype=NUMPY_DTYPES[dst.dtype])
        if host.size != dst.num_elements:
            raise ValueError(f"copy_from_host: {host.size} elements into a tensor of {dst.num_elements}")
        self._rt.staging.upload(dst.address, host)

    def download(self, src: CudaTensor) -> np.ndarray:
        self._rt.ensure_current()
        self._rt.forbid_in_capture("download")
        checks.tensor(src, "src")
        out = np.empty(src.shape, dtype=NUMPY_DTYPES[src.dtype])
        self._rt.staging.download(src.address, out)
        return out

    def begin_download(self, src: CudaTensor) -> PendingCopy:
        self._rt.ensure_current()
        self._rt.forbid_in_capture("begin_download")
        checks.tensor(src, "src")
        return self._rt.downloads.begin(src.address, src.shape, NUMPY_DTYPES[src.dtype])

    def fill(self, dst: CudaTensor, value: float) -> None:
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

    def allocate_kv_cache(self, spec: KvCacheSpec) -> CudaKvCache:
        self._rt.ensure_current()
        self._rt.forbid_in_capture("allocate_kv_cache")
        if spec.dtype not in self._capabilities.kv_dtypes:
            supported = ", ".join(dtype.value for dtype in self._capabilities.kv_dtypes)
            raise ValueError(f"spec.dtype: {spec.dtype.value} KV caches are not supported on this GPU ({supported})")
        if spec.head_dim % 8:
            raise ValueError(f"spec.head_dim: {spec.head_dim} is not a multiple of 8")
        try:
            allocation = self._rt.pool.allocate(spec.total_bytes)
        except MemoryError as error:
            free, _ = self._rt.memory_info()
            fits = free // spec.bytes_per_block
            raise MemoryError(
                f"a KV cache of {spec.num_blocks} blocks needs {spec.total_bytes / 2**30:.2f} GiB; "
                f"{free / 2**30:.2f} GiB free holds {fits} blocks ({error})"
            ) from error
        return CudaKvCache(spec, allocation)

    def kv_to_host(self, kv: CudaKvCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
        self._rt.ensure_current()
        spec = kv.spec
        planes = []
        for address in (kv.key_plane(layer), kv.value_plane(layer)):
            raw = np.empty(spec.num_blocks * kv.page_bytes // spec.dtype.itemsize, dtype=NUMPY_DTYPES[spec.dtype])
            self._rt.staging.download(address, raw)
            planes.append(np.ascontiguousarray(kv.plane_to_slots(raw)))
        return planes[0], planes[1]

    # -- ops ----------------------------------------------------------------------------
    def embedding(self, token_ids: CudaTensor, table: CudaTensor, out: CudaTensor) -> None:
        ops_dense.gather_rows(self._rt, table, token_ids, out, "embedding")

    def gather_rows(self, x: CudaTensor, indices: CudaTensor, out: CudaTensor) -> None:
        ops_dense.gather_rows(self._rt, x, indices, out, "gather_rows")

    def rmsnorm(self, x: CudaTensor, weight: CudaTensor, eps: float, out: CudaTensor) -> None:
        ops_dense.rmsnorm(self._rt, x, None, weight, eps, out)

    def add_rmsnorm(self, x: CudaTensor, residual: CudaTensor, weight: CudaTensor, eps: float, out: CudaTensor) -> None:
        ops_dense.rmsnorm(self._rt, x, residual, weight, eps, out)

    def linear(self, x: CudaTensor, weight: CudaTensor, out: CudaTensor, bias: CudaTensor | None = None) -> None:
        self._linear(x, weight, out, bias)

    def linear_add(
        self, x: CudaTensor, weight: CudaTensor, residual: CudaTensor, scratch: CudaTensor, defer: bool = False
    ) -> bool:
        return self._linear.linear_add(x, weight, residual, scratch, defer)

    def fold_rmsnorm(self, norm_weight: CudaTensor, weight: CudaTensor) -> bool:
        return self._linear.fold_rmsnorm(norm_weight, weight)

    def rmsnorm_linear(
        self,
        x: CudaTensor,
        norm_weight: CudaTensor | None,
        eps: float,
        weight: CudaTensor,
        out: CudaTensor,
        normed: CudaTensor,
        bias: CudaTensor | None = None,
        add_first: CudaTensor | None = None,
    ) -> None:
        self._linear.rmsnorm_linear(x, norm_weight, eps, weight, out, normed, bias, add_first=add_first)

    def rmsnorm_gated_linear(
        self,
        x: CudaTensor,
        norm_weight: CudaTensor | None,
        eps: float,
        weight: CudaTensor,
        activation: Activation,
        out: CudaTensor,
        normed: CudaTensor,
        scratch: CudaTensor,
        add_first: CudaTensor | None = None,
    ) -> None:
        self._linear.rmsnorm_linear(x, norm_weight, eps, weight, out, normed, None, activation, scratch, add_first)

    def qkv_rope_cache(
        self,
        x: CudaTensor,
        norm_weight: CudaTensor | None,
        eps: float,
        weight: CudaTensor,
        bias: CudaTensor | None,
        meta: AttentionMetadata,
        rope_table: CudaTensor,
        kv: CudaKvCache,
        layer: int,
        heads: HeadLayout,
        q_out: CudaTensor,
        qkv: CudaTensor,
        normed: CudaTensor,
        q_norm: CudaTensor | None = None,
        k_norm: CudaTensor | None = None,
        add_first: CudaTensor | None = None,
    ) -> None:
        if q_norm is None and k_norm is None:
            targets = ops_attention.rope_targets(meta, rope_table, kv, layer, heads, q_out)
            if targets is not None and self._linear.rmsnorm_linear_rope(
                x, norm_weight, eps, weight, bias, q_out, targets, add_first
            ):
                return
        if bias is None and self._linear.rms_after_product(x, norm_weight, add_first):
            self._linear(x, weight, qkv, None)  # the RoPE kernel scales by the norm's RMS
            ops_attention.rope_and_cache(
                self._rt, qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm, eps, rms_source=x
            )
            return
        self.rmsnorm_linear(x, norm_weight, eps, weight, qkv, normed, bias, add_first)
        self.rope_and_cache(qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm, eps)

    def act_mul(self, x: CudaTensor, activation: Activation, out: CudaTensor) -> None:
        ops_dense.act_mul(self._rt, x, activation, out)

    def rope_and_cache(
        self,
        qkv: CudaTensor,
        meta: AttentionMetadata,
        rope_table: CudaTensor,
        kv: CudaKvCache,
        layer: int,
        heads: HeadLayout,
        q_out: CudaTensor,
        q_norm: CudaTensor | None = None,
        k_norm: CudaTensor | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        ops_attention.rope_and_cache(self._rt, qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm, norm_eps)

    def attention(
        self,
        q: CudaTensor,
        kv: CudaKvCache,
        layer: int,
        meta: AttentionMetadata,
        heads: HeadLayout,
        scale: float,
        out: CudaTensor,
        sliding_window: int | None = None,
    ) -> None:
        ops_attention.attention(self._rt, q, kv, layer, meta, heads, scale, out, sliding_window)

    def sample(
        self,
        logits: CudaTensor,
        params: SamplingTensors,
        out_token_ids: CudaTensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        ops_sampling.sample(self._rt, logits, params, out_token_ids, logprobs)

    def copy_blocks(self, kv: CudaKvCache, src_block_ids: CudaTensor, dst_block_ids: CudaTensor) -> None:
        ops_attention.copy_blocks(self._rt, kv, src_block_ids, dst_block_ids)

    # -- execution ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> graphs.CudaGraph:
        return graphs.capture(self._rt, fn)

    def synchronize(self) -> None:
        self._rt.synchronize()

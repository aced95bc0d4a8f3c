"""MockGpuBackend: every op of the GPU port in numpy, with real math.

Compute is float32. Storage follows each tensor's dtype (bf16 through ml_dtypes), so the mock
can run a model in float32 activations (the reference mode, default) or in bf16 activations
(rounding like a GPU). It is the reference the CUDA adapter is tested against, and it runs real
models on a laptop CPU. For tests it injects faults: make an op raise, cap allocations.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from atlas.adapters.mock.numerics import causal_attention, gather_f32
from atlas.adapters.mock.sampler import sample_rows
from atlas.adapters.mock.tensor import MockTensor
from atlas.domain.sampling import PackedSampling
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

_FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


class MockKvCache:
    """K and V of every layer as [num_layers, num_slots, num_kv_heads, head_dim], slot-major."""

    __slots__ = ("_spec", "keys", "values")

    def __init__(self, spec: KvCacheSpec) -> None:
        self._spec = spec
        shape = (spec.num_layers, spec.num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = np.zeros(shape, NUMPY_DTYPES[spec.dtype])
        self.values = np.zeros(shape, NUMPY_DTYPES[spec.dtype])

    @property
    def spec(self) -> KvCacheSpec:
        return self._spec


class _CompletedDownload:
    """Ops run synchronously on the mock, so a download is complete when it starts."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def wait(self) -> np.ndarray:
        return self._array


class _MockGraph:
    """No graphs on a CPU: replay re-runs the captured function on the buffers' contents."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class MockGpuBackend:
    """The numpy backend. `memory_bytes` caps what it may allocate (default: 80% of free RAM)."""

    def __init__(
        self, activation_dtype: DType = DType.F32, memory_bytes: int | None = None, emulate_graphs: bool = False
    ) -> None:
        """`emulate_graphs` reports graph support so the worker's graph path (padding, capture,
        replay over persistent buffers) runs on the CPU; replay re-runs the captured function."""
        self._activation_dtype = activation_dtype
        self._emulate_graphs = emulate_graphs
        self._total_bytes = memory_bytes if memory_bytes is not None else _default_memory_bytes()
        self._allocated_bytes = 0
        self._faults: dict[str, Exception] = {}
        self.op_counts: dict[str, int] = {}

    # -- identity -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "mock"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            activation_dtype=self._activation_dtype,
            kv_dtypes=(DType.F32, DType.BF16, DType.F16, DType.FP8_E4M3),
            supports_graphs=self._emulate_graphs,
            device_name=f"numpy on {os.cpu_count()} CPU cores",
        )

    # -- fault injection (tests) --------------------------------------------------------
    def inject_fault(self, op: str, error: Exception) -> None:
        """Make every later call of `op` (an op or memory method name) raise `error`."""
        self._faults[op] = error

    def clear_faults(self) -> None:
        self._faults.clear()

    def limit_memory(self, total_bytes: int) -> None:
        """Cap total allocations (tests of the startup memory check and of OOM handling)."""
        self._total_bytes = total_bytes

    def _enter(self, op: str) -> None:
        error = self._faults.get(op)
        if error is not None:
            raise error
        self.op_counts[op] = self.op_counts.get(op, 0) + 1

    # -- memory -------------------------------------------------------------------------
    def _allocate(self, shape: Sequence[int], dtype: DType) -> np.ndarray:
        self._enter("empty")
        num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        free_bytes = self._total_bytes - self._allocated_bytes
        if num_bytes > free_bytes:
            raise MemoryError(
                f"mock backend: cannot allocate {num_bytes / 2**20:.1f} MiB for {tuple(shape)} {dtype.value}; "
                f"{free_bytes / 2**20:.1f} MiB free of {self._total_bytes / 2**20:.1f} MiB"
            )
        array = np.empty(tuple(shape), NUMPY_DTYPES[dtype])
        self._allocated_bytes += num_bytes
        weakref.finalize(array, self._release, num_bytes)
        return array

    def _release(self, num_bytes: int) -> None:
        self._allocated_bytes -= num_bytes

    def empty(self, shape: Sequence[int], dtype: DType) -> MockTensor:
        return MockTensor(self._allocate(shape, dtype), dtype)

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> MockTensor:
        target = dtype or dtype_of(array)
        tensor = self.empty(array.shape, target)
        tensor.data[...] = array
        return tensor

    def copy_from_host(self, dst: MockTensor, array: np.ndarray) -> None:
        self._enter("copy_from_host")
        if array.size != dst.data.size:
            raise ValueError(f"copy_from_host: {array.size} elements into a tensor of {dst.data.size}")
        dst.data[...] = np.asarray(array).reshape(dst.data.shape)

    def download(self, src: MockTensor) -> np.ndarray:
        self._enter("download")
        return src.data.copy()

    def begin_download(self, src: MockTensor) -> _CompletedDownload:
        self._enter("download")
        return _CompletedDownload(src.data.copy())

    def fill(self, dst: MockTensor, value: float) -> None:
        dst.data[...] = value

    def memory_info(self) -> tuple[int, int]:
        return self._total_bytes - self._allocated_bytes, self._total_bytes

    def allocate_kv_cache(self, spec: KvCacheSpec) -> MockKvCache:
        self._enter("allocate_kv_cache")
        free_bytes = self._total_bytes - self._allocated_bytes
        if spec.total_bytes > free_bytes:
            fits = free_bytes // spec.bytes_per_block
            raise MemoryError(
                f"mock backend: a KV cache of {spec.num_blocks} blocks needs {spec.total_bytes / 2**20:.1f} MiB; "
                f"{free_bytes / 2**20:.1f} MiB free holds {fits} blocks"
            )
        cache = MockKvCache(spec)
        self._allocated_bytes += spec.total_bytes
        weakref.finalize(cache.keys, self._release, spec.total_bytes)
        return cache

    def kv_to_host(self, kv: MockKvCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
        spec = kv.spec
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return kv.keys[layer].reshape(shape).copy(), kv.values[layer].reshape(shape).copy()

    # -- ops ----------------------------------------------------------------------------
    def embedding(self, token_ids: MockTensor, table: MockTensor, out: MockTensor) -> None:
        self._enter("embedding")
        ids = token_ids.data
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise ValueError(f"embedding: token id out of range [0, {table.shape[0]})")
        out.data[...] = table.data[ids]

    def rmsnorm(self, x: MockTensor, weight: MockTensor, eps: float, out: MockTensor) -> None:
        self._enter("rmsnorm")
        out.data[...] = _rmsnorm(x.as_f32(), weight.weight_f32(), eps)

    def add_rmsnorm(self, x: MockTensor, residual: MockTensor, weight: MockTensor, eps: float, out: MockTensor) -> None:
        self._enter("add_rmsnorm")
        residual.data[...] = residual.as_f32() + x.as_f32()
        out.data[...] = _rmsnorm(residual.as_f32(), weight.weight_f32(), eps)

    def linear(self, x: MockTensor, weight: MockTensor, out: MockTensor, bias: MockTensor | None = None) -> None:
        self._enter("linear")
        if x.shape[1] != weight.shape[1] or out.shape != (x.shape[0], weight.shape[0]):
            raise ValueError(f"linear: x {x.shape} @ weight {weight.shape}.T does not fit out {out.shape}")
        result = x.as_f32() @ weight.weight_f32().T
        if bias is not None:
            result += bias.weight_f32()
        out.data[...] = result

    def linear_add(
        self, x: MockTensor, weight: MockTensor, residual: MockTensor, scratch: MockTensor, defer: bool = False
    ) -> bool:
        self.linear(x, weight, scratch)
        if defer:  # the next norm adds it (add_first), as CUDA does past its GEMV sizes
            return True
        self._enter("add")
        residual.data[...] = residual.as_f32() + scratch.as_f32()
        return False

    def fold_rmsnorm(self, norm_weight: MockTensor, weight: MockTensor) -> bool:
        # The mock keeps the reference's order of operations (the norm weight times x), so that
        # it rounds as transformers does; CUDA folds where that removes a kernel.
        return False

    def _rmsnorm_input(
        self, x: MockTensor, norm_weight: MockTensor | None, eps: float, normed: MockTensor, add_first: MockTensor | None
    ) -> None:
        if add_first is not None:
            self._enter("add")
            x.data[...] = x.as_f32() + add_first.as_f32()
        if norm_weight is not None:
            self.rmsnorm(x, norm_weight, eps, normed)
        else:  # the projection carries the norm weight (fold_rmsnorm)
            self._enter("rmsnorm")
            normed.data[...] = _rmsnorm(x.as_f32(), np.float32(1.0), eps)

    def rmsnorm_linear(
        self,
        x: MockTensor,
        norm_weight: MockTensor | None,
        eps: float,
        weight: MockTensor,
        out: MockTensor,
        normed: MockTensor,
        bias: MockTensor | None = None,
        add_first: MockTensor | None = None,
    ) -> None:
        self._rmsnorm_input(x, norm_weight, eps, normed, add_first)
        self.linear(normed, weight, out, bias)

    def rmsnorm_gated_linear(
        self,
        x: MockTensor,
        norm_weight: MockTensor | None,
        eps: float,
        weight: MockTensor,
        activation: Activation,
        out: MockTensor,
        normed: MockTensor,
        scratch: MockTensor,
        add_first: MockTensor | None = None,
    ) -> None:
        self._rmsnorm_input(x, norm_weight, eps, normed, add_first)
        self.linear(normed, weight, scratch)
        self.act_mul(scratch, activation, out)

    def rope_and_cache(
        self,
        qkv: MockTensor,
        meta: AttentionMetadata,
        rope_table: MockTensor,
        kv: MockKvCache,
        layer: int,
        heads: HeadLayout,
        q_out: MockTensor,
        q_norm: MockTensor | None = None,
        k_norm: MockTensor | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        self._enter("rope_and_cache")
        num_tokens, dim = qkv.shape[0], heads.head_dim
        fused = qkv.as_f32()
        q = fused[:, : heads.q_size].reshape(num_tokens, heads.num_q_heads, dim)
        k = fused[:, heads.q_size : heads.q_size + heads.kv_size].reshape(num_tokens, heads.num_kv_heads, dim)
        v = fused[:, heads.q_size + heads.kv_size :].reshape(num_tokens, heads.num_kv_heads, dim)
        if q_norm is not None and k_norm is not None:
            q = _rmsnorm(q, q_norm.weight_f32(), norm_eps)
            k = _rmsnorm(k, k_norm.weight_f32(), norm_eps)
        table = rope_table.weight_f32()[meta.positions.data]  # [N, r]
        q_out.data[...] = _rotate(q, table).reshape(num_tokens, heads.q_size)
        slots = meta.slot_mapping.data
        k_scale, v_scale = kv.spec.layer_scales(layer)
        kv.keys[layer, slots] = _quantize(_rotate(k, table), k_scale, kv.spec.dtype)
        kv.values[layer, slots] = _quantize(v, v_scale, kv.spec.dtype)

    def qkv_rope_cache(
        self,
        x: MockTensor,
        norm_weight: MockTensor | None,
        eps: float,
        weight: MockTensor,
        bias: MockTensor | None,
        meta: AttentionMetadata,
        rope_table: MockTensor,
        kv: MockKvCache,
        layer: int,
        heads: HeadLayout,
        q_out: MockTensor,
        qkv: MockTensor,
        normed: MockTensor,
        q_norm: MockTensor | None = None,
        k_norm: MockTensor | None = None,
        add_first: MockTensor | None = None,
    ) -> None:
        self.rmsnorm_linear(x, norm_weight, eps, weight, qkv, normed, bias, add_first)
        self.rope_and_cache(qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm, eps)

    def attention(
        self,
        q: MockTensor,
        kv: MockKvCache,
        layer: int,
        meta: AttentionMetadata,
        heads: HeadLayout,
        scale: float,
        out: MockTensor,
        sliding_window: int | None = None,
    ) -> None:
        self._enter("attention")
        block_size = kv.spec.block_size
        k_scale, v_scale = kv.spec.layer_scales(layer)
        query_start = meta.query_start_loc.data
        seq_lens = meta.seq_lens.data
        block_tables = meta.block_tables.data
        queries = q.as_f32().reshape(-1, heads.num_kv_heads, heads.num_q_heads // heads.num_kv_heads, heads.head_dim)
        result = np.empty(queries.shape, np.float32)
        for seq in range(meta.num_seqs):
            start, stop = int(query_start[seq]), int(query_start[seq + 1])
            context_len = int(seq_lens[seq])
            if stop == start:
                continue
            num_blocks = -(-context_len // block_size)
            slots = (block_tables[seq, :num_blocks, None] * block_size + np.arange(block_size)).reshape(-1)
            slots = slots[:context_len]
            keys = gather_f32(kv.keys[layer], slots, k_scale)  # [L, Hkv, D]
            values = gather_f32(kv.values[layer], slots, v_scale)
            result[start:stop] = causal_attention(
                queries[start:stop], keys, values, context_len - (stop - start), scale, sliding_window
            )
        out.data[...] = result.reshape(out.shape)

    def act_mul(self, x: MockTensor, activation: Activation, out: MockTensor) -> None:
        self._enter("act_mul")
        values = x.as_f32()
        half = values.shape[1] // 2
        gate, up = values[:, :half], values[:, half:]
        if activation is Activation.SILU:
            activated = gate / (1.0 + np.exp(-gate))
        else:
            activated = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)))
        out.data[...] = activated * up

    def gather_rows(self, x: MockTensor, indices: MockTensor, out: MockTensor) -> None:
        self._enter("gather_rows")
        out.data[...] = x.data[indices.data]

    def sample(
        self,
        logits: MockTensor,
        params: SamplingTensors,
        out_token_ids: MockTensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        self._enter("sample")
        packed = PackedSampling(
            temperature=params.temperature.data,
            top_k=params.top_k.data,
            top_p=params.top_p.data,
            min_p=params.min_p.data,
            seeds=params.seeds.data,
            counters=params.counters.data,
            repetition_penalty=params.repetition_penalty.data,
            presence_penalty=params.presence_penalty.data,
            frequency_penalty=params.frequency_penalty.data,
            penalty_offsets=params.penalty_offsets.data,
            penalty_token_ids=params.penalty_token_ids.data,
            penalty_output_counts=params.penalty_output_counts.data,
            bias_offsets=params.bias_offsets.data,
            bias_token_ids=params.bias_token_ids.data,
            bias_values=params.bias_values.data,
            num_rows=params.num_rows,
            all_greedy=params.all_greedy,
            any_penalties=params.any_penalties,
            any_bias=params.any_bias,
        )
        num_top = logprobs.num_top if logprobs is not None else None
        result = sample_rows(logits.as_f32()[: params.num_rows], packed, num_top)
        out_token_ids.data[: params.num_rows] = result.token_ids
        if logprobs is not None:
            logprobs.sampled.data[: params.num_rows] = result.sampled_logprobs
            if logprobs.num_top:
                logprobs.top_ids.data[: params.num_rows] = result.top_ids
                logprobs.top_logprobs.data[: params.num_rows] = result.top_logprobs

    def copy_blocks(self, kv: MockKvCache, src_block_ids: MockTensor, dst_block_ids: MockTensor) -> None:
        self._enter("copy_blocks")
        block_size = kv.spec.block_size
        offsets = np.arange(block_size)
        src = (src_block_ids.data[:, None] * block_size + offsets).reshape(-1)
        dst = (dst_block_ids.data[:, None] * block_size + offsets).reshape(-1)
        kv.keys[:, dst] = kv.keys[:, src]
        kv.values[:, dst] = kv.values[:, src]

    # -- execution ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> _MockGraph:
        return _MockGraph(fn)

    def synchronize(self) -> None:
        self._enter("synchronize")


def _rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def _quantize(x: np.ndarray, scale: float, dtype: DType) -> np.ndarray:
    """What a cache of `dtype` stores for x: x / scale, saturated at the format's largest finite
    value for FP8 (as the CUDA kernels' satfinite conversion), rounded to nearest even."""
    if not dtype.is_quantized:
        return x
    return np.clip(x / np.float32(scale), -_FP8_MAX, _FP8_MAX).astype(NUMPY_DTYPES[dtype])


def _rotate(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Half-split rotation of the first r dims of each head: x [N, heads, D], table [N, r]."""
    rotary_dim = table.shape[1]
    half = rotary_dim // 2
    cos = table[:, None, :half]
    sin = table[:, None, half:]
    first, second = x[..., :half], x[..., half:rotary_dim]
    rotated = x.copy()
    rotated[..., :half] = first * cos - second * sin
    rotated[..., half:rotary_dim] = second * cos + first * sin
    return rotated


def _default_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.8)
    except OSError:
        pass
    return 8 * 2**30

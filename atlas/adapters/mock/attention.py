"""The mock's attention kind: a slot-major KV cache, q/k/v with RoPE into it, and causal
attention with windows, sinks, soft-capping and gated outputs, in numpy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from atlas.adapters.mock.dense import MockLinear, MockNorm, apply_norm
from atlas.adapters.mock.numerics import causal_attention, gather_f32
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.gpu import NUMPY_DTYPES, DType
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HostAttention, KvCacheSpec

if TYPE_CHECKING:
    from atlas.adapters.mock.backend import MockGpuBackend

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

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of `layer` as [num_blocks, block_size, num_kv_heads, head_dim] (tests)."""
        spec = self._spec
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return self.keys[layer].reshape(shape).copy(), self.values[layer].reshape(shape).copy()


@dataclass(frozen=True, slots=True)
class MockAttentionLayer:
    layer: AttentionLayer
    input_norm: MockNorm
    qkv: MockLinear
    q_norm: MockNorm | None
    k_norm: MockNorm | None
    sinks: np.ndarray | None  # [Hq] f32


class MockAttention:
    """`AttentionKernels` in numpy."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self._backend = backend

    def allocate_cache(self, spec: KvCacheSpec) -> MockKvCache:
        backend = self._backend
        backend.enter("attention.allocate_cache")
        if spec.dtype not in backend.capabilities.kv_dtypes:
            raise ValueError(f"spec.dtype: {spec.dtype.value} KV caches are not supported on the mock")
        free_bytes = backend.free_bytes()
        if spec.total_bytes > free_bytes:
            fits = free_bytes // spec.bytes_per_block
            raise MemoryError(
                f"mock backend: a KV cache of {spec.num_blocks} blocks needs {spec.total_bytes / 2**20:.1f} MiB; "
                f"{free_bytes / 2**20:.1f} MiB free holds {fits} blocks"
            )
        cache = MockKvCache(spec)
        backend.count(cache.keys, spec.total_bytes)
        return cache

    def prepare(self, host: HostAttention, layer: AttentionLayer) -> MockAttentionLayer:
        self._backend.enter("attention.prepare")
        heads = layer.heads
        width = layer.q_width + 2 * heads.kv_size
        if host.qkv.out_features != width:
            raise ValueError(f"qkv: {host.qkv.out_features} rows, the heads need {width}")
        if host.sinks is not None and np.shape(host.sinks) != (heads.num_q_heads,):
            raise ValueError(f"sinks: shape {np.shape(host.sinks)} is not [{heads.num_q_heads}]")
        dense = self._backend.dense
        sinks = None if host.sinks is None else np.asarray(host.sinks, np.float32).copy()
        return MockAttentionLayer(layer, dense.norm(host.input_norm), dense.linear(host.qkv),
                                  dense.norm(host.q_norm), dense.norm(host.k_norm), sinks)

    def project(
        self, x: MockTensor, layer: MockAttentionLayer, meta: AttentionMetadata, cache: MockKvCache, q_out: MockTensor
    ) -> None:
        self._backend.enter("attention.project")
        dense = self._backend.dense
        spec, heads = layer.layer, layer.layer.heads
        num_tokens, dim = x.shape[0], heads.head_dim
        if q_out.shape != (num_tokens, spec.q_width):
            raise ValueError(f"q_out: shape {list(q_out.shape)} is not [{num_tokens}, {spec.q_width}]")
        normed = dense.rounded(apply_norm(x.as_f32(), layer.input_norm))
        fused = dense.rounded(layer.qkv.apply(normed))
        q = fused[:, : heads.q_size].reshape(num_tokens, heads.num_q_heads, dim)
        gate = fused[:, heads.q_size : spec.q_width]
        k = fused[:, spec.q_width : spec.q_width + heads.kv_size].reshape(num_tokens, heads.num_kv_heads, dim)
        v = fused[:, spec.q_width + heads.kv_size :].reshape(num_tokens, heads.num_kv_heads, dim)
        q, k = apply_norm(q, layer.q_norm), apply_norm(k, layer.k_norm)
        if spec.rope_table is not None:
            table = spec.rope_table.weight_f32()[meta.positions.data]  # [N, r]
            q, k = _rotate(q, table), _rotate(k, table)
        q_out.data[...] = np.concatenate([q.reshape(num_tokens, heads.q_size), gate], axis=1)
        slots = meta.slot_mapping.data
        stored = slots >= 0  # a graph's padding rows may write nowhere
        k_scale, v_scale = cache.spec.layer_scales(spec.cache_layer)
        cache.keys[spec.cache_layer, slots[stored]] = _quantize(k[stored], k_scale, cache.spec.dtype)
        cache.values[spec.cache_layer, slots[stored]] = _quantize(v[stored], v_scale, cache.spec.dtype)

    def attend(
        self, q: MockTensor, layer: MockAttentionLayer, meta: AttentionMetadata, cache: MockKvCache, out: MockTensor
    ) -> None:
        self._backend.enter("attention.attend")
        spec, heads = layer.layer, layer.layer.heads
        if q.shape != (meta.num_tokens, spec.q_width) or out.shape != (meta.num_tokens, heads.q_size):
            raise ValueError(
                f"q {list(q.shape)} / out {list(out.shape)}: not [N, {spec.q_width}] / [N, {heads.q_size}]"
            )
        block_size = cache.spec.block_size
        k_scale, v_scale = cache.spec.layer_scales(spec.cache_layer)
        query_start, seq_lens = meta.query_start_loc.data, meta.seq_lens.data
        group = heads.num_q_heads // heads.num_kv_heads
        values = q.as_f32()
        queries = values[:, : heads.q_size].reshape(-1, heads.num_kv_heads, group, heads.head_dim)
        result = np.zeros(queries.shape, np.float32)
        sinks = None if layer.sinks is None else layer.sinks.reshape(heads.num_kv_heads, group)
        tables = _tables_through_shared_prefix(meta, block_size)
        for seq in range(meta.num_seqs):
            start, stop = int(query_start[seq]), int(query_start[seq + 1])
            context_len = int(seq_lens[seq])
            if stop == start:
                continue
            num_blocks = -(-context_len // block_size)
            slots = (tables[seq, :num_blocks, None] * block_size + np.arange(block_size)).reshape(-1)
            slots = slots[:context_len]
            keys = gather_f32(cache.keys[spec.cache_layer], slots, k_scale)  # [L, Hkv, D]
            vals = gather_f32(cache.values[spec.cache_layer], slots, v_scale)
            result[start:stop] = causal_attention(queries[start:stop], keys, vals, context_len - (stop - start),
                                                  spec.scale, spec.sliding_window, spec.logit_softcap, sinks)
        attended = result.reshape(meta.num_tokens, heads.q_size)
        if spec.gated_output:
            attended = attended / (1.0 + np.exp(-values[:, heads.q_size :]))
        out.data[...] = attended


def _tables_through_shared_prefix(meta: AttentionMetadata, block_size: int) -> np.ndarray:
    """The step's block tables, with each decode row that shares the named prefix
    (`meta.shared_prefix`) reading its first pages through the anchor row's table, as CUDA's
    cascade kernel does: a prefix named wrongly then changes the mock's output too."""
    tables = meta.block_tables.data
    if meta.shared_prefix is None or not meta.shared_prefix_len:
        return tables
    named = meta.shared_prefix.data
    length, anchor, sharing = int(named[0]), int(named[1]), np.flatnonzero(named[2 : 2 + meta.num_seqs])
    query_lens = np.diff(meta.query_start_loc.data[: meta.num_seqs + 1])
    sharing = sharing[query_lens[sharing] == 1]
    if length <= 0 or not len(sharing):
        return tables
    tables = tables.copy()
    pages = -(-length // block_size)
    tables[sharing, :pages] = tables[anchor, :pages]
    return tables


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

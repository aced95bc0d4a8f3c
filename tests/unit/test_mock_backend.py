"""MockGpuBackend ops against direct float64 computations, plus its fault injection."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.ports.gpu import Activation, AttentionMetadata, DType, HeadLayout, KvCacheSpec


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_add_rmsnorm_updates_residual_and_normalises(rng):
    backend = MockGpuBackend()
    x = rng.standard_normal((5, 32)).astype(np.float32)
    residual = rng.standard_normal((5, 32)).astype(np.float32)
    weight = rng.standard_normal(32).astype(np.float32)
    t_res = backend.upload(residual)
    out = backend.empty((5, 32), DType.F32)
    backend.fill(out, float("nan"))
    backend.add_rmsnorm(backend.upload(x), t_res, backend.upload(weight), 1e-6, out)
    summed = residual.astype(np.float64) + x
    expected = summed / np.sqrt((summed**2).mean(-1, keepdims=True) + 1e-6) * weight
    assert rel(backend.download(t_res), summed) < 1e-6
    assert rel(backend.download(out), expected) < 1e-6


def test_linear_with_bias_in_bf16_storage(rng):
    backend = MockGpuBackend(activation_dtype=DType.BF16)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    weight = rng.standard_normal((8, 16)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    out = backend.empty((3, 8), DType.BF16)
    tx, tw, tb = backend.upload(x, DType.BF16), backend.upload(weight, DType.BF16), backend.upload(bias, DType.BF16)
    backend.linear(tx, tw, out, tb)
    expected = backend.download(tx).astype(np.float64) @ backend.download(tw).astype(np.float64).T
    expected += backend.download(tb).astype(np.float64)
    assert 1e-4 < rel(backend.download(out), expected) < 1e-2  # rounded to bf16, not more


@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
def test_act_mul(activation, rng):
    backend = MockGpuBackend()
    x = rng.standard_normal((4, 20)).astype(np.float32)
    out = backend.empty((4, 10), DType.F32)
    backend.act_mul(backend.upload(x), activation, out)
    gate, up = x[:, :10].astype(np.float64), x[:, 10:]
    if activation is Activation.SILU:
        act = gate / (1 + np.exp(-gate))
    else:
        act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    assert rel(backend.download(out), act * up) < 1e-6


def _paged_case(backend, rng, context_lens, query_lens, heads, block_size, num_blocks):
    """Random K/V written through rope_and_cache with an identity rotation, scattered blocks."""
    spec = KvCacheSpec(1, num_blocks, block_size, heads.num_kv_heads, heads.head_dim, DType.F32)
    kv = backend.allocate_kv_cache(spec)
    free = list(rng.permutation(num_blocks))
    tables, all_k, all_v = [], [], []
    width = max(-(-c // block_size) for c in context_lens)
    for context_len in context_lens:
        count = -(-context_len // block_size)
        blocks = [int(b) for b in free[:count]]
        free = free[count:]
        tables.append(blocks + [0] * (width - count))
        positions = np.arange(context_len)
        slots = np.asarray(blocks)[positions // block_size] * block_size + positions % block_size
        k = rng.standard_normal((context_len, heads.num_kv_heads, heads.head_dim)).astype(np.float32)
        v = rng.standard_normal((context_len, heads.num_kv_heads, heads.head_dim)).astype(np.float32)
        kv.keys[0, slots] = k
        kv.values[0, slots] = v
        all_k.append(k)
        all_v.append(v)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    meta = AttentionMetadata(
        positions=backend.upload(np.zeros(int(query_start[-1]), np.int32)),
        slot_mapping=backend.upload(np.zeros(int(query_start[-1]), np.int32)),
        query_start_loc=backend.upload(query_start),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        block_tables=backend.upload(np.asarray(tables, np.int32)),
        num_tokens=int(query_start[-1]),
        num_seqs=len(context_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )
    return kv, meta, all_k, all_v, query_start


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_a_direct_loop(window, rng):
    backend = MockGpuBackend()
    heads = HeadLayout(num_q_heads=6, num_kv_heads=2, head_dim=8)
    context_lens, query_lens = [9, 1, 17], [9, 1, 4]
    kv, meta, keys, values, query_start = _paged_case(backend, rng, context_lens, query_lens, heads, 4, 16)
    q = rng.standard_normal((sum(query_lens), heads.q_size)).astype(np.float32)
    out = backend.empty(q.shape, DType.F32)
    backend.fill(out, float("nan"))
    backend.attention(backend.upload(q), kv, 0, meta, heads, 0.3, out, window)
    got = backend.download(out).reshape(-1, heads.num_q_heads, heads.head_dim)
    group = heads.num_q_heads // heads.num_kv_heads
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        for i in range(query_len):
            row = query_start[seq] + i
            position = context_len - query_len + i
            lo = 0 if window is None else max(0, position - window + 1)
            for h in range(heads.num_q_heads):
                k = keys[seq][lo : position + 1, h // group].astype(np.float64)
                v = values[seq][lo : position + 1, h // group].astype(np.float64)
                scores = k @ q[row].reshape(heads.num_q_heads, -1)[h] * 0.3
                weights = np.exp(scores - scores.max())
                expected = weights @ v / weights.sum()
                assert rel(got[row, h], expected) < 1e-5


def test_rope_rotates_pairs_and_writes_slots(rng):
    backend = MockGpuBackend()
    heads = HeadLayout(2, 1, 8)
    spec = KvCacheSpec(2, 4, 4, 1, 8, DType.F32)
    kv = backend.allocate_kv_cache(spec)
    qkv = rng.standard_normal((3, heads.q_size + 2 * heads.kv_size)).astype(np.float32)
    angles = rng.uniform(0, 6, size=(10, 3))  # rotary dim 6 of 8: the last two dims pass through
    table = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    positions = np.array([7, 0, 3], np.int32)
    slots = np.array([5, 14, 2], np.int32)
    meta = AttentionMetadata(
        backend.upload(positions), backend.upload(slots), backend.upload(np.array([0, 3], np.int32)),
        backend.upload(np.array([8], np.int32)), backend.upload(np.zeros((1, 4), np.int32)), 3, 1, 3, 8,
    )
    q_out = backend.empty((3, heads.q_size), DType.F32)
    backend.rope_and_cache(backend.upload(qkv), meta, backend.upload(table), kv, 1, heads, q_out)

    def rotate(x, position):
        c, s = np.cos(angles[position]), np.sin(angles[position])
        y = x.astype(np.float64).copy()
        y[:3], y[3:6] = x[:3] * c - x[3:6] * s, x[3:6] * c + x[:3] * s
        return y

    keys, vals = backend.kv_to_host(kv, 1)
    for t in range(3):
        for h in range(2):
            assert rel(backend.download(q_out)[t, h * 8 : h * 8 + 8], rotate(qkv[t, h * 8 : h * 8 + 8], positions[t])) < 1e-6
        block, offset = divmod(int(slots[t]), 4)
        assert rel(keys[block, offset, 0], rotate(qkv[t, 16:24], positions[t])) < 1e-6
        assert np.array_equal(vals[block, offset, 0], qkv[t, 24:32])
    assert not np.any(backend.kv_to_host(kv, 0)[0])  # layer 0 untouched


def test_copy_blocks_copies_every_layer(rng):
    backend = MockGpuBackend()
    kv = backend.allocate_kv_cache(KvCacheSpec(3, 6, 4, 2, 4, DType.F32))
    kv.keys[...] = rng.standard_normal(kv.keys.shape)
    kv.values[...] = rng.standard_normal(kv.values.shape)
    before_k = [backend.kv_to_host(kv, layer)[0] for layer in range(3)]
    backend.copy_blocks(kv, backend.upload(np.array([1, 4], np.int32)), backend.upload(np.array([5, 0], np.int32)))
    for layer in range(3):
        after = backend.kv_to_host(kv, layer)[0]
        assert np.array_equal(after[5], before_k[layer][1]) and np.array_equal(after[0], before_k[layer][4])
        assert np.array_equal(after[2], before_k[layer][2])


def test_fault_injection_and_memory_cap():
    backend = MockGpuBackend(memory_bytes=1 << 20)
    backend.inject_fault("linear", RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        backend.linear(backend.empty((1, 4), DType.F32), backend.empty((4, 4), DType.F32), backend.empty((1, 4), DType.F32))
    backend.clear_faults()
    with pytest.raises(MemoryError, match="MiB free"):
        backend.empty((1 << 20,), DType.F32)
    held = backend.empty((1 << 17,), DType.F32)  # half the budget
    free_before = backend.memory_info()[0]
    del held
    assert backend.memory_info()[0] == free_before + (1 << 19)
    with pytest.raises(MemoryError, match="holds"):
        backend.allocate_kv_cache(KvCacheSpec(4, 1000, 16, 8, 64, DType.F32))


def test_fp8_cache_stores_scaled_saturated_e4m3(rng):
    """An FP8 cache holds E4M3 of k / k_scale and v / v_scale per layer, saturated at +-448."""
    backend = MockGpuBackend()
    heads = HeadLayout(2, 1, 8)
    spec = KvCacheSpec(2, 4, 4, 1, 8, DType.FP8_E4M3, ((1.0, 1.0), (0.5, 4.0)))
    kv = backend.allocate_kv_cache(spec)
    qkv = rng.standard_normal((2, heads.q_size + 2 * heads.kv_size)).astype(np.float32) * 3
    qkv[1, 24] = 1000.0  # v / 4 = 250 fits; k below saturates
    qkv[1, 16] = -300.0  # k / 0.5 = -600: saturates at -448
    table = np.concatenate([np.ones((4, 4)), np.zeros((4, 4))], 1).astype(np.float32)  # identity rotation
    meta = AttentionMetadata(
        backend.upload(np.array([0, 1], np.int32)), backend.upload(np.array([3, 9], np.int32)),
        backend.upload(np.array([0, 2], np.int32)), backend.upload(np.array([2], np.int32)),
        backend.upload(np.zeros((1, 4), np.int32)), 2, 1, 2, 2,
    )
    backend.rope_and_cache(backend.upload(qkv), meta, backend.upload(table), kv, 1, heads,
                           backend.empty((2, heads.q_size), DType.F32))
    keys, values = backend.kv_to_host(kv, 1)
    assert keys.dtype == ml_dtypes.float8_e4m3fn
    for token, slot in enumerate((3, 9)):
        block, offset = divmod(slot, 4)
        k = np.clip(qkv[token, 16:24] / 0.5, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        v = (qkv[token, 24:32] / 4.0).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(keys[block, offset, 0].view(np.uint8), k.view(np.uint8))
        assert np.array_equal(values[block, offset, 0].view(np.uint8), v.view(np.uint8))
    assert float(keys[2, 1, 0, 0]) == -448.0
    stored = keys[0, 3, 0].astype(np.float64) * 0.5
    assert 0 < rel(stored, qkv[0, 16:24]) < 0.07  # E4M3 keeps 3 mantissa bits: rounded, not more


def test_paged_attention_reads_fp8_cache_times_its_scales(rng):
    """Attention over an FP8 cache equals attention over its dequantized values (stored * scale)."""
    backend = MockGpuBackend()
    heads = HeadLayout(num_q_heads=4, num_kv_heads=2, head_dim=8)
    context_lens, query_lens = [9, 6], [3, 1]
    exact, meta, _, _, _ = _paged_case(backend, rng, context_lens, query_lens, heads, 4, 8)
    k_scale, v_scale = 0.25, 3.0
    spec = KvCacheSpec(1, 8, 4, 2, 8, DType.FP8_E4M3, ((k_scale, v_scale),))
    fp8 = backend.allocate_kv_cache(spec)
    fp8.keys[...] = (exact.keys / k_scale).astype(ml_dtypes.float8_e4m3fn)
    fp8.values[...] = (exact.values / v_scale).astype(ml_dtypes.float8_e4m3fn)
    dequantized = backend.allocate_kv_cache(KvCacheSpec(1, 8, 4, 2, 8, DType.F32))
    dequantized.keys[...] = fp8.keys.astype(np.float32) * k_scale
    dequantized.values[...] = fp8.values.astype(np.float32) * v_scale
    q = backend.upload(rng.standard_normal((sum(query_lens), heads.q_size)).astype(np.float32))
    outs = []
    for cache in (fp8, dequantized, exact):
        out = backend.empty((sum(query_lens), heads.q_size), DType.F32)
        backend.attention(q, cache, 0, meta, heads, 0.35, out)
        outs.append(backend.download(out))
    assert rel(outs[0], outs[1]) < 1e-6
    assert 1e-3 < rel(outs[0], outs[2]) < 0.1  # the quantization shows, within E4M3's precision

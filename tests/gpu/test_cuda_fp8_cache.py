"""The FP8 (E4M3) KV cache on CUDA: the RoPE + cache write and every attention kernel that reads
the cache (decode on tensor cores in each of its shapes, prefill, mixed batches) against the mock
reading the same bytes; and a whole model's batched decode over it against transformers."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from cuda_harness import BF16_TOLERANCE, bf16, host, paged_case, poisoned, rel_l2, upload_metadata

from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import HeadLayout, KvCacheSpec

pytestmark = pytest.mark.gpu

FP8 = ml_dtypes.float8_e4m3fn
K_SCALE, V_SCALE = 0.75, 1.5  # away from 1 so that a scale applied twice, or not at all, shows


def _fp8_spec(case) -> KvCacheSpec:
    heads = case.heads
    return KvCacheSpec(1, case.num_blocks, case.block_size, heads.num_kv_heads, heads.head_dim, DType.FP8_E4M3,
                       ((K_SCALE, V_SCALE),))


def _quantized(case) -> tuple[np.ndarray, np.ndarray]:
    """The case's K and V as the cache stores them (NaN outside the contexts stays NaN)."""
    return (case.keys / K_SCALE).astype(FP8), (case.values / V_SCALE).astype(FP8)


def _cuda_fp8_cache(backend, case):
    from atlas.adapters.cuda.tensor import CudaTensor

    spec = _fp8_spec(case)
    kv = backend.attention.allocate_cache(spec)
    for address, slots in zip((kv.key_plane(0), kv.value_plane(0)), _quantized(case), strict=True):
        pages = slots.reshape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim).transpose(0, 2, 1, 3)
        raw = np.ascontiguousarray(pages).view(np.uint8).reshape(-1)
        backend.copy_from_host(CudaTensor(address, raw.shape, DType.U8, kv), raw)
    return kv


def _mock_fp8_cache(backend, case):
    kv = backend.attention.allocate_cache(_fp8_spec(case))
    kv.keys[0], kv.values[0] = _quantized(case)
    return kv


FP8_ATTENTION_CASES = [
    # (heads, context lens, query lens, sliding window, block size)
    (HeadLayout(8, 8, 64), [1, 17, 64, 129], [1, 17, 64, 129], None, 16),  # MHA prompts
    (HeadLayout(8, 2, 128), [300, 45, 1000, 7], [1, 1, 1, 1], None, 16),  # GQA 4 decode
    (HeadLayout(32, 4, 128), [513, 90, 33, 2000], [1, 90, 5, 1], None, 16),  # GQA 8 mixed, prefix-cached
    (HeadLayout(9, 3, 64), [200, 31, 96], [50, 1, 96], None, 32),  # SmolLM2, chunked prefill
    (HeadLayout(8, 2, 128), [700, 260, 3], [1, 100, 3], 128, 16),  # sliding window
    (HeadLayout(16, 2, 64), [3000, 2500], [1, 1], None, 16),  # long decode: split-K
    (HeadLayout(4, 1, 256), [300, 65], [1, 65], None, 16),  # head_dim 256
    (HeadLayout(24, 2, 128), [16, 17, 15, 1, 300], [1, 1, 1, 1, 1], None, 8),  # GQA 12, tile edges, block 8
    (HeadLayout(8, 2, 64), [999, 64, 130], [1, 1, 1], 100, 64),  # decode window off tile edges
    # batches whose blocks take each head-dim-128 FP8 decode shape (132 SMs): (8, 4), (4, 6), (4, 3) in waves
    (HeadLayout(32, 8, 128), [37 * i % 700 + 1 for i in range(8)], [1] * 8, None, 16),
    (HeadLayout(32, 8, 128), [53 * i % 600 + 1 for i in range(24)], [1] * 24, None, 16),
    (HeadLayout(32, 8, 128), [29 * i % 500 + 1 for i in range(70)], [1] * 70, None, 16),
]


@pytest.mark.parametrize("heads, context_lens, query_lens, window, block_size", FP8_ATTENTION_CASES)
def test_fp8_attention_against_the_mock_on_the_same_bytes(
    cuda_backend, mock_backend, rng, heads, context_lens, query_lens, window, block_size
):
    case = paged_case(rng, heads, context_lens, query_lens, block_size=block_size)
    scale = 1 / math.sqrt(heads.head_dim)
    c_kv, m_kv = _cuda_fp8_cache(cuda_backend, case), _mock_fp8_cache(mock_backend, case)
    out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
    cuda_backend.paged_attention(cuda_backend.upload(case.query, DType.BF16), c_kv, 0, upload_metadata(cuda_backend, case),
                           heads, scale, out, window)
    expected = mock_backend.empty((case.num_tokens, heads.q_size), DType.F32)
    mock_backend.paged_attention(mock_backend.upload(case.query), m_kv, 0, upload_metadata(mock_backend, case), heads,
                           scale, expected, window)
    assert rel_l2(host(cuda_backend, out), host(mock_backend, expected)) < BF16_TOLERANCE


def test_fp8_decode_reads_every_dim_of_every_key_in_place(cuda_backend, mock_backend, rng):
    """The FP8 decode kernel permutes dims inside its fragments: a change to one dim of one
    cached value moves exactly that output dim of the heads reading it."""
    heads = HeadLayout(8, 2, 128)
    case = paged_case(rng, heads, [600, 600], [1, 1])
    scale = 1 / math.sqrt(heads.head_dim)

    def run() -> np.ndarray:
        out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
        cuda_backend.paged_attention(cuda_backend.upload(case.query, DType.BF16), _cuda_fp8_cache(cuda_backend, case), 0,
                               upload_metadata(cuda_backend, case), heads, scale, out, None)
        return host(cuda_backend, out).reshape(2, heads.num_q_heads, heads.head_dim)

    before = run()
    slot = int(case.block_tables[0, 3]) * case.block_size + 5
    for dim in (0, 1, 37, 100, 127):
        case.values[slot, 1, dim] += 200.0
    after = run()
    moved = np.argwhere(np.abs(after - before) > 1e-3)
    assert {(int(s), int(h) // 4, int(d)) for s, h, d in moved} == {(0, 1, d) for d in (0, 1, 37, 100, 127)}


@pytest.mark.parametrize("heads", [HeadLayout(9, 3, 64), HeadLayout(32, 8, 128), HeadLayout(8, 1, 256)])
def test_fp8_rope_and_cache_writes_the_mocks_bytes(cuda_backend, mock_backend, rng, heads):
    from atlas.adapters.cuda.tensor import CudaTensor

    case = paged_case(rng, heads, context_lens=[40, 1, 77], query_lens=[40, 1, 13])
    qkv = bf16(rng.standard_normal((case.num_tokens, heads.q_size + 2 * heads.kv_size)) * 4)
    qkv[0, heads.q_size] = 2000.0  # saturates at 448 * K_SCALE
    inverse = 10000.0 ** (-np.arange(0, heads.head_dim, 2) / heads.head_dim)
    angles = np.arange(256)[:, None] * inverse[None, :]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    c_kv = cuda_backend.attention.allocate_cache(_fp8_spec(case))
    raw = CudaTensor(c_kv.base_address, (2 * c_kv.plane_bytes,), DType.U8, c_kv)
    cuda_backend.copy_from_host(raw, np.full(raw.shape, 0x7F, np.uint8))  # NaN: unwritten slots stay so
    m_kv = mock_backend.attention.allocate_cache(_fp8_spec(case))
    c_q = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
    cuda_backend.rope_and_cache(cuda_backend.upload(qkv, DType.BF16), upload_metadata(cuda_backend, case),
                                cuda_backend.upload(table), c_kv, 0, heads, c_q)
    mock_backend.rope_and_cache(mock_backend.upload(qkv), upload_metadata(mock_backend, case),
                                mock_backend.upload(table), m_kv, 0, heads,
                                mock_backend.empty((case.num_tokens, heads.q_size), DType.F32))
    written = case.slot_mapping
    for got, expected in zip(cuda_backend.kv_to_host(c_kv, 0), mock_backend.kv_to_host(m_kv, 0), strict=True):
        got = got.reshape(-1, heads.num_kv_heads, heads.head_dim)
        expected = expected.reshape(got.shape)
        same = got[written].view(np.uint8) == expected[written].view(np.uint8)
        # the same float32 value rounds the same way; RoPE's float32 sums may differ in the last
        # bit and so, rarely, land on the other side of a rounding midpoint
        assert same.mean() > 0.99, same.mean()
        assert rel_l2(got[written].astype(np.float32), expected[written].astype(np.float32)) < 0.02
        assert np.isnan(np.delete(got, written, axis=0).astype(np.float32)).all()
    assert float(cuda_backend.kv_to_host(c_kv, 0)[0].reshape(-1, heads.num_kv_heads, heads.head_dim)[
        written[0], 0, 0]) == 448.0

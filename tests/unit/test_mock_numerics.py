"""The mock's tiled attention against a straightforward float64 loop: tiles, windows, chunks, FP8."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.numerics import causal_attention
from atlas.ports.gpu import AttentionMetadata, DType, HeadLayout, KvCacheSpec


def reference_attention(queries, keys, values, first_position, scale, window):
    """Row by row, head by head, in float64: what every query at position p sees is keys
    (p - window, p]."""
    num_queries, num_kv_heads, group, _ = queries.shape
    out = np.empty(queries.shape, np.float64)
    for i in range(num_queries):
        position = first_position + i
        lo = 0 if window is None else max(0, position - window + 1)
        for h in range(num_kv_heads):
            k = keys[lo : position + 1, h].astype(np.float64)
            v = values[lo : position + 1, h].astype(np.float64)
            for g in range(group):
                scores = k @ queries[i, h, g].astype(np.float64) * scale
                weights = np.exp(scores - scores.max())
                out[i, h, g] = weights @ v / weights.sum()
    return out


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize("first_position", [0, 29])
def test_tiled_attention_matches_the_reference_across_many_small_tiles(window, first_position, rng):
    """A tile budget of 16 rows makes every tile boundary, causal band and window band show up."""
    num_queries, num_kv_heads, group, head_dim = 53, 2, 3, 16
    context_len = first_position + num_queries
    queries = rng.standard_normal((num_queries, num_kv_heads, group, head_dim)).astype(np.float32)
    keys = rng.standard_normal((context_len, num_kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((context_len, num_kv_heads, head_dim)).astype(np.float32)
    got = causal_attention(queries, keys, values, first_position, 0.4, window, max_tile_scores=1)
    assert got.shape == queries.shape and got.dtype == np.float32
    expected = reference_attention(queries, keys, values, first_position, 0.4, window)
    assert rel(got, expected) < 1e-5
    for i in (0, num_queries // 2, num_queries - 1):  # every row on its own, not only in the norm
        assert rel(got[i], expected[i]) < 1e-5


def test_attention_refuses_queries_past_the_context(rng):
    queries = rng.standard_normal((4, 1, 1, 8)).astype(np.float32)
    keys = rng.standard_normal((6, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"positions \[3, 7\).*holds 6"):
        causal_attention(queries, keys, keys, 3, 1.0)


@pytest.mark.parametrize("window", [None, 6])
def test_backend_attention_over_fp8_cache_in_prefill_chunks_matches_the_reference(window, rng):
    """Three sequences in one batch (a second prefill chunk, a whole prompt, a decode) over
    scattered blocks of an FP8 cache: the reference sees the cache's stored values x scales."""
    backend = MockGpuBackend()
    heads = HeadLayout(num_q_heads=6, num_kv_heads=2, head_dim=16)
    block_size, num_blocks, k_scale, v_scale = 4, 40, 0.5, 2.0
    spec = KvCacheSpec(1, num_blocks, block_size, heads.num_kv_heads, heads.head_dim, DType.FP8_E4M3,
                       ((k_scale, v_scale),))
    kv = backend.allocate_kv_cache(spec)
    context_lens, query_lens = [45, 23, 30], [20, 23, 1]
    free = [int(b) for b in rng.permutation(num_blocks)]
    width = max(-(-c // block_size) for c in context_lens)
    tables, stored = [], []
    for context_len in context_lens:
        count = -(-context_len // block_size)
        blocks, free = free[:count], free[count:]
        tables.append(blocks + [0] * (width - count))
        positions = np.arange(context_len)
        slots = np.asarray(blocks)[positions // block_size] * block_size + positions % block_size
        for cache, scale in ((kv.keys, k_scale), (kv.values, v_scale)):
            cache[0, slots] = (rng.standard_normal((context_len, heads.num_kv_heads, heads.head_dim)) * 3 / scale
                               ).astype(ml_dtypes.float8_e4m3fn)
        stored.append((kv.keys[0, slots].astype(np.float32) * k_scale, kv.values[0, slots].astype(np.float32) * v_scale))
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start[-1])
    meta = AttentionMetadata(
        positions=backend.upload(np.zeros(num_tokens, np.int32)),
        slot_mapping=backend.upload(np.zeros(num_tokens, np.int32)),
        query_start_loc=backend.upload(query_start),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        block_tables=backend.upload(np.asarray(tables, np.int32)),
        num_tokens=num_tokens, num_seqs=len(context_lens), max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )
    q = rng.standard_normal((num_tokens, heads.q_size)).astype(np.float32)
    out = backend.empty(q.shape, DType.F32)
    backend.fill(out, float("nan"))
    backend.attention(backend.upload(q), kv, 0, meta, heads, 0.25, out, window)
    got = backend.download(out).reshape(num_tokens, heads.num_kv_heads, -1, heads.head_dim)
    grouped = q.reshape(got.shape)
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        rows = slice(query_start[seq], query_start[seq + 1])
        keys, values = stored[seq]
        expected = reference_attention(grouped[rows], keys, values, context_len - query_len, 0.25, window)
        assert rel(got[rows], expected) < 1e-5

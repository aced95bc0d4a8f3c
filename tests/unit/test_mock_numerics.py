"""The mock's tiled attention against a straightforward float64 loop: tiles, windows, soft-capping,
sinks. The attention kind's contract suite covers it inside the backend (paged caches, FP8)."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.mock.numerics import causal_attention


def reference_attention(queries, keys, values, first_position, scale, window, cap=None, sinks=None):
    """Row by row, head by head, in float64: what every query at position p sees is keys
    (p - window, p]; a sink is one more logit with a zero value."""
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
                if cap is not None:
                    scores = cap * np.tanh(scores / cap)
                sink = -np.inf if sinks is None else float(sinks[h, g])
                peak = max(scores.max(), sink)
                weights = np.exp(scores - peak)
                denominator = weights.sum() + np.exp(sink - peak)
                out[i, h, g] = weights @ v / denominator
    return out


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("cap, with_sinks", [(None, False), (0.7, True)])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize("first_position", [0, 29])
def test_tiled_attention_matches_the_reference_across_many_small_tiles(window, first_position, cap, with_sinks, rng):
    """A tile budget of 16 rows makes every tile boundary, causal band and window band show up."""
    num_queries, num_kv_heads, group, head_dim = 53, 2, 3, 16
    context_len = first_position + num_queries
    queries = rng.standard_normal((num_queries, num_kv_heads, group, head_dim)).astype(np.float32)
    keys = rng.standard_normal((context_len, num_kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((context_len, num_kv_heads, head_dim)).astype(np.float32)
    sinks = (rng.standard_normal((num_kv_heads, group)) * 2).astype(np.float32) if with_sinks else None
    got = causal_attention(queries, keys, values, first_position, 0.4, window, cap, sinks, max_tile_scores=1)
    assert got.shape == queries.shape and got.dtype == np.float32
    expected = reference_attention(queries, keys, values, first_position, 0.4, window, cap, sinks)
    assert rel(got, expected) < 1e-5
    for i in (0, num_queries // 2, num_queries - 1):  # every row on its own, not only in the norm
        assert rel(got[i], expected[i]) < 1e-5


def test_attention_refuses_queries_past_the_context(rng):
    queries = rng.standard_normal((4, 1, 1, 8)).astype(np.float32)
    keys = rng.standard_normal((6, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"positions \[3, 7\).*holds 6"):
        causal_attention(queries, keys, keys, 3, 1.0)

"""Fast float32 numerics for the mock backend: the reference math, arranged so BLAS does the work.

The mock is the reference the CUDA kernels are tested against, so nothing here approximates:
every product accumulates in float32 and softmax subtracts the exact row maximum. What changes
against a straightforward version is only where the time goes. Causal attention runs as
batched GEMMs over query tiles, skips the keys a tile cannot see (the upper triangle, and what
lies outside a sliding window) and masks only the columns where some row of the tile stops
seeing keys.
"""

from __future__ import annotations

import numpy as np

# Scores of one query tile (kv heads x group x tile rows x keys) are kept under this many
# float32 elements (4 MiB): bounded memory at any context, a tile's six passes (product, mask,
# max, exp, sum, product) stay in a core's L2 (8% faster than 16 MiB for a 2,000-token
# SmolLM2 prompt on the development box), and tiles are still few enough that Python's per-tile
# cost stays small against the GEMMs.
MAX_TILE_SCORES = 1 << 20
_MIN_TILE_ROWS = 16


def gather_f32(cache: np.ndarray, slots: np.ndarray, scale: float) -> np.ndarray:
    """cache[slots] in float32 times `scale` (a quantized cache's dequantization), built in one
    new array: the same numbers as `cache[slots].astype(float32) * scale`, without two more
    copies of the context's K or V in every decode step."""
    rows = cache[slots]
    if rows.dtype != np.float32:
        rows = rows.astype(np.float32)
    if scale != 1.0:
        rows *= np.float32(scale)
    return rows


def causal_attention(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    first_position: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: np.ndarray | None = None,
    max_tile_scores: int = MAX_TILE_SCORES,
) -> np.ndarray:
    """Softmax attention of one sequence's queries over its keys, causal and optionally windowed.

    queries [n, num_kv_heads, group, head_dim] float32, query i at position first_position + i;
    keys, values [context_len, num_kv_heads, head_dim] float32, key j at position j. Query at p
    sees keys j with p - sliding_window < j <= p (all j <= p without a window). Scores are
    scale x q.k, soft-capped to cap x tanh(score / cap) with `logit_softcap`; `sinks`
    [num_kv_heads, group] adds one logit per head to the softmax's denominator (and to nothing
    else). Returns [n, num_kv_heads, group, head_dim] float32. Raises ValueError when the
    queries' positions run past the keys.
    """
    num_queries, num_kv_heads, group, head_dim = queries.shape
    if first_position < 0 or first_position + num_queries > keys.shape[0]:
        raise ValueError(f"attention: queries at positions [{first_position}, {first_position + num_queries}) "
                         f"need keys there; the context holds {keys.shape[0]}")
    # One GEMM per kv head over its group's rows: [num_kv_heads, group, n, head_dim]. The scale
    # goes on the queries (n x D products) rather than on the scores (n x L).
    grouped = np.ascontiguousarray(queries.transpose(1, 2, 0, 3)) * np.float32(scale)
    # Views, not copies: each head's [L, head_dim] rows are strided but BLAS takes them as they
    # are (a leading dimension of num_kv_heads x head_dim), and copying K^T cost more than the
    # products in decode.
    keys_t = keys.transpose(1, 2, 0)  # [num_kv_heads, head_dim, L]
    values_h = values.transpose(1, 0, 2)  # [num_kv_heads, L, head_dim]
    out = np.empty((num_kv_heads, group, num_queries, head_dim), np.float32)
    sink_logits = None if sinks is None else np.asarray(sinks, np.float32).reshape(num_kv_heads, group, 1, 1)
    rows_per_tile = _tile_rows(num_kv_heads * group, first_position + num_queries, max_tile_scores)
    for row_start in range(0, num_queries, rows_per_tile):
        row_stop = min(num_queries, row_start + rows_per_tile)
        first, last = first_position + row_start, first_position + row_stop - 1
        key_start = 0 if sliding_window is None else max(0, first - sliding_window + 1)
        key_stop = last + 1
        tile_queries = grouped[:, :, row_start:row_stop].reshape(num_kv_heads, -1, head_dim)
        scores = np.matmul(tile_queries, keys_t[:, :, key_start:key_stop])  # [Hkv, G * rows, keys]
        scores = scores.reshape(num_kv_heads, group, row_stop - row_start, key_stop - key_start)
        if logit_softcap is not None:
            cap = np.float32(logit_softcap)
            scores /= cap
            np.tanh(scores, out=scores)
            scores *= cap
        _mask(scores, np.arange(first, last + 1), key_start, sliding_window)
        peak = scores.max(axis=-1, keepdims=True)  # [Hkv, G, rows, 1]
        if sinks is not None:
            peak = np.maximum(peak, sink_logits)
        scores -= peak
        np.exp(scores, out=scores)
        sums = scores.sum(axis=-1, keepdims=True)
        if sinks is not None:
            sums += np.exp(sink_logits - peak)
        tile_out = np.matmul(scores.reshape(num_kv_heads, -1, key_stop - key_start), values_h[:, key_start:key_stop])
        # Normalising after the product divides rows x D numbers instead of rows x keys.
        out[:, :, row_start:row_stop] = tile_out.reshape(num_kv_heads, group, -1, head_dim) / sums
    return out.transpose(2, 0, 1, 3)


def _tile_rows(num_heads: int, context_len: int, max_tile_scores: int) -> int:
    return max(_MIN_TILE_ROWS, max_tile_scores // max(num_heads * context_len, 1))


def _mask(scores: np.ndarray, positions: np.ndarray, key_start: int, sliding_window: int | None) -> None:
    """Set to -inf the scores of keys the rows cannot see, touching only the columns that hold any.

    scores [..., rows, keys] cover keys [key_start, key_start + keys) for rows at `positions`
    (consecutive). Two bands of columns can hold masked entries:

        keys:  key_start .. first-W+rows-1 | fully visible | first+1 .. last
               (window band, only with W)                  (causal band)
    """
    first, last = int(positions[0]), int(positions[-1])
    key_stop = key_start + scores.shape[-1]
    bands = [(first + 1, key_stop)]  # key j > p is hidden from some row when j > first
    if sliding_window is not None:  # key j <= p - W is hidden from some row when j <= last - W
        bands.insert(0, (key_start, min(key_stop, last - sliding_window + 1)))
        if bands[0][1] >= bands[1][0]:
            bands = [(key_start, key_stop)]
    for band_start, band_stop in bands:
        if band_start >= band_stop:
            continue
        key_positions = np.arange(band_start, band_stop)
        hidden = key_positions[None, :] > positions[:, None]
        if sliding_window is not None:
            hidden |= key_positions[None, :] <= positions[:, None] - sliding_window
        band = scores[..., band_start - key_start : band_stop - key_start]
        np.copyto(band, np.float32(-np.inf), where=hidden)

"""Allowed-token bitmasks: the layout, and the numpy reference of applying one to logits.

A constrained step ships one int32 array [R, W], W = ceil(V / 32), beside the sampling
tensors. Token v of row r is allowed when bit (v % 32) of word (v // 32) is set:

    word:   0                          1
    bit:    0 1 2 ... 31               0 1 ...
    token:  0 1 2 ... 31               32 33 ...        (bits past V - 1 are ignored)

The sampler applies it after penalties and logit bias and before temperature: a disallowed
token's logit becomes -inf, so greedy, top-k/p, min-p and the Gumbel race all skip it. A row
of all ones (-1 words) changes nothing. Every row must allow at least one token below V.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

NEG_INF = np.float32(-np.inf)
ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """Words per row for a vocabulary of `vocab_size` logits."""
    return (vocab_size + 31) // 32


def allowed_bits(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., V]: the mask unpacked, one entry per token id."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def allow_only(bitmask_row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Set `bitmask_row` (int32 [W]) to allow exactly `token_ids`."""
    bitmask_row[:] = 0
    allow(bitmask_row, token_ids)


def is_allowed(bitmask_row: np.ndarray, token_id: int) -> bool:
    """Whether `bitmask_row` (int32 [W]) allows `token_id`."""
    return bool((int(bitmask_row[token_id >> 5]) >> (token_id & 31)) & 1)


def allow(bitmask_row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Also allow `token_ids` in `bitmask_row` (int32 [W])."""
    words = bitmask_row.view(np.uint32)
    for token_id in token_ids:
        words[token_id >> 5] |= np.uint32(1 << (token_id & 31))


def forbid(bitmask_row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Disallow `token_ids` in `bitmask_row` (int32 [W])."""
    words = bitmask_row.view(np.uint32)
    for token_id in token_ids:
        words[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """float32 [R, V]: `logits` with every token the mask disallows set to -inf (a new array).

    `bitmask` is int32 [R, ceil(V / 32)]. Raises ValueError naming the argument when the shapes
    disagree, and when a row allows no token at all (the sampler would have nothing to draw).
    """
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [R, V], got {list(logits.shape)}")
    num_rows, vocab_size = logits.shape
    expected = (num_rows, bitmask_width(vocab_size))
    if bitmask.dtype != np.int32 or bitmask.shape != expected:
        raise ValueError(f"bitmask: expected int32 {list(expected)}, got {bitmask.dtype} {list(bitmask.shape)}")
    allowed = allowed_bits(bitmask, vocab_size)
    empty_rows = np.flatnonzero(~allowed.any(axis=1))
    if empty_rows.size:
        raise ValueError(f"bitmask: rows {empty_rows.tolist()} allow no token")
    return np.where(allowed, logits, NEG_INF)

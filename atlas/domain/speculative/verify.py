"""Verification: which drafts the target accepts, and the token it adds. Pure functions on arrays.

A row verifies the k drafts x_0..x_{k-1} of one sequence whose next token is output token number
c (the row's sampling counter: tokens sampled before). Position j in 0..k decides output token
c + j from p_j, the target's distribution there (after penalties, bias, temperature, top-k/p,
min-p, with drafts x_0..x_{j-1} taken as context). Every draw comes from the engine's
counter-based stream (`atlas.ports.gpu.SamplingTensors`, `atlas.domain.sampling`), so a seed
reproduces whatever else is in the batch and every backend can compute the same bits:

    key_j      = seed ^ ((c + j) * 0x9E3779B97F4A7C15)                   (stream_keys)
    U(key, i)  = token_uniforms(key, i): splitmix64 of key ^ (i * 0xD1B54A32D192ED03), 23 bits
    race_j[v]  = U(key_j, v), v < V              the ordinary sampler's draw c + j uses these
    accept_j   = U(key_j, 2**32)                 the acceptance uniform (2**32 is no token id)
    drafts:      a draft model samples x_j with the ordinary sampler at counter c + j under the
                 seed `draft_seeds(seed)` = seed ^ 2**63

These are disjoint inputs of one hash for a given key: i * 0xD1B5... is a bijection mod 2**64,
so the ids v < 2**31, 2**32 and (seed ^ 2**63)'s v + 2**63 never meet. The drafts are therefore
independent of the uniforms that judge them, which the exactness proof below needs.

Point-mass drafts (`accept_matching`: greedy rows, n-gram, and proposers that draft greedily):
t_j is the target's ordinary draw c + j (argmax for a greedy row). Drafts are accepted in order
while x_j == t_j; the row yields x_0..x_{a-1}, t_a. Accepting x_j is the event "the target drew
x_j", of probability p_j(x_j) = min(1, p/q) for q = the point mass, and on rejection t_a is the
target's draw conditioned on not being x_a, i.e. from norm(max(0, p - q)): exact rejection
sampling, and the tokens are bit for bit those the sequence gets without speculation.

Sampled drafts (`rejection_sample`: x_j ~ q_j, the draft's distribution), in float32:

    accept x_j       iff  accept_j * q_j(x_j) < p_j(x_j)             (probability min(1, p/q))
    at the first rejection a (or a = k: the bonus, with q_k = 0):
        r[v] = max(0, p_a[v] - q_a[v]);  if no r[v] > 0, r = p_a    (p = q up to rounding)
        t_a  = argmax over v with r[v] > 0 of  log r[v] - log(-log race_a[v])   (ties: lowest id)

The race is a Gumbel-max draw from norm(r) that needs no normalisation. By Leviathan et al.
(2023) each output token then follows p exactly, whatever q is (up to the uniforms' 2**-23
grid). Cross-backend agreement is bitwise in the draws; a comparison that lands within float32
rounding (a * q against p, two near-equal race scores) may go either way.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from atlas.domain.sampling import neg_gumbel, stream_keys, token_uniforms
from atlas.domain.speculative.outcome import VerifyOutcome, VerifyResult

ACCEPT_TOKEN_ID = 1 << 32
DRAFT_SEED_BIT = np.uint64(1 << 63)
_ACCEPT_LANE = np.array([ACCEPT_TOKEN_ID], dtype=np.uint64)  # an array: uint64 scalar maths warns on wrap


def draft_seeds(seeds: np.ndarray) -> np.ndarray:
    """uint64 [R]: the seeds a draft model samples its drafts with (the target's, top bit flipped)."""
    return np.asarray(seeds).astype(np.uint64, copy=False) ^ DRAFT_SEED_BIT


def accept_uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """float32: the acceptance uniform of each (seed, counter) pair, broadcast together."""
    keys = stream_keys(np.asarray(seeds), np.asarray(counters))
    return token_uniforms(keys, _ACCEPT_LANE)


def race(weights: np.ndarray, seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """int32 [R]: a draw from each row of `weights` [R, V] (>= 0, unnormalised) with the race
    uniforms of (seed, counter). Raises ValueError when a row has no positive weight."""
    weights = np.asarray(weights, dtype=np.float32)
    positive = weights > 0
    empty = ~positive.any(axis=1)
    if empty.any():
        raise ValueError(f"weights: row {int(np.argmax(empty))} has no token with positive weight")
    keys = stream_keys(np.asarray(seeds), np.asarray(counters))[:, None]
    noise = neg_gumbel(keys, np.arange(weights.shape[1], dtype=np.uint64))
    with np.errstate(divide="ignore"):
        scores = np.where(positive, np.log(weights) - noise, np.float32(-np.inf))
    return np.argmax(scores, axis=1).astype(np.int32)


def accept_matching(target_ids: np.ndarray, draft_ids: np.ndarray, num_drafts: np.ndarray) -> VerifyResult:
    """Verify point-mass drafts against the target's own draws (see the module docstring).

    `target_ids` [R, K+1]: the target's ordinary draw at counters c..c+K; `draft_ids` [R, K];
    `num_drafts` [R]: row r's drafts are draft_ids[r, :num_drafts[r]], the rest is padding.
    Raises ValueError on inconsistent shapes or a draft count outside [0, K].
    """
    target_ids = np.asarray(target_ids)
    if target_ids.ndim != 2:
        raise ValueError(f"target_ids: expected [R, K+1], got {list(target_ids.shape)}")
    draft_ids, num_drafts, valid = _check_drafts(draft_ids, num_drafts, target_ids.shape)
    num_accepted = _leading_true(valid & (target_ids[:, :-1] == draft_ids))
    next_ids = target_ids[np.arange(target_ids.shape[0]), num_accepted]
    return VerifyResult(num_accepted.astype(np.int32), next_ids.astype(np.int32))


def verify_drafts(
    drafts: SequenceOf[SequenceOf[int]], target_ids: SequenceOf[SequenceOf[int]]
) -> tuple[VerifyOutcome, ...]:
    """`accept_matching` over ragged rows, as the engine's commit applies it: row i has drafts[i]
    (k_i of them) and the target's k_i + 1 draws at counters c..c+k_i (`target_ids[i]`).
    Plain Python: a step's rows are a few ints each, where numpy's per-call cost would dominate
    (tests check both agree). Raises ValueError when a row's draw count is not its draft count + 1."""
    outcomes = []
    for row, (row_drafts, row_targets) in enumerate(zip(drafts, target_ids, strict=True)):
        if len(row_targets) != len(row_drafts) + 1:
            raise ValueError(f"row {row}: {len(row_targets)} draws for {len(row_drafts)} drafts (needs drafts + 1)")
        num_accepted = 0
        while num_accepted < len(row_drafts) and row_drafts[num_accepted] == row_targets[num_accepted]:
            num_accepted += 1
        outcomes.append(VerifyOutcome((*row_drafts[:num_accepted], row_targets[num_accepted]), len(row_drafts)))
    return tuple(outcomes)


def rejection_sample(
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    draft_ids: np.ndarray,
    num_drafts: np.ndarray,
    seeds: np.ndarray,
    counters: np.ndarray,
) -> VerifyResult:
    """Verify drafts sampled from `draft_probs` by exact rejection sampling (module docstring).

    `target_probs` [R, K+1, V]: p_j per position (rows sum to 1, zeros where filtered);
    `draft_probs` [R, K, V]: the q_j each draft was drawn from; `draft_ids` [R, K];
    `num_drafts` [R] (the rest is padding); `seeds` [R] (uint64 bit pattern, int64 accepted);
    `counters` [R]: output tokens before this step. Raises ValueError on inconsistent shapes.
    """
    target_probs = np.asarray(target_probs, dtype=np.float32)
    draft_probs = np.asarray(draft_probs, dtype=np.float32)
    num_rows, num_positions, vocab_size = target_probs.shape
    if draft_probs.shape != (num_rows, num_positions - 1, vocab_size):
        raise ValueError(
            f"draft_probs: expected {[num_rows, num_positions - 1, vocab_size]}, got {list(draft_probs.shape)}"
        )
    draft_ids, num_drafts, valid = _check_drafts(draft_ids, num_drafts, (num_rows, num_positions))
    if draft_ids.size and (draft_ids.min() < 0 or draft_ids.max() >= vocab_size):
        raise ValueError(f"draft_ids: ids must lie in [0, {vocab_size})")
    seeds = np.asarray(seeds).astype(np.uint64, copy=False)
    counters = np.asarray(counters).astype(np.int64)
    positions = np.arange(num_positions - 1)

    p_draft = np.take_along_axis(target_probs[:, :-1], draft_ids[:, :, None], axis=2)[:, :, 0]
    q_draft = np.take_along_axis(draft_probs, draft_ids[:, :, None], axis=2)[:, :, 0]
    uniforms = accept_uniforms(seeds[:, None], counters[:, None] + positions)
    num_accepted = _leading_true(valid & (uniforms * q_draft < p_draft))

    rows = np.arange(num_rows)
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts  # else every draft passed: the bonus, q = 0
    q_next = np.zeros_like(p_next)
    if num_positions > 1:
        q_next[rejected] = draft_probs[rows[rejected], num_accepted[rejected]]
    residual = np.maximum(p_next - q_next, np.float32(0))
    exhausted = ~(residual > 0).any(axis=1)
    residual[exhausted] = p_next[exhausted]
    next_ids = race(residual, seeds, counters + num_accepted)
    return VerifyResult(num_accepted.astype(np.int32), next_ids)


def _check_drafts(
    draft_ids: np.ndarray, num_drafts: np.ndarray, target_shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draft ids with padding zeroed, counts as int64, the [R, K] mask of real drafts)."""
    num_rows, num_positions = target_shape
    draft_ids = np.asarray(draft_ids, dtype=np.int64)
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    if draft_ids.shape != (num_rows, num_positions - 1) or num_drafts.shape != (num_rows,):
        raise ValueError(
            f"draft_ids [R, K] and num_drafts [R] must match the target's [R, K+1] = {[num_rows, num_positions]}"
        )
    if num_drafts.size and (num_drafts.min() < 0 or num_drafts.max() > num_positions - 1):
        raise ValueError(f"num_drafts: counts must lie in [0, {num_positions - 1}]")
    valid = np.arange(num_positions - 1) < num_drafts[:, None]
    return np.where(valid, draft_ids, 0), num_drafts, valid


def _leading_true(mask: np.ndarray) -> np.ndarray:
    """int64 [R]: how many entries at the front of each row of `mask` [R, K] are True."""
    return np.cumprod(mask, axis=1).sum(axis=1) if mask.shape[1] else np.zeros(mask.shape[0], np.int64)

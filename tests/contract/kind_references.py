"""Float64 numpy references for the contract suite, written from the port's docstrings (plain
loops where that is clearer), independent of any backend's code."""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu


def bf16(array) -> np.ndarray:
    """float32 values exactly representable in bf16 (what every backend then reads alike)."""
    return np.asarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rel(actual, expected) -> float:
    """||actual - expected|| / ||expected||; NaN anywhere gives inf."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def rmsnorm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def glu(x, activation):
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    if isinstance(activation, ClampedSwiglu):
        gate = np.minimum(gate, activation.limit)
        up = np.clip(up, -activation.limit, activation.limit)
        return gate * sigmoid(activation.alpha * gate) * (up + 1)
    if activation is Activation.SILU:
        return gate * sigmoid(gate) * up
    return 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up


def rope_table(max_positions: int, rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    inverse = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(max_positions)[:, None] * inverse[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def rotate(head: np.ndarray, row: np.ndarray) -> np.ndarray:
    """One head [D] rotated "half-split" by a table row [r] (cos | sin)."""
    half = row.shape[0] // 2
    cos, sin = row[:half].astype(np.float64), row[half:].astype(np.float64)
    out = head.astype(np.float64).copy()
    first, second = head[:half].astype(np.float64), head[half : 2 * half].astype(np.float64)
    out[:half] = first * cos - second * sin
    out[half : 2 * half] = second * cos + first * sin
    return out


@dataclass(frozen=True)
class Paged:
    """A varlen batch over a paged cache: sequence s has context_lens[s] tokens, the last
    query_lens[s] of them this step's. Blocks are handed out shuffled; block tables are padded
    with an id past the cache (never read)."""

    block_size: int
    num_blocks: int
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_tables: np.ndarray  # [S, W] i32
    positions: np.ndarray  # [N] i32
    slot_mapping: np.ndarray  # [N] i32
    query_start_loc: np.ndarray  # [S + 1] i32

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def context_slots(self, seq: int) -> np.ndarray:
        positions = np.arange(self.context_lens[seq])
        return self.block_tables[seq][positions // self.block_size] * self.block_size + positions % self.block_size


def paged(rng, context_lens, query_lens, block_size: int = 16, spare_blocks: int = 3) -> Paged:
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + spare_blocks
    order = [int(b) for b in rng.permutation(num_blocks)]
    width = max(needed) + 1
    tables = np.full((len(context_lens), width), num_blocks + 1000, np.int32)
    positions, slots = [], []
    for s, (context_len, query_len) in enumerate(zip(context_lens, query_lens, strict=True)):
        blocks, order = order[: needed[s]], order[needed[s] :]
        tables[s, : len(blocks)] = blocks
        token_positions = np.arange(context_len)
        token_slots = np.asarray(blocks)[token_positions // block_size] * block_size + token_positions % block_size
        positions.append(token_positions[context_len - query_len :])
        slots.append(token_slots[context_len - query_len :])
    return Paged(
        block_size=block_size,
        num_blocks=num_blocks,
        context_lens=tuple(context_lens),
        query_lens=tuple(query_lens),
        block_tables=tables,
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
    )


def attention(case: Paged, q, keys, values, heads, scale, window=None, softcap=None, sinks=None, gate=None):
    """out [N, Hq D] of causal attention over slot-major keys/values [slots, Hkv, D]."""
    group = heads.num_q_heads // heads.num_kv_heads
    dim = heads.head_dim
    out = np.zeros((case.num_tokens, heads.num_q_heads, dim))
    for seq, (context_len, query_len) in enumerate(zip(case.context_lens, case.query_lens, strict=True)):
        slots = case.context_slots(seq)
        for i in range(query_len):
            row = int(case.query_start_loc[seq]) + i
            position = context_len - query_len + i
            low = 0 if window is None else max(0, position - window + 1)
            for h in range(heads.num_q_heads):
                k = keys[slots[low : position + 1], h // group].astype(np.float64)
                v = values[slots[low : position + 1], h // group].astype(np.float64)
                scores = k @ q[row, h * dim : (h + 1) * dim].astype(np.float64) * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                peak = scores.max() if sinks is None else max(scores.max(), sinks[h])
                weights = np.exp(scores - peak)
                denominator = weights.sum() + (0.0 if sinks is None else math.exp(sinks[h] - peak))
                out[row, h] = weights @ v / denominator
    out = out.reshape(case.num_tokens, heads.q_size)
    return out if gate is None else out * sigmoid(np.asarray(gate, np.float64))


def route(normed, router, router_bias, routing, selection_bias=None):
    """(ids [N, k], weights [N, k]) by `Routing`'s rules, one token at a time."""
    ids, weights = [], []
    for row in np.asarray(normed, np.float64):
        logits = router.astype(np.float64) @ row
        if router_bias is not None:
            logits = logits + router_bias
        if routing.scoring.value == "softmax":
            scores = np.exp(logits - logits.max())
            scores /= scores.sum()
        else:
            scores = sigmoid(logits)
        ranked = scores + (0 if selection_bias is None else selection_bias)
        chosen = sorted(range(len(ranked)), key=lambda e: (-ranked[e], e))[: routing.top_k]
        picked = scores[chosen]
        if routing.renormalize:
            picked = picked / picked.sum()
        ids.append(chosen)
        weights.append(picked * routing.scaling)
    return np.asarray(ids), np.asarray(weights)


def expert(x, gate_up, gate_up_bias, down, down_bias, activation):
    hidden = x @ gate_up.T.astype(np.float64)
    if gate_up_bias is not None:
        hidden = hidden + gate_up_bias
    out = glu(hidden, activation) @ down.T.astype(np.float64)
    return out if down_bias is None else out + down_bias


def causal_conv(inputs, weight, history):
    """silu of the depthwise causal conv of inputs [L, C] after history [K - 1, C]; returns (out,
    the last K - 1 inputs)."""
    kernel = weight.shape[1]
    padded = np.concatenate([history, inputs]).astype(np.float64)
    out = np.zeros(inputs.shape)
    for t in range(inputs.shape[0]):
        window = padded[t : t + kernel]  # [K, C]
        out[t] = np.sum(window.T * weight, axis=1)
    return out * sigmoid(out), padded[-(kernel - 1) :]


def delta_rule(q, k, v, beta, decay, state):
    """The gated delta rule token by token (float64): q, k [L, H, dk] normalised and scaled
    already, v [L, H, dv], beta and decay [L, H], state [H, dk, dv]. Returns (o [L, H, dv],
    final state)."""
    state = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            state[h] *= math.exp(decay[t, h])
            error = v[t, h] - state[h].T @ k[t, h]
            state[h] += np.outer(k[t, h], beta[t, h] * error)
            out[t, h] = state[h].T @ q[t, h]
    return out, state

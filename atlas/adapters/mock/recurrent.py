"""The mock's recurrent kind: state slots, the causal conv1d and the gated delta rule in numpy.

A sequence with several tokens in the step goes through the chunkwise form of the delta rule
(chunks of `CHUNK` tokens, each a few small matrix products and one triangular solve); a
sequence with one token, or one whose step names snapshot slots (a verify chunk: the states
after each token are wanted, and token by token they are bit for bit those of plain decoding),
takes the plain recurrence. Both are the same math:

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t

Within a chunk, with G_t = exp(cumulative g up to t) and S_0 the state before it, unrolling gives
u = (I + A)^-1 (beta v - beta G K S_0) where A[t, s] = beta_t (G_t / G_s) k_t.k_s for s < t,
o = G Q S_0 + ((G_t / G_s) q_t.k_s for s <= t) u, and the state after it
G_C S_0 + sum_s (G_C / G_s) k_s u_s^T.

In bf16 activations the kind rounds where transformers' bf16 path for Qwen3-Next does (the one
`atlas doctor` measures the noise by): the conv's sum before silu, then its output; beta; the
delta rule's output o before the gated norm. g, the l2 norms, the recurrence and the state stay
float32, as there (a fused conv kernel that rounds once, after silu, is as exact). Why it
matters: a head whose o nearly cancels is scaled up by the gated norm and the MoE after it may
pick another expert at a near tie, so a bf16 error of the same size but another pattern can land
several times past transformers' noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from atlas.adapters.mock.dense import MockNorm, rmsnorm
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.kernels.recurrent import (
    DeltaNetLayer,
    HostDeltaNet,
    RecurrentMetadata,
    RecurrentStateSpec,
)

if TYPE_CHECKING:
    from atlas.adapters.mock.backend import MockGpuBackend

CHUNK = 64
_L2_EPS = 1e-6


class MockRecurrentState:
    """conv [num_layers, num_slots, K - 1, conv_dim] and recurrent [num_layers, num_slots, H, dk,
    dv], float32."""

    __slots__ = ("_spec", "conv", "recurrent")

    def __init__(self, spec: RecurrentStateSpec) -> None:
        self._spec = spec
        self.conv = np.zeros((spec.num_layers, spec.num_slots, spec.conv_kernel - 1, spec.conv_dim), np.float32)
        self.recurrent = np.zeros(
            (spec.num_layers, spec.num_slots, spec.num_heads, spec.key_dim, spec.value_dim), np.float32
        )

    @property
    def spec(self) -> RecurrentStateSpec:
        return self._spec


@dataclass(frozen=True, slots=True)
class MockDeltaNetLayer:
    layer: DeltaNetLayer
    conv_weight: np.ndarray  # [conv_dim, K] f32
    decay_rate: np.ndarray  # [Hv] exp(a_log)
    dt_bias: np.ndarray  # [Hv]
    norm: MockNorm


class MockRecurrent:
    """`RecurrentKernels` in numpy."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self._backend = backend

    def allocate_state(self, spec: RecurrentStateSpec) -> MockRecurrentState:
        backend = self._backend
        backend.enter("recurrent.allocate_state")
        total = spec.num_slots * spec.bytes_per_slot
        if total > backend.free_bytes():
            raise MemoryError(
                f"mock backend: {spec.num_slots} recurrent state slots need {total / 2**20:.1f} MiB; "
                f"{backend.free_bytes() / 2**20:.1f} MiB free holds {backend.free_bytes() // spec.bytes_per_slot}"
            )
        state = MockRecurrentState(spec)
        backend.count(state.recurrent, total)
        return state

    def prepare(self, host: HostDeltaNet, layer: DeltaNetLayer) -> MockDeltaNetLayer:
        self._backend.enter("recurrent.prepare")
        heads = layer.num_value_heads
        if heads % layer.num_key_heads:
            raise ValueError(f"layer: {heads} value heads do not divide over {layer.num_key_heads} key heads")
        if np.shape(host.conv_weight) != (layer.conv_dim, layer.conv_kernel):
            expected = [layer.conv_dim, layer.conv_kernel]
            raise ValueError(f"conv_weight: shape {np.shape(host.conv_weight)} is not {expected}")
        for name, values in (("a_log", host.a_log), ("dt_bias", host.dt_bias)):
            if np.shape(values) != (heads,):
                raise ValueError(f"{name}: shape {np.shape(values)} is not [{heads}]")
        return MockDeltaNetLayer(
            layer,
            np.asarray(host.conv_weight, np.float32).copy(),
            np.exp(np.asarray(host.a_log, np.float32)),
            np.asarray(host.dt_bias, np.float32).copy(),
            self._backend.dense.norm(host.norm),
        )

    def causal_conv1d(
        self,
        projected: MockTensor,
        layer: MockDeltaNetLayer,
        meta: RecurrentMetadata,
        state: MockRecurrentState,
        out: MockTensor,
    ) -> None:
        self._backend.enter("recurrent.causal_conv1d")
        shape = layer.layer
        tokens = meta.num_tokens
        if projected.shape != (tokens, shape.projected_width) or out.shape != (tokens, shape.conv_dim):
            raise ValueError(f"projected {list(projected.shape)} / out {list(out.shape)}: not "
                             f"[N, {shape.projected_width}] / [N, {shape.conv_dim}]")
        x = projected.as_f32()[:, : shape.conv_dim]
        rounded = self._backend.dense.rounded
        kernel = layer.conv_weight.shape[1]
        result = np.empty_like(x)
        for rows, fresh, slot, snapshots in _sequences(meta):
            history = state.conv[shape.state_layer, slot]
            if fresh:
                history = np.zeros_like(history)
            inputs = np.concatenate([history, x[rows]], axis=0)  # [K - 1 + L, C]
            length = rows.stop - rows.start
            mixed = rounded(sum(inputs[j : j + length] * layer.conv_weight[:, j] for j in range(kernel)))
            result[rows] = mixed / (1.0 + np.exp(-mixed))
            state.conv[shape.state_layer, slot] = inputs[length:]
            for token, snapshot in snapshots:  # the K - 1 inputs up to and including the token
                state.conv[shape.state_layer, snapshot] = inputs[token + 1 : token + kernel]
        out.data[...] = rounded(result)

    def gated_delta_rule(
        self,
        mixed: MockTensor,
        projected: MockTensor,
        layer: MockDeltaNetLayer,
        meta: RecurrentMetadata,
        state: MockRecurrentState,
        out: MockTensor,
    ) -> None:
        self._backend.enter("recurrent.gated_delta_rule")
        shape = layer.layer
        key_dim, value_dim, heads = shape.key_dim, shape.value_dim, shape.num_value_heads
        if out.shape != (meta.num_tokens, value_dim):
            raise ValueError(f"out: shape {list(out.shape)} is not [{meta.num_tokens}, {value_dim}]")
        values, extra = mixed.as_f32(), projected.as_f32()[:, shape.conv_dim :]
        group = heads // shape.num_key_heads
        q = _heads(values[:, :key_dim], shape.key_head_dim, group)
        k = _heads(values[:, key_dim : 2 * key_dim], shape.key_head_dim, group)
        v = values[:, 2 * key_dim :].reshape(-1, heads, shape.value_head_dim)
        z = extra[:, :value_dim].reshape(-1, heads, shape.value_head_dim)
        rounded = self._backend.dense.rounded
        beta = rounded(1.0 / (1.0 + np.exp(-extra[:, value_dim : value_dim + heads])))
        a = extra[:, value_dim + heads :]
        decay = -layer.decay_rate * np.logaddexp(0.0, a + layer.dt_bias)  # -exp(a_log) * softplus
        q = _l2_normalize(q) * np.float32(shape.key_head_dim**-0.5)
        k = _l2_normalize(k)
        core = np.empty_like(v)
        for rows, fresh, slot, snapshots in _sequences(meta):
            start = state.recurrent[shape.state_layer, slot]
            if fresh:
                start = np.zeros_like(start)
            inputs = (q[rows], k[rows], v[rows], beta[rows], decay[rows], start)
            if snapshots:
                states: list[np.ndarray] = []
                core[rows], state.recurrent[shape.state_layer, slot] = _delta_rule_recurrent(*inputs, states)
                for token, snapshot in snapshots:
                    state.recurrent[shape.state_layer, snapshot] = states[token]
                continue
            step = _delta_rule_chunked if rows.stop - rows.start > 1 else _delta_rule_recurrent
            core[rows], state.recurrent[shape.state_layer, slot] = step(*inputs)
        gated = rmsnorm(rounded(core), layer.norm.weight, layer.norm.eps) * (z / (1.0 + np.exp(-z)))
        out.data[...] = gated.reshape(meta.num_tokens, value_dim)


def _sequences(meta: RecurrentMetadata):
    """(token rows, whether it starts fresh, state slot, [(token, snapshot slot)]) of each
    sequence with tokens."""
    query_start, seq_lens, slots = meta.query_start_loc.data, meta.seq_lens.data, meta.state_slots.data
    snapshot_slots = meta.snapshot_slots.data if meta.snapshot_slots is not None else None
    for seq in range(meta.num_seqs):
        start, stop = int(query_start[seq]), int(query_start[seq + 1])
        if stop > start:
            snapshots = []
            if snapshot_slots is not None:
                row = snapshot_slots[seq]
                snapshots = [(int(token), int(row[token])) for token in np.flatnonzero(row[: stop - start] >= 0)]
            yield slice(start, stop), int(seq_lens[seq]) == stop - start, int(slots[seq]), snapshots


def _heads(x: np.ndarray, head_dim: int, group: int) -> np.ndarray:
    """[N, Hk dk] -> [N, Hv, dk]: each key head repeated for the value heads that read it."""
    return np.repeat(x.reshape(x.shape[0], -1, head_dim), group, axis=1)


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + _L2_EPS)


def _delta_rule_recurrent(q, k, v, beta, decay, state, states=None):
    """Token by token. q, k [L, H, dk]; v [L, H, dv]; beta, decay [L, H]; state [H, dk, dv];
    `states`: a list that receives the state after each token."""
    outputs = np.empty_like(v)
    for t in range(q.shape[0]):
        state = state * np.exp(decay[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", state, k[t])
        update = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * update[:, None, :]
        outputs[t] = np.einsum("hkv,hk->hv", state, q[t])
        if states is not None:
            states.append(state)
    return outputs, state


def _delta_rule_chunked(q, k, v, beta, decay, state):
    """Chunk by chunk (see the module docstring); same arguments as `_delta_rule_recurrent`."""
    outputs = np.empty_like(v)
    length = q.shape[0]
    for start in range(0, length, CHUNK):
        rows = slice(start, min(start + CHUNK, length))
        qc, kc, vc = (np.swapaxes(a[rows], 0, 1) for a in (q, k, v))  # [H, C, d]
        bc, log_gain = beta[rows].T, np.cumsum(decay[rows].T, axis=1)  # [H, C]
        size = qc.shape[1]
        causal = np.tril(np.ones((size, size), bool))
        relative = np.where(causal, log_gain[:, :, None] - log_gain[:, None, :], -np.inf)  # log(G_t / G_s)
        gains = np.exp(relative)
        strictly = gains * ~np.eye(size, dtype=bool)
        system = np.eye(size) + bc[:, :, None] * strictly * (kc @ np.swapaxes(kc, 1, 2))
        gain = np.exp(log_gain)[:, :, None]  # G_t
        rhs = bc[:, :, None] * (vc - gain * (kc @ state))
        updates = np.linalg.solve(system, rhs)  # [H, C, dv]
        outputs[rows] = np.swapaxes(gain * (qc @ state) + (gains * (qc @ np.swapaxes(kc, 1, 2))) @ updates, 0, 1)
        to_end = np.exp(log_gain[:, -1:] - log_gain)[:, :, None]  # G_C / G_s
        state = np.exp(log_gain[:, -1])[:, None, None] * state + np.swapaxes(kc * to_end, 1, 2) @ updates
    return outputs, state.astype(np.float32)

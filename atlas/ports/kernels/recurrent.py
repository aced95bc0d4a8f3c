"""The recurrent kind: per-sequence state slots and the linear-attention mixers that carry them.

Gated DeltaNet (Qwen3-Next) runs between its input projection (a dense `project` with the
layer's norm) and its output projection (a dense `project_add`):

    causal_conv1d(projected, layer, meta, state, mixed)           # q|k|v through the conv
    gated_delta_rule(mixed, projected, layer, meta, state, out)   # the recurrence + gated norm

A step mixes sequences that start fresh, continue a prompt in chunks and decode one token; each
member carries every sequence's state from its slot and leaves it there. Chunkwise (prefill) or
token-by-token (decode) is the backend's choice per sequence, as prefill and decode attention
kernels are. Mamba-2 fits as another mixer of this kind over the same slots.

Speculative verification needs the state after each of a sequence's tokens, not only its last:
a verify chunk (the last token and k drafts) runs as one sequence continuing from its slot, and
names snapshot slots (`RecurrentMetadata.snapshot_slots`) for the states after its first k
tokens; once the drafts are judged the cache manager makes the snapshot after the last kept one
the sequence's slot (ids swap on the host, nothing is copied). A backend that writes snapshots
says so in `Capabilities.state_snapshots`; without it a hybrid model cannot speculate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from atlas.ports.gpu import DType, Tensor
from atlas.ports.kernels.host_weights import RmsNorm


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """The state slots of one cache group: for each of `num_layers` layers and `num_slots`
    sequences, the conv state (the last conv_kernel - 1 inputs of `conv_dim` channels) and the
    recurrent state ([num_heads, key_dim, value_dim]). The layout is the backend's."""

    num_layers: int
    num_slots: int
    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int
    dtype: DType = DType.F32

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1)
        recurrent = self.num_heads * self.key_dim * self.value_dim
        return self.num_layers * (conv + recurrent) * self.dtype.itemsize


class RecurrentState(Protocol):
    """The state slots of a cache group (`RecurrentKernels.allocate_state`)."""

    @property
    def spec(self) -> RecurrentStateSpec: ...


@dataclass(frozen=True, slots=True)
class RecurrentMetadata:
    """The step's sequences as the recurrent members see them.

    Sequence s's tokens are rows query_start_loc[s] : query_start_loc[s + 1], the last of its
    seq_lens[s] tokens; its state lives in slot state_slots[s]. A sequence whose tokens are its
    whole context (seq_lens[s] equals its token count) starts from zero state; any other
    continues from the slot's. Afterwards the slot holds the state after its last token.

    That one rule is what the scheduler relies on: a new sequence, and a preempted one that
    recomputes from its first token, start from zero whatever a slot held before; the chunks of
    a long prompt carry the state from one step to the next. A captured graph's padding rows are
    one-token fresh sequences in a scratch slot, so they read no state either.

    Snapshots (only from a backend with `Capabilities.state_snapshots`; None: none this step):
    where snapshot_slots[s, j] >= 0, that slot afterwards also holds sequence s's whole state
    (conv and recurrent, every layer of the group) after its token j of the step (row
    query_start_loc[s] + j), as its own slot would had the sequence ended there. -1: no
    snapshot. A verify chunk of the last token and k drafts names k of them, one after each
    token but the last, whose state its slot keeps:

        rows         t    d0   d1   d2        (k = 3, positions P .. P+3)
        state after  t    d0   d1   d2
        written to   s0   s1   s2   slot      snapshot_slots[s] = [s0, s1, s2]

    Snapshot slots are distinct from every slot the step reads or writes otherwise; a sequence
    still reads only its own slot, so the snapshots of a step change nothing it computes.
    """

    query_start_loc: Tensor  # [S + 1] i32
    seq_lens: Tensor  # [S] i32
    state_slots: Tensor  # [S] i32
    num_tokens: int
    num_seqs: int
    max_query_len: int
    snapshot_slots: Tensor | None = None  # [S, W] i32, -1 = none


@dataclass(frozen=True, slots=True)
class DeltaNetLayer:
    """Shape of one Gated DeltaNet layer. Its input projection's output (`projected`) is laid out

        | q [Hk dk] | k [Hk dk] | v [Hv dv] | z [Hv dv] | b [Hv] | a [Hv] |
        '------- conv channels (conv_dim) -----'

    (a loader reorders the checkpoint's per-key-head groups into this). Value head j reads key
    head j // (Hv / Hk).
    """

    state_layer: int  # its layer within the state slots of its cache group
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def projected_width(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads


@dataclass(frozen=True, slots=True)
class HostDeltaNet:
    """A Gated DeltaNet layer's own weights (its projections are dense).

    conv_weight [conv_dim, conv_kernel]: the depthwise causal conv (no bias), SiLU after.
    a_log, dt_bias [Hv]: the decay g = -exp(a_log) * softplus(a + dt_bias) (log space, <= 0).
    norm: the gated RMSNorm of each value head's output ([dv]), times silu(z).
    """

    conv_weight: np.ndarray
    a_log: np.ndarray
    dt_bias: np.ndarray
    norm: RmsNorm


class PreparedDeltaNet(Protocol):
    """A backend's prepared Gated DeltaNet layer (opaque)."""


class RecurrentKernels(Protocol):
    def allocate_state(self, spec: RecurrentStateSpec) -> RecurrentState:
        """The state slots of a cache group (contents unspecified: fresh sequences never read
        them). Raises `MemoryError` saying how many slots would fit."""
        ...

    def prepare(self, host: HostDeltaNet, layer: DeltaNetLayer) -> PreparedDeltaNet:
        """The backend's form of one layer, made once at load; `UnsupportedError` naming what it
        cannot run, `ValueError` for shapes that do not fit the layer."""
        ...

    def causal_conv1d(
        self, projected: Tensor, layer: PreparedDeltaNet, meta: RecurrentMetadata, state: RecurrentState, out: Tensor
    ) -> None:
        """out[t, c] = silu(sum over j < K of conv_weight[c, j] * x[t - K + 1 + j, c]) for the
        conv channels x = projected[:, :conv_dim], where the inputs before a sequence's first
        token of the step come from its slot's conv state (zeros for a fresh sequence); the
        slot then keeps its last K - 1 inputs, and each snapshot slot (`meta.snapshot_slots`)
        the K - 1 inputs up to its token. projected [N, projected_width] (only read),
        out [N, conv_dim]."""
        ...

    def gated_delta_rule(
        self,
        mixed: Tensor,
        projected: Tensor,
        layer: PreparedDeltaNet,
        meta: RecurrentMetadata,
        state: RecurrentState,
        out: Tensor,
    ) -> None:
        """The gated delta rule over each sequence's tokens, from its slot's state S [Hv, dk, dv]:

            q, k, v = mixed's heads; q, k l2-normalised (eps 1e-6), q scaled by dk ** -0.5
            beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias)      (b, a from projected)
            per token:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
            out = rmsnorm(o, norm) * silu(z), per value head

        mixed [N, conv_dim] (`causal_conv1d`'s out), projected [N, projected_width], out
        [N, Hv dv]; the slot keeps the state after the sequence's last token, and each
        snapshot slot (`meta.snapshot_slots`) the state after its token."""
        ...

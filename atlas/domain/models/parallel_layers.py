"""The layer kinds of one tensor-parallel rank: each runs its part of a layer (`sharding.py`)
and joins the ranks' partial sums of its output with one all-reduce of the residual stream.

Every layer kind ends in a product whose input the ranks split (o_proj, down, out_proj, the
experts), so each rank's product is a partial sum. Rank 0 adds its part into the residual
stream as on one device; every other rank writes its part in place of the residual (whose
value it no longer needs once the layer's first member has read it); the all-reduce then
gives every rank residual + the sum of all parts, bit for bit the same everywhere:

    rank 0:  residual = residual + part_0          (project_add, as on one device)
    rank r:  residual = part_r                     (project; the experts with accumulate off)
    all:     all_reduce(residual)                  -> residual + part_0 + ... + part_{t-1}

One collective per mixer and per feed-forward, enqueued on the device's stream with the layer's
kernels, so a captured graph holds it. A model on one device keeps the single-device kinds:
nothing of this runs there.
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.models.layers import LayerStep, WorkspaceNeeds
from atlas.domain.models.feed_forward import dense_needs, moe_needs, route_tokens
from atlas.domain.models.mixers import attention_needs, delta_net_heads, delta_net_needs
from atlas.ports.comm import CommBackend
from atlas.ports.gpu import Kind, Tensor
from atlas.ports.kernels.attention import AttentionLayer, PreparedAttention
from atlas.ports.kernels.dense import DenseKernels, Projection
from atlas.ports.kernels.moe import PreparedMoe
from atlas.ports.kernels.recurrent import DeltaNetLayer, PreparedDeltaNet


@dataclass(frozen=True, slots=True)
class PartialSums:
    """How this rank's part of a layer's output joins the residual stream (module docstring)."""

    comm: CommBackend
    carries_residual: bool

    def add_projection(self, dense: DenseKernels, x: Tensor, projection: Projection, residual: Tensor) -> None:
        """residual += the sum over ranks of each rank's product of x."""
        if self.carries_residual:
            dense.project_add(x, projection, residual)
        else:
            dense.project(x, projection, residual)
        self.comm.all_reduce(residual)

    def reduce(self, residual: Tensor) -> None:
        self.comm.all_reduce(residual)


@dataclass(frozen=True, slots=True)
class ParallelAttentionMixer:
    """`AttentionMixer` over the rank's heads (`spec` is the rank's part)."""

    spec: AttentionLayer
    group: int
    attention: PreparedAttention
    output: Projection  # the o_proj columns of the rank's heads
    sums: PartialSums
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.ATTENTION, Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return attention_needs(self.spec, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        attention = step.backend.attention
        queries = step.scratch(0, self.spec.q_width)
        attended = step.scratch(1, self.spec.heads.q_size)
        meta, cache = step.attention(self.group)
        attention.project(residual, self.attention, meta, cache, queries)
        attention.attend(queries, self.attention, meta, cache, attended)
        self.sums.add_projection(step.backend.dense, attended, self.output, residual)


@dataclass(frozen=True, slots=True)
class ParallelDeltaNetMixer:
    """`DeltaNetMixer` over the rank's key and value heads (`spec` is the rank's part)."""

    spec: DeltaNetLayer
    group: int
    input: Projection
    delta_net: PreparedDeltaNet
    output: Projection
    sums: PartialSums
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.RECURRENT, Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return delta_net_needs(self.spec, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        out = delta_net_heads(step, residual, self.spec, self.group, self.input, self.delta_net)
        self.sums.add_projection(step.backend.dense, out, self.output, residual)


@dataclass(frozen=True, slots=True)
class ParallelDenseFeedForward:
    """`DenseFeedForward` over the rank's part of the width."""

    gate_up: Projection
    down: Projection
    sums: PartialSums
    intermediate_size: int  # the rank's part
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return dense_needs(self.intermediate_size, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        dense = step.backend.dense
        hidden = step.scratch(0, self.intermediate_size)
        dense.project(residual, self.gate_up, hidden)
        self.sums.add_projection(dense, hidden, self.down, residual)


@dataclass(frozen=True, slots=True)
class ParallelMoeFeedForward:
    """`MoeFeedForward` over the rank's experts and part of their width: every rank routes
    every token alike (the router is whole), adds its experts' contributions, and the
    all-reduce sums them. With the tokens already on every rank, this moves one [N, H] sum per
    layer, where dispatching the routed copies with all-to-all would move top_k of them."""

    moe: PreparedMoe
    sums: PartialSums
    top_k: int
    hidden_size: int
    expert_intermediate_size: int  # the widest of the rank's routed and shared expert parts

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.MOE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return moe_needs(self.top_k, self.expert_intermediate_size, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        normed, expert_ids, expert_weights = route_tokens(step, residual, self.moe, self.top_k, self.hidden_size)
        # the rank that carries the residual adds its experts' share; the others write theirs
        step.backend.moe.experts(normed, self.moe, expert_ids, expert_weights, residual,
                                 accumulate=self.sums.carries_residual)
        self.sums.reduce(residual)

"""Mixers: attention (full, sliding window, with sinks, gated; the variants are data of
`AttentionLayer`) and Gated DeltaNet. Each runs its kernel kind's members between the input
norm it carries and its output projection into the residual stream."""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.models.layers import LayerStep, WorkspaceNeeds
from atlas.ports.gpu import Kind, Tensor
from atlas.ports.kernels.attention import AttentionLayer, PreparedAttention
from atlas.ports.kernels.dense import Projection
from atlas.ports.kernels.recurrent import DeltaNetLayer, PreparedDeltaNet


@dataclass(frozen=True, slots=True)
class AttentionMixer:
    """residual += o_proj(attend(project(residual))), over the KV cache of group `group`."""

    spec: AttentionLayer
    group: int
    attention: PreparedAttention  # the input norm, q/k/v, q/k norms, sinks
    output: Projection  # o_proj (with Gemma's post-attention norm)
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.ATTENTION, Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        heads = self.spec.heads
        qkv_width = self.spec.q_width + 2 * heads.kv_size
        return WorkspaceNeeds(scratch=(self.spec.q_width, heads.q_size), intermediate=self.hidden_size + qkv_width)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        attention, dense = step.backend.attention, step.backend.dense
        meta, cache = step.attention(self.group)
        queries = step.scratch(0, self.spec.q_width)
        attended = step.scratch(1, self.spec.heads.q_size)
        attention.project(residual, self.attention, meta, cache, queries)
        attention.attend(queries, self.attention, meta, cache, attended)
        dense.project_add(attended, self.output, residual)


@dataclass(frozen=True, slots=True)
class DeltaNetMixer:
    """residual += out_proj(gated_delta_rule(causal_conv1d(in_proj(rmsnorm(residual))))), over
    the state slots of group `group` (Qwen3-Next's linear attention)."""

    spec: DeltaNetLayer
    group: int
    input: Projection  # the input norm and in_proj, rows laid out as `DeltaNetLayer` says
    delta_net: PreparedDeltaNet
    output: Projection  # out_proj
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.RECURRENT, Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        spec = self.spec
        return WorkspaceNeeds(
            scratch=(spec.projected_width, spec.conv_dim, spec.value_dim), intermediate=self.hidden_size
        )

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        recurrent, dense = step.backend.recurrent, step.backend.dense
        meta, state = step.recurrent(self.group)
        projected = step.scratch(0, self.spec.projected_width)
        mixed = step.scratch(1, self.spec.conv_dim)
        out = step.scratch(2, self.spec.value_dim)
        dense.project(residual, self.input, projected)
        recurrent.causal_conv1d(projected, self.delta_net, meta, state, mixed)
        recurrent.gated_delta_rule(mixed, projected, self.delta_net, meta, state, out)
        dense.project_add(out, self.output, residual)

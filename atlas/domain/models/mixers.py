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
        return attention_needs(self.spec, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        attention, dense = step.backend.attention, step.backend.dense
        meta, cache = step.attention(self.group)
        queries = step.scratch(0, self.spec.q_width)
        attended = step.scratch(1, self.spec.heads.q_size)
        attention.project(residual, self.attention, meta, cache, queries)
        prepared, group = self.attention, self.group

        def attend(now: LayerStep) -> None:  # a replay's step may have fewer tokens than the rows
            now_meta, now_cache = now.attention(group)
            rows = now_meta.num_tokens
            q, out = (queries, attended) if rows == queries.shape[0] else (queries.rows(0, rows), attended.rows(0, rows))
            now.backend.attention.attend(q, prepared, now_meta, now_cache, out)

        step.eager(attend)
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
        return delta_net_needs(self.spec, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        out = delta_net_heads(step, residual, self.spec, self.group, self.input, self.delta_net)
        step.backend.dense.project_add(out, self.output, residual)


def attention_needs(spec: AttentionLayer, hidden_size: int) -> WorkspaceNeeds:
    """The scratch an attention mixer's step takes: the queries and the attended heads."""
    heads = spec.heads
    qkv_width = spec.q_width + 2 * heads.kv_size
    return WorkspaceNeeds(scratch=(spec.q_width, heads.q_size), intermediate=hidden_size + qkv_width)


def delta_net_needs(spec: DeltaNetLayer, hidden_size: int) -> WorkspaceNeeds:
    """The scratch a DeltaNet mixer's step takes: in_proj's rows, the conv output, the heads."""
    return WorkspaceNeeds(scratch=(spec.projected_width, spec.conv_dim, spec.value_dim), intermediate=hidden_size)


def delta_net_heads(
    step: LayerStep, residual: Tensor, spec: DeltaNetLayer, group: int, input: Projection, delta_net: PreparedDeltaNet
) -> Tensor:
    """A DeltaNet mixer up to its output projection: the input norm and in_proj, the causal
    conv1d and the gated delta rule over the group's state; returns the heads' output (scratch 2,
    [tokens, value_dim]), which the caller projects into the residual (all of it, or a rank's part)."""
    recurrent, dense = step.backend.recurrent, step.backend.dense
    meta, state = step.recurrent(group)
    projected = step.scratch(0, spec.projected_width)
    mixed = step.scratch(1, spec.conv_dim)
    out = step.scratch(2, spec.value_dim)
    dense.project(residual, input, projected)
    recurrent.causal_conv1d(projected, delta_net, meta, state, mixed)
    recurrent.gated_delta_rule(mixed, projected, delta_net, meta, state, out)
    return out

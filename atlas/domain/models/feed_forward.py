"""Feed-forwards: a dense GLU (SiLU or GELU-tanh) and a mixture of experts (top-k routing,
shared experts). The norm before each is data of its first member."""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.models.layers import LayerStep, WorkspaceNeeds
from atlas.ports.gpu import Kind, Tensor
from atlas.ports.kernels.dense import Projection
from atlas.ports.kernels.moe import PreparedMoe


@dataclass(frozen=True, slots=True)
class DenseFeedForward:
    """residual += down(act(gate(rmsnorm(residual))) * up(rmsnorm(residual)))."""

    gate_up: Projection  # the norm, [gate; up] and the activation
    down: Projection  # (with Gemma's post-feed-forward norm)
    intermediate_size: int
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return WorkspaceNeeds(
            scratch=(self.intermediate_size,), intermediate=self.hidden_size + 2 * self.intermediate_size
        )

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        dense = step.backend.dense
        hidden = step.scratch(0, self.intermediate_size)
        dense.project(residual, self.gate_up, hidden)
        dense.project_add(hidden, self.down, residual)


@dataclass(frozen=True, slots=True)
class MoeFeedForward:
    """residual += sum of each token's top-k experts, weighted, plus the shared expert."""

    moe: PreparedMoe
    top_k: int
    hidden_size: int
    expert_intermediate_size: int  # the widest of a routed expert's and the shared expert's

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.MOE})

    @property
    def needs(self) -> WorkspaceNeeds:
        return WorkspaceNeeds(
            scratch=(self.hidden_size,),
            intermediate=self.top_k * 2 * self.expert_intermediate_size + self.hidden_size,
            top_k=self.top_k,
        )

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        moe = step.backend.moe
        normed = step.scratch(0, self.hidden_size)
        expert_ids, expert_weights = step.routing(self.top_k)
        moe.route(residual, self.moe, normed, expert_ids, expert_weights)
        moe.experts(normed, self.moe, expert_ids, expert_weights, residual)

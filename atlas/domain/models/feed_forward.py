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
        return dense_needs(self.intermediate_size, self.hidden_size)

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
        return moe_needs(self.top_k, self.expert_intermediate_size, self.hidden_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        normed, expert_ids, expert_weights = route_tokens(step, residual, self.moe, self.top_k, self.hidden_size)
        step.backend.moe.experts(normed, self.moe, expert_ids, expert_weights, residual)


def dense_needs(intermediate_size: int, hidden_size: int) -> WorkspaceNeeds:
    """The scratch a dense feed-forward's step takes: act(gate) * up."""
    return WorkspaceNeeds(scratch=(intermediate_size,), intermediate=hidden_size + 2 * intermediate_size)


def moe_needs(top_k: int, expert_intermediate_size: int, hidden_size: int) -> WorkspaceNeeds:
    """The scratch a mixture of experts' step takes: the normed rows, and each token's top k."""
    return WorkspaceNeeds(
        scratch=(hidden_size,), intermediate=top_k * 2 * expert_intermediate_size + hidden_size, top_k=top_k
    )


def route_tokens(
    step: LayerStep, residual: Tensor, moe: PreparedMoe, top_k: int, hidden_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The MoE's input norm and routing: (normed rows, expert ids, expert weights) for the
    experts that follow (all of them, or a rank's)."""
    normed = step.scratch(0, hidden_size)
    expert_ids, expert_weights = step.routing(top_k)
    step.backend.moe.route(residual, moe, normed, expert_ids, expert_weights)
    return normed, expert_ids, expert_weights

"""The MoE kind: routing each token to its top-k experts, and the grouped experts over the routed
tokens (a shared expert included).

A mixture-of-experts feed-forward is two members:

    route(residual, moe, normed, expert_ids, expert_weights)    # rmsnorm, router, top-k
    experts(normed, moe, expert_ids, expert_weights, residual)  # residual += routed + shared

Routing (softmax or sigmoid scores, renormalisation, a selection bias, a scaling) and the
experts' activation (SwiGLU, GPT-OSS's clamped SwiGLU with its biases) are data. The split lets
expert parallelism move the routed tokens between ranks between the two.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from atlas.ports.gpu import Tensor
from atlas.ports.kernels.host_weights import GatedActivation, HostLinear, RmsNorm


class Scoring(enum.Enum):
    SOFTMAX = "softmax"  # scores = softmax(logits) over all experts
    SIGMOID = "sigmoid"  # scores = sigmoid(logits), each expert on its own


@dataclass(frozen=True, slots=True)
class Routing:
    """How a token's experts and their weights follow from the router's logits [E]:

        scores   = softmax(logits) or sigmoid(logits)        (float32)
        chosen   = the top_k experts by scores + selection_bias (ties: lowest expert id)
        weights  = scores[chosen], divided by their sum if `renormalize`, times `scaling`

    (GPT-OSS's softmax over the top-k logits is SOFTMAX with renormalize.)
    """

    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = False
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k: {self.top_k} must be in [1, num_experts = {self.num_experts}]")


@dataclass(frozen=True, slots=True)
class HostSharedExpert:
    """An expert every token goes through: down(act(gate_up(x))) with the routed experts'
    activation, times sigmoid(x @ gate.T) where `gate` ([1, H]) is given (Qwen3-Next)."""

    gate_up: HostLinear  # [2 Is, H]: gate rows, then up rows
    down: HostLinear  # [H, Is]
    gate: HostLinear | None = None


@dataclass(frozen=True, slots=True)
class HostMoe:
    """A mixture-of-experts feed-forward.

    input_norm: the RMSNorm of the residual stream that router and experts read.
    router: [E, H], bias [E] optional (added to the logits: GPT-OSS).
    gate_up: [E, 2I, H], each expert's gate rows then up rows, biases [E, 2I] optional.
    down: [E, H, I], biases [E, H] optional.
    selection_bias: [E] f32 added to the scores to choose experts, not to weigh them
        (DeepSeek-V3's correction bias); None: 0.
    first_expert: an expert-parallel rank's share. gate_up and down (and their biases) then
        hold experts first_expert .. first_expert + H - 1 of the E the router scores (H their
        leading dimension); `experts` adds those experts' contributions only (the ranks' parts
        are summed by an all-reduce). 0 with all E held: the whole layer.
    """

    input_norm: RmsNorm
    router: HostLinear
    gate_up: HostLinear
    down: HostLinear
    activation: GatedActivation
    routing: Routing
    selection_bias: np.ndarray | None = None
    shared: HostSharedExpert | None = None
    first_expert: int = 0


class PreparedMoe(Protocol):
    """A backend's prepared MoE feed-forward (opaque)."""


class MoeKernels(Protocol):
    def prepare(self, host: HostMoe) -> PreparedMoe:
        """The backend's form of one MoE feed-forward, made once at load. Raises
        `UnsupportedError` naming what it cannot run (a scoring, an activation, a weight format)
        and `ValueError` for shapes that do not fit the routing."""
        ...

    def route(
        self, x: Tensor, moe: PreparedMoe, normed: Tensor, expert_ids: Tensor, expert_weights: Tensor
    ) -> None:
        """normed = rmsnorm(x, input_norm); each token's experts and weights from the logits
        normed @ router.T (+ bias), as `Routing` defines, highest score + selection bias first.
        x [N, H] (the residual stream, only read), normed [N, H] of x's dtype, expert_ids
        [N, top_k] i32, expert_weights [N, top_k] f32. normed is written on return; the ids and
        weights may be written by the `experts` call that follows instead (CUDA routes a lone
        token inside its expert kernels), so they are the routing once that call has run."""
        ...

    def experts(
        self,
        normed: Tensor,
        moe: PreparedMoe,
        expert_ids: Tensor,
        expert_weights: Tensor,
        residual: Tensor,
        accumulate: bool = True,
    ) -> None:
        """residual[t] += sum over k of expert_weights[t, k] * E_{expert_ids[t, k]}(normed[t])
        + the shared expert of normed[t], where E_e(x) = (act(x @ gate_up[e].T + b) @ down[e].T + b).
        normed [N, H], residual [N, H]; ids and weights as `route` wrote them, and the call
        follows that `route` call on the same stream with no other MoE call between (a backend
        may hand what routing learned to the experts: CUDA's slot table). Only the experts held
        (`HostMoe.first_expert`) contribute; ids of others are skipped. With `accumulate` False
        the sum replaces residual[t], whose old value is not read (a tensor-parallel rank that
        does not carry the residual stream writes its share in place of it)."""
        ...

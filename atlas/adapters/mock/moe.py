"""The mock's MoE kind: routing and the experts in numpy, one expert at a time over the tokens
routed to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from atlas.adapters.mock.dense import MockLinear, MockNorm, apply_norm, gated_activation
from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import GatedActivation
from atlas.ports.kernels.moe import HostMoe, Routing, Scoring

if TYPE_CHECKING:
    from atlas.adapters.mock.backend import MockGpuBackend


@dataclass(frozen=True, slots=True)
class MockSharedExpert:
    gate_up: MockLinear
    down: MockLinear
    gate: MockLinear | None


@dataclass(frozen=True, slots=True)
class MockMoeLayer:
    input_norm: MockNorm
    router: MockLinear
    gate_up: MockLinear  # [E, 2I, H]
    down: MockLinear  # [E, H, I]
    activation: GatedActivation
    routing: Routing
    selection_bias: np.ndarray | None  # [E] f32
    shared: MockSharedExpert | None
    first_expert: int  # gate_up and down hold experts first_expert.. (an expert-parallel rank's)


class MockMoe:
    """`MoeKernels` in numpy."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self._backend = backend

    def prepare(self, host: HostMoe) -> MockMoeLayer:
        self._backend.enter("moe.prepare")
        routing, dense = host.routing, self._backend.dense
        num_experts, hidden = routing.num_experts, host.router.in_features
        held = host.gate_up.weight.shape[0]
        if not (0 <= host.first_expert and host.first_expert + held <= num_experts):
            raise ValueError(f"first_expert: {held} experts from {host.first_expert} exceed the {num_experts} routed")
        expected = {
            "router": (host.router.weight.shape, (num_experts, hidden)),
            "gate_up": (host.gate_up.weight.shape[:1] + host.gate_up.weight.shape[2:], (held, hidden)),
            "down": (host.down.weight.shape[:2], (held, hidden)),
        }
        for name, (got, want) in expected.items():
            if tuple(got) != want:
                raise ValueError(
                    f"{name}: weight shape {list(got)} does not fit {num_experts} experts of width {hidden}"
                )
        if host.selection_bias is not None and np.shape(host.selection_bias) != (num_experts,):
            raise ValueError(f"selection_bias: shape {np.shape(host.selection_bias)} is not [{num_experts}]")
        shared = None
        if host.shared is not None:
            gate = None if host.shared.gate is None else dense.linear(host.shared.gate)
            shared = MockSharedExpert(dense.linear(host.shared.gate_up), dense.linear(host.shared.down), gate)
        bias = None if host.selection_bias is None else np.asarray(host.selection_bias, np.float32).copy()
        return MockMoeLayer(dense.norm(host.input_norm), dense.linear(host.router), dense.linear(host.gate_up),
                            dense.linear(host.down), host.activation, routing, bias, shared, host.first_expert)

    def route(
        self, x: MockTensor, moe: MockMoeLayer, normed: MockTensor, expert_ids: MockTensor, expert_weights: MockTensor
    ) -> None:
        self._backend.enter("moe.route")
        routing = moe.routing
        num_tokens = x.shape[0]
        outputs = (("expert_ids", expert_ids, DType.I32), ("expert_weights", expert_weights, DType.F32))
        for name, tensor, dtype in outputs:
            if tensor.shape != (num_tokens, routing.top_k) or tensor.dtype is not dtype:
                raise ValueError(f"{name}: {list(tensor.shape)} {tensor.dtype.value}, expected "
                                 f"[{num_tokens}, {routing.top_k}] {dtype.value}")
        values = self._backend.dense.rounded(apply_norm(x.as_f32(), moe.input_norm))
        normed.data[...] = values
        logits = moe.router.apply(normed.as_f32())
        if routing.scoring is Scoring.SOFTMAX:
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            scores = shifted / shifted.sum(axis=1, keepdims=True)
        else:
            scores = 1.0 / (1.0 + np.exp(-logits))
        ranked = scores if moe.selection_bias is None else scores + moe.selection_bias
        chosen = np.argsort(-ranked, axis=1, kind="stable")[:, : routing.top_k]  # ties: lowest id first
        weights = np.take_along_axis(scores, chosen, axis=1)
        if routing.renormalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
        expert_ids.data[...] = chosen
        expert_weights.data[...] = weights * np.float32(routing.scaling)

    def experts(
        self,
        normed: MockTensor,
        moe: MockMoeLayer,
        expert_ids: MockTensor,
        expert_weights: MockTensor,
        residual: MockTensor,
        accumulate: bool = True,
    ) -> None:
        self._backend.enter("moe.experts")
        dense = self._backend.dense
        x = normed.as_f32()
        ids, weights = expert_ids.data, expert_weights.data
        total = np.zeros((x.shape[0], residual.shape[1]), np.float32)
        gate_up, gate_up_bias = moe.gate_up.weight.weight_f32(), moe.gate_up.bias
        down, down_bias = moe.down.weight.weight_f32(), moe.down.bias
        held = range(moe.first_expert, moe.first_expert + gate_up.shape[0])
        for expert in np.unique(ids):
            if expert not in held:
                continue
            local = expert - moe.first_expert
            tokens, picks = np.nonzero(ids == expert)
            hidden = x[tokens] @ gate_up[local].T
            if gate_up_bias is not None:
                hidden += gate_up_bias.weight_f32()[local]
            hidden = dense.rounded(gated_activation(dense.rounded(hidden), moe.activation))
            out = hidden @ down[local].T
            if down_bias is not None:
                out += down_bias.weight_f32()[local]
            np.add.at(total, tokens, out * weights[tokens, picks, None])
        if moe.shared is not None:
            shared = moe.shared.down.apply(
                dense.rounded(gated_activation(dense.rounded(moe.shared.gate_up.apply(x)), moe.activation))
            )
            if moe.shared.gate is not None:
                shared = shared / (1.0 + np.exp(-moe.shared.gate.apply(x)))
            total += shared
        residual.data[...] = (residual.as_f32() if accumulate else 0.0) + dense.rounded(total)

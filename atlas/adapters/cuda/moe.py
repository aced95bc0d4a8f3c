"""The MoE kind on CUDA: routing on the device (one launch at decode sizes) and the experts
grouped by expert (a grouped GEMV over the active experts' weights at decode, an aligned grouped
GEMM at prefill), the shared expert in the same launches, and a combine that adds the weighted
outputs into the residual (kernels/common/moe.cu, ops_moe.py).

`prepare` uploads the experts as the checkpoint gives them ([E, 2I, H], [E, H, I]: an
expert-parallel rank's E held experts from `HostMoe.first_expert`): bf16, or E4M3 bytes with
their per-channel or 128 x 128 block scales (expert_fp8.py), which the `_fp8` kernels read at
half bf16's bytes. A shared expert follows the experts' format (an E4M3 one beside bf16 experts
is held in bf16, dequantized); the router and the shared expert's gate stay float. The norm
weight stays apart (route writes the normalised rows the experts read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlas.adapters.cuda import checks, ops_dense, ops_moe
from atlas.adapters.cuda.expert_fp8 import Fp8ExpertStack, Fp8MoeWeights, fp8_moe_weights, is_fp8
from atlas.adapters.cuda.ops_dense import LinearOp
from atlas.adapters.cuda.ops_moe import ExpertScales, ExpertWeights, RoutingArgs
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType, UnsupportedError
from atlas.ports.kernels.host_weights import HostLinear
from atlas.ports.kernels.moe import HostMoe, Scoring


@dataclass(frozen=True, slots=True)
class CudaMoeLayer:
    input_norm: CudaTensor  # [H] bf16
    eps: float
    router: CudaTensor  # [E, H] bf16
    router_bias: CudaTensor | None  # [E] bf16
    routing: RoutingArgs
    experts: ExpertWeights


class CudaMoe:
    """`MoeKernels` on one GPU."""

    def __init__(self, rt: CudaRuntime, linear: LinearOp, upload) -> None:
        self._rt = rt
        self._linear = linear
        self._upload = upload  # CudaGpuBackend.upload

    def prepare(self, host: HostMoe) -> CudaMoeLayer:
        routing = host.routing
        experts, hidden = routing.num_experts, host.router.in_features
        inner, held = host.down.in_features, np.shape(host.gate_up.weight)[0]
        if not (0 <= host.first_expert and host.first_expert + held <= experts):
            raise ValueError(f"first_expert: {held} experts from {host.first_expert} exceed the {experts} routed")
        if is_fp8(host.router):
            raise UnsupportedError("router: an FP8 router is not supported by the CUDA backend; published FP8 "
                                   "checkpoints keep mlp.gate in bf16 (list it in the quantization config's ignore)")
        if is_fp8(host.gate_up) != is_fp8(host.down):
            raise UnsupportedError("gate_up / down: the experts mix FP8 and float weights, which the CUDA kernels "
                                   "cannot read in one layer")
        expected = {
            "router": (tuple(host.router.weight.shape), (experts, hidden)),
            "gate_up": (tuple(np.shape(host.gate_up.weight)), (held, 2 * inner, hidden)),
            "down": (tuple(np.shape(host.down.weight)), (held, hidden, inner)),
        }
        for name, (got, want) in expected.items():
            if got != want:
                raise ValueError(f"{name}: weight shape {list(got)} does not fit {experts} experts of width {hidden}")
        if experts > ops_moe.MAX_EXPERTS:
            raise UnsupportedError(f"routing.num_experts: {experts} is over the CUDA kernels' {ops_moe.MAX_EXPERTS}")
        if routing.top_k > ops_moe.MAX_TOP_K:
            raise UnsupportedError(f"routing.top_k: {routing.top_k} is over the CUDA kernels' {ops_moe.MAX_TOP_K}")
        if hidden % 8 or inner % 8:
            raise UnsupportedError(f"gate_up: hidden {hidden} and inner {inner} must be multiples of 8 on CUDA")
        upload = self._upload
        bias = None if host.selection_bias is None else upload(np.asarray(host.selection_bias, np.float32), DType.F32)
        args = RoutingArgs(experts, routing.top_k, routing.scoring is Scoring.SIGMOID, routing.renormalize,
                           routing.scaling, bias)
        return CudaMoeLayer(
            upload(host.input_norm.weight, DType.BF16), host.input_norm.eps, upload(host.router.weight, DType.BF16),
            self._bias(host.router), args, self._experts(host, hidden),
        )

    def _experts(self, host: HostMoe, hidden: int) -> ExpertWeights:
        upload = self._upload
        activation = ops_moe.gated_kind(host.activation)
        fp8 = self._fp8(host, activation) if is_fp8(host.gate_up) else None
        shared_gate_up = shared_down = shared_gate = None
        if host.shared is not None:
            shared_gate_up, shared_down, shared_gate = self._shared(host, hidden, fp8)
        if fp8 is None:
            gate_up, down = upload(host.gate_up.weight, DType.BF16), upload(host.down.weight, DType.BF16)
            scales = None
        else:
            gate_up, down = upload(fp8.gate_up.data, DType.FP8_E4M3), upload(fp8.down.data, DType.FP8_E4M3)
            scales = ExpertScales(fp8.block, self._scales(fp8.gate_up), self._scales(fp8.down),
                                  self._scales(fp8.shared_gate_up), self._scales(fp8.shared_down))
        return ExpertWeights(
            gate_up=gate_up,
            gate_up_bias=self._bias(host.gate_up),
            down=down,
            down_bias=self._bias(host.down),
            shared_gate_up=shared_gate_up,
            shared_down=shared_down,
            shared_gate=shared_gate,
            activation=activation,
            first_expert=host.first_expert,
            scales=scales,
        )

    def _bias(self, linear: HostLinear) -> CudaTensor | None:
        return None if linear.bias is None else self._upload(linear.bias, DType.BF16)

    def _fp8(self, host: HostMoe, activation: ops_moe.GatedKind) -> Fp8MoeWeights:
        """The E4M3 experts as the `_fp8` kernels read them; `UnsupportedError` for what they
        cannot run (the GPU, the activation, and expert_fp8.py's refusals)."""
        major, minor = self._rt.compute_capability
        if (major, minor) < (8, 9):
            raise UnsupportedError(f"gate_up: FP8 experts run on sm_89 and later GPUs; this one is sm_{major}{minor}")
        if activation.name not in ops_moe.FP8_ACTIVATIONS:
            raise UnsupportedError(f"activation: FP8 experts run with {', '.join(ops_moe.FP8_ACTIVATIONS)} gating on "
                                   f"the CUDA backend, not {activation.name}")
        return fp8_moe_weights(host)

    def _scales(self, stack: Fp8ExpertStack | None) -> CudaTensor | None:
        return None if stack is None else self._upload(stack.scales, DType.F32)

    def _shared(
        self, host: HostMoe, hidden: int, fp8: Fp8MoeWeights | None
    ) -> tuple[CudaTensor, CudaTensor, CudaTensor | None]:
        """The shared expert's gate_up, down and gate row on the device: E4M3 bytes beside FP8
        experts (their scales go with the experts'), else bf16 (an FP8 one dequantized)."""
        shared = host.shared
        assert shared is not None
        parts = (("shared.gate_up", shared.gate_up), ("shared.down", shared.down), ("shared.gate", shared.gate))
        for name, linear in parts:
            if linear is not None and linear.bias is not None:
                raise UnsupportedError(f"{name}: biases are not supported by the CUDA backend yet")
        inner = shared.down.in_features
        if shared.gate_up.weight.shape != (2 * inner, hidden) or shared.down.weight.shape != (hidden, inner):
            raise ValueError(f"shared: gate_up {list(shared.gate_up.weight.shape)} / down "
                             f"{list(shared.down.weight.shape)} do not fit width {hidden}")
        if inner % 8:
            raise UnsupportedError(f"shared: inner {inner} must be a multiple of 8 on CUDA")
        gate = None
        if shared.gate is not None:
            if shared.gate.weight.shape != (1, hidden):
                raise ValueError(f"shared.gate: shape {list(shared.gate.weight.shape)} is not [1, {hidden}]")
            gate = self._upload(np.asarray(shared.gate.values()).reshape(hidden), DType.BF16)
        if fp8 is not None:
            assert fp8.shared_gate_up is not None and fp8.shared_down is not None
            return (self._upload(fp8.shared_gate_up.data, DType.FP8_E4M3),
                    self._upload(fp8.shared_down.data, DType.FP8_E4M3), gate)
        gate_up, down = (part.values() if is_fp8(part) else part.weight for part in (shared.gate_up, shared.down))
        return self._upload(gate_up, DType.BF16), self._upload(down, DType.BF16), gate

    def route(
        self, x: CudaTensor, moe: CudaMoeLayer, normed: CudaTensor, expert_ids: CudaTensor, expert_weights: CudaTensor
    ) -> None:
        rt = self._rt
        checks.rank(x, "x", 2)
        checks.dtype(x, "x", (DType.BF16,))
        num_tokens, hidden = x.shape
        if hidden != moe.router.shape[1]:
            raise ValueError(f"x: width {hidden} is not the router's {moe.router.shape[1]}")
        checks.shape(normed, "normed", x.shape)
        checks.dtype(normed, "normed", (DType.BF16,))
        ops_moe.check_routing_outputs(expert_ids, expert_weights, num_tokens, moe.routing.top_k)
        if num_tokens == 0:
            return
        held = ops_moe.HeldExperts(moe.experts.first_expert, moe.experts.num_experts)
        if num_tokens <= ops_moe.ROUTE_SMALL_MAX_TOKENS:
            ops_moe.route_small(rt, x, moe.input_norm, moe.eps, moe.router, moe.router_bias, moe.routing, held,
                                normed, expert_ids, expert_weights)
            return
        ops_dense.rmsnorm(rt, x, None, moe.input_norm, moe.eps, normed)
        logits = rt.scratch_tensor("moe_logits", (num_tokens, moe.routing.num_experts), DType.F32)
        self._linear(normed, moe.router, logits, moe.router_bias)
        ops_moe.top_k(rt, logits, moe.routing, held, expert_ids, expert_weights)

    def experts(
        self,
        normed: CudaTensor,
        moe: CudaMoeLayer,
        expert_ids: CudaTensor,
        expert_weights: CudaTensor,
        residual: CudaTensor,
        accumulate: bool = True,
    ) -> None:
        checks.rank(normed, "normed", 2)
        checks.dtype(normed, "normed", (DType.BF16,))
        checks.dtype(residual, "residual", (DType.BF16,))
        checks.shape(residual, "residual", normed.shape)
        if normed.shape[1] != moe.experts.hidden:
            raise ValueError(f"normed: width {normed.shape[1]} is not the experts' {moe.experts.hidden}")
        ops_moe.check_routing_outputs(expert_ids, expert_weights, normed.shape[0], moe.routing.top_k)
        ops_moe.experts(self._rt, moe.experts, moe.routing, normed, expert_ids, expert_weights, residual, accumulate)

// Gated activations of a [gate | up] product as one function of (gate, up), for the kernels that
// take the activation as a template parameter and its constants at run time (the MoE experts, the
// dense variants): SwiGLU, GeGLU (tanh GELU) and GPT-OSS's clamped SwiGLU.
//
//     GATED_SILU:      silu(gate) * up
//     GATED_GELU_TANH: gelu_tanh(gate) * up
//     GATED_CLAMPED:   g = min(gate, limit), u = clamp(up, -limit, limit),
//                      g * sigmoid(alpha * g) * (u + 1)
//
// Callers round gate and up to bf16 first and the result after, as an unfused product, bias add
// and act_mul would (the mock's rounding points).
#pragma once

#include "atlas_common.cuh"

#define GATED_SILU 0
#define GATED_GELU_TANH 1
#define GATED_CLAMPED 2

template <int ACT>
__device__ __forceinline__ float gated_value(float gate, float up, float alpha, float limit) {
    if constexpr (ACT == GATED_SILU) {
        return SiluOp()(gate) * up;
    } else if constexpr (ACT == GATED_GELU_TANH) {
        return GeluTanhOp()(gate) * up;
    } else {
        const float g = fminf(gate, limit);
        const float u = fminf(fmaxf(up, -limit), limit);
        return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

__device__ __forceinline__ float round_bf16(float x) { return to_float(from_float<bf16>(x)); }

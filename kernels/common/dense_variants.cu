// The dense kind's family variants, as small kernels around the existing products (the Llama
// path never launches them):
//
// scale_bf16:            x[i] = bf16(x[i] * scale) in place: Gemma's embedding scale after the
//                        lookup (a tied head reads the table unscaled). Bytes 4 n.
// softcap_f32:           x[i] = cap tanh(x[i] / cap) in place: soft-capped logits. Bytes 8 n.
// gated_act_<act>:       out[t, i] = bf16(act(x[t, i], x[t, I + i])) (gated_act.cuh: SwiGLU, GeGLU,
//                        the clamped SwiGLU with alpha and limit) over x [N, 2I] bf16 (a product
//                        with its bias). Bytes 6 N I.
// add_rmsnorm_of_bf16:   residual[t] = bf16(residual[t] + bf16(rmsnorm(delta[t]) * weight)): a
//                        sandwich norm after an output projection (Gemma's post-norms), a block per
//                        row, H % 8 == 0. Bytes 6 N H.
// All are bound by HBM bandwidth (or by launch latency at decode sizes).
#include "atlas_common.cuh"
#include "gated_act.cuh"

extern "C" __global__ void scale_bf16(bf16* x, long long count, float scale) {
    dependent_launch_entry();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
        x[i] = from_float<bf16>(to_float(x[i]) * scale);
}

extern "C" __global__ void softcap_f32(float* x, long long count, float cap) {
    dependent_launch_entry();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

template <int ACT>
__device__ __forceinline__ void gated_act_impl(const bf16* x, bf16* out, int num_tokens, int inner, float alpha,
                                               float limit) {
    const long long total = (long long)num_tokens * inner;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long token = i / inner, feature = i % inner;
        const bf16* row = x + token * 2 * inner;
        out[i] = from_float<bf16>(gated_value<ACT>(to_float(row[feature]), to_float(row[inner + feature]), alpha, limit));
    }
}

#define DEFINE_GATED_ACT(NAME, ACT)                                                                      \
    extern "C" __global__ void gated_act_##NAME(const bf16* x, bf16* out, int num_tokens, int inner,    \
                                                float alpha, float limit) {                             \
        dependent_launch_entry();                                                                       \
        gated_act_impl<ACT>(x, out, num_tokens, inner, alpha, limit);                                   \
    }

DEFINE_GATED_ACT(silu, GATED_SILU)
DEFINE_GATED_ACT(gelu_tanh, GATED_GELU_TANH)
DEFINE_GATED_ACT(clamped, GATED_CLAMPED)

extern "C" __global__ void __launch_bounds__(256)
    add_rmsnorm_of_bf16(const bf16* delta, const bf16* weight, float eps, bf16* residual, int hidden) {
    dependent_launch_entry();
    __shared__ float scratch[32];
    const bf16* row = delta + (long long)blockIdx.x * hidden;
    const float inverse_rms = block_inverse_rms(row, hidden, eps, scratch);
    bf16* stream = residual + (long long)blockIdx.x * hidden;
    for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
        float values[8], scales[8], current[8];
        load8(row + col, values);
        load8(weight + col, scales);
        load8(stream + col, current);
#pragma unroll
        for (int i = 0; i < 8; ++i) current[i] += round_bf16(values[i] * inverse_rms * scales[i]);
        store8(stream + col, current);
    }
}

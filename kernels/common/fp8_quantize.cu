// Activations to E4M3 for the FP8 tensor-core products (cuBLASLt's FP8 GEMM over FP8 weights):
// each token row's values v, optionally normalised first,
//
//     v = x                                   (no norm_weight)
//     v = x / sqrt(mean(x^2) + eps) * g       (norm_weight g: the projection's input RMSNorm)
//
// stored as q = e4m3(v / s) with s = amax / 448 over
//
//     quantize_e4m3_token[_norm_<g type>]:  the whole row   -> scales [rows] f32
//     quantize_e4m3_group[_norm_<g type>]:  each 128 columns -> scales [ceil(K / 128)][rows] f32
//                                           (token-major: cuBLASLt's VEC128 layout for B)
//
// so that v = q * s to E4M3's rounding (3 mantissa bits: a relative error of at most 2^-4 per
// value). In f32: q = e4m3_rn(v * (448 / amax)), s = amax / 448, both divisions IEEE. An input
// exactly halfway between two E4M3 values (frequent for bf16 x without a norm: 19.125 under amax
// 51 is 168, between 160 and 176) rounds by the f32 reciprocal's error, not to even.
// x [N, K] bf16; q [rows, K] E4M3; rows >= N, and rows past N (cuBLASLt's block-scaled products
// want a multiple of 4) get zeros and scale 0. A zero row gets scale 0 and zeros.
// K % 8 == 0 (token) or K % 4 == 0 (group), 16-byte aligned rows (the host checks).
//
// One block of 256 threads per row. Bytes: 2 N K read (twice more from L1/L2 with the norm) and
// N K written, plus the scales: HBM-bound at prefill sizes, launch-latency-bound at decode ones.
#include "atlas_common.cuh"

#define QUANT_THREADS 256
#define QUANT_GROUP 128

// 1 / sqrt(mean(x^2) + eps) of the row, or 1 without a norm (every thread gets it).
template <typename NW>
__device__ __forceinline__ float quant_inverse_rms(const bf16* row, int width, const NW* norm_weight, float eps,
                                                   float* scratch) {
    if (norm_weight == nullptr) return 1.0f;
    return block_inverse_rms(row, width, eps, scratch);
}

template <typename NW>
__device__ __forceinline__ float quant_weight(const NW* norm_weight, int k) {
    return norm_weight == nullptr ? 1.0f : to_float(norm_weight[k]);
}

// 8 values times `inverse`, stored as E4M3 bytes.
__device__ __forceinline__ void store_e4m3x8(fp8_e4m3* q, const float* v, float inverse) {
    uint2 packed;
    packed.x = (u32)pack_fp8x2(v[0] * inverse, v[1] * inverse) | ((u32)pack_fp8x2(v[2] * inverse, v[3] * inverse) << 16);
    packed.y = (u32)pack_fp8x2(v[4] * inverse, v[5] * inverse) | ((u32)pack_fp8x2(v[6] * inverse, v[7] * inverse) << 16);
    *reinterpret_cast<uint2*>(q) = packed;
}

// One token row of at most QUANT_THREADS * 8 * CHUNKS columns, read from memory once: every thread
// issues its chunk loads together and keeps them in registers (4 a chunk) for the RMS, the amax
// and the write (`quantize_e4m3_token*_r<CHUNKS>`, CHUNKS the fewest of 1, 2, 4, 8 that hold the
// row, so the registers and the occupancy follow the row's width). Wider rows take
// quantize_token_impl's three passes over the row. The sums run in the same order as those
// passes', so both give the same bits. On an H200 the passes' quantize_e4m3_token_norm took 63 us
// a call on 8,192 rows of 4,096 against ~25 us of bytes, and at 64 rows (a block a row, half the
// SMs idle) each block's 21 dependent loads bounded it (docs/lab/cuda-runs.md).
template <typename NW, int CHUNKS>
__device__ __forceinline__ void quantize_row_resident(const bf16* __restrict__ x_row,
                                                      const NW* __restrict__ norm_weight, float eps,
                                                      fp8_e4m3* __restrict__ q_row, float* __restrict__ scale,
                                                      int inner, float* scratch) {
    Vec8<bf16> chunks[CHUNKS];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int k = (c * QUANT_THREADS + threadIdx.x) * 8;
        if (k < inner) chunks[c].load(x_row + k);
    }
    float inverse_rms = 1.0f;
    if (norm_weight != nullptr) {
        float sum_squares = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            if ((c * QUANT_THREADS + threadIdx.x) * 8 >= inner) break;
            float v[8];
            chunks[c].to_floats(v);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum_squares += v[i] * v[i];
        }
        inverse_rms = 1.0f / sqrtf(block_sum(sum_squares, scratch) / inner + eps);
    }
    auto values = [&](int c, float* v) {
        const int k = (c * QUANT_THREADS + threadIdx.x) * 8;
        chunks[c].to_floats(v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = v[i] * inverse_rms * quant_weight(norm_weight, k + i);
    };
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        if ((c * QUANT_THREADS + threadIdx.x) * 8 >= inner) break;
        float v[8];
        values(c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = block_max(amax, scratch);
    const float inverse = amax > 0.0f ? 448.0f / amax : 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int k = (c * QUANT_THREADS + threadIdx.x) * 8;
        if (k >= inner) break;
        float v[8];
        values(c, v);
        store_e4m3x8(q_row + k, v, inverse);
    }
    if (threadIdx.x == 0) *scale = amax / 448.0f;
}

template <typename NW, int CHUNKS>
__device__ __forceinline__ void quantize_token_impl(const bf16* __restrict__ x, const NW* __restrict__ norm_weight,
                                                    float eps, fp8_e4m3* __restrict__ q, float* __restrict__ scales,
                                                    int num_tokens, int inner) {
#if ATLAS_HAS_FP8
    __shared__ float scratch[32];
    dependent_launch_entry();
    const int row = blockIdx.x;
    fp8_e4m3* q_row = q + (long long)row * inner;
    if (row >= num_tokens) {  // padding: zeros, scale 0
        for (int k = threadIdx.x * 8; k < inner; k += QUANT_THREADS * 8)
            *reinterpret_cast<uint2*>(q_row + k) = make_uint2(0, 0);
        if (threadIdx.x == 0) scales[row] = 0.0f;
        return;
    }
    const bf16* x_row = x + (long long)row * inner;
    if constexpr (CHUNKS > 0) {
        quantize_row_resident<NW, CHUNKS>(x_row, norm_weight, eps, q_row, scales + row, inner, scratch);
        return;
    }
    const float inverse_rms = quant_inverse_rms(x_row, inner, norm_weight, eps, scratch);
    auto values = [&](int k, float* v) {
        load8(x_row + k, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = v[i] * inverse_rms * quant_weight(norm_weight, k + i);
    };
    float amax = 0.0f;
    for (int k = threadIdx.x * 8; k < inner; k += QUANT_THREADS * 8) {
        float v[8];
        values(k, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = block_max(amax, scratch);
    const float inverse = amax > 0.0f ? 448.0f / amax : 0.0f;
    for (int k = threadIdx.x * 8; k < inner; k += QUANT_THREADS * 8) {
        float v[8];
        values(k, v);
        store_e4m3x8(q_row + k, v, inverse);
    }
    if (threadIdx.x == 0) scales[row] = amax / 448.0f;
#else
    __trap();
#endif
}

// A warp per 128-column group (lane: 4 consecutive columns), the block's 8 warps taking groups in
// turn; the last group of a row may be partial.
template <typename NW>
__device__ __forceinline__ void quantize_group_impl(const bf16* __restrict__ x, const NW* __restrict__ norm_weight,
                                                    float eps, fp8_e4m3* __restrict__ q, float* __restrict__ scales,
                                                    int num_tokens, int num_rows, int inner) {
#if ATLAS_HAS_FP8
    __shared__ float scratch[32];
    dependent_launch_entry();
    const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (inner + QUANT_GROUP - 1) / QUANT_GROUP;
    fp8_e4m3* q_row = q + (long long)row * inner;
    const bool padding = row >= num_tokens;
    const bf16* x_row = x + (long long)(padding ? 0 : row) * inner;
    const float inverse_rms = padding ? 0.0f : quant_inverse_rms(x_row, inner, norm_weight, eps, scratch);
    for (int group = warp; group < groups; group += QUANT_THREADS / 32) {
        const int k = group * QUANT_GROUP + 4 * lane;
        const bool inside = k < inner && !padding;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (inside) {
            const uint2 raw = *reinterpret_cast<const uint2*>(x_row + k);
            const bf16x2* pairs = reinterpret_cast<const bf16x2*>(&raw);
            const float2 a = __bfloat1622float2(pairs[0]), b = __bfloat1622float2(pairs[1]);
            v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = v[i] * inverse_rms * quant_weight(norm_weight, k + i);
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        amax = warp_max(amax);
        const float inverse = amax > 0.0f ? 448.0f / amax : 0.0f;
        if (k < inner)
            *reinterpret_cast<u32*>(q_row + k) =
                (u32)pack_fp8x2(v[0] * inverse, v[1] * inverse) | ((u32)pack_fp8x2(v[2] * inverse, v[3] * inverse) << 16);
        if (lane == 0) scales[(long long)group * num_rows + row] = amax / 448.0f;
    }
#else
    __trap();
#endif
}

// quantize_e4m3_{token,group}[_norm_{bf16,f32}]: a grid of `num_rows` (>= num_tokens) blocks of
// QUANT_THREADS. norm_weight [K] (the _norm forms; null otherwise), eps.
#define DEFINE_QUANTIZE_RESIDENT(SUFFIX, NW, CHUNKS)                                                             \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) quantize_e4m3_token##SUFFIX##_r##CHUNKS(           \
        const bf16* x, const NW* norm_weight, float eps, fp8_e4m3* q, float* scales, int num_tokens, int inner) {  \
        quantize_token_impl<NW, CHUNKS>(x, norm_weight, eps, q, scales, num_tokens, inner);                       \
    }

#define DEFINE_QUANTIZE(SUFFIX, NW)                                                                               \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) quantize_e4m3_token##SUFFIX(                    \
        const bf16* x, const NW* norm_weight, float eps, fp8_e4m3* q, float* scales, int num_tokens, int inner) {  \
        quantize_token_impl<NW, 0>(x, norm_weight, eps, q, scales, num_tokens, inner);                            \
    }                                                                                                             \
    DEFINE_QUANTIZE_RESIDENT(SUFFIX, NW, 1)                                                                       \
    DEFINE_QUANTIZE_RESIDENT(SUFFIX, NW, 2)                                                                       \
    DEFINE_QUANTIZE_RESIDENT(SUFFIX, NW, 4)                                                                       \
    DEFINE_QUANTIZE_RESIDENT(SUFFIX, NW, 8)                                                                       \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) quantize_e4m3_group##SUFFIX(                       \
        const bf16* x, const NW* norm_weight, float eps, fp8_e4m3* q, float* scales, int num_tokens, int num_rows, \
        int inner) {                                                                                              \
        quantize_group_impl<NW>(x, norm_weight, eps, q, scales, num_tokens, num_rows, inner);                     \
    }

DEFINE_QUANTIZE(, bf16)
DEFINE_QUANTIZE(_norm_bf16, bf16)
DEFINE_QUANTIZE(_norm_f32, float)

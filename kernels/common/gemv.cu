// Skinny matrix product for decode: out[n, m] = sum_k x[n, k] * w[m, k] (+ bias[m]) for a few
// token rows n < N <= 8.
//
//   x [N, K] bf16, w [M, K] bf16 row-major (the checkpoint's [out, in]), bias [M] bf16 or null,
//   out [N, M] bf16 or f32.  K % 8 == 0 (16-byte loads; the host checks).
//
// Bytes: M K 2 (the weight, read once) + N K 2 + N M sizeof(out); FLOPs: 2 N M K.  At N <= 8 the
// arithmetic intensity is <= 8 FLOP/byte, far under the ridge (~200 on an H200), so the kernel
// must run at HBM bandwidth: every lane issues 16-byte loads of ROWS weight rows at once (and the
// loop is unrolled twice), giving 32 * 16 * ROWS * 2 bytes in flight per warp; weights stream
// through the non-coherent path while x stays hot in L1.
//
// Layout of the work: a warp owns ROWS consecutive output features, its lanes stride over K in
// chunks of 8 elements; the TOKENS accumulators per row are reduced across the warp at the end.
//
//     w rows m0 .. m0+ROWS-1:  | lane0: k 0..7 | lane1: k 8..15 | ... | lane31 | lane0: k 256.. |
//     x rows 0 .. N-1, same k chunks, reused by every row of the warp
#include "atlas_common.cuh"

#define GEMV_WARPS 4

__device__ __forceinline__ uint4 load_streaming(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    const bf16x2* pa = reinterpret_cast<const bf16x2*>(&a);
    const bf16x2* pb = reinterpret_cast<const bf16x2*>(&b);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fa = __bfloat1622float2(pa[i]);
        const float2 fb = __bfloat1622float2(pb[i]);
        sum = fmaf(fa.x, fb.x, sum);
        sum = fmaf(fa.y, fb.y, sum);
    }
    return sum;
}

template <typename OUT, int ROWS, int TOKENS>
__device__ __forceinline__ void gemv_impl(const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens,
                                          int num_rows, int inner) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_row = (blockIdx.x * GEMV_WARPS + warp) * ROWS;
    if (first_row >= num_rows) return;

    float acc[ROWS][TOKENS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) acc[r][n] = 0.0f;

    const bf16* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        // Rows past the end re-read the last valid row; their results are never stored.
        const int row = min(first_row + r, num_rows - 1);
        w_rows[r] = w + (long long)row * inner;
    }

#pragma unroll 2
    for (int k = lane * 8; k < inner; k += 32 * 8) {
        uint4 weights[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) weights[r] = load_streaming(w_rows[r] + k);
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            if (n < num_tokens) {
                const uint4 xs = *reinterpret_cast<const uint4*>(x + (long long)n * inner + k);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r][n] += dot8(weights[r], xs);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = first_row + r;
        const float bias_value = (bias != nullptr && row < num_rows) ? to_float(bias[row]) : 0.0f;
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            const float total = warp_sum(acc[r][n]);
            if (lane == 0 && n < num_tokens && row < num_rows)
                out[(long long)n * num_rows + row] = from_float<OUT>(total + bias_value);
        }
    }
}

#define DEFINE_GEMV(OUT_NAME, OUT, ROWS, TOKENS)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_##OUT_NAME##_r##ROWS##_t##TOKENS(       \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner) {   \
        gemv_impl<OUT, ROWS, TOKENS>(x, w, bias, out, num_tokens, num_rows, inner);                            \
    }

#define DEFINE_GEMV_TOKENS(OUT_NAME, OUT, ROWS) \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 1)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 2)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 4)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 8)

DEFINE_GEMV_TOKENS(bf16, bf16, 1)
DEFINE_GEMV_TOKENS(bf16, bf16, 2)
DEFINE_GEMV_TOKENS(bf16, bf16, 4)
DEFINE_GEMV_TOKENS(f32, float, 1)
DEFINE_GEMV_TOKENS(f32, float, 2)
DEFINE_GEMV_TOKENS(f32, float, 4)

// Bias for the cuBLASLt path when its epilogue cannot take it (f32 output): out[n, m] += bias[m].
template <typename OUT>
__device__ __forceinline__ void add_bias_impl(OUT* out, const bf16* bias, int num_tokens, int num_rows) {
    const long long total = (long long)num_tokens * num_rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_float<OUT>(to_float(out[i]) + to_float(bias[i % num_rows]));
}

extern "C" __global__ void add_bias_bf16(bf16* out, const bf16* bias, int num_tokens, int num_rows) {
    add_bias_impl<bf16>(out, bias, num_tokens, num_rows);
}

extern "C" __global__ void add_bias_f32(float* out, const bf16* bias, int num_tokens, int num_rows) {
    add_bias_impl<float>(out, bias, num_tokens, num_rows);
}

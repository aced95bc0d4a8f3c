// Skinny matrix product for decode: out[n, m] = sum_k x[n, k] * w[m, k] (+ bias[m]) for a few
// token rows n < N <= 8.
//
//   x [N, K] bf16, w [M, K] bf16 row-major (the checkpoint's [out, in]), bias [M] bf16 or null,
//   out [N, M] bf16 or f32.  K % 8 == 0 (16-byte loads; the host checks).
//
// Bytes: M K 2 (the weight, read once) + N K 2 + N M sizeof(out); FLOPs: 2 N M K.  At N <= 8 the
// arithmetic intensity is <= 8 FLOP/byte, far under the ridge (~200 on an H200), so the kernel
// must run at HBM bandwidth.
//
// Layout of the work: a block owns ROWS consecutive output features; its 4 warps split K
// (split-K inside the block, so even a small M fills the GPU with ROWS-row blocks), each lane
// loading 16 bytes of every one of the ROWS weight rows per step (ROWS * 16 * 2 bytes in flight
// per lane with the 2x unroll). x chunks are converted once and reused by all ROWS rows, so
// L1 traffic for x is N / ROWS times the weight traffic. Partial sums meet in shared memory.
//
//     block b: rows m0 = b * ROWS .. m0 + ROWS - 1
//     warp w, lane l: k chunks (w * 32 + l) * 8, then + 4 * 32 * 8, ...
//     w rows:  | w0 l0 | w0 l1 | ... | w0 l31 | w1 l0 | ... | w3 l31 | w0 l0 | ...
#include "atlas_common.cuh"

#define GEMV_WARPS 4

__device__ __forceinline__ uint4 load_streaming(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void bf16x8_to_floats(uint4 raw, float* out) {
    const bf16x2* pairs = reinterpret_cast<const bf16x2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

template <typename OUT, int ROWS, int TOKENS>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                          int num_rows, int inner) {
    __shared__ float partial[GEMV_WARPS][ROWS][TOKENS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first_row = blockIdx.x * ROWS;

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
    for (int k = (warp * 32 + lane) * 8; k < inner; k += GEMV_WARPS * 32 * 8) {
        float weights[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) bf16x8_to_floats(load_streaming(w_rows[r] + k), weights[r]);
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            if (n < num_tokens) {
                float xs[8];
                bf16x8_to_floats(*reinterpret_cast<const uint4*>(x + (long long)n * inner + k), xs);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][n] = fmaf(weights[r][i], xs[i], acc[r][n]);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            const float total = warp_sum(acc[r][n]);
            if (lane == 0) partial[warp][r][n] = total;
        }
    __syncthreads();
    if (threadIdx.x < ROWS * TOKENS) {
        const int r = threadIdx.x / TOKENS, n = threadIdx.x % TOKENS;
        const int row = first_row + r;
        if (row < num_rows && n < num_tokens) {
            float total = bias != nullptr ? to_float(bias[row]) : 0.0f;
#pragma unroll
            for (int j = 0; j < GEMV_WARPS; ++j) total += partial[j][r][n];
            out[(long long)n * num_rows + row] = from_float<OUT>(total);
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

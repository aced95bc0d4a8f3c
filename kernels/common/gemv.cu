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
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
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

    // Full steps of BATCH chunks issue all their loads before the first FMA (BATCH * ROWS * 16
    // bytes of weights in flight per lane); the remaining chunks go one at a time.
    constexpr int STEP = GEMV_WARPS * 32 * 8;
    constexpr int BATCH = TOKENS <= 2 ? 4 : 2;
    auto accumulate = [&](const uint4* weights_raw, const uint4* x_raw) {
        float weights[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) bf16x8_to_floats(weights_raw[r], weights[r]);
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            if (n < num_tokens) {
                float xs[8];
                bf16x8_to_floats(x_raw[n], xs);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][n] = fmaf(weights[r][i], xs[i], acc[r][n]);
            }
        }
    };
    auto load_chunk = [&](int k, uint4* weights_raw, uint4* x_raw) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) weights_raw[r] = load_streaming(w_rows[r] + k);
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
            x_raw[n] = n < num_tokens ? *reinterpret_cast<const uint4*>(x + (long long)n * inner + k) : make_uint4(0, 0, 0, 0);
    };
    int k = (warp * 32 + lane) * 8;
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 weights_raw[BATCH][ROWS], x_raw[BATCH][TOKENS];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) load_chunk(k + u * STEP, weights_raw[u], x_raw[u]);
#pragma unroll
        for (int u = 0; u < BATCH; ++u) accumulate(weights_raw[u], x_raw[u]);
    }
    for (; k < inner; k += STEP) {
        uint4 weights_raw[ROWS], x_raw[TOKENS];
        load_chunk(k, weights_raw, x_raw);
        accumulate(weights_raw, x_raw);
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
        dependent_launch_entry();                                                                              \
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

// ---------------------------------------------------------------------------------------------
// Tensor-core variant for 2..8 token rows: at N = 8 the fp32 FMAs of the SIMT kernel cost more
// than the bytes (8 FMAs per weight element), so the products go to mma.sync m16n8k16 with the
// N tokens as the n = 8 columns. A warp owns 16 weight rows; its lane (g = lane / 4, t = lane % 4)
// loads 16 bytes of rows g and g + 8 and of token g's x at k = k0 + 8t .. 8t + 7 for each 32-wide
// chunk k0, and feeds them to two mma steps. The k order inside a chunk is permuted the same way
// for weights and x (a dot product does not care), which turns the mma fragment layout into
// plain 16-byte loads:
//
//     mma step s (0, 1), logical k 2t + i  <-  physical k0 + 8t + 4s + i
//                        logical k 2t+8+i  <-  physical k0 + 8t + 4s + 2 + i        (i = 0, 1)
//
// The block's 8 warps split K and meet in shared memory. K % 32 == 0 (the host checks).
#define GEMV_MMA_WARPS 8

template <typename OUT>
__device__ __forceinline__ void gemv_mma_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                              int num_rows, int inner) {
    __shared__ float partial[GEMV_MMA_WARPS][16][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int first_row = blockIdx.x * 16;
    const bf16* row_a = w + (long long)min(first_row + g, num_rows - 1) * inner;
    const bf16* row_b = w + (long long)min(first_row + g + 8, num_rows - 1) * inner;
    const bool has_token = g < num_tokens;
    const bf16* x_row = x + (long long)(has_token ? g : 0) * inner;

    // Full steps of four chunks load 8 x 16 bytes of weights per lane before the first mma; the
    // remaining chunks go one at a time.
    constexpr int STEP = GEMV_MMA_WARPS * 32;
    constexpr int BATCH = 4;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto multiply = [&](uint4 wa, uint4 wb, uint4 xs) {
        const u32 a0[4] = {wa.x, wb.x, wa.y, wb.y};
        const u32 b0[2] = {xs.x, xs.y};
        mma_bf16_16816(acc, a0, b0);
        const u32 a1[4] = {wa.z, wb.z, wa.w, wb.w};
        const u32 b1[2] = {xs.z, xs.w};
        mma_bf16_16816(acc, a1, b1);
    };
    int k = warp * 32 + 8 * t;
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 wa[BATCH], wb[BATCH], xs[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            wa[u] = load_streaming(row_a + k + u * STEP);
            wb[u] = load_streaming(row_b + k + u * STEP);
            xs[u] = *reinterpret_cast<const uint4*>(x_row + k + u * STEP);
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) multiply(wa[u], wb[u], has_token ? xs[u] : make_uint4(0, 0, 0, 0));
    }
    for (; k < inner; k += STEP) {
        const uint4 xs = *reinterpret_cast<const uint4*>(x_row + k);
        multiply(load_streaming(row_a + k), load_streaming(row_b + k), has_token ? xs : make_uint4(0, 0, 0, 0));
    }
    // acc: (row g, tokens 2t, 2t + 1) and (row g + 8, tokens 2t, 2t + 1)
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t] = acc[2];
    partial[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (threadIdx.x < 16 * 8) {
        const int r = threadIdx.x / 8, n = threadIdx.x % 8;
        const int row = first_row + r;
        if (row < num_rows && n < num_tokens) {
            float total = bias != nullptr ? to_float(bias[row]) : 0.0f;
#pragma unroll
            for (int j = 0; j < GEMV_MMA_WARPS; ++j) total += partial[j][r][n];
            out[(long long)n * num_rows + row] = from_float<OUT>(total);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_WARPS * 32)
    gemv_mma_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner) {
    dependent_launch_entry();
    gemv_mma_impl<bf16>(x, w, bias, out, num_tokens, num_rows, inner);
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_WARPS * 32)
    gemv_mma_f32(const bf16* x, const bf16* w, const bf16* bias, float* out, int num_tokens, int num_rows, int inner) {
    dependent_launch_entry();
    gemv_mma_impl<float>(x, w, bias, out, num_tokens, num_rows, inner);
}

// Bias for the cuBLASLt path when its epilogue cannot take it (f32 output): out[n, m] += bias[m].
template <typename OUT>
__device__ __forceinline__ void add_bias_impl(OUT* out, const bf16* bias, int num_tokens, int num_rows) {
    const long long total = (long long)num_tokens * num_rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_float<OUT>(to_float(out[i]) + to_float(bias[i % num_rows]));
}

extern "C" __global__ void add_bias_bf16(bf16* out, const bf16* bias, int num_tokens, int num_rows) {
    dependent_launch_entry();
    add_bias_impl<bf16>(out, bias, num_tokens, num_rows);
}

extern "C" __global__ void add_bias_f32(float* out, const bf16* bias, int num_tokens, int num_rows) {
    dependent_launch_entry();
    add_bias_impl<float>(out, bias, num_tokens, num_rows);
}

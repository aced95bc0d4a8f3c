// RMSNorm and the fused residual-add + RMSNorm of the pre-norm residual stream.
//
// rmsnorm_<T>_<W>:      out[n] = x[n] / sqrt(mean(x[n]^2) + eps) * weight
// add_rmsnorm_<T>_<W>:  residual[n] += x[n] (rounded to T), then out[n] = rmsnorm(residual[n])
//   x, residual, out [N, H] of T; weight [H] of W; one block per row, fp32 accumulation.
//   The second pass re-reads the row the same thread just wrote (an L1/L2 hit, no barrier needed).
// Bytes: rmsnorm 2 N H sizeof(T) + H sizeof(W); add_rmsnorm 4 N H sizeof(T) (x, residual in and
// out, out).  FLOPs: ~4 N H.  Bound by bandwidth; one block per row keeps every SM busy once N is
// in the hundreds, and at decode sizes the whole op is a few microseconds of launch latency
// (which is why narrow decode GEMVs take the norm themselves: gemv.cu).
#include "atlas_common.cuh"

template <typename T, typename W, bool ADD, bool VEC>
__device__ __forceinline__ void rmsnorm_row(const T* x_row, T* residual_row, const W* weight, float eps, T* out_row,
                                            int hidden) {
    __shared__ float scratch[32];
    // The values whose mean square we take: x itself, or residual + x after rounding to T (what
    // the residual stream holds from now on).
    const T* source_row = ADD ? residual_row : x_row;

    float sum_squares = 0.0f;
    if (VEC) {
        for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
            float values[8];
            load8(x_row + col, values);
            if (ADD) {
                float previous[8];
                load8(residual_row + col, previous);
#pragma unroll
                for (int i = 0; i < 8; ++i) values[i] = to_float(from_float<T>(previous[i] + values[i]));
                store8(residual_row + col, values);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) sum_squares += values[i] * values[i];
        }
    } else {
        for (int col = threadIdx.x; col < hidden; col += blockDim.x) {
            float value = to_float(x_row[col]);
            if (ADD) {
                const T summed = from_float<T>(to_float(residual_row[col]) + value);
                residual_row[col] = summed;
                value = to_float(summed);
            }
            sum_squares += value * value;
        }
    }
    const float total = block_sum(sum_squares, scratch);
    const float inverse_rms = 1.0f / sqrtf(total / hidden + eps);

    if (VEC) {
        for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
            float values[8], scales[8];
            load8(source_row + col, values);
            load8(weight + col, scales);
#pragma unroll
            for (int i = 0; i < 8; ++i) values[i] = values[i] * inverse_rms * scales[i];
            store8(out_row + col, values);
        }
    } else {
        for (int col = threadIdx.x; col < hidden; col += blockDim.x)
            out_row[col] = from_float<T>(to_float(source_row[col]) * inverse_rms * to_float(weight[col]));
    }
}

// One block per row.
template <typename T, typename W, bool ADD, bool VEC>
__device__ __forceinline__ void rmsnorm_block_row(const T* x, T* residual, const W* weight, float eps, T* out,
                                                  int hidden) {
    const long long row_offset = (long long)blockIdx.x * hidden;
    rmsnorm_row<T, W, ADD, VEC>(x + row_offset, ADD ? residual + row_offset : nullptr, weight, eps,
                                out + row_offset, hidden);
}

#define DEFINE_RMSNORM(SUFFIX, T, W)                                                                           \
    extern "C" __global__ void rmsnorm_##SUFFIX##_vec8(const T* x, const W* weight, float eps, T* out,          \
                                                       int hidden) {                                           \
        dependent_launch_entry();                                                                              \
        rmsnorm_block_row<T, W, false, true>(x, nullptr, weight, eps, out, hidden);                            \
    }                                                                                                          \
    extern "C" __global__ void rmsnorm_##SUFFIX##_scalar(const T* x, const W* weight, float eps, T* out,        \
                                                         int hidden) {                                         \
        dependent_launch_entry();                                                                              \
        rmsnorm_block_row<T, W, false, false>(x, nullptr, weight, eps, out, hidden);                           \
    }                                                                                                          \
    extern "C" __global__ void add_rmsnorm_##SUFFIX##_vec8(const T* x, T* residual, const W* weight, float eps, \
                                                           T* out, int hidden) {                               \
        dependent_launch_entry();                                                                              \
        rmsnorm_block_row<T, W, true, true>(x, residual, weight, eps, out, hidden);                            \
    }                                                                                                          \
    extern "C" __global__ void add_rmsnorm_##SUFFIX##_scalar(const T* x, T* residual, const W* weight,          \
                                                             float eps, T* out, int hidden) {                  \
        dependent_launch_entry();                                                                              \
        rmsnorm_block_row<T, W, true, false>(x, residual, weight, eps, out, hidden);                           \
    }

DEFINE_RMSNORM(bf16_bf16, bf16, bf16)
DEFINE_RMSNORM(bf16_f32, bf16, float)
DEFINE_RMSNORM(f32_bf16, float, bf16)
DEFINE_RMSNORM(f32_f32, float, float)

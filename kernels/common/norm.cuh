// One row of RMSNorm, or of the fused residual add + RMSNorm, done by a whole block: the norm
// kernels (norm.cu) run one block per row, and a GEMV whose output is the residual's delta runs
// it in its last block (gemv.cu).
//
//   ADD == false:  out = x / sqrt(mean(x^2) + eps) * weight
//   ADD == true:   residual += x (rounded to T), then out = rmsnorm(residual) * weight
//
// fp32 accumulation. The second pass re-reads the row the same thread just wrote (an L1/L2 hit,
// no barrier needed). VEC needs hidden % 8 == 0 (16-byte accesses; the host checks).
// X_FROM_L2 reads x with ld.global.cg (bypassing L1): for an x that other blocks of the same grid
// have just written (the GEMV's last block).
#pragma once

#include "atlas_common.cuh"

template <typename T, typename W, bool ADD, bool VEC, bool X_FROM_L2 = false>
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
            if (X_FROM_L2) {
                Vec8<T> fresh;
                fresh.load_from_l2(x_row + col);
                fresh.to_floats(values);
            } else {
                load8(x_row + col, values);
            }
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

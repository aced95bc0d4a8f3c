// RMSNorm and the fused residual-add + RMSNorm of the pre-norm residual stream.
//
// rmsnorm_<T>_<W>:      out[n] = x[n] / sqrt(mean(x[n]^2) + eps) * weight
// add_rmsnorm_<T>_<W>:  residual[n] += x[n] (rounded to T), then out[n] = rmsnorm(residual[n])
//   x, residual, out [N, H] of T; weight [H] of W; one block per row (norm.cuh), fp32 accumulation.
// Bytes: rmsnorm 2 N H sizeof(T) + H sizeof(W); add_rmsnorm 4 N H sizeof(T) (x, residual in and
// out, out).  FLOPs: ~4 N H.  Bound by bandwidth; one block per row keeps every SM busy once N is
// in the hundreds, and at decode sizes the whole op is a few microseconds of launch latency
// (which is why the decode GEMVs run the add + norm in their last block: gemv.cu).
#include "norm.cuh"

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

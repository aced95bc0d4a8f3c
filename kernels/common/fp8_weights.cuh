// E4M3 weight bytes as bf16 mma operands, shared by the FP8 decode GEMVs (gemv_fp8.cu) and the
// MoE kernels over FP8 experts (moe.cuh). sm_89 and later (atlas_common.cuh's ATLAS_HAS_FP8).
#pragma once

#include "atlas_common.cuh"

// Two E4M3 bytes (the low byte first) as a bf16 pair, exactly (E4M3's 3 mantissa bits and
// exponents 2^-9 .. 2^8 are all bf16 values).
__device__ __forceinline__ u32 e4m3_pair_to_bf16x2(u32 two_bytes) {
    const float2 f = f16x2_to_floats(fp8x2_to_f16x2(two_bytes));
    return pack_bf16x2(f.x, f.y);
}

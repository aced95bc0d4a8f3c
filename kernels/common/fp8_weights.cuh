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

// acc (rows g, g + 8; columns 2t, 2t + 1) += a lane's 16 E4M3 bytes of rows g (wa) and g + 8 (wb)
// times the 8 words of x (16 bf16 values) at the same k: four m16n8k16 steps in the FP8 GEMVs' k
// order (gemv_fp8.cu's gemv_fp8_mma draws it), each E4M3 pair an exact bf16 pair.
__device__ __forceinline__ void fp8_mma_chunk(float* acc, uint4 wa, uint4 wb, const u32* xs) {
    const u32 a_words[4] = {wa.x, wa.y, wa.z, wa.w};
    const u32 b_words[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const u32 a[4] = {e4m3_pair_to_bf16x2(a_words[s] & 0xffffu), e4m3_pair_to_bf16x2(b_words[s] & 0xffffu),
                          e4m3_pair_to_bf16x2(a_words[s] >> 16), e4m3_pair_to_bf16x2(b_words[s] >> 16)};
        const u32 b[2] = {xs[2 * s], xs[2 * s + 1]};
        mma_bf16_16816(acc, a, b);
    }
}

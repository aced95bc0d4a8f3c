// Pieces of the persistent ring kernels (sm90/moe.cu's moe_ring_silu, benchmarks/cuda's probes):
// bulk copies into a ring's shared-memory stages, acquire loads of a grid barrier's counter, a
// bf16 dot product, a warp's reduce-scatter. Only inline functions (sm_90 and later).
#pragma once

#include "atlas_common.cuh"

// Eight values a lane, summed over the warp: lane l returns the total of value ((l >> 2) & 7), in 9
// shuffles instead of 40 (each step halves the values a lane keeps and sends the other half).
__device__ __forceinline__ float reduce_scatter8(const float* v, int lane) {
    float a[4], b[2];
    const bool hi16 = lane & 16, hi8 = lane & 8, hi4 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float send = hi16 ? v[i] : v[i + 4], keep = hi16 ? v[i + 4] : v[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float send = hi8 ? a[i] : a[i + 2], keep = hi8 ? a[i + 2] : a[i];
        b[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    const float send = hi4 ? b[0] : b[1], keep = hi4 ? b[1] : b[0];
    float c = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    c += __shfl_xor_sync(0xffffffffu, c, 2);
    c += __shfl_xor_sync(0xffffffffu, c, 1);
    return c;
}

__device__ __forceinline__ unsigned ring_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ring_copy(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;\n" ::"r"(smem_address(dst)),
        "l"(src), "r"(bytes), "r"(smem_address(bar)), "l"(policy)
        : "memory");
}

// 8 bf16 weights (16 bytes) dotted with 8 floats.
__device__ __forceinline__ float ring_dot8(uint4 w, const float* x) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s = fmaf(__uint_as_float(words[i] << 16), x[2 * i], s);
        s = fmaf(__uint_as_float(words[i] & 0xffff0000u), x[2 * i + 1], s);
    }
    return s;
}

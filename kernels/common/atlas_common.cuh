// Shared device helpers for every Atlas kernel: element types, 16-byte vector loads, warp and
// block reductions, and the bf16 tensor-core primitives (mma.sync m16n8k16, ldmatrix, cp.async)
// that run unchanged on sm_80, sm_90 and sm_120.
//
// Conventions: activations and weights are bf16 (`bf16`), accumulation is fp32; every pointer
// the host passes is at least 16-byte aligned (the pool hands out 512-byte aligned blocks and
// row strides are checked on the host before a vector path is chosen).
#pragma once

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf16x2;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define ATLAS_INF __int_as_float(0x7f800000)
#define ATLAS_LOG2E 1.4426950408889634f

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90 and later). The host launches kernels with programmatic
// stream serialization, so a kernel's blocks may be scheduled while the previous kernel in the
// stream is still running. Every kernel therefore calls `dependent_launch_entry()` before it
// touches memory:
//
//     griddepcontrol.wait               returns once the previous grid has completed and its
//                                       writes are visible (at once without the attribute)
//     griddepcontrol.launch_dependents  lets the next kernel's blocks be scheduled now; they
//                                       wait in their own entry in turn
//
// so the stream stays ordered exactly as without PDL, but the next kernel's launch latency and
// block scheduling overlap this kernel's run instead of following its last block.
// Before its wait a kernel may read only what the previous kernel does not write: every kernel
// before that one has completed, since each lets its successor launch after its own wait (or, a
// library kernel, runs only after its predecessor completed; graphs.py then lets the kernel after
// it launch once its blocks have all started). A kernel that lets its successor launch before
// its own wait (the RoPE + cache write, the skinny GEMM) says so in its header: its successor's
// early reads must not be written by the kernel before it either.
// tests/gpu/test_kernel_registry.py checks that every __global__ function makes the call (or,
// where a kernel issues loads that need no wait first, makes the two calls itself).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void dependent_launch_entry() {
    grid_dependency_wait();
    grid_dependents_launch();
}

// ---------------------------------------------------------------------------------------------
// "Last block done": a grid whose blocks each produce part of a result lets the last block to
// finish run a step over the whole of it (the merge of a decode attention's splits), which
// saves a kernel launch and a grid drain. Every thread calls it after writing its part; it returns true in exactly one block, once `arrivals` blocks have
// counted themselves at `counter`, and that block then sees every other block's writes. The
// counter must start at zero; the last block puts it back to zero, so the next launch (which
// waits for this grid in dependent_launch_entry before touching it) finds it ready. The last
// block reads the others' results from L2 (ld.global.cg), never through L1.
__device__ __forceinline__ bool last_block_done(unsigned* counter, unsigned arrivals) {
    // The barrier orders the block's writes before thread 0's fence, which releases them all
    // device-wide before the block is counted (one fence per block, as cooperative groups do).
    __syncthreads();
    bool is_last = false;
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(counter, 1u) == arrivals - 1;
        if (is_last) {
            *counter = 0u;
            __threadfence();
        }
    }
    return __syncthreads_or(is_last);  // the barrier broadcasts it (no shared memory taken)
}

// ---------------------------------------------------------------------------------------------
// Scalar conversions: one spelling for every element type the kernels are instantiated with.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------------------------
// Weights read once per step: 16-byte loads that skip L1 (the GEMVs, the MoE expert GEMVs).
__device__ __forceinline__ uint4 load_streaming(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The same load, issued where it stands: before the wait for the previous grid (volatile asm
// statements keep their order, so the compiler cannot sink it below griddepcontrol.wait). Only
// for what the previous kernel does not write.
__device__ __forceinline__ uint4 load_streaming_early(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A warp's m16n8 accumulator (rows g and g + 8, columns 2t and 2t + 1, lane 4g + t) into its
// [16][8] tile of shared memory, where the block's warps then sum.
__device__ __forceinline__ void store_mma_tile(float (*tile)[8], const float* acc, int g, int t) {
    tile[g][2 * t] = acc[0];
    tile[g][2 * t + 1] = acc[1];
    tile[g + 8][2 * t] = acc[2];
    tile[g + 8][2 * t + 1] = acc[3];
}

// ---------------------------------------------------------------------------------------------
// Eight consecutive elements as one 16-byte (bf16) or two 16-byte (f32) accesses.
template <typename T> struct Vec8;

template <> struct Vec8<bf16> {
    uint4 raw;
    __device__ __forceinline__ void load(const bf16* p) { raw = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void store(bf16* p) const { *reinterpret_cast<uint4*>(p) = raw; }
    __device__ __forceinline__ void to_floats(float* out) const {
        const bf16x2* pairs = reinterpret_cast<const bf16x2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __bfloat1622float2(pairs[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ void from_floats(const float* in) {
        bf16x2* pairs = reinterpret_cast<bf16x2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    }
};

template <> struct Vec8<float> {
    float4 lo, hi;
    __device__ __forceinline__ void load(const float* p) {
        lo = reinterpret_cast<const float4*>(p)[0];
        hi = reinterpret_cast<const float4*>(p)[1];
    }
    __device__ __forceinline__ void store(float* p) const {
        reinterpret_cast<float4*>(p)[0] = lo;
        reinterpret_cast<float4*>(p)[1] = hi;
    }
    __device__ __forceinline__ void to_floats(float* out) const {
        out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
        out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
    }
    __device__ __forceinline__ void from_floats(const float* in) {
        lo = make_float4(in[0], in[1], in[2], in[3]);
        hi = make_float4(in[4], in[5], in[6], in[7]);
    }
};

// Loads of 8 elements of any type straight into floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
    Vec8<T> v;
    v.load(p);
    v.to_floats(out);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* in) {
    Vec8<T> v;
    v.from_floats(in);
    v.store(p);
}

// ---------------------------------------------------------------------------------------------
// Gated activations: act(gate) of SwiGLU (SiLU) and GeGLU (tanh-approximated GELU).
struct SiluOp {
    __device__ __forceinline__ float operator()(float g) const { return g / (1.0f + expf(-g)); }
};

struct GeluTanhOp {
    __device__ __forceinline__ float operator()(float g) const {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
    }
};

// ---------------------------------------------------------------------------------------------
// Reductions.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats and
// may be reused right after the call returns (the trailing barrier protects it).
__device__ __forceinline__ float block_sum(float x, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    x = warp_sum(x);
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float total = lane < num_warps ? scratch[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();
    return total;
}

// 1 / sqrt(mean(row^2) + eps) of a bf16 row of `width` (a multiple of 8, 16-byte aligned),
// summed over the whole block; every thread gets it. `scratch`: as block_sum's. The RMS of a norm
// whose weight was folded into the projection after it, taken by the kernel that consumes the
// product (RoPE, act_mul) instead of a norm kernel before it.
__device__ __forceinline__ float block_inverse_rms(const bf16* row, int width, float eps, float* scratch) {
    float sum_squares = 0.0f;
#pragma unroll 4
    for (int col = threadIdx.x * 8; col < width; col += blockDim.x * 8) {
        float values[8];
        load8(row + col, values);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum_squares += values[i] * values[i];
    }
    return 1.0f / sqrtf(block_sum(sum_squares, scratch) / width + eps);
}

__device__ __forceinline__ float block_max(float x, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    x = warp_max(x);
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float total = lane < num_warps ? scratch[lane] : -ATLAS_INF;
    total = warp_max(total);
    __syncthreads();
    return total;
}

// ---------------------------------------------------------------------------------------------
// Tensor cores: D[16x8] += A[16x16] * B[16x8], bf16 operands, fp32 accumulators.
// Fragment ownership (g = lane / 4, t = lane % 4):
//   A: a0 (row g,   k 2t..2t+1)  a1 (row g+8, k 2t..)  a2 (row g, k 2t+8..)  a3 (row g+8, k 2t+8..)
//   B: b0 (k 2t..2t+1, col g)    b1 (k 2t+8..2t+9, col g)
//   C: c0 c1 (row g, col 2t..2t+1)   c2 c3 (row g+8, col 2t..2t+1)
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, const u32* b) {
    // Not volatile: a pure function of its operands, so the compiler may schedule loads around it.
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    bf16x2 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&pair);
}

__device__ __forceinline__ u32 smem_address(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8x8 bf16 matrices: lane L passes the address of row L % 8 of matrix L / 8 and receives,
// from each matrix m, elements (g, 2t) and (g, 2t + 1) in r[m].
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row_address)));
}

// Four 8x8 bf16 matrices, transposed on the way in: lane L passes the address of row L % 8 of
// matrix L / 8 and receives, from each matrix m, elements (2t, g) and (2t + 1, g) in r[m].
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row_address)));
}

// 16-byte asynchronous global -> shared copy; `valid == false` writes zeros instead of reading.
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(shared_dst)),
                 "l"(global_src), "r"(src_bytes));
}

// An L2 eviction policy for data read once (K/V pages, weights): its lines go first.
__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// cp_async_16 with an L2 eviction policy (`l2_evict_first()`).
__device__ __forceinline__ void cp_async_16_hint(void* shared_dst, const void* global_src, bool valid, u64 policy) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_address(shared_dst)),
                 "l"(global_src), "r"(src_bytes), "l"(policy));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// The memory clobber keeps the compiler from hoisting a shared-memory read of the copied data
// above the wait (a kernel whose threads read back only their own copies has no barrier there).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---------------------------------------------------------------------------------------------
// FP8 (OCP E4M3: 1 sign, 4 exponent bits biased by 7, 3 mantissa bits; max 448, no infinities)
// for quantized KV caches (sm_89 and later). A stored byte stands for its value times the
// cache's per-layer scale; every E4M3 value is exact in f16 (and in bf16). Before sm_89 the
// conversions do not exist: the _fp8 kernels still compile there but trap, and the host offers
// no FP8 cache (CudaBackend's capabilities).
typedef unsigned char fp8_e4m3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define ATLAS_HAS_FP8 1
#else
#define ATLAS_HAS_FP8 0
#endif

// Two floats as E4M3 bytes, `lo` in the low byte: round to nearest even, saturating at +-448.
__device__ __forceinline__ u16 pack_fp8x2(float lo, float hi) {
    u16 packed = 0;
#if ATLAS_HAS_FP8
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(packed) : "f"(hi), "f"(lo));
#else
    __trap();
#endif
    return packed;
}

// Two E4M3 bytes (the low byte first) as an f16 pair, exactly.
__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 two_bytes) {
    u32 pair = 0;
#if ATLAS_HAS_FP8
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(pair) : "h"(static_cast<u16>(two_bytes)));
#else
    __trap();
#endif
    return pair;
}

// Two floats as an f16 pair, `lo` in the low half; and back.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 pair;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(pair) : "f"(hi), "f"(lo));
    return pair;
}

__device__ __forceinline__ float2 f16x2_to_floats(u32 pair) {
    float2 out;
    asm("{\n .reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;\n}\n"
        : "=f"(out.x), "=f"(out.y)
        : "r"(pair));
    return out;
}

// mma_bf16_16816 with f16 operands (same fragment ownership).
__device__ __forceinline__ void mma_f16_16816(float* c, const u32* a, const u32* b) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Mixture of experts on Hopper (sm_90a): every generic kernel (moe.cuh) plus a warpgroup-MMA
// grouped GEMM for the experts at prefill sizes, which the host launches instead of the mma.sync
// moe_gemm_* kernels where this module provides it (ops_moe.py; ATLAS_CUDA_DISABLE=moe_wgmma
// turns it off). FP8 experts take moe_gemm_*_fp8[_blk] (moe.cuh) on Hopper too.
//
// Same tiles, grid, alignment (moe_align) and epilogues as moe_gemm_*: a block computes 128 rows
// (pairs, gathered through the expert-contiguous order as they load) by 128 weight rows (gate_up:
// 64 features' gate and up rows interleaved; down: 128 rows of H). Two warpgroups of 64 rows:
//
//     acc[64 x 128] += A[64 x 16] B[16 x 128]    wgmma m64n128k16, A and B from shared memory
//
// K tiles of 64 elements (one 128-byte swizzled panel a row, wgmma.cuh) stream by cp.async into
// three stages (A and B [128 rows][64] each, 32 KB a stage: two blocks an SM); a K tile's four
// wgmma run while the next two tiles' copies are in flight. FLOPs 6 N k H I; bound by the tensor
// cores. Registers: 64 accumulators a thread.
#include "moe.cuh"
#include "wgmma.cuh"

#define WG_GEMM_K 64
#define WG_GEMM_STAGES 3
#define WG_GEMM_THREADS 256
#define WG_GEMM_TILE_BYTES (128 * 128)  // A (or B) of one stage: 128 rows of one 128-byte panel
#define WG_GEMM_SHARED_BYTES (WG_GEMM_STAGES * 2 * WG_GEMM_TILE_BYTES + 1024)  // + swizzle alignment

// acc[4 j + c] (warpgroup wg, warp w): row 64 wg + 16 (w % 4) + g (+ 8 for c >= 2), column
// 8 j + 2 t + (c & 1) of A[128 rows, K] B[128 rows, K]^T. This thread copies rows tid / 8 + 32 i
// (chunk tid % 8) of each K tile: A's `a_rows[i]`, B's `b_rows[i]` (null: zeros; `fallback` any
// valid global address). K % 8 == 0.
__device__ __forceinline__ void wgmma_gemm_tile(float* acc, const bf16* const* a_rows, const bf16* const* b_rows,
                                                int inner, unsigned char* smem, const bf16* fallback) {
    const int tid = threadIdx.x, warpgroup = tid >> 7;
    const int chunk = tid & 7;
    auto load_stage = [&](int k_tile, int stage) {
        unsigned char* a_dst = smem + stage * 2 * WG_GEMM_TILE_BYTES;
        unsigned char* b_dst = a_dst + WG_GEMM_TILE_BYTES;
        const int k = k_tile * WG_GEMM_K + chunk * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = (tid >> 3) + 32 * i;
            const u32 at = swizzled_panel_offset(r, chunk);
            const bool a_valid = a_rows[i] != nullptr && k < inner;
            const bool b_valid = b_rows[i] != nullptr && k < inner;
            cp_async_16(a_dst + at, a_valid ? a_rows[i] + k : fallback, a_valid);
            cp_async_16(b_dst + at, b_valid ? b_rows[i] + k : fallback, b_valid);
        }
    };
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const int k_tiles = (inner + WG_GEMM_K - 1) / WG_GEMM_K;
    // One commit group per K tile, empty ones included, so wait_group counts tiles exactly.
#pragma unroll
    for (int stage = 0; stage < WG_GEMM_STAGES - 1; ++stage) {
        if (stage < k_tiles) load_stage(stage, stage);
        cp_async_commit();
    }
    for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
        cp_async_wait<WG_GEMM_STAGES - 2>();  // this thread's copies of k_tile have landed
        fence_proxy_async_shared();            // cp.async wrote through the generic proxy; wgmma reads async
        __syncthreads();                       // everyone's have; both warpgroups are done with k_tile - 1
        const int next = k_tile + WG_GEMM_STAGES - 1;
        if (next < k_tiles) load_stage(next, next % WG_GEMM_STAGES);
        cp_async_commit();
        const unsigned char* a_tile = smem + (k_tile % WG_GEMM_STAGES) * 2 * WG_GEMM_TILE_BYTES;
        const unsigned char* b_tile = a_tile + WG_GEMM_TILE_BYTES;
        wgmma_fence_registers<64>(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < WG_GEMM_K / 16; ++k) {
            const u64 desc_a = wgmma_descriptor(a_tile + warpgroup * (64 * 128) + k * 32, 16, 1024);
            const u64 desc_b = wgmma_descriptor(b_tile + k * 32, 16, 1024);
            wgmma_m64n128k16_ss(acc, desc_a, desc_b, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_registers<64>(acc);
    }
    cp_async_wait<0>();
}

__device__ __forceinline__ unsigned char* aligned_gemm_shared() {
    const u32 raw_address = smem_address(gemm_shared);
    return reinterpret_cast<unsigned char*>(gemm_shared) + (((raw_address + 1023u) & ~1023u) - raw_address);
}

// moe_wgmma_gate_up_<act>: grid (ceil(max(I, Is) / 64), max tiles), WG_GEMM_THREADS, WG_GEMM_SHARED_BYTES.
template <int ACT>
__device__ __forceinline__ void moe_wgmma_gate_up_impl(const bf16* normed, const int* offsets, const int* tile_starts,
                                                       const int* sorted_pairs, const bf16* gate_up,
                                                       const bf16* gate_up_bias, const bf16* shared_gate_up,
                                                       bf16* hidden_out, int num_tokens, int top_k, int num_experts,
                                                       int groups, int hidden, int inner, int shared_inner,
                                                       int stride, float alpha, float limit) {
    const GemmTile tile = locate_gemm_tile(offsets, tile_starts, groups, blockIdx.y);
    if (tile.group < 0) return;
    const bool is_shared = tile.group == num_experts;
    const int features = is_shared ? shared_inner : inner;
    const int f0 = blockIdx.x * 64;
    if (f0 >= features) return;
    const bf16* w = is_shared ? shared_gate_up : gate_up + (long long)tile.group * 2 * inner * hidden;
    const bf16* bias = is_shared || gate_up_bias == nullptr ? nullptr : gate_up_bias + (long long)tile.group * 2 * inner;
    const int num_pairs = num_tokens * top_k;
    const int tid = threadIdx.x;
    const bf16* a_rows[4];
    const bf16* b_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = (tid >> 3) + 32 * i;
        const int row = tile.begin + r;
        a_rows[i] = row < tile.end ? normed + (long long)token_of_pair(sorted_pairs[row], num_pairs, top_k) * hidden
                                   : nullptr;
        const int f = f0 + r / 2;
        b_rows[i] = f < features ? w + (long long)((r & 1) ? features + f : f) * hidden : nullptr;
    }
    float acc[64];
    wgmma_gemm_tile(acc, a_rows, b_rows, hidden, aligned_gemm_shared(), w);
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = tile.begin + (warp >> 2) * 64 + (warp & 3) * 16 + g + half * 8;
        if (row >= tile.end) continue;
        bf16* out = hidden_out + (long long)sorted_pairs[row] * stride;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int feature = f0 + 4 * j + t;
            if (feature >= features) continue;
            float gate = acc[4 * j + 2 * half], up = acc[4 * j + 2 * half + 1];
            if (bias != nullptr) {
                gate += to_float(bias[feature]);
                up += to_float(bias[inner + feature]);
            }
            out[feature] = from_float<bf16>(gated_value<ACT>(round_bf16(gate), round_bf16(up), alpha, limit));
        }
    }
}

#define DEFINE_MOE_WGMMA_GATE_UP(NAME, ACT)                                                                   \
    extern "C" __global__ void __launch_bounds__(WG_GEMM_THREADS, 2) moe_wgmma_gate_up_##NAME(                \
        const bf16* normed, const int* offsets, const int* tile_starts, const int* sorted_pairs,             \
        const bf16* gate_up, const bf16* gate_up_bias, const bf16* shared_gate_up, bf16* hidden_out,         \
        int num_tokens, int top_k, int num_experts, int groups, int hidden, int inner, int shared_inner,     \
        int stride, float alpha, float limit) {                                                              \
        dependent_launch_entry();                                                                            \
        moe_wgmma_gate_up_impl<ACT>(normed, offsets, tile_starts, sorted_pairs, gate_up, gate_up_bias,       \
                                    shared_gate_up, hidden_out, num_tokens, top_k, num_experts, groups,      \
                                    hidden, inner, shared_inner, stride, alpha, limit);                      \
    }

DEFINE_MOE_WGMMA_GATE_UP(silu, GATED_SILU)
DEFINE_MOE_WGMMA_GATE_UP(gelu_tanh, GATED_GELU_TANH)
DEFINE_MOE_WGMMA_GATE_UP(clamped, GATED_CLAMPED)

// moe_wgmma_down: grid (ceil(H / 128), max tiles), WG_GEMM_THREADS, WG_GEMM_SHARED_BYTES.
extern "C" __global__ void __launch_bounds__(WG_GEMM_THREADS, 2)
    moe_wgmma_down(const bf16* hidden_in, const int* offsets, const int* tile_starts, const int* sorted_pairs,
                   const bf16* down, const bf16* down_bias, const bf16* shared_down, float* y, int num_experts,
                   int groups, int hidden, int inner, int shared_inner, int stride) {
    dependent_launch_entry();
    const GemmTile tile = locate_gemm_tile(offsets, tile_starts, groups, blockIdx.y);
    if (tile.group < 0) return;
    const bool is_shared = tile.group == num_experts;
    const int reduced = is_shared ? shared_inner : inner;
    const int first = blockIdx.x * 128;
    if (first >= hidden) return;
    const bf16* w = is_shared ? shared_down : down + (long long)tile.group * hidden * inner;
    const bf16* bias = is_shared || down_bias == nullptr ? nullptr : down_bias + (long long)tile.group * hidden;
    const int tid = threadIdx.x;
    const bf16* a_rows[4];
    const bf16* b_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = (tid >> 3) + 32 * i;
        const int row = tile.begin + r;
        a_rows[i] = row < tile.end ? hidden_in + (long long)sorted_pairs[row] * stride : nullptr;
        b_rows[i] = first + r < hidden ? w + (long long)(first + r) * reduced : nullptr;
    }
    float acc[64];
    wgmma_gemm_tile(acc, a_rows, b_rows, reduced, aligned_gemm_shared(), w);
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = tile.begin + (warp >> 2) * 64 + (warp & 3) * 16 + g + half * 8;
        if (row >= tile.end) continue;
        float* out = y + (long long)sorted_pairs[row] * hidden;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int column = first + 8 * j + 2 * t + e;
                if (column < hidden)
                    out[column] = acc[4 * j + 2 * half + e] + (bias != nullptr ? to_float(bias[column]) : 0.0f);
            }
        }
    }
}

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
#include "ring.cuh"
#include "tma.cuh"
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

// ---------------------------------------------------------------------------------------------
// One token's routed experts as one persistent kernel (moe_ring_silu; ops_moe.ring_applies): one
// block an SM, a producer thread streaming every weight row the block needs through a ring of
// shared-memory stages (cp.async.bulk, mbarrier full/empty), consumer warps multiplying each stage
// as it lands. The chain it replaces (moe_gate_up, then moe_down and its combine) starts down's
// rows only once gate_up has ended; here they stream while gate_up still runs. H200, Qwen3-30B-A3B
// at batch 1: 27.4 us a layer of wall in the step against the chain's 28.4 (step by replay 2,463.5
// against 2,482.5 us); outside Atlas (benchmarks/cuda/moe_layer_probe.cu, no routing) the same
// ring took 23.8 (docs/lab/moe-decode.md).
//   1. every block routes the token from the logits with one warp (block 0 writes ids, weights);
//   2. G: the block's groups of RING_FEATURES features (of the flattened [top_k][inner]), their
//      gate rows then up rows a stage; consumer thread t takes 16-byte chunk t of every row (hidden
//      2048); hidden_rows[j][f] = bf16(silu(gate) * up);
//   3. a grid barrier (all blocks are resident: one an SM);
//   4. D: block b owns residual rows [r0, r1): every expert's down rows there, a stage an expert,
//      each row one warp's, summed over experts in k order; residual = bf16(residual + bf16(sum)).
// bf16 experts, SiLU, no biases, no shared expert, every expert held, hidden 2048, inner a
// multiple of 256 up to 1024, top_k <= 16; the host checks it.
#define RING_CONSUMER_WARPS 8
#define RING_CONSUMERS (RING_CONSUMER_WARPS * 32)
#define RING_THREADS (RING_CONSUMERS + 32)
#define RING_STAGES 3
#define RING_STAGE_BYTES (32 * 1024)
#define RING_HIDDEN 2048
#define RING_FEATURES 4      // a G stage: 4 features' gate rows, then their up rows (32 KB at hidden 2048)
#define RING_MAX_TOP_K 16
#define RING_MAX_INNER 1024
#define RING_MAX_G 128       // a block's G features (top_k inner / blocks, rounded up to RING_FEATURES)
#define RING_MAX_D 32        // a block's D rows (hidden / blocks)
#define RING_SHARED_BYTES (RING_STAGES * RING_STAGE_BYTES + 2 * RING_STAGES * 8)

__device__ __forceinline__ void ring_consumers_sync() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(RING_CONSUMERS) : "memory");
}

// Every block's consumers meet here once (barrier[0] counts arrivals, barrier[1] the generation,
// so the next launch finds the count at zero again); the consumers' writes before it are visible
// to every block's consumers after it.
__device__ __forceinline__ void ring_grid_barrier(unsigned* barrier, unsigned blocks) {
    ring_consumers_sync();
    if (threadIdx.x == 0) {
        const unsigned generation = ring_load_acquire(barrier + 1);
        __threadfence();
        if (atomicAdd(barrier, 1u) == blocks - 1) {
            atomicExch(barrier, 0u);
            __threadfence();
            atomicAdd(barrier + 1, 1u);
        } else {
            while (ring_load_acquire(barrier + 1) == generation) __nanosleep(32);
        }
        __threadfence();
    }
    ring_consumers_sync();
}

__device__ __forceinline__ void moe_ring_silu_impl(
    const bf16* __restrict__ normed, const float* __restrict__ logits, const float* __restrict__ selection_bias,
    int num_experts, int top_k, int sigmoid_scoring, int renormalize, float scaling, const bf16* __restrict__ gate_up,
    const bf16* __restrict__ down, int inner, bf16* __restrict__ hidden_rows, int stride, bf16* __restrict__ residual,
    int* __restrict__ expert_ids, float* __restrict__ expert_weights, unsigned* __restrict__ barrier) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    u64* full = reinterpret_cast<u64*>(smem + RING_STAGES * RING_STAGE_BYTES);
    u64* empty = full + RING_STAGES;
    __shared__ int ids[RING_MAX_TOP_K];
    __shared__ float weights[RING_MAX_TOP_K];
    __shared__ float partial[RING_CONSUMER_WARPS][2 * RING_MAX_G];
    __shared__ float sums[RING_MAX_D];
    __shared__ __align__(16) bf16 act[RING_MAX_TOP_K * RING_MAX_INNER / 2];  // half of [top_k][inner] at a time
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = threadIdx.x;
    const int b = blockIdx.x, blocks = gridDim.x;
    if (t == 0) {
        for (int s = 0; s < RING_STAGES; ++s) {
            mbarrier_init(full + s, 1);
            mbarrier_init(empty + s, RING_CONSUMER_WARPS);
        }
        mbarrier_init_fence();
    }
    // The logits and normed are the routing kernel's. The kernel after this one may launch only
    // once every block here is resident (after the grid barrier): its blocks, waiting, could
    // otherwise hold the slots that blocks of this grid still need, and the barrier never end.
    grid_dependency_wait();
    if (warp == 0)
        route_token(logits, selection_bias, num_experts, top_k, sigmoid_scoring, renormalize, scaling,
                    b == 0 ? expert_ids : nullptr, b == 0 ? expert_weights : nullptr, ids, weights);
    __syncthreads();
    const int groups = top_k * inner / RING_FEATURES;
    const int g_first = (int)((long long)groups * b / blocks) * RING_FEATURES;
    const int g_last = (int)((long long)groups * (b + 1) / blocks) * RING_FEATURES;
    const int d_first = (int)((long long)RING_HIDDEN * b / blocks);
    const int d_last = (int)((long long)RING_HIDDEN * (b + 1) / blocks);
    const int d_rows = RING_STAGE_BYTES / (inner * 2);  // a D stage's rows at most

    if (warp == RING_CONSUMER_WARPS) {  // the producer: G's stages, then D's, in the order consumed
        if (lane != 0) return;
        const u64 policy = l2_evict_first();
        unsigned it = 0;
        auto next_slot = [&]() {
            const int slot = it % RING_STAGES;
            mbarrier_wait(empty + slot, ((it / RING_STAGES) & 1) ^ 1);
            ++it;
            return slot;
        };
        const u32 g_bytes = RING_FEATURES * RING_HIDDEN * 2;
        for (int f = g_first; f < g_last; f += RING_FEATURES) {
            const int slot = next_slot(), j = f / inner, feature = f % inner;
            const bf16* expert = gate_up + (long long)ids[j] * 2 * inner * RING_HIDDEN;
            unsigned char* dst = ring + slot * RING_STAGE_BYTES;
            mbarrier_arrive_expect_tx(full + slot, 2 * g_bytes);
            ring_copy(dst, expert + (long long)feature * RING_HIDDEN, g_bytes, full + slot, policy);
            ring_copy(dst + g_bytes, expert + (long long)(inner + feature) * RING_HIDDEN, g_bytes, full + slot, policy);
        }
        for (int j = 0; j < top_k; ++j)
            for (int r = d_first; r < d_last; r += d_rows) {
                const int slot = next_slot(), n = min(d_rows, d_last - r);
                const u32 bytes = (u32)n * inner * 2;
                mbarrier_arrive_expect_tx(full + slot, bytes);
                ring_copy(ring + slot * RING_STAGE_BYTES, down + ((long long)ids[j] * RING_HIDDEN + r) * inner, bytes,
                          full + slot, policy);
            }
        return;
    }

    // the consumers
    unsigned it = 0;
    auto take_stage = [&]() {
        const int slot = it % RING_STAGES;
        mbarrier_wait(full + slot, (it / RING_STAGES) & 1);
        ++it;
        return slot;
    };
    auto release = [&](int slot) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty + slot);
    };
    float x[8];
    Vec8<bf16>{__ldcg(reinterpret_cast<const uint4*>(normed) + t)}.to_floats(x);
    for (int f = g_first; f < g_last; f += RING_FEATURES) {
        const int slot = take_stage();
        const unsigned char* stage = ring + slot * RING_STAGE_BYTES;
        uint4 wv[2 * RING_FEATURES];
#pragma unroll
        for (int r = 0; r < 2 * RING_FEATURES; ++r)
            wv[r] = *reinterpret_cast<const uint4*>(stage + r * RING_HIDDEN * 2 + t * 16);
        release(slot);
        float acc[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[r] = ring_dot8(wv[r], x);
        const float total = reduce_scatter8(acc, lane);  // lane l: row (l >> 2) & 7's
        const int row = (lane >> 2) & 7, local = f - g_first + row % RING_FEATURES;
        if ((lane & 3) == 0) partial[warp][local + (row >= RING_FEATURES ? RING_MAX_G : 0)] = total;
    }
    ring_consumers_sync();
    for (int u = t; u < g_last - g_first; u += RING_CONSUMERS) {
        float g = 0.0f, up = 0.0f;
#pragma unroll
        for (int w = 0; w < RING_CONSUMER_WARPS; ++w) {
            g += partial[w][u];
            up += partial[w][RING_MAX_G + u];
        }
        const int f = g_first + u;
        hidden_rows[(long long)(f / inner) * stride + f % inner] = from_float<bf16>(g / (1.0f + __expf(-g)) * up);
    }
    ring_grid_barrier(barrier, blocks);
    grid_dependents_launch();
    for (int r = t; r < RING_MAX_D; r += RING_CONSUMERS) sums[r] = 0.0f;
    const int chunks = inner / 8 / 32;  // a lane's 16-byte chunks of a down row: 1..4
    for (int j = 0; j < top_k; ++j) {
        if (j % (RING_MAX_TOP_K / 2) == 0) {  // act of experts [j, j + 8) into shared memory
            ring_consumers_sync();
            const int count = min(RING_MAX_TOP_K / 2, top_k - j) * inner / 8;
            for (int c = t; c < count; c += RING_CONSUMERS) {
                const int jj = j + c / (inner / 8), k = c % (inner / 8);
                reinterpret_cast<uint4*>(act)[c] =
                    __ldcg(reinterpret_cast<const uint4*>(hidden_rows + (long long)jj * stride) + k);
            }
            ring_consumers_sync();
        }
        float a[4][8];
        const bf16* act_j = act + (j % (RING_MAX_TOP_K / 2)) * inner;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (k < chunks) Vec8<bf16>{reinterpret_cast<const uint4*>(act_j)[lane + 32 * k]}.to_floats(a[k]);
        for (int r0 = d_first; r0 < d_last; r0 += d_rows) {
            const int slot = take_stage(), n = min(d_rows, d_last - r0);
            const unsigned char* stage = ring + slot * RING_STAGE_BYTES;
            uint4 wv[4][4];  // rows warp + 8 h, chunks lane + 32 k
#pragma unroll
            for (int h = 0; h < 4; ++h)
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (warp + 8 * h < n && k < chunks)
                        wv[h][k] = *reinterpret_cast<const uint4*>(stage + (warp + 8 * h) * inner * 2 +
                                                                   (lane + 32 * k) * 16);
            release(slot);
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const int row = warp + 8 * h;
                if (row >= n) continue;
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (k < chunks) s += ring_dot8(wv[h][k], a[k]);
                s = warp_sum(s);
                if (lane == 0) sums[r0 - d_first + row] = fmaf(weights[j], s, sums[r0 - d_first + row]);
            }
        }
    }
    ring_consumers_sync();
    for (int r = t; r < d_last - d_first; r += RING_CONSUMERS) {
        bf16* at = residual + d_first + r;
        *at = from_float<bf16>(to_float(*at) + round_bf16(sums[r]));
    }
}

extern "C" __global__ void __launch_bounds__(RING_THREADS, 1)
    moe_ring_silu(const bf16* normed, const float* logits, const float* selection_bias, int num_experts, int top_k,
                  int sigmoid_scoring, int renormalize, float scaling, const bf16* gate_up, const bf16* down,
                  int inner, bf16* hidden_rows, int stride, bf16* residual, int* expert_ids, float* expert_weights,
                  unsigned* barrier) {
    moe_ring_silu_impl(normed, logits, selection_bias, num_experts, top_k, sigmoid_scoring, renormalize, scaling,
                       gate_up, down, inner, hidden_rows, stride, residual, expert_ids, expert_weights, barrier);
}

// Test kernels for kernels/common/wgmma.cuh: one warpgroup computes each product of the wgmma
// prefill attention kernel in isolation, with the same shared-memory panels and descriptors,
// and writes the fp32 accumulators out in row-major order. test_wgmma_probe.py compares them with
// numpy, so a layout or descriptor error shows up here as a pattern, not as a wrong attention.
#include "wgmma.cuh"

// Row-major [rows][HEAD_DIM] bf16 -> swizzled panels of a tile of `rows` rows.
template <int HEAD_DIM>
__device__ void load_panels(unsigned char* tile, const bf16* src, int rows) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    for (int c = threadIdx.x; c < rows * CHUNKS; c += blockDim.x) {
        const int r = c / CHUNKS, chunk = c % CHUNKS;
        const u32 offset = (u32)((chunk >> 3) * rows * 128) + swizzled_panel_offset(r, chunk & 7);
        *reinterpret_cast<uint4*>(tile + offset) = *reinterpret_cast<const uint4*>(src + r * HEAD_DIM + chunk * 8);
    }
}

__device__ unsigned char* aligned_shared() {
    extern __shared__ uint4 probe_shared[];
    const u32 raw = smem_address(probe_shared);
    return reinterpret_cast<unsigned char*>(probe_shared) + (((raw + 1023u) & ~1023u) - raw);
}

// Accumulators of a 64 x N tile (m16n8 layout per warp) -> row-major out [64][N].
template <int N>
__device__ void store_accumulators(const float* d, float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int row = warp * 16 + g, col = 8 * j + 2 * t;
        out[row * N + col] = d[4 * j];
        out[row * N + col + 1] = d[4 * j + 1];
        out[(row + 8) * N + col] = d[4 * j + 2];
        out[(row + 8) * N + col + 1] = d[4 * j + 3];
    }
}

// s [64][128] = q [64][D] k[128][D]^T, both operands K-major from shared memory.
template <int HEAD_DIM>
__device__ void probe_qk(const bf16* q, const bf16* k, float* s_out) {
    unsigned char* q_tile = aligned_shared();
    unsigned char* k_tile = q_tile + (HEAD_DIM / 64) * 64 * 128;
    load_panels<HEAD_DIM>(q_tile, q, 64);
    load_panels<HEAD_DIM>(k_tile, k, 128);
    fence_proxy_async_shared();
    __syncthreads();
    float s[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = 0.0f;
    wgmma_fence_registers<64>(s);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < HEAD_DIM / 16; ++step) {
        const u64 desc_q = wgmma_descriptor(q_tile + (step >> 2) * (64 * 128) + (step & 3) * 32, 16, 1024);
        const u64 desc_k = wgmma_descriptor(k_tile + (step >> 2) * (128 * 128) + (step & 3) * 32, 16, 1024);
        wgmma_m64n128k16_ss(s, desc_q, desc_k, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_registers<64>(s);
    store_accumulators<128>(s, s_out);
}

// o [64][D] = p [64][128] v [128][D]: p from registers, v MN-major from shared memory.
template <int HEAD_DIM>
__device__ void probe_pv(const bf16* p, const bf16* v, float* o_out) {
    unsigned char* v_tile = aligned_shared();
    load_panels<HEAD_DIM>(v_tile, v, 128);
    fence_proxy_async_shared();
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row = warp * 16 + g;
    u32 a[32];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const int key = kk * 16 + 2 * t;
        a[4 * kk + 0] = *reinterpret_cast<const u32*>(p + row * 128 + key);
        a[4 * kk + 1] = *reinterpret_cast<const u32*>(p + (row + 8) * 128 + key);
        a[4 * kk + 2] = *reinterpret_cast<const u32*>(p + row * 128 + key + 8);
        a[4 * kk + 3] = *reinterpret_cast<const u32*>(p + (row + 8) * 128 + key + 8);
    }
    float o[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.0f;
    wgmma_fence_registers<HEAD_DIM / 2>(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const u64 desc_v = wgmma_descriptor(v_tile + kk * 16 * 128, 128 * 128, 1024);
        if constexpr (HEAD_DIM == 128) {
            wgmma_m64n128k16_rs_transposed_b(o, a + 4 * kk, desc_v);
        } else {
            wgmma_m64n64k16_rs_transposed_b(o, a + 4 * kk, desc_v);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_registers<HEAD_DIM / 2>(o);
    store_accumulators<HEAD_DIM>(o, o_out);
}

extern "C" __global__ void __launch_bounds__(128) probe_qk_d64(const bf16* q, const bf16* k, float* s) {
    probe_qk<64>(q, k, s);
}
extern "C" __global__ void __launch_bounds__(128) probe_qk_d128(const bf16* q, const bf16* k, float* s) {
    probe_qk<128>(q, k, s);
}
extern "C" __global__ void __launch_bounds__(128) probe_pv_d64(const bf16* p, const bf16* v, float* o) {
    probe_pv<64>(p, v, o);
}
extern "C" __global__ void __launch_bounds__(128) probe_pv_d128(const bf16* p, const bf16* v, float* o) {
    probe_pv<128>(p, v, o);
}

// Split the fused QKV projection, optionally RMS-normalise each q/k head (Qwen3), rotate q and k
// (half-split RoPE of the first `rotary_dim` dims), write q to q_out and k, v into the paged cache.
//
//   qkv      [N, (Hq + 2 Hkv) * D]  bf16      q heads | k heads | v heads, side by side
//   table    [max_pos, r]           f32|bf16  cos of the r/2 pair angles, then their sin
//   q_out    [N, Hq * D]            bf16
//   k_plane, v_plane: this layer's K and V planes of the cache, pages of [Hkv][block_size][D]:
//
//       slot = block * block_size + offset
//       element (slot, h, d) of a plane = ((block * Hkv + h) * block_size + offset) * D + d
//
//   Rotation of a head x (pairs (i, i + r/2), i < r/2; dims >= r pass through):
//       y[i]       = x[i] cos[i] - x[i + r/2] sin[i]
//       y[i + r/2] = x[i + r/2] cos[i] + x[i] sin[i]
//   A gated layer (num_gate_heads G = Hq, Qwen3-Next) has its gate heads between the q and the k
//   heads: qkv [N, (Hq + G + 2 Hkv) D], q_out [N, (Hq + G) D]; a gate head is copied to q_out
//   after the q heads as the product gave it (scaled by the RMS like every value, no norm, no
//   rotation). rotary_dim 0: no rotation (a layer without RoPE).
//   A negative slot skips the K/V write (padding rows of a captured graph). An FP8 cache (the
//   _fp8 kernels) stores E4M3 bytes of k / k_scale and v / v_scale (saturated at +-448).
//   rms_source (may be null) [N, rms_width] bf16: the unnormalised input of the projection whose
//   norm weight was folded into it; every q, k, v value is first scaled by the token's
//   1 / sqrt(mean(rms_source^2) + eps), which makes the norm kernel before the product needless.
//   It is read before griddepcontrol.wait: the kernel before this one must not write it (the
//   product reads it), so after cuBLASLt's product in a captured graph this kernel may launch
//   once the product's blocks have all started (graphs.py) and take the RMS while it runs.
//
// The kernel lets the next one launch at its start, before its own wait for the product: that is
// decode attention, which reads before its wait only the step's metadata and the K/V of earlier
// tokens, none of which the product or this kernel writes, so its first K/V copies go out while
// the product still runs (H200, Llama-3.1-8B step: batch 1 3,911 -> 3,850 us, 64 5,595 -> 5,535).
//
// grid = (token, y): a block of 4 warps, a warp per head, takes the token's groups of 4 heads
// blockIdx.y, + gridDim.y, ... The host spreads a decode token's groups over as many blocks (its
// heads over the SMs instead of queueing in one block) and gives a prefill token's one block all
// of them, so that the token's RMS (rms_source) is taken once: at 8192 tokens of Llama-3.1-8B a
// block per group read the row 12 times, 390 us a layer on an H200. Bytes: read N (Hq + 2 Hkv) D
// * 2 + N r * 4, write the same amount of q, k, v; with rms_source each block also reads its
// token's row, N H * 2 per block of the token (from L2). FLOPs: ~6 N (Hq + Hkv) D. Bandwidth bound.
#include "atlas_common.cuh"

#define ROPE_MAX_HEAD_DIM 256
#define ROPE_WARPS 4
#define ROPE_PER_LANE (ROPE_MAX_HEAD_DIM / 32)

// A K or V value as the cache stores it: bf16, or E4M3 of value * inverse_scale.
__device__ __forceinline__ void store_cache(bf16* at, float value, float) { *at = from_float<bf16>(value); }
__device__ __forceinline__ void store_cache(fp8_e4m3* at, float value, float inverse_scale) {
    *at = static_cast<fp8_e4m3>(pack_fp8x2(value * inverse_scale, 0.0f));
}

template <typename TABLE, typename W, typename CACHE>
__device__ __forceinline__ void rope_and_cache_impl(const bf16* qkv, const int* positions, const int* slot_mapping,
                                                    const TABLE* table, int max_position, CACHE* k_plane,
                                                    CACHE* v_plane, bf16* q_out, const W* q_norm, const W* k_norm,
                                                    float eps, int num_q_heads, int num_kv_heads, int head_dim,
                                                    int rotary_dim, int block_size, const bf16* rms_source,
                                                    int rms_width, int num_gate_heads, float k_inverse_scale,
                                                    float v_inverse_scale) {
    __shared__ float head_values[ROPE_WARPS][ROPE_MAX_HEAD_DIM];
    __shared__ float rms_scratch[32];
    grid_dependents_launch();  // before this kernel's own wait: see the file comment
    const int token = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q_heads = num_q_heads + num_gate_heads;  // the heads q_out holds
    const int total_heads = q_heads + 2 * num_kv_heads;
    const long long row_stride = (long long)total_heads * head_dim;
    const int half = rotary_dim / 2;

    // Before the wait for the previous kernel (which writes qkv): the step inputs and the lane's
    // cos and sin (the table is constant), so only the qkv load is left on the path after it.
    int position = positions[token];
    position = position < 0 ? 0 : (position >= max_position ? max_position - 1 : position);
    const TABLE* cos_row = table + (long long)position * rotary_dim;
    const int slot = slot_mapping[token];
    float cos_values[ROPE_PER_LANE], sin_values[ROPE_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROPE_PER_LANE; ++j) {
        const int d = lane + 32 * j, pair = d < half ? d : d - half;
        const bool rotated = d < rotary_dim;
        cos_values[j] = rotated ? to_float(cos_row[pair]) : 1.0f;
        sin_values[j] = rotated ? to_float(cos_row[half + pair]) : 0.0f;
    }
    // The RMS's row too: the previous kernel (the qkv product) reads rms_source and does not
    // write it, and every kernel before that one has completed. Every thread of the block takes
    // part in the sum (before any warp leaves).
    const float scale = rms_source == nullptr
                            ? 1.0f
                            : block_inverse_rms(rms_source + (long long)token * rms_width, rms_width, eps, rms_scratch);
    grid_dependency_wait();
    float* values = head_values[warp];
    for (int head = blockIdx.y * ROPE_WARPS + warp; head < total_heads; head += gridDim.y * ROPE_WARPS) {
        const bool is_q = head < q_heads;  // a q head, or a gate head (is_gate)
        const bool is_gate = is_q && head >= num_q_heads;
        const bool is_v = head >= q_heads + num_kv_heads;
        const bf16* in = qkv + token * row_stride + (long long)head * head_dim;
        bf16 raw[ROPE_PER_LANE];
#pragma unroll
        for (int j = 0; j < ROPE_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            if (d < head_dim) raw[j] = in[d];
        }
        __syncwarp();  // the warp's previous head is out of `values`

        float sum_squares = 0.0f;
#pragma unroll
        for (int j = 0; j < ROPE_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            if (d >= head_dim) break;
            const float v = to_float(raw[j]) * scale;
            values[d] = v;
            sum_squares += v * v;
        }
        const W* norm = is_v || is_gate ? nullptr : (is_q ? q_norm : k_norm);
        if (norm != nullptr) {
            const float inverse_rms = 1.0f / sqrtf(warp_sum(sum_squares) / head_dim + eps);
            for (int d = lane; d < head_dim; d += 32) values[d] = values[d] * inverse_rms * to_float(norm[d]);
        }
        __syncwarp();

        if (!is_q && slot < 0) continue;
        float results[ROPE_PER_LANE];
#pragma unroll
        for (int j = 0; j < ROPE_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            if (d >= head_dim) break;
            results[j] = values[d];
            if (!is_v && !is_gate && d < rotary_dim) {
                const float other = d < half ? -values[d + half] : values[d - half];
                results[j] = values[d] * cos_values[j] + other * sin_values[j];
            }
        }
        if (is_q) {
            bf16* out = q_out + (long long)token * q_heads * head_dim + (long long)head * head_dim;
#pragma unroll
            for (int j = 0; j < ROPE_PER_LANE; ++j)
                if (lane + 32 * j < head_dim) out[lane + 32 * j] = from_float<bf16>(results[j]);
        } else {
            const int kv_head = is_v ? head - q_heads - num_kv_heads : head - q_heads;
            const long long block = slot / block_size, offset = slot % block_size;
            CACHE* out = (is_v ? v_plane : k_plane) + ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
            const float inverse_scale = is_v ? v_inverse_scale : k_inverse_scale;
#pragma unroll
            for (int j = 0; j < ROPE_PER_LANE; ++j)
                if (lane + 32 * j < head_dim) store_cache(out + lane + 32 * j, results[j], inverse_scale);
        }
    }
}

#define DEFINE_ROPE(SUFFIX, TABLE, W)                                                                          \
    extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32) rope_and_cache_##SUFFIX(                     \
        const bf16* qkv, const int* positions, const int* slot_mapping, const TABLE* table, int max_position,  \
        bf16* k_plane, bf16* v_plane, bf16* q_out, const W* q_norm, const W* k_norm, float eps,                \
        int num_q_heads, int num_kv_heads, int head_dim, int rotary_dim, int block_size,                       \
        const bf16* rms_source, int rms_width, int num_gate_heads) {                                           \
        rope_and_cache_impl<TABLE, W, bf16>(qkv, positions, slot_mapping, table, max_position, k_plane,        \
                                            v_plane, q_out, q_norm, k_norm, eps, num_q_heads, num_kv_heads,    \
                                            head_dim, rotary_dim, block_size, rms_source, rms_width,           \
                                            num_gate_heads, 1.0f, 1.0f);                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32) rope_and_cache_##SUFFIX##_fp8(               \
        const bf16* qkv, const int* positions, const int* slot_mapping, const TABLE* table, int max_position,  \
        fp8_e4m3* k_plane, fp8_e4m3* v_plane, bf16* q_out, const W* q_norm, const W* k_norm, float eps,        \
        int num_q_heads, int num_kv_heads, int head_dim, int rotary_dim, int block_size,                       \
        const bf16* rms_source, int rms_width, int num_gate_heads, float k_inverse_scale,                      \
        float v_inverse_scale) {                                                                               \
        rope_and_cache_impl<TABLE, W, fp8_e4m3>(qkv, positions, slot_mapping, table, max_position, k_plane,    \
                                                v_plane, q_out, q_norm, k_norm, eps, num_q_heads,              \
                                                num_kv_heads, head_dim, rotary_dim, block_size, rms_source,    \
                                                rms_width, num_gate_heads, k_inverse_scale, v_inverse_scale);  \
    }

// Table type, then q/k norm weight type; each with a bf16 cache and (_fp8) an E4M3 one, whose
// kernel takes the inverses of the layer's K and V scales last.
DEFINE_ROPE(f32_bf16, float, bf16)
DEFINE_ROPE(f32_f32, float, float)
DEFINE_ROPE(bf16_bf16, bf16, bf16)
DEFINE_ROPE(bf16_f32, bf16, float)

// The wgmma prefill attention kernels' code (see kernels/sm90/attention_prefill.cu for what they
// compute): included by attention_prefill.cu (the Llama-shaped instantiations, compiled alone so
// that NVVM's whole-module choices leave them as they were) and attention_prefill_x.cu (head dim
// 256 and the `_x` variants).
#pragma once

#include "attention_prefill_mma.cuh"
#include "wgmma.cuh"

#define WG_BLOCK_M 128  // query rows per block: two warpgroups of 64
#define WG_THREADS 256

template <int HEAD_DIM, int BLOCK_N>
struct WgmmaTile {
    static constexpr int PANELS = HEAD_DIM / 64;  // 128-byte panels per row
    static constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    static constexpr int Q_BYTES = PANELS * WG_BLOCK_M * 128;
    static constexpr int KV_BYTES = PANELS * BLOCK_N * 128;  // K (or V) of one tile
    static constexpr int FP8_CHUNKS = HEAD_DIM / 16;         // 16-byte chunks per FP8 row
    static constexpr int FP8_KV_BYTES = BLOCK_N * HEAD_DIM;  // FP8 K (or V) of one tile
    // bf16: Q, then stages 0 and 1 of K and V. FP8: Q, K and V, then stages 0 and 1 of FP8 K and V.
    static constexpr int SHARED_BYTES = Q_BYTES + 2 * 2 * KV_BYTES + 1024;
    static_assert(2 * KV_BYTES + 2 * 2 * FP8_KV_BYTES == 2 * 2 * KV_BYTES, "FP8 fits the bf16 layout's bytes");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `rows` rows stored as panels.
__device__ __forceinline__ u32 tile_chunk_offset(int rows, int row, int chunk) {
    return (u32)((chunk >> 3) * rows * 128) + swizzled_panel_offset(row, chunk & 7);
}

// The `_split` kernels' context split (flash-decoding for short query chunks over long
// contexts): grid.z = num_splits; block z of a (tile, KV head) reads its z-th share of the
// tile's key tiles (`used` shares of whole BLOCK_N tiles, used <= num_splits, computed from
// the tile's own keys, so a graph may bake in a count for its longest context; blocks past
// `used` leave at once, uncounted). With one share the block writes `out` as the unsplit
// kernel does. Otherwise each writes its rows' normalised partial outputs and log2-sum-exps,
// slot ((token * Hq + head) * num_splits + z):
//     partial_out [num_tokens, Hq, num_splits, D] f32, partial_lse [num_tokens, Hq, num_splits] f32
// and the last of the tile's blocks to finish (counters [tiles, Hkv], zero between launches,
// last_block_done) merges them into `out`: out = sum_z 2^(lse_z - max) o_z / sum_z 2^(lse_z - max).
struct PrefillSplit {
    float* partial_out;
    float* partial_lse;
    unsigned* counters;
    int num_splits;
};

// A `_split` block's end (see PrefillSplit): its rows' normalised partial outputs and
// log2-sum-exps to the workspace; the tile's last block to finish merges every share into `out`.
template <int HEAD_DIM>
__device__ __forceinline__ void split_prefill_finish(const float* o, const float* row_max, const float* row_sum,
                                                     const PrefillSplit& split, bf16* __restrict__ out,
                                                     long long q_row_stride, int first_token, int first_row,
                                                     int num_rows, int group, int kv_head, int num_q_heads,
                                                     int warp_row, int t, int tile_id, int used_splits) {
    const int num_splits = split.num_splits;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = first_row + warp_row + half * 8;
        if (row >= num_rows) continue;
        const int token = row / group, head = kv_head * group + row % group;
        const long long slot = ((long long)(first_token + token) * num_q_heads + head) * num_splits + blockIdx.z;
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        float* dst = split.partial_out + slot * HEAD_DIM;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
            *reinterpret_cast<float2*>(dst + d * 8 + 2 * t) =
                make_float2(o[4 * d + 2 * half] * inverse, o[4 * d + 2 * half + 1] * inverse);
        }
        if (t == 0) split.partial_lse[slot] = total > 0.0f ? row_max[half] + log2f(total) : -ATLAS_INF;
    }
    if (!last_block_done(split.counters + (long long)tile_id * gridDim.y + kv_head, used_splits)) return;
    constexpr int CHUNKS = HEAD_DIM / 8;
    const int rows_here = min(WG_BLOCK_M, num_rows - first_row);
    for (int item = threadIdx.x; item < rows_here * CHUNKS; item += blockDim.x) {
        const int row = first_row + item / CHUNKS, chunk = item % CHUNKS;
        const int token = row / group, head = kv_head * group + row % group;
        const long long first_slot = ((long long)(first_token + token) * num_q_heads + head) * num_splits;
        float best = -ATLAS_INF;
        for (int z = 0; z < used_splits; ++z) best = fmaxf(best, __ldcg(split.partial_lse + first_slot + z));
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        float weights = 0.0f;
        if (best != -ATLAS_INF) {
            for (int z = 0; z < used_splits; ++z) {
                const float lse = __ldcg(split.partial_lse + first_slot + z);
                if (lse == -ATLAS_INF) continue;
                const float weight = exp2f(lse - best);
                weights += weight;
                const float4* part = reinterpret_cast<const float4*>(split.partial_out + (first_slot + z) * HEAD_DIM + chunk * 8);
                const float4 lo = __ldcg(part), hi = __ldcg(part + 1);
                acc[0] += weight * lo.x; acc[1] += weight * lo.y; acc[2] += weight * lo.z; acc[3] += weight * lo.w;
                acc[4] += weight * hi.x; acc[5] += weight * hi.y; acc[6] += weight * hi.z; acc[7] += weight * hi.w;
            }
        }
        const float inverse = weights > 0.0f ? 1.0f / weights : 0.0f;
        uint4 packed;
        packed.x = pack_bf16x2(acc[0] * inverse, acc[1] * inverse);
        packed.y = pack_bf16x2(acc[2] * inverse, acc[3] * inverse);
        packed.z = pack_bf16x2(acc[4] * inverse, acc[5] * inverse);
        packed.w = pack_bf16x2(acc[6] * inverse, acc[7] * inverse);
        *reinterpret_cast<uint4*>(out + (first_token + token) * q_row_stride + (long long)head * HEAD_DIM + chunk * 8) = packed;
    }
}

// KV = bf16, or unsigned char for FP8 (E4M3) K/V with v_scale (see the file comment). EXTRAS: the
// `_x` kernels' sinks, soft-capping and gated output (attention_extras.cuh). SPLIT: the `_split`
// kernels' context split (PrefillSplit; neither FP8 nor EXTRAS).
template <int HEAD_DIM, int BLOCK_N, typename KV, bool EXTRAS = false, bool SPLIT = false>
__device__ __forceinline__ void attention_prefill_wgmma_impl(
    const bf16* __restrict__ q, const KV* __restrict__ k_plane, const KV* __restrict__ v_plane,
    bf16* __restrict__ out, const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int block_table_stride, int num_seqs, int num_q_heads, int num_kv_heads,
    int block_size, float scale_log2, int sliding_window, int skip_single_token, float v_scale,
    AttentionExtras extras = AttentionExtras{0, 0.0f, nullptr, 0}, PrefillSplit split = PrefillSplit{nullptr, nullptr, nullptr, 1}) {
    constexpr bool FP8 = sizeof(KV) == 1;
    static_assert(!SPLIT || (!FP8 && !EXTRAS), "the split kernels are bf16 without extras");
    using Tile = WgmmaTile<HEAD_DIM, BLOCK_N>;
    constexpr int S_REGS = BLOCK_N / 2;  // m64nBLOCK_N accumulators per thread
    constexpr int O_REGS = HEAD_DIM / 2;
    extern __shared__ uint4 shared_raw[];
    // Swizzle atoms are 1024 bytes and must start 1024-byte aligned.
    const u32 raw_address = smem_address(shared_raw);
    unsigned char* smem = reinterpret_cast<unsigned char*>(shared_raw) + (((raw_address + 1023u) & ~1023u) - raw_address);
    unsigned char* q_tile = smem;
    unsigned char* kv_tiles = smem + Tile::Q_BYTES;  // stage s: K at 2 s KV_BYTES, V right after
    unsigned char* fp8_tiles = kv_tiles + 2 * Tile::KV_BYTES;  // FP8 stage s: K at 2 s FP8_KV_BYTES, V after

    const int group = num_q_heads / num_kv_heads;
    const int kv_head = blockIdx.y;
    const int tile_id = gridDim.x - 1 - blockIdx.x;

    const PrefillTile tile = locate_prefill_tile(query_start_loc, seq_lens, num_seqs, group, WG_BLOCK_M, tile_id);
    const int seq = tile.seq, first_token = tile.first_token, query_len = tile.query_len;
    const int context_len = tile.context_len, first_row = tile.first_row, num_rows = tile.num_rows;
    if (query_len <= 0 || first_row >= num_rows || (skip_single_token && query_len == 1)) return;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warpgroup = warp >> 2;
    const int g = lane >> 2, t = lane & 3;
    const long long q_row_stride = (long long)num_q_heads * HEAD_DIM;  // of out (and of q without EXTRAS)
    const long long q_stride = EXTRAS ? (long long)extras.q_stride : q_row_stride;
    const int first_position = context_len - query_len;

    // Q tile -> shared (rows past the sequence are zero-filled).
    for (int c = tid; c < WG_BLOCK_M * Tile::CHUNKS; c += WG_THREADS) {
        const int r = c / Tile::CHUNKS, chunk = c % Tile::CHUNKS;
        const int row = first_row + r;
        const bool valid = row < num_rows;
        const int token = valid ? row / group : 0;
        const int head = kv_head * group + (valid ? row % group : 0);
        const bf16* src = q + (first_token + token) * q_stride + (long long)head * HEAD_DIM + chunk * 8;
        cp_async_16(q_tile + tile_chunk_offset(WG_BLOCK_M, r, chunk), valid ? src : q, valid);
    }
    cp_async_commit();

    // The two rows this thread owns in the accumulator layout.
    const int warp_row = warpgroup * 64 + (warp & 3) * 16 + g;
    int row_position[2];
    bool row_valid[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = first_row + warp_row + half * 8;
        row_valid[half] = row < num_rows;
        row_position[half] = first_position + (row_valid[half] ? row / group : 0);
    }
    const int last_row = min(first_row + WG_BLOCK_M, num_rows) - 1;
    const int lowest_position = first_position + first_row / group;
    const int kv_end = first_position + last_row / group + 1;
    const int kv_begin = sliding_window > 0 ? max(0, lowest_position - sliding_window + 1) : 0;

    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.0f;
    float row_max[2] = {-ATLAS_INF, -ATLAS_INF};
    float row_sum[2] = {0.0f, 0.0f};
    const int* table = block_tables + (long long)seq * block_table_stride;

    // K and V tiles -> shared through the page table (keys past kv_end are zero-filled), one
    // cp.async group per tile.
    // A thread always copies the same 16-byte chunk of its rows (WG_THREADS is a multiple of
    // CHUNKS). The one-block-per-SM variant unrolls the passes so their page-table loads issue
    // together; the two-block variant keeps them rolled (unrolled, they spill at its 128 registers).
    constexpr int ROWS_PER_PASS = WG_THREADS / Tile::CHUNKS;
    constexpr int LOAD_UNROLL = BLOCK_N == 128 ? BLOCK_N / ROWS_PER_PASS : 1;
    const int load_chunk = tid % Tile::CHUNKS;
    auto load_tile = [&](int kv_start, int stage) {
        unsigned char* k_dst = kv_tiles + stage * 2 * Tile::KV_BYTES;
        unsigned char* v_dst = k_dst + Tile::KV_BYTES;
#pragma unroll LOAD_UNROLL
        for (int pass = 0; pass < BLOCK_N / ROWS_PER_PASS; ++pass) {
            const int r = tid / Tile::CHUNKS + pass * ROWS_PER_PASS;
            const int key = kv_start + r;
            const bool valid = key < kv_end;
            long long offset = 0;
            if (valid) {
                const long long block = table[key / block_size];
                offset = ((block * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + load_chunk * 8;
            }
            const u32 dst = tile_chunk_offset(BLOCK_N, r, load_chunk);
            cp_async_16(k_dst + dst, k_plane + offset, valid);
            cp_async_16(v_dst + dst, v_plane + offset, valid);
        }
        cp_async_commit();
    };
    // FP8: thread t copies, and later converts, chunk (row + pass FP8_ROWS_PER_PASS, chunk) of
    // the tile (fp8_chunk_of_thread: each bf16 store covers 8 distinct swizzled 16-byte positions);
    // staging holds them by thread, pass p at (p WG_THREADS + t) 16 bytes. FP8 chunk c is bf16
    // chunks 2c and 2c + 1; the passes are whole swizzle atoms apart.
    constexpr int FP8_ROWS_PER_PASS = WG_THREADS / Tile::FP8_CHUNKS;
    constexpr int FP8_PASSES = BLOCK_N / FP8_ROWS_PER_PASS;
    static_assert(FP8_ROWS_PER_PASS % 8 == 0, "");
    auto load_fp8_tile = [&](int kv_start, int stage) {
        unsigned char* k_dst = fp8_tiles + stage * 2 * Tile::FP8_KV_BYTES + tid * 16;
        unsigned char* v_dst = k_dst + Tile::FP8_KV_BYTES;
        const int2 at = fp8_chunk_of_thread<Tile::FP8_CHUNKS>(tid);
        const int row = at.x, chunk = at.y;
#pragma unroll LOAD_UNROLL
        for (int pass = 0; pass < FP8_PASSES; ++pass) {
            const int key = kv_start + row + pass * FP8_ROWS_PER_PASS;
            const bool valid = key < kv_end;
            long long offset = 0;
            if (valid) {
                const long long block = table[key / block_size];
                offset = ((block * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + chunk * 16;
            }
            cp_async_16(k_dst + pass * WG_THREADS * 16, k_plane + offset, valid);
            cp_async_16(v_dst + pass * WG_THREADS * 16, v_plane + offset, valid);
        }
        cp_async_commit();
    };
    auto convert_fp8_tile = [&](int stage) {  // once this thread's copies of `stage` landed
        const unsigned char* k_src = fp8_tiles + stage * 2 * Tile::FP8_KV_BYTES + tid * 16;
        const unsigned char* v_src = k_src + Tile::FP8_KV_BYTES;
        const int2 at = fp8_chunk_of_thread<Tile::FP8_CHUNKS>(tid);
        unsigned char* lo_at = kv_tiles + tile_chunk_offset(BLOCK_N, at.x, 2 * at.y);
        unsigned char* hi_at = kv_tiles + tile_chunk_offset(BLOCK_N, at.x, 2 * at.y + 1);
#pragma unroll
        for (int pass = 0; pass < FP8_PASSES; ++pass) {
            const int step = pass * FP8_ROWS_PER_PASS * 128;
            store_e4m3x16_as_bf16(lo_at + step, hi_at + step,
                                  *reinterpret_cast<const uint4*>(k_src + pass * WG_THREADS * 16));
            store_e4m3x16_as_bf16(lo_at + Tile::KV_BYTES + step, hi_at + Tile::KV_BYTES + step,
                                  *reinterpret_cast<const uint4*>(v_src + pass * WG_THREADS * 16));
        }
    };
    const int num_kv_tiles = (kv_end - kv_begin + BLOCK_N - 1) / BLOCK_N;
    const int highest_position = kv_end - 1;
    int first_kv_tile = 0, end_kv_tile = num_kv_tiles, used_splits = 1;
    if constexpr (SPLIT) {
        const int share = max(1, (num_kv_tiles + split.num_splits - 1) / split.num_splits);
        used_splits = max(1, (num_kv_tiles + share - 1) / share);
        if ((int)blockIdx.z >= used_splits) {
            cp_async_wait<0>();  // the Q tile's copies
            return;
        }
        first_kv_tile = blockIdx.z * share;
        end_kv_tile = min(num_kv_tiles, first_kv_tile + share);
    }
    if (end_kv_tile > first_kv_tile) {
        if constexpr (FP8) {
            load_fp8_tile(kv_begin + first_kv_tile * BLOCK_N, 0);
        } else {
            load_tile(kv_begin + first_kv_tile * BLOCK_N, 0);
        }
    }

    for (int tile = first_kv_tile; tile < end_kv_tile; ++tile) {
        const int kv_start = kv_begin + tile * BLOCK_N;
        const int stage = (tile - first_kv_tile) & 1;
        if (tile + 1 < end_kv_tile) {
            if constexpr (FP8) {
                load_fp8_tile(kv_start + BLOCK_N, stage ^ 1);
            } else {
                load_tile(kv_start + BLOCK_N, stage ^ 1);
            }
            cp_async_wait<1>();  // everything but the tile just issued has landed
        } else {
            cp_async_wait<0>();
        }
        if constexpr (FP8) convert_fp8_tile(stage);
        fence_proxy_async_shared();  // cp.async and the conversion wrote through the generic proxy; wgmma reads async
        __syncthreads();
        const unsigned char* k_tile = FP8 ? kv_tiles : kv_tiles + stage * 2 * Tile::KV_BYTES;  // FP8: one stage
        const unsigned char* v_tile = k_tile + Tile::KV_BYTES;

        // S = Q K^T for this warpgroup's 64 rows x BLOCK_N keys.
        float s[S_REGS];
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) s[i] = 0.0f;
        wgmma_fence_registers<S_REGS>(s);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            const u64 desc_q = wgmma_descriptor(
                q_tile + (k >> 2) * (WG_BLOCK_M * 128) + warpgroup * (64 * 128) + (k & 3) * 32, 16, 1024);
            const u64 desc_k = wgmma_descriptor(k_tile + (k >> 2) * (BLOCK_N * 128) + (k & 3) * 32, 16, 1024);
            if constexpr (BLOCK_N == 128) {
                wgmma_m64n128k16_ss(s, desc_q, desc_k, 1);
            } else {
                wgmma_m64n64k16_ss(s, desc_q, desc_k, 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_registers<S_REGS>(s);

        // A tile wholly inside every row's causal window needs no mask (rows past the sequence
        // hold zero queries there: finite, and never stored).
        const bool unmasked = kv_start + BLOCK_N <= kv_end && kv_start + BLOCK_N - 1 <= lowest_position &&
                              (sliding_window <= 0 || kv_start > highest_position - sliding_window);

        // Mask, scale, and the online-softmax update of both rows. s[4n + 2 half + e] is row
        // (g + 8 half), key kv_start + 8n + 2t + e.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int position = row_position[half];
            float tile_max = -ATLAS_INF;
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kv_start + n * 8 + 2 * t + e;
                    const bool allowed = unmasked || (row_valid[half] && key < kv_end && key <= position &&
                                                      (sliding_window <= 0 || key > position - sliding_window));
                    const int index = 4 * n + 2 * half + e;
                    float value;
                    if constexpr (EXTRAS) {
                        value = allowed ? capped_log2(s[index] * scale_log2, extras.softcap_log2) : -ATLAS_INF;
                    } else {
                        value = allowed ? s[index] * scale_log2 : -ATLAS_INF;
                    }
                    s[index] = value;
                    tile_max = fmaxf(tile_max, value);
                }
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[half], tile_max);
            const float reference = new_max == -ATLAS_INF ? 0.0f : new_max;  // a fully masked row so far
            const float rescale = exp2f(row_max[half] - reference);
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int index = 4 * n + 2 * half + e;
                    const float p = exp2f(s[index] - reference);
                    s[index] = p;
                    tile_sum += p;
                }
            }
            row_sum[half] = row_sum[half] * rescale + tile_sum;
            row_max[half] = new_max;
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 8; ++d) {
                o[4 * d + 2 * half] *= rescale;
                o[4 * d + 2 * half + 1] *= rescale;
            }
        }

        // O += P V: the C layout of two 8-key blocks is the A fragment of one 16-key step.
        u32 p[BLOCK_N / 4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            p[4 * kk + 0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
            p[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
            p[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
            p[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
        }
        wgmma_fence_registers<O_REGS>(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const u64 desc_v = wgmma_descriptor(v_tile + kk * 16 * 128, BLOCK_N * 128, 1024);
            if constexpr (HEAD_DIM == 256) {
                wgmma_m64n256k16_rs_transposed_b(o, p + 4 * kk, desc_v);
            } else if constexpr (HEAD_DIM == 128) {
                wgmma_m64n128k16_rs_transposed_b(o, p + 4 * kk, desc_v);
            } else {
                wgmma_m64n64k16_rs_transposed_b(o, p + 4 * kk, desc_v);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_registers<O_REGS>(o);
        __syncthreads();  // both warpgroups are done with this stage before a later load overwrites it
    }
    cp_async_wait<0>();

    if constexpr (SPLIT) {
        if (used_splits > 1) {
            split_prefill_finish<HEAD_DIM>(o, row_max, row_sum, split, out, q_row_stride, first_token, first_row, num_rows,
                                           group, kv_head, num_q_heads, warp_row, t, tile_id, used_splits);
            return;
        }
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (!row_valid[half]) continue;
        if constexpr (EXTRAS) {
            const int row = first_row + warp_row + half * 8;
            const int token = row / group, head = kv_head * group + row % group;
            total += sink_term(extras.sinks, head, row_max[half]);
            const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            bf16* dst = out + (first_token + token) * q_row_stride + (long long)head * HEAD_DIM;
            const bf16* gate = q + (first_token + token) * q_stride + (long long)(num_q_heads + head) * HEAD_DIM;
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 8; ++d) {
                float lo = o[4 * d + 2 * half] * inverse, hi = o[4 * d + 2 * half + 1] * inverse;
                if (extras.gated) {
                    lo *= sigmoid_of(gate[d * 8 + 2 * t]);
                    hi *= sigmoid_of(gate[d * 8 + 2 * t + 1]);
                }
                *reinterpret_cast<u32*>(dst + d * 8 + 2 * t) = pack_bf16x2(lo, hi);
            }
            continue;
        }
        float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        if constexpr (FP8) inverse *= v_scale;  // O sums stored V values
        const int row = first_row + warp_row + half * 8;
        const int token = row / group, head = kv_head * group + row % group;
        bf16* dst = out + (first_token + token) * q_row_stride + (long long)head * HEAD_DIM;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
            const u32 pair = pack_bf16x2(o[4 * d + 2 * half] * inverse, o[4 * d + 2 * half + 1] * inverse);
            *reinterpret_cast<u32*>(dst + d * 8 + 2 * t) = pair;
        }
    }
}

#define DEFINE_PREFILL_WGMMA(HEAD_DIM, BLOCK_N, MIN_BLOCKS)                                                   \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MIN_BLOCKS)                                      \
        attention_prefill_wgmma_d##HEAD_DIM##_n##BLOCK_N(                                                      \
            const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, const int* query_start_loc,    \
            const int* seq_lens, const int* block_tables, int block_table_stride, int num_seqs,                \
            int num_q_heads, int num_kv_heads, int block_size, float scale_log2, int sliding_window,           \
            int skip_single_token) {                                                                           \
        dependent_launch_entry();                                                                              \
        attention_prefill_wgmma_impl<HEAD_DIM, BLOCK_N, bf16>(q, k_plane, v_plane, out, query_start_loc,       \
                                                              seq_lens, block_tables, block_table_stride,      \
                                                              num_seqs, num_q_heads, num_kv_heads, block_size, \
                                                              scale_log2, sliding_window, skip_single_token,   \
                                                              1.0f);                                           \
    }

#define DEFINE_PREFILL_WGMMA_FP8(HEAD_DIM, BLOCK_N, MIN_BLOCKS)                                               \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MIN_BLOCKS)                                      \
        attention_prefill_wgmma_d##HEAD_DIM##_n##BLOCK_N##_fp8(                                                \
            const bf16* q, const unsigned char* k_plane, const unsigned char* v_plane, bf16* out,              \
            const int* query_start_loc, const int* seq_lens, const int* block_tables, int block_table_stride,  \
            int num_seqs, int num_q_heads, int num_kv_heads, int block_size, float scale_log2,                 \
            int sliding_window, int skip_single_token, float v_scale) {                                        \
        dependent_launch_entry();                                                                              \
        attention_prefill_wgmma_impl<HEAD_DIM, BLOCK_N, unsigned char>(                                        \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, v_scale);    \
    }

// The `_x` twins (attention_extras.cuh).
#define DEFINE_PREFILL_WGMMA_X(HEAD_DIM, BLOCK_N, MIN_BLOCKS)                                                 \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MIN_BLOCKS)                                      \
        attention_prefill_wgmma_d##HEAD_DIM##_n##BLOCK_N##_x(                                                  \
            const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, const int* query_start_loc,    \
            const int* seq_lens, const int* block_tables, int block_table_stride, int num_seqs,                \
            int num_q_heads, int num_kv_heads, int block_size, float scale_log2, int sliding_window,           \
            int skip_single_token, int q_stride, float softcap_log2, const float* sinks, int gated) {          \
        dependent_launch_entry();                                                                              \
        attention_prefill_wgmma_impl<HEAD_DIM, BLOCK_N, bf16, true>(                                           \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, 1.0f,        \
            AttentionExtras{q_stride, softcap_log2, sinks, gated});                                            \
    }

// The `_split` twins (PrefillSplit): bf16, no extras.
#define DEFINE_PREFILL_WGMMA_SPLIT(HEAD_DIM, BLOCK_N, MIN_BLOCKS)                                             \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MIN_BLOCKS)                                      \
        attention_prefill_wgmma_d##HEAD_DIM##_n##BLOCK_N##_split(                                              \
            const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, const int* query_start_loc,    \
            const int* seq_lens, const int* block_tables, int block_table_stride, int num_seqs,                \
            int num_q_heads, int num_kv_heads, int block_size, float scale_log2, int sliding_window,           \
            int skip_single_token, float* partial_out, float* partial_lse, unsigned* counters, int num_splits) { \
        dependent_launch_entry();                                                                              \
        attention_prefill_wgmma_impl<HEAD_DIM, BLOCK_N, bf16, false, true>(                                    \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, 1.0f,        \
            AttentionExtras{0, 0.0f, nullptr, 0}, PrefillSplit{partial_out, partial_lse, counters, num_splits}); \
    }

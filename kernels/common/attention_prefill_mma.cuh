// Paged causal attention for the query tokens of a varlen batch (prefill chunks, speculative
// verification, and decodes when the decode kernel is not launched), FlashAttention-2 style.
//
//   q, out   [N, Hq * D] bf16          k_plane, v_plane: this layer's pages [Hkv][block_size][D]
//   query_start_loc [S + 1], seq_lens [S], block_tables [S, stride]  (see AttentionMetadata)
//
// Work split: the G = Hq / Hkv query heads that share a KV head are folded into the rows of a
// tile, so one K/V tile load serves all of them (GQA costs no extra KV traffic):
//
//     tile rows r = 0..63 of sequence s, KV head h:   row index  R = 64 * tile + r
//         token i = R / G   (query token i of s, at position seq_len - query_len + i)
//         head    = h * G + R % G
//
// grid.x enumerates tiles of all sequences: sequence s owns tiles [T(s), T(s + 1)) with
// T(s) = floor(query_start_loc[s] * G / 64) + s, which always covers ceil(query_len * G / 64);
// each block finds its s by binary search, so the grid depends only on the host bounds (N, S).
// grid.y = KV head.
//
// Per tile, 4 warps of 16 rows each run the online softmax over 64-key tiles of the context
// (keys > the row's position, or outside the sliding window, are masked):
//     S = Q K^T * scale (mma.sync m16n8k16, fp32), m' = max(m, rowmax S), P = exp2(S - m'),
//     l = l * exp2(m - m') + rowsum P,  O = O * exp2(m - m') + P V,   out = O / l
// K and V tiles arrive through cp.async, double-buffered (the next tile loads while this one
// computes) where shared memory allows; the scale is folded with log2(e) so exp2 does the work.
//
// FP8 K/V (the _fp8 kernels: `k_plane`/`v_plane` hold E4M3 bytes, one per element of the same
// layout; the host folds the K scale into scale_log2 and passes v_scale, which multiplies the
// normalised output): the next tile's bytes stream by cp.async into two stages of staging (half
// a bf16 tile's bytes each) while this one computes; at the top of its iteration each thread
// converts the chunks it copied itself (exactly: store_e4m3x16_as_bf16) into one stage of bf16
// K/V tiles, which the MMA code reads unchanged. The single-stage variant (head_dim 256) has no
// staging: after a tile computes it loads the next one's bytes to registers and stores them
// converted (its bf16 twin does not overlap the load either). Conversion costs about 5 integer
// or bf16 instructions per pair of elements.
//
// `_x` twins (defined last; attention_extras.cuh): q rows q_stride apart, soft-capped scores, the
// head's sink in the final denominator, a sigmoid gate on the output. The host runs them, and
// not the wgmma kernels, for layers that have any of these.
//
// FLOPs: 4 * sum over sequences of (query_len * context_len * Hq * D), halved by the causal mask
// for prompts. Bytes: the K/V context of each sequence once per 64 rows of tile (a byte an element
// with FP8), plus q and out.
// Long prompts are tensor-core bound (mma.sync reaches ~60% of Hopper's wgmma peak; a wgmma
// variant is kernels/sm90/attention_prefill.cu).
#pragma once

#include "atlas_common.cuh"
#include "attention_extras.cuh"

// A varlen prefill grid: sequence s owns T(s) = floor(query_start[s] * G / block_m) + s tiles
// onwards, each tile block_m query rows (token x head-in-group) of that sequence.
struct PrefillTile {
    int seq, first_token, query_len, context_len, first_row, num_rows;
};

__device__ __forceinline__ PrefillTile locate_prefill_tile(const int* query_start_loc, const int* seq_lens,
                                                           int num_seqs, int group, int block_m, int tile_id) {
    int lo = 0, hi = num_seqs - 1;  // the last s with T(s) <= tile_id
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const int start = (int)(((long long)query_start_loc[mid] * group) / block_m) + mid;
        if (start <= tile_id) lo = mid; else hi = mid - 1;
    }
    PrefillTile tile;
    tile.seq = lo;
    tile.first_token = query_start_loc[lo];
    tile.query_len = query_start_loc[lo + 1] - tile.first_token;
    tile.context_len = seq_lens[lo];
    const int local_tile = tile_id - ((int)(((long long)tile.first_token * group) / block_m) + lo);
    tile.first_row = local_tile * block_m;
    tile.num_rows = tile.query_len * group;
    return tile;
}


// ---------------------------------------------------------------------------------------------
// FP8 K/V: an OCP E4M3 byte (1 sign, 4 exponent bits biased by 7, 3 mantissa bits) becomes a bf16
// exactly, with integer ops and one bf16 multiply per pair (the same bits on every arch):
//
//     half  = byte << 8                         sign at bit 15, exponent 11..14, mantissa 8..10
//     bits  = sign | (half >> 4) & 0x07f0       a bf16 holding the E4M3 exponent and mantissa
//     value = bits * 2^120                      rebias 7 -> 127; E4M3 subnormals (exponent 0) are
//                                               bf16 subnormals there, which the multiply keeps
//
// The NaN bytes 0x7f / 0xff come out as +-480 (the cache writer saturates finite values to 448).
__device__ __forceinline__ u32 e4m3x2_to_bf16x2(u32 halves) {  // the two bytes at bits 8..15 and 24..31
    const u32 bits = (halves & 0x80008000u) | ((halves >> 4) & 0x07f007f0u);
    u32 value;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(value) : "r"(bits), "r"(0x7b807b80u), "r"(0x80008000u));
    return value;
}

// Sixteen E4M3 bytes (element i in byte i) as sixteen bf16 (shared memory): elements 0-7 at
// `lo_at`, 8-15 at `hi_at`.
__device__ __forceinline__ void store_e4m3x16_as_bf16(unsigned char* lo_at, unsigned char* hi_at, const uint4& raw) {
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    u32 pairs[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        pairs[2 * i] = e4m3x2_to_bf16x2(__byte_perm(words[i], 0u, 0x1404));      // bytes 0, 1
        pairs[2 * i + 1] = e4m3x2_to_bf16x2(__byte_perm(words[i], 0u, 0x3424));  // bytes 2, 3
    }
    *reinterpret_cast<uint4*>(lo_at) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    *reinterpret_cast<uint4*>(hi_at) = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
}

// The 16-byte chunk of an FP8 K/V tile, (row, chunk) with FP8_CHUNKS chunks a row, that thread t
// copies and converts (rows then advance by THREADS / FP8_CHUNKS a pass). Each 8 threads take 4
// chunks of an even row and the same 4 of the next row, so each bf16 store of theirs covers 8
// distinct 16-byte bank groups in the padded layout (rows 16 bytes a bank group apart, mod 32)
// and in the swizzled one (rows of different swizzle parity) alike; 8 chunks of one row would
// hit 4 groups twice:
//
//     threads 8q .. 8q + 7:   row 2p:      chunks 4k .. 4k + 3        (k = q % (FP8_CHUNKS / 4),
//                             row 2p + 1:  chunks 4k .. 4k + 3         p = q / (FP8_CHUNKS / 4))
template <int FP8_CHUNKS>
__device__ __forceinline__ int2 fp8_chunk_of_thread(int t) {
    constexpr int QUADS = FP8_CHUNKS / 4;  // 4-chunk groups a row
    const int q = t >> 3;
    return make_int2(2 * (q / QUADS) + ((t >> 2) & 1), (q % QUADS) * 4 + (t & 3));
}

#define PREFILL_BLOCK_N 64

// KV = bf16, or unsigned char for FP8 (E4M3) K/V with v_scale (see the file comment).
// EXTRAS: the `_x` kernels' sinks, soft-capping and gated output (attention_extras.cuh).
template <int HEAD_DIM, int STAGES, int BLOCK_M, typename KV, bool EXTRAS = false>
__device__ __forceinline__ void attention_prefill_impl(
    const bf16* __restrict__ q, const KV* __restrict__ k_plane, const KV* __restrict__ v_plane,
    bf16* __restrict__ out, const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int block_table_stride, int num_seqs, int num_q_heads, int num_kv_heads,
    int block_size, float scale_log2, int sliding_window, int skip_single_token, float v_scale,
    AttentionExtras extras = AttentionExtras{0, 0.0f, nullptr, 0}) {
    constexpr bool FP8 = sizeof(KV) == 1;
    constexpr int STRIDE = HEAD_DIM + 8;  // padded row: conflict-free fragment loads
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int FP8_CHUNKS = HEAD_DIM / 16;  // 16-byte chunks per row of FP8 bytes
    constexpr int DIM_TILES = HEAD_DIM / 8;
    constexpr int THREADS = BLOCK_M / 16 * 32;  // a warp per 16 rows
    constexpr int TILE_STAGES = FP8 ? 1 : STAGES;  // stages of bf16 K/V tiles
    extern __shared__ uint4 shared_raw[];
    // Shared memory: Q [BLOCK_M][STRIDE], then per stage K [64][STRIDE] and V [64][STRIDE] (bf16).
    // FP8: one stage of those, then (STAGES 2) two stages of the cached bytes K [64][D], V [64][D].
    bf16* q_tile = reinterpret_cast<bf16*>(shared_raw);
    bf16* kv_tiles = q_tile + BLOCK_M * STRIDE;
    unsigned char* fp8_tiles = reinterpret_cast<unsigned char*>(kv_tiles + TILE_STAGES * 2 * PREFILL_BLOCK_N * STRIDE);

    const int group = num_q_heads / num_kv_heads;
    const int kv_head = blockIdx.y;
    const int tile_id = blockIdx.x;

    const PrefillTile tile = locate_prefill_tile(query_start_loc, seq_lens, num_seqs, group, BLOCK_M, tile_id);
    const int seq = tile.seq, first_token = tile.first_token, query_len = tile.query_len;
    const int context_len = tile.context_len, first_row = tile.first_row, num_rows = tile.num_rows;
    if (query_len <= 0 || first_row >= num_rows || (skip_single_token && query_len == 1)) return;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long q_row_stride = (long long)num_q_heads * HEAD_DIM;  // of out (and of q without EXTRAS)
    const long long q_stride = EXTRAS ? (long long)extras.q_stride : q_row_stride;
    const int first_position = context_len - query_len;

    // Q tile -> shared (rows past the sequence are zero-filled).
    for (int c = tid; c < BLOCK_M * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, chunk = c % CHUNKS;
        const int row = first_row + r;
        const bool valid = row < num_rows;
        const int token = valid ? row / group : 0;
        const int head = kv_head * group + (valid ? row % group : 0);
        const bf16* src = q + (first_token + token) * q_stride + (long long)head * HEAD_DIM + chunk * 8;
        cp_async_16(q_tile + r * STRIDE + chunk * 8, valid ? src : q, valid);
    }
    cp_async_commit();

    // The two rows this thread owns in the accumulator layout: warp * 16 + g and + 8.
    int row_position[2];
    bool row_valid[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = first_row + warp * 16 + g + half * 8;
        row_valid[half] = row < num_rows;
        row_position[half] = first_position + (row_valid[half] ? row / group : 0);
    }
    const int last_row = min(first_row + BLOCK_M, num_rows) - 1;
    const int lowest_position = first_position + first_row / group;
    const int kv_end = first_position + last_row / group + 1;
    const int kv_begin = sliding_window > 0 ? max(0, lowest_position - sliding_window + 1) : 0;

    float o[DIM_TILES][4];
#pragma unroll
    for (int d = 0; d < DIM_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float row_max[2] = {-ATLAS_INF, -ATLAS_INF};
    float row_sum[2] = {0.0f, 0.0f};
    const int* table = block_tables + (long long)seq * block_table_stride;

    // K and V tiles -> shared through the page table (keys past kv_end are zero-filled), one
    // cp.async group per tile. With two stages the next tile streams in while this one computes.
    auto load_tile = [&](int kv_start, int stage) {
        bf16* k_dst = kv_tiles + stage * 2 * PREFILL_BLOCK_N * STRIDE;
        bf16* v_dst = k_dst + PREFILL_BLOCK_N * STRIDE;
        for (int c = tid; c < PREFILL_BLOCK_N * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, chunk = c % CHUNKS;
            const int key = kv_start + r;
            const bool valid = key < kv_end;
            long long offset = 0;
            if (valid) {
                const long long block = table[key / block_size];
                offset = ((block * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + chunk * 8;
            }
            cp_async_16(k_dst + r * STRIDE + chunk * 8, k_plane + offset, valid);
            cp_async_16(v_dst + r * STRIDE + chunk * 8, v_plane + offset, valid);
        }
        cp_async_commit();
    };
    // FP8 K/V: thread t owns chunk (fp8_row + i ROW_STEP, fp8_chunk) of the tile for i < FP8_PER_THREAD
    // (fp8_chunk_of_thread): it copies them to staging (two stages) or loads them to registers
    // (one stage), and stores them converted. Staging holds them by thread, pass i at
    // (i THREADS + t) 16 bytes, which the copies and the reads both cover without bank conflicts.
    constexpr int FP8_PER_THREAD = PREFILL_BLOCK_N * FP8_CHUNKS / THREADS;
    constexpr int ROW_STEP = THREADS / FP8_CHUNKS;
    static_assert(THREADS % (2 * FP8_CHUNKS) == 0 && FP8_PER_THREAD * ROW_STEP == PREFILL_BLOCK_N, "");
    const int2 fp8_at = fp8_chunk_of_thread<FP8_CHUNKS>(tid);
    const int fp8_row = fp8_at.x, fp8_chunk = fp8_at.y;
    unsigned char* const fp8_lo_at =  // this thread's converted elements 0-7 in K's bf16 tile (i = 0)
        reinterpret_cast<unsigned char*>(kv_tiles + fp8_row * STRIDE + fp8_chunk * 16);
    unsigned char* const fp8_hi_at = fp8_lo_at + 16;  // and elements 8-15
    constexpr int V_TILE_BYTES = PREFILL_BLOCK_N * STRIDE * 2;  // V's bf16 tile after K's
    constexpr int STEP_BYTES = ROW_STEP * STRIDE * 2;
    auto fp8_offset = [&](int key) -> long long {
        const long long block = table[key / block_size];
        return ((block * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + fp8_chunk * 16;
    };
    auto load_fp8_tile = [&](int kv_start, int stage) {
        unsigned char* k_dst = fp8_tiles + stage * 2 * PREFILL_BLOCK_N * HEAD_DIM + tid * 16;
        unsigned char* v_dst = k_dst + PREFILL_BLOCK_N * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < FP8_PER_THREAD; ++i) {
            const int key = kv_start + fp8_row + i * ROW_STEP;
            const bool valid = key < kv_end;
            const long long offset = valid ? fp8_offset(key) : 0;
            cp_async_16(k_dst + i * THREADS * 16, k_plane + offset, valid);
            cp_async_16(v_dst + i * THREADS * 16, v_plane + offset, valid);
        }
        cp_async_commit();
    };
    auto convert_fp8_tile = [&](int stage) {  // once this thread's copies of `stage` landed
        const unsigned char* k_src = fp8_tiles + stage * 2 * PREFILL_BLOCK_N * HEAD_DIM + tid * 16;
        const unsigned char* v_src = k_src + PREFILL_BLOCK_N * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < FP8_PER_THREAD; ++i) {
            const int at = i * STEP_BYTES;
            store_e4m3x16_as_bf16(fp8_lo_at + at, fp8_hi_at + at,
                                  *reinterpret_cast<const uint4*>(k_src + i * THREADS * 16));
            store_e4m3x16_as_bf16(fp8_lo_at + V_TILE_BYTES + at, fp8_hi_at + V_TILE_BYTES + at,
                                  *reinterpret_cast<const uint4*>(v_src + i * THREADS * 16));
        }
    };
    auto load_fp8_tile_now = [&](int kv_start) {  // one stage: global -> registers -> bf16 tile
        uint4 k_raw[FP8_PER_THREAD], v_raw[FP8_PER_THREAD];
#pragma unroll
        for (int i = 0; i < FP8_PER_THREAD; ++i) {
            const int key = kv_start + fp8_row + i * ROW_STEP;
            k_raw[i] = v_raw[i] = make_uint4(0u, 0u, 0u, 0u);
            if (key < kv_end) {
                const long long offset = fp8_offset(key);
                k_raw[i] = __ldg(reinterpret_cast<const uint4*>(k_plane + offset));
                v_raw[i] = __ldg(reinterpret_cast<const uint4*>(v_plane + offset));
            }
        }
#pragma unroll
        for (int i = 0; i < FP8_PER_THREAD; ++i) {
            const int at = i * STEP_BYTES;
            store_e4m3x16_as_bf16(fp8_lo_at + at, fp8_hi_at + at, k_raw[i]);
            store_e4m3x16_as_bf16(fp8_lo_at + V_TILE_BYTES + at, fp8_hi_at + V_TILE_BYTES + at, v_raw[i]);
        }
    };
    const int num_kv_tiles = (kv_end - kv_begin + PREFILL_BLOCK_N - 1) / PREFILL_BLOCK_N;
    const int highest_position = kv_end - 1;
    if (num_kv_tiles > 0) {
        if constexpr (!FP8) {
            load_tile(kv_begin, 0);
        } else if constexpr (STAGES == 2) {
            load_fp8_tile(kv_begin, 0);
        } else {
            load_fp8_tile_now(kv_begin);
        }
    }

    for (int tile = 0; tile < num_kv_tiles; ++tile) {
        const int kv_start = kv_begin + tile * PREFILL_BLOCK_N;
        const int stage = STAGES == 2 ? tile & 1 : 0;
        if (STAGES == 2 && tile + 1 < num_kv_tiles) {
            if constexpr (FP8) {
                load_fp8_tile(kv_start + PREFILL_BLOCK_N, stage ^ 1);
            } else {
                load_tile(kv_start + PREFILL_BLOCK_N, stage ^ 1);
            }
            cp_async_wait<1>();  // everything but the tile just issued has landed
        } else {
            cp_async_wait<0>();
        }
        if constexpr (FP8 && STAGES == 2) convert_fp8_tile(stage);
        __syncthreads();
        const bf16* k_tile = kv_tiles + (FP8 ? 0 : stage) * 2 * PREFILL_BLOCK_N * STRIDE;
        const bf16* v_tile = k_tile + PREFILL_BLOCK_N * STRIDE;

        // S = Q K^T for this warp's 16 rows x 64 keys.
        float s[PREFILL_BLOCK_N / 8][4];
#pragma unroll
        for (int n = 0; n < PREFILL_BLOCK_N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        // Fragments through ldmatrix.x4: lane L addresses row L % 8 of 8x8 matrix L / 8.
        //   Q (A, 16 x 16): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), row-half = bit 0 of L / 8
        //   K (B, two n-tiles x 16 k): matrices (keys n..n+7 | n+8..n+15) x (k 0-7 | 8-15),
        //     k-half = bit 0 of L / 8, key-half = bit 1
        const bf16* q_lane = q_tile + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
        const bf16* k_lane = k_tile + ((lane & 7) + (lane >> 4) * 8) * STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            u32 a[4];
            ldmatrix_x4(a, q_lane + k * 16);
#pragma unroll
            for (int n = 0; n < PREFILL_BLOCK_N / 8; n += 2) {
                u32 b[4];
                ldmatrix_x4(b, k_lane + n * 8 * STRIDE + k * 16);
                mma_bf16_16816(s[n], a, b);
                mma_bf16_16816(s[n + 1], a, b + 2);
            }
        }

        // A tile wholly inside every row's causal window needs no mask (rows past the sequence
        // hold zero queries there: finite, and never stored).
        const bool unmasked = kv_start + PREFILL_BLOCK_N <= kv_end && kv_start + PREFILL_BLOCK_N - 1 <= lowest_position &&
                              (sliding_window <= 0 || kv_start > highest_position - sliding_window);

        // Mask, scale, and the online-softmax update of both rows.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int position = row_position[half];
            float tile_max = -ATLAS_INF;
#pragma unroll
            for (int n = 0; n < PREFILL_BLOCK_N / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kv_start + n * 8 + 2 * t + e;
                    const bool allowed = unmasked || (row_valid[half] && key < kv_end && key <= position &&
                                                      (sliding_window <= 0 || key > position - sliding_window));
                    float value = s[n][half * 2 + e] * scale_log2;
                    if constexpr (EXTRAS) value = capped_log2(value, extras.softcap_log2);
                    value = allowed ? value : -ATLAS_INF;
                    s[n][half * 2 + e] = value;
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
            for (int n = 0; n < PREFILL_BLOCK_N / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(s[n][half * 2 + e] - reference);
                    s[n][half * 2 + e] = p;
                    tile_sum += p;
                }
            }
            row_sum[half] = row_sum[half] * rescale + tile_sum;
            row_max[half] = new_max;
#pragma unroll
            for (int d = 0; d < DIM_TILES; ++d) {
                o[d][half * 2] *= rescale;
                o[d][half * 2 + 1] *= rescale;
            }
        }

        // O += P V: P from the score registers (C layout of two n-tiles = A layout of one k-step),
        // V through ldmatrix.trans (rows = keys, columns = head dims).
#pragma unroll
        for (int kk = 0; kk < PREFILL_BLOCK_N / 16; ++kk) {
            u32 a[4];
            a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const int key_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int dd = 0; dd < HEAD_DIM / 16; ++dd) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_tile + key_row * STRIDE + dd * 16 + (lane >> 4) * 8);
                mma_bf16_16816(o[2 * dd], a, b);
                mma_bf16_16816(o[2 * dd + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with this stage before a later load overwrites it
        if (STAGES == 1 && tile + 1 < num_kv_tiles) {
            if constexpr (FP8) {
                load_fp8_tile_now(kv_start + PREFILL_BLOCK_N);
            } else {
                load_tile(kv_start + PREFILL_BLOCK_N, 0);
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (!row_valid[half]) continue;
        const int row = first_row + warp * 16 + g + half * 8;
        const int token = row / group, head = kv_head * group + row % group;
        if constexpr (EXTRAS) total += sink_term(extras.sinks, head, row_max[half]);
        float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        if constexpr (FP8) inverse *= v_scale;  // O sums stored V values
        bf16* dst = out + (first_token + token) * q_row_stride + (long long)head * HEAD_DIM;
        const bf16* gate = q + (first_token + token) * q_stride + (long long)(num_q_heads + head) * HEAD_DIM;
#pragma unroll
        for (int d = 0; d < DIM_TILES; ++d) {
            float lo = o[d][half * 2] * inverse, hi = o[d][half * 2 + 1] * inverse;
            if constexpr (EXTRAS) {
                if (extras.gated) {
                    lo *= sigmoid_of(gate[d * 8 + 2 * t]);
                    hi *= sigmoid_of(gate[d * 8 + 2 * t + 1]);
                }
            }
            *reinterpret_cast<u32*>(dst + d * 8 + 2 * t) = pack_bf16x2(lo, hi);
        }
    }
}

#define DEFINE_PREFILL(HEAD_DIM, STAGES, BLOCK_M)                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_M / 16 * 32, 2) attention_prefill_d##HEAD_DIM##_m##BLOCK_M( \
        const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, const int* query_start_loc,        \
        const int* seq_lens, const int* block_tables, int block_table_stride, int num_seqs, int num_q_heads,   \
        int num_kv_heads, int block_size, float scale_log2, int sliding_window, int skip_single_token) {       \
        dependent_launch_entry();                                                                              \
        attention_prefill_impl<HEAD_DIM, STAGES, BLOCK_M, bf16>(                                               \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, 1.0f);       \
    }

#define DEFINE_PREFILL_FP8(HEAD_DIM, STAGES, BLOCK_M)                                                          \
    extern "C" __global__ void __launch_bounds__(BLOCK_M / 16 * 32, 2)                                        \
        attention_prefill_d##HEAD_DIM##_m##BLOCK_M##_fp8(                                                      \
            const bf16* q, const unsigned char* k_plane, const unsigned char* v_plane, bf16* out,              \
            const int* query_start_loc, const int* seq_lens, const int* block_tables, int block_table_stride,  \
            int num_seqs, int num_q_heads, int num_kv_heads, int block_size, float scale_log2,                 \
            int sliding_window, int skip_single_token, float v_scale) {                                        \
        dependent_launch_entry();                                                                              \
        attention_prefill_impl<HEAD_DIM, STAGES, BLOCK_M, unsigned char>(                                      \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, v_scale);    \
    }

// Two blocks per SM (the register cap of __launch_bounds__(.., 2) costs d128_m128 20 bytes of
// spills, its FP8 twin about twice that, and doubles the warps that hide latency).
// Shared memory is (BLOCK_M + 2 STAGES 64) (D + 8) 2 bytes; FP8: (BLOCK_M + 2 64) (D + 8) 2, plus
// 2 2 64 D of staging with two stages (no more than bf16). 128-row tiles (8 warps) halve the K/V
// traffic per query row; the host takes them when the device allows the shared memory
// (d128_m128 needs 102 KB: Hopper and A100 yes, sm_120's 99 KB no, so d128_m64 exists too).
// The FP8 kernels come first: NVVM's choices for a kernel can depend on those compiled before
// it, and this order leaves the bf16 kernels' code as it was without FP8 (sm90's d128_n64 spills
// otherwise).
DEFINE_PREFILL_FP8(64, 2, 128)
DEFINE_PREFILL_FP8(128, 2, 128)
DEFINE_PREFILL_FP8(128, 2, 64)
DEFINE_PREFILL_FP8(256, 1, 64)
DEFINE_PREFILL(64, 2, 128)
DEFINE_PREFILL(128, 2, 128)
DEFINE_PREFILL(128, 2, 64)
DEFINE_PREFILL(256, 1, 64)

// The `_x` twins (attention_extras.cuh), after the kernels above so that those compile as they did.
#define DEFINE_PREFILL_X(HEAD_DIM, STAGES, BLOCK_M, SUFFIX, KV, V_SCALE_PARAM, V_SCALE)                       \
    extern "C" __global__ void __launch_bounds__(BLOCK_M / 16 * 32, 2)                                        \
        attention_prefill_d##HEAD_DIM##_m##BLOCK_M##SUFFIX##_x(                                                \
            const bf16* q, const KV* k_plane, const KV* v_plane, bf16* out, const int* query_start_loc,        \
            const int* seq_lens, const int* block_tables, int block_table_stride, int num_seqs,                \
            int num_q_heads, int num_kv_heads, int block_size, float scale_log2, int sliding_window,           \
            int skip_single_token V_SCALE_PARAM, int q_stride, float softcap_log2, const float* sinks,         \
            int gated) {                                                                                       \
        dependent_launch_entry();                                                                              \
        attention_prefill_impl<HEAD_DIM, STAGES, BLOCK_M, KV, true>(                                           \
            q, k_plane, v_plane, out, query_start_loc, seq_lens, block_tables, block_table_stride, num_seqs,   \
            num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, skip_single_token, V_SCALE,     \
            AttentionExtras{q_stride, softcap_log2, sinks, gated});                                            \
    }

#define PREFILL_NO_V_SCALE
#define PREFILL_V_SCALE_PARAM , float v_scale
DEFINE_PREFILL_X(64, 2, 128, , bf16, PREFILL_NO_V_SCALE, 1.0f)
DEFINE_PREFILL_X(128, 2, 128, , bf16, PREFILL_NO_V_SCALE, 1.0f)
DEFINE_PREFILL_X(128, 2, 64, , bf16, PREFILL_NO_V_SCALE, 1.0f)
DEFINE_PREFILL_X(256, 1, 64, , bf16, PREFILL_NO_V_SCALE, 1.0f)
DEFINE_PREFILL_X(64, 2, 128, _fp8, unsigned char, PREFILL_V_SCALE_PARAM, v_scale)
DEFINE_PREFILL_X(128, 2, 128, _fp8, unsigned char, PREFILL_V_SCALE_PARAM, v_scale)
DEFINE_PREFILL_X(128, 2, 64, _fp8, unsigned char, PREFILL_V_SCALE_PARAM, v_scale)
DEFINE_PREFILL_X(256, 1, 64, _fp8, unsigned char, PREFILL_V_SCALE_PARAM, v_scale)

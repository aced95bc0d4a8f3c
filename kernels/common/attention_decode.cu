// Paged attention for single-token queries (decode), split along the context (FlashDecoding).
//
//   q, out [N, Hq * D] bf16; k_plane, v_plane: this layer's pages [Hkv][block_size][D].
//   Only sequences with query_len == 1 are handled; the prefill kernel takes the rest.
//
// grid = (sequence, KV head x head group, split). A block reads one KV head's slice
// [start, end) of the context once and serves HEADS (1, 2, 4 or 8, the host picks the smallest
// power of two >= min(G, 8)) query heads of its GQA group from it.
// Inside the block, lanes form groups of D / 8 (one 16-byte chunk of a K or V row per lane);
// each group walks its own strided subset of tokens with a private online softmax, four tokens
// at a time so eight 16-byte loads per lane are in flight and one rescale covers four tokens:
//
//     group j of the block handles tokens start + j, start + j + GROUPS, ...
//     score = q . k (reduced over the group's lanes by shuffles), m, l, o updated per token
//
// K and V reach the lanes through a per-thread ring in shared memory: each lane cp.async-copies
// its own 16-byte chunks of the step DECODE_STAGES - 1 ahead and reads back only what it copied
// itself, so cp.async.wait_group orders it without a barrier, the page-table loads and the K/V
// traffic of later steps overlap this step's arithmetic, and no register holds data in flight:
//
//     ring [DECODE_STAGES][DECODE_UNROLL][K | V][thread] 16-byte slots (48 KB at 3 stages)
//     step i: issue step i + STAGES - 1, wait for step i, compute step i
//
// then the groups are merged through shared memory (the same rescaling as the split merge; the
// merge buffers reuse the ring's memory).
// Before its wait for the previous kernel (griddepcontrol.wait) a block reads only what no kernel
// of the step writes, the metadata and the K/V of earlier tokens: it resolves its pages and
// issues its first DECODE_STAGES - 1 steps of copies while that kernel (the one writing q and
// the cache) finishes. q and the step's own K/V row are read after the wait; that token joins
// group 0's softmax after the ring. (Kernels before the previous one have completed: each one
// lets its successor launch only after its own wait.)
// With one split the block writes `out`; otherwise it writes its normalised partial output and
// log2-sum-exp to the workspace, and the last split of its (sequence, head group) to finish
// (counted in split_counters [S, Hkv x head groups], zero between launches) combines them:
//
//     partial_out [S, Hq, splits, D] f32, partial_lse [S, Hq, splits] f32 (log2 domain)
//     out = sum_z exp2(lse_z - M) o_z / sum_z exp2(lse_z - M),  M = max_z lse_z
//
// Bytes: each sequence's context K and V once per KV head (2 * L * Hkv * D * 2) plus q and out:
// pure bandwidth. Splits exist so that small batches still cover every SM.
#include "atlas_common.cuh"

#define DECODE_THREADS 128
#define DECODE_UNROLL 4
#define DECODE_STAGES 3
#define DECODE_MERGE_BATCH 8

template <int HEAD_DIM, int HEADS>
__device__ __forceinline__ void attention_decode_impl(
    const bf16* __restrict__ q, const bf16* __restrict__ k_plane, const bf16* __restrict__ v_plane,
    bf16* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    unsigned* __restrict__ split_counters, const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
    int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, float scale_log2,
    int sliding_window, int num_splits, int min_split_tokens) {
    constexpr int LANES = HEAD_DIM / 8;                 // lanes per token row
    constexpr int GROUPS = DECODE_THREADS / LANES;      // token groups per block
    constexpr int STEP = DECODE_UNROLL * GROUPS;        // tokens per step of the block
    constexpr int RING_SLOTS = DECODE_STAGES * DECODE_UNROLL * 2 * DECODE_THREADS;
    constexpr int MERGE_FLOATS = GROUPS * HEADS * (2 + HEAD_DIM);
    constexpr int SHARED_SLOTS = RING_SLOTS > MERGE_FLOATS / 4 + 1 ? RING_SLOTS : MERGE_FLOATS / 4 + 1;
    __shared__ uint4 shared[SHARED_SLOTS];
    // ring slot of (stage, u, K | V) for this thread: consecutive threads, consecutive 16 bytes
    auto ring_slot = [&](int stage, int u, int plane) -> uint4* {
        return shared + ((stage * DECODE_UNROLL + u) * 2 + plane) * DECODE_THREADS + threadIdx.x;
    };

    // Until the wait below, only what no kernel of this step writes: the step's metadata and the
    // K/V rows of earlier tokens (see the file comment).
    const int seq = blockIdx.x;
    const int token = query_start_loc[seq];
    if (query_start_loc[seq + 1] - token != 1) return;
    const int group_size = num_q_heads / num_kv_heads;
    const int head_groups = (group_size + HEADS - 1) / HEADS;
    const int kv_head = blockIdx.y / head_groups;
    const int first_head = kv_head * group_size + (blockIdx.y % head_groups) * HEADS;
    const int num_heads = min(HEADS, kv_head * group_size + group_size - first_head);

    const int context_len = seq_lens[seq];
    const int position = context_len - 1;
    const int lo = sliding_window > 0 ? max(0, position - sliding_window + 1) : 0;
    // A graph bakes in the split count of its longest context; a shorter one uses fewer splits
    // (each at least min_split_tokens long). The blocks of the others leave at once, uncounted.
    const int used_splits = max(1, min(num_splits, (context_len - lo + min_split_tokens - 1) / min_split_tokens));
    const int split = blockIdx.z;
    if (split >= used_splits) return;
    const int chunk = (context_len - lo + used_splits - 1) / used_splits;
    const int start = lo + split * chunk;
    const int end = min(context_len, start + chunk);
    // The step's own token (the previous kernel just wrote its K/V) is left out of the ring and
    // taken after the wait, by the split that holds it.
    const bool has_newest = end == context_len;
    const int ring_end = has_newest ? context_len - 1 : end;

    const int lane_in_group = threadIdx.x % LANES, group = threadIdx.x / LANES;
    const int dim = lane_in_group * 8;

    float m[HEADS], l[HEADS], o[HEADS][8];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        m[h] = -ATLAS_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[h][i] = 0.0f;
    }

    // Every group runs the same number of steps (shuffles need the whole warp in step); a token
    // past `ring_end` reads the last token of the range instead (always a valid page, and never
    // the step's own token), so every copy is unconditional and the page-table loads of a step
    // issue together, and it is masked below.
    const int* table = block_tables + (long long)seq * block_table_stride;
    const int num_steps = ring_end > start ? (ring_end - start + STEP - 1) / STEP : 0;
    auto issue_step = [&](int step, int stage) {
        const int base = start + step * STEP;
        long long offsets[DECODE_UNROLL];
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const int key = base + group + u * GROUPS;
            const int safe_key = key < ring_end ? key : ring_end - 1;
            const long long block = __ldg(table + safe_key / block_size);
            offsets[u] = ((block * num_kv_heads + kv_head) * block_size + safe_key % block_size) * HEAD_DIM + dim;
        }
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            cp_async_16(ring_slot(stage, u, 0), k_plane + offsets[u], true);
            cp_async_16(ring_slot(stage, u, 1), v_plane + offsets[u], true);
        }
    };
    // One commit group per step, empty ones included, so wait_group counts steps exactly.
#pragma unroll
    for (int step = 0; step < DECODE_STAGES - 1; ++step) {
        if (step < num_steps) issue_step(step, step);
        cp_async_commit();
    }

    // q and the step's own K/V row come from the previous kernel.
    dependent_launch_entry();
    const long long q_row = (long long)token * num_q_heads * HEAD_DIM;
    float qv[HEADS][8];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        if (h < num_heads) {
            load8(q + q_row + (long long)(first_head + h) * HEAD_DIM + dim, qv[h]);
#pragma unroll
            for (int i = 0; i < 8; ++i) qv[h][i] *= scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) qv[h][i] = 0.0f;
        }
    }
    int read_stage = 0, write_stage = DECODE_STAGES - 1;
    for (int step = 0; step < num_steps; ++step) {
        if (step + DECODE_STAGES - 1 < num_steps) issue_step(step + DECODE_STAGES - 1, write_stage);
        cp_async_commit();
        cp_async_wait<DECODE_STAGES - 1>();  // this thread's copies of `step` have landed
        const int base = start + step * STEP;
        bool present[DECODE_UNROLL];
        uint4 k_raw[DECODE_UNROLL], v_raw[DECODE_UNROLL];
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            present[u] = base + group + u * GROUPS < ring_end;
            k_raw[u] = *ring_slot(read_stage, u, 0);
            v_raw[u] = *ring_slot(read_stage, u, 1);
        }
        read_stage = read_stage + 1 == DECODE_STAGES ? 0 : read_stage + 1;
        write_stage = write_stage + 1 == DECODE_STAGES ? 0 : write_stage + 1;
        float k_values[DECODE_UNROLL][8];
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            Vec8<bf16> packed;
            packed.raw = k_raw[u];
            packed.to_floats(k_values[u]);
        }
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            float scores[DECODE_UNROLL];
            float step_max = -ATLAS_INF;
#pragma unroll
            for (int u = 0; u < DECODE_UNROLL; ++u) {
                float score = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) score = fmaf(qv[h][i], k_values[u][i], score);
#pragma unroll
                for (int offset = LANES / 2; offset > 0; offset >>= 1)
                    score += __shfl_xor_sync(0xffffffffu, score, offset);
                scores[u] = present[u] ? score : -ATLAS_INF;
                step_max = fmaxf(step_max, scores[u]);
            }
            // A step with no token of this group (past `end`) changes nothing: with no score yet
            // the reference is 0, so every exp2 below is of -inf.
            const float new_max = fmaxf(m[h], step_max);
            const float reference = new_max == -ATLAS_INF ? 0.0f : new_max;
            const float rescale = exp2f(m[h] - reference);
            l[h] *= rescale;
#pragma unroll
            for (int i = 0; i < 8; ++i) o[h][i] *= rescale;
#pragma unroll
            for (int u = 0; u < DECODE_UNROLL; ++u) {
                const float p = exp2f(scores[u] - reference);
                l[h] += p;
                float v_values[8];
                Vec8<bf16> packed;
                packed.raw = v_raw[u];
                packed.to_floats(v_values);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[h][i] = fmaf(p, v_values[i], o[h][i]);
            }
            m[h] = new_max;
        }
    }

    if (has_newest) {
        // The step's own token, read from L2 after the wait, joins group 0's softmax (every
        // group computes its score: the shuffles need whole warps).
        const int newest = context_len - 1;
        const long long block = table[newest / block_size];
        const long long offset = ((block * num_kv_heads + kv_head) * block_size + newest % block_size) * HEAD_DIM + dim;
        Vec8<bf16> k_packed, v_packed;
        k_packed.raw = __ldcg(reinterpret_cast<const uint4*>(k_plane + offset));
        v_packed.raw = __ldcg(reinterpret_cast<const uint4*>(v_plane + offset));
        float k_values[8], v_values[8];
        k_packed.to_floats(k_values);
        v_packed.to_floats(v_values);
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            float score = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) score = fmaf(qv[h][i], k_values[i], score);
#pragma unroll
            for (int offset_lanes = LANES / 2; offset_lanes > 0; offset_lanes >>= 1)
                score += __shfl_xor_sync(0xffffffffu, score, offset_lanes);
            if (group == 0) {
                const float new_max = fmaxf(m[h], score);
                const float rescale = exp2f(m[h] - new_max);
                const float p = exp2f(score - new_max);
                l[h] = l[h] * rescale + p;
#pragma unroll
                for (int i = 0; i < 8; ++i) o[h][i] = fmaf(p, v_values[i], o[h][i] * rescale);
                m[h] = new_max;
            }
        }
    }

    // Merge the groups of this block, in the ring's memory once every thread is done with it.
    cp_async_wait<0>();
    __syncthreads();
    float* merge_max = reinterpret_cast<float*>(shared);  // [GROUPS][HEADS]
    float* merge_sum = merge_max + GROUPS * HEADS;        // [GROUPS][HEADS]
    float* merge_out = merge_sum + GROUPS * HEADS;        // [GROUPS][HEADS][HEAD_DIM]
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        if (lane_in_group == 0) {
            merge_max[group * HEADS + h] = m[h];
            merge_sum[group * HEADS + h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) merge_out[(group * HEADS + h) * HEAD_DIM + dim + i] = o[h][i];
    }
    __syncthreads();

    for (int item = threadIdx.x; item < num_heads * HEAD_DIM; item += DECODE_THREADS) {
        const int h = item / HEAD_DIM, d = item % HEAD_DIM;
        float best = -ATLAS_INF;
#pragma unroll
        for (int j = 0; j < GROUPS; ++j) best = fmaxf(best, merge_max[j * HEADS + h]);
        float total = 0.0f, value = 0.0f;
        if (best != -ATLAS_INF) {
#pragma unroll
            for (int j = 0; j < GROUPS; ++j) {
                const float weight = exp2f(merge_max[j * HEADS + h] - best);
                total += merge_sum[j * HEADS + h] * weight;
                value += merge_out[(j * HEADS + h) * HEAD_DIM + d] * weight;
            }
        }
        const int head = first_head + h;
        const float normalised = total > 0.0f ? value / total : 0.0f;
        if (num_splits == 1) {
            out[q_row + (long long)head * HEAD_DIM + d] = from_float<bf16>(normalised);
        } else {
            const long long slot = ((long long)seq * num_q_heads + head) * num_splits + split;
            partial_out[slot * HEAD_DIM + d] = normalised;
            if (d == 0) partial_lse[slot] = total > 0.0f ? best + log2f(total) : -ATLAS_INF;
        }
    }
    if (num_splits == 1 || !last_block_done(split_counters + (long long)seq * gridDim.y + blockIdx.y, used_splits))
        return;
    // The last split to finish merges every split of this block's heads (read from L2), in
    // batches of DECODE_MERGE_BATCH splits whose loads all issue before the first is used: the
    // merge sits at the end of the layer's critical path, and a loop of dependent L2 round trips
    // (two per split) cost ~0.8 us per layer for each split past four.
    for (int item = threadIdx.x; item < num_heads * HEAD_DIM; item += DECODE_THREADS) {
        const int head = first_head + item / HEAD_DIM, d = item % HEAD_DIM;
        const long long first_slot = ((long long)seq * num_q_heads + head) * num_splits;
        float best = -ATLAS_INF, total = 0.0f, value = 0.0f;
        for (int z0 = 0; z0 < used_splits; z0 += DECODE_MERGE_BATCH) {
            float lse[DECODE_MERGE_BATCH], part[DECODE_MERGE_BATCH];
#pragma unroll
            for (int i = 0; i < DECODE_MERGE_BATCH; ++i) {
                const bool used = z0 + i < used_splits;
                lse[i] = used ? __ldcg(partial_lse + first_slot + z0 + i) : -ATLAS_INF;
                part[i] = used ? __ldcg(partial_out + (first_slot + z0 + i) * HEAD_DIM + d) : 0.0f;
            }
            float new_best = best;
#pragma unroll
            for (int i = 0; i < DECODE_MERGE_BATCH; ++i) new_best = fmaxf(new_best, lse[i]);
            if (new_best == -ATLAS_INF) continue;  // no split with a token yet
            const float rescale = exp2f(best - new_best);  // 0 while best is -inf
            total *= rescale;
            value *= rescale;
#pragma unroll
            for (int i = 0; i < DECODE_MERGE_BATCH; ++i) {
                const float weight = exp2f(lse[i] - new_best);
                total += weight;
                value += weight * part[i];
            }
            best = new_best;
        }
        out[q_row + (long long)head * HEAD_DIM + d] = from_float<bf16>(total > 0.0f ? value / total : 0.0f);
    }
}

#define DEFINE_DECODE(HEAD_DIM, HEADS)                                                                          \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) attention_decode_d##HEAD_DIM##_h##HEADS(        \
        const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, float* partial_out,                 \
        float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,          \
        const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size,     \
        float scale_log2, int sliding_window, int num_splits, int min_split_tokens) {                           \
        attention_decode_impl<HEAD_DIM, HEADS>(q, k_plane, v_plane, out, partial_out, partial_lse,              \
                                               split_counters, query_start_loc, seq_lens, block_tables,         \
                                               block_table_stride, num_q_heads, num_kv_heads, block_size,       \
                                               scale_log2, sliding_window, num_splits, min_split_tokens);       \
    }

#define DEFINE_DECODE_HEADS(HEAD_DIM) \
    DEFINE_DECODE(HEAD_DIM, 1)        \
    DEFINE_DECODE(HEAD_DIM, 2)        \
    DEFINE_DECODE(HEAD_DIM, 4)        \
    DEFINE_DECODE(HEAD_DIM, 8)

DEFINE_DECODE_HEADS(64)
DEFINE_DECODE_HEADS(128)
DEFINE_DECODE_HEADS(256)

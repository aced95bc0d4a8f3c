// Paged attention for single-token queries (decode), split along the context (FlashDecoding).
//
//   q, out [N, Hq * D] bf16; k_plane, v_plane: this layer's pages [Hkv][block_size][D].
//   Only sequences with query_len == 1 are handled; the prefill kernel takes the rest.
//
// Two kernels share the launch shape, the split merge and the PDL discipline: the tensor-core
// one (attention_decode_mma_*, further down), which the host launches, and the SIMT one
// described here (ATLAS_CUDA_DISABLE=mma_decode; also for block sizes that are not 8 or a
// multiple of 16). Only the tensor-core one reads an FP8 cache (its _fp8 variants).
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
// group 0's softmax after the ring. (The RoPE kernel lets this one launch at its own start, so
// the qkv product may still run too: no kernel of the step writes what is read early.)
// A verify step breaks the exception: it runs a sequence's k + 1 tokens as consecutive
// single-token rows over one block table (atlas.domain.worker.decode_rows), so a row after the
// first also reads the rows before it, which the previous kernel is writing. Such a row waits
// before its first copies (`reads_step_rows`); read early, those rows held the K/V of the last
// step's rejected drafts, and SmolLM2 drafting for itself at batch 1 kept 37% of its drafts.
// With one split the block writes `out`; otherwise it writes its normalised partial output and
// log2-sum-exp to the workspace, and the last split of its (sequence, head group) to finish
// (counted in split_counters [S, Hkv x head groups], zero between launches) combines them:
//
//     partial_out [S, Hq, splits, D] f32, partial_lse [S, Hq, splits] f32 (log2 domain)
//     out = sum_z exp2(lse_z - M) o_z / sum_z exp2(lse_z - M),  M = max_z lse_z
//
// The tensor-core kernels have `_x` twins (defined last) for the layer variants of
// attention_extras.cuh: q rows q_stride apart, soft-capped scores, a sink per head in the final
// denominator (the last split's merge, or the one split's), a sigmoid gate on the output.
//
// Bytes: each sequence's context K and V once per KV head (2 * L * Hkv * D * 2; FP8 * 1) plus q
// and out: pure bandwidth. Splits exist so that small batches still cover every SM.
#include "atlas_common.cuh"
#include "attention_extras.cuh"
#include "tma.cuh"

#define DECODE_THREADS 128
#define DECODE_UNROLL 4
#define DECODE_STAGES 3
#define DECODE_MERGE_BATCH 8

// The query heads a decode block serves (blockIdx.y = KV head x head group): `count` (<= HEADS)
// heads of KV head `kv_head`'s GQA group, from `first` on.
// Whether row `seq` continues the row before it: the same block table and the next position,
// as the rows of a verify step (or a chunk and the decode rows after it) do. Its context then
// holds tokens this step writes besides its own (see the file comment). A row of another
// sequence that shares the first page and ends one token later only waits early for nothing.
__device__ __forceinline__ bool reads_step_rows(const int* seq_lens, const int* block_tables, int block_table_stride,
                                                int seq) {
    return seq > 0 && seq_lens[seq - 1] == seq_lens[seq] - 1 &&
           __ldg(block_tables + (long long)(seq - 1) * block_table_stride) ==
               __ldg(block_tables + (long long)seq * block_table_stride);
}

struct DecodeHeads {
    int kv_head, first, count;
};

template <int HEADS>
__device__ __forceinline__ DecodeHeads decode_heads(int num_q_heads, int num_kv_heads) {
    const int group_size = num_q_heads / num_kv_heads;
    const int head_groups = (group_size + HEADS - 1) / HEADS;
    const int kv_head = blockIdx.y / head_groups;
    const int first = kv_head * group_size + (blockIdx.y % head_groups) * HEADS;
    return {kv_head, first, min(HEADS, kv_head * group_size + group_size - first)};
}

// ---------------------------------------------------------------------------------------------
// Cascade attention: decode rows whose contexts open with the same pages (a shared system
// prompt, a few-shot preamble, the prompt of n > 1 forks) read those pages once for all of them
// instead of once per row. The step's metadata names the shared prefix (`shared_prefix`, i32,
// written by the host with the step's other inputs, so a captured graph replays new ones):
//
//     shared_prefix [2 + S] = { prefix_len, anchor, row 0 shares?, row 1 shares?, ... }
//
// prefix_len tokens (whole pages, short of every sharing row's newest token) of the anchor row's
// block table are the first prefix_len of every sharing row's table. Two kernels then split
// each sharing row's softmax at prefix_len (FlashInfer's cascade, vLLM's cascade attention):
//
//     attention_cascade_d*   the prefix for every sharing row at once: a FlashAttention-2 tile of
//                            64 query rows (row R = s G + h, G the GQA group) against the
//                            prefix's keys, in `parts` pieces along the keys; each piece writes
//                            its normalised output and log2-sum-exp:
//                                cascade_out [S, Hq, parts, D] f32, cascade_lse [S, Hq, parts]
//     attention_decode_mma_*_cascade   the decode kernel over keys [prefix_len, context) of a
//                            sharing row; where it writes the row's output it first folds in
//                            the prefix pieces (the split merge's rule), so `out` is the softmax
//                            over the whole context.
//
// A prefix of P keys read by B rows then costs P (B G / 64 tiles) key reads a KV head instead of
// P B. Rows that do not share (another prompt, a graph's padding rows) are skipped by the first
// kernel and decoded whole by the second. The pieces: parts (grid z, the host's, so that a tile's
// KV heads and pieces about fill the GPU) pieces of at least CASCADE_MIN_PART_KEYS keys, whole
// 64-key tiles; both kernels derive the pieces in use from prefix_len the same way.
#define CASCADE_ROWS 64  // query rows (sequence x head of the group) a block of the prefix kernel serves
#define CASCADE_MIN_PART_KEYS 256

struct CascadeParts {
    int used, keys;  // pieces in use, keys a piece (a multiple of 64)
};

__device__ __forceinline__ CascadeParts cascade_parts(int prefix_len, int parts) {
    if (prefix_len <= 0) return {0, 64};
    const int wanted = max(1, min(parts, prefix_len / CASCADE_MIN_PART_KEYS));
    const int keys = ((prefix_len + wanted - 1) / wanted + 63) / 64 * 64;
    return {(prefix_len + keys - 1) / keys, keys};
}

// What the `_cascade` decode kernels read of the prefix kernel's work.
struct CascadeInput {
    const int* shared_prefix;  // [2 + S], see above
    const float* out;          // [S, Hq, parts, D]
    const float* lse;          // [S, Hq, parts]
    int parts;
};

// Fold row `seq`'s prefix pieces into a softmax state over the rest of its context: `best`
// (log2 max), `total` and `value` (sum of exp2(score - best) and of its products with V at dim d).
// `scale` multiplies the pieces' outputs (sums of stored V values): 1 where `value` is of stored
// values too, an FP8 cache's v_scale where it is of values already scaled (the split merge's).
__device__ __forceinline__ void absorb_cascade(const CascadeInput& cascade, int seq, int head, int num_q_heads, int d,
                                               int head_dim, float scale, float& best, float& total, float& value) {
    const CascadeParts pieces = cascade_parts(cascade.shared_prefix[0], cascade.parts);
    const long long first = ((long long)seq * num_q_heads + head) * cascade.parts;
    for (int i = 0; i < pieces.used; ++i) {
        const float lse = __ldcg(cascade.lse + first + i);
        if (lse == -ATLAS_INF) continue;
        const float part = __ldcg(cascade.out + (first + i) * head_dim + d) * scale;
        const float new_best = fmaxf(best, lse);
        const float rescale = exp2f(best - new_best);  // 0 while best is -inf
        const float weight = exp2f(lse - new_best);
        total = total * rescale + weight;
        value = value * rescale + weight * part;
        best = new_best;
    }
}

// Where a decode block's result goes, and what it needs to get there.
struct DecodeOutput {
    bf16* out;
    float* partial_out;
    float* partial_lse;
    unsigned* split_counters;
    long long q_row;  // token * Hq * D: the token's row of `out`
    int seq, num_q_heads, first_head, num_heads, split, num_splits, used_splits;
    float v_scale;  // what the block's sums of stored V values are multiplied by (FP8 caches)
    const bf16* gate;     // EXTRAS: the token's gate heads (gated layers), or null
    const float* sinks;   // EXTRAS: [Hq] sink logits, or null
    CascadeInput cascade = {nullptr, nullptr, nullptr, 0};  // CASCADE: the prefix kernel's pieces
    bool clustered = false;  // the splits are one cluster that merges through shared memory (merge_cluster)
};

// Where value (row, d) of the merge buffer [PARTS x HEADS rows][HEAD_DIM] lies. The tensor-core
// kernels' warps store their O^T fragments there with XOR swizzles that put a store's 32 lanes
// in 32 banks (a row per head: without them the lanes of one dim but four heads, bf16, or of
// dims 32 apart, FP8, share a bank; at batch 1 the FP8 kernel's 16-way conflicts cost ~1.6 us a
// layer). MERGE_PLAIN: none (the SIMT kernel); MERGE_BF16: bits 3-4 of d take the lane's t (row
// bits 1-2: heads 2t, 2t + 1); MERGE_FP8: bits 0-1 of d take t and bits 2-3 d's bits 5-6.
enum MergeLayout { MERGE_PLAIN, MERGE_BF16, MERGE_FP8 };

template <int HEAD_DIM, MergeLayout LAYOUT>
__device__ __forceinline__ int merge_index(int row, int d) {
    const int t = (row >> 1) & 3;
    if constexpr (LAYOUT == MERGE_BF16) d ^= t << 3;
    if constexpr (LAYOUT == MERGE_FP8) d ^= (((d >> 5) & 3) << 2) | t;
    return row * HEAD_DIM + d;
}

// The last split's merge of every split, for blocks with many (head, dim) items a thread
// (merge_staged): the log2-sum-exps of the block's heads are staged in shared memory (`staged`,
// the merge buffers, free by then) in one pass and turned into each split's normalised weight
// per head, a warp a head; then each thread requests MERGE_LOADS partial outputs at once,
// MERGE_ITEMS of its items times MERGE_LOADS / MERGE_ITEMS splits, with clamped addresses and no
// branches, so that they all are in flight together. Item by item (finish_decode's loop), a
// thread's items are a chain of dependent L2 round trips: Qwen3-Next's 8 heads x 256 dims on 128
// threads, 16 items a thread. Decode attention alone at batch 1 (bench_kernels' rows), NVIDIA
// H200, us, item by item -> staged:
//
//     heads (q / kv x dim)          512 tokens     4096 tokens
//     16 / 2 x 256 (Qwen3-Next)     15.3 -> 11.4   55.5 -> 24.9
//     32 / 4 x 128 (Qwen3-30B-A3B)   7.4 -> 7.1    12.7 -> 9.6
//     32 / 8 x 128 (Llama-3.1-8B)    5.4 -> 6.1     8.6 -> 9.0   (so it keeps the item loop)
//
// The same staged merge with branches around its loads (item < items, z < splits) and both loops
// unrolled took 28.2 and 159.4 us for Qwen3-Next's heads.
#define MERGE_LOADS 32
#define MERGE_ITEMS 4

template <int HEAD_DIM, int HEADS, int THREADS, bool EXTRAS>
__device__ __forceinline__ void merge_staged(float* staged, const DecodeOutput& to) {
    constexpr int ITEMS_A_THREAD = (HEADS * HEAD_DIM + THREADS - 1) / THREADS;
    constexpr int ITEMS = ITEMS_A_THREAD < MERGE_ITEMS ? ITEMS_A_THREAD : MERGE_ITEMS;
    constexpr int SPLITS = MERGE_LOADS / ITEMS;
    const int splits = to.used_splits, heads = to.num_heads, items = heads * HEAD_DIM;
    const long long first_slot = ((long long)to.seq * to.num_q_heads + to.first_head) * to.num_splits;
    // staged [heads][splits]: log2-sum-exp, then exp2(lse - best) / (sum + sink)
    for (int i = threadIdx.x; i < heads * splits; i += THREADS)
        staged[i] = __ldcg(to.partial_lse + first_slot + (long long)(i / splits) * to.num_splits + i % splits);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int h = threadIdx.x >> 5; h < heads; h += THREADS / 32) {
        float* weight = staged + h * splits;
        float best = -ATLAS_INF;
        for (int z = lane; z < splits; z += 32) best = fmaxf(best, weight[z]);
        best = warp_max(best);
        float total = 0.0f;
        for (int z = lane; z < splits; z += 32) {
            weight[z] = best == -ATLAS_INF ? 0.0f : exp2f(weight[z] - best);  // a split without a token: 0
            total += weight[z];
        }
        total = warp_sum(total);
        float denominator = total;
        if constexpr (EXTRAS) denominator += sink_term(to.sinks, to.first_head + h, best);
        const float inverse = total > 0.0f ? 1.0f / denominator : 0.0f;
        for (int z = lane; z < splits; z += 32) weight[z] *= inverse;
    }
    __syncthreads();
#pragma unroll 1
    for (int base = threadIdx.x; base < items; base += THREADS * ITEMS) {
        float value[ITEMS];
        bf16 gate[ITEMS];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int item = base + i * THREADS;
            value[i] = 0.0f;
            // gate [Hq][D] of the token: item h D + d is head first_head + h's dim d
            if (EXTRAS && to.gate != nullptr)
                gate[i] = to.gate[(long long)to.first_head * HEAD_DIM + min(item, items - 1)];
        }
#pragma unroll 1
        for (int z0 = 0; z0 < splits; z0 += SPLITS) {
            float part[SPLITS][ITEMS];
#pragma unroll
            for (int u = 0; u < SPLITS; ++u)
#pragma unroll
                for (int i = 0; i < ITEMS; ++i) {
                    const int item = min(base + i * THREADS, items - 1), z = min(z0 + u, splits - 1);
                    const long long slot = first_slot + (long long)(item / HEAD_DIM) * to.num_splits + z;
                    part[u][i] = __ldcg(to.partial_out + slot * HEAD_DIM + item % HEAD_DIM);
                }
#pragma unroll
            for (int u = 0; u < SPLITS; ++u)
#pragma unroll
                for (int i = 0; i < ITEMS; ++i) {
                    const int item = min(base + i * THREADS, items - 1), z = z0 + u;
                    const float weight = z < splits ? staged[(item / HEAD_DIM) * splits + z] : 0.0f;
                    value[i] = fmaf(weight, part[u][i], value[i]);
                }
        }
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int item = base + i * THREADS;
            if (item >= items) continue;
            float merged = value[i];
            if (EXTRAS && to.gate != nullptr) merged *= sigmoid_of(gate[i]);
            to.out[to.q_row + (long long)to.first_head * HEAD_DIM + item] = from_float<bf16>(merged);
        }
    }
}

// The split merge of a cluster (sm_90+; the host's `cluster_merge`, 2..8 splits): the splits of
// a (sequence, head group) are one cluster along blockIdx.z, so block rank z is split z. Each
// block leaves its normalised output and log2-sum-exp per head in its own shared memory
// (`mine`: [HEADS] log2-sum-exps, then [HEADS][HEAD_DIM] outputs) instead of global memory;
// after a cluster barrier block r merges items [r items / S, (r + 1) items / S) of the S blocks'
// results, read through distributed shared memory, and a second barrier keeps every block's
// memory alive until the others have read it. Against the last-block merge this takes a fence,
// the counter's atomic, the reset and two dependent L2 round trips (the log2-sum-exps, then the
// partials) off the step's chain, and every split's block takes part in the merge. A split the
// context leaves unused takes part with no token (log2-sum-exp -inf, weight 0).
#define CLUSTER_MAX_SPLITS 8
template <int HEAD_DIM, int HEADS, int THREADS, bool EXTRAS>
__device__ __forceinline__ void merge_cluster(const float* mine, const DecodeOutput& to) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_sync();  // release / acquire: every block's `mine` is written and visible
    const int blocks = (int)cluster_blocks(), rank = (int)cluster_rank();
    const int items = to.num_heads * HEAD_DIM;
    const int share = (items + blocks - 1) / blocks;
    const int end = min(items, (rank + 1) * share);
    u32 remote[CLUSTER_MAX_SPLITS];
#pragma unroll
    for (int z = 0; z < CLUSTER_MAX_SPLITS; ++z) remote[z] = cluster_address(mine, min(z, blocks - 1));
    for (int item = rank * share + threadIdx.x; item < end; item += THREADS) {
        const int h = item / HEAD_DIM;
        float lse[CLUSTER_MAX_SPLITS], part[CLUSTER_MAX_SPLITS];
#pragma unroll
        for (int z = 0; z < CLUSTER_MAX_SPLITS; ++z) {  // every load issued before the first is used
            lse[z] = load_cluster_float(remote[z] + 4 * h);
            part[z] = load_cluster_float(remote[z] + 4 * (HEADS + item));
        }
        float best = -ATLAS_INF;
#pragma unroll
        for (int z = 0; z < CLUSTER_MAX_SPLITS; ++z) best = z < blocks ? fmaxf(best, lse[z]) : best;
        float weight[CLUSTER_MAX_SPLITS], total = 0.0f;
#pragma unroll
        for (int z = 0; z < CLUSTER_MAX_SPLITS; ++z) {
            weight[z] = z < blocks && best != -ATLAS_INF ? exp2f(lse[z] - best) : 0.0f;  // no token: 0
            total += weight[z];
        }
        float denominator = total;
        if constexpr (EXTRAS) denominator += sink_term(to.sinks, to.first_head + h, best);
        const float inverse = total > 0.0f ? 1.0f / denominator : 0.0f;
        float value = 0.0f;
#pragma unroll
        for (int z = 0; z < CLUSTER_MAX_SPLITS; ++z) value = fmaf(weight[z] * inverse, part[z], value);
        if (EXTRAS && to.gate != nullptr) value *= sigmoid_of(to.gate[(long long)to.first_head * HEAD_DIM + item]);
        to.out[to.q_row + (long long)to.first_head * HEAD_DIM + item] = from_float<bf16>(value);
    }
    cluster_sync();  // no block leaves while another still reads its memory
#endif
}

// The end of a decode block: combine its PARTS partial softmaxes (shared memory, [PARTS][HEADS]
// maxima and sums in the log2 domain, [PARTS][HEADS][HEAD_DIM] outputs at merge_index), then
// write `out` (one split) or the block's normalised partial and log2-sum-exp, and let the last split of the (sequence, head group) to finish merge every split
// (see the file comment), in the merge buffers' memory. THREADS: the block's.
// EXTRAS: a head's sink joins the final denominator, and a gated layer's output is multiplied
// by sigmoid of its gate (attention_extras.cuh).
// CASCADE: a row that shares the step's prefix folds in its pieces where it writes `out`.
template <int HEAD_DIM, int HEADS, int PARTS, int THREADS, MergeLayout LAYOUT = MERGE_PLAIN, bool EXTRAS = false,
          bool CASCADE = false>
__device__ __forceinline__ void finish_decode(float* merge_max, const float* merge_sum, const float* merge_out,
                                              const DecodeOutput& to) {
    const bool cascaded = CASCADE && to.cascade.shared_prefix[0] > 0 && to.cascade.shared_prefix[2 + to.seq] != 0;
    const bool whole = to.num_splits == 1;
    // merge_cluster's [HEADS] log2-sum-exps and [HEADS][HEAD_DIM] outputs, past the merge buffers
    float* mine = merge_max + PARTS * HEADS * (2 + HEAD_DIM);
    for (int item = threadIdx.x; item < to.num_heads * HEAD_DIM; item += THREADS) {
        const int h = item / HEAD_DIM, d = item % HEAD_DIM;
        float best = -ATLAS_INF;
#pragma unroll
        for (int j = 0; j < PARTS; ++j) best = fmaxf(best, merge_max[j * HEADS + h]);
        float total = 0.0f, value = 0.0f;
        if (best != -ATLAS_INF) {
#pragma unroll
            for (int j = 0; j < PARTS; ++j) {
                const float weight = exp2f(merge_max[j * HEADS + h] - best);
                total += merge_sum[j * HEADS + h] * weight;
                value += merge_out[merge_index<HEAD_DIM, LAYOUT>(j * HEADS + h, d)] * weight;
            }
        }
        const int head = to.first_head + h;
        if (cascaded && whole)
            absorb_cascade(to.cascade, to.seq, head, to.num_q_heads, d, HEAD_DIM, 1.0f, best, total, value);
        float normalised = total > 0.0f ? value / total * to.v_scale : 0.0f;
        if (whole) {
            if constexpr (EXTRAS) {
                normalised = total > 0.0f ? value / (total + sink_term(to.sinks, head, best)) * to.v_scale : 0.0f;
                if (to.gate != nullptr) normalised *= sigmoid_of(to.gate[(long long)head * HEAD_DIM + d]);
            }
            to.out[to.q_row + (long long)head * HEAD_DIM + d] = from_float<bf16>(normalised);
        } else if (to.clustered) {
            mine[HEADS + item] = normalised;
            if (d == 0) mine[h] = total > 0.0f ? best + log2f(total) : -ATLAS_INF;
        } else {
            const long long slot = ((long long)to.seq * to.num_q_heads + head) * to.num_splits + to.split;
            to.partial_out[slot * HEAD_DIM + d] = normalised;
            if (d == 0) to.partial_lse[slot] = total > 0.0f ? best + log2f(total) : -ATLAS_INF;
        }
    }
    if (to.clustered && !whole) {
        merge_cluster<HEAD_DIM, HEADS, THREADS, EXTRAS>(mine, to);
        return;
    }
    if (whole || !last_block_done(to.split_counters + (long long)to.seq * gridDim.y + blockIdx.y, to.used_splits))
        return;
    // The merge buffers are free: last_block_done's barrier follows every read of them.
    constexpr int STAGED_FLOATS = PARTS * HEADS * (2 + HEAD_DIM);
    if (!cascaded && to.num_heads * HEAD_DIM > 2 * THREADS && HEADS * to.used_splits <= STAGED_FLOATS) {
        merge_staged<HEAD_DIM, HEADS, THREADS, EXTRAS>(merge_max, to);
        return;
    }
    // Item by item, DECODE_MERGE_BATCH splits' loads issued before the first is used: a thread
    // with at most two items, a cascaded row (its prefix pieces join the merge), or more splits
    // than the buffers hold.
    for (int item = threadIdx.x; item < to.num_heads * HEAD_DIM; item += THREADS) {
        const int head = to.first_head + item / HEAD_DIM, d = item % HEAD_DIM;
        const long long first_slot = ((long long)to.seq * to.num_q_heads + head) * to.num_splits;
        float best = -ATLAS_INF, total = 0.0f, value = 0.0f;
        for (int z0 = 0; z0 < to.used_splits; z0 += DECODE_MERGE_BATCH) {
            float lse[DECODE_MERGE_BATCH], part[DECODE_MERGE_BATCH];
#pragma unroll
            for (int i = 0; i < DECODE_MERGE_BATCH; ++i) {
                const bool used = z0 + i < to.used_splits;
                lse[i] = used ? __ldcg(to.partial_lse + first_slot + z0 + i) : -ATLAS_INF;
                part[i] = used ? __ldcg(to.partial_out + (first_slot + z0 + i) * HEAD_DIM + d) : 0.0f;
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
        if (cascaded) absorb_cascade(to.cascade, to.seq, head, to.num_q_heads, d, HEAD_DIM, to.v_scale, best, total, value);
        float merged = total > 0.0f ? value / total : 0.0f;
        if constexpr (EXTRAS) {
            merged = total > 0.0f ? value / (total + sink_term(to.sinks, head, best)) : 0.0f;
            if (to.gate != nullptr) merged *= sigmoid_of(to.gate[(long long)head * HEAD_DIM + d]);
        }
        to.out[to.q_row + (long long)head * HEAD_DIM + d] = from_float<bf16>(merged);
    }
}

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
    const DecodeHeads block_heads = decode_heads<HEADS>(num_q_heads, num_kv_heads);
    const int kv_head = block_heads.kv_head, first_head = block_heads.first, num_heads = block_heads.count;

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
    if (reads_step_rows(seq_lens, block_tables, block_table_stride, seq)) grid_dependency_wait();
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
    DecodeOutput out_to{out, partial_out, partial_lse, split_counters, q_row, seq, num_q_heads, first_head,
                        num_heads, split, num_splits, used_splits, 1.0f, nullptr, nullptr};
    finish_decode<HEAD_DIM, HEADS, GROUPS, DECODE_THREADS>(merge_max, merge_sum, merge_out, out_to);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core variant: the same work with the products on mma.sync m16n8k16, oriented so that
// the context tokens are the 16 rows and a GQA group's (up to 8) query heads the 8 columns:
//
//     S^T [16 tokens, 8 heads] = K_tile [16, D] . Q^T [D, 8]          (A = K rows, ldmatrix)
//     O^T [D, 8 heads]        += V_tile^T [D, 16] . P^T [16, 8]       (A = V^T, ldmatrix.trans)
//
// Q^T stays in registers as B fragments for the whole kernel. P^T must be a B fragment (tokens
// along k) but S^T's accumulator holds tokens along rows; movmatrix.trans turns each 8x8 half of
// the bf16 P into the B layout without shared memory. Per 16-token tile a warp issues 2 D / 16
// ldmatrix.x4 and 3 D / 16 mma (P V twice: P as a bf16 pair, see below), ~10x fewer instructions
// than the SIMT kernel's per-token FMAs and shuffles, so the kernel is bound by the K/V bytes
// instead of by issue.
//
// Tiles are aligned to 16 tokens of the sequence, so a tile's rows sit in one page (two at
// block size 8) and its K (and V) rows are one contiguous 16 D-element run per page. Each of the
// block's WARPS warps takes every WARPS-th tile of the split and keeps its own ring of STAGES
// tiles in shared memory (no block barrier in the loop); the 16-byte chunks of a row are
// XOR-swizzled by row so ldmatrix reads are free of bank conflicts:
//
//     ring [warp][stage][K | V][16 rows][D / 8 chunks], chunk c of row r at c ^ (r % 8)
//
// Tokens outside [lo, context_len) and the step's own token are zero-filled by the copy (so no
// copy reads past the context or what the previous kernel is writing, and the copies of the
// first stages issue before griddepcontrol.wait); the own token's row is read from L2 after the
// wait by the warp whose tile holds it, just before that tile is used. Masked scores are -inf.
//
// FP8 variant (_fp8: the cache holds E4M3 bytes; the host folds k_scale into scale_log2 and the
// kernel multiplies its output by v_scale). Tiles are 16 rows of D bytes, and the products run
// in f16 (every E4M3 value is exact in f16), with fragments built from 16-byte shared loads and
// cvt.rn.f16x2.e4m3x2 instead of ldmatrix, since no ldmatrix transposes bytes:
//
//     S^T: lane (g, t) reads chunk 4 c + t of key rows g and g + 8; word i of it is k-step 4 c + i,
//          its low byte pair k (2t, 2t + 1) and high pair (2t + 8, 2t + 9); Q^T's fragments are
//          loaded over the same permutation of dims (a dot product does not mind the order).
//     O^T: lane (g, t) owns dims g D / 8 .. (g + 1) D / 8 - 1 and reads them from key rows 2t,
//          2t + 1, 2t + 8, 2t + 9 (its k of P^T); a byte permute pairs one dim of two keys, and
//          m-tile i's rows g and g + 8 are its dims 2i and 2i + 1 (the merge puts them in place).
//
// The kernel is then bound by each tile's latency more than by its bytes, so its head-dim-128
// shapes favour blocks per SM (ops_attention.DECODE_MMA_SHAPES_FP8).
#define DECODE_MMA_HEADS 8  // the n = 8 columns of the mma: query heads per block

template <int HEAD_DIM, int STAGES, int KV_BYTES>
struct DecodeMmaShape {
    static constexpr int CHUNKS = HEAD_DIM * KV_BYTES / 16;        // 16-byte chunks per K or V row
    static constexpr int CHUNK_ELEMS = 16 / KV_BYTES;              // elements per chunk
    static constexpr int PLANE_CHUNKS = 16 * CHUNKS;               // one tile of K (or V)
    static constexpr int WARP_CHUNKS = STAGES * 2 * PLANE_CHUNKS;  // a warp's ring
};

__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

template <int HEAD_DIM>
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) {
    return row * (HEAD_DIM / 8) + (chunk ^ (row & 7));
}

// The FP8 tile's rows are D bytes; its chunks are swizzled so that both of its reads are free of
// bank conflicts (head dim 128; 64 has 2-way ones in the V read): K's (lane (g, t) reads chunk
// 4 c + t of rows g and g + 8: rows 2p and 2p + 1 must differ in swizzle bit 2) and V's (lane
// (g, t) reads chunk g of rows 2t, 2t + 1, 2t + 8, 2t + 9: the even rows, and the odd ones, must
// differ in bits 1-2). (r & 6) ^ ((r & 1) << 2) gives rows 0-7 the swizzles 0 4 2 6 4 0 6 2.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzled_chunk_fp8(int row, int chunk) {
    constexpr int CHUNKS = HEAD_DIM / 16;
    return row * CHUNKS + (chunk ^ (((row & 6) ^ ((row & 1) << 2)) & (CHUNKS - 1)));
}

template <int HEAD_DIM, int KV_BYTES>
__device__ __forceinline__ int kv_chunk(int row, int chunk) {
    if constexpr (KV_BYTES == 1) return swizzled_chunk_fp8<HEAD_DIM>(row, chunk);
    else return swizzled_chunk<HEAD_DIM>(row, chunk);
}

template <int HEAD_DIM, int WARPS, int STAGES, typename KV, bool EXTRAS = false, bool CASCADE = false>
__device__ __forceinline__ void attention_decode_mma_impl(
    const bf16* __restrict__ q, const KV* __restrict__ k_plane, const KV* __restrict__ v_plane,
    bf16* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    unsigned* __restrict__ split_counters, const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size,
    float scale_log2, int sliding_window, int num_splits, int min_split_tokens, float v_scale,
    AttentionExtras extras = AttentionExtras{0, 0.0f, nullptr, 0}, CascadeInput cascade = {nullptr, nullptr, nullptr, 0}) {
    constexpr int KV_BYTES = sizeof(KV);
    constexpr bool FP8 = KV_BYTES == 1;
    constexpr MergeLayout LAYOUT = FP8 ? MERGE_FP8 : MERGE_BF16;
    typedef DecodeMmaShape<HEAD_DIM, STAGES, KV_BYTES> Shape;
    constexpr int CHUNKS = Shape::CHUNKS, K_STEPS = HEAD_DIM / 16;
    extern __shared__ uint4 decode_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    uint4* ring = decode_shared + warp * Shape::WARP_CHUNKS;  // [stage][K | V][PLANE_CHUNKS]

    // Until the wait below, only what no kernel of this step writes (see the file comment).
    const int seq = blockIdx.x;
    const int token = query_start_loc[seq];
    if (query_start_loc[seq + 1] - token != 1) return;
    const DecodeHeads block_heads = decode_heads<DECODE_MMA_HEADS>(num_q_heads, num_kv_heads);
    const int kv_head = block_heads.kv_head, first_head = block_heads.first, num_heads = block_heads.count;

    const int context_len = seq_lens[seq];
    const int newest = context_len - 1;
    int lo = sliding_window > 0 ? max(0, newest - sliding_window + 1) : 0;
    // A row sharing the step's prefix reads only what follows it (the prefix kernel did the rest).
    if constexpr (CASCADE) {
        if (cascade.shared_prefix[0] > 0 && cascade.shared_prefix[2 + seq])
            lo = min(max(lo, cascade.shared_prefix[0]), newest);
    }
    // Splits are whole tiles; a graph bakes in the split count of its longest context and a
    // shorter one uses fewer (each at least min_split_tokens long); the blocks of the others
    // leave at once, uncounted.
    const int first_tile = lo / 16, num_tiles = (context_len + 15) / 16 - first_tile;
    int used_splits = max(1, min(num_splits, (context_len - lo + min_split_tokens - 1) / min_split_tokens));
    const int split_tiles = (num_tiles + used_splits - 1) / used_splits;
    used_splits = (num_tiles + split_tiles - 1) / split_tiles;
    const int split = blockIdx.z;
    // In a cluster (merge_cluster) every split's block takes part in the merge: an unused one
    // stays, with no tiles.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool clustered = !CASCADE && num_splits > 1 && cluster_blocks() > 1;
#else
    constexpr bool clustered = false;
#endif
    if (split >= used_splits && !clustered) return;
    const int tile_begin = first_tile + split * split_tiles;
    const int tile_end = min(first_tile + num_tiles, tile_begin + split_tiles);
    // This warp's tiles are tile_begin + warp, + WARPS, ..., taken newest first: when the tiles
    // do not divide among the warps, the warp with one more holds the ragged last tile (the step's
    // own token, the fewest keys), and taken first it costs a round under the loads still in
    // flight instead of a round of its own after the other warps are done (the Llama-3.1-8B step
    // at batch 64 on an H200, 513-529-token contexts: 16-25 us less than oldest first).
    const int my_tiles = tile_begin + warp < tile_end ? (tile_end - tile_begin - warp - 1) / WARPS + 1 : 0;
    auto tile_of = [&](int j) { return tile_begin + warp + (my_tiles - 1 - j) * WARPS; };

    const int* table = block_tables + (long long)seq * block_table_stride;
    const long long head_offset = (long long)kv_head * block_size * HEAD_DIM;
    const long long page_stride = (long long)num_kv_heads * block_size * HEAD_DIM;
    // Rows of a tile in global memory: rows 0-7 and 8-15 each lie in one page (the same one
    // unless the block size is 8). A lane copies chunk `lane % CHUNKS` of every ROWS_PER_PASS-th row.
    constexpr int ROWS_PER_PASS = 32 / CHUNKS < 1 ? 1 : 32 / CHUNKS;
    const int lane_row = lane / CHUNKS, lane_chunk = lane % CHUNKS;
    // K and V are read once per step: evict_first lets them go before the lines other kernels
    // still read (batch 64, Llama-3.1-8B on an H200: 5822 -> 5780 us per step).
    const u64 kv_policy = l2_evict_first();
    auto issue_tile = [&](int j) {
        const int t0 = tile_of(j) * 16;
        const long long page_lo = __ldg(table + t0 / block_size);
        const long long base_lo =
            page_lo * page_stride + head_offset + (t0 % block_size) * HEAD_DIM + lane_chunk * Shape::CHUNK_ELEMS;
        long long base_hi = base_lo + 8 * HEAD_DIM;
        if (block_size < 16 && t0 + 8 < context_len)
            base_hi = __ldg(table + (t0 + 8) / block_size) * page_stride + head_offset + lane_chunk * Shape::CHUNK_ELEMS;
        uint4* slot = ring + (j % STAGES) * 2 * Shape::PLANE_CHUNKS;
#pragma unroll
        for (int pass = 0; pass < 16 / ROWS_PER_PASS; ++pass) {
            const int row = lane_row + pass * ROWS_PER_PASS, key = t0 + row;
            const bool valid = key >= lo && key < newest;
            const long long offset = row < 8 ? base_lo + row * HEAD_DIM : base_hi + (row - 8) * HEAD_DIM;
            const int at = kv_chunk<HEAD_DIM, KV_BYTES>(row, lane_chunk);
            cp_async_16_hint(slot + at, k_plane + (valid ? offset : 0), valid, kv_policy);
            cp_async_16_hint(slot + Shape::PLANE_CHUNKS + at, v_plane + (valid ? offset : 0), valid, kv_policy);
        }
    };
    if (reads_step_rows(seq_lens, block_tables, block_table_stride, seq)) grid_dependency_wait();
    // One commit group per tile, empty ones included, so wait_group counts tiles exactly.
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < my_tiles) issue_tile(j);
        cp_async_commit();
    }

    // q and the step's own K/V row come from the previous kernel.
    dependent_launch_entry();
    const long long q_row = (long long)token * (EXTRAS ? extras.q_stride : num_q_heads * HEAD_DIM);
    const long long out_row = (long long)token * num_q_heads * HEAD_DIM;
    // Q^T as B fragments: b0 (dims 16 s + 2t, + 1; head g), b1 (dims 16 s + 2t + 8, + 9; head g).
    // FP8: f16 fragments over dims permuted as the K fragments are (see above): k-step
    // s = 4 c + i takes dims 64 c + 16 t + 4 i + (0, 1) as k 2t, 2t + 1 and + (2, 3) as k 2t + 8,
    // 2t + 9.
    u32 q_frag[K_STEPS][2];
    {
        const bool has_head = g < num_heads;
        const bf16* q_head = q + q_row + (long long)(first_head + (has_head ? g : 0)) * HEAD_DIM;
        if constexpr (FP8) {
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 64; ++c) {
                float values[16];
                if (has_head) {
                    load8(q_head + 64 * c + 16 * t, values);
                    load8(q_head + 64 * c + 16 * t + 8, values + 8);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    q_frag[4 * c + i][0] = has_head ? pack_f16x2(values[4 * i], values[4 * i + 1]) : 0u;
                    q_frag[4 * c + i][1] = has_head ? pack_f16x2(values[4 * i + 2], values[4 * i + 3]) : 0u;
                }
            }
        } else {
#pragma unroll
            for (int s = 0; s < K_STEPS; ++s) {
                q_frag[s][0] = has_head ? *reinterpret_cast<const u32*>(q_head + 16 * s + 2 * t) : 0u;
                q_frag[s][1] = has_head ? *reinterpret_cast<const u32*>(q_head + 16 * s + 2 * t + 8) : 0u;
            }
        }
    }
    // This thread's softmax state is for heads 2t and 2t + 1 (the accumulator columns); m is the
    // same in every lane of a column, l sums only this lane's rows until the end.
    float m[2] = {-ATLAS_INF, -ATLAS_INF}, l[2] = {0.0f, 0.0f};
    float o[K_STEPS][4];  // O^T: (dim 16 i + g, heads 2t, 2t + 1), (dim 16 i + g + 8, same heads)
#pragma unroll
    for (int i = 0; i < K_STEPS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int j = 0; j < my_tiles; ++j) {
        __syncwarp();  // every lane is done reading the stage the next copies overwrite
        if (j + STAGES - 1 < my_tiles) issue_tile(j + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();  // this lane's copies of tile j have landed
        uint4* slot = ring + (j % STAGES) * 2 * Shape::PLANE_CHUNKS;
        const int t0 = tile_of(j) * 16;
        if (t0 + 16 > newest) {
            // The step's own token is in this tile: its row now, from L2, once no lane's
            // zero-filling copy of that row is still in flight.
            __syncwarp();
            const long long page = table[newest / block_size];
            const long long row_offset = page * page_stride + head_offset + (newest % block_size) * HEAD_DIM;
            for (int i = lane; i < 2 * CHUNKS; i += 32) {
                const int chunk = i % CHUNKS;
                const KV* plane = i < CHUNKS ? k_plane : v_plane;
                slot[(i < CHUNKS ? 0 : Shape::PLANE_CHUNKS) + kv_chunk<HEAD_DIM, KV_BYTES>(newest - t0, chunk)] =
                    __ldcg(reinterpret_cast<const uint4*>(plane + row_offset + chunk * Shape::CHUNK_ELEMS));
            }
        }
        __syncwarp();  // the other lanes' copies (and the own row) are visible

        // S^T = K Q^T, in two accumulator chains.
        float s_acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        if constexpr (FP8) {
            // Lane (g, t) reads chunk 4 c + t (dims 64 c + 16 t ...) of rows g and g + 8; word i
            // of it holds k-step 4 c + i's (k 2t, 2t + 1) in its low bytes, (2t + 8, 2t + 9) high.
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 64; ++c) {
                const uint4 lo = slot[swizzled_chunk_fp8<HEAD_DIM>(g, 4 * c + t)];
                const uint4 hi = slot[swizzled_chunk_fp8<HEAD_DIM>(g + 8, 4 * c + t)];
                const u32 row_g[4] = {lo.x, lo.y, lo.z, lo.w}, row_g8[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const u32 a[4] = {fp8x2_to_f16x2(row_g[i]), fp8x2_to_f16x2(row_g8[i]),
                                      fp8x2_to_f16x2(row_g[i] >> 16), fp8x2_to_f16x2(row_g8[i] >> 16)};
                    mma_f16_16816(s_acc[i & 1], a, q_frag[4 * c + i]);
                }
            }
        } else {
            // ldmatrix.x4 matrices: rows 0-7 / 8-15 (lane bit 3) x chunk 2 s / 2 s + 1 (lane bit 4)
            const int row = (lane & 7) + (lane & 8);
#pragma unroll
            for (int s = 0; s < K_STEPS; ++s) {
                u32 a[4];
                ldmatrix_x4(a, slot + swizzled_chunk<HEAD_DIM>(row, 2 * s + (lane >> 4)));
                mma_bf16_16816(s_acc[s & 1], a, q_frag[s]);
            }
        }
        // rows g and g + 8 are tokens t0 + g, t0 + g + 8; columns 2t, 2t + 1 are heads
        float p[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int key = t0 + g + (c >> 1) * 8;
            float score = (s_acc[0][c] + s_acc[1][c]) * scale_log2;
            if constexpr (EXTRAS) score = capped_log2(score, extras.softcap_log2);
            p[c] = key >= lo && key < context_len ? score : -ATLAS_INF;
        }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tile_max = fmaxf(p[h], p[h + 2]);
#pragma unroll
            for (int offset = 4; offset < 32; offset <<= 1)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
            const float new_max = fmaxf(m[h], tile_max);
            // With no score yet the reference is 0, so every exp2 below is of -inf.
            const float reference = new_max == -ATLAS_INF ? 0.0f : new_max;
            alpha[h] = exp2f(m[h] - reference);
            p[h] = exp2f(p[h] - reference);
            p[h + 2] = exp2f(p[h + 2] - reference);
            l[h] = l[h] * alpha[h] + p[h] + p[h + 2];
            m[h] = new_max;
        }
        // P^T as the B fragment: each 8x8 half of P (tokens 0-7, 8-15 by heads), transposed. P
        // goes in as two bf16 terms, hi = bf16(p) and lo = bf16(p - hi), so the products keep
        // ~16 bits of p as the SIMT kernel's fp32 ones do (one bf16 P flips greedy tokens of a
        // real model against the mock, tests/gpu/test_models.py).
        // (FP8: f16 terms, as the V fragments are f16.)
        u32 p_hi[2], p_lo[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if constexpr (FP8) {
                const u32 hi = pack_f16x2(p[2 * half], p[2 * half + 1]);
                const float2 rounded = f16x2_to_floats(hi);
                p_hi[half] = movmatrix_trans(hi);
                p_lo[half] = movmatrix_trans(pack_f16x2(p[2 * half] - rounded.x, p[2 * half + 1] - rounded.y));
            } else {
                const u32 hi = pack_bf16x2(p[2 * half], p[2 * half + 1]);
                const float2 rounded = __bfloat1622float2(*reinterpret_cast<const bf16x2*>(&hi));
                p_hi[half] = movmatrix_trans(hi);
                p_lo[half] = movmatrix_trans(pack_bf16x2(p[2 * half] - rounded.x, p[2 * half + 1] - rounded.y));
            }
        }
#pragma unroll
        for (int i = 0; i < K_STEPS; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[1];
            o[i][2] *= alpha[0];
            o[i][3] *= alpha[1];
        }
        if constexpr (FP8) {
            // Lane (g, t) owns the D / 8 dims from g D / 8 on: it reads them from key rows 2t,
            // 2t + 1, 2t + 8, 2t + 9 (its k of P^T) and byte-permutes each pair of rows so that a
            // word holds one dim of two keys; A's rows g and g + 8 of m-tile i are its dims 2i
            // and 2i + 1 (the merge below puts them back in place).
            constexpr int SLICE_WORDS = HEAD_DIM / 32;  // 4-byte words of a row's slice
            u32 words[4][SLICE_WORDS];
            const uint4* v_tile = slot + Shape::PLANE_CHUNKS;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = 2 * t + (r & 1) + (r >> 1) * 8;
                if constexpr (HEAD_DIM == 64) {
                    const uint2 half_chunk =
                        reinterpret_cast<const uint2*>(v_tile + swizzled_chunk_fp8<HEAD_DIM>(row, g >> 1))[g & 1];
                    words[r][0] = half_chunk.x;
                    words[r][1] = half_chunk.y;
                } else {
                    uint4 chunks[HEAD_DIM / 128];
                    if constexpr (HEAD_DIM == 128) {
                        chunks[0] = v_tile[swizzled_chunk_fp8<HEAD_DIM>(row, g)];
                    } else {
                        // D 256: lanes of odd g read their second chunk first (no bank conflict)
                        const int odd = g & 1;
                        const uint4 first = v_tile[swizzled_chunk_fp8<HEAD_DIM>(row, 2 * g + odd)];
                        const uint4 second = v_tile[swizzled_chunk_fp8<HEAD_DIM>(row, 2 * g + 1 - odd)];
                        chunks[0] = odd ? second : first;
                        chunks[1] = odd ? first : second;
                    }
#pragma unroll
                    for (int part = 0; part < HEAD_DIM / 128; ++part) {
                        words[r][4 * part] = chunks[part].x;
                        words[r][4 * part + 1] = chunks[part].y;
                        words[r][4 * part + 2] = chunks[part].z;
                        words[r][4 * part + 3] = chunks[part].w;
                    }
                }
            }
#pragma unroll
            for (int w = 0; w < SLICE_WORDS; ++w) {
                // [x_d, y_d, x_d+1, y_d+1] of rows x and y: its low and high halves are key pairs
                const u32 low_keys[2] = {__byte_perm(words[0][w], words[1][w], 0x5140),
                                         __byte_perm(words[0][w], words[1][w], 0x7362)};
                const u32 high_keys[2] = {__byte_perm(words[2][w], words[3][w], 0x5140),
                                          __byte_perm(words[2][w], words[3][w], 0x7362)};
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int i = 2 * w + j;
                    const u32 a[4] = {fp8x2_to_f16x2(low_keys[j]), fp8x2_to_f16x2(low_keys[j] >> 16),
                                      fp8x2_to_f16x2(high_keys[j]), fp8x2_to_f16x2(high_keys[j] >> 16)};
                    mma_f16_16816(o[i], a, p_hi);
                    mma_f16_16816(o[i], a, p_lo);
                }
            }
        } else {
            // ldmatrix.x4.trans matrices: chunk 2 i / 2 i + 1 (lane bit 3) x rows 0-7 / 8-15 (lane bit 4)
            const int row = (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
            for (int i = 0; i < K_STEPS; ++i) {
                u32 a[4];
                ldmatrix_x4_trans(a, slot + Shape::PLANE_CHUNKS + swizzled_chunk<HEAD_DIM>(row, 2 * i + ((lane >> 3) & 1)));
                mma_bf16_16816(o[i], a, p_hi);
                mma_bf16_16816(o[i], a, p_lo);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int offset = 4; offset < 32; offset <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
    }

    // Merge the warps of this block, in the rings' memory once every warp is done with it.
    cp_async_wait<0>();
    __syncthreads();
    float* merge_max = reinterpret_cast<float*>(decode_shared);   // [WARPS][HEADS]
    float* merge_sum = merge_max + WARPS * DECODE_MMA_HEADS;  // [WARPS][HEADS]
    float* merge_out = merge_sum + WARPS * DECODE_MMA_HEADS;  // [WARPS][HEADS][HEAD_DIM]
    if (g == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            merge_max[warp * DECODE_MMA_HEADS + 2 * t + h] = m[h];
            merge_sum[warp * DECODE_MMA_HEADS + 2 * t + h] = l[h];
        }
    }
#pragma unroll
    for (int i = 0; i < K_STEPS; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int head = 2 * t + (c & 1);
            const int dim = FP8 ? g * (HEAD_DIM / 8) + 2 * i + (c >> 1) : 16 * i + g + (c >> 1) * 8;
            merge_out[merge_index<HEAD_DIM, LAYOUT>(warp * DECODE_MMA_HEADS + head, dim)] = o[i][c];
        }
    }
    __syncthreads();
    const bf16* gate = EXTRAS && extras.gated ? q + q_row + (long long)num_q_heads * HEAD_DIM : nullptr;
    DecodeOutput out_to{out, partial_out, partial_lse, split_counters, out_row, seq, num_q_heads, first_head,
                        num_heads, split, num_splits, used_splits, v_scale, gate, EXTRAS ? extras.sinks : nullptr,
                        cascade, clustered};
    finish_decode<HEAD_DIM, DECODE_MMA_HEADS, WARPS, WARPS * 32, LAYOUT, EXTRAS, CASCADE>(merge_max, merge_sum,
                                                                                   merge_out, out_to);
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

#define DEFINE_DECODE_MMA(HEAD_DIM, WARPS, STAGES)                                                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        attention_decode_mma_d##HEAD_DIM##_w##WARPS##_s##STAGES(                                                 \
            const bf16* q, const bf16* k_plane, const bf16* v_plane, bf16* out, float* partial_out,             \
            float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,      \
            const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, \
            float scale_log2, int sliding_window, int num_splits, int min_split_tokens) {                       \
        attention_decode_mma_impl<HEAD_DIM, WARPS, STAGES, bf16>(                                                \
            q, k_plane, v_plane, out, partial_out, partial_lse, split_counters, query_start_loc, seq_lens,       \
            block_tables, block_table_stride, num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, \
            num_splits, min_split_tokens, 1.0f);                                                                 \
    }

// FP8 (E4M3) caches: the host folds the layer's K scale into scale_log2 and passes its V scale.
#define DEFINE_DECODE_MMA_FP8(HEAD_DIM, WARPS, STAGES)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        attention_decode_mma_d##HEAD_DIM##_w##WARPS##_s##STAGES##_fp8(                                           \
            const bf16* q, const fp8_e4m3* k_plane, const fp8_e4m3* v_plane, bf16* out, float* partial_out,     \
            float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,      \
            const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, \
            float scale_log2, int sliding_window, int num_splits, int min_split_tokens, float v_scale) {        \
        attention_decode_mma_impl<HEAD_DIM, WARPS, STAGES, fp8_e4m3>(                                            \
            q, k_plane, v_plane, out, partial_out, partial_lse, split_counters, query_start_loc, seq_lens,       \
            block_tables, block_table_stride, num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, \
            num_splits, min_split_tokens, v_scale);                                                              \
    }

// Head dim 128 has two shapes, one and two blocks per SM; the host takes the one whose single
// wave the batch's blocks fill best (ops_attention.decode_mma_shape; measured on an H200 in
// docs/cuda-notes.md, runs 8 and 14). FP8 tiles are half the bytes: head dim 128 adds a shape of
// four blocks per SM in the same shared memory as bf16's two, (4, 3), which at batch 64 takes the
// batch's blocks in one wave (run 22).
DEFINE_DECODE_MMA(64, 4, 3)
DEFINE_DECODE_MMA(128, 4, 3)
DEFINE_DECODE_MMA(128, 8, 2)
DEFINE_DECODE_MMA(256, 4, 2)
DEFINE_DECODE_MMA_FP8(64, 4, 6)
DEFINE_DECODE_MMA_FP8(128, 4, 3)
DEFINE_DECODE_MMA_FP8(128, 4, 6)
DEFINE_DECODE_MMA_FP8(128, 8, 4)
DEFINE_DECODE_MMA_FP8(256, 4, 4)

// The `_x` twins (attention_extras.cuh): sinks, soft-capping and gated outputs, each shape of the
// kernels above with the extras' four arguments last. Defined after them so that the kernels
// above compile as they did.
#define DEFINE_DECODE_MMA_X(HEAD_DIM, WARPS, STAGES, SUFFIX, KV, V_SCALE_PARAM, V_SCALE)                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        attention_decode_mma_d##HEAD_DIM##_w##WARPS##_s##STAGES##SUFFIX##_x(                                     \
            const bf16* q, const KV* k_plane, const KV* v_plane, bf16* out, float* partial_out,                 \
            float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,      \
            const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, \
            float scale_log2, int sliding_window, int num_splits, int min_split_tokens V_SCALE_PARAM,           \
            int q_stride, float softcap_log2, const float* sinks, int gated) {                                  \
        attention_decode_mma_impl<HEAD_DIM, WARPS, STAGES, KV, true>(                                            \
            q, k_plane, v_plane, out, partial_out, partial_lse, split_counters, query_start_loc, seq_lens,       \
            block_tables, block_table_stride, num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, \
            num_splits, min_split_tokens, V_SCALE, AttentionExtras{q_stride, softcap_log2, sinks, gated});       \
    }

#define DECODE_NO_V_SCALE
#define DECODE_V_SCALE_PARAM , float v_scale
DEFINE_DECODE_MMA_X(64, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X(128, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X(128, 8, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X(256, 4, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X(64, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X(128, 4, 3, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X(128, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X(128, 8, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X(256, 4, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)


// ---------------------------------------------------------------------------------------------
// The cascade's prefix kernel (see "Cascade attention" above). grid = (ceil(S G / 64), Hkv,
// parts), 4 warps of 16 query rows. Per 64-key tile of its piece, as the prefill kernel's loop
// (attention_prefill_mma.cuh) but with no causal mask (every key of the prefix lies before every
// sharing row's token) and P in two bf16 terms, as the decode kernel's (its rows are decode rows):
//     S = Q K^T (mma.sync m16n8k16), online softmax, O += P_hi V + P_lo V
// K/V tiles stream through two cp.async stages (one at head dim 256), all after griddepcontrol.wait.
// The tile load, S = Q K^T, the online softmax and O += P V repeat the prefill kernel's loop on
// purpose: folded into functions both call, the prefill kernels' code changed (the load alone as
// a shared function moved the _x kernels' registers and spills, nvcc 13.0, sm_90a), and those are
// tuned; this kernel differs in its mask (none but the piece's end), P's two terms and its output.
// Sixteen E4M3 bytes (element i in byte i) as sixteen bf16 at `dst`, exactly (through f16).
__device__ __forceinline__ void store_fp8x16_as_bf16(bf16* dst, const uint4& raw) {
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    u32 pairs[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 pair = f16x2_to_floats(fp8x2_to_f16x2(words[i] >> (16 * h)));
            pairs[2 * i + h] = pack_bf16x2(pair.x, pair.y);
        }
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    *reinterpret_cast<uint4*>(dst + 8) = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
}

// KV: bf16, or fp8_e4m3 (an FP8 cache: one stage, each tile loaded to registers and stored
// converted to bf16; the host folds k_scale into scale_log2, and the pieces are of stored V
// values, which the decode kernel scales by v_scale with its own).
// EXTRAS (the `_x` twins): q rows `q_stride` apart and soft-capped scores; a layer's sinks and
// gate are the decode kernel's, where it writes the row (after folding the pieces in).
template <int HEAD_DIM, int STAGES, typename KV, bool EXTRAS = false>
__device__ __forceinline__ void attention_cascade_impl(
    const bf16* __restrict__ q, const KV* __restrict__ k_plane, const KV* __restrict__ v_plane,
    float* __restrict__ cascade_out, float* __restrict__ cascade_lse, const int* __restrict__ query_start_loc,
    const int* __restrict__ shared_prefix, const int* __restrict__ block_tables, int block_table_stride, int num_seqs,
    int num_q_heads, int num_kv_heads, int block_size, float scale_log2, int q_stride = 0, float softcap_log2 = 0.0f) {
    constexpr int BLOCK_N = 64;
    constexpr int STRIDE = HEAD_DIM + 8;  // padded rows: conflict-free ldmatrix
    constexpr int CHUNKS = HEAD_DIM / 8;
    constexpr int DIM_TILES = HEAD_DIM / 8;
    constexpr int THREADS = CASCADE_ROWS / 16 * 32;
    extern __shared__ uint4 cascade_shared[];
    bf16* q_tile = reinterpret_cast<bf16*>(cascade_shared);  // [64][STRIDE]
    bf16* kv_tiles = q_tile + CASCADE_ROWS * STRIDE;        // [STAGES][K | V][64][STRIDE]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int group = num_q_heads / num_kv_heads, kv_head = blockIdx.y;
    const int prefix_len = shared_prefix[0];
    const CascadeParts pieces = cascade_parts(prefix_len, gridDim.z);
    const int part = blockIdx.z;
    if (prefix_len <= 0 || part >= pieces.used) return;
    const int first_row = blockIdx.x * CASCADE_ROWS;
    const int* sharing = shared_prefix + 2;
    // A row is (sequence, head of the group); it counts if its sequence shares the prefix and is
    // a decode row (a sharing sequence is one by the host's rule; checked all the same).
    auto row_shares = [&](int row) {
        const int seq = row / group;
        return row < num_seqs * group && sharing[seq] && query_start_loc[seq + 1] - query_start_loc[seq] == 1;
    };
    bool mine = false;
    for (int r = tid; r < CASCADE_ROWS; r += THREADS) mine |= row_shares(first_row + r);
    if (!__syncthreads_or(mine)) return;

    const int kv_begin = part * pieces.keys, kv_end = min(prefix_len, kv_begin + pieces.keys);
    const int* table = block_tables + (long long)shared_prefix[1] * block_table_stride;
    auto load_tile = [&](int kv_start, int stage) {
        bf16* k_dst = kv_tiles + stage * 2 * BLOCK_N * STRIDE;
        bf16* v_dst = k_dst + BLOCK_N * STRIDE;
        if constexpr (sizeof(KV) == 1) {
            constexpr int FP8_CHUNKS = HEAD_DIM / 16;  // 16-byte chunks of a row of E4M3 bytes
            for (int c = tid; c < BLOCK_N * FP8_CHUNKS; c += THREADS) {
                const int r = c / FP8_CHUNKS, chunk = c % FP8_CHUNKS;
                const int key = kv_start + r;
                uint4 k_raw = make_uint4(0u, 0u, 0u, 0u), v_raw = k_raw;
                if (key < kv_end) {
                    const long long page = __ldg(table + key / block_size);
                    const long long offset =
                        ((page * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + chunk * 16;
                    k_raw = __ldg(reinterpret_cast<const uint4*>(k_plane + offset));
                    v_raw = __ldg(reinterpret_cast<const uint4*>(v_plane + offset));
                }
                store_fp8x16_as_bf16(k_dst + r * STRIDE + chunk * 16, k_raw);
                store_fp8x16_as_bf16(v_dst + r * STRIDE + chunk * 16, v_raw);
            }
        } else {
            for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {
                const int r = c / CHUNKS, chunk = c % CHUNKS;
                const int key = kv_start + r;
                const bool valid = key < kv_end;
                long long offset = 0;
                if (valid) {
                    const long long page = __ldg(table + key / block_size);
                    offset = ((page * num_kv_heads + kv_head) * block_size + key % block_size) * HEAD_DIM + chunk * 8;
                }
                cp_async_16(k_dst + r * STRIDE + chunk * 8, k_plane + offset, valid);
                cp_async_16(v_dst + r * STRIDE + chunk * 8, v_plane + offset, valid);
            }
            cp_async_commit();
        }
    };
    const int num_kv_tiles = (kv_end - kv_begin + BLOCK_N - 1) / BLOCK_N;
    // After the wait: q comes from the previous kernel, and a verify step's rows (single-token
    // rows of one sequence) may share a page that an earlier row of theirs writes.
    dependent_launch_entry();
    load_tile(kv_begin, 0);
    for (int c = tid; c < CASCADE_ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, chunk = c % CHUNKS, row = first_row + r;
        const bool valid = row_shares(row);
        const int seq = valid ? row / group : 0;
        const bf16* src = q + (long long)query_start_loc[seq] * (EXTRAS ? q_stride : num_q_heads * HEAD_DIM) +
                          (long long)(kv_head * group + row % group) * HEAD_DIM + chunk * 8;
        cp_async_16(q_tile + r * STRIDE + chunk * 8, valid ? src : q, valid);
    }
    cp_async_commit();

    float o[DIM_TILES][4];
#pragma unroll
    for (int d = 0; d < DIM_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float row_max[2] = {-ATLAS_INF, -ATLAS_INF}, row_sum[2] = {0.0f, 0.0f};

    for (int tile = 0; tile < num_kv_tiles; ++tile) {
        const int kv_start = kv_begin + tile * BLOCK_N;
        const int stage = STAGES == 2 ? tile & 1 : 0;
        if (STAGES == 2 && tile + 1 < num_kv_tiles) {
            load_tile(kv_start + BLOCK_N, stage ^ 1);
            cp_async_wait<1>();  // all but the tile just issued have landed
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* k_tile = kv_tiles + stage * 2 * BLOCK_N * STRIDE;
        const bf16* v_tile = k_tile + BLOCK_N * STRIDE;

        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        const bf16* q_lane = q_tile + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + (lane >> 4) * 8;
        const bf16* k_lane = k_tile + ((lane & 7) + (lane >> 4) * 8) * STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            u32 a[4];
            ldmatrix_x4(a, q_lane + k * 16);
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; n += 2) {
                u32 b[4];
                ldmatrix_x4(b, k_lane + n * 8 * STRIDE + k * 16);
                mma_bf16_16816(s[n], a, b);
                mma_bf16_16816(s[n + 1], a, b + 2);
            }
        }
        const bool full = kv_start + BLOCK_N <= kv_end;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -ATLAS_INF;
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kv_start + n * 8 + 2 * t + e;
                    float value = s[n][half * 2 + e] * scale_log2;
                    if constexpr (EXTRAS) value = capped_log2(value, softcap_log2);
                    value = full || key < kv_end ? value : -ATLAS_INF;
                    s[n][half * 2 + e] = value;
                    tile_max = fmaxf(tile_max, value);
                }
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[half], tile_max);
            const float reference = new_max == -ATLAS_INF ? 0.0f : new_max;
            const float rescale = exp2f(row_max[half] - reference);
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) {
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
        // O += P V with P = hi + lo, two bf16 terms (~16 bits of p, as the decode kernel keeps).
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            u32 hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float* pair = s[2 * kk + (i >> 1)] + (i & 1) * 2;
                hi[i] = pack_bf16x2(pair[0], pair[1]);
                const float2 rounded = __bfloat1622float2(*reinterpret_cast<const bf16x2*>(&hi[i]));
                lo[i] = pack_bf16x2(pair[0] - rounded.x, pair[1] - rounded.y);
            }
            const int key_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int dd = 0; dd < HEAD_DIM / 16; ++dd) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_tile + key_row * STRIDE + dd * 16 + (lane >> 4) * 8);
                mma_bf16_16816(o[2 * dd], hi, b);
                mma_bf16_16816(o[2 * dd + 1], hi, b + 2);
                mma_bf16_16816(o[2 * dd], lo, b);
                mma_bf16_16816(o[2 * dd + 1], lo, b + 2);
            }
        }
        __syncthreads();  // every warp is done with this stage before a later load overwrites it
        if (STAGES == 1 && tile + 1 < num_kv_tiles) load_tile(kv_start + BLOCK_N, 0);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = first_row + warp * 16 + g + half * 8;
        if (!row_shares(row)) continue;
        const int seq = row / group, head = kv_head * group + row % group;
        const long long slot = ((long long)seq * num_q_heads + head) * gridDim.z + part;
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        float* dst = cascade_out + slot * HEAD_DIM;
#pragma unroll
        for (int d = 0; d < DIM_TILES; ++d)
            *reinterpret_cast<float2*>(dst + d * 8 + 2 * t) =
                make_float2(o[d][half * 2] * inverse, o[d][half * 2 + 1] * inverse);
        if (t == 0) cascade_lse[slot] = total > 0.0f ? row_max[half] + log2f(total) : -ATLAS_INF;
    }
}

#define DEFINE_CASCADE(HEAD_DIM, STAGES, SUFFIX, KV)                                                            \
    extern "C" __global__ void __launch_bounds__(CASCADE_ROWS / 16 * 32, 2) attention_cascade_d##HEAD_DIM##SUFFIX( \
        const bf16* q, const KV* k_plane, const KV* v_plane, float* cascade_out, float* cascade_lse,            \
        const int* query_start_loc, const int* shared_prefix, const int* block_tables, int block_table_stride,  \
        int num_seqs, int num_q_heads, int num_kv_heads, int block_size, float scale_log2) {                    \
        attention_cascade_impl<HEAD_DIM, STAGES, KV>(q, k_plane, v_plane, cascade_out, cascade_lse,            \
                                                     query_start_loc, shared_prefix, block_tables,              \
                                                     block_table_stride, num_seqs, num_q_heads, num_kv_heads,   \
                                                     block_size, scale_log2);                                   \
    }

// The decode kernels' `_cascade` twins (no extras; an FP8 cache's with its v_scale): a sharing
// row decodes past the prefix and folds in the prefix kernel's pieces.
#define DEFINE_DECODE_MMA_CASCADE(HEAD_DIM, WARPS, STAGES, SUFFIX, KV, V_SCALE_PARAM, V_SCALE)                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        attention_decode_mma_d##HEAD_DIM##_w##WARPS##_s##STAGES##SUFFIX##_cascade(                               \
            const bf16* q, const KV* k_plane, const KV* v_plane, bf16* out, float* partial_out,                 \
            float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,      \
            const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, \
            float scale_log2, int sliding_window, int num_splits, int min_split_tokens V_SCALE_PARAM,           \
            const int* shared_prefix, const float* cascade_out, const float* cascade_lse, int cascade_parts) {  \
        attention_decode_mma_impl<HEAD_DIM, WARPS, STAGES, KV, false, true>(                                     \
            q, k_plane, v_plane, out, partial_out, partial_lse, split_counters, query_start_loc, seq_lens,       \
            block_tables, block_table_stride, num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, \
            num_splits, min_split_tokens, V_SCALE, AttentionExtras{0, 0.0f, nullptr, 0},                         \
            CascadeInput{shared_prefix, cascade_out, cascade_lse, cascade_parts});                               \
    }

// The `_x` twins of both (sinks, soft-capping, gated outputs; attention_extras.cuh).
#define DEFINE_CASCADE_X(HEAD_DIM, STAGES, SUFFIX, KV)                                                          \
    extern "C" __global__ void __launch_bounds__(CASCADE_ROWS / 16 * 32, 2)                                     \
        attention_cascade_d##HEAD_DIM##SUFFIX##_x(                                                               \
            const bf16* q, const KV* k_plane, const KV* v_plane, float* cascade_out, float* cascade_lse,        \
            const int* query_start_loc, const int* shared_prefix, const int* block_tables,                      \
            int block_table_stride, int num_seqs, int num_q_heads, int num_kv_heads, int block_size,            \
            float scale_log2, int q_stride, float softcap_log2) {                                               \
        attention_cascade_impl<HEAD_DIM, STAGES, KV, true>(q, k_plane, v_plane, cascade_out, cascade_lse,      \
                                                           query_start_loc, shared_prefix, block_tables,        \
                                                           block_table_stride, num_seqs, num_q_heads,           \
                                                           num_kv_heads, block_size, scale_log2, q_stride,      \
                                                           softcap_log2);                                       \
    }

#define DEFINE_DECODE_MMA_X_CASCADE(HEAD_DIM, WARPS, STAGES, SUFFIX, KV, V_SCALE_PARAM, V_SCALE)                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        attention_decode_mma_d##HEAD_DIM##_w##WARPS##_s##STAGES##SUFFIX##_x_cascade(                             \
            const bf16* q, const KV* k_plane, const KV* v_plane, bf16* out, float* partial_out,                 \
            float* partial_lse, unsigned* split_counters, const int* query_start_loc, const int* seq_lens,      \
            const int* block_tables, int block_table_stride, int num_q_heads, int num_kv_heads, int block_size, \
            float scale_log2, int sliding_window, int num_splits, int min_split_tokens V_SCALE_PARAM,           \
            int q_stride, float softcap_log2, const float* sinks, int gated, const int* shared_prefix,          \
            const float* cascade_out, const float* cascade_lse, int cascade_parts) {                            \
        attention_decode_mma_impl<HEAD_DIM, WARPS, STAGES, KV, true, true>(                                      \
            q, k_plane, v_plane, out, partial_out, partial_lse, split_counters, query_start_loc, seq_lens,       \
            block_tables, block_table_stride, num_q_heads, num_kv_heads, block_size, scale_log2, sliding_window, \
            num_splits, min_split_tokens, V_SCALE, AttentionExtras{q_stride, softcap_log2, sinks, gated},        \
            CascadeInput{shared_prefix, cascade_out, cascade_lse, cascade_parts});                               \
    }

DEFINE_CASCADE(64, 2, , bf16)
DEFINE_CASCADE(128, 2, , bf16)
DEFINE_CASCADE(256, 1, , bf16)
DEFINE_CASCADE(64, 1, _fp8, fp8_e4m3)
DEFINE_CASCADE(128, 1, _fp8, fp8_e4m3)
DEFINE_CASCADE(256, 1, _fp8, fp8_e4m3)
DEFINE_DECODE_MMA_CASCADE(64, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_CASCADE(128, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_CASCADE(128, 8, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_CASCADE(256, 4, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_CASCADE(64, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_CASCADE(128, 4, 3, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_CASCADE(128, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_CASCADE(128, 8, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_CASCADE(256, 4, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_CASCADE_X(64, 2, , bf16)
DEFINE_CASCADE_X(128, 2, , bf16)
DEFINE_CASCADE_X(256, 1, , bf16)
DEFINE_CASCADE_X(64, 1, _fp8, fp8_e4m3)
DEFINE_CASCADE_X(128, 1, _fp8, fp8_e4m3)
DEFINE_CASCADE_X(256, 1, _fp8, fp8_e4m3)
DEFINE_DECODE_MMA_X_CASCADE(64, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X_CASCADE(128, 4, 3, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X_CASCADE(128, 8, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X_CASCADE(256, 4, 2, , bf16, DECODE_NO_V_SCALE, 1.0f)
DEFINE_DECODE_MMA_X_CASCADE(64, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X_CASCADE(128, 4, 3, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X_CASCADE(128, 4, 6, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X_CASCADE(128, 8, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)
DEFINE_DECODE_MMA_X_CASCADE(256, 4, 4, _fp8, fp8_e4m3, DECODE_V_SCALE_PARAM, v_scale)

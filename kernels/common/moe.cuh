// Mixture of experts: routing on the device and the experts grouped by expert, without a host
// sync on the routing (every grid is sized by host bounds: tokens N, top_k, experts E).
//
//   x, normed, residual [N, H] bf16   router [E, H] bf16 (+ bias [E])   logits [N, E] f32
//   expert_ids [N, k] i32, expert_weights [N, k] f32  (pair p = t k + j: token t's j-th expert)
//   gate_up [E, 2I, H] bf16 (gate rows, then up rows; bias [E, 2I])   down [E, H, I] (bias [E, H])
//   shared expert (optional): gate_up [2Is, H], down [H, Is], its sigmoid gate row [H]; it runs as
//   group E with pairs P0 + t (P0 = N k), every token once, weight 1 (times its gate).
//   hidden [P0 + N, Imax] bf16: act(gate) * up of each pair (pair order: no unpermute needed)
//   y [P0 + N, H] f32: each pair's expert output (down product + bias), pair order
//
// Routing (moe_route_small for N <= 8, else the norm kernel + the router product + moe_topk):
// a warp per token takes softmax or sigmoid scores of the logits, the top k by score + selection
// bias (ties: lowest id: a warp arg-max over (value, -id) k times), renormalises and scales.
// moe_route_small fuses the decode path into one launch: every block takes its ROUTE_ROWS router
// rows' logits for all tokens (normalising x as it loads it, as the norm kernel would, block 0
// writing `normed`), and the last block to finish routes every token.
// Bytes: E H 2 (router, once) + N H 2 per block (x, from L2); FLOPs 2 N E H.
//
// Experts, decode (N <= MOE_GEMV_MAX_TOKENS): a grouped GEMV on tensor cores. grid.y = expert
// slots: min(E, N k) for the routed experts (slot i serves the i-th smallest expert id that some
// pair chose; the surplus slots leave at once) plus one for the shared expert. The routing
// kernel's last block writes a slot table (each slot's expert and pairs), so a block learns its
// slot with one read: no alignment kernel and no host sync. At one token the routing kernel
// stops after the logits and the expert blocks route the token themselves (LocalRoute). Each
// block streams its weight rows once per 8 of the expert's tokens (mma.sync m16n8k16, the
// tokens as the 8 columns, the k order
// permuted as in gemv.cu's gemv_mma so that the fragments are plain 16-byte loads):
//     moe_gate_up_<act>:  16 rows = the gate and up rows of 8 features; hidden = act(gate) * up
//     moe_down:           16 rows of down; y = the product + bias
// Only the active experts' weights are read: at N = 1 the 8 routed experts of Qwen3-30B-A3B are
// 75 MB a layer, 9.4 MB an expert. A block's 4 warps split K, each requesting 4 chunks a round
// (128 threads: an SM holds 6-8 blocks, so Qwen3-30B-A3B's 768 gate_up and 1024 down blocks of a
// decode step run in one wave). moe_down reads (or routes) its slot before waiting for
// moe_gate_up; the weight loads mark their lines first to go from L2 so other lines stay.
// Three launches a decode layer: route, gate_up, down (whose last block per row tile is the
// combine). Past 8 tokens, where a step touches most experts, moe_down_looped takes moe_down's
// place: a block loops over a share of the slots for its row tile, each token's weighted sum in
// shared memory, in one wave (Qwen3-30B-A3B batch 64 on an H200: 115 us a layer against 142).
//
// Experts, prefill (N > MOE_GEMV_MAX_TOKENS): moe_align (one block) counts the pairs per expert,
// prefix-sums them into offsets and tile starts (tiles of GEMM_BM rows) and scatters the pair ids
// into expert-contiguous order; then a grouped GEMM whose tiles gather their rows through that
// order as they load them (the permute fused into the load):
//     moe_gemm_gate_up_<act>: [128 rows x (64 features' gate and up rows, interleaved)] tiles,
//                             hidden = act(gate) * up
//     moe_gemm_down:          [128 rows x 128 weight rows] tiles, y = product + bias
// mma.sync m16n8k16 (4 warps of 64 x 64) over K tiles of 32 in a three-stage cp.async pipeline.
// FLOPs 6 N k H I; bound by the tensor cores (mma.sync: under Hopper's wgmma peak; a wgmma
// variant is the next step, docs/cuda-notes.md).
//
// moe_combine (after the grouped GEMM; the grouped GEMV's down kernel does the same in the last
// block of each row tile, its shared gates taken by moe_gate_up's shared slot):
// residual[t] += bf16(sum_j w_tj y[t k + j] + sigmoid(normed[t] . gate) y[P0 + t])
// (the unpermute is the pair order of y; the shared gate is a dot product the block takes itself).
// With accumulate 0 (the three kernels that write the residual take it) the sum replaces the row
// unread: a tensor-parallel rank that does not carry the residual stream writes its share there.
// Bytes N (k + 1) H 4 + 4 N H.
//
// FP8 experts (E4M3 bytes with f32 scales per channel [E, rows] or per 128 x 128 tile (_blk)
// [E, ceil(rows / 128), ceil(K / 128)]; the shared expert in the same layout): the expert kernels'
// _fp8[_blk] forms, each weight argument followed by its scales. The GEMVs read the bytes (half
// bf16's: 4.7 MB an expert of Qwen3-30B-A3B) and turn each pair into an exact bf16 pair for the
// same mma steps (grouped_mma_rows over Fp8Rows); the grouped GEMM widens each E4M3 tile times
// its scale to bf16 in shared memory (gemm_tile_fp8; mma.sync on every GPU). SiLU gating only.
//
// Expert parallelism: a rank holds E of the routed experts, from first_expert on. moe_shift_ids
// makes the ids local first (one launch, only where first_expert > 0); every kernel skips pairs
// whose id is outside [0, E), the combine included, so the rank adds its experts' share only.
//
// Every kernel waits for the previous one before reading what it wrote: the weights a block
// streams depend on the ids (moe_down's early reads are of the slot table or the logits, written
// two kernels back).
// The kernels live in this header so that kernels/sm90/moe.cu (the wgmma grouped GEMM) can define
// every symbol of kernels/common/moe.cu beside its own.
#pragma once

#include "atlas_common.cuh"
#include "fp8_weights.cuh"
#include "gated_act.cuh"

#define MOE_MAX_EXPERTS 512
#define MOE_LANE_EXPERTS (MOE_MAX_EXPERTS / 32)
#define MOE_MAX_SLOT_TOKENS 64  // MOE_GEMV_MAX_TOKENS: a token picks an expert at most once
#define MOE_WARPS 4
// Blocks an SM must hold (launch bounds): Qwen3-30B-A3B's decode step, 768 gate_up and 1024 down
// blocks, in one wave of 132 SMs (down: at most 64 registers; gate_up 6, which spills nothing).
#define MOE_DOWN_MIN_BLOCKS 8
// moe_down's rows a block, in groups of 16 whose K the block's warps share. 16: 32 (two groups,
// each over K in two warps' parts) stepped Qwen3-30B-A3B slower on an H200, batch 1 3.047 ms
// against 2.978 and batch 64 20.16 against 19.78.
#define MOE_DOWN_ROWS 16
#define MOE_GATE_UP_MIN_BLOCKS 6
#define MOE_GATE_UP_BATCH 4  // moe_gate_up's chunks of loads in flight a round (grouped_mma_rows)
#define ROUTE_THREADS 256
#define ROUTE_ROWS 4
#define ROUTE_MAX_TOKENS 8

// Whether expert id e names one of the E experts this GPU holds (an expert-parallel rank's ids
// are shifted by moe_shift_ids; the others' pairs are skipped everywhere).
__device__ __forceinline__ bool held(int e, int num_experts) { return e >= 0 && e < num_experts; }

// ---------------------------------------------------------------------------------------------
// The grouped GEMV's slots. The routing kernel's last block writes a slot table once a step
// (build_slot_table), so a GEMV block finds its expert and pairs with one read instead of a scan
// of every id: slot_table [routed_slots][MOE_SLOT_INTS] i32, each slot = (expert, count, pairs
// ascending). Slot s serves the s-th smallest expert this GPU holds that some pair chose (ids
// local: global id - first_expert, within [0, E)); surplus slots hold expert -1. Its reads by
// moe_down come before that kernel's griddepcontrol.wait: the routing kernel that wrote it
// completed before moe_gate_up's wait returned, and moe_down launches only after that.
#define MOE_SLOT_INTS (2 + MOE_MAX_SLOT_TOKENS)
#define MOE_MAX_SLOT_PAIRS (MOE_MAX_SLOT_TOKENS * 16)  // N <= 64 tokens, top_k <= 16

struct SlotPairs {
    int expert;  // -1: no expert for this slot (the block leaves); E: the shared expert
    int count;
    int pairs[MOE_MAX_SLOT_TOKENS];
};

// One block (blockDim a multiple of 32) writes the slot table from expert_ids [num_pairs]
// (global ids, read through L2: other blocks of the grid may have written them), or from
// shared_ids [num_pairs] where this block routed every token itself (no L2 round trip). A slot's pairs
// come in the order the block's shared-memory atomics rank them, which may change from run to
// run; no result depends on it (each pair's rows are its own GEMV columns and output rows, and
// the combine sums a token's pairs in k order).
__device__ __forceinline__ void build_slot_table(const int* expert_ids, int num_pairs, int first_expert,
                                                 int num_experts, int routed_slots, int* slot_table,
                                                 const int* shared_ids = nullptr) {
    __shared__ unsigned present[MOE_MAX_EXPERTS / 32];
    __shared__ int word_base[MOE_MAX_EXPERTS / 32];
    __shared__ int counts[MOE_MAX_EXPERTS];
    __shared__ short ranks[MOE_MAX_SLOT_PAIRS];
    __shared__ short ids[MOE_MAX_SLOT_PAIRS];
    __shared__ int distinct;
    const int words = (num_experts + 31) / 32;
    for (int i = threadIdx.x; i < words; i += blockDim.x) present[i] = 0u;
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int e = (shared_ids != nullptr ? shared_ids[p] : __ldcg(expert_ids + p)) - first_expert;
        const bool mine = held(e, num_experts);
        ids[p] = mine ? e : -1;
        if (mine) {
            atomicOr(present + (e >> 5), 1u << (e & 31));
            ranks[p] = atomicAdd(counts + e, 1);
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int count = lane < words ? __popc(present[lane]) : 0;
        int inclusive = count;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int before = __shfl_up_sync(0xffffffffu, inclusive, offset);
            if (lane >= offset) inclusive += before;
        }
        if (lane < words) word_base[lane] = inclusive - count;
        if (lane == 31) distinct = inclusive;
    }
    __syncthreads();
    for (int s = distinct + threadIdx.x; s < routed_slots; s += blockDim.x) slot_table[s * MOE_SLOT_INTS] = -1;
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e < 0) continue;
        const int slot = word_base[e >> 5] + __popc(present[e >> 5] & ((1u << (e & 31)) - 1u));
        const int rank = ranks[p];
        int* entry = slot_table + slot * MOE_SLOT_INTS;
        if (rank < MOE_MAX_SLOT_TOKENS) entry[2 + rank] = p;
        if (rank == 0) {
            entry[0] = e;
            entry[1] = min(counts[e], MOE_MAX_SLOT_TOKENS);
        }
    }
}

// Fills `slot_pairs` (shared memory) for `slot` from the table; every thread calls it.
// Slots below `routed_slots` are the table's, slot `routed_slots` the shared expert (all tokens,
// pairs num_pairs + t).
__device__ __forceinline__ void read_slot(const int* slot_table, int num_pairs, int num_tokens, int num_experts,
                                          int routed_slots, SlotPairs& slot_pairs, int slot) {
    if (slot >= routed_slots) {
        if (threadIdx.x == 0) {
            slot_pairs.expert = num_experts;
            slot_pairs.count = min(num_tokens, MOE_MAX_SLOT_TOKENS);
        }
        for (int t = threadIdx.x; t < min(num_tokens, MOE_MAX_SLOT_TOKENS); t += blockDim.x)
            slot_pairs.pairs[t] = num_pairs + t;
    } else {
        // One round trip: the expert, its count and as many pairs as there are tokens are all
        // requested at once (a slot's count never exceeds the tokens; a surplus slot's count and
        // pairs are stale and unused), not the count after the expert and the pairs after both.
        const int* entry = slot_table + slot * MOE_SLOT_INTS;
        if (threadIdx.x == 0) {
            const int expert = __ldcg(entry), count = __ldcg(entry + 1);
            slot_pairs.expert = expert;
            slot_pairs.count = expert >= 0 ? count : 0;
        }
        for (int t = threadIdx.x; t < min(num_tokens, MOE_MAX_SLOT_TOKENS); t += blockDim.x)
            slot_pairs.pairs[t] = __ldcg(entry + 2 + t);
    }
    __syncthreads();
}

// An unsigned key whose order is the float order (-inf above 0, the key no expert gets).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned bits = __float_as_uint(f + 0.0f);  // -0 becomes +0: equal floats, equal keys
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// ---------------------------------------------------------------------------------------------
// Routing of one token by one warp. logits [E] (bias included) in global memory, read through L2
// (another block may have just written them). Expert e sits in lane e % 32, register e / 32 of
// LANE_EXPERTS (route_token picks 4 where E <= 128: a quarter of the scans and loads of 16).
template <int LANE_EXPERTS>
__device__ __forceinline__ void route_token_in(const float* logits, const float* selection_bias, int num_experts,
                                               int top_k, int sigmoid_scoring, int renormalize, float scaling,
                                               int* ids_out, float* weights_out, int* ids_shared,
                                               float* weights_shared) {
    const int lane = threadIdx.x & 31;
    float score[LANE_EXPERTS];
    float peak = -ATLAS_INF;
#pragma unroll
    for (int i = 0; i < LANE_EXPERTS; ++i) {
        const int e = i * 32 + lane;
        score[i] = e < num_experts ? __ldcg(logits + e) : -ATLAS_INF;
        peak = fmaxf(peak, score[i]);
    }
    if (sigmoid_scoring) {
#pragma unroll
        for (int i = 0; i < LANE_EXPERTS; ++i)
            if (i * 32 + lane < num_experts) score[i] = 1.0f / (1.0f + expf(-score[i]));
    } else {
        peak = warp_max(peak);
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < LANE_EXPERTS; ++i) {
            if (i * 32 + lane < num_experts) {
                score[i] = expf(score[i] - peak);
                total += score[i];
            }
        }
        total = warp_sum(total);
#pragma unroll
        for (int i = 0; i < LANE_EXPERTS; ++i)
            if (i * 32 + lane < num_experts) score[i] = score[i] / total;
    }
    // The top k by (ranked score, lowest id): each round a lane offers its best untaken expert
    // (strict > over ascending registers: its lowest id among equals), one warp max of the
    // order-preserving keys finds the best score and one warp min the lowest id holding it,
    // two redux instructions where a shuffle tree of (score, id, weight) took fifteen.
    unsigned key[LANE_EXPERTS];  // 0: not offered (past E, or taken)
#pragma unroll
    for (int i = 0; i < LANE_EXPERTS; ++i) {
        const int e = i * 32 + lane;
        key[i] = e < num_experts ? order_key(score[i] + (selection_bias != nullptr ? selection_bias[e] : 0.0f)) : 0u;
    }
    int my_id = 0;
    float my_score = 0.0f, chosen_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        unsigned best = 0u;
        int best_i = 0;
#pragma unroll
        for (int i = 0; i < LANE_EXPERTS; ++i) {
            if (key[i] > best) {
                best = key[i];
                best_i = i;
            }
        }
        const unsigned top = __reduce_max_sync(0xffffffffu, best);
        const int best_e = __reduce_min_sync(0xffffffffu, best == top && top != 0u ? best_i * 32 + lane : 0x7fffffff);
        float best_score = 0.0f;
#pragma unroll
        for (int i = 0; i < LANE_EXPERTS; ++i) {
            if (i * 32 + lane == best_e) {
                best_score = score[i];
                key[i] = 0u;
            }
        }
        best_score = __shfl_sync(0xffffffffu, best_score, best_e & 31);
        if (lane == j) {
            my_id = best_e;
            my_score = best_score;
        }
        chosen_sum += best_score;
    }
    if (lane < top_k) {
        const float weight = (renormalize ? my_score / chosen_sum : my_score) * scaling;
        if (ids_out != nullptr) {
            ids_out[lane] = my_id;
            weights_out[lane] = weight;
        }
        if (ids_shared != nullptr) ids_shared[lane] = my_id;
        if (weights_shared != nullptr) weights_shared[lane] = weight;
    }
}

__device__ __forceinline__ void route_token(const float* logits, const float* selection_bias, int num_experts,
                                            int top_k, int sigmoid_scoring, int renormalize, float scaling,
                                            int* ids_out, float* weights_out, int* ids_shared = nullptr,
                                            float* weights_shared = nullptr) {
    if (num_experts <= 128)
        route_token_in<4>(logits, selection_bias, num_experts, top_k, sigmoid_scoring, renormalize, scaling, ids_out,
                          weights_out, ids_shared, weights_shared);
    else
        route_token_in<MOE_LANE_EXPERTS>(logits, selection_bias, num_experts, top_k, sigmoid_scoring, renormalize,
                                         scaling, ids_out, weights_out, ids_shared, weights_shared);
}

// ---------------------------------------------------------------------------------------------
// One token's experts routing it themselves (`LocalRoute`; ops_moe.routes_in_experts): at batch 1
// moe_route_small stops after the logits (`logits_only`) and each moe_gate_up block routes the
// token from them with one warp, as the routing kernel's last block would have. That last
// block's chain (fence, counter, logits back from L2, top k, slot table: ~3.4 of the routing's
// 5.4 us at Qwen3-30B-A3B's shape on an H200, docs/lab/moe-decode.md) leaves the step's critical
// path; a moe_gate_up block pays a warp's top k after one L2 read of the logits, where it read
// its slot before. Slot j serves pair j (expert -1 where another rank holds it): the host takes
// this path only where the routed slots number top_k. moe_gate_up's block (0, 0) writes the ids
// and weights (the port's outputs of `route`), its blocks (0, j) slot j of the table.
// moe_down routes the token before its wait where E <= 128 (a warp's top k over 4 registers a
// lane, hidden beside moe_gate_up's stream); past that (Qwen3-Next's 512) the top k is a chain
// of ~3 us, and its blocks, most of which become resident only as moe_gate_up's leave, read the
// table moe_gate_up wrote after their wait instead (H200, Qwen3-Next batch 1: routing there made
// moe_down 3.9 us a layer slower).
struct LocalRoute {
    const float* logits;  // [E] f32, bias included; null: the routing kernel wrote the slot table
    const float* selection_bias;
    int num_experts, sigmoid_scoring, renormalize;
    float scaling;
};
#define MOE_LOCAL_ROUTE_PARAMS                                                                                 \
    const float *route_logits, const float *route_selection_bias, int route_experts, int route_sigmoid,       \
        int route_renormalize, float route_scaling
#define MOE_LOCAL_ROUTE \
    LocalRoute { route_logits, route_selection_bias, route_experts, route_sigmoid, route_renormalize, route_scaling }
#define MOE_LOCAL_ROUTE_MAX_DOWN_EXPERTS 128  // moe_down routes the token itself up to this E

// Fills `slot_pairs` for `slot` as read_slot does, routing the one token first (see LocalRoute) into
// ids and weights [top_k] (shared memory; global ids), and into ids_out / weights_out where not null.
// Every thread calls it; the shared slot (slot >= routed_slots) routes only where `always_route`.
__device__ __forceinline__ void route_slot(const LocalRoute& route, int top_k, int first_expert, int num_experts,
                                           int routed_slots, SlotPairs& slot_pairs, int slot, int* ids,
                                           float* weights, bool always_route, int* ids_out = nullptr,
                                           float* weights_out = nullptr) {
    const bool is_shared = slot >= routed_slots;
    if (threadIdx.x < 32 && (always_route || !is_shared))
        route_token(route.logits, route.selection_bias, route.num_experts, top_k, route.sigmoid_scoring,
                    route.renormalize, route.scaling, ids_out, weights_out, ids, weights);
    __syncthreads();  // the ids are in shared memory
    if (threadIdx.x == 0) {
        const int e = is_shared ? num_experts : ids[slot] - first_expert;
        const bool mine = is_shared || held(e, num_experts);
        slot_pairs.expert = mine ? e : -1;
        slot_pairs.count = mine ? 1 : 0;
        slot_pairs.pairs[0] = is_shared ? top_k : slot;  // the shared pair of token 0: num_pairs + 0
    }
    __syncthreads();
}

// moe_topk: a warp per token over logits [N, E] (bias included). grid ceil(N / 8), 256 threads.
// With a slot_table (N <= MOE_MAX_SLOT_TOKENS: the grouped GEMV follows), the last block to
// finish writes it (`counter` one zeroed u32); held_experts experts from first_expert on.
extern "C" __global__ void __launch_bounds__(256)
    moe_topk(const float* logits, const float* selection_bias, int* expert_ids, float* expert_weights,
             int num_tokens, int num_experts, int top_k, int sigmoid_scoring, int renormalize, float scaling,
             unsigned* counter, int* slot_table, int first_expert, int held_experts, int routed_slots) {
    dependent_launch_entry();
    const int token = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (token < num_tokens)
        route_token(logits + (long long)token * num_experts, selection_bias, num_experts, top_k, sigmoid_scoring,
                    renormalize, scaling, expert_ids + (long long)token * top_k,
                    expert_weights + (long long)token * top_k);
    if (slot_table == nullptr || !last_block_done(counter, gridDim.x)) return;
    build_slot_table(expert_ids, num_tokens * top_k, first_expert, held_experts, routed_slots, slot_table);
}

// moe_route_small: the whole decode routing in one launch (see the file comment). grid
// ceil(E / ROUTE_ROWS), ROUTE_THREADS threads; N <= ROUTE_MAX_TOKENS, H % 8 == 0; `counter` one
// zeroed u32 (last_block_done).
__device__ __forceinline__ void moe_route_small_impl(
    const bf16* x, const bf16* norm_weight, float eps, const bf16* router, const bf16* router_bias,
    const float* selection_bias, bf16* normed, float* logits, unsigned* counter, int* expert_ids, float* expert_weights,
    int num_tokens, int hidden, int num_experts, int top_k, int sigmoid_scoring, int renormalize, float scaling,
    int* slot_table, int first_expert, int held_experts, int routed_slots, int logits_only) {
    __shared__ float scratch[32];
    __shared__ float inverse_rms[ROUTE_MAX_TOKENS];
    __shared__ float partial[ROUTE_THREADS / 32][ROUTE_ROWS][ROUTE_MAX_TOKENS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = blockIdx.x * ROUTE_ROWS;
    // The router rows and the norm weight do not depend on the previous kernel: the thread's
    // first chunk of each is requested before the wait, so their HBM latency overlaps that
    // kernel's tail instead of following the norm.
    const int first_col = threadIdx.x * 8;
    Vec8<bf16> early_rows[ROUTE_ROWS], early_scales;
    if (first_col < hidden) {
#pragma unroll
        for (int r = 0; r < ROUTE_ROWS; ++r)
            early_rows[r].raw =
                load_streaming_early(router + (long long)min(first + r, num_experts - 1) * hidden + first_col);
        early_scales.raw = load_streaming_early(norm_weight + first_col);
    }
    dependent_launch_entry();
    for (int n = 0; n < num_tokens; ++n) {
        const float total = block_sum(
            [&] {
                float sum = 0.0f;
                for (int col = threadIdx.x * 8; col < hidden; col += ROUTE_THREADS * 8) {
                    float values[8];
                    load8(x + (long long)n * hidden + col, values);
#pragma unroll
                    for (int i = 0; i < 8; ++i) sum += values[i] * values[i];
                }
                return sum;
            }(),
            scratch);
        if (threadIdx.x == 0) inverse_rms[n] = 1.0f / sqrtf(total / hidden + eps);
    }
    __syncthreads();
    float acc[ROUTE_ROWS][ROUTE_MAX_TOKENS];
#pragma unroll
    for (int r = 0; r < ROUTE_ROWS; ++r)
#pragma unroll
        for (int n = 0; n < ROUTE_MAX_TOKENS; ++n) acc[r][n] = 0.0f;
    for (int col = first_col; col < hidden; col += ROUTE_THREADS * 8) {
        float weights[ROUTE_ROWS][8], scales[8];
        if (col == first_col) {
#pragma unroll
            for (int r = 0; r < ROUTE_ROWS; ++r) early_rows[r].to_floats(weights[r]);
            early_scales.to_floats(scales);
        } else {
#pragma unroll
            for (int r = 0; r < ROUTE_ROWS; ++r)
                load8(router + (long long)min(first + r, num_experts - 1) * hidden + col, weights[r]);
            load8(norm_weight + col, scales);
        }
#pragma unroll
        for (int n = 0; n < ROUTE_MAX_TOKENS; ++n) {
            if (n < num_tokens) {
                float values[8];
                load8(x + (long long)n * hidden + col, values);
#pragma unroll
                for (int i = 0; i < 8; ++i) values[i] = round_bf16(values[i] * inverse_rms[n] * scales[i]);
                if (blockIdx.x == 0) store8(normed + (long long)n * hidden + col, values);
#pragma unroll
                for (int r = 0; r < ROUTE_ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][n] = fmaf(weights[r][i], values[i], acc[r][n]);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < ROUTE_MAX_TOKENS; ++n) {
        if (n >= num_tokens) break;  // uniform: the warp reductions of live tokens only
#pragma unroll
        for (int r = 0; r < ROUTE_ROWS; ++r) {
            const float total = warp_sum(acc[r][n]);
            if (lane == 0) partial[warp][r][n] = total;
        }
    }
    __syncthreads();
    if (threadIdx.x < ROUTE_ROWS * ROUTE_MAX_TOKENS) {
        const int r = threadIdx.x / ROUTE_MAX_TOKENS, n = threadIdx.x % ROUTE_MAX_TOKENS;
        const int expert = first + r;
        if (expert < num_experts && n < num_tokens) {
            float total = router_bias != nullptr ? to_float(router_bias[expert]) : 0.0f;
#pragma unroll
            for (int j = 0; j < ROUTE_THREADS / 32; ++j) total += partial[j][r][n];
            logits[(long long)n * num_experts + expert] = total;
        }
    }
    if (logits_only || !last_block_done(counter, gridDim.x)) return;  // logits_only: see LocalRoute
    __shared__ int routed_ids[ROUTE_MAX_TOKENS * 16];  // top_k <= 16 (MOE_MAX_SLOT_PAIRS)
    if (warp < num_tokens)
        route_token(logits + (long long)warp * num_experts, selection_bias, num_experts, top_k, sigmoid_scoring,
                    renormalize, scaling, expert_ids + (long long)warp * top_k,
                    expert_weights + (long long)warp * top_k, routed_ids + warp * top_k);
    if (slot_table == nullptr) return;
    __syncthreads();  // the block's ids are written
    build_slot_table(expert_ids, num_tokens * top_k, first_expert, held_experts, routed_slots, slot_table,
                     routed_ids);
}

extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_small(const bf16* x, const bf16* norm_weight, float eps, const bf16* router, const bf16* router_bias,
                    const float* selection_bias, bf16* normed, float* logits, unsigned* counter, int* expert_ids,
                    float* expert_weights, int num_tokens, int hidden, int num_experts, int top_k,
                    int sigmoid_scoring, int renormalize, float scaling, int* slot_table, int first_expert,
                    int held_experts, int routed_slots, int logits_only) {
    moe_route_small_impl(x, norm_weight, eps, router, router_bias, selection_bias, normed, logits, counter,
                         expert_ids, expert_weights, num_tokens, hidden, num_experts, top_k, sigmoid_scoring,
                         renormalize, scaling, slot_table, first_expert, held_experts, routed_slots, logits_only);
}

// The token whose row a pair reads: t for routed pair t k + j, t for shared pair num_pairs + t.
__device__ __forceinline__ int token_of_pair(int pair, int num_pairs, int top_k) {
    return pair >= num_pairs ? pair - num_pairs : pair / top_k;
}

// A weight chunk read once: no L1 allocation (as gemv.cu's weight loads), and in L2 first to go
// (`policy` = l2_evict_first()), so what the step reads again (activations, the slot table) stays.
template <typename T>
__device__ __forceinline__ uint4 load_weights(const T* p, u64 policy) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(policy));
    return v;
}

// A grouped GEMV's two weight rows of a lane (its mma tile's rows g and g + 8): bf16, or E4M3
// with the rows' scales (per channel: the row's; BLOCK: its row of 128-column tile scales).
struct Bf16Rows {
    const bf16* a;
    const bf16* b;
};

template <bool BLOCK>
struct Fp8Rows {
    const fp8_e4m3* a;
    const fp8_e4m3* b;
    const float* scale_a;
    const float* scale_b;
};

// acc (rows g, g + 8; columns 2t, 2t + 1) += W[16 rows, K] x[8 columns, K]^T, with the k order
// inside each 32-wide chunk permuted alike for both (gemv.cu's gemv_mma). The block's warps split
// K in chunks of 32; a lane whose chunk lies past K contributes zeros (K % 8 == 0). BATCH chunks
// a round.
template <int KWARPS, int BATCH = 4>
__device__ __forceinline__ void grouped_mma_rows(float* acc, Bf16Rows rows, const bf16* x_row, bool has_column,
                                                 int inner, int kwarp) {
    const bf16* row_a = rows.a;
    const bf16* row_b = rows.b;
    const int lane = threadIdx.x & 31;
    const int t = lane & 3;
    constexpr int STEP = KWARPS * 32;
    auto multiply = [&](uint4 wa, uint4 wb, uint4 xs) {
        const u32 a0[4] = {wa.x, wb.x, wa.y, wb.y};
        const u32 b0[2] = {xs.x, xs.y};
        mma_bf16_16816(acc, a0, b0);
        const u32 a1[4] = {wa.z, wb.z, wa.w, wb.w};
        const u32 b1[2] = {xs.z, xs.w};
        mma_bf16_16816(acc, a1, b1);
    };
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const u64 policy = l2_evict_first();
    // Every round requests BATCH chunks before its products, the last round's chunks past K
    // predicated off: a K of a few chunks a warp (an expert's down rows, I = 768 over 4 warps:
    // 6) takes two rounds of loads in flight, not one round trip a chunk.
    for (int k0 = kwarp * 32; k0 < inner; k0 += BATCH * STEP) {
        uint4 wa[BATCH], wb[BATCH], xs[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int k = k0 + u * STEP + 8 * t;
            const bool valid = k < inner;
            wa[u] = valid ? load_weights(row_a + k, policy) : zero;
            wb[u] = valid ? load_weights(row_b + k, policy) : zero;
            xs[u] = valid && has_column ? *reinterpret_cast<const uint4*>(x_row + k) : zero;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) multiply(wa[u], wb[u], xs[u]);
    }
}

// grouped_mma_rows over E4M3 rows with their scales. The warps split K in chunks of 64: a lane
// loads 16 bytes (16 weights) of each row and 32 bytes of its token's x at k0 + 16 t, for four
// mma steps in gemv_fp8.cu's gemv_fp8_mma order, each E4M3 pair an exact bf16 pair. Block scales
// multiply each chunk's products (a chunk never crosses a 128-column tile), channel scales the
// sum at the end. K % 16 == 0. BATCH chunks a round: x takes twice the weights' bytes a lane, so
// the down kernels (64 registers for 8 blocks an SM) hold two chunks (64 bytes of weights in
// flight, half the bf16 kernels'), moe_gate_up (80) four, as its bf16 form (MOE_GATE_UP_BATCH).
template <int KWARPS, int BATCH = 2, bool BLOCK>
__device__ __forceinline__ void grouped_mma_rows(float* acc, Fp8Rows<BLOCK> rows, const bf16* x_row, bool has_column,
                                                 int inner, int kwarp) {
#if ATLAS_HAS_FP8
    const fp8_e4m3* row_a = rows.a;
    const fp8_e4m3* row_b = rows.b;
    const int lane = threadIdx.x & 31;
    const int t = lane & 3;
    constexpr int CHUNK = 64, STEP = KWARPS * CHUNK;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const u64 policy = l2_evict_first();
    for (int k0 = kwarp * CHUNK; k0 < inner; k0 += BATCH * STEP) {
        uint4 wa[BATCH], wb[BATCH], x_lo[BATCH], x_hi[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int k = k0 + u * STEP + 16 * t;
            const bool valid = k < inner, take = valid && has_column;
            wa[u] = valid ? load_weights(row_a + k, policy) : zero;
            wb[u] = valid ? load_weights(row_b + k, policy) : zero;
            x_lo[u] = take ? *reinterpret_cast<const uint4*>(x_row + k) : zero;
            x_hi[u] = take ? *reinterpret_cast<const uint4*>(x_row + k + 8) : zero;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const u32 xs[8] = {x_lo[u].x, x_lo[u].y, x_lo[u].z, x_lo[u].w, x_hi[u].x, x_hi[u].y, x_hi[u].z, x_hi[u].w};
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            fp8_mma_chunk(BLOCK ? part : acc, wa[u], wb[u], xs);
            const int chunk = k0 + u * STEP;  // the same for the warp: its scale reads are uniform
            if (BLOCK && chunk < inner) {
                const float sa = __ldg(rows.scale_a + (chunk >> 7)), sb = __ldg(rows.scale_b + (chunk >> 7));
                acc[0] = fmaf(sa, part[0], acc[0]);
                acc[1] = fmaf(sa, part[1], acc[1]);
                acc[2] = fmaf(sb, part[2], acc[2]);
                acc[3] = fmaf(sb, part[3], acc[3]);
            }
        }
    }
    if (!BLOCK) {
        const float sa = __ldg(rows.scale_a), sb = __ldg(rows.scale_b);
        acc[0] *= sa;
        acc[1] *= sa;
        acc[2] *= sb;
        acc[3] *= sb;
    }
#else
    __trap();  // the host offers FP8 experts from sm_89 on
#endif
}

// ---------------------------------------------------------------------------------------------
// The experts' weights as the kernels read them (the host's ExpertWeights): a stack [E, rows, K]
// of bf16 (a plain pointer), or of E4M3 bytes with f32 multipliers (Fp8Experts) per channel
// [E, rows] or per 128 x 128 tile (BLOCK) [E, ceil(rows / 128), ceil(K / 128)]. A shared expert
// is a stack of one. pick_expert<PARTS>(routed, shared, is_shared, e, rows, inner): routed expert
// e's matrix [PARTS rows, inner] (gate_up: PARTS 2, its gate and up rows), or the shared expert's,
// as a stack of one; expert_rows(w, a, b, width): its rows a and b (`width` long), the grouped
// GEMV's rows g and g + 8 of an mma tile (grouped_mma_rows's).
template <int PARTS>
__device__ __forceinline__ const bf16* pick_expert(const bf16* routed, const bf16* shared, bool is_shared, int e,
                                                   int rows, int inner) {
    return is_shared ? shared : routed + (long long)e * PARTS * rows * inner;
}

__device__ __forceinline__ Bf16Rows expert_rows(const bf16* w, int a, int b, int width) {
    return {w + (long long)a * width, w + (long long)b * width};
}

template <bool BLOCK>
struct Fp8Experts {
    const fp8_e4m3* data;
    const float* scales;
};

template <int PARTS, bool BLOCK>
__device__ __forceinline__ Fp8Experts<BLOCK> pick_expert(Fp8Experts<BLOCK> routed, Fp8Experts<BLOCK> shared,
                                                         bool is_shared, int e, int rows, int inner) {
    const int count = BLOCK ? ((PARTS * rows + 127) >> 7) * ((inner + 127) >> 7) : PARTS * rows;
    return {is_shared ? shared.data : routed.data + (long long)e * PARTS * rows * inner,
            is_shared ? shared.scales : routed.scales + (long long)e * count};
}

// where row r's scale (BLOCK: its row of tile scales) is, in a matrix of rows `width` long
template <bool BLOCK>
__device__ __forceinline__ int fp8_scale_offset(int r, int width) {
    return BLOCK ? (r >> 7) * ((width + 127) >> 7) : r;
}

template <bool BLOCK>
__device__ __forceinline__ Fp8Rows<BLOCK> expert_rows(Fp8Experts<BLOCK> w, int a, int b, int width) {
    return {w.data + (long long)a * width, w.data + (long long)b * width, w.scales + fp8_scale_offset<BLOCK>(a, width),
            w.scales + fp8_scale_offset<BLOCK>(b, width)};
}

// moe_gate_up_<act>: grid (ceil(max(I, Is) / 8), slots), MOE_WARPS warps. hidden [P, stride].
// The shared slot's blocks also take the shared expert's gate, sigmoid(normed[t] . shared_gate),
// block x for tokens x, x + gridDim.x, ... (at most one each up to 8 gridDim.x tokens), into
// shared_gate_values [N] for moe_down's combine (null shared_gate: none).
template <int ACT, typename W>
__device__ __forceinline__ void moe_gate_up_impl(const bf16* __restrict__ normed, int* __restrict__ slot_table,
                                                 W gate_up, const bf16* __restrict__ gate_up_bias,
                                                 W shared_gate_up, bf16* __restrict__ hidden_out,
                                                 int num_tokens, int top_k, int num_experts, int hidden, int inner,
                                                 int shared_inner, int stride, int routed_slots, float alpha,
                                                 float limit, const bf16* __restrict__ shared_gate,
                                                 float* __restrict__ shared_gate_values, const LocalRoute& route,
                                                 int first_expert, int* expert_ids, float* expert_weights) {
    __shared__ SlotPairs slot_pairs;
    __shared__ float partial[MOE_WARPS][16][8];
    const int num_pairs = num_tokens * top_k;
    if (route.logits != nullptr) {  // one token, routed here (LocalRoute)
        __shared__ int ids[16];
        __shared__ float weights[16];
        const bool writes = blockIdx.x == 0 && blockIdx.y == 0;
        route_slot(route, top_k, first_expert, num_experts, routed_slots, slot_pairs, blockIdx.y, ids, weights, false,
                   writes ? expert_ids : nullptr, writes ? expert_weights : nullptr);
        if (blockIdx.x == 0 && blockIdx.y < routed_slots && threadIdx.x == 0) {  // moe_down's slot, past its wait
            int* entry = slot_table + blockIdx.y * MOE_SLOT_INTS;
            entry[0] = slot_pairs.expert;
            entry[1] = slot_pairs.count;
            entry[2] = blockIdx.y;
        }
    } else {
        read_slot(slot_table, num_pairs, num_tokens, num_experts, routed_slots, slot_pairs, blockIdx.y);
    }
    const int expert = slot_pairs.expert, count = slot_pairs.count;
    if (expert < 0) return;
    const bool is_shared = expert == num_experts;
    if (is_shared && shared_gate != nullptr) {
        for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
            float dot = 0.0f;
            for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
                float values[8], weights[8];
                load8(normed + (long long)t * hidden + col, values);
                load8(shared_gate + col, weights);
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = fmaf(values[i], weights[i], dot);
            }
            const float total = block_sum(dot, &partial[0][0][0]);
            if (threadIdx.x == 0) shared_gate_values[t] = 1.0f / (1.0f + expf(-total));
        }
    }
    const int features = is_shared ? shared_inner : inner;
    const int first = blockIdx.x * 8;
    if (first >= features) return;
    const W w = pick_expert<2>(gate_up, shared_gate_up, is_shared, expert, inner, hidden);
    const bf16* bias = is_shared || gate_up_bias == nullptr ? nullptr : gate_up_bias + (long long)expert * 2 * inner;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int feature_g = min(first + g, features - 1);
    const auto rows = expert_rows(w, feature_g, features + feature_g, hidden);  // the gate row of feature g, its up row
    for (int tile = 0; tile < count; tile += 8) {
        const bool has_column = tile + g < count;
        const int token = has_column ? token_of_pair(slot_pairs.pairs[tile + g], num_pairs, top_k) : 0;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        grouped_mma_rows<MOE_WARPS, MOE_GATE_UP_BATCH>(acc, rows, normed + (long long)token * hidden, has_column,
                                                       hidden, warp);
        store_mma_tile(partial[warp], acc, g, t);
        __syncthreads();
        if (threadIdx.x < 64) {
            const int f = threadIdx.x >> 3, n = threadIdx.x & 7;
            const int feature = first + f;
            if (feature < features && tile + n < count) {
                float gate = bias != nullptr ? to_float(bias[feature]) : 0.0f;
                float up = bias != nullptr ? to_float(bias[inner + feature]) : 0.0f;
#pragma unroll
                for (int j = 0; j < MOE_WARPS; ++j) {
                    gate += partial[j][f][n];
                    up += partial[j][f + 8][n];
                }
                const float value = gated_value<ACT>(round_bf16(gate), round_bf16(up), alpha, limit);
                hidden_out[(long long)slot_pairs.pairs[tile + n] * stride + feature] = from_float<bf16>(value);
            }
        }
        __syncthreads();  // `partial` is free for the next tile
    }
}

template <typename W>
__device__ __forceinline__ void moe_down_rows(const bf16* __restrict__ hidden_in, W down,
                                              const bf16* __restrict__ down_bias, W shared_down,
                                              float* __restrict__ y, const SlotPairs& slot_pairs,
                                              float (*partial)[16][8], int num_experts, int hidden, int inner,
                                              int shared_inner, int stride, int first);

// moe_down: grid (ceil(H / MOE_DOWN_ROWS), slots), MOE_WARPS warps. y [P, H] f32. The last of a row tile's
// blocks (every slot's, counted at counters[blockIdx.x], zero between launches) adds the tile's
// MOE_DOWN_ROWS rows of every token into the residual: the weighted sum of its k pairs' rows of y and its
// shared expert's row times shared_gate_values[t] (null: 1), as moe_combine does.
template <typename W>
__device__ __forceinline__ void moe_down_impl(const bf16* __restrict__ hidden_in, const int* __restrict__ slot_table,
                                              const int* __restrict__ expert_ids, int first_expert,
                                              W down, const bf16* __restrict__ down_bias,
                                              W shared_down, float* __restrict__ y, int num_tokens,
                                              int top_k, int num_experts, int hidden, int inner, int shared_inner,
                                              int stride, int routed_slots, const float* __restrict__ expert_weights,
                                              const float* shared_gate_values, int has_shared,
                                              bf16* __restrict__ residual, unsigned* __restrict__ counters,
                                              int accumulate, const LocalRoute& route) {
    __shared__ SlotPairs slot_pairs;
    __shared__ float partial[MOE_WARPS][16][8];
    __shared__ int local_ids[16];
    __shared__ float local_weights[16];
    const int num_pairs = num_tokens * top_k;
    // Before the wait (see read_slot, LocalRoute): the slot; only hidden_in needs moe_gate_up. The
    // block's weight rows are not asked of L2 here: blocks of this kernel fit beside moe_gate_up's
    // from its start, and their requests slowed its stream more than they sped this kernel's (H200,
    // Qwen3-30B-A3B batch 1: step 2,810-2,815 us with them, 2,750 without; docs/lab/moe-decode.md).
    const bool routes = route.logits != nullptr && route.num_experts <= MOE_LOCAL_ROUTE_MAX_DOWN_EXPERTS;
    if (routes) {  // every block may be its row tile's last: each keeps the weights
        route_slot(route, top_k, first_expert, num_experts, routed_slots, slot_pairs, blockIdx.y, local_ids,
                   local_weights, true);
        expert_ids = local_ids;
        expert_weights = local_weights;
    } else if (route.logits == nullptr) {
        read_slot(slot_table, num_pairs, num_tokens, num_experts, routed_slots, slot_pairs, blockIdx.y);
    }
    dependent_launch_entry();
    if (route.logits != nullptr && !routes)  // the slot moe_gate_up wrote (LocalRoute)
        read_slot(slot_table, num_pairs, num_tokens, num_experts, routed_slots, slot_pairs, blockIdx.y);
    const int expert = slot_pairs.expert;
    const int first = blockIdx.x * MOE_DOWN_ROWS;
    if (expert >= 0) moe_down_rows(hidden_in, down, down_bias, shared_down, y, slot_pairs, partial, num_experts, hidden,
                                   inner, shared_inner, stride, first);
    if (!last_block_done(counters + blockIdx.x, gridDim.y)) return;
    for (int item = threadIdx.x; item < num_tokens * MOE_DOWN_ROWS; item += blockDim.x) {
        const int token = item / MOE_DOWN_ROWS, row = first + item % MOE_DOWN_ROWS;
        if (row >= hidden) continue;
        float total = 0.0f;
        for (int j0 = 0; j0 < top_k; j0 += 4) {  // four pairs' loads in flight, summed in k order
            float weight[4], value[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const long long pair = (long long)token * top_k + j0 + u;
                const bool use = j0 + u < top_k && held(expert_ids[pair] - first_expert, num_experts);
                weight[u] = use ? expert_weights[pair] : 0.0f;
                value[u] = use ? __ldcg(y + pair * hidden + row) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) total = fmaf(weight[u], value[u], total);
        }
        if (has_shared) {
            const float gate = shared_gate_values != nullptr ? __ldcg(shared_gate_values + token) : 1.0f;
            total = fmaf(gate, __ldcg(y + ((long long)num_pairs + token) * hidden + row), total);
        }
        bf16* at = residual + (long long)token * hidden + row;
        *at = from_float<bf16>((accumulate ? to_float(*at) : 0.0f) + round_bf16(total));
    }
}

// The MOE_DOWN_ROWS rows of y from `first` for the slot's pairs (the expert's down rows, streamed once per 8
// of its tokens).
template <typename W>
__device__ __forceinline__ void moe_down_rows(const bf16* __restrict__ hidden_in, W down,
                                              const bf16* __restrict__ down_bias, W shared_down,
                                              float* __restrict__ y, const SlotPairs& slot_pairs,
                                              float (*partial)[16][8], int num_experts, int hidden, int inner,
                                              int shared_inner, int stride, int first) {
    const int expert = slot_pairs.expert, count = slot_pairs.count;
    const bool is_shared = expert == num_experts;
    const int reduced = is_shared ? shared_inner : inner;
    const W w = pick_expert<1>(down, shared_down, is_shared, expert, hidden, inner);
    const bf16* bias = is_shared || down_bias == nullptr ? nullptr : down_bias + (long long)expert * hidden;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // warp w: rows 16 (w / DOWN_KWARPS) .. + 15 of the block's, K part w % DOWN_KWARPS
    constexpr int DOWN_KWARPS = MOE_WARPS * 16 / MOE_DOWN_ROWS;
    const int group_first = first + 16 * (warp / DOWN_KWARPS);
    const auto rows = expert_rows(w, min(group_first + g, hidden - 1), min(group_first + g + 8, hidden - 1), reduced);
    for (int tile = 0; tile < count; tile += 8) {
        const bool has_column = tile + g < count;
        const int pair = has_column ? slot_pairs.pairs[tile + g] : 0;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        grouped_mma_rows<DOWN_KWARPS>(acc, rows, hidden_in + (long long)pair * stride, has_column, reduced,
                                            warp % DOWN_KWARPS);
        store_mma_tile(partial[warp], acc, g, t);
        __syncthreads();
        for (int item = threadIdx.x; item < MOE_DOWN_ROWS * 8; item += blockDim.x) {
            const int r = item >> 3, n = item & 7;
            const int row = first + r;
            if (row < hidden && tile + n < count) {
                float total = bias != nullptr ? to_float(bias[row]) : 0.0f;
                const int group = r >> 4;
#pragma unroll
                for (int j = 0; j < DOWN_KWARPS; ++j) total += partial[group * DOWN_KWARPS + j][r & 15][n];
                y[(long long)slot_pairs.pairs[tile + n] * hidden + row] = total;
            }
        }
        __syncthreads();
    }
}

#define DEFINE_MOE_GATE_UP(NAME, ACT)                                                                        \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_GATE_UP_MIN_BLOCKS)                   \
        moe_gate_up_##NAME(                                                                                  \
        const bf16* normed, int* slot_table, const bf16* gate_up, const bf16* gate_up_bias,           \
        const bf16* shared_gate_up, bf16* hidden_out, int num_tokens, int top_k, int num_experts, int hidden, \
        int inner, int shared_inner, int stride, int routed_slots, float alpha, float limit,                \
        const bf16* shared_gate, float* shared_gate_values, MOE_LOCAL_ROUTE_PARAMS, int first_expert,       \
        int* expert_ids, float* expert_weights) {                                                           \
        dependent_launch_entry();                                                                           \
        moe_gate_up_impl<ACT>(normed, slot_table, gate_up, gate_up_bias,                       \
                              shared_gate_up, hidden_out, num_tokens, top_k, num_experts,      \
                              hidden, inner, shared_inner, stride, routed_slots, alpha, limit, shared_gate, \
                              shared_gate_values, MOE_LOCAL_ROUTE, first_expert, expert_ids,               \
                              expert_weights);                                                              \
    }

DEFINE_MOE_GATE_UP(silu, GATED_SILU)
DEFINE_MOE_GATE_UP(gelu_tanh, GATED_GELU_TANH)
DEFINE_MOE_GATE_UP(clamped, GATED_CLAMPED)

// moe_gate_up_fp8[_blk]_<act>: moe_gate_up_<act> over E4M3 experts (and an E4M3 shared expert in
// the same layout), each weight followed by its scales (Fp8Experts).
#define DEFINE_MOE_GATE_UP_FP8(NAME, ACT, SUFFIX, BLOCK)                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_GATE_UP_MIN_BLOCKS)                   \
        moe_gate_up_fp8##SUFFIX##_##NAME(                                                                    \
        const bf16* normed, int* slot_table, const fp8_e4m3* gate_up, const float* gate_up_scales,    \
        const bf16* gate_up_bias, const fp8_e4m3* shared_gate_up, const float* shared_gate_up_scales,       \
        bf16* hidden_out, int num_tokens, int top_k, int num_experts, int hidden, int inner,                \
        int shared_inner, int stride, int routed_slots, float alpha, float limit, const bf16* shared_gate,  \
        float* shared_gate_values, MOE_LOCAL_ROUTE_PARAMS, int first_expert, int* expert_ids,               \
        float* expert_weights) {                                                                            \
        dependent_launch_entry();                                                                           \
        moe_gate_up_impl<ACT>(normed, slot_table, Fp8Experts<BLOCK>{gate_up, gate_up_scales}, gate_up_bias, \
                              Fp8Experts<BLOCK>{shared_gate_up, shared_gate_up_scales}, hidden_out,         \
                              num_tokens, top_k, num_experts, hidden, inner, shared_inner, stride,          \
                              routed_slots, alpha, limit, shared_gate, shared_gate_values, MOE_LOCAL_ROUTE, \
                              first_expert, expert_ids, expert_weights);                                    \
    }

DEFINE_MOE_GATE_UP_FP8(silu, GATED_SILU, , false)
DEFINE_MOE_GATE_UP_FP8(silu, GATED_SILU, _blk, true)

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_DOWN_MIN_BLOCKS)
    moe_down(const bf16* hidden_in, const int* slot_table, const int* expert_ids, int first_expert, const bf16* down,
             const bf16* down_bias, const bf16* shared_down, float* y, int num_tokens, int top_k, int num_experts,
             int hidden, int inner, int shared_inner, int stride, int routed_slots, const float* expert_weights,
             const float* shared_gate_values, int has_shared, bf16* residual, unsigned* counters, int accumulate,
             MOE_LOCAL_ROUTE_PARAMS) {
    moe_down_impl(hidden_in, slot_table, expert_ids, first_expert, down, down_bias,
                  shared_down, y, num_tokens, top_k, num_experts, hidden, inner, shared_inner, stride,
                  routed_slots, expert_weights, shared_gate_values, has_shared, residual, counters, accumulate,
                  MOE_LOCAL_ROUTE);
}

// moe_down_fp8[_blk]: moe_down over E4M3 experts, each weight followed by its scales.
#define DEFINE_MOE_DOWN_FP8(SUFFIX, BLOCK)                                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_DOWN_MIN_BLOCKS) moe_down_fp8##SUFFIX(   \
        const bf16* hidden_in, const int* slot_table, const int* expert_ids, int first_expert,                 \
        const fp8_e4m3* down, const float* down_scales, const bf16* down_bias, const fp8_e4m3* shared_down,    \
        const float* shared_down_scales, float* y, int num_tokens, int top_k, int num_experts, int hidden,     \
        int inner, int shared_inner, int stride, int routed_slots, const float* expert_weights,                \
        const float* shared_gate_values, int has_shared, bf16* residual, unsigned* counters, int accumulate,   \
        MOE_LOCAL_ROUTE_PARAMS) {                                                                              \
        moe_down_impl(hidden_in, slot_table, expert_ids, first_expert, Fp8Experts<BLOCK>{down, down_scales},   \
                      down_bias, Fp8Experts<BLOCK>{shared_down, shared_down_scales}, y, num_tokens, top_k,     \
                      num_experts, hidden, inner, shared_inner, stride, routed_slots, expert_weights,          \
                      shared_gate_values, has_shared, residual, counters, accumulate, MOE_LOCAL_ROUTE);        \
    }

DEFINE_MOE_DOWN_FP8(, false)
DEFINE_MOE_DOWN_FP8(_blk, true)

// moe_down_looped: the down GEMV past ROUTE_MAX_TOKENS tokens, where a step touches most experts
// (batch 64 of Qwen3-30B-A3B: 127 of 128) and moe_down's block per (row tile, slot) spends as
// long on its slot read, fence and counter as on its 24 KB of rows. grid (ceil(H / 16), groups):
// a block takes the row tile's rows of slots g, g + groups, ... in turn and keeps each token's
// weighted sum of them in shared memory (a token's pairs lie in distinct slots, so no two
// threads add to one sum at once), then writes partial[g][t][rows] (f32 [groups, N, H]); the
// row tile's last block adds the groups' partials in group order (deterministic) into the
// residual. Pair weights: expert_weights (routed), shared_gate_values[t] or 1 (shared).
template <typename W>
__device__ __forceinline__ void moe_down_looped_impl(const bf16* __restrict__ hidden_in,
                                                     const int* __restrict__ slot_table, W down,
                                                     const bf16* __restrict__ down_bias, W shared_down,
                                                     float* __restrict__ partial_out, int num_tokens, int top_k,
                                                     int num_experts, int hidden, int inner, int shared_inner,
                                                     int stride, int routed_slots, int slots,
                                                     const float* __restrict__ expert_weights,
                                                     const float* shared_gate_values, bf16* __restrict__ residual,
                                                     unsigned* __restrict__ counters, int accumulate) {
    __shared__ SlotPairs slot_pairs;
    __shared__ float partial[MOE_WARPS][16][8];
    __shared__ float sums[MOE_MAX_SLOT_TOKENS][16];
    const int num_pairs = num_tokens * top_k;
    const int first = blockIdx.x * 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    for (int i = threadIdx.x; i < num_tokens * 16; i += blockDim.x) sums[i >> 4][i & 15] = 0.0f;
    for (int slot = blockIdx.y; slot < slots; slot += gridDim.y) {
        read_slot(slot_table, num_pairs, num_tokens, num_experts, routed_slots, slot_pairs, slot);
        const int expert = slot_pairs.expert, count = slot_pairs.count;
        if (expert >= 0) {
            const bool is_shared = expert == num_experts;
            const int reduced = is_shared ? shared_inner : inner;
            const W w = pick_expert<1>(down, shared_down, is_shared, expert, hidden, inner);
            const bf16* bias = is_shared || down_bias == nullptr ? nullptr : down_bias + (long long)expert * hidden;
            const auto rows = expert_rows(w, min(first + g, hidden - 1), min(first + g + 8, hidden - 1), reduced);
            for (int tile = 0; tile < count; tile += 8) {
                const bool has_column = tile + g < count;
                const int pair = has_column ? slot_pairs.pairs[tile + g] : 0;
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                grouped_mma_rows<MOE_WARPS>(acc, rows, hidden_in + (long long)pair * stride, has_column, reduced,
                                                  warp);
                store_mma_tile(partial[warp], acc, g, t);
                __syncthreads();
                if (threadIdx.x < 128) {
                    const int r = threadIdx.x >> 3, n = threadIdx.x & 7;
                    const int row = first + r;
                    if (row < hidden && tile + n < count) {
                        float value = bias != nullptr ? to_float(bias[row]) : 0.0f;
#pragma unroll
                        for (int j = 0; j < MOE_WARPS; ++j) value += partial[j][r][n];
                        const int pair_n = slot_pairs.pairs[tile + n];
                        const int token = token_of_pair(pair_n, num_pairs, top_k);
                        const float weight = is_shared ? (shared_gate_values != nullptr ? shared_gate_values[token] : 1.0f)
                                                       : expert_weights[pair_n];
                        sums[token][r] = fmaf(weight, value, sums[token][r]);
                    }
                }
                __syncthreads();  // `partial` is free for the next tile
            }
        }
        __syncthreads();  // slot_pairs is free for the next slot
    }
    float* mine = partial_out + (long long)blockIdx.y * num_tokens * hidden;
    for (int i = threadIdx.x; i < num_tokens * 16; i += blockDim.x) {
        const int token = i >> 4, row = first + (i & 15);
        if (row < hidden) mine[(long long)token * hidden + row] = sums[token][i & 15];
    }
    if (!last_block_done(counters + blockIdx.x, gridDim.y)) return;
    for (int i = threadIdx.x; i < num_tokens * 16; i += blockDim.x) {
        const int token = i >> 4, row = first + (i & 15);
        if (row >= hidden) continue;
        float total = 0.0f;
        for (int group = 0; group < gridDim.y; ++group)
            total += __ldcg(partial_out + ((long long)group * num_tokens + token) * hidden + row);
        bf16* at = residual + (long long)token * hidden + row;
        *at = from_float<bf16>((accumulate ? to_float(*at) : 0.0f) + round_bf16(total));
    }
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_DOWN_MIN_BLOCKS)
    moe_down_looped(const bf16* __restrict__ hidden_in, const int* __restrict__ slot_table,
                    const bf16* __restrict__ down, const bf16* __restrict__ down_bias,
                    const bf16* __restrict__ shared_down, float* __restrict__ partial_out, int num_tokens, int top_k,
                    int num_experts, int hidden, int inner, int shared_inner, int stride, int routed_slots,
                    int slots, const float* __restrict__ expert_weights, const float* shared_gate_values,
                    bf16* __restrict__ residual, unsigned* __restrict__ counters, int accumulate) {
    dependent_launch_entry();
    moe_down_looped_impl(hidden_in, slot_table, down, down_bias, shared_down, partial_out,
                         num_tokens, top_k, num_experts, hidden, inner, shared_inner, stride, routed_slots, slots,
                         expert_weights, shared_gate_values, residual, counters, accumulate);
}

// moe_down_looped_fp8[_blk]: moe_down_looped over E4M3 experts, each weight followed by its scales.
#define DEFINE_MOE_DOWN_LOOPED_FP8(SUFFIX, BLOCK)                                                                \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MOE_DOWN_MIN_BLOCKS)                          \
        moe_down_looped_fp8##SUFFIX(                                                                           \
        const bf16* hidden_in, const int* slot_table, const fp8_e4m3* down, const float* down_scales,          \
        const bf16* down_bias, const fp8_e4m3* shared_down, const float* shared_down_scales,                   \
        float* partial_out, int num_tokens, int top_k, int num_experts, int hidden, int inner,                 \
        int shared_inner, int stride, int routed_slots, int slots, const float* expert_weights,                \
        const float* shared_gate_values, bf16* residual, unsigned* counters, int accumulate) {                 \
        dependent_launch_entry();                                                                               \
        moe_down_looped_impl(hidden_in, slot_table, Fp8Experts<BLOCK>{down, down_scales}, down_bias,           \
                             Fp8Experts<BLOCK>{shared_down, shared_down_scales}, partial_out, num_tokens,      \
                             top_k, num_experts, hidden, inner, shared_inner, stride, routed_slots, slots,     \
                             expert_weights, shared_gate_values, residual, counters, accumulate);              \
    }

DEFINE_MOE_DOWN_LOOPED_FP8(, false)
DEFINE_MOE_DOWN_LOOPED_FP8(_blk, true)

// ---------------------------------------------------------------------------------------------
// moe_shift_ids: local[p] = expert_ids[p] - first_expert (an expert-parallel rank holding experts
// first_expert .. first_expert + E - 1: the others' ids leave [0, E) and are skipped).
extern "C" __global__ void __launch_bounds__(256)
    moe_shift_ids(const int* expert_ids, int* local_ids, int num_pairs, int first_expert) {
    dependent_launch_entry();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < num_pairs) local_ids[p] = expert_ids[p] - first_expert;
}

// ---------------------------------------------------------------------------------------------
// Prefill: alignment and the grouped GEMM.
//
// moe_align: one block of 1024 threads. Groups are the E experts, then (has_shared) the shared
// expert as group E. offsets [groups + 1] (pair positions), tile_starts [groups + 1] (tiles of
// GEMM_BM rows before each group), sorted_pairs [N k + N]: pair ids, grouped (in arrival order
// within a group: every pair's result is computed alike whatever its row in a tile).
#define GEMM_BM 128  // rows (pairs) a tile
#define GEMM_BN 128  // weight rows a tile (gate_up: 64 features' gate and up rows, interleaved)
#define GEMM_BK 32
#define GEMM_STAGES 3
#define GEMM_THREADS 128  // 4 warps, 2 along M x 2 along N, each a 64 x 64 tile
#define GEMM_STRIDE (GEMM_BK + 8)  // padded rows (80 bytes): conflict-free ldmatrix and 16-byte cp.async
#define GEMM_SHARED_BYTES (GEMM_STAGES * (GEMM_BM + GEMM_BN) * GEMM_STRIDE * 2)  // 61440: dynamic

extern "C" __global__ void __launch_bounds__(1024)
    moe_align(const int* expert_ids, int num_tokens, int top_k, int num_experts, int has_shared, int* offsets,
              int* tile_starts, int* sorted_pairs) {
    dependent_launch_entry();
    __shared__ int counts[MOE_MAX_EXPERTS + 1];
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];
    const int num_pairs = num_tokens * top_k;
    const int groups = num_experts + (has_shared ? 1 : 0);
    for (int e = threadIdx.x; e < groups; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int e = expert_ids[p];
        if (held(e, num_experts)) atomicAdd(counts + e, 1);
    }
    if (has_shared && threadIdx.x == 0) counts[num_experts] = num_tokens;
    __syncthreads();
    if (threadIdx.x == 0) {
        int offset = 0, tiles = 0;
        for (int e = 0; e < groups; ++e) {
            offsets[e] = offset;
            tile_starts[e] = tiles;
            cursor[e] = offset;
            offset += counts[e];
            tiles += (counts[e] + GEMM_BM - 1) / GEMM_BM;
        }
        offsets[groups] = offset;
        tile_starts[groups] = tiles;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int e = expert_ids[p];
        if (held(e, num_experts)) sorted_pairs[atomicAdd(cursor + e, 1)] = p;
    }
    if (has_shared)
        for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) sorted_pairs[cursor[num_experts] + t] = num_pairs + t;
}

// The group (expert) and rows [begin, end) of sorted_pairs of GEMM tile `tile` (grid.y); group -1
// for a tile past the last.
struct GemmTile {
    int group, begin, end;
};

__device__ __forceinline__ GemmTile locate_gemm_tile(const int* offsets, const int* tile_starts, int groups, int tile) {
    GemmTile located{-1, 0, 0};
    if (tile >= tile_starts[groups]) return located;
    int lo = 0, hi = groups - 1;  // the last group whose tiles start at or before `tile`
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_starts[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    located.group = lo;
    located.begin = offsets[lo] + (tile - tile_starts[lo]) * GEMM_BM;
    located.end = min(located.begin + GEMM_BM, offsets[lo + 1]);
    return located;
}

// acc[mt][nt][c] of the tile A[GEMM_BM rows, K] B[GEMM_BN rows, K]^T: warp w (wm = w % 2, wn = w / 2)
// holds rows 64 wm + 16 mt + g (+ 8 for c >= 2) and columns 64 wn + 8 nt + 2 t + (c & 1). A's
// rows are `a_rows[i]` and B's `b_rows[i]` for the rows this thread copies (row tid / 4 + 32 i,
// chunk tid % 4; null: zeros; `fallback` is any valid global address), K % 8 == 0. GEMM_STAGES
// of cp.async over K tiles of GEMM_BK, one barrier a K tile; `shared` holds GEMM_SHARED_BYTES.
constexpr int GEMM_PASSES = GEMM_BM * (GEMM_BK / 8) / GEMM_THREADS;
extern __shared__ uint4 gemm_shared[];  // the GEMM kernels' GEMM_SHARED_BYTES

// The ldmatrix.x4 lanes of gemm_k_tile: A's 16 x 16 step (rows 0-7 | 8-15 by lane bit 3, k 0-7 |
// 8-15 by bit 4); B's two 8-row n-tiles x 16 k (k halves by lane bit 3, n-tiles by bit 4).
struct GemmLanes {
    int a_row, a_col, b_row, b_col;
};

__device__ __forceinline__ GemmLanes gemm_lanes(int lane, int warp_m, int warp_n) {
    return {warp_m * 64 + (lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8,
            warp_n * 64 + (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8};
}

// acc += one K tile's product: A [GEMM_BM][GEMM_STRIDE] and B [GEMM_BN][GEMM_STRIDE] bf16 in
// shared memory (GEMM_BK of each row used), each warp its 64 x 64.
__device__ __forceinline__ void gemm_k_tile(float (*acc)[8][4], const bf16* a_tile, const bf16* b_tile,
                                            GemmLanes lanes) {
    const int a_row = lanes.a_row, a_col = lanes.a_col, b_row = lanes.b_row, b_col = lanes.b_col;
#pragma unroll
    for (int k = 0; k < GEMM_BK / 16; ++k) {
        u32 a[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) ldmatrix_x4(a[mt], a_tile + (a_row + mt * 16) * GEMM_STRIDE + a_col + k * 16);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            u32 b[4];
            ldmatrix_x4(b, b_tile + (b_row + np * 16) * GEMM_STRIDE + b_col + k * 16);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                mma_bf16_16816(acc[mt][2 * np], a[mt], b);
                mma_bf16_16816(acc[mt][2 * np + 1], a[mt], b + 2);
            }
        }
    }
}

__device__ __forceinline__ void gemm_tile(float (*acc)[8][4], const bf16* const* a_rows, const bf16* const* b_rows,
                                          int inner, bf16* shared, const bf16* fallback) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp & 1, warp_n = warp >> 1;
    constexpr int A_TILE = GEMM_BM * GEMM_STRIDE, STAGE = (GEMM_BM + GEMM_BN) * GEMM_STRIDE;
    constexpr int CHUNKS = GEMM_BK / 8;
    const int chunk = tid % CHUNKS;
    auto load_stage = [&](int k_tile, int stage) {
        bf16* a_dst = shared + stage * STAGE;
        bf16* b_dst = a_dst + A_TILE;
        const int k = k_tile * GEMM_BK + chunk * 8;
#pragma unroll
        for (int i = 0; i < GEMM_PASSES; ++i) {
            const int r = tid / CHUNKS + i * (GEMM_THREADS / CHUNKS);
            const bool a_valid = a_rows[i] != nullptr && k < inner;
            const bool b_valid = b_rows[i] != nullptr && k < inner;
            cp_async_16(a_dst + r * GEMM_STRIDE + chunk * 8, a_valid ? a_rows[i] + k : fallback, a_valid);
            cp_async_16(b_dst + r * GEMM_STRIDE + chunk * 8, b_valid ? b_rows[i] + k : fallback, b_valid);
        }
    };
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    const int k_tiles = (inner + GEMM_BK - 1) / GEMM_BK;
    // One commit group per K tile, empty ones included, so wait_group counts tiles exactly.
#pragma unroll
    for (int stage = 0; stage < GEMM_STAGES - 1; ++stage) {
        if (stage < k_tiles) load_stage(stage, stage);
        cp_async_commit();
    }
    const GemmLanes lanes = gemm_lanes(lane, warp_m, warp_n);
    for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
        cp_async_wait<GEMM_STAGES - 2>();  // this thread's copies of k_tile have landed
        __syncthreads();                   // everyone's have, and every warp is done with k_tile - 1
        const int next = k_tile + GEMM_STAGES - 1;
        if (next < k_tiles) load_stage(next, next % GEMM_STAGES);
        cp_async_commit();
        const bf16* a_tile = shared + (k_tile % GEMM_STAGES) * STAGE;
        gemm_k_tile(acc, a_tile, a_tile + A_TILE, lanes);
    }
    cp_async_wait<0>();
}

// gemm_tile over E4M3 weight rows: B's bytes stream by cp.async into stages of their own
// ([GEMM_BN][GEMM_BK] bytes: a thread copies 16 of rows tid / 2 and tid / 2 + 64), and each
// thread widens the chunks it copied into one of two bf16 B tiles, times their scale (b_scales[j]:
// the row's, or per BLOCK its row of 128-column tile scales; a K tile never crosses one), which
// the mma steps then read as gemm_tile's. Widening rounds each weight times its scale to bf16 (a
// relative 2^-9): the price of bf16 tensor cores here, where the decode GEMVs stay exact. One
// barrier a K tile: tile k's widening writes the B tile that k - 2 used, which every warp left
// before k - 1's barrier. K % 16 == 0; `shared` holds GEMM_FP8_SHARED_BYTES.
#define GEMM_FP8_B_BYTES (GEMM_BN * GEMM_BK)
#define GEMM_FP8_SHARED_BYTES \
    (GEMM_STAGES * (GEMM_BM * GEMM_STRIDE * 2 + GEMM_FP8_B_BYTES) + 2 * GEMM_BN * GEMM_STRIDE * 2)  // 63488

template <bool BLOCK>
__device__ __forceinline__ void gemm_tile_fp8(float (*acc)[8][4], const bf16* const* a_rows,
                                              const fp8_e4m3* const* b_rows, const float* const* b_scales, int inner,
                                              unsigned char* shared, const void* fallback) {
#if ATLAS_HAS_FP8
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp & 1, warp_n = warp >> 1;
    constexpr int A_TILE = GEMM_BM * GEMM_STRIDE, B_TILE = GEMM_BN * GEMM_STRIDE;
    constexpr int CHUNKS = GEMM_BK / 8;
    bf16* a_stages = reinterpret_cast<bf16*>(shared);
    unsigned char* b_stages = shared + GEMM_STAGES * A_TILE * 2;
    bf16* b_tiles = reinterpret_cast<bf16*>(b_stages + GEMM_STAGES * GEMM_FP8_B_BYTES);
    const int chunk = tid % CHUNKS, b_chunk = tid & 1;
    auto load_stage = [&](int k_tile, int stage) {
        bf16* a_dst = a_stages + stage * A_TILE;
        const int k = k_tile * GEMM_BK + chunk * 8;
#pragma unroll
        for (int i = 0; i < GEMM_PASSES; ++i) {
            const int r = tid / CHUNKS + i * (GEMM_THREADS / CHUNKS);
            const bool a_valid = a_rows[i] != nullptr && k < inner;
            cp_async_16(a_dst + r * GEMM_STRIDE + chunk * 8, a_valid ? a_rows[i] + k : fallback, a_valid);
        }
        unsigned char* b_dst = b_stages + stage * GEMM_FP8_B_BYTES;
        const int kb = k_tile * GEMM_BK + b_chunk * 16;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = (tid >> 1) + 64 * j;
            const bool b_valid = b_rows[j] != nullptr && kb < inner;
            cp_async_16(b_dst + r * GEMM_BK + b_chunk * 16, b_valid ? b_rows[j] + kb : fallback, b_valid);
        }
    };
    auto widen = [&](int k_tile) {  // this thread's B chunks of k_tile (landed) into b_tiles[k_tile % 2]
        const unsigned char* b_src = b_stages + (k_tile % GEMM_STAGES) * GEMM_FP8_B_BYTES;
        bf16* b_dst = b_tiles + (k_tile & 1) * B_TILE;
        const int kb = k_tile * GEMM_BK + b_chunk * 16;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = (tid >> 1) + 64 * j;
            const uint4 raw = *reinterpret_cast<const uint4*>(b_src + r * GEMM_BK + b_chunk * 16);
            float scale = 0.0f;  // a chunk past K or the rows holds zeros
            if (b_rows[j] != nullptr && kb < inner) scale = __ldg(b_scales[j] + (BLOCK ? kb >> 7 : 0));
            const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
            u32 pairs[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 lo = f16x2_to_floats(fp8x2_to_f16x2(words[i] & 0xffffu));
                const float2 hi = f16x2_to_floats(fp8x2_to_f16x2(words[i] >> 16));
                pairs[2 * i] = pack_bf16x2(lo.x * scale, lo.y * scale);
                pairs[2 * i + 1] = pack_bf16x2(hi.x * scale, hi.y * scale);
            }
            uint4* out = reinterpret_cast<uint4*>(b_dst + r * GEMM_STRIDE + b_chunk * 16);
            out[0] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
            out[1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
        }
    };
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    const int k_tiles = (inner + GEMM_BK - 1) / GEMM_BK;
#pragma unroll
    for (int stage = 0; stage < GEMM_STAGES - 1; ++stage) {
        if (stage < k_tiles) load_stage(stage, stage);
        cp_async_commit();
    }
    const GemmLanes lanes = gemm_lanes(lane, warp_m, warp_n);
    for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
        cp_async_wait<GEMM_STAGES - 2>();  // this thread's copies of k_tile have landed
        widen(k_tile);
        __syncthreads();  // everyone's A has landed and B is widened; every warp is done with k_tile - 1
        const int next = k_tile + GEMM_STAGES - 1;
        if (next < k_tiles) load_stage(next, next % GEMM_STAGES);
        cp_async_commit();
        gemm_k_tile(acc, a_stages + (k_tile % GEMM_STAGES) * A_TILE, b_tiles + (k_tile & 1) * B_TILE, lanes);
    }
    cp_async_wait<0>();
#else
    __trap();  // the host offers FP8 experts from sm_89 on
#endif
}

// A GEMM tile's product over an expert's weights: bf16 rows (gemm_tile) or E4M3 ones with their
// scales (gemm_tile_fp8). B row r of the tile is weight row weight_row(r) of `w` (rows `width`
// long), or zeros where that is -1.
template <typename RowOf>
__device__ __forceinline__ void gemm_expert_tile(float (*acc)[8][4], const bf16* const* a_rows, const bf16* w,
                                                 int width, RowOf weight_row) {
    const bf16* b_rows[GEMM_PASSES];
#pragma unroll
    for (int i = 0; i < GEMM_PASSES; ++i) {
        const int row = weight_row(threadIdx.x / (GEMM_BK / 8) + i * (GEMM_THREADS / (GEMM_BK / 8)));
        b_rows[i] = row >= 0 ? w + (long long)row * width : nullptr;
    }
    gemm_tile(acc, a_rows, b_rows, width, reinterpret_cast<bf16*>(gemm_shared), w);
}

template <bool BLOCK, typename RowOf>
__device__ __forceinline__ void gemm_expert_tile(float (*acc)[8][4], const bf16* const* a_rows, Fp8Experts<BLOCK> w,
                                                 int width, RowOf weight_row) {
    const fp8_e4m3* b_rows[2];
    const float* b_scales[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = weight_row((threadIdx.x >> 1) + 64 * j);
        b_rows[j] = row >= 0 ? w.data + (long long)row * width : nullptr;
        b_scales[j] = w.scales + fp8_scale_offset<BLOCK>(max(row, 0), width);
    }
    gemm_tile_fp8<BLOCK>(acc, a_rows, b_rows, b_scales, width, reinterpret_cast<unsigned char*>(gemm_shared), w.data);
}

// moe_gemm_gate_up_<act>: grid (ceil(max(I, Is) / 64), max tiles), GEMM_THREADS, GEMM_SHARED_BYTES.
// A = normed rows of the tile's tokens; B row r = feature f0 + r / 2's gate row (r even) or up row
// (r odd), so a thread's accumulator pair (2t, 2t + 1) is one feature's gate and up; hidden [P, stride].
template <int ACT, typename W>
__device__ __forceinline__ void moe_gemm_gate_up_impl(const bf16* normed, const int* offsets, const int* tile_starts,
                                                      const int* sorted_pairs, W gate_up,
                                                      const bf16* gate_up_bias, W shared_gate_up,
                                                      bf16* hidden_out, int num_tokens, int top_k, int num_experts,
                                                      int groups, int hidden, int inner, int shared_inner, int stride,
                                                      float alpha, float limit) {
    const GemmTile tile = locate_gemm_tile(offsets, tile_starts, groups, blockIdx.y);
    if (tile.group < 0) return;
    const bool is_shared = tile.group == num_experts;
    const int features = is_shared ? shared_inner : inner;
    const int f0 = blockIdx.x * (GEMM_BN / 2);
    if (f0 >= features) return;
    const W w = pick_expert<2>(gate_up, shared_gate_up, is_shared, tile.group, inner, hidden);
    const bf16* bias = is_shared || gate_up_bias == nullptr ? nullptr : gate_up_bias + (long long)tile.group * 2 * inner;
    const int num_pairs = num_tokens * top_k;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bf16* a_rows[GEMM_PASSES];
#pragma unroll
    for (int i = 0; i < GEMM_PASSES; ++i) {
        const int row = tile.begin + tid / (GEMM_BK / 8) + i * (GEMM_THREADS / (GEMM_BK / 8));
        a_rows[i] = row < tile.end ? normed + (long long)token_of_pair(sorted_pairs[row], num_pairs, top_k) * hidden
                                   : nullptr;
    }
    float acc[4][8][4];
    gemm_expert_tile(acc, a_rows, w, hidden, [&](int r) {
        const int f = f0 + r / 2;
        return f < features ? ((r & 1) ? features + f : f) : -1;
    });
    const int g = lane >> 2, t = lane & 3;
    const int warp_m = warp & 1, warp_n = warp >> 1;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = tile.begin + warp_m * 64 + mt * 16 + g + half * 8;
            if (row >= tile.end) continue;
            bf16* out = hidden_out + (long long)sorted_pairs[row] * stride;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int feature = f0 + warp_n * 32 + nt * 4 + t;
                if (feature >= features) continue;
                float gate = acc[mt][nt][2 * half], up = acc[mt][nt][2 * half + 1];
                if (bias != nullptr) {
                    gate += to_float(bias[feature]);
                    up += to_float(bias[inner + feature]);
                }
                out[feature] = from_float<bf16>(gated_value<ACT>(round_bf16(gate), round_bf16(up), alpha, limit));
            }
        }
    }
}

#define DEFINE_MOE_GEMM_GATE_UP(NAME, ACT)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_gate_up_##NAME(                       \
        const bf16* normed, const int* offsets, const int* tile_starts, const int* sorted_pairs,             \
        const bf16* gate_up, const bf16* gate_up_bias, const bf16* shared_gate_up, bf16* hidden_out,         \
        int num_tokens, int top_k, int num_experts, int groups, int hidden, int inner, int shared_inner,     \
        int stride, float alpha, float limit) {                                                              \
        dependent_launch_entry();                                                                            \
        moe_gemm_gate_up_impl<ACT>(normed, offsets, tile_starts, sorted_pairs, gate_up, gate_up_bias,        \
                                   shared_gate_up, hidden_out, num_tokens, top_k, num_experts, groups,       \
                                   hidden, inner, shared_inner, stride, alpha, limit);                       \
    }

DEFINE_MOE_GEMM_GATE_UP(silu, GATED_SILU)
DEFINE_MOE_GEMM_GATE_UP(gelu_tanh, GATED_GELU_TANH)
DEFINE_MOE_GEMM_GATE_UP(clamped, GATED_CLAMPED)

// moe_gemm_gate_up_fp8[_blk]_<act>: moe_gemm_gate_up_<act> over E4M3 experts (gemm_tile_fp8), each
// weight followed by its scales; GEMM_FP8_SHARED_BYTES. Every GPU takes it (no wgmma form yet).
#define DEFINE_MOE_GEMM_GATE_UP_FP8(NAME, ACT, SUFFIX, BLOCK)                                                 \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_gate_up_fp8##SUFFIX##_##NAME(        \
        const bf16* normed, const int* offsets, const int* tile_starts, const int* sorted_pairs,             \
        const fp8_e4m3* gate_up, const float* gate_up_scales, const bf16* gate_up_bias,                      \
        const fp8_e4m3* shared_gate_up, const float* shared_gate_up_scales, bf16* hidden_out,                \
        int num_tokens, int top_k, int num_experts, int groups, int hidden, int inner, int shared_inner,     \
        int stride, float alpha, float limit) {                                                              \
        dependent_launch_entry();                                                                            \
        moe_gemm_gate_up_impl<ACT>(normed, offsets, tile_starts, sorted_pairs,                               \
                                   Fp8Experts<BLOCK>{gate_up, gate_up_scales}, gate_up_bias,                 \
                                   Fp8Experts<BLOCK>{shared_gate_up, shared_gate_up_scales}, hidden_out,     \
                                   num_tokens, top_k, num_experts, groups, hidden, inner, shared_inner,      \
                                   stride, alpha, limit);                                                    \
    }

DEFINE_MOE_GEMM_GATE_UP_FP8(silu, GATED_SILU, , false)
DEFINE_MOE_GEMM_GATE_UP_FP8(silu, GATED_SILU, _blk, true)

// moe_gemm_down: grid (ceil(H / 128), max tiles), GEMM_THREADS, GEMM_SHARED_BYTES. A = hidden rows of
// the tile's pairs; B = 128 rows of down; y [P, H] f32.
template <typename W>
__device__ __forceinline__ void moe_gemm_down_impl(const bf16* hidden_in, const int* offsets, const int* tile_starts,
                                                   const int* sorted_pairs, W down, const bf16* down_bias,
                                                   W shared_down, float* y, int num_experts, int groups, int hidden,
                                                   int inner, int shared_inner, int stride) {
    const GemmTile tile = locate_gemm_tile(offsets, tile_starts, groups, blockIdx.y);
    if (tile.group < 0) return;
    const bool is_shared = tile.group == num_experts;
    const int reduced = is_shared ? shared_inner : inner;
    const int first = blockIdx.x * GEMM_BN;
    if (first >= hidden) return;
    const W w = pick_expert<1>(down, shared_down, is_shared, tile.group, hidden, inner);
    const bf16* bias = is_shared || down_bias == nullptr ? nullptr : down_bias + (long long)tile.group * hidden;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bf16* a_rows[GEMM_PASSES];
#pragma unroll
    for (int i = 0; i < GEMM_PASSES; ++i) {
        const int row = tile.begin + tid / (GEMM_BK / 8) + i * (GEMM_THREADS / (GEMM_BK / 8));
        a_rows[i] = row < tile.end ? hidden_in + (long long)sorted_pairs[row] * stride : nullptr;
    }
    float acc[4][8][4];
    gemm_expert_tile(acc, a_rows, w, reduced, [&](int r) { return first + r < hidden ? first + r : -1; });
    const int g = lane >> 2, t = lane & 3;
    const int warp_m = warp & 1, warp_n = warp >> 1;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = tile.begin + warp_m * 64 + mt * 16 + g + half * 8;
            if (row >= tile.end) continue;
            float* out = y + (long long)sorted_pairs[row] * hidden;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int column = first + warp_n * 64 + nt * 8 + 2 * t;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (column + e < hidden)
                        out[column + e] = acc[mt][nt][2 * half + e] + (bias != nullptr ? to_float(bias[column + e]) : 0.0f);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    moe_gemm_down(const bf16* hidden_in, const int* offsets, const int* tile_starts, const int* sorted_pairs,
                  const bf16* down, const bf16* down_bias, const bf16* shared_down, float* y, int num_experts,
                  int groups, int hidden, int inner, int shared_inner, int stride) {
    dependent_launch_entry();
    moe_gemm_down_impl(hidden_in, offsets, tile_starts, sorted_pairs, down, down_bias, shared_down, y, num_experts,
                       groups, hidden, inner, shared_inner, stride);
}

// moe_gemm_down_fp8[_blk]: moe_gemm_down over E4M3 experts, each weight followed by its scales;
// GEMM_FP8_SHARED_BYTES.
#define DEFINE_MOE_GEMM_DOWN_FP8(SUFFIX, BLOCK)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_down_fp8##SUFFIX(                    \
        const bf16* hidden_in, const int* offsets, const int* tile_starts, const int* sorted_pairs,          \
        const fp8_e4m3* down, const float* down_scales, const bf16* down_bias, const fp8_e4m3* shared_down,  \
        const float* shared_down_scales, float* y, int num_experts, int groups, int hidden, int inner,       \
        int shared_inner, int stride) {                                                                      \
        dependent_launch_entry();                                                                            \
        moe_gemm_down_impl(hidden_in, offsets, tile_starts, sorted_pairs, Fp8Experts<BLOCK>{down, down_scales}, \
                           down_bias, Fp8Experts<BLOCK>{shared_down, shared_down_scales}, y, num_experts,     \
                           groups, hidden, inner, shared_inner, stride);                                     \
    }

DEFINE_MOE_GEMM_DOWN_FP8(, false)
DEFINE_MOE_GEMM_DOWN_FP8(_blk, true)

// ---------------------------------------------------------------------------------------------
// moe_combine: grid N, 256 threads, H % 8 == 0. shared_gate [H] bf16 or null (an ungated shared
// expert adds with weight 1); has_shared: y holds the shared expert's rows at P0 + t. Pairs of
// experts not held (ids outside [0, E)) have no row of y and add nothing.
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* y, const int* expert_ids, const float* expert_weights, const bf16* normed,
                const bf16* shared_gate, int has_shared, bf16* residual, int num_tokens, int top_k, int num_experts,
                int hidden, int accumulate) {
    dependent_launch_entry();
    __shared__ float scratch[32];
    const int token = blockIdx.x;
    const int num_pairs = num_tokens * top_k;
    float gate = 1.0f;
    if (has_shared && shared_gate != nullptr) {
        float dot = 0.0f;
        for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
            float values[8], weights[8];
            load8(normed + (long long)token * hidden + col, values);
            load8(shared_gate + col, weights);
#pragma unroll
            for (int i = 0; i < 8; ++i) dot = fmaf(values[i], weights[i], dot);
        }
        gate = 1.0f / (1.0f + expf(-block_sum(dot, scratch)));
    }
    for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
        float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < top_k; ++j) {
            const long long pair = (long long)token * top_k + j;
            if (!held(expert_ids[pair], num_experts)) continue;
            const float weight = expert_weights[pair];
            float values[8];
            load8(y + pair * hidden + col, values);
#pragma unroll
            for (int i = 0; i < 8; ++i) total[i] = fmaf(weight, values[i], total[i]);
        }
        if (has_shared) {
            float values[8];
            load8(y + ((long long)num_pairs + token) * hidden + col, values);
#pragma unroll
            for (int i = 0; i < 8; ++i) total[i] = fmaf(gate, values[i], total[i]);
        }
        float stream[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        bf16* row = residual + (long long)token * hidden + col;
        if (accumulate) load8(row, stream);
#pragma unroll
        for (int i = 0; i < 8; ++i) stream[i] += round_bf16(total[i]);
        store8(row, stream);
    }
}

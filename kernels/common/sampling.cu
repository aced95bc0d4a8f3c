// On-device sampling: one token id per row of logits [R, V], bit-identical to the numpy reference
// (atlas/adapters/mock/sampler.py) under the rules of `SamplingTensors`:
//
//   1. penalties (CSR entries of the row): repetition divides positive / multiplies negative
//      logits; presence + frequency * count is subtracted for tokens with output count > 0
//   2. logit bias, added entry by entry in order (one thread: repeated ids add in order); then
//      the allowed-token mask when given (int32 [R, ceil(V / 32)], bit v % 32 of word v / 32
//      set = allowed): a cleared bit makes the logit -inf. -inf survives rules 1-2 unchanged
//      (x / r, x * r, x - c and x + b of -inf are -inf), so the bit is tested in the pass that
//      reads the logits, before the penalties: the same ids as masking after the bias
//   3. temperature 0 -> argmax of the processed row (ties: lowest id)
//   4. top-k (ties at the cut: lowest ids), then top-p over the top-k set in order (value desc,
//      id asc), keeping tokens whose preceding mass / total < top_p, then min-p
//      (exp((logit - max) / T) >= min_p)
//   5. Gumbel-max race over the kept tokens: argmax of logit / T - log(-log(u_v)) with
//      u_v from splitmix64(seed ^ counter * C1 ^ v * C2) (ties: lowest id)
//
// Every float step uses the contract's operation order with explicitly rounded intrinsics
// (__fdiv_rn, __fmul_rn, ...), so no contraction into FMA changes a bit.
//
// Top-k and top-p never sort: both are radix selects over the order-preserving 32-bit key of
// the float value (four passes of 8 bits, histograms in shared memory). Top-p histograms carry
// the probability mass per bin (float64), so the cut value x_L is the lowest value whose mass
// strictly above it is < top_p * total; ties at a cut are resolved by an ordered scan in id order.
//
// Logprobs (when asked) are log_softmax of the raw logits: the sampled token's, and the K most
// likely (ties: lowest id) by K rounds of a block argmax below the previous pick.
//
// One block of 1024 threads per row (64 KiB of dynamic shared memory for per-warp top-p
// histograms); the processed row lives in a float32 workspace [R, V]. A greedy row with no
// penalty or bias entries skips it: one pass over the logits (and its mask) finds its argmax.
// Bytes: ~15 passes over V * 4 bytes per row (L2 resident after the first), plus V / 8 bytes of
// mask read once with the logits. FLOPs: negligible
// except one splitmix64 hash and two logf per token in the race. Bound by the single SM's L2
// bandwidth per row; batches spread rows over SMs.
#include "atlas_common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define RADIX_BINS 256
#define GREEDY_BATCH 4

struct SampleShared {
    int counts[RADIX_BINS];
    double masses[RADIX_BINS];
    float best_values[SAMPLE_WARPS];
    int best_ids[SAMPLE_WARPS];
    int warp_counts[SAMPLE_WARPS];
    double sums[SAMPLE_WARPS];
    double lane_masses[SAMPLE_WARPS][32];
    int chosen_bin;
    int remaining;
    double mass_above;
    int found_id;
};

// Order-preserving map of a float to an unsigned key: a < b  <=>  key(a) < key(b).
__device__ __forceinline__ u32 order_key(float value) {
    const u32 bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ bool ranks_before(float value, int id, float best_value, int best_id) {
    return value > best_value || (value == best_value && id < best_id);
}

// Block-wide argmax of (value, id) pairs with the lowest id winning ties. All threads get it.
__device__ void block_argmax(float& value, int& id, SampleShared& shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
        const int other_id = __shfl_xor_sync(0xffffffffu, id, offset);
        if (ranks_before(other_value, other_id, value, id)) {
            value = other_value;
            id = other_id;
        }
    }
    if (lane == 0) {
        shared.best_values[warp] = value;
        shared.best_ids[warp] = id;
    }
    __syncthreads();
    value = shared.best_values[0];
    id = shared.best_ids[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) {
        if (ranks_before(shared.best_values[w], shared.best_ids[w], value, id)) {
            value = shared.best_values[w];
            id = shared.best_ids[w];
        }
    }
    __syncthreads();
}

__device__ double block_sum_f64(double x, SampleShared& shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    if (lane == 0) shared.sums[warp] = x;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) total += shared.sums[w];
    __syncthreads();
    return total;
}

// The splitmix64 stream of the contract: u in (0, 1), exact in float32.
__device__ __forceinline__ float counter_uniform(u64 stream_key, u64 token_id) {
    u64 x = stream_key ^ (token_id * 0xD1B54A32D192ED03ull);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return __fmul_rn((float)(x >> 41) + 0.5f, 1.1920928955078125e-07f);  // * 2**-23
}

// Adds one count (and `mass`) to bin `bin` for every lane with `active`. Lanes that share a bin
// find each other with one match instruction; the lowest of them (the leader) issues the count
// atomic for all and sums their masses in lane order from a per-warp scratch row, then adds the
// sum to the warp's own histogram row `warp_masses` with a plain add (float64 shared-memory
// atomics are compare-and-swap loops that crawl under contention; the fixed order also keeps
// the result deterministic). Every lane of the warp must call it.
__device__ __forceinline__ void histogram_add(bool active, int bin, double mass, int* counts, double* warp_masses,
                                              double* lane_masses) {
    const int lane = threadIdx.x & 31;
    const unsigned peers = __match_any_sync(0xffffffffu, active ? bin : -1);
    const bool leader = active && lane == __ffs(peers) - 1;
    if (warp_masses != nullptr) {
        lane_masses[lane] = mass;
        __syncwarp();
        if (leader) {
            double total = 0.0;
            for (unsigned rest = peers; rest != 0; rest &= rest - 1) total += lane_masses[__ffs(rest) - 1];
            warp_masses[bin] += total;
        }
        __syncwarp();
    }
    if (leader) atomicAdd(&counts[bin], __popc(peers));
}

// The `need`-th (1-based) smallest id v < V with predicate(v) true; -1 when there are fewer.
template <typename Predicate>
__device__ int nth_matching_id(int vocab_size, int need, Predicate predicate, SampleShared& shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) shared.found_id = -1;
    int running = 0;
    for (int base = 0; base < vocab_size; base += SAMPLE_THREADS) {
        const int v = base + threadIdx.x;
        const bool flag = v < vocab_size && predicate(v);
        const int total = __syncthreads_count(flag);
        if (running + total >= need) {
            const unsigned ballot = __ballot_sync(0xffffffffu, flag);
            if (lane == 0) shared.warp_counts[warp] = __popc(ballot);
            __syncthreads();
            int before = running + __popc(ballot & ((1u << lane) - 1u));
            for (int w = 0; w < warp; ++w) before += shared.warp_counts[w];
            if (flag && before + 1 == need) shared.found_id = v;
            __syncthreads();
            return shared.found_id;
        }
        running += total;
    }
    __syncthreads();
    return shared.found_id;
}

// Clears to -inf the values of the 8 tokens chunk * 8 .. chunk * 8 + 7 whose bits `mask_row`
// clears (a chunk's 8 bits are one byte of a word: chunk * 8 is a multiple of 8).
__device__ __forceinline__ void mask8(const u32* __restrict__ mask_row, int chunk, float* values) {
    const u32 bits = __ldg(mask_row + (chunk >> 2)) >> ((chunk & 3) * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (!((bits >> i) & 1u)) values[i] = -ATLAS_INF;
    }
}

// Token v's logit, -inf where the mask clears its bit (no mask: every token is allowed).
__device__ __forceinline__ float masked_value(const u32* __restrict__ mask_row, int v, float value) {
    return mask_row == nullptr || ((__ldg(mask_row + (v >> 5)) >> (v & 31)) & 1u) ? value : -ATLAS_INF;
}

struct RowParams {
    float temperature, top_p, min_p;
    int top_k;
};

template <typename LOGIT>
__device__ void sample_row(const LOGIT* __restrict__ logits_row, float* __restrict__ row, int vocab_size,
                           const RowParams params, u64 stream_key, int penalty_begin, int penalty_end,
                           const int* __restrict__ penalty_ids, const int* __restrict__ penalty_counts,
                           float repetition, float presence, float frequency, int bias_begin, int bias_end,
                           const int* __restrict__ bias_ids, const float* __restrict__ bias_values,
                           const u32* __restrict__ mask_row, int* __restrict__ out_id, SampleShared& shared,
                           double* warp_masses) {
    const int tid = threadIdx.x;
    const bool vector_rows = vocab_size % 8 == 0;  // rows then start 16-byte aligned
    if (params.temperature == 0.0f && penalty_begin == penalty_end && bias_begin == bias_end) {
        // A greedy row that nothing changes: its argmax, in one pass over the logits. Each thread
        // issues GREEDY_BATCH chunks' loads before comparing any (the compare chain would
        // otherwise hold every load back to one L2 round trip per chunk).
        float max_value = -ATLAS_INF;
        int argmax_id = 0x7fffffff;
        const int vector_end = vector_rows ? vocab_size : 0;
        for (int base = tid; base * 8 < vector_end; base += GREEDY_BATCH * SAMPLE_THREADS) {
            float values[GREEDY_BATCH][8];
#pragma unroll
            for (int u = 0; u < GREEDY_BATCH; ++u) {
                const int chunk = base + u * SAMPLE_THREADS;
                if (chunk * 8 < vector_end) {
                    load8(logits_row + chunk * 8, values[u]);
                    if (mask_row != nullptr) mask8(mask_row, chunk, values[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < GREEDY_BATCH; ++u) {
                const int chunk = base + u * SAMPLE_THREADS;
                if (chunk * 8 >= vector_end) break;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (ranks_before(values[u][i], chunk * 8 + i, max_value, argmax_id)) {
                        max_value = values[u][i];
                        argmax_id = chunk * 8 + i;
                    }
                }
            }
        }
        for (int v = vector_end + tid; v < vocab_size; v += SAMPLE_THREADS) {
            const float value = masked_value(mask_row, v, to_float(logits_row[v]));
            if (ranks_before(value, v, max_value, argmax_id)) {
                max_value = value;
                argmax_id = v;
            }
        }
        block_argmax(max_value, argmax_id, shared);
        if (tid == 0) *out_id = argmax_id;
        return;
    }
    // 1-2: the processed row.
    if (vector_rows) {
        for (int chunk = tid; chunk < vocab_size / 8; chunk += SAMPLE_THREADS) {
            float values[8];
            load8(logits_row + chunk * 8, values);
            if (mask_row != nullptr) mask8(mask_row, chunk, values);
            store8(row + chunk * 8, values);
        }
    } else {
        for (int v = tid; v < vocab_size; v += SAMPLE_THREADS)
            row[v] = masked_value(mask_row, v, to_float(logits_row[v]));
    }
    __syncthreads();
    for (int e = penalty_begin + tid; e < penalty_end; e += SAMPLE_THREADS) {
        const int id = penalty_ids[e];
        if (id < 0 || id >= vocab_size) continue;
        float value = row[id];
        value = value > 0.0f ? __fdiv_rn(value, repetition) : __fmul_rn(value, repetition);
        const int count = penalty_counts[e];
        if (count > 0) value = __fsub_rn(value, __fadd_rn(presence, __fmul_rn(frequency, (float)count)));
        row[id] = value;
    }
    __syncthreads();
    if (tid == 0) {
        for (int e = bias_begin; e < bias_end; ++e) {
            const int id = bias_ids[e];
            if (id >= 0 && id < vocab_size) row[id] = __fadd_rn(row[id], bias_values[e]);
        }
    }
    __syncthreads();

    // 3: the argmax is the answer for greedy rows and the fallback when nothing is kept.
    float max_value = -ATLAS_INF;
    int argmax_id = 0x7fffffff;
    if (vector_rows) {
        for (int chunk = tid; chunk < vocab_size / 8; chunk += SAMPLE_THREADS) {
            float values[8];
            load8(row + chunk * 8, values);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (ranks_before(values[i], chunk * 8 + i, max_value, argmax_id)) {
                    max_value = values[i];
                    argmax_id = chunk * 8 + i;
                }
            }
        }
    } else {
        for (int v = tid; v < vocab_size; v += SAMPLE_THREADS) {
            if (ranks_before(row[v], v, max_value, argmax_id)) {
                max_value = row[v];
                argmax_id = v;
            }
        }
    }
    block_argmax(max_value, argmax_id, shared);
    const float temperature = params.temperature;
    if (temperature == 0.0f) {
        if (tid == 0) *out_id = argmax_id;
        return;
    }

    // 4a: top-k as a cut key and, among ties at the cut, the highest id kept.
    const bool use_top_k = params.top_k > 0 && params.top_k < vocab_size;
    u32 top_k_key = 0;
    int top_k_last_tie = 0x7fffffff;
    if (use_top_k) {
        u32 prefix = 0, prefix_mask = 0;
        if (tid == 0) shared.remaining = params.top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < RADIX_BINS; b += SAMPLE_THREADS) shared.counts[b] = 0;
            __syncthreads();
            for (int base = 0; base < vocab_size; base += SAMPLE_THREADS) {
                const int v = base + tid;
                const u32 key = v < vocab_size ? order_key(row[v]) : 0u;
                const bool active = v < vocab_size && (key & prefix_mask) == prefix;
                histogram_add(active, (key >> shift) & 0xff, 0.0, shared.counts, nullptr, nullptr);
            }
            __syncthreads();
            if (tid == 0) {
                int remaining = shared.remaining, bin = 0;
                for (int b = RADIX_BINS - 1; b >= 0; --b) {
                    if (remaining <= shared.counts[b]) { bin = b; break; }
                    remaining -= shared.counts[b];
                }
                shared.chosen_bin = bin;
                shared.remaining = remaining;
            }
            __syncthreads();
            prefix |= (u32)shared.chosen_bin << shift;
            prefix_mask |= 0xffu << shift;
        }
        top_k_key = prefix;
        const int ties_kept = shared.remaining;
        __syncthreads();
        top_k_last_tie = nth_matching_id(
            vocab_size, ties_kept, [&](int v) { return order_key(row[v]) == top_k_key; }, shared);
    }
    auto in_top_k = [&](int v, u32 key) {
        return !use_top_k || key > top_k_key || (key == top_k_key && v <= top_k_last_tie);
    };

    const bool use_top_p = params.top_p < 1.0f;
    const bool use_min_p = params.min_p > 0.0f;
    const bool filtered = use_top_k || use_top_p || use_min_p;
    const bool finite_max = max_value > -ATLAS_INF && max_value < ATLAS_INF;
    if ((use_top_p || use_min_p) && !finite_max) {  // the reference keeps nothing: argmax stands
        if (tid == 0) *out_id = argmax_id;
        return;
    }

    // 4b: top-p cut over the top-k set.
    bool any_top_p = true;
    u32 top_p_key = 0;
    int top_p_last_tie = 0x7fffffff;
    if (use_top_p) {
        double partial = 0.0;
        #pragma unroll 4
        for (int v = tid; v < vocab_size; v += SAMPLE_THREADS) {
            const float value = row[v];
            if (in_top_k(v, order_key(value)))
                partial += (double)expf(__fdiv_rn(__fsub_rn(value, max_value), temperature));
        }
        const double total = block_sum_f64(partial, shared);
        const double top_p = (double)params.top_p;
        u32 prefix = 0, prefix_mask = 0;
        if (tid == 0) shared.mass_above = 0.0;
        for (int shift = 24; shift >= 0 && any_top_p; shift -= 8) {
            for (int b = tid; b < RADIX_BINS; b += SAMPLE_THREADS) shared.counts[b] = 0;
            for (int b = tid; b < SAMPLE_WARPS * RADIX_BINS; b += SAMPLE_THREADS) warp_masses[b] = 0.0;
            __syncthreads();
            for (int base = 0; base < vocab_size; base += SAMPLE_THREADS) {
                const int v = base + tid;
                const float value = v < vocab_size ? row[v] : 0.0f;
                const u32 key = order_key(value);
                const bool active = v < vocab_size && (key & prefix_mask) == prefix && in_top_k(v, key);
                const double mass =
                    active ? (double)expf(__fdiv_rn(__fsub_rn(value, max_value), temperature)) : 0.0;
                histogram_add(active, (key >> shift) & 0xff, mass, shared.counts, warp_masses + (tid >> 5) * RADIX_BINS,
                              shared.lane_masses[tid >> 5]);
            }
            __syncthreads();
            for (int b = tid; b < RADIX_BINS; b += SAMPLE_THREADS) {
                double bin_mass = 0.0;
                for (int w = 0; w < SAMPLE_WARPS; ++w) bin_mass += warp_masses[w * RADIX_BINS + b];
                shared.masses[b] = bin_mass;
            }
            __syncthreads();
            if (tid == 0) {
                // The lowest non-empty bin whose mass above its top value is still < top_p.
                double above = shared.mass_above;
                int bin = -1;
                double bin_above = 0.0;
                for (int b = RADIX_BINS - 1; b >= 0; --b) {
                    if (shared.counts[b] == 0) continue;
                    if (above / total < top_p) {
                        bin = b;
                        bin_above = above;
                    } else {
                        break;
                    }
                    above += shared.masses[b];
                }
                shared.chosen_bin = bin;
                shared.mass_above = bin_above;
            }
            __syncthreads();
            if (shared.chosen_bin < 0) {
                any_top_p = false;
            } else {
                prefix |= (u32)shared.chosen_bin << shift;
                prefix_mask |= 0xffu << shift;
            }
        }
        if (any_top_p) {
            top_p_key = prefix;
            // Ties at the cut value, in id order, while their preceding mass stays < top_p.
            if (tid == 0) {
                const float cut_value = key_value(prefix);
                const double weight = (double)expf(__fdiv_rn(__fsub_rn(cut_value, max_value), temperature));
                const int num_ties = shared.counts[shared.chosen_bin];  // the last pass pins the whole key
                double preceding = shared.mass_above;
                int kept = 0;
                while (kept < num_ties && preceding / total < top_p) {
                    ++kept;
                    preceding += weight;
                }
                shared.remaining = kept;
            }
            __syncthreads();
            const int ties_kept = shared.remaining;
            __syncthreads();
            top_p_last_tie = nth_matching_id(
                vocab_size, ties_kept,
                [&](int v) {
                    const u32 key = order_key(row[v]);
                    return key == top_p_key && in_top_k(v, key);
                },
                shared);
        }
    }

    // 5: the race over the kept tokens.
    float best_score = -ATLAS_INF;
    int best_id = 0x7fffffff;
    bool any_kept = false;
    if (!use_top_p || any_top_p) {
        #pragma unroll 4
        for (int v = tid; v < vocab_size; v += SAMPLE_THREADS) {
            const float value = row[v];
            // A token at -inf (masked out) never wins: a finite token is always kept, and with
            // none (every value -inf) the answer is the lowest id either way, the argmax's. So
            // it skips the race's hash and two logarithms: most of a grammar-masked row.
            if (value == -ATLAS_INF) continue;
            const u32 key = order_key(value);
            if (filtered) {
                if (!in_top_k(v, key)) continue;
                if (use_top_p && (key < top_p_key || (key == top_p_key && v > top_p_last_tie))) continue;
                if (use_min_p && !(expf(__fdiv_rn(__fsub_rn(value, max_value), temperature)) >= params.min_p)) continue;
            }
            any_kept = true;
            const float u = counter_uniform(stream_key, (u64)v);
            const float noise = logf(-logf(u));
            const float score = __fsub_rn(__fdiv_rn(value, temperature), noise);
            if (ranks_before(score, v, best_score, best_id)) {
                best_score = score;
                best_id = v;
            }
        }
    }
    const int num_kept = __syncthreads_or(any_kept);
    block_argmax(best_score, best_id, shared);
    if (tid == 0) *out_id = num_kept ? best_id : argmax_id;
}

// log_softmax of the raw logits: the sampled token's logprob and the K most likely tokens.
template <typename LOGIT>
__device__ void row_logprobs(const LOGIT* __restrict__ logits_row, int vocab_size, int sampled_id, int num_top,
                             float* __restrict__ sampled_logprob, int* __restrict__ top_ids,
                             float* __restrict__ top_logprobs, SampleShared& shared) {
    const int tid = threadIdx.x;
    float max_value = -ATLAS_INF;
    int max_id = 0x7fffffff;
    #pragma unroll 4
    for (int v = tid; v < vocab_size; v += SAMPLE_THREADS) {
        const float value = to_float(logits_row[v]);
        if (ranks_before(value, v, max_value, max_id)) {
            max_value = value;
            max_id = v;
        }
    }
    block_argmax(max_value, max_id, shared);
    double partial = 0.0;
    #pragma unroll 4
    for (int v = tid; v < vocab_size; v += SAMPLE_THREADS)
        partial += (double)expf(__fsub_rn(to_float(logits_row[v]), max_value));
    const float log_total = (float)log(block_sum_f64(partial, shared));
    if (tid == 0)
        *sampled_logprob = __fsub_rn(__fsub_rn(to_float(logits_row[sampled_id]), max_value), log_total);

    // Rank i: the best (value, id) strictly after rank i - 1 in (value desc, id asc) order.
    float previous_value = max_value;
    int previous_id = max_id;
    for (int rank = 0; rank < num_top; ++rank) {
        float value = -ATLAS_INF;
        int id = 0x7fffffff;
        if (rank == 0) {
            value = previous_value;
            id = previous_id;
        } else {
            for (int v = tid; v < vocab_size; v += SAMPLE_THREADS) {
                const float candidate = to_float(logits_row[v]);
                if (ranks_before(previous_value, previous_id, candidate, v) && ranks_before(candidate, v, value, id)) {
                    value = candidate;
                    id = v;
                }
            }
            block_argmax(value, id, shared);
        }
        if (tid == 0) {
            top_ids[rank] = id;
            top_logprobs[rank] = __fsub_rn(__fsub_rn(value, max_value), log_total);
        }
        previous_value = value;
        previous_id = id;
    }
}

template <typename LOGIT>
__device__ __forceinline__ void sample_kernel_impl(
    const LOGIT* logits, int vocab_size, float* workspace, const float* temperature, const int* top_k,
    const float* top_p, const float* min_p, const i64* seeds, const i64* counters, const float* repetition_penalty,
    const float* presence_penalty, const float* frequency_penalty, const int* penalty_offsets,
    const int* penalty_token_ids, const int* penalty_output_counts, const int* bias_offsets,
    const int* bias_token_ids, const float* bias_values, const int* token_mask, int mask_words, int any_penalties,
    int any_bias, int all_greedy, int* out_token_ids, float* sampled_logprobs, int* top_ids, float* top_logprobs,
    int num_top) {
    __shared__ SampleShared shared;
    extern __shared__ double warp_masses[];  // [SAMPLE_WARPS][RADIX_BINS], 64 KiB (dynamic)
    const int r = blockIdx.x;
    const LOGIT* logits_row = logits + (long long)r * vocab_size;
    RowParams params;
    params.temperature = all_greedy ? 0.0f : temperature[r];
    params.top_k = top_k[r];
    params.top_p = top_p[r];
    params.min_p = min_p[r];
    const u64 stream_key = (u64)seeds[r] ^ ((u64)counters[r] * 0x9E3779B97F4A7C15ull);
    const int penalty_begin = any_penalties ? penalty_offsets[r] : 0;
    const int penalty_end = any_penalties ? penalty_offsets[r + 1] : 0;
    const int bias_begin = any_bias ? bias_offsets[r] : 0;
    const int bias_end = any_bias ? bias_offsets[r + 1] : 0;
    const u32* mask_row = token_mask != nullptr ? (const u32*)token_mask + (long long)r * mask_words : nullptr;
    sample_row<LOGIT>(logits_row, workspace + (long long)r * vocab_size, vocab_size, params, stream_key,
                      penalty_begin, penalty_end, penalty_token_ids, penalty_output_counts,
                      any_penalties ? repetition_penalty[r] : 1.0f, any_penalties ? presence_penalty[r] : 0.0f,
                      any_penalties ? frequency_penalty[r] : 0.0f, bias_begin, bias_end, bias_token_ids,
                      bias_values, mask_row, out_token_ids + r, shared, warp_masses);
    if (sampled_logprobs != nullptr) {
        __syncthreads();
        const int sampled_id = out_token_ids[r];
        row_logprobs<LOGIT>(logits_row, vocab_size, sampled_id, num_top, sampled_logprobs + r,
                            top_ids + (long long)r * num_top, top_logprobs + (long long)r * num_top, shared);
    }
}

#define DEFINE_SAMPLE(SUFFIX, LOGIT)                                                                             \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_##SUFFIX(                                \
        const LOGIT* logits, int vocab_size, float* workspace, const float* temperature, const int* top_k,       \
        const float* top_p, const float* min_p, const i64* seeds, const i64* counters,                           \
        const float* repetition_penalty, const float* presence_penalty, const float* frequency_penalty,          \
        const int* penalty_offsets, const int* penalty_token_ids, const int* penalty_output_counts,              \
        const int* bias_offsets, const int* bias_token_ids, const float* bias_values, const int* token_mask,      \
        int mask_words, int any_penalties, int any_bias, int all_greedy, int* out_token_ids,                     \
        float* sampled_logprobs, int* top_ids, float* top_logprobs, int num_top) {                               \
        dependent_launch_entry();                                                                                \
        sample_kernel_impl<LOGIT>(logits, vocab_size, workspace, temperature, top_k, top_p, min_p, seeds,        \
                                  counters, repetition_penalty, presence_penalty, frequency_penalty,             \
                                  penalty_offsets, penalty_token_ids, penalty_output_counts, bias_offsets,       \
                                  bias_token_ids, bias_values, token_mask, mask_words, any_penalties, any_bias,  \
                                  all_greedy, out_token_ids, sampled_logprobs, top_ids, top_logprobs, num_top);  \
    }

DEFINE_SAMPLE(f32, float)
DEFINE_SAMPLE(bf16, bf16)

// Gated DeltaNet (Qwen3-Next's linear attention): the causal conv1d with its per-slot state, the
// gated delta rule over each sequence's tokens from its slot's state, and the gated RMSNorm.
//
//   projected [N, W] bf16: | q [Hk dk] | k [Hk dk] | v [Hv dv] | z [Hv dv] | b [Hv] | a [Hv] |
//                          '------------ conv channels C ----------'
//   mixed [N, C] bf16 (the conv's output: q | k | v)     core [N, Hv dv] f32 (workspace)
//   conv state of a layer  [slots][K - 1][C] f32: a slot's last K - 1 conv inputs, oldest first
//   recurrent state of a layer [slots][Hv][dk][dv] f32: S of each value head
//   A sequence whose step holds its whole context (seq_lens[s] == its token count) starts from
//   zeros and never reads its slot.
//   snapshots [S, W] i32 (nullptr: none): where snapshots[s, t] >= 0 (t < W), that slot also gets
//   the state after token t of sequence s (a verify chunk's states after its inner tokens, so
//   rejected drafts roll back by taking a snapshot's slot; RecurrentMetadata.snapshot_slots).
//
// causal_conv1d: a thread per (channel, sequence) walks the sequence's tokens in order with the
// last K - 1 inputs in registers (history from the slot, zeros when fresh), out = silu(sum_j
// w[c, j] x[t - K + 1 + j]), then stores the new history. Bytes 2 N C 2 + state; bound by HBM
// (at prefill the walk is a chain of independent loads, at decode one launch).
//
// gated_delta_rule: per token, for value head h (key head h / (Hv / Hk)), q and k l2-normalised
// (eps 1e-6), q times dk^-0.5, beta = sigmoid(b), g = -exp(a_log) softplus(a + dt_bias):
//
//     S = e^g S;   u = beta (v - S^T k);   S += k u^T;   o = S^T q
//
// computed as kv = S_d^T k and sq = S_d^T q from the decayed S_d in one pass, then
// o = sq + u (k . q), so each token takes one reduction. A block of 4 warps owns 32 columns
// (dv) of one head's S for one sequence, in registers: warp w holds rows w r .. w r + r - 1
// (r = ceil(dk / 4) <= 32), lane j column j; the warps' partial dots meet in shared memory (one
// barrier a token, the partials double-buffered by token parity). Tokens are staged TOKENS at a
// time: each warp normalises its tokens' q and k into shared memory (with k . q, e^g, beta), so
// the loop over a token is ~3 r FMAs a thread plus the exchange. grid (ceil(dv / 32), Hv, S).
// Bytes: the state read and written once per sequence (Hv dk dv 4 each way: Qwen3-Next's 2 MiB
// a layer each way), q, k, v, a, b read once per (head, column block); FLOPs ~6 dk dv Hv a token.
// Decode is bound by the state's bytes; a prompt is a chain of T token steps per block (the
// chunkwise WY form, tensor cores over chunks of 64, is the prefill's next step).
//
// Rounding: the conv's sum (before silu) and its output, beta and o are rounded to bf16 where
// transformers' bf16 path for Qwen3-Next rounds them (the noise `atlas doctor` measures; the mock
// rounds the same places); g, the l2 norms, the recurrence and the state stay f32. A head whose o
// nearly cancels is scaled up by the gated norm, so another rounding pattern of the same size can
// move an MoE near tie after it.
//
// gdn_gated_norm: out[t, h] = rmsnorm(core[t, h], norm) * silu(z[t, h]) per value head, a warp per
// (token, head). Bytes N Hv dv (4 + 2 + 2). At decode (fuse_norm) gated_delta_rule does it instead:
// the last of a head's column blocks (counters [S, Hv], zero between launches) normalises the
// head's row, one launch less a layer.
#include "atlas_common.cuh"
#include "gated_act.cuh"  // round_bf16

#define CONV_THREADS 64
#define CONV_MAX_KERNEL 8
#define CONV_BATCH 16  // a prompt's inputs in flight a thread
#define GDN_THREADS 128
#define GDN_COLUMNS 32
#define GDN_MAX_KEY_DIM 128
#define GDN_ROWS (GDN_MAX_KEY_DIM / 4)  // state rows a thread holds at most
#define GDN_TOKENS 16                   // tokens staged in shared memory at a time

// The slot that gets sequence `seq`'s state after its token `t`, or -1.
__device__ __forceinline__ int snapshot_slot(const int* snapshots, int width, int seq, int t) {
    return snapshots != nullptr && t < width ? snapshots[(long long)seq * width + t] : -1;
}

// The step's rows and the slot of sequence `seq`, and whether it starts from zeros.
struct SequenceRows {
    int first, count, slot;
    bool fresh;
};

__device__ __forceinline__ SequenceRows sequence_rows(const int* query_start_loc, const int* seq_lens,
                                                      const int* state_slots, int seq) {
    SequenceRows rows;
    rows.first = query_start_loc[seq];
    rows.count = query_start_loc[seq + 1] - rows.first;
    rows.slot = state_slots[seq];
    rows.fresh = seq_lens[seq] == rows.count;
    return rows;
}

__device__ __forceinline__ void causal_conv1d_impl(const bf16* projected, int projected_width,
                                                   const float* conv_weight, const int* query_start_loc,
                                                   const int* seq_lens, const int* state_slots, float* conv_state,
                                                   bf16* out, int conv_dim, int kernel_size, const int* snapshots,
                                                   int snapshot_width) {
    // The weights, the step's rows and the slot's history are not the input projection's (the
    // kernel before): they are requested before the wait, beside that kernel's tail.
    const int channel = blockIdx.x * CONV_THREADS + threadIdx.x;
    const SequenceRows rows = sequence_rows(query_start_loc, seq_lens, state_slots, blockIdx.y);
    const bool active = channel < conv_dim && rows.count > 0;
    const int history_len = kernel_size - 1;
    float weights[CONV_MAX_KERNEL - 1], history[CONV_MAX_KERNEL - 1];
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
        weights[j] = active && j < history_len ? conv_weight[(long long)channel * kernel_size + j] : 0.0f;
    const float newest_weight = active ? conv_weight[(long long)channel * kernel_size + history_len] : 0.0f;
    float* state = conv_state + (long long)rows.slot * history_len * conv_dim + channel;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
        history[j] = active && j < history_len && !rows.fresh ? state[(long long)j * conv_dim] : 0.0f;
    dependent_launch_entry();  // every thread waits before it leaves: the next kernel relies on it
    if (!active) return;
    const bf16* x = projected + (long long)rows.first * projected_width + channel;
    bf16* y = out + (long long)rows.first * conv_dim + channel;
    // CONV_BATCH tokens' inputs are loaded before the first is used: a prompt's walk is then a
    // chain of batches, not of single loads.
    for (int t0 = 0; t0 < rows.count; t0 += CONV_BATCH) {
        float inputs[CONV_BATCH];
#pragma unroll
        for (int u = 0; u < CONV_BATCH; ++u)
            inputs[u] = t0 + u < rows.count ? to_float(x[(long long)(t0 + u) * projected_width]) : 0.0f;
#pragma unroll
        for (int u = 0; u < CONV_BATCH; ++u) {
            if (t0 + u >= rows.count) break;
            const float input = inputs[u];
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
                if (j < history_len) acc = fmaf(weights[j], history[j], acc);
            acc = fmaf(newest_weight, input, acc);
#pragma unroll
            for (int j = 0; j < CONV_MAX_KERNEL - 2; ++j)
                if (j + 1 < history_len) history[j] = history[j + 1];
            if (history_len > 0) {
#pragma unroll
                for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
                    if (j == history_len - 1) history[j] = input;
            }
            acc = round_bf16(acc);  // as transformers' bf16 conv: its sum rounded, then silu's output
            y[(long long)(t0 + u) * conv_dim] = from_float<bf16>(acc / (1.0f + expf(-acc)));
            const int snapshot = snapshot_slot(snapshots, snapshot_width, blockIdx.y, t0 + u);
            if (snapshot >= 0) {
                float* to = conv_state + (long long)snapshot * history_len * conv_dim + channel;
#pragma unroll
                for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
                    if (j < history_len) to[(long long)j * conv_dim] = history[j];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL - 1; ++j)
        if (j < history_len) state[(long long)j * conv_dim] = history[j];
}

extern "C" __global__ void __launch_bounds__(CONV_THREADS)
    causal_conv1d(const bf16* projected, int projected_width, const float* conv_weight, const int* query_start_loc,
                  const int* seq_lens, const int* state_slots, float* conv_state, bf16* out, int conv_dim,
                  int kernel_size, const int* snapshots, int snapshot_width) {
    causal_conv1d_impl(projected, projected_width, conv_weight, query_start_loc, seq_lens, state_slots, conv_state,
                       out, conv_dim, kernel_size, snapshots, snapshot_width);
}

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// FULL: key_dim == GDN_MAX_KEY_DIM, so every thread holds GDN_ROWS rows and reads its rows of the
// staged k and q as float4 (a quarter of the shared loads); else rows past key_dim are masked.
template <bool FULL>
__device__ __forceinline__ void gated_delta_rule_impl(
    const bf16* mixed, const bf16* projected, const float* decay_rate, const float* dt_bias,
    const int* query_start_loc, const int* seq_lens, const int* state_slots, float* state, float* core,
    int num_key_heads, int num_value_heads, int key_dim, int value_dim, int conv_dim, int projected_width,
    int fuse_norm, const bf16* norm_weight, float eps, bf16* out, unsigned* counters, const int* snapshots,
    int snapshot_width) {
    __shared__ __align__(16) float k_staged[GDN_TOKENS][GDN_MAX_KEY_DIM];
    __shared__ __align__(16) float q_staged[GDN_TOKENS][GDN_MAX_KEY_DIM];
    __shared__ float v_staged[GDN_TOKENS][GDN_COLUMNS];
    __shared__ float decay_staged[GDN_TOKENS], beta_staged[GDN_TOKENS], kq_staged[GDN_TOKENS];
    __shared__ float partial[2][4][GDN_COLUMNS][2];  // [token parity][warp][column] (kv, sq)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head = blockIdx.y, column = blockIdx.x * GDN_COLUMNS + lane;
    const bool has_column = column < value_dim;
    // The step's rows, the slot's state and the head's constants are not the conv's (the kernel
    // before): the state, the decode step's largest read, is requested before the wait, beside
    // the conv's run.
    const SequenceRows rows = sequence_rows(query_start_loc, seq_lens, state_slots, blockIdx.z);
    const bool active = rows.count > 0;
    const int key_head = head / (num_value_heads / num_key_heads);
    const int rows_per_warp = (key_dim + 3) / 4;
    const int row0 = warp * rows_per_warp;
    float* head_state = state + ((long long)rows.slot * num_value_heads + head) * key_dim * value_dim;
    float s[GDN_ROWS];
#pragma unroll
    for (int i = 0; i < GDN_ROWS; ++i) {
        const int row = row0 + i;
        s[i] = active && i < rows_per_warp && row < key_dim && has_column && !rows.fresh
                   ? head_state[(long long)row * value_dim + column]
                   : 0.0f;
    }
    const float rate = decay_rate[head], bias = dt_bias[head];
    dependent_launch_entry();  // every thread waits before it leaves: the next kernel relies on it
    if (!active) return;
    const float q_scale = rsqrtf((float)key_dim);
    const long long q_offset = (long long)key_head * key_dim;
    const long long k_offset = (long long)num_key_heads * key_dim + q_offset;
    const long long v_offset = 2LL * num_key_heads * key_dim + (long long)head * value_dim;
    const long long b_offset = (long long)conv_dim + (long long)num_value_heads * value_dim + head;
    const long long a_offset = b_offset + num_value_heads;
    int parity = 0;
    for (int base = 0; base < rows.count; base += GDN_TOKENS) {
        const int staged = min(GDN_TOKENS, rows.count - base);
        __syncthreads();  // the previous stage's tokens are done with the staging buffers
        // Warp w stages tokens w, w + 4, ...: every load of its tokens first, then the norms.
        constexpr int PER_WARP = GDN_TOKENS / 4;
        float q_in[PER_WARP][GDN_MAX_KEY_DIM / 32], k_in[PER_WARP][GDN_MAX_KEY_DIM / 32];
        float v_in[PER_WARP], b_in[PER_WARP], a_in[PER_WARP];
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) {
            const int i = warp + 4 * j;
            if (i >= staged) continue;
            const long long token = rows.first + base + i;
            const bf16* mixed_row = mixed + token * conv_dim;
#pragma unroll
            for (int m = 0; m < GDN_MAX_KEY_DIM / 32; ++m) {
                const int d = lane + 32 * m;
                q_in[j][m] = d < key_dim ? to_float(mixed_row[q_offset + d]) : 0.0f;
                k_in[j][m] = d < key_dim ? to_float(mixed_row[k_offset + d]) : 0.0f;
            }
            v_in[j] = has_column ? to_float(mixed_row[v_offset + column]) : 0.0f;
            const bf16* projected_row = projected + token * projected_width;
            b_in[j] = to_float(projected_row[b_offset]);
            a_in[j] = to_float(projected_row[a_offset]);
        }
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) {
            const int i = warp + 4 * j;
            if (i >= staged) continue;
            float q_squares = 0.0f, k_squares = 0.0f;
#pragma unroll
            for (int m = 0; m < GDN_MAX_KEY_DIM / 32; ++m) {
                q_squares += q_in[j][m] * q_in[j][m];
                k_squares += k_in[j][m] * k_in[j][m];
            }
            const float q_norm = rsqrtf(warp_sum(q_squares) + 1e-6f) * q_scale;
            const float k_norm = rsqrtf(warp_sum(k_squares) + 1e-6f);
            float kq = 0.0f;
#pragma unroll
            for (int m = 0; m < GDN_MAX_KEY_DIM / 32; ++m) {
                const int d = lane + 32 * m;
                const float qn = q_in[j][m] * q_norm, kn = k_in[j][m] * k_norm;
                if (d < key_dim) {
                    q_staged[i][d] = qn;
                    k_staged[i][d] = kn;
                }
                kq += qn * kn;
            }
            kq = warp_sum(kq);
            v_staged[i][lane] = v_in[j];
            if (lane == 0) {
                kq_staged[i] = kq;
                beta_staged[i] = round_bf16(1.0f / (1.0f + expf(-b_in[j])));  // bf16, as transformers holds it
                decay_staged[i] = expf(-rate * softplus(a_in[j] + bias));
            }
        }
        __syncthreads();
        for (int i = 0; i < staged; ++i) {
            const float decay = decay_staged[i];
            float kv = 0.0f, sq = 0.0f;
            if constexpr (FULL) {
                const float4* k4 = reinterpret_cast<const float4*>(&k_staged[i][row0]);
                const float4* q4 = reinterpret_cast<const float4*>(&q_staged[i][row0]);
#pragma unroll
                for (int j = 0; j < GDN_ROWS / 4; ++j) {
                    const float4 kk = k4[j], qq = q4[j];
                    const float ks[4] = {kk.x, kk.y, kk.z, kk.w}, qs[4] = {qq.x, qq.y, qq.z, qq.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[4 * j + e] *= decay;
                        kv = fmaf(s[4 * j + e], ks[e], kv);
                        sq = fmaf(s[4 * j + e], qs[e], sq);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < GDN_ROWS; ++j) {
                    if (j < rows_per_warp && row0 + j < key_dim) {
                        s[j] *= decay;
                        kv = fmaf(s[j], k_staged[i][row0 + j], kv);
                        sq = fmaf(s[j], q_staged[i][row0 + j], sq);
                    }
                }
            }
            partial[parity][warp][lane][0] = kv;
            partial[parity][warp][lane][1] = sq;
            __syncthreads();
            kv = sq = 0.0f;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                kv += partial[parity][w][lane][0];
                sq += partial[parity][w][lane][1];
            }
            parity ^= 1;
            const float u = beta_staged[i] * (v_staged[i][lane] - kv);
            if constexpr (FULL) {
                const float4* k4 = reinterpret_cast<const float4*>(&k_staged[i][row0]);
#pragma unroll
                for (int j = 0; j < GDN_ROWS / 4; ++j) {
                    const float4 kk = k4[j];
                    s[4 * j] = fmaf(kk.x, u, s[4 * j]);
                    s[4 * j + 1] = fmaf(kk.y, u, s[4 * j + 1]);
                    s[4 * j + 2] = fmaf(kk.z, u, s[4 * j + 2]);
                    s[4 * j + 3] = fmaf(kk.w, u, s[4 * j + 3]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < GDN_ROWS; ++j)
                    if (j < rows_per_warp && row0 + j < key_dim) s[j] = fmaf(k_staged[i][row0 + j], u, s[j]);
            }
            if (warp == 0 && has_column)
                core[(rows.first + base + i) * (long long)num_value_heads * value_dim + (long long)head * value_dim +
                     column] = round_bf16(sq + u * kq_staged[i]);  // o in bf16, as the gated norm reads it there
            const int snapshot = snapshot_slot(snapshots, snapshot_width, blockIdx.z, base + i);
            if (snapshot >= 0) {
                float* to = state + ((long long)snapshot * num_value_heads + head) * key_dim * value_dim;
#pragma unroll
                for (int j = 0; j < GDN_ROWS; ++j) {
                    const int row = row0 + j;
                    if (j < rows_per_warp && row < key_dim && has_column)
                        to[(long long)row * value_dim + column] = s[j];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < GDN_ROWS; ++i) {
        const int row = row0 + i;
        if (i < rows_per_warp && row < key_dim && has_column) head_state[(long long)row * value_dim + column] = s[i];
    }
    if (!fuse_norm) return;
    // The gated norm of the head's rows, by the last of its column blocks (decode: one token).
    if (!last_block_done(counters + (long long)blockIdx.z * num_value_heads + head, gridDim.x)) return;
    for (int i = 0; i < rows.count; ++i) {
        const long long item = (rows.first + i) * (long long)num_value_heads + head;
        const float* row = core + item * value_dim;
        float squares = 0.0f;
        for (int d = threadIdx.x; d < value_dim; d += GDN_THREADS) {
            const float value = __ldcg(row + d);
            squares += value * value;
        }
        const float inverse_rms = rsqrtf(block_sum(squares, &partial[0][0][0][0]) / value_dim + eps);
        const bf16* z = projected + (rows.first + i) * (long long)projected_width + conv_dim + (long long)head * value_dim;
        for (int d = threadIdx.x; d < value_dim; d += GDN_THREADS) {
            const float gate = to_float(z[d]);
            out[item * value_dim + d] =
                from_float<bf16>(__ldcg(row + d) * inverse_rms * to_float(norm_weight[d]) * (gate / (1.0f + expf(-gate))));
        }
    }
}

#define DEFINE_GATED_DELTA_RULE(NAME, FULL)                                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS) NAME(                                            \
        const bf16* mixed, const bf16* projected, const float* decay_rate, const float* dt_bias,              \
        const int* query_start_loc, const int* seq_lens, const int* state_slots, float* state, float* core,   \
        int num_key_heads, int num_value_heads, int key_dim, int value_dim, int conv_dim, int projected_width, \
        int fuse_norm, const bf16* norm_weight, float eps, bf16* out, unsigned* counters,                    \
        const int* snapshots, int snapshot_width) {                                                           \
        gated_delta_rule_impl<FULL>(mixed, projected, decay_rate, dt_bias, query_start_loc, seq_lens,         \
                                    state_slots, state, core, num_key_heads, num_value_heads, key_dim,        \
                                    value_dim, conv_dim, projected_width, fuse_norm, norm_weight, eps, out,   \
                                    counters, snapshots, snapshot_width);                                     \
    }

DEFINE_GATED_DELTA_RULE(gated_delta_rule, false)
DEFINE_GATED_DELTA_RULE(gated_delta_rule_d128, true)

extern "C" __global__ void __launch_bounds__(256)
    gdn_gated_norm(const float* core, const bf16* projected, const bf16* norm_weight, float eps, bf16* out,
                   int num_tokens, int num_value_heads, int value_dim, int conv_dim, int projected_width) {
    dependent_launch_entry();
    const int lane = threadIdx.x & 31;
    const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);  // (token, head)
    if (item >= (long long)num_tokens * num_value_heads) return;
    const long long token = item / num_value_heads;
    const int head = (int)(item % num_value_heads);
    const float* row = core + item * value_dim;
    float squares = 0.0f;
    for (int d = lane; d < value_dim; d += 32) squares += row[d] * row[d];
    const float inverse_rms = rsqrtf(warp_sum(squares) / value_dim + eps);
    const bf16* z = projected + token * projected_width + conv_dim + (long long)head * value_dim;
    bf16* y = out + item * value_dim;
    for (int d = lane; d < value_dim; d += 32) {
        const float gate = to_float(z[d]);
        y[d] = from_float<bf16>(row[d] * inverse_rms * to_float(norm_weight[d]) * (gate / (1.0f + expf(-gate))));
    }
}

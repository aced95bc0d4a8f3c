// Skinny matrix product for decode: out[n, m] = sum_k x[n, k] * w[m, k] (+ bias[m]) for a few
// token rows n < N <= 8, and the same product with the op that follows it fused in.
//
//   x [N, K] bf16, w [M, K] bf16 row-major (the checkpoint's [out, in]), bias [M] bf16 or null,
//   out [N, M] bf16 or f32.  K % 8 == 0 (16-byte loads; the host checks).
//
// Bytes: M K 2 (the weight, read once) + N K 2 + N M sizeof(out); FLOPs: 2 N M K.  At N <= 8 the
// arithmetic intensity is <= 8 FLOP/byte, far under the ridge (~200 on an H200), so the kernel
// must run at HBM bandwidth.
//
// Layout of the work: a block owns ROWS consecutive output features; its 4 warps split K
// (split-K inside the block, so even a small M fills the GPU with ROWS-row blocks), each lane
// loading 16 bytes of every one of the ROWS weight rows per step (ROWS * 16 * 2 bytes in flight
// per lane with the 2x unroll). x chunks are converted once and reused by all ROWS rows, so
// L1 traffic for x is N / ROWS times the weight traffic. Partial sums meet in shared memory.
//
//     block b: rows m0 = b * ROWS .. m0 + ROWS - 1
//     warp w, lane l: k chunks (w * 32 + l) * 8, then + 4 * 32 * 8, ...
//     w rows:  | w0 l0 | w0 l1 | ... | w0 l31 | w1 l0 | ... | w3 l31 | w0 l0 | ...
//
// The weights do not depend on the previous kernel, so each lane requests its first chunks of
// them before waiting for that kernel (dependent_launch_entry comes after those loads): the
// GEMV's HBM ramp-up overlaps the tail of the small kernel before it.
//
// Fused variants (each removes a kernel, its launch and its grid drain, from every decode layer):
//   rmsnorm:  x is the residual stream; each block first takes the inverse RMS of its token rows
//             (the whole row, from L2) and multiplies by it and norm_weight as it loads x, rounding
//             to bf16 as the norm kernel's output would be: out = rmsnorm(x) w^T. Every block
//             re-reads the row, so the host uses it for narrow rows only (ops_dense.py).
//   gated:    w = [gate; up] [2I, K], out [N, I] = act(x gate^T) * (x up^T): a block owns
//             features f (gate row f and up row I + f), so the product needs no second pass.
//             Gate and up are rounded to bf16 before act, as the unfused linear + act_mul.
//   add:      out is the residual stream: out[n, m] += x w^T, each element by the thread that
//             owns it; the product is rounded to bf16 before the add, as a linear + add would.
//   rope:     w is a fused q | k | v projection [(Hq + 2 Hkv) D, K] and the step is one token:
//             the block's ROWS rows are RoPE pairs (d, d + D/2) of a q or k head (the weight rows
//             are read in that order; no copy of the weight is permuted), or v rows. The block
//             rounds its products to bf16 (the projection's output), rotates q and k by the
//             token's position and stores q into q_out and k, v into the paged cache, as
//             linear + rope_and_cache would (full rotary width, no q/k norm; the host checks).
//             Position and slot are step inputs no kernel of the step writes, so they are
//             requested before the wait for the previous kernel, with the first weights; the
//             pair's cos and sin after the first products (see RopeState).
#include "atlas_common.cuh"

#define GEMV_WARPS 4

__device__ __forceinline__ void bf16x8_to_floats(uint4 raw, float* out) {
    const bf16x2* pairs = reinterpret_cast<const bf16x2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// What a block's row sums become. Plain: out[n, m] = sum (+ bias). Gated<Act>: the block's rows
// are gate rows then up rows of the same features, and out[n, f] = act(gate) * up.
struct NoArgs {};

struct Plain {
    static constexpr bool gated = false, rope = false;
    typedef NoArgs Args;
};

template <typename Act>
struct Gated {
    static constexpr bool gated = true, rope = false;
    typedef NoArgs Args;
};

struct AddTo {
    static constexpr bool gated = false, rope = false;
    typedef NoArgs Args;
};

// Where the rope epilogue writes, and the token's rotation (TABLE [max_position, D]: cos of the
// D/2 pair angles, then their sin). The cache planes are pages of [Hkv][block_size][D].
template <typename TABLE>
struct RopeArgs {
    const int* positions;
    const int* slot_mapping;
    const TABLE* table;
    int max_position;
    bf16* k_plane;
    bf16* v_plane;
    int num_q_heads, num_kv_heads, head_dim, block_size;
};

template <typename TABLE>
struct Rope {
    static constexpr bool gated = false, rope = true;
    typedef RopeArgs<TABLE> Args;
};

// Weight row of rope feature f: below (Hq + Hkv) D the features are pairs, f = 2 p + s
// -> head p / (D/2), dim p % (D/2) + s D/2; v rows keep their place.
__device__ __forceinline__ long long rope_weight_row(int f, int rope_rows, int head_dim) {
    if (f >= rope_rows) return f;
    const int half = head_dim / 2, pair = f >> 1, head = pair / half;
    return (long long)head * head_dim + (pair - head * half) + (f & 1) * half;
}

__device__ __forceinline__ int load_int_early(const int* p) {
    int v;
    asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}

// What the block stores for feature value `total` (and `up`, gated) at `slot` of out.
template <typename EPI, typename OUT>
__device__ __forceinline__ void store_feature(OUT* slot, float total, float up);

template <typename EPI>
struct ActOf {
    typedef SiluOp type;  // unused for Plain
};
template <typename Act>
struct ActOf<Gated<Act>> {
    typedef Act type;
};

// The value a plain or gated form stores for a feature whose sum is `total` (gated: the gate's,
// `up` the up row's, both rounded to bf16 first as the unfused product would be).
template <typename EPI>
__device__ __forceinline__ float feature_value(float total, float up) {
    if (EPI::gated) {
        const typename ActOf<EPI>::type act;
        return act(to_float(from_float<bf16>(total))) * to_float(from_float<bf16>(up));
    }
    return total;
}

template <typename EPI, typename OUT>
__device__ __forceinline__ void store_feature(OUT* slot, float total, float up) {
    *slot = from_float<OUT>(feature_value<EPI>(total, up));
}

template <>
__device__ __forceinline__ void store_feature<AddTo, bf16>(bf16* slot, float total, float) {
    *slot = from_float<bf16>(to_float(*slot) + to_float(from_float<bf16>(total)));
}

// x chunks as the products see them: the raw 8 bf16 values, or (rmsnorm) those values times the
// row's inverse RMS and the norm weight, rounded to bf16 again.
template <bool NORM, typename NW>
__device__ __forceinline__ uint4 input_chunk(const bf16* x, int k, const NW* norm_weight, float inverse_rms) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + k);
    if (!NORM) return raw;
    float values[8], scales[8];
    bf16x8_to_floats(raw, values);
    load8(norm_weight + k, scales);
#pragma unroll
    for (int i = 0; i < 8; ++i) values[i] = values[i] * inverse_rms * scales[i];
    Vec8<bf16> normed;
    normed.from_floats(values);
    return normed.raw;
}

// 1 / sqrt(mean(row^2) + eps) of a row of `inner` bf16 values, summed by a whole block (the
// result reaches every thread) or by one warp.
__device__ __forceinline__ float row_sum_squares(const bf16* row, int inner, int first, int stride) {
    float sum = 0.0f;
    for (int k = first * 8; k < inner; k += stride * 8) {
        float values[8];
        load8(row + k, values);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += values[i] * values[i];
    }
    return sum;
}

__device__ __forceinline__ float inverse_rms_of(float sum_squares, int inner, float eps) {
    return 1.0f / sqrtf(sum_squares / inner + eps);
}

// Weight row of the block's r-th row: features first .. first + FEATURES - 1, then (gated) their
// up rows at num_features + f. Rows past the end re-read the last valid one (never stored).
template <typename EPI, int FEATURES>
__device__ __forceinline__ long long weight_row(int first, int r, int num_features) {
    const int feature = min(first + r % FEATURES, num_features - 1);
    return EPI::gated && r >= FEATURES ? (long long)num_features + feature : (long long)feature;
}

// What a rope thread loads for its epilogue: the token's position and slot before the wait
// (two independent loads: nothing stalls on them there), then its pair's cos and sin once the
// position has long arrived (after the first products), so no warp waits on the chain.
struct RopeState {
    int position, slot;
    float cos, sin;
};

template <typename TABLE>
__device__ __forceinline__ void rope_prefetch(const RopeArgs<TABLE>& args, RopeState& state) {
    state.position = load_int_early(args.positions);
    state.slot = load_int_early(args.slot_mapping);
}

template <typename TABLE>
__device__ __forceinline__ void rope_load_angles(const RopeArgs<TABLE>& args, int f, RopeState& state) {
    const int half = args.head_dim / 2;
    const int position = min(max(state.position, 0), args.max_position - 1);
    const TABLE* cos_row = args.table + (long long)position * args.head_dim + (f >> 1) % half;
    state.cos = to_float(cos_row[0]);
    state.sin = to_float(cos_row[half]);
}

// Rotate feature f (value x, its pair partner's value `other`) and store it: q into q_out,
// k and v into the token's cache slot (none for a negative slot: a graph's padding row).
template <typename TABLE>
__device__ __forceinline__ void rope_store(const RopeArgs<TABLE>& args, int f, float x, float other,
                                           const RopeState& state, bf16* q_out) {
    const int rope_rows = (args.num_q_heads + args.num_kv_heads) * args.head_dim;
    const long long row = rope_weight_row(f, rope_rows, args.head_dim);
    const int head = (int)(row / args.head_dim), d = (int)(row % args.head_dim);
    if (f < rope_rows) x = (f & 1) ? x * state.cos + other * state.sin : x * state.cos - other * state.sin;
    if (head < args.num_q_heads) {
        q_out[row] = from_float<bf16>(x);
        return;
    }
    if (state.slot < 0) return;
    const bool is_v = f >= rope_rows;
    const int kv_head = head - args.num_q_heads - (is_v ? args.num_kv_heads : 0);
    const long long block = state.slot / args.block_size, offset = state.slot % args.block_size;
    bf16* plane = is_v ? args.v_plane : args.k_plane;
    plane[((block * args.num_kv_heads + kv_head) * args.block_size + offset) * args.head_dim + d] = from_float<bf16>(x);
}

// num_rows counts output features: the weight's rows, or half of them when gated. With NORM,
// x is normalised on the way in (norm_weight [K], eps). With FOLDED, x is the raw residual and
// the norm weight is already in w's columns (folded at load): the block sums x^2 over the chunks
// it multiplies (its 128 lanes cover K once) and scales its row sums by the inverse RMS.
//
// WARPS (default GEMV_WARPS) split K. The `_w2` entry points take 2: at K <= 2048 a 4-warp block's
// lanes cover K before using half of their BATCH chunks of loads, so a block of 2 warps keeps
// the same bytes in flight with half the threads and registers, and twice as many blocks fit
// an SM (a TP=2 rank of the 8B: o_proj's 1024 blocks of 4 rows at K = 2048 take one wave
// instead of two, every one of them loading its weights before the attention before it ends).
template <typename OUT, int ROWS, int TOKENS, typename EPI, bool NORM = false, typename NW = bf16,
          bool FOLDED = false, int WARPS = GEMV_WARPS>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                          int num_rows, int inner, const NW* __restrict__ norm_weight = nullptr,
                                          float eps = 0.0f, typename EPI::Args args = typename EPI::Args()) {
    static_assert(!EPI::rope || (TOKENS == 1 && ROWS % 2 == 0), "rope: one token, whole pairs per block");
    static_assert(!(NORM && FOLDED), "one way to normalise x");
    static_assert(!(EPI::rope && FOLDED), "the rope epilogue takes unscaled sums (measured slower folded)");
    constexpr int FEATURES = EPI::gated ? ROWS / 2 : ROWS;
    __shared__ float partial[WARPS][ROWS][TOKENS];
    __shared__ float partial_squares[WARPS][TOKENS];
    float squares[TOKENS];
#pragma unroll
    for (int n = 0; n < TOKENS; ++n) squares[n] = 0.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = blockIdx.x * FEATURES;

    float acc[ROWS][TOKENS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) acc[r][n] = 0.0f;

    const bf16* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if constexpr (EPI::rope) {
            const int rope_rows = (args.num_q_heads + args.num_kv_heads) * args.head_dim;
            w_rows[r] = w + rope_weight_row(min(first + r, num_rows - 1), rope_rows, args.head_dim) * inner;
        } else {
            w_rows[r] = w + weight_row<EPI, FEATURES>(first, r, num_rows) * inner;
        }
    }

    // Full steps of BATCH chunks issue all their loads before the first FMA (BATCH * ROWS * 16
    // bytes of weights in flight per lane); the remaining chunks go one at a time.
    constexpr int STEP = WARPS * 32 * 8;
    constexpr int BATCH = TOKENS <= 2 ? 4 : 2;
    auto accumulate = [&](const uint4* weights_raw, const uint4* x_raw) {
        float weights[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) bf16x8_to_floats(weights_raw[r], weights[r]);
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            if (n < num_tokens) {
                float xs[8];
                bf16x8_to_floats(x_raw[n], xs);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][n] = fmaf(weights[r][i], xs[i], acc[r][n]);
                if (FOLDED) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) squares[n] = fmaf(xs[i], xs[i], squares[n]);
                }
            }
        }
    };
    float inverse_rms[TOKENS];
    auto load_x = [&](int k, uint4* x_raw) {
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
            x_raw[n] = n < num_tokens ? input_chunk<NORM>(x + (long long)n * inner, k, norm_weight, inverse_rms[n])
                                      : make_uint4(0, 0, 0, 0);
    };
    RopeState rope_state;
    int k = (warp * 32 + lane) * 8;
    {
        // The first step's weights are requested before the previous kernel is waited for: all
        // BATCH chunks, or those a short row has (K < BATCH * STEP: SmolLM2's 576 and 1536).
        const bool full = k + (BATCH - 1) * STEP < inner;
        uint4 weights_raw[BATCH][ROWS], x_raw[BATCH][TOKENS];
        if (full) {
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) weights_raw[u][r] = load_streaming_early(w_rows[r] + k + u * STEP);
        } else {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (k + u * STEP < inner) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
                        weights_raw[u][r] = load_streaming_early(w_rows[r] + k + u * STEP);
                }
            }
        }
        if constexpr (EPI::rope) {
            if (threadIdx.x < ROWS) rope_prefetch(args, rope_state);
        }
        dependent_launch_entry();
        if (NORM) {
            __shared__ float scratch[32];
#pragma unroll
            for (int n = 0; n < TOKENS; ++n) {
                const float sum = n < num_tokens ? row_sum_squares(x + (long long)n * inner, inner, threadIdx.x, blockDim.x) : 0.0f;
                inverse_rms[n] = inverse_rms_of(block_sum(sum, scratch), inner, eps);
            }
        }
        if (full) {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) load_x(k + u * STEP, x_raw[u]);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) accumulate(weights_raw[u], x_raw[u]);
        } else {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (k + u * STEP < inner) load_x(k + u * STEP, x_raw[u]);
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (k + u * STEP < inner) accumulate(weights_raw[u], x_raw[u]);
            }
        }
        k += BATCH * STEP;
        if constexpr (EPI::rope) {
            if (threadIdx.x < ROWS) rope_load_angles(args, first + threadIdx.x, rope_state);
        }
    }
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 weights_raw[BATCH][ROWS], x_raw[BATCH][TOKENS];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) weights_raw[u][r] = load_streaming(w_rows[r] + k + u * STEP);
            load_x(k + u * STEP, x_raw[u]);
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) accumulate(weights_raw[u], x_raw[u]);
    }
    for (; k < inner; k += STEP) {
        uint4 weights_raw[ROWS], x_raw[TOKENS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) weights_raw[r] = load_streaming(w_rows[r] + k);
        load_x(k, x_raw);
        accumulate(weights_raw, x_raw);
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            const float total = warp_sum(acc[r][n]);
            if (lane == 0) partial[warp][r][n] = total;
        }
    if (FOLDED) {
#pragma unroll
        for (int n = 0; n < TOKENS; ++n) {
            const float total = warp_sum(squares[n]);
            if (lane == 0) partial_squares[warp][n] = total;
        }
    }
    __syncthreads();
    // The inverse RMS of token n's row (FOLDED), from the warps' sums of squares.
    auto row_scale = [&](int n) {
        if (!FOLDED) return 1.0f;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < WARPS; ++j) sum += partial_squares[j][n];
        return inverse_rms_of(sum, inner, eps);
    };
    if constexpr (EPI::rope) {
        if (threadIdx.x < ROWS && first + threadIdx.x < num_rows) {
            const int rope_rows = (args.num_q_heads + args.num_kv_heads) * args.head_dim;
            // The projection's output of block row r, rounded to bf16 as linear would store it.
            auto projected = [&](int r) {
                const long long row = rope_weight_row(first + r, rope_rows, args.head_dim);
                float total = bias != nullptr ? to_float(bias[row]) : 0.0f;
#pragma unroll
                for (int j = 0; j < WARPS; ++j) total += partial[j][r][0];
                return to_float(from_float<bf16>(total));
            };
            const int f = first + threadIdx.x;
            const float other = f < rope_rows ? projected(threadIdx.x ^ 1) : 0.0f;
            rope_store(args, f, projected(threadIdx.x), other, rope_state, reinterpret_cast<bf16*>(out));
        }
        return;
    }
    if (threadIdx.x < FEATURES * TOKENS) {
        const int f = threadIdx.x / TOKENS, n = threadIdx.x % TOKENS;
        const int feature = first + f;
        if (feature < num_rows && n < num_tokens) {
            const float biased = bias != nullptr ? to_float(bias[feature]) : 0.0f;
            float total = FOLDED ? 0.0f : biased, up = 0.0f;
#pragma unroll
            for (int j = 0; j < WARPS; ++j) total += partial[j][f][n];
            if (EPI::gated) {
#pragma unroll
                for (int j = 0; j < WARPS; ++j) up += partial[j][f + FEATURES][n];
            }
            if (FOLDED) {
                const float scale = row_scale(n);
                total = total * scale + biased;
                up *= scale;
            }
            store_feature<EPI>(out + (long long)n * num_rows + feature, total, up);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core variant for 2..8 token rows: at N = 8 the fp32 FMAs of the SIMT kernel cost more
// than the bytes (8 FMAs per weight element), so the products go to mma.sync m16n8k16 with the
// N tokens as the n = 8 columns. A warp owns 16 weight rows; its lane (g = lane / 4, t = lane % 4)
// loads 16 bytes of rows g and g + 8 and of token g's x at k = k0 + 8t .. 8t + 7 for each 32-wide
// chunk k0, and feeds them to two mma steps. The k order inside a chunk is permuted the same way
// for weights and x (a dot product does not care), which turns the mma fragment layout into
// plain 16-byte loads:
//
//     mma step s (0, 1), logical k 2t + i  <-  physical k0 + 8t + 4s + i
//                        logical k 2t+8+i  <-  physical k0 + 8t + 4s + 2 + i        (i = 0, 1)
//
// Gated, the 16 rows are the gate rows of 8 features (g) and their up rows (g + 8).
// The block's WARPS warps split K and meet in shared memory; each lane has BATCH chunks of loads
// in flight at a time. K % 32 == 0 (the host checks). Two shapes:
//   gemv_mma_<what>       8 warps, 4 chunks: rows up to 2048 wide (SmolLM2's verify and batch rows)
//   gemv_mma_wide_<what>, gemv_mma_folded_<what>   16 warps, 1 chunk: wider rows, where fewer bytes
//     a lane and more warps an SM measured faster (Llama-3.1-8B k = 4 verify step on an H100:
//     5.71 ms against 6.03; 2 or 4 chunks a lane from 4, 8, 16 or 32 warps: 5.77 to 6.49 ms;
//     docs/lab/speculative-plan.md). Keeping the narrow shape keeps SmolLM2's sums in their order.
#define MMA_NARROW 8, 4
#define MMA_WIDE 16, 1

// FOLDED: x is the raw residual and the norm weight is in w's columns (as gemv_impl's FOLDED). Lane
// (g, t) loads token g's chunks at k = 32 warp + 8 t + STEP u, so the block's lanes of token g
// cover its row once: they sum x^2 from the chunks they multiply, and the epilogue scales each
// token's sums by its inverse RMS. A verify step (k + 1 rows) then runs no norm kernel.
template <int WARPS, int BATCH, typename OUT, typename EPI, bool NORM = false, typename NW = bf16,
          bool FOLDED = false>
__device__ __forceinline__ void gemv_mma_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                              int num_rows, int inner, const NW* __restrict__ norm_weight = nullptr,
                                              float eps = 0.0f) {
    static_assert(!(NORM && FOLDED), "one way to normalise x");
    constexpr int FEATURES = EPI::gated ? 8 : 16;
    __shared__ float partial[WARPS][16][8];
    __shared__ float partial_squares[WARPS][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int first = blockIdx.x * FEATURES;
    const bf16* row_a = w + weight_row<EPI, FEATURES>(first, g, num_rows) * inner;
    const bf16* row_b = w + weight_row<EPI, FEATURES>(first, g + 8, num_rows) * inner;
    const bool has_token = g < num_tokens;
    const bf16* x_row = x + (long long)(has_token ? g : 0) * inner;

    constexpr int STEP = WARPS * 32;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto multiply = [&](uint4 wa, uint4 wb, uint4 xs) {
        const u32 a0[4] = {wa.x, wb.x, wa.y, wb.y};
        const u32 b0[2] = {xs.x, xs.y};
        mma_bf16_16816(acc, a0, b0);
        const u32 a1[4] = {wa.z, wb.z, wa.w, wb.w};
        const u32 b1[2] = {xs.z, xs.w};
        mma_bf16_16816(acc, a1, b1);
    };
    float inverse_rms = 0.0f;  // of token g's row (NORM)
    float squares = 0.0f;      // of the chunks of token g's row this lane loads (FOLDED)
    auto load_x = [&](int k) {
        const uint4 chunk = has_token ? input_chunk<NORM>(x_row, k, norm_weight, inverse_rms) : make_uint4(0, 0, 0, 0);
        if (FOLDED) {
            float values[8];
            bf16x8_to_floats(chunk, values);
#pragma unroll
            for (int i = 0; i < 8; ++i) squares = fmaf(values[i], values[i], squares);
        }
        return chunk;
    };
    int k = warp * 32 + 8 * t;
    {
        // The first step's weights are requested before the previous kernel is waited for (all
        // BATCH chunks, or those a short row has).
        uint4 wa[BATCH], wb[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (k + u * STEP < inner) {
                wa[u] = load_streaming_early(row_a + k + u * STEP);
                wb[u] = load_streaming_early(row_b + k + u * STEP);
            }
        }
        dependent_launch_entry();
        if (NORM) {
            // Warp j sums token j's row (at most 8 tokens, no more than the warps).
            __shared__ float row_inverse_rms[WARPS];
            if (warp < num_tokens) {
                const float sum = warp_sum(row_sum_squares(x + (long long)warp * inner, inner, lane, 32));
                if (lane == 0) row_inverse_rms[warp] = inverse_rms_of(sum, inner, eps);
            }
            __syncthreads();
            inverse_rms = has_token ? row_inverse_rms[g] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (k + u * STEP < inner) multiply(wa[u], wb[u], load_x(k + u * STEP));
        }
        k += BATCH * STEP;
    }
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 wa[BATCH], wb[BATCH], xs[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            wa[u] = load_streaming(row_a + k + u * STEP);
            wb[u] = load_streaming(row_b + k + u * STEP);
            xs[u] = load_x(k + u * STEP);
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) multiply(wa[u], wb[u], xs[u]);
    }
    for (; k < inner; k += STEP) multiply(load_streaming(row_a + k), load_streaming(row_b + k), load_x(k));
    // acc: (row g, tokens 2t, 2t + 1) and (row g + 8, tokens 2t, 2t + 1)
    store_mma_tile(partial[warp], acc, g, t);
    if (FOLDED) {
        squares += __shfl_xor_sync(0xffffffffu, squares, 1);
        squares += __shfl_xor_sync(0xffffffffu, squares, 2);
        if (t == 0) partial_squares[warp][g] = squares;
    }
    __syncthreads();
    if (threadIdx.x < FEATURES * 8) {
        const int f = threadIdx.x / 8, n = threadIdx.x % 8;
        const int feature = first + f;
        if (feature < num_rows && n < num_tokens) {
            const float biased = bias != nullptr ? to_float(bias[feature]) : 0.0f;
            float total = FOLDED ? 0.0f : biased, up = 0.0f;
#pragma unroll
            for (int j = 0; j < WARPS; ++j) total += partial[j][f][n];
            if (EPI::gated) {
#pragma unroll
                for (int j = 0; j < WARPS; ++j) up += partial[j][f + 8][n];
            }
            if (FOLDED) {
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < WARPS; ++j) sum += partial_squares[j][n];
                const float scale = inverse_rms_of(sum, inner, eps);
                total = total * scale + biased;
                up *= scale;
            }
            store_feature<EPI>(out + (long long)n * num_rows + feature, total, up);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points. They wait for the previous grid inside the impl, after the first weight loads.
#define DEFINE_GEMV(OUT_NAME, OUT, ROWS, TOKENS)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_##OUT_NAME##_r##ROWS##_t##TOKENS(       \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner) {   \
        gemv_impl<OUT, ROWS, TOKENS, Plain>(x, w, bias, out, num_tokens, num_rows, inner);                     \
    }

#define DEFINE_GEMV_TOKENS(OUT_NAME, OUT, ROWS) \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 1)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 2)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 4)         \
    DEFINE_GEMV(OUT_NAME, OUT, ROWS, 8)

// One token row, 4 rows, 2 warps (see gemv_impl): gemv_{bf16,f32}_r4_w2_t1.
#define DEFINE_GEMV_W2(OUT_NAME, OUT)                                                                          \
    extern "C" __global__ void __launch_bounds__(2 * 32) gemv_##OUT_NAME##_r4_w2_t1(                           \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner) {   \
        gemv_impl<OUT, 4, 1, Plain, false, bf16, false, 2>(x, w, bias, out, num_tokens, num_rows, inner);      \
    }

DEFINE_GEMV_W2(bf16, bf16)
DEFINE_GEMV_W2(f32, float)
DEFINE_GEMV_TOKENS(bf16, bf16, 1)
DEFINE_GEMV_TOKENS(bf16, bf16, 2)
DEFINE_GEMV_TOKENS(bf16, bf16, 4)
DEFINE_GEMV_TOKENS(f32, float, 1)
DEFINE_GEMV_TOKENS(f32, float, 2)
DEFINE_GEMV_TOKENS(f32, float, 4)

#define DEFINE_GEMV_MMA(PREFIX, SHAPE, WARPS, NAME, OUT)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) PREFIX##NAME(                                   \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner) { \
        gemv_mma_impl<SHAPE, OUT, Plain>(x, w, bias, out, num_tokens, num_rows, inner);                      \
    }

DEFINE_GEMV_MMA(gemv_mma_, MMA_NARROW, 8, bf16, bf16)
DEFINE_GEMV_MMA(gemv_mma_, MMA_NARROW, 8, f32, float)
DEFINE_GEMV_MMA(gemv_mma_wide_, MMA_WIDE, 16, bf16, bf16)
DEFINE_GEMV_MMA(gemv_mma_wide_, MMA_WIDE, 16, f32, float)

// The fused decode variants: one token row on the SIMT kernel, 2..8 on the mma kernel.
// [rmsnorm_<norm weight type>_]gated_<act>, rmsnorm_<norm weight type>: out = [act-gated]
// [rmsnorm](x) w^T;  add: out += x w^T.
#define DEFINE_GEMV_FUSED_ROWS(NAME, EPI, NORM, NW, ROWS)                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_##NAME##_r##ROWS##_t1(                \
        const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner,   \
        const NW* norm_weight, float eps) {                                                                   \
        gemv_impl<bf16, ROWS, 1, EPI, NORM, NW>(x, w, bias, out, num_tokens, num_rows, inner, norm_weight,    \
                                                eps);                                                         \
    }

#define DEFINE_GEMV_MMA_FUSED(PREFIX, SHAPE, WARPS, NAME, EPI, NORM, NW)                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) PREFIX##NAME(                                    \
        const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner,   \
        const NW* norm_weight, float eps) {                                                                   \
        gemv_mma_impl<SHAPE, bf16, EPI, NORM, NW>(x, w, bias, out, num_tokens, num_rows, inner, norm_weight,  \
                                                  eps);                                                       \
    }

#define DEFINE_GEMV_FUSED(NAME, EPI, NORM, NW)                     \
    DEFINE_GEMV_FUSED_ROWS(NAME, EPI, NORM, NW, 2)                 \
    DEFINE_GEMV_FUSED_ROWS(NAME, EPI, NORM, NW, 4)                 \
    DEFINE_GEMV_MMA_FUSED(gemv_mma_, MMA_NARROW, 8, NAME, EPI, NORM, NW)

// gemv_{add,rmsnorm_bf16,rmsnorm_f32}_r4_w2_t1: 2 warps a block (see gemv_impl).
#define DEFINE_GEMV_FUSED_W2(NAME, EPI, NORM, NW)                                                             \
    extern "C" __global__ void __launch_bounds__(2 * 32) gemv_##NAME##_r4_w2_t1(                              \
        const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner,   \
        const NW* norm_weight, float eps) {                                                                   \
        gemv_impl<bf16, 4, 1, EPI, NORM, NW, false, 2>(x, w, bias, out, num_tokens, num_rows, inner,          \
                                                       norm_weight, eps);                                     \
    }

DEFINE_GEMV_FUSED_W2(add, AddTo, false, bf16)
DEFINE_GEMV_FUSED_W2(rmsnorm_bf16, Plain, true, bf16)
DEFINE_GEMV_FUSED_W2(rmsnorm_f32, Plain, true, float)
DEFINE_GEMV_FUSED_ROWS(rmsnorm_bf16, Plain, true, bf16, 1)
DEFINE_GEMV_FUSED_ROWS(rmsnorm_f32, Plain, true, float, 1)
DEFINE_GEMV_FUSED_ROWS(add, AddTo, false, bf16, 1)
DEFINE_GEMV_FUSED(rmsnorm_bf16, Plain, true, bf16)
DEFINE_GEMV_FUSED(rmsnorm_f32, Plain, true, float)
DEFINE_GEMV_FUSED(rmsnorm_bf16_gated_silu, Gated<SiluOp>, true, bf16)
DEFINE_GEMV_FUSED(rmsnorm_f32_gated_silu, Gated<SiluOp>, true, float)
DEFINE_GEMV_FUSED(rmsnorm_bf16_gated_gelu_tanh, Gated<GeluTanhOp>, true, bf16)
DEFINE_GEMV_FUSED(rmsnorm_f32_gated_gelu_tanh, Gated<GeluTanhOp>, true, float)
DEFINE_GEMV_FUSED(gated_silu, Gated<SiluOp>, false, bf16)
DEFINE_GEMV_FUSED(gated_gelu_tanh, Gated<GeluTanhOp>, false, bf16)
DEFINE_GEMV_FUSED(add, AddTo, false, bf16)
// Rows wider than 2048 (no norm inside: folded, or the norm kernel before).
DEFINE_GEMV_MMA_FUSED(gemv_mma_wide_, MMA_WIDE, 16, gated_silu, Gated<SiluOp>, false, bf16)
DEFINE_GEMV_MMA_FUSED(gemv_mma_wide_, MMA_WIDE, 16, gated_gelu_tanh, Gated<GeluTanhOp>, false, bf16)
DEFINE_GEMV_MMA_FUSED(gemv_mma_wide_, MMA_WIDE, 16, add, AddTo, false, bf16)

// The folded variants (one token row): x is the raw residual and w carries the norm weight in its
// columns (W diag(g), folded when the model was loaded); out = rmsnorm(x) w^T with no norm
// kernel and no prologue. gemv_folded_{bf16,f32}_r{1,2,4}_t1, gemv_folded_gated_<act>_r{2,4}_t1
// (norm_weight is unused). (A rope variant, the qkv GEMV rotating q and k itself, measured slower
// than the RoPE kernel at width 4096: Llama-3.1-8B batch 1 4208 us against 4062 on an H200.)
#define DEFINE_GEMV_FOLDED_ROWS(NAME, OUT, EPI, ROWS)                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_folded_##NAME##_r##ROWS##_t1(          \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner,    \
        const bf16* norm_weight, float eps) {                                                                 \
        gemv_impl<OUT, ROWS, 1, EPI, false, bf16, true>(x, w, bias, out, num_tokens, num_rows, inner, nullptr, \
                                                        eps);                                                 \
    }

DEFINE_GEMV_FOLDED_ROWS(bf16, bf16, Plain, 1)
DEFINE_GEMV_FOLDED_ROWS(bf16, bf16, Plain, 2)
DEFINE_GEMV_FOLDED_ROWS(bf16, bf16, Plain, 4)
DEFINE_GEMV_FOLDED_ROWS(f32, float, Plain, 1)
DEFINE_GEMV_FOLDED_ROWS(f32, float, Plain, 2)
DEFINE_GEMV_FOLDED_ROWS(f32, float, Plain, 4)
DEFINE_GEMV_FOLDED_ROWS(gated_silu, bf16, Gated<SiluOp>, 2)
DEFINE_GEMV_FOLDED_ROWS(gated_silu, bf16, Gated<SiluOp>, 4)
DEFINE_GEMV_FOLDED_ROWS(gated_gelu_tanh, bf16, Gated<GeluTanhOp>, 2)
DEFINE_GEMV_FOLDED_ROWS(gated_gelu_tanh, bf16, Gated<GeluTanhOp>, 4)

// 2..8 token rows on the tensor cores, the wide shape (norms are folded only past 2048):
// gemv_mma_folded_{bf16,f32,gated_<act>} (norm_weight unused).
#define DEFINE_GEMV_MMA_FOLDED(NAME, OUT, EPI)                                                                \
    extern "C" __global__ void __launch_bounds__(16 * 32) gemv_mma_folded_##NAME(                             \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_rows, int inner,    \
        const bf16* norm_weight, float eps) {                                                                 \
        gemv_mma_impl<MMA_WIDE, OUT, EPI, false, bf16, true>(x, w, bias, out, num_tokens, num_rows, inner,    \
                                                             nullptr, eps);                                   \
    }

DEFINE_GEMV_MMA_FOLDED(bf16, bf16, Plain)
DEFINE_GEMV_MMA_FOLDED(f32, float, Plain)
DEFINE_GEMV_MMA_FOLDED(gated_silu, bf16, Gated<SiluOp>)
DEFINE_GEMV_MMA_FOLDED(gated_gelu_tanh, bf16, Gated<GeluTanhOp>)

// The rope variants (one token row, the norm inside): gemv_rmsnorm_<norm weight type>_rope_<table
// type>_r{2,4}_t1. (Without the norm, behind the norm kernel at width 4096, the fusion measured
// slower than the RoPE kernel: Llama-3.1-8B batch 1 4373-4415 us against 4231-4272 on an H200.)
// out is q_out [1, Hq D]; num_rows = (Hq + 2 Hkv) D.
#define DEFINE_GEMV_ROPE_ROWS(NAME, NORM, NW, TABLE, ROWS)                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_##NAME##_r##ROWS##_t1(                 \
        const bf16* x, const bf16* w, const bf16* bias, bf16* q_out, int num_tokens, int num_rows, int inner,  \
        const NW* norm_weight, float eps, const int* positions, const int* slot_mapping, const TABLE* table,   \
        int max_position, bf16* k_plane, bf16* v_plane, int num_q_heads, int num_kv_heads, int head_dim,       \
        int block_size) {                                                                                      \
        gemv_impl<bf16, ROWS, 1, Rope<TABLE>, NORM, NW>(                                                       \
            x, w, bias, q_out, num_tokens, num_rows, inner, norm_weight, eps,                                  \
            RopeArgs<TABLE>{positions, slot_mapping, table, max_position, k_plane, v_plane, num_q_heads,       \
                            num_kv_heads, head_dim, block_size});                                              \
    }

#define DEFINE_GEMV_ROPE(NAME, NORM, NW, TABLE)        \
    DEFINE_GEMV_ROPE_ROWS(NAME, NORM, NW, TABLE, 2) \
    DEFINE_GEMV_ROPE_ROWS(NAME, NORM, NW, TABLE, 4)

DEFINE_GEMV_ROPE(rmsnorm_bf16_rope_f32, true, bf16, float)
DEFINE_GEMV_ROPE(rmsnorm_bf16_rope_bf16, true, bf16, bf16)
DEFINE_GEMV_ROPE(rmsnorm_f32_rope_f32, true, float, float)
DEFINE_GEMV_ROPE(rmsnorm_f32_rope_bf16, true, float, bf16)

// ---------------------------------------------------------------------------------------------
// Skinny GEMM for 9..64 token rows (batched decode) on Hopper: the same product, out[n, m] =
// sum_k x[n, k] w[m, k], with the tokens as the 64 rows of wgmma's M and a tile of BN weight rows
// as its N. At N = 64 tokens the product is 64 FLOPs per weight byte, under the ridge: the kernel
// must stream the weights at HBM bandwidth, which takes a deep pipeline on every SM, every SM
// busy for the same time, and no step between tiles that is not streaming.
//
// Work: the weight's row tiles (BN rows; gated: BN / 2 features' gate rows then their up rows)
// times K in 64-wide units. The host's plan (ops_dense.skinny_plan) picks BN and a split S of K
// so that every SM gets the same bytes:
//   S = 1: persistent blocks, one per SM, each taking tiles b, b + gridDim.x, ... whole;
//   S > 1: a cluster of S blocks per tile, block rank r taking K units [r KI / S, (r + 1) KI / S);
//          the blocks then store their fp32 sums to their own shared memory, and after a
//          cluster barrier each reduces 1/S of the tile's outputs over the S blocks' sums read
//          through distributed shared memory, in rank order (the result does not depend on
//          timing), and runs the epilogue. One wave: the host keeps tiles x S within the
//          clusters the GPU holds at once.
//
// In a block, warp 4 is the producer: one lane issues TMA copies into a ring of stages, each x's
// [64 tokens][64] tile (its token rows rounded up to 8; the tile's other rows are stale and feed
// only output rows that are never stored) then the weight's [BN][64],
// both 128-byte swizzled, and full[s] counts the bytes in. The first stages' weights are
// requested before griddepcontrol.wait (they do not depend on the previous kernel), so the weight
// stream overlaps that kernel's tail; x follows after the wait. Warps 0-3, one warpgroup, wait on
// full[s], run wgmma m64n64k16 (and m64n32k16) over the tile's columns (A = x, B = the weights,
// both from shared memory), and release the stage on empty[s]. Thread (warp w, g = lane / 4,
// t = lane % 4) ends with
//
//     acc[4 j + e]: token 16 w + g + 8 (e / 2), tile row 8 j + 2 t + e % 2
//
// so gated, acc[4 j + e] (j < BN / 16) is a gate and acc[4 (j + BN / 16) + e] its up. Epilogues:
// bias (bf16 or f32 out), the gated activation (gate and up rounded to bf16 as the unfused
// product would be), or the add into the residual.
#include "tma.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SKINNY_TMA 1
#else
#define SKINNY_TMA 0
#endif
#define SKINNY_TOKENS 64
#define SKINNY_STAGE_K 64
#define SKINNY_CONSUMERS 128
#define SKINNY_THREADS (SKINNY_CONSUMERS + 32)
#define SKINNY_RING_BYTES (200 * 1024)

template <int BN>
struct SkinnyTile {
    static constexpr int x_bytes = SKINNY_TOKENS * SKINNY_STAGE_K * 2;
    static constexpr int stage_bytes = x_bytes + BN * SKINNY_STAGE_K * 2;
    static constexpr int stages = SKINNY_RING_BYTES / stage_bytes < 8 ? SKINNY_RING_BYTES / stage_bytes : 8;
    // Dynamic shared memory: 1024 bytes of alignment slack, the ring, 2 barriers per stage
    // (ops_dense.skinny_shared_bytes says the same).
    static constexpr int shared_bytes = 1024 + stages * stage_bytes + 16 * stages;
};

// acc (+)= x_stage w_stage^T for one 16-wide k step: the tile's columns in wgmma n64 chunks, then
// n32 and n16 ones for the rest (each chunk's accumulators and B rows follow the previous ones').
template <int BN>
__device__ __forceinline__ void skinny_mma(float* acc, u64 desc_x, const unsigned char* w_step) {
    constexpr int FULL = BN / 64, REST = BN % 64, N16_ROW = 64 * FULL + (REST >= 32 ? 32 : 0);
#pragma unroll
    for (int c = 0; c < FULL; ++c)
        wgmma_m64n64k16_ss(acc + 32 * c, desc_x, wgmma_descriptor(w_step + 64 * 128 * c, 16, 1024), 1);
    if constexpr (REST >= 32)
        wgmma_m64n32k16_ss(acc + 32 * FULL, desc_x, wgmma_descriptor(w_step + 64 * 128 * FULL, 16, 1024), 1);
    if constexpr (REST % 32 == 16)
        wgmma_m64n16k16_ss(acc + N16_ROW / 2, desc_x, wgmma_descriptor(w_step + 128 * N16_ROW, 16, 1024), 1);
}

template <typename EPI>
struct IsAddTo {
    static constexpr bool value = false;
};
template <>
struct IsAddTo<AddTo> {
    static constexpr bool value = true;
};

// The bf16 pair a plain, gated or add form stores for features `feature` and feature + 1 of one
// token, whose sums are v[0], v[1] (gated: the gates', up[] the up rows'); the bias is added to
// features that exist.
template <typename EPI>
__device__ __forceinline__ u32 skinny_pair(const bf16* bias, int num_features, int feature, const float* v,
                                           const float* up) {
    float value[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float total = v[e];
        if (!EPI::gated && bias != nullptr && feature + e < num_features) total += to_float(bias[feature + e]);
        value[e] = feature_value<EPI>(total, EPI::gated ? up[e] : 0.0f);
    }
    return pack_bf16x2(value[0], value[1]);
}

// Stores the outputs of token rows n0 and n0 + 8 at features f and f + 1: v[2 h + e] for token
// n0 + 8 h, feature f + e (gated: the gate, `up` the up row's sum). QUADS: the four lanes of each
// quad call it together with f = f0 + 2 t, so between them they hold 8 consecutive features of
// both tokens; bf16 outputs other than the residual add then leave as one 16-byte store per token
// (lane h of the quad stores token n0 + 8 h's) where the rows are whole 16-byte runs. Element by
// element stores of a 64 x 28672 product cost 3 us more (H200; docs/cuda-notes.md run 18).
template <typename OUT, typename EPI, bool QUADS>
__device__ __forceinline__ void skinny_store(OUT* out, const bf16* bias, int num_tokens, int num_features, int n0,
                                             int f, const float* v, const float* up) {
    if constexpr (QUADS && sizeof(OUT) == 2 && !IsAddTo<EPI>::value) {
        if (num_features % 8 == 0 && (reinterpret_cast<unsigned long long>(out) & 15) == 0) {
            const int t = threadIdx.x & 3, f0 = f - 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 pair = skinny_pair<EPI>(bias, num_features, f, v + 2 * h, up + 2 * h);
                uint4 run;
                run.x = __shfl_sync(0xffffffffu, pair, 0, 4);
                run.y = __shfl_sync(0xffffffffu, pair, 1, 4);
                run.z = __shfl_sync(0xffffffffu, pair, 2, 4);
                run.w = __shfl_sync(0xffffffffu, pair, 3, 4);
                const int n = n0 + 8 * h;
                if (t == h && n < num_tokens && f0 < num_features)
                    *reinterpret_cast<uint4*>(out + (long long)n * num_features + f0) = run;
            }
            return;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = n0 + 8 * h;
        if (n >= num_tokens) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int feature = f + e;
            if (feature >= num_features) continue;
            float total = v[2 * h + e];
            if (!EPI::gated && bias != nullptr) total += to_float(bias[feature]);
            store_feature<EPI>(out + (long long)n * num_features + feature, total, EPI::gated ? up[2 * h + e] : 0.0f);
        }
    }
}

// The staged epilogue: a tile's outputs go to shared memory (a row of TF features per token,
// 16 bytes of padding so that a quad's rows fall in different banks) and leave in whole 16-byte
// runs of consecutive features, a warp covering whole rows. Under the weight stream of the next
// product, stores a quad at a time (16 bytes per token row) cost ~0.8 us a product more than
// whole lines, and element-by-element ones ~3 us more (H200; docs/cuda-notes.md run 20).
__device__ __forceinline__ void skinny_consumers_sync() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(SKINNY_CONSUMERS) : "memory");
}

template <int TF>
struct SkinnyStaging {
    static constexpr int row_bytes = TF * 2 + 16;
    static constexpr int bytes = SKINNY_TOKENS * row_bytes;
};

// The values of tokens n0 and n0 + 8 at the tile's features f and f + 1 (global feature
// `feature`) into the staging rows: v[2 h + e] as skinny_store takes them, rounded to bf16 (the
// add form stores the product, added to the residual on the way out).
template <int TF, typename EPI>
__device__ __forceinline__ void skinny_stage(unsigned char* staging, const bf16* bias, int num_features, int n0, int f,
                                             int feature, const float* v, const float* up) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
        *reinterpret_cast<u32*>(staging + (n0 + 8 * h) * SkinnyStaging<TF>::row_bytes + 2 * f) =
            skinny_pair<EPI>(bias, num_features, feature, v + 2 * h, up + 2 * h);
}

// Token rows [row0, row1) of a staged tile to out[:, feature0 : feature0 + TF] (features past
// num_features left out; num_features is a multiple of 8), 16 bytes a thread at a time; the add
// form adds them into out.
template <int TF, typename EPI>
__device__ __forceinline__ void skinny_copy_out(const unsigned char* staging, bf16* out, int row0, int row1,
                                                int num_features, int feature0) {
    constexpr int RUNS = TF / 8;
    for (int c = threadIdx.x; c < (row1 - row0) * RUNS; c += SKINNY_CONSUMERS) {
        const int row = row0 + c / RUNS, run = c % RUNS, feature = feature0 + 8 * run;
        if (feature >= num_features) continue;
        uint4 value = *reinterpret_cast<const uint4*>(staging + row * SkinnyStaging<TF>::row_bytes + 16 * run);
        bf16* dst = out + (long long)row * num_features + feature;
        if (IsAddTo<EPI>::value) {
            const uint4 residual = *reinterpret_cast<const uint4*>(dst);
            u32* words = reinterpret_cast<u32*>(&value);
            const u32* old = reinterpret_cast<const u32*>(&residual);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&old[w]);
                const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&words[w]);
                words[w] = pack_bf16x2(__low2float(a) + __low2float(b), __high2float(a) + __high2float(b));
            }
        }
        *reinterpret_cast<uint4*>(dst) = value;
    }
}

// Split K: the sums of fragment slot `mine` (and, gated, its up column's) over the cluster's
// blocks, in rank order.
template <typename EPI, int COLUMNS>
__device__ __forceinline__ void skinny_cluster_sum(const float4* mine, int splits, float* sum, float* up) {
    for (int b = 0; b < splits; ++b) {
        const float4 part = load_cluster_float4(cluster_address(mine, b));
        sum[0] += part.x, sum[1] += part.y, sum[2] += part.z, sum[3] += part.w;
        if (EPI::gated) {
            const float4 part_up = load_cluster_float4(cluster_address(mine + COLUMNS / 2 * SKINNY_CONSUMERS, b));
            up[0] += part_up.x, up[1] += part_up.y, up[2] += part_up.z, up[3] += part_up.w;
        }
    }
}

template <int BN, typename OUT, typename EPI>
__device__ __forceinline__ void skinny_impl(const TmaMap* w_map, const TmaMap* x_map, const bf16* __restrict__ bias,
                                            OUT* __restrict__ out, int num_tokens, int num_features, int inner,
                                            int tiles, int splits) {
#if SKINNY_TMA
    typedef SkinnyTile<BN> Tile;
    constexpr int STAGES = Tile::stages, COLUMNS = BN / 8;  // fragment columns j
    constexpr int TILE_FEATURES = EPI::gated ? BN / 2 : BN;
    extern __shared__ unsigned char skinny_shared[];
    if (dynamic_shared_bytes() < (u32)Tile::shared_bytes) __trap();
    unsigned char* const ring = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(skinny_shared) + 1023) & ~1023ULL);  // the swizzle's alignment
    u64* const full = reinterpret_cast<u64*>(ring + STAGES * Tile::stage_bytes);
    u64* const empty = full + STAGES;
    const int k_iters = (inner + SKINNY_STAGE_K - 1) / SKINNY_STAGE_K;
    // This block's tiles (first, step, count) and K units [k_begin, k_end) of each.
    const bool split = splits > 1;
    const int rank = split ? (int)cluster_rank() : 0;
    const int first_tile = split ? blockIdx.x / splits : blockIdx.x;
    const int tile_step = split ? tiles : gridDim.x;
    const int k_begin = rank * k_iters / splits, k_end = (rank + 1) * k_iters / splits;
    const int units_per_tile = k_end - k_begin;
    const int my_tiles = first_tile < tiles ? (tiles - first_tile + tile_step - 1) / tile_step : 0;
    const int units = my_tiles * units_per_tile;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], SKINNY_CONSUMERS / 32);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    grid_dependents_launch();

    if (threadIdx.x >= SKINNY_CONSUMERS) {  // the producer warp
        if (threadIdx.x == SKINNY_CONSUMERS) {
            tma_prefetch_map(w_map);
            tma_prefetch_map(x_map);
            const u64 stream_once = l2_evict_first();
            // x's box holds its token rows rounded up to 8 (ops_dense.skinny_x_box_rows): a box
            // mostly past the matrix costs far more than its bytes (16 token rows in a 64-row
            // box: o 4096 x 4096 17.6 us against 11.8; docs/cuda-notes.md run 19). The stage's
            // rows past the box keep stale data; they feed only output rows past the token
            // count, which are never stored.
            const u32 stage_tx = Tile::stage_bytes - Tile::x_bytes +
                                 (u32)min(SKINNY_TOKENS, (num_tokens + 7) / 8 * 8) * SKINNY_STAGE_K * 2;
            // Blocks that run at the same time start their tiles' K at different units, so they
            // do not all read the same x chunk from L2 at once.
            const int slot = split ? first_tile : blockIdx.x, concurrent = split ? tiles : gridDim.x;
            const int rotation = (int)((long long)slot * units_per_tile / concurrent);
            auto unit_k = [&](int i) {
                return (k_begin + (i % units_per_tile + rotation) % units_per_tile) * SKINNY_STAGE_K;
            };
            auto load_weights = [&](int s, int i) {
                const int tile = first_tile + (i / units_per_tile) * tile_step;
                unsigned char* dst = ring + s * Tile::stage_bytes + Tile::x_bytes;
                if (EPI::gated) {  // the gate rows of the tile's features, then their up rows
                    tma_load_2d_hint(dst, w_map, unit_k(i), tile * TILE_FEATURES, &full[s], stream_once);
                    tma_load_2d_hint(dst + BN * 64, w_map, unit_k(i), num_features + tile * TILE_FEATURES, &full[s],
                                     stream_once);
                } else {
                    tma_load_2d_hint(dst, w_map, unit_k(i), tile * BN, &full[s], stream_once);
                }
            };
            auto load_x = [&](int s, int i) {
                tma_load_2d(ring + s * Tile::stage_bytes, x_map, unit_k(i), 0, &full[s]);
            };
            const int early = min(STAGES, units);
            for (int i = 0; i < early; ++i) {
                mbarrier_arrive_expect_tx(&full[i], stage_tx);
                load_weights(i, i);
            }
            grid_dependency_wait();  // x is the previous kernel's output
            for (int i = 0; i < early; ++i) load_x(i, i);
            for (int i = early; i < units; ++i) {
                const int s = i % STAGES;
                mbarrier_wait(&empty[s], (u32)((i / STAGES) & 1) ^ 1u);
                mbarrier_arrive_expect_tx(&full[s], stage_tx);
                load_weights(s, i);
                load_x(s, i);
            }
        }
        if (split) {  // the producer warp takes part in the cluster's two barriers
            __syncwarp();
            cluster_sync();
            cluster_sync();
        }
        return;
    }

    grid_dependency_wait();  // the epilogues read the residual
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // Whole 16-byte runs of bf16 outputs: the staged epilogue (the ring then holds it).
    static_assert(SkinnyStaging<TILE_FEATURES>::bytes + BN * SKINNY_CONSUMERS * 2 <= STAGES * Tile::stage_bytes,
                  "the staging rows and the split's sums fit in the ring");
    const bool stageable = sizeof(OUT) == 2 && num_features % 8 == 0 && (reinterpret_cast<unsigned long long>(out) & 15) == 0;
    float acc[BN / 2];
    int i = 0;
    for (int n = 0; n < my_tiles; ++n) {
        const int tile = first_tile + n * tile_step;
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) acc[r] = 0.0f;
        for (int u = 0; u < units_per_tile; ++u, ++i) {
            const int s = i % STAGES;
            mbarrier_wait(&full[s], (u32)((i / STAGES) & 1));
            const unsigned char* xs = ring + s * Tile::stage_bytes;
            const unsigned char* ws = xs + Tile::x_bytes;
            wgmma_fence_registers<BN / 2>(acc);
            wgmma_fence();
#pragma unroll
            for (int step = 0; step < SKINNY_STAGE_K / 16; ++step)
                skinny_mma<BN>(acc, wgmma_descriptor(xs + 32 * step, 16, 1024), ws + 32 * step);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_registers<BN / 2>(acc);
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[s]);
        }
        if (split) break;  // one tile per cluster: reduced below
        if (stageable && n == my_tiles - 1) {  // the ring is free after the block's last tile
            skinny_consumers_sync();             // every warp's last wgmma has read its stage
#pragma unroll
            for (int j = 0; j < (EPI::gated ? COLUMNS / 2 : COLUMNS); ++j)
                skinny_stage<TILE_FEATURES, EPI>(ring, bias, num_features, 16 * warp + g, 8 * j + 2 * t,
                                                 tile * TILE_FEATURES + 8 * j + 2 * t, &acc[4 * j],
                                                 &acc[4 * (EPI::gated ? j + COLUMNS / 2 : j)]);
            skinny_consumers_sync();
            skinny_copy_out<TILE_FEATURES, EPI>(ring, reinterpret_cast<bf16*>(out), 0, num_tokens, num_features,
                                                tile * TILE_FEATURES);
            break;
        }
#pragma unroll
        for (int j = 0; j < (EPI::gated ? COLUMNS / 2 : COLUMNS); ++j) {
            const float* up = &acc[4 * (EPI::gated ? j + COLUMNS / 2 : j)];
            const int feature = tile * TILE_FEATURES + 8 * j + 2 * t;
            skinny_store<OUT, EPI, true>(out, bias, num_tokens, num_features, 16 * warp + g, feature, &acc[4 * j], up);
        }
    }
    if (!split) return;

    // Split K: this block's sums to its own ring (every stage is consumed), in fragment order.
    const int active_threads = 32 * min(4, (num_tokens + 15) / 16);
    float4* sums = reinterpret_cast<float4*>(ring);
    if (tid < active_threads) {
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j)
            sums[j * SKINNY_CONSUMERS + tid] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    cluster_sync();
    const int columns = EPI::gated ? COLUMNS / 2 : COLUMNS;
    const int tile = first_tile;
    if (stageable) {
        // Rank r reduces the token rows of warps [r W / S, (r + 1) W / S) of the W active ones,
        // every column, into staging rows after its sums, and stores those rows whole.
        const int warps = active_threads / 32;
        const int first = 32 * (rank * warps / splits), span = 32 * ((rank + 1) * warps / splits) - first;
        unsigned char* const staging = ring + COLUMNS * SKINNY_CONSUMERS * sizeof(float4);
        for (int group = tid; group < columns * span; group += SKINNY_CONSUMERS) {
            const int j = group / span, thread = first + group % span;
            const float4* mine = sums + j * SKINNY_CONSUMERS + thread;
            float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f}, up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            skinny_cluster_sum<EPI, COLUMNS>(mine, splits, sum, up);
            const int lane_of = thread & 31, f = 8 * j + 2 * (lane_of & 3);
            skinny_stage<TILE_FEATURES, EPI>(staging, bias, num_features, 16 * (thread >> 5) + (lane_of >> 2), f,
                                             tile * TILE_FEATURES + f, sum, up);
        }
        skinny_consumers_sync();
        skinny_copy_out<TILE_FEATURES, EPI>(staging, reinterpret_cast<bf16*>(out), first / 2,
                                            min(num_tokens, (first + span) / 2), num_features, tile * TILE_FEATURES);
        cluster_sync();  // no block leaves while another still reads its sums
        return;
    }
    // Rank r's share of the tile: groups [r G / S, (r + 1) G / S) of G = (fragment column,
    // active thread) pairs (gated: the gate columns, each with its up column).
    const int groups = columns * active_threads;
    const int group_end = (rank + 1) * groups / splits;
    for (int group = rank * groups / splits + tid; group < group_end; group += SKINNY_CONSUMERS) {
        const int j = group / active_threads, thread = group % active_threads;
        const float4* mine = sums + j * SKINNY_CONSUMERS + thread;
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f}, up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        skinny_cluster_sum<EPI, COLUMNS>(mine, splits, sum, up);
        const int lane_of = thread & 31;
        skinny_store<OUT, EPI, false>(out, bias, num_tokens, num_features, 16 * (thread >> 5) + (lane_of >> 2),
                                      tile * TILE_FEATURES + 8 * j + 2 * (lane_of & 3), sum, up);
    }
    cluster_sync();  // no block leaves while another still reads its sums
#else
    __trap();  // the host launches it on sm_90a only
#endif
}

// gemm_skinny_<what>_<BN>: 9..64 token rows, SKINNY_THREADS threads, SkinnyTile<BN>::shared_bytes
// of dynamic shared memory; splits = 1: a grid of at most one block per SM, else a grid of tiles x
// splits blocks in clusters of `splits`. <what>: bf16, f32 (out = x w^T +
// bias), gated_<act> (w = [gate; up], out = act(x gate^T) * (x up^T)), add (out += x w^T). w_map:
// the weight [rows, inner] in boxes of [BN][64] (gated: [BN / 2][64]); x_map: x [num_tokens,
// inner] in boxes of [min(64, num_tokens rounded up to 8)][64], both 128-byte swizzled. num_features: rows
// of w (gated: of each half); tiles: ceil(num_features / BN) (gated: / (BN / 2)).
#define DEFINE_SKINNY(NAME, OUT, EPI, BN)                                                                           \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, 1)                                                 \
        gemm_skinny_##NAME##_##BN(const __grid_constant__ TmaMap w_map, const __grid_constant__ TmaMap x_map,       \
                                  const bf16* bias, OUT* out, int num_tokens, int num_features, int inner, int tiles, \
                                  int splits) {                                                                     \
        skinny_impl<BN, OUT, EPI>(&w_map, &x_map, bias, out, num_tokens, num_features, inner, tiles, splits);      \
    }

#define DEFINE_SKINNY_WIDTHS(NAME, OUT, EPI) \
    DEFINE_SKINNY(NAME, OUT, EPI, 64)        \
    DEFINE_SKINNY(NAME, OUT, EPI, 96)        \
    DEFINE_SKINNY(NAME, OUT, EPI, 128)       \
    DEFINE_SKINNY(NAME, OUT, EPI, 144)       \
    DEFINE_SKINNY(NAME, OUT, EPI, 160)       \
    DEFINE_SKINNY(NAME, OUT, EPI, 192)       \
    DEFINE_SKINNY(NAME, OUT, EPI, 224)       \
    DEFINE_SKINNY(NAME, OUT, EPI, 256)

DEFINE_SKINNY_WIDTHS(bf16, bf16, Plain)
DEFINE_SKINNY_WIDTHS(f32, float, Plain)
DEFINE_SKINNY_WIDTHS(gated_silu, bf16, Gated<SiluOp>)
DEFINE_SKINNY_WIDTHS(gated_gelu_tanh, bf16, Gated<GeluTanhOp>)
DEFINE_SKINNY_WIDTHS(add, bf16, AddTo)

// Bias for the cuBLASLt path when its epilogue cannot take it (f32 output): out[n, m] += bias[m].
template <typename OUT>
__device__ __forceinline__ void add_bias_impl(OUT* out, const bf16* bias, int num_tokens, int num_rows) {
    const long long total = (long long)num_tokens * num_rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_float<OUT>(to_float(out[i]) + to_float(bias[i % num_rows]));
}

extern "C" __global__ void add_bias_bf16(bf16* out, const bf16* bias, int num_tokens, int num_rows) {
    dependent_launch_entry();
    add_bias_impl<bf16>(out, bias, num_tokens, num_rows);
}

extern "C" __global__ void add_bias_f32(float* out, const bf16* bias, int num_tokens, int num_rows) {
    dependent_launch_entry();
    add_bias_impl<float>(out, bias, num_tokens, num_rows);
}

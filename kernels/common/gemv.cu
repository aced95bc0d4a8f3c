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

__device__ __forceinline__ uint4 load_streaming(const bf16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The same load, issued where it stands: before the wait for the previous grid (volatile asm
// statements keep their order, so the compiler cannot sink it below griddepcontrol.wait).
__device__ __forceinline__ uint4 load_streaming_early(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

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

template <typename EPI, typename OUT>
__device__ __forceinline__ void store_feature(OUT* slot, float total, float up) {
    if (EPI::gated) {
        const typename ActOf<EPI>::type act;
        total = act(to_float(from_float<bf16>(total))) * to_float(from_float<bf16>(up));
    }
    *slot = from_float<OUT>(total);
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
template <typename OUT, int ROWS, int TOKENS, typename EPI, bool NORM = false, typename NW = bf16,
          bool FOLDED = false>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                          int num_rows, int inner, const NW* __restrict__ norm_weight = nullptr,
                                          float eps = 0.0f, typename EPI::Args args = typename EPI::Args()) {
    static_assert(!EPI::rope || (TOKENS == 1 && ROWS % 2 == 0), "rope: one token, whole pairs per block");
    static_assert(!(NORM && FOLDED), "one way to normalise x");
    static_assert(!(EPI::rope && FOLDED), "the rope epilogue takes unscaled sums (measured slower folded)");
    constexpr int FEATURES = EPI::gated ? ROWS / 2 : ROWS;
    __shared__ float partial[GEMV_WARPS][ROWS][TOKENS];
    __shared__ float partial_squares[GEMV_WARPS][TOKENS];
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
    constexpr int STEP = GEMV_WARPS * 32 * 8;
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
        for (int j = 0; j < GEMV_WARPS; ++j) sum += partial_squares[j][n];
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
                for (int j = 0; j < GEMV_WARPS; ++j) total += partial[j][r][0];
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
            for (int j = 0; j < GEMV_WARPS; ++j) total += partial[j][f][n];
            if (EPI::gated) {
#pragma unroll
                for (int j = 0; j < GEMV_WARPS; ++j) up += partial[j][f + FEATURES][n];
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
// The block's 8 warps split K and meet in shared memory. K % 32 == 0 (the host checks).
#define GEMV_MMA_WARPS 8

template <typename OUT, typename EPI, bool NORM = false, typename NW = bf16>
__device__ __forceinline__ void gemv_mma_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                              int num_rows, int inner, const NW* __restrict__ norm_weight = nullptr,
                                              float eps = 0.0f) {
    constexpr int FEATURES = EPI::gated ? 8 : 16;
    __shared__ float partial[GEMV_MMA_WARPS][16][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int first = blockIdx.x * FEATURES;
    const bf16* row_a = w + weight_row<EPI, FEATURES>(first, g, num_rows) * inner;
    const bf16* row_b = w + weight_row<EPI, FEATURES>(first, g + 8, num_rows) * inner;
    const bool has_token = g < num_tokens;
    const bf16* x_row = x + (long long)(has_token ? g : 0) * inner;

    // Full steps of four chunks load 8 x 16 bytes of weights per lane before the first mma; the
    // remaining chunks go one at a time.
    constexpr int STEP = GEMV_MMA_WARPS * 32;
    constexpr int BATCH = 4;
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
    auto load_x = [&](int k) {
        return has_token ? input_chunk<NORM>(x_row, k, norm_weight, inverse_rms) : make_uint4(0, 0, 0, 0);
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
            // Warp j sums token j's row (8 warps, at most 8 tokens).
            __shared__ float row_inverse_rms[GEMV_MMA_WARPS];
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
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t] = acc[2];
    partial[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (threadIdx.x < FEATURES * 8) {
        const int f = threadIdx.x / 8, n = threadIdx.x % 8;
        const int feature = first + f;
        if (feature < num_rows && n < num_tokens) {
            float total = bias != nullptr ? to_float(bias[feature]) : 0.0f, up = 0.0f;
#pragma unroll
            for (int j = 0; j < GEMV_MMA_WARPS; ++j) total += partial[j][f][n];
            if (EPI::gated) {
#pragma unroll
                for (int j = 0; j < GEMV_MMA_WARPS; ++j) up += partial[j][f + 8][n];
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

DEFINE_GEMV_TOKENS(bf16, bf16, 1)
DEFINE_GEMV_TOKENS(bf16, bf16, 2)
DEFINE_GEMV_TOKENS(bf16, bf16, 4)
DEFINE_GEMV_TOKENS(f32, float, 1)
DEFINE_GEMV_TOKENS(f32, float, 2)
DEFINE_GEMV_TOKENS(f32, float, 4)

extern "C" __global__ void __launch_bounds__(GEMV_MMA_WARPS * 32)
    gemv_mma_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner) {
    gemv_mma_impl<bf16, Plain>(x, w, bias, out, num_tokens, num_rows, inner);
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_WARPS * 32)
    gemv_mma_f32(const bf16* x, const bf16* w, const bf16* bias, float* out, int num_tokens, int num_rows, int inner) {
    gemv_mma_impl<float, Plain>(x, w, bias, out, num_tokens, num_rows, inner);
}

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

#define DEFINE_GEMV_FUSED(NAME, EPI, NORM, NW)                                                                \
    DEFINE_GEMV_FUSED_ROWS(NAME, EPI, NORM, NW, 2)                                                            \
    DEFINE_GEMV_FUSED_ROWS(NAME, EPI, NORM, NW, 4)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_MMA_WARPS * 32) gemv_mma_##NAME(                        \
        const bf16* x, const bf16* w, const bf16* bias, bf16* out, int num_tokens, int num_rows, int inner,   \
        const NW* norm_weight, float eps) {                                                                   \
        gemv_mma_impl<bf16, EPI, NORM, NW>(x, w, bias, out, num_tokens, num_rows, inner, norm_weight, eps);   \
    }

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
// Skinny GEMM for 9..64 token rows (batched decode): the same product with TOKENS = 8 NT rows of
// x, on tensor cores. At N = 64 the product is 64 FLOPs per weight byte, still under the ridge,
// so the kernel must stream the weights at HBM bandwidth like the GEMVs above, and like them it
// requests its first weights before it waits for the previous kernel (cuBLASLt's kernels take
// no part in PDL, so each of them waits for its predecessor's grid to drain first).
//
// A block of 8 warps owns 128 weight rows and a range of K (split-K when the row tiles alone
// give too few blocks). Both operands stream through a ring of SKINNY_STAGES shared-memory
// stages, 64 wide in K, filled by cp.async: the weight tile [128][64] and the x tile
// [TOKENS][64], each row 128 bytes, so copies run along whole rows and the ring (not registers)
// holds the bytes in flight; the first SKINNY_STAGES - 1 weight stages are requested before the
// wait. Granule q (16 bytes) of row r sits at q ^ (r & 7): the 128-byte swizzle of wgmma.cuh's
// panels, which also keeps ldmatrix's 8 rows on 8 different bank groups.
//
// On sm_90a each warpgroup multiplies 64 of the rows by all tokens with wgmma (m64 n8NT k16,
// both operands from shared memory); elsewhere warp w takes rows 16 w .. 16 w + 15 with
// mma.sync (ldmatrix.x4 fragments). Either way thread (warp w, g = lane / 4, t = lane % 4) ends
// with the accumulator layout of wgmma:
//
//     acc[4 j + e]: row 16 w + g + 8 (e / 2) of the block's 128, token 8 j + 2 t + e % 2
//
// Gated, warp w's 16 rows are the gate rows of 8 features (g) and their up rows (g + 8), so each
// thread holds both halves of its outputs. With split-K (gridDim.y > 1) each block stores its
// fp32 sums, in fragment order, to `partials`; the last block of a row tile to finish adds them
// up in split order (the result does not depend on which block was last) and runs the epilogue:
// bias, the gated activation (gate and up rounded to bf16 as the unfused product would be), or
// the add into the residual.
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SKINNY_WGMMA 1
#else
#define SKINNY_WGMMA 0
#endif
#define SKINNY_THREADS 256
#define SKINNY_ROWS 128
#define SKINNY_STAGE_K 64
#define SKINNY_STAGES 4

template <int NT>
struct SkinnyShape {
    static constexpr int tokens = 8 * NT;
    static constexpr int weight_bytes = SKINNY_ROWS * SKINNY_STAGE_K * 2;
    static constexpr int stage_bytes = (SKINNY_ROWS + tokens) * SKINNY_STAGE_K * 2;  // a multiple of 1024
};

// Byte offset of granule q of row r in a stage's tile.
__device__ __forceinline__ int skinny_at(int r, int q) { return r * 128 + 16 * (q ^ (r & 7)); }

template <int NT>
__device__ __forceinline__ void skinny_wgmma(float* acc, u64 desc_a, u64 desc_b) {
    if constexpr (NT == 8) {
        wgmma_m64n64k16_ss(acc, desc_a, desc_b, 1);
    } else if constexpr (NT == 4) {
        wgmma_m64n32k16_ss(acc, desc_a, desc_b, 1);
    } else {
        wgmma_m64n16k16_ss(acc, desc_a, desc_b, 1);
    }
}

template <int NT, typename OUT, typename EPI>
__device__ __forceinline__ void skinny_impl(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                            const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                            int num_features, int inner, int split_len, float* __restrict__ partials,
                                            unsigned* __restrict__ counters) {
    typedef SkinnyShape<NT> Shape;
    extern __shared__ uint4 skinny_shared[];
    unsigned char* const ring = reinterpret_cast<unsigned char*>(skinny_shared);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int k_begin = blockIdx.y * split_len;
    const int k_end = min(inner, k_begin + split_len);
    const int num_stages = (k_end - k_begin + SKINNY_STAGE_K - 1) / SKINNY_STAGE_K;

    // The weight row behind row r of the block's tile: row 128 b + r, or (gated) for r = 16 v + s
    // the gate row (s < 8) or up row (s >= 8) of feature 64 b + 8 v + s % 8. -1 past the end:
    // zero-filled, never stored.
    auto weight_row = [&](int r) -> long long {
        if (EPI::gated) {
            const int feature = blockIdx.x * 64 + (r >> 4) * 8 + (r & 7);
            if (feature >= num_features) return -1;
            return (r & 8) ? (long long)num_features + feature : feature;
        }
        const int row = blockIdx.x * SKINNY_ROWS + r;
        return row < num_features ? row : -1;
    };
    // Thread i copies granule i % 8 of rows i / 8 + 32 u (a warp covers four whole rows per copy).
    constexpr int WEIGHT_COPIES = SKINNY_ROWS / 32;
    const int copy_q = threadIdx.x & 7, copy_row = threadIdx.x >> 3;
    const bf16* weight_from[WEIGHT_COPIES];
#pragma unroll
    for (int u = 0; u < WEIGHT_COPIES; ++u) {
        const long long row = weight_row(copy_row + 32 * u);
        weight_from[u] = row < 0 ? nullptr : w + row * inner + k_begin + 8 * copy_q;
    }
    auto fill_weights = [&](int stage) {
        unsigned char* tile = ring + (stage % SKINNY_STAGES) * Shape::stage_bytes;
        const int k = stage * SKINNY_STAGE_K;
        const bool in_range = k_begin + k + 8 * copy_q < k_end;
#pragma unroll
        for (int u = 0; u < WEIGHT_COPIES; ++u) {
            const bool valid = in_range && weight_from[u] != nullptr;
            cp_async_16(tile + skinny_at(copy_row + 32 * u, copy_q), valid ? weight_from[u] + k : w, valid);
        }
    };
    auto fill_x = [&](int stage) {
        unsigned char* tile = ring + (stage % SKINNY_STAGES) * Shape::stage_bytes + Shape::weight_bytes;
        const int k = k_begin + stage * SKINNY_STAGE_K + 8 * copy_q;
#pragma unroll
        for (int u = 0; u < (Shape::tokens + 31) / 32; ++u) {
            const int n = copy_row + 32 * u;
            if (n < Shape::tokens) {
                const bool valid = n < num_tokens && k < k_end;
                cp_async_16(tile + skinny_at(n, copy_q), valid ? x + (long long)n * inner + k : x, valid);
            }
        }
    };

    // The weights of the first stages do not depend on the previous kernel: request them first.
#pragma unroll
    for (int s = 0; s < SKINNY_STAGES - 1; ++s) {
        if (s < num_stages) fill_weights(s);
        cp_async_commit();
    }
    dependent_launch_entry();
#pragma unroll
    for (int s = 0; s < SKINNY_STAGES - 1; ++s) {
        if (s < num_stages) fill_x(s);
    }
    cp_async_commit();

    float acc[4 * NT];
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) acc[i] = 0.0f;
    for (int stage = 0; stage < num_stages; ++stage) {
        // Stage `stage` is in: at the first, everything committed so far; later, all but the
        // SKINNY_STAGES - 2 newest groups. The barrier also frees the slot refilled below.
        if (stage == 0)
            cp_async_wait<0>();
        else
            cp_async_wait<SKINNY_STAGES - 2>();
#if SKINNY_WGMMA
        fence_proxy_async_shared();  // cp.async wrote through the generic proxy; wgmma reads async
#endif
        __syncthreads();
        const int next = stage + SKINNY_STAGES - 1;
        if (next < num_stages) {
            fill_weights(next);
            fill_x(next);
        }
        cp_async_commit();
        const unsigned char* weights = ring + (stage % SKINNY_STAGES) * Shape::stage_bytes;
        const unsigned char* xs = weights + Shape::weight_bytes;
#if SKINNY_WGMMA
        wgmma_fence_registers<4 * NT>(acc);
        wgmma_fence();
#pragma unroll
        for (int step = 0; step < SKINNY_STAGE_K / 16; ++step) {
            const u64 desc_a = wgmma_descriptor(weights + (warp >> 2) * 64 * 128 + 32 * step, 16, 1024);
            const u64 desc_b = wgmma_descriptor(xs + 32 * step, 16, 1024);
            skinny_wgmma<NT>(acc, desc_a, desc_b);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_registers<4 * NT>(acc);
#else
        // ldmatrix rows: A matrix lane / 8 = (row half, k half); B = (token half, k half).
        const int a_row = warp * 16 + (lane & 15), a_half = lane >> 4;
        const int b_row = (lane & 7) + ((lane >> 4) << 3), b_half = (lane >> 3) & 1;
#pragma unroll
        for (int step = 0; step < SKINNY_STAGE_K / 16; ++step) {
            u32 a[4];
            ldmatrix_x4(a, weights + skinny_at(a_row, 2 * step + a_half));
#pragma unroll
            for (int p = 0; p < NT / 2; ++p) {
                u32 b[4];  // b0, b1 of token tile 2p, then of 2p + 1
                ldmatrix_x4(b, xs + skinny_at(16 * p + b_row, 2 * step + b_half));
                mma_bf16_16816(acc + 8 * p, a, b);
                mma_bf16_16816(acc + 8 * p + 4, a, b + 2);
            }
        }
#endif
    }
    const int active_tiles = (num_tokens + 7) >> 3;  // token tiles with at least one token

    if (gridDim.y > 1) {
        // Fragment order: partials[tile][split][j][thread] as float4.
        float4* mine = reinterpret_cast<float4*>(partials) +
                       ((long long)blockIdx.x * gridDim.y + blockIdx.y) * NT * SKINNY_THREADS + threadIdx.x;
#pragma unroll
        for (int j = 0; j < NT; ++j)
            if (j < active_tiles)
                mine[j * SKINNY_THREADS] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        if (!last_block_done(counters + blockIdx.x, gridDim.y)) return;
        const float4* tile =
            reinterpret_cast<const float4*>(partials) + (long long)blockIdx.x * gridDim.y * NT * SKINNY_THREADS + threadIdx.x;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (j < active_tiles) {
                float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int s = 0; s < (int)gridDim.y; ++s) {
                    const float4 part = __ldcg(tile + ((long long)s * NT + j) * SKINNY_THREADS);
                    sum.x += part.x;
                    sum.y += part.y;
                    sum.z += part.z;
                    sum.w += part.w;
                }
                acc[4 * j] = sum.x;
                acc[4 * j + 1] = sum.y;
                acc[4 * j + 2] = sum.z;
                acc[4 * j + 3] = sum.w;
            }
        }
    }

#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = 8 * j + 2 * t + (e & 1);
            if (n >= num_tokens) continue;
            if (EPI::gated) {
                const int feature = blockIdx.x * 64 + warp * 8 + g;
                if (e < 2 && feature < num_features)
                    store_feature<EPI>(out + (long long)n * num_features + feature, acc[4 * j + e], acc[4 * j + 2 + e]);
            } else {
                const int feature = blockIdx.x * SKINNY_ROWS + warp * 16 + g + 8 * (e >> 1);
                if (feature < num_features) {
                    const float total = acc[4 * j + e] + (bias != nullptr ? to_float(bias[feature]) : 0.0f);
                    store_feature<EPI>(out + (long long)n * num_features + feature, total, 0.0f);
                }
            }
        }
    }
}

// gemm_skinny_<what>_n<NT>: tokens <= 8 NT, 256 threads. <what>: bf16, f32 (out = x w^T + bias),
// gated_<act> (w = [gate; up], out = act(x gate^T) * (x up^T)), add (out += x w^T).
// num_features: rows of w (gated: of each half); split_len: K per blockIdx.y (a multiple of 64).
#define DEFINE_SKINNY(NAME, OUT, EPI, NT)                                                                      \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) gemm_skinny_##NAME##_n##NT(                   \
        const bf16* x, const bf16* w, const bf16* bias, OUT* out, int num_tokens, int num_features, int inner, \
        int split_len, float* partials, unsigned* counters) {                                                  \
        skinny_impl<NT, OUT, EPI>(x, w, bias, out, num_tokens, num_features, inner, split_len, partials,      \
                                  counters);                                                                   \
    }

#define DEFINE_SKINNY_TOKENS(NAME, OUT, EPI) \
    DEFINE_SKINNY(NAME, OUT, EPI, 2)         \
    DEFINE_SKINNY(NAME, OUT, EPI, 4)         \
    DEFINE_SKINNY(NAME, OUT, EPI, 8)

DEFINE_SKINNY_TOKENS(bf16, bf16, Plain)
DEFINE_SKINNY_TOKENS(f32, float, Plain)
DEFINE_SKINNY_TOKENS(gated_silu, bf16, Gated<SiluOp>)
DEFINE_SKINNY_TOKENS(gated_gelu_tanh, bf16, Gated<GeluTanhOp>)
DEFINE_SKINNY_TOKENS(add, bf16, AddTo)

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

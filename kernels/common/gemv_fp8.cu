// Decode products over FP8 (E4M3) weights: out[n, m] = sum_k x[n, k] * W[m, k] (+ bias[m]) for
// 1..8 token rows, W[m, k] = e4m3 byte * its scale, and the same product with the op after it
// fused in (the gated activation, the residual add), as gemv.cu computes them over bf16 weights.
//
//   x [N, K] bf16; w [M, K] E4M3 bytes, row-major (the checkpoint's [out, in]); bias [M] bf16 or
//   null; out [N, M] bf16 or f32. K % 16 == 0 (one 16-byte load holds 16 weights; the host checks).
//   scales f32, multipliers (never inverses):
//     per channel (*_t1 / mma without _blk): scales[m], applied to the row's sum at the end
//       (a per-tensor scale reaches the device as one per row);
//     per block (_blk): scales[(m / 128) * scale_stride + k / 128], a 128 x 128 tile each, applied
//       to each 16-wide (SIMT) or 64-wide (mma) partial sum, which never crosses a tile.
//
// Bytes: M K (the weight, once) + M 4 (channel scales) + N K 2 + N M sizeof(out); FLOPs 2 N M K.
// At N <= 8 that is <= 16 FLOP per weight byte, far under the ridge: the kernels must stream the
// weights at HBM bandwidth, now with twice bf16's elements per byte. Each E4M3 pair becomes an
// exact f16 pair in one cvt.rn.f16x2.e4m3x2. The mma forms take it on to exact bf16 and multiply
// bf16 x in f32, so their products are those of the dequantized weight. The SIMT form multiplies
// in f16 (below): x rounded to f16 (11 significant bits, bf16 has 8) and each 8-product partial
// sum rounded per step, about 2^-11 relative, under the bf16 rounding of the output.
//
// SIMT (one token row, gemv_fp8_<what>_r{1,2,4}): as gemv_impl, a block owns ROWS output rows,
// its warps split K, each lane loading 16 bytes of every row per step, BATCH steps of loads in
// flight (the first before griddepcontrol.wait: the weights do not depend on the previous kernel);
// x chunks are converted once per step and reused by the ROWS rows; partial sums meet in shared
// memory. A lane scales each 16-value chunk of x by the power of two that puts its largest |x|
// in [8, 16) and packs it into f16 pairs, shared by the ROWS rows; a row's 16 weights then cost
// 8 conversions and 8 fma.f16x2 into one f16 pair (the even and the odd k's products, each
// under 448 * 16, their 8-term sums under f16's 65504), which leaves the f32 sum once, times
// the inverse power of two. Before (2026-11-29): each weight converted on to f32 for an f32 FMA,
// 40 instructions a row's 16 weights instead of about 20, and the 8B's FP8 step took 2,477 us,
// not 2,378-2,394 (H200, docs/lab/cuda-runs.md). Two warps a block, not gemv_impl's four: a 16-byte
// load covers twice bf16's elements, so at K = 4096 four warps would leave each lane two loads a
// row (128 bytes in flight, ~48 KB an SM at 3 blocks); two warps keep BATCH = 4 loads a row in
// flight and fit 7 blocks an SM (~110 KB).
//
//     block b: rows b * ROWS .. (gated: features b * ROWS / 2 .., gate then up rows)
//     warp w, lane l: k = (w * 32 + l) * 16, then + 2 * 32 * 16, ...
//
// SIMT with the RMSNorm inside (gemv_fp8_rmsnorm_<nw>_<what>): x is the raw residual row and
// out = rmsnorm(x) W^T with no norm kernel before it, as gemv.cu's folded forms (E4M3 columns
// cannot carry the norm weight, so it is applied to x instead). Each lane multiplies the x chunk
// it converts by norm_weight there (in f32, then to f16 as above; never to bf16) and sums the
// raw x^2 of it; the block's lanes convert every chunk of K once, so the warps' sums meet in
// shared memory as the row's sum of squares, and each row sum (gated: gate and up) is scaled by
// 1 / sqrt(mean + eps) before its scale, bias and epilogue. Right for _blk too: the 16-wide
// partial sums are linear in x. Extra: K * sizeof(nw) bytes of norm weight a block (L2) and 2 FLOPs a value of x.
//
// mma (2..8 token rows, gemv_fp8_mma_<what>): as gemv_mma_impl, a warp owns 16 weight rows and
// feeds mma.sync m16n8k16 (bf16, f32 accumulators) with the tokens as n = 8 columns. Lane
// (g = lane / 4, t = lane % 4) loads 16 bytes of rows g and g + 8 and 32 bytes of token g's x at
// k0 + 16 t of each 64-wide chunk k0, and feeds four mma steps; the k order inside a chunk is
// permuted alike for weights and x, which makes the fragments plain loads:
//
//     mma step s (0..3), logical k 2t + i    <-  physical k0 + 16t + 4s + i        (i = 0, 1)
//                        logical k 2t + 8 + i <-  physical k0 + 16t + 4s + 2 + i
//
// Gated, the 16 rows are the gate rows of 8 features (g) and their up rows (g + 8). The block's
// 8 warps split K and meet in shared memory.

#include "atlas_common.cuh"
#include "fp8_weights.cuh"

#define FP8_GEMV_WARPS 2
#define FP8_MMA_WARPS 8
#define FP8_LOAD 16  // weights per 16-byte load

// d = a * b + c on f16 pairs, rounded once per half.
__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The power of two that brings a chunk's largest |x| into [8, 16) (`scale`) and its inverse
// (`unscale`), from amax's exponent field, clamped so both stay normal floats: x * scale as f16
// times an E4M3 weight (|w| <= 448) is under 7168, and 8 such products under f16's 65504.
__device__ __forceinline__ void fp8_chunk_scale(float amax, float& scale, float& unscale) {
    const u32 biased = min(max(__float_as_uint(amax) >> 23, 16u), 240u);
    scale = __uint_as_float((257u - biased) << 23);  // 2^(130 - biased) = 2^(3 - e)
    unscale = __uint_as_float((biased - 3u) << 23);  // 2^(e - 3)
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

// What a block's row sums become: Plain out = sum (+ bias); Gated<Act> act(gate) * up, both
// rounded to bf16 first as the unfused product would be; AddTo out += sum rounded to bf16.
struct Fp8Plain {
    static constexpr bool gated = false, add = false;
};
template <typename Act>
struct Fp8Gated {
    static constexpr bool gated = true, add = false;
    typedef Act Op;
};
struct Fp8AddTo {
    static constexpr bool gated = false, add = true;
};

template <typename EPI>
struct Fp8ActOf {
    typedef SiluOp type;  // unused but by the gated forms
};
template <typename Act>
struct Fp8ActOf<Fp8Gated<Act>> {
    typedef Act type;
};

template <typename EPI, typename OUT>
__device__ __forceinline__ void fp8_store(OUT* slot, float total, float up) {
    if constexpr (EPI::gated) {
        const typename Fp8ActOf<EPI>::type act;
        *slot = from_float<OUT>(act(to_float(from_float<bf16>(total))) * to_float(from_float<bf16>(up)));
    } else if constexpr (EPI::add) {
        *slot = from_float<OUT>(to_float(*slot) + to_float(from_float<bf16>(total)));
    } else {
        *slot = from_float<OUT>(total);
    }
}

// Feature `feature`'s row sums (gated: its gate row's and its up row's) into `slot`: times the
// channel scales (the block scales are in the sums already), plus the bias, through the epilogue.
template <typename EPI, bool BLOCK, typename OUT>
__device__ __forceinline__ void fp8_finish(OUT* slot, const float* scales, const bf16* bias, int num_rows, int feature,
                                           float total, float up) {
    if constexpr (!BLOCK) {
        total *= __ldg(scales + feature);
        if constexpr (EPI::gated) up *= __ldg(scales + num_rows + feature);
    }
    if (!EPI::gated && bias != nullptr) total += to_float(bias[feature]);
    fp8_store<EPI>(slot, total, up);
}

// Weight row of the block's r-th row: features first .. first + FEATURES - 1, then (gated) their
// up rows at num_features + f. Rows past the end re-read the last valid one (never stored).
template <typename EPI, int FEATURES>
__device__ __forceinline__ long long fp8_weight_row(int first, int r, int num_features) {
    const int feature = min(first + r % FEATURES, num_features - 1);
    return EPI::gated && r >= FEATURES ? (long long)num_features + feature : (long long)feature;
}

// The scale of weight row `row` over the 128-wide column tile holding k (_blk forms).
__device__ __forceinline__ float fp8_block_scale(const float* scales, int scale_stride, long long row, int k) {
    return __ldg(scales + (row >> 7) * scale_stride + (k >> 7));
}

// num_rows counts output features: the weight's rows, or half of them when gated. With NORM, x
// is the raw residual row, normalised by norm_weight [K] and eps inside (see the header).
template <typename OUT, int ROWS, typename EPI, bool BLOCK, bool NORM = false, typename NW = bf16>
__device__ __forceinline__ void gemv_fp8_impl(const bf16* __restrict__ x, const fp8_e4m3* __restrict__ w,
                                              const float* __restrict__ scales, int scale_stride,
                                              const bf16* __restrict__ bias, OUT* __restrict__ out, int num_rows,
                                              int inner, const NW* __restrict__ norm_weight = nullptr,
                                              float eps = 0.0f) {
#if ATLAS_HAS_FP8
    constexpr int FEATURES = EPI::gated ? ROWS / 2 : ROWS;
    constexpr int STEP = FP8_GEMV_WARPS * 32 * FP8_LOAD;
    constexpr int BATCH = 4;
    __shared__ float partial[FP8_GEMV_WARPS][ROWS];
    __shared__ float partial_squares[FP8_GEMV_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = blockIdx.x * FEATURES;
    long long rows[ROWS];
    const fp8_e4m3* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        rows[r] = fp8_weight_row<EPI, FEATURES>(first, r, num_rows);
        w_rows[r] = w + rows[r] * inner;
    }
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    float squares = 0.0f;  // of the raw x chunks this lane converts (NORM)

    auto accumulate = [&](const uint4* raw, int k) {
        float xs[FP8_LOAD];
        bf16x8_to_floats(*reinterpret_cast<const uint4*>(x + k), xs);
        bf16x8_to_floats(*reinterpret_cast<const uint4*>(x + k + 8), xs + 8);
        if constexpr (NORM) {
            float gains[FP8_LOAD];
            load8(norm_weight + k, gains);
            load8(norm_weight + k + 8, gains + 8);
#pragma unroll
            for (int i = 0; i < FP8_LOAD; ++i) {
                squares = fmaf(xs[i], xs[i], squares);
                xs[i] *= gains[i];
            }
        }
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < FP8_LOAD; ++i) amax = fmaxf(amax, fabsf(xs[i]));
        float scale, unscale;
        fp8_chunk_scale(amax, scale, unscale);
        u32 pairs[FP8_LOAD / 2];  // x * scale as f16 pairs, (k, k + 1), (k + 2, k + 3), ...
#pragma unroll
        for (int i = 0; i < FP8_LOAD / 2; ++i) pairs[i] = pack_f16x2(xs[2 * i] * scale, xs[2 * i + 1] * scale);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const u32 words[4] = {raw[r].x, raw[r].y, raw[r].z, raw[r].w};
            u32 sums = 0;  // f16 pair: the even and the odd k's 8 products
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sums = fma_f16x2(fp8x2_to_f16x2(words[i] & 0xffffu), pairs[2 * i], sums);
                sums = fma_f16x2(fp8x2_to_f16x2(words[i] >> 16), pairs[2 * i + 1], sums);
            }
            const float2 halves = f16x2_to_floats(sums);
            float multiplier = unscale;
            if constexpr (BLOCK) multiplier *= fp8_block_scale(scales, scale_stride, rows[r], k);
            acc[r] = fmaf(halves.x + halves.y, multiplier, acc[r]);
        }
    };

    int k = threadIdx.x * FP8_LOAD;
    {
        // The first BATCH steps' weights are requested before the previous kernel is waited for.
        const bool full = k + (BATCH - 1) * STEP < inner;
        uint4 raw[BATCH][ROWS];
        if (full) {
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) raw[u][r] = load_streaming_early(w_rows[r] + k + u * STEP);
        } else {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (k + u * STEP < inner) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) raw[u][r] = load_streaming_early(w_rows[r] + k + u * STEP);
                }
            }
        }
        dependent_launch_entry();
        if (full) {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) accumulate(raw[u], k + u * STEP);
        } else {
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (k + u * STEP < inner) accumulate(raw[u], k + u * STEP);
            }
        }
        k += BATCH * STEP;
    }
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 raw[BATCH][ROWS];
#pragma unroll
        for (int u = 0; u < BATCH; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) raw[u][r] = load_streaming(w_rows[r] + k + u * STEP);
#pragma unroll
        for (int u = 0; u < BATCH; ++u) accumulate(raw[u], k + u * STEP);
    }
    if (k < inner) {
        // Fewer than BATCH steps remain (K = 14336: 2 of 14): their loads go out together, not
        // one round trip after another.
        uint4 raw[BATCH - 1][ROWS];
#pragma unroll
        for (int u = 0; u < BATCH - 1; ++u) {
            if (k + u * STEP < inner) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) raw[u][r] = load_streaming(w_rows[r] + k + u * STEP);
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH - 1; ++u) {
            if (k + u * STEP < inner) accumulate(raw[u], k + u * STEP);
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float total = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = total;
    }
    if constexpr (NORM) {
        const float total = warp_sum(squares);
        if (lane == 0) partial_squares[warp] = total;
    }
    __syncthreads();
    if (threadIdx.x < FEATURES) {
        const int f = threadIdx.x, feature = first + f;
        if (feature < num_rows) {
            float total = 0.0f, up = 0.0f;
#pragma unroll
            for (int j = 0; j < FP8_GEMV_WARPS; ++j) total += partial[j][f];
            if constexpr (EPI::gated) {
#pragma unroll
                for (int j = 0; j < FP8_GEMV_WARPS; ++j) up += partial[j][f + FEATURES];
            }
            if constexpr (NORM) {  // the row's inverse RMS, from the warps' sums of squares
                float sum_squares = 0.0f;
#pragma unroll
                for (int j = 0; j < FP8_GEMV_WARPS; ++j) sum_squares += partial_squares[j];
                const float inverse_rms = 1.0f / sqrtf(sum_squares / inner + eps);
                total *= inverse_rms;
                up *= inverse_rms;
            }
            fp8_finish<EPI, BLOCK>(out + feature, scales, bias, num_rows, feature, total, up);
        }
    }
#else
    __trap();  // the host offers FP8 weights from sm_89 on
#endif
}

template <typename OUT, typename EPI, bool BLOCK>
__device__ __forceinline__ void gemv_fp8_mma_impl(const bf16* __restrict__ x, const fp8_e4m3* __restrict__ w,
                                                  const float* __restrict__ scales, int scale_stride,
                                                  const bf16* __restrict__ bias, OUT* __restrict__ out, int num_tokens,
                                                  int num_rows, int inner) {
#if ATLAS_HAS_FP8
    constexpr int FEATURES = EPI::gated ? 8 : 16;
    constexpr int CHUNK = 64;
    constexpr int STEP = FP8_MMA_WARPS * CHUNK;
    constexpr int BATCH = 4;
    __shared__ float partial[FP8_MMA_WARPS][16][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int first = blockIdx.x * FEATURES;
    const long long row_a = fp8_weight_row<EPI, FEATURES>(first, g, num_rows);
    const long long row_b = fp8_weight_row<EPI, FEATURES>(first, g + 8, num_rows);
    const fp8_e4m3* w_a = w + row_a * inner;
    const fp8_e4m3* w_b = w + row_b * inner;
    const bool has_token = g < num_tokens;
    const bf16* x_row = x + (long long)(has_token ? g : 0) * inner;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // acc (+)= this lane's 16 bytes of rows g and g + 8 at k times token g's x there (4 mma steps).
    auto multiply = [&](uint4 wa, uint4 wb, int k) {
        uint4 x_lo = make_uint4(0, 0, 0, 0), x_hi = make_uint4(0, 0, 0, 0);
        if (has_token) {
            x_lo = *reinterpret_cast<const uint4*>(x_row + k);
            x_hi = *reinterpret_cast<const uint4*>(x_row + k + 8);
        }
        const u32 xs[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        fp8_mma_chunk(BLOCK ? part : acc, wa, wb, xs);
        if constexpr (BLOCK) {
            const float scale_a = fp8_block_scale(scales, scale_stride, row_a, k);
            const float scale_b = fp8_block_scale(scales, scale_stride, row_b, k);
            acc[0] = fmaf(scale_a, part[0], acc[0]);
            acc[1] = fmaf(scale_a, part[1], acc[1]);
            acc[2] = fmaf(scale_b, part[2], acc[2]);
            acc[3] = fmaf(scale_b, part[3], acc[3]);
        }
    };
    int k = warp * CHUNK + FP8_LOAD * t;
    {
        // The first BATCH chunks' weights are requested before the previous kernel is waited for.
        uint4 wa[BATCH], wb[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (k + u * STEP < inner) {
                wa[u] = load_streaming_early(w_a + k + u * STEP);
                wb[u] = load_streaming_early(w_b + k + u * STEP);
            }
        }
        dependent_launch_entry();
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (k + u * STEP < inner) multiply(wa[u], wb[u], k + u * STEP);
        }
        k += BATCH * STEP;
    }
    for (; k + (BATCH - 1) * STEP < inner; k += BATCH * STEP) {
        uint4 wa[BATCH], wb[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            wa[u] = load_streaming(w_a + k + u * STEP);
            wb[u] = load_streaming(w_b + k + u * STEP);
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) multiply(wa[u], wb[u], k + u * STEP);
    }
    if (k < inner) {  // fewer than BATCH chunks remain: their loads go out together
        uint4 wa[BATCH - 1], wb[BATCH - 1];
#pragma unroll
        for (int u = 0; u < BATCH - 1; ++u) {
            if (k + u * STEP < inner) {
                wa[u] = load_streaming(w_a + k + u * STEP);
                wb[u] = load_streaming(w_b + k + u * STEP);
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH - 1; ++u) {
            if (k + u * STEP < inner) multiply(wa[u], wb[u], k + u * STEP);
        }
    }
    // acc: (row g, tokens 2t, 2t + 1) and (row g + 8, tokens 2t, 2t + 1)
    store_mma_tile(partial[warp], acc, g, t);
    __syncthreads();
    if (threadIdx.x < FEATURES * 8) {
        const int f = threadIdx.x / 8, n = threadIdx.x % 8;
        const int feature = first + f;
        if (feature < num_rows && n < num_tokens) {
            float total = 0.0f, up = 0.0f;
#pragma unroll
            for (int j = 0; j < FP8_MMA_WARPS; ++j) total += partial[j][f][n];
            if constexpr (EPI::gated) {
#pragma unroll
                for (int j = 0; j < FP8_MMA_WARPS; ++j) up += partial[j][f + 8][n];
            }
            fp8_finish<EPI, BLOCK>(out + (long long)n * num_rows + feature, scales, bias, num_rows, feature, total,
                                   up);
        }
    }
#else
    __trap();
#endif
}


// ---------------------------------------------------------------------------------------------
// Entry points: gemv_fp8_<what>[_blk]_r<ROWS> (one token row, FP8_GEMV_WARPS * 32 threads) and
// gemv_fp8_mma_<what>[_blk] (2..8 rows, FP8_MMA_WARPS * 32 threads). <what>: bf16, f32 (out = x
// W^T + bias), gated_<act> (W = [gate; up], out = act(x gate^T) * (x up^T), no bias), add (out +=
// x W^T, no bias). num_rows: W's rows, or (gated) half of them. scale_stride: the block scales'
// row stride (unused per channel).
//
// With the RMSNorm inside (one token row; x the raw residual): gemv_fp8_rmsnorm_<nw>_bf16[_blk]_r
// {1,2,4} and gemv_fp8_rmsnorm_<nw>_gated_<act>[_blk]_r{2,4}, <nw> the norm weight's type (bf16,
// f32), out = <what>(rmsnorm(x) W^T): the same parameters, then norm_weight [K] and eps.
#define DEFINE_FP8_GEMV(NAME, OUT, EPI, BLOCK, SUFFIX, ROWS)                                                    \
    extern "C" __global__ void __launch_bounds__(FP8_GEMV_WARPS * 32) gemv_fp8_##NAME##SUFFIX##_r##ROWS(        \
        const bf16* x, const fp8_e4m3* w, const float* scales, int scale_stride, const bf16* bias, OUT* out,   \
        int num_rows, int inner) {                                                                           \
        gemv_fp8_impl<OUT, ROWS, EPI, BLOCK>(x, w, scales, scale_stride, bias, out, num_rows, inner);         \
    }

#define DEFINE_FP8_GEMV_NORM(NW_NAME, NW, NAME, OUT, EPI, BLOCK, SUFFIX, ROWS)                                  \
    extern "C" __global__ void __launch_bounds__(FP8_GEMV_WARPS * 32)                                         \
        gemv_fp8_rmsnorm_##NW_NAME##_##NAME##SUFFIX##_r##ROWS(const bf16* x, const fp8_e4m3* w,                \
                                                              const float* scales, int scale_stride,           \
                                                              const bf16* bias, OUT* out, int num_rows,        \
                                                              int inner, const NW* norm_weight, float eps) {   \
        gemv_fp8_impl<OUT, ROWS, EPI, BLOCK, true, NW>(x, w, scales, scale_stride, bias, out, num_rows, inner, \
                                                       norm_weight, eps);                                     \
    }

#define DEFINE_FP8_MMA(NAME, OUT, EPI, BLOCK, SUFFIX)                                                            \
    extern "C" __global__ void __launch_bounds__(FP8_MMA_WARPS * 32) gemv_fp8_mma_##NAME##SUFFIX(                \
        const bf16* x, const fp8_e4m3* w, const float* scales, int scale_stride, const bf16* bias, OUT* out,    \
        int num_tokens, int num_rows, int inner) {                                                            \
        gemv_fp8_mma_impl<OUT, EPI, BLOCK>(x, w, scales, scale_stride, bias, out, num_tokens, num_rows, inner); \
    }

#define DEFINE_FP8_FORMS(SUFFIX, BLOCK)                                          \
    DEFINE_FP8_GEMV(bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 1)                      \
    DEFINE_FP8_GEMV(bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 2)                      \
    DEFINE_FP8_GEMV(bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 4)                      \
    DEFINE_FP8_GEMV(f32, float, Fp8Plain, BLOCK, SUFFIX, 1)                      \
    DEFINE_FP8_GEMV(f32, float, Fp8Plain, BLOCK, SUFFIX, 2)                      \
    DEFINE_FP8_GEMV(f32, float, Fp8Plain, BLOCK, SUFFIX, 4)                      \
    DEFINE_FP8_GEMV(add, bf16, Fp8AddTo, BLOCK, SUFFIX, 1)                       \
    DEFINE_FP8_GEMV(add, bf16, Fp8AddTo, BLOCK, SUFFIX, 2)                       \
    DEFINE_FP8_GEMV(add, bf16, Fp8AddTo, BLOCK, SUFFIX, 4)                       \
    DEFINE_FP8_GEMV(gated_silu, bf16, Fp8Gated<SiluOp>, BLOCK, SUFFIX, 2)        \
    DEFINE_FP8_GEMV(gated_silu, bf16, Fp8Gated<SiluOp>, BLOCK, SUFFIX, 4)        \
    DEFINE_FP8_GEMV(gated_gelu_tanh, bf16, Fp8Gated<GeluTanhOp>, BLOCK, SUFFIX, 2) \
    DEFINE_FP8_GEMV(gated_gelu_tanh, bf16, Fp8Gated<GeluTanhOp>, BLOCK, SUFFIX, 4) \
    DEFINE_FP8_MMA(bf16, bf16, Fp8Plain, BLOCK, SUFFIX)                          \
    DEFINE_FP8_MMA(f32, float, Fp8Plain, BLOCK, SUFFIX)                          \
    DEFINE_FP8_MMA(add, bf16, Fp8AddTo, BLOCK, SUFFIX)                           \
    DEFINE_FP8_MMA(gated_silu, bf16, Fp8Gated<SiluOp>, BLOCK, SUFFIX)            \
    DEFINE_FP8_MMA(gated_gelu_tanh, bf16, Fp8Gated<GeluTanhOp>, BLOCK, SUFFIX)

#define DEFINE_FP8_NORM_FORMS(NW_NAME, NW, SUFFIX, BLOCK)                                               \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 1)                             \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 2)                             \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, bf16, bf16, Fp8Plain, BLOCK, SUFFIX, 4)                             \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, gated_silu, bf16, Fp8Gated<SiluOp>, BLOCK, SUFFIX, 2)               \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, gated_silu, bf16, Fp8Gated<SiluOp>, BLOCK, SUFFIX, 4)               \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, gated_gelu_tanh, bf16, Fp8Gated<GeluTanhOp>, BLOCK, SUFFIX, 2)      \
    DEFINE_FP8_GEMV_NORM(NW_NAME, NW, gated_gelu_tanh, bf16, Fp8Gated<GeluTanhOp>, BLOCK, SUFFIX, 4)

DEFINE_FP8_FORMS(, false)
DEFINE_FP8_FORMS(_blk, true)
DEFINE_FP8_NORM_FORMS(bf16, bf16, , false)
DEFINE_FP8_NORM_FORMS(bf16, bf16, _blk, true)
DEFINE_FP8_NORM_FORMS(f32, float, , false)
DEFINE_FP8_NORM_FORMS(f32, float, _blk, true)

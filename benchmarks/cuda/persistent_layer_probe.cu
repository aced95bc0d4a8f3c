// Probe: the four products of a Llama-3.1-8B layer over FP8 (E4M3) weights at one token, as ONE
// persistent kernel whose weight stream never stops at a product boundary, against the bytes at
// the read rate measured in the same process. Not part of Atlas; it answers whether a persistent
// layer kernel would take back the ~6 us a layer the kernel chain loses at its boundaries
// (docs/lab/cuda-runs.md, session 13).
//
//   phase o:       residual += s_o * (Wo attn)                 Wo   [H, H]
//   phase gate_up: act = silu(g) * u, [g; u] = Wgu rms(residual) Wgu  [2I, H] (gate rows, then up)
//   phase down:    residual += s_d * (Wd act)                  Wd   [H, I]
//   phase qkv:     qkv = s_qkv * (Wqkv rms(residual))           Wqkv [QKV, H]
//   the next layer's attn = qkv[0, H) (a stand-in for attention, so each layer waits on the last)
//
// One block an SM (132 on an H200): a producer warp streams the block's share of every phase's
// weight rows, layer after layer, through a ring of shared-memory stages (cp.async.bulk, mbarrier
// full/empty handshakes) without waiting for anything but a free stage; the consumer warps wait
// at a grid barrier (a monotonic counter) for each phase's input, then multiply each stage as it
// lands (x scaled per 16 values to f16 pairs, fma.f16x2, as gemv_fp8.cu's one-row kernel) and
// keep each warp's row sums in shared memory until the phase ends. A chain of plain reference
// kernels checks two layers; the last run prints where the blocks' time went.
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a -I kernels/common -o /tmp/probe benchmarks/cuda/persistent_layer_probe.cu
//   /tmp/probe [layers]
// -DSTAGE_KB=.. -DRING_STAGES=.. size the ring (32 KB x 6); -DWARP_GROUPS=2 runs 16 consumer
// warps (8 by default), each group a contiguous share of a stage's rows; -DPRODUCER_WAITS=1
// makes the producer wait for each phase's input as the consumers do, so no weight byte crosses
// a boundary early; -DNO_COMPUTE=1 multiplies nothing (the pipeline and the barriers alone; its
// check then fails by design); -DATTN_CHAIN=n puts an attention stand-in before each layer's o:
// 8 blocks follow n dependent L2 loads, then hand x on. -DMMA_CONSUMERS=1 runs the products on
// tensor cores (x in shared memory, 5 stages; -DX_SMEM=0 keeps x in registers, -DACC_CHAINS=n);
// -DEARLY_RELEASE=0 frees a slot only after the products; -DGU_INTERLEAVE=1 stores gate_up a
// feature's gate and up rows together; -DPREFETCH_AHEAD=n asks L2 for the stage n ahead;
// -DLAST_WARP_ENDS=1 lets a phase's last warp end it alone; -DFUSED_MLP=1 runs gate_up and down
// as one phase over down stored transposed (docs/lab/cuda-runs.md, session 14, has the figures).
// PROBE_DEBUG=1 in the environment also checks the mma fragments and the o phase alone.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "atlas_common.cuh"
#include "probe_common.cuh"
#include "tma.cuh"

constexpr int H = 4096, I = 14336, QKV = 6144;
#ifndef WARP_GROUPS  // groups of 8 consumer warps, each taking every GROUPS-th row of a stage
#define WARP_GROUPS 1
#endif
#ifndef RELEASE_ADD  // 0: each block counts itself in after a fence (atomicAdd), not with a release add
#define RELEASE_ADD 1
#endif
#ifndef NO_COMPUTE  // 1: consumers take each stage and multiply nothing (the pipeline alone)
#define NO_COMPUTE 0
#endif
#ifndef MMA_CONSUMERS  // 1: the products on tensor cores (see `stream_mma`); 0: fma.f16x2 chains (faster)
#define MMA_CONSUMERS 0
#endif
#ifndef X_SMEM  // 1: the mma form's x in shared memory (f16), read each span; 0: in registers for the phase
#define X_SMEM 1
#endif
#ifndef GU_INTERLEAVE  // 1: gate_up's rows stored gate, up, gate, up, ... a feature at a time, so that a stage
#define GU_INTERLEAVE 0   // is one copy; 0: every gate row, then every up row (two copies a stage, as Atlas)
#endif
constexpr bool MMA = MMA_CONSUMERS != 0;
constexpr int GROUPS = WARP_GROUPS, GROUP_THREADS = 256;
constexpr int CONSUMER_WARPS = 8 * GROUPS, CONSUMERS = CONSUMER_WARPS * 32, THREADS = CONSUMERS + 32;
#ifndef STAGE_KB
#define STAGE_KB 32
#endif
#ifndef RING_STAGES
#define RING_STAGES (MMA_CONSUMERS && X_SMEM ? 5 : 6)
#endif
#ifndef EARLY_RELEASE  // 1: a consumer warp reads its share of a stage into registers and frees the slot
#define EARLY_RELEASE 1   // before its products
#endif
#ifndef LAST_WARP_ENDS  // 1 (fma.f16x2 form): warps add their row sums into the block's shared sums and the
#define LAST_WARP_ENDS 0   // last warp to finish a phase ends it alone; each warp polls the grid barrier
#endif
#ifndef FUSED_MLP  // 1 (fma.f16x2 form): gate_up and down as one phase, down stored transposed and split over
#define FUSED_MLP 0   // each block's features, its partial sums added across blocks (3 grid barriers a layer)
#endif
#ifndef ACC_CHAINS  // the mma form's independent accumulator chains a stage
#define ACC_CHAINS 2
#endif
#ifndef PREFETCH_AHEAD  // > 0: the producer asks L2 for the stage this many ahead of the one it copies
#define PREFETCH_AHEAD 0
#endif
#ifndef PRODUCER_WAITS  // 1: the producer waits for each phase's input too (a kernel chain's boundary)
#define PRODUCER_WAITS 0
#endif
constexpr int STAGE_BYTES = STAGE_KB * 1024, STAGES = RING_STAGES;
constexpr int PHASES = 4;
#ifndef ATTN_CHAIN  // > 0: an attention stand-in before each layer's o (see `attention`)
#define ATTN_CHAIN 0
#endif
constexpr int ATTN_BLOCKS = 8, CHAIN_WORDS = 1 << 18;
constexpr int PER_LAYER = PHASES + (ATTN_CHAIN > 0 ? 1 : 0);  // grid barriers a layer

struct Layer {
    const unsigned char *wo, *wgu, *wd, *wqkv;
    const float *so, *sgu, *sd, *sqkv;
};

struct Params {
    const Layer* layers;
    int num_layers;
    float* residual;    // [H]
    bf16* attn;         // [H]: layer 0's input
    bf16* act;          // [I]
    bf16* qkv;          // [QKV]
    unsigned* counter;  // zero before the launch
    unsigned long long* stats;  // [blocks][4] ns: consumers starved, at the grid barrier, phase ends; producer blocked
    float* sumsq;  // [layers][PHASES], zero before the launch: the residual's sum of squares after o (0), down (2);
                   // the largest |act| (1) and |qkv| (3), as float bits
    const unsigned* chain;  // [CHAIN_WORDS]: a random cycle the attention stand-in follows
    bf16* attn_out;         // [H]: what the attention stand-in hands o
    int only_phases;        // > 0: stop after this many of the first layer's phases (PROBE_DEBUG)
    float* y_acc;           // [H] FUSED_MLP: the layer's down, summed over blocks (zero before the launch)
};

// A phase's work units (rows; gate_up: features, each a gate and an up row), the units a stage
// holds, and K.
__host__ __device__ constexpr int phase_units(int p) { return p == 0 ? H : p == 1 ? I : p == 2 ? H : QKV; }
__host__ __device__ constexpr int phase_inner(int p) { return p == 2 ? I : H; }
// The width of the rows a phase streams: FUSED_MLP's down rows are Wd's columns (one a feature).
__host__ __device__ constexpr int stream_inner(int p) { return FUSED_MLP && p == 2 ? H : phase_inner(p); }
__host__ __device__ constexpr int stage_units(int p) {
    return p == 1 ? STAGE_BYTES / (2 * H) : STAGE_BYTES / stream_inner(p);
}

// A gate_up stage row r (of `per` features): its feature within the stage, and whether it is the up row.
__host__ __device__ constexpr int gu_feature(int r, int per) { return GU_INTERLEAVE ? r >> 1 : r % per; }
__host__ __device__ constexpr bool gu_up(int r, int per) { return GU_INTERLEAVE ? (r & 1) != 0 : r >= per; }
// The physical row of feature f's gate (or up) row.
__host__ __device__ constexpr long long gu_row(int f, bool up) {
    return GU_INTERLEAVE ? 2LL * f + up : f + (up ? I : 0);
}

__device__ __forceinline__ void unit_range(int p, int b, int blocks, int& first, int& last) {
    const int units = phase_units(FUSED_MLP && p == 2 ? 1 : p);  // FUSED_MLP: down over the block's features
    first = (int)((long long)units * b / blocks);
    last = (int)((long long)units * (b + 1) / blocks);
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

// x chunk (16 values from `values`, f32) as f16 pairs under a power of two; returns the unscale.
__device__ __forceinline__ float chunk_to_f16(const float* values, u32* pairs) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(values[i]));
    const u32 biased = min(max(__float_as_uint(amax) >> 23, 16u), 240u);
    const float scale = __uint_as_float((257u - biased) << 23), unscale = __uint_as_float((biased - 3u) << 23);
#pragma unroll
    for (int i = 0; i < 8; ++i) pairs[i] = pack_f16x2(values[2 * i] * scale, values[2 * i + 1] * scale);
    return unscale;
}

__device__ __forceinline__ float dot16(uint4 w, const u32* pairs, float unscale) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    u32 sums[2] = {0, 0};  // two chains of four fma.f16x2: words 0-1 and 2-3
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 lo = fp8x2_to_f16x2(words[i] & 0xffffu), hi = fp8x2_to_f16x2(words[i] >> 16);
        u32& s = sums[i >> 1];
        asm("fma.rn.f16x2 %0, %1, %2, %0;\n" : "+r"(s) : "r"(lo), "r"(pairs[2 * i]));
        asm("fma.rn.f16x2 %0, %1, %2, %0;\n" : "+r"(s) : "r"(hi), "r"(pairs[2 * i + 1]));
    }
    const float2 a = f16x2_to_floats(sums[0]), b = f16x2_to_floats(sums[1]);
    return ((a.x + a.y) + (b.x + b.y)) * unscale;
}

constexpr int MAX_LOCAL = 256;  // a block's units of a phase (gate_up: features, twice) on >= 128 SMs
static_assert(STAGE_BYTES / H <= 8 * GROUPS && STAGE_BYTES >= I, "a stage holds 1..8 rows a warp group");
static_assert(!(MMA && LAST_WARP_ENDS), "the last warp ends a phase from the fma.f16x2 form's shared sums");
static_assert(!FUSED_MLP || (!MMA && !LAST_WARP_ENDS && !PRODUCER_WAITS && GROUPS == 1 && CONSUMERS * 16 == H),
              "FUSED_MLP: the fma.f16x2 form, 16 of down's outputs a consumer thread");

// The consumer warps' side: one phase at a time, its stages multiplied as they land.
struct Consumer {
    Params params;
    unsigned char* ring;
    u64* full;
    u64* empty;
    float (*partial)[MAX_LOCAL];
    float* own_residual;
    u32* xs;  // the mma form's x (X_SMEM): [I / 2] f16 pairs
    float (*block_sums)[MAX_LOCAL];  // LAST_WARP_ENDS: [2][MAX_LOCAL], a phase's row sums (by phase parity)
    float (*block_scales)[MAX_LOCAL];  // LAST_WARP_ENDS: [2][MAX_LOCAL] the row scales (gate_up: and up's)
    unsigned* warps_done;            // LAST_WARP_ENDS: warps that finished the phase
    u32* act_pair;                   // FUSED_MLP: [MAX_LOCAL / 2] the block's act as (a, a) f16 pairs, scaled
    float* act_stat;                 // FUSED_MLP: [CONSUMER_WARPS + 1] warp maxima, then the act's unscale
    int t, warp, lane, b, blocks;
    unsigned it = 0, phase_index = 0;
    unsigned long long starved = 0, at_barrier = 0, ends = 0;
    const bf16* attn = params.attn;

    // The grid barrier before a phase: thread 0 waits until every block counted the phase before in.
    __device__ __forceinline__ void wait_for_phase_input() {
        if (t != 0) return;
        const unsigned long long t0 = now_ns();
        const unsigned target = phase_index * blocks;
        while (ring_load_acquire(params.counter) < target) __nanosleep(20);
        __threadfence();
        at_barrier += now_ns() - t0;
    }

    // The block counts itself in once its consumers are done (their writes ordered before thread
    // 0's count by the block barrier) and moves on to the next phase.
    __device__ __forceinline__ void count_in(unsigned long long t0) {
        consumers_sync();
        if (t == 0) {
#if RELEASE_ADD
            // the count releases the block's writes and does not wait for them to land
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(params.counter) : "memory");
#else
            __threadfence();
            atomicAdd(params.counter, 1u);
#endif
            ends += now_ns() - t0;
        }
        ++phase_index;
    }

    // The attention stand-in: after the barrier, ATTN_BLOCKS blocks each follow ATTN_CHAIN dependent
    // loads (L2 hits of a 1 MB random cycle: a decode attention's latency chain, not its bytes),
    // then copy their share of x into attn_out; every other block only counts itself in. The
    // producers meanwhile stream the next phases' rows.
    __device__ __forceinline__ void attention() {
        wait_for_phase_input();
        unsigned long long t0 = now_ns();
        consumers_sync();
        t0 = now_ns();
        if (b < ATTN_BLOCKS) {
            if (warp == 0) {
                unsigned at = (unsigned)(b * 4099 + lane * 131) % CHAIN_WORDS;
                for (int i = 0; i < ATTN_CHAIN; ++i) at = __ldcg(params.chain + at);
                if (at == 0xffffffffu) params.attn_out[0] = __float2bfloat16_rn(0.0f);  // keeps the chain
            }
            consumers_sync();
            constexpr int SHARE = H / ATTN_BLOCKS;
            for (int i = t; i < SHARE; i += CONSUMERS) params.attn_out[b * SHARE + i] = __ldcg(attn + b * SHARE + i);
        }
        count_in(t0);
    }

    // The mma form of a phase's products, over the same stages as the fma.f16x2 form (a stage: 8 rows
    // of K = 4096, gate_up's 4 gate rows then their 4 up rows, or 2 rows of down's 14336). The
    // weights are B of m16n8k16 steps, B's 8 columns the stage's (row, segment) pairs: each row's K
    // in SEGS = 8 / rows segments. A row m holds x's segment m % SEGS, so C[m][n] with equal
    // segments is row n's partial product. Warp w takes columns [w WK, + WK) of every segment, in
    // 64-column spans: lane (g, q) = (lane / 4, lane % 4) loads the 16 bytes at 16 q of its column
    // g's span, the B fragments of four steps (one cvt.rn.f16x2.e4m3x2 a pair). Its x, the A
    // fragments, comes from shared memory each span (X_SMEM) or stays in registers for the phase:
    // f16 under a power of two (the normalised rows are at most sqrt(H) and go as they are; act and
    // qkv so that their largest magnitude, which the phase that wrote them counted, sits in
    // [2^14, 2^15)). f32 accumulators, so no per-chunk power of two is needed. Slower than the
    // fma.f16x2 form (docs/lab/cuda-runs.md, session 14); kept to measure against it.
    template <int P>
    __device__ __forceinline__ void stream_mma(int l, int first, int last) {
        constexpr int K = phase_inner(P), PER = stage_units(P), ROWS = P == 1 ? 2 * PER : PER;
        constexpr int SEGS = 8 / ROWS, SEG = K / SEGS, WK = SEG / CONSUMER_WARPS, SPANS = WK / 64;
        static_assert(ROWS * SEGS == 8 && SEG % (64 * CONSUMER_WARPS) == 0, "a stage is 8 (row, segment) columns");
        const int g = lane >> 2, q = lane & 3;
        float x_scale = 1.0f;
        if (P == 1 || P == 3) x_scale = rsqrtf(__ldcg(params.sumsq + l * PHASES + P - 1) / H + 1e-5f);
        if (P == 0 || P == 2) {
            const float amax = P == 2  ? __ldcg(params.sumsq + l * PHASES + 1)
                               : l > 0 ? __ldcg(params.sumsq + (l - 1) * PHASES + 3)
                                       : 1.0f;  // layer 0's attn is the probe's, within [-1, 1]
            const int e = amax > 0.0f ? (int)((__float_as_uint(amax) >> 23) & 0xff) - 127 : 0;
            x_scale = __uint_as_float((u32)(14 - e + 127) << 23);
        }
        const float unscale = (P == 1 || P == 3) ? 1.0f : 1.0f / x_scale;
        const int x_base = (g % SEGS) * SEG + warp * WK + q * 16;  // A row g's columns of this lane
        const bf16* source = P == 0 ? (ATTN_CHAIN > 0 ? params.attn_out : attn) : params.act;
        constexpr int XR = X_SMEM ? 1 : SPANS;
        u32 xr[XR][8];
        // x_smem: every consumer converts 16 values a pass; registers: each lane its own spans
#pragma unroll
        for (int sp = 0; sp < (X_SMEM ? (K / 16 + CONSUMERS - 1) / CONSUMERS : SPANS); ++sp) {
            const int at = X_SMEM ? (t + sp * CONSUMERS) * 16 : x_base + sp * 64;
            if (X_SMEM && at >= K) break;
            float v[16];
            if (P == 1 || P == 3) {
                load16_cg(params.residual + at, v);
            } else {
                Vec8<bf16>{__ldcg(reinterpret_cast<const uint4*>(source + at))}.to_floats(v);
                Vec8<bf16>{__ldcg(reinterpret_cast<const uint4*>(source + at + 8))}.to_floats(v + 8);
            }
            u32 packed[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) packed[i] = pack_f16x2(v[2 * i] * x_scale, v[2 * i + 1] * x_scale);
            if (X_SMEM) {
                uint4* dst = reinterpret_cast<uint4*>(xs + at / 2);
                dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) xr[X_SMEM ? 0 : sp][i] = packed[i];
            }
        }
        if (X_SMEM) consumers_sync();
        const int w_base = (g / SEGS) * K + (g % SEGS) * SEG + warp * WK + q * 16;  // B column g's bytes
        for (int u = first; u < last; u += PER, ++it) {
            const int n = min(PER, last - u), slot = it % STAGES;
            const unsigned long long t0 = now_ns();
            mbarrier_wait(full + slot, (it / STAGES) & 1);
            if (t == 0) starved += now_ns() - t0;
            float acc[ACC_CHAINS][4] = {};
            if (!NO_COMPUTE) {
                const unsigned char* stage = ring + slot * STAGE_BYTES + w_base;
                uint4 wv[SPANS];
#pragma unroll
                for (int sp = 0; sp < SPANS; ++sp) wv[sp] = *reinterpret_cast<const uint4*>(stage + sp * 64);
                if (EARLY_RELEASE) {
                    __syncwarp();
                    if (lane == 0) mbarrier_arrive(empty + slot);
                }
#pragma unroll
                for (int sp = 0; sp < SPANS; ++sp) {
                    const uint4 w = wv[sp];
                    const u32 words[4] = {w.x, w.y, w.z, w.w};
                    if (X_SMEM) {
                        const uint4* src = reinterpret_cast<const uint4*>(xs + (x_base + sp * 64) / 2);
                        const uint4 x0 = src[0], x1 = src[1];
                        const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                        for (int i = 0; i < 8; ++i) xr[0][i] = xw[i];
                    }
                    u32 (&xs_sp)[8] = xr[X_SMEM ? 0 : sp];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const u32 a[4] = {xs_sp[2 * i], xs_sp[2 * i], xs_sp[2 * i + 1], xs_sp[2 * i + 1]};
                        const u32 b[2] = {fp8x2_to_f16x2(words[i] & 0xffffu), fp8x2_to_f16x2(words[i] >> 16)};
                        mma_f16_16816(acc[(sp * 4 + i) % ACC_CHAINS], a, b);
                    }
                }
            }
            if (!EARLY_RELEASE || NO_COMPUTE) {
                __syncwarp();
                if (lane == 0) mbarrier_arrive(empty + slot);
            }
            float c0 = 0.0f, c1 = 0.0f;  // C[g][2q], C[g][2q + 1]
#pragma unroll
            for (int c = 0; c < ACC_CHAINS; ++c) {
                c0 += acc[c][0];
                c1 += acc[c][1];
            }
            if (SEGS == 1) {  // every A row is x: lanes 0..3 hold the 8 rows' sums
                if (g == 0) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int r = 2 * q + e;  // the stage's row; gate_up: features 0..3's gate, then up rows
                        const int unit = P == 1 ? gu_feature(r, PER) : r;
                        if (unit < n)
                            partial[warp][u - first + unit + (P == 1 && gu_up(r, PER) ? MAX_LOCAL / 2 : 0)] =
                                (e ? c1 : c0) * unscale;
                    }
                }
            } else {  // down: row q / 2's segment sums sit where A's segment (g) is B's ((2q + e) % 4)
                float v = g < SEGS ? (g == (2 * q) % SEGS ? c0 : g == (2 * q + 1) % SEGS ? c1 : 0.0f) : 0.0f;
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                const int r = q >> 1;
                if ((lane & ~2) == 0 && r < n) partial[warp][u - first + r] = v * unscale;
            }
        }
    }

    // The warps' sums of the block's row u (gate_up: and of its up row, else 0 there).
    __device__ __forceinline__ float warps_sum(int u, float& up) const {
        float total = 0.0f;
        up = 0.0f;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
            total += partial[w][u];
            up += partial[w][MAX_LOCAL / 2 + u];
        }
        return total;
    }

    // The sum of every consumer thread's v (a block barrier; act_stat as scratch).
    __device__ __forceinline__ float block_sum(float v) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        consumers_sync();
        if (lane == 0) act_stat[warp] = v;
        consumers_sync();
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) total += act_stat[w];
        return total;
    }

    // FUSED_MLP, the end of gate_up: the block's act (its features) as f16 pairs in shared memory,
    // scaled by a power of two so that the largest is in [8, 16): 8 products of E4M3 (<= 448)
    // then stay under f16's range in down's f16 sums.
    __device__ __forceinline__ void keep_act(int units, float scale, float scale_up) {
        consumers_sync();
        float a = 0.0f;
        if (t < units) {
            float up;
            const float total = warps_sum(t, up);
            a = silu(total * scale) * (up * scale_up);
        }
        float m = fabsf(a);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) act_stat[warp] = m;
        consumers_sync();
        float amax = 0.0f;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) amax = fmaxf(amax, act_stat[w]);
        const u32 biased = amax > 0.0f ? min(max(__float_as_uint(amax) >> 23, 16u), 240u) : 127u;
        const float up_scale = __uint_as_float((130u - biased + 127u) << 23);  // 2^(3 - e)
        if (t < units) act_pair[t] = pack_f16x2(a * up_scale, a * up_scale);
        consumers_sync();  // every warp read act_stat before it is overwritten
        if (t == 0) act_stat[CONSUMER_WARPS] = 1.0f / up_scale;
        consumers_sync();
    }

    // FUSED_MLP, down: the block's features' rows of Wd^T (each H wide) times their act, thread t
    // owning outputs [16 t, + 16) in f16 pairs a stage (8 rows), f32 across stages; the block's
    // partial sums then go to y_acc with vector adds, and the block counts itself in.
    __device__ __forceinline__ void down_fused(const float* scales) {
        int first, last;
        unit_range(2, b, blocks, first, last);
        const int h0 = t * 16;
        float out_scale[16], y[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            out_scale[i] = __ldg(scales + h0 + i);
            y[i] = 0.0f;
        }
        constexpr int PER = stage_units(2);
        for (int u = first; u < last; u += PER, ++it) {
            const int n = min(PER, last - u), slot = it % STAGES;
            unsigned long long t0 = now_ns();
            mbarrier_wait(full + slot, (it / STAGES) & 1);
            if (t == 0) starved += now_ns() - t0;
            const unsigned char* stage = ring + slot * STAGE_BYTES + h0;
            uint4 wv[PER];
#pragma unroll
            for (int r = 0; r < PER; ++r)
                if (r < n) wv[r] = *reinterpret_cast<const uint4*>(stage + r * H);
            if (EARLY_RELEASE) {
                __syncwarp();
                if (lane == 0) mbarrier_arrive(empty + slot);
            }
            u32 acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int r = 0; r < PER; ++r) {
                if (NO_COMPUTE || r >= n) continue;
                const u32 a = act_pair[u - first + r];
                const u32 words[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const u32 lo = fp8x2_to_f16x2(words[i] & 0xffffu), hi = fp8x2_to_f16x2(words[i] >> 16);
                    asm("fma.rn.f16x2 %0, %1, %2, %0;\n" : "+r"(acc[2 * i]) : "r"(lo), "r"(a));
                    asm("fma.rn.f16x2 %0, %1, %2, %0;\n" : "+r"(acc[2 * i + 1]) : "r"(hi), "r"(a));
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float2 f = f16x2_to_floats(acc[i]);
                y[2 * i] += f.x;
                y[2 * i + 1] += f.y;
            }
            if (!EARLY_RELEASE) {
                __syncwarp();
                if (lane == 0) mbarrier_arrive(empty + slot);
            }
        }
        const unsigned long long t0 = now_ns();
        const float unscale = act_stat[CONSUMER_WARPS];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = y[4 * j + i] * out_scale[4 * j + i] * unscale;
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(params.y_acc + h0 + 4 * j),
                         "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                         : "memory");
        }
        count_in(t0);
    }

    // LAST_WARP_ENDS: the warp that finishes the phase last writes the block's rows from the shared
    // sums (zeroing them for the phase after next), counts the norm's statistics and the block in;
    // the other warps go straight on to the next phase's barrier.
    template <int P>
    __device__ __forceinline__ void finish_as_last_warp(int l, int first, int units, float* sums) {
        const float* scales = block_scales[phase_index & 1];
        const unsigned long long t0 = now_ns();
        __syncwarp();
        __threadfence_block();  // this warp's shared adds before its count
        unsigned done = 0;
        if (lane == 0) done = atomicAdd(warps_done, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done != CONSUMER_WARPS - 1) return;
        __threadfence_block();  // every warp's adds, then the reads below
        float stat = 0.0f;
        for (int u = lane; u < units; u += 32) {
            const float total = sums[u], scale = scales[u];
            sums[u] = 0.0f;
            const int unit = first + u;
            if (P == 0 || P == 2) {
                const float value = own_residual[u] + total * scale;
                own_residual[u] = value;
                params.residual[unit] = value;
                stat += value * value;
            } else {
                const float up = sums[MAX_LOCAL / 2 + u] * scales[MAX_LOCAL / 2 + u];
                if (P == 1) sums[MAX_LOCAL / 2 + u] = 0.0f;
                const bf16 value = __float2bfloat16_rn(P == 1 ? silu(total * scale) * up : total * scale);
                (P == 1 ? params.act : params.qkv)[unit] = value;
                stat = fmaxf(stat, fabsf(__bfloat162float(value)));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, stat, o);
            stat = (P == 0 || P == 2) ? stat + other : fmaxf(stat, other);
        }
        __syncwarp();
        if (lane == 0) {
            if (P == 0 || P == 2) atomicAdd(params.sumsq + l * PHASES + P, stat);
            else atomicMax(reinterpret_cast<int*>(params.sumsq) + l * PHASES + P, __float_as_int(stat));
            *warps_done = 0;
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(params.counter) : "memory");
        }
        if (t == 0) ends += now_ns() - t0;
    }

    template <int P>
    __device__ __forceinline__ void phase(int l, const float* scales) {
        if constexpr (FUSED_MLP && P == 2) {
            down_fused(scales);
            return;
        }
        constexpr int K = phase_inner(P), CHUNKS = K / 16, PER = stage_units(P);
        constexpr int ROWS = P == 1 ? 2 * PER : PER;  // gate_up: PER features' gate rows, then up rows
        constexpr int MINE = (CHUNKS + GROUP_THREADS - 1) / GROUP_THREADS;  // x chunks a thread owns
        constexpr int RPG = ROWS / GROUPS;  // a warp group's rows of a stage: rows [group RPG, + RPG)
        static_assert(ROWS % GROUPS == 0 && RPG <= 8, "a stage's rows split evenly over the warp groups");
        int first, last;
        unit_range(P, b, blocks, first, last);
        const int units = last - first;
        // before the barrier: the scales of this block's rows (nothing a phase writes)
        float scale = 0.0f, scale_up = 0.0f;
        if (t < units) {
            scale = __ldg(scales + first + t);
            if (P == 1) scale_up = __ldg(scales + I + first + t);
            if (LAST_WARP_ENDS) {  // by phase parity: the last warp of the phase before may still read the other
                block_scales[phase_index & 1][t] = scale;
                if (P == 1) block_scales[phase_index & 1][MAX_LOCAL / 2 + t] = scale_up;
            }
        }
        float* sums = block_sums[phase_index & 1];
        unsigned long long t0;
        if (LAST_WARP_ENDS) {  // each warp waits for the phase's input itself
            t0 = now_ns();
            if (lane == 0) {
                while (ring_load_acquire(params.counter) < phase_index * blocks) __nanosleep(20);
                __threadfence();
            }
            __syncwarp();
            if (t == 0) at_barrier += now_ns() - t0;
            t0 = now_ns();
        } else {
            wait_for_phase_input();
            t0 = now_ns();
            // a warp writes only its group's rows below: the others' entries of this phase start at zero
            for (int f = lane; f < MAX_LOCAL; f += 32) partial[warp][f] = 0.0f;
            consumers_sync();
        }
        if constexpr (MMA) {
            stream_mma<P>(l, first, last);
        } else {
        // the norm's sum of squares is read beside x; a uniform scale only moves each chunk's power of
        // two, so it multiplies the unscales once known
        float sum_squares = 0.0f;
        if ((P == 1 || P == 3) && !(FUSED_MLP && P == 3)) sum_squares = __ldcg(params.sumsq + l * PHASES + P - 1);
        const int tg = t % GROUP_THREADS, group = t / GROUP_THREADS;
        u32 pairs[MINE][8];
        float unscale[MINE];
#pragma unroll
        for (int j = 0; j < MINE; ++j) {
            const int chunk = tg + j * GROUP_THREADS;
            if (chunk < CHUNKS) {
                float values[16];
                if (P == 1 || P == 3) {
                    load16_cg(params.residual + chunk * 16, values);
                    if (FUSED_MLP && P == 3) {  // the residual after down is the residual plus the blocks' sums
                        float down[16];
                        load16_cg(params.y_acc + chunk * 16, down);
#pragma unroll
                        for (int i = 0; i < 16; ++i) {
                            values[i] += down[i];
                            sum_squares += values[i] * values[i];
                        }
                    }
                } else {
                    const bf16* src = (P == 0 ? (ATTN_CHAIN > 0 ? params.attn_out : attn) : params.act) + chunk * 16;
                    Vec8<bf16>{__ldcg(reinterpret_cast<const uint4*>(src))}.to_floats(values);
                    Vec8<bf16>{__ldcg(reinterpret_cast<const uint4*>(src + 8))}.to_floats(values + 8);
                }
                unscale[j] = chunk_to_f16(values, pairs[j]);
            }
        }
        if (FUSED_MLP && P == 3) sum_squares = block_sum(sum_squares);
        if (P == 1 || P == 3) {
            const float inverse_rms = rsqrtf(sum_squares / H + 1e-5f);
#pragma unroll
            for (int j = 0; j < MINE; ++j) unscale[j] *= inverse_rms;
        }
        for (int u = first; u < last; u += PER, ++it) {
            const int n = min(PER, last - u), slot = it % STAGES;
            t0 = now_ns();
            mbarrier_wait(full + slot, (it / STAGES) & 1);
            if (t == 0) starved += now_ns() - t0;
            const unsigned char* stage = ring + slot * STAGE_BYTES;
            // the warp's share of the stage (at most 8 chunks a lane), read out first where EARLY_RELEASE
            // lets the producer refill the slot while the products run
            uint4 wv[RPG][MINE];
#pragma unroll
            for (int lr = 0; lr < RPG; ++lr) {
                const int r = group * RPG + lr;
#pragma unroll
                for (int j = 0; j < MINE; ++j) {
                    const int chunk = tg + j * GROUP_THREADS;
                    if (MINE * GROUP_THREADS == CHUNKS || chunk < CHUNKS)
                        wv[lr][j] = *reinterpret_cast<const uint4*>(stage + r * K + chunk * 16);
                }
            }
            if (EARLY_RELEASE) {
                __syncwarp();
                if (lane == 0) mbarrier_arrive(empty + slot);
            }
            float acc[8];
#pragma unroll
            for (int lr = 0; lr < 8; ++lr) {
                acc[lr] = 0.0f;
                const int r = group * RPG + lr, unit = P == 1 ? gu_feature(r, PER) : r;
                if (!NO_COMPUTE && lr < RPG && unit < n) {
#pragma unroll
                    for (int j = 0; j < MINE; ++j) {
                        const int chunk = tg + j * GROUP_THREADS;
                        if (MINE * GROUP_THREADS == CHUNKS || chunk < CHUNKS)
                            acc[lr] += dot16(wv[lr < RPG ? lr : 0][j], pairs[j], unscale[j]);
                    }
                }
            }
            if (!EARLY_RELEASE) {
                __syncwarp();
                if (lane == 0) mbarrier_arrive(empty + slot);  // this warp is done reading the stage
            }
            // the warp's 8 row sums, reduce-scattered: lane l ends with local row ((l >> 2) & 7)'s
            const float total = reduce_scatter8(acc, lane);
            const int lr = (lane >> 2) & 7, r = group * RPG + lr, unit = P == 1 ? gu_feature(r, PER) : r;
            if ((lane & 3) == 0 && lr < RPG && unit < n) {
                const int at = u - first + unit + (P == 1 && gu_up(r, PER) ? MAX_LOCAL / 2 : 0);
                if (LAST_WARP_ENDS) atomicAdd(sums + at, total);
                else partial[warp][at] = total;
            }
        }
        }
        if (LAST_WARP_ENDS) {
            finish_as_last_warp<P>(l, first, units, sums);
            ++phase_index;
            return;
        }
        if constexpr (FUSED_MLP && P == 1) {  // act stays in the block for its down; no grid barrier
            keep_act(units, scale, scale_up);
            return;
        }
        // the block's rows: the warps' sums, scaled, written (o and down: the owned residual rows,
        // their squares added to the next norm's sum); then counted in
        t0 = now_ns();
        consumers_sync();
        float squares = 0.0f;
        if (t < units) {
            float up;
            const float total = warps_sum(t, up);
            const int unit = first + t;
            if (FUSED_MLP && P == 0) {  // the previous layer's down joins the residual here
                const float value = __ldcg(params.residual + unit) + __ldcg(params.y_acc + unit) + total * scale;
                params.y_acc[unit] = 0.0f;
                params.residual[unit] = value;
                squares = value * value;
            } else if (P == 0 || P == 2) {
                const float value = own_residual[t] + total * scale;
                own_residual[t] = value;
                params.residual[unit] = value;
                squares = value * value;
            } else {  // act or qkv, and its magnitude (the mma form scales the next phase's x by it)
                const bf16 value = __float2bfloat16_rn(P == 1 ? silu(total * scale) * (up * scale_up) : total * scale);
                (P == 1 ? params.act : params.qkv)[unit] = value;
                squares = fabsf(__bfloat162float(value));
            }
        }
        if (P == 0 || P == 2) {
            float v[1] = {squares};
            warp_sums<1>(v);
            if (lane == 0 && warp < (units + 31) / 32) atomicAdd(params.sumsq + l * PHASES + P, v[0]);
        } else {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) squares = fmaxf(squares, __shfl_xor_sync(0xffffffffu, squares, o));
            if (lane == 0 && warp < (units + 31) / 32)
                atomicMax(reinterpret_cast<int*>(params.sumsq) + l * PHASES + P, __float_as_int(squares));
        }
        count_in(t0);
    }
};

// The producer's walk over its block's stages, layer after layer, phase after phase.
struct StageCursor {
    const Params* params;
    int b, blocks;
    int l = 0, p = 0, u = 0, first = 0, last = 0;

    // from (l, p) on, the first phase with units for this block
    __device__ void enter() {
        while (l < params->num_layers) {
            unit_range(p, b, blocks, first, last);
            u = first;
            if (u < last && !(params->only_phases > 0 && p >= params->only_phases)) return;
            if (++p == PHASES) {
                p = 0;
                ++l;
            }
        }
    }
    __device__ bool valid() const { return l < params->num_layers; }
    __device__ void next() {
        u += stage_units(p);
        if (u < last) return;
        if (++p == PHASES) {
            p = 0;
            ++l;
        }
        enter();
    }
    // the stage's bytes: one run, or gate_up's gate rows and up rows (not interleaved)
    __device__ int parts(const unsigned char** src, u32* bytes) const {
        const Layer& layer = params->layers[l];
        const unsigned char* w = p == 0 ? layer.wo : p == 1 ? layer.wgu : p == 2 ? layer.wd : layer.wqkv;
        const int inner = stream_inner(p), n = min(stage_units(p), last - u);
        if (p == 1) {
            src[0] = w + gu_row(u, false) * inner;
            bytes[0] = (u32)n * inner * (GU_INTERLEAVE ? 2 : 1);
            if (GU_INTERLEAVE) return 1;
            src[1] = w + gu_row(u, true) * inner;
            bytes[1] = (u32)n * inner;
            return 2;
        }
        src[0] = w + (long long)u * inner;
        bytes[0] = (u32)n * inner;
        return 1;
    }
    // asks L2 for the stage's bytes (PREFETCH_AHEAD stages before its copy)
    __device__ void prefetch() const {
        const unsigned char* src[2];
        u32 bytes[2];
        const int n = parts(src, bytes);
        for (int i = 0; i < n; ++i)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src[i]), "r"(bytes[i]) : "memory");
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) persistent_layers(Params params) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    u64* full = reinterpret_cast<u64*>(smem + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;
    u32* xs = reinterpret_cast<u32*>(empty + STAGES);
    __shared__ float partial[CONSUMER_WARPS][MAX_LOCAL];  // each warp's sum of each of the block's rows
    __shared__ float own_residual[MAX_LOCAL];  // the residual rows this block owns (o's and down's)
    __shared__ float block_sums[2][MAX_LOCAL], block_scales[2][MAX_LOCAL];
    __shared__ unsigned warps_done;
    __shared__ u32 act_pair[MAX_LOCAL / 2];
    __shared__ float act_stat[CONSUMER_WARPS + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.x, blocks = gridDim.x;
    init_ring(full, empty, STAGES, CONSUMER_WARPS);

    if (warp == CONSUMER_WARPS) {  // the producer: every stage of every phase of every layer, in order
        if (lane != 0) return;
        const u64 policy = l2_evict_first();
        unsigned long long blocked = 0;
        StageCursor cur{&params, b, blocks}, ahead{&params, b, blocks};
        cur.enter();
        ahead.enter();
        for (int i = 0; i < PREFETCH_AHEAD && ahead.valid(); ++i, ahead.next()) ahead.prefetch();
        for (unsigned it = 0; cur.valid(); ++it, cur.next()) {
            if (PREFETCH_AHEAD > 0 && ahead.valid()) {
                ahead.prefetch();
                ahead.next();
            }
            if (PRODUCER_WAITS && cur.u == cur.first) {
                const unsigned target = (unsigned)(cur.l * PER_LAYER + PER_LAYER - PHASES + cur.p) * blocks;
                while (ring_load_acquire(params.counter) < target) __nanosleep(20);
            }
            const int slot = it % STAGES;
            const unsigned long long t0 = now_ns();
            mbarrier_wait(empty + slot, ((it / STAGES) & 1) ^ 1);
            blocked += now_ns() - t0;
            const unsigned char* src[2];
            u32 bytes[2];
            const int parts = cur.parts(src, bytes);
            mbarrier_arrive_expect_tx(full + slot, bytes[0] + (parts > 1 ? bytes[1] : 0));
            unsigned char* dst = ring + slot * STAGE_BYTES;
            ring_copy(dst, src[0], bytes[0], full + slot, policy);
            if (parts > 1) ring_copy(dst + stage_units(1) * H, src[1], bytes[1], full + slot, policy);
        }
        params.stats[b * 4 + 3] = blocked;
        return;
    }

    // consumers
    const int t = threadIdx.x;
    Consumer c{params,       ring,        full,     empty,    partial, own_residual, xs,   block_sums,
               block_scales, &warps_done, act_pair, act_stat, t,       warp,         lane, b,
               blocks};
    int first, last;
    unit_range(0, b, blocks, first, last);  // o and down own the same residual rows
    for (int f = t; f < last - first; f += CONSUMERS) own_residual[f] = params.residual[first + f];
    for (int f = t; f < 2 * MAX_LOCAL; f += CONSUMERS) block_sums[f / MAX_LOCAL][f % MAX_LOCAL] = 0.0f;
    if (t == 0) warps_done = 0;
    consumers_sync();
    for (int l = 0; l < params.num_layers; ++l) {
        const Layer layer = params.layers[l];
        if (ATTN_CHAIN > 0) c.attention();
        c.phase<0>(l, layer.so);
        if (params.only_phases == 1) break;
        c.phase<1>(l, layer.sgu);
        c.phase<2>(l, layer.sd);
        c.phase<3>(l, layer.sqkv);
        c.attn = params.qkv;  // the next layer reads qkv[0, H) as its attn
    }
    if (t == 0) {
        params.stats[b * 4] = c.starved;
        params.stats[b * 4 + 1] = c.at_barrier;
        params.stats[b * 4 + 2] = c.ends;
    }
}

// ---------------------------------------------------------------------------------------------
// Reference: one warp a row, f32, exact E4M3.
__device__ __forceinline__ float e4m3(unsigned char byte) {
    const float2 f = f16x2_to_floats(fp8x2_to_f16x2(byte));
    return f.x;
}

__global__ void ref_rms(const float* residual, float* out) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) s += residual[i] * residual[i];
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < (int)blockDim.x / 32; ++w) total += part[w];
        *out = rsqrtf(total / H + 1e-5f);
    }
}

// phase p of one layer, rows [0, units)
__global__ void ref_phase(int p, Layer layer, float* residual, const bf16* attn, bf16* act, bf16* qkv,
                          const float* inverse_rms) {
    const int unit = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (unit >= phase_units(p)) return;
    const int inner = phase_inner(p);
    auto x_at = [&](int k) -> float {
        if (p == 0) return __bfloat162float(attn[k]);
        if (p == 2) return __bfloat162float(act[k]);
        return residual[k] * *inverse_rms;
    };
    auto row_dot = [&](const unsigned char* w, long long row) {
        float s = 0.0f;
        for (int k = lane; k < inner; k += 32) {
            // FUSED_MLP stores down transposed: Wd[row][k] at Wd^T[k][row]
            const long long at = FUSED_MLP && p == 2 ? (long long)k * H + row : row * inner + k;
            s += e4m3(w[at]) * x_at(k);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        return s;
    };
    if (p == 0 || p == 2) {
        const float s = row_dot(p == 0 ? layer.wo : layer.wd, unit) * (p == 0 ? layer.so : layer.sd)[unit];
        __syncwarp();
        if (lane == 0) residual[unit] += s;  // every row read x before any wrote: x is not the residual here
    } else if (p == 1) {
        const float g = row_dot(layer.wgu, gu_row(unit, false)) * layer.sgu[unit];
        const float v = row_dot(layer.wgu, gu_row(unit, true)) * layer.sgu[I + unit];
        if (lane == 0) act[unit] = __float2bfloat16_rn(silu(g) * v);
    } else {
        const float s = row_dot(layer.wqkv, unit) * layer.sqkv[unit];
        if (lane == 0) qkv[unit] = __float2bfloat16_rn(s);
    }
}

// One warp, one 64-column span of 8 rows: the mma form's fragments against a plain sum (PROBE_DEBUG).
__global__ void mma_selftest(const unsigned char* w, const float* x, float* out) {
    const int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
    const uint4 wv = *reinterpret_cast<const uint4*>(w + g * 64 + q * 16);
    const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
    u32 xs[8];
    for (int i = 0; i < 8; ++i) xs[i] = pack_f16x2(x[q * 16 + 2 * i], x[q * 16 + 2 * i + 1]);
    float acc[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) {
        const u32 a[4] = {xs[2 * i], xs[2 * i], xs[2 * i + 1], xs[2 * i + 1]};
        const u32 b[2] = {fp8x2_to_f16x2(words[i] & 0xffffu), fp8x2_to_f16x2(words[i] >> 16)};
        mma_f16_16816(acc, a, b);
    }
    if (g == 0) {
        out[2 * q] = acc[0];
        out[2 * q + 1] = acc[1];
    }
    if (lane == 0) {
        for (int r = 0; r < 8; ++r) {
            float s = 0.0f;
            for (int k = 0; k < 64; ++k) s += e4m3(w[r * 64 + k]) * x[k];
            out[8 + r] = s;
        }
    }
}

__global__ void fill_bytes(unsigned char* p, long long n, unsigned seed) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const unsigned magnitude = h % 0x7e;  // E4M3 0 .. 0x7d (448 is 0x7e; 0x7f is NaN)
        p[i] = (unsigned char)(magnitude | ((h >> 8) & 0x80u));
    }
}

int main(int argc, char** argv) {
    const int num_layers = argc > 1 ? atoi(argv[1]) : 16;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long bytes_o = (long long)H * H, bytes_gu = 2LL * I * H, bytes_d = (long long)H * I,
                    bytes_qkv = (long long)QKV * H;
    const long long layer_bytes = bytes_o + bytes_gu + bytes_d + bytes_qkv;
    unsigned char* weights;
    CHECK(cudaMalloc(&weights, layer_bytes * num_layers));
    fill_bytes<<<4096, 256>>>(weights, layer_bytes * num_layers, 12345u);
    const int scale_count = H + 2 * I + H + QKV;
    float* scales;
    CHECK(cudaMalloc(&scales, sizeof(float) * scale_count * num_layers));
    std::vector<Layer> host_layers(num_layers);
    for (int l = 0; l < num_layers; ++l) {
        unsigned char* base = weights + layer_bytes * l;
        float* s = scales + (long long)scale_count * l;
        host_layers[l] = {base, base + bytes_o, base + bytes_o + bytes_gu, base + bytes_o + bytes_gu + bytes_d,
                          s, s + H, s + H + 2 * I, s + H + 2 * I + H};
        fill_floats<<<64, 256>>>(s, H, 0.5f / (200.0f * 64.0f));             // o: K = 4096
        fill_floats<<<64, 256>>>(s + H, 2 * I, 1.0f / (200.0f * 64.0f));     // gate_up
        fill_floats<<<64, 256>>>(s + H + 2 * I, H, 0.5f / (200.0f * 120.0f)); // down: K = 14336
        fill_floats<<<64, 256>>>(s + H + 2 * I + H, QKV, 1.0f / (200.0f * 64.0f));
    }
    Layer* layers;
    CHECK(cudaMalloc(&layers, sizeof(Layer) * num_layers));
    CHECK(cudaMemcpy(layers, host_layers.data(), sizeof(Layer) * num_layers, cudaMemcpyHostToDevice));
    float *residual, *residual0, *inverse_rms;
    bf16 *attn, *attn0, *act, *qkv;
    unsigned *counter, *sink;
    unsigned long long* stats;
    CHECK(cudaMalloc(&stats, 8 * 4 * 1024));
    float* sumsq;
    CHECK(cudaMalloc(&sumsq, sizeof(float) * PHASES * num_layers));
    unsigned* chain;
    bf16* attn_out;
    CHECK(cudaMalloc(&chain, sizeof(unsigned) * CHAIN_WORDS));
    CHECK(cudaMalloc(&attn_out, H * 2));
    {
        std::vector<unsigned> order(CHAIN_WORDS), next(CHAIN_WORDS);
        for (int i = 0; i < CHAIN_WORDS; ++i) order[i] = i;
        unsigned state = 2463534242u;
        for (int i = CHAIN_WORDS - 1; i > 0; --i) {  // a random cycle through every word
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            std::swap(order[i], order[state % (i + 1)]);
        }
        for (int i = 0; i < CHAIN_WORDS; ++i) next[order[i]] = order[(i + 1) % CHAIN_WORDS];
        CHECK(cudaMemcpy(chain, next.data(), sizeof(unsigned) * CHAIN_WORDS, cudaMemcpyHostToDevice));
    }
    CHECK(cudaMalloc(&residual, H * 4));
    CHECK(cudaMalloc(&residual0, H * 4));
    CHECK(cudaMalloc(&inverse_rms, 4));
    CHECK(cudaMalloc(&attn, H * 2));
    CHECK(cudaMalloc(&attn0, H * 2));
    CHECK(cudaMalloc(&act, I * 2));
    CHECK(cudaMalloc(&qkv, QKV * 2));
    CHECK(cudaMalloc(&counter, 4));
    float* y_acc;
    CHECK(cudaMalloc(&y_acc, H * 4));
    CHECK(cudaMalloc(&sink, 4));
    fill_bf16<<<16, 256>>>(attn0, H, 7u);
    fill_floats<<<16, 256>>>(residual0, H, 0.25f);
    CHECK(cudaDeviceSynchronize());

    const int smem = STAGES * STAGE_BYTES + 2 * STAGES * 8 + (MMA && X_SMEM ? I * 2 : 0);
    CHECK(cudaFuncSetAttribute(persistent_layers, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto run_persistent = [&](int layers_run, int only_phases = 0) {
        CHECK(cudaMemcpyAsync(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpyAsync(attn, attn0, H * 2, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemsetAsync(counter, 0, 4));
        CHECK(cudaMemsetAsync(y_acc, 0, H * 4));
        CHECK(cudaMemsetAsync(sumsq, 0, sizeof(float) * PHASES * num_layers));
        Params params{layers, layers_run, residual, attn, act, qkv, counter, stats, sumsq, chain, attn_out,
                      only_phases, y_acc};
        persistent_layers<<<sms, THREADS, smem>>>(params);
        CHECK(cudaGetLastError());
    };

    // check two layers against the reference chain
    const int check_layers = num_layers < 2 ? num_layers : 2;
    run_persistent(check_layers);
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got(H);
    std::vector<unsigned short> got_qkv(QKV);
    CHECK(cudaMemcpy(got.data(), residual, H * 4, cudaMemcpyDeviceToHost));
    if (FUSED_MLP) {  // the last layer's down is still in y_acc
        std::vector<float> down(H);
        CHECK(cudaMemcpy(down.data(), y_acc, H * 4, cudaMemcpyDeviceToHost));
        for (int i = 0; i < H; ++i) got[i] += down[i];
    }
    CHECK(cudaMemcpy(got_qkv.data(), qkv, QKV * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(attn, attn0, H * 2, cudaMemcpyDeviceToDevice));
    for (int l = 0; l < check_layers; ++l) {
        for (int p = 0; p < PHASES; ++p) {
            if (p == 1 || p == 3) ref_rms<<<1, 1024>>>(residual, inverse_rms);
            const int units = p == 0 ? H : p == 1 ? I : p == 2 ? H : QKV;
            ref_phase<<<(units + 7) / 8, 256>>>(p, host_layers[l], residual, l == 0 ? attn : qkv, act, qkv,
                                                inverse_rms);
        }
    }
    CHECK(cudaDeviceSynchronize());
    std::vector<float> want(H);
    std::vector<unsigned short> want_qkv(QKV);
    CHECK(cudaMemcpy(want.data(), residual, H * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(want_qkv.data(), qkv, QKV * 2, cudaMemcpyDeviceToHost));
    auto bf = [](unsigned short bits) { unsigned u = (unsigned)bits << 16; float f; memcpy(&f, &u, 4); return f; };
    double err = 0, norm = 0, err_q = 0, norm_q = 0;
    for (int i = 0; i < H; ++i) {  // against what the layers added to the 0.25 the residual starts at
        err += (got[i] - want[i]) * (double)(got[i] - want[i]);
        norm += (want[i] - 0.25) * (double)(want[i] - 0.25);
    }
    for (int i = 0; i < QKV; ++i) {
        const double d = bf(got_qkv[i]) - bf(want_qkv[i]);
        err_q += d * d;
        norm_q += bf(want_qkv[i]) * (double)bf(want_qkv[i]);
    }
    printf("check over %d layers: residual delta rel L2 %.2e (rms delta %.3e), qkv rel L2 %.2e\n", check_layers,
           sqrt(err / norm), sqrt(norm / H), sqrt(err_q / norm_q));
    if (getenv("PROBE_DEBUG")) {  // where a wrong check went wrong: the fragments alone, then one layer
        float *x64, *out16;
        CHECK(cudaMalloc(&x64, 64 * 4));
        CHECK(cudaMalloc(&out16, 16 * 4));
        std::vector<float> hx(64), ho(16);
        for (int k = 0; k < 64; ++k) hx[k] = (k % 7) - 3.0f;
        CHECK(cudaMemcpy(x64, hx.data(), 64 * 4, cudaMemcpyHostToDevice));
        mma_selftest<<<1, 32>>>(weights, x64, out16);
        CHECK(cudaMemcpy(ho.data(), out16, 16 * 4, cudaMemcpyDeviceToHost));
        printf("mma selftest (got / want):");
        for (int r = 0; r < 8; ++r) printf(" %.4g/%.4g", ho[r], ho[8 + r]);
        printf("\n");
        run_persistent(1, 1);  // o alone, against the reference's o
        CHECK(cudaDeviceSynchronize());
        std::vector<float> got_o(H), want_o(H);
        CHECK(cudaMemcpy(got_o.data(), residual, H * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpy(attn, attn0, H * 2, cudaMemcpyDeviceToDevice));
        ref_phase<<<H / 8, 256>>>(0, host_layers[0], residual, attn, act, qkv, inverse_rms);
        CHECK(cudaMemcpy(want_o.data(), residual, H * 4, cudaMemcpyDeviceToHost));
        int nan_o = 0, first_nan = -1;
        double e_o = 0, n_o = 0;
        for (int i = 0; i < H; ++i) {
            if (!std::isfinite(got_o[i])) {
                if (first_nan < 0) first_nan = i;
                ++nan_o;
                continue;
            }
            e_o += (got_o[i] - want_o[i]) * (double)(got_o[i] - want_o[i]);
            n_o += (want_o[i] - 0.25) * (double)(want_o[i] - 0.25);
        }
        printf("o alone: non-finite %d (first %d), finite rows rel L2 %.2e; got[0..3] %.4g %.4g %.4g %.4g "
               "want %.4g %.4g\n",
               nan_o, first_nan, sqrt(e_o / n_o), got_o[0], got_o[1], got_o[2], got_o[3], want_o[0], want_o[1]);
        run_persistent(1);
        CHECK(cudaDeviceSynchronize());
        std::vector<unsigned short> got_act(I);
        std::vector<float> stat(PHASES);
        CHECK(cudaMemcpy(got_act.data(), act, I * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(stat.data(), sumsq, PHASES * 4, cudaMemcpyDeviceToHost));
        int bad = 0;
        double amax = 0;
        for (int i = 0; i < I; ++i) {
            const float v = bf(got_act[i]);
            if (!std::isfinite(v)) ++bad;
            else amax = fmax(amax, fabs(v));
        }
        printf("one layer: act non-finite %d, |act| max %.3e; counts %.3e %.3e %.3e %.3e; act[0..2] %.3e %.3e %.3e\n",
               bad, amax, stat[0], stat[1], stat[2], stat[3], bf(got_act[0]), bf(got_act[1]), bf(got_act[2]));
    }

    const double rate = read_rate(weights, layer_bytes * num_layers, sms, sink);
    float mean_ms = 0.0f;
    const float best_ms = best_of_5(
        [&] {
            CHECK(cudaMemcpy(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
            CHECK(cudaMemcpy(attn, attn0, H * 2, cudaMemcpyDeviceToDevice));
            CHECK(cudaMemset(counter, 0, 4));
            CHECK(cudaMemset(y_acc, 0, H * 4));
            CHECK(cudaMemset(sumsq, 0, sizeof(float) * PHASES * num_layers));
        },
        [&] {
            Params params{layers, num_layers, residual, attn, act, qkv, counter, stats, sumsq, chain, attn_out,
                          0, y_acc};
            persistent_layers<<<sms, THREADS, smem>>>(params);
        },
        &mean_ms);
    const double per_layer = best_ms * 1e3 / num_layers, at_rate = layer_bytes / rate * 1e6;
    printf("%d layers, %.1f MB a layer; read rate %.3f TB/s (%d SMs, %d stages of %d KB, %s)\n", num_layers,
           layer_bytes / 1e6, rate / 1e12, sms, STAGES, STAGE_BYTES / 1024, MMA ? "mma" : "fma.f16x2");
    printf("persistent: %.2f us a layer (best of 5; mean %.2f), bytes at the read rate %.2f us: %.1f%%\n", per_layer,
           mean_ms * 1e3 / num_layers, at_rate, 100.0 * at_rate / per_layer);
    print_stats(stats, sms, num_layers);
    return 0;
}

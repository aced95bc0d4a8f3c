// Probe: the routed experts of a Qwen3-30B-A3B layer at one token (8 of 128 experts, bf16), as ONE
// persistent kernel whose weight stream crosses the gate_up -> down boundary, against the bytes at
// the read rate measured in the same process. Not part of Atlas; it asks whether the experts'
// 28.9 us a layer in the model (moe_gate_up 17.9 + moe_down 11.0 for 75.5 MB, H200,
// docs/lab/moe-decode.md) can come near the bytes' ~18 us (issue 30's 70% needs ~7.7 us a layer).
//
//   phase G:  act[j][f] = silu(Wg_j[f] . x) * (Wu_j[f] . x),  x = rms(residual)   gate_up_j [2I, H]
//   phase D:  residual[r] += sum_j w_j (Wd_j[r] . act[j])                           down_j    [H, I]
//
// One block an SM: a producer thread streams the block's share of every phase's rows through a
// ring of shared-memory stages (cp.async.bulk, mbarrier full/empty), as
// persistent_layer_probe.cu's does. G's rows depend on the routing, which the model knows only
// after the layer's attention, so the producer waits for each layer's start (the grid barrier
// after the previous layer's D); D's rows it streams while G still runs (-DROUTE_WAITS_D=1 makes
// it wait for G's end too: the boundary of a kernel chain). Block b owns D's rows [r0, r1) for
// all 8 experts, so the weighted sum over experts (the combine) stays in the block: no atomics,
// the same sums every run.
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a -I kernels/common -o /tmp/moe_probe benchmarks/cuda/moe_layer_probe.cu
//   /tmp/moe_probe [layers]

#include <cmath>
#include <vector>

#include "atlas_common.cuh"
#include "probe_common.cuh"
#include "tma.cuh"

constexpr int H = 2048, I = 768, TOPK = 8;
constexpr int CONSUMER_WARPS = 8, CONSUMERS = CONSUMER_WARPS * 32, THREADS = CONSUMERS + 32;
#ifndef RING_STAGES  // 3: the fastest of 2..6 on an H200 (docs/lab/moe-decode.md)
#define RING_STAGES 3
#endif
#ifndef ROUTE_WAITS_D  // 1: the producer waits for G's end before D's rows too
#define ROUTE_WAITS_D 0
#endif
#ifndef NO_COMPUTE  // 1: consumers take each stage and multiply nothing
#define NO_COMPUTE 0
#endif
constexpr int STAGES = RING_STAGES, STAGE_BYTES = 32 * 1024;
constexpr int G_FEATURES = 4;   // a G stage: 4 features' gate rows, then their up rows (8 rows of 4 KB)
constexpr int D_ROWS = 16;      // a D stage: at most 16 rows of one expert's down (24 KB)
constexpr int G_GROUPS = TOPK * I / G_FEATURES;  // 1536
constexpr int CHUNKS_G = H / 8, CHUNKS_D = I / 8;  // 16-byte chunks of a row: 256, 96
static_assert(CHUNKS_G == CONSUMERS && CHUNKS_D == 96, "a G row is a chunk a consumer; a D row 3 a lane");
static_assert(I % G_FEATURES == 0, "a G stage stays within one expert");

struct Layer {
    const bf16* gate_up[TOPK];  // the routed experts' [2I, H]
    const bf16* down[TOPK];     // [H, I]
    float weight[TOPK];         // the routing weights
};

struct Params {
    const Layer* layers;
    int num_layers;
    float* residual;    // [H]
    bf16* act;          // [TOPK][I]
    float* sumsq;       // [layers + 1]: the residual's sum of squares before each layer (0: set by the host)
    unsigned* counter;  // zero before the launch
    unsigned long long* stats;  // [blocks][4] ns: starved, grid barrier, phase ends; producer blocked
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

// A block's groups of G (features of the flattened [TOPK][I]) and rows of D.
__device__ __forceinline__ void g_range(int b, int blocks, int& first, int& last) {
    first = (int)((long long)G_GROUPS * b / blocks) * G_FEATURES;
    last = (int)((long long)G_GROUPS * (b + 1) / blocks) * G_FEATURES;
}
__device__ __forceinline__ void d_range(int b, int blocks, int& first, int& last) {
    first = (int)((long long)H * b / blocks);
    last = (int)((long long)H * (b + 1) / blocks);
}

constexpr int MAX_G = 64;  // a block's G features (46.5 on 132 SMs)
constexpr int MAX_D = 32;  // a block's D rows (15.5)

extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_layers(Params params) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    u64* full = reinterpret_cast<u64*>(smem + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;
    __shared__ float partial[CONSUMER_WARPS][2 * MAX_G];  // G: each warp's gate (then up) row sums
    __shared__ float d_sums[MAX_D];                        // D: the block's rows, summed over experts
    __shared__ bf16 act_s[TOPK * I];                       // D: every expert's act
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.x, blocks = gridDim.x;
    init_ring(full, empty, STAGES, CONSUMER_WARPS);
    int g_first, g_last, d_first, d_last;
    g_range(b, blocks, g_first, g_last);
    d_range(b, blocks, d_first, d_last);

    if (warp == CONSUMER_WARPS) {  // the producer
        if (lane != 0) return;
        const u64 policy = l2_evict_first();
        unsigned it = 0;
        unsigned long long blocked = 0;
        auto next_slot = [&]() {
            const int slot = it % STAGES;
            const unsigned long long t0 = now_ns();
            mbarrier_wait(empty + slot, ((it / STAGES) & 1) ^ 1);
            blocked += now_ns() - t0;
            ++it;
            return slot;
        };
        for (int l = 0; l < params.num_layers; ++l) {
            const Layer& layer = params.layers[l];
            // G's rows follow the routing: known once the previous layer's D has ended
            while (ring_load_acquire(params.counter) < (unsigned)(2 * l) * blocks) __nanosleep(20);
            for (int f = g_first; f < g_last; f += G_FEATURES) {
                const int slot = next_slot(), j = f / I, feature = f % I;
                unsigned char* dst = ring + slot * STAGE_BYTES;
                const u32 bytes = G_FEATURES * H * 2;
                mbarrier_arrive_expect_tx(full + slot, 2 * bytes);
                ring_copy(dst, layer.gate_up[j] + (long long)feature * H, bytes, full + slot, policy);
                ring_copy(dst + bytes, layer.gate_up[j] + (long long)(I + feature) * H, bytes, full + slot, policy);
            }
            if (ROUTE_WAITS_D)
                while (ring_load_acquire(params.counter) < (unsigned)(2 * l + 1) * blocks) __nanosleep(20);
            for (int j = 0; j < TOPK; ++j)
                for (int r = d_first; r < d_last; r += D_ROWS) {
                    const int slot = next_slot(), n = min(D_ROWS, d_last - r);
                    const u32 bytes = (u32)n * I * 2;
                    mbarrier_arrive_expect_tx(full + slot, bytes);
                    ring_copy(ring + slot * STAGE_BYTES, layer.down[j] + (long long)r * I, bytes, full + slot, policy);
                }
        }
        params.stats[b * 4 + 3] = blocked;
        return;
    }

    // consumers
    const int t = threadIdx.x;
    unsigned it = 0;
    unsigned long long starved = 0, at_barrier = 0, ends = 0;
    auto wait_counter = [&](unsigned target) {
        if (t == 0) {
            const unsigned long long t0 = now_ns();
            while (ring_load_acquire(params.counter) < target) __nanosleep(20);
            __threadfence();
            at_barrier += now_ns() - t0;
        }
        consumers_sync();
    };
    auto take_stage = [&]() {
        const int slot = it % STAGES;
        const unsigned long long t0 = now_ns();
        mbarrier_wait(full + slot, (it / STAGES) & 1);
        if (t == 0) starved += now_ns() - t0;
        ++it;
        return slot;
    };
    auto release = [&](int slot) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty + slot);
    };
    auto count_in = [&](unsigned long long t0) {
        consumers_sync();
        if (t == 0) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(params.counter) : "memory");
            ends += now_ns() - t0;
        }
    };
    for (int l = 0; l < params.num_layers; ++l) {
        const Layer& layer = params.layers[l];
        // ---- G: x = rms(residual), thread t's chunk t of every row
        wait_counter((unsigned)(2 * l) * blocks);
        float x[8];
        {
            const float inverse_rms = rsqrtf(__ldcg(params.sumsq + l) / H + 1e-6f);
            const float4* r = reinterpret_cast<const float4*>(params.residual + t * 8);
            const float4 a = __ldcg(r), c = __ldcg(r + 1);
            x[0] = a.x * inverse_rms; x[1] = a.y * inverse_rms; x[2] = a.z * inverse_rms; x[3] = a.w * inverse_rms;
            x[4] = c.x * inverse_rms; x[5] = c.y * inverse_rms; x[6] = c.z * inverse_rms; x[7] = c.w * inverse_rms;
        }
        for (int f = g_first; f < g_last; f += G_FEATURES) {
            const int slot = take_stage();
            const unsigned char* stage = ring + slot * STAGE_BYTES;
            uint4 wv[2 * G_FEATURES];
#pragma unroll
            for (int r = 0; r < 2 * G_FEATURES; ++r)
                wv[r] = *reinterpret_cast<const uint4*>(stage + r * H * 2 + t * 16);
            release(slot);
            float acc[8];
#pragma unroll
            for (int r = 0; r < 8; ++r) acc[r] = NO_COMPUTE ? 0.0f : ring_dot8(wv[r], x);
            const float total = reduce_scatter8(acc, lane);  // lane l: row (l >> 2) & 7
            const int row = (lane >> 2) & 7, local = f - g_first + (row % G_FEATURES);
            if ((lane & 3) == 0) partial[warp][local + (row >= G_FEATURES ? MAX_G : 0)] = total;
        }
        unsigned long long t0 = now_ns();
        consumers_sync();
        for (int u = t; u < g_last - g_first; u += CONSUMERS) {
            float g = 0.0f, up = 0.0f;
#pragma unroll
            for (int w = 0; w < CONSUMER_WARPS; ++w) {
                g += partial[w][u];
                up += partial[w][MAX_G + u];
            }
            params.act[g_first + u] = __float2bfloat16_rn(silu(g) * up);
        }
        count_in(t0);
        // ---- D: every expert's act to shared memory, then each expert's rows of the block
        wait_counter((unsigned)(2 * l + 1) * blocks);
        for (int c = t; c < TOPK * I / 8; c += CONSUMERS)
            reinterpret_cast<uint4*>(act_s)[c] = __ldcg(reinterpret_cast<const uint4*>(params.act) + c);
        for (int r = t; r < MAX_D; r += CONSUMERS) d_sums[r] = 0.0f;
        consumers_sync();
        for (int j = 0; j < TOPK; ++j) {
            float a[3][8];  // this lane's chunks lane, lane + 32, lane + 64 of act_j
#pragma unroll
            for (int k = 0; k < 3; ++k)
                Vec8<bf16>{reinterpret_cast<const uint4*>(act_s + j * I)[lane + 32 * k]}.to_floats(a[k]);
            for (int r0 = d_first; r0 < d_last; r0 += D_ROWS) {
                const int slot = take_stage(), n = min(D_ROWS, d_last - r0);
                const unsigned char* stage = ring + slot * STAGE_BYTES;
                uint4 wv[2][3];  // rows warp and warp + 8 of the stage
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int k = 0; k < 3; ++k)
                        if (warp + 8 * h < n) {
                            const unsigned char* chunk = stage + (warp + 8 * h) * I * 2 + (lane + 32 * k) * 16;
                            wv[h][k] = *reinterpret_cast<const uint4*>(chunk);
                        }
                release(slot);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = warp + 8 * h;
                    if (row >= n) continue;
                    float s = 0.0f;
                    if (!NO_COMPUTE)
#pragma unroll
                        for (int k = 0; k < 3; ++k) s += ring_dot8(wv[h][k], a[k]);
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (lane == 0) d_sums[r0 - d_first + row] += layer.weight[j] * s;  // a row is one warp's
                }
            }
        }
        t0 = now_ns();
        consumers_sync();
        float squares = 0.0f;
        for (int r = t; r < d_last - d_first; r += CONSUMERS) {
            const float value = params.residual[d_first + r] + d_sums[r];
            params.residual[d_first + r] = value;
            squares += value * value;
        }
        float v[1] = {squares};
        warp_sums<1>(v);
        if (lane == 0 && warp == 0) atomicAdd(params.sumsq + l + 1, v[0]);
        count_in(t0);
    }
    if (t == 0) {
        params.stats[b * 4] = starved;
        params.stats[b * 4 + 1] = at_barrier;
        params.stats[b * 4 + 2] = ends;
    }
}

// ---------------------------------------------------------------------------------------------
// Reference: one warp a row, f32.
__global__ void ref_gate_up(Layer layer, const float* residual, float sum_squares, bf16* act) {
    const int u = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (u >= TOPK * I) return;
    const int j = u / I, f = u % I;
    const float inverse_rms = rsqrtf(sum_squares / H + 1e-6f);
    float g = 0.0f, up = 0.0f;
    for (int k = lane; k < H; k += 32) {
        const float x = residual[k] * inverse_rms;
        g += __bfloat162float(layer.gate_up[j][(long long)f * H + k]) * x;
        up += __bfloat162float(layer.gate_up[j][(long long)(I + f) * H + k]) * x;
    }
    for (int o = 16; o > 0; o >>= 1) {
        g += __shfl_xor_sync(0xffffffffu, g, o);
        up += __shfl_xor_sync(0xffffffffu, up, o);
    }
    if (lane == 0) act[u] = __float2bfloat16_rn(silu(g) * up);
}

__global__ void ref_down(Layer layer, const bf16* act, float* residual) {
    const int r = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= H) return;
    float total = 0.0f;
    for (int j = 0; j < TOPK; ++j) {
        float s = 0.0f;
        for (int k = lane; k < I; k += 32)
            s += __bfloat162float(layer.down[j][(long long)r * I + k]) * __bfloat162float(act[j * I + k]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        total += layer.weight[j] * s;
    }
    if (lane == 0) residual[r] += total;
}

int main(int argc, char** argv) {
    const int num_layers = argc > 1 ? atoi(argv[1]) : 16;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long gu_elems = 2LL * I * H, d_elems = (long long)H * I;
    const long long layer_bytes = TOPK * (gu_elems + d_elems) * 2;
    bf16* weights;
    CHECK(cudaMalloc(&weights, layer_bytes * num_layers));
    fill_bf16<<<4096, 256>>>(weights, (int)(layer_bytes * num_layers / 2), 99u);
    std::vector<Layer> host_layers(num_layers);
    for (int l = 0; l < num_layers; ++l) {
        bf16* base = weights + layer_bytes / 2 * l;
        for (int j = 0; j < TOPK; ++j) {
            host_layers[l].gate_up[j] = base + j * (gu_elems + d_elems);
            host_layers[l].down[j] = base + j * (gu_elems + d_elems) + gu_elems;
            host_layers[l].weight[j] = 0.05f + 0.02f * j;
        }
    }
    Layer* layers;
    CHECK(cudaMalloc(&layers, sizeof(Layer) * num_layers));
    CHECK(cudaMemcpy(layers, host_layers.data(), sizeof(Layer) * num_layers, cudaMemcpyHostToDevice));
    float *residual, *residual0, *sumsq;
    bf16* act;
    unsigned *counter, *sink;
    unsigned long long* stats;
    CHECK(cudaMalloc(&residual, H * 4));
    CHECK(cudaMalloc(&residual0, H * 4));
    CHECK(cudaMalloc(&sumsq, 4 * (num_layers + 1)));
    CHECK(cudaMalloc(&act, TOPK * I * 2));
    CHECK(cudaMalloc(&counter, 4));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&stats, 8 * 4 * 1024));
    std::vector<float> host_residual(H);
    double sum_squares0 = 0;
    for (int i = 0; i < H; ++i) {
        host_residual[i] = 0.5f + 0.25f * std::sin(0.01f * i);
        sum_squares0 += host_residual[i] * (double)host_residual[i];
    }
    CHECK(cudaMemcpy(residual0, host_residual.data(), H * 4, cudaMemcpyHostToDevice));
    const int smem = STAGES * STAGE_BYTES + 2 * STAGES * 8;
    CHECK(cudaFuncSetAttribute(moe_layers, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto reset = [&]() {
        CHECK(cudaMemcpy(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemset(sumsq, 0, 4 * (num_layers + 1)));
        const float s0 = (float)sum_squares0;
        CHECK(cudaMemcpy(sumsq, &s0, 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemset(counter, 0, 4));
    };

    // check two layers against the reference
    const int check_layers = num_layers < 2 ? num_layers : 2;
    reset();
    moe_layers<<<sms, THREADS, smem>>>(Params{layers, check_layers, residual, act, sumsq, counter, stats});
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got(H), want(H);
    CHECK(cudaMemcpy(got.data(), residual, H * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(residual, residual0, H * 4, cudaMemcpyDeviceToDevice));
    for (int l = 0; l < check_layers; ++l) {
        CHECK(cudaMemcpy(want.data(), residual, H * 4, cudaMemcpyDeviceToHost));
        double s = 0;
        for (int i = 0; i < H; ++i) s += want[i] * (double)want[i];
        ref_gate_up<<<TOPK * I / 8, 256>>>(host_layers[l], residual, (float)s, act);
        ref_down<<<H / 8, 256>>>(host_layers[l], act, residual);
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(want.data(), residual, H * 4, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (int i = 0; i < H; ++i) {
        err += (got[i] - want[i]) * (double)(got[i] - want[i]);
        norm += (want[i] - host_residual[i]) * (double)(want[i] - host_residual[i]);
    }
    printf("check over %d layers: residual delta rel L2 %.2e (rms delta %.3e)\n", check_layers, sqrt(err / norm),
           sqrt(norm / H));

    const double rate = read_rate(weights, layer_bytes * num_layers, sms, sink);
    float mean_ms = 0.0f;
    const float best_ms = best_of_5(
        reset,
        [&] { moe_layers<<<sms, THREADS, smem>>>(Params{layers, num_layers, residual, act, sumsq, counter, stats}); },
        &mean_ms);
    const double per_layer = best_ms * 1e3 / num_layers, at_rate = layer_bytes / rate * 1e6;
    printf("%d layers, %.1f MB a layer; read rate %.3f TB/s (%d SMs, %d stages)\n", num_layers, layer_bytes / 1e6,
           rate / 1e12, sms, STAGES);
    printf("experts: %.2f us a layer (best of 5; mean %.2f), bytes at the read rate %.2f us: %.1f%%\n", per_layer,
           mean_ms * 1e3 / num_layers, at_rate, 100.0 * at_rate / per_layer);
    print_stats(stats, sms, num_layers);

    // The same layers as one launch each, replayed from a CUDA graph (as the model would run them:
    // the ring starts empty at every layer, and each launch pays its start and end).
    unsigned* counters;
    CHECK(cudaMalloc(&counters, 4 * num_layers));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < num_layers; ++l)
        moe_layers<<<sms, THREADS, smem, stream>>>(
            Params{layers + l, 1, residual, act, sumsq + l, counters + l, stats});
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const float launch_ms = best_of_5(
        [&] {
            reset();
            CHECK(cudaMemset(counters, 0, 4 * num_layers));
        },
        [&] { CHECK(cudaGraphLaunch(exec, 0)); }, &mean_ms);
    printf("a launch a layer (graph): %.2f us a layer (best of 5; mean %.2f): %.1f%% of the read rate\n",
           launch_ms * 1e3 / num_layers, mean_ms * 1e3 / num_layers, 100.0 * at_rate / (launch_ms * 1e3 / num_layers));
    return 0;
}

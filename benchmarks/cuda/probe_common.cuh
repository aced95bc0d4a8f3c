// Helpers the standalone probes in benchmarks/cuda share (persistent_layer_probe.cu,
// moe_layer_probe.cu), beside kernels/common/ring.cuh's (bulk copies, acquire loads, the
// reduce-scatter): the global timer, the ring's barriers, warp sums, fills, a plain read of a
// buffer for the read rate, best-of-5 timing, the stats print, CHECK.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "atlas_common.cuh"
#include "ring.cuh"
#include "tma.cuh"

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
    return t;
}

// The ring's barriers: a stage is full once its bytes land (one arrival, the producer's expect_tx),
// empty once every consumer warp has arrived. Every thread of the block calls it.
__device__ __forceinline__ void init_ring(u64* full, u64* empty, int stages, int consumer_warps) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbarrier_init(full + s, 1);
            mbarrier_init(empty + s, consumer_warps);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
}


// 16 floats from global memory through L2 (another block may have just written them).
__device__ __forceinline__ void load16_cg(const float* src, float* v) {
    const float4* r = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 f = __ldcg(r + i);
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
    }
}

template <int N>
__device__ __forceinline__ void warp_sums(float* v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < N; ++r) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__global__ void fill_floats(float* p, int n, float value) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = value;
}

__global__ void fill_bf16(bf16* p, int n, unsigned seed) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 16;
        p[i] = __float2bfloat16_rn(((int)(h % 2001) - 1000) / 1000.0f);  // within [-1, 1]
    }
}

__global__ void read_all(const uint4* p, long long n, unsigned* sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = load_streaming(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

#define CHECK(call)                                                                                  \
    do {                                                                                             \
        cudaError_t e = (call);                                                                      \
        if (e != cudaSuccess) {                                                                      \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e));             \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

// The best of five timed runs of `launch` after a warm-up, each after `prepare` (untimed), in ms;
// their mean into `mean` where given.
template <typename Prepare, typename Launch>
float best_of_5(Prepare prepare, Launch launch, float* mean = nullptr) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    float best = 1e30f, sum = 0.0f, ms = 0.0f;
    for (int rep = 0; rep < 6; ++rep) {
        prepare();
        CHECK(cudaEventRecord(start));
        launch();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (rep > 0) {
            sum += ms;
            best = ms < best ? ms : best;
        }
    }
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    if (mean) *mean = sum / 5;
    return best;
}

// A plain read of `bytes` at p (a multiple of 16), best of five, in bytes a second.
inline double read_rate(const void* p, long long bytes, int sms, unsigned* sink) {
    const uint4* words = static_cast<const uint4*>(p);
    const float ms = best_of_5([] {}, [&] { read_all<<<sms * 8, 512>>>(words, bytes / 16, sink); });
    return bytes / (ms * 1e-3);
}

// The probes' [blocks][4] ns counters (consumers starved, at the grid barrier, phase ends; the
// producer blocked), as means over blocks a layer.
inline void print_stats(const unsigned long long* device_stats, int sms, int layers) {
    unsigned long long* host = static_cast<unsigned long long*>(malloc(8 * 4 * sms));
    CHECK(cudaMemcpy(host, device_stats, 8 * 4 * sms, cudaMemcpyDeviceToHost));
    double mean[4] = {0, 0, 0, 0};
    for (int i = 0; i < sms; ++i)
        for (int j = 0; j < 4; ++j) mean[j] += host[i * 4 + j] / 1e3 / sms / layers;
    free(host);
    printf("us a layer, mean over blocks (last run): consumers starved %.2f, at the grid barrier %.2f, phase ends "
           "%.2f; producer blocked on a full ring %.2f\n", mean[0], mean[1], mean[2], mean[3]);
}

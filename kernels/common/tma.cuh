// Hopper (sm_90) asynchronous copies: the tensor memory accelerator (TMA) and the shared-memory
// barriers (mbarrier) that count its bytes in.
//
// A TMA copy moves one box of a tensor (described by a 128-byte tensor map the host encodes with
// cuTensorMapEncodeTiled, atlas/adapters/cuda/tma.py) from global to shared memory without any
// thread touching the bytes; parts of the box outside the tensor arrive as zeros. Its completion
// is reported to an mbarrier as a byte count: a thread first arms the barrier with
// `mbarrier_arrive_expect_tx(bar, bytes)`, the copies complete_tx those bytes, and the phase
// completes once every expected arrival and byte is in. Waiters poll a phase by its parity.
//
// Only inline functions: modules built for other archs include this and never call them.
#pragma once

#include "atlas_common.cuh"

// A CUtensorMap as a kernel parameter (`const __grid_constant__ TmaMap`): 128 opaque bytes.
struct alignas(64) TmaMap {
    u64 bits[16];
};

__device__ __forceinline__ void mbarrier_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// Makes initialised barriers visible to the async proxy (TMA) and the other threads; a block
// barrier must follow before anyone uses them.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
                 : "memory");
}

// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_address(bar)),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Box at (c0 along the contiguous dim, c1) of a 2-D map into `dst` (aligned as the map's swizzle
// needs: 1024 bytes for 128-byte swizzle); its bytes complete_tx on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(smem_address(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(smem_address(bar))
        : "memory");
}

// The same with an L2 eviction policy (`l2_evict_first()`: data read once, such as weights).
__device__ __forceinline__ void tma_load_2d_hint(void* dst, const TmaMap* map, int c0, int c1, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%2, %3}], [%4], %5;\n" ::"r"(smem_address(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(smem_address(bar)), "l"(policy)
        : "memory");
}

// Thread-block clusters: the block's rank in its cluster, the cluster-wide barrier (every thread
// of every block arrives; release/acquire order shared-memory writes before remote reads), and
// reads of another block's shared memory (distributed shared memory).
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of `local` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ u32 cluster_address(const void* local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address(local)), "r"(rank));
    return remote;
}

__device__ __forceinline__ float load_cluster_float(u32 address) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(address) : "memory");
    return v;
}

// Blocks in this block's cluster (1 for a launch without clusters).
__device__ __forceinline__ u32 cluster_blocks() {
    u32 blocks;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(blocks));
    return blocks;
}

__device__ __forceinline__ float4 load_cluster_float4(u32 address) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(address)
                 : "memory");
    return v;
}

__device__ __forceinline__ u32 dynamic_shared_bytes() {
    u32 bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
    return bytes;
}


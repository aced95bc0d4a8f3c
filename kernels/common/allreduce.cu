// All-reduce of small messages across the GPUs of one host over peer-to-peer memory (NVLink):
// the two all-reduces per layer of tensor-parallel decode, a few KB to a few hundred KB each,
// where NCCL's protocol and launch latency dominate the bytes (atlas/adapters/cuda/
// custom_allreduce.py picks these kernels or NCCL by size).
//
// out[i] = sum over ranks r = 0, 1, ..., N-1 of in_r[i], accumulated in f32 in that order and
// rounded once to the element type: the reference sum of atlas/ports/comm.py, bit for bit, and
// the same bits on every rank. `in` may be `out` (in place). bf16 or f32; N = 2, 4 or 8.
//
// Every rank owns one region that every other rank has mapped (CUDA IPC), laid out as
//
//     [ AllreduceSignals (ALLREDUCE_SIGNAL_BYTES) | slot 0 (slot_bytes) | slot 1 (slot_bytes)
//       | lines 0 (line_slot_bytes) | lines 1 (line_slot_bytes) ]   (the lines: allreduce_ll below)
//
//     arrive[b][p], reduced[b][p]   written by rank p's block b (st.release.sys over NVLink):
//                                   the call number it has reached in each barrier
//     epoch[b]                      this rank's call count, one copy per block index, all equal
//
// `regions[p]` is rank p's region as mapped in this process (regions[rank] our own). Call
// number e = 1, 2, ... uses slot e % 2 of every region, so a rank may fill its slot for call
// e+1 while a slower peer still reads call e's: the same slot is written again only by call
// e+2, which no rank starts before every rank has arrived at call e+1 (finished call e). The
// counters live in device memory and every launch advances them, so a captured graph replays
// with no host work. Every rank must make the same sequence of calls with the same sizes.
//
// Work split: the message is `units` 16-byte units (8 bf16 or 4 f32); block b, thread t handles
// the unit offsets k = b * blockDim + t + j * gridDim * blockDim. Each barrier is per block:
// block b waits only for block b of every peer, which is enough because block b of every rank
// writes and reads exactly the same offsets (same grid on every rank).
//
// allreduce_one_shot_<T>_w<N>: copy our share of `in` into our slot; barrier (arrive); read the
//     same share from every peer's slot and sum. Bytes per rank: (N-1) S read over NVLink, 2 S
//     written and S read locally. Bound: two barrier latencies (~1-2 us on NVLink) below a few
//     tens of KB, then the NVLink read bandwidth of (N-1) S.
// allreduce_two_shot_<T>_w<N>: copy `in` into our slot; barrier (arrive); reduce chunk `rank`
//     (units/N, rounded up) from every peer's slot into our slot; barrier (reduced); gather every
//     chunk q from rank q's slot. Bytes per rank over NVLink: 2 (N-1)/N S. Bound: NVLink
//     bandwidth at mid sizes, at the price of one more barrier.
//
// allreduce_ll_<T>_w<N>: push, no barrier (NCCL's "LL" protocol). Every 16-byte unit goes to
//     each peer as two 16-byte lines {w0, flag, w1, flag} {w2, flag, w3, flag}: each 8-byte half
//     carries 4 bytes of data beside the call's flag and lands in one piece, so a reader that
//     sees the flag in both halves of both lines holds the data, with no fence and no flag
//     word of its own. Each rank then polls the lines its peers pushed into its own region (an
//     L2 hit until they land) and sums. A call costs one NVLink crossing, where one_shot pays a
//     fence, a barrier's crossing, and the read of every peer's slot over NVLink afterwards.
//     Twice the bytes on the wire, so it wins only for small messages. The lines live in their
//     own two slots after the plain ones ([ signals | slot 0 | slot 1 | lines 0 | lines 1 ]),
//     rank p's lines at [p * units * 2, ...) of slot `number % 2`; the reader zeroes what it
//     consumed, so a later call never takes a stale line for its own (the flag is the call
//     number mod 2^32 - 1, plus 1: never zero, and a line's content is either zero or the
//     current call's once the writer of call e + 2 may write it, which as above it does only
//     after every rank has finished call e).
//
// A peer that never arrives (it died) would leave a block spinning for ever: a barrier that
// waits longer than `timeout_ns` traps instead, which fails this rank's context, so the rank's
// process reports an error rather than hanging.
#include "atlas_common.cuh"

#define ALLREDUCE_MAX_BLOCKS 64
#define ALLREDUCE_MAX_WORLD 8
#define ALLREDUCE_SIGNAL_BYTES 16384
#define ALLREDUCE_THREADS 512

struct AllreduceSignals {
    u64 arrive[ALLREDUCE_MAX_BLOCKS][ALLREDUCE_MAX_WORLD];
    u64 reduced[ALLREDUCE_MAX_BLOCKS][ALLREDUCE_MAX_WORLD];
    u64 epoch[ALLREDUCE_MAX_BLOCKS];
};
static_assert(sizeof(AllreduceSignals) <= ALLREDUCE_SIGNAL_BYTES, "signals outgrow their bytes");

// Byte offsets of the two barriers' flags in AllreduceSignals.
#define ALLREDUCE_ARRIVE 0
#define ALLREDUCE_REDUCED (ALLREDUCE_MAX_BLOCKS * ALLREDUCE_MAX_WORLD * 8)

// ---------------------------------------------------------------------------------------------
// Memory-model primitives. A barrier is: __syncthreads() (the block's writes happen before
// what its signalling threads do next), a system-scope release store into each peer's flag, an
// acquire spin on our own flags, and __syncthreads() again (what every peer released is now
// visible to every thread of the block). Peer data is read with ld.global.cg (L2, never a
// stale L1 line of a slot used two calls ago).
__device__ __forceinline__ void store_release_system(u64* flag, u64 value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ u64 load_acquire_system(const u64* flag) {
    u64 value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(value) : "l"(flag) : "memory");
    return value;
}

__device__ __forceinline__ u64 global_timer_ns() {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
    return now;
}

__device__ __forceinline__ uint4 load_l2(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// 16 bytes of T as floats and back (round to nearest even for bf16).
template <typename T> struct Unit;

template <> struct Unit<bf16> {
    static constexpr int count = 8;
    __device__ __forceinline__ static void to_floats(uint4 raw, float* out) {
        const bf16x2* pairs = reinterpret_cast<const bf16x2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __bfloat1622float2(pairs[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ static uint4 from_floats(const float* in) {
        uint4 raw;
        bf16x2* pairs = reinterpret_cast<bf16x2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
        return raw;
    }
};

template <> struct Unit<float> {
    static constexpr int count = 4;
    __device__ __forceinline__ static void to_floats(uint4 raw, float* out) {
        out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
        out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
    }
    __device__ __forceinline__ static uint4 from_floats(const float* in) {
        return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                          __float_as_uint(in[3]));
    }
};

// Block b of this rank tells block b of every peer it has reached call `epoch` of the barrier
// whose flags sit at `field` (the offset of arrive or reduced in AllreduceSignals), then waits
// until every peer's block b has said the same (>=: a peer may already be one call ahead).
template <int N>
__device__ __forceinline__ void barrier(const u64* regions, int rank, u64 field, u64 epoch, long long timeout_ns) {
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < N && peer != rank) {
        const u64 flag = field + (u64)(blockIdx.x * ALLREDUCE_MAX_WORLD) * sizeof(u64);
        store_release_system(reinterpret_cast<u64*>(regions[peer] + flag) + rank, epoch);
        const u64* mine = reinterpret_cast<const u64*>(regions[rank] + flag) + peer;
        const u64 started = global_timer_ns();
        while (load_acquire_system(mine) < epoch) {
            if (global_timer_ns() - started > (u64)timeout_ns) __trap();  // peer `peer` is gone
        }
    }
    __syncthreads();
}

// This call's number (1 for the first) and the address of slot `number % 2` of region `base`.
__device__ __forceinline__ u64 call_number(const u64* regions, int rank) {
    __shared__ u64 number;
    if (threadIdx.x == 0) {
        const AllreduceSignals* own = reinterpret_cast<const AllreduceSignals*>(regions[rank]);
        number = own->epoch[blockIdx.x] + 1;
    }
    __syncthreads();
    return number;
}

__device__ __forceinline__ uint4* slot_of(u64 base, u64 number, long long slot_bytes) {
    return reinterpret_cast<uint4*>(base + ALLREDUCE_SIGNAL_BYTES + (number & 1) * (u64)slot_bytes);
}

// Every block index's counter ends at `number` (blocks of this grid write their residues), so
// the next call, whatever its grid, reads the same count in every block.
__device__ __forceinline__ void finish_call(const u64* regions, int rank, u64 number) {
    if (threadIdx.x == 0) {
        AllreduceSignals* own = reinterpret_cast<AllreduceSignals*>(regions[rank]);
        for (int b = blockIdx.x; b < ALLREDUCE_MAX_BLOCKS; b += gridDim.x) own->epoch[b] = number;
    }
}

// The rank-order f32 sum of unit k over every rank: our own from `in`, peers' from their slots.
template <typename T, int N>
__device__ __forceinline__ uint4 sum_unit(const uint4* in, const u64* regions, int rank, u64 number,
                                          long long slot_bytes, long long k) {
    constexpr int C = Unit<T>::count;
    float total[C];
    float part[C];
#pragma unroll
    for (int p = 0; p < N; ++p) {
        const uint4 raw = p == rank ? in[k] : load_l2(slot_of(regions[p], number, slot_bytes) + k);
        Unit<T>::to_floats(raw, p == 0 ? total : part);
        if (p > 0) {
#pragma unroll
            for (int i = 0; i < C; ++i) total[i] += part[i];
        }
    }
    return Unit<T>::from_floats(total);
}

template <typename T, int N>
__device__ __forceinline__ void one_shot(const uint4* in, uint4* out, const u64* regions, int rank, long long units,
                                         long long slot_bytes, long long timeout_ns) {
    const u64 number = call_number(regions, rank);
    uint4* own = slot_of(regions[rank], number, slot_bytes);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = first; k < units; k += stride) own[k] = in[k];
    barrier<N>(regions, rank, ALLREDUCE_ARRIVE, number, timeout_ns);
    for (long long k = first; k < units; k += stride) out[k] = sum_unit<T, N>(in, regions, rank, number, slot_bytes, k);
    finish_call(regions, rank, number);
}

template <typename T, int N>
__device__ __forceinline__ void two_shot(const uint4* in, uint4* out, const u64* regions, int rank, long long units,
                                         long long slot_bytes, long long timeout_ns) {
    const u64 number = call_number(regions, rank);
    uint4* own = slot_of(regions[rank], number, slot_bytes);
    const long long chunk = (units + N - 1) / N;  // chunk q = units [q * chunk, min((q + 1) * chunk, units))
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = first; k < chunk; k += stride) {
#pragma unroll
        for (int q = 0; q < N; ++q) {
            const long long i = q * chunk + k;
            if (i < units) own[i] = in[i];
        }
    }
    barrier<N>(regions, rank, ALLREDUCE_ARRIVE, number, timeout_ns);
    for (long long k = first; k < chunk; k += stride) {
        const long long i = rank * chunk + k;
        if (i < units) own[i] = sum_unit<T, N>(in, regions, rank, number, slot_bytes, i);
    }
    barrier<N>(regions, rank, ALLREDUCE_REDUCED, number, timeout_ns);
    for (long long k = first; k < chunk; k += stride) {
#pragma unroll
        for (int q = 0; q < N; ++q) {
            const long long i = q * chunk + k;
            if (i < units) out[i] = load_l2(slot_of(regions[q], number, slot_bytes) + i);
        }
    }
    finish_call(regions, rank, number);
}

// One 16-byte line as a single access (st/ld.volatile: each 8-byte half is single-copy atomic,
// which the LL protocol needs; never cached in L1).
__device__ __forceinline__ void store_line(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 load_line(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ uint4* lines_of(u64 base, u64 number, long long slot_bytes, long long line_slot_bytes) {
    return reinterpret_cast<uint4*>(base + ALLREDUCE_SIGNAL_BYTES + 2 * (u64)slot_bytes +
                                    (number & 1) * (u64)line_slot_bytes);
}

template <typename T, int N>
__device__ __forceinline__ void ll(const uint4* in, uint4* out, const u64* regions, int rank, long long units,
                                   long long slot_bytes, long long line_slot_bytes, long long timeout_ns) {
    constexpr int C = Unit<T>::count;
    const u64 number = call_number(regions, rank);
    const unsigned flag = 1u + (unsigned)(number % 0xFFFFFFFFull);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = first; k < units; k += stride) {
        const uint4 raw = in[k];
        const uint4 low = make_uint4(raw.x, flag, raw.y, flag), high = make_uint4(raw.z, flag, raw.w, flag);
#pragma unroll
        for (int p = 0; p < N; ++p) {
            if (p == rank) continue;
            uint4* line = lines_of(regions[p], number, slot_bytes, line_slot_bytes) + 2 * (rank * units + k);
            store_line(line, low);
            store_line(line + 1, high);
        }
    }
    uint4* mine = lines_of(regions[rank], number, slot_bytes, line_slot_bytes);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (long long k = first; k < units; k += stride) {
        float total[C];
        float part[C];
#pragma unroll
        for (int p = 0; p < N; ++p) {
            uint4 raw;
            if (p == rank) {
                raw = in[k];
            } else {
                uint4* line = mine + 2 * (p * units + k);
                uint4 low = load_line(line), high = load_line(line + 1);
                if (low.y != flag || low.w != flag || high.y != flag || high.w != flag) {
                    const u64 started = global_timer_ns();
                    do {
                        if (global_timer_ns() - started > (u64)timeout_ns) __trap();  // peer `p` is gone
                        low = load_line(line);
                        high = load_line(line + 1);
                    } while (low.y != flag || low.w != flag || high.y != flag || high.w != flag);
                }
                store_line(line, zero);
                store_line(line + 1, zero);
                raw = make_uint4(low.x, low.z, high.x, high.z);
            }
            Unit<T>::to_floats(raw, p == 0 ? total : part);
            if (p > 0) {
#pragma unroll
                for (int i = 0; i < C; ++i) total[i] += part[i];
            }
        }
        out[k] = Unit<T>::from_floats(total);
    }
    finish_call(regions, rank, number);
}

#define ALLREDUCE_KERNELS(NAME, T, N)                                                                            \
    extern "C" __global__ void __launch_bounds__(ALLREDUCE_THREADS)                                              \
        allreduce_one_shot_##NAME##_w##N(const uint4* in, uint4* out, const u64* regions, int rank,               \
                                         long long units, long long slot_bytes, long long timeout_ns) {          \
        dependent_launch_entry();                                                                                \
        one_shot<T, N>(in, out, regions, rank, units, slot_bytes, timeout_ns);                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ALLREDUCE_THREADS)                                              \
        allreduce_two_shot_##NAME##_w##N(const uint4* in, uint4* out, const u64* regions, int rank,               \
                                         long long units, long long slot_bytes, long long timeout_ns) {          \
        dependent_launch_entry();                                                                                \
        two_shot<T, N>(in, out, regions, rank, units, slot_bytes, timeout_ns);                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ALLREDUCE_THREADS)                                              \
        allreduce_ll_##NAME##_w##N(const uint4* in, uint4* out, const u64* regions, int rank, long long units,     \
                                   long long slot_bytes, long long line_slot_bytes, long long timeout_ns) {      \
        dependent_launch_entry();                                                                                \
        ll<T, N>(in, out, regions, rank, units, slot_bytes, line_slot_bytes, timeout_ns);                        \
    }

ALLREDUCE_KERNELS(bf16, bf16, 2)
ALLREDUCE_KERNELS(bf16, bf16, 4)
ALLREDUCE_KERNELS(bf16, bf16, 8)
ALLREDUCE_KERNELS(f32, float, 2)
ALLREDUCE_KERNELS(f32, float, 4)
ALLREDUCE_KERNELS(f32, float, 8)

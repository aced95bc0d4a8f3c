// Row gathers (embedding lookup, gather_rows), gated activations (SwiGLU / GeGLU), 64-bit fill
// and KV page copies. All are pure data movement, bound by HBM bandwidth.
//
// gather_rows_*:  dst[r, :] = src[indices[r], :]       rows of `row_bytes`, any element type.
//                 An index outside [0, num_src_rows) writes a zero row (never reads out of bounds).
//                 Bytes: 2 * R * row_bytes + 4 R.  FLOPs: 0.
// act_mul_*:      out[n, i] = act(x[n, i]) * x[n, I + i]       x [N, 2I], out [N, I].
//                 Bytes: 3 * N * I * sizeof(T).  FLOPs: ~10 N I (one exp or tanh each).
// act_mul_rms_<act>_bf16_vec8:  act_mul of x [N, 2I] = h W^T scaled by each token's inverse RMS
//                 first: out[n, i] = act(s_n x[n, i]) * s_n x[n, I + i], s_n = 1 / sqrt(mean(h[n]^2) +
//                 eps), h [N, H] the projection's input, its norm weight folded into W. grid (chunks
//                 of I, N). Bytes: 3 N I * 2 + N H * 2 per chunk.
// add_into_bf16:  residual[i] = bf16(residual[i] + delta[i]), both bf16: the residual add after
//                 a GEMM.  Bytes: 6 n.
// scale_columns_bf16_<scale type>:  w[m, k] = bf16(w[m, k] * scale[k]), w [M, K] in place: an
//                 RMSNorm weight folded into the projection after it, once at load.  Bytes: 4 M K.
// fill_u64:       every 8-byte element of dst set to `pattern` (i64 tensors; narrower types use
//                 the driver's memset).  Bytes: 8 n.
// copy_kv_pages:  pages src[i] -> dst[i] of every (layer, K|V) plane of the paged cache.
//                 Bytes: 2 * C * 2 * num_layers * page_bytes.
#include "atlas_common.cuh"

// ---------------------------------------------------------------------------------------------
// One block per output row; the row is copied in units of U (uint4, u32 or unsigned char).
template <typename U>
__device__ __forceinline__ void gather_rows_impl(unsigned char* dst, const unsigned char* src, const int* indices,
                                                 int num_src_rows, long long row_bytes) {
    const int row = blockIdx.x;
    const int index = indices[row];
    const long long units = row_bytes / sizeof(U);
    U* out = reinterpret_cast<U*>(dst + row * row_bytes);
    if (index < 0 || index >= num_src_rows) {
        const U zero{};
        for (long long i = threadIdx.x; i < units; i += blockDim.x) out[i] = zero;
        return;
    }
    const U* in = reinterpret_cast<const U*>(src + index * row_bytes);
    for (long long i = threadIdx.x; i < units; i += blockDim.x) out[i] = in[i];
}

extern "C" __global__ void gather_rows_v16(unsigned char* dst, const unsigned char* src, const int* indices,
                                           int num_src_rows, long long row_bytes) {
    dependent_launch_entry();
    gather_rows_impl<uint4>(dst, src, indices, num_src_rows, row_bytes);
}

extern "C" __global__ void gather_rows_v4(unsigned char* dst, const unsigned char* src, const int* indices,
                                          int num_src_rows, long long row_bytes) {
    dependent_launch_entry();
    gather_rows_impl<u32>(dst, src, indices, num_src_rows, row_bytes);
}

extern "C" __global__ void gather_rows_v1(unsigned char* dst, const unsigned char* src, const int* indices,
                                          int num_src_rows, long long row_bytes) {
    dependent_launch_entry();
    gather_rows_impl<unsigned char>(dst, src, indices, num_src_rows, row_bytes);
}

// ---------------------------------------------------------------------------------------------
// Eight elements per thread: needs I % 8 == 0 (checked on the host).
template <typename T, typename Act>
__device__ __forceinline__ void act_mul_vec8(const T* x, T* out, int num_tokens, int inner) {
    const long long chunks_per_row = inner / 8;
    const long long num_chunks = num_tokens * chunks_per_row;
    const Act act;
    for (long long chunk = blockIdx.x * (long long)blockDim.x + threadIdx.x; chunk < num_chunks;
         chunk += (long long)gridDim.x * blockDim.x) {
        const long long row = chunk / chunks_per_row;
        const long long col = (chunk - row * chunks_per_row) * 8;
        float gate[8], up[8], result[8];
        load8(x + row * 2 * inner + col, gate);
        load8(x + row * 2 * inner + inner + col, up);
#pragma unroll
        for (int i = 0; i < 8; ++i) result[i] = act(gate[i]) * up[i];
        store8(out + row * inner + col, result);
    }
}

template <typename T, typename Act>
__device__ __forceinline__ void act_mul_scalar(const T* x, T* out, int num_tokens, int inner) {
    const long long total = (long long)num_tokens * inner;
    const Act act;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / inner, col = i - row * inner;
        const float gate = to_float(x[row * 2 * inner + col]);
        const float up = to_float(x[row * 2 * inner + inner + col]);
        out[i] = from_float<T>(act(gate) * up);
    }
}

#define DEFINE_ACT_MUL(NAME, T, ACT)                                                                     \
    extern "C" __global__ void act_mul_##NAME##_vec8(const T* x, T* out, int num_tokens, int inner) {    \
        dependent_launch_entry();                                                                        \
        act_mul_vec8<T, ACT>(x, out, num_tokens, inner);                                                 \
    }                                                                                                    \
    extern "C" __global__ void act_mul_##NAME##_scalar(const T* x, T* out, int num_tokens, int inner) {  \
        dependent_launch_entry();                                                                        \
        act_mul_scalar<T, ACT>(x, out, num_tokens, inner);                                               \
    }

DEFINE_ACT_MUL(silu_bf16, bf16, SiluOp)
DEFINE_ACT_MUL(silu_f32, float, SiluOp)
DEFINE_ACT_MUL(gelu_tanh_bf16, bf16, GeluTanhOp)
DEFINE_ACT_MUL(gelu_tanh_f32, float, GeluTanhOp)

// One token row per blockIdx.y; every block of the row takes its RMS (an L2 read of H values)
// before its wait for the previous kernel: that kernel is the product, which reads rms_source and
// writes x, and every kernel before it has completed (see act_mul_rms_* below).
template <typename Act>
__device__ __forceinline__ void act_mul_rms_vec8(const bf16* x, bf16* out, const bf16* rms_source, float eps,
                                                 int inner, int width) {
    __shared__ float scratch[32];
    const long long token = blockIdx.y;
    const float scale = block_inverse_rms(rms_source + token * width, width, eps, scratch);
    dependent_launch_entry();
    const bf16* row = x + token * 2 * inner;
    bf16* out_row = out + token * inner;
    const int stride = gridDim.x * blockDim.x * 8;
    int col = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    Vec8<bf16> gate_raw, up_raw;
    if (col < inner) {
        gate_raw.load(row + col);
        up_raw.load(row + inner + col);
    }
    const Act act;
    for (; col < inner; col += stride) {
        float gate[8], up[8], result[8];
        gate_raw.to_floats(gate);
        up_raw.to_floats(up);
        if (col + stride < inner) {
            gate_raw.load(row + col + stride);
            up_raw.load(row + inner + col + stride);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) result[i] = act(gate[i] * scale) * (up[i] * scale);
        store8(out_row + col, result);
    }
}

// The block reads rms_source before griddepcontrol.wait (dependent_launch_entry inside): the
// caller guarantees that the kernel before this one does not write it. After cuBLASLt's product
// in a captured graph, this kernel may launch once the product's blocks have all started
// (graphs.py), and the RMS is then taken while the product runs.
#define DEFINE_ACT_MUL_RMS(NAME, ACT)                                                                  \
    extern "C" __global__ void act_mul_rms_##NAME##_bf16_vec8(const bf16* x, bf16* out, const bf16* rms_source, \
                                                             float eps, int inner, int width) {         \
        act_mul_rms_vec8<ACT>(x, out, rms_source, eps, inner, width);                                  \
    }

DEFINE_ACT_MUL_RMS(silu, SiluOp)
DEFINE_ACT_MUL_RMS(gelu_tanh, GeluTanhOp)

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void add_into_bf16(bf16* residual, const bf16* delta, long long count) {
    dependent_launch_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        residual[i] = from_float<bf16>(to_float(residual[i]) + to_float(delta[i]));
}

// ---------------------------------------------------------------------------------------------
template <typename S>
__device__ __forceinline__ void scale_columns_impl(bf16* w, const S* scale, long long count, int columns) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        w[i] = from_float<bf16>(to_float(w[i]) * to_float(scale[i % columns]));
}

extern "C" __global__ void scale_columns_bf16_bf16(bf16* w, const bf16* scale, long long count, int columns) {
    dependent_launch_entry();
    scale_columns_impl(w, scale, count, columns);
}

extern "C" __global__ void scale_columns_bf16_f32(bf16* w, const float* scale, long long count, int columns) {
    dependent_launch_entry();
    scale_columns_impl(w, scale, count, columns);
}

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void fill_u64(u64* dst, long long count, u64 pattern) {
    dependent_launch_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = pattern;
}

// ---------------------------------------------------------------------------------------------
// Reads `count` 16-byte words, so that the L2 afterwards holds them (clean) instead of what it held:
// the GEMM tuner times a weight smaller than the L2 after this, as a decode step meets it, streamed
// from HBM (cublaslt.py). Stores only if the words' XOR equals `never`, which keeps the loads.
extern "C" __global__ void read_through_l2(const uint4* data, long long count, unsigned never, unsigned* sink) {
    dependent_launch_entry();
    unsigned folded = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        const uint4 word = data[i];
        folded ^= word.x ^ word.y ^ word.z ^ word.w;
    }
    if (folded == never) *sink = folded;
}

// ---------------------------------------------------------------------------------------------
// The cache is one allocation of planes [num_layers][2 (K, V)][num_blocks][page]: each page
// (block_size x num_kv_heads x head_dim elements) is contiguous, so a page copy is a flat copy.
//   grid.x = pair i, grid.y = plane (layer * 2 + K|V).
extern "C" __global__ void copy_kv_pages(unsigned char* cache, const int* src_block_ids, const int* dst_block_ids,
                                         int num_blocks, long long page_bytes) {
    dependent_launch_entry();
    const int pair = blockIdx.x, plane = blockIdx.y;
    const int src = src_block_ids[pair], dst = dst_block_ids[pair];
    if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
    unsigned char* plane_base = cache + (long long)plane * num_blocks * page_bytes;
    const uint4* from = reinterpret_cast<const uint4*>(plane_base + src * page_bytes);
    uint4* to = reinterpret_cast<uint4*>(plane_base + dst * page_bytes);
    for (long long i = threadIdx.x; i < page_bytes / 16; i += blockDim.x) to[i] = from[i];
}

// Paged causal prefill attention on Hopper (sm_90a): warpgroup MMA (wgmma) kernels for head_dim 64
// and 128, plus every generic mma.sync kernel (attention_prefill_mma.cuh) so that this module
// can stand in for kernels/common/attention_prefill.cu (the host launches the wgmma kernel when
// the module defines it, see ops_attention.prefill_kernel).
//
// Same contract and work split as the generic kernel: the G = Hq / Hkv query heads of a KV head
// are folded into the rows of a tile (row R of sequence s: token R / G, head h * G + R % G), one
// block per 128-row tile and KV head, grid.x enumerating the tiles of all sequences
// (T(s) = floor(query_start_loc[s] * G / 128) + s). Blocks take the tiles in reverse order so
// the longest causal rows start first and the short ones fill the tail.
//
// A block is two warpgroups (8 warps); warpgroup w owns rows 64w .. 64w + 63 of the tile. Per
// tile of BLOCK_N (64 or 128) keys of the context, both warpgroups share one K/V tile in shared
// memory:
//
//     S[64 x N]    = Q K^T             wgmma m64nNk16, Q and K from shared memory (K-major)
//     online softmax on S in registers (mask, max, exp2, sum: the same update as the generic kernel)
//     O[64 x D]   += P V               wgmma m64nDk16, P from registers (bf16), V from shared
//                                      memory (MN-major: V's rows are the keys)
//
// Shared memory holds 128-byte-swizzled panels (wgmma.cuh): Q [D/64][128 rows][64], and two
// stages of K and V [D/64][N keys][64] each; the next tile's cp.async loads run while this one
// computes. Variants (the host picks, ops_attention.WGMMA_KEYS_PER_TILE):
//
//     _n128: 128-key tiles, one block per SM (D 128: 32 + 2 x 64 KB of shared memory, 186 registers)
//     _n64:  64-key tiles, two blocks per SM (D 128: 32 + 2 x 32 KB, 128 registers), so one
//            block's softmax can overlap the other's wgmma
//
// FP8 K/V (the _fp8 kernels: E4M3 bytes in the same page layout, the K scale folded into
// scale_log2 by the host, v_scale multiplying the normalised output): one stage of the bf16 K/V
// panels above plus two stages of the cached bytes, K and V [N keys][D] each (half a bf16 tile):
// the same shared memory. The next tile's bytes stream by cp.async into staging while this one
// computes; at the top of its iteration each thread converts the chunks it copied itself
// (store_e4m3x16_as_bf16, attention_prefill_mma.cuh) into the swizzled bf16 panels, which the
// wgmma code reads unchanged. The conversion (about 5 integer or bf16 instructions per pair of
// elements) is not overlapped within a block: _n64 leaves that to the SM's other block. Registers
// (D 128, nvcc 13.0): _n64 128 (4 bytes spilled, one reload a tile) and _n128 191, against 128
// and 190 for bf16.
//
// FLOPs: 4 * query_len * context_len * Hq * D per sequence (about half of it masked for a prompt).
#include "attention_prefill_mma.cuh"
#include "attention_prefill_wgmma.cuh"

// The FP8 kernels first, as in attention_prefill_mma.cuh (the bf16 kernels' code stays as it was).
DEFINE_PREFILL_WGMMA_FP8(64, 128, 1)
DEFINE_PREFILL_WGMMA_FP8(128, 128, 1)
DEFINE_PREFILL_WGMMA_FP8(64, 64, 2)
DEFINE_PREFILL_WGMMA_FP8(128, 64, 2)
DEFINE_PREFILL_WGMMA(64, 128, 1)
DEFINE_PREFILL_WGMMA(128, 128, 1)
DEFINE_PREFILL_WGMMA(64, 64, 2)
DEFINE_PREFILL_WGMMA(128, 64, 2)

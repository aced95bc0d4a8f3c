// Hopper (sm_90a) prefill attention beyond the Llama shapes: the wgmma kernel of head dim 256
// (Qwen3-Next, Gemma 3) and the `_x` twins (sinks, soft-capping, gated output:
// attention_extras.cuh) of head dims 64, 128 and 256, the same code as kernels/sm90/
// attention_prefill.cu (attention_prefill_wgmma.cuh) in a module of their own, so that adding them
// leaves that module's kernels compiled as they were (one more instantiation there gave the Llama
// kernel d128_n64 4 bytes of spill). Also the `_split` twins of head dims 64 and 128 (PrefillSplit:
// short query chunks over long contexts, split along the context). Only Hopper has this module;
// elsewhere the host takes the mma.sync kernels.
#include "attention_prefill_wgmma.cuh"

// Head dim 256: 64-key tiles, one block an SM (Q 64 KB + two stages of K and V 128 KB of shared
// memory; O is 128 accumulators a thread). bf16 caches only (an FP8 cache takes the mma.sync kernel).
DEFINE_PREFILL_WGMMA(256, 64, 1)
DEFINE_PREFILL_WGMMA_X(64, 64, 2)
DEFINE_PREFILL_WGMMA_X(128, 64, 2)
DEFINE_PREFILL_WGMMA_X(256, 64, 1)
DEFINE_PREFILL_WGMMA_SPLIT(64, 64, 2)
DEFINE_PREFILL_WGMMA_SPLIT(128, 64, 2)

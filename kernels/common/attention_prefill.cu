// Paged causal prefill attention, the generic build (mma.sync, any GPU from sm_80). The kernels
// live in attention_prefill_mma.cuh so that a tuned module (kernels/sm90/attention_prefill.cu)
// can define the same symbols next to its own.
#include "attention_prefill_mma.cuh"

// The layer variants of attention that only some families have, for the kernels' `_x` twins
// (decode on tensor cores, mma.sync prefill): the Llama-shaped kernels are compiled without them
// (EXTRAS = false: not a register or an instruction more), a layer that has any of them runs the
// `_x` symbol of the same shape with these arguments.
//
//   q_stride:      elements between two tokens' q rows: Hq D, or 2 Hq D when each row carries its
//                  gates after its q heads (a gated layer: Qwen3-Next)
//   softcap_log2:  c log2(e) of a soft-capped layer (Gemma 2: scores = c tanh(scores / c)), 0 none;
//                  the kernels hold scores as scale log2(e) q.k, so capped = C tanh(s / C) with
//                  C = c log2(e) is the capped score in the same log2 domain
//   sinks:         [Hq] f32 logits (natural units, not scaled) that join each softmax's denominator
//                  without a value (GPT-OSS), or null: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})
//   gated:         out = attention * sigmoid(gate), the gate of head h at q row + Hq D + h D
#pragma once

#include "atlas_common.cuh"

struct AttentionExtras {
    int q_stride;
    float softcap_log2;
    const float* sinks;
    int gated;
};

__device__ __forceinline__ float capped_log2(float score_log2, float softcap_log2) {
    return softcap_log2 > 0.0f ? softcap_log2 * tanhf(score_log2 / softcap_log2) : score_log2;
}

// What a head's sink adds to a softmax denominator whose terms are exp2(score - best), 0 without
// a sink or with no score at all (best -inf: the output is then 0).
__device__ __forceinline__ float sink_term(const float* sinks, int head, float best) {
    if (sinks == nullptr || best == -ATLAS_INF) return 0.0f;
    return exp2f(sinks[head] * ATLAS_LOG2E - best);
}

__device__ __forceinline__ float sigmoid_of(bf16 gate) { return 1.0f / (1.0f + expf(-to_float(gate))); }

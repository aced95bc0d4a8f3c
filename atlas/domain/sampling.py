"""Sampling rules on the host side: what each sequence asks of the device's sampler.

The device applies the rules in the order `atlas.ports.gpu.SamplingTensors` documents; this
module turns a sequence's state into a `SamplingRow` (penalty context, biases, the position
in its random stream) and rows into the flat arrays the device reads.
"""

from __future__ import annotations

from collections import Counter

from atlas.domain.batch import SamplingRow
from atlas.domain.requests import Sequence

NEG_INF = float("-inf")


def sampling_row(seq: Sequence) -> SamplingRow:
    """The row for the next token of `seq` (called once its whole context is computed)."""
    params = seq.sampling
    penalty_ids: tuple[int, ...] = ()
    penalty_counts: tuple[int, ...] = ()
    if params.has_penalties:
        output_counts = Counter(seq.output_token_ids)
        seen = dict.fromkeys(seq.token_ids if params.repetition_penalty != 1.0 else output_counts)
        penalty_ids = tuple(seen)
        penalty_counts = tuple(output_counts.get(t, 0) for t in penalty_ids)

    bias = dict(params.logit_bias or {})
    if seq.num_output_tokens < params.min_tokens:
        for token_id in seq.eos_token_ids | seq.stop_token_ids:
            bias[token_id] = NEG_INF

    return SamplingRow(
        temperature=params.temperature,
        top_k=max(params.top_k, 0),
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seq.request.seed & 0xFFFF_FFFF_FFFF_FFFF,
        counter=seq.num_output_tokens,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        penalty_token_ids=penalty_ids,
        penalty_output_counts=penalty_counts,
        bias_token_ids=tuple(bias),
        bias_values=tuple(bias.values()),
        num_logprobs=params.logprobs,
    )

"""The sampling kind: one token per row of logits, by rules every backend applies bit for bit.

Speculative verification with point-mass drafts (n-gram) needs nothing more: a sequence's k + 1
positions are k + 1 rows sampled at counters c..c+k, and the host compares the draws with the
drafts (`atlas.domain.speculative.verify.accept_matching`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from atlas.ports.gpu import Tensor


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters for `SamplingKernels.sample`, in the order rules apply:

    1. penalties over the row's context (`penalty_*` CSR): repetition (divide positive logits,
       multiply negative ones) for every token seen in prompt or output; presence and frequency
       (subtract `presence + frequency * count`) for tokens in the output;
    2. logit bias (`bias_*` CSR; -inf bans a token); then, with `token_mask`, the row's
       allowed-token bitmask (int32 [R, ceil(V / 32)]; token v is allowed where bit v % 32 of
       word v // 32 is set; bits past V - 1 are ignored) sets every token it leaves out to
       -inf (`atlas.domain.token_mask.apply_token_bitmask`), greedy rows included. A masked
       logit stays -inf through every later rule, so a backend may apply the mask as it reads
       the logits, before penalties and bias: the ids are the same;
    3. temperature; a row with temperature 0 is greedy (argmax of the biased logits);
    4. top-k (0 = off), then top-p over the renormalised top-k set, then min-p
       (keep p >= min_p * max p);
    5. draw with the row's counter-based random stream (`seeds`, `counters`): the same seed and
       counter give the same token whatever else is in the batch.

    The draw is a Gumbel-max race, defined bit for bit so every backend picks the same id.
    In wrapping uint64 arithmetic, for row r and token id v:

        x = seed ^ (counter * 0x9E3779B97F4A7C15) ^ (v * 0xD1B54A32D192ED03)
        x = splitmix64(x)   # x += 0x9E3779B97F4A7C15; x = (x ^ x >> 30) * 0xBF58476D1CE4E5B9;
                            # x = (x ^ x >> 27) * 0x94D049BB133111EB; x ^= x >> 31
        u = ((x >> 41) + 0.5) * 2**-23          # float32, exactly representable, in (0, 1)
                                                # (23 bits: with 24 the top value rounds to 1.0)
        token = argmax over kept v of  logit_v / T - log(-log(u))   (ties: lowest id)

    Greedy rows take argmax of the processed logits (ties: lowest id). Logprobs stay those of
    the raw logits, mask or not. A row whose mask allows no token is the caller's mistake: the
    reference raises ValueError, a device picks some id. Top-k keeps the k
    largest (ties: lowest id); top-p keeps, in descending probability, each token whose
    preceding cumulative probability is < top_p (so at least one); min-p compares
    exp((logit_v - logit_max) / T) with min_p.
    """

    temperature: Tensor  # [R] f32
    top_k: Tensor  # [R] i32, 0 = off
    top_p: Tensor  # [R] f32, 1 = off
    min_p: Tensor  # [R] f32, 0 = off
    seeds: Tensor  # [R] i64
    counters: Tensor  # [R] i64, how many tokens the row has sampled before
    repetition_penalty: Tensor  # [R] f32, 1 = off
    presence_penalty: Tensor  # [R] f32
    frequency_penalty: Tensor  # [R] f32
    penalty_offsets: Tensor  # [R + 1] i32
    penalty_token_ids: Tensor  # [P] i32, distinct per row
    penalty_output_counts: Tensor  # [P] i32, occurrences in the output (0: prompt only)
    bias_offsets: Tensor  # [R + 1] i32
    bias_token_ids: Tensor  # [B] i32
    bias_values: Tensor  # [B] f32
    num_rows: int
    all_greedy: bool
    any_penalties: bool
    any_bias: bool
    token_mask: Tensor | None = None  # [R, ceil(V / 32)] i32 allowed-token bits; None: all allowed


@dataclass(frozen=True, slots=True)
class LogprobsOut:
    """Where `sample` writes log-probabilities of the raw (unprocessed) logits."""

    sampled: Tensor  # [R] f32, log p of the chosen token
    top_ids: Tensor  # [R, K] i32, the K most likely tokens, most likely first
    top_logprobs: Tensor  # [R, K] f32
    num_top: int  # K, may be 0


class SamplingKernels(Protocol):
    def sample(
        self,
        logits: Tensor,
        params: SamplingTensors,
        out_token_ids: Tensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        """One token per row of logits [R, V] (f32, or bf16 where the backend takes it) into
        out_token_ids [R] i32, by the rules and the random stream of `SamplingTensors`; with
        `logprobs`, the log-probabilities of the raw logits too. Every backend picks the mock's
        ids exactly. A penalty or bias token id outside [0, V), or a `token_mask` that is not
        int32 [>= R, ceil(V / 32)], raises `ValueError` where the backend can see it."""
        ...

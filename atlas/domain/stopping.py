"""Token-level stop rules: when a sequence is done, judged from its token ids alone.

Stop strings need text and are the front end's business (it detokenizes and aborts). Here:

- STOP: the last token is an eos id (from config.json and generation_config.json; `Sequence`
  already holds none when `ignore_eos` is set) or one of the request's `stop_token_ids`.
- LENGTH: `max_tokens` outputs were produced, or the sequence reached `max_total_tokens`
  (the engine sets it to min(max_model_len, prompt + max_tokens)).

STOP wins over LENGTH when both hold: the model ended on its own.
"""

from __future__ import annotations

from atlas.domain.requests import FinishReason
from atlas.domain.sequence import Sequence


def stop_reason(seq: Sequence) -> FinishReason | None:
    """Why `seq` is finished after its last resolved token, or None to keep going.

    `min_tokens` is enforced by the sampler banning eos and stop ids; as a second guard an eos or
    stop id is not honoured unless at least `min_tokens` outputs come before it. Never raises for
    a sequence that holds at least one output token.
    """
    num_resolved = seq.num_resolved_tokens
    if (
        num_resolved - seq.num_prompt_tokens > seq.sampling.min_tokens
        and seq.last_resolved_token_id in seq.ending_token_ids
    ):
        return FinishReason.STOP
    if num_resolved >= seq.length_limit:  # max_tokens outputs, or max_total_tokens
        return FinishReason.LENGTH
    return None


def first_stop(seq: Sequence, token_ids: tuple[int, ...]) -> tuple[int, FinishReason | None]:
    """Where `seq` would stop if `token_ids` followed its resolved tokens (a verify step's
    accepted drafts and next token): (how many of them to keep, the reason), or
    (len(token_ids), None) when none of them ends it. The rules of `stop_reason`, token by token."""
    num_resolved = seq.num_resolved_tokens
    num_output = num_resolved - seq.num_prompt_tokens
    for index, token_id in enumerate(token_ids, start=1):
        if num_output + index > seq.sampling.min_tokens and token_id in seq.ending_token_ids:
            return index, FinishReason.STOP
        if num_resolved + index >= seq.length_limit:
            return index, FinishReason.LENGTH
    return len(token_ids), None


def ends_by_length(seq: Sequence) -> bool:
    """True when the last token (real or pending) is the last `max_tokens` or the length limit allow."""
    return seq.num_tokens >= seq.length_limit

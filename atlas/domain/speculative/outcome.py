"""What verification decides, in the shapes its consumers want.

`VerifyResult` is what the device returns for a batch (two ids per row); `VerifyOutcome` is one
sequence's share, the bookkeeping the scheduler applies; `SpecDecodeStats` accumulates the
counters the metrics endpoint and `atlas bench` report.

A verify step computes the sequence's last token and its k drafts at positions P..P+k:

    position     P       P+1    P+2    P+3    P+4          (k = 4, 2 drafts accepted)
    computed     last    d0     d1     d2     d3
    decided              d0 ok  d1 ok  d2 no  (d3 moot)    -> token_ids = (d0, d1, t2)
    KV kept      P .. P+2                                   -> num_rolled_back = 2 (P+3, P+4)

t2 (the target's own token where d2 was rejected, or the bonus token after all k) is not in
the cache yet: like any sampled token, the next step computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    """One sequence's verified step: the tokens to append and the KV slots to give back."""

    token_ids: tuple[int, ...]  # accepted drafts, then the target's next token (at least one)
    num_drafts: int  # drafts that were verified (k for this sequence)

    def __post_init__(self) -> None:
        if not 1 <= len(self.token_ids) <= self.num_drafts + 1:
            raise ValueError(f"{len(self.token_ids)} tokens cannot come from verifying {self.num_drafts} drafts")

    @property
    def num_accepted(self) -> int:
        """Drafts accepted (those at the front of `token_ids`)."""
        return len(self.token_ids) - 1

    @property
    def num_rolled_back(self) -> int:
        """Trailing positions of this step's KV writes that hold no kept token: `rollback(n)`."""
        return self.num_drafts + 1 - len(self.token_ids)

    def keep(self, num_tokens: int) -> VerifyOutcome:
        """The outcome cut to its first `num_tokens` tokens (a stop condition hit inside them);
        the cut tokens' slots join the rollback. Raises ValueError outside [1, len(token_ids)]."""
        if not 1 <= num_tokens <= len(self.token_ids):
            raise ValueError(f"can keep 1 to {len(self.token_ids)} tokens, not {num_tokens}")
        return VerifyOutcome(self.token_ids[:num_tokens], self.num_drafts)


@dataclass(frozen=True, slots=True, eq=False)  # holds arrays
class VerifyResult:
    """A batch's verification as the device returns it: rows in the batch's order."""

    num_accepted: np.ndarray  # [R] i32, drafts accepted per row
    next_token_ids: np.ndarray  # [R] i32, the target's token after them (correction or bonus)

    def outcomes(self, draft_ids: np.ndarray, num_drafts: np.ndarray) -> tuple[VerifyOutcome, ...]:
        """Per-row outcomes, given the drafts that were verified ([R, K] and [R], as passed to
        the verify function). Raises ValueError when a row accepted more drafts than it had."""
        outcomes = []
        for row, (accepted, next_token, drafted) in enumerate(zip(self.num_accepted, self.next_token_ids, num_drafts)):
            if accepted > drafted:
                raise ValueError(f"row {row} accepted {accepted} of {drafted} drafts")
            tokens = (*(int(t) for t in draft_ids[row, :accepted]), int(next_token))
            outcomes.append(VerifyOutcome(tokens, int(drafted)))
        return tuple(outcomes)


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals: `atlas_spec_decode_num_draft_tokens_total`, `..._num_accepted_tokens_total`,
    and acceptance by position (`accepted_by_position[j]`: drafts at position j accepted)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # sequence-steps that verified at least one draft
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, outcome: VerifyOutcome) -> None:
        """Count one sequence's verification (before any `keep` cut: what the drafts earned)."""
        if outcome.num_drafts == 0:
            return
        self.num_verify_steps += 1
        self.num_draft_tokens += outcome.num_drafts
        self.num_accepted_tokens += outcome.num_accepted
        if len(self.accepted_by_position) < outcome.num_drafts:
            self.accepted_by_position.extend([0] * (outcome.num_drafts - len(self.accepted_by_position)))
        for position in range(outcome.num_accepted):
            self.accepted_by_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence-step yields on average (accepted drafts + 1); 0 before any."""
        if self.num_verify_steps == 0:
            return 0.0
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps

"""A request being run: its tokens, its cache pages, and the token a step in flight will sample.

A sequence owns its tokens and its cache holdings (block tables per cache group, its path in
the prefix cache) and changes only through named methods; the cache manager changes the
holdings. With the
engine preparing step N+1 while step N runs, a sequence sampled in step N carries a *pending*
token: a placeholder whose id only the device knows until step N is committed. Step N+1 can
already compute it (the worker reads the id from step N's sampled ids on the device).

Speculative drafts are tentative tokens after the final ones, computed like any token:

    tokens     p0 .. p4 | o0 o1 | d0 d1 d2 | P        (prompt, output, drafts, pending)
    resolved   ----------------              (the host knows them for good: the prefix cache,
                                              the n-gram index and the stop rules read these)

Verification keeps the accepted drafts and the target's next token (`resolve_verified`) and
rolls back the computed count past the rejected ones.
"""

from __future__ import annotations

import msgspec

from atlas.domain.batch import SamplingRow
from atlas.domain.cache.holdings import CacheHoldings
from atlas.domain.requests import FinishReason, ParameterError, Request, SamplingParams, SequenceStatus

PLACEHOLDER_TOKEN = -1


class PendingToken(msgspec.Struct, frozen=True):
    """Where the id of a sequence's last token will come from."""

    step_id: int  # the step that samples it
    sample_row: int  # its row among that step's sampled ids


class Sequence:
    """A request being run: its tokens, how many are in the KV cache, and its cache pages.

    `token_ids` holds the prompt then the output. `num_computed_tokens` counts tokens whose
    K/V are in the cache (found in the prefix cache, or computed); the scheduler feeds the next
    ones until it catches up with `num_tokens`, then each step samples one more.

    What the request fixes (`seq_id`, `sampling`, `num_prompt_tokens`, the token limits,
    `has_penalties`) and `cache` (the one holdings object, which the cache manager changes) are
    plain attributes, set once here: the scheduler reads them for every sequence of every step,
    and a slot reads several times faster than a property.
    """

    __slots__ = (
        "request",
        "seq_id",
        "sampling",
        "num_prompt_tokens",
        "length_limit",
        "ending_token_ids",
        "_token_ids",
        "_num_resolved",
        "num_computed_tokens",
        "num_cached_tokens",
        "cache",
        "has_penalties",
        "status",
        "finish_reason",
        "max_total_tokens",
        "eos_token_ids",
        "stop_token_ids",
        "num_preemptions",
        "_penalty_counts",
        "_pending",
        "_num_drafts",
        "sampling_row_base",
    )

    def __init__(self, request: Request, max_total_tokens: int, eos_token_ids: frozenset[int]) -> None:
        if not request.prompt_token_ids:
            raise ParameterError("prompt", "the prompt is empty")
        self.request = request
        self.seq_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self._token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self._num_resolved = self.num_prompt_tokens  # all but drafts and pending tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first admitted
        # its pages in each cache group and its path in the prefix cache (the cache manager's)
        self.cache = CacheHoldings()
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.max_total_tokens = max_total_tokens
        self.eos_token_ids = frozenset() if request.sampling.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(request.sampling.stop_token_ids)
        # either of them ends it (STOP), once past min_tokens (`atlas.domain.stopping`)
        self.ending_token_ids = self.eos_token_ids | self.stop_token_ids
        # The number of tokens at which it ends by LENGTH: max_total_tokens, or max_tokens outputs.
        max_tokens = request.sampling.max_tokens
        self.length_limit = max_total_tokens if max_tokens is None else min(
            max_total_tokens, self.num_prompt_tokens + max_tokens
        )
        self.num_preemptions = 0
        # oldest first; the last len(_pending) tokens (a tuple: read several times a step)
        self._pending: tuple[PendingToken, ...] = ()
        self._num_drafts = 0  # tentative tokens before the pending ones
        # token id -> occurrences in the output, kept only when penalties need it; prompt tokens
        # enter with 0 when the repetition penalty also covers the prompt
        self._penalty_counts: dict[int, int] | None = None
        self.has_penalties = request.sampling.has_penalties
        if self.has_penalties:
            covers_prompt = request.sampling.repetition_penalty != 1.0
            self._penalty_counts = dict.fromkeys(request.prompt_token_ids, 0) if covers_prompt else {}
        # The sampling module's row for this request without drafts, penalties or bans, which
        # depends on the request alone: built once, each step's row is it with its counter.
        self.sampling_row_base: SamplingRow | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids[self.num_prompt_tokens :])

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self._token_ids) - self.num_computed_tokens

    def tokens_slice(self, start: int, stop: int) -> list[int]:
        return self._token_ids[start:stop]

    def token_tuple(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens [start, stop) as a tuple (placeholders included); stop <= num_tokens."""
        if stop - start == 1:  # a decode: no slice to copy
            return (self._token_ids[start],)
        return tuple(self._token_ids[start:stop])

    def append_token(self, token_id: int) -> None:
        if self._pending or self._num_drafts:
            raise AssertionError(f"{self.seq_id}: a token is appended while one is pending or drafted")
        self._token_ids.append(token_id)
        self._num_resolved += 1
        self._count_for_penalties(token_id)

    @property
    def num_draft_tokens(self) -> int:
        """Speculative drafts awaiting verification (0 outside a verify step)."""
        return self._num_drafts

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        start = self.num_resolved_tokens
        return tuple(self._token_ids[start : start + self._num_drafts])

    @property
    def num_final_tokens(self) -> int:
        """What a proposer may read (`TokenHistory`): the resolved tokens."""
        return self.num_resolved_tokens

    def add_drafts(self, token_ids: tuple[int, ...]) -> None:
        """Append speculative drafts after the last (resolved) token; the step that computes them
        verifies them. Raises AssertionError with a token pending or drafts already there."""
        if self._pending or self._num_drafts:
            raise AssertionError(f"{self.seq_id}: drafts added while a token is pending or drafted")
        self._token_ids.extend(token_ids)
        self._num_drafts = len(token_ids)

    def resolve_verified(self, token_ids: tuple[int, ...]) -> int:
        """The oldest step in flight verified this sequence's drafts: `token_ids` (the accepted
        drafts, then the target's next token, possibly cut short by a stop) replace the drafts
        and the placeholder. The computed count falls back to cover the kept drafts only;
        returns how many computed positions were rolled back."""
        if not self._pending or not self._num_drafts:
            raise AssertionError(f"{self.seq_id}: no verify step to resolve")
        start = self.num_resolved_tokens
        drafts = self._token_ids[start : start + self._num_drafts]
        num_kept_drafts = 0
        while num_kept_drafts < len(token_ids) and num_kept_drafts < len(drafts) and (
            token_ids[num_kept_drafts] == drafts[num_kept_drafts]
        ):
            num_kept_drafts += 1
        del self._token_ids[start:]
        self._token_ids.extend(token_ids)
        self._pending = self._pending[1:]
        self._num_drafts = 0
        self._num_resolved = start + len(token_ids)
        for token_id in token_ids:
            self._count_for_penalties(token_id)
        computed = min(self.num_computed_tokens, start + num_kept_drafts)
        rolled_back, self.num_computed_tokens = self.num_computed_tokens - computed, computed
        return rolled_back

    @property
    def pending(self) -> tuple[PendingToken, ...]:
        """Tokens steps in flight are sampling for this sequence, oldest first (at most two)."""
        return self._pending

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose ids the host knows for good (all but drafts and pending ones)."""
        return self._num_resolved

    @property
    def last_resolved_token_id(self) -> int:
        return self._token_ids[self._num_resolved - 1]

    def append_pending(self, pending: PendingToken) -> None:
        """Add the next token as a placeholder; `resolve_pending` fills in its id."""
        self._token_ids.append(PLACEHOLDER_TOKEN)
        self._pending += (pending,)

    def resolve_pending(self, token_id: int) -> None:
        """The oldest step in flight sampled `token_id`: it replaces that placeholder."""
        if not self._pending or self._num_drafts:
            raise AssertionError(f"{self.seq_id}: no pending token to resolve, or drafts to verify first")
        self._token_ids[self._num_resolved] = token_id
        self._num_resolved += 1
        self._pending = self._pending[1:]
        if self._penalty_counts is not None:
            self._count_for_penalties(token_id)

    def rewind_to_resample(self) -> None:
        """The oldest step in flight sampled a token that may not stand (`Scheduler.resample`):
        forget it and any token after it in flight, and count the last resolved token as not
        computed, so that the next step computes it again and samples the position after it."""
        if self._num_drafts or not self._pending or self._num_resolved <= self.num_prompt_tokens:
            raise AssertionError(f"{self.seq_id}: no output token in flight to sample again")
        self._drop_tentative()
        self.num_computed_tokens = min(self.num_computed_tokens, self._num_resolved - 1)

    def _drop_tentative(self) -> None:
        """Forget pending tokens and drafts (a finished or preempted sequence's)."""
        num_tentative = len(self._pending) + self._num_drafts
        if num_tentative:
            del self._token_ids[-num_tentative:]
            self._pending = ()
            self._num_drafts = 0
            self.num_computed_tokens = min(self.num_computed_tokens, len(self._token_ids))

    def _count_for_penalties(self, token_id: int) -> None:
        if self._penalty_counts is not None:
            self._penalty_counts[token_id] = self._penalty_counts.get(token_id, 0) + 1

    def penalty_counts(self) -> dict[int, int]:
        """Tokens the penalties apply to, with their output counts (empty without penalties)."""
        return self._penalty_counts if self._penalty_counts is not None else {}

    def start_from_cache(self, num_tokens: int) -> None:
        """Admission found its first `num_tokens` tokens in the prefix cache: they count as
        computed. The first admission's count is the request's cached prompt tokens."""
        if self.num_computed_tokens or self.status is not SequenceStatus.WAITING:
            raise AssertionError(f"{self.seq_id}: only a waiting sequence starts from the cache")
        self.mark_computed(num_tokens)
        if self.num_preemptions == 0:
            self.num_cached_tokens = num_tokens

    def mark_computed(self, num_tokens: int) -> None:
        if self.num_computed_tokens + num_tokens > len(self._token_ids):
            raise AssertionError("computed more tokens than the sequence holds")
        self.num_computed_tokens += num_tokens

    def reset_for_recompute(self) -> None:
        """Preemption by recompute, once the cache manager released its pages: forget the
        computed count (and a pending token, sampled again later); prompt and output are
        refilled later, from the prefix cache as far as it still holds them."""
        if not self.cache.is_empty:
            raise AssertionError(f"{self.seq_id}: preempted while still holding cache pages")
        self._drop_tentative()
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def finish(self, reason: FinishReason) -> None:
        self._drop_tentative()  # finished while steps sample for it: those tokens are void
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"{self.cache!r}, {self.status.value})"
        )

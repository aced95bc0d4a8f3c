"""Requests and their sampling parameters.

A `Request` is what a client asked for; the engine runs it as one `Sequence`
(`atlas.domain.sequence`; a request with `n > 1` is fanned out by the front end into `n`
sequences with derived seeds). A request may carry an `OutputConstraint`: what its tokens must
follow beyond sampling (a grammar, a thinking budget), as plain data the engine turns into a
`TokenConstraint` (`atlas.domain.request_constraints`).
"""

from __future__ import annotations

import enum
import math

import msgspec

from atlas.ports.grammar import ConstraintSpec


class ParameterError(ValueError):
    """A request field with a value Atlas cannot honour. `field` names it for the 400 reply."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# Per-request bounds, so no request costs memory or time out of proportion to what it asks
# for; the HTTP schema declares the same numbers (and /openapi.json publishes them).
MAX_N = 128  # choices per prompt (OpenAI's bound)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs bound)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # each stop string
MAX_STOP_TOTAL_CHARS = 4096  # all stop strings together
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024  # packed into the sampling inputs every step
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
# Seen tokens' logits scale by at most 10x either way: below this, dividing a logit by the
# penalty overflows float32 (1e-300 is 0 there) and the row's probabilities become NaN.
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How to pick tokens and when to stop. Invalid values raise `ParameterError` on creation.

    temperature 0 is greedy. top_k <= 0, top_p 1 and min_p 0 switch those filters off.
    max_tokens None means "until a stop condition or the model's length limit".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1 (got {self.n})")
        _check(self.n <= MAX_N, "n", f"must be at most {MAX_N} (got {self.n})")
        _finite("temperature", self.temperature)
        _check(self.temperature >= 0, "temperature", f"must be >= 0 (got {self.temperature}); use 0 for greedy")
        _finite("top_p", self.top_p)
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (got {self.top_p}); use 1 to disable")
        _check(self.top_k >= -1, "top_k", f"must be >= 1, or 0/-1 to disable (got {self.top_k})")
        _finite("min_p", self.min_p)
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1] (got {self.min_p}); use 0 to disable")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits")
        _finite("repetition_penalty", self.repetition_penalty)
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (got {self.repetition_penalty}); "
            f"use 1 to disable",
        )
        low, high = PENALTY_RANGE
        _finite("presence_penalty", self.presence_penalty)
        _check(low <= self.presence_penalty <= high, "presence_penalty",
               f"must be in [{low:g}, {high:g}] (got {self.presence_penalty})")
        _finite("frequency_penalty", self.frequency_penalty)
        _check(low <= self.frequency_penalty <= high, "frequency_penalty",
               f"must be in [{low:g}, {high:g}] (got {self.frequency_penalty})")
        if self.logit_bias:
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                   f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (got {len(self.logit_bias)})")
            low, high = LOGIT_BIAS_RANGE
            for token_id, bias in self.logit_bias.items():
                _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
                _check(
                    not math.isnan(bias) and low <= bias <= high,
                    "logit_bias",
                    f"bias for token {token_id} must be in [{low:g}, {high:g}] (got {bias})",
                )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0 (got {self.min_tokens})")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1 (got {self.max_tokens})")
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        self._check_stops()
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})",
            )

    def _check_stops(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings (got {len(self.stop)})")
        for text in self.stop:
            _check(len(text) > 0, "stop", "stop strings must not be empty")
            _check(len(text) <= MAX_STOP_STRING_CHARS, "stop",
                   f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters (got {len(text)})")
        total = sum(len(text) for text in self.stop)
        _check(total <= MAX_STOP_TOTAL_CHARS, "stop",
               f"the stop strings may have at most {MAX_STOP_TOTAL_CHARS} characters together (got {total})")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids (got {len(self.stop_token_ids)})")
        for token_id in self.stop_token_ids:
            _check(token_id >= 0, "stop_token_ids", f"token id {token_id} is negative")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ParameterError(field, message)


def _finite(field: str, value: float) -> None:
    _check(math.isfinite(value), field, f"must be a finite number (got {value})")


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"  # the client went away, timed out or the server shut down


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks, is scheduled every step
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is SequenceStatus.FINISHED


class ReasoningMarkers(msgspec.Struct, frozen=True):
    """The reasoning block in token ids. Reasoning models have one token per tag (Qwen3's
    151667/151668); `forced_end_token_ids` is the end the engine writes at the budget and
    contains `end_token_id`. Raises ValueError when it does not."""

    start_token_id: int
    end_token_id: int
    forced_end_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.end_token_id not in self.forced_end_token_ids:
            raise ValueError("forced_end_token_ids must contain end_token_id")

    @property
    def after_end_token_ids(self) -> tuple[int, ...]:
        """The part of the forced end after the end tag (the padding before the answer)."""
        idx = self.forced_end_token_ids.index(self.end_token_id)
        return self.forced_end_token_ids[idx + 1 :]


class OutputConstraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a sequence's tokens must follow beyond its sampling parameters, as plain data.

    `grammar` constrains the answer (the front end has compiled it once already, so it is
    valid; `grammar_field` names the request field it came from). `reasoning` is the model's
    reasoning block in token ids, present when the answer's grammar must start after the block
    or a thinking budget must be kept; `starts_in_reasoning` says the prompt opened the block.
    `thinking_budget` caps the tokens inside the block (None: no cap). Raises ValueError for a
    budget without markers or a negative one, and for a constraint that constrains nothing.
    """

    grammar: ConstraintSpec | None = None
    grammar_field: str = ""
    reasoning: ReasoningMarkers | None = None
    starts_in_reasoning: bool = False
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if self.thinking_budget is not None:
            if self.thinking_budget < 0:
                raise ValueError(f"thinking_budget must be >= 0 (got {self.thinking_budget})")
            if self.reasoning is None:
                raise ValueError("a thinking budget needs the reasoning markers")
        if self.grammar is None and self.thinking_budget is None:
            raise ValueError("an OutputConstraint needs a grammar or a thinking budget")


class Request(msgspec.Struct, frozen=True):
    """One sequence to run: what the front end submits to the engine.

    `constraint` None: sampling alone decides. Sequences of one client request (n > 1) carry
    equal constraints, so the engine may compile the grammar once and fork its matcher.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int  # resolved: the client's seed, or one drawn by the front end
    arrival_s: float = 0.0
    priority: int = 0  # lower runs first under --scheduling-policy priority (fifo accepts only 0)
    constraint: OutputConstraint | None = None

"""Requests and their sampling parameters.

A `Request` is what a client asked for; the engine runs it as one `Sequence`
(`atlas.domain.sequence`; a request with `n > 1` is fanned out by the front end into `n`
sequences with derived seeds).
"""

from __future__ import annotations

import enum
import math

import msgspec


class ParameterError(ValueError):
    """A request field with a value Atlas cannot honour. `field` names it for the 400 reply."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


MAX_LOGPROBS = 20


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
        _check(self.n <= 128, "n", f"must be at most 128 (got {self.n})")
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
            0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            f"must be in (0, 10] (got {self.repetition_penalty}); use 1 to disable",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2] (got {value})")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
                _check(
                    not math.isnan(bias) and -100 <= bias <= 100,
                    "logit_bias",
                    f"bias for token {token_id} must be in [-100, 100] (got {bias})",
                )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0 (got {self.min_tokens})")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1 (got {self.max_tokens})")
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for text in self.stop:
            _check(len(text) > 0, "stop", "stop strings must not be empty")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings (got {len(self.stop)})")
        for token_id in self.stop_token_ids:
            _check(token_id >= 0, "stop_token_ids", f"token id {token_id} is negative")
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})",
            )

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


class Request(msgspec.Struct, frozen=True):
    """One sequence to run: what the front end submits to the engine."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int  # resolved: the client's seed, or one drawn by the front end
    arrival_s: float = 0.0
    priority: int = 0  # lower runs first under --scheduling-policy priority (fifo accepts only 0)

"""The speculative-decoding configuration: `--speculative-config JSON` and `atlas.LLM(speculative_config=...)`.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    {"method": "mtp", "num_speculative_tokens": 1}
    {"method": "eagle3", "num_speculative_tokens": 3, "model": "/models/eagle3-llama-3.1-8b"}

Every key may also carry `"disable_by_batch_size": N` (null: never): steps with more than N
sequences run without speculation, since a verify step over B x (k + 1) tokens stops being
memory-bound at large B and then costs more than the accepted tokens save. The key names
follow vLLM's, so a configuration written for it reads the same here.

Every mistake raises `SpeculativeConfigError`, a `ParameterError` whose field is
`speculative_config.<key>` and whose one-line message says what is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from atlas.domain.requests import ParameterError

# Prompt lookup on a small model pays past 16 drafts: a verify step of 33 rows costs about what
# one of 17 does (SmolLM2 on an H200: 0.88 against 0.84 ms), and copying answers accept long
# runs (acceptance 13.8 at k = 32 against 10.3 at 16; docs/lab/speculative-plan.md).
MAX_SPECULATIVE_TOKENS = 64
MAX_PROMPT_LOOKUP = 16
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
# A verify step computes B x (k + 1) tokens. bf16 decode does 2 FLOPs per 2-byte weight per token,
# so a step stays memory-bound up to FLOP/s / (byte/s) tokens: ~295 on an H100 (989 T / 3.35 T).
# With k = 4 that is B ~ 60 at best; 32 leaves room for attention, until `atlas bench` says more.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


class SpeculativeConfigError(ParameterError):
    """A speculative configuration Atlas cannot run; `field` is `speculative_config.<key>`."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__("speculative_config" + (f".{key}" if key else ""), message)


class SpeculativeMethod(Enum):
    NGRAM = "ngram"  # prompt lookup: drafts copied from the sequence's own earlier tokens
    DRAFT_MODEL = "draft_model"  # a small model sharing the target's tokenizer
    MTP = "mtp"  # the multi-token-prediction layers the target checkpoint carries
    EAGLE3 = "eagle3"  # an EAGLE-3 draft head fed the target's hidden states

    @property
    def needs_model(self) -> bool:
        """Whether `model` names a second checkpoint (the draft model or the EAGLE-3 head)."""
        return self in (SpeculativeMethod.DRAFT_MODEL, SpeculativeMethod.EAGLE3)


_COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
_KEYS_BY_METHOD = {
    SpeculativeMethod.NGRAM: (*_COMMON_KEYS, "prompt_lookup_min", "prompt_lookup_max"),
    SpeculativeMethod.DRAFT_MODEL: (*_COMMON_KEYS, "model"),
    SpeculativeMethod.MTP: _COMMON_KEYS,
    SpeculativeMethod.EAGLE3: (*_COMMON_KEYS, "model"),
}
_METHOD_NAMES = ", ".join(method.value for method in SpeculativeMethod)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How to speculate; validated on construction (raises `SpeculativeConfigError`).

    `prompt_lookup_min`/`max` are set for n-gram only (else None); `model` for draft_model and
    eagle3 only. `disable_by_batch_size` None never switches speculation off.
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.method.needs_model:
            if not isinstance(self.model, str) or not self.model.strip():
                needs = f"{self.method.value} needs the draft checkpoint: a path or a name"
                raise SpeculativeConfigError("model", needs)
        elif self.model is not None:
            uses = "its own n-gram index" if self.method is SpeculativeMethod.NGRAM else "the target's own MTP layers"
            raise SpeculativeConfigError("model", f"{self.method.value} uses {uses}; remove model")
        if self.method is SpeculativeMethod.NGRAM:
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP)
            if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
                raise SpeculativeConfigError(
                    "prompt_lookup_min",
                    f"{self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}",
                )
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise SpeculativeConfigError("prompt_lookup_min", "only the ngram method takes prompt_lookup_min/max")

    def speculates_at(self, batch_size: int) -> bool:
        """Whether a step running `batch_size` sequences should speculate."""
        return self.disable_by_batch_size is None or batch_size <= self.disable_by_batch_size

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the `--speculative-config` value: a JSON object (see the module docstring)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as error:
            raise SpeculativeConfigError(None, f"not valid JSON ({error}); pass an object like {_EXAMPLE}") from None
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: Any) -> SpeculativeConfig:
        """Build from parsed JSON or a Python dict; unknown keys are refused, naming those accepted."""
        if not isinstance(data, Mapping):
            raise SpeculativeConfigError(None, f"must be a JSON object like {_EXAMPLE}, got {type(data).__name__}")
        for key in data:
            if not isinstance(key, str):
                raise SpeculativeConfigError(None, f"keys must be strings, got {key!r}")
        method = _method(data.get("method"))
        for key in data:
            if key not in _KEYS_BY_METHOD[method]:
                raise SpeculativeConfigError(
                    key, f"unknown for method {method.value}; accepted: {', '.join(_KEYS_BY_METHOD[method])}"
                )
        if "num_speculative_tokens" not in data:
            raise SpeculativeConfigError(
                "num_speculative_tokens", f"required: how many tokens to draft a step (1 to {MAX_SPECULATIVE_TOKENS})"
            )
        lookup_min, lookup_max = None, None
        if method is SpeculativeMethod.NGRAM:
            lookup_min, lookup_max = _lookup_bounds(data.get("prompt_lookup_min"), data.get("prompt_lookup_max"))
        return cls(
            method=method,
            num_speculative_tokens=data["num_speculative_tokens"],
            model=data.get("model"),
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
            disable_by_batch_size=data.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
        )


_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def _method(value: Any) -> SpeculativeMethod:
    if value is None:
        raise SpeculativeConfigError("method", f"required: one of {_METHOD_NAMES}")
    try:
        return SpeculativeMethod(value)
    except ValueError:
        raise SpeculativeConfigError("method", f"{value!r} is not one of {_METHOD_NAMES}") from None


def _lookup_bounds(lookup_min: Any, lookup_max: Any) -> tuple[Any, Any]:
    """Defaults for the n-gram sizes; a lone bound pulls the other's default to stay ordered."""
    if lookup_min is None and lookup_max is None:
        return DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
    if lookup_min is None:
        _check_int("prompt_lookup_max", lookup_max, 1, MAX_PROMPT_LOOKUP)
        return min(DEFAULT_PROMPT_LOOKUP_MIN, lookup_max), lookup_max
    if lookup_max is None:
        _check_int("prompt_lookup_min", lookup_min, 1, MAX_PROMPT_LOOKUP)
        return lookup_min, max(DEFAULT_PROMPT_LOOKUP_MAX, lookup_min)
    return lookup_min, lookup_max


def _check_int(key: str, value: Any, low: int, high: int | None) -> None:
    # bool is an int in Python, but `true` for a count is a mistake worth naming.
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not (is_int and value >= low and (high is None or value <= high)):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise SpeculativeConfigError(key, f"must be an integer {bounds}, got {value!r}")

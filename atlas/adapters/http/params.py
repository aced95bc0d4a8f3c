"""From request fields to `SamplingParams`, with every rejection a 400 naming the client's field."""

from __future__ import annotations

import re
from dataclasses import dataclass

from atlas.adapters.http.engine_client import SamplingDefaults
from atlas.adapters.http.errors import bad_request, excerpt
from atlas.adapters.http.schemas import ChatCompletionRequest, CompletionRequest
from atlas.domain.requests import ParameterError, SamplingParams
from atlas.domain.sampling import validate_token_ids

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """400 when the prompt leaves no room for one output token."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            param,
            f"the prompt has {num_prompt_tokens} tokens but this model's context is {max_model_len} tokens "
            f"(prompt + output); shorten the prompt",
            code="context_length_exceeded",
        )


def check_choices(num_prompts: int, n: int | None, max_choices: int) -> None:
    """400 naming `n` and --max-choices-per-request when prompts x n choices exceed it."""
    num_choices = num_prompts * (n if n is not None else 1)
    if num_choices > max_choices:
        asked = f"n={n or 1}" if num_prompts == 1 else f"{num_prompts} prompts x n={n or 1}"
        raise bad_request(
            "n", f"{asked} asks for {num_choices} choices; this server generates at most {max_choices} per "
                 f"request (--max-choices-per-request)",
        )


def _max_tokens(requested: int | None, param: str, num_prompt_tokens: int, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested < 1:
        raise bad_request(param, f"{param} must be at least 1 (got {requested})")
    if requested > room:
        raise bad_request(
            param,
            f"{param} is too large: the prompt has {num_prompt_tokens} tokens and this model's context is "
            f"{max_model_len}, so at most {room} tokens can be generated (got {requested})",
            code="context_length_exceeded",
        )
    return requested


# int() alone also takes " 5", "1_0", "+5" and non-ASCII digits; 18 digits fit in 64 bits, so a
# longer key is refused here rather than by int()'s limit on digits
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        if _TOKEN_ID_KEY.fullmatch(key) is None:
            raise bad_request("logit_bias", f"logit_bias keys are token ids (decimal integers); {excerpt(key)} is "
                                            f"not one")
        bias[int(key)] = value
    return bias


GREEDY = SamplingDefaults()


@dataclass(frozen=True, slots=True)
class RequestedSampling:
    """Sampling fields as one API's request gave them (None: absent), with that API's names
    for the fields a 400 may name (Anthropic's `stop_sequences`, the Responses API's
    `max_output_tokens`)."""

    max_tokens: int | None
    max_tokens_field: str = "max_tokens"
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_field: str = "stop"
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logprobs_field: str = "logprobs"
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def _requested(request: ChatCompletionRequest | CompletionRequest) -> RequestedSampling:
    """An OpenAI request's fields; 400 for top_logprobs without logprobs."""
    if isinstance(request, CompletionRequest):
        max_field = "max_tokens"
        requested = request.max_tokens if request.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs_field, logprobs = "logprobs", request.logprobs
    else:
        if request.top_logprobs and not request.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs_field, logprobs = "top_logprobs", (request.top_logprobs or 0) if request.logprobs else None
        max_field, requested = "max_tokens", request.max_tokens
        if request.max_completion_tokens is not None:
            max_field, requested = "max_completion_tokens", request.max_completion_tokens
    return RequestedSampling(
        max_tokens=requested, max_tokens_field=max_field, n=request.n, temperature=request.temperature,
        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p, seed=request.seed,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias, min_tokens=request.min_tokens,
        stop=(request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs, logprobs_field=logprobs_field,
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=request.skip_special_tokens if request.skip_special_tokens is not None else True,
    )


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    defaults: SamplingDefaults = GREEDY,
) -> SamplingParams:
    """The engine's parameters for an OpenAI `request` (see `build_sampling_params`). An absent
    max_tokens means "until the context is full" for chat and 16 for completions, as OpenAI does."""
    return build_sampling_params(_requested(request), num_prompt_tokens, max_model_len, vocab_size, defaults)


def build_sampling_params(
    requested: RequestedSampling,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    defaults: SamplingDefaults = GREEDY,
) -> SamplingParams:
    """The engine's parameters; raises ApiError(400) naming the client's field.

    Call after `check_prompt_fits`. An absent max_tokens means "until the context is full";
    absent sampling fields take `defaults`.
    """
    max_param = requested.max_tokens_field
    max_tokens = _max_tokens(requested.max_tokens, max_param, num_prompt_tokens, max_model_len)

    def pick(value, default):
        return value if value is not None else default

    try:
        params = SamplingParams(
            n=pick(requested.n, 1),
            temperature=pick(requested.temperature, defaults.temperature),
            top_p=pick(requested.top_p, defaults.top_p),
            top_k=pick(requested.top_k, defaults.top_k),
            min_p=pick(requested.min_p, defaults.min_p),
            seed=requested.seed,
            repetition_penalty=pick(requested.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=requested.presence_penalty or 0.0,
            frequency_penalty=requested.frequency_penalty or 0.0,
            logit_bias=_logit_bias(requested.logit_bias),
            min_tokens=requested.min_tokens or 0,
            max_tokens=max_tokens,
            stop=requested.stop,
            stop_token_ids=requested.stop_token_ids,
            ignore_eos=requested.ignore_eos,
            logprobs=requested.logprobs,
            include_stop_str_in_output=requested.include_stop_str_in_output,
            skip_special_tokens=requested.skip_special_tokens,
        )
        validate_token_ids(params, vocab_size)
    except ParameterError as error:
        param = {"logprobs": requested.logprobs_field, "max_tokens": max_param,
                 "stop": requested.stop_field}.get(error.field, error.field)
        message = str(error).split(": ", 1)[-1]
        raise bad_request(param, f"{param}: {message}") from None
    return params

"""From request fields to `SamplingParams`, with every rejection a 400 naming the client's field."""

from __future__ import annotations

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


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias keys are token ids; {excerpt(key)} is not an integer") from None
    return bias


GREEDY = SamplingDefaults()


def _client_fields(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, int, str, int | None]:
    """(max-tokens field name, requested max tokens, logprobs field name, engine logprobs) as the
    endpoint defines them; 400 for top_logprobs without logprobs."""
    if isinstance(request, CompletionRequest):
        requested = request.max_tokens if request.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return "max_tokens", requested, "logprobs", request.logprobs
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    if request.max_completion_tokens is not None:
        return "max_completion_tokens", request.max_completion_tokens, "top_logprobs", logprobs
    return "max_tokens", request.max_tokens, "top_logprobs", logprobs


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    defaults: SamplingDefaults = GREEDY,
) -> SamplingParams:
    """The engine's parameters for `request`; raises ApiError(400) naming the bad field.

    Call after `check_prompt_fits`. An absent max_tokens means "until the context is full"
    for chat and 16 for completions, as OpenAI does; absent sampling fields take `defaults`.
    """
    max_param, requested, logprobs_param, logprobs = _client_fields(request)
    max_tokens = _max_tokens(requested, max_param, num_prompt_tokens, max_model_len)
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    try:
        params = SamplingParams(
            n=request.n if request.n is not None else 1,
            temperature=request.temperature if request.temperature is not None else defaults.temperature,
            top_p=request.top_p if request.top_p is not None else defaults.top_p,
            top_k=request.top_k if request.top_k is not None else defaults.top_k,
            min_p=request.min_p if request.min_p is not None else defaults.min_p,
            seed=request.seed,
            repetition_penalty=(request.repetition_penalty if request.repetition_penalty is not None
                                else defaults.repetition_penalty),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            logit_bias=_logit_bias(request.logit_bias),
            min_tokens=request.min_tokens or 0,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=bool(request.ignore_eos),
            logprobs=logprobs,
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
            skip_special_tokens=request.skip_special_tokens if request.skip_special_tokens is not None else True,
        )
        validate_token_ids(params, vocab_size)
    except ParameterError as error:
        param = {"logprobs": logprobs_param, "max_tokens": max_param}.get(error.field, error.field)
        message = str(error).split(": ", 1)[-1]
        raise bad_request(param, f"{param}: {message}") from None
    return params

"""Every number and size a request can carry is bounded: out of range, non-finite or oversized
values get a 400 naming the field before any work is done, and no error message quotes a large
value back or names Atlas's internals."""

from __future__ import annotations

import re

import msgspec
import pytest

from atlas.adapters.http.errors import ApiError, ErrorDetail
from atlas.adapters.http.params import check_choices, sampling_params
from atlas.adapters.http.prompts import count_prompts, render_chat
from atlas.adapters.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from atlas.adapters.http.state import decode_body
from atlas.domain.requests import MAX_STOP_TOTAL_CHARS, ParameterError, SamplingParams

USER = {"role": "user", "content": "hi"}
INTERNALS = re.compile(r"atlas\.|\.py\b|msgspec|quart|werkzeug|hypercorn|Traceback|HfTokenizer", re.IGNORECASE)


def rejected(schema: type, body: dict | bytes) -> ErrorDetail:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    with pytest.raises(ApiError) as raised:
        decode_body(raw, schema)
    assert raised.value.status == 400
    detail = raised.value.detail
    assert not INTERNALS.search(detail.message), detail.message
    return detail


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.01), ("top_p", 0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", 2.01),
    ("repetition_penalty", 0), ("repetition_penalty", 1e-300), ("repetition_penalty", 0.09),
    ("repetition_penalty", 10.5), ("top_k", -2), ("top_k", 2**31), ("n", 0), ("n", 129),
    ("max_tokens", 0), ("max_tokens", 2**31), ("max_completion_tokens", 0), ("min_tokens", -1),
    ("top_logprobs", -1), ("top_logprobs", 21), ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]),
])
def test_numbers_outside_their_documented_range_name_the_field(field, value):
    detail = rejected(ChatCompletionRequest, {"messages": [USER], field: value})
    assert detail.param.split("[")[0] == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("literal", [b"1e999", b"-1e999", b"NaN", b"Infinity"])
def test_non_finite_numbers_are_a_400(field, literal):
    body = b'{"messages":[{"role":"user","content":"x"}],"' + field.encode() + b'":' + literal + b"}"
    detail = rejected(ChatCompletionRequest, body)
    assert detail.param in (field, None)  # NaN / Infinity are not JSON at all: no field to name


def test_a_non_finite_logit_bias_is_a_400():
    assert rejected(ChatCompletionRequest, b'{"messages":[{"role":"user"}],"logit_bias":{"5":-1e999}}').param.startswith(
        "logit_bias")
    assert rejected(CompletionRequest, {"prompt": "x", "logit_bias": {"5": 101}}).param.startswith("logit_bias")


def test_completions_bounds_name_the_field():
    assert rejected(CompletionRequest, {"prompt": "x", "logprobs": 21}).param == "logprobs"
    assert rejected(CompletionRequest, {"prompt": "x", "best_of": 129}).param == "best_of"
    assert rejected(CompletionRequest, {"prompt": []}).param == "prompt"
    assert rejected(DetokenizeRequest, {"tokens": [-1]}).param == "tokens[0]"


@pytest.mark.parametrize("body,param", [
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["ok", "x" * 1025]}, "stop[1]"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": [""]}, "stop[0]"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"messages": [USER] * 8193}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]}, "messages[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 513}, "tools"),
])
def test_oversized_lists_and_strings_name_the_field(body, param):
    assert rejected(ChatCompletionRequest, {"messages": [USER], **body}).param == param


def test_a_megabyte_stop_string_is_refused_by_the_schema_and_by_sampling_params():
    assert rejected(CompletionRequest, {"prompt": "x", "stop": "x" * (1 << 20)}).param == "stop"
    with pytest.raises(ParameterError, match="1024 characters"):
        SamplingParams(stop=("x" * (1 << 20),))


def test_a_repetition_penalty_too_small_for_float32_logits_is_refused_by_sampling_params_too():
    """1e-300 is 0 in float32: dividing a seen token's logit by it made the row's logits inf."""
    SamplingParams(repetition_penalty=0.1)
    for penalty in (1e-300, 0.05):
        with pytest.raises(ParameterError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=penalty)


def test_stop_strings_together_are_bounded_too():
    stops = ["x" * 1000] * 5
    assert sum(map(len, stops)) > MAX_STOP_TOTAL_CHARS
    request = decode_body(msgspec.json.encode({"messages": [USER], "stop": stops}), ChatCompletionRequest)
    with pytest.raises(ApiError) as raised:
        sampling_params(request, 1, 100, 50)
    assert raised.value.detail.param == "stop" and str(MAX_STOP_TOTAL_CHARS) in raised.value.detail.message


def test_prompts_times_n_over_the_cap_names_the_flag():
    check_choices(2, 128, 256)
    for num_prompts, n in ((3, 128), (257, None), (1, 9)):
        with pytest.raises(ApiError) as raised:
            check_choices(num_prompts, n, 256 if n != 9 else 8)
        assert raised.value.detail.param == "n" and "--max-choices-per-request" in raised.value.detail.message
    assert count_prompts("one") == 1 and count_prompts([1, 2, 3]) == 1 and count_prompts(["a", "b"]) == 2
    with pytest.raises(ApiError, match="at most 256 prompts"):
        count_prompts(["a"] * 257)


@pytest.mark.parametrize("schema,body", [
    (ChatCompletionRequest, {"messages": [{"role": "w" * 100_000, "content": "x"}]}),
    (ChatCompletionRequest, {"messages": [USER], "k" * 100_000: 1}),
    (ChatCompletionRequest, {"messages": [USER], "tool_choice": "t" * 100_000}),
    (TokenizeRequest, {"prompt": 5, "messages": [{"role": "user", "content": {"x": "y" * 100_000}}]}),
])
def test_error_messages_quote_at_most_a_few_dozen_characters(schema, body):
    detail = rejected(schema, body)
    assert len(detail.message) < 400 and len(detail.param or "") < 400


class _Tokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
        return "".join(m["content"] for m in messages)


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "self"])
async def test_chat_template_kwargs_cannot_replace_what_the_server_sets(key):
    messages = decode_body(msgspec.json.encode({"messages": [USER]}), ChatCompletionRequest).messages
    with pytest.raises(ApiError) as raised:
        await render_chat(_Tokenizer(), messages, None, True, {key: 1})
    detail = raised.value.detail
    assert detail.param == "chat_template_kwargs" and not INTERNALS.search(detail.message), detail.message


@pytest.fixture
def anyio_backend():
    return "asyncio"

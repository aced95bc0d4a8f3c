"""The HTTP layer's pure parts: request schemas and parameter mapping, error objects, auth,
metrics exposition, SSE frames spliced from templates, and the serve command's configuration checks."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from atlas.adapters.http import sse
from atlas.adapters.http.anthropic_schemas import ContentBlockDelta, TextDelta
from atlas.adapters.http.auth import AuthConfigError, BearerAuth, read_tokens_file
from atlas.adapters.http.engine_client import SamplingDefaults
from atlas.adapters.http.errors import ApiError, from_validation_error
from atlas.adapters.http.metrics import MetricsRegistry
from atlas.adapters.http.params import sampling_params
from atlas.adapters.http.prompts import message_dicts
from atlas.adapters.http.responses import ChatChunk, ChatChunkChoice, ChatDelta, Completion, CompletionChoice
from atlas.adapters.http.schemas import ChatCompletionRequest, CompletionRequest, unsupported_features
from atlas.adapters.http.state import decode_body
from atlas.app.arguments import ArgumentParser
from atlas.app.server import add_serve_arguments, exposure_warning, http_config, sampling_defaults
from atlas.domain.batch import TokenLogprobs
from atlas.domain.requests import FinishReason

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": USER, **fields}, ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **fields}, CompletionRequest)


def test_chat_defaults_fill_the_context_and_decode_greedily():
    params = sampling_params(chat(), num_prompt_tokens=30, max_model_len=100, vocab_size=50)
    assert params.max_tokens == 70 and params.temperature == 0.0 and params.n == 1 and params.logprobs is None


def test_absent_sampling_fields_take_the_served_defaults():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    params = sampling_params(chat(top_k=5), 1, 100, 50, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 5)


def test_sampling_defaults_read_generation_config_then_the_override(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}')
    assert sampling_defaults(tmp_path, None) == SamplingDefaults(temperature=0.6, top_p=0.95)
    assert sampling_defaults(tmp_path, '{"temperature": 0.2}') == SamplingDefaults(temperature=0.2, top_p=0.95)
    assert sampling_defaults(tmp_path / "elsewhere", None) == SamplingDefaults()
    for bad, message in (("{", "JSON"), ('{"temprature": 1}', "temprature"), ('{"top_p": 7}', "top_p"),
                         ("[1]", "object")):
        with pytest.raises(ValueError, match=message):
            sampling_defaults(tmp_path, bad)


def test_completions_default_to_sixteen_tokens():
    assert sampling_params(completion(), 5, 100, 50).max_tokens == 16


def test_max_completion_tokens_wins_and_is_named_in_errors():
    assert sampling_params(chat(max_tokens=5, max_completion_tokens=9), 10, 100, 50).max_tokens == 9
    with pytest.raises(ApiError) as error:
        sampling_params(chat(max_completion_tokens=95), 10, 100, 50)
    assert error.value.status == 400 and error.value.detail.param == "max_completion_tokens"
    assert "90" in error.value.detail.message and "10" in error.value.detail.message


def test_logprobs_map_to_the_engine_and_errors_use_the_client_names():
    assert sampling_params(chat(logprobs=True), 1, 100, 50).logprobs == 0
    assert sampling_params(chat(logprobs=True, top_logprobs=4), 1, 100, 50).logprobs == 4
    assert sampling_params(completion(logprobs=3), 1, 100, 50).logprobs == 3
    with pytest.raises(ApiError) as error:
        sampling_params(chat(top_logprobs=2), 1, 100, 50)
    assert error.value.detail.param == "top_logprobs"
    with pytest.raises(ApiError) as error:
        decode_body(b'{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}',
                    ChatCompletionRequest)
    assert error.value.detail.param == "top_logprobs"


def test_logit_bias_keys_are_token_ids_inside_the_vocabulary():
    params = sampling_params(chat(logit_bias={"7": -100, "3": 2.5}), 1, 100, 50)
    assert params.logit_bias == {7: -100, 3: 2.5}
    for bias in ({"x": 1}, {"50": 1}, {" 5": 1}, {"1_0": 1}, {"+5": 1}, {"\u0663": 1}, {"5.0": 1},
                 {"9" * 5000: 1}):
        with pytest.raises(ApiError) as error:
            sampling_params(chat(logit_bias=bias), 1, 100, 50)
        assert error.value.detail.param == "logit_bias"


def test_a_text_part_without_text_is_named_as_such_not_as_an_unsupported_type():
    for part, param, says in (({"type": "text", "text": None}, "messages[0].content[1].text", "needs its text"),
                              ({"type": "image_url"}, "messages[0].content[1]", "not supported")):
        request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
        with pytest.raises(ApiError) as error:
            message_dicts(request.messages)
        assert error.value.detail.param == param and says in error.value.detail.message


def test_stop_may_be_a_string_or_a_list():
    assert sampling_params(chat(stop="END"), 1, 100, 50).stop == ("END",)
    assert sampling_params(chat(stop=["a", "b"]), 1, 100, 50).stop == ("a", "b")


def test_unsupported_features_are_named():
    assert unsupported_features(chat(modalities=["text", "audio"]))[0] == "modalities"
    assert unsupported_features(chat(response_format={"type": "json_object"})) is None
    assert unsupported_features(chat(tool_choice={"type": "function", "function": {"name": "f"}})) is None
    assert unsupported_features(completion(suffix="x"))[0] == "suffix"
    assert unsupported_features(completion(best_of=2, n=2)) is None


def test_openai_client_extras_decode_and_typos_are_named():
    body = (b'{"messages":[{"role":"assistant","content":"x","refusal":null,"annotations":[]}],'
            b'"user":"u","metadata":{"a":"b"},"store":true,"service_tier":"auto","parallel_tool_calls":false}')
    assert decode_body(body, ChatCompletionRequest).user == "u"
    with pytest.raises(ApiError) as error:
        decode_body(b'{"messages":[{"role":"user"}],"temprature":1}', ChatCompletionRequest)
    assert error.value.detail.param == "temprature"


@pytest.mark.parametrize("body,param", [
    (b'{"messages":[{"role":1}]}', "messages[0].role"),
    (b'{"messages":[{"content":"x"}]}', "messages[0].role"),
    (b'{"messages":[{"role":"user"}],"stop":["a",3]}', "stop"),
    (b'{"messages":[{"role":"user"}],"stream_options":{"x":1}}', "stream_options.x"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.json.decode(body, type=ChatCompletionRequest)
    error = from_validation_error(raised.value)
    assert error.status == 400 and error.detail.param.startswith(param)


def test_bearer_auth_accepts_only_configured_tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\n tok-a \n\ntok-b\n")
    tokens = read_tokens_file(path)
    assert tokens == ["tok-a", "tok-b"]
    auth = BearerAuth(tokens)
    auth.check("Bearer tok-b")
    auth.check("bearer tok-a")
    for header in (None, "", "Bearer", "Bearer tok-c", "Basic tok-a", "tok-a", "Bearer tok-a tok-b"):
        with pytest.raises(ApiError) as error:
            auth.check(header)
        assert error.value.status == 401
    assert BearerAuth.protects("/v1/models") and BearerAuth.protects("/tokenize")
    assert not BearerAuth.protects("/health") and not BearerAuth.protects("/metrics")
    with pytest.raises(AuthConfigError, match="--auth-token"):
        BearerAuth([])
    with pytest.raises(AuthConfigError, match="--auth-tokens-file"):
        read_tokens_file(tmp_path / "missing")


def test_metrics_render_the_prometheus_text_format():
    registry = MetricsRegistry()
    counter = registry.counter("x_total", "things", ("kind",))
    counter.inc(("a",))
    counter.inc(('q"u\\ote',), 2)
    histogram = registry.histogram("lat_seconds", "latency", (0.1, 1.0))
    histogram.observe(0.05)
    histogram.observe(0.5, count=3)
    histogram.observe(7.0)
    registry.gauge("g", "a gauge", lambda: 2.5)
    lines = registry.render().splitlines()
    assert 'x_total{kind="a"} 1' in lines and 'x_total{kind="q\\"u\\\\ote"} 2' in lines
    assert "# TYPE lat_seconds histogram" in lines
    assert ['lat_seconds_bucket{le="0.1"} 1', 'lat_seconds_bucket{le="1"} 4', 'lat_seconds_bucket{le="+Inf"} 5'] == [
        line for line in lines if line.startswith("lat_seconds_bucket")]
    assert "lat_seconds_count 5" in lines and "lat_seconds_sum 8.55" in lines and "g 2.5" in lines
    with pytest.raises(ValueError):
        registry.counter("x_total", "again")


def parse_serve(*argv: str) -> argparse.Namespace:
    parser = ArgumentParser(prog="atlas serve")
    add_serve_arguments(parser)
    return parser.parse_args(["model", *argv])


def test_serve_defaults_bind_loopback_on_8888():
    args = parse_serve()
    assert (args.host, args.port, args.require_auth, args.single_process) == ("127.0.0.1", 8888, False, False)


def test_serve_configuration_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--auth-token"):
        http_config(parse_serve("--require-auth"))
    with pytest.raises(ValueError, match="--request-timeout"):
        http_config(parse_serve("--request-timeout", "0"))
    config = http_config(parse_serve("--require-auth", "--auth-token", "t1", "--dump", str(tmp_path / "d.jsonl")))
    assert config.auth_tokens == frozenset({"t1"}) and config.dump_path == tmp_path / "d.jsonl"
    assert http_config(parse_serve("--dump")).dump_path.name.startswith("atlas-dump-")


def test_exposure_warning_only_beyond_loopback():
    assert exposure_warning("127.0.0.1", False) is None and exposure_warning("::1", False) is None
    assert exposure_warning("localhost", False) is None
    assert "--require-auth" in exposure_warning("0.0.0.0", False)
    assert "--require-auth" not in exposure_warning("0.0.0.0", True)


class _Generation:
    def __init__(self, in_flight) -> None:
        self.in_flight, self.interrupted = in_flight, 0

    def interrupt(self) -> None:
        self.interrupted += 1
        self.in_flight.discard(self)  # as batches() does once it has sent its abort chunk


def test_the_drain_interrupts_what_is_left_and_anything_that_starts_after_it():
    import anyio

    from atlas.adapters.http.in_flight import InFlight

    in_flight = InFlight()
    early, late = _Generation(in_flight), _Generation(in_flight)
    in_flight.add(early)
    assert anyio.run(in_flight.drain, 0.0) == 1 and early.interrupted == 1 and len(in_flight) == 0
    in_flight.add(late)  # admitted before the shutdown, reached the engine after its timeout
    assert late.interrupted == 1 and len(in_flight) == 0


TEXTS = ["", "a", ' "quoted" \\ back', "line\nbreak\ttab\x00\x1f", "日本 🎉 café", "\u2028\u2029", "</script>",
         "\x00atlas text\x00", "\uffff"]


@pytest.mark.parametrize("text", TEXTS)
def test_text_frames_splice_the_text_exactly_where_encoding_the_structs_puts_it(text):
    shapes = [
        lambda t: sse.event(Completion("cmpl-1", 5, "m\"odel", [CompletionChoice(3, t, None, None)], None)),
        lambda t: sse.event(ChatChunk("chatcmpl-1", 5, "m", [ChatChunkChoice(0, ChatDelta(content=t))])),
        lambda t: sse.named_event("content_block_delta", ContentBlockDelta(2, TextDelta(t))),
    ]
    for make in shapes:
        assert sse.TextFrames(make)(text) == make(text)


def test_text_frames_need_the_text_in_the_frame_exactly_once():
    with pytest.raises(ValueError):
        sse.TextFrames(lambda t: sse.event({"a": "b"}))
    with pytest.raises(ValueError):
        sse.TextFrames(lambda t: sse.event({"a": t, "b": t}))

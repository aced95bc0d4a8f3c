"""POST /v1/messages and /v1/messages/count_tokens through the real anthropic SDK, on scripted output:
text, the exact stream event sequence, thinking and tool_use blocks, forced tools and budgets
up to the engine boundary, Anthropic's error shape and x-api-key."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest
from helpers.chat_templates import TOOL_TEMPLATES
from helpers.model_folders import with_chat_template
from helpers.scripted_engine import serving

from atlas.adapters.http import HttpConfig
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.chat_features import chat_features
from atlas.ports.grammar import ForcedToolCalls, FunctionTool

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather by city", "input_schema": WEATHER_SCHEMA}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT_CALL = f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n{CALL}"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def qwen3(tiny, tmp_path_factory):
    folder = with_chat_template(tiny, tmp_path_factory.mktemp("qwen3") / "model", TOOL_TEMPLATES["qwen3"],
                                think_tags=True)
    tokenizer = HfTokenizer.from_folder(folder)
    return tokenizer, chat_features(tokenizer, folder, tokenizer.vocab_size)


def sse_events(body: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each event of an Anthropic stream."""
    events = []
    for block in body.decode().split("\n\n"):
        if block:
            name_line, data_line = block.split("\n")
            assert name_line.startswith("event: ") and data_line.startswith("data: ")
            events.append((name_line[7:], json.loads(data_line[6:])))
    return events


def collapsed(names: list[str]) -> list[str]:
    """Runs of the same name as one."""
    return [name for idx, name in enumerate(names) if idx == 0 or names[idx - 1] != name]


@pytest.mark.anyio
async def test_a_text_answer_and_its_token_counts(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "It is sunny.") as served:
        message = await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER,
                                                          system="Be brief.")
        counted = await served.anthropic.messages.count_tokens(model="tiny", messages=USER, system="Be brief.")
        prompt = tokenizer.decode(served.engine.submitted[0].prompt_token_ids, skip_special_tokens=False)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "It is sunny.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == counted.input_tokens == len(served.engine.submitted[0].prompt_token_ids)
    assert message.usage.output_tokens == len(tokenizer.encode("It is sunny.", add_special_tokens=False)) + 1
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.anyio
async def test_prompt_tokens_from_the_prefix_cache_are_cache_reads(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "Hi.", cached_tokens=16) as served:
        message = await served.anthropic.messages.create(model="tiny", max_tokens=10, messages=USER)
        counted = await served.anthropic.messages.count_tokens(model="tiny", messages=USER)
        response = await served.http.post("/v1/messages", json={"max_tokens": 10, "messages": USER, "stream": True})
    assert message.usage.cache_read_input_tokens == 16
    assert message.usage.input_tokens + 16 == counted.input_tokens
    final = sse_events(response.content)[-2][1]["usage"]
    assert final["cache_read_input_tokens"] == 16 and final["input_tokens"] == counted.input_tokens - 16


@pytest.mark.anyio
async def test_the_stream_is_anthropics_event_sequence(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, THINK_TEXT_CALL) as served:
        response = await served.http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 300, "messages": USER, "tools": TOOLS, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.content)
    assert all(name == data["type"] for name, data in events)
    assert collapsed([name for name, _ in events]) == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    starts = [data for name, data in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert starts[2]["content_block"]["name"] == "get_weather" and starts[2]["content_block"]["id"].startswith("toolu_")
    deltas = [data for name, data in events if name == "content_block_delta"]
    kinds = collapsed([(d["index"], d["delta"]["type"]) for d in deltas])
    assert kinds == [(0, "thinking_delta"), (0, "signature_delta"), (1, "text_delta"), (2, "input_json_delta")]
    by_kind = {kind: "".join(d["delta"].get(field, "") for d in deltas if d["delta"]["type"] == kind)
               for kind, field in (("thinking_delta", "thinking"), ("text_delta", "text"),
                                   ("input_json_delta", "partial_json"))}
    assert by_kind == {"thinking_delta": "The user wants weather.", "text_delta": "Let me check.",
                       "input_json_delta": '{"city": "Paris"}'}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(tokenizer.encode(THINK_TEXT_CALL, add_special_tokens=False)) + 1


@pytest.mark.anyio
async def test_thinking_text_and_tool_use_blocks_streamed_and_not(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, THINK_TEXT_CALL) as served:
        whole = await served.anthropic.messages.create(model="tiny", max_tokens=300, messages=USER, tools=TOOLS)
        async with served.anthropic.messages.stream(model="tiny", max_tokens=300, messages=USER, tools=TOOLS) as stream:
            streamed = await stream.get_final_message()
    for message in (whole, streamed):
        thinking, text, use = message.content
        assert (thinking.type, thinking.thinking) == ("thinking", "The user wants weather.") and thinking.signature
        assert (text.type, text.text) == ("text", "Let me check.")
        assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
        assert use.id.startswith("toolu_") and message.stop_reason == "tool_use"


@pytest.mark.anyio
async def test_a_tool_use_and_its_result_render_for_the_next_turn(qwen3):
    tokenizer, features = qwen3
    history = [*USER,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    async with serving(tokenizer, features, "Sunny.") as served:
        await served.anthropic.messages.create(model="tiny", max_tokens=50, messages=history, tools=TOOLS)
        prompt = tokenizer.decode(served.engine.submitted[0].prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.index("<tool_response>\n21 C\n</tool_response>") < prompt.index("And tomorrow?")


@pytest.mark.anyio
async def test_tool_choice_any_and_tool_force_the_call_through_the_grammar(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, CALL) as served:
        forced = await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER, tools=TOOLS,
                                                         tool_choice={"type": "any"})
        await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER, tools=TOOLS,
                                               tool_choice={"type": "tool", "name": "get_weather"})
        await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER, tools=TOOLS,
                                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
        await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER, tools=TOOLS,
                                               tool_choice={"type": "none"})
        submitted = served.engine.submitted
        prompt = tokenizer.decode(submitted[3].prompt_token_ids, skip_special_tokens=False)
    weather = FunctionTool("get_weather", WEATHER_SCHEMA, "Weather by city")
    assert [r.constraint.grammar for r in submitted[:3]] == [
        ForcedToolCalls("hermes", (weather,), parallel=True), ForcedToolCalls("hermes", (weather,)),
        ForcedToolCalls("hermes", (weather,))]
    assert submitted[3].constraint is None and "get_weather" not in prompt
    assert forced.stop_reason == "tool_use" and forced.content[-1].input == {"city": "Paris"}


@pytest.mark.anyio
async def test_thinking_enabled_carries_its_budget_and_disabled_closes_the_block(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "<think>\nHm.\n</think>\n\nSunny.") as served:
        message = await served.anthropic.messages.create(model="tiny", max_tokens=2000, messages=USER,
                                                          thinking={"type": "enabled", "budget_tokens": 1024})
        await served.anthropic.messages.create(model="tiny", max_tokens=2000, messages=USER,
                                               thinking={"type": "disabled"})
        enabled, disabled = served.engine.submitted
        prompt = tokenizer.decode(disabled.prompt_token_ids, skip_special_tokens=False)
    assert enabled.constraint.thinking_budget == 1024 and enabled.constraint.reasoning is not None
    assert disabled.constraint is None and prompt.endswith("<think>\n\n</think>\n\n")
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[0].thinking == "Hm."


@pytest.mark.anyio
async def test_stop_sequences_and_max_tokens_are_the_stop_reason(qwen3):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "It is sunny today and warm.") as served:
        stopped = await served.anthropic.messages.create(model="tiny", max_tokens=100, messages=USER,
                                                          stop_sequences=["today"])
        cut = await served.anthropic.messages.create(model="tiny", max_tokens=3, messages=USER)
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "today",
                                                                                      "It is sunny ")
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.anyio
@pytest.mark.parametrize("body,status,kind,words", [
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": USER, "model": "claude-opus"}, 404, "not_found_error", "does not exist"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "image blocks are not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]}]}]},
     400, "invalid_request_error", "document blocks are not supported"),
    ({"max_tokens": 5, "messages": USER, "mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error", "MCP"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "tools[0]"),
])
async def test_errors_have_anthropics_shape(qwen3, body, status, kind, words):
    tokenizer, features = qwen3
    async with serving(tokenizer, features, "x") as served:
        response = await served.http.post("/v1/messages", json=body)
    error = response.json()
    assert response.status_code == status and error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"], error


@pytest.mark.anyio
async def test_x_api_key_is_accepted_beside_bearer_tokens(qwen3):
    tokenizer, features = qwen3
    config = HttpConfig(require_auth=True, auth_tokens=frozenset({"secret"}))
    async with serving(tokenizer, features, "Hi.", config) as served:
        denied = await served.http.post("/v1/messages", json={"max_tokens": 5, "messages": USER},
                                        headers={"x-api-key": "wrong"})
        missing = await served.http.post("/v1/messages/count_tokens", json={"messages": USER})
        by_key = await served.http.post("/v1/messages", json={"max_tokens": 5, "messages": USER},
                                        headers={"x-api-key": "secret"})
        by_bearer = await served.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                                           headers={"Authorization": "Bearer secret"})
        openai_by_key = await served.http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                                               headers={"x-api-key": "secret"})
    assert denied.status_code == missing.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error" and denied.json()["type"] == "error"
    assert by_key.status_code == by_bearer.status_code == openai_by_key.status_code == 200
    assert isinstance(by_key.json()["content"], list)


@pytest.mark.anyio
async def test_an_engine_failure_mid_stream_is_an_anthropic_error_event(qwen3):
    tokenizer, _ = qwen3
    from helpers.scripted_engine import ScriptedEngine, make_app, wait_healthy

    from atlas.domain.engine_events import EngineFailure

    engine = ScriptedEngine([], failure=EngineFailure("the engine fell over", False))
    app = make_app(engine, tokenizer, max_model_len=4096)
    async with app.test_app() as test_app:
        await wait_healthy(test_app.test_client())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as http:
            response = await http.post("/v1/messages", json={"max_tokens": 5, "messages": USER, "stream": True})
    events = sse_events(response.content)
    assert [name for name, _ in events] == ["message_start", "ping", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error" and "fell over" in events[-1][1]["error"]["message"]


@pytest.mark.anyio
async def test_a_quiet_stream_gets_pings_until_the_engine_writes_again(qwen3, monkeypatch):
    from helpers.scripted_engine import ScriptedEngine, make_app, wait_healthy

    from atlas.adapters.http import anthropic as anthropic_route

    tokenizer, features = qwen3
    monkeypatch.setattr(anthropic_route, "PING_INTERVAL_S", 0.05)
    engine = ScriptedEngine(tokenizer.encode(" the sea is blue", add_special_tokens=False), stall_after=2)
    app = make_app(engine, tokenizer, HttpConfig(request_timeout_s=0.5), chat=features, max_model_len=4096)
    async with app.test_app() as test_app:
        await wait_healthy(test_app.test_client())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as http:
            response = await http.post("/v1/messages", json={"max_tokens": 50, "messages": USER, "stream": True})
    names = [name for name, _ in sse_events(response.content)]
    deltas = [idx for idx, name in enumerate(names) if name == "content_block_delta"]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[deltas[-1] + 1:].count("ping") >= 3  # the engine stalled after two tokens
    assert sse_events(response.content)[-2][1]["delta"]["stop_reason"] == "max_tokens"  # --request-timeout

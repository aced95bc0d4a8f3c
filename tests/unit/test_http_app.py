"""The Quart app against a scripted engine: lifecycle, streaming shape, stops, timeouts, failures,
disconnects and metrics, with no model in the loop (the tokenizer is the tiny model's)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import anyio
import pytest
from helpers.scripted_engine import NUM_BLOCKS, ScriptedEngine, make_app, sse_payloads, wait_healthy

from atlas.adapters.http import HttpConfig
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.domain.engine_events import EngineFailure

SCRIPT_TEXT = " the sea is blue and the sky is grey over the hills today"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> HfTokenizer:
    return HfTokenizer.from_folder(model_dir)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.anyio
async def test_health_is_503_while_loading_then_200(tokenizer):
    gate = anyio.Event()
    app = make_app(ScriptedEngine(tokenizer.encode(SCRIPT_TEXT)), tokenizer, gate=gate)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        loading = await client.get("/health")
        assert loading.status_code == 503
        assert (await loading.get_json())["error"]["code"] == "loading"
        assert (await client.get("/health/live")).status_code == 200
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503 and "loading" in (await refused.get_json())["error"]["message"]
        assert (await client.get("/v1/models")).status_code == 503
        gate.set()
        await wait_healthy(client)
        models = await (await client.get("/v1/models")).get_json()
        assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256


@pytest.mark.anyio
async def test_a_failed_load_keeps_health_at_503_and_reports_it(tokenizer):
    fatal: list[str] = []
    app = make_app(ScriptedEngine([]), tokenizer, failure=MemoryError("the KV cache needs 3 GiB; lower --max-seq-len"),
                   fatal=fatal)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        with anyio.fail_after(10):
            while not fatal:
                await anyio.sleep(0.01)
        response = await client.get("/health")
        assert response.status_code == 503
        assert "--max-seq-len" in (await response.get_json())["error"]["message"]
    assert fatal == ["the KV cache needs 3 GiB; lower --max-seq-len"]


@pytest.mark.anyio
async def test_stream_shape_for_two_choices(tokenizer):
    script = tokenizer.encode(SCRIPT_TEXT)
    app = make_app(ScriptedEngine(script), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/chat/completions", json={
            **CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 200})
        assert response.status_code == 200 and response.content_type.startswith("text/event-stream")
        chunks = sse_payloads(await response.get_data())
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * len(script)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == tokenizer.decode(script)
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_priority_reaches_the_engine_and_usage_counts_cached_prompt_tokens_once(tokenizer):
    """With n choices the later ones reuse the first's blocks: the usage reports what the
    prompt found in the cache before the request, the fewest any choice found."""
    script = tokenizer.encode(SCRIPT_TEXT)
    engine = ScriptedEngine(script, cached_tokens=lambda request_id: 4 if request_id.endswith("-0") else 12)
    app = make_app(engine, tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/chat/completions", json={**CHAT, "n": 3, "priority": -2, "max_tokens": 3})
        usage = (await response.get_json())["usage"]
        response = await client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
        streamed = sse_payloads(await response.get_data())[-1]["usage"]
        bad = await client.post("/v1/chat/completions", json={**CHAT, "priority": "high"})
        metrics = (await (await client.get("/metrics")).get_data()).decode()
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert [r.priority for r in engine.submitted] == [-2, -2, -2, 0]
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 12}  # n = 1: its one choice's
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "priority"
    assert "atlas_prefix_cache_hits_total 40" in metrics  # 4 + 12 + 12 + 12, as the engine counts
    assert "# TYPE atlas_prefix_cache_queries_total counter" in metrics


@pytest.mark.anyio
async def test_a_stop_string_cuts_the_text_and_aborts_the_sequence(tokenizer):
    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT))
    app = make_app(engine, tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/completions", json={"prompt": "x", "stop": ["sky"], "max_tokens": 200})
        choice = (await response.get_json())["choices"][0]
    assert choice["text"] == " the sea is blue and the " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "sky"
    assert engine.aborted == [engine.submitted[0].request_id]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_the_request_timeout_ends_a_stalled_request_with_length(tokenizer, stream):
    script = tokenizer.encode(SCRIPT_TEXT)
    engine = ScriptedEngine(script, stall_after=3)
    app = make_app(engine, tokenizer, HttpConfig(request_timeout_s=0.3))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": stream})
        assert response.status_code == 200
        if stream:
            chunks = sse_payloads(await response.get_data())
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        else:
            choice = (await response.get_json())["choices"][0]
            text, finishes = choice["text"], [choice["finish_reason"]]
        metrics = await (await client.get("/metrics")).get_data()
    assert finishes == ["length"]
    assert text == tokenizer.decode(script[:3])
    assert engine.aborted == [engine.submitted[0].request_id]
    assert b'atlas_requests_aborted_total{cause="timeout"} 1' in metrics


@pytest.mark.anyio
@pytest.mark.parametrize("failure,status", [
    (EngineFailure("prompt: token id 900 is outside the vocabulary", True, "prompt"), 400),
    (EngineFailure("RuntimeError: device lost"), 503),
])
async def test_engine_failures_become_error_objects(tokenizer, failure, status):
    app = make_app(ScriptedEngine([], failure=failure), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == status
        error = (await response.get_json())["error"]
        assert failure.message in error["message"] and error["param"] == failure.field
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = sse_payloads(await streamed.get_data())
        assert failure.message in events[-1]["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("failure", [EngineFailure("prompt: token id 900 is outside the vocabulary", True, "prompt"),
                                     EngineFailure("RuntimeError: device lost")])
async def test_a_responses_stream_that_fails_ends_with_response_failed_numbered_in_order(tokenizer, failure):
    app = make_app(ScriptedEngine([], failure=failure), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        streamed = await client.post("/v1/responses", json={"model": "tiny", "input": "hello", "stream": True})
        body = (await streamed.get_data()).decode()
    events = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in body.split("\n\n") if frame]
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "error",
                                                  "response.failed"]
    assert [event["sequence_number"] for event in events] == [0, 1, 2, 3]
    error, failed = events[2], events[3]["response"]
    assert failure.message in error["message"] and error["param"] == failure.field
    assert failed["status"] == "failed" and failure.message in failed["error"]["message"]
    assert failed["error"]["code"] == error["code"] and failed["id"] == events[0]["response"]["id"]


@pytest.mark.anyio
async def test_a_client_that_disconnects_mid_stream_aborts_its_sequences(tokenizer):
    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT) * 50, stall_after=5)
    app = make_app(engine, tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        async with client.request("/v1/chat/completions", method="POST") as connection:
            await connection.send(json.dumps({**CHAT, "n": 3, "stream": True}).encode())
            await connection.send_complete()
            received = b""
            while received.count(b"data: ") < 3 * 4:
                received += await connection.receive()
            await connection.disconnect()
        with anyio.fail_after(5):
            while len(engine.aborted) < 3:
                await anyio.sleep(0.01)
        metrics = (await (await client.get("/metrics")).get_data()).decode()
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
    assert not engine.active and len(engine.router) == 0
    assert 'atlas_requests_aborted_total{cause="client_disconnected"} 1' in metrics
    assert "atlas_requests_in_flight 0" in metrics


@pytest.mark.anyio
async def test_metrics_count_requests_and_latencies(tokenizer):
    app = make_app(ScriptedEngine(tokenizer.encode(SCRIPT_TEXT)), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})).status_code == 200
        assert (await client.post("/v1/chat/completions", json={**CHAT, "n": 0})).status_code == 400
        response = await client.get("/metrics")
        text = (await response.get_data()).decode()
    assert response.content_type.startswith("text/plain")
    assert 'atlas_requests_total{endpoint="/v1/chat/completions",status="200"} 3' in text
    assert 'atlas_requests_total{endpoint="/v1/chat/completions",status="400"} 1' in text
    assert "atlas_time_to_first_token_seconds_count 3" in text
    assert "atlas_inter_token_latency_seconds_count 9" in text  # 3 gaps in each of the 3 answers
    assert 'atlas_sequences_finished_total{finish_reason="length"} 3' in text
    assert f"atlas_kv_blocks_free {NUM_BLOCKS}" in text


@pytest.mark.anyio
async def test_the_dump_records_a_streamed_answer_whole_as_the_stream_sent_it(tokenizer, tmp_path):
    script = tokenizer.encode(SCRIPT_TEXT)
    app = make_app(ScriptedEngine(script), tokenizer, HttpConfig(dump_path=tmp_path / "dump.jsonl"))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        completion = await client.post("/v1/completions",
                                       json={"prompt": "x", "n": 2, "max_tokens": 100, "stream": True})
        chat = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        completion_chunks, chat_chunks = sse_payloads(await completion.get_data()), sse_payloads(await chat.get_data())
    records = [json.loads(line) for line in (tmp_path / "dump.jsonl").read_text().splitlines()]
    assert [(r["endpoint"], r["stream"]) for r in records] == [("completions", True), ("chat", True)]
    texts = ["".join(c["choices"][0]["text"] for c in completion_chunks
                     if c["choices"] and c["choices"][0]["index"] == index) for index in range(2)]
    chat_text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat_chunks if c["choices"])
    assert texts == [tokenizer.decode(script)] * 2 and chat_text == tokenizer.decode(script)
    assert [choice["text"] for choice in records[0]["response"]["choices"]] == texts
    dumped = records[1]["response"]["choices"][0]
    assert dumped["message"]["content"] == chat_text and dumped["finish_reason"] == "length"


@pytest.mark.anyio
async def test_curl_style_form_content_type_is_read_as_json(tokenizer):
    app = make_app(ScriptedEngine(tokenizer.encode(SCRIPT_TEXT)), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/v1/chat/completions", data=json.dumps({**CHAT, "max_tokens": 3}),
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert response.status_code == 200
        assert (await response.get_json())["usage"]["completion_tokens"] == 3


@pytest.mark.anyio
async def test_chat_template_kwargs_reach_the_template(model_dir, tmp_path):
    folder = tmp_path / "shouting"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shouting = HfTokenizer.from_folder(folder)
    engine = ScriptedEngine(shouting.encode(SCRIPT_TEXT))
    app = make_app(engine, shouting)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        for kwargs in ({}, {"chat_template_kwargs": {"shout": True}}):
            response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, **kwargs})
            assert response.status_code == 200
        counted = await client.post("/tokenize", json={"messages": CHAT["messages"],
                                                       "chat_template_kwargs": {"shout": True}})
        assert (await counted.get_json())["tokens"] == list(engine.submitted[1].prompt_token_ids)
    plain, loud = (shouting.decode(r.prompt_token_ids) for r in engine.submitted)
    assert (plain, loud) == ("hello", "LOUD hello")


@pytest.mark.anyio
async def test_tokenize_and_detokenize_round_trip(tokenizer):
    app = make_app(ScriptedEngine([]), tokenizer)
    text = "The capital of France is Paris, 42 and 日本!"
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        tokenized = await (await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})).get_json()
        assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 5
        assert tokenized["tokens"] == tokenizer.encode(text) and tokenized["max_model_len"] == 256
        back = await (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).get_json()
        assert back == {"prompt": text}


@pytest.mark.anyio
async def test_a_reply_without_tool_calls_has_no_tool_calls_field(tokenizer):
    app = make_app(ScriptedEngine(tokenizer.encode(SCRIPT_TEXT)), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        answer = await (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).get_json()
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] and "tool_calls" not in message


@pytest.mark.anyio
async def test_choices_over_the_flag_are_a_400_naming_it(tokenizer):
    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT))
    app = make_app(engine, tokenizer, HttpConfig(max_choices_per_request=4))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        chat = await client.post("/v1/chat/completions", json={**CHAT, "n": 5})
        completion = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        fits = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        for response in (chat, completion):
            assert response.status_code == 400
            error = (await response.get_json())["error"]
            assert error["param"] == "n" and "--max-choices-per-request" in error["message"]
        assert fits.status_code == 200 and len((await fits.get_json())["choices"]) == 4
    assert len(engine.submitted) == 4  # the refused requests reached neither tokenizer nor engine


@pytest.mark.anyio
async def test_detokenize_takes_at_most_a_context_of_ids(tokenizer):
    app = make_app(ScriptedEngine([]), tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        response = await client.post("/detokenize", json={"tokens": [5] * 257})  # the context is 256
        assert response.status_code == 400 and (await response.get_json())["error"]["param"] == "tokens"


@pytest.mark.anyio
async def test_openapi_describes_every_registered_route_with_the_request_schemas(tokenizer):
    import msgspec

    from atlas.adapters.http.schemas import ChatCompletionRequest

    app = make_app(ScriptedEngine([]), tokenizer, HttpConfig(require_auth=True, auth_tokens=frozenset({"t"})))
    registered = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
                  for rule in app.url_map.iter_rules() for method in rule.methods - {"HEAD", "OPTIONS"}
                  if rule.endpoint != "static"}
    async with app.test_app() as test_app:
        client = test_app.test_client()
        document = await (await client.get("/openapi.json")).get_json()  # open without the token
    described = {(path, method) for path, item in document["paths"].items() for method in item}
    assert described == registered and ("/v1/chat/completions", "post") in described
    chat = document["paths"]["/v1/chat/completions"]["post"]
    body_schema = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema["$ref"] == "#/components/schemas/ChatCompletionRequest" and "anyOf" in body_schema
    _, generated = msgspec.json.schema_components([ChatCompletionRequest], ref_template="#/components/schemas/{name}")
    served = document["components"]["schemas"]
    for name, schema in generated.items():
        assert {**served[name], "properties": {}} == {**schema, "properties": {}}
        for field, field_schema in schema["properties"].items():
            if field not in ("model", "max_tokens", "max_completion_tokens"):  # these describe the served model
                assert served[name]["properties"][field] == field_schema, field
    chat_properties = served["ChatCompletionRequest"]["properties"]
    assert chat_properties["temperature"]["anyOf"][0]["maximum"] == 2.0
    assert chat_properties["model"]["anyOf"][0] == {"enum": ["tiny"]}
    assert chat_properties["max_tokens"]["anyOf"][0]["maximum"] == 255  # the context is 256 tokens
    assert chat["security"] == [{"bearer": []}, {"apiKey": []}] and "security" not in document["paths"]["/health"]["get"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    messages = document["paths"]["/v1/messages"]["post"]["responses"]
    assert messages["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorBody")
    assert served["MessagesRequest"]["properties"]["max_tokens"] == {"type": "integer", "minimum": 1, "maximum": 255}
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages/count_tokens"} <= set(document["paths"])
    links = document["paths"]["/v1/responses"]["post"]["responses"]["200"]["links"]
    assert links["getResponse"]["parameters"] == {"response_id": "$response.body#/id"}


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_shutdown_refuses_new_requests_then_ends_the_rest_with_abort(tokenizer, stream):
    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT), stall_after=3)
    app = make_app(engine, tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        async with anyio.create_task_group() as group:
            responses = []

            async def request() -> None:
                responses.append(await client.post("/v1/chat/completions",
                                                   json={**CHAT, "n": 2, "max_tokens": 50, "stream": stream}))

            group.start_soon(request)
            with anyio.fail_after(10):
                while len(engine.submitted) < 2:
                    await anyio.sleep(0.01)
            drained = []
            group.start_soon(lambda: _drain(app, drained))
            with anyio.fail_after(10):
                while (await client.get("/health")).status_code == 200:
                    await anyio.sleep(0.01)
            refused = await client.post("/v1/chat/completions", json=CHAT)
            health = await client.get("/health")
        metrics = (await (await client.get("/metrics")).get_data()).decode()
    assert refused.status_code == 503 and (await refused.get_json())["error"]["code"] == "shutting_down"
    assert (await health.get_json())["error"]["code"] == "shutting_down"
    assert drained == [1]
    (response,) = responses
    if stream:
        chunks = sse_payloads(await response.get_data())  # ends with data: [DONE]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    else:
        finishes = [choice["finish_reason"] for choice in (await response.get_json())["choices"]]
    assert finishes == ["abort", "abort"]
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
    assert 'atlas_requests_aborted_total{cause="shutdown"} 1' in metrics and "atlas_requests_in_flight 0" in metrics


async def _drain(app, drained: list) -> None:
    from atlas.adapters.http import shut_down

    drained.append(await shut_down(app, timeout_s=0.3))


@pytest.mark.anyio
async def test_shutdown_lets_a_request_that_finishes_in_time_finish(tokenizer):
    script = tokenizer.encode(SCRIPT_TEXT)
    engine = ScriptedEngine(script)
    app = make_app(engine, tokenizer)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_healthy(client)
        async with anyio.create_task_group() as group:
            responses = []

            async def request() -> None:
                responses.append(await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                            "stream": True}))

            group.start_soon(request)
            with anyio.fail_after(10):
                while not engine.submitted:
                    await anyio.sleep(0.001)
            drained = []
            await _drain_with(app, drained, 30.0)
    chunks = sse_payloads(await responses[0].get_data())
    assert drained == [0] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(script)


async def _drain_with(app, drained: list, timeout_s: float) -> None:
    from atlas.adapters.http import shut_down

    with anyio.fail_after(20):
        drained.append(await shut_down(app, timeout_s))

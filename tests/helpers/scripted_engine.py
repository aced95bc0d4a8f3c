"""The HTTP app against a scripted engine: every sequence plays the same token ids, so a test
controls exactly what the "model" writes (tool-call markup, a reasoning block) with no model."""

from __future__ import annotations

import json
from collections import deque
from contextlib import asynccontextmanager

import anyio

from atlas.adapters.http import HttpConfig, ServedModel, create_app
from atlas.adapters.http.engine_client import ChatFeatures
from atlas.app.engine_actor import OutputRouter
from atlas.domain.batch import SequenceOutput
from atlas.domain.engine import EngineStats
from atlas.domain.engine_events import EngineFailure, EngineHealth
from atlas.domain.requests import FinishReason, Request

NUM_BLOCKS = 100


class ScriptedEngine:
    """An EngineClient that plays every sequence the same token ids, one per tick.

    `stall_after` stops producing after that many tokens; `failure` answers every request
    with that EngineFailure instead. The script ends with finish_reason length, or, given an
    `eos_token_id`, with that token and finish_reason stop (unless max_tokens cuts it first).
    """

    def __init__(self, token_ids: list[int], stall_after: int | None = None,
                 failure: EngineFailure | None = None, eos_token_id: int | None = None,
                 cached_tokens=lambda request_id: 0) -> None:
        self.token_ids = list(token_ids) + ([eos_token_id] if eos_token_id is not None else [])
        self.ends_with_stop = eos_token_id is not None
        self.cached_tokens = cached_tokens  # request id -> prompt tokens it reports as cached
        self.stall_after = stall_after
        self.failure = failure
        self.router = OutputRouter()
        self.active: dict[str, tuple[Request, deque[int], int, bool]] = {}
        self.aborted: list[str] = []
        self.submitted: list[Request] = []

    def submit(self, requests):
        stream = self.router.open([r.request_id for r in requests])
        for request in requests:
            self.submitted.append(request)
            if self.failure is not None:
                self.router.fail(request.request_id, self.failure)
                return stream
            script = self.token_ids[: request.sampling.max_tokens or len(self.token_ids)]
            stops = self.ends_with_stop and len(script) == len(self.token_ids)  # not cut by max_tokens
            self.active[request.request_id] = (request, deque(script), len(script), stops)
        return stream

    def abort(self, request_ids):
        for request_id in self.router.close(request_ids):
            self.aborted.append(request_id)
            self.active.pop(request_id, None)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.active), 0, NUM_BLOCKS, NUM_BLOCKS - len(self.active), 0, 0, 0, 0,
                           num_prefix_cache_queries=sum(len(r.prompt_token_ids) for r in self.submitted),
                           num_prefix_cache_hits=sum(self.cached_tokens(r.request_id) for r in self.submitted))

    def health(self) -> EngineHealth:
        return EngineHealth(True, True, "ok")

    async def run(self) -> None:
        while True:
            await anyio.sleep(0.001)
            outputs = []
            for request_id, (request, queue, num_scripted, stops) in list(self.active.items()):
                done = num_scripted - len(queue)
                if not queue or (self.stall_after is not None and done >= self.stall_after):
                    continue
                token = queue.popleft()
                finish = None if queue else FinishReason.STOP if stops else FinishReason.LENGTH
                outputs.append(SequenceOutput(request_id, (token,), finish, len(request.prompt_token_ids), done + 1,
                                              num_cached_tokens=self.cached_tokens(request_id)))
                if finish is not None:
                    del self.active[request_id]
            self.router.deliver(outputs)


DEFAULT_CONFIG = HttpConfig()


def make_app(engine, tokenizer, config=DEFAULT_CONFIG, gate: anyio.Event | None = None,
             failure: Exception | None = None, fatal: list | None = None, chat: ChatFeatures = ChatFeatures(),
             max_model_len: int = 256):
    """The app serving `engine` as the model "tiny" (context `max_model_len`, `chat` features)."""

    @asynccontextmanager
    async def launch():
        if gate is not None:
            await gate.wait()
        if failure is not None:
            raise failure
        model = ServedModel("tiny", frozenset({"/models/tiny"}), tokenizer, max_model_len, tokenizer.vocab_size, 7, 0,
                            chat=chat)
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run)
            yield model, engine
            group.cancel_scope.cancel()

    return create_app(config, launch, fatal.append if fatal is not None else None)


async def wait_healthy(client) -> None:
    with anyio.fail_after(10):
        while (await client.get("/health")).status_code != 200:
            await anyio.sleep(0.01)


def sse_payloads(body: bytes) -> list:
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]




class Served:
    """The app under test with SDK clients on it (no socket: httpx's ASGI transport)."""

    def __init__(self, engine: ScriptedEngine, app) -> None:
        import anthropic
        import httpx
        import httpx2
        import openai

        self.engine = engine
        self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny")
        self._http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://tiny")
        self.openai = openai.AsyncOpenAI(base_url="http://tiny/v1", api_key="unused", http_client=self._http,
                                         max_retries=0)
        self.anthropic = anthropic.AsyncAnthropic(base_url="http://tiny", api_key="unused", http_client=self._http2,
                                                  max_retries=0)

    @property
    def http(self):
        return self._http

    async def close(self) -> None:
        await self._http.aclose()
        await self._http2.aclose()


@asynccontextmanager
async def serving(tokenizer, chat: ChatFeatures, script_text: str, config=DEFAULT_CONFIG, cached_tokens: int = 0):
    """The app with SDK clients (`Served`): the scripted model writes `script_text`, then its
    end-of-sequence token; each request reports `cached_tokens` prompt tokens from the cache."""
    engine = ScriptedEngine(tokenizer.encode(script_text, add_special_tokens=False),
                            eos_token_id=min(tokenizer.eos_token_ids), cached_tokens=lambda request_id: cached_tokens)
    app = make_app(engine, tokenizer, config, chat=chat, max_model_len=4096)
    async with app.test_app() as test_app:
        await wait_healthy(test_app.test_client())
        served = Served(engine, app)
        try:
            yield served
        finally:
            await served.close()

"""The Quart app: routes, auth, error objects, and the lifespan that loads the model.

The lifespan starts the engine launcher in the background and returns at once, so the server
listens while the model loads: `/health` answers 503 ("loading the model") until it is ready,
and API requests get a 503 error object rather than a refused connection.

Every error a client can cause is an OpenAI error object with a 4xx status: handlers raise
`ApiError`; Quart's own errors (404 unknown route, 405 wrong method, 408 slow body, 413 body
too large) are converted here (hypercorn's, for malformed HTTP, in `h11_protocol`);
anything unexpected is logged and answered with a 500 error object.

The routes are the table `ROUTES`; /openapi.json is generated from it and the Structs.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import Callable

import anyio
import msgspec
from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from atlas.adapters.http import anthropic, responses_api, service
from atlas.adapters.http.anthropic_schemas import CountTokensBody, MessageOut, MessagesBody, StreamEvent, TokenCountOut
from atlas.adapters.http.auth import BearerAuth
from atlas.adapters.http.chat import chat_completions
from atlas.adapters.http.completions import completions
from atlas.adapters.http.engine_client import EngineLauncher
from atlas.adapters.http.errors import AnthropicErrorBody, ApiError, excerpt, status_error
from atlas.adapters.http.openapi import ApiDocument, Route
from atlas.adapters.http import page
from atlas.adapters.http.responses import ChatChunk, ChatCompletion, Completion
from atlas.adapters.http.responses_api_schemas import (
    ResponseDeleted,
    ResponseObject,
    ResponsesBody,
    ResponsesStreamEvent,
)
from atlas.adapters.http.schemas import ChatCompletionBody, CompletionBody, DetokenizeRequest, TokenizeBody
from atlas.adapters.http.service import Detokenized, HealthStatus, ModelCard, ModelList, Tokenized
from atlas.adapters.http.state import HttpConfig, ServerState

log = logging.getLogger("atlas.http")
JSON = "application/json"
DUMPED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
                "/v1/responses": "responses"}
BODY_TIMEOUT_S = 60  # a body still arriving then gets 408
ENGINE_STOP_TIMEOUT_S = 1.0  # after the drain the engine has no work; its process exits on EOF regardless


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """The error object in the shape of the route asked for (Anthropic's on /v1/messages)."""
    return Response(error.body_for(request.path), error.status, headers or {}, content_type=JSON)


def create_app(
    config: HttpConfig,
    launcher: EngineLauncher,
    on_fatal: Callable[[str], None] | None = None,
) -> Quart:
    """The ASGI app. `launcher` loads the model and runs the engine while its context is open;
    `on_fatal(message)` is called when loading fails or the engine stops (the `atlas serve`
    command shuts the server down then; under a bare hypercorn the server stays up with
    /health at 503)."""
    app = Quart("atlas")
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        BODY_TIMEOUT=BODY_TIMEOUT_S,
        RESPONSE_TIMEOUT=None,  # streams last as long as generation; --request-timeout bounds them
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    state = ServerState(config, ApiDocument(ROUTES, "Atlas", _version(), config.require_auth))
    app.extensions["atlas"] = state
    lifespan = _Lifespan(state, launcher, on_fatal)
    app.before_serving(lifespan.start)
    app.after_serving(lifespan.stop)
    _add_hooks(app, state)
    _add_routes(app, state)
    _add_error_handlers(app, state)
    return app


async def shut_down(app: Quart, timeout_s: float, abort_now: anyio.Event | None = None) -> int:
    """Start shutting down: new API requests get 503 and /health 503; generations in flight
    may finish within `timeout_s` (or until `abort_now` is set), then those left end with
    finish_reason "abort". Returns how many were ended so; the caller then stops the server."""
    state: ServerState = app.extensions["atlas"]
    return await state.shut_down(timeout_s, abort_now)


def _add_hooks(app: Quart, state: ServerState) -> None:
    auth = BearerAuth(state.config.auth_tokens) if state.config.require_auth else None

    @app.before_request
    async def check_auth() -> None:
        g.started_s = time.monotonic()
        if auth is not None and auth.protects(request.path):
            auth.check(request.headers.get("Authorization"), request.headers.get("x-api-key"))

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state.metrics.requests.inc((rule, str(response.status_code)))
        return response


ROUTES = (
    Route("POST", "/v1/chat/completions", "createChatCompletion", "Chat completion (OpenAI)", chat_completions,
          ChatCompletionBody, ChatCompletion, ChatChunk),
    Route("POST", "/v1/completions", "createCompletion", "Text completion (OpenAI, legacy)", completions,
          CompletionBody, Completion, Completion),
    Route("POST", "/v1/messages", "createMessage", "Messages (Anthropic)", anthropic.messages, MessagesBody,
          MessageOut, StreamEvent, error=AnthropicErrorBody),
    Route("POST", "/v1/messages/count_tokens", "countMessageTokens", "A Messages request's prompt tokens (Anthropic)",
          anthropic.count_tokens, CountTokensBody, TokenCountOut, error=AnthropicErrorBody),
    Route("POST", "/v1/responses", "createResponse", "Responses (OpenAI)", responses_api.create_response,
          ResponsesBody, ResponseObject, ResponsesStreamEvent,
          links=(("getResponse", "response_id", "id"), ("deleteResponse", "response_id", "id"))),
    Route("GET", "/v1/responses/<response_id>", "getResponse", "A stored response", responses_api.get_response,
          response=ResponseObject),
    Route("DELETE", "/v1/responses/<response_id>", "deleteResponse", "Forget a stored response",
          responses_api.delete_response, response=ResponseDeleted),
    Route("GET", "/v1/models", "listModels", "The served model", service.list_models, response=ModelList),
    Route("GET", "/v1/models/<path:model_id>", "retrieveModel", "One model by id", service.get_model,
          response=ModelCard),
    Route("POST", "/tokenize", "tokenize", "Text or chat messages to token ids", service.tokenize_endpoint,
          TokenizeBody, Tokenized),
    Route("POST", "/detokenize", "detokenize", "Token ids to text", service.detokenize_endpoint,
          DetokenizeRequest, Detokenized),
    Route("GET", "/health", "health", "200 when the model is loaded and the engine makes progress",
          service.health, response=HealthStatus),
    Route("GET", "/health/live", "live", "200 while the process answers HTTP", service.live,
          response=HealthStatus),
    Route("GET", "/metrics", "metrics", "Prometheus metrics", service.metrics, media_type="text/plain"),
    Route("GET", "/openapi.json", "openapi", "This document", service.openapi),
    Route("GET", "/", "chatPage", "The chat page (outside auth: it holds no secrets)", page.index_page,
          media_type="text/html"),
    Route("GET", "/static/<name>", "chatPageAsset", "The chat page's scripts and styles", page.static_asset,
          media_type="text/javascript"),
)


def _add_routes(app: Quart, state: ServerState) -> None:
    for route in ROUTES:
        app.add_url_rule(route.path, route.name, _view(state, route), methods=[route.method])


def _view(state: ServerState, route: Route):
    if route.request is None:
        async def view(**path_parameters: str) -> Response:
            return await route.handler(state, **path_parameters)
    else:
        async def view(**path_parameters: str) -> Response:
            body = await request.get_data()  # kept for the request, so an error can be dumped with it
            return await route.handler(state, body, **path_parameters)
    return view


async def _dump_error(state: ServerState, error: ApiError) -> None:
    """--dump records failed generation requests too, with their error object."""
    endpoint = DUMPED_PATHS.get(request.path)
    if state.dump is None or endpoint is None:
        return
    body = b""
    if error.status != 413:  # the body is what was too large: record the request without it
        try:
            body = await request.get_data()
        except HTTPException:
            body = b""
    started_s = g.get("started_s", time.monotonic())
    state.dump.write(endpoint, error.status, False, started_s, body, msgspec.json.decode(error.body()))


def _add_error_handlers(app: Quart, state: ServerState) -> None:
    config = state.config

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        await _dump_error(state, error)
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        headers = {}
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            headers["Allow"] = ", ".join(error.valid_methods)
        path = excerpt(request.path)
        message = {404: f"no route {request.method} {path}",
                   405: f"{request.method} is not allowed on {path}",
                   408: f"the request body did not arrive within {BODY_TIMEOUT_S} s",
                   413: f"the request body is larger than the limit of {config.max_body_bytes} bytes"}.get(
            status, error.description or error.name)
        api_error = status_error(status, message)
        await _dump_error(state, api_error)
        return _error_response(api_error, headers)

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return _error_response(ApiError(500, f"internal error: {type(error).__name__}", "server_error"))


class _Lifespan:
    """Starts the launcher in a background task and stops it at shutdown."""

    def __init__(self, state: ServerState, launcher: EngineLauncher, on_fatal: Callable[[str], None] | None) -> None:
        self._state = state
        self._launcher = launcher
        self._on_fatal = on_fatal
        self._task: asyncio.Task | None = None
        self._stopping: asyncio.Event | None = None

    async def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, ENGINE_STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("the engine did not stop within %.0fs", ENGINE_STOP_TIMEOUT_S)
        if self._state.dump is not None:
            self._state.dump.close()

    async def _run(self) -> None:
        state = self._state
        try:
            async with self._launcher() as (model, engine):
                state.attach(model, engine)
                log.info("ready: serving %s (context %d tokens)", model.name, model.max_model_len)
                await self._stopping.wait()
                state.detach()
        except Exception as error:  # loading failed, or the engine stopped serving
            state.detach()
            message = _describe(error)
            state.load_error = message
            if state.model is None:
                log.error("the model failed to load: %s", message)
            else:
                log.error("the engine stopped: %s", message)
            if self._on_fatal is not None:
                self._on_fatal(message)


def _version() -> str:
    try:
        return importlib.metadata.version("atlas")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _describe(error: BaseException) -> str:
    """The innermost error's message (task groups wrap failures in exception groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return str(error) or type(error).__name__

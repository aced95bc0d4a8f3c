"""The small endpoints: models, tokenize/detokenize, health and metrics."""

from __future__ import annotations

import anyio
import msgspec
from quart import Response

from atlas.adapters.http.errors import UNAVAILABLE, ApiError, bad_request, excerpt
from atlas.adapters.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from atlas.adapters.http.prompts import check_token_ids, render_chat, tokenize
from atlas.adapters.http.schemas import DetokenizeRequest, TokenizeRequest
from atlas.adapters.http.sse import encode_json
from atlas.adapters.http.state import ServerState, decode_body

JSON = "application/json"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    root: str
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class Tokenized(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(msgspec.Struct):
    prompt: str


class HealthStatus(msgspec.Struct):
    status: str  # "ok" (/health) or "alive" (/health/live)


def _json(payload: object, status: int = 200) -> Response:
    return Response(encode_json(payload), status, content_type=JSON)


def _card(state: ServerState) -> ModelCard:
    model = state.model
    if model is None:
        raise ApiError(503, f"the server is not ready: {state.health().detail}", UNAVAILABLE)
    root = sorted(model.aliases)[0] if model.aliases else model.name
    return ModelCard(model.name, model.created_s, "atlas", model.max_model_len, root)


async def list_models(state: ServerState) -> Response:
    return _json(ModelList([_card(state)]))


async def get_model(state: ServerState, model_id: str) -> Response:
    card = _card(state)
    if state.model is None or not state.model.accepts(model_id):
        raise ApiError(404, f"the model {excerpt(model_id)} does not exist", "invalid_request_error", "model",
                       "model_not_found")
    return _json(card)


async def tokenize_endpoint(state: ServerState, body: bytes) -> Response:
    """`{"prompt": text}` or `{"messages": [...]}` (rendered with the chat template) -> ids."""
    request = decode_body(body, TokenizeRequest)
    model, _ = state.ready(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("prompt", "send exactly one of 'prompt' or 'messages'")
    if request.messages is not None:
        text = await render_chat(model.tokenizer, request.messages, None, request.add_generation_prompt,
                                 request.chat_template_kwargs)
        add_special = bool(request.add_special_tokens)
    else:
        text = request.prompt or ""
        add_special = request.add_special_tokens if request.add_special_tokens is not None else True
    ids = await tokenize(model.tokenizer, text, add_special)
    strs = [model.tokenizer.token_to_text(t) for t in ids] if request.return_token_strs else None
    return _json(Tokenized(len(ids), model.max_model_len, ids, strs))


async def detokenize_endpoint(state: ServerState, body: bytes) -> Response:
    """`{"tokens": ids}` -> text; at most the model's context of ids."""
    request = decode_body(body, DetokenizeRequest)
    model, _ = state.ready(request.model)
    if len(request.tokens) > model.max_model_len:
        raise bad_request("tokens", f"at most {model.max_model_len} token ids (the model's context; "
                                    f"got {len(request.tokens)})")
    check_token_ids(request.tokens, model.vocab_size, "tokens")
    text = await anyio.to_thread.run_sync(lambda: model.tokenizer.decode(request.tokens, skip_special_tokens=False))
    return _json(Detokenized(text))


async def health(state: ServerState) -> Response:
    """200 when the model is loaded and the engine makes progress; 503 saying why otherwise."""
    status = state.health()
    if status.is_healthy:
        return _json(HealthStatus("ok"))
    code = "shutting_down" if state.shutting_down else "loading" if not status.ready else "stalled"
    error = ApiError(503, status.detail, UNAVAILABLE, code=code)
    return Response(error.body(), 503, content_type=JSON)


async def live(state: ServerState) -> Response:
    """200 while the process serves HTTP at all (loading, stalled or shutting down too)."""
    return _json(HealthStatus("alive"))


async def openapi(state: ServerState) -> Response:
    """The OpenAPI document, with the served model's name and context once it is loaded."""
    return Response(state.api_document.json(state.model), 200, content_type=JSON)


async def metrics(state: ServerState) -> Response:
    return Response(state.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

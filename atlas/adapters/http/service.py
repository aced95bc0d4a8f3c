"""The small endpoints: models, tokenize/detokenize, health and metrics."""

from __future__ import annotations

import msgspec
from quart import Response

from atlas.adapters.http.errors import UNAVAILABLE, ApiError, bad_request
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


def _json(payload: object, status: int = 200) -> Response:
    return Response(encode_json(payload), status, content_type=JSON)


def _card(state: ServerState) -> ModelCard:
    model = state.model
    if model is None:
        raise ApiError(503, f"the server is not ready: {state.health().detail}", UNAVAILABLE)
    root = sorted(model.aliases)[0] if model.aliases else model.name
    return ModelCard(model.name, model.created_s, "atlas", model.max_model_len, root)


def list_models(state: ServerState) -> Response:
    return _json(ModelList([_card(state)]))


def get_model(state: ServerState, model_id: str) -> Response:
    card = _card(state)
    if state.model is None or not state.model.accepts(model_id):
        raise ApiError(404, f"the model '{model_id}' does not exist", "invalid_request_error", "model",
                       "model_not_found")
    return _json(card)


async def tokenize_endpoint(state: ServerState, body: bytes) -> Response:
    """`{"prompt": text}` or `{"messages": [...]}` (rendered with the chat template) -> ids."""
    request = decode_body(body, TokenizeRequest)
    model, _ = state.ready(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("prompt", "send exactly one of 'prompt' or 'messages'")
    if request.messages is not None:
        text = render_chat(model.tokenizer, request.messages, None, request.add_generation_prompt,
                           request.chat_template_kwargs)
        add_special = bool(request.add_special_tokens)
    else:
        text = request.prompt or ""
        add_special = request.add_special_tokens if request.add_special_tokens is not None else True
    ids = await tokenize(model.tokenizer, text, add_special)
    strs = [model.tokenizer.token_to_text(t) for t in ids] if request.return_token_strs else None
    return _json(Tokenized(len(ids), model.max_model_len, ids, strs))


async def detokenize_endpoint(state: ServerState, body: bytes) -> Response:
    request = decode_body(body, DetokenizeRequest)
    model, _ = state.ready(request.model)
    check_token_ids(request.tokens, model.vocab_size, "tokens")
    return _json(Detokenized(model.tokenizer.decode(request.tokens, skip_special_tokens=False)))


def health(state: ServerState) -> Response:
    """200 when the model is loaded and the engine makes progress; 503 saying why otherwise."""
    status = state.health()
    if status.is_healthy:
        return _json({"status": "ok"})
    error = ApiError(503, status.detail, UNAVAILABLE, code="loading" if not status.ready else "stalled")
    return Response(error.body(), 503, content_type=JSON)


def metrics(state: ServerState) -> Response:
    return Response(state.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

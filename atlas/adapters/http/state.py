"""The server's shared state: configuration, the loaded model and engine, metrics, dump."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from atlas.adapters.http.dump import DumpWriter
from atlas.adapters.http.engine_client import EngineClient, ServedModel
from atlas.adapters.http.errors import (
    UNAVAILABLE,
    ApiError,
    bad_request,
    excerpt,
    from_validation_error,
    malformed_json,
)
from atlas.adapters.http.in_flight import InFlight
from atlas.adapters.http.openapi import ApiDocument
from atlas.adapters.http.response_store import ResponseStore
from atlas.adapters.http.responses import TokenTexts
from atlas.adapters.http.server_metrics import ServerMetrics
from atlas.domain.engine import EngineStats
from atlas.domain.engine_events import EngineHealth
from atlas.domain.fan_out import SeedSource

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_CHOICES = 256  # prompts x n in one request
DEFAULT_MAX_STORED_RESPONSES = 1000
DEFAULT_MAX_STORED_RESPONSES_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP side's settings (the engine's are `EngineSettings`)."""

    served_name: str | None = None  # --model-name; default: the model spec
    request_timeout_s: float | None = None  # --request-timeout: a request still running then ends
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    max_choices_per_request: int = DEFAULT_MAX_CHOICES  # prompts x n; more is a 400
    require_auth: bool = False
    auth_tokens: frozenset[str] = frozenset()
    dump_path: Path | None = None
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES  # /v1/responses store; 0 stores none
    max_stored_responses_bytes: int = DEFAULT_MAX_STORED_RESPONSES_BYTES


class ServerState:
    """Everything handlers share. `model`/`engine` are None until the lifespan has loaded them."""

    def __init__(self, config: HttpConfig, api_document: ApiDocument) -> None:
        self.config = config
        self.api_document = api_document  # /openapi.json
        self.model: ServedModel | None = None
        self.engine: EngineClient | None = None
        self.load_error: str | None = None
        self.seeds = SeedSource(None, _fresh_seed)
        self.token_texts: TokenTexts | None = None  # set with the model, before the engine
        self.in_flight = InFlight()
        self.shutting_down = False
        self.metrics = ServerMetrics(self.engine_stats, lambda: self.health().is_healthy, lambda: len(self.in_flight))
        self.dump = DumpWriter(config.dump_path) if config.dump_path is not None else None
        self.responses = ResponseStore(config.max_stored_responses, config.max_stored_responses_bytes)

    def attach(self, model: ServedModel, engine: EngineClient) -> None:
        self.token_texts = TokenTexts(model.tokenizer)
        self.seeds = SeedSource(model.seed, _fresh_seed)
        self.model, self.engine = model, engine

    def detach(self) -> None:
        self.engine = None

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    async def shut_down(self, timeout_s: float, abort_now: anyio.Event | None = None) -> int:
        """Refuse new requests (503) and drain those in flight (`InFlight.drain`); returns how
        many were interrupted at the timeout."""
        self.shutting_down = True
        return await self.in_flight.drain(timeout_s, abort_now)

    def health(self) -> EngineHealth:
        if self.shutting_down:
            return EngineHealth(False, False, "shutting down")
        if self.load_error is not None:
            return EngineHealth(False, False, f"the model failed to load: {self.load_error}")
        if self.engine is None:
            return EngineHealth(False, False, "loading the model" if self.model is None else "shutting down")
        return self.engine.health()

    def ready(self, requested_model: str | None) -> tuple[ServedModel, EngineClient]:
        """The model and engine for a request naming `requested_model`; 503 while loading,
        shutting down or after an engine failure, 404 for another model's name."""
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", UNAVAILABLE, code="shutting_down")
        model, engine = self.model, self.engine
        if model is None or engine is None:
            raise ApiError(503, f"the server is not ready: {self.health().detail}", UNAVAILABLE)
        health = engine.health()
        if not health.ready:
            raise ApiError(503, f"the engine is not available: {health.detail}", UNAVAILABLE)
        if not model.accepts(requested_model):
            raise ApiError(404, f"the model {excerpt(requested_model)} does not exist; this server serves "
                                f"'{model.name}' (GET /v1/models)", "invalid_request_error", "model",
                           "model_not_found")
        return model, engine


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_body(body: bytes, schema: type):
    """The request body as `schema`; a 400 naming the field (or saying the JSON is malformed)."""
    if not body.strip():
        raise bad_request(None, "the request body is empty; send a JSON object", code="invalid_json")
    decoder = _decoders.get(schema)
    if decoder is None:
        decoder = _decoders[schema] = msgspec.json.Decoder(schema)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as error:
        raise from_validation_error(error) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise malformed_json(error) from None


def now_s() -> int:
    return int(time.time())


def _fresh_seed() -> int:
    return secrets.randbits(64)

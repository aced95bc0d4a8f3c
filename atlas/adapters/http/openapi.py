"""The route table and the OpenAPI document built from it and the request/response Structs.

Every route the app serves is one `Route`; the app registers exactly these, and
`/openapi.json` describes exactly these, with JSON Schemas msgspec generates from the same
Structs that validate the bodies, so the document cannot drift from what the server accepts.
A later API (Anthropic messages, Responses) is more rows in the table.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from atlas.adapters.http.auth import BearerAuth
from atlas.adapters.http.engine_client import ServedModel
from atlas.adapters.http.errors import ErrorBody

OPENAPI_VERSION = "3.1.0"
_PATH_PARAMETER = re.compile(r"<(?:\w+:)?(\w+)>")  # Quart's <path:model_id> -> OpenAPI's {model_id}


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: where, what it takes and answers, and the coroutine that serves it.

    `handler(state, body, **path_parameters)` when `request` is set, else
    `handler(state, **path_parameters)`; it returns the response or raises ApiError.
    """

    method: str
    path: str  # Quart's syntax: /v1/models/<path:model_id>
    name: str  # the operationId
    summary: str
    handler: Callable[..., Awaitable[Any]]
    request: Any = None  # the JSON body's Struct (Annotated with cross-field rules for the schema)
    response: type | None = None  # the 200 JSON body's Struct
    stream: type | None = None  # the Struct of each SSE event when the body asks `stream: true`
    media_type: str = "application/json"  # of the 200 body when it is not a Struct
    error: type = ErrorBody  # the error object's shape on this route (Anthropic's on /v1/messages)
    # OpenAPI links: routes whose path parameter a field of this route's 200 body supplies
    links: tuple[tuple[str, str, str], ...] = ()  # (operationId, path parameter, field of the 200 body)

    @property
    def openapi_path(self) -> str:
        return _PATH_PARAMETER.sub(r"{\1}", self.path)

    @property
    def path_parameters(self) -> list[str]:
        return _PATH_PARAMETER.findall(self.path)


class ApiDocument:
    """/openapi.json as bytes, rebuilt when the served model changes (None while loading)."""

    def __init__(self, routes: Sequence[Route], title: str, version: str, bearer_auth: bool) -> None:
        self._routes, self._title, self._version, self._bearer_auth = routes, title, version, bearer_auth
        self._cached: tuple[ServedModel | None, bytes] | None = None

    def json(self, model: ServedModel | None) -> bytes:
        if self._cached is None or self._cached[0] is not model:
            document = openapi_document(self._routes, self._title, self._version, self._bearer_auth, model)
            self._cached = (model, msgspec.json.encode(document))
        return self._cached[1]


def openapi_document(routes: Sequence[Route], title: str, version: str, bearer_auth: bool,
                     model: ServedModel | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`; with `bearer_auth`, protected routes require it.
    Once a `model` is loaded, request bodies' `model` is its name (or absent) and the token
    counts are bounded by its context."""
    types = list(dict.fromkeys(t for route in routes for t in (route.request, route.response, route.stream, route.error)
                               if t))
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    schema_of = dict(zip(types, schemas, strict=True))
    if model is not None:
        for route in routes:
            if route.request is not None:
                struct = typing.get_args(route.request)[0] if typing.get_origin(route.request) else route.request
                _describe_served_model(components[struct.__name__]["properties"], model)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation = _operation(route, schema_of)
        if bearer_auth and BearerAuth.protects(route.path):
            operation["security"] = [{"bearer": []}, {"apiKey": []}]  # either header
        paths.setdefault(route.openapi_path, {})[route.method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if bearer_auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                      "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return document


def _describe_served_model(properties: dict[str, Any], model: ServedModel) -> None:
    if "model" in properties:
        properties["model"] = {"anyOf": [{"enum": [model.name]}, {"type": "null"}], "default": None}
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # at most the context minus the prompt
        if name not in properties:
            continue
        bounded = {"type": "integer", "minimum": 1, "maximum": model.max_model_len - 1}
        if "default" in properties[name]:  # optional (null allowed); Anthropic's max_tokens is required
            bounded = {"anyOf": [bounded, {"type": "null"}], "default": None}
        properties[name] = bounded


def _event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes an event stream per event):
    `data:` holds a chunk, an error object (an error after the 200 went out), or `[DONE]`;
    Anthropic's and the Responses API's events also name their type in `event:`."""
    return {
        "description": "with `stream: true`: an event per chunk (OpenAI's chat and completions end with "
                       "`data: [DONE]`)",
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}},
            ]},
        },
    }


def _operation(route: Route, schema_of: dict[type, dict[str, Any]]) -> dict[str, Any]:
    if route.response is not None:
        success = {"application/json": {"schema": schema_of[route.response]}}
    else:
        success = {route.media_type: {"schema": {"type": "string"} if route.media_type != "application/json"
                                      else {"type": "object"}}}
    if route.stream is not None:
        success["text/event-stream"] = {"schema": _event_schema(schema_of[route.stream], schema_of[route.error])}
    ok: dict[str, Any] = {"description": "OK", "content": success}
    if route.links:
        ok["links"] = {
            operation_id: {"operationId": operation_id, "parameters": {parameter: f"$response.body#/{field}"}}
            for operation_id, parameter, field in route.links
        }
    operation: dict[str, Any] = {
        "operationId": route.name,
        "summary": route.summary,
        "responses": {
            "200": ok,
            "default": {"description": "an error object (4xx for the client's mistakes, 503 while not ready)",
                        "content": {"application/json": {"schema": schema_of[route.error]}}},
        },
    }
    if route.path_parameters:
        operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for name in route.path_parameters]
    if route.request is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema_of[route.request]}}}
    return operation

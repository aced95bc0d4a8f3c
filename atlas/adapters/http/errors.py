"""Error objects: every failure a client can cause becomes a 4xx with one of these.

OpenAI's shape (every route but Anthropic's):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Anthropic's, on /v1/messages routes (the type follows the status; the field is named in the message):

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: ..."}}

Handlers raise `ApiError`; the app turns it (and Quart's own 404/405/413) into the route's
shape. A `msgspec.ValidationError` names the offending field in its path
(`$.messages[0].role`); the field becomes `param` so clients can point at it.
"""

from __future__ import annotations

import re

import msgspec

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"

MAX_ECHO_CHARS = 80  # of a client's value quoted in an error message
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED_FIELD = re.compile(r"(unknown|missing required) field `([^`]*)`")


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    error: AnthropicErrorDetail
    type: str = "error"


# Anthropic's error types by status (its API documents these); 503 is its "overloaded".
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message, error_type, param, code)

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorBody(self.detail))

    def anthropic(self) -> AnthropicErrorBody:
        """The error in Anthropic's shape: the type follows the status, the field leads the message."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.detail.message
        param = self.detail.param
        if param and not message.startswith(param):
            message = f"{param}: {message}"
        return AnthropicErrorBody(AnthropicErrorDetail(kind, message))

    def body_for(self, path: str) -> bytes:
        """The body in the shape of the route at `path`."""
        if path.startswith(ANTHROPIC_PATH_PREFIX):
            return msgspec.json.encode(self.anthropic())
        return self.body()


def excerpt(value: object) -> str:
    """`value` quoted for an error message, cut to MAX_ECHO_CHARS so a huge value is not echoed."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def from_validation_error(error: msgspec.ValidationError) -> ApiError:
    """A 400 naming the field msgspec rejected (`$.stop[2]` -> param "stop[2]"); a field name or
    value from the body is cut to a few dozen characters."""
    text = str(error)
    match = _PATH.search(text)
    named = _NAMED_FIELD.search(text)
    if named is not None:
        prefix = match.group(1) + "." if match and match.group(1) else ""
        field = _cut(prefix + named.group(2))
        if named.group(1) == "unknown":
            return bad_request(field, f"unknown field '{field}': this server does not accept it")
        return bad_request(field, f"missing required field '{field}'")
    if match is None:
        return bad_request(None, f"invalid request body: {_cut(text)}")
    field = _cut(match.group(1)) or None
    message = _cut(text[: match.start()])  # msgspec quotes an invalid enum value whole
    return bad_request(field, f"invalid value for '{field}': {message}" if field else message)


def _cut(text: str) -> str:
    return text if len(text) <= 2 * MAX_ECHO_CHARS else text[: 2 * MAX_ECHO_CHARS] + "..."


def malformed_json(error: Exception) -> ApiError:
    return bad_request(None, f"the request body is not valid JSON ({error})", code="invalid_json")


def status_error(status: int, message: str) -> ApiError:
    """An error for a status Quart raised (404, 405, 413, ...)."""
    if status == 404:
        return ApiError(404, message, NOT_FOUND, code="not_found")
    if status >= 500:
        return ApiError(status, message, SERVER_ERROR)
    return ApiError(status, message, INVALID_REQUEST)

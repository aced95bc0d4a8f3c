"""Bearer-token auth for the API routes; health and metrics stay open for probes and scrapers.

A token is accepted as `Authorization: Bearer <token>` (OpenAI's clients) or as `x-api-key:
<token>` (Anthropic's).

Tokens come from `--auth-token` (repeatable) and `--auth-tokens-file` (one per line, `#`
comments). A presented token is compared with every configured one in constant time, and the
comparison does not stop at the first match, so timing reveals neither a token nor its index.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from atlas.adapters.http.errors import ApiError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class AuthConfigError(ValueError):
    """Auth is required but cannot work; the message names the flag to fix."""


def read_tokens_file(path: Path | str) -> list[str]:
    """Tokens from a file, one per line; blank lines and `#` comments are skipped."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise AuthConfigError(f"--auth-tokens-file {path}: cannot read it ({error})") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


class BearerAuth:
    """Checks `Authorization: Bearer <token>` on protected paths."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = [token.encode("utf-8") for token in tokens]
        if not self._tokens:
            raise AuthConfigError(
                "--require-auth needs at least one token: pass --auth-token TOKEN or --auth-tokens-file PATH "
                "(or set ATLAS_AUTH_TOKEN)"
            )

    @staticmethod
    def protects(path: str) -> bool:
        return path.startswith(PROTECTED_PREFIXES)

    def check(self, authorization: str | None, api_key: str | None = None) -> None:
        """Raises ApiError(401) unless the Authorization header (a bearer token) or the
        x-api-key header carries a configured token."""
        if not authorization and not api_key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <token>' or 'x-api-key: <token>'",
                           "invalid_request_error", code="invalid_api_key")
        matched = False
        if authorization:
            scheme, _, presented = authorization.partition(" ")
            matched |= self._matches(presented.strip()) and scheme.lower() == "bearer"
        if api_key:
            matched |= self._matches(api_key.strip())
        if not matched:
            raise ApiError(401, "invalid API key" if api_key else "invalid bearer token", "invalid_request_error",
                           code="invalid_api_key")

    def _matches(self, presented: str) -> bool:
        presented_bytes = presented.encode("utf-8", "replace")
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(presented_bytes, token)
        return matched

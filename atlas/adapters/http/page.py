"""The chat page: `GET /` and its assets, static files shipped as package data (`static/`).

The page holds no secrets, so its routes are outside bearer auth (auth.PROTECTED_PREFIXES);
the API calls it makes carry the token the user types into it. The files are read once when
the app is built. Every answer carries an ETag and `Cache-Control: no-cache`: a browser
revalidates (a 304, no body) and so never runs a page older than the server it talks to.
The Content-Security-Policy allows only this origin's scripts, styles and API, so nothing a
model writes can load or run anything even if it reached the DOM as markup.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from quart import Response, request
from werkzeug.exceptions import NotFound

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
INDEX = "index.html"


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str  # quoted, as sent in the ETag header

    def response(self) -> Response:
        """200 with the body, or 304 when the request already holds this version."""
        headers = {**HEADERS, "ETag": self.etag}
        if self.etag in request.headers.get("If-None-Match", ""):
            return Response(b"", 304, headers)
        return Response(self.body, 200, headers, content_type=self.content_type)


def load_static() -> dict[str, StaticFile]:
    """The page's files by name; a file whose suffix has no known content type is left out."""
    files = {}
    for entry in (resources.files(__package__) / "static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            files[entry.name] = StaticFile(body, CONTENT_TYPES[suffix], etag)
    return files


@functools.cache
def _files() -> dict[str, StaticFile]:
    return load_static()


async def index_page(state: object) -> Response:
    """`GET /`: the page."""
    return _files()[INDEX].response()


async def static_asset(state: object, name: str) -> Response:
    """`GET /static/<name>`: one of the page's scripts and styles; 404 for any other name."""
    file = _files().get(name)
    if file is None:
        raise NotFound()
    return file.response()

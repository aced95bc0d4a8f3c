"""`GET /` serves the chat page and its assets: content types, revalidation, no auth.

What the page does in a browser is tests/e2e/test_chat_page.py's business."""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

import pytest

from atlas.adapters.http import HttpConfig, create_app
from atlas.adapters.http.page import CONTENT_TYPES

AUTH = HttpConfig(require_auth=True, auth_tokens=frozenset({"secret"}))
REFERENCE = re.compile(r"""(?:src|href)="(static/[^"]+)"|from "\./([^"]+)\"""")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@asynccontextmanager
async def no_model():
    raise RuntimeError("this test serves no model")
    yield


@pytest.fixture
def client():
    return create_app(AUTH, no_model).test_client()


async def fetch_all(client) -> dict[str, object]:
    """The page and, transitively, every static file it or its scripts refer to, by path."""
    responses = {"/": await client.get("/")}
    pending = ["/"]
    while pending:
        body = (await responses[pending.pop()].get_data()).decode()
        for match in REFERENCE.finditer(body):
            path = "/" + (match[1] or "static/" + match[2])
            if path not in responses:
                responses[path] = await client.get(path)
                pending.append(path)
    return responses


@pytest.mark.anyio
async def test_the_page_and_everything_it_loads_are_served_with_their_types_without_auth(client):
    responses = await fetch_all(client)
    assert set(responses) == {"/", "/static/chat.css", "/static/chat.js", "/static/stream.js"}
    for path, response in responses.items():
        assert response.status_code == 200, path
        suffix = ".html" if path == "/" else "." + path.rpartition(".")[2]
        assert response.content_type == CONTENT_TYPES[suffix]
        assert response.headers["Cache-Control"] == "no-cache"
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    assert (await client.get("/v1/models")).status_code == 401  # the API itself stays protected


@pytest.mark.anyio
async def test_a_browser_holding_the_current_version_gets_a_304_without_a_body(client):
    first = await client.get("/static/chat.js")
    etag = first.headers["ETag"]
    again = await client.get("/static/chat.js", headers={"If-None-Match": etag})
    assert again.status_code == 304 and await again.get_data() == b""
    assert again.headers["ETag"] == etag
    stale = await client.get("/static/chat.js", headers={"If-None-Match": '"an-older-version"'})
    assert stale.status_code == 200 and await stale.get_data() == await first.get_data()
    assert (await client.get("/static/chat.css")).headers["ETag"] != etag


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/static/missing.js", "/static/../app.py", "/static/page.py"])
async def test_anything_but_the_pages_files_is_a_404_error_object(client, path):
    response = await client.get(path)
    assert response.status_code == 404
    assert (await response.get_json())["error"]["message"].startswith("no route GET ")

"""The composition root: settings, wiring, actors, the CLI and the ASGI app.

`atlas.app.serve` is the ASGI app for `hypercorn atlas.app:serve`, configured from ATLAS_*
variables. It is built on first access, so importing `atlas.app` stays cheap.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "serve":
        from atlas.app.server import app_from_environment

        app = app_from_environment()
        globals()["serve"] = app
        return app
    raise AttributeError(f"module 'atlas.app' has no attribute {name!r}")

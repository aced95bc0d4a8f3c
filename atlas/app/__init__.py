"""The composition root: settings, wiring, actors, the CLI and the ASGI app.

`atlas.app.serve` is the ASGI app for `hypercorn atlas.app:serve`, configured from ATLAS_*
variables. It is a thin callable that builds the Quart app on its first call (the lifespan
startup), so importing `atlas.app` stays cheap and hypercorn, which looks the name up in the
module's namespace, finds it.
"""

from __future__ import annotations

from typing import Any


class LazyAsgiApp:
    """An ASGI app that builds the real one (`atlas.app.server.app_from_environment`) when first
    called. A bad ATLAS_* value fails that first call (hypercorn's lifespan startup)."""

    def __init__(self) -> None:
        self._app: Any = None

    def build(self) -> Any:
        """The Quart app, built now if it has not been yet."""
        if self._app is None:
            from atlas.app.server import app_from_environment

            try:
                self._app = app_from_environment()
            except SystemExit as exit_:  # argparse rejected an ATLAS_* value (the message is on stderr)
                raise RuntimeError(f"invalid ATLAS_* configuration (exit status {exit_.code})") from None
        return self._app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.build()(scope, receive, send)


serve = LazyAsgiApp()

"""The OpenAI-compatible HTTP surface (Quart): chat, completions, models, tokenize, health, metrics."""

from atlas.adapters.http.app import create_app, shut_down
from atlas.adapters.http.engine_client import EngineClient, EngineLauncher, ServedModel
from atlas.adapters.http.state import HttpConfig

__all__ = ["EngineClient", "EngineLauncher", "HttpConfig", "ServedModel", "create_app", "shut_down"]

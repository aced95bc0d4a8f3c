"""Live servers for end-to-end tests: `atlas serve` subprocesses on free loopback ports.

The tiny random-weight model (atlas.app.bench.tiny_model) makes each engine step cost well
under a millisecond on the mock backend, so the suite exercises the server, not the model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model

STARTUP_TIMEOUT_S = 90.0
MAX_SEQ_LEN = 512
# The device the live servers run on: the mock everywhere, `cuda` on a GPU machine
# (ATLAS_E2E_DEVICE=cuda python -m pytest tests/e2e), where the tiny model gets 64-dim heads.
DEVICE = os.environ.get("ATLAS_E2E_DEVICE", "mock")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra)
    return env


class LiveServer:
    """One `atlas serve` process; `url` is its base URL, `v1` the OpenAI base URL."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 command: list[str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.v1 = self.url + "/v1"
        self.log_path = log_path
        base = command or [sys.executable, "-m", "atlas.app.cli", "serve"]
        full = [*base, *args] if command else [*base, *args, "--port", str(self.port)]
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(full, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env or server_environment(), start_new_session=True)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> LiveServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server was not healthy within {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (`name value` lines), as floats."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    shape = TinyModelShape(hidden_size=256, intermediate_size=512) if DEVICE == "cuda" else TinyModelShape()
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", shape=shape)


def tiny_server_args(model: Path, *extra: str) -> list[str]:
    return [str(model), "--device", DEVICE, "--kv-cache-gb", "0.25", "--max-seq-len", str(MAX_SEQ_LEN),
            "--model-name", "tiny", *extra]


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """The shared server: engine in its own process, as deployed."""
    live = LiveServer(tiny_server_args(tiny_model), tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield live
    live.stop()

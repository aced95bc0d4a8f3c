"""SIGTERM with streams in flight, against a live `atlas serve` of SmolLM2 on the mock: new
requests get 503, each open stream ends with a final chunk (finish_reason "abort") and
`data: [DONE]`, one log line says what happens, and the process exits within
--shutdown-timeout + 2 s.

Skipped unless SmolLM2 has been pulled (`atlas pull smollm2`)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import DEVICE, LiveServer

from atlas.app.model_store import is_model_folder, models_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_STREAMS = 16
SHUTDOWN_TIMEOUT_S = 3


class Stream(threading.Thread):
    """One streamed chat completion, read to its end on its own thread."""

    def __init__(self, url: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url, self.index = url, index
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": f"Count from {self.index} to a thousand."}],
                "max_tokens": 900, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"content":"' in line and '"content":""' not in line:
                            self.started.set()
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.started.set()

    def finish_reasons(self) -> list[str]:
        chunks = [json.loads(event) for event in self.events if event != "[DONE]"]
        return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


@pytest.fixture
def smollm2(tmp_path):
    if not is_model_folder(models_dir() / "smollm2"):
        pytest.skip("SmolLM2 is not pulled (atlas pull smollm2)")
    live = LiveServer(["smollm2", "--device", DEVICE, "--max-seq-len", "1024", "--kv-cache-gb", "0.25",
                       "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)], tmp_path / "server.log")
    yield live.wait_ready(timeout_s=300)
    live.stop()


def test_sigterm_ends_every_stream_with_abort_and_done_then_exits(smollm2):
    streams = [Stream(smollm2.url, index) for index in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(240) and stream.error is None, stream.error
    signalled_s = time.monotonic()
    smollm2.process.send_signal(signal.SIGTERM)
    while httpx.get(smollm2.url + "/health", timeout=30).status_code == 200:  # until the signal is handled
        pass
    refused = httpx.post(smollm2.url + "/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    smollm2.process.wait(SHUTDOWN_TIMEOUT_S + 2)  # raises TimeoutExpired past the promise
    print(f"exited {time.monotonic() - signalled_s:.2f} s after SIGTERM (--shutdown-timeout {SHUTDOWN_TIMEOUT_S})")
    for stream in streams:
        stream.join(10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]" and stream.finish_reasons() == ["abort"], stream.events[-3:]
    log = smollm2.log()
    assert smollm2.process.returncode == 0
    assert [line for line in log.splitlines() if "shutting down" in line][0].count("SIGTERM") == 1
    assert len([line for line in log.splitlines() if "SIGTERM" in line]) == 1
    assert "Traceback" not in log

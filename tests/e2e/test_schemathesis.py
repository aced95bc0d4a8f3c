"""Schemathesis against a live `atlas serve`: requests it generates from /openapi.json, valid
and invalid, over every route, get no 5xx; every response (each streamed chunk too) matches
its documented schema; the server logs no traceback.

CI sends the schema's examples (a streamed one among them), then a few hundred random cases (40
per route, and stateful sequences), to a server whose context is 64 tokens and which allows 4
choices a request, so generation stays short. The run behind the "1,000+ requests, 0 5xx"
figure in docs/api.md adds the coverage phase (boundary values of every field) and more cases:

    ATLAS_SCHEMATHESIS_PHASES=examples,coverage,fuzzing,stateful ATLAS_SCHEMATHESIS_EXAMPLES=100 \
        python -m pytest tests/e2e/test_schemathesis.py -s

`positive_data_acceptance` is left out: a schema-valid request can still be refused for a
reason a schema cannot state (the prompt's token count against the context, a feature value
that is not supported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LiveServer, tiny_server_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = os.environ.get("ATLAS_SCHEMATHESIS_EXAMPLES", "40")  # per route
PHASES = os.environ.get("ATLAS_SCHEMATHESIS_PHASES", "examples,fuzzing,stateful")
SEED = os.environ.get("ATLAS_SCHEMATHESIS_SEED", "20261126")
CONFIG = Path(__file__).with_name("schemathesis.toml")  # 413 counts as rejecting an invalid body


def schemathesis_command(url: str) -> list[str]:
    return [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", url + "/openapi.json",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-response-time", "60",
            "--phases", PHASES, "--max-examples", EXAMPLES, "--seed", SEED, "--request-timeout", "120",
            "--generation-database", "none", "--no-color"]


def test_generated_requests_over_every_route_get_no_server_error(tiny_model, tmp_path):
    live = LiveServer(tiny_server_args(tiny_model, "--max-seq-len", "64", "--max-choices-per-request", "4"),
                      tmp_path / "server.log").wait_ready()
    try:
        result = subprocess.run(schemathesis_command(live.url), capture_output=True, text=True, timeout=3600,
                                cwd=tmp_path)
        log = live.log()
    finally:
        live.stop()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    selected, total = map(int, re.search(r"Selected: (\d+)/(\d+)", output).groups())
    assert selected == total >= 9  # every route (schemathesis leaves out /openapi.json itself)
    generated = int(re.search(r"(\d+) generated", output).group(1))
    print(f"schemathesis: {generated} generated requests over {selected} routes, no failure")
    assert generated >= 9 * 20
    assert "Traceback" not in log and "unexpected error" not in log

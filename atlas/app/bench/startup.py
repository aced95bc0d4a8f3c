"""`atlas bench startup MODEL`: seconds from `atlas serve` starting to its first streamed token.

Starts the server once per `--starts` entry:
- cold: an empty kernel cache with the package's cubins on (their default; cuBLASLt
  has no stored winners);
- nvrtc: an empty kernel cache and the packaged cubins off (`ATLAS_PACKAGED_CUBINS=0`): every
  module compiles, as after a kernel edit that was not prebuilt;
- warm: the cache the first earlier start filled (kernels and cuBLASLt winners).
Each start times process start -> the first token of a streamed completion (the server answers
503 while it loads, so the request is retried until the engine is ready), and prints where the
seconds went: the `startup:` phase lines of the server's log (`atlas.ports.startup`), in the
order they ended, across the API and engine processes.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atlas.ports.startup import EPOCH_ENVIRONMENT, parse_phase


def add_startup_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder or name, as `atlas serve` takes it")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a start after this many seconds")
    parser.add_argument("--serve-args", default="", help="extra `atlas serve` flags, quoted as one string")
    parser.add_argument("--starts", default="cold,warm",
                        help="comma list of cold, nvrtc, warm (see `atlas bench startup --help`); default cold,warm")


STARTS = ("cold", "nvrtc", "warm")


def parse_starts(text: str) -> list[str]:
    """The `--starts` list; ValueError naming the flag for an unknown entry or a warm start
    with no earlier start to fill its cache."""
    starts = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in starts if item not in STARTS]
    if unknown or not starts:
        raise ValueError(f"--starts: {', '.join(unknown) or 'nothing'} is not a start; use a comma list of {', '.join(STARTS)}")
    if starts[0] == "warm":
        raise ValueError("--starts: a warm start needs an earlier cold or nvrtc start to fill its kernel cache")
    return starts


def run_startup_bench(args: argparse.Namespace) -> int:
    starts = parse_starts(args.starts)
    warm_cache: Path | None = None
    results = []
    for label in starts:
        cache_dir = warm_cache if label == "warm" else Path(tempfile.mkdtemp(prefix=f"atlas-startup-{label}-"))
        warm_cache = warm_cache or cache_dir
        extra = {"ATLAS_PACKAGED_CUBINS": "0" if label == "nvrtc" else "1"}
        print(f"starting atlas serve ({label}: kernel cache {cache_dir}) ...", file=sys.stderr)
        seconds, log_text = _first_token_seconds(args, cache_dir, extra)
        results.append((label, seconds))
        print(f"\n{label} start: first token after {seconds:.2f} s")
        print(phase_table(log_text, seconds))
    print(f"\n{'start':<8} {'first token (s)':>16}")
    for label, seconds in results:
        print(f"{label:<8} {seconds:>16.2f}")
    return 0


def phase_table(log_text: str, first_token_s: float) -> str:
    """The server's startup phases as a table, in the order they ended, then the first token."""
    phases = sorted((phase for line in log_text.splitlines() if (phase := parse_phase(line))), key=lambda p: p.at_s)
    rows = [f"  {'phase':<16} {'seconds':>8} {'ended at':>9}  detail"]
    rows += [f"  {p.name:<16} {p.seconds:>8.2f} {p.at_s:>9.2f}  {p.detail}" for p in phases]
    rows.append(f"  {'first token':<16} {'':>8} {first_token_s:>9.2f}  measured by the client")
    return "\n".join(rows)


def _first_token_seconds(args: argparse.Namespace, cache_dir: Path, extra: dict[str, str]) -> tuple[float, str]:
    port = _free_port()
    environment = dict(os.environ, ATLAS_KERNEL_CACHE=str(cache_dir), **extra)
    environment[EPOCH_ENVIRONMENT] = repr(time.time())  # the server's phases count from the launch
    command = [sys.executable, "-m", "atlas", "serve", args.model, "--device", args.device,
               "--port", str(port), *args.serve_args.split()]
    log = tempfile.TemporaryFile(mode="w+")
    started = time.perf_counter()
    process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise ValueError(f"atlas serve exited with {process.returncode} before answering:\n{log.read()[-2000:]}")
            if time.perf_counter() - started > args.timeout:
                raise ValueError(f"atlas serve did not answer within --timeout {args.timeout:.0f} s")
            if _streamed_first_token(port):
                seconds = time.perf_counter() - started
                break
            time.sleep(0.05)
    finally:
        _stop(process)
    log.seek(0)
    return seconds, log.read()


def _stop(process: subprocess.Popen) -> None:
    """End the server's whole session (it may have exited already, with its group)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    except ProcessLookupError:
        process.wait()
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _streamed_first_token(port: int) -> bool:
    """True once a streamed completion's first token arrives; False while the server is not up."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0})
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return False
        while line := response.readline():
            if line.startswith(b"data: {") and b'"text"' in line:
                return True
        return False
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

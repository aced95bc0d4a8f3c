"""`atlas bench startup MODEL`: seconds from `atlas serve` starting to its first streamed token.

Runs the server twice: once with an empty kernel cache (cold: kernels compile) and once with
the cache the first run filled (warm). Each run times process start -> the first token of a
streamed completion (the server answers 503 while it loads, so the request is retried until
the engine is ready).
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


def add_startup_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder or name, as `atlas serve` takes it")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a start after this many seconds")
    parser.add_argument("--serve-args", default="", help="extra `atlas serve` flags, quoted as one string")


def run_startup_bench(args: argparse.Namespace) -> int:
    cache_dir = Path(tempfile.mkdtemp(prefix="atlas-startup-kernels-"))
    results = []
    for label in ("cold", "warm"):
        print(f"starting atlas serve ({label} kernel cache) ...", file=sys.stderr)
        seconds, log_tail = _first_token_seconds(args, cache_dir)
        results.append((label, seconds))
        compiled = [line for line in log_tail.splitlines() if "compiled" in line and "kernel" in line]
        print(f"  {label}: first token after {seconds:.2f} s; {compiled[-1].strip() if compiled else ''}",
              file=sys.stderr)
    print(f"{'kernel cache':<13} {'first token (s)':>16}")
    for label, seconds in results:
        print(f"{label:<13} {seconds:>16.2f}")
    return 0


def _first_token_seconds(args: argparse.Namespace, cache_dir: Path) -> tuple[float, str]:
    port = _free_port()
    environment = dict(os.environ, ATLAS_KERNEL_CACHE=str(cache_dir))
    command = [sys.executable, "-m", "atlas.app.cli", "serve", args.model, "--device", args.device,
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
    return seconds, log.read()[-5000:]


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

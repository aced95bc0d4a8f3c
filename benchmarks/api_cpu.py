"""CPU the API process spends per streamed output token and per request, under `atlas bench serve`.

The API process (HTTP, tokenizing, detokenizing, SSE) runs one event loop; when it is busy, its
CPU per token bounds throughput and delays every stream's chunks. This script reads that
process's CPU time (utime + stime from /proc/PID/stat) when each run's load starts and ends
(not the prompts' /tokenize calls around it), so the figure excludes start-up and the engine
process (whose CPU is shown beside it):

    # a server already running (the API process is found by its listening port):
    python3 benchmarks/api_cpu.py --url http://127.0.0.1:8899
    # or one started here, stopped at the end (any `atlas serve` flags after --serve):
    python3 benchmarks/api_cpu.py --serve "$HOME/.cache/atlas/bench/llama-3.1-8b --device cuda \\
        --max-seq-len 4096 --max-num-seqs 64"
    # on a CPU box, the engine replaced by a stand-in stepping every 12 ms at no CPU
    # (benchmarks/paced_serve.py), so the API sees a GPU's traffic:
    python3 -m atlas.app.bench.tiny_model /tmp/tiny --num-layers 1 --hidden-size 32
    python3 benchmarks/api_cpu.py --paced-step-ms 12 --serve "/tmp/tiny --device mock --max-seq-len 512"

Each run is `atlas bench serve` (streamed /v1/completions, concurrency 64, 16:64 tokens in,
64:256 out by default; `--bench "..."` replaces those flags) after one unmeasured warm-up
run. Prints one row per run: throughput, TTFT p50, tokens per SSE chunk (what the client saw;
above 1 when the API loop falls behind and merges a stream's tokens), the API's CPU seconds,
its share of one core, and its CPU per output token, per chunk and per request (all of the
API's CPU divided by each). A server whose API loop keeps up (a GPU's steps) sends about one
token per chunk; a saturated one merges tokens, so compare CPU per token between builds only
where their tokens per chunk are alike (`--bench "... --request-rate R"` paces the load).
Only compare figures taken back to back on the same machine: other load moves them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]  # subprocesses run this checkout's atlas
DEFAULT_BENCH = "--concurrency 64 --num-prompts 256 --input-len 16:64 --output-len 64:256"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15


def listening_pid(port: int) -> int:
    """The process holding a TCP socket that listens on `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{parts[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise SystemExit(f"no process of this user listens on port {port}; pass --pid")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.extend(int(child) for child in (task / "children").read_text().split())
    return found


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout_s:.0f}s")


# `atlas bench serve` tokenizes every prompt through the server's /tokenize before the load
# and again after it; its progress lines on stderr mark the load in between.
LOAD_STARTS = "prompts ready:"  # ... (100%): the last prompt is ready, the load starts
LOAD_ENDS = "counting the reusable prompt tokens"


class CpuWindow:
    """The CPU seconds of the API process (and of its children, the engine) between two marks."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._engines = children(pid)
        self.api_s = self.engine_s = 0.0
        self._start: tuple[float, float] | None = None
        self.closed = False

    def _read(self) -> tuple[float, float]:
        return cpu_s(self._pid), sum(cpu_s(child) for child in self._engines)

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> None:
        if self._start is not None:
            api, engine = self._read()
            self.api_s, self.engine_s = api - self._start[0], engine - self._start[1]
            self.closed = True


def bench(url: str, flags: list[str], seed: int, window: CpuWindow | None = None) -> dict:
    """One `atlas bench serve` run: its summary, plus the SSE chunks that carried text; with
    `window`, the API's CPU over the load alone (not the prompts' /tokenize calls around it)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "atlas", "bench", "serve", "--url", url, "--seed", str(seed),
                   "--json-file", out.name, *flags]
        client = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
        log = []
        for line in client.stderr:
            log.append(line)
            if window is not None and LOAD_STARTS in line and "(100%)" in line:
                window.start()
            elif window is not None and LOAD_ENDS in line:
                window.stop()
        if client.wait() != 0:
            raise SystemExit(f"bench serve failed ({client.returncode}): {''.join(log[-20:])}")
        if window is not None and not window.closed:
            raise SystemExit(f"bench serve's progress lines did not mark its load: {''.join(log[-20:])}")
        saved = json.loads(Path(out.name).read_text())
    summary = saved["summary"]
    summary["num_chunks"] = sum(row.get("num_chunks") or 0 for row in saved["requests"])
    return summary


def measure(url: str, pid: int, flags: list[str], seed: int) -> dict:
    window = CpuWindow(pid)
    summary = bench(url, flags, seed, window)
    return {"summary": summary, "api_cpu_s": window.api_s, "engine_cpu_s": window.engine_s}


def print_row(label: str, run: dict) -> None:
    s = run["summary"]
    tokens, requests, api = s["output_tokens"], s["completed"], run["api_cpu_s"]
    chunks = max(s["num_chunks"], 1)
    print(f"{label:>6} {requests:>5} {tokens:>7} {s['output_tokens_per_s']:>9.1f} {s['ttft_p50_ms']:>8.1f} "
          f"{tokens / chunks:>6.2f} {api:>7.2f} {api / s['duration_s']:>5.0%} {1e6 * api / max(tokens, 1):>8.1f} "
          f"{1e6 * api / chunks:>8.1f} {1e3 * api / max(requests, 1):>7.2f} {run['engine_cpu_s']:>7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: the one --serve starts)")
    parser.add_argument("--pid", type=int, default=None, help="the API process (default: found by the URL's port)")
    parser.add_argument("--serve", default=None, metavar="ARGS",
                        help="start `atlas serve ARGS --port PORT` here and stop it at the end")
    parser.add_argument("--port", type=int, default=8950, help="the port for --serve (default 8950)")
    parser.add_argument("--paced-step-ms", type=float, default=None, metavar="MS",
                        help="with --serve: replace the engine process by benchmarks/paced_serve.py's stand-in, "
                             "one token per running request every MS milliseconds, at no CPU")
    parser.add_argument("--bench", default=DEFAULT_BENCH, metavar="FLAGS",
                        help=f"`atlas bench serve` flags of each run (default: {DEFAULT_BENCH})")
    parser.add_argument("--runs", type=int, default=3, help="measured runs (default 3)")
    parser.add_argument("--warmup-prompts", type=int, default=64, help="requests of the unmeasured first run")
    args = parser.parse_args()
    if (args.url is None) == (args.serve is None):
        parser.error("give --url (a running server) or --serve (start one)")
    if args.paced_step_ms is not None and args.serve is None:
        parser.error("--paced-step-ms needs --serve")
    flags = shlex.split(args.bench)
    server = None
    url = args.url
    if args.serve is not None:
        url = f"http://127.0.0.1:{args.port}"
        serve_args = [*shlex.split(args.serve), "--port", str(args.port), "--shutdown-timeout", "0"]
        command = [sys.executable, "-m", "atlas", "serve", *serve_args]
        if args.paced_step_ms is not None:
            command = [sys.executable, str(REPO / "benchmarks" / "paced_serve.py"), "--step-ms",
                       str(args.paced_step_ms), "--", *serve_args]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        if server is not None:
            wait_healthy(url, server)
        pid = args.pid or (server.pid if server is not None else listening_pid(urlparse(url).port or 80))
        warmup = [*flags, "--num-prompts", str(args.warmup_prompts)]
        bench(url, warmup, seed=100)
        print(f"API process {pid}; bench serve {' '.join(flags)}")
        print(f"{'run':>6} {'reqs':>5} {'tokens':>7} {'tok/s':>9} {'TTFT p50':>8} {'tok/ch':>6} {'API s':>7} "
              f"{'core':>5} {'us/token':>8} {'us/chunk':>8} {'ms/req':>7} {'engine':>7}")
        for run in range(args.runs):
            print_row(str(run + 1), measure(url, pid, flags, seed=run + 1))
            sys.stdout.flush()
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

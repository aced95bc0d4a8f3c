"""`atlas serve` with a stand-in engine process that costs no CPU: for measuring the API process.

    python3 benchmarks/paced_serve.py --step-ms 12 -- /tmp/tiny --device mock --port 8950

The API process is the real one (hypercorn, Quart, tokenizing, detokenizing, SSE, the engine
socket); only the engine process is replaced. Every `--step-ms` while requests run, the stand-in
publishes one `StepOutputs` frame with one new token for each (a random id of the model's
vocabulary), finishing each at its `max_tokens` (finish_reason "length"; stop conditions are
not modelled), and sleeps between steps. So the API sees the traffic of a GPU engine stepping
every `--step-ms` (a random 8B model on an H100 at 64 streams: ~11 ms), with the two cores of a
development box left to the API process and the client. Flags after `--` are `atlas serve`'s
(the model folder gives the tokenizer, config.json the vocabulary size).
"""

from __future__ import annotations

import argparse
import json
import random
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's atlas

from atlas.app.engine_actor import AbortRequest, AddRequest, Shutdown  # noqa: E402
from atlas.app.engine_protocol import (  # noqa: E402
    Commands,
    FrameBuffer,
    FromEngine,
    Ready,
    StepOutputs,
    ToEngine,
    frame,
)
from atlas.domain.batch import SequenceOutput  # noqa: E402
from atlas.domain.engine import EngineStats  # noqa: E402
from atlas.domain.requests import FinishReason, Request  # noqa: E402


class PacedEngine:
    """The engine side of the socket: commands in, one frame of outputs per step out."""

    def __init__(self, sock: socket.socket, step_s: float, seed: int = 0) -> None:
        self._sock = sock
        self._step_s = step_s
        self._frames = FrameBuffer()
        self._decode = msgspec.msgpack.Decoder(ToEngine).decode
        self._encode = msgspec.msgpack.Encoder().encode
        self._rng = random.Random(seed)
        self._running: dict[str, tuple[Request, list[int]]] = {}  # id -> (request, [tokens out])
        self._vocab_size = 0
        self._num_steps = self._num_prompt_tokens = self._num_generated = 0

    def send(self, message: FromEngine) -> None:
        self._sock.sendall(frame(self._encode(message)))

    def stats(self) -> EngineStats:
        return EngineStats(len(self._running), 0, 1000, 1000 - len(self._running), self._num_steps,
                           self._num_prompt_tokens, self._num_generated, 0)

    def run(self) -> None:
        next_step_s = time.monotonic()
        while True:
            timeout_s = None if not self._running else max(next_step_s - time.monotonic(), 0.0)
            readable, _, _ = select.select([self._sock], [], [], timeout_s)
            if readable:
                data = self._sock.recv(1 << 20)
                if not data or not self._apply(self._frames.feed(data)):
                    return
                if timeout_s is None:
                    next_step_s = time.monotonic() + self._step_s  # the first token, one step after
                continue
            self._step()
            next_step_s += self._step_s

    def _apply(self, bodies: list[bytes]) -> bool:
        for body in bodies:
            message = self._decode(body)
            if not isinstance(message, Commands):
                settings = message.settings  # Start: "load" the model
                config = json.loads((Path(settings.model) / "config.json").read_text())
                self._vocab_size = config["vocab_size"]
                self.send(Ready(settings.model, settings.max_seq_len or 4096, self._vocab_size, self.stats()))
                continue
            for command in message.commands:
                if isinstance(command, Shutdown):
                    return False
                if isinstance(command, AbortRequest):
                    self._running.pop(command.request_id, None)
                elif isinstance(command, AddRequest):
                    self._running[command.request.request_id] = (command.request, [])
                    self._num_prompt_tokens += len(command.request.prompt_token_ids)
        return True

    def _step(self) -> None:
        outputs = []
        for request_id, (request, tokens) in list(self._running.items()):
            tokens.append(self._rng.randrange(1, self._vocab_size))
            done = len(tokens) >= (request.sampling.max_tokens or 16)
            outputs.append(SequenceOutput(request_id, (tokens[-1],), FinishReason.LENGTH if done else None,
                                          len(request.prompt_token_ids), len(tokens)))
            if done:
                del self._running[request_id]
        self._num_steps += 1
        self._num_generated += len(outputs)
        self.send(StepOutputs(outputs, [], self.stats()))


def serve(step_ms: float, serve_args: list[str]) -> int:
    """`atlas serve serve_args` whose engine process is `PacedEngine`."""
    from atlas.app import engine_process
    from atlas.app.arguments import ArgumentParser
    from atlas.app.engine_spawn import SpawnedEngine
    from atlas.app.server import add_serve_arguments, run_server

    def spawn_paced(preload_cuda: bool = False) -> SpawnedEngine:
        parent, child = socket.socketpair()
        command = [sys.executable, __file__, "--engine-fd", str(child.fileno()), "--step-ms", str(step_ms)]
        process = subprocess.Popen(command, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        return SpawnedEngine(process, parent)

    engine_process.spawn_engine = spawn_paced  # the one seam: which process EngineProcess starts
    parser = ArgumentParser(prog="paced_serve.py")
    add_serve_arguments(parser)
    return run_server(parser.parse_args(serve_args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=12.0, help="milliseconds per engine step (default 12)")
    parser.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)  # the stand-in's own run
    parser.add_argument("serve_args", nargs="*", help="`atlas serve` flags (after --)")
    args = parser.parse_args()
    if args.engine_fd is not None:
        try:
            PacedEngine(socket.socket(fileno=args.engine_fd), args.step_ms / 1e3).run()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the API process went away
        return 0
    return serve(args.step_ms, args.serve_args)


if __name__ == "__main__":
    sys.exit(main())

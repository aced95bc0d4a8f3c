"""`atlas serve MODEL [flags]` and the ASGI app `atlas.app.serve` (for `hypercorn atlas.app:serve`).

Both read the same flags; the bare hypercorn form takes them from ATLAS_* variables
(ATLAS_MODEL, ATLAS_MAX_SEQ_LEN, ATLAS_REQUIRE_AUTH, ...), and serves `smollm2` when
ATLAS_MODEL is unset. The engine core runs in its own process unless `--single-process`.

(This module is not called `serve.py`: importing a submodule `atlas.app.serve` would replace
the package attribute `atlas.app.serve`, which must stay the ASGI app.)
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from atlas.app.arguments import ArgumentParser, add_engine_arguments, engine_settings
from atlas.app.arguments import _env as env_default
from atlas.app.settings import EngineSettings
from atlas.ports.startup import EPOCH_ENVIRONMENT, report_phase, since_start_s, startup_epoch

if TYPE_CHECKING:
    from hypercorn.config import Config
    from quart import Quart

log = logging.getLogger("atlas.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8888
DEFAULT_MODEL = "smollm2"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
EXIT_FATAL = 2
# After the drain: hypercorn closes connections and the engine stops. The process exits by
# --shutdown-timeout + EXIT_MARGIN_S (plus interpreter teardown) even if something hangs.
EXIT_MARGIN_S = 1.5
HYPERCORN_GRACEFUL_S = 0.5


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags: the model, where to listen, auth, limits, dumping, engine flags."""
    parser.add_argument("model", nargs="?", default=env_default("model", DEFAULT_MODEL),
                        help="a model folder, a pulled name or an HF repo id (default: $ATLAS_MODEL or smollm2)")
    group = parser.add_argument_group("server")
    group.add_argument("--bind", "--host", dest="host", default=env_default("bind", DEFAULT_HOST),
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes the API to the network)")
    group.add_argument("--port", type=int, default=env_default("port", DEFAULT_PORT, int), help="default 8888")
    group.add_argument("--model-name", default=env_default("model_name", None),
                       help="the model id clients send and /v1/models lists (default: MODEL as given)")
    group.add_argument("--require-auth", action="store_true", default=env_default("require_auth", False, bool),
                       help="require 'Authorization: Bearer TOKEN' on /v1/*, /tokenize and /detokenize")
    group.add_argument("--auth-token", action="append", default=_env_list("auth_token"),
                       help="an accepted bearer token (repeatable; env ATLAS_AUTH_TOKEN)")
    group.add_argument("--auth-tokens-file", default=env_default("auth_tokens_file", None),
                       help="a file of accepted tokens, one per line")
    group.add_argument("--request-timeout", type=float, default=env_default("request_timeout", None, float),
                       help="seconds after which a request still generating ends with finish_reason 'length'")
    group.add_argument("--max-request-bytes", type=int, default=env_default("max_request_bytes", 16 << 20, int),
                       help="largest request body accepted; larger ones get 413 (default 16 MiB)")
    group.add_argument("--max-choices-per-request", type=int, default=env_default("max_choices_per_request", None, int),
                       help="most sequences one request may ask for, prompts x n; more is a 400 (default 256)")
    group.add_argument("--shutdown-timeout", type=float,
                       default=env_default("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S, float), metavar="SECONDS",
                       help="at SIGINT/SIGTERM, how long requests in flight may finish before they end with "
                            "finish_reason 'abort' (default 30; 0 ends them at once; a second signal too)")
    group.add_argument("--dump", nargs="?", const="", default=env_default("dump", None), metavar="PATH",
                       help="append every request and its response to a JSONL file "
                            "(default PATH: ./atlas-dump-<time>.jsonl)")
    group.add_argument("--override-generation-config", default=env_default("override_generation_config", None),
                       metavar="JSON",
                       help="defaults for sampling fields a request leaves out, over the model's "
                            "generation_config.json, e.g. '{\"temperature\": 0.7, \"top_p\": 0.9}' "
                            "(without either: greedy)")
    group.add_argument("--single-process", action="store_true", default=env_default("single_process", False, bool),
                       help="run the engine core in the API process (a thread) instead of its own process")
    group.add_argument("--access-log", action="store_true", default=env_default("access_log", False, bool),
                       help="log every HTTP request")
    _add_chat_arguments(parser)
    add_engine_arguments(parser)


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    from atlas.app.chat_features import REASONING_PARSER_CHOICES, TOOL_CALL_PARSER_CHOICES

    group = parser.add_argument_group("tools, reasoning and stored responses")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_CHOICES,
                       default=env_default("tool_call_parser", "auto"),
                       help="the markup tool calls are read from (default auto: detected from the chat template; "
                            "none: tool calls come back as text)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES,
                       default=env_default("reasoning_parser", "auto"),
                       help="split <think>...</think> into reasoning_content (default auto: detected from the chat "
                            "template; none: the block stays in the content)")
    group.add_argument("--max-stored-responses", type=int, default=env_default("max_stored_responses", 1000, int),
                       help="responses /v1/responses keeps for previous_response_id and GET, least recently used "
                            "dropped first (default 1000; 0 stores none)")
    group.add_argument("--max-stored-responses-bytes", type=int,
                       default=env_default("max_stored_responses_bytes", 64 << 20, int),
                       help="their total size (default 64 MiB)")


def _env_list(name: str) -> list[str] | None:
    value = env_default(name, None)
    return [value] if value else None


def http_config(args: argparse.Namespace):
    """The HTTP settings from parsed flags. Raises ValueError naming the flag to fix."""
    from atlas.adapters.http.auth import BearerAuth, read_tokens_file
    from atlas.adapters.http.state import HttpConfig

    tokens = list(args.auth_token or [])
    if args.auth_tokens_file:
        tokens.extend(read_tokens_file(args.auth_tokens_file))
    if args.require_auth:
        BearerAuth(tokens)  # raises naming --auth-token / --auth-tokens-file when there are none
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be positive (got {args.request_timeout})")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024 (got {args.max_request_bytes})")
    if args.max_choices_per_request is not None and args.max_choices_per_request < 1:
        raise ValueError(f"--max-choices-per-request must be at least 1 (got {args.max_choices_per_request})")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds (got {args.shutdown_timeout})")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be between 1 and 65535 (got {args.port})")
    if args.max_stored_responses < 0 or args.max_stored_responses_bytes < 0:
        raise ValueError("--max-stored-responses and --max-stored-responses-bytes must be 0 or more")
    dump_path = None
    if args.dump is not None:
        dump_path = Path(args.dump or f"atlas-dump-{datetime.now():%Y%m%d-%H%M%S}.jsonl")
    limits = {} if args.max_choices_per_request is None else {"max_choices_per_request": args.max_choices_per_request}
    return HttpConfig(
        served_name=args.model_name,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_request_bytes,
        require_auth=args.require_auth,
        auth_tokens=frozenset(tokens),
        dump_path=dump_path,
        max_stored_responses=args.max_stored_responses,
        max_stored_responses_bytes=args.max_stored_responses_bytes,
        **limits,
    )


SAMPLING_DEFAULT_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                         "repetition_penalty": float}


def sampling_defaults(model_dir: Path, override_json: str | None):
    """Request defaults from the model's generation_config.json, then `override_json`.

    Raises ValueError naming --override-generation-config for bad JSON, an unknown key or an
    out-of-range value; an unreadable generation_config.json is ignored with a warning.
    """
    from atlas.adapters.http.engine_client import SamplingDefaults
    from atlas.domain.requests import ParameterError, SamplingParams

    values: dict[str, float | int] = {}
    path = model_dir / "generation_config.json"
    try:
        generation_config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as error:
        log.warning("ignoring %s: %s", path, error)
        generation_config = {}
    override: dict = {}
    if override_json:
        try:
            override = json.loads(override_json)
        except ValueError as error:
            raise ValueError(f"--override-generation-config is not valid JSON ({error})") from None
        if not isinstance(override, dict):
            raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.7}'")
        unknown = sorted(set(override) - set(SAMPLING_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key {unknown[0]!r}; "
                             f"use {', '.join(SAMPLING_DEFAULT_KEYS)}")
    for source in (generation_config, override):
        for key, cast in SAMPLING_DEFAULT_KEYS.items():
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = cast(value)
    try:
        SamplingParams(**values)
    except ParameterError as error:
        raise ValueError(f"--override-generation-config / {path.name}: {error}") from None
    return SamplingDefaults(**values)


def _served_model(settings: EngineSettings, served_name: str | None, model_dir: Path, tokenizer,
                  max_model_len: int, vocab_size: int, override_json: str | None, parsers: tuple[str, str],
                  features=None):
    """The model as the HTTP layer serves it; `features`: its chat features computed earlier
    for the same vocabulary (else computed now)."""
    from atlas.adapters.http.engine_client import ServedModel
    from atlas.app.chat_features import chat_features

    name = served_name or settings.model
    aliases = frozenset({settings.model, str(model_dir)} - {name})
    features = features or chat_features(tokenizer, model_dir, vocab_size, *parsers)
    return ServedModel(name, aliases, tokenizer, max_model_len, vocab_size, settings.seed, int(time.time()),
                       sampling_defaults(model_dir, override_json), features)


def _tokenizer_and_features(model_dir: Path, parsers: tuple[str, str]):
    """The tokenizer and chat features (llguidance's grammar compiler takes a while), built in
    the API process while the engine process loads the model; the vocabulary size is
    config.json's, which the engine confirms when it is ready."""
    from atlas.adapters.tokenizers.hf import HfTokenizer
    from atlas.app.chat_features import chat_features
    from atlas.domain.models.config import ModelConfig

    tokenizer = HfTokenizer.from_folder(model_dir)
    vocab_size = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text())).vocab_size
    return tokenizer, vocab_size, chat_features(tokenizer, model_dir, vocab_size, *parsers)


def engine_launcher(settings: EngineSettings, served_name: str | None, single_process: bool,
                    override_json: str | None = None, parsers: tuple[str, str] = ("auto", "auto")):
    """The lifespan's launcher: load the model, run the engine while the context is open."""

    @asynccontextmanager
    async def in_this_process() -> AsyncIterator:
        from atlas.app.builder import build_engine
        from atlas.app.engine_actor import EngineActor

        started = time.perf_counter()
        engine = await anyio.to_thread.run_sync(build_engine, settings)
        try:
            actor = EngineActor(engine.core)
            engine.watch(actor.fail_from_thread)  # rank processes that die while the engine idles
            model = await anyio.to_thread.run_sync(
                _served_model, settings, served_name, engine.model_dir, engine.tokenizer, engine.max_model_len,
                engine.config.vocab_size, override_json, parsers)
            report_phase("http ready", time.perf_counter() - started, "engine built in this process")
            async with anyio.create_task_group() as group:
                group.start_soon(actor.run)
                yield model, actor
                actor.shutdown()
        finally:
            await anyio.to_thread.run_sync(engine.close)

    @asynccontextmanager
    async def in_own_process() -> AsyncIterator:
        from atlas.app.engine_process import EngineProcess
        from atlas.app.model_store import resolve_model

        started = time.perf_counter()
        model_dir = resolve_model(settings.model)
        process = EngineProcess(settings)
        prepared: list = []

        async def prepare() -> None:  # beside the engine's load, not after it
            prepared.extend(await anyio.to_thread.run_sync(_tokenizer_and_features, model_dir, parsers))

        try:
            try:
                async with anyio.create_task_group() as group:
                    group.start_soon(prepare)
                    ready = await process.start()
            except BaseExceptionGroup as failures:  # the load's own error, as without the group
                raise failures.exceptions[0] from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await process.close()
            raise
        tokenizer, vocab_size, features = prepared
        model = await anyio.to_thread.run_sync(
            _served_model, settings, served_name, model_dir, tokenizer, ready.max_model_len, ready.vocab_size,
            override_json, parsers, features if vocab_size == ready.vocab_size else None)
        report_phase("http ready", time.perf_counter() - started, "engine process ready, chat features built")
        async with anyio.create_task_group() as group:
            group.start_soon(process.run)
            yield model, process
            process.shutdown()

    return in_this_process if single_process else in_own_process


def build_app(args: argparse.Namespace, on_fatal=None):
    """The Quart app for parsed `serve` flags. Raises ValueError for a bad flag value."""
    from atlas.adapters.http import create_app

    settings = engine_settings(args)
    config = http_config(args)
    launcher = engine_launcher(settings, args.model_name, args.single_process, args.override_generation_config,
                               (args.tool_call_parser, args.reasoning_parser))
    return create_app(config, launcher, on_fatal)


def limit_blas_threads(single_process: bool) -> None:
    """With the engine in this process, bound BLAS threads (`atlas.app.threads`); the engine
    process gets its own variables when it is spawned."""
    if single_process:
        from atlas.app.threads import limit_blas_threads as limit

        limit()


def app_from_environment():
    """`atlas.app.serve`: the app configured from ATLAS_* variables only."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = ArgumentParser(prog="atlas.app:serve")
    add_serve_arguments(parser)
    args = parser.parse_args([])
    limit_blas_threads(args.single_process)
    from atlas.adapters.http import h11_protocol

    h11_protocol.install()  # before hypercorn accepts a connection (the lifespan starts first)
    return build_app(args)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, require_auth: bool) -> str | None:
    """The warning logged when the server listens beyond this machine, else None."""
    if _is_loopback(host):
        return None
    advice = "" if require_auth else "; anyone who can reach it can use it: consider --require-auth"
    return f"listening on {host}: the API is reachable from other machines{advice}"


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound socket for `host:port`, before anything loads, so a taken port or an address that
    is not this machine's is a one-line ValueError naming --port or --bind."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"--bind {host}: not an address this machine can listen on ({error})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); "
                             f"stop it or choose another --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}; check --bind and --port") from None
    return sock


def run_server(args: argparse.Namespace) -> int:
    """`atlas serve`: check the configuration, then serve until Ctrl-C or SIGTERM."""
    from hypercorn.config import Config

    from atlas.adapters.http import h11_protocol
    from atlas.app.model_store import resolve_model

    os.environ.setdefault(EPOCH_ENVIRONMENT, repr(startup_epoch()))  # the engine process counts from here too
    limit_blas_threads(args.single_process)
    model_dir = resolve_model(args.model)  # a missing model is a one-line error now, not after startup
    sampling_defaults(model_dir, args.override_generation_config)
    fatal: list[str] = []
    failed = asyncio.Event()

    def on_fatal(message: str) -> None:
        fatal.append(message)
        failed.set()

    app = build_app(args, on_fatal)  # flag errors first; nothing loads until hypercorn starts it
    listener = listening_socket(args.host, args.port)
    h11_protocol.install()
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]
    config.accesslog = logging.getLogger("atlas.access") if args.access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handler, once
    config.graceful_timeout = HYPERCORN_GRACEFUL_S
    config.include_server_header = False
    warning = exposure_warning(args.host, args.require_auth)
    if warning is not None:
        log.warning("%s", warning)
    log.info("Atlas listening on http://%s:%d (model %s loads in the background; /health is 503 until ready)",
             args.host, args.port, args.model_name or args.model)
    report_phase("api process", since_start_s(), "interpreter, imports, flags, socket")
    asyncio.run(_serve(app, config, failed, args.shutdown_timeout))
    if fatal:
        print(f"atlas: error: {fatal[0]}", file=sys.stderr)
        return EXIT_FATAL
    return 0


async def _serve(app: Quart, config: Config, failed: asyncio.Event, shutdown_timeout_s: float) -> None:
    """Serve until the engine fails or a signal. A signal drains first (`shut_down`): new
    requests get 503, those in flight get `shutdown_timeout_s`; a second signal ends them now."""
    from hypercorn.asyncio import serve

    from atlas.adapters.http import shut_down

    loop = asyncio.get_running_loop()
    received: list[str] = []
    signalled, stop_serving, abort_now = asyncio.Event(), asyncio.Event(), anyio.Event()

    def on_signal(signum: int) -> None:
        if signalled.is_set():
            abort_now.set()
        received.append(signal.Signals(signum).name)
        signalled.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    serving = asyncio.create_task(serve(app, config, shutdown_trigger=stop_serving.wait))
    waits = [asyncio.create_task(signalled.wait()), asyncio.create_task(failed.wait())]
    await asyncio.wait([serving, *waits], return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if serving.done():
        serving.result()  # hypercorn stopped by itself: raise what stopped it
        return
    deadline_s = loop.time() + (shutdown_timeout_s if signalled.is_set() else 0.0) + EXIT_MARGIN_S
    if signalled.is_set():
        log.info("%s: shutting down; new requests get 503, requests in flight may finish within %gs "
                 "(--shutdown-timeout), then end with finish_reason 'abort'", received[0], shutdown_timeout_s)
        await shut_down(app, shutdown_timeout_s, abort_now)
    stop_serving.set()
    try:
        await asyncio.wait_for(serving, max(deadline_s - loop.time(), 0.1))
    except TimeoutError:
        log.warning("the server did not stop within %gs of the shutdown timeout; exiting", EXIT_MARGIN_S)

"""The `atlas` command: generate, chat, serve, pull, import-gguf, bench, kernels, doctor.

User mistakes (a missing model, a bad flag value, a corrupt checkpoint, too little memory) end
with one line naming the fix and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from atlas.ports import startup as _startup  # noqa: F401 - first, so a server's start counts from here

from atlas.app.arguments import (
    ArgumentParser,
    add_engine_arguments,
    add_sampling_arguments,
    engine_settings,
)
from atlas.app.bench.engine_arguments import add_engine_bench_arguments
from atlas.app.bench.serve import add_bench_serve_arguments
from atlas.app.bench.startup import add_startup_bench_arguments
from atlas.app.server import add_serve_arguments
from atlas.app.settings import DEVICES, DTYPES
from atlas.app.threads import limit_blas_threads
from atlas.domain.requests import SamplingParams

EXIT_USER_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()  # flag defaults come from ATLAS_* variables, which may be malformed
    except ValueError as error:
        print(f"atlas: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    args = parser.parse_args(_default_bench(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.handler is None:
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return args.handler(args) or 0
    except (ValueError, MemoryError) as error:
        print(f"atlas: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="atlas", description="Atlas: serve and run LLMs on your own hardware.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=ArgumentParser)

    generate = commands.add_parser("generate", help="complete prompts and print the results")
    generate.add_argument("model", help="a model folder, a pulled name (smollm2) or an HF repo id in the HF cache")
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    generate.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    add_sampling_arguments(generate, default_max_tokens=128)
    add_engine_arguments(generate)
    generate.set_defaults(handler=_generate)

    chat = commands.add_parser("chat", help="talk to a model in the terminal (chat template applied)")
    chat.add_argument("model")
    chat.add_argument("-m", "--message", help="ask one question, print the answer and exit")
    chat.add_argument("--system", help="a system prompt")
    add_sampling_arguments(chat, default_max_tokens=512)
    add_engine_arguments(chat)
    chat.set_defaults(handler=_chat)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    serve.set_defaults(handler=_serve)

    pull = commands.add_parser("pull", help="fetch a model into Atlas's cache (smollm2)")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="fetch and import again")
    pull.set_defaults(handler=_pull)

    import_gguf = commands.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face model folder")
    import_gguf.add_argument("file")
    import_gguf.add_argument("out_dir")
    import_gguf.set_defaults(handler=_import_gguf)

    kernels = commands.add_parser("kernels", help="list the CUDA kernels Atlas selects for a model and device")
    kernels.add_argument("model", help="a model (its config.json gives the model type)")
    kernels.add_argument("--arch", help="compute capability like 9.0 or sm_90, instead of asking the GPU")
    kernels.add_argument("--quant", default="bf16")
    kernels.add_argument("--device-ordinal", type=int, default=0)
    kernels.set_defaults(handler=_kernels)

    doctor = commands.add_parser(
        "doctor", help="compare a model's hidden state after every layer with transformers' and name the first "
        "layer that leaves bf16 noise (exits 1 then)",
    )
    doctor.add_argument("model", help="a model folder, a pulled name or an HF repo id in the HF cache")
    doctor.add_argument("--device", choices=DEVICES, default="auto", help="cuda, mock or auto (as for serve)")
    doctor.add_argument("--dtype", choices=DTYPES, default="auto", help="Atlas's activation type (f32: mock only)")
    doctor.add_argument("--prompt", help="the text to run (default: two sentences of English)")
    doctor.add_argument("--reference", help="compare against this checkpoint instead of MODEL itself "
                        "(the original of a GGUF import, say)")
    doctor.set_defaults(handler=_doctor)

    bench = commands.add_parser("bench", help="benchmarks that print figures (engine decode by default)")
    bench_commands = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", parser_class=ArgumentParser)
    engine = bench_commands.add_parser("engine", help="decode and prefill throughput against the device's ceilings "
                                       "(the default)")
    add_engine_bench_arguments(engine)
    add_engine_arguments(engine)
    engine.set_defaults(handler=_bench)
    startup = bench_commands.add_parser("startup", help="seconds from `atlas serve` starting to its first token, "
                                        "with a cold and a warm kernel cache")
    add_startup_bench_arguments(startup)
    startup.set_defaults(handler=_bench_startup)
    serve_bench = bench_commands.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP")
    add_bench_serve_arguments(serve_bench)
    serve_bench.set_defaults(handler=_bench_serve)
    bench.set_defaults(handler=None, bench_parser=bench)
    return parser


BENCHMARKS = ("engine", "serve", "startup")


def _default_bench(argv: list[str]) -> list[str]:
    """`atlas bench MODEL ...` means `atlas bench engine MODEL ...`."""
    if "bench" in argv:
        index = argv.index("bench")
        rest = argv[index + 1 :]
        if rest and rest[0] not in BENCHMARKS and rest[0] not in ("-h", "--help"):
            return [*argv[: index + 1], "engine", *rest]
    return argv


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.request_seed,
    )


def _generate(args: argparse.Namespace) -> int:
    limit_blas_threads()  # before numpy loads with atlas.app.llm
    from atlas.app.llm import LLM

    params = _sampling(args)
    llm = LLM.from_settings(engine_settings(args))
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        results = llm.generate(args.prompt, params)
    for prompt, result in zip(args.prompt, results):
        for choice in result.outputs:
            print(f"--- prompt: {prompt!r} ({choice.finish_reason}, {len(choice.token_ids)} tokens)")
            print(choice.text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    limit_blas_threads()  # before numpy loads with atlas.app.llm
    from atlas.app.llm import LLM

    params = _sampling(args)
    llm = LLM.from_settings(engine_settings(args))
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None and sys.stdin.isatty()
    questions = [args.message] if args.message is not None else _questions(interactive)
    for question in questions:
        messages.append({"role": "user", "content": question})
        answer = []
        for text in llm.stream_chat(messages, params):
            answer.append(text)
            print(text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 0


def _questions(interactive: bool):
    if interactive:
        print("Type a message and press Enter (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if line.strip():
            yield line


def _pull(args: argparse.Namespace) -> int:
    from atlas.app.pull import pull

    path = pull(args.name, force=args.force)
    print(path)
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from atlas.adapters.weights.gguf_import import import_gguf

    path = import_gguf(args.file, args.out_dir)
    print(path)
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from atlas.adapters.cuda import describe_kernels
    from atlas.app.builder import read_model_config
    from atlas.app.model_store import resolve_model

    config = read_model_config(resolve_model(args.model))
    capability = None
    if args.arch:
        digits = args.arch.lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
        if not digits.isdigit() or len(digits) < 2:
            raise ValueError(f"--arch {args.arch!r} is not a compute capability like 9.0 or sm_90")
        capability = (int(digits[:-1]), int(digits[-1]))
    if capability is None:
        from atlas.app.backends import cuda_available

        if not cuda_available():
            raise ValueError("no CUDA GPU here (or the cuda extra is missing); pass --arch 9.0 for an H100/H200")
    choices = describe_kernels(config.model_type, args.quant, args.device_ordinal, capability)
    print(f"{'module':<20} {'cached':<7} {'source':<58} reason")
    for choice in choices:
        cached = "?" if choice.cached is None else ("yes" if choice.cached else "no")
        print(f"{choice.name:<20} {cached:<7} {choice.source_path:<58} {choice.reason}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    limit_blas_threads()  # before numpy loads with atlas.app.doctor
    from atlas.app.doctor import DEFAULT_PROMPT, run_doctor

    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    report = run_doctor(args.model, args.device, args.dtype, prompt, args.reference)
    return 0 if report.passed else 1


def _bench(args: argparse.Namespace) -> int:
    limit_blas_threads()  # the mock's figures at the BLAS threads `atlas serve` gives its engine
    from atlas.app.bench.engine import run_engine_bench

    return run_engine_bench(args, engine_settings(args))


def _bench_startup(args: argparse.Namespace) -> int:
    from atlas.app.bench.startup import run_startup_bench

    return run_startup_bench(args)


def _serve(args: argparse.Namespace) -> int:
    from atlas.app import engine_spawn

    if not args.single_process:  # the engine process imports while this one does (engine_spawn.py)
        engine_spawn.spawn_early(preload_cuda=args.device in ("cuda", "auto"))
    try:
        from atlas.app.server import run_server

        return run_server(args)
    finally:
        engine_spawn.discard_early()


def _bench_serve(args: argparse.Namespace) -> int:
    from atlas.app.bench.serve import run_serve_bench

    return run_serve_bench(args)


if __name__ == "__main__":
    sys.exit(main())

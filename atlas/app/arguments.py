"""Command-line parsing: engine flags shared by every command, ATLAS_* defaults, close-match errors."""

from __future__ import annotations

import argparse
import difflib
import os
from typing import NoReturn

from atlas.app.settings import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    GRAMMAR_PROCESS,
    SCHEDULING_POLICIES,
    EngineSettings,
    SettingsError,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that names the closest existing flag when given one that does not exist."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            unknown = [a for a in message.split(":", 1)[1].split() if a.startswith("-")]
            known = _all_flags(self)
            for flag in unknown:
                name = flag.split("=", 1)[0]
                match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                if match:
                    message = f"unexpected argument '{name}'; did you mean '{match[0]}'?"
                    break
                message = f"unexpected argument '{name}'; see --help for the flags"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `parser` and its subcommands (unknown flags surface at the top)."""
    flags = []
    for action in parser._actions:
        flags.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                flags.extend(_all_flags(subparser))
    return flags


def _env(name: str, default, cast=str):
    """Default for a flag from ATLAS_<NAME> (e.g. ATLAS_MAX_SEQ_LEN), else `default`.
    Raises SettingsError naming the variable when its value is not a `cast`."""
    variable = "ATLAS_" + name.upper().replace("-", "_")
    value = os.environ.get(variable)
    if value is None:
        return default
    if cast is bool:
        return value.lower() in ("1", "true", "yes", "on")
    try:
        return cast(value)
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(cast, "valid")
        raise SettingsError(f"{variable}={value!r} is not {kind}") from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the engine (every command that loads a model takes them)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", choices=DEVICES, default=_env("device", "auto"),
                       help="cuda, mock (numpy on the CPU) or auto (cuda when a GPU is present)")
    group.add_argument("--dtype", choices=DTYPES, default=_env("dtype", "auto"),
                       help="activation type: auto (f32 on the mock, bf16 on GPUs), bf16, f32 (mock only)")
    group.add_argument("--max-seq-len", type=int, default=_env("max_seq_len", None, int),
                       help="longest sequence, prompt + output (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 128, int),
                       help="sequences running at once (default 128)")
    group.add_argument("--max-batch-size", type=int, default=_env("max_batch_size", None, int),
                       help="largest decode batch captured as a CUDA graph (default: --max-num-seqs)")
    group.add_argument("--max-prefill-tokens", type=int, default=_env("max_prefill_tokens", 2048, int),
                       help="tokens computed per step; longer prompts are prefilled in chunks (default 2048)")
    group.add_argument("--max-admitted-tokens", type=int, default=_env("max_admitted_tokens", None, int),
                       help="once the requests a step admits hold this many prompt tokens and number 4 and a "
                       "quarter of the queue, the others wait for the next step: a burst of short prompts gets its "
                       "first tokens over a few short steps (default: a sixteenth of --max-prefill-tokens)")
    group.add_argument("--block-size", type=int, default=_env("block_size", 16, int),
                       help="tokens per KV cache block (default 16)")
    group.add_argument("--gpu-memory-utilization", type=float, default=_env("gpu_memory_utilization", 0.90, float),
                       help="fraction of device memory Atlas may use for weights, activations and KV (default 0.90)")
    group.add_argument("--kv-cache-gb", type=float, default=_env("kv_cache_gb", None, float),
                       help="size the KV cache to this many GiB instead (default on the mock: 2)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=_env("kv_cache_dtype", "auto"),
                       help="KV cache element type (default: the activation type); fp8 (= fp8_e4m3) halves the "
                       "cache's bytes, with per-layer K/V scales from the checkpoint (self_attn.k_scale, "
                       "v_scale) or 1.0")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=_env("quantization", "none"),
                       help="fp8: quantize a float checkpoint's layer projections to FP8 (E4M3, one scale per "
                       "output channel) as it loads, halving their bytes; embeddings and the LM head stay as "
                       "stored. FP8 checkpoints load as published without it")
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=_env("scheduling_policy", "fifo"),
                       help="fifo (default) or priority: requests with a lower priority field run first and are "
                       "preempted last")
    group.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       default=not _env("no_prefix_caching", False, bool),
                       help="recompute every prompt instead of reusing the KV of cached prefixes")
    group.add_argument("--enforce-eager", action="store_true", default=_env("enforce_eager", False, bool),
                       help="never capture CUDA graphs")
    group.add_argument("--batch-invariant", action="store_true", default=_env("batch_invariant", False, bool),
                       help="CUDA: compute every token row of a decode-sized step (up to 8 rows) as it would be "
                       "computed alone, so that greedy output with --speculative-config (k <= 7 at batch 1) is "
                       "bit for bit the output without it; products of one row take the tensor-core GEMV, "
                       "a little slower than the one-row kernel")
    group.add_argument("--seed", type=int, default=_env("seed", None, int),
                       help="seed for requests that bring none (default: a fresh random seed per request)")
    group.add_argument("--speculative-config", metavar="JSON", default=_env("speculative_config", None),
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                       "(methods: ngram, draft_model, mtp, eagle3; keys: method, num_speculative_tokens, "
                       "prompt_lookup_min/max, model, disable_by_batch_size)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=_env("tensor_parallel_size", 1, int),
                       help="split the model over this many GPUs (one process each; default 1); heads, "
                       "feed-forward width and vocabulary must divide by it")
    group.add_argument("--grammar-process", choices=GRAMMAR_PROCESS, default=_env("grammar_process", "auto"),
                       help="structured output: keep the grammar state (matchers, accepts, mask fills) in a helper "
                       "process that runs beside the engine's step loop on another core (on), or in the engine's "
                       "process on a thread (off); auto (default) is on for CUDA on an x86-64 host with 8 cores or more")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       default=_env("enable_expert_parallel", False, bool),
                       help="MoE models: place whole experts on the --tensor-parallel-size ranks instead of "
                       "splitting every expert over them")


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_num_seqs=args.max_num_seqs,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_admitted_tokens=args.max_admitted_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gb=args.kv_cache_gb,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        scheduling_policy=args.scheduling_policy,
        prefix_caching=args.prefix_caching,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        seed=args.seed,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        grammar_process=args.grammar_process,
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, default_max_tokens: int | None) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--request-seed", type=int, default=None, help="seed of this request's sampling")

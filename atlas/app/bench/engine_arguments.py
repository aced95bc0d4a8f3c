"""Flags of `atlas bench engine` (kept apart so parsing the CLI imports no numpy)."""

from __future__ import annotations

import argparse


def add_engine_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a model folder or name (or use --random)")
    parser.add_argument("--random", metavar="CONFIG", help="a random-weight model of a real config: "
                        "llama-3.1-8b, llama-3.1-70b, qwen3-8b, qwen3-30b-a3b or smollm2-135m (a folder under "
                        "~/.cache/atlas/bench; weights generated as they load, written as files for --reference hf; "
                        "more configs in atlas/app/bench/random_model.py)")
    parser.add_argument("--batch-sizes", default="1,16", help="decode batch sizes (default 1,16)")
    parser.add_argument("--input-len", "--context", dest="context", type=int, default=512,
                        help="context of each decoding sequence (default 512)")
    parser.add_argument("--output-len", "--decode-tokens", dest="decode_tokens", type=int, default=64,
                        help="decode steps timed per batch (default 64)")
    parser.add_argument("--prefill-lens", default=None,
                        help="prompt lengths for prefill (default 512,2048,8192 on a GPU, none on the mock)")
    parser.add_argument("--reference", choices=("none", "hf", "hf-random"), default="none",
                        help="also run transformers (needs torch + transformers): on the same weights (hf; a "
                        "--random model is written as files for it), or on weights of its own random draw of "
                        "the same shapes (hf-random: nothing written; for speed only)")
    parser.add_argument("--reference-batch-sizes", default="1",
                        help="decode batch sizes for the reference (empty: prefill only)")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="instead of the usual figures: decode each batch size under this JSON schema and free, "
                        "in the same run, and print both tokens/s (use a schema whose documents outlast "
                        "--output-len, such as an array with a large minItems)")
    parser.add_argument("--prompts", metavar="FILE",
                        help="with --speculative-config: the prompts (a JSON list of strings; default: the 24 "
                        "edit-and-repeat prompts shipped with Atlas)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --speculative-config or --json-schema: the plain (free) and speculative "
                        "(constrained) runs alternate this many times at each batch size; tokens/s are medians, "
                        "the speed-up (ratio) the median paired one")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    parser.add_argument("--plot", dest="plot_path", help="write tokens/s vs batch with the roofline to this PNG")

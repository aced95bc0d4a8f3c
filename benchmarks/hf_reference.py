"""The reference for `atlas bench engine --reference hf`: the same checkpoint through transformers.

Runs as its own process (Atlas never imports torch) and prints one JSON object on stdout:
decode tokens/s with a static KV cache and `torch.compile(mode="reduce-overhead")` (CUDA
graphs), and prefill seconds with SDPA attention, on the same workloads `atlas bench` uses.
With `--random-weights` only DIR's config.json is read and the weights are transformers' own
random initialisation, drawn on the GPU (a generated `atlas bench --random` folder has no files;
the shapes, hence the speed, are the same). An empty `--batch-sizes` times prefill only.

    python benchmarks/hf_reference.py --model DIR --batch-sizes 1 --context 512 --decode-tokens 64 \
        --prefill-lens 512,2048,8192 [--random-weights]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig


def log(message: str) -> None:
    print(f"hf-reference: {message}", file=sys.stderr, flush=True)


def timed_generate(model, input_ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - started


def decode_tokens_per_s(model, batch: int, context: int, decode_tokens: int, vocab: int) -> dict:
    """Steady-state decode: (time for N+1 tokens - time for 1 token) / N, after compiling. The
    prompt is shorter than `context` by half the N steps, so their contexts centre on it (as in
    `atlas bench`)."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    prompt_len = max(1, context - (decode_tokens + 1) // 2)
    input_ids = torch.randint(0, vocab, (batch, prompt_len), device="cuda", generator=generator)
    started = time.perf_counter()
    for _ in range(3):  # compile and capture for this shape; static cache sized once
        timed_generate(model, input_ids, decode_tokens + 1)
    log(f"batch {batch}: warm-up (compilation) took {time.perf_counter() - started:.0f}s")
    full = min(timed_generate(model, input_ids, decode_tokens + 1) for _ in range(3))
    first = min(timed_generate(model, input_ids, 1) for _ in range(3))
    step_s = (full - first) / decode_tokens
    return {"batch": batch, "step_s": step_s, "tokens_per_s": batch / step_s}


def prefill_seconds(model, num_tokens: int, vocab: int) -> dict:
    """One forward pass over a prompt (eager, SDPA attention), best of three after a warm-up."""
    input_ids = torch.randint(0, vocab, (1, num_tokens), device="cuda")
    best = float("inf")
    with torch.no_grad():
        for attempt in range(4):
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(input_ids, logits_to_keep=1)
            torch.cuda.synchronize()
            if attempt:
                best = min(best, time.perf_counter() - started)
    return {"num_tokens": num_tokens, "seconds": best, "tokens_per_s": num_tokens / best}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-lens", default="512,2048,8192")
    parser.add_argument("--random-weights", action="store_true", help="the config's shapes, random weights")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.random_weights:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    log(f"loaded in {time.perf_counter() - started:.0f}s")
    vocab = model.config.vocab_size
    prefill = [prefill_seconds(model, int(n), vocab) for n in args.prefill_lens.split(",") if n]
    # generate() compiles the forward pass itself when the cache is static; say how, explicitly
    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    decode = [decode_tokens_per_s(model, int(b), args.context, args.decode_tokens, vocab)
              for b in args.batch_sizes.split(",") if b]
    print(json.dumps({
        "implementation": "transformers static cache + torch.compile (decode), SDPA (prefill)",
        "weights": "random (its own draw)" if args.random_weights else "the checkpoint's",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "decode": decode,
        "prefill": prefill,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The serving bench's workloads run on the engine alone, with no HTTP in between:

    python3 benchmarks/offline_serve.py [--model PATH] [--device cuda] [--runs mixed,fixed] [--kv-cache-dtype fp8]
                                        [--profile]

A closed loop of `--concurrency` requests on the engine core in this process: a request that
finishes is replaced by the next in the same step, as a client with no network and no front end
would. The workloads are `atlas bench serve`'s (issue 29): mixed 16:900 tokens in, 16:256 out;
fixed 512/128; prefix: a 2,048-token prefix shared by every request, 32 tokens of its own, 128
out; temperature 0.8, EOS ignored, random prompt ids. Prints output tokens/s per run.
Set beside `benchmarks/serve_gpu_run.sh`'s figures of the same machine, the gap is what the
HTTP front end and the client cost; the engine's own figure is what the scheduler and the
kernels give. `--profile` (needs torch on the GPU machine) also records every kernel through
CUPTI (torch.profiler sees kernels any library launches) and prints, per run, the GPU's busy
seconds against the wall and the kernels that took the most time.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from atlas.app.llm import LLM
from atlas.domain.requests import Request, SamplingParams

WORKLOADS = {"mixed": ((16, 900), (16, 256)), "fixed": ((512, 512), (128, 128)), "prefix": ((32, 32), (128, 128))}
SHARED_PREFIX = {"prefix": 2048}  # tokens every request of the workload opens with


def run(llm: LLM, name: str, num: int, concurrency: int, seed: int) -> tuple[float, int, int, int]:
    """(seconds, output tokens, prompt tokens, steps) of one closed-loop run."""
    (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[name]
    rng = random.Random(seed)
    vocab = llm.tokenizer.vocab_size
    shared = tuple(rng.randrange(100, vocab - 100) for _ in range(SHARED_PREFIX.get(name, 0)))
    requests = []
    for index in range(num):
        prompt = shared + tuple(rng.randrange(100, vocab - 100) for _ in range(rng.randint(in_lo, in_hi)))
        params = SamplingParams(max_tokens=rng.randint(out_lo, out_hi), temperature=0.8, ignore_eos=True)
        requests.append(Request(f"{name}-{index}", prompt, params, seed=index))
    core = llm.engine.core
    pending = list(reversed(requests))
    running = 0
    outputs = steps = 0
    start = time.perf_counter()
    while pending and running < concurrency:
        core.add_request(pending.pop()); running += 1
    while running:
        for output in core.step():
            outputs += len(output.new_token_ids)
            if output.finish_reason is not None:
                running -= 1
                if pending:
                    core.add_request(pending.pop()); running += 1
        steps += 1
    while core.has_unfinished:
        core.step()
    return time.perf_counter() - start, outputs, sum(len(r.prompt_token_ids) for r in requests), steps


def kernel_table(recording, top: int = 22) -> tuple[float, list[tuple[str, float, int]]]:
    """(seconds the GPU ran kernels, [(kernel, seconds, launches)] longest first)."""
    totals: dict[str, list] = {}
    for event in recording.events():
        if event.device_type.name != "CUDA":
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time_total * 1e-6
        entry[1] += 1
    rows = sorted(((name, total, count) for name, (total, count) in totals.items()), key=lambda row: -row[1])
    return sum(row[1] for row in rows), rows[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path("~/.cache/atlas/bench/llama-3.1-8b").expanduser()))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", default="mixed,fixed")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=args.concurrency, max_seq_len=args.max_seq_len,
              kv_cache_dtype=args.kv_cache_dtype)
    run(llm, "fixed", args.concurrency, args.concurrency, seed=99)  # warm-up: graphs, cuBLASLt plans
    print(f"{'run':>6} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>11} {'steps':>6} {'tokens/step':>11}")
    tables = []
    for name in args.runs.split(","):
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as recording:
                seconds, out, prompt, steps = run(llm, name, args.num_prompts, args.concurrency, seed=1)
            tables.append((name, seconds, kernel_table(recording)))
        else:
            seconds, out, prompt, steps = run(llm, name, args.num_prompts, args.concurrency, seed=1)
        print(f"{name:>6} {seconds:>8.2f} {out / seconds:>10.1f} {(out + prompt) / seconds:>11.1f} {steps:>6} "
              f"{out / steps:>11.1f}")
    for name, seconds, (busy, rows) in tables:
        print(f"\n{name}: kernels busy {busy:.2f} s of {seconds:.2f} s wall")
        for kernel, total, count in rows:
            print(f"  {total:7.3f} s {count:>7}  {kernel[:110]}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

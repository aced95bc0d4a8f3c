"""Which kernels make a batch-1 verify step dearer than a decode step (issue 31: <= 1.15x):

    python3 benchmarks/verify_kernels.py [--model PATH] [--drafts 4] [--context 512]

Builds the engine as `atlas bench --speculative-config` does (n-gram, k drafts, batch 1, the
verify graphs), decodes a random prompt to get a plain decode step, then replays it and the
k-draft verify step in its place (`atlas.app.bench.speculative.verify_over`) under
torch.profiler (CUPTI sees every kernel) and prints each kernel's mean wall microseconds per
step for both (the time it adds after the kernels before it end), largest difference first.
Needs torch on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import msgspec
from torch.profiler import ProfilerActivity, profile

from atlas.app.bench.measure import replay_device_time
from atlas.app.bench.speculative import verify_over
from atlas.app.llm import LLM
from atlas.domain.requests import Request, SamplingParams


def kernel_means(run, repeats: int) -> dict[str, float]:
    """Each kernel's mean wall microseconds per step: the time it adds after the end of the kernels
    before it (a kernel launched early under programmatic dependent launch waits for the one
    before; its wait is not its cost)."""
    with profile(activities=[ProfilerActivity.CUDA]) as recording:
        run(repeats)
    events = sorted(
        (e for e in recording.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    totals: dict[str, float] = {}
    done = float("-inf")
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        totals[event.name] = totals.get(event.name, 0.0) + max(0.0, end - max(start, done))
        done = max(done, end)
    return {name: total / (repeats + 1) for name, total in totals.items()}  # + replay_device_time's warm-up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path("~/.cache/atlas/bench/llama-3.1-8b").expanduser()))
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    config = json.dumps({"method": "ngram", "num_speculative_tokens": args.drafts})
    llm = LLM(args.model, device="cuda", max_num_seqs=1, max_batch_size=1, max_seq_len=2048,
              speculative_config=config, show_progress=False)
    core = llm.engine.core
    rng = random.Random(0)
    prompt = tuple(rng.randrange(200, llm.tokenizer.vocab_size - 200) for _ in range(args.context))
    core.add_request(Request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), seed=0))
    decode = None
    while core.has_unfinished:
        core.step()
        batch = core.newest_batch
        if batch is not None and batch.num_tokens == 1 and decode is None:
            decode = batch
    assert decode is not None, "no plain decode step was recorded"
    first = msgspec.structs.replace(decode.sequences[0], token_ids=(0,), placeholder_row=None)
    decode = replace(decode, sequences=(first,))
    verify = verify_over(decode, args.drafts)
    steps = {"decode": decode, "verify": verify}
    wall = {name: replay_device_time(llm.engine, batch, args.repeats) for name, batch in steps.items()}
    means = {name: kernel_means(lambda n, b=batch: replay_device_time(llm.engine, b, n), args.repeats)
             for name, batch in steps.items()}
    print(f"decode step {1e3 * wall['decode']:.3f} ms, verify ({args.drafts} drafts) {1e3 * wall['verify']:.3f} ms, "
          f"ratio {wall['verify'] / wall['decode']:.3f}")
    names = set(means["decode"]) | set(means["verify"])
    rows = sorted(names, key=lambda n: -(means["verify"].get(n, 0) - means["decode"].get(n, 0)))
    print(f"{'decode us':>10} {'verify us':>10} {'diff':>8}  kernel")
    for name in rows[:18]:
        d, v = means["decode"].get(name, 0.0), means["verify"].get(name, 0.0)
        print(f"{d:>10.1f} {v:>10.1f} {v - d:>8.1f}  {name[:90]}")
    print(f"{sum(means['decode'].values()):>10.1f} {sum(means['verify'].values()):>10.1f}  (sums)")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

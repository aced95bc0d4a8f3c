"""Where a serving run's engine time went, from an `ATLAS_STEP_TRACE` file:

    python3 benchmarks/step_trace_table.py FILE.steps.jsonl [--gap 0.5]

Splits the trace into runs at idle gaps longer than `--gap` seconds (the time between two
`atlas bench serve` runs against one server), then prints per run: wall seconds from its first
step to its last, the seconds inside step calls and between them (the engine process's command
handling and idle waits), steps by kind (decode only, mixed with prefill tokens), each kind's
mean step time and tokens, and the mean batch of decodes. A decode-only step's time against a
mixed step's shows what the prefill chunks cost; time between steps shows the front end's waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def runs(steps: list[dict], gap: float) -> list[list[dict]]:
    """Steps grouped into runs at idle gaps (from one step's end to the next's start)."""
    groups: list[list[dict]] = []
    end = None
    for step in steps:
        if not step["seqs"] and not step["outputs"]:
            continue
        if end is None or step["t"] - end > gap:
            groups.append([])
        groups[-1].append(step)
        end = step["t"] + step["dt"]
    return groups


def summary(steps: list[dict]) -> dict:
    wall = steps[-1]["t"] + steps[-1]["dt"] - steps[0]["t"]
    inside = sum(s["dt"] for s in steps)
    decode = [s for s in steps if s["seqs"] and s["tokens"] == s["decodes"]]
    mixed = [s for s in steps if s["tokens"] > s["decodes"]]

    def mean(values):
        return statistics.fmean(values) if values else 0.0

    return {
        "steps": len(steps), "wall_s": wall, "in_steps_s": inside, "between_s": wall - inside,
        "decode_steps": len(decode), "decode_ms": 1e3 * mean([s["dt"] for s in decode]),
        "decode_batch": mean([s["decodes"] for s in decode]),
        "mixed_steps": len(mixed), "mixed_ms": 1e3 * mean([s["dt"] for s in mixed]),
        "mixed_batch": mean([s["decodes"] for s in mixed]),
        "mixed_prefill_tokens": mean([s["tokens"] - s["decodes"] for s in mixed]),
        "decode_s": sum(s["dt"] for s in decode), "mixed_s": sum(s["dt"] for s in mixed),
        "running_mean": mean([s["running"] for s in steps]), "waiting_mean": mean([s["waiting"] for s in steps]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap", type=float, default=0.5)
    args = parser.parse_args()
    steps = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    print(f"{'run':>3} {'wall s':>7} {'steps s':>7} {'between':>7} | {'decode':>6} {'ms':>6} {'batch':>5} "
          f"{'s':>5} | {'mixed':>5} {'ms':>6} {'batch':>5} {'prefill':>7} {'s':>5} | {'running':>7} {'waiting':>7}")
    for index, group in enumerate(runs(steps, args.gap)):
        row = summary(group)
        print(f"{index:>3} {row['wall_s']:>7.2f} {row['in_steps_s']:>7.2f} {row['between_s']:>7.2f} | "
              f"{row['decode_steps']:>6} {row['decode_ms']:>6.2f} {row['decode_batch']:>5.1f} {row['decode_s']:>5.2f} | "
              f"{row['mixed_steps']:>5} {row['mixed_ms']:>6.2f} {row['mixed_batch']:>5.1f} "
              f"{row['mixed_prefill_tokens']:>7.0f} {row['mixed_s']:>5.2f} | {row['running_mean']:>7.1f} "
              f"{row['waiting_mean']:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

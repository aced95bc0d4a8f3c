"""Issue 29's serving bars from `atlas bench serve --json-file` runs of one machine:

    python3 benchmarks/serve_table.py DIR     # DIR holds mixed.json fixed.json prefix-on.json
                                              # prefix-off.json chat.json (any may be missing)

Prints one row per run (output tokens/s, TTFT and TPOT p50/p99, prefix-cache hits against the
reusable tokens) and then each bar with its ratio:

    mixed traffic  output tokens/s >= 0.9 x the fixed 512/128 run's, and >= 5,000
    shared prefix  TTFT p50 <= 1/4 of the --no-prefix-caching run's; output tokens/s >= 2x
    multi-turn     prefix-cache hits (/metrics) >= 0.9 x the reusable tokens

Exit status 0 when every bar it could check holds, 1 when one fails or a run is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = ("mixed", "fixed", "prefix-on", "prefix-off", "chat")


def load(folder: Path) -> dict[str, dict]:
    """Each run's summary by name; runs whose file is missing or unreadable are left out."""
    summaries = {}
    for name in RUNS:
        path = folder / f"{name}.json"
        try:
            summaries[name] = json.loads(path.read_text())["summary"]
        except (OSError, ValueError, KeyError):
            continue
    return summaries


def bars(runs: dict[str, dict]) -> list[tuple[str, float | None, str, bool | None]]:
    """(bar, measured value, what it must be, holds) for each of issue 29's serving bars; value
    and holds are None where a run is missing or failed every request."""

    def value(name: str, key: str) -> float | None:
        summary = runs.get(name)
        return summary[key] if summary and summary["completed"] and summary.get(key) is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    mixed, fixed = value("mixed", "output_tokens_per_s"), value("fixed", "output_tokens_per_s")
    on_ttft, off_ttft = value("prefix-on", "ttft_p50_ms"), value("prefix-off", "ttft_p50_ms")
    on_out, off_out = value("prefix-on", "output_tokens_per_s"), value("prefix-off", "output_tokens_per_s")
    hits = value("chat", "prefix_cache_hits_of_reusable")
    checks = [
        ("mixed / fixed output tokens/s", ratio(mixed, fixed), ">= 0.90", lambda v: v >= 0.9),
        ("mixed output tokens/s", mixed, ">= 5000", lambda v: v >= 5000),
        ("prefix TTFT p50 on / off", ratio(on_ttft, off_ttft), "<= 0.25", lambda v: v <= 0.25),
        ("prefix output tokens/s on / off", ratio(on_out, off_out), ">= 2.00", lambda v: v >= 2.0),
        ("chat prefix hits / reusable", hits, ">= 0.90", lambda v: v >= 0.9),
    ]
    return [(bar, v, need, None if v is None else holds(v)) for bar, v, need, holds in checks]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = load(Path(argv[0]))
    print(f"{'run':<30} {'ok':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
          f"{'hits / reusable':>18}")
    for name in RUNS:
        s = runs.get(name)
        if s is None:
            print(f"{name:<30} {'missing':>7}")
            continue
        label = f"{name} {s['input_len']}/{s['output_len']}" + (
            f" +{s['shared_prefix_len']}" if s["shared_prefix_len"] else "") + (
            f" x{s['num_turns']}" if s["num_turns"] > 1 else "")
        hits = "n/a" if s.get("prefix_cache_hits") is None else (
            f"{s['prefix_cache_hits']:.0f} / {s['reusable_tokens'] or 0}")
        print(f"{label:<30} {s['completed']:>3}/{s['num_prompts']:<3} {s['output_tokens_per_s']:>10.1f} "
              f"{s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>8.1f} {s['tpot_p50_ms']:>9.2f} {s['tpot_p99_ms']:>7.2f} "
              f"{hits:>18}")
    print()
    all_hold = True
    for bar, measured, need, holds in bars(runs):
        shown = "n/a" if measured is None else f"{measured:.2f}"
        verdict = {True: "holds", False: "FAILS", None: "not measured"}[holds]
        print(f"{bar:<34} {shown:>9}  (must be {need})  {verdict}")
        all_hold = all_hold and bool(holds)
    return 0 if all_hold else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

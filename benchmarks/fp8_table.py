"""The FP8-weights run beside the bf16 one: `python3 benchmarks/fp8_table.py BF16.json FP8.json [...]`.

Reads `atlas bench --json` files of the same model on the same machine and prints, per run,
batch 1 and 64 tokens/s with their roofline fraction (weight bytes as the device holds them,
FP8 projections a byte an element and the bf16 LM head two, plus the KV bytes read) and the
8192-token prefill, then each later run's speedup over the first.
"""

from __future__ import annotations

import json
import sys


def _row(report: dict, batch: int) -> dict | None:
    return next((row for row in report["decode"] if row["batch"] == batch), None)


def _prefill(report: dict, tokens: int) -> dict | None:
    return next((row for row in report["prefill"] if row["tokens"] == tokens), None)


def main(paths: list[str]) -> int:
    reports = [json.loads(open(path).read()) for path in paths]
    print(f"{'run':<34} {'KV':>8} {'GB/step':>7} {'b1 tok/s':>9} {'b1 roof':>7} {'b64 tok/s':>10} {'b64 roof':>8} "
          f"{'8k prefill s':>12}")
    for path, report in zip(paths, reports):
        b1, b64, prefill = _row(report, 1), _row(report, 64), _prefill(report, 8192)
        print(f"{report['weights'][:34]:<34} {report['kv_cache_dtype']:>8} {report['weight_gb_per_step']:>7.2f} "
              f"{b1['tokens_per_s'] if b1 else float('nan'):>9.1f} "
              f"{100 * b1['roofline_fraction'] if b1 else float('nan'):>6.1f}% "
              f"{b64['tokens_per_s'] if b64 else float('nan'):>10.1f} "
              f"{100 * b64['roofline_fraction'] if b64 else float('nan'):>7.1f}% "
              f"{prefill['seconds'] if prefill else float('nan'):>12.4f}")
    base = reports[0]
    for path, report in zip(paths[1:], reports[1:]):
        ratios = []
        for batch in (1, 64):
            ours, theirs = _row(report, batch), _row(base, batch)
            if ours and theirs:
                ratios.append(f"batch {batch} {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
        ours, theirs = _prefill(report, 8192), _prefill(base, 8192)
        if ours and theirs:
            ratios.append(f"8k prefill {theirs['seconds'] / ours['seconds']:.2f}x")
        print(f"{path} over {paths[0]}: " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

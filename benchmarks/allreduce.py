"""All-reduce on N GPUs: our P2P kernels against NCCL, checked then timed; a short table last.

    source .devkit/env.sh && python3 benchmarks/allreduce.py --world-size 2
    python3 benchmarks/allreduce.py --world-size 4 --skip-checks

Checks (1 KB .. 64 MB, bf16 and f32, one rank process per GPU): every path against the float64
sum, ours bit for bit against the reference sum (rank order, f32 accumulation), and a captured
graph of two all-reduces replayed on fresh inputs. Timings: the 8B's decode all-reduces
(hidden 4096 x batch 1..32 x bf16 = 8..256 KB), each path captured 32 times in one graph and
replayed; the slowest rank's time per all-reduce. NVLink multicast (NCCL_NVLS_ENABLE=0) stays
off in every process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

os.environ["NCCL_NVLS_ENABLE"] = "0"

from atlas.app.bench.allreduce import CHECK_SIZES, DECODE_SIZES, run_checks, run_timings, start_group  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, required=True, help="GPUs 0..N-1, one rank each")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--kernel-cache", default=os.environ.get("ATLAS_KERNEL_CACHE"))
    args = parser.parse_args()
    group = start_group(args.world_size, args.kernel_cache)
    try:
        failed = 0 if args.skip_checks else report_checks(run_checks(group, CHECK_SIZES))
        report_timings(run_timings(group, DECODE_SIZES), args.world_size)
    finally:
        group.close()
    return 1 if failed else 0


def report_checks(rows) -> int:
    worst: dict[tuple, list] = defaultdict(list)
    for row in rows:
        worst[(row.dtype, row.num_bytes, row.path)].append(row)
    print(f"{'dtype':5} {'bytes':>10} {'path':10} {'max rel err':>12} {'bit-exact':>9}  ok")
    failed = 0
    for (dtype, num_bytes, path), group in worst.items():
        error = max(row.relative_error for row in group)
        bitwise = "-" if group[0].bitwise is None else str(all(row.bitwise for row in group))
        ok = all(row.ok for row in group)
        failed += not ok
        print(f"{dtype:5} {num_bytes:>10} {path:10} {error:12.2e} {bitwise:>9}  {'ok' if ok else 'FAIL'}")
    print(f"checks: {len(worst) - failed} passed, {failed} failed")
    return failed


def report_timings(rows, world_size: int) -> None:
    slowest: dict[tuple[int, str], float] = defaultdict(float)
    for row in rows:
        key = (row.num_bytes, row.path)
        slowest[key] = max(slowest[key], row.us_per_call)
    print(f"\nall-reduce of bf16 on {world_size} GPUs, us per call inside a CUDA graph (slowest rank)")
    ours_paths = ("ll", "one_shot", "two_shot")
    print(f"{'bytes':>8} {'LL':>9} {'one-shot':>9} {'two-shot':>9} {'NCCL':>8} {'NCCL/ours':>10}")
    for num_bytes in sorted({key[0] for key in slowest}):
        ours = [slowest[(num_bytes, path)] for path in ours_paths if (num_bytes, path) in slowest]
        nccl = slowest.get((num_bytes, "nccl"), float("nan"))
        cells = [f"{slowest[(num_bytes, p)]:9.2f}" if (num_bytes, p) in slowest else f"{'-':>9}" for p in ours_paths]
        ratio = f"{nccl / min(ours):10.1f}" if ours else f"{'-':>10}"
        print(f"{num_bytes:>8} {' '.join(cells)} {nccl:8.2f} {ratio}")


if __name__ == "__main__":
    sys.exit(main())

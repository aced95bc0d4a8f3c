"""Where a request's TTFT goes, phase by phase, across the bench client, API and engine processes.

A throwaway measurement, not a feature: `benchmarks/prefix_phases.patch` adds timestamps
(CLOCK_MONOTONIC, the same clock in every process of one host) at each hand-over, written to
`$ATLAS_TRACE.<pid>` by every process that has the variable set. For the shared-prefix run:

    git apply benchmarks/prefix_phases.patch
    export ATLAS_TRACE=/tmp/out/trace
    RUNS=prefix-on bash benchmarks/serve_gpu_run.sh
    python3 benchmarks/prefix_phases.py /tmp/out/trace     # p50 / p90 / mean of each phase, ms
    git apply -R benchmarks/prefix_phases.patch

Requests are keyed by their sampling seed (the client's) and their completion id (the
server's). The first wave (`--skip`, default 64 requests) is left out: it computes the prefix.
"""

from __future__ import annotations

import argparse
import collections
import glob
import statistics

PHASES = ("c_send", "a_hook", "a_body", "a_tok", "a_gen", "a_submit", "a_sent", "e_add", "e_first", "a_out",
          "a_wake", "c_first")
NAMES = {
    "c_send": "client sends", "a_hook": "handler starts", "a_body": "body read", "a_tok": "tokenized",
    "a_gen": "Generation made", "a_submit": "submitted", "a_sent": "on the engine socket", "e_add": "engine adds it",
    "e_first": "engine's first output", "a_out": "API holds it", "a_wake": "generation wakes",
    "c_first": "client's first chunk",
}


def read_events(prefix: str) -> list[dict[str, float]]:
    """Each traced request's phase -> time, joined across the processes' files."""
    by_key: dict[str, dict[str, float]] = collections.defaultdict(dict)
    seed_to_id: dict[str, str] = {}
    for path in glob.glob(f"{glob.escape(prefix)}.*"):
        with open(path) as file:
            for line in file:
                parts = line.split()
                if parts[0] == "a_hookv":  # the handler's start, stamped by Quart's before_request
                    by_key[parts[1]]["a_hook"] = float(parts[2])
                elif parts[0] == "a_gen":
                    seed_to_id[parts[1]] = parts[2]
                    by_key[parts[1]]["a_gen"] = float(parts[3])
                elif len(parts) == 3:
                    by_key[parts[1]][parts[0]] = float(parts[2])
    requests = [{**by_key[seed], **by_key[request_id]} for seed, request_id in seed_to_id.items()]
    return sorted((r for r in requests if all(p in r for p in PHASES)), key=lambda r: r["c_send"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the ATLAS_TRACE path the processes wrote to")
    parser.add_argument("--skip", type=int, default=64, help="first requests left out (default 64: the first wave)")
    args = parser.parse_args()
    requests = read_events(args.prefix)[args.skip :]
    if not requests:
        raise SystemExit(f"no complete traces under {args.prefix}.* (was the patch applied and ATLAS_TRACE set?)")
    print(f"{len(requests)} requests; ms")
    print(f"{'phase':46}{'p50':>9}{'p90':>9}{'mean':>9}")
    for start, end in [*zip(PHASES, PHASES[1:]), (PHASES[0], PHASES[-1])]:
        values = sorted(1e3 * (r[end] - r[start]) for r in requests)
        name = f"{NAMES[start]} -> {NAMES[end]}"
        print(f"{name:46}{values[len(values) // 2]:>9.2f}{values[int(0.9 * (len(values) - 1))]:>9.2f}"
              f"{statistics.mean(values):>9.2f}")


if __name__ == "__main__":
    main()

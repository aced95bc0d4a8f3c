"""How an expert-parallel MoE layer should join its ranks: all-reduce of the combined output,
or all-to-all dispatch and combine. Counts the bytes each rank sends per layer and times both
exchanges on the mock's ranks (MockComm), for Qwen3-30B-A3B's layer (H 2048, top-8 of 128).

    python benchmarks/moe_traffic.py [--ranks 2] [--batches 1,8,64]

The ranks of one model hold every token (tensor parallelism replicates the residual stream).
  all-reduce: every rank adds its experts' part for every token; one all-reduce of [N, H].
  all-to-all: each rank routes its N/t tokens, sends each routed copy to the rank holding the
      expert (N/t * k rows, padded to a fixed capacity so the exchange is capturable), gets
      the results back the same way, and all-gathers the [N, H] output to replicate it again.
Ring all-reduce sends 2 (t-1)/t * N*H elements per rank; all-to-all sends (t-1)/t * N*H *
(2k/t + 1) (dispatch, combine, the all-gather): more whenever k/t > 1/2, i.e. below 16 ranks at
top-8. So the ranks all-reduce (`parallel_layers.ParallelMoeFeedForward`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.adapters.comm.harness import run_ranks  # noqa: E402
from atlas.adapters.mock.tensor import MockTensor  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402

HIDDEN, TOP_K, BYTES = 2048, 8, 2  # Qwen3-30B-A3B, bf16
REPEATS = 20


def sent_bytes(scheme: str, tokens: int, ranks: int) -> float:
    """Bytes one rank sends per MoE layer (ring algorithms; uniform routing)."""
    share = (ranks - 1) / ranks
    if scheme == "all_reduce":
        return 2 * share * tokens * HIDDEN * BYTES
    routed = tokens * TOP_K / ranks  # this rank's tokens' routed copies
    return 2 * share * routed * HIDDEN * BYTES + share * tokens * HIDDEN * BYTES


def time_scheme(scheme: str, tokens: int, ranks: int) -> float:
    def rank_main(comm) -> float:
        output = MockTensor(np.ones((tokens, HIDDEN), np.float32), DType.F32)
        capacity = max(1, -(-tokens * TOP_K // ranks // ranks)) * ranks  # rows per exchange, a multiple of t
        routed = MockTensor(np.ones((capacity * ranks, HIDDEN), np.float32), DType.F32)
        received = MockTensor(np.empty_like(routed.data), DType.F32)
        mine = MockTensor(np.ones((max(tokens // ranks, 1), HIDDEN), np.float32), DType.F32)
        gathered = MockTensor(np.empty((mine.shape[0] * ranks, HIDDEN), np.float32), DType.F32)

        def once() -> None:
            if scheme == "all_reduce":
                comm.all_reduce(output)
            else:
                comm.all_to_all(routed, received)  # dispatch
                comm.all_to_all(received, routed)  # combine
                comm.all_gather(mine, gathered)  # every rank holds every token again

        once()
        started = time.perf_counter()
        for _ in range(REPEATS):
            once()
        return (time.perf_counter() - started) / REPEATS

    return max(run_ranks(ranks, rank_main, timeout_s=300))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", default="1,8,64")
    args = parser.parse_args()
    print(f"MoE layer exchange, H {HIDDEN}, top-{TOP_K}, {args.ranks} ranks (MockComm over Unix sockets)")
    print(f"{'tokens':>6} {'all-reduce KB':>14} {'all-to-all KB':>14} {'all-reduce ms':>14} {'all-to-all ms':>14}")
    for tokens in (int(part) for part in args.batches.split(",")):
        kb = [sent_bytes(scheme, tokens, args.ranks) / 1e3 for scheme in ("all_reduce", "all_to_all")]
        ms = [1e3 * time_scheme(scheme, tokens, args.ranks) for scheme in ("all_reduce", "all_to_all")]
        print(f"{tokens:>6} {kb[0]:>14.1f} {kb[1]:>14.1f} {ms[0]:>14.3f} {ms[1]:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every cuBLASLt candidate for the Llama-3.1-8B projections at decode-sized token counts, timed
from HBM (a script, not a test):

    python3 benchmarks/cuda/gemm_race.py [--tokens 16,64] [--bf16]

For each projection ([out, in]: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336)
it builds the plan the tuner would (cublaslt.py: the heuristic's top 8, split-K copies of the
first two, the tile variants of the first) over per-channel E4M3 weights (or bf16 with
`--bf16`) and times each candidate with the weight rotating over copies of >= 400 MB, so that
every call reads HBM as a decode step does. Prints the heuristic's pick, the fastest candidate
(h: heuristic, s: split-K, t: tile variant) and the weight's bytes at the copy rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "cuda"), str(ROOT / "benchmarks")]

from bench_kernels import Timer, bf16_random  # noqa: E402
from fp8_gemv_bench import copy_rate, random_e4m3  # noqa: E402

from atlas.adapters.cuda.backend import CudaGpuBackend  # noqa: E402
from atlas.adapters.cuda.cublaslt import CublasLtGemm, Fp8Scales  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.dense import HostProjection  # noqa: E402
from atlas.ports.kernels.host_weights import HostLinear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROTATION_BYTES = 400 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,64")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights instead of E4M3")
    args = parser.parse_args()
    backend = CudaGpuBackend()
    timer, rt = Timer(backend), backend.runtime
    copy = copy_rate(backend, timer)
    print(f"copy rate {copy / 1e9:.0f} GB/s; device {rt.device_name}")
    rng = np.random.default_rng(0)
    dtype = DType.BF16 if args.bf16 else DType.FP8_E4M3
    for name, (rows, inner) in SHAPES.items():
        weight_bytes = rows * inner * dtype.itemsize
        copies = max(2, -(-ROTATION_BYTES // weight_bytes))
        if args.bf16:
            weights = [backend.upload(bf16_random(rng, (rows, inner), 0.02), DType.BF16) for _ in range(copies)]
            addresses, weight_scales = [w.address for w in weights], None
        else:
            data, scales = random_e4m3(rng, (rows, inner)), rng.uniform(1e-3, 2e-3, rows).astype(np.float32)
            weights = [backend.dense.prepare(HostProjection(HostLinear(data, None, scales, None))).weight
                       for _ in range(copies)]
            addresses, weight_scales = [w.data.address for w in weights], weights[0].scales.address
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            rows4 = -(-num_tokens // 4) * 4  # the FP8 path's padding to whole 4-row groups
            if args.bf16:
                x, fp8 = backend.upload(bf16_random(rng, (num_tokens, inner)), DType.BF16), None
                rows4 = num_tokens
            else:
                x = backend.upload(random_e4m3(rng, (rows4, inner)), DType.FP8_E4M3)
                x_scales = backend.upload(np.full(rows4, 1e-2, np.float32))
                fp8 = Fp8Scales(False, weight_scales, x_scales.address)
            out = backend.empty((rows4, rows), DType.BF16)
            gemm = CublasLtGemm(rt.stream_handle, rt.workspace("gemm_race", 32 << 20))
            plan = gemm._build(rows4, rows, inner, dtype, DType.BF16, False, False,
                               fp8.modes if fp8 else None, (fp8.weight_address, fp8.x_address) if fp8 else None)
            heuristic = gemm._heuristic(plan.descriptor, plan.layouts, 8)
            split = gemm._split_k_variants(plan.descriptor, plan.layouts, heuristic[:2])
            tiles = gemm._tile_variants(plan.descriptor, plan.layouts, heuristic[0], rows4, heuristic)
            plan.candidates = np.concatenate([heuristic, split, tiles])
            kinds = ["h"] * len(heuristic) + ["s"] * len(split) + ["t"] * len(tiles)
            times = []
            for index in range(len(plan.candidates)):
                turn = [0]

                def call(index=index, turn=turn) -> None:
                    address = addresses[turn[0] % copies]
                    turn[0] += 1
                    gemm._enqueue(plan, index, (x.address, address, out.address))

                try:
                    times.append(timer.per_call_us(call, rounds=3))
                except Exception:  # noqa: BLE001 - a candidate refused at run time drops out
                    times.append(float("inf"))
            best = int(np.argmin(times))
            print(f"{name} {rows}x{inner} N={num_tokens}: heuristic {times[0]:.1f} us, fastest {times[best]:.1f} "
                  f"({kinds[best]}{best} of {len(times)}), weight at the copy rate {weight_bytes / copy * 1e6:.1f}")
            gemm.close()
        del weights
        backend.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FP8 decode GEMVs against the copy rate, per Llama-3.1-8B shape (a script, not a test).

    python3 benchmarks/fp8_gemv_bench.py            # ~1 minute on an H100 with a warm kernel cache

For each projection shape of the 8B ([out, in]: o 4096x4096, qkv 6144x4096, gate_up 28672x4096,
down 4096x14336) at 1 and 8 token rows it times, through the dense kind as the model calls it:

    fp8          project over per-channel E4M3 weights, no norm (the GEMV alone)
    fp8+norm     the same with the input RMSNorm (today the norm kernel, then the GEMV)
    fp8 gated    the gated project with its input norm, as the model runs gate_up (norm kernel,
                 then gate and up rows with act(g) * u in the GEMV's epilogue)
    fp8 add      project_add (o and down: residual += product)
    fp8 blk      project over 128 x 128 block-scaled weights, no norm
    bf16         project over bf16 weights, no norm (the bf16 run's GEMV)

Each call is captured 20 times in a CUDA graph and replayed (bench_kernels.Timer: device time,
no Python launch cost); weights rotate over copies totalling >= 400 MB so each call reads HBM,
not the 50 MB L2. GB/s counts the weight bytes with their scales plus x and out once; "of copy"
divides it by the copy rate measured first (a 2 GiB device copy, read + write).
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "cuda")]

from bench_kernels import Timer, bf16_random  # noqa: E402

from atlas.adapters.cuda.backend import CudaGpuBackend  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.dense import HostProjection  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm  # noqa: E402

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROTATION_BYTES = 400 << 20
EPS = 1e-5


def random_e4m3(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Random E4M3 bytes, the two NaN codes (0x7f, 0xff) replaced by zero."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    return raw.view(E4M3)


def copy_rate(backend: CudaGpuBackend, timer: Timer) -> float:
    row_bytes, num_rows = 64 << 10, 16384
    src = backend.empty((num_rows, row_bytes), DType.U8)
    dst = backend.empty((num_rows, row_bytes), DType.U8)
    backend.fill(src, 3)
    identity = backend.upload(np.arange(num_rows, dtype=np.int32))
    us = timer.per_call_us(lambda: backend.gather_rows(src, identity, dst), rounds=5)
    return 2 * num_rows * row_bytes / (us * 1e-6)


def main() -> int:
    rng = np.random.default_rng(0)
    backend = CudaGpuBackend()
    timer = Timer(backend)
    dense = backend.dense
    copy = copy_rate(backend, timer)
    print(f"copy rate {copy / 1e9:.0f} GB/s (read + write); device {backend.runtime.device_name}")
    print(f"{'shape':<20} {'N':>2} {'variant':<11} {'us':>8} {'GB/s':>7} {'of copy':>8}")
    for name, (rows, inner) in SHAPES.items():
        data = random_e4m3(rng, (rows, inner))
        channel_scales = rng.uniform(1e-3, 2e-3, rows).astype(np.float32)
        block_scales = rng.uniform(1e-3, 2e-3, (-(-rows // 128), -(-inner // 128))).astype(np.float32)
        norm = RmsNorm(np.ones(inner, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32), EPS)
        copies = max(2, min(8, -(-ROTATION_BYTES // (rows * inner))))
        gated = name == "gate_up"
        variants: dict[str, list] = {
            "fp8": [HostProjection(HostLinear(data, None, channel_scales, None)) for _ in range(copies)],
            "fp8+norm": [HostProjection(HostLinear(data, None, channel_scales, None), norm) for _ in range(copies)],
            "fp8 blk": [HostProjection(HostLinear(data, None, block_scales, (128, 128))) for _ in range(copies)],
        }
        if gated:
            variants["fp8 gated"] = [
                HostProjection(HostLinear(data, None, channel_scales, None), norm, Activation.SILU)
                for _ in range(copies)
            ]
        if name in ("o", "down"):
            variants["fp8 add"] = variants["fp8"]
        bf16_weight = bf16_random(rng, (rows, inner), 0.02).astype(np.float32)
        bf16_copies = max(2, min(8, -(-ROTATION_BYTES // (2 * rows * inner))))
        variants["bf16"] = [HostProjection(HostLinear(bf16_weight)) for _ in range(bf16_copies)]
        prepared = {kind: [dense.prepare(host) for host in hosts] for kind, hosts in variants.items()}
        for num_tokens in (1, 8):
            x = backend.upload(bf16_random(rng, (num_tokens, inner)), DType.BF16)
            out = backend.empty((num_tokens, rows), DType.BF16)
            half = backend.empty((num_tokens, rows // 2), DType.BF16)
            residual = backend.upload(bf16_random(rng, (num_tokens, rows)), DType.BF16)
            for kind, projections in prepared.items():
                turn = [0]

                def call(kind=kind, projections=projections, turn=turn) -> None:
                    projection = projections[turn[0] % len(projections)]
                    turn[0] += 1
                    if kind == "fp8 add":
                        dense.project_add(x, projection, residual)
                    else:
                        dense.project(x, projection, half if kind == "fp8 gated" else out)

                us = timer.per_call_us(call, rounds=5)
                weight_bytes = rows * inner * (2 if kind == "bf16" else 1)
                scale_bytes = 4 * (block_scales.size if kind == "fp8 blk" else 0 if kind == "bf16" else rows)
                out_width = rows // 2 if kind == "fp8 gated" else rows
                moved = weight_bytes + scale_bytes + 2 * num_tokens * (inner + out_width)
                rate = moved / (us * 1e-6)
                print(f"{name} {rows}x{inner:<8} {num_tokens:>2} {kind:<11} {us:>8.1f} {rate / 1e9:>7.0f} "
                      f"{100 * rate / copy:>7.1f}%")
        del prepared
        backend.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel timings on the GPU (not a test; prints a table). Run: python benchmarks/cuda/bench_kernels.py

Each op is captured 20 times into one CUDA graph and the replays are timed with events, so the
figures are device time without Python launch overhead. Weights rotate over several copies so
repeated GEMVs read HBM, not L2. Figures go with the two ceilings measured in the same run: a
device-to-device copy (bytes read + written) and a large cuBLASLt bf16 GEMM.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))  # the kernel-path test backends
from cuda_harness import cuda_test_backend  # noqa: E402

from atlas.adapters.cuda import CudaGpuBackend, ops_attention
from atlas.adapters.cuda.cublaslt import WORKSPACE_BYTES, CublasLtGemm
from atlas.adapters.cuda.driver import check
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionMetadata, HeadLayout, KvCacheSpec
from atlas.ports.kernels.sampling import SamplingTensors

_REPEATS_PER_GRAPH = 20


class Timer:
    def __init__(self, backend: CudaGpuBackend) -> None:
        self.backend = backend
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        self.start = check("cuEventCreate", cu.cuEventCreate(flags))
        self.stop = check("cuEventCreate", cu.cuEventCreate(flags))

    def per_call_us(self, fn, rounds: int = 7) -> float:
        """Median device microseconds of one `fn` call (captured 20x per graph)."""
        fn()
        self.backend.synchronize()

        def repeated() -> None:
            for _ in range(_REPEATS_PER_GRAPH):
                fn()

        graph = self.backend.capture(repeated)
        graph.replay()
        stream = self.backend.runtime.stream_handle
        samples = []
        for _ in range(rounds):
            check("cuEventRecord", cu.cuEventRecord(self.start, stream))
            graph.replay()
            check("cuEventRecord", cu.cuEventRecord(self.stop, stream))
            check("cuEventSynchronize", cu.cuEventSynchronize(self.stop))
            elapsed_ms = check("cuEventElapsedTime", cu.cuEventElapsedTime(self.start, self.stop))
            samples.append(elapsed_ms * 1000 / _REPEATS_PER_GRAPH)
        return statistics.median(samples)


def bf16_random(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)


def main() -> int:
    rng = np.random.default_rng(0)
    backend = cuda_test_backend(None)  # with the kernel paths' entry points (linear, paged_attention)
    timer = Timer(backend)
    rows: list[tuple[str, str, str]] = []

    # Ceiling 1: an SM-driven copy of 2 GiB (gather_rows over 64 KiB rows), bytes read + written.
    row_bytes, num_rows = 64 << 10, 32768
    src = backend.empty((num_rows, row_bytes), DType.U8)
    dst = backend.empty((num_rows, row_bytes), DType.U8)
    backend.fill(src, 3)
    identity = backend.upload(np.arange(num_rows, dtype=np.int32))
    copy_us = timer.per_call_us(lambda: backend.gather_rows(src, identity, dst), rounds=5)
    bandwidth = 2 * num_rows * row_bytes / (copy_us * 1e-6)
    rows.append(("copy 2 GiB (kernel)", f"{copy_us:.0f} us", f"{bandwidth / 1e12:.2f} TB/s (read + write)"))

    # Ceiling 2: cuBLASLt bf16 GEMM 8192^3, the tuned choice (backend.linear) and the heuristic's
    # first pick (a second GEMM object without tuning, on the same stream).
    rt = backend.runtime
    untuned = CublasLtGemm(rt.stream_handle, rt.workspace("bench-cublaslt", WORKSPACE_BYTES), None)

    def heuristic_linear(x, w, out) -> None:
        n, k = x.shape
        untuned.matmul(x.address, w.address, out.address, n, w.shape[0], k, DType.BF16, out.dtype)

    size = 8192
    a = backend.upload(bf16_random(rng, (size, size)), DType.BF16)
    b = backend.upload(bf16_random(rng, (size, size)), DType.BF16)
    c = backend.empty((size, size), DType.BF16)
    gemm_us = timer.per_call_us(lambda: backend.linear(a, b, c), rounds=5)
    first_pick_us = timer.per_call_us(lambda: heuristic_linear(a, b, c), rounds=5)
    gemm_rate = 2 * size**3 / (gemm_us * 1e-6)
    rows.append(
        (
            "cuBLASLt bf16 8192^3",
            f"{gemm_us:.0f} us",
            f"{gemm_rate / 1e12:.0f} TFLOP/s (heuristic's pick {2 * size**3 / first_pick_us / 1e6:.0f})",
        )
    )

    # Decode sizes, weights rotating over up to 6 copies so each call reads HBM: the GEMV for 1
    # and 8 token rows, then the skinny GEMM and cuBLASLt for 16 and 64; then prefill sizes.
    features = rt.features
    shapes = ((6144, 4096), (4096, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (576, 576))
    for num_rows, inner in shapes:
        copies = max(1, min(6, (400 << 20) // (num_rows * inner * 2)))
        weights = [backend.upload(bf16_random(rng, (num_rows, inner), 0.02), DType.BF16) for _ in range(copies)]
        for num_tokens in (1, 8, 16, 64):
            x = backend.upload(bf16_random(rng, (num_tokens, inner)), DType.BF16)
            out = backend.empty((num_tokens, num_rows), DType.BF16)
            turn = [0]

            def rotating(x=x, out=out, weights=weights, turn=turn) -> None:
                backend.linear(x, weights[turn[0] % len(weights)], out)
                turn[0] += 1

            moved = (num_rows * inner + num_tokens * (inner + num_rows)) * 2
            flops = 2 * num_tokens * num_rows * inner
            for kind in ("gemv",) if num_tokens <= 8 else ("skinny", "cublaslt"):
                rt.features = dataclasses.replace(features, skinny_gemm=kind == "skinny")
                us = timer.per_call_us(rotating)
                rate = f"{moved / (us * 1e-6) / 1e12:.2f} TB/s, {flops / us / 1e6:.0f} TFLOP/s"
                rows.append((f"{kind} N={num_tokens} {num_rows}x{inner}", f"{us:.1f} us", rate))
            rt.features = features
        del weights
    for num_rows, inner in ((4096, 4096), (14336, 4096)):
        weight = backend.upload(bf16_random(rng, (num_rows, inner), 0.02), DType.BF16)
        for num_tokens in (256, 8192):
            x = backend.upload(bf16_random(rng, (num_tokens, inner)), DType.BF16)
            out = backend.empty((num_tokens, num_rows), DType.BF16)
            us = timer.per_call_us(lambda x=x, out=out, weight=weight: backend.linear(x, weight, out), rounds=5)
            first_pick_us = timer.per_call_us(
                lambda x=x, out=out, weight=weight: heuristic_linear(x, weight, out), rounds=5
            )
            moved = (num_rows * inner + num_tokens * (inner + num_rows)) * 2
            flops = 2 * num_tokens * num_rows * inner
            rate = f"{moved / (us * 1e-6) / 1e12:.2f} TB/s, {flops / (us * 1e-6) / 1e12:.0f} TFLOP/s"
            rate += f" (heuristic's pick {first_pick_us:.1f} us)"
            rows.append((f"cublaslt N={num_tokens} {num_rows}x{inner}", f"{us:.1f} us", rate))
    untuned.close()

    # Attention: 8k-token prompts (causal) with both prefill kernels, then decode batches.
    heads = HeadLayout(32, 8, 128)
    smollm2_heads = HeadLayout(9, 3, 64)
    default_keys = dict(ops_attention.WGMMA_KEYS_PER_TILE)
    for kind in ("wgmma n64", "wgmma n128", "mma.sync"):
        rt.features = dataclasses.replace(rt.features, wgmma_attention=kind != "mma.sync")
        keys = 128 if kind == "wgmma n128" else 64
        ops_attention.WGMMA_KEYS_PER_TILE.update({64: keys, 128: keys})
        rows += _attention_rows(
            backend, timer, rng, heads, [8192], [8192], f"prefill 8192 tok, 32/8 x 128, {kind}", True
        )
        rows += _attention_rows(
            backend, timer, rng, smollm2_heads, [8192], [8192], f"prefill 8192 tok, 9/3 x 64, {kind}", True
        )
    ops_attention.WGMMA_KEYS_PER_TILE.update(default_keys)
    rt.features = dataclasses.replace(rt.features, wgmma_attention=True)
    for kind in ("mma", "simt"):
        rt.features = dataclasses.replace(rt.features, mma_decode=kind == "mma")
        for lens, label in (([4096] * 64, "64 x 4096"), ([512] * 64, "64 x 512"), ([512], "1 x 512"), ([32768], "1 x 32768")):
            rows += _attention_rows(backend, timer, rng, heads, lens, [1] * len(lens), f"decode {label} ctx, {kind}", False)
    rt.features = dataclasses.replace(rt.features, mma_decode=True)

    # Sampling: 64 rows over a 128k vocabulary.
    rows += _sampling_rows(backend, timer, rng)

    width = max(len(r[0]) for r in rows)
    print(f"device: {backend.capabilities.device_name}")
    for name, time_text, rate in rows:
        print(f"{name:<{width}}  {time_text:>12}  {rate}")
    return 0


def _attention_rows(backend, timer, rng, heads, context_lens, query_lens, label, is_prefill):
    block_size = 16
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq)
    spec = KvCacheSpec(1, num_blocks, block_size, heads.num_kv_heads, heads.head_dim, DType.BF16)
    kv = backend.attention.allocate_cache(spec)
    from atlas.adapters.cuda.tensor import CudaTensor

    plane_elements = 2 * kv.plane_bytes // 2
    backend.copy_from_host(
        CudaTensor(kv.base_address, (plane_elements,), DType.BF16, kv),
        bf16_random(rng, (plane_elements,)),
    )
    order = rng.permutation(num_blocks).astype(np.int32)
    width = max(blocks_per_seq)
    tables = np.zeros((len(context_lens), width), np.int32)
    start = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[start : start + count]
        start += count
    num_tokens = sum(query_lens)
    positions = np.concatenate([np.arange(c - q, c) for c, q in zip(context_lens, query_lens, strict=True)])
    meta = AttentionMetadata(
        positions=backend.upload(positions.astype(np.int32)),
        slot_mapping=backend.upload(np.zeros(num_tokens, np.int32)),
        query_start_loc=backend.upload(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        block_tables=backend.upload(tables),
        num_tokens=num_tokens,
        num_seqs=len(context_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )
    q = backend.upload(bf16_random(rng, (num_tokens, heads.q_size)), DType.BF16)
    out = backend.empty((num_tokens, heads.q_size), DType.BF16)
    scale = 1 / math.sqrt(heads.head_dim)
    us = timer.per_call_us(lambda: backend.paged_attention(q, kv, 0, meta, heads, scale, out), rounds=5)
    if is_prefill:
        flops = sum(
            2 * 2 * q_len * c * heads.num_q_heads * heads.head_dim / 2
            for c, q_len in zip(context_lens, query_lens, strict=True)
        )
        return [(f"attention {label}", f"{us:.0f} us", f"{flops / (us * 1e-6) / 1e12:.0f} TFLOP/s (causal)")]
    kv_bytes = sum(2 * c * heads.kv_size * 2 for c in context_lens)
    return [(f"attention {label}", f"{us:.1f} us", f"{kv_bytes / (us * 1e-6) / 1e12:.2f} TB/s of KV")]


def _sampling_rows(backend, timer, rng):
    num_rows, vocab_size = 64, 128256
    logits = backend.upload(bf16_random(rng, (num_rows, vocab_size), 3.0), DType.BF16)
    out = backend.empty((num_rows,), DType.I32)
    result = []
    variants = (
        ("greedy", 0.0, 0, 1.0, 0.0),
        ("T=0.8", 0.8, 0, 1.0, 0.0),
        ("T=0.8 top_k=50", 0.8, 50, 1.0, 0.0),
        ("T=0.8 min_p=0.05", 0.8, 0, 1.0, 0.05),
        ("T=0.8 top_p=0.9", 0.8, 0, 0.9, 0.0),
        ("T=0.8 top_k=50 top_p=0.9", 0.8, 50, 0.9, 0.0),
    )
    for label, temperature, top_k, top_p, min_p in variants:
        params = SamplingTensors(
            temperature=backend.upload(np.full(num_rows, temperature, np.float32)),
            top_k=backend.upload(np.full(num_rows, top_k, np.int32)),
            top_p=backend.upload(np.full(num_rows, top_p, np.float32)),
            min_p=backend.upload(np.full(num_rows, min_p, np.float32)),
            seeds=backend.upload(np.arange(num_rows, dtype=np.int64)),
            counters=backend.upload(np.zeros(num_rows, np.int64)),
            repetition_penalty=backend.upload(np.ones(num_rows, np.float32)),
            presence_penalty=backend.upload(np.zeros(num_rows, np.float32)),
            frequency_penalty=backend.upload(np.zeros(num_rows, np.float32)),
            penalty_offsets=backend.upload(np.zeros(num_rows + 1, np.int32)),
            penalty_token_ids=backend.upload(np.zeros(1, np.int32)),
            penalty_output_counts=backend.upload(np.zeros(1, np.int32)),
            bias_offsets=backend.upload(np.zeros(num_rows + 1, np.int32)),
            bias_token_ids=backend.upload(np.zeros(1, np.int32)),
            bias_values=backend.upload(np.zeros(1, np.float32)),
            num_rows=num_rows,
            all_greedy=temperature == 0.0,
            any_penalties=False,
            any_bias=False,
        )
        us = timer.per_call_us(lambda params=params: backend.sample(logits, params, out), rounds=5)
        result.append((f"sample {num_rows} x {vocab_size} {label}", f"{us:.0f} us", ""))
    return result


if __name__ == "__main__":
    sys.exit(main())

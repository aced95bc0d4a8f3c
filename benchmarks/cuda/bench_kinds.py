"""Layer-level timings of the MoE, recurrent and attention-variant kinds on CUDA against their
byte rooflines and against transformers' own modules (not a test; prints a table last).

    python benchmarks/cuda/bench_kinds.py [moe route gdn prefill sinks]     (from the repository root)

moe:     the Qwen3-30B-A3B MoE layer (H 2048, 128 experts of 768, top 8), route + experts at
         batch 1 and 64, weights rotating over 4 layer copies so they stream from HBM; roofline
         = (router + the distinct experts the step touched) / the copy bandwidth of the same run.
route:   the decode routing alone (moe_route_small) and routing + experts at batch 1 and 4, for
         Qwen3-30B-A3B's shape and Qwen3-Next's (H 2048, 512 experts of 512, top 10), with a
         digest of the ids, weights and output (two kernel sources should print the same).
gdn:     a Qwen3-Next Gated DeltaNet mixer (in_proj, conv, delta rule, gated norm, out_proj) at
         batch 1; roofline = (projection weights + conv and recurrent state read and written) / BW.
prefill: 8192 tokens through the same MoE layer and GDN mixer, against transformers'
         Qwen3MoeSparseMoeBlock (grouped_mm where the torch build has it, and eager) and
         Qwen3NextGatedDeltaNet (the torch chunked delta rule: fla is not installed) on this GPU.
sinks:   GPT-OSS-shaped attention (64 q / 8 KV heads of 64): decode at 64 x 4096 and an 8192-token
         prompt, with sinks (the `_x` kernels) against without.
Every figure is device time of graph replays (events), median of 5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))

from cuda_harness import cuda_cache_with, paged_case, upload_metadata  # noqa: E402

from atlas.adapters.cuda import CudaGpuBackend, ops_attention  # noqa: E402
from atlas.adapters.cuda.driver import check  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import HeadLayout  # noqa: E402
from atlas.ports.kernels.dense import HostProjection  # noqa: E402
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm  # noqa: E402
from atlas.ports.kernels.moe import HostMoe, Routing  # noqa: E402
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec  # noqa: E402

_NORMAL = np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32)
_POOLS: dict[float, np.ndarray] = {}
_REPEATS = 10


def random_bf16(rng, shape, scale=0.02):
    """bf16 values from a pool of normal samples at a random offset (seconds, not minutes, for
    a GB of weights)."""
    pool = _POOLS.get(scale)
    if pool is None:
        pool = _POOLS[scale] = (_NORMAL * np.float32(scale)).astype(ml_dtypes.bfloat16)
    count = int(np.prod(shape))
    return np.resize(np.roll(pool, -int(rng.integers(0, pool.size))), count).reshape(shape)


class Timer:
    def __init__(self, backend: CudaGpuBackend) -> None:
        self.backend = backend
        self.start = check("cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
        self.stop = check("cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))

    def us(self, fns, repeats: int = _REPEATS) -> float:
        """Median device us of one round over `fns` (each called once a round, in a graph)."""
        for fn in fns:
            fn()
        self.backend.synchronize()

        def rounds() -> None:
            for _ in range(repeats):
                for fn in fns:
                    fn()

        graph = self.backend.capture(rounds)
        graph.replay()
        stream = self.backend.runtime.stream_handle
        samples = []
        for _ in range(5):
            check("cuEventRecord", cu.cuEventRecord(self.start, stream))
            graph.replay()
            check("cuEventRecord", cu.cuEventRecord(self.stop, stream))
            check("cuEventSynchronize", cu.cuEventSynchronize(self.stop))
            samples.append(check("cuEventElapsedTime", cu.cuEventElapsedTime(self.start, self.stop)) * 1000 / repeats)
        return statistics.median(samples) / len(fns)


def copy_bandwidth(backend, timer) -> float:
    row_bytes, num_rows = 64 << 10, 16384
    src, dst = backend.empty((num_rows, row_bytes), DType.U8), backend.empty((num_rows, row_bytes), DType.U8)
    backend.fill(src, 3)
    identity = backend.upload(np.arange(num_rows, dtype=np.int32))
    us = timer.us([lambda: backend.gather_rows(src, identity, dst)], repeats=3)
    return 2 * num_rows * row_bytes / (us * 1e-6)


QWEN3_30B = dict(hidden=2048, inner=768, experts=128, top_k=8)


def moe_host(rng, hidden, inner, experts, top_k):
    return HostMoe(
        input_norm=RmsNorm(np.ones(hidden, np.float32), 1e-6),
        router=HostLinear(random_bf16(rng, (experts, hidden), 0.05)),
        gate_up=HostLinear(random_bf16(rng, (experts, 2 * inner, hidden))),
        down=HostLinear(random_bf16(rng, (experts, hidden, inner))),
        activation=Activation.SILU,
        routing=Routing(experts, top_k, renormalize=True),
    )


def bench_moe(backend, timer, rng, bandwidth, rows):
    shape = QWEN3_30B
    layers = [backend.moe.prepare(moe_host(rng, **shape)) for _ in range(4)]
    expert_bytes = 3 * shape["hidden"] * shape["inner"] * 2
    for batch in (1, 64):
        steps, touched = [], []
        for layer in layers:
            x = backend.upload(random_bf16(rng, (batch, shape["hidden"]), 1.0), DType.BF16)
            normed = backend.empty((batch, shape["hidden"]), DType.BF16)
            ids = backend.empty((batch, shape["top_k"]), DType.I32)
            weights = backend.empty((batch, shape["top_k"]), DType.F32)

            def step(layer=layer, x=x, normed=normed, ids=ids, weights=weights):
                backend.moe.route(x, layer, normed, ids, weights)
                backend.moe.experts(normed, layer, ids, weights, x)

            step()
            touched.append(len(np.unique(backend.download(ids))))
            steps.append(step)
        us = timer.us(steps)
        roofline_us = (statistics.mean(touched) * expert_bytes + shape["experts"] * shape["hidden"] * 2) / bandwidth * 1e6
        rows.append((f"MoE Qwen3-30B-A3B batch {batch}", f"{us:.1f} us",
                     f"{roofline_us / us:.0%} of roofline ({statistics.mean(touched):.0f} experts, {roofline_us:.1f} us)"))


QWEN3_NEXT_MOE = dict(hidden=2048, inner=512, experts=512, top_k=10)


def bench_route(backend, timer, rows):
    for name, shape in (("Qwen3-30B-A3B", QWEN3_30B), ("Qwen3-Next", QWEN3_NEXT_MOE)):
        rng = np.random.default_rng(1)
        layers = [backend.moe.prepare(moe_host(rng, **shape)) for _ in range(4)]
        for batch in (1, 4):
            routes, fulls, digest = [], [], hashlib.sha1()
            for layer in layers:
                values = random_bf16(rng, (batch, shape["hidden"]), 1.0)
                x, residual = backend.upload(values, DType.BF16), backend.upload(values, DType.BF16)
                normed = backend.empty((batch, shape["hidden"]), DType.BF16)
                ids = backend.empty((batch, shape["top_k"]), DType.I32)
                weights = backend.empty((batch, shape["top_k"]), DType.F32)

                def route(layer=layer, x=x, normed=normed, ids=ids, weights=weights):
                    backend.moe.route(x, layer, normed, ids, weights)

                def full(layer=layer, x=residual, normed=normed, ids=ids, weights=weights):
                    backend.moe.route(x, layer, normed, ids, weights)
                    backend.moe.experts(normed, layer, ids, weights, x)

                route()
                digest.update(backend.download(ids).tobytes() + backend.download(weights).tobytes())
                full()
                digest.update(backend.download(residual).tobytes())
                routes.append(route)
                fulls.append(full)
            rows.append((f"MoE route {name} batch {batch}", f"{timer.us(routes):.2f} us",
                         f"route + experts {timer.us(fulls):.2f} us; digest {digest.hexdigest()[:12]}"))


QWEN3_NEXT = DeltaNetLayer(state_layer=0, num_key_heads=16, num_value_heads=32, key_head_dim=128,
                           value_head_dim=128, conv_kernel=4)


def gdn_layer(backend, rng, hidden=2048, index=0):
    layer = dataclasses.replace(QWEN3_NEXT, state_layer=index)
    in_proj = backend.dense.prepare(HostProjection(HostLinear(random_bf16(rng, (layer.projected_width, hidden))),
                                                   RmsNorm(np.ones(hidden, np.float32), 1e-6)))
    out_proj = backend.dense.prepare(HostProjection(HostLinear(random_bf16(rng, (hidden, layer.value_dim)))))
    host = HostDeltaNet(random_bf16(rng, (layer.conv_dim, layer.conv_kernel), 0.3),
                        np.log(rng.uniform(1, 16, layer.num_value_heads)).astype(np.float32),
                        random_bf16(rng, (layer.num_value_heads,), 0.5), RmsNorm(np.ones(128, np.float32), 1e-6))
    return in_proj, backend.recurrent.prepare(host, layer), out_proj


def gdn_mixer(backend, rng, batch, tokens_each, hidden=2048, layers=4):
    """Callables running `layers` GDN mixers over `batch` sequences of `tokens_each` tokens each
    (a fresh prompt when tokens_each > 1, else a decode step)."""
    layer = QWEN3_NEXT
    spec = RecurrentStateSpec(layers, max(batch, 1), layer.conv_dim, layer.conv_kernel, layer.num_value_heads,
                              layer.key_head_dim, layer.value_head_dim)
    state = backend.recurrent.allocate_state(spec)
    tokens = batch * tokens_each
    contexts = [tokens_each if tokens_each > 1 else 100] * batch
    meta = RecurrentMetadata(backend.upload(np.arange(0, tokens + 1, tokens_each, dtype=np.int32)),
                             backend.upload(np.asarray(contexts, np.int32)),
                             backend.upload(np.arange(batch, dtype=np.int32)), tokens, batch, tokens_each)
    x = backend.upload(random_bf16(rng, (tokens, hidden), 1.0), DType.BF16)
    projected = backend.empty((tokens, layer.projected_width), DType.BF16)
    mixed = backend.empty((tokens, layer.conv_dim), DType.BF16)
    out = backend.empty((tokens, layer.value_dim), DType.BF16)
    fns = []
    for index in range(layers):
        in_proj, prepared, out_proj = gdn_layer(backend, rng, hidden, index)

        def run(in_proj=in_proj, prepared=prepared, out_proj=out_proj):
            backend.dense.project(x, in_proj, projected)
            backend.recurrent.causal_conv1d(projected, prepared, meta, state, mixed)
            backend.recurrent.gated_delta_rule(mixed, projected, prepared, meta, state, out)
            backend.dense.project_add(out, out_proj, x)

        fns.append(run)
    return fns


def bench_gdn(backend, timer, rng, bandwidth, rows):
    layer, hidden = QWEN3_NEXT, 2048
    us = timer.us(gdn_mixer(backend, rng, 1, 1, hidden))
    weights = (layer.projected_width * hidden + hidden * layer.value_dim) * 2
    state = 2 * 4 * (layer.num_value_heads * layer.key_head_dim * layer.value_head_dim
                     + (layer.conv_kernel - 1) * layer.conv_dim)
    roofline_us = (weights + state) / bandwidth * 1e6
    rows.append(("GDN mixer Qwen3-Next batch 1", f"{us:.1f} us", f"{roofline_us / us:.0%} of roofline "
                 f"({(weights + state) / 2**20:.0f} MiB, state {state / 2**20:.1f} MiB)"))


def bench_prefill(backend, timer, rng, rows):
    tokens = 8192
    shape = QWEN3_30B
    layer = backend.moe.prepare(moe_host(rng, **shape))
    x = backend.upload(random_bf16(rng, (tokens, shape["hidden"]), 1.0), DType.BF16)
    normed = backend.empty((tokens, shape["hidden"]), DType.BF16)
    ids, weights = backend.empty((tokens, 8), DType.I32), backend.empty((tokens, 8), DType.F32)

    def moe_step():
        backend.moe.route(x, layer, normed, ids, weights)
        backend.moe.experts(normed, layer, ids, weights, x)

    moe_us = timer.us([moe_step], repeats=2)
    flops = 6 * tokens * shape["top_k"] * shape["hidden"] * shape["inner"]
    gdn_us = timer.us(gdn_mixer(backend, rng, 1, tokens, layers=1), repeats=1)
    reference = transformers_prefill(tokens)
    rows.append((f"MoE prefill {tokens}", f"{moe_us / 1e3:.2f} ms", f"{flops / moe_us / 1e6:.0f} TFLOP/s; "
                 + ", ".join(f"{name} {ms:.2f} ms" for name, ms in reference.get("moe", {}).items())))
    rows.append((f"GDN mixer prefill {tokens}", f"{gdn_us / 1e3:.2f} ms",
                 ", ".join(f"{name} {ms:.2f} ms" for name, ms in reference.get("gdn", {}).items())))


def transformers_prefill(tokens: int) -> dict:
    """transformers' own blocks on this GPU (bf16, random weights), ms per call."""
    try:
        import torch
        from transformers import Qwen3MoeConfig, Qwen3NextConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    except Exception as error:  # noqa: BLE001 - a bench prints what it could not run
        print(f"transformers reference skipped: {error}", file=sys.stderr)
        return {}
    if not torch.cuda.is_available():
        return {}

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(5):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        return statistics.median(samples)

    results: dict = {"moe": {}, "gdn": {}}
    with torch.no_grad():
        config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                norm_topk_prob=True)
        x = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
        for implementation in ("grouped_mm", "eager"):
            try:
                config._experts_implementation = implementation
            except Exception:  # noqa: BLE001
                continue
            block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
            for parameter in block.parameters():
                parameter.normal_(0, 0.02)
            try:
                results["moe"][f"transformers {implementation}"] = timed(lambda block=block: block(x))
            except Exception as error:  # noqa: BLE001
                print(f"transformers {implementation}: {error}", file=sys.stderr)
        next_config = Qwen3NextConfig(hidden_size=2048, linear_num_value_heads=32, linear_num_key_heads=16,
                                      linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
        mixer = Qwen3NextGatedDeltaNet(next_config, 0).to("cuda", torch.bfloat16)
        for parameter in mixer.parameters():
            parameter.normal_(0, 0.02)
        results["gdn"]["transformers"] = timed(lambda: mixer(x))
    return results


def bench_sinks(backend, timer, rng, rows):
    heads = HeadLayout(64, 8, 64)
    sinks = backend.upload((rng.standard_normal(64) * 2).astype(np.float32), DType.F32)
    for label, context_lens, query_lens in (("decode 64 x 4096", [4096] * 64, [1] * 64),
                                            ("prefill 8192", [8192], [8192])):
        case = paged_case(rng, heads, context_lens, query_lens)
        kv = cuda_cache_with(backend, case)
        meta = upload_metadata(backend, case)
        q = backend.upload(case.query, DType.BF16)
        out = backend.empty((case.num_tokens, heads.q_size), DType.BF16)
        figures = []
        for extras in (None, ops_attention.AttentionExtras(sinks)):
            figures.append(timer.us([lambda extras=extras: ops_attention.attention(
                backend.runtime, q, kv, 0, meta, heads, 0.125, out, None, extras)], repeats=3))
        rows.append((f"attention GPT-OSS {label}", f"{figures[1]:.1f} us with sinks", f"{figures[0]:.1f} us without"))


def main() -> int:
    steps = sys.argv[1:] or ["moe", "gdn", "prefill", "sinks"]
    backend = CudaGpuBackend()
    timer = Timer(backend)
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(backend, timer)
    rows = [("copy ceiling", f"{bandwidth / 1e12:.2f} TB/s", backend.runtime.device_name)]
    for step in steps:
        {"moe": lambda: bench_moe(backend, timer, rng, bandwidth, rows),
         "route": lambda: bench_route(backend, timer, rows),
         "gdn": lambda: bench_gdn(backend, timer, rng, bandwidth, rows),
         "prefill": lambda: bench_prefill(backend, timer, rng, rows),
         "sinks": lambda: bench_sinks(backend, timer, rng, rows)}[step]()
        print(rows[-1], file=sys.stderr, flush=True)
    width = max(len(row[0]) for row in rows)
    for name, figure, note in rows:
        print(f"{name:<{width}}  {figure:>16}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole-model step timings on the GPU with random weights (not a test; prints a table).

Run: python benchmarks/cuda/bench_model_step.py [smollm2] [llama8b]

The real model loop (atlas.domain.models.model) over random bf16 weights of two shapes:

  SmolLM2-135M, batch 1 at a 512-token context: one captured decode step (forward + greedy
    sampling, ~280 kernels) replayed back to back, with and without programmatic dependent
    launch: launch gaps, not bytes, bound it.
  Llama-3.1-8B, decode at batch 1 and 64 (512-token contexts, one graph per step; the norm
    weights folded into the projections as the loader does, then not) against the roofline
    (weight bytes + KV bytes read per step over the copy bandwidth measured here), and an
    8192-token prefill (eager) against the bf16 GEMM rate measured here, with both prefill
    attention kernels.

Weights and KV are copies of one random buffer (values do not matter to the time; zeros are
never used). Device time by events; replays are back to back, so host work is not counted.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import ml_dtypes
import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda import CudaGpuBackend, ops_attention
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.domain.models.cache_groups import KvShape, group_caches
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.feed_forward import DenseFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.mixers import AttentionMixer
from atlas.domain.models.model import Model, StepTensors
from atlas.domain.models.rope import rope_table
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, KvCacheSpec
from atlas.ports.kernels.host_weights import Activation
from atlas.ports.kernels.sampling import SamplingTensors

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
_BLOCK_SIZE = 16
_POOL_BYTES = 64 << 20


class RandomFill:
    """Fills device tensors with copies of one 64 MB random bf16 buffer (std `scale`)."""

    def __init__(self, backend: CudaGpuBackend, rng: np.random.Generator, scale: float) -> None:
        self.backend = backend
        values = (rng.standard_normal(_POOL_BYTES // 2, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)
        self.pool = backend.upload(values, DType.BF16)

    def tensor(self, shape: tuple[int, ...]) -> CudaTensor:
        out = self.backend.empty(shape, DType.BF16)
        self.fill_bytes(out.address, out.num_elements * 2)
        return out

    def fill_bytes(self, address: int, num_bytes: int) -> None:
        stream = self.backend.runtime.stream_handle
        for offset in range(0, num_bytes, _POOL_BYTES):
            count = min(_POOL_BYTES, num_bytes - offset)
            check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(address + offset, self.pool.address, count, stream))


def build_model(
    backend: CudaGpuBackend, fill: RandomFill, raw_config: dict, max_positions: int, fold: bool = True
) -> Model:
    """A model of `raw_config`'s shape over random weights filled on the device, prepared as the
    CUDA kinds prepare a checkpoint's (the norm weights folded into the projections where the
    backend folds them) unless `fold` is False."""
    config = ModelConfig.from_dict(raw_config)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads = HeadLayout(config.num_heads, config.num_kv_heads, d)
    ones = backend.upload(np.ones(h, np.float32), DType.BF16)
    table = backend.upload(rope_table(config, max_positions), DType.F32)
    dense, attention, eps = backend.dense, backend.attention, config.rms_norm_eps
    layers = []
    for index in range(config.num_layers):
        spec = AttentionLayer(heads, index, d**-0.5, table)
        qkv = fill.tensor((heads.q_size + 2 * heads.kv_size, h))
        mixer = AttentionMixer(
            spec, 0, attention.layer(spec, qkv, None, ones, eps, fold=fold),
            dense.projection(fill.tensor((h, heads.q_size)), None, None, 0.0, None), h,
        )
        feed_forward = DenseFeedForward(
            dense.projection(fill.tensor((2 * i, h)), None, ones, eps, Activation.SILU, fold=fold),
            dense.projection(fill.tensor((h, i)), None, None, 0.0, None), i, h,
        )
        layers.append(Layer(mixer, feed_forward))
    embedding = fill.tensor((config.vocab_size, h))
    lm_head = None if config.tie_word_embeddings else fill.tensor((config.vocab_size, h))
    vocab = dense.vocab(embedding, ones, eps, lm_head, fold=fold)
    groups = group_caches([KvShape(config.num_kv_heads, d)] * config.num_layers)
    return Model(backend, vocab, layers, groups, h, config.vocab_size)


def weight_bytes_per_step(config: ModelConfig) -> int:
    """Bytes of every matrix a decode step reads (layers and lm_head; embedding rows are few)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv, output = (config.num_heads + 2 * config.num_kv_heads) * d * h, h * config.num_heads * d
    return 2 * (config.num_layers * (qkv + output + 3 * h * i) + config.vocab_size * h)


def step_inputs(backend, model: Model, context_lens: list[int], query_lens: list[int]):
    """Token ids, metadata and sample rows for sequences whose last `query_lens` tokens run now."""
    blocks = [-(-c // _BLOCK_SIZE) for c in context_lens]
    tables = np.zeros((len(context_lens), max(blocks)), np.int32)
    next_block, positions, slots = 0, [], []
    for s, (context, query) in enumerate(zip(context_lens, query_lens, strict=True)):
        tables[s, : blocks[s]] = np.arange(next_block, next_block + blocks[s])
        next_block += blocks[s]
        token_positions = np.arange(context - query, context)
        positions.append(token_positions)
        slots.append(tables[s, token_positions // _BLOCK_SIZE] * _BLOCK_SIZE + token_positions % _BLOCK_SIZE)
    num_tokens = sum(query_lens)
    meta = AttentionMetadata(
        positions=backend.upload(np.concatenate(positions).astype(np.int32)),
        slot_mapping=backend.upload(np.concatenate(slots).astype(np.int32)),
        query_start_loc=backend.upload(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
        seq_lens=backend.upload(np.asarray(context_lens, np.int32)),
        block_tables=backend.upload(tables),
        num_tokens=num_tokens,
        num_seqs=len(context_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )
    token_ids = backend.upload(np.arange(num_tokens, dtype=np.int32) % model.vocab_size)
    last_rows = (np.cumsum(query_lens) - 1).astype(np.int32)
    return StepTensors(token_ids, (meta,), backend.upload(last_rows)), next_block


def greedy_params(backend, num_rows: int) -> SamplingTensors:
    zeros_f, zeros_i = np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int32)
    return SamplingTensors(
        temperature=backend.upload(zeros_f),
        top_k=backend.upload(zeros_i),
        top_p=backend.upload(np.ones(num_rows, np.float32)),
        min_p=backend.upload(zeros_f),
        seeds=backend.upload(np.arange(num_rows, dtype=np.int64)),
        counters=backend.upload(np.zeros(num_rows, np.int64)),
        repetition_penalty=backend.upload(np.ones(num_rows, np.float32)),
        presence_penalty=backend.upload(zeros_f),
        frequency_penalty=backend.upload(zeros_f),
        penalty_offsets=backend.upload(np.zeros(num_rows + 1, np.int32)),
        penalty_token_ids=backend.upload(np.zeros(1, np.int32)),
        penalty_output_counts=backend.upload(np.zeros(1, np.int32)),
        bias_offsets=backend.upload(np.zeros(num_rows + 1, np.int32)),
        bias_token_ids=backend.upload(np.zeros(1, np.int32)),
        bias_values=backend.upload(np.zeros(1, np.float32)),
        num_rows=num_rows,
        all_greedy=True,
        any_penalties=False,
        any_bias=False,
    )


class Events:
    def __init__(self, backend: CudaGpuBackend) -> None:
        self.backend = backend
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        self.start = check("cuEventCreate", cu.cuEventCreate(flags))
        self.stop = check("cuEventCreate", cu.cuEventCreate(flags))

    def median_us(self, fn, repeats: int, rounds: int = 5) -> float:
        """Median over `rounds` of the device time of `repeats` back-to-back `fn()`, per call."""
        stream = self.backend.runtime.stream_handle
        samples = []
        for _ in range(rounds):
            check("cuEventRecord", cu.cuEventRecord(self.start, stream))
            for _ in range(repeats):
                fn()
            check("cuEventRecord", cu.cuEventRecord(self.stop, stream))
            check("cuEventSynchronize", cu.cuEventSynchronize(self.stop))
            samples.append(check("cuEventElapsedTime", cu.cuEventElapsedTime(self.start, self.stop)) * 1e3 / repeats)
        return statistics.median(samples)


def llama_8b_with_kv(backend, fill, max_batch: int, context: int = 512):
    """The Llama-3.1-8B shape over random weights, and a filled KV cache for `max_batch`
    sequences of `context` tokens."""
    model = build_model(backend, fill, LLAMA_8B, 8192)
    config = ModelConfig.from_dict(LLAMA_8B)
    blocks = max_batch * context // _BLOCK_SIZE + 64
    spec = KvCacheSpec(config.num_layers, blocks, _BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    kv = backend.attention.allocate_cache(spec)
    fill.fill_bytes(kv.base_address, spec.total_bytes)
    return model, kv


def decode_step_us(backend, events, fill, model, kv, batch: int, context: int, sample: bool = True) -> float:
    """Device microseconds of one captured decode step (forward, then greedy sampling unless
    `sample` is False) at `batch`."""
    return events.median_us(capture_decode_step(backend, model, kv, batch, context, sample).replay, repeats=20)


def capture_decode_step(backend, model, kv, batch: int, context: int, sample: bool = True):
    """The decode step of `batch` sequences at `context` tokens, captured (and replayed once)."""
    step, _ = step_inputs(backend, model, [context] * batch, [1] * batch)
    workspace = model.allocate_workspace(batch, batch)
    params = greedy_params(backend, batch)
    out_ids = backend.empty((batch,), DType.I32)

    def forward() -> None:
        logits = model.forward(step, (kv,), workspace, batch)
        if sample:
            backend.sampling.sample(logits, params, out_ids)

    forward()  # eager first: cuBLASLt times its candidates outside the capture
    backend.synchronize()
    graph = backend.capture(forward)
    graph.replay()
    return graph


def with_features(backend, **changes) -> None:
    rt = backend.runtime
    rt.features = dataclasses.replace(rt.features, **changes)


def smollm2_rows(backend, events, rng) -> list[tuple[str, str, str]]:
    fill = RandomFill(backend, rng, 0.05)
    model = build_model(backend, fill, SMOLLM2, 1024)
    config = ModelConfig.from_dict(SMOLLM2)
    spec = KvCacheSpec(config.num_layers, 64, _BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    kv = backend.attention.allocate_cache(spec)
    fill.fill_bytes(kv.base_address, spec.total_bytes)
    rows = []
    for pdl in (True, False):
        with_features(backend, programmatic_launch=pdl)
        us = decode_step_us(backend, events, fill, model, kv, 1, 512)
        label = "PDL on" if pdl else "PDL off"
        rows.append((f"SmolLM2-135M decode b1 ctx512, {label}", f"{us:.1f} us", f"{1e6 / us:.0f} tokens/s"))
    with_features(backend, programmatic_launch=True)
    us = decode_step_us(backend, events, fill, model, kv, 1, 512, sample=False)
    rows.append(("SmolLM2-135M decode b1 ctx512, forward only", f"{us:.1f} us", ""))
    with_features(backend, gemv_rope=False)
    us = decode_step_us(backend, events, fill, model, kv, 1, 512)
    rows.append(
        ("SmolLM2-135M decode b1 ctx512, RoPE kernel (gemv_rope off)", f"{us:.1f} us", f"{1e6 / us:.0f} tokens/s")
    )
    with_features(backend, gemv_rope=True)
    return rows


def llama_rows(backend, events, rng, copy_bandwidth: float) -> list[tuple[str, str, str]]:
    fill = RandomFill(backend, rng, 0.02)
    model = build_model(backend, fill, LLAMA_8B, 8192)
    config = ModelConfig.from_dict(LLAMA_8B)
    kv_blocks = 64 * 512 // _BLOCK_SIZE + 8192 // _BLOCK_SIZE
    spec = KvCacheSpec(config.num_layers, kv_blocks, _BLOCK_SIZE, config.num_kv_heads, config.head_dim, DType.BF16)
    kv = backend.attention.allocate_cache(spec)
    fill.fill_bytes(kv.base_address, spec.total_bytes)
    weights = weight_bytes_per_step(config)
    kv_per_token = config.kv_bytes_per_token_per_dtype_byte * 2
    rows, step_us = [], {}
    for batch in (1, 64):
        us = decode_step_us(backend, events, fill, model, kv, batch, 512)
        step_us[batch] = us
        ideal_us = (weights + batch * 512 * kv_per_token) / copy_bandwidth * 1e6
        rows.append(
            (
                f"Llama-3.1-8B decode b{batch} ctx512",
                f"{us:.0f} us",
                f"{ideal_us / us:.0%} of roofline ({ideal_us:.0f} us)",
            )
        )
    rows.append(("Llama-3.1-8B decode b64 / b1", f"{step_us[64] / step_us[1]:.3f}", "target <= 1.35"))
    unfolded = build_model(backend, fill, LLAMA_8B, 8192, fold=False)
    for batch in (1, 64):
        us = decode_step_us(backend, events, fill, unfolded, kv, batch, 512)
        rows.append((f"Llama-3.1-8B decode b{batch} ctx512, norms not folded", f"{us:.0f} us", ""))
    del unfolded

    # GEMM rate of this run, then an 8192-token prefill (eager; cuBLASLt tuned in the warm-up).
    gemm_rate = prefill_gemm_rate(backend, events, fill)
    rows.append(("cuBLASLt bf16 8192 x 14336 x 4096", "", f"{gemm_rate / 1e12:.0f} TFLOP/s"))
    tokens = 8192
    step, _ = step_inputs(backend, model, [tokens], [tokens])
    workspace = model.allocate_workspace(tokens, 1)
    # FLOPs: the layers' matrices for every token, lm_head for the sampled row, causal attention.
    lm_head = config.vocab_size * config.hidden_size
    layer_matrices = weights // 2 - lm_head
    flops = 2 * layer_matrices * tokens + 2 * lm_head
    flops += config.num_layers * 4 * tokens * tokens / 2 * config.num_heads * config.head_dim
    default_keys = dict(ops_attention.WGMMA_KEYS_PER_TILE)
    for kind in ("wgmma n64", "wgmma n128", "mma.sync"):
        with_features(backend, wgmma_attention=kind != "mma.sync")
        keys = 128 if kind == "wgmma n128" else 64
        ops_attention.WGMMA_KEYS_PER_TILE.update({64: keys, 128: keys})
        model.forward(step, (kv,), workspace, 1)
        backend.synchronize()
        us = events.median_us(lambda: model.forward(step, (kv,), workspace, 1), repeats=1, rounds=3)
        rate = flops / (us * 1e-6)
        rows.append(
            (
                f"Llama-3.1-8B prefill 8192 ({kind} attention)",
                f"{us / 1e3:.1f} ms",
                f"{rate / 1e12:.0f} TFLOP/s = {rate / gemm_rate:.0%} of the GEMM rate",
            )
        )
    ops_attention.WGMMA_KEYS_PER_TILE.update(default_keys)
    with_features(backend, wgmma_attention=True)
    return rows


def prefill_gemm_rate(backend, events, fill) -> float:
    x = fill.tensor((8192, 4096))
    projection = backend.dense.projection(fill.tensor((14336, 4096)), None, None, 0.0, None)
    out = backend.empty((8192, 14336), DType.BF16)
    backend.dense.project(x, projection, out)
    us = events.median_us(lambda: backend.dense.project(x, projection, out), repeats=5)
    return 2 * 8192 * 14336 * 4096 / (us * 1e-6)


def copy_rate(backend, events) -> float:
    row_bytes, num_rows = 64 << 10, 32768
    src = backend.empty((num_rows, row_bytes), DType.U8)
    dst = backend.empty((num_rows, row_bytes), DType.U8)
    backend.fill(src, 3)
    identity = backend.upload(np.arange(num_rows, dtype=np.int32))
    us = events.median_us(lambda: backend.gather_rows(src, identity, dst), repeats=5)
    return 2 * num_rows * row_bytes / (us * 1e-6)


def main(argv: list[str]) -> int:
    wanted = set(argv) or {"smollm2", "llama8b"}
    rng = np.random.default_rng(0)
    backend = CudaGpuBackend()
    events = Events(backend)
    rows: list[tuple[str, str, str]] = []
    bandwidth = copy_rate(backend, events)
    rows.append(("copy 2 GiB (kernel)", "", f"{bandwidth / 1e12:.2f} TB/s (read + write)"))
    if "smollm2" in wanted:
        rows += smollm2_rows(backend, events, rng)
    if "llama8b" in wanted:
        rows += llama_rows(backend, events, rng, bandwidth)
    width = max(len(r[0]) for r in rows)
    print(f"device: {backend.capabilities.device_name}")
    for name, time_text, rate in rows:
        print(f"{name:<{width}}  {time_text:>10}  {rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Helpers for the CUDA backend's kernel-path tests: rounding, poisoning, paged KV cases, and the
two test backends that give each internal op path an entry point.

The port's members work at a layer's granularity (tests/contract checks them on every backend);
these tests pin down the CUDA paths behind them one by one (GEMV, tensor-core GEMV, skinny
GEMM, cuBLASLt; the folded norm; the RoPE epilogue; each attention kernel). `CudaTestBackend`
is the CUDA backend with those paths callable; `MockReference` is the mock with the same entry
points in numpy, the float32 reference they are compared with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from atlas.adapters.mock.attention import MockAttentionLayer, _quantize, _rotate
from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.dense import gated_activation, rmsnorm
from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.sampling import PackedSampling
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, KvCacheSpec
from atlas.ports.kernels.host_weights import Activation
from atlas.ports.kernels.sampling import LogprobsOut, SamplingTensors

BF16_TOLERANCE = 1e-2


def rel_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere gives inf.

    With ATLAS_ERROR_LOG set, each value is appended to that file with the current test's id,
    so a GPU run can report the error figures, not only pass or fail.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    error = float("inf")
    if np.all(np.isfinite(actual)):
        error = float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))
    log_path = os.environ.get("ATLAS_ERROR_LOG")
    if log_path:
        test_id = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log_path, "a") as log:
            log.write(f"{error:.3e} {test_id}\n")
    return error


def bf16(array: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in bf16 (what both backends then see)."""
    return np.asarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def poisoned(backend, shape: tuple[int, ...], dtype: DType):
    """An output tensor pre-filled with NaN (floats) or -7 (integers)."""
    tensor = backend.empty(shape, dtype)
    backend.fill(tensor, float("nan") if dtype.is_float else -7)
    return tensor


def host(backend, tensor) -> np.ndarray:
    return np.asarray(backend.download(tensor), dtype=np.float64 if tensor.dtype.is_float else np.int64)


@dataclass(frozen=True)
class PagedCase:
    """A varlen batch over a paged cache: sequence s has `context_lens[s]` tokens, of which
    the last `query_lens[s]` are this step's queries. Blocks are handed out in a shuffled order
    (non-contiguous tables); every slot outside a context holds NaN."""

    heads: HeadLayout
    block_size: int
    num_blocks: int
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    query: np.ndarray  # [N, Hq * D] bf16 values as f32
    keys: np.ndarray  # [num_blocks * block_size, Hkv, D]
    values: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def spec(self) -> KvCacheSpec:
        return KvCacheSpec(
            1, self.num_blocks, self.block_size, self.heads.num_kv_heads, self.heads.head_dim, DType.BF16
        )


def assert_moe_replays_eager(backend, rng, moe, num_tokens: int, hidden: int, top_k: int) -> None:
    """route + experts over `moe` (prepared by `backend`) captured once replay, for fresh rows,
    the bits an eager run computes, and change the residual."""
    x_tensor = backend.upload(bf16(rng.standard_normal((num_tokens, hidden))), DType.BF16)
    residual = backend.empty((num_tokens, hidden), DType.BF16)
    normed = backend.empty((num_tokens, hidden), DType.BF16)
    ids = backend.empty((num_tokens, top_k), DType.I32)
    weights = backend.empty((num_tokens, top_k), DType.F32)
    row_ids = backend.upload(np.arange(num_tokens, dtype=np.int32))

    def step():
        backend.gather_rows(x_tensor, row_ids, residual)
        backend.moe.route(residual, moe, normed, ids, weights)
        backend.moe.experts(normed, moe, ids, weights, residual)

    step()  # workspaces grow outside the capture
    graph = backend.capture(step)
    for _ in range(2):
        fresh = bf16(rng.standard_normal((num_tokens, hidden)) * 2)
        backend.copy_from_host(x_tensor, fresh)
        graph.replay()
        replayed = host(backend, residual)
        step()
        np.testing.assert_array_equal(replayed, host(backend, residual))
        assert not np.allclose(replayed, fresh, atol=1e-3)


def paged_case(
    rng: np.random.Generator,
    heads: HeadLayout,
    context_lens: list[int],
    query_lens: list[int],
    block_size: int = 16,
    spare_blocks: int = 5,
) -> PagedCase:
    blocks_needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    order = [int(b) for b in rng.permutation(num_blocks)]
    width = max(blocks_needed) + 2
    tables = np.full((len(context_lens), width), num_blocks + 1000, dtype=np.int32)  # never read
    num_slots = num_blocks * block_size
    keys = np.full((num_slots, heads.num_kv_heads, heads.head_dim), np.nan, dtype=np.float32)
    values = keys.copy()
    positions, slot_mapping = [], []
    for s, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        blocks = order[: blocks_needed[s]]
        order = order[blocks_needed[s] :]
        tables[s, : len(blocks)] = blocks
        token_positions = np.arange(context_len)
        slots = np.asarray(blocks)[token_positions // block_size] * block_size + token_positions % block_size
        shape = (context_len, heads.num_kv_heads, heads.head_dim)
        keys[slots] = bf16(rng.standard_normal(shape))
        values[slots] = bf16(rng.standard_normal(shape))
        positions.append(token_positions[context_len - query_len :])
        slot_mapping.append(slots[context_len - query_len :])
    num_tokens = sum(query_lens)
    query = bf16(rng.standard_normal((num_tokens, heads.q_size)))
    return PagedCase(
        heads=heads,
        block_size=block_size,
        num_blocks=num_blocks,
        context_lens=tuple(context_lens),
        query_lens=tuple(query_lens),
        query=query,
        keys=keys,
        values=values,
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slot_mapping).astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        seq_lens=np.asarray(context_lens, dtype=np.int32),
        block_tables=tables,
    )


def upload_metadata(backend, case: PagedCase) -> AttentionMetadata:
    return AttentionMetadata(
        positions=backend.upload(case.positions),
        slot_mapping=backend.upload(case.slot_mapping),
        query_start_loc=backend.upload(case.query_start_loc),
        seq_lens=backend.upload(case.seq_lens),
        block_tables=backend.upload(case.block_tables),
        num_tokens=case.num_tokens,
        num_seqs=len(case.context_lens),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.context_lens),
    )


def cuda_cache_with(backend, case: PagedCase):
    """A CUDA cache whose layer 0 holds the case's K and V (NaN outside the contexts)."""
    from atlas.adapters.cuda.tensor import CudaTensor

    kv = backend.attention.allocate_cache(case.spec)
    spec = case.spec
    for address, slots in ((kv.key_plane(0), case.keys), (kv.value_plane(0), case.values)):
        # slot-major [blocks * bs, Hkv, D] -> the adapter's head-major pages [blocks, Hkv, bs, D]
        pages = slots.reshape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim).transpose(0, 2, 1, 3)
        plane = CudaTensor(address, (pages.size,), DType.BF16, kv)
        backend.copy_from_host(plane, np.ascontiguousarray(pages))
    return kv


def mock_cache_with(backend, case: PagedCase):
    kv = backend.attention.allocate_cache(case.spec)
    kv.keys[0] = case.keys
    kv.values[0] = case.values
    return kv


def reference_attention(case: PagedCase, scale: float, sliding_window: int | None) -> np.ndarray:
    """float64 causal attention per sequence with BLAS (for prompts too large for the mock)."""
    heads = case.heads
    group = heads.num_q_heads // heads.num_kv_heads
    out = np.zeros((case.num_tokens, heads.num_q_heads, heads.head_dim))
    queries = case.query.reshape(case.num_tokens, heads.num_q_heads, heads.head_dim).astype(np.float64)
    for s, (context_len, query_len) in enumerate(zip(case.context_lens, case.query_lens)):
        start = int(case.query_start_loc[s])
        blocks = case.block_tables[s, : -(-context_len // case.block_size)]
        slots = (blocks[:, None] * case.block_size + np.arange(case.block_size)).reshape(-1)[:context_len]
        keys = case.keys[slots].astype(np.float64)
        values = case.values[slots].astype(np.float64)
        positions = np.arange(context_len - query_len, context_len)
        key_positions = np.arange(context_len)
        allowed = key_positions[None, :] <= positions[:, None]
        if sliding_window is not None:
            allowed &= key_positions[None, :] > positions[:, None] - sliding_window
        for head in range(heads.num_q_heads):
            kv_head = head // group
            scores = queries[start : start + query_len, head] @ keys[:, kv_head].T * scale
            scores = np.where(allowed, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=1, keepdims=True)
            out[start : start + query_len, head] = weights @ values[:, kv_head]
    return out.reshape(case.num_tokens, heads.q_size)


def sampling_tensors(backend, packed: PackedSampling) -> SamplingTensors:
    """`packed` uploaded to `backend` as the op's tensors."""
    return SamplingTensors(
        temperature=backend.upload(packed.temperature),
        top_k=backend.upload(packed.top_k),
        top_p=backend.upload(packed.top_p),
        min_p=backend.upload(packed.min_p),
        seeds=backend.upload(packed.seeds),
        counters=backend.upload(packed.counters),
        repetition_penalty=backend.upload(packed.repetition_penalty),
        presence_penalty=backend.upload(packed.presence_penalty),
        frequency_penalty=backend.upload(packed.frequency_penalty),
        penalty_offsets=backend.upload(packed.penalty_offsets),
        penalty_token_ids=backend.upload(_non_empty(packed.penalty_token_ids, np.int32)),
        penalty_output_counts=backend.upload(_non_empty(packed.penalty_output_counts, np.int32)),
        bias_offsets=backend.upload(packed.bias_offsets),
        bias_token_ids=backend.upload(_non_empty(packed.bias_token_ids, np.int32)),
        bias_values=backend.upload(_non_empty(packed.bias_values, np.float32)),
        num_rows=packed.num_rows,
        all_greedy=packed.all_greedy,
        any_penalties=packed.any_penalties,
        any_bias=packed.any_bias,
    )


def _non_empty(array: np.ndarray, dtype) -> np.ndarray:
    """A one-element placeholder for an empty CSR array (a device buffer of size 0 is legal,
    but keeping one element matches what a persistent runner buffer looks like)."""
    return array.astype(dtype) if array.size else np.zeros(1, dtype=dtype)


def launched_symbols(backend, fn) -> list[str]:
    """The kernel symbols `fn` launches on `backend` (cuBLASLt's kernels are not ours: not listed)."""
    rt = backend.runtime
    launched: list[str] = []
    launch = rt.launch

    def recording_launch(module, symbol, *args, **kwargs):
        launched.append(symbol)
        launch(module, symbol, *args, **kwargs)

    rt.launch = recording_launch
    try:
        fn()
    finally:
        rt.launch = launch
    return launched


def cuda_test_backend(kernel_cache_dir):
    """A `CudaTestBackend` (imported here: the CUDA adapter needs the cuda extra)."""
    from atlas.adapters.cuda.backend import CudaGpuBackend

    class CudaTestBackend(CudaGpuBackend):
        """The CUDA backend with an entry point for each internal op path (see the module doc)."""

        def rmsnorm(self, x, weight, eps, out):
            from atlas.adapters.cuda import ops_dense

            ops_dense.rmsnorm(self.runtime, x, None, weight, eps, out)

        def add_rmsnorm(self, x, residual, weight, eps, out):
            from atlas.adapters.cuda import ops_dense

            ops_dense.rmsnorm(self.runtime, x, residual, weight, eps, out)

        def embedding(self, token_ids, table, out):
            from atlas.adapters.cuda import ops_dense

            ops_dense.gather_rows(self.runtime, table, token_ids, out, "embedding")

        def act_mul(self, x, activation, out):
            from atlas.adapters.cuda import ops_dense

            ops_dense.act_mul(self.runtime, x, activation, out)

        def linear(self, x, weight, out, bias=None):
            self._linear(x, weight, out, bias)

        def linear_add(self, x, weight, residual, scratch):
            self._linear.linear_add(x, weight, residual, scratch)

        def fold_rmsnorm(self, norm_weight, weight) -> bool:
            return self._linear.fold_rmsnorm(norm_weight, weight)

        def rmsnorm_linear(self, x, norm_weight, eps, weight, out, normed, bias=None):
            self._linear.rmsnorm_linear(x, norm_weight, eps, weight, out, normed, bias)

        def rmsnorm_gated_linear(self, x, norm_weight, eps, weight, activation, out, normed, scratch):
            self._linear.rmsnorm_linear(x, norm_weight, eps, weight, out, normed, None, activation, scratch)

        def rope_and_cache(self, qkv, meta, rope_table, kv, layer, heads, q_out, q_norm=None, k_norm=None,
                           norm_eps=1e-6):
            from atlas.adapters.cuda import ops_attention

            ops_attention.rope_and_cache(self.runtime, qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm,
                                         norm_eps)

        def qkv_rope_cache(self, x, norm_weight, eps, weight, bias, meta, rope_table, kv, layer, heads, q_out,
                           q_norm=None, k_norm=None):
            """The attention kind's `project` over tensors prepared by hand (`norm_weight` None:
            folded into `weight`)."""
            from atlas.adapters.cuda.attention import CudaAttentionLayer

            spec = AttentionLayer(heads, layer, heads.head_dim**-0.5, rope_table)
            prepared = CudaAttentionLayer(spec, weight, bias, norm_weight, eps, q_norm, k_norm, rope_table)
            self.attention.project(x, prepared, meta, kv, q_out)

        def paged_attention(self, q, kv, layer, meta, heads, scale, out, sliding_window=None):
            from atlas.adapters.cuda import ops_attention

            ops_attention.attention(self.runtime, q, kv, layer, meta, heads, scale, out, sliding_window)

        def sample(self, logits, params, out_token_ids, logprobs=None):
            self.sampling.sample(logits, params, out_token_ids, logprobs)

    return CudaTestBackend(kernel_cache_dir=kernel_cache_dir)


class MockReference(MockGpuBackend):
    """The mock (float32) with `CudaTestBackend`'s entry points, each in numpy."""

    def __init__(self) -> None:
        super().__init__(activation_dtype=DType.F32)

    def rmsnorm(self, x, weight, eps, out):
        out.data[...] = rmsnorm(x.as_f32(), weight.weight_f32(), eps)

    def add_rmsnorm(self, x, residual, weight, eps, out):
        residual.data[...] = residual.as_f32() + x.as_f32()
        self.rmsnorm(residual, weight, eps, out)

    def embedding(self, token_ids, table, out):
        out.data[...] = table.data[token_ids.data]

    def act_mul(self, x, activation: Activation, out):
        out.data[...] = gated_activation(x.as_f32(), activation)

    def linear(self, x, weight, out, bias=None):
        result = x.as_f32() @ weight.weight_f32().T
        out.data[...] = result if bias is None else result + bias.weight_f32()

    def linear_add(self, x, weight, residual, scratch):
        self.linear(x, weight, scratch)
        residual.data[...] = residual.as_f32() + scratch.as_f32()

    def rmsnorm_linear(self, x, norm_weight, eps, weight, out, normed, bias=None):
        self.rmsnorm(x, norm_weight, eps, normed)
        self.linear(normed, weight, out, bias)

    def rmsnorm_gated_linear(self, x, norm_weight, eps, weight, activation, out, normed, scratch):
        self.rmsnorm_linear(x, norm_weight, eps, weight, scratch, normed)
        self.act_mul(scratch, activation, out)

    def rope_and_cache(self, qkv, meta, rope_table, kv, layer, heads, q_out, q_norm=None, k_norm=None, norm_eps=1e-6):
        n, dim = qkv.shape[0], heads.head_dim
        fused = qkv.as_f32()
        q = fused[:, : heads.q_size].reshape(n, heads.num_q_heads, dim)
        k = fused[:, heads.q_size : heads.q_size + heads.kv_size].reshape(n, heads.num_kv_heads, dim)
        v = fused[:, heads.q_size + heads.kv_size :].reshape(n, heads.num_kv_heads, dim)
        if q_norm is not None:
            q, k = rmsnorm(q, q_norm.weight_f32(), norm_eps), rmsnorm(k, k_norm.weight_f32(), norm_eps)
        table = rope_table.weight_f32()[meta.positions.data]
        q_out.data[...] = _rotate(q, table).reshape(n, heads.q_size)
        slots = meta.slot_mapping.data
        stored = slots >= 0
        k_scale, v_scale = kv.spec.layer_scales(layer)
        kv.keys[layer, slots[stored]] = _quantize(_rotate(k, table)[stored], k_scale, kv.spec.dtype)
        kv.values[layer, slots[stored]] = _quantize(v[stored], v_scale, kv.spec.dtype)

    def qkv_rope_cache(self, x, norm_weight, eps, weight, bias, meta, rope_table, kv, layer, heads, q_out,
                       q_norm=None, k_norm=None):
        width = heads.q_size + 2 * heads.kv_size
        qkv, normed = self.empty((x.shape[0], width), DType.F32), self.empty(x.shape, DType.F32)
        self.rmsnorm_linear(x, norm_weight, eps, weight, qkv, normed, bias)
        self.rope_and_cache(qkv, meta, rope_table, kv, layer, heads, q_out, q_norm, k_norm, eps)

    def paged_attention(self, q, kv, layer, meta, heads, scale, out, sliding_window=None):
        spec = AttentionLayer(heads, layer, scale, None, sliding_window)
        self.attention.attend(q, MockAttentionLayer(spec, None, None, None, None, None), meta, kv, out)

    def sample(self, logits, params: SamplingTensors, out_token_ids, logprobs: LogprobsOut | None = None):
        self.sampling.sample(logits, params, out_token_ids, logprobs)

    def kv_to_host(self, kv, layer: int):
        return kv.to_host(layer)


def gap_where_paths_part(llm, prompt_ids, got, expected, block_size: int) -> float:
    """Where two greedy paths of `llm`'s engine over `prompt_ids` first part (`got` against
    `expected`): the relative gap between the best logit there and the one of `got`'s token.
    The probe writes its K/V into blocks 0 .. n: ask the engine nothing after it that could
    read them from its prefix cache."""
    index = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    context = tuple(prompt_ids) + tuple(got[:index])
    greedy = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
    blocks = tuple(range(-(-len(context) // block_size)))
    batch = ScheduledBatch(0, (ScheduledSequence("probe", context, 0, blocks, greedy),), block_size)
    logits = llm.engine.core.executor.compute_logits(batch)[0]
    best = int(np.argmax(logits))
    return float((logits[best] - logits[got[index]]) / abs(logits[best]))

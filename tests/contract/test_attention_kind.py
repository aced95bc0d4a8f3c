"""The attention kind: the KV cache, q/k/v with RoPE into it, and attention over it."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from contract_harness import prepared_or_skip
from kind_references import Paged, attention, bf16, paged, rel, rmsnorm, rope_table, rotate

from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, HostAttention, KvCacheSpec
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm

EPS = 1e-6
FP8 = ml_dtypes.float8_e4m3fn


def _metadata(backend, case: Paged) -> AttentionMetadata:
    return AttentionMetadata(
        positions=backend.upload(case.positions),
        slot_mapping=backend.upload(case.slot_mapping),
        query_start_loc=backend.upload(case.query_start_loc),
        seq_lens=backend.upload(np.asarray(case.context_lens, np.int32)),
        block_tables=backend.upload(case.block_tables),
        num_tokens=case.num_tokens,
        num_seqs=len(case.context_lens),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.context_lens),
    )


def _cache(harness, case: Paged, heads: HeadLayout, dtype: DType, scales=(), layers: int = 1, fill=np.nan):
    spec = KvCacheSpec(layers, case.num_blocks, case.block_size, heads.num_kv_heads, heads.head_dim, dtype, scales)
    kv = harness.backend.attention.allocate_cache(spec)
    planes = np.full((case.num_slots, heads.num_kv_heads, heads.head_dim), fill, np.float32)
    for layer in range(layers):
        harness.write_cache(kv, layer, planes.astype(_host_dtype(dtype)), planes.astype(_host_dtype(dtype)))
    return kv


def _host_dtype(dtype: DType):
    return FP8 if dtype is DType.FP8_E4M3 else (ml_dtypes.bfloat16 if dtype is DType.BF16 else np.float32)


def _kv_dtype(harness) -> DType:
    return harness.act if harness.act in harness.backend.capabilities.kv_dtypes else DType.BF16


PROJECT_CASES = [
    # (heads, hidden, rotary dim, q/k norms, qkv bias, tokens per sequence)
    (HeadLayout(9, 3, 64), 576, 64, False, False, [1]),  # SmolLM2 decode
    (HeadLayout(9, 3, 64), 576, 64, False, True, [1]),
    (HeadLayout(32, 8, 128), 4096, 128, False, False, [1]),  # Llama-3.1-8B decode (CUDA folds the norm)
    (HeadLayout(8, 2, 128), 2560, 128, False, True, [1, 1, 1]),
    (HeadLayout(16, 4, 128), 1024, 128, True, False, [1, 7, 12]),  # Qwen3 q/k norms, mixed
    (HeadLayout(4, 4, 128), 512, 64, False, False, [5, 1]),  # partial rotary
    (HeadLayout(32, 8, 128), 4096, 128, True, False, [9, 12, 3]),  # past the GEMV sizes
    (HeadLayout(8, 1, 256), 512, 256, True, False, [20]),
]


@pytest.mark.parametrize("heads, hidden, rotary_dim, qk_norm, bias, query_lens", PROJECT_CASES)
def test_project_rotates_q_and_writes_k_v_into_the_cache(harness, rng, heads, hidden, rotary_dim, qk_norm, bias, query_lens):
    """q out and the written slots against a float64 reference; every other slot untouched."""
    backend = harness.backend
    context_lens = [q + int(rng.integers(0, 40)) for q in query_lens]
    case = paged(rng, context_lens, query_lens)
    width = heads.q_size + 2 * heads.kv_size
    table = rope_table(256, rotary_dim)
    host = HostAttention(
        input_norm=RmsNorm(bf16(1 + 0.3 * rng.standard_normal(hidden)), EPS),
        qkv=HostLinear(bf16(rng.standard_normal((width, hidden)) / math.sqrt(hidden)),
                       bf16(rng.standard_normal(width)) if bias else None),
        q_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(heads.head_dim)), EPS) if qk_norm else None,
        k_norm=RmsNorm(bf16(1 + 0.2 * rng.standard_normal(heads.head_dim)), EPS) if qk_norm else None,
    )
    layer_spec = AttentionLayer(heads, cache_layer=1, scale=heads.head_dim**-0.5,
                                rope_table=backend.upload(table, DType.F32))
    layer = prepared_or_skip(backend.attention.prepare, host, layer_spec)
    kv = _cache(harness, case, heads, _kv_dtype(harness), layers=2)
    x = bf16(rng.standard_normal((case.num_tokens, hidden)) * 3)
    x[0] *= 30  # rows of very different RMS
    q_out = harness.poisoned((case.num_tokens, heads.q_size))
    backend.attention.project(backend.upload(x, harness.act), layer, _metadata(backend, case), kv, q_out)

    fused = rmsnorm(x, host.input_norm.weight, EPS) @ host.qkv.weight.T.astype(np.float64)
    if bias:
        fused = fused + host.qkv.bias
    dim = heads.head_dim
    expected_q = np.zeros((case.num_tokens, heads.q_size))
    expected_k = np.zeros((case.num_tokens, heads.num_kv_heads, dim))
    for t in range(case.num_tokens):
        row = table[case.positions[t]]
        for h in range(heads.num_q_heads):
            head = fused[t, h * dim : (h + 1) * dim]
            head = rmsnorm(head, host.q_norm.weight, EPS) if qk_norm else head
            expected_q[t, h * dim : (h + 1) * dim] = rotate(head, row)
        for h in range(heads.num_kv_heads):
            head = fused[t, heads.q_size + h * dim : heads.q_size + (h + 1) * dim]
            head = rmsnorm(head, host.k_norm.weight, EPS) if qk_norm else head
            expected_k[t, h] = rotate(head, row)
    expected_v = fused[:, heads.q_size + heads.kv_size :].reshape(-1, heads.num_kv_heads, dim)
    assert rel(harness.host(q_out), expected_q) < harness.tolerance
    keys, values = harness.read_cache(kv, 1)
    written = case.slot_mapping
    assert rel(keys[written], expected_k) < harness.tolerance
    assert rel(values[written], expected_v) < harness.tolerance
    others = np.setdiff1d(np.arange(case.num_slots), written)
    assert np.isnan(keys[others]).all() and np.isnan(values[others]).all()
    assert np.isnan(harness.read_cache(kv, 0)[0]).all()  # the other layer untouched


def test_a_negative_slot_writes_q_only(harness, rng):
    """A captured graph's padding rows may write nowhere."""
    backend = harness.backend
    heads, hidden = HeadLayout(9, 3, 64), 576
    case = paged(rng, [10], [1])
    case = Paged(**{**case.__dict__, "slot_mapping": np.full(1, -1, np.int32)})
    host = HostAttention(RmsNorm(bf16(np.ones(hidden)), EPS),
                         HostLinear(bf16(rng.standard_normal((heads.q_size + 2 * heads.kv_size, hidden)) / 24)))
    spec = AttentionLayer(heads, 0, heads.head_dim**-0.5, backend.upload(rope_table(64, 64), DType.F32))
    layer = prepared_or_skip(backend.attention.prepare, host, spec)
    kv = _cache(harness, case, heads, _kv_dtype(harness))
    q_out = harness.poisoned((1, heads.q_size))
    backend.attention.project(backend.upload(bf16(rng.standard_normal((1, hidden))), harness.act), layer,
                              _metadata(backend, case), kv, q_out)
    assert np.isfinite(harness.host(q_out)).all()
    assert np.isnan(harness.read_cache(kv, 0)[0]).all()


def test_project_stores_scaled_saturated_e4m3_in_an_fp8_cache(harness, rng):
    """An FP8 cache holds E4M3 of k / k_scale and v / v_scale, saturated at +-448."""
    backend = harness.backend
    if DType.FP8_E4M3 not in backend.capabilities.kv_dtypes:
        pytest.skip("no FP8 KV cache on this backend")
    heads, hidden = HeadLayout(8, 2, 128), 256
    case = paged(rng, [30, 5], [30, 1])
    width = heads.q_size + 2 * heads.kv_size
    weight = bf16(rng.standard_normal((width, hidden)) / 16)
    weight[heads.q_size + heads.kv_size] *= 400  # one v channel far past 448 * v_scale: saturates
    host = HostAttention(RmsNorm(bf16(np.ones(hidden)), EPS), HostLinear(weight))
    identity = np.concatenate([np.ones((64, 64)), np.zeros((64, 64))], axis=1).astype(np.float32)
    spec = AttentionLayer(heads, 0, 0.1, backend.upload(identity, DType.F32))
    layer = prepared_or_skip(backend.attention.prepare, host, spec)
    k_scale, v_scale = 0.5, 0.25
    kv = _cache(harness, case, heads, DType.FP8_E4M3, scales=((k_scale, v_scale),))
    x = bf16(rng.standard_normal((case.num_tokens, hidden)))
    backend.attention.project(backend.upload(x, harness.act), layer, _metadata(backend, case), kv,
                              harness.poisoned((case.num_tokens, heads.q_size)))
    fused = rmsnorm(x, 1.0, EPS) @ weight.T.astype(np.float64)
    k = fused[:, heads.q_size : heads.q_size + heads.kv_size].reshape(-1, heads.num_kv_heads, 128)
    v = fused[:, heads.q_size + heads.kv_size :].reshape(-1, heads.num_kv_heads, 128)
    keys, values = harness.read_cache(kv, 0)
    written = case.slot_mapping
    assert values[written].max() == 448.0 or values[written].min() == -448.0
    for stored, exact, scale in ((keys, k, k_scale), (values, v, v_scale)):
        expected = np.clip(exact / scale, -448, 448).astype(np.float32).astype(FP8).astype(np.float64)
        assert rel(stored[written], expected) < 0.07  # E4M3 keeps 3 mantissa bits


ATTEND_CASES = [
    # (heads, context lens, query lens, sliding window, block size)
    (HeadLayout(8, 8, 64), [1, 17, 64, 129], [1, 17, 64, 129], None, 16),  # MHA prompts
    (HeadLayout(8, 2, 128), [300, 45, 700, 7], [1, 1, 1, 1], None, 16),  # GQA 4 decode
    (HeadLayout(32, 4, 128), [513, 90, 33, 400], [1, 90, 5, 1], None, 16),  # GQA 8 mixed, prefix-cached
    (HeadLayout(9, 3, 64), [200, 31, 96], [50, 1, 96], None, 32),  # SmolLM2, chunked prefill
    (HeadLayout(8, 2, 128), [700, 260, 3], [1, 100, 3], 128, 16),  # sliding window
    (HeadLayout(4, 1, 256), [300, 65], [1, 65], None, 16),  # head_dim 256
    (HeadLayout(16, 16, 128), [5, 1, 3], [2, 1, 3], 2, 8),  # a tiny window, block size 8
    (HeadLayout(24, 2, 128), [16, 17, 15, 1, 300], [1, 1, 1, 1, 1], None, 8),  # GQA 12, tile edges
]


def _attend(harness, rng, heads, context_lens, query_lens, block_size, window=None, dtype=None, scales=(),
            sinks=None, softcap=None, gated=False):
    """(out, reference) of `attend` over random K/V (bf16 values, or E4M3 bytes with `scales`)."""
    backend = harness.backend
    case = paged(rng, context_lens, query_lens, block_size)
    dtype = dtype or _kv_dtype(harness)
    kv = _cache(harness, case, heads, dtype, scales)
    shape = (case.num_slots, heads.num_kv_heads, heads.head_dim)
    keys, values = bf16(rng.standard_normal(shape)), bf16(rng.standard_normal(shape))
    k_scale, v_scale = scales[0] if scales else (1.0, 1.0)
    stored_k, stored_v = (a.astype(_host_dtype(dtype)) for a in (keys / k_scale, values / v_scale))
    harness.write_cache(kv, 0, stored_k, stored_v)
    spec = AttentionLayer(heads, 0, heads.head_dim**-0.5, None, window, softcap, gated)
    host = HostAttention(RmsNorm(np.ones(8, np.float32), EPS), HostLinear(np.zeros((spec.q_width + 2 * heads.kv_size, 8), np.float32)),
                         sinks=sinks)
    layer = prepared_or_skip(backend.attention.prepare, host, spec)
    q = bf16(rng.standard_normal((case.num_tokens, spec.q_width)))
    out = harness.poisoned((case.num_tokens, heads.q_size))
    backend.attention.attend(backend.upload(q, harness.act), layer, _metadata(backend, case), kv, out)
    expected = attention(case, q, stored_k.astype(np.float64) * k_scale, stored_v.astype(np.float64) * v_scale,
                         heads, spec.scale, window, softcap, sinks, q[:, heads.q_size :] if gated else None)
    return harness.host(out), expected


@pytest.mark.parametrize("heads, context_lens, query_lens, window, block_size", ATTEND_CASES)
def test_attend(harness, rng, heads, context_lens, query_lens, window, block_size):
    out, expected = _attend(harness, rng, heads, context_lens, query_lens, block_size, window)
    assert rel(out, expected) < harness.tolerance


@pytest.mark.parametrize("heads, context_lens, query_lens, window, block_size", ATTEND_CASES[1:5])
def test_attend_over_an_fp8_cache_reads_stored_times_scale(harness, rng, heads, context_lens, query_lens, window, block_size):
    if DType.FP8_E4M3 not in harness.backend.capabilities.kv_dtypes:
        pytest.skip("no FP8 KV cache on this backend")
    out, expected = _attend(harness, rng, heads, context_lens, query_lens, block_size, window, DType.FP8_E4M3,
                            ((0.75, 1.5),))
    assert rel(out, expected) < harness.tolerance


def test_attend_with_sinks(harness, rng):
    """GPT-OSS: each head's sink logit joins the softmax's denominator."""
    heads = HeadLayout(8, 2, 64)
    sinks = (rng.standard_normal(8) * 2).astype(np.float32)
    sinks[0] = 40.0  # a sink that takes nearly all the weight
    out, expected = _attend(harness, rng, heads, [40, 9], [40, 1], 16, window=16, sinks=sinks)
    assert rel(out, expected) < harness.tolerance
    assert np.abs(out[:, :64]).max() < 1e-3


def test_attend_with_logit_softcap_and_a_gated_output(harness, rng):
    """Gemma 2's soft-capped scores; Qwen3-Next's output times sigmoid(gate)."""
    heads = HeadLayout(4, 2, 64)
    out, expected = _attend(harness, rng, heads, [33, 7], [33, 2], 16, softcap=0.5, gated=True)
    assert rel(out, expected) < harness.tolerance


@pytest.mark.parametrize("heads, block_size, fp8, extras",
                         [(HeadLayout(8, 2, 128), 16, False, False), (HeadLayout(9, 3, 64), 32, False, False),
                          (HeadLayout(8, 2, 128), 16, True, False), (HeadLayout(8, 2, 64), 16, False, True),
                          (HeadLayout(8, 2, 64), 16, True, True)],
                         ids=["gqa4", "smollm2", "fp8", "extras", "fp8_extras"])
def test_attend_with_a_shared_prefix_named_is_the_same_attention(harness, rng, heads, block_size, fp8, extras):
    """Metadata may name the pages a step's decode rows share (`shared_prefix`, as
    step_inputs.shared_prefixes does); a backend may read them once for all of those rows
    (CUDA's cascade attention), but every row's output is still its attention over its context:
    here 12 decode rows over a shared 800-token prompt, 2 rows of other prompts and a prefill
    chunk over the same prompt; also over an FP8 cache (stored values times its scales), and
    with sinks, soft-capped scores and a gated output."""
    from dataclasses import replace

    from atlas.domain.step_inputs import CacheLayout, shared_prefixes

    backend = harness.backend
    pages = 800 // block_size
    context_lens = [800 + 3 + 5 * i for i in range(12)] + [500, 900, 820]
    query_lens = [1] * 14 + [20]
    case = paged(rng, context_lens, query_lens, block_size)
    tables = case.block_tables.copy()
    for row in list(range(12)) + [14]:
        tables[row, :pages] = tables[0, :pages]
    case = replace(case, block_tables=tables)
    layout = CacheLayout(block_size, tables.shape[1], (case.num_blocks + 1000,))
    prefix = shared_prefixes(tables[:, None, :], np.asarray(query_lens), np.asarray(context_lens, np.int32), layout)
    assert prefix is not None and prefix[0, 0] == 800 and prefix[0, 2:].tolist() == [1] * 12 + [0] * 3
    if fp8 and DType.FP8_E4M3 not in backend.capabilities.kv_dtypes:
        pytest.skip("no FP8 KV cache on this backend")
    k_scale, v_scale = (0.75, 1.5) if fp8 else (1.0, 1.0)
    kv = _cache(harness, case, heads, DType.FP8_E4M3 if fp8 else _kv_dtype(harness),
                ((k_scale, v_scale),) if fp8 else ())
    shape = (case.num_slots, heads.num_kv_heads, heads.head_dim)
    dtype = _host_dtype(kv.spec.dtype)
    keys = (bf16(rng.standard_normal(shape)) / k_scale).astype(dtype)
    values = (bf16(rng.standard_normal(shape)) / v_scale).astype(dtype)
    harness.write_cache(kv, 0, keys, values)
    sinks = (rng.standard_normal(heads.num_q_heads) * 2).astype(np.float32) if extras else None
    softcap = 0.5 if extras else None
    spec = AttentionLayer(heads, 0, heads.head_dim**-0.5, None, None, softcap, extras)
    layer = prepared_or_skip(backend.attention.prepare, HostAttention(
        RmsNorm(np.ones(8, np.float32), EPS), HostLinear(np.zeros((spec.q_width + 2 * heads.kv_size, 8), np.float32)),
        sinks=sinks), spec)
    q = bf16(rng.standard_normal((case.num_tokens, spec.q_width)))
    meta = replace(_metadata(backend, case), shared_prefix=backend.upload(prefix[0]), shared_prefix_len=800)
    out = harness.poisoned((case.num_tokens, heads.q_size))
    backend.attention.attend(backend.upload(q, harness.act), layer, meta, kv, out)
    expected = attention(case, q, keys.astype(np.float64) * k_scale, values.astype(np.float64) * v_scale, heads,
                         spec.scale, None, softcap, sinks, q[:, heads.q_size :] if extras else None)
    assert rel(harness.host(out), expected) < harness.tolerance


def test_attend_reads_only_its_own_sequence(harness, rng):
    """Changing one cached value of one sequence moves only that sequence's rows."""
    backend = harness.backend
    heads = HeadLayout(8, 2, 128)
    case = paged(rng, [200, 200], [1, 1])
    kv = _cache(harness, case, heads, _kv_dtype(harness), fill=0.0)
    shape = (case.num_slots, heads.num_kv_heads, heads.head_dim)
    keys, values = bf16(rng.standard_normal(shape)), bf16(rng.standard_normal(shape))
    spec = AttentionLayer(heads, 0, heads.head_dim**-0.5, None)
    layer = prepared_or_skip(backend.attention.prepare, HostAttention(
        RmsNorm(np.ones(8, np.float32), EPS), HostLinear(np.zeros((heads.q_size + 2 * heads.kv_size, 8), np.float32))), spec)
    q = backend.upload(bf16(rng.standard_normal((2, heads.q_size))), harness.act)
    outputs = []
    for change in (0.0, 50.0):
        changed = values.copy()
        changed[case.context_slots(0)[3]] += change
        harness.write_cache(kv, 0, keys.astype(_host_dtype(kv.spec.dtype)), changed.astype(_host_dtype(kv.spec.dtype)))
        out = harness.poisoned((2, heads.q_size))
        backend.attention.attend(q, layer, _metadata(backend, case), kv, out)
        outputs.append(harness.host(out))
    assert np.abs(outputs[1][0] - outputs[0][0]).max() > 1e-3
    np.testing.assert_array_equal(outputs[1][1], outputs[0][1])


@pytest.mark.parametrize("heads, hidden, context",
                         [(HeadLayout(9, 3, 64), 576, 40), (HeadLayout(32, 8, 128), 4096, 70)])
def test_verify_rows_attend_over_what_project_just_wrote(harness, rng, heads, hidden, context):
    """A verify step: k + 1 = 5 consecutive single-token rows of one sequence over one block
    table (`decode_rows`), whose positions hold the last step's rejected drafts. `project`
    writes the new K/V and `attend` runs right after it: row j must see rows 0 .. j - 1's new
    K/V. (CUDA's decode attention copied earlier tokens before waiting for the kernel writing
    the cache, so rows 1-4 read the stale drafts: SmolLM2 drafting for itself kept 37%.)"""
    backend = harness.backend
    rows = 5
    one = paged(rng, [context], [rows])
    first = context - rows
    case = Paged(block_size=one.block_size, num_blocks=one.num_blocks,
                 context_lens=tuple(first + 1 + j for j in range(rows)), query_lens=(1,) * rows,
                 block_tables=np.repeat(one.block_tables, rows, axis=0), positions=one.positions,
                 slot_mapping=one.slot_mapping, query_start_loc=np.arange(rows + 1, dtype=np.int32))
    kv = _cache(harness, case, heads, _kv_dtype(harness))
    shape = (case.num_slots, heads.num_kv_heads, heads.head_dim)
    stale = (bf16(rng.standard_normal(shape) * 4) for _ in range(2))  # every slot, the drafts' too
    harness.write_cache(kv, 0, *(a.astype(_host_dtype(kv.spec.dtype)) for a in stale))
    width = heads.q_size + 2 * heads.kv_size
    host = HostAttention(RmsNorm(bf16(1 + 0.3 * rng.standard_normal(hidden)), EPS),
                         HostLinear(bf16(rng.standard_normal((width, hidden)) / math.sqrt(hidden))))
    spec = AttentionLayer(heads, 0, heads.head_dim**-0.5, backend.upload(rope_table(512, heads.head_dim), DType.F32))
    layer = prepared_or_skip(backend.attention.prepare, host, spec)
    meta = _metadata(backend, case)
    q_out = harness.poisoned((rows, heads.q_size))
    out = harness.poisoned((rows, heads.q_size))
    backend.attention.project(backend.upload(bf16(rng.standard_normal((rows, hidden))), harness.act), layer, meta, kv,
                              q_out)
    backend.attention.attend(q_out, layer, meta, kv, out)
    keys, values = harness.read_cache(kv, 0)  # the new rows, as project left them
    expected = attention(case, harness.host(q_out).astype(np.float64), keys.astype(np.float64),
                         values.astype(np.float64), heads, spec.scale)
    assert rel(harness.host(out), expected) < harness.tolerance


def test_a_cache_too_large_says_how_many_blocks_fit(harness):
    _, total = harness.backend.memory_info()
    per_block = KvCacheSpec(32, 1, 16, 8, 128, DType.BF16).bytes_per_block
    with pytest.raises(MemoryError, match="blocks"):
        harness.backend.attention.allocate_cache(KvCacheSpec(32, 2 * total // per_block, 16, 8, 128, DType.BF16))

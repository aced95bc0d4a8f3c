"""The CUDA RoPE + cache write paths and each attention kernel against the float32 reference (and
a float64 BLAS reference for prompts too long for the mock's einsum)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from cuda_harness import (
    BF16_TOLERANCE,
    bf16,
    cuda_cache_with,
    host,
    launched_symbols,
    mock_cache_with,
    paged_case,
    poisoned,
    reference_attention,
    rel_l2,
    upload_metadata,
)

from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import HeadLayout

pytestmark = pytest.mark.gpu


def _rope_table(max_position: int, rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    inverse = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(max_position)[:, None] * inverse[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


@pytest.mark.parametrize(
    "heads, rotary_dim, with_norm, table_dtype",
    [
        (HeadLayout(8, 2, 128), 128, False, DType.F32),
        (HeadLayout(9, 3, 64), 64, False, DType.F32),  # SmolLM2-135M
        (HeadLayout(16, 4, 128), 128, True, DType.F32),  # Qwen3-style q/k norms
        (HeadLayout(4, 4, 128), 64, False, DType.BF16),  # partial rotary (GLM/Phi style)
        (HeadLayout(8, 1, 256), 256, True, DType.F32),
    ],
)
@pytest.mark.parametrize("one_block_per_token", [False, True])
def test_rope_and_cache(
    cuda_backend, mock_backend, rng, monkeypatch, heads, rotary_dim, with_norm, table_dtype, one_block_per_token
):
    """Against the mock; with a block per group of heads (decode sizes) and with one block taking
    all of a token's groups in turn (prefill sizes, `rope_blocks_per_token`)."""
    from atlas.adapters.cuda import ops_attention

    if one_block_per_token:
        monkeypatch.setattr(ops_attention, "rope_blocks_per_token", lambda *args: 1)
    case = paged_case(rng, heads, context_lens=[40, 1, 77], query_lens=[40, 1, 13])
    width = heads.q_size + 2 * heads.kv_size
    qkv = bf16(rng.standard_normal((case.num_tokens, width)))
    table = _rope_table(256, rotary_dim)
    if table_dtype is DType.BF16:
        table = bf16(table)
    norms = [bf16(rng.standard_normal(heads.head_dim) + 1) for _ in range(2)] if with_norm else [None, None]

    c_kv = cuda_backend.attention.allocate_cache(case.spec)
    m_kv = mock_backend.attention.allocate_cache(case.spec)
    _poison_cache(cuda_backend, c_kv)  # unwritten slots must stay NaN
    m_kv.keys[...] = np.nan
    m_kv.values[...] = np.nan

    c_meta, m_meta = upload_metadata(cuda_backend, case), upload_metadata(mock_backend, case)
    c_out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
    m_out = mock_backend.empty((case.num_tokens, heads.q_size), DType.F32)
    cuda_backend.rope_and_cache(
        cuda_backend.upload(qkv, DType.BF16),
        c_meta,
        cuda_backend.upload(table, table_dtype),
        c_kv,
        0,
        heads,
        c_out,
        *(cuda_backend.upload(n, DType.BF16) if n is not None else None for n in norms),
        norm_eps=1e-6,
    )
    mock_backend.rope_and_cache(
        mock_backend.upload(qkv),
        m_meta,
        mock_backend.upload(table),
        m_kv,
        0,
        heads,
        m_out,
        *(mock_backend.upload(n) if n is not None else None for n in norms),
        norm_eps=1e-6,
    )
    assert rel_l2(host(cuda_backend, c_out), host(mock_backend, m_out)) < BF16_TOLERANCE
    c_keys, c_values = cuda_backend.kv_to_host(c_kv, 0)
    m_keys, m_values = mock_backend.kv_to_host(m_kv, 0)
    written = case.slot_mapping
    for c_plane, m_plane in ((c_keys, m_keys), (c_values, m_values)):
        c_slots = np.asarray(c_plane, np.float32).reshape(-1, heads.num_kv_heads, heads.head_dim)
        m_slots = np.asarray(m_plane, np.float32).reshape(-1, heads.num_kv_heads, heads.head_dim)
        assert rel_l2(c_slots[written], m_slots[written]) < BF16_TOLERANCE
        untouched = np.setdiff1d(np.arange(c_slots.shape[0]), written)
        assert np.isnan(c_slots[untouched]).all()


def test_rope_takes_a_tokens_heads_in_one_block_at_prefill_sizes():
    """Llama-3.1-8B's 48 heads in groups of 4 on 132 SMs: a block per group up to 64 tokens, one
    block per token from 2048 (its RMS read once, not 12 times)."""
    from atlas.adapters.cuda.ops_attention import rope_blocks_per_token

    assert [rope_blocks_per_token(n, 48, 132) for n in (1, 64, 128, 512, 2048, 8192)] == [12, 12, 9, 3, 1, 1]
    assert rope_blocks_per_token(1, 15, 132) == 4  # SmolLM2: 9 + 2 x 3 heads


@pytest.mark.parametrize(
    "heads, hidden, with_bias, table_dtype, norm_dtype, padding",
    [
        (HeadLayout(9, 3, 64), 576, False, DType.F32, DType.BF16, False),  # SmolLM2: norm inside, 2 rows
        (HeadLayout(32, 8, 128), 256, True, DType.BF16, DType.F32, False),  # Llama's heads: 4 rows per block
        (HeadLayout(8, 2, 128), 2560, True, DType.F32, DType.BF16, False),  # wide: the norm folded into w
        (HeadLayout(32, 8, 128), 4096, False, DType.F32, DType.BF16, False),  # Llama-3.1-8B: folded
        (HeadLayout(9, 3, 64), 576, False, DType.F32, DType.BF16, True),  # a graph's padding row
    ],
)
def test_qkv_rope_cache_one_token(
    cuda_backend, mock_backend, rng, heads, hidden, with_bias, table_dtype, norm_dtype, padding
):
    """The one-token projection with RoPE and the cache write in the GEMV against the mock's
    rmsnorm_linear + rope_and_cache, and against CUDA's own unfused path (the same rounding
    points, so they agree to the last bit but for FMA contraction). Rows wider than the GEMV
    normalises itself have the norm weight folded in (`fold_rmsnorm`) on CUDA, then the folded
    GEMV and the RoPE kernel run. Cache slots other than the token's stay NaN; a padding row
    (slot -1) writes q only."""
    from dataclasses import replace

    from atlas.adapters.cuda.ops_dense import FOLD_NORM_MIN_WIDTH

    case = paged_case(rng, heads, context_lens=[77], query_lens=[1])
    if padding:
        case = replace(case, slot_mapping=np.full(1, -1, np.int32))
    width = heads.q_size + 2 * heads.kv_size
    x = bf16(rng.standard_normal((1, hidden)) * 3)
    weight = bf16(rng.standard_normal((width, hidden)) / math.sqrt(hidden))
    bias = bf16(rng.standard_normal(width)) if with_bias else None
    norm = bf16(rng.standard_normal(hidden) * 0.3 + 1)
    table = _rope_table(256, heads.head_dim)

    def on_cuda(fused: bool):
        rt = cuda_backend.runtime
        saved = rt.features
        rt.features = replace(saved, gemv_rope=fused)
        try:
            kv = cuda_backend.attention.allocate_cache(case.spec)
            _poison_cache(cuda_backend, kv)
            q_out = poisoned(cuda_backend, (1, heads.q_size), DType.BF16)
            c_norm, c_weight = cuda_backend.upload(norm, norm_dtype), cuda_backend.upload(weight, DType.BF16)
            if cuda_backend.fold_rmsnorm(c_norm, c_weight):
                c_norm = None
            assert (c_norm is None) == (hidden >= FOLD_NORM_MIN_WIDTH)
            cuda_backend.qkv_rope_cache(
                cuda_backend.upload(x, DType.BF16),
                c_norm,
                1e-5,
                c_weight,
                cuda_backend.upload(bias, DType.BF16) if bias is not None else None,
                upload_metadata(cuda_backend, case),
                cuda_backend.upload(table, table_dtype),
                kv,
                0,
                heads,
                q_out,
            )
            keys, values = cuda_backend.kv_to_host(kv, 0)
            return host(cuda_backend, q_out), np.asarray(keys, np.float32), np.asarray(values, np.float32)
        finally:
            rt.features = saved

    m_kv = mock_backend.attention.allocate_cache(case.spec)
    m_kv.keys[...] = np.nan
    m_kv.values[...] = np.nan
    m_q = mock_backend.empty((1, heads.q_size), DType.F32)
    mock_backend.qkv_rope_cache(
        mock_backend.upload(x),
        mock_backend.upload(norm),
        1e-5,
        mock_backend.upload(weight),
        mock_backend.upload(bias) if bias is not None else None,
        upload_metadata(mock_backend, case),
        mock_backend.upload(table if table_dtype is DType.F32 else bf16(table)),
        m_kv,
        0,
        heads,
        m_q,
    )
    m_keys, m_values = (np.asarray(plane, np.float32) for plane in mock_backend.kv_to_host(m_kv, 0))
    fused, unfused = on_cuda(True), on_cuda(False)
    assert rel_l2(fused[0], host(mock_backend, m_q)) < BF16_TOLERANCE
    assert rel_l2(fused[0], unfused[0]) < 1e-3
    slot = int(case.slot_mapping[0])
    for index, expected in ((1, m_keys), (2, m_values)):
        got = fused[index].reshape(-1, heads.num_kv_heads, heads.head_dim)
        if slot >= 0:
            assert rel_l2(got[slot], expected.reshape(got.shape)[slot]) < BF16_TOLERANCE
            assert rel_l2(got[slot], unfused[index].reshape(got.shape)[slot]) < 1e-3
        others = np.setdiff1d(np.arange(got.shape[0]), [slot])
        assert np.isnan(got[others]).all()


@pytest.mark.parametrize("heads, with_norm", [(HeadLayout(32, 8, 128), False), (HeadLayout(16, 8, 128), True)])
def test_qkv_rope_cache_scales_after_the_product(cuda_backend, mock_backend, rng, heads, with_norm):
    """Past the GEMV sizes, a folded norm (`rms_after_product`): cuBLASLt multiplies the
    unnormalised rows and the RoPE kernel scales q, k and v by each token's inverse RMS before the
    q/k norms and the rotation; no norm kernel runs. Against the mock (norm first) and against
    CUDA with the norm kernel first (feature off): the q rows and the written cache slots agree
    to bf16 rounding, and no other slot is written."""
    from dataclasses import replace

    hidden = 4096
    case = paged_case(rng, heads, context_lens=[40, 77, 20], query_lens=[1, 12, 3])
    num_tokens = len(case.positions)
    width = heads.q_size + 2 * heads.kv_size
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 3)
    x[2] *= 50  # rows of very different RMS
    weight = bf16(rng.standard_normal((width, hidden)) / math.sqrt(hidden))
    norm = bf16(rng.standard_normal(hidden) * 0.3 + 1)
    q_norm, k_norm = (bf16(rng.standard_normal(heads.head_dim) * 0.2 + 1) for _ in range(2))
    table = _rope_table(256, heads.head_dim)
    rt = cuda_backend.runtime
    saved = rt.features

    def on_cuda(on: bool):
        rt.features = replace(saved, rms_after_product=on)
        try:
            kv = cuda_backend.attention.allocate_cache(case.spec)
            _poison_cache(cuda_backend, kv)
            q_out = poisoned(cuda_backend, (num_tokens, heads.q_size), DType.BF16)
            c_norm, c_weight = cuda_backend.upload(norm, DType.BF16), cuda_backend.upload(weight, DType.BF16)
            assert cuda_backend.fold_rmsnorm(c_norm, c_weight)
            launched = launched_symbols(cuda_backend, lambda: cuda_backend.qkv_rope_cache(
                cuda_backend.upload(x, DType.BF16),
                None,
                1e-5,
                c_weight,
                None,
                upload_metadata(cuda_backend, case),
                cuda_backend.upload(table, DType.F32),
                kv,
                0,
                heads,
                q_out,
                cuda_backend.upload(q_norm, DType.BF16) if with_norm else None,
                cuda_backend.upload(k_norm, DType.BF16) if with_norm else None,
            ))
            assert any(symbol.startswith("rmsnorm_") for symbol in launched) != on  # no norm kernel ran
            keys, values = cuda_backend.kv_to_host(kv, 0)
            return host(cuda_backend, q_out), np.asarray(keys, np.float32), np.asarray(values, np.float32)
        finally:
            rt.features = saved

    m_kv = mock_backend.attention.allocate_cache(case.spec)
    m_q = mock_backend.empty((num_tokens, heads.q_size), DType.F32)
    mock_backend.qkv_rope_cache(
        mock_backend.upload(x),
        mock_backend.upload(norm),
        1e-5,
        mock_backend.upload(weight),
        None,
        upload_metadata(mock_backend, case),
        mock_backend.upload(table),
        m_kv,
        0,
        heads,
        m_q,
        mock_backend.upload(q_norm) if with_norm else None,
        mock_backend.upload(k_norm) if with_norm else None,
    )
    m_keys, m_values = (np.asarray(plane, np.float32) for plane in mock_backend.kv_to_host(m_kv, 0))
    after, before = on_cuda(True), on_cuda(False)
    expected_q = host(mock_backend, m_q)
    assert rel_l2(after[0], expected_q) < BF16_TOLERANCE
    assert rel_l2(after[0][2], expected_q[2]) < BF16_TOLERANCE
    assert rel_l2(after[0], before[0]) < BF16_TOLERANCE
    slots = case.slot_mapping
    for index, expected in ((1, m_keys), (2, m_values)):
        got = after[index].reshape(-1, heads.num_kv_heads, heads.head_dim)
        assert rel_l2(got[slots], expected.reshape(got.shape)[slots]) < BF16_TOLERANCE
        assert rel_l2(got[slots], before[index].reshape(got.shape)[slots]) < BF16_TOLERANCE
        others = np.setdiff1d(np.arange(got.shape[0]), slots)
        assert np.isnan(got[others]).all()


def _poison_cache(backend, kv) -> None:
    from atlas.adapters.cuda.tensor import CudaTensor

    num_elements = 2 * kv.spec.num_layers * kv.plane_bytes // 2
    backend.fill(CudaTensor(kv.base_address, (num_elements,), DType.BF16, kv), float("nan"))


def _attention_pair(cuda_backend, mock_backend, case, scale, window, use_mock: bool):
    c_kv = cuda_cache_with(cuda_backend, case)
    c_meta = upload_metadata(cuda_backend, case)
    out = poisoned(cuda_backend, (case.num_tokens, case.heads.q_size), DType.BF16)
    cuda_backend.paged_attention(cuda_backend.upload(case.query, DType.BF16), c_kv, 0, c_meta, case.heads, scale, out, window)
    actual = host(cuda_backend, out)
    if use_mock:
        m_kv = mock_cache_with(mock_backend, case)
        m_meta = upload_metadata(mock_backend, case)
        expected_tensor = mock_backend.empty((case.num_tokens, case.heads.q_size), DType.F32)
        mock_backend.paged_attention(
            mock_backend.upload(case.query), m_kv, 0, m_meta, case.heads, scale, expected_tensor, window
        )
        expected = host(mock_backend, expected_tensor)
    else:
        expected = reference_attention(case, scale, window)
    return actual, expected


ATTENTION_CASES = [
    # (heads, context lens, query lens, sliding window, block size)
    (HeadLayout(8, 8, 64), [1, 17, 64, 129], [1, 17, 64, 129], None, 16),  # MHA prompts
    (HeadLayout(8, 2, 128), [300, 45, 1000, 7], [1, 1, 1, 1], None, 16),  # GQA 4 decode
    (HeadLayout(32, 4, 128), [513, 90, 33, 2000], [1, 90, 5, 1], None, 16),  # GQA 8 mixed
    (HeadLayout(9, 3, 64), [200, 31, 96], [50, 1, 96], None, 32),  # SmolLM2, chunked prefill
    (HeadLayout(8, 2, 128), [700, 260, 3], [1, 100, 3], 128, 16),  # sliding window
    (HeadLayout(16, 2, 64), [3000, 2500], [1, 1], None, 16),  # long decode: split-K
    (HeadLayout(4, 1, 256), [300, 65], [1, 65], None, 16),  # head_dim 256
    (HeadLayout(16, 16, 128), [5, 1, 3], [2, 1, 3], 2, 8),  # tiny window, spec-decode shapes
    (HeadLayout(24, 2, 128), [16, 17, 15, 1, 300], [1, 1, 1, 1, 1], None, 8),  # GQA 12, tile edges
    (HeadLayout(8, 2, 64), [999, 64, 130], [1, 1, 1], 100, 64),  # decode window off tile edges
    # batches whose blocks take each head-dim-128 decode shape (decode_mma_shape, 132 SMs):
    (HeadLayout(32, 8, 128), [37 * i % 700 + 1 for i in range(8)], [1] * 8, None, 16),  # 64: (8, 2), 2 splits
    (HeadLayout(32, 8, 128), [53 * i % 600 + 1 for i in range(24)], [1] * 24, None, 16),  # 192: (4, 3)
    (HeadLayout(32, 8, 128), [29 * i % 500 + 1 for i in range(70)], [1] * 70, None, 16),  # 560: (4, 3), waves
]


@pytest.fixture(params=["mma", "simt"])
def decode_kernel(request, cuda_backend):
    """Each decode attention kernel in turn: the tensor-core one (the default) and the SIMT one
    (`ATLAS_CUDA_DISABLE=mma_decode`)."""
    from dataclasses import replace

    rt = cuda_backend.runtime
    saved = rt.features
    rt.features = replace(saved, mma_decode=request.param == "mma")
    yield request.param
    rt.features = saved


@pytest.mark.parametrize("heads, context_lens, query_lens, window, block_size", ATTENTION_CASES)
def test_attention_against_mock(
    cuda_backend, mock_backend, rng, decode_kernel, heads, context_lens, query_lens, window, block_size
):
    case = paged_case(rng, heads, context_lens, query_lens, block_size=block_size)
    scale = 1 / math.sqrt(heads.head_dim)
    actual, expected = _attention_pair(cuda_backend, mock_backend, case, scale, window, use_mock=True)
    assert rel_l2(actual, expected) < BF16_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads, context_lens, query_lens, window",
    [
        (HeadLayout(8, 1, 128), [4096], [4096], None),  # one 4k prompt, GQA 8
        (HeadLayout(4, 4, 64), [4096, 1, 2048, 3000], [4096, 1, 1024, 1], None),  # mixed 4k batch
        (HeadLayout(8, 2, 128), [4096, 4096], [4096, 1], 1024),  # long sliding window
        (HeadLayout(8, 2, 128), [32768], [1], None),  # very long decode
    ],
)
def test_attention_long_prompts_against_float64(
    cuda_backend, rng, decode_kernel, heads, context_lens, query_lens, window
):
    case = paged_case(rng, heads, context_lens, query_lens, block_size=16)
    scale = 1 / math.sqrt(heads.head_dim)
    actual, expected = _attention_pair(cuda_backend, None, case, scale, window, use_mock=False)
    assert rel_l2(actual, expected) < BF16_TOLERANCE


def test_attention_output_depends_on_every_context_token(cuda_backend, mock_backend, rng, decode_kernel):
    """Changing one cached value of one sequence moves only that sequence's output rows."""
    heads = HeadLayout(8, 2, 128)
    case = paged_case(rng, heads, [600, 600], [1, 1])
    scale = 1 / math.sqrt(heads.head_dim)
    before, _ = _attention_pair(cuda_backend, mock_backend, case, scale, None, use_mock=False)
    changed_slot = int(case.block_tables[0, 0]) * case.block_size + 3
    case.values[changed_slot] += 50.0
    after, _ = _attention_pair(cuda_backend, mock_backend, case, scale, None, use_mock=False)
    assert np.abs(after[0] - before[0]).max() > 1e-3
    np.testing.assert_array_equal(after[1], before[1])


def test_prefill_falls_back_to_64_row_tiles_where_shared_memory_is_scarce(cuda_backend, mock_backend, rng, monkeypatch):
    """sm_120 gives a block 99 KB: head_dim 128 then runs the 64-row variant; check it here."""
    from atlas.adapters.cuda.ops_attention import prefill_tile

    assert prefill_tile(128, 101376)[0] == 64 and prefill_tile(128, 232448)[0] == 128
    monkeypatch.setattr(cuda_backend.runtime, "max_shared_optin", 101376)
    heads = HeadLayout(32, 4, 128)
    case = paged_case(rng, heads, [513, 90, 200], [300, 90, 1])
    scale = 1 / math.sqrt(heads.head_dim)
    actual, expected = _attention_pair(cuda_backend, mock_backend, case, scale, None, use_mock=True)
    assert rel_l2(actual, expected) < BF16_TOLERANCE


@pytest.mark.parametrize("keys_per_tile", [64, 128])
def test_wgmma_prefill_tiles_against_float64(cuda_backend, rng, monkeypatch, keys_per_tile):
    """Both wgmma variants (64-key tiles at two blocks per SM, 128-key tiles at one) on Hopper:
    long and short prompts, a prompt continuing a cached context, GQA 4 and 3, a sliding window."""
    from atlas.adapters.cuda import ops_attention

    if cuda_backend.runtime.compute_capability != (9, 0):
        pytest.skip("the wgmma kernels are built for sm_90a")
    for head_dim in (64, 128):
        monkeypatch.setitem(ops_attention.WGMMA_KEYS_PER_TILE, head_dim, keys_per_tile)
        chosen = ops_attention.prefill_kernel(cuda_backend.runtime, head_dim).symbol
        assert chosen == f"attention_prefill_wgmma_d{head_dim}_n{keys_per_tile}"
    for heads, context_lens, query_lens, window in (
        (HeadLayout(32, 8, 128), [1500, 300, 77], [1500, 200, 77], None),
        (HeadLayout(9, 3, 64), [1000, 129, 1], [1000, 64, 1], None),
        (HeadLayout(8, 2, 128), [900, 400], [900, 1], 256),
    ):
        case = paged_case(rng, heads, context_lens, query_lens, block_size=16)
        scale = 1 / math.sqrt(heads.head_dim)
        actual, expected = _attention_pair(cuda_backend, None, case, scale, window, use_mock=False)
        assert rel_l2(actual, expected) < BF16_TOLERANCE


@pytest.mark.parametrize(
    "heads, context_lens, query_lens, window",
    [
        # a serving step: chunks after a cached 2,048-token prefix beside long decodes
        (HeadLayout(32, 8, 128), [2080, 2080, 2080, 2080, 2100, 1500, 3000], [32, 32, 32, 32, 1, 1, 1], None),
        (HeadLayout(9, 3, 64), [1800, 600, 1200], [40, 17, 1], None),  # GQA 3, head dim 64
        (HeadLayout(8, 2, 128), [2500, 2000, 1100], [64, 1, 200], 700),  # a sliding window
        (HeadLayout(8, 8, 128), [4097, 1030], [300, 129], None),  # tiles past a 64-key edge, MHA
    ],
)
def test_wgmma_prefill_split_along_the_context_against_float64(cuda_backend, rng, heads, context_lens, query_lens,
                                                               window):
    """The `_split` twins: a few query tokens over long contexts run as several blocks a tile,
    merged by the last (prefill_split_count > 1 for each case)."""
    from atlas.adapters.cuda import ops_attention

    rt = cuda_backend.runtime
    if rt.compute_capability != (9, 0):
        pytest.skip("the wgmma kernels are built for sm_90a")
    group = heads.num_q_heads // heads.num_kv_heads
    num_tokens = sum(query_lens)
    assert ops_attention.prefill_split_count(rt.num_sms, num_tokens, max(context_lens), group, heads.num_kv_heads) > 1
    symbol = ops_attention.prefill_kernel(rt, heads.head_dim).symbol + "_split"
    assert rt.kernels.provides(ops_attention.WGMMA_X_MODULE, symbol)
    for _ in range(2):  # the counters are back at zero for the second launch
        case = paged_case(rng, heads, context_lens, query_lens, block_size=16)
        scale = 1 / math.sqrt(heads.head_dim)
        actual, expected = _attention_pair(cuda_backend, None, case, scale, window, use_mock=False)
        assert rel_l2(actual, expected) < BF16_TOLERANCE


def test_wgmma_prefill_of_head_dim_256_against_float64(cuda_backend, rng):
    """Head dim 256 (Qwen3-Next, Gemma 3) on wgmma (module attention_prefill_x, Hopper): GQA 8 and
    4, a prompt continuing a cached context, a sliding window."""
    from atlas.adapters.cuda import ops_attention

    if cuda_backend.runtime.compute_capability != (9, 0):
        pytest.skip("the wgmma kernels are built for sm_90a")
    kernel = ops_attention.prefill_kernel(cuda_backend.runtime, 256)
    assert (kernel.module, kernel.symbol) == ("attention_prefill_x", "attention_prefill_wgmma_d256_n64")
    for heads, context_lens, query_lens, window in (
        (HeadLayout(16, 2, 256), [1200, 300, 77], [1200, 200, 77], None),
        (HeadLayout(8, 2, 256), [900, 400], [900, 1], 512),
    ):
        case = paged_case(rng, heads, context_lens, query_lens, block_size=16)
        actual, expected = _attention_pair(cuda_backend, None, case, heads.head_dim**-0.5, window, use_mock=False)
        assert rel_l2(actual, expected) < BF16_TOLERANCE


# -- FP8 (E4M3) K/V: the prefill kernels' _fp8 twins ---------------------------------------------

_E4M3_FINITE = np.array([code for code in range(256) if code & 0x7F != 0x7F], np.uint8)  # all but NaN
_E4M3_SUBNORMAL = np.array([code for code in range(256) if code & 0x78 == 0], np.uint8)  # exponent 0


def _e4m3_bytes(rng, case, values: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(K bytes, V bytes, k_scale, v_scale) for the case's slots [slots, Hkv, D]; slots outside
    the contexts hold the NaN byte. "normal": the case's K and V scaled to the E4M3 range, as a
    calibrated cache holds them. "every_code": K bytes drawn from every finite code, V bytes from
    the subnormal ones and zeros only (an output that the conversion flushed to zero shows)."""
    used = ~np.isnan(case.keys)
    if values == "normal":
        k_scale = float(np.abs(case.keys[used]).max()) / 448
        v_scale = float(np.abs(case.values[used]).max()) / 448
        k_bytes = (case.keys / k_scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        v_bytes = (case.values / v_scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:
        k_scale, v_scale = 0.004, 3.0
        k_bytes = rng.choice(_E4M3_FINITE, case.keys.shape)
        v_bytes = rng.choice(_E4M3_SUBNORMAL, case.values.shape)
    k_bytes[~used] = v_bytes[~used] = 0x7F
    return k_bytes, v_bytes, k_scale, v_scale


@pytest.mark.parametrize("kernel", ["wgmma_n64", "wgmma_n128", "mma.sync", "mma.sync_99KB"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("values", ["normal", "every_code"])
def test_fp8_prefill_kernels_against_float64(cuda_backend, rng, monkeypatch, kernel, head_dim, values):
    """Every _fp8 prefill kernel (wgmma with 64- and 128-key tiles on Hopper; mma.sync with 128-
    and, where a block gets 99 KB, 64-row tiles; head_dim 256's one-stage kernel) over a paged
    cache of E4M3 bytes, GQA 4, prompts continuing prefix-cached contexts, against a float64
    reference that dequantizes the same bytes (k_scale and v_scale not 1)."""
    from dataclasses import replace

    from atlas.adapters.cuda import ops_attention

    rt = cuda_backend.runtime
    wgmma = kernel.startswith("wgmma")
    if wgmma and (rt.compute_capability != (9, 0) or head_dim not in (64, 128)):
        pytest.skip("the wgmma FP8 kernels are built for sm_90a, head dims 64 and 128")
    monkeypatch.setattr(rt, "features", replace(rt.features, wgmma_attention=wgmma))
    if wgmma:
        keys_per_tile = int(kernel.removeprefix("wgmma_n"))
        monkeypatch.setitem(ops_attention.WGMMA_KEYS_PER_TILE, head_dim, keys_per_tile)
        expected_symbol = f"attention_prefill_wgmma_d{head_dim}_n{keys_per_tile}_fp8"
    else:
        if kernel == "mma.sync_99KB":
            monkeypatch.setattr(rt, "max_shared_optin", 101376)
        rows = 64 if head_dim == 256 or (kernel == "mma.sync_99KB" and head_dim == 128) else 128
        expected_symbol = f"attention_prefill_d{head_dim}_m{rows}_fp8"
    assert ops_attention.prefill_kernel(rt, head_dim, kv_fp8=True).symbol == expected_symbol

    heads = HeadLayout(16, 4, head_dim)
    case = paged_case(rng, heads, [700, 300, 130], [200, 300, 17], block_size=16)  # 500 and 113 cached
    k_bytes, v_bytes, k_scale, v_scale = _e4m3_bytes(rng, case, values)
    planes = []
    for slots in (k_bytes, v_bytes):
        # slot-major [blocks * bs, Hkv, D] -> the adapter's head-major pages [blocks, Hkv, bs, D]
        pages = slots.reshape(case.num_blocks, case.block_size, heads.num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        planes.append(cuda_backend.upload(np.ascontiguousarray(pages), DType.U8))
    meta = upload_metadata(cuda_backend, case)
    table_stride = np.int32(case.block_tables.shape[1])
    common = (meta.query_start_loc.address, meta.seq_lens.address, meta.block_tables.address, table_stride)
    scale = 1 / math.sqrt(head_dim)
    scale_log2 = np.float32(scale * k_scale * math.log2(math.e))  # the K scale folded in, as attention() does
    q = cuda_backend.upload(case.query, DType.BF16)
    out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
    addresses = (planes[0].address, planes[1].address)
    ops_attention._prefill(
        rt, q, out, addresses, common, meta, heads, case.block_size, scale_log2, np.int32(0), True, v_scale
    )

    def dequantized(raw: np.ndarray, plane_scale: float) -> np.ndarray:
        return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * plane_scale

    reference = replace(case, keys=dequantized(k_bytes, k_scale), values=dequantized(v_bytes, v_scale))
    assert rel_l2(host(cuda_backend, out), reference_attention(reference, scale, None)) < BF16_TOLERANCE


# -- the `_x` kernels: sinks, soft-capping, gated output -----------------------------------------


def _reference_with_extras(case, scale, window, sinks, softcap, gate):
    """float64 attention with a sink logit per head, soft-capped scores and a sigmoid gate."""
    heads = case.heads
    group = heads.num_q_heads // heads.num_kv_heads
    out = np.zeros((case.num_tokens, heads.num_q_heads, heads.head_dim))
    queries = case.query.reshape(case.num_tokens, heads.num_q_heads, heads.head_dim).astype(np.float64)
    for s, (context_len, query_len) in enumerate(zip(case.context_lens, case.query_lens)):
        start = int(case.query_start_loc[s])
        blocks = case.block_tables[s, : -(-context_len // case.block_size)]
        slots = (blocks[:, None] * case.block_size + np.arange(case.block_size)).reshape(-1)[:context_len]
        positions = np.arange(context_len - query_len, context_len)
        key_positions = np.arange(context_len)
        allowed = key_positions[None, :] <= positions[:, None]
        if window is not None:
            allowed &= key_positions[None, :] > positions[:, None] - window
        for head in range(heads.num_q_heads):
            keys = case.keys[slots, head // group].astype(np.float64)
            values = case.values[slots, head // group].astype(np.float64)
            scores = queries[start : start + query_len, head] @ keys.T * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(allowed, scores, -np.inf)
            peak = scores.max(axis=1, keepdims=True)
            if sinks is not None:
                peak = np.maximum(peak, sinks[head])
            weights = np.exp(scores - peak)
            denominator = weights.sum(axis=1, keepdims=True)
            if sinks is not None:
                denominator = denominator + np.exp(sinks[head] - peak)
            out[start : start + query_len, head] = weights @ values / denominator
    out = out.reshape(case.num_tokens, heads.q_size)
    return out if gate is None else out / (1 + np.exp(-gate.astype(np.float64)))


EXTRAS_CASES = [
    # (heads, context lens, query lens, window, sinks, softcap, gated)
    (HeadLayout(64, 8, 64), [700, 3000, 90, 1], [1, 1, 90, 1], 128, True, None, False),  # GPT-OSS, split decode
    (HeadLayout(64, 8, 64), [2000], [1], None, True, None, False),  # one sequence: many splits merge the sink
    (HeadLayout(16, 2, 256), [300, 1200, 40], [1, 1, 40], None, False, None, True),  # Qwen3-Next gated
    (HeadLayout(8, 4, 256), [500, 77], [1, 77], 64, False, 50.0, False),  # soft-capped, windowed
    (HeadLayout(32, 8, 128), [900, 130], [1, 130], None, True, 30.0, True),  # all at once
]


@pytest.mark.parametrize("heads, context_lens, query_lens, window, with_sinks, softcap, gated", EXTRAS_CASES,
                         ids=["gpt_oss", "sink_splits", "qwen3_next_gated", "softcap", "everything"])
def test_attention_extras_against_float64(cuda_backend, rng, heads, context_lens, query_lens, window, with_sinks,
                                          softcap, gated):
    from atlas.adapters.cuda import ops_attention

    case = paged_case(rng, heads, context_lens, query_lens)
    kv = cuda_cache_with(cuda_backend, case)
    sinks = (rng.standard_normal(heads.num_q_heads) * 3).astype(np.float32) if with_sinks else None
    if sinks is not None:
        sinks[0] = 30.0  # one head whose sink takes nearly all the weight
    gate = bf16(rng.standard_normal((case.num_tokens, heads.q_size)) * 2) if gated else None
    q = case.query if gate is None else np.concatenate([case.query, gate], axis=1)
    extras = ops_attention.AttentionExtras(
        None if sinks is None else cuda_backend.upload(sinks, DType.F32), softcap, gated)
    out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
    scale = heads.head_dim**-0.5
    ops_attention.attention(cuda_backend.runtime, cuda_backend.upload(q, DType.BF16), kv, 0,
                            upload_metadata(cuda_backend, case), heads, scale, out, window, extras)
    expected = _reference_with_extras(case, scale, window, sinks, softcap, gate)
    assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE


CLUSTER_CASES = [
    # (heads, context lens, sinks, gated): decodes of 2..8 splits; rows shorter than the longest
    # leave splits of their cluster without a token
    (HeadLayout(32, 8, 128), [512], False, False),  # Llama-3.1-8B at batch 1: 4 splits
    (HeadLayout(32, 4, 128), [512, 100, 1], False, False),  # Qwen3-30B-A3B's heads, unused splits
    (HeadLayout(16, 2, 256), [500, 33], False, True),  # Qwen3-Next's gated heads: 8 splits
    (HeadLayout(64, 8, 64), [500, 250], True, False),  # GPT-OSS's sinks: 8 splits
]


@pytest.mark.parametrize("heads, context_lens, with_sinks, gated", CLUSTER_CASES,
                         ids=["llama_b1", "qwen3_moe_unused_splits", "qwen3_next_gated", "gpt_oss_sinks"])
def test_decode_splits_merge_in_a_cluster_as_through_global_memory(cuda_backend, rng, heads, context_lens, with_sinks,
                                                                     gated):
    """`cluster_merge` on, a head group's splits are one cluster that merges through distributed
    shared memory; off, the last split to finish merges the partials from global memory. Both
    give the float64 reference, and each other's result up to the merge's own rounding."""
    from dataclasses import replace

    from atlas.adapters.cuda import ops_attention

    rt = cuda_backend.runtime
    if rt.compute_capability[0] < 9:
        pytest.skip("clusters need sm_90")
    case = paged_case(rng, heads, context_lens, [1] * len(context_lens))
    kv = cuda_cache_with(cuda_backend, case)
    meta = upload_metadata(cuda_backend, case)
    sinks = (rng.standard_normal(heads.num_q_heads) * 3).astype(np.float32) if with_sinks else None
    gate = bf16(rng.standard_normal((case.num_tokens, heads.q_size)) * 2) if gated else None
    q = cuda_backend.upload(case.query if gate is None else np.concatenate([case.query, gate], axis=1), DType.BF16)
    extras = None
    if with_sinks or gated:
        extras = ops_attention.AttentionExtras(None if sinks is None else cuda_backend.upload(sinks, DType.F32),
                                               None, gated)
    scale = heads.head_dim**-0.5
    saved, launch = rt.features, rt.launch
    results, clusters = {}, {}
    try:
        for on in (True, False):
            rt.features = replace(saved, cluster_merge=on)
            shapes = clusters[on] = []

            def recording_launch(module, symbol, *args, cluster=1, **kwargs):
                if symbol.startswith("attention_decode"):
                    shapes.append(cluster)
                launch(module, symbol, *args, cluster=cluster, **kwargs)

            rt.launch = recording_launch
            out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
            ops_attention.attention(rt, q, kv, 0, meta, heads, scale, out, None, extras)
            results[on] = host(cuda_backend, out)
    finally:
        rt.features, rt.launch = saved, launch
    assert len(clusters[True]) == 1 and 1 < clusters[True][0][2] <= 8, clusters
    assert clusters[False] == [(1, 1, 1)]
    expected = _reference_with_extras(case, scale, None, sinks, None, gate)
    assert rel_l2(results[True], expected) < BF16_TOLERANCE
    assert rel_l2(results[True], results[False]) < 1e-3


def test_a_lone_sequences_chunk_launches_no_decode_kernel(cuda_backend, rng):
    """One sequence of several query tokens (a request's prefill step) runs the prefill kernel
    alone; with a decode row beside it the decode kernel runs too. Both match the reference."""
    heads = HeadLayout(9, 3, 64)
    scale = heads.head_dim**-0.5
    for context_lens, query_lens, decode_runs in (([300], [300], False), ([77], [13], False),
                                                  ([77, 40], [13, 1], True)):
        case = paged_case(rng, heads, context_lens=context_lens, query_lens=query_lens)
        kv = cuda_cache_with(cuda_backend, case)
        meta = upload_metadata(cuda_backend, case)
        out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
        q = cuda_backend.upload(case.query, DType.BF16)
        symbols = launched_symbols(cuda_backend,
                                   lambda: cuda_backend.paged_attention(q, kv, 0, meta, heads, scale, out))
        assert any(symbol.startswith("attention_decode") for symbol in symbols) == decode_runs, symbols
        assert rel_l2(host(cuda_backend, out), reference_attention(case, scale, None)) < BF16_TOLERANCE


CASCADE_CASES = [
    # (heads, context lens, query lens, rows sharing the first row's pages, shared pages, block size)
    # a serving step: 52 decodes after a 2,048-token system prompt, 4 decodes of other prompts, 4
    # chunks over the same system prompt (not decode rows: never in the cascade)
    (HeadLayout(32, 8, 128), [2080 + 7 * i for i in range(52)] + [2200] * 4 + [2080] * 4, [1] * 56 + [32] * 4,
     list(range(52)) + list(range(56, 60)), 128, 16),
    (HeadLayout(9, 3, 64), [300 + 5 * i for i in range(12)], [1] * 12, list(range(12)), 9, 32),  # SmolLM2, 288
    (HeadLayout(16, 2, 256), [1000 + i for i in range(10)], [1] * 10, list(range(10)), 62, 16),  # head dim 256
    # MHA at block size 8, and a row whose context goes on 3,360 tokens past the prefix (split decode)
    (HeadLayout(8, 8, 128), [700] * 8 + [4000], [1] * 9, list(range(9)), 80, 8),
]


@pytest.mark.parametrize("heads, context_lens, query_lens, sharing, pages, block_size", CASCADE_CASES,
                         ids=["serving", "smollm2", "d256", "mha_b8_split"])
def test_cascade_attention_against_float64(cuda_backend, rng, heads, context_lens, query_lens, sharing, pages,
                                           block_size):
    """Decode rows that open with the same pages read them once (attention_cascade_* and the
    `_cascade` decode kernel): each row's output is its attention over its whole context, as
    the float64 reference and the plain kernels give it; rows outside the prefix (other
    prompts, prefill chunks) are untouched by it."""
    from dataclasses import replace

    from atlas.domain.step_inputs import CacheLayout, shared_prefixes

    case = paged_case(rng, heads, context_lens, query_lens, block_size=block_size)
    tables = case.block_tables.copy()
    for row in sharing:
        tables[row, :pages] = tables[0, :pages]
    case = replace(case, block_tables=tables)
    layout = CacheLayout(block_size, tables.shape[1], (case.num_blocks + 1000,))
    prefix = shared_prefixes(tables[:, None, :], np.asarray(query_lens), case.seq_lens, layout)
    assert prefix is not None and prefix[0, 0] == pages * block_size
    decode_sharing = [row for row in sharing if query_lens[row] == 1]
    assert np.flatnonzero(prefix[0, 2:]).tolist() == decode_sharing

    scale = 1 / math.sqrt(heads.head_dim)
    kv = cuda_cache_with(cuda_backend, case)
    q = cuda_backend.upload(case.query, DType.BF16)
    plain_meta = upload_metadata(cuda_backend, case)
    meta = replace(plain_meta, shared_prefix=cuda_backend.upload(prefix[0]), shared_prefix_len=int(prefix[0, 0]))
    expected = reference_attention(case, scale, None)
    outputs = []
    for metadata in (meta, plain_meta, meta):  # twice: the split counters are back at zero
        out = poisoned(cuda_backend, (case.num_tokens, heads.q_size), DType.BF16)
        symbols = launched_symbols(
            cuda_backend, lambda: cuda_backend.paged_attention(q, kv, 0, metadata, heads, scale, out))  # noqa: B023
        assert (f"attention_cascade_d{heads.head_dim}" in symbols) == (metadata is meta), symbols
        outputs.append(host(cuda_backend, out))
        assert rel_l2(outputs[-1], expected) < BF16_TOLERANCE
    cascaded, plain, again = outputs
    np.testing.assert_array_equal(cascaded, again)
    group = heads.num_q_heads // heads.num_kv_heads
    rows = case.query_start_loc[:-1]
    untouched = [row for row in range(len(context_lens)) if row not in decode_sharing]
    for row in untouched:  # the same kernels, the same bits
        np.testing.assert_array_equal(cascaded[rows[row] : rows[row] + query_lens[row]],
                                      plain[rows[row] : rows[row] + query_lens[row]])
    for row in decode_sharing:
        assert rel_l2(cascaded[rows[row]], expected[rows[row]]) < BF16_TOLERANCE, (row, group)


def test_cascade_is_off_where_it_does_not_apply(cuda_backend, rng):
    """A sliding window, batch invariance and ATLAS_CUDA_DISABLE=cascade_attention decode each
    row whole (an FP8 cache and the `_x` extras cascade through their twins)."""
    from dataclasses import replace

    from atlas.adapters.cuda import ops_attention

    rt = cuda_backend.runtime
    heads = HeadLayout(8, 2, 128)
    meta = replace(upload_metadata(cuda_backend, paged_case(rng, heads, [400] * 8, [1] * 8)),
                   shared_prefix=cuda_backend.upload(np.array([384, 0] + [1] * 8, np.int32)), shared_prefix_len=384)
    assert ops_attention._cascades(rt, meta, np.int32(0))
    assert not ops_attention._cascades(rt, meta, np.int32(128))
    assert not ops_attention._cascades(rt, replace(meta, shared_prefix_len=0), np.int32(0))
    saved = rt.features
    try:
        for off in (replace(saved, batch_invariant=True), replace(saved, cascade_attention=False)):
            rt.features = off
            assert not ops_attention._cascades(rt, meta, np.int32(0))
    finally:
        rt.features = saved

"""The CUDA dense paths (GEMV, tensor-core GEMV, skinny GEMM, cuBLASLt; norms inside the GEMV or
folded into the weight; gated and residual-add epilogues) against the float32 reference: random
inputs, outputs poisoned with NaN first."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_harness import BF16_TOLERANCE, bf16, host, poisoned, rel_l2

from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import Activation

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[8, 1], ids=["wide-rows-gemv", "wide-rows-cublaslt"])
def wide_gemv_rows(request, cuda_backend):
    """Both routes of 2..8 token rows wider than NORM_IN_GEMV_MAX_WIDTH, whichever one this
    device picks (`LinearOps.wide_gemv_rows`)."""
    linear = cuda_backend._linear
    saved = linear.wide_gemv_rows
    linear.wide_gemv_rows = request.param
    yield request.param
    linear.wide_gemv_rows = saved


def test_fill_poisons_every_element_and_rows_view_shares_memory(cuda_backend, rng):
    tensor = cuda_backend.upload(rng.standard_normal((6, 8)).astype(np.float32))
    cuda_backend.fill(tensor.rows(2, 4), float("nan"))
    result = cuda_backend.download(tensor)
    assert np.isnan(result[2:4]).all() and np.isfinite(result[:2]).all() and np.isfinite(result[4:]).all()
    wide = cuda_backend.upload(rng.integers(0, 9, (5,), dtype=np.int64))
    cuda_backend.fill(wide, -(2**40) - 3)
    assert (cuda_backend.download(wide) == -(2**40) - 3).all()


@pytest.mark.parametrize("hidden", [576, 4096, 100])
def test_embedding(cuda_backend, mock_backend, rng, hidden):
    table = bf16(rng.standard_normal((1000, hidden)))
    ids = rng.integers(0, 1000, 37, dtype=np.int32)
    out = poisoned(cuda_backend, (37, hidden), DType.BF16)
    cuda_backend.embedding(cuda_backend.upload(ids), cuda_backend.upload(table, DType.BF16), out)
    expected = mock_backend.empty((37, hidden), DType.F32)
    mock_backend.embedding(mock_backend.upload(ids), mock_backend.upload(table), expected)
    np.testing.assert_array_equal(host(cuda_backend, out), host(mock_backend, expected))


def test_gather_rows_f32(cuda_backend, mock_backend, rng):
    x = rng.standard_normal((50, 77)).astype(np.float32)
    indices = rng.integers(0, 50, 13, dtype=np.int32)
    out = poisoned(cuda_backend, (13, 77), DType.F32)
    cuda_backend.gather_rows(cuda_backend.upload(x), cuda_backend.upload(indices), out)
    np.testing.assert_array_equal(cuda_backend.download(out), x[indices])


@pytest.mark.parametrize("hidden, weight_dtype", [(576, DType.BF16), (4096, DType.F32), (130, DType.BF16)])
def test_rmsnorm_and_add_rmsnorm(cuda_backend, mock_backend, rng, hidden, weight_dtype):
    num_tokens = 19
    x = bf16(rng.standard_normal((num_tokens, hidden)) * 3)
    residual = bf16(rng.standard_normal((num_tokens, hidden)))
    weight = bf16(rng.standard_normal(hidden) + 1)
    eps = 1e-5
    cx, cw = (
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(weight, weight_dtype),
    )
    mx, mw = mock_backend.upload(x), mock_backend.upload(weight)

    out = poisoned(cuda_backend, (num_tokens, hidden), DType.BF16)
    expected = mock_backend.empty((num_tokens, hidden), DType.F32)
    cuda_backend.rmsnorm(cx, cw, eps, out)
    mock_backend.rmsnorm(mx, mw, eps, expected)
    assert rel_l2(host(cuda_backend, out), host(mock_backend, expected)) < BF16_TOLERANCE

    c_residual, m_residual = (
        cuda_backend.upload(residual, DType.BF16),
        mock_backend.upload(residual),
    )
    out = poisoned(cuda_backend, (num_tokens, hidden), DType.BF16)
    cuda_backend.add_rmsnorm(cx, c_residual, cw, eps, out)
    mock_backend.add_rmsnorm(mx, m_residual, mw, eps, expected)
    assert rel_l2(host(cuda_backend, c_residual), host(mock_backend, m_residual)) < BF16_TOLERANCE
    assert rel_l2(host(cuda_backend, out), host(mock_backend, expected)) < BF16_TOLERANCE


@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
@pytest.mark.parametrize("inner", [1536, 36])
def test_act_mul(cuda_backend, mock_backend, rng, activation, inner):
    x = bf16(rng.standard_normal((23, 2 * inner)) * 2)
    out = poisoned(cuda_backend, (23, inner), DType.BF16)
    cuda_backend.act_mul(cuda_backend.upload(x, DType.BF16), activation, out)
    expected = mock_backend.empty((23, inner), DType.F32)
    mock_backend.act_mul(mock_backend.upload(x), activation, expected)
    assert rel_l2(host(cuda_backend, out), host(mock_backend, expected)) < BF16_TOLERANCE


# GEMV for 1..8 token rows, cuBLASLt above; odd widths, f32 logits, and bias.
@pytest.mark.parametrize(
    "num_tokens, num_rows, inner, out_dtype, with_bias",
    [
        (1, 4096, 4096, DType.BF16, False),
        (1, 11008, 4096, DType.BF16, False),  # rows per warp > 1
        (1, 4096, 2048, DType.BF16, True),  # 2-warp blocks (K of 1025..2048, 4 rows a block)
        (1, 4098, 1032, DType.F32, False),  # the same, a partial block of rows and of K
        (3, 576, 576, DType.BF16, True),
        (5, 1536, 576, DType.F32, False),
        (8, 49152, 576, DType.F32, True),  # a logits projection
        (2, 100, 264, DType.BF16, True),  # K % 32 != 0: the SIMT kernel
        (4, 1000, 4096, DType.BF16, True),  # tensor-core GEMV, a partial 16-row tile
        (7, 4096, 1024, DType.F32, False),
        (6, 200, 160, DType.BF16, True),  # tensor-core GEMV, K shorter than a block's warps cover
        (9, 1024, 512, DType.BF16, True),
        (64, 4096, 4096, DType.BF16, False),
        (300, 1536, 576, DType.F32, True),
        (17, 96, 40, DType.BF16, False),
        (3, 64, 36, DType.BF16, False),  # K % 8 != 0 goes to cuBLASLt
    ],
)
def test_linear(cuda_backend, wide_gemv_rows, mock_backend, rng, num_tokens, num_rows, inner, out_dtype, with_bias):
    x = bf16(rng.standard_normal((num_tokens, inner)))
    weight = bf16(rng.standard_normal((num_rows, inner)) / np.sqrt(inner))
    bias = bf16(rng.standard_normal(num_rows)) if with_bias else None
    out = poisoned(cuda_backend, (num_tokens, num_rows), out_dtype)
    cuda_backend.linear(
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(weight, DType.BF16),
        out,
        cuda_backend.upload(bias, DType.BF16) if bias is not None else None,
    )
    expected = mock_backend.empty((num_tokens, num_rows), DType.F32)
    mock_backend.linear(
        mock_backend.upload(x),
        mock_backend.upload(weight),
        expected,
        mock_backend.upload(bias) if bias is not None else None,
    )
    tolerance = BF16_TOLERANCE if out_dtype is DType.BF16 else 1e-4
    assert rel_l2(host(cuda_backend, out), host(mock_backend, expected)) < tolerance


_SKINNY_CASES = [
    (9, 4096, 4096),
    (17, 1000, 4000),
    (64, 14336, 4096),
    (40, 300, 96),
    (16, 10000, 576),
    (33, 2048, 14336),
    (64, 64, 64),
    (24, 4416, 512),
    (12, 2176, 512),
    (48, 25536, 512),
    (20, 6656, 1024),
]


@pytest.mark.parametrize("num_tokens, features, inner", _SKINNY_CASES)
def test_skinny_gemm_forms_match_cublas(cuda_backend, mock_backend, rng, num_tokens, features, inner):
    """9..64 token rows with `skinny_gemm` on: linear (bf16, and f32 with a bias), its residual
    add and its gated form each run one `gemm_skinny_*` launch and agree with the cuBLASLt path:
    the product to bf16 rounding, the add exactly as linear + add on the same product; a second
    run gives the same bits (the cluster's reduction is in rank order). Among the shapes: row
    tiles past the end, K not a multiple of 64 and of one and a half stages, K split over
    clusters of 2 and 4, tiles of 128 to 256 rows, more tiles than SMs (persistent blocks)."""
    from dataclasses import replace

    rt = cuda_backend.runtime
    saved = rt.features
    x = bf16(rng.standard_normal((num_tokens, inner)))
    weight = bf16(rng.standard_normal((2 * features, inner)) / np.sqrt(inner))
    bias = cuda_backend.upload(bf16(rng.standard_normal(2 * features)), DType.BF16)
    residual = bf16(rng.standard_normal((num_tokens, 2 * features)) * 4)
    cx, cw = cuda_backend.upload(x, DType.BF16), cuda_backend.upload(weight, DType.BF16)

    def run_all():
        plain = poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16)
        cuda_backend.linear(cx, cw, plain)
        added = cuda_backend.upload(residual, DType.BF16)
        cuda_backend.linear_add(cx, cw, added, poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16))
        gated = poisoned(cuda_backend, (num_tokens, features), DType.BF16)
        cuda_backend.rmsnorm_gated_linear(
            cx,
            cuda_backend.upload(np.ones(inner, np.float32), DType.BF16),
            1e-5,
            cw,
            Activation.SILU,
            gated,
            poisoned(cuda_backend, (num_tokens, inner), DType.BF16),
            poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16),
        )
        logits = poisoned(cuda_backend, (num_tokens, 2 * features), DType.F32)
        cuda_backend.linear(cx, cw, logits, bias)
        return (
            host(cuda_backend, plain),
            host(cuda_backend, added),
            host(cuda_backend, gated),
            host(cuda_backend, logits),
        )

    launched: list[str] = []
    launch = rt.launch

    def recording_launch(module, symbol, *args, **kwargs):
        launched.append(symbol)
        launch(module, symbol, *args, **kwargs)

    rt.launch = recording_launch
    rt.features = replace(saved, skinny_gemm=True)
    try:
        skinny = run_all()
        again = run_all()
    finally:
        rt.launch = launch
        rt.features = saved
    assert [s.rsplit("_", 1)[0] for s in launched if s.startswith("gemm_skinny_")] == 2 * [
        "gemm_skinny_bf16",
        "gemm_skinny_add",
        "gemm_skinny_gated_silu",
        "gemm_skinny_f32",
    ]
    for first, second in zip(skinny, again, strict=True):
        np.testing.assert_array_equal(first, second)
    rt.features = replace(saved, skinny_gemm=False)
    try:
        reference = run_all()  # cuBLASLt
    finally:
        rt.features = saved
    plain, added, gated, logits = skinny
    assert rel_l2(plain, reference[0]) < BF16_TOLERANCE
    np.testing.assert_array_equal(added, bf16(residual + plain.astype(np.float32)).astype(np.float64))
    assert rel_l2(gated, reference[2]) < BF16_TOLERANCE
    assert rel_l2(logits, reference[3]) < 1e-5


def test_linear_into_a_rows_view_leaves_other_rows(cuda_backend, rng):
    x = bf16(rng.standard_normal((4, 256)))
    weight = bf16(rng.standard_normal((128, 256)))
    out = poisoned(cuda_backend, (10, 128), DType.F32)
    cuda_backend.linear(
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(weight, DType.BF16),
        out.rows(3, 7),
    )
    result = cuda_backend.download(out)
    assert np.isnan(result[:3]).all() and np.isnan(result[7:]).all()
    assert rel_l2(result[3:7], x.astype(np.float64) @ weight.T) < 1e-4


def test_shape_errors_name_the_argument(cuda_backend):
    x = cuda_backend.empty((2, 64), DType.BF16)
    weight = cuda_backend.empty((32, 48), DType.BF16)
    with pytest.raises(ValueError, match="weight"):
        cuda_backend.linear(x, weight, cuda_backend.empty((2, 32), DType.BF16))
    with pytest.raises(ValueError, match="out"):
        cuda_backend.rmsnorm(
            x,
            cuda_backend.empty((64,), DType.BF16),
            1e-6,
            cuda_backend.empty((3, 64), DType.BF16),
        )


def test_memory_pool_reuses_freed_blocks_and_reports_oom(cuda_backend):
    stats = cuda_backend.memory_stats()
    tensor = cuda_backend.empty((1 << 20,), DType.F32)
    address = tensor.address
    del tensor
    again = cuda_backend.empty((1 << 20,), DType.F32)
    assert again.address == address
    after = cuda_backend.memory_stats()
    assert after.num_reused > stats.num_reused
    assert after.peak_allocated_bytes >= after.allocated_bytes >= 4 << 20
    free, total = cuda_backend.memory_info()
    assert 0 < free <= total
    with pytest.raises(MemoryError, match="cannot allocate"):
        cuda_backend.empty((total // 2 + 1, 2), DType.F32)


# The fused decode ops: one GEMV that normalises x as it loads it (and applies the gated
# activation to its own rows), or that adds into the residual (1..8 rows); else the unfused ops
# (cuBLASLt rows, odd widths). Each must give what the separate ops give on CUDA (bit for bit,
# but for the norm's sum of squares, which the GEMV reduces in its own order) and match the mock.
_FUSED_SHAPES = [
    (1, 4096, 4096),  # SIMT GEMV, four rows per block
    (1, 4096, 2048),  # four rows per block in blocks of 2 warps
    (1, 576, 1536),  # SmolLM2: two rows per block
    (1, 100, 264),
    (2, 576, 576),  # tensor-core GEMV
    (8, 4096, 1024),
    (5, 1000, 4096),  # a partial tile
    (4, 96, 224),  # K shorter than the block's warps cover: idle warps still meet the norm's barrier
    (3, 96, 264),  # K % 32 != 0 with several rows: unfused
    (16, 576, 1536),  # cuBLASLt: unfused
]


def _norm_inputs(rng, num_tokens, rows, inner):
    x = bf16(rng.standard_normal((num_tokens, inner)) * 3)
    norm = bf16(rng.standard_normal(inner) * 0.5 + 1)
    weight = bf16(rng.standard_normal((rows, inner)) / np.sqrt(inner) * 2)
    return x, norm, weight


def _mock_rmsnorm_linear(mock_backend, x, norm, weight, bias):
    """The mock's rmsnorm_linear (norm weight apart) on host arrays, as f32."""
    num_tokens, inner = x.shape
    expected = mock_backend.empty((num_tokens, weight.shape[0]), DType.F32)
    mock_backend.rmsnorm_linear(
        mock_backend.upload(x),
        mock_backend.upload(norm),
        1e-5,
        mock_backend.upload(weight),
        expected,
        mock_backend.empty((num_tokens, inner), DType.F32),
        mock_backend.upload(bias) if bias is not None else None,
    )
    return host(mock_backend, expected)


def _mock_rmsnorm_gated_linear(mock_backend, x, norm, weight, activation):
    num_tokens, inner = x.shape
    features = weight.shape[0] // 2
    expected = mock_backend.empty((num_tokens, features), DType.F32)
    mock_backend.rmsnorm_gated_linear(
        mock_backend.upload(x),
        mock_backend.upload(norm),
        1e-5,
        mock_backend.upload(weight),
        activation,
        expected,
        mock_backend.empty((num_tokens, inner), DType.F32),
        mock_backend.empty((num_tokens, 2 * features), DType.F32),
    )
    return host(mock_backend, expected)


@pytest.mark.parametrize("norm_dtype, with_bias", [(DType.BF16, False), (DType.F32, True)])
@pytest.mark.parametrize("num_tokens, rows, inner", _FUSED_SHAPES)
def test_rmsnorm_linear(cuda_backend, mock_backend, rng, norm_dtype, with_bias, num_tokens, rows, inner):
    x, norm, weight = _norm_inputs(rng, num_tokens, rows, inner)
    bias = bf16(rng.standard_normal(rows)) if with_bias else None
    cx, cn, cw = (
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(norm, norm_dtype),
        cuda_backend.upload(weight, DType.BF16),
    )
    cb = cuda_backend.upload(bias, DType.BF16) if bias is not None else None
    normed = poisoned(cuda_backend, (num_tokens, inner), DType.BF16)
    unfused = poisoned(cuda_backend, (num_tokens, rows), DType.BF16)
    cuda_backend.rmsnorm(cx, cn, 1e-5, normed)
    cuda_backend.linear(normed, cw, unfused, cb)
    out = poisoned(cuda_backend, (num_tokens, rows), DType.BF16)
    cuda_backend.rmsnorm_linear(
        cx,
        cn,
        1e-5,
        cw,
        out,
        poisoned(cuda_backend, (num_tokens, inner), DType.BF16),
        cb,
    )
    assert rel_l2(host(cuda_backend, out), host(cuda_backend, unfused)) < 1e-3

    expected = _mock_rmsnorm_linear(mock_backend, x, norm, weight, bias)
    assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE


@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
@pytest.mark.parametrize("num_tokens, features, inner", _FUSED_SHAPES)
def test_rmsnorm_gated_linear(cuda_backend, mock_backend, rng, activation, num_tokens, features, inner):
    x, norm, weight = _norm_inputs(rng, num_tokens, 2 * features, inner)
    cx, cn, cw = (
        cuda_backend.upload(x, DType.BF16),
        cuda_backend.upload(norm, DType.BF16),
        cuda_backend.upload(weight, DType.BF16),
    )
    normed = poisoned(cuda_backend, (num_tokens, inner), DType.BF16)
    gated = poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16)
    unfused = poisoned(cuda_backend, (num_tokens, features), DType.BF16)
    cuda_backend.rmsnorm(cx, cn, 1e-5, normed)
    cuda_backend.linear(normed, cw, gated)
    cuda_backend.act_mul(gated, activation, unfused)
    out = poisoned(cuda_backend, (num_tokens, features), DType.BF16)
    cuda_backend.rmsnorm_gated_linear(
        cx,
        cn,
        1e-5,
        cw,
        activation,
        out,
        poisoned(cuda_backend, (num_tokens, inner), DType.BF16),
        poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16),
    )
    assert rel_l2(host(cuda_backend, out), host(cuda_backend, unfused)) < 1e-3

    expected = _mock_rmsnorm_gated_linear(mock_backend, x, norm, weight, activation)
    assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE


# Rows wider than NORM_IN_GEMV_MAX_WIDTH, where CUDA folds the norm weight into the projection.
_FOLDED_SHAPES = [
    (1, 6144, 4096),  # 4 rows per block
    (1, 1000, 4096),  # 2 rows per block
    (1, 100, 2560),  # 1 row per block, K not a multiple of a full batch of chunks
    (3, 1000, 4096),  # tensor-core GEMV scaling by each row's RMS (a verify step's rows)
    (8, 6144, 4096),
    (2, 100, 2560),
    (5, 200, 4104),  # K not a multiple of 32: the norm kernel (unit weight), then the GEMV
    (16, 576, 2560),  # cuBLASLt behind the norm kernel
]


def _fold_on_cuda(cuda_backend, norm, norm_dtype, weight):
    """The weight uploaded and folded on CUDA, checked against bf16(weight * norm)."""
    cw = cuda_backend.upload(weight, DType.BF16)
    assert cuda_backend.fold_rmsnorm(cuda_backend.upload(norm, norm_dtype), cw)
    folded = bf16(weight.astype(np.float32) * norm.astype(np.float32))
    np.testing.assert_array_equal(cuda_backend.download(cw).astype(np.float32), folded.astype(np.float32))
    return cw


@pytest.mark.parametrize(
    "norm_dtype, with_bias, out_dtype", [(DType.BF16, False, DType.BF16), (DType.F32, True, DType.F32)]
)
@pytest.mark.parametrize("num_tokens, rows, inner", _FOLDED_SHAPES)
def test_folded_rmsnorm_linear(
    cuda_backend, wide_gemv_rows, mock_backend, rng, norm_dtype, with_bias, out_dtype, num_tokens, rows, inner
):
    """A norm weight folded into the projection (`fold_rmsnorm`, then no norm weight) against the
    mock's rmsnorm_linear with the weight apart: one rounding moves (bf16(w g) instead of
    bf16(x g)), so they agree to bf16 tolerance."""
    x, norm, weight = _norm_inputs(rng, num_tokens, rows, inner)
    bias = bf16(rng.standard_normal(rows)) if with_bias else None
    cw = _fold_on_cuda(cuda_backend, norm, norm_dtype, weight)
    out = poisoned(cuda_backend, (num_tokens, rows), out_dtype)
    cuda_backend.rmsnorm_linear(
        cuda_backend.upload(x, DType.BF16),
        None,
        1e-5,
        cw,
        out,
        poisoned(cuda_backend, (num_tokens, inner), DType.BF16),
        cuda_backend.upload(bias, DType.BF16) if bias is not None else None,
    )
    expected = _mock_rmsnorm_linear(mock_backend, x, norm, weight, bias)
    assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE


@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
@pytest.mark.parametrize(
    "num_tokens, features, inner",
    [(1, 2000, 4096), (1, 200, 2560), (4, 300, 4096), (8, 1000, 4096), (2, 96, 2560), (16, 96, 2560)],
)
def test_folded_rmsnorm_gated_linear(
    cuda_backend, wide_gemv_rows, mock_backend, rng, activation, num_tokens, features, inner
):
    x, norm, weight = _norm_inputs(rng, num_tokens, 2 * features, inner)
    cw = _fold_on_cuda(cuda_backend, norm, DType.BF16, weight)
    out = poisoned(cuda_backend, (num_tokens, features), DType.BF16)
    cuda_backend.rmsnorm_gated_linear(
        cuda_backend.upload(x, DType.BF16),
        None,
        1e-5,
        cw,
        activation,
        out,
        poisoned(cuda_backend, (num_tokens, inner), DType.BF16),
        poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16),
    )
    expected = _mock_rmsnorm_gated_linear(mock_backend, x, norm, weight, activation)
    assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE


@pytest.mark.parametrize("skinny", [False, True])
@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
@pytest.mark.parametrize("num_tokens, features, inner", [(9, 1024, 4096), (64, 1000, 4096), (300, 256, 2560)])
def test_a_folded_gated_norm_scales_after_the_product(
    cuda_backend, mock_backend, rng, skinny, activation, num_tokens, features, inner
):
    """Past the GEMV sizes (`rms_after_product`) the folded gated projection runs no norm kernel:
    cuBLASLt (or up to 64 rows with `skinny_gemm` the skinny GEMM) multiplies the unnormalised
    rows and act_mul_rms scales gate and up by each row's inverse RMS. Against the mock (the norm
    first) and the norm kernel first on CUDA (feature off): bf16 rounding apart."""
    from dataclasses import replace

    x, norm, weight = _norm_inputs(rng, num_tokens, 2 * features, inner)
    x[1] *= 40  # rows of very different RMS
    cw = _fold_on_cuda(cuda_backend, norm, DType.BF16, weight)
    rt = cuda_backend.runtime
    saved = rt.features
    results = []
    try:
        for on in (True, False):
            rt.features = replace(saved, rms_after_product=on, skinny_gemm=skinny)
            out = poisoned(cuda_backend, (num_tokens, features), DType.BF16)
            normed = poisoned(cuda_backend, (num_tokens, inner), DType.BF16)
            cx = cuda_backend.upload(x, DType.BF16)
            scratch = poisoned(cuda_backend, (num_tokens, 2 * features), DType.BF16)
            cuda_backend.rmsnorm_gated_linear(cx, None, 1e-5, cw, activation, out, normed, scratch)
            results.append(host(cuda_backend, out))
            assert np.isnan(host(cuda_backend, normed)).all() == on  # no norm kernel wrote it
    finally:
        rt.features = saved
    expected = _mock_rmsnorm_gated_linear(mock_backend, x, norm, weight, activation)
    assert rel_l2(results[0], expected) < BF16_TOLERANCE
    assert rel_l2(results[0], results[1]) < BF16_TOLERANCE
    for row in (0, 1):
        assert rel_l2(results[0][row], expected[row]) < BF16_TOLERANCE


def test_fold_rmsnorm_leaves_narrow_rows_and_says_so(cuda_backend, rng):
    """Up to NORM_IN_GEMV_MAX_WIDTH the GEMV normalises x itself: nothing to fold, the weight
    stays as it was."""
    weight = bf16(rng.standard_normal((64, 576)))
    cw = cuda_backend.upload(weight, DType.BF16)
    assert not cuda_backend.fold_rmsnorm(cuda_backend.upload(bf16(np.full(576, 2.0)), DType.BF16), cw)
    np.testing.assert_array_equal(cuda_backend.download(cw), weight)


@pytest.mark.parametrize("num_tokens, hidden, inner", _FUSED_SHAPES)
def test_linear_add_is_linear_then_add(cuda_backend, wide_gemv_rows, mock_backend, rng, num_tokens, hidden, inner):
    x = bf16(rng.standard_normal((num_tokens, inner)))
    weight = bf16(rng.standard_normal((hidden, inner)) / np.sqrt(inner))
    residual = bf16(rng.standard_normal((num_tokens, hidden)) * 4)
    cx, cw = cuda_backend.upload(x, DType.BF16), cuda_backend.upload(weight, DType.BF16)
    product = poisoned(cuda_backend, (num_tokens, hidden), DType.BF16)
    cuda_backend.linear(cx, cw, product)
    expected_cuda = bf16(residual + cuda_backend.download(product).astype(np.float32))
    # past the GEMV sizes (`gemv_rows`) with `rms_after_product`, cuBLASLt adds the f32 product (one rounding)
    in_epilogue = num_tokens > cuda_backend._linear.gemv_rows(inner) and cuda_backend.runtime.features.rms_after_product
    if in_epilogue:
        product = poisoned(cuda_backend, (num_tokens, hidden), DType.F32)
        cuda_backend.linear(cx, cw, product)
        expected_cuda = bf16(residual + cuda_backend.download(product))
    c_residual = cuda_backend.upload(residual, DType.BF16)
    for step in range(2):  # a second add, onto the first one's result
        cuda_backend.linear_add(cx, cw, c_residual, poisoned(cuda_backend, (num_tokens, hidden), DType.BF16))
        if step == 0 and in_epilogue:  # the f32 product may come from another algorithm
            assert rel_l2(host(cuda_backend, c_residual), expected_cuda.astype(np.float64)) < 4e-3
        elif step == 0:
            np.testing.assert_array_equal(host(cuda_backend, c_residual), expected_cuda.astype(np.float64))

    m_residual = mock_backend.upload(residual)
    for _ in range(2):
        m_scratch = mock_backend.empty((num_tokens, hidden), DType.BF16)
        mock_backend.linear_add(mock_backend.upload(x), mock_backend.upload(weight), m_residual, m_scratch)
    assert rel_l2(host(cuda_backend, c_residual), host(mock_backend, m_residual)) < BF16_TOLERANCE

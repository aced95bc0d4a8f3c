"""FP8 (E4M3) weights on CUDA, path by path, against the exact dequantization (`HostLinear.values()`,
what the mock computes with), through the dense kind's members; outputs poisoned with NaN first.

- Up to 8 token rows the GEMVs read the E4M3 bytes and their scales (per channel, or 128 x 128
  blocks) and keep x in bf16: within bf16 rounding of the product (BF16_TOLERANCE), the bf16
  GEMVs' own bound. One row runs the SIMT kernel (it multiplies in f16, x scaled by a power of
  two per 16 values: about 2^-11 relative), 2..8 the tensor-core one (K % 64 == 0).
- Past 8 rows x is rounded to E4M3 (per token; per 1 x 128 group for block weights) for
  cuBLASLt's FP8 tensor cores: within bf16 rounding of the same product with x rounded so in
  numpy, and within FP8_ACTIVATION_TOLERANCE of the unrounded one. That bound is E4M3's: 3
  mantissa bits round each value of x by at most 2^-4 of itself, 2^-4 / sqrt(3) ~ 3.6% in the
  mean square at worst, and a product's relative error is about its terms' (these cases'
  rounded references: 1.6-2.7% from the exact ones, 3.6-4.0% for the gated form, where the
  gate's and the up row's errors compound through act(gate) * up).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from cuda_harness import BF16_TOLERANCE, bf16, host, poisoned, rel_l2

from atlas.ports.gpu import DType
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm

pytestmark = pytest.mark.gpu

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_ACTIVATION_TOLERANCE = 0.06
EPS = 1e-5


def fp8_linear(rng, rows: int, inner: int, block: bool, bias: bool = False) -> HostLinear:
    """Random E4M3 bytes (normal samples, 4.5 sigma at 448) with per-row or per-tile scales that
    differ by up to 4x, so a scale applied to the wrong row or tile shows."""
    data = np.clip(rng.standard_normal((rows, inner)) * 448 / 4.5, -448, 448).astype(E4M3)
    spread = 0.02 * 4.5 / 448 / np.sqrt(inner / 1024)
    shape = (-(-rows // 128), -(-inner // 128)) if block else (rows,)
    scales = (spread * rng.uniform(0.5, 2.0, shape)).astype(np.float32)
    return HostLinear(data, bf16(rng.standard_normal(rows)) if bias else None, scales, (128, 128) if block else None)


def rmsnorm(x: np.ndarray, norm: RmsNorm | None) -> np.ndarray:
    if norm is None:
        return x
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + norm.eps) * norm.weight.astype(np.float64)


def round_e4m3(values: np.ndarray, group: int | None) -> np.ndarray:
    """x as the quantizing kernel rounds it, per row (`group` None) or per `group` columns, in its
    f32 arithmetic: q = e4m3(v * f32(448 / amax)), s = f32(amax / 448), value = q * s.

    The f32 reciprocal matters at exact ties: bf16 inputs (8 significant bits) often land exactly
    halfway between two E4M3 values, e.g. x = 19.125 under amax = 51 gives 168, the midpoint of
    160 and 176. The exact quotient rounds to even (160); the kernel's x * f32(448 / 51) is 168
    plus an f32 ulp and rounds up (176). Both are roundings of x to E4M3 within 2^-4; the reference
    takes the kernel's, so that it stays within bf16 rounding of the kernel's product."""
    values = values.astype(np.float32)
    rows, width = values.shape
    size = width if group is None else group
    out = np.empty(values.shape, np.float64)
    for start in range(0, width, size):
        part = values[:, start : start + size]
        amax = np.abs(part).max(axis=1, keepdims=True)
        inverse = np.float32(448) / np.where(amax > 0, amax, np.float32(1))
        quantized = np.clip(part * inverse, -448, 448).astype(E4M3).astype(np.float64)
        out[:, start : start + size] = quantized * (amax / np.float32(448)).astype(np.float64)
    return out


def reference(x: np.ndarray, host: HostProjection, quantize_x: bool = False) -> np.ndarray:
    """The float64 product; with `quantize_x`, x rounded as the GEMM path rounds it (per token
    for channel scales, per 128 columns for block scales)."""
    values = rmsnorm(x.astype(np.float64), host.input_norm)
    if quantize_x:
        values = round_e4m3(values, 128 if host.linear.block_shape else None)
    product = values @ host.linear.values().astype(np.float64).T
    if host.linear.bias is not None:
        product = product + host.linear.bias.astype(np.float64)
    if host.activation is None:
        return product
    half = product.shape[1] // 2
    gate = bf16(product[:, :half]).astype(np.float64)  # the kernels round gate and up to bf16 first
    return gate / (1 + np.exp(-gate)) * bf16(product[:, half:]).astype(np.float64)


FORMS = ["plain", "f32_bias", "gated", "add"]


def run_form(
    cuda_backend, rng, form: str, num_tokens: int, rows: int, inner: int, block: bool, norm: bool,
    norm_type: DType = DType.BF16,
):
    """(CUDA output, the float64 reference without and with x rounded to E4M3) of one form."""
    dense = cuda_backend.dense
    norm_weight = RmsNorm(bf16(1 + 0.3 * rng.standard_normal(inner)), EPS) if norm else None
    gated = form == "gated"
    linear = fp8_linear(rng, 2 * rows if gated else rows, inner, block, bias=form == "f32_bias")
    host_projection = HostProjection(linear, norm_weight, Activation.SILU if gated else None)
    prepared = dense.prepare(host_projection)
    if norm_weight is not None and norm_type is not DType.BF16:  # prepare uploads bf16 norm weights
        norm_tensor = cuda_backend.upload(norm_weight.weight.astype(np.float32), norm_type)
        prepared = dense.projection(prepared.weight, prepared.bias, norm_tensor, EPS, host_projection.activation)
    x = bf16(rng.standard_normal((num_tokens, inner)) * 2)
    x[0] *= 8  # rows of very different size: the per-token scales must follow them
    x_tensor = cuda_backend.upload(x, DType.BF16)
    if form == "add":
        residual = bf16(rng.standard_normal((num_tokens, rows)))
        stream = cuda_backend.upload(residual, DType.BF16)
        dense.project_add(x_tensor, prepared, stream)
        got = host(cuda_backend, stream) - residual
    else:
        out = poisoned(cuda_backend, (num_tokens, rows), DType.F32 if form == "f32_bias" else DType.BF16)
        dense.project(x_tensor, prepared, out)
        got = host(cuda_backend, out)
    return got, reference(x, host_projection), reference(x, host_projection, quantize_x=True)


# (tokens, output rows, inner): one row (SIMT: 4, 2 and 1 rows a block; a partial 128-row tile and
# a partial 128-column tile; K = 5120 one step past the first round of 4), 2..8 rows (tensor
# cores), and K % 64 != 0 at 3 rows (the GEMM).
DECODE_SHAPES = [(1, 4096, 4096), (1, 1000, 4096), (1, 1502, 5120), (1, 200, 320), (2, 1536, 4096), (5, 1000, 4096),
                 (8, 1024, 14336)]


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_tokens, rows, inner", DECODE_SHAPES)
def test_the_decode_gemvs_read_e4m3_weights_exactly(cuda_backend, rng, num_tokens, rows, inner, form, block):
    got, exact, _ = run_form(cuda_backend, rng, form, num_tokens, rows, inner, block, norm=form != "add")
    assert rel_l2(got, exact) < BF16_TOLERANCE, (form, num_tokens, rows, inner)


@pytest.mark.parametrize("form", ["plain", "gated"])
def test_the_one_row_gemv_takes_an_f32_norm_weight_too(cuda_backend, rng, form):
    """One row normalises x inside the GEMV; its `_f32` norm-weight forms (block scales here)."""
    got, exact, _ = run_form(cuda_backend, rng, form, 1, 1000, 4096, True, norm=True, norm_type=DType.F32)
    assert rel_l2(got, exact) < BF16_TOLERANCE, form


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_tokens, rows, inner", [(9, 1000, 4096), (64, 4096, 4096), (301, 512, 1024), (3, 256, 336)])
def test_the_fp8_gemm_rounds_x_to_e4m3_and_nothing_else(cuda_backend, rng, num_tokens, rows, inner, form, block):
    """Past the GEMVs (and for K % 64 != 0 at 2..8 rows): x rounded to E4M3 per token or per
    1 x 128 group, then the exact product; 9, 301 and 3 rows take the padding to 4 rows, and
    K = 336 a partial last group."""
    got, exact, rounded = run_form(cuda_backend, rng, form, num_tokens, rows, inner, block, norm=form != "add")
    assert rel_l2(got, rounded) < BF16_TOLERANCE, (form, num_tokens, rows, inner)
    assert rel_l2(got, exact) < FP8_ACTIVATION_TOLERANCE, (form, num_tokens, rows, inner)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("num_tokens, inner", [(5, 2048), (64, 6144), (62, 14336), (7, 16384)])
def test_the_register_resident_quantizer_gives_the_three_pass_kernels_bits(cuda_backend, rng, num_tokens, inner,
                                                                            norm):
    """The token quantizer that keeps a row in registers (`_r1` .. `_r8`, by width) writes the
    same E4M3 bytes and scales as the kernel that reads the row three times, the scale is the
    row's amax / 448 and the padding rows are zeros."""
    from atlas.adapters.cuda.ops_fp8 import _QUANT_THREADS, _resident_suffix

    rt = cuda_backend.dense.fp8._rt
    rows = -(-num_tokens // 4) * 4
    x = bf16(rng.standard_normal((num_tokens, inner)) * 2)
    x[0] *= 8
    weight = bf16(1 + 0.3 * rng.standard_normal(inner))
    x_tensor = cuda_backend.upload(x, DType.BF16)
    weight_tensor = cuda_backend.upload(weight, DType.BF16)
    suffix = "_norm_bf16" if norm else ""
    results = []
    for name in (f"quantize_e4m3_token{suffix}{_resident_suffix(inner)}", f"quantize_e4m3_token{suffix}"):
        quantized = poisoned(cuda_backend, (rows, inner), DType.FP8_E4M3)
        scales = poisoned(cuda_backend, (rows,), DType.F32)
        rt.launch("fp8_quantize", name, (rows,), _QUANT_THREADS, x_tensor.address,
                  weight_tensor.address if norm else 0, np.float32(EPS), quantized.address, scales.address,
                  np.int32(num_tokens), np.int32(inner))
        results.append((host(cuda_backend, quantized).view(np.uint8), host(cuda_backend, scales)))
    (resident, resident_scales), (passes, passes_scales) = results
    assert _resident_suffix(inner) != ""
    np.testing.assert_array_equal(resident, passes)
    np.testing.assert_array_equal(resident_scales, passes_scales)
    values = x.astype(np.float32)
    if norm:
        values = values / np.sqrt(np.mean(values**2, axis=1, keepdims=True) + EPS) * weight.astype(np.float32)
    np.testing.assert_allclose(resident_scales[:num_tokens], np.abs(values).max(axis=1) / 448, rtol=1e-3)
    assert not resident[num_tokens:].any() and not resident_scales[num_tokens:].any()


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
def test_every_decode_candidate_of_the_fp8_gemm_applies_the_scales(cuda_backend, rng, block):
    """At decode sizes the tuner races the heuristic's picks, their split-K copies and, for
    per-channel scales, the tile variants (weights smaller than the L2 as well, `hbm_tuning`), and
    keeps whichever is fastest: every candidate it races must compute the product with the scales
    applied, as the heuristic's pick does. (A tile variant of a block-scaled product did not on an
    H200, so those race none.)"""
    from atlas.adapters.cuda import cublaslt

    fp8 = cuda_backend.dense.fp8
    gemm = fp8._gemm
    if gemm._tuning is None:
        pytest.skip("cuBLASLt tuning is off (ATLAS_CUDA_DISABLE=gemm_tuning)")
    num_tokens, rows, inner = 40, 1024, 4096
    linear = fp8_linear(rng, rows, inner, block)
    matrix = cuda_backend.dense.prepare(HostProjection(linear)).weight
    x = bf16(rng.standard_normal((num_tokens, inner)))
    quantized, scales, padded = fp8._quantize(cuda_backend.upload(x, DType.BF16), matrix, None, 0.0)
    assert padded == num_tokens
    expected = round_e4m3(x.astype(np.float64), 128 if block else None) @ linear.values().astype(np.float64).T
    plan = gemm._build(padded, rows, inner, DType.FP8_E4M3, DType.BF16, False, False, scales.modes,
                       (scales.weight_address, scales.x_address))
    heuristic = gemm._heuristic(plan.descriptor, plan.layouts, cublaslt._HEURISTIC_CANDIDATES)
    if not block and gemm._evict_l2 is not None:
        assert len(plan.candidates) > len(heuristic)  # split-K copies and tile variants join the race
    # per-channel products accumulate without promotion (`fp8_fast_accum`), block-scaled ones never
    assert (",fast" in plan.tuning_key) == (not block and cuda_backend.dense.fp8._rt.features.fp8_fast_accum)
    for index in range(len(plan.candidates)):
        out = poisoned(cuda_backend, (padded, rows), DType.BF16)
        gemm._enqueue(plan, index, (quantized.address, matrix.data.address, out.address))
        assert rel_l2(host(cuda_backend, out), expected) < BF16_TOLERANCE, f"candidate {index}"


def test_an_fp8_projection_captured_in_a_graph_replays_the_eager_bits(cuda_backend, rng):
    """Decode GEMV and FP8 GEMM (with its quantizing kernel and cuBLASLt's scale pointers), in one
    graph: replays equal the eager calls bit for bit."""
    dense = cuda_backend.dense
    projection = dense.prepare(HostProjection(fp8_linear(rng, 2048, 1024, block=True),
                                              RmsNorm(bf16(1 + 0.3 * rng.standard_normal(1024)), EPS)))
    inputs = [cuda_backend.upload(bf16(rng.standard_normal((n, 1024))), DType.BF16) for n in (1, 16)]
    outs = [cuda_backend.empty((n, 2048), DType.BF16) for n in (1, 16)]

    def step() -> None:
        for x, out in zip(inputs, outs):
            dense.project(x, projection, out)

    step()
    eager = [host(cuda_backend, out) for out in outs]
    graph = cuda_backend.capture(step)
    for out in outs:
        cuda_backend.fill(out, float("nan"))
    graph.replay()
    for out, expected in zip(outs, eager):
        np.testing.assert_array_equal(host(cuda_backend, out), expected)


def test_fp8_weights_the_kernels_cannot_take_are_refused_by_name(cuda_backend, rng):
    from atlas.ports.gpu import UnsupportedError

    with pytest.raises(UnsupportedError, match="multiple of 16"):
        cuda_backend.dense.prepare(HostProjection(fp8_linear(rng, 64, 40, block=False)))
    odd_blocks = HostLinear(np.zeros((64, 64), E4M3), scales=np.ones((16, 8), np.float32), block_shape=(4, 8))
    with pytest.raises(UnsupportedError, match="128 x 128"):
        cuda_backend.dense.prepare(HostProjection(odd_blocks))

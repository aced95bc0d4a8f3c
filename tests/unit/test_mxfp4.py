"""MXFP4 dequantization against the OCP MX spec: E2M1 elements, two a byte (low nibble first),
times 2^(E8M0 scale - 127) per block of 32; what cannot be read is refused, named."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoints import mxfp4_values, quantize_mxfp4

from atlas.domain.models.mxfp4 import dequantize
from atlas.ports.weights import WeightError


def test_a_block_by_hand():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0xA7  # element 0: 0x7 = +6; element 1: 0xA = -1
    blocks[0, 0, 1] = 0x91  # element 2: 0x1 = +0.5; element 3: 0x9 = -0.5
    blocks[0, 0, 15] = 0x5C  # element 30: 0xC = -2; element 31: 0x5 = +3
    values = dequantize(blocks, np.array([[125]], np.uint8), "w")  # 2^-2
    assert values.dtype == ml_dtypes.bfloat16 and values.shape == (1, 32)
    expected = np.zeros(32, np.float32)
    expected[[0, 1, 2, 3, 30, 31]] = [1.5, -0.25, 0.125, -0.125, -0.5, 0.75]
    np.testing.assert_array_equal(values[0].astype(np.float32), expected)


def test_every_byte_and_scale_equals_the_spec_exactly(rng):
    """All 256 bytes under scales from 2^-127 to 2^125, over stacked experts: bf16 holds every
    value exactly, so the comparison is bitwise."""
    blocks = rng.integers(0, 256, size=(3, 5, 4, 16), dtype=np.uint8)
    blocks[0, 0, :, :] = np.arange(64, dtype=np.uint8).reshape(4, 16) * 4 + np.arange(4, dtype=np.uint8)[:, None]
    scales = rng.integers(0, 250, size=(3, 5, 4), dtype=np.uint8)
    scales[0, 0] = [0, 1, 127, 252]  # 2^125: the largest that holds 6 in bf16
    values = dequantize(blocks, scales, "w")
    assert values.shape == (3, 5, 128)
    np.testing.assert_array_equal(values.astype(np.float32), mxfp4_values(blocks, scales))


def test_quantized_weights_come_back_within_the_format_step(rng):
    weights = rng.standard_normal((2, 8, 64)).astype(np.float32) * 0.05
    blocks, scales = quantize_mxfp4(weights)
    values = dequantize(blocks, scales, "w").astype(np.float32)
    block_max = np.abs(weights.reshape(2, 8, 2, 32)).max(axis=-1, keepdims=True)
    # a block's scale 2^e is under max / 3, and E2M1's widest step (4 to 6) is 2 of it
    assert (np.abs(values - weights).reshape(2, 8, 2, 32) <= block_max / 3).all()
    assert np.abs(values - weights).max() > 0  # it was quantized


@pytest.mark.parametrize(
    "blocks, scales, match",
    [
        (np.zeros((2, 1, 16), np.uint8), np.full((2, 1), 0xFF, np.uint8), "0xFF.*NaN"),
        (np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8), r"do not pair up"),
        (np.zeros((2, 1, 8), np.uint8), np.zeros((2, 1), np.uint8), r"do not pair up"),
        (np.zeros((2, 1, 16), np.int8), np.zeros((2, 1), np.uint8), "must be uint8"),
        (np.full((2, 1, 16), 0x77, np.uint8), np.full((2, 1), 254, np.uint8), "overflows bf16"),
    ],
    ids=["nan-scale", "scales-shape", "block-width", "dtype", "overflow"],
)
def test_what_the_format_does_not_allow_is_refused_naming_the_tensor(blocks, scales, match):
    with pytest.raises(WeightError, match=f"experts.down_proj: .*{match}"):
        dequantize(blocks, scales, "experts.down_proj")

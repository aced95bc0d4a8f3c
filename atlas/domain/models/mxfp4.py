"""MXFP4 weights (OCP Microscaling Formats v1.0): dequantized on the host at load.

A row of K values is stored as K / 32 blocks. Each block is 16 bytes of FP4 E2M1 elements, two
per byte with the low nibble first, and one E8M0 scale byte s, standing for 2^(s - 127):

    blocks [..., K/32, 16] u8    byte j of block g: element 2j (bits 0-3), element 2j+1 (bits 4-7)
    scales [..., K/32]     u8    0xFF is NaN in the spec and is refused
    value[..., 32 g + i] = E2M1(element i of block g) * 2^(scales[..., g] - 127)

    E2M1 (sign, 2 exponent bits, 1 mantissa bit): 0 0.5 1 1.5 2 3 4 6, then the same negated

Every value has at most two significant bits, so bf16 holds it exactly (its exponent range is
float32's); dequantizing to bf16 loses nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from atlas.ports.weights import WeightError

BLOCK_SIZE = 32  # elements per scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# Both elements of every possible byte: [256, 2] (low nibble, high nibble).
_BYTE_VALUES = np.stack([E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=1)
_CHUNK_ELEMENTS = 1 << 22  # float32 values dequantized at once (16 MiB)


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """The bf16 values [..., K] of MXFP4 `blocks` [..., K/32, 16] and `scales` [..., K/32] (both
    uint8). Raises `WeightError` naming `name` for other dtypes, shapes that do not pair up, a NaN
    scale, or a value too large for bf16. Works in chunks of rows so the float32 intermediate stays small."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise WeightError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise WeightError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up "
            f"(blocks must be [..., K/{BLOCK_SIZE}, {BLOCK_SIZE // 2}] and scales [..., K/{BLOCK_SIZE}])"
        )
    if (scales == E8M0_NAN).any():
        raise WeightError(f"{name}: an MXFP4 scale is 0xFF, which the E8M0 format reserves for NaN")
    width = blocks.shape[-2] * BLOCK_SIZE
    flat_blocks = blocks.reshape(-1, blocks.shape[-2], BLOCK_SIZE // 2)
    flat_scales = scales.reshape(-1, scales.shape[-1])
    out = np.empty((flat_blocks.shape[0], width), ml_dtypes.bfloat16)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // width)
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        stop = start + rows_per_chunk
        elements = _BYTE_VALUES[flat_blocks[start:stop]].reshape(-1, blocks.shape[-2], BLOCK_SIZE)
        powers = np.ldexp(np.float32(1.0), flat_scales[start:stop].astype(np.int32) - E8M0_BIAS)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            values = elements * powers[..., None]
        if not np.isfinite(values).all():
            raise WeightError(f"{name}: an MXFP4 value overflows bf16 (a scale near 2^127 on a large element)")
        out[start:stop] = values.reshape(-1, width)
    return out.reshape(*blocks.shape[:-2], width)

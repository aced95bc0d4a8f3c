"""Block dequantisers for ggml's quantised types, vectorised in numpy.

Each decoder maps [num_blocks, block_bytes] uint8 to [num_blocks, block_elems] float32 and
mirrors ggml-quants.c `dequantize_row_*`, including its float32 operation order, so results
are bit-identical to ggml's. Block layouts are written next to each decoder, fields in
storage order (f16 = little-endian IEEE half).
"""

from __future__ import annotations

import numpy as np


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [num_blocks, 1]."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles are values 0..15, high nibbles values 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 `qh`: bit j of the little-endian u32 is the 5th bit of value j -> [n, 32] of 0/16."""
    qh = qh_bytes.copy().view("<u4")  # [n, 1]
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # f16 d | i8 qs[32]
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks, 0)


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # f16 d | u8 qs[16]
    return (_nibbles(blocks[:, 2:]).astype(np.float32) - 8) * _f16(blocks, 0)


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # f16 d | f16 m | u8 qs[16]
    return _nibbles(blocks[:, 4:]).astype(np.float32) * _f16(blocks, 0) + _f16(blocks, 2)


def _q5_0(blocks: np.ndarray) -> np.ndarray:  # f16 d | u8 qh[4] | u8 qs[16]
    values = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.float32) - 16
    return values * _f16(blocks, 0)


def _q5_1(blocks: np.ndarray) -> np.ndarray:  # f16 d | f16 m | u8 qh[4] | u8 qs[16]
    values = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return values * _f16(blocks, 0) + _f16(blocks, 2)


# K-quants: 256-value super-blocks. Q2_K and Q3_K pack 2-bit values four to a byte:
#
#   output index = half*128 + shift_idx*32 + sub*16 + l      (half<2, shift_idx<4, sub<2, l<16)
#   value        = (qs[half*32 + sub*16 + l] >> 2*shift_idx) & 3
#   scale index  = half*8 + shift_idx*2 + sub                (16 scales, one per 16 values)
_TWO_BIT_SHIFTS = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)


def _two_bit_values(qs: np.ndarray) -> np.ndarray:
    """[n, 64] packed bytes -> [n, 2, 4, 2, 16] (half, shift_idx, sub, l) values 0..3."""
    return (qs.reshape(-1, 2, 1, 2, 16) >> _TWO_BIT_SHIFTS) & 3


def _q2_k(blocks: np.ndarray) -> np.ndarray:  # u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
    scales = blocks[:, :16].reshape(-1, 2, 4, 2, 1)
    d, dmin = _f16(blocks, 80).reshape(-1, 1, 1, 1, 1), _f16(blocks, 82).reshape(-1, 1, 1, 1, 1)
    scale, offset = d * (scales & 0xF), dmin * (scales >> 4)
    return (scale * _two_bit_values(blocks[:, 16:80]) - offset).reshape(-1, 256)


def _q3_k(blocks: np.ndarray) -> np.ndarray:  # u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
    packed = blocks[:, 96:108]
    low, high = packed[:, 0:8], packed[:, 8:12]  # 16 six-bit scales: 4 low bits + 2 high bits each
    low_bits = np.concatenate([low & 0xF, low >> 4], axis=1)
    high_bits = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1)
    scales = ((low_bits | (high_bits << 4)).astype(np.int8) - 32).astype(np.float32)
    bit_idx = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)  # half*4 + shift_idx
    high_set = (blocks[:, :32].reshape(-1, 1, 1, 2, 16) >> bit_idx) & 1
    values = _two_bit_values(blocks[:, 32:96]).astype(np.float32) - 4 * (1 - high_set)
    scale = _f16(blocks, 108).reshape(-1, 1, 1, 1, 1) * scales.reshape(-1, 2, 4, 2, 1)
    return (scale * values).reshape(-1, 256)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K `get_scale_min_k4`: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    scales = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 0xF) | ((packed[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# Q4_K/Q5_K: output index = chunk*64 + nibble*32 + l (chunk<4, l<32), sub-block = chunk*2 + nibble,
# value = (qs[chunk*32 + l] >> 4*nibble) & 0xF, plus 16 when bit `sub-block` of qh[l] is set (Q5_K).
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    return ((qs.reshape(-1, 4, 1, 32) >> _NIBBLE_SHIFTS) & 0xF).reshape(-1, 8, 32)


def _k_affine(blocks: np.ndarray, values: np.ndarray) -> np.ndarray:
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return ((d * scales)[:, :, None] * values - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> np.ndarray:  # f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
    return _k_affine(blocks, _k_nibbles(blocks[:, 16:144]).astype(np.float32))


def _q5_k(blocks: np.ndarray) -> np.ndarray:  # f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
    sub_bits = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    fifth = ((blocks[:, 16:48].reshape(-1, 1, 32) >> sub_bits) & 1) << 4
    return _k_affine(blocks, (_k_nibbles(blocks[:, 48:176]) | fifth).astype(np.float32))


def _q6_k(blocks: np.ndarray) -> np.ndarray:  # u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
    # output index = half*128 + k*32 + l (k<4, l<32); k = 2*nibble + quarter:
    #   low 4 bits  = (ql[half*64 + quarter*32 + l] >> 4*nibble) & 0xF
    #   high 2 bits = (qh[half*32 + l] >> 2*k) & 3;  scale = scales[half*8 + 2*k + l//16]
    ql = blocks[:, :128].reshape(-1, 2, 1, 2, 32)
    low = ((ql >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1, 1)) & 0xF).reshape(-1, 2, 4, 32)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    values = (low | (high << 4)).astype(np.float32) - 32
    scales = np.repeat(blocks[:, 192:208].view(np.int8).reshape(-1, 2, 4, 2), 16, axis=3).astype(np.float32)
    return (_f16(blocks, 208).reshape(-1, 1, 1, 1) * scales * values).reshape(-1, 256)


# ggml type name -> (values per block, bytes per block, decoder)
BLOCK_DEQUANTIZERS = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q2_K": (256, 84, _q2_k),
    "Q3_K": (256, 110, _q3_k),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}

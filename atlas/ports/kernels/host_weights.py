"""Weights as a loader hands them to a kind's `prepare` member: host arrays plus what they mean.

A kind's `prepare` turns these into its backend's opaque prepared form once, at load. New weight
formats and shardings are new data here, never new members: a quantized checkpoint fills
`HostLinear.scales`; a tensor-parallel rank passes the slice of each matrix it holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RmsNorm:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (of a row, or of a head).

    `weight` [D] is a plain multiplier: a family whose checkpoint stores w for (1 + w) (Gemma,
    Qwen3-Next) passes 1 + w.
    """

    weight: np.ndarray
    eps: float


@dataclass(frozen=True, slots=True)
class HostLinear:
    """A projection: y = x @ weight.T + bias, or a stack of them (the experts of an MoE layer).

    weight [..., out, in]: float values (a backend stores them in its weight dtype, bf16 on both
        backends today), or, with `scales`, quantized values (FP8 E4M3, ml_dtypes'
        float8_e4m3fn) that stand for weight * scale: `values()` is their exact meaning.
    bias [..., out] or None.
    scales: None for float weights. float32 multipliers per output channel [..., out] (a
        per-tensor scale arrives as one per channel), or per block
        [..., ceil(out / block_shape[0]), ceil(in / block_shape[1])], the last row and column of
        blocks possibly partial. Leading dims stack an MoE layer's experts, each with its own.
    block_shape: (rows, columns) of a scale's block, (128, 128) in published checkpoints; None
        for per-channel scales.

    A tensor-parallel shard is the HostLinear of the rows (column-parallel) or the columns
    (row-parallel) its rank holds, with the bias on one rank only; nothing else changes.
    A backend that cannot hold a format raises `ValueError` naming it.
    """

    weight: np.ndarray
    bias: np.ndarray | None = None
    scales: np.ndarray | None = None
    block_shape: tuple[int, int] | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[-2])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[-1])

    def values(self) -> np.ndarray:
        """The float32 values this stands for: the weight, or weight * scales expanded over their
        channels or blocks. Raises `ValueError` when the scales fit neither form."""
        weight = np.asarray(self.weight).astype(np.float32)
        if self.scales is None:
            return weight
        scales = np.asarray(self.scales, np.float32)
        rows, columns = weight.shape[-2:]
        if self.block_shape is None:
            if scales.shape != weight.shape[:-1]:
                expected = list(weight.shape[:-1])
                raise ValueError(f"scales: per-channel scales must be {expected}, got {list(scales.shape)}")
            return weight * scales[..., None]
        block_rows, block_columns = self.block_shape
        expected = (*weight.shape[:-2], -(-rows // block_rows), -(-columns // block_columns))
        if scales.shape != expected:
            raise ValueError(f"scales: {self.block_shape} blocks need {list(expected)}, got {list(scales.shape)}")
        expanded = np.repeat(np.repeat(scales, block_rows, axis=-2), block_columns, axis=-1)
        return weight * expanded[..., :rows, :columns]


class Activation(enum.Enum):
    """A gated activation over the [gate | up] halves of a product: act(gate) * up."""

    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation


@dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """GPT-OSS's gated activation: g = min(gate, limit), u = clamp(up, -limit, limit),
    out = g * sigmoid(alpha * g) * (u + 1)."""

    alpha: float
    limit: float


GatedActivation = Activation | ClampedSwiglu

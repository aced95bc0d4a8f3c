"""Rotary position tables for every scaling the configs declare.

The device op `rope_and_cache` reads a table [max_positions, r]: cos of each position's angles
in the first r/2 columns, sin in the rest. All scaling lives here, so every backend supports
every scaling by construction. Inverse frequencies are computed in float32 as Hugging Face does
(their rounding is what the checkpoints were trained with); angles in float64.
"""

from __future__ import annotations

import math

import numpy as np

from atlas.domain.models.config import ModelConfig, Rope, RopeScaling


def rope_table(config: ModelConfig, max_positions: int, rope: Rope | None = None) -> np.ndarray:
    """[max_positions, rotary_dim] float32: cos | sin, scaled by the attention factor (yarn).
    `rope`: the RoPE of a layer type (`ModelConfig.layer_rope`); None: the config's main one."""
    rope = rope or Rope(config.rope_theta, config.rope_scaling)
    frequencies, attention_factor = inverse_frequencies(rope, config.rotary_dim, config.max_position_embeddings)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * frequencies.astype(np.float64)[None, :]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * attention_factor
    return table.astype(np.float32)


def inverse_frequencies(rope: Rope, rotary_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """([rotary_dim / 2] float32 inverse frequencies, the factor cos and sin are scaled by)."""
    theta, scaling = rope.theta, rope.scaling
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    base_frequencies = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling.kind == "default":
        return base_frequencies, 1.0
    if scaling.kind == "linear":
        return base_frequencies / np.float32(scaling.factor or 1.0), 1.0
    if scaling.kind == "llama3":
        return _llama3(base_frequencies, scaling, max_position_embeddings), 1.0
    if scaling.kind == "yarn":
        return _yarn(theta, rotary_dim, exponents, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling {scaling.kind!r}")


def _llama3(frequencies: np.ndarray, scaling: RopeScaling, max_position_embeddings: int) -> np.ndarray:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling.factor or 1.0
    original_context = scaling.original_max_position_embeddings or max_position_embeddings
    low_frequency_wavelength = original_context / scaling.low_freq_factor
    high_frequency_wavelength = original_context / scaling.high_freq_factor
    wavelengths = 2 * math.pi / frequencies
    scaled = np.where(wavelengths > low_frequency_wavelength, frequencies / factor, frequencies)
    smooth = (original_context / wavelengths - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelengths >= high_frequency_wavelength) & (wavelengths <= low_frequency_wavelength)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(
    theta: float, rotary_dim: int, exponents: np.ndarray, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention
    (cos and sin) by the attention factor, 0.1 ln(factor) + 1 unless the config gives it."""
    original_context = scaling.original_max_position_embeddings or max_position_embeddings
    # DeepSeek-style configs leave out the factor: the context they were stretched to says it.
    factor = scaling.factor if scaling.factor is not None else max_position_embeddings / original_context

    def mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_context / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:  # whole dimensions (GPT-OSS ramps between the exact ones instead)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    position_frequencies = np.float32(theta) ** exponents
    extrapolated = np.float32(1.0) / position_frequencies
    interpolated = np.float32(1.0) / (np.float32(factor) * position_frequencies)
    frequencies = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return frequencies.astype(np.float32), float(attention_factor)

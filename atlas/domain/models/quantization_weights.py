"""FP8 weights on the host: the exact math of the published layouts, quantizing a bf16 checkpoint
at load (`--quantization fp8`), fusing projections, and what a kind's `prepare` receives.

An FP8 weight is E4M3 bytes times float32 scales (quantization_config.py says which layouts and
which modules). `QuantizedWeight.dequantize()` is the reference every backend is held to: the
E4M3 value is exact in float32, so a weight value is one rounding (the product with its scale).
A kind receives the bytes and scales as a `HostLinear` (`host_linear`): per output channel
([..., out]; a per-tensor scale becomes one per channel, exactly) or per 128 x 128 block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from atlas.domain.models.quantization_config import (
    ActivationScheme,
    Fp8Checkpoint,
    Fp8Layout,
)
from atlas.ports.kernels.host_weights import HostLinear
from atlas.ports.weights import WeightError, WeightSource

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # largest finite E4M3 value; larger magnitudes would cast to NaN


def scale_shape(data_shape: tuple[int, ...], layout: Fp8Layout, block_size: tuple[int, int] | None) -> tuple[int, ...]:
    """The canonical scale shape of an FP8 weight of `data_shape` [..., out, in] (see `QuantizedWeight`)."""
    *lead, rows, columns = data_shape
    if layout is Fp8Layout.PER_TENSOR:
        return tuple(lead)
    if layout is Fp8Layout.PER_CHANNEL:
        return (*lead, rows)
    if block_size is None:
        raise ValueError("block_size: a BLOCK weight needs one")
    return (*lead, -(-rows // block_size[0]), -(-columns // block_size[1]))


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare with dequantize(), not ==
class QuantizedWeight:
    """An FP8 weight on the host, as a device port takes it; checked on construction (ValueError).

    `data` [..., out, in] E4M3; `scales` float32, multipliers: PER_TENSOR [...], PER_CHANNEL
    [..., out], BLOCK [..., ceil(out / rows), ceil(in / columns)] with `block_size` (rows, columns).
    Leading dims stack experts. `input_scale` is the static activation scale, or None.
    """

    data: np.ndarray
    scales: np.ndarray
    layout: Fp8Layout
    block_size: tuple[int, int] | None = None
    input_scale: float | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != E4M3 or self.data.ndim < 2:
            raise ValueError(f"data: expected float8_e4m3fn [..., out, in], got {self.data.dtype} {self.data.shape}")
        if self.scales.dtype != np.float32 or self.scales.shape != self.scale_shape:
            raise ValueError(
                f"scales: expected float32 {self.scale_shape}, got {self.scales.dtype} {self.scales.shape}"
            )
        if not (np.isfinite(self.scales).all() and (self.scales >= 0).all()):
            raise ValueError("scales: must be finite and >= 0")
        if self.input_scale is not None and not (np.isfinite(self.input_scale) and self.input_scale > 0):
            raise ValueError(f"input_scale: must be a positive number, got {self.input_scale}")

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return scale_shape(self.data.shape, self.layout, self.block_size)

    def dequantize(self) -> np.ndarray:
        """float32 data * scale: the E4M3 value is exact in float32, so one rounding (the product)."""
        values = self.data.astype(np.float32)
        if self.layout is Fp8Layout.PER_TENSOR:
            return values * self.scales[..., None, None]
        if self.layout is Fp8Layout.PER_CHANNEL:
            return values * self.scales[..., :, None]
        rows, columns = self.data.shape[-2:]
        expanded = np.repeat(np.repeat(self.scales, self.block_size[0], axis=-2), self.block_size[1], axis=-1)
        return values * expanded[..., :rows, :columns]


def read_fp8_weight(weights: WeightSource, module: str, checkpoint: Fp8Checkpoint) -> QuantizedWeight | None:
    """`<module>.weight` with its scales when stored as E4M3; None when stored unquantized (the
    caller reads it as usual). Raises KeyError when `<module>.weight` is absent, and WeightError
    naming the tensor when an FP8 weight has no scheme (the config leaves it unquantized), or its
    scale (or static input scale) is missing, mis-shaped or not finite."""
    name = f"{module}.weight"
    data = weights.get(name)
    if data.dtype != E4M3:
        return None
    scheme = checkpoint.scheme_for(module)
    if scheme is None:
        raise WeightError(
            f"tensor {name!r} is FP8, but quantization_config ({checkpoint.format.value}) leaves {module} unquantized"
        )
    scale_name = next((f"{module}.{s}" for s in scheme.scale_names if f"{module}.{s}" in weights), None)
    if scale_name is None:
        raise WeightError(f"tensor {module}.{scheme.scale_names[0]} is missing: {name} is FP8 {scheme.layout.value}")
    scales = weights.get(scale_name).astype(np.float32)
    # Per-tensor scales come as [] or [1], per-channel ones as [out, 1]: squeeze to the canonical shape.
    expected = scale_shape(data.shape, scheme.layout, scheme.block_size)
    if scales.size != int(np.prod(expected)) or (scheme.layout is Fp8Layout.BLOCK and scales.shape != expected):
        raise WeightError(f"tensor {scale_name!r} has shape {scales.shape}; {name} {data.shape} needs {expected}")
    input_scale = None
    if scheme.activations is ActivationScheme.STATIC_PER_TENSOR:
        input_name = f"{module}.input_scale"
        if input_name not in weights:
            raise WeightError(f"tensor {input_name!r} is missing: static activation scales need it")
        input_scale = float(weights.get(input_name).astype(np.float32).reshape(-1).max())
    try:
        return QuantizedWeight(data, scales.reshape(expected), scheme.layout, scheme.block_size, input_scale)
    except ValueError as error:
        raise WeightError(f"{module}: {error}") from None


def quantize_per_channel(weight: np.ndarray) -> QuantizedWeight:
    """`--quantization fp8`: E4M3 with one float32 scale per output channel (row), from any float
    weight [..., out, in] (bf16 is exact in float32).

    scale = max |row| / 448 (1 for an all-zero row); byte = E4M3(w / scale) rounded to nearest,
    ties to even, after clamping to +-448 (float32 rounding of the division may overshoot 448 by
    an ulp, and E4M3 has no infinity: it would become NaN). Error per element: at most
    max(|w| / 16, scale / 1024): half a step of E4M3's 3-bit mantissa, or of its subnormal
    spacing 2**-9. Raises ValueError for non-finite weights.
    """
    values = np.asarray(weight, dtype=np.float32)
    if values.ndim < 2 or not np.isfinite(values).all():
        raise ValueError(f"weight: expected finite [..., out, in], got shape {values.shape}")
    row_max = np.abs(values).max(axis=-1)
    scales = np.where(row_max > 0, row_max / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    scaled = np.clip(values / scales[..., None], -E4M3_MAX, E4M3_MAX)
    return QuantizedWeight(scaled.astype(E4M3), scales, Fp8Layout.PER_CHANNEL)


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Concatenate weights along the output dim (fusing q/k/v or gate/up into one projection).

    Per-tensor parts become per-channel (each row keeps its part's scale: exact). Block parts
    must share the block size and, all but the last, fill whole tiles of rows. Static input
    scales become their max, since the fused input is quantized once and must not saturate for
    any part. Raises ValueError for mixed block / non-block parts, a part that ends mid-tile,
    differing input dims, or mixed static / dynamic activations.
    """
    if not parts:
        raise ValueError("parts: nothing to stack")
    if len({part.data.shape[:-2] + part.data.shape[-1:] for part in parts}) != 1:
        raise ValueError("parts: every part needs the same leading and input dims")
    input_scales = [part.input_scale for part in parts]
    if len({scale is None for scale in input_scales}) != 1:
        raise ValueError("parts: mixes static and dynamic activation scales")
    input_scale = None if input_scales[0] is None else max(input_scales)  # type: ignore[type-var]
    data = np.concatenate([part.data for part in parts], axis=-2)
    blocks = {part.block_size for part in parts}
    if blocks == {None}:
        scales = np.concatenate([_per_channel_scales(part) for part in parts], axis=-1)
        return QuantizedWeight(data, scales, Fp8Layout.PER_CHANNEL, None, input_scale)
    if len(blocks) != 1 or None in blocks:
        raise ValueError("parts: mixes block sizes or block and non-block layouts")
    block_rows = parts[0].block_size[0]  # type: ignore[index]
    if any(part.data.shape[-2] % block_rows for part in parts[:-1]):
        raise ValueError(f"parts: all but the last must have a multiple of {block_rows} rows to stack whole tiles")
    scales = np.concatenate([part.scales for part in parts], axis=-2)
    return QuantizedWeight(data, scales, Fp8Layout.BLOCK, parts[0].block_size, input_scale)


def take_rows(weight: QuantizedWeight, rows: np.ndarray) -> QuantizedWeight:
    """The rows `rows` of `weight` in that order (a checkpoint's per-head interleaving regrouped).

    Per-channel scales go with their rows (per-tensor ones become per-channel, exactly). Block
    scales can only move with whole tiles: each run of 128 taken rows must be one stored tile, in
    order (the last run may be the last, partial, tile); ValueError otherwise.
    """
    rows = np.asarray(rows)
    if weight.layout is not Fp8Layout.BLOCK:
        scales = _per_channel_scales(weight)[..., rows]
        return QuantizedWeight(weight.data[..., rows, :], scales, Fp8Layout.PER_CHANNEL, None, weight.input_scale)
    size, stored_rows = weight.block_size[0], weight.data.shape[-2]  # type: ignore[index]
    tiles = []
    for start in range(0, len(rows), size):
        run, first = rows[start : start + size], int(rows[start])
        if first % size or len(run) != min(size, stored_rows - first) or (np.diff(run) != 1).any():
            raise ValueError(f"rows: taken rows {start}..{start + len(run) - 1} are not one whole {size}-row tile")
        tiles.append(first // size)
    scales = weight.scales[..., tiles, :]
    return QuantizedWeight(weight.data[..., rows, :], scales, Fp8Layout.BLOCK, weight.block_size, weight.input_scale)


def take_columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Columns [start, stop) of `weight` (a projection over a concatenated input, split). Row
    scales stay as they are; block scales need the split on whole 128-column tiles (ValueError)."""
    if weight.layout is not Fp8Layout.BLOCK:
        data = np.ascontiguousarray(weight.data[..., start:stop])
        return QuantizedWeight(data, weight.scales, weight.layout, None, weight.input_scale)
    size, columns = weight.block_size[1], weight.data.shape[-1]  # type: ignore[index]
    if start % size or (stop % size and stop != columns):
        raise ValueError(f"columns: [{start}, {stop}) does not fall on whole {size}-column tiles")
    scales = weight.scales[..., start // size : -(-stop // size)]
    data = np.ascontiguousarray(weight.data[..., start:stop])
    return QuantizedWeight(data, scales, Fp8Layout.BLOCK, weight.block_size, weight.input_scale)


def _per_channel_scales(part: QuantizedWeight) -> np.ndarray:
    if part.layout is Fp8Layout.PER_CHANNEL:
        return part.scales
    return np.broadcast_to(part.scales[..., None], part.data.shape[:-1]).astype(np.float32)


def host_linear(weight: QuantizedWeight, bias: np.ndarray | None = None) -> HostLinear:
    """The `HostLinear` a kind's `prepare` takes: E4M3 bytes with per-channel scales (per-tensor
    ones broadcast to every row, exactly) or 128 x 128 block scales."""
    if weight.layout is Fp8Layout.BLOCK:
        return HostLinear(weight.data, bias, weight.scales, weight.block_size)
    return HostLinear(weight.data, bias, _per_channel_scales(weight))


def stack_experts(linears: Sequence[HostLinear]) -> HostLinear:
    """Expert projections [out, in] as one [E, out, in] `HostLinear` (an MoE kind's gate_up or
    down): the weights, biases and scales stacked along a new leading dim. Raises ValueError for
    experts of different shapes or formats (float and FP8, or different block shapes)."""
    if not linears:
        raise ValueError("linears: no experts to stack")
    first = linears[0]
    for linear in linears[1:]:
        if (np.shape(linear.weight) != np.shape(first.weight) or np.asarray(linear.weight).dtype != np.asarray(
                first.weight).dtype or (linear.scales is None) != (first.scales is None)
                or linear.block_shape != first.block_shape or (linear.bias is None) != (first.bias is None)):
            raise ValueError("linears: experts differ in shape or format")
    return HostLinear(
        np.stack([np.asarray(linear.weight) for linear in linears]),
        None if first.bias is None else np.stack([np.asarray(linear.bias) for linear in linears]),
        None if first.scales is None else np.stack([np.asarray(linear.scales, np.float32) for linear in linears]),
        first.block_shape,
    )


# -- --quantization fp8: a bf16 checkpoint seen as a per-channel FP8 one -----------------------------

_EXPERT_PROJECTIONS = ("w1", "w2", "w3")


def quantized_at_load(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `--quantization fp8` quantizes tensor `name`: the [out, in] weight of a layer's
    projection (`model.layers.N.<...>_proj`, or an expert's w1 / w2 / w3). The embedding, the LM
    head, norms, routers and gates, convolutions and expert tensors stacked as one [E, a, b]
    (some store them transposed) stay as stored: they are a small part of the bytes, and the
    head and the router are where the logits and the routing are most sensitive to rounding."""
    if not name.startswith("model.layers.") or not name.endswith(".weight") or len(shape) != 2:
        return False
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf.endswith("proj") or leaf in _EXPERT_PROJECTIONS


class QuantizedOnLoad:
    """A `WeightSource` over a float checkpoint that stores every `quantized_at_load` weight as
    E4M3 with per-channel scales (`quantize_per_channel`) and adds its `<module>.weight_scale`
    [out, 1]: llm-compressor's layout, which quantization_config.PER_CHANNEL_AT_LOAD describes.
    Quantized on first read, once: a module's scale is kept until it is read (loaders read a
    weight and then its scale)."""

    def __init__(self, weights: WeightSource) -> None:
        self._weights = weights
        self._quantized = {
            name.removesuffix(".weight"): tuple(weights.shape(name))
            for name in weights.names()
            if quantized_at_load(name, tuple(weights.shape(name)))
        }
        self._pending: dict[str, QuantizedWeight] = {}

    def names(self) -> Iterable[str]:
        yield from self._weights.names()
        for module in self._quantized:
            yield f"{module}.weight_scale"

    def __contains__(self, name: str) -> bool:
        scale_of = name.removesuffix(".weight_scale")
        return name in self._weights or (scale_of != name and scale_of in self._quantized)

    def shape(self, name: str) -> tuple[int, ...]:
        module = name.removesuffix(".weight_scale")
        if name.endswith(".weight_scale") and module in self._quantized:
            return (self._quantized[module][0], 1)
        return tuple(self._weights.shape(name))

    def get(self, name: str) -> np.ndarray:
        module = name.removesuffix(".weight").removesuffix(".weight_scale")
        if module not in self._quantized or name not in (f"{module}.weight", f"{module}.weight_scale"):
            return self._weights.get(name)
        weight = self._pending.get(module)
        if weight is None:
            weight = quantize_per_channel(self._weights.get(f"{module}.weight"))
            self._pending[module] = weight
        if name.endswith(".weight_scale"):
            del self._pending[module]
            return weight.scales[:, None]
        return weight.data


def checkpoint_bytes(weights: WeightSource, quantize: bool = False,
                     include: Callable[[str], bool] | None = None) -> int:
    """Bytes the checkpoint's tensors take on a device: two per element of a float tensor (the
    device holds bf16 whatever the file stores), one per E4M3 element, or (`quantize`) as
    `QuantizedOnLoad` will store them: one byte per quantized weight element and four per row
    for its scale. A multi-token-prediction head (`mtp.*`) is loaded only when speculative
    decoding asks for it, so it is not counted. What the device holds, give or take a backend's
    padding; the builder checks it against free memory before loading. `include`: only the
    tensors whose names it accepts."""
    total = 0
    for name in weights.names():
        if name.startswith("mtp.") or (include is not None and not include(name)):
            continue
        shape = tuple(weights.shape(name))
        elements = int(np.prod(shape))
        if quantize and quantized_at_load(name, shape):
            total += elements + 4 * shape[0]
        else:
            total += elements * min(weights.get(name).dtype.itemsize, 2)
    return total

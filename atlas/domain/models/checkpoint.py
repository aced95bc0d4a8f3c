"""Reading a checkpoint's tensors by Hugging Face name, shape-checked, for the family loaders.

Over `DeferredWeights` (a tensor-parallel rank's load) every tensor stays deferred, stacks
included, until the sharding pass reads the rank's part (`shard_reads.py`)."""

from __future__ import annotations

import numpy as np

from atlas.domain.models.quantization_config import Fp8Checkpoint
from atlas.domain.models.quantization_weights import (
    E4M3,
    QuantizedWeight,
    host_linear,
    read_fp8_weight,
    stack_rows,
    take_rows,
)
from atlas.domain.models.shard_reads import concatenate_rows, stack_leading
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm
from atlas.ports.weights import WeightError, WeightSource


class CheckpointReader:
    """Host arrays by name; a missing tensor or a shape config.json does not imply is a
    `WeightError` naming the tensor.

    `quantization`: the checkpoint's FP8 description (`read_quantization(config.raw)`), or None.
    Projections (`linear`, `stacked_linear`) come back as stored: float weights, or E4M3 bytes
    with their scales where the checkpoint holds them so (`HostLinear.scales`).
    """

    def __init__(self, weights: WeightSource, quantization: Fp8Checkpoint | None = None) -> None:
        self.weights = weights
        self.quantization = quantization

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float tensor; an FP8 one is refused (only projections may be FP8: see `linear`)."""
        if name not in self.weights:
            raise WeightError(
                f"the checkpoint has no tensor {name!r}: the model folder is incomplete or does not match config.json"
            )
        array = self.weights.get(name)
        if tuple(array.shape) != shape:
            raise WeightError(f"tensor {name!r} has shape {tuple(array.shape)}, config.json implies {shape}")
        if array.dtype == E4M3:
            raise WeightError(f"tensor {name!r} is FP8, which Atlas reads only for the weights of Linear layers")
        return array

    def stacked(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
        """The tensors concatenated along their first dimension (fused projections), as a
        `RowStack` of the checkpoint's own views: nothing is copied on the host until a reader
        asks (`np.asarray` concatenates; a backend uploading `row_blocks` copies each part
        straight to its rows). One tensor comes back as it is."""
        return concatenate_rows([self.array(name, shape) for name, shape in names_and_shapes], lazy=True)

    def experts(self, names_and_shapes: list[list[tuple[str, tuple[int, ...]]]]) -> np.ndarray:
        """One [E, ...] stack of an MoE layer's experts, expert e the concatenation of group e's
        tensors along their first dimension (gate_proj and up_proj into its gate_up rows).
        Deferred tensors give a deferred stack, so an expert-parallel rank reads its experts only."""
        groups = [[self.array(name, shape) for name, shape in group] for group in names_and_shapes]
        return stack_leading([concatenate_rows(group) for group in groups])

    def norm(self, name: str, width: int, eps: float) -> RmsNorm:
        return RmsNorm(self.array(name, (width,)), eps)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> HostLinear:
        """`<prefix>.weight` [out, in] (float, or E4M3 with its scales) and, with `bias`,
        `<prefix>.bias` [out]."""
        return self.stacked_linear([(prefix, out_features)], in_features, bias)

    def stacked_linear(self, parts: list[tuple[str, int]], in_features: int, bias: bool = False) -> HostLinear:
        """Projections `(prefix, out_features)` fused along their rows (q | k | v, gate | up): the
        float weights concatenated, or FP8 ones with their scales (`stack_rows`: per-tensor
        scales become per-channel, block ones must end on whole 128-row tiles but the last).
        Raises WeightError for parts that mix FP8 and float weights, or FP8 blocks that cannot
        be fused."""
        quantized = [self._fp8(prefix, rows, in_features) for prefix, rows in parts]
        biases = None
        if bias:
            biases = np.concatenate([self.array(f"{prefix}.bias", (rows,)) for prefix, rows in parts])
        if all(weight is None for weight in quantized):
            weights = [(f"{prefix}.weight", (rows, in_features)) for prefix, rows in parts]
            return HostLinear(self.stacked(weights), biases)
        if any(weight is None for weight in quantized):
            names = ", ".join(prefix for prefix, _ in parts)
            raise WeightError(f"{names}: fused projections mix FP8 and unquantized weights")
        try:
            fused = stack_rows(quantized)  # type: ignore[arg-type]
        except ValueError as error:
            raise WeightError(f"{', '.join(prefix for prefix, _ in parts)}: {error}") from None
        return host_linear(fused, biases)

    def regrouped_linear(self, parts: list[tuple[str, int, np.ndarray | None]], in_features: int) -> HostLinear:
        """Projections `(prefix, out_features, rows)` fused along their rows, each part's rows
        taken in the order `rows` (None: as stored): a fused checkpoint tensor's per-head
        interleaving regrouped (Qwen3-Next's in_proj_qkvz, its q | gate rows).

        FP8 where every part is FP8 and the regrouping and the fusion move whole 128-row tiles
        (`take_rows`, `stack_rows`; always so for per-channel and per-tensor scales). Otherwise
        the projection is float, its FP8 parts dequantized (float32; a backend then holds them
        in its weight dtype, bf16, one more rounding): the case of a tile that straddles two
        heads, or of FP8 rows fused with float ones (Qwen3-Next-FP8 leaves in_proj_ba in bf16).
        Raises WeightError naming a missing or misshapen tensor."""
        stored = [self.stored(prefix, out_features, in_features) for prefix, out_features, _ in parts]
        orders = [rows for _, _, rows in parts]
        quantized = [weight for weight in stored if isinstance(weight, QuantizedWeight)]
        if not quantized:
            return HostLinear(concatenate_rows([weight if rows is None else np.asarray(weight)[rows]
                                                for weight, rows in zip(stored, orders, strict=True)], lazy=True))
        if len(quantized) == len(stored):
            try:
                return host_linear(stack_rows([weight if rows is None else take_rows(weight, rows)
                                               for weight, rows in zip(quantized, orders, strict=True)]))
            except ValueError:
                pass  # a tile the regrouping or the fusion would cut: dequantize below
        values = [weight.dequantize() if isinstance(weight, QuantizedWeight) else np.asarray(weight, np.float32)
                  for weight in stored]
        return HostLinear(np.concatenate([value if rows is None else value[rows]
                                          for value, rows in zip(values, orders, strict=True)]))

    def stored(self, prefix: str, out_features: int, in_features: int) -> np.ndarray | QuantizedWeight:
        """`<prefix>.weight` [out, in] as stored: a float array, or E4M3 with its scales."""
        quantized = self._fp8(prefix, out_features, in_features)
        return quantized if quantized is not None else self.array(f"{prefix}.weight", (out_features, in_features))

    def _fp8(self, prefix: str, out_features: int, in_features: int):
        name = f"{prefix}.weight"
        if name not in self.weights:
            self.array(name, (out_features, in_features))  # raises, naming it
        if self.weights.get(name).dtype != E4M3:
            return None
        if self.quantization is None:
            raise WeightError(f"tensor {name!r} is FP8, but config.json has no quantization_config describing it")
        weight = read_fp8_weight(self.weights, prefix, self.quantization)
        expected = (out_features, in_features)
        if weight is not None and tuple(weight.data.shape) != expected:
            raise WeightError(f"tensor {name!r} has shape {tuple(weight.data.shape)}, config.json implies {expected}")
        return weight

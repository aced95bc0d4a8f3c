"""Reading a checkpoint's tensors by Hugging Face name, shape-checked, for the family loaders.

Over `DeferredWeights` (a tensor-parallel rank's load) every tensor stays deferred, stacks
included, until the sharding pass reads the rank's part (`shard_reads.py`)."""

from __future__ import annotations

import numpy as np

from atlas.domain.models.shard_reads import concatenate_rows, stack_leading
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm
from atlas.ports.weights import WeightError, WeightSource


class CheckpointReader:
    """Host arrays by name; a missing tensor or a shape config.json does not imply is a
    `WeightError` naming the tensor."""

    def __init__(self, weights: WeightSource) -> None:
        self.weights = weights

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weights:
            raise WeightError(
                f"the checkpoint has no tensor {name!r}: the model folder is incomplete or does not match config.json"
            )
        array = self.weights.get(name)
        if tuple(array.shape) != shape:
            raise WeightError(f"tensor {name!r} has shape {tuple(array.shape)}, config.json implies {shape}")
        return array

    def stacked(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
        """The tensors concatenated along their first dimension (fused projections); deferred
        tensors give a deferred `RowStack`."""
        return concatenate_rows([self.array(name, shape) for name, shape in names_and_shapes])

    def experts(self, names_and_shapes: list[list[tuple[str, tuple[int, ...]]]]) -> np.ndarray:
        """One [E, ...] stack of an MoE layer's experts, expert e the concatenation of group e's
        tensors along their first dimension (gate_proj and up_proj into its gate_up rows).
        Deferred tensors give a deferred stack, so an expert-parallel rank reads its experts only."""
        return stack_leading([self.stacked(group) for group in names_and_shapes])

    def norm(self, name: str, width: int, eps: float) -> RmsNorm:
        return RmsNorm(self.array(name, (width,)), eps)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> HostLinear:
        """`<prefix>.weight` [out, in] and, with `bias`, `<prefix>.bias` [out]."""
        weight = self.array(f"{prefix}.weight", (out_features, in_features))
        return HostLinear(weight, self.array(f"{prefix}.bias", (out_features,)) if bias else None)

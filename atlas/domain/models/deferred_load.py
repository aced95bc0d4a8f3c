"""Loading a model's description without preparing it: the first half of a rank's load.

A family loader builds its layers by calling each kind's `prepare` on the backend it is given.
A tensor-parallel rank gives it a `DescribingBackend` instead: every `prepare` returns the host
weights it was handed (with the layer spec, where the kind takes one), so the loader's `Model`
holds descriptions in place of prepared weights, and nothing is read or uploaded. The sharding
pass (`parallel_model.shard_model`) then cuts each layer's weights as its kind declares and
prepares the rank's part on the real backend. Loaders need no change to run on several ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from atlas.ports.gpu import Capabilities, DType, GpuBackend, Tensor
from atlas.ports.kernels.attention import AttentionLayer, HostAttention
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.moe import HostMoe
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet


@dataclass(frozen=True, slots=True)
class DescribedAttention:
    """What `attention.prepare` was given."""

    host: HostAttention
    layer: AttentionLayer


@dataclass(frozen=True, slots=True)
class DescribedDeltaNet:
    """What `recurrent.prepare` was given."""

    host: HostDeltaNet
    layer: DeltaNetLayer


class _DescribingDense:
    def prepare(self, host: HostProjection) -> HostProjection:
        return host

    def prepare_vocab(self, host: HostVocab) -> HostVocab:
        return host


class _DescribingAttention:
    def prepare(self, host: HostAttention, layer: AttentionLayer) -> DescribedAttention:
        return DescribedAttention(host, layer)


class _DescribingMoe:
    def prepare(self, host: HostMoe) -> HostMoe:
        return host


class _DescribingRecurrent:
    def prepare(self, host: HostDeltaNet, layer: DeltaNetLayer) -> DescribedDeltaNet:
        return DescribedDeltaNet(host, layer)


class DescribingBackend:
    """The backend a loader sees during a rank's first half of loading: the real one's identity
    and memory (RoPE tables are uploaded as usual), and kinds whose `prepare` only describe.
    Nothing else of a kind may be called (the model is not run before the sharding pass)."""

    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend
        self.dense = _DescribingDense()
        self.attention = _DescribingAttention()
        self.moe = _DescribingMoe()
        self.recurrent = _DescribingRecurrent()

    @property
    def name(self) -> str:
        return self._backend.name

    @property
    def capabilities(self) -> Capabilities:
        return self._backend.capabilities

    def empty(self, shape: Sequence[int], dtype: DType) -> Tensor:
        return self._backend.empty(shape, dtype)

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> Tensor:
        return self._backend.upload(array, dtype)

"""The mock's dense kind, and the numpy helpers the other mock kinds share (norms, gated
activations, rounding to the activation dtype).

Prepared weights keep the reference's order of operations: the norm weight multiplies the
normalised x, never folded into the matrix, so the mock rounds as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from atlas.adapters.mock.tensor import MockTensor
from atlas.ports.gpu import NUMPY_DTYPES, DType
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, GatedActivation, HostLinear, RmsNorm

if TYPE_CHECKING:
    from atlas.adapters.mock.backend import MockGpuBackend


@dataclass(frozen=True, slots=True)
class MockNorm:
    weight: np.ndarray  # [D] f32
    eps: float


@dataclass(frozen=True, slots=True)
class MockLinear:
    weight: MockTensor  # [..., out, in], bf16 storage
    bias: MockTensor | None  # [..., out]

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x @ weight.T (+ bias) in float32.  x [N, in]."""
        result = x @ self.weight.weight_f32().T
        if self.bias is not None:
            result += self.bias.weight_f32()
        return result


@dataclass(frozen=True, slots=True)
class MockProjection:
    linear: MockLinear
    input_norm: MockNorm | None
    activation: GatedActivation | None
    output_norm: MockNorm | None


@dataclass(frozen=True, slots=True)
class MockVocab:
    embedding: MockTensor  # [V, H]
    embedding_scale: float
    final_norm: MockNorm
    lm_head: MockLinear  # the embedding itself when tied
    logit_softcap: float | None


def rmsnorm(x: np.ndarray, weight: np.ndarray | float, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def apply_norm(x: np.ndarray, norm: MockNorm | None) -> np.ndarray:
    return x if norm is None else rmsnorm(x, norm.weight, norm.eps)


def gated_activation(x: np.ndarray, activation: GatedActivation) -> np.ndarray:
    """act(gate) * up over the [gate | up] halves of the last axis, float32."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    if isinstance(activation, ClampedSwiglu):
        gate = np.minimum(gate, activation.limit)
        up = np.clip(up, -activation.limit, activation.limit)
        return gate * _sigmoid(activation.alpha * gate) * (up + 1.0)
    if activation is Activation.SILU:
        return _silu_mul(gate, up)
    inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
    return 0.5 * gate * (1.0 + np.tanh(inner)) * up


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    return x if cap is None else np.tanh(x / np.float32(cap)) * np.float32(cap)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate * _sigmoid(gate) * up, the same float32 operations in the same order, in one new
    array instead of six (a prompt's MLP rows are the mock's largest elementwise work)."""
    out = np.negative(gate)
    np.exp(out, out=out)
    out += np.float32(1.0)
    np.reciprocal(out, out=out)
    out *= gate
    out *= up
    return out


class MockDense:
    """`DenseKernels` in numpy."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self._backend = backend

    def rounded(self, values: np.ndarray) -> np.ndarray:
        """`values` as the activation dtype holds them (where a GPU stores an intermediate)."""
        dtype = self._backend.capabilities.activation_dtype
        if dtype is DType.F32:
            return values
        return values.astype(NUMPY_DTYPES[dtype]).astype(np.float32)

    def norm(self, norm: RmsNorm | None) -> MockNorm | None:
        if norm is None:
            return None
        return MockNorm(np.asarray(norm.weight, np.float32).copy(), float(norm.eps))

    def linear(self, host: HostLinear) -> MockLinear:
        """Weights in bf16 storage, computed in float32; quantized ones dequantized, kept in
        float32 (their values times a scale need not be bf16 values)."""
        backend = self._backend
        weight = backend.upload(host.values(), DType.BF16 if host.scales is None else DType.F32)
        bias = backend.upload(np.asarray(host.bias, np.float32), DType.BF16) if host.bias is not None else None
        return MockLinear(weight, bias)

    # -- the kind ---------------------------------------------------------------------------
    def prepare(self, host: HostProjection) -> MockProjection:
        self._backend.enter("dense.prepare")
        if host.activation is not None and host.linear.out_features % 2:
            raise ValueError(f"linear: {host.linear.out_features} rows are not [gate; up] halves")
        return MockProjection(self.linear(host.linear), self.norm(host.input_norm), host.activation,
                              self.norm(host.output_norm))

    def prepare_vocab(self, host: HostVocab) -> MockVocab:
        self._backend.enter("dense.prepare_vocab")
        embedding = self._backend.upload(np.asarray(host.embedding), DType.BF16)
        lm_head = MockLinear(embedding, None) if host.lm_head is None else self.linear(host.lm_head)
        if lm_head.weight.shape[-1] != embedding.shape[1]:
            raise ValueError(f"lm_head: width {lm_head.weight.shape[-1]} is not the hidden size {embedding.shape[1]}")
        return MockVocab(embedding, float(host.embedding_scale), self.norm(host.final_norm), lm_head,
                         host.logit_softcap)

    def embed(self, token_ids: MockTensor, vocab: MockVocab, out: MockTensor) -> None:
        self._backend.enter("dense.embed")
        ids = token_ids.data
        table = vocab.embedding
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise ValueError(f"token_ids: a token id outside [0, {table.shape[0]})")
        rows = table.data[ids]
        out.data[...] = rows if vocab.embedding_scale == 1.0 else rows.astype(np.float32) * np.float32(
            vocab.embedding_scale
        )

    def project(self, x: MockTensor, projection: MockProjection, out: MockTensor) -> None:
        self._backend.enter("dense.project")
        out.data[...] = self._apply(x, projection, out.shape)

    def project_add(self, x: MockTensor, projection: MockProjection, residual: MockTensor) -> None:
        self._backend.enter("dense.project_add")
        if projection.activation is not None:
            raise ValueError("projection: a gated activation has no residual form (use project)")
        delta = self.rounded(self._apply(x, projection, residual.shape))
        residual.data[...] = residual.as_f32() + delta

    def logits(self, hidden: MockTensor, vocab: MockVocab, out: MockTensor) -> None:
        self._backend.enter("dense.logits")
        normed = self.rounded(apply_norm(hidden.as_f32(), vocab.final_norm))
        result = softcap(vocab.lm_head.apply(normed), vocab.logit_softcap)
        if out.shape != result.shape:
            raise ValueError(f"out: shape {list(out.shape)} is not {list(result.shape)}")
        out.data[...] = result

    def _apply(self, x: MockTensor, projection: MockProjection, out_shape: tuple[int, ...]) -> np.ndarray:
        weight = projection.linear.weight
        if len(x.shape) != 2 or x.shape[1] != weight.shape[-1]:
            raise ValueError(f"x: shape {list(x.shape)} does not take a weight of {list(weight.shape)}")
        values = self.rounded(apply_norm(x.as_f32(), projection.input_norm))
        values = projection.linear.apply(values)
        if projection.activation is not None:
            values = gated_activation(self.rounded(values), projection.activation)
        values = apply_norm(values, projection.output_norm)
        if tuple(out_shape) != values.shape:
            raise ValueError(f"out: shape {list(out_shape)} is not {list(values.shape)}")
        return values

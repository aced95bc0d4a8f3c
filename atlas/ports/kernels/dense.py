"""The dense kind: the embedding, projections with the norms and activations around them, and
the logits.

A projection site is described whole (`HostProjection`): the RMSNorm before it, the product, a
gated activation of the product, the RMSNorm after it. The backend prepares it once and runs it
as one member, fusing what it can (CUDA normalises x inside its decode GEMVs or folds the norm
weight into the matrix, applies the activation in the GEMV's epilogue, adds into the residual
inside the product). The pre-norm residual stream of a decoder layer is then:

    hidden = project(residual, gate_up)          # rmsnorm + [gate; up] product + act(gate) * up
    project_add(hidden, down, residual)          # residual += down product (+ post-norm)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from atlas.ports.gpu import Tensor
from atlas.ports.kernels.host_weights import GatedActivation, HostLinear, RmsNorm


@dataclass(frozen=True, slots=True)
class HostProjection:
    """One projection of a layer with what surrounds it:

        out = output_norm(act(input_norm(x) @ W.T + b))

    input_norm: the RMSNorm of x first (a pre-norm layer's norm of the residual stream).
    activation: W is [gate; up] ([2I, K]); out = act(gate rows' product) * (up rows' product),
        [N, I]. Only for `project`.
    output_norm: the RMSNorm of the product (Gemma's post-attention and post-feed-forward norms).
    """

    linear: HostLinear
    input_norm: RmsNorm | None = None
    activation: GatedActivation | None = None
    output_norm: RmsNorm | None = None

    @property
    def out_features(self) -> int:
        """Width of `project`'s output (half the rows for a gated activation)."""
        rows = self.linear.out_features
        return rows // 2 if self.activation is not None else rows


@dataclass(frozen=True, slots=True)
class HostVocab:
    """The vocabulary's two ends: the token embedding and the head that gives the logits.

    embedding [V, H]; embedding_scale multiplies the looked-up rows (Gemma: sqrt(H)).
    final_norm: the RMSNorm before the head. lm_head [V, H], or None where the head is the
    embedding itself (tied). logit_softcap: logits = c * tanh(logits / c) (Gemma 2).
    """

    embedding: np.ndarray
    final_norm: RmsNorm
    lm_head: HostLinear | None
    embedding_scale: float = 1.0
    logit_softcap: float | None = None


class Projection(Protocol):
    """A backend's prepared `HostProjection` (opaque)."""


class Vocab(Protocol):
    """A backend's prepared `HostVocab` (opaque)."""


class DenseKernels(Protocol):
    def prepare(self, host: HostProjection) -> Projection:
        """The backend's form of a projection site, made once at load (the host arrays may be
        dropped after). Raises `UnsupportedError` naming a field this backend cannot run (an
        activation, a weight format, an output norm), `ValueError` for shapes that do not fit,
        and `MemoryError` like `Device.empty`."""
        ...

    def prepare_vocab(self, host: HostVocab) -> Vocab:
        """The backend's form of the embedding and the head (a tied head shares the table)."""
        ...

    def embed(self, token_ids: Tensor, vocab: Vocab, out: Tensor) -> None:
        """out[i] = embedding[token_ids[i]] * embedding_scale.  token_ids [N] i32, out [N, H].
        A token id outside [0, V) raises `ValueError` where the backend can see it (the mock) and
        gives an unspecified row otherwise."""
        ...

    def project(self, x: Tensor, projection: Projection, out: Tensor) -> None:
        """out = the projection of x (see `HostProjection`).  x [N, K], out [N, out_features].
        x is only read."""
        ...

    def project_add(self, x: Tensor, projection: Projection, residual: Tensor) -> None:
        """residual += the projection of x: a layer's output projection into the residual stream.
        x [N, K], residual [N, M] of the activation dtype. A gated activation raises
        `ValueError`."""
        ...

    def logits(self, hidden: Tensor, vocab: Vocab, out: Tensor) -> None:
        """out = softcap(rmsnorm(hidden, final_norm) @ lm_head.T).  hidden [R, H] (only read),
        out [R, V] f32."""
        ...


"""A model is a list of layers, each a mixer times a feed-forward, over the residual stream.

    residual += mixer(residual)          # attention (full, sliding, sinks, gated), Gated DeltaNet
    residual += feed_forward(residual)   # dense GLU, MoE

(each normalises its own input: the norm is data of its first member). Mixers live in
`mixers.py`, feed-forwards in `feed_forward.py`; MLA and Mamba-2 are further mixers of the same
protocol. A layer kind names the kernel kinds it calls, its cache group, and the scratch it
needs, and issues its members in `forward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from atlas.ports.gpu import GpuBackend, Kind, Tensor, leading_block
from atlas.ports.kernels.attention import AttentionMetadata, KvCache
from atlas.ports.kernels.recurrent import RecurrentMetadata, RecurrentState

# What a step tells each cache group's layers: where the tokens' K/V go and what they attend to
# (a KV group), or which state slot each sequence carries (a recurrent group).
GroupMetadata = AttentionMetadata | RecurrentMetadata


@dataclass(frozen=True, slots=True)
class WorkspaceNeeds:
    """What a layer kind reads and writes besides the residual stream, per token.

    scratch: widths of the activation buffers it uses, in order (mixer and feed-forward run one
        after the other, so they share buffers; each buffer is as wide as its widest user).
    top_k: an MoE feed-forward's routed experts per token (its id and weight buffers).
    intermediate: the widest intermediate a backend may keep for this kind's members where it
        does not fuse it away (a norm's output and a product before its epilogue), for the
        startup memory check.
    """

    scratch: tuple[int, ...]
    intermediate: int
    top_k: int = 0


@dataclass(frozen=True, slots=True)
class Workspace:
    """Activation buffers for up to `max_tokens` tokens and `max_sample_rows` sampled rows."""

    max_tokens: int
    max_sample_rows: int
    residual: Tensor  # [T, H]
    scratch: tuple[Tensor, ...]  # [T, width of buffer i]
    expert_ids: Tensor | None  # [T, k] i32 (MoE models)
    expert_weights: Tensor | None  # [T, k] f32
    sample_hidden: Tensor  # [R, H]: the residual rows whose next token is sampled
    logits: Tensor  # [R, V] f32


@dataclass(frozen=True, slots=True)
class LayerStep:
    """What a layer reads in one step: the backend, the step's metadata and the cache of every
    cache group (both in `Model.cache_groups` order) and the workspace.

    `cut` is set while the layers are captured in pieces (`Model.capture_layers`): `eager`
    then hands its call to it, to run between the pieces of each replay with the replayed
    step's `LayerStep`."""

    backend: GpuBackend
    num_tokens: int
    metadata: Sequence[GroupMetadata]
    caches: Sequence[object]
    workspace: Workspace
    cut: Callable[[Callable[[LayerStep], None]], None] | None = None

    def eager(self, call: Callable[[LayerStep], None]) -> None:
        """Run `call(self)` now; while captured in pieces, at each replay instead, between the
        pieces, with the replayed step. For work a captured graph cannot hold: kernels sized by
        the step's host-side metadata (prefill attention), with their inputs and outputs in
        buffers captured around them."""
        if self.cut is None:
            call(self)
        else:
            self.cut(call)

    def attention(self, group: int) -> tuple[AttentionMetadata, KvCache]:
        """KV group `group`'s metadata and cache; ValueError if it is a recurrent group."""
        meta = self.metadata[group]
        if not isinstance(meta, AttentionMetadata):
            raise ValueError(f"cache group {group} is a recurrent-state group, not a KV group an attention layer reads")
        return meta, self.caches[group]  # type: ignore[return-value]

    def recurrent(self, group: int) -> tuple[RecurrentMetadata, RecurrentState]:
        """Recurrent group `group`'s metadata and state slots; ValueError if it is a KV group."""
        meta = self.metadata[group]
        if not isinstance(meta, RecurrentMetadata):
            raise ValueError(f"cache group {group} is a KV group, not the recurrent-state group a recurrent layer reads")
        return meta, self.caches[group]  # type: ignore[return-value]

    def scratch(self, index: int, width: int) -> Tensor:
        """Scratch buffer `index` as [num_tokens, width]."""
        return leading_block(self.workspace.scratch[index], self.num_tokens, width)

    def routing(self, top_k: int) -> tuple[Tensor, Tensor]:
        """The step's expert ids [N, top_k] i32 and weights [N, top_k] f32."""
        ids, weights = self.workspace.expert_ids, self.workspace.expert_weights
        if ids is None or weights is None:
            raise ValueError("the workspace has no routing buffers (no MoE layer was declared)")
        return leading_block(ids, self.num_tokens, top_k), leading_block(weights, self.num_tokens, top_k)


class Mixer(Protocol):
    """The token-mixing half of a layer: residual += mixer(residual)."""

    @property
    def kinds(self) -> frozenset[Kind]: ...

    @property
    def needs(self) -> WorkspaceNeeds: ...

    def forward(self, step: LayerStep, residual: Tensor) -> None: ...


class FeedForward(Protocol):
    """The per-token half of a layer: residual += feed_forward(residual)."""

    @property
    def kinds(self) -> frozenset[Kind]: ...

    @property
    def needs(self) -> WorkspaceNeeds: ...

    def forward(self, step: LayerStep, residual: Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class Layer:
    mixer: Mixer
    feed_forward: FeedForward

"""The per-sequence state a model needs, declared as data: cache groups and the layers each covers.

Layers whose per-sequence state has the same shape share a group (one pool of pages or slots,
one block table per sequence): the full-attention layers of a model are one group, its
sliding-window layers another, its Gated DeltaNet layers a third. A layer's index within its
group's `layers` is its layer in that group's cache (`AttentionLayer.cache_layer`,
`DeltaNetLayer.state_layer`).

    layers         0     1     2     3     4     5
    kind           full  slide slide full  gdn   gdn
    groups         A: (0, 3)   B: (1, 2)   C: (4, 5)
    layer in group 0     0     1     1     0     1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvShape:
    """Paged K and V of an attention layer: pages of `num_kv_heads` x `head_dim`, of which a
    query sees the last `sliding_window` positions (None: all)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class StateShape:
    """A recurrent layer's state slot: conv inputs [conv_kernel - 1, conv_dim] and the recurrent
    state [num_heads, key_dim, value_dim]."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int


CacheShape = KvShape | StateShape


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """Layers (model indices, ascending) whose per-sequence state has one `shape`."""

    shape: CacheShape
    layers: tuple[int, ...]

    def index_of(self, layer: int) -> int:
        """The layer's index within this group's cache; `ValueError` if it is not a member."""
        return self.layers.index(layer)


def group_caches(shapes: Sequence[CacheShape | None]) -> tuple[CacheGroup, ...]:
    """One group per distinct shape, in order of first appearance; `shapes[i]` is layer i's
    (None: a layer that keeps no per-sequence state)."""
    members: dict[CacheShape, list[int]] = {}
    for layer, shape in enumerate(shapes):
        if shape is not None:
            members.setdefault(shape, []).append(layer)
    return tuple(CacheGroup(shape, tuple(layers)) for shape, layers in members.items())


def locate(groups: Sequence[CacheGroup], layer: int) -> tuple[int, int]:
    """(group index, index within the group) of a model layer; `ValueError` if none covers it."""
    for index, group in enumerate(groups):
        if layer in group.layers:
            return index, group.index_of(layer)
    raise ValueError(f"layer {layer} is in no cache group")


def attention_groups(shapes: Sequence[KvShape]) -> tuple[CacheGroup, ...]:
    """The cache groups of a model whose every layer attends; `shapes[i]` is layer i's KV shape
    with its own window.

    The engine serves one KV cache group today (`Model.single_kv_group`), so layers whose shapes
    differ only in their window (Gemma 3's and GPT-OSS's sliding and full layers) share one group
    without a window: every layer keeps all its pages and each applies its own window in
    attention (`AttentionLayer.sliding_window`). That is correct, not memory-saving; once the
    engine serves several groups this becomes `group_caches(shapes)`, whose sliding groups free
    the pages that left their window, and no loader changes.
    """
    if len({(shape.num_kv_heads, shape.head_dim) for shape in shapes}) == 1 and len(set(shapes)) > 1:
        shapes = [KvShape(shape.num_kv_heads, shape.head_dim) for shape in shapes]
    return group_caches(shapes)

"""The per-sequence state a model needs, declared once as data: its cache groups.

A model (its family loader) declares the groups; everything else reads the same declaration:
the memory plan sizes a pool per group (`atlas.domain.memory_plan`), the cache manager gives
each sequence pages in every group (`atlas.domain.cache`), the worker allocates one device cache
per group and hands each step one block table per KV group and one state slot per recurrent
group (`atlas.domain.device_caches`, `atlas.domain.worker`), and each layer finds its cache by
its group's index.

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

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import KvCacheSpec
from atlas.ports.kernels.recurrent import RecurrentStateSpec

# What recurrent state is kept in: the recurrence accumulates over the whole sequence, so it
# stays float32 on every backend (as the reference kernels keep it).
STATE_DTYPE = DType.F32


class CacheGroupKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT_STATE = "recurrent_state"

    @property
    def is_kv(self) -> bool:
        """Paged KV (block tables), as opposed to one state slot per sequence."""
        return self is not CacheGroupKind.RECURRENT_STATE


@dataclass(frozen=True, slots=True)
class KvShape:
    """Paged K and V of an attention layer: pages of `num_kv_heads` x `head_dim`, of which a
    query sees the last `sliding_window` positions (None: all). Raises ValueError for a window
    under 2 tokens."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError(f"a sliding window must cover at least 2 tokens (got {self.sliding_window})")


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
class CacheGroupSpec:
    """One cache group: the layers (model indices, ascending) whose per-sequence state has one
    `shape`. A KV shape with a window is a sliding-window group, one without a full-attention
    group; a state shape is a recurrent-state group (one slot per running sequence)."""

    shape: CacheShape
    layers: tuple[int, ...] = ()

    @property
    def kind(self) -> CacheGroupKind:
        if isinstance(self.shape, StateShape):
            return CacheGroupKind.RECURRENT_STATE
        if self.shape.sliding_window is None:
            return CacheGroupKind.FULL_ATTENTION
        return CacheGroupKind.SLIDING_WINDOW

    @property
    def window(self) -> int | None:
        """A sliding-window group's window: a token attends to itself and the window - 1 before it."""
        return self.shape.sliding_window if isinstance(self.shape, KvShape) else None

    def index_of(self, layer: int) -> int:
        """The layer's index within this group's cache; `ValueError` if it is not a member."""
        return self.layers.index(layer)

    def kv_cache_spec(
        self, num_blocks: int, block_size: int, dtype: DType, scales: tuple[tuple[float, float], ...] = ()
    ) -> KvCacheSpec:
        """The device cache of this KV group (`scales`: its layers' FP8 K/V scales, in `layers`
        order). Raises ValueError for a recurrent-state group."""
        if not isinstance(self.shape, KvShape):
            raise ValueError("a recurrent-state group has state slots, not a KV cache")
        shape = self.shape
        return KvCacheSpec(len(self.layers), num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype, scales)

    def state_spec(self, num_slots: int) -> RecurrentStateSpec:
        """The device state slots of this recurrent group. Raises ValueError for a KV group."""
        if not isinstance(self.shape, StateShape):
            raise ValueError("a KV group has a paged cache, not state slots")
        shape = self.shape
        return RecurrentStateSpec(
            len(self.layers), num_slots, shape.conv_dim, shape.conv_kernel, shape.num_heads, shape.key_dim,
            shape.value_dim, STATE_DTYPE,
        )

    def bytes_per_page(self, block_size: int, kv_dtype: DType) -> int:
        """Device bytes of one page: a KV block of `block_size` tokens, or one state slot."""
        if isinstance(self.shape, KvShape):
            return self.kv_cache_spec(1, block_size, kv_dtype).bytes_per_block
        return self.state_spec(1).bytes_per_slot


def group_caches(shapes: Sequence[CacheShape | None]) -> tuple[CacheGroupSpec, ...]:
    """One group per distinct shape, in order of first appearance; `shapes[i]` is layer i's
    (None: a layer that keeps no per-sequence state)."""
    members: dict[CacheShape, list[int]] = {}
    for layer, shape in enumerate(shapes):
        if shape is not None:
            members.setdefault(shape, []).append(layer)
    return tuple(CacheGroupSpec(shape, tuple(layers)) for shape, layers in members.items())


def locate(groups: Sequence[CacheGroupSpec], layer: int) -> tuple[int, int]:
    """(group index, index within the group) of a model layer; `ValueError` if none covers it."""
    for index, group in enumerate(groups):
        if layer in group.layers:
            return index, group.index_of(layer)
    raise ValueError(f"layer {layer} is in no cache group")


def kv_group_indices(groups: Sequence[CacheGroupSpec]) -> tuple[int, ...]:
    """The indices of the KV groups (block tables), in order."""
    return tuple(index for index, group in enumerate(groups) if group.kind.is_kv)


def state_group_indices(groups: Sequence[CacheGroupSpec]) -> tuple[int, ...]:
    """The indices of the recurrent-state groups (state slots), in order."""
    return tuple(index for index, group in enumerate(groups) if not group.kind.is_kv)

"""Cache groups: one kind of per-sequence state each, with the rules of how much a sequence needs.

A model declares its groups as data (`atlas.domain.models.cache_groups.CacheGroupSpec`): the
layers of one full-attention (heads, head dim) shape share one group; sliding-window layers of
one window another; recurrent layers (conv + SSM state) a state group. Each group here holds
its declaration and its own pool of pages (KV blocks, or state slots) and answers, for the `CacheManager`, four questions: how many pages a sequence of
n tokens holds, which of its blocks a computation from position p still reads, which cached
blocks a prefix hit needs, and how long a sequence can ever get.

    full attention   blocks 0 .. ceil(n / B) - 1, all kept
    sliding window   blocks that hold the last `window` positions; earlier ones are released
                       window 8, B 4, next position 13: reads 6 .. 13 -> blocks 1 .. 3; block 0 goes
    recurrent state  one slot, whatever n (no prefix hits: see `StateSlotGroup`), and while a
                     sequence verifies k drafts, k snapshot slots besides
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.holdings import GroupHolding
from atlas.domain.cache.radix_tree import RadixNode
from atlas.domain.models.cache_groups import CacheGroupKind, CacheGroupSpec


def window_pages(window: int, num_tokens: int, block_size: int) -> int:
    """The most blocks a sequence holds in a sliding-window group while computing `num_tokens`
    tokens in one step: the window - 1 positions before the step and the step's own, and a run
    of L positions touches at most ceil((L - 1) / block_size) + 1 blocks."""
    return -(-(window + num_tokens - 2) // block_size) + 1


class CacheGroup(Protocol):
    """The rules of one cache group over its pool (page ids are per group)."""

    spec: CacheGroupSpec
    pool: BlockPool

    @property
    def is_prefix_closed(self) -> bool:
        """Whether a cached page is useful only below its parent's (the radix tree's rule)."""
        ...

    @property
    def serves_prefix_hits(self) -> bool:
        """Whether a sequence can ever start from this group's cached pages."""
        ...

    def num_pages(self, num_tokens: int) -> int:
        """Pages covering a sequence of `num_tokens` tokens, released ones included."""
        ...

    def num_draft_pages(self, num_drafts: int) -> int:
        """Pages a sequence holds besides `num_pages` while a step verifies `num_drafts` of its
        tokens as drafts (they come after the pages of its tokens)."""
        ...

    def trim(self, holding: GroupHolding, num_tokens: int, num_rolled_back: int) -> tuple[int, ...]:
        """Cut `holding` back to a sequence of `num_tokens` computed tokens that just gave up
        its last `num_rolled_back` computed positions (rejected drafts; 0 when every draft was
        kept): returns the pages it no longer holds, for the pool. Raises AssertionError when
        the holding cannot roll back that far."""
        ...

    def first_needed_block(self, position: int) -> int:
        """The first block that computing tokens from `position` on reads; blocks before it can
        be released."""
        ...

    def longest_hit(self, path: Sequence[RadixNode], group_idx: int, num_blocks: int) -> int:
        """The longest prefix hit of at most `num_blocks` blocks this group can serve from the
        cached pages of `path` (its index among the manager's groups: `group_idx`)."""
        ...

    def hit_blocks(self, num_blocks: int) -> range:
        """The blocks of a `num_blocks`-block hit whose cached pages a sequence takes over."""
        ...

    def cached_page(self, holding: GroupHolding, block_idx: int) -> int | None:
        """The page a sequence offers the prefix cache for its full block `block_idx`, which it
        also pins there (None: it offers and pins nothing)."""
        ...

    def max_tokens(self) -> int | None:
        """The longest sequence the whole pool can hold (None: no limit from this group)."""
        ...

    def max_step_pages(self, num_tokens: int) -> int | None:
        """The most pages one sequence holds while computing `num_tokens` tokens in one step,
        however long it is (None: it grows with the sequence, as `max_tokens` bounds)."""
        ...


class KvGroup:
    """Paged KV of one (heads, head dim, window) group: full attention, or a sliding window."""

    __slots__ = ("spec", "pool", "block_size")

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool) -> None:
        """Raises ValueError for a recurrent-state spec."""
        if not spec.kind.is_kv:
            raise ValueError(f"a KvGroup holds KV blocks, not {spec.kind.value}")
        self.spec = spec
        self.pool = pool
        self.block_size = pool.block_size

    @property
    def is_prefix_closed(self) -> bool:
        return self.spec.window is None

    @property
    def serves_prefix_hits(self) -> bool:
        return True

    def num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_draft_pages(self, num_drafts: int) -> int:
        return 0  # drafts are tokens: `num_pages` covers them

    def trim(self, holding: GroupHolding, num_tokens: int, num_rolled_back: int) -> tuple[int, ...]:
        num_extra = holding.num_covered - self.num_pages(num_tokens)
        if num_extra <= 0:
            return ()
        freed, holding.block_ids = holding.block_ids[-num_extra:], holding.block_ids[:-num_extra]
        return freed

    def first_needed_block(self, position: int) -> int:
        if self.spec.window is None:
            return 0
        return max(0, position - self.spec.window + 1) // self.block_size

    def longest_hit(self, path: Sequence[RadixNode], group_idx: int, num_blocks: int) -> int:
        if self.spec.window is None:
            for idx in range(num_blocks):
                if path[idx].block_ids[group_idx] is None:
                    return idx
            return num_blocks
        while num_blocks > 0:  # the window before the first uncached position must be cached
            first = self.first_needed_block(num_blocks * self.block_size)
            missing = [i for i in range(first, num_blocks) if path[i].block_ids[group_idx] is None]
            if not missing:
                return num_blocks
            num_blocks = missing[-1]  # a hit ending at or after a missing page needs it
        return 0

    def hit_blocks(self, num_blocks: int) -> range:
        return range(self.first_needed_block(num_blocks * self.block_size), num_blocks)

    def cached_page(self, holding: GroupHolding, block_idx: int) -> int | None:
        return holding.block_at(block_idx)

    def max_tokens(self) -> int | None:
        # a window only ever holds its last blocks (`max_step_pages` bounds them)
        return self.pool.num_blocks * self.block_size if self.spec.window is None else None

    def max_step_pages(self, num_tokens: int) -> int | None:
        if self.spec.window is None:
            return None
        return window_pages(self.spec.window, num_tokens, self.block_size)


class StateSlotGroup:
    """Recurrent-state slots (conv + SSM state), one per running sequence.

    Its pool's pages are slots (`block_size` 1). A slot's state is reset by the kernels, not
    here: a sequence computing from its first token starts from zero (`RecurrentMetadata`), so
    a new or preempted sequence never reads what a slot held before.

    A state cannot be rolled back, so a sequence verifying k drafts also holds k snapshot
    slots, into which the step writes the states after its last token and each draft but the
    last (`RecurrentMetadata.snapshot_slots`); its slot gets the state after the last draft.
    Once the drafts are judged, the state after the last kept position becomes its slot by
    swapping ids (nothing is copied) and the other slots go back to the pool:

        holding while verifying 3 drafts    (slot 5, snapshots 8 2 6): after t, d0, d1 | d2
        2 accepted (1 position rolled back)  -> (6,)     frees 5 8 2
        all 3 accepted                       -> (5,)     frees 8 2 6

    Prefix hits would need the state at the hit's last block boundary, which is not kept, so
    this group serves no hit and a model with recurrent layers computes every prompt in full.
    Keeping it needs the recurrent kinds to write the state at block boundaries inside a step
    (their chunked form has it only at chunk ends) into snapshot pages, and a copy from a
    snapshot into a slot at admission; a snapshot is a whole state (some 75 MiB for
    Qwen3-Next-80B), so only a few per prompt are affordable (docs/architecture.md).
    """

    __slots__ = ("spec", "pool")

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool) -> None:
        """Raises ValueError for a KV spec or a pool whose pages are not single slots."""
        if spec.kind is not CacheGroupKind.RECURRENT_STATE:
            raise ValueError(f"a StateSlotGroup holds recurrent state, not {spec.kind.value}")
        if pool.block_size != 1:
            raise ValueError(f"a state slot pool has block_size 1 (got {pool.block_size})")
        self.spec = spec
        self.pool = pool

    @property
    def is_prefix_closed(self) -> bool:
        return False

    @property
    def serves_prefix_hits(self) -> bool:
        return False  # no state snapshots (see the class docstring)

    def num_pages(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def num_draft_pages(self, num_drafts: int) -> int:
        return num_drafts  # the snapshots after the last token and each draft but the last

    def trim(self, holding: GroupHolding, num_tokens: int, num_rolled_back: int) -> tuple[int, ...]:
        slot, snapshots = holding.block_ids[0], holding.block_ids[1:]
        if num_rolled_back > len(snapshots):
            raise AssertionError(f"a state with {len(snapshots)} snapshots cannot roll back {num_rolled_back} positions")
        if not snapshots:
            return ()
        kept = snapshots[len(snapshots) - num_rolled_back] if num_rolled_back else slot
        holding.block_ids = (kept,)
        return tuple(page for page in (slot, *snapshots) if page != kept)

    def first_needed_block(self, position: int) -> int:
        return 0

    def longest_hit(self, path: Sequence[RadixNode], group_idx: int, num_blocks: int) -> int:
        return 0

    def hit_blocks(self, num_blocks: int) -> range:
        return range(0)

    def cached_page(self, holding: GroupHolding, block_idx: int) -> int | None:
        return None

    def max_tokens(self) -> int | None:
        return None

    def max_step_pages(self, num_tokens: int) -> int | None:
        return 1

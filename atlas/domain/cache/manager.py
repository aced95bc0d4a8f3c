"""The one cache API the scheduler uses, over every cache group and the prefix cache.

    admission   hit = lookup(seq)                the longest cached prefix every group can serve
                r = reserve(seq, n, hit)         None when pages are short; nothing changed
                commit(seq, r)                   pins the hit, evicts what is short, hands out pages
    each step   on_scheduled(seq, start, end)    offers the blocks the step fills to the prefix cache
                release_unread(seqs)             once the step is built: releases the blocks that
                                                 left a sliding window
    growth      r = reserve(seq, n); commit(seq, r)
    drafts      r = reserve(seq, 1 + k, num_drafts=k)   also the pages verifying k drafts needs
                                                 (a recurrent group's snapshot slots)
    rollback    trim(seq, r)                     rejected drafts: the pages past the computed count,
                                                 the state after the last kept token made the slot
    the end     release(seq)                     finish, abort or preemption: full blocks stay
                                                 cached (evictable), the rest goes back to the pools

A block enters the prefix cache when the step computing its last token is scheduled, but only
steps after that one may read it: a sequence whose hit would reach a block the step being built
computes waits (`PrefixHit.waits_for_step`) and hits it in full a step later, so the `n` forks
of one prompt compute it once. Only resolved tokens are cached (never a pending placeholder),
and the last prompt token is always computed, since it samples.

Every page of a group's pool is free, held by running sequences (and maybe cached too), or
cached and evictable: `reserve` counts free + evictable pages, minus those the hit will pin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence as SequenceList
from dataclasses import dataclass

import msgspec

from atlas.domain.batch import BlockTable
from atlas.domain.cache.block_key import BlockKey
from atlas.domain.cache.block_pool import BlockPool
from atlas.domain.cache.groups import CacheGroup, KvGroup, StateSlotGroup
from atlas.domain.cache.holdings import CacheHoldings
from atlas.domain.cache.radix_tree import NoPrefixCache, RadixNode, RadixTree
from atlas.domain.models.cache_groups import CacheGroupSpec
from atlas.domain.requests import ParameterError
from atlas.domain.sequence import Sequence


# What a step's ScheduledSequence carries of a sequence's cache (`CacheManager.step_tables`):
# the first KV group's block ids, every KV group's table (none for a lone full-attention group),
# every state group's slot, and every state group's snapshot slots (none without drafts).
StepTables = tuple[tuple[int, ...], tuple[BlockTable, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached blocks a waiting sequence can start from: `nodes[i]` holds its block i."""

    nodes: tuple[RadixNode, ...]
    num_tokens: int
    waits_for_step: bool  # some of these blocks are computed by the step being built


class CacheReservation(msgspec.Struct, frozen=True):
    """A checked promise of pages for one sequence, redeemable once by `CacheManager.commit`
    before the cache changes again."""

    seq_id: str
    hit: PrefixHit | None
    num_new_pages: tuple[int, ...]  # per group
    version: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_blocks_total: int  # KV blocks over every KV group
    num_blocks_free: int  # free or evictable: what new work can take
    num_blocks_cached: int  # evictable: cached and unused by any running sequence
    num_queried_tokens: int  # prompt tokens of the requests admitted (resumed ones not counted)
    num_hit_tokens: int  # of those, found in the prefix cache


class CacheManager:
    """Per-sequence cache pages in every group, and the prefix cache over them."""

    __slots__ = (
        "groups", "block_size", "tree", "_kv_groups", "_state_groups", "_windowed_groups", "_lone_full_group",
        "_no_pages", "_max_tokens", "_fresh", "_version", "_num_queried", "_num_hit",
    )

    def __init__(self, groups: SequenceList[CacheGroup], tree: RadixTree | NoPrefixCache) -> None:
        """Raises ValueError without a KV group, for KV groups of different block sizes, or
        for a tree over another number of groups."""
        kv_groups = [idx for idx, group in enumerate(groups) if group.spec.kind.is_kv]
        if not kv_groups:
            raise ValueError("a cache needs at least one KV group (its blocks are the prefix cache's unit)")
        block_sizes = {groups[idx].pool.block_size for idx in kv_groups}
        if len(block_sizes) != 1:
            raise ValueError(f"the KV cache groups must share one block size (got {sorted(block_sizes)})")
        if tree.num_groups != len(groups):
            raise ValueError(f"the prefix cache covers {tree.num_groups} groups, not {len(groups)}")
        self.groups = tuple(groups)
        self.block_size = block_sizes.pop()
        self.tree = tree
        self._kv_groups = tuple(kv_groups)
        self._state_groups = tuple(idx for idx in range(len(groups)) if idx not in kv_groups)
        self._windowed_groups = tuple(idx for idx, group in enumerate(groups) if group.spec.window is not None)
        self._no_pages = (0,) * len(groups)
        limits = [limit for group in groups if (limit := group.max_tokens()) is not None]
        self._max_tokens = min(limits) if limits else None
        self._lone_full_group = len(groups) == 1 and groups[0].is_prefix_closed
        self._fresh: set[RadixNode] = set()  # nodes the step being built computes
        self._version = 0
        self._num_queried = 0
        self._num_hit = 0

    @classmethod
    def build(cls, groups: SequenceList[CacheGroup], prefix_caching: bool) -> CacheManager:
        """A manager with a radix prefix cache, or with `NoPrefixCache` when caching is off or
        some group serves no prefix hit (recurrent state): a hit needs every group, so nothing
        cached could be reused."""
        caching = prefix_caching and all(group.serves_prefix_hits for group in groups)
        tree = RadixTree([group.is_prefix_closed for group in groups]) if caching else NoPrefixCache(len(groups))
        return cls(groups, tree)

    @classmethod
    def for_groups(
        cls, specs: SequenceList[CacheGroupSpec], num_pages: SequenceList[int], block_size: int, prefix_caching: bool
    ) -> CacheManager:
        """A manager over a model's declared cache groups: group i gets a pool of `num_pages[i]`
        pages (KV blocks of `block_size` tokens, or state slots). Raises ValueError like the
        constructor, or when the counts do not match the groups."""
        if len(num_pages) != len(specs):
            raise ValueError(f"{len(num_pages)} page counts for {len(specs)} cache groups")
        groups: list[CacheGroup] = [
            KvGroup(spec, BlockPool(count, block_size)) if spec.kind.is_kv else StateSlotGroup(spec, BlockPool(count, 1))
            for spec, count in zip(specs, num_pages, strict=True)
        ]
        return cls.build(groups, prefix_caching)

    @property
    def caches_prefixes(self) -> bool:
        """Whether blocks are kept for later prompts (caching on, and every group can serve a hit)."""
        return isinstance(self.tree, RadixTree)

    @property
    def can_recompute_last_token(self) -> bool:
        """Whether a running sequence's last computed position may be computed again
        (`Scheduler.resample`): every group holds full-attention KV pages of more than one
        token. A recurrent state would advance twice, a sliding window may have let go of the
        block the position's window starts in, and a one-token block of it may be cached
        (`trims_only_fresh_pages`)."""
        return len(self._kv_groups) == len(self.groups) and not self._windowed_groups and self.block_size > 1

    def trims_only_fresh_pages(self, seq: Sequence, num_computed: int) -> bool:
        """Whether `trim` after `seq`'s computed count fell to `num_computed` would give back
        only pages of blocks never offered to the prefix cache (with blocks of a token or two,
        the last resolved token's block may be full and cached)."""
        return len(seq.cache.nodes) <= -(-num_computed // self.block_size)

    def begin_step(self) -> None:
        """A new step is being built: blocks computed by earlier steps are readable now."""
        self._fresh.clear()

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of a waiting sequence's tokens that every group can serve,
        leaving at least its last token to compute."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        path = self.tree.match(self._keys(seq, max_blocks)[:max_blocks])
        num_blocks = len(path)
        while (shortest := min(g.longest_hit(path, i, num_blocks) for i, g in enumerate(self.groups))) < num_blocks:
            num_blocks = shortest  # a sliding window may accept a shorter hit only
        nodes = tuple(path[:num_blocks])
        waits = bool(self._fresh) and any(node in self._fresh for node in nodes)
        return PrefixHit(nodes, num_blocks * self.block_size, waits)

    def covers(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether running `seq` already holds the pages for `num_tokens` more tokens in every
        group (most steps of a running sequence): reserving them would hand out nothing."""
        return seq.num_computed_tokens + num_tokens <= seq.cache.num_tokens_covered

    def reserve(
        self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None, num_drafts: int = 0
    ) -> CacheReservation | None:
        """Check that `seq` can hold `num_tokens` more tokens: from its computed ones when
        running, or from `hit` when it is being admitted (pass the hit, even an empty one);
        `num_drafts` of them drafts a step verifies (a running sequence's last ones), which may
        need pages of their own (`CacheGroup.num_draft_pages`: a recurrent group's snapshots).
        Returns None, changing nothing, when some group is short of pages even after evicting.
        Raises ValueError for a running sequence given a hit, or a waiting one given none or
        drafts."""
        holdings = seq.cache
        if (hit is None) != bool(holdings.groups) or (hit is not None and num_drafts):
            raise ValueError(f"{seq.seq_id!r}: a hit is given exactly when a waiting sequence is admitted, "
                             f"without drafts")
        if hit is None:
            end = seq.num_computed_tokens + num_tokens
            if end <= holdings.num_tokens_covered and not (num_drafts and self._state_groups):
                return CacheReservation(seq.seq_id, None, self._no_pages, self._version)  # most steps: keep it short
            needs = tuple([g.num_pages(end) + g.num_draft_pages(num_drafts) - h.num_covered
                           for g, h in zip(self.groups, holdings.groups)])
            newly_pinned = self._no_pages
        else:
            end = hit.num_tokens + num_tokens
            hit_blocks = [group.hit_blocks(len(hit.nodes)) for group in self.groups]
            needs = tuple(g.num_pages(end) - b.stop for g, b in zip(self.groups, hit_blocks, strict=True))
            newly_pinned = tuple(
                sum(1 for i in blocks if hit.nodes[i].num_pins[idx] == 0) for idx, blocks in enumerate(hit_blocks)
            )
        for idx, need in enumerate(needs):
            if need and need > self.groups[idx].pool.num_free_blocks + self.tree.num_evictable(idx) - newly_pinned[idx]:
                return None
        return CacheReservation(seq.seq_id, hit, needs, self._version)

    def commit(self, seq: Sequence, reservation: CacheReservation) -> None:
        """Hand out the reserved pages (after the hit's, which `seq` starts from: its computed
        count becomes the hit's tokens), evicting cached pages where the free ones fall short.
        Raises ValueError, changing nothing, for another sequence's or a stale reservation."""
        if reservation.seq_id != seq.seq_id or reservation.version != self._version:
            raise ValueError(f"the reservation for {reservation.seq_id!r} is stale or not {seq.seq_id!r}'s")
        if reservation.num_new_pages is self._no_pages:
            return  # nothing to hand out, nothing changes
        if reservation.hit is not None:
            self._attach_hit(seq, reservation.hit)
        for idx, (group, need) in enumerate(zip(self.groups, reservation.num_new_pages, strict=True)):
            if need == 0:
                continue
            if need > group.pool.num_free_blocks:
                group.pool.free(self.tree.evict(idx, need - group.pool.num_free_blocks))
            pool_reservation = group.pool.reserve(need)
            if pool_reservation is None:
                raise AssertionError(f"group {idx}: a checked reservation of {need} pages no longer fits")
            seq.cache.groups[idx].block_ids += tuple(group.pool.commit(pool_reservation))
        seq.cache.num_tokens_covered = min(
            self.groups[idx].pool.block_size * seq.cache.groups[idx].num_covered for idx in self._kv_groups
        )
        self._version += 1

    def on_scheduled(self, seq: Sequence, start: int, end: int) -> None:
        """`seq` computes tokens [start, end) in the step being built: offer the blocks this
        fills (if resolved) to the prefix cache."""
        holdings = seq.cache
        next_full = (len(holdings.nodes) + 1) * self.block_size  # tokens that fill its next block
        if end >= next_full and not holdings.path_ended:  # most steps fill no block: end below
            num_tokens = min(end, seq.num_resolved_tokens)
            if num_tokens >= next_full:
                self._offer(seq, num_tokens, fresh_from=start)
                self._version += 1

    def release_unread(self, seqs: Iterable[Sequence]) -> None:
        """The step computing each of `seqs` up to its computed count is built (their block
        tables taken): release the blocks no later step reads, those that left a sliding window.
        Nothing else is handed out for this step, so they are reused only by steps that run
        after it."""
        if not self._windowed_groups:
            return
        for seq in seqs:
            self._release_unread(seq)

    def _release_unread(self, seq: Sequence) -> None:
        holdings = seq.cache
        # Drafts may be rolled back: keep what a step from the first draft on would read.
        position = seq.num_computed_tokens - seq.num_draft_tokens
        for idx in self._windowed_groups:
            holding = holdings.groups[idx]
            first_needed = self.groups[idx].first_needed_block(position)
            while holding.first_block_idx < first_needed and holding.block_ids:
                self._unpin(holdings, idx, holding.first_block_idx)
                self.groups[idx].pool.free([holding.release_first()])
                self._version += 1

    def trim(self, seq: Sequence, num_rolled_back: int) -> None:
        """`seq`'s computed count fell by `num_rolled_back` (verification rejected drafts, or
        `Scheduler.resample` took its last token back), or a verify step kept every draft (0):
        return the pages past it to their pools. They held only drafts, or the last resolved
        token and the refused one after it: never a full block, so no cache node and no other
        sequence shares them. A recurrent group keeps the state after the last kept token as
        its slot (`StateSlotGroup`) and frees the other snapshots."""
        holdings = seq.cache
        for group, holding in zip(self.groups, holdings.groups, strict=True):
            freed = group.trim(holding, seq.num_computed_tokens, num_rolled_back)
            if freed:
                group.pool.free(freed)
        holdings.num_tokens_covered = min(
            self.groups[idx].pool.block_size * holdings.groups[idx].num_covered for idx in self._kv_groups
        )
        self._version += 1
        self.release_unread((seq,))

    def release(self, seq: Sequence) -> None:
        """`seq` stops running (finished, aborted or preempted): its full computed blocks stay
        in the prefix cache, every other page returns to its pool. A no-op for a sequence that
        holds nothing."""
        holdings = seq.cache
        if not holdings.groups:
            return
        self._offer(seq, min(seq.num_computed_tokens, seq.num_resolved_tokens), fresh_from=seq.num_computed_tokens)
        for idx, (group, holding) in enumerate(zip(self.groups, holdings.groups, strict=True)):
            # Eviction follows the unpin order. Full attention: deepest first, since a block is
            # useless without its parent. A sliding window: first first, as blocks leave a
            # window, since a hit at the sequence's end needs only its last blocks.
            blocks = range(holding.first_block_idx, holding.num_covered)
            for block_idx in reversed(blocks) if group.is_prefix_closed else blocks:
                self._unpin(holdings, idx, block_idx)
            group.pool.free(holding.block_ids)
        holdings.clear()
        self._version += 1

    def reset_prefix_cache(self) -> int:
        """Evict every page no running sequence pins; returns how many went back to the pools."""
        num_evicted = 0
        for idx, group in enumerate(self.groups):
            evicted = self.tree.evict(idx, self.tree.num_evictable(idx))
            group.pool.free(evicted)
            num_evicted += len(evicted)
        self._version += 1
        return num_evicted

    def step_tables(self, seq: Sequence) -> StepTables:
        """What a step's `ScheduledSequence` carries: the first KV group's block ids, every KV
        group's table (empty for a lone full-attention group: its table is the block ids) and
        every state group's slot."""
        holdings = seq.cache.groups
        first = holdings[self._kv_groups[0]]
        if self._lone_full_group:
            return first.block_ids, (), (), ()
        tables = tuple(BlockTable(holdings[i].block_ids, holdings[i].first_block_idx) for i in self._kv_groups)
        states = [holdings[i].block_ids for i in self._state_groups]
        snapshots = tuple(ids[1:] for ids in states) if seq.num_draft_tokens and states else ()
        return tables[0].block_ids, tables, tuple(ids[0] for ids in states), snapshots

    def check_prompt_fits(self, num_prompt_tokens: int) -> None:
        """Raises ParameterError("prompt", ...) when the whole cache cannot hold the prompt."""
        for idx in self._kv_groups:
            group = self.groups[idx]
            max_tokens = group.max_tokens()
            if max_tokens is not None and num_prompt_tokens > max_tokens:
                pool = group.pool
                raise ParameterError(
                    "prompt",
                    f"the prompt has {num_prompt_tokens} tokens, which need "
                    f"{BlockPool.blocks_needed(num_prompt_tokens, pool.block_size)} KV blocks of {pool.block_size} "
                    f"tokens, but the KV cache holds only {pool.num_blocks} blocks ({max_tokens} tokens); "
                    f"shorten the prompt or give the KV cache more memory",
                )

    def check_step_fits(self, max_step_tokens: int) -> None:
        """Raises ValueError when some group's pool cannot hold one sequence computing a step of
        `max_step_tokens` tokens (that sequence would wait forever)."""
        for idx, group in enumerate(self.groups):
            needed = group.max_step_pages(max_step_tokens)
            if needed is not None and needed > group.pool.num_blocks:
                raise ValueError(
                    f"cache group {idx} ({group.spec.kind.value}) has {group.pool.num_blocks} pages, but one "
                    f"sequence computing {max_step_tokens} tokens in a step can hold {needed}"
                )

    def fits(self, num_tokens: int) -> bool:
        """Whether the whole cache could hold one sequence of `num_tokens` tokens."""
        return self._max_tokens is None or num_tokens <= self._max_tokens

    def stats(self) -> CacheStats:
        pools = [(idx, self.groups[idx].pool) for idx in self._kv_groups]
        cached = sum(self.tree.num_evictable(idx) for idx, _ in pools)
        return CacheStats(
            num_blocks_total=sum(pool.num_blocks for _, pool in pools),
            num_blocks_free=sum(pool.num_free_blocks for _, pool in pools) + cached,
            num_blocks_cached=cached,
            num_queried_tokens=self._num_queried,
            num_hit_tokens=self._num_hit,
        )

    def check_invariants(self, running: Collection[Sequence]) -> None:
        """Raise AssertionError if pages, pins and sequences disagree.

        Checked on top of each pool's and the tree's own invariants: a running sequence covers
        exactly its computed tokens in every group and holds exactly the blocks its next step
        reads (a sliding window's later ones); every
        used page has as many holders (sequences, plus the cache) as its ref count; every pin is
        a running sequence's; an evictable page has no holder but the cache, so free + used +
        evictable = total; a sequence's path follows its keys.
        """
        self.tree.check_invariants()
        for seq in running:
            self._check_path(seq)
        nodes = list(self.tree.nodes())
        for idx in range(len(self.groups)):
            self._check_group(idx, running, nodes)

    def _check_group(self, idx: int, running: Collection[Sequence], nodes: list[RadixNode]) -> None:
        group = self.groups[idx]
        pool = group.pool
        pool.check_invariants()
        holders: Counter[int] = Counter()  # page -> holders: sequences, plus the cache
        pins: Counter[int] = Counter()  # id(node) -> sequences pinning it
        for seq in running:
            holding = seq.cache.groups[idx]
            expected = group.num_pages(seq.num_computed_tokens) + group.num_draft_pages(seq.num_draft_tokens)
            if holding.num_covered != expected:
                raise AssertionError(f"{seq!r}: group {idx} covers {holding.num_covered} pages, not {expected}")
            # drafts in flight may be rolled back: the window of their first one is kept
            if holding.first_block_idx != group.first_needed_block(seq.num_computed_tokens - seq.num_draft_tokens):
                raise AssertionError(f"{seq!r}: group {idx} released a block it still reads, or keeps one it does not")
            holders.update(holding.block_ids)
            for block_idx in range(holding.first_block_idx, holding.num_covered):
                if self._pins(seq.cache, idx, block_idx):
                    pins[id(seq.cache.nodes[block_idx])] += 1
        for node in nodes:
            num_pins, page = node.num_pins[idx], node.block_ids[idx]
            if num_pins != pins[id(node)]:
                raise AssertionError(f"{node!r}: {num_pins} pins in group {idx}, sequences hold {pins[id(node)]}")
            if page is not None:
                holders[page] += 1
                if num_pins == 0 and pool.ref_count(page) != 1:
                    raise AssertionError(f"evictable page {page} of group {idx} has other holders")
        for page, count in holders.items():
            if pool.ref_count(page) != count:
                raise AssertionError(f"page {page} of group {idx}: {count} holders, ref count {pool.ref_count(page)}")
        if pool.num_used_blocks != len(holders):
            raise AssertionError(f"group {idx}: {pool.num_used_blocks} pages used, {len(holders)} held")

    def _check_path(self, seq: Sequence) -> None:
        holdings, size = seq.cache, self.block_size
        if len(holdings.groups) != len(self.groups):
            raise AssertionError(f"{seq!r} holds pages in {len(holdings.groups)} groups, not {len(self.groups)}")
        if holdings.num_tokens_covered != min(size * holdings.groups[idx].num_covered for idx in self._kv_groups):
            raise AssertionError(f"{seq!r}: {holdings.num_tokens_covered} tokens covered is out of date")
        for block_idx, node in enumerate(holdings.nodes):
            key = holdings.keys[block_idx]
            if node.key != key or key.token_ids != tuple(seq.tokens_slice(block_idx * size, (block_idx + 1) * size)):
                raise AssertionError(f"{seq!r}: block {block_idx}'s cache node or key does not match its tokens")

    def _pins(self, holdings: CacheHoldings, group_idx: int, block_idx: int) -> bool:
        """Whether the sequence pins its block's node in this group: the block was offered to
        the cache and the sequence holds a page the group caches for it."""
        if block_idx >= len(holdings.nodes):
            return False
        return self.groups[group_idx].cached_page(holdings.groups[group_idx], block_idx) is not None

    def _unpin(self, holdings: CacheHoldings, group_idx: int, block_idx: int) -> None:
        if self._pins(holdings, group_idx, block_idx):
            self.tree.unpin(holdings.nodes[block_idx], group_idx)

    def _attach_hit(self, seq: Sequence, hit: PrefixHit) -> None:
        holdings = seq.cache
        holdings.open(len(self.groups))
        for idx, group in enumerate(self.groups):
            holding = holdings.groups[idx]
            blocks = group.hit_blocks(len(hit.nodes))
            holding.first_block_idx = blocks.start if blocks else 0
            for block_idx in blocks:
                self.tree.pin(hit.nodes[block_idx], idx)
            holding.block_ids = tuple(hit.nodes[block_idx].block_ids[idx] for block_idx in blocks)  # type: ignore[misc]
            group.pool.incref(holding.block_ids)
        holdings.nodes = list(hit.nodes)
        seq.start_from_cache(hit.num_tokens)
        if seq.num_preemptions == 0:
            self._num_queried += seq.num_tokens
            self._num_hit += hit.num_tokens

    def _offer(self, seq: Sequence, num_tokens: int, fresh_from: int) -> None:
        """Insert `seq`'s full blocks within its first `num_tokens` tokens into the prefix cache
        and pin them; those holding a token from position `fresh_from` on are fresh."""
        holdings = seq.cache
        num_full = num_tokens // self.block_size
        if num_full <= len(holdings.nodes) or holdings.path_ended:
            return
        parent = holdings.nodes[-1] if holdings.nodes else self.tree.root
        if parent.is_detached:  # its path was evicted (only possible without full attention)
            holdings.path_ended = True
            return
        keys = self._keys(seq, num_full)
        for block_idx in range(len(holdings.nodes), num_full):
            pages = [group.cached_page(holdings.groups[i], block_idx) for i, group in enumerate(self.groups)]
            node, taken = self.tree.insert(parent, keys[block_idx], pages)
            if node is None:  # the cache keeps nothing more of this sequence (it is off, say)
                holdings.path_ended = True
                return
            for idx in taken:
                self.groups[idx].pool.incref([pages[idx]])  # type: ignore[list-item]
            for idx, page in enumerate(pages):
                if page is not None:
                    self.tree.pin(node, idx)
            holdings.nodes.append(node)
            if (block_idx + 1) * self.block_size > fresh_from:
                self._fresh.add(node)
            parent = node

    def _keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        """Keys of `seq`'s first `num_blocks` blocks (at least), each hashed once per sequence."""
        keys = seq.cache.keys
        if num_blocks * self.block_size > seq.num_resolved_tokens:
            raise AssertionError(f"{seq!r}: block {num_blocks - 1} holds a token not sampled yet")
        size = self.block_size
        for block_idx in range(len(keys), num_blocks):
            keys.append(BlockKey(seq.tokens_slice(block_idx * size, (block_idx + 1) * size)))
        return keys

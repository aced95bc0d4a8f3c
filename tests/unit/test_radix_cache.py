"""The radix prefix cache on its own: exact pages, pins, eviction order, and a randomized run
against a reference model, with the tree's invariants checked after every operation."""

from __future__ import annotations

import random

import pytest

from atlas.domain.cache.block_key import BlockKey
from atlas.domain.cache.radix_tree import NoPrefixCache, RadixNode, RadixTree

FULL, WINDOW = 0, 1


def key(*token_ids: int) -> BlockKey:
    return BlockKey(token_ids)


def chain(tree: RadixTree, keys: list[BlockKey], pages: list[int], group: int = FULL) -> list[RadixNode]:
    """Insert `keys` as one path, offering `pages` in `group` (None in the others), and pin it."""
    parent, nodes = tree.root, []
    for block_key, page in zip(keys, pages, strict=True):
        offered = [None] * tree.num_groups
        offered[group] = page
        node, _ = tree.insert(parent, block_key, offered)
        tree.pin(node, group)
        tree.check_invariants()
        nodes.append(node)
        parent = node
    return nodes


A, B, C, D = key(1, 2), key(3, 4), key(5, 6), key(7, 8)


def test_a_key_hashes_once_and_compares_by_tokens() -> None:
    assert key(1, 2) == key(1, 2) and hash(key(1, 2)) == hash((1, 2))
    assert key(1, 2) != key(2, 1) and key(1, 2) != (1, 2)
    assert {key(1, 2): "a"}[BlockKey([1, 2])] == "a"


def test_match_follows_the_longest_cached_path() -> None:
    tree = RadixTree([True])
    a, b, c = chain(tree, [A, B, C], [4, 7, 1])
    (d,) = chain(tree, [D], [2])  # a second branch at the root
    assert tree.match([A, B, C, D]) == [a, b, c]
    assert tree.match([A, C]) == [a] and tree.match([B]) == [] and tree.match([D, A]) == [d]
    assert [n.block_ids for n in (a, b, c)] == [[4], [7], [1]] and [n.depth for n in (a, b, c)] == [1, 2, 3]
    assert tree.num_cached(FULL) == 4 and tree.num_evictable(FULL) == 0


def test_inserting_an_existing_block_keeps_its_page_and_takes_nothing() -> None:
    tree = RadixTree([True])
    (a,) = chain(tree, [A], [4])
    node, taken = tree.insert(tree.root, A, [9])
    assert node is a and taken == () and a.block_ids == [4]
    node, taken = tree.insert(a, B, [None])
    assert node is None and taken == () and tree.match([A, B]) == [a]  # nothing offered: nothing made
    tree.check_invariants()


def test_eviction_takes_unpinned_pages_least_recently_unpinned_first() -> None:
    tree = RadixTree([True])
    a, b, c = chain(tree, [A, B, C], [4, 7, 1])
    (d,) = chain(tree, [D], [2])
    assert tree.evict(FULL, 5) == []  # everything is pinned
    for node in (c, b, a):  # a sequence releases its deepest block first
        tree.unpin(node, FULL)
        tree.check_invariants()
    tree.unpin(d, FULL)
    assert tree.num_evictable(FULL) == 4
    assert tree.evict(FULL, 1) == [1]
    tree.check_invariants()
    assert tree.match([A, B, C]) == [a, b] and c.is_detached
    assert tree.evict(FULL, 2) == [7, 4]
    tree.check_invariants()
    assert tree.match([A]) == [] and tree.evict(FULL, 5) == [2]
    assert tree.num_cached(FULL) == 0 and not tree.root.children


def test_a_pinned_page_survives_and_a_repinned_one_moves_to_the_back() -> None:
    tree = RadixTree([True])
    (a,) = chain(tree, [A], [4])
    (d,) = chain(tree, [D], [2])
    tree.unpin(a, FULL)
    tree.unpin(d, FULL)
    tree.pin(a, FULL)  # a hit reuses it
    assert tree.evict(FULL, 2) == [2]
    tree.unpin(a, FULL)
    assert tree.evict(FULL, 2) == [4]
    with pytest.raises(ValueError, match="not pinned"):
        tree.unpin(a, FULL)


def test_evicting_a_full_attention_page_takes_its_descendants_first() -> None:
    tree = RadixTree([True])
    a, b = chain(tree, [A, B], [4, 7])
    (c,) = chain(tree, [C], [1])  # another root branch
    tree.unpin(a, FULL)  # released out of order: the parent before its child
    tree.unpin(c, FULL)
    tree.unpin(b, FULL)
    assert tree.evict(FULL, 1) == [7, 4]  # b's page is useless without a's, so it goes first
    tree.check_invariants()
    assert tree.match([A]) == [] and tree.match([C]) == [c]


def test_sliding_window_pages_go_independently_and_the_node_stays_for_the_other_group() -> None:
    tree = RadixTree([True, False])
    a, _ = tree.insert(tree.root, A, [4, 40])
    b, _ = tree.insert(a, B, [7, 70])
    for node in (a, b):
        tree.pin(node, FULL)
        tree.pin(node, WINDOW)
    tree.unpin(a, WINDOW)  # a left the window; the full group still uses it
    tree.check_invariants()
    assert tree.evict(WINDOW, 1) == [40] and tree.evict(FULL, 1) == []
    assert a.block_ids == [4, None] and tree.match([A, B]) == [a, b]
    tree.check_invariants()
    tree.unpin(b, FULL)
    tree.unpin(a, FULL)
    assert tree.evict(FULL, 2) == [7, 4]
    assert b.block_ids == [None, 70] and not b.is_detached  # its window page keeps it
    with pytest.raises(ValueError, match="prefix-closed"):
        tree.insert(a, C, [9, None])  # a full page under a parent without one
    tree.unpin(b, WINDOW)
    assert tree.evict(WINDOW, 1) == [70] and not tree.root.children and b.is_detached
    with pytest.raises(ValueError, match="pruned"):
        tree.insert(b, C, [9, 90])
    tree.check_invariants()


def test_no_prefix_cache_matches_keeps_and_evicts_nothing() -> None:
    cache = NoPrefixCache(2)
    assert cache.insert(cache.root, A, [1, 2]) == (None, ())
    assert cache.match([A]) == [] and cache.evict(0, 3) == [] and cache.num_evictable(1) == 0
    with pytest.raises(ValueError):
        cache.pin(cache.root, 0)


class ReferenceCache:
    """What the tree must hold: prefix (as keys) -> page, pins, and the unpin order."""

    def __init__(self) -> None:
        self.pages: dict[tuple[BlockKey, ...], int] = {}
        self.pins: dict[tuple[BlockKey, ...], int] = {}
        self.unpinned: list[tuple[BlockKey, ...]] = []  # least recently unpinned first

    def evict(self, num_blocks: int) -> list[int]:
        evicted: list[int] = []
        while len(evicted) < num_blocks and self.unpinned:
            self._evict(self.unpinned[0], evicted)
        return evicted

    def _evict(self, prefix: tuple[BlockKey, ...], evicted: list[int]) -> None:
        for child in [p for p in self.pages if len(p) == len(prefix) + 1 and p[:-1] == prefix]:
            self._evict(child, evicted)
        self.unpinned.remove(prefix)
        evicted.append(self.pages.pop(prefix))
        del self.pins[prefix]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_reference(seed: int) -> None:
    """Sequences insert and pin paths over a small alphabet of blocks (so they share prefixes),
    release them deepest first, and eviction reclaims pages; the tree must hold exactly the
    reference's pages and evict them in the reference's order."""
    rng = random.Random(seed)
    alphabet = [key(i, i + 1) for i in range(3)]
    tree, reference = RadixTree([True]), ReferenceCache()
    free_pages = list(range(40))
    live: list[list[RadixNode]] = []
    for _ in range(300):
        action = rng.random()
        if action < 0.45 and len(free_pages) >= 5:
            keys = [rng.choice(alphabet) for _ in range(rng.randint(1, 5))]
            parent, path = tree.root, []
            for depth in range(len(keys)):
                prefix = tuple(keys[: depth + 1])
                offered = free_pages[-1]
                node, taken = tree.insert(parent, keys[depth], [offered])
                if taken:
                    free_pages.pop()
                    reference.pages[prefix] = offered
                    reference.pins[prefix] = 0
                    reference.unpinned.append(prefix)
                assert node is not None and node.block_ids == [reference.pages[prefix]]
                tree.pin(node, FULL)
                if reference.pins[prefix] == 0:
                    reference.unpinned.remove(prefix)
                reference.pins[prefix] += 1
                path.append(node)
                parent = node
            live.append(path)
        elif action < 0.8 and live:
            path = live.pop(rng.randrange(len(live)))
            for depth in reversed(range(len(path))):
                tree.unpin(path[depth], FULL)
                prefix = tuple(n.key for n in path[: depth + 1])
                reference.pins[prefix] -= 1
                if reference.pins[prefix] == 0:
                    reference.unpinned.append(prefix)
        else:
            num_blocks = rng.randint(1, 4)
            evicted = tree.evict(FULL, num_blocks)
            assert evicted == reference.evict(num_blocks)
            free_pages.extend(evicted)
        tree.check_invariants()
        assert tree.num_evictable(FULL) == len(reference.unpinned)
        assert tree.num_cached(FULL) == len(reference.pages)
        for prefix, page in reference.pages.items():
            path = tree.match(list(prefix))
            assert len(path) == len(prefix) and path[-1].block_ids == [page]
    for path in live:
        for node in reversed(path):
            tree.unpin(node, FULL)
    free_pages.extend(tree.evict(FULL, 1000))
    assert sorted(free_pages) == list(range(40)) and not tree.root.children

"""The radix prefix cache: full blocks of token ids -> the pages holding them, one per cache group.

    root -- [5 9 14 22] -- [31 8 17 40] -- [2 6 19 11]     one node per full block of tokens;
                       \\- [31 8 17 41]                    a path from the root spells a prefix

A node holds, for each cache group, one page id or None: a full-attention group's page, a
sliding-window group's page (which may be gone while the full group's stays), a recurrent
group's state snapshot. The tree maps blocks to page ids and nothing else: it never sees
requests, tensors or pools. Callers `pin` the pages a running sequence uses; an unpinned page is
evictable, and `evict` hands back page ids, least recently unpinned first, for the caller to free.

In a *prefix-closed* group (full attention) a page is useful only below its parent's page, so a
node has a page only if its parent has one, and evicting a page takes its descendants' with it.
Pins there cover whole paths (a sequence pins every block it attends to), so an unpinned page has
no pinned descendant.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from atlas.domain.cache.block_key import BlockKey


class RadixNode:
    """One full block of a cached prefix: its key, its page in each group, and who pins those."""

    __slots__ = ("key", "parent", "children", "block_ids", "num_pins", "depth")

    def __init__(self, key: BlockKey | None, parent: RadixNode | None, num_groups: int) -> None:
        self.key = key
        self.parent = parent  # None for the root and for a node pruned from the tree
        self.children: dict[BlockKey, RadixNode] = {}
        self.block_ids: list[int | None] = [None] * num_groups
        self.num_pins = [0] * num_groups
        self.depth = 0 if parent is None else parent.depth + 1  # = its block's index + 1

    @property
    def is_detached(self) -> bool:
        """Pruned from the tree (it had no page and no child left); a root is never detached."""
        return self.parent is None and self.key is not None

    def __repr__(self) -> str:
        return f"RadixNode(depth={self.depth}, block_ids={self.block_ids}, pins={self.num_pins})"


class RadixTree:
    """The prefix cache over `len(prefix_closed)` cache groups."""

    __slots__ = ("root", "_prefix_closed", "_unpinned", "_num_pages")

    def __init__(self, prefix_closed: Sequence[bool]) -> None:
        """`prefix_closed[g]`: whether group g's pages are only useful below their parent's."""
        self._prefix_closed = tuple(prefix_closed)
        self.root = RadixNode(None, None, len(self._prefix_closed))
        # per group: nodes whose page nobody pins, least recently unpinned first
        self._unpinned: list[OrderedDict[RadixNode, None]] = [OrderedDict() for _ in self._prefix_closed]
        self._num_pages = [0] * len(self._prefix_closed)

    @property
    def num_groups(self) -> int:
        return len(self._prefix_closed)

    def num_cached(self, group: int) -> int:
        """Pages of `group` the tree holds, pinned or not."""
        return self._num_pages[group]

    def num_evictable(self, group: int) -> int:
        """Pages of `group` nobody pins: `evict` can hand back this many."""
        return len(self._unpinned[group])

    def match(self, keys: Sequence[BlockKey]) -> list[RadixNode]:
        """The nodes spelling the longest cached prefix of `keys`, whatever pages they hold."""
        path: list[RadixNode] = []
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(
        self, parent: RadixNode, key: BlockKey, block_ids: Sequence[int | None]
    ) -> tuple[RadixNode | None, tuple[int, ...]]:
        """The child of `parent` for `key`, created if missing; in each group where it has no
        page, it takes the one offered (None: none offered). The new page is unpinned.

        Returns the node (None, creating nothing, when the node is missing and nothing is
        offered) and the groups that took the offered page, where the caller must add the
        cache's holder. Raises ValueError, changing nothing, for a detached parent or a page
        offered in a prefix-closed group under a parent without one.
        """
        if parent.is_detached:
            raise ValueError("cannot insert under a node pruned from the tree")
        if len(block_ids) != self.num_groups:
            raise ValueError(f"{len(block_ids)} block ids for {self.num_groups} cache groups")
        node = parent.children.get(key)
        taking = [
            group for group, block_id in enumerate(block_ids)
            if block_id is not None and (node is None or node.block_ids[group] is None)
        ]
        for group in taking:
            if self._prefix_closed[group] and parent is not self.root and parent.block_ids[group] is None:
                raise ValueError(f"group {group} is prefix-closed but the parent block has no page in it")
        if node is None:
            if not taking:
                return None, ()
            node = RadixNode(key, parent, self.num_groups)
            parent.children[key] = node
        for group in taking:
            node.block_ids[group] = block_ids[group]
            self._num_pages[group] += 1
            self._unpinned[group][node] = None
        return node, tuple(taking)

    def pin(self, node: RadixNode, group: int) -> None:
        """A sequence uses `node`'s page in `group`: it cannot be evicted until unpinned.
        Raises ValueError when the node has no page there."""
        if node.block_ids[group] is None:
            raise ValueError(f"{node!r} has no page in group {group} to pin")
        if node.num_pins[group] == 0:
            del self._unpinned[group][node]
        node.num_pins[group] += 1

    def unpin(self, node: RadixNode, group: int) -> None:
        """Undo one `pin`; a page left unpinned becomes the most recently used evictable one.
        Raises ValueError when it is not pinned."""
        if node.num_pins[group] < 1:
            raise ValueError(f"{node!r} is not pinned in group {group}")
        node.num_pins[group] -= 1
        if node.num_pins[group] == 0:
            self._unpinned[group][node] = None

    def evict(self, group: int, num_blocks: int) -> list[int]:
        """Drop at least `num_blocks` unpinned pages of `group` (or all there are), least
        recently unpinned first, and return their ids. A prefix-closed page takes its
        descendants' with it, so more may come back. Nodes left with no page and no child are
        pruned."""
        evicted: list[int] = []
        unpinned = self._unpinned[group]
        while len(evicted) < num_blocks and unpinned:
            self._evict_page(next(iter(unpinned)), group, evicted)
        return evicted

    def _evict_page(self, node: RadixNode, group: int, evicted: list[int]) -> None:
        if self._prefix_closed[group]:
            for child in [c for c in node.children.values() if c.block_ids[group] is not None]:
                self._evict_page(child, group, evicted)
        del self._unpinned[group][node]  # a KeyError here would mean a pinned page under an unpinned one
        block_id = node.block_ids[group]
        assert block_id is not None
        evicted.append(block_id)
        node.block_ids[group] = None
        self._num_pages[group] -= 1
        self._prune(node)

    def _prune(self, node: RadixNode) -> None:
        while node.parent is not None and not node.children and all(b is None for b in node.block_ids):
            parent = node.parent
            del parent.children[node.key]  # type: ignore[arg-type]
            node.parent = None
            node = parent

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree's bookkeeping is inconsistent.

        Checked: children are keyed by their key and sit one level below their parent; no node
        but the root is empty of pages and children; pins only on pages; a page is evictable
        exactly when unpinned; prefix-closed pages have parents with pages; no page twice in a
        group; the page counts add up.
        """
        seen: list[set[int]] = [set() for _ in self._prefix_closed]
        for node in self.nodes():
            parent = node.parent
            linked = parent is not None and node.key is not None and parent.children.get(node.key) is node
            if not linked or node.depth != parent.depth + 1:  # type: ignore[union-attr]
                raise AssertionError(f"{node!r} is not linked to its parent")
            if not node.children and all(b is None for b in node.block_ids):
                raise AssertionError(f"{node!r} has no page and no child but was not pruned")
            for group, block_id in enumerate(node.block_ids):
                pins = node.num_pins[group]
                if pins < 0 or (block_id is None and pins):
                    raise AssertionError(f"{node!r}: group {group} has {pins} pins on page {block_id}")
                if block_id is None:
                    continue
                if (pins == 0) != (node in self._unpinned[group]):
                    raise AssertionError(f"{node!r}: group {group} evictability disagrees with its pins")
                if self._prefix_closed[group] and parent is not self.root and parent.block_ids[group] is None:
                    raise AssertionError(f"{node!r}: prefix-closed group {group} page under a parent without one")
                if block_id in seen[group]:
                    raise AssertionError(f"page {block_id} of group {group} is cached twice")
                seen[group].add(block_id)
        for group, pages in enumerate(seen):
            if len(pages) != self._num_pages[group]:
                raise AssertionError(f"group {group}: {len(pages)} pages found, {self._num_pages[group]} counted")
            if any(node.block_ids[group] is None or node.is_detached for node in self._unpinned[group]):
                raise AssertionError(f"group {group}: an evictable entry has no page or left the tree")


class NoPrefixCache:
    """The prefix cache switched off (`--no-prefix-caching`): nothing matches, nothing is kept.

    The same interface as `RadixTree`, so the cache manager never asks whether caching is on.
    """

    __slots__ = ("root", "_num_groups")

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self.root = RadixNode(None, None, num_groups)

    @property
    def num_groups(self) -> int:
        return self._num_groups

    def num_cached(self, group: int) -> int:
        return 0

    def num_evictable(self, group: int) -> int:
        return 0

    def match(self, keys: Sequence[BlockKey]) -> list[RadixNode]:
        return []

    def insert(
        self, parent: RadixNode, key: BlockKey, block_ids: Sequence[int | None]
    ) -> tuple[RadixNode | None, tuple[int, ...]]:
        return None, ()

    def pin(self, node: RadixNode, group: int) -> None:
        raise ValueError("nothing is cached, so nothing can be pinned")

    def unpin(self, node: RadixNode, group: int) -> None:
        raise ValueError("nothing is cached, so nothing is pinned")

    def evict(self, group: int, num_blocks: int) -> list[int]:
        return []

    def nodes(self) -> Iterator[RadixNode]:
        return iter(())

    def check_invariants(self) -> None:
        pass

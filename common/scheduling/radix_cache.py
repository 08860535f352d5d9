"""Radix prefix cache over the paged KV pool (SGLang's RadixCache, page-granular).

The tree maps token sequences to the KV pages that hold them. Keys are whole pages: a node's key
has len(pages) * page_size tokens, so a match or a split never lands inside a page.

    lock_ref   how many live requests use this node (and so every ancestor): a locked node's
               pages are never evicted
    evictable  pages of unlocked nodes; they count as free for admission and are given back to
               the pool leaf by leaf, least recently used first, when the pool runs dry

Eviction pops a heap of candidate leaves kept up to date as the tree changes (an entry goes stale
when its node is locked, gains a child, is touched again or is gone, and is skipped when popped),
so it costs what it evicts, not the size of the tree: a full pool evicts on every admission.

Host tier (optional, `--host-kv-cache-gb`): a node's pages may also have a copy in host memory
(`host` slots), and a node whose device pages were evicted stays, host-only: radix_host.py.

Ownership: pages in the tree belong to the tree. A request owns only the pages after its matched
prefix until it finishes; then `insert` hands the tree the pages it did not already have, and the
caller frees the duplicates (the same tokens cached by someone else meanwhile) and the partial
last page. Insert only after the KV of those tokens is written: the tree must never hand out a
page whose KV is still being computed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from pdserve.common.scheduling.radix_host import HostTier

if TYPE_CHECKING:  # (the pools hold device memory: scheduling only calls their host-side methods)
    from pdserve.common.engine.kv_pool import PagedKVPool


class TreeNode:
    __slots__ = ("parent", "children", "key", "pages", "lock_ref", "last_access", "host", "loading", "storing")

    def __init__(self, parent: TreeNode | None, key: tuple[int, ...], pages: list[int], tick: int):
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first page of the child's key -> child
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = tick
        self.host: list[int] | None = None  # host pool slots: a backup of `pages`, or all there is
        self.loading = None  # (issue order, event) of the copy filling `pages` from the host tier
        self.storing = None  # event of the copy filling `host` from `pages` (write-through)


class RadixCache(HostTier):
    def __init__(self, kv_pool: PagedKVPool, host=None):
        """`host`: a HostKVPool that evicted pages go to (None: they are dropped)."""
        self.kv_pool = kv_pool
        self.host = host
        self.host_pages = 0  # host slots the tree holds
        # host_stored_pages: copied to host memory, host_backup_pages of them when inserted (write-through);
        # host_evicted_without_copy_pages: evicted with their backup made already, so no copy then.
        stored = ("host_stored_pages", "host_backup_pages", "host_evicted_without_copy_pages")
        self.stats = dict.fromkeys((*stored, "host_loaded_pages", "host_dropped_pages"), 0)
        self.unsettled: list[tuple[list[int], object]] = []  # (freed pages, a store still reading them)
        self._host_lru: list[tuple[int, int, TreeNode]] = []
        self.page_size = kv_pool.page_size
        self._ticks = itertools.count()
        self.root = TreeNode(None, (), [], next(self._ticks))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_pages = self.protected_pages = 0
        self.num_nodes = 1
        # (last_access, push order, node) for leaves that were evictable when pushed.
        self._lru: list[tuple[int, int, TreeNode]] = []
        self._pushes = itertools.count()

    # ---- lookup ---------------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached page-aligned prefix of `tokens`, and the node it ends at.

        Splits a node when the match ends inside it, so the returned node covers exactly the match.
        """
        usable = len(tokens) // self.page_size * self.page_size
        key = tuple(tokens[:usable])
        node, pages, pos = self.root, [], 0
        tick = next(self._ticks)
        node.last_access = tick
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page_size])
            if child is None or not child.pages:  # (host-only: load_continuation)
                break
            n = self._common_pages(child.key, key[pos:])
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = tick
            pages += child.pages
            pos += len(child.key)
            node = child
        self._offer(node)  # touched: its old heap entry is stale
        return pages, node

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """Tokens of `tokens` a match would reuse, without touching the tree (for scheduling policy)."""
        node, pos = self.root, 0
        usable = len(tokens) // self.page_size * self.page_size
        while pos < usable:
            child = node.children.get(tuple(tokens[pos : pos + self.page_size]))
            if child is None or not child.pages:
                break
            n = self._common_pages(child.key, tuple(tokens[pos:usable]))
            pos += n * self.page_size
            if n < len(child.pages):
                break
            node = child
        return pos

    # ---- insertion ------------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Cache `pages` as holding `tokens` (whole pages only). Returns how many leading pages were
        already cached: those of `pages` are duplicates the caller must free."""
        assert len(tokens) == len(pages) * self.page_size, (len(tokens), len(pages))
        key = tuple(tokens)
        node, pos, tick = self.root, 0, next(self._ticks)
        while pos < len(key):
            first = key[pos : pos + self.page_size]
            child = node.children.get(first)
            if child is not None and not child.pages:  # host-only: the request's pages replace it
                self._drop_subtree(child)
                child = None
            if child is None:
                new = TreeNode(node, key[pos:], pages[pos // self.page_size :], tick)
                node.children[first] = new
                self.evictable_pages += len(new.pages)
                self.num_nodes += 1
                if self.host is not None and self.host.write_through:
                    self._back_up(new)
                self._offer(new)
                return pos // self.page_size
            n = self._common_pages(child.key, key[pos:])  # >= 1: the first page matched
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = tick
            pos += len(child.key)
            node = child
        self._offer(node)  # touched: its old heap entry is stale
        return len(pages)

    def _common_pages(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Whole pages on which a and b agree from the start."""
        n, p = 0, self.page_size
        limit = min(len(a), len(b)) // p
        while n < limit and a[n * p : (n + 1) * p] == b[n * p : (n + 1) * p]:
            n += 1
        return n

    def _split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Cut `node` after n_pages; returns the new upper half (which keeps the parent link)."""
        cut = n_pages * self.page_size
        upper = TreeNode(node.parent, node.key[:cut], node.pages[:n_pages], node.last_access)
        upper.lock_ref = node.lock_ref
        upper.loading, upper.storing = node.loading, node.storing  # (both halves complete with one copy)
        if node.host is not None:
            upper.host, node.host = node.host[:n_pages], node.host[n_pages:]
        upper.children[node.key[cut : cut + self.page_size]] = node
        node.parent.children[node.key[: self.page_size]] = upper
        node.parent = upper
        self.num_nodes += 1
        node.key, node.pages = node.key[cut:], node.pages[n_pages:]
        return upper

    # ---- locking --------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                self._offer(node)
            node = node.parent

    # ---- eviction -------------------------------------------------------------------------------

    def evict(self, num_pages: int, keep: TreeNode | None = None) -> int:
        """Free at least `num_pages` pages from unlocked leaves, LRU first. Returns pages freed.
        `keep`: a host-only node that making host room must not drop (load_continuation's)."""
        freed = 0
        while freed < num_pages and self._lru:
            access, _, leaf = heapq.heappop(self._lru)
            if leaf.parent is None or not self._device_leaf(leaf) or leaf.lock_ref or leaf.last_access != access:
                continue  # stale: gone, no longer a leaf, locked, or touched since it was pushed
            n = len(leaf.pages)
            parent = leaf.parent
            if leaf.host is not None:  # backed up: no copy
                self._await_store(leaf)
                self.stats["host_evicted_without_copy_pages"] += n
            elif self.host is not None and self._host_room(n, keep):
                leaf.host = self.host.alloc(n)
                done = self.host.store(self.kv_pool, leaf.pages, leaf.host)  # (on the caller's stream)
                self.unsettled += [(leaf.pages, done)] if done is not None else []
                self.host_pages += n
                self.stats["host_stored_pages"] += n
            self.kv_pool.free_pages(leaf.pages)
            if leaf.host is not None:
                leaf.pages = []
                self._offer_host(leaf)
            else:
                self._drop_subtree(leaf)
            freed += n
            self.evictable_pages -= n
            self._offer(parent)
        return freed

    # ---- the host tier: radix_host.py; what both use ------------------------------------------

    def _device_leaf(self, node: TreeNode) -> bool:
        """Holds device pages, and none of its children does (an eviction candidate)."""
        return bool(node.pages) and not any(c.pages for c in node.children.values())

    def _drop_subtree(self, node: TreeNode) -> None:
        """Take `node` (device pages already given back) and its host-only descendants out of the tree."""
        del node.parent.children[node.key[: self.page_size]]
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host is not None:
                self._free_host(n)  # (counted as dropped)
            n.parent = None
            self.num_nodes -= 1
            stack.extend(n.children.values())
            n.children = {}

    def _offer(self, node: TreeNode) -> None:
        """Push `node` as an eviction candidate if it is an unlocked leaf (a stale entry of it may
        remain; it is skipped when popped). Rebuilds the heap when stale entries dominate."""
        if node is self.root or node.lock_ref or not self._device_leaf(node):
            return
        heapq.heappush(self._lru, (node.last_access, next(self._pushes), node))
        if len(self._lru) > 4 * self.num_nodes + 1024:
            nodes = [n for n in self._nodes() if n is not self.root and self._device_leaf(n) and n.lock_ref == 0]
            self._lru = [(n.last_access, next(self._pushes), n) for n in nodes]
            heapq.heapify(self._lru)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def total_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    def reset(self) -> None:
        """Give every cached page back, device and host (only valid when no request holds a lock)."""
        assert self.protected_pages == 0, "reset with locked nodes"
        for node in self._nodes():
            if node.pages:  # dropped, not stored
                self._await_store(node)
                self.kv_pool.free_pages(node.pages)
                node.pages = []
        self.evictable_pages, self._lru, self._host_lru = 0, [], []
        for child in list(self.root.children.values()):
            self._drop_subtree(child)

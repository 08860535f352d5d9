"""The radix cache's host tier: RadixCache (radix_cache.py) inherits these methods; the state is its.

Optional (`--host-kv-cache-gb`; the pool: common/engine/host_kv_pool.py): a node's pages may have
a copy in host slots (`host`); an evicted leaf keeps it and stays, host-only (no device pages).
Write-through (`--host-kv-write-policy`, the default): `insert` backs the tree's new pages up at
once on the host pool's store stream, off the forward's critical path (`storing`: that copy's
event), so evicting them copies nothing: the current stream only waits, on the device, for a store
still running before the pages are freed. A backup is skipped when the host pool is full of other
nodes' backups (host-only leaves are dropped for it, backups of device nodes never); such a leaf,
and every leaf under write-back, is copied when evicted, on the caller's stream (in the critical
path of the next forward). A write no stream orders (into a KV destination: another server's)
starts only once the stores in `unsettled` are done: (pages, event) of stores still reading pages
an eviction freed (KVManager and decode/scheduler.py poll them).
A device match stops at a host-only node; `load_continuation` brings the host-only nodes that
continue a match back into fresh device pages (the request then runs from the longer prefix).
Loads are asynchronous (the load stream): a node being loaded has device pages and `loading` set to
its copy's event, and whoever matches through it must wait for that event before a forward reads
its pages (`pending_load`); the scheduler polls, it never waits. Under write-through a loaded node
keeps its host slots as its backup (evicted again, it copies nothing).
Invariants: a host-only node has only host-only descendants (eviction goes leaf-upward; an insert
through a host-only node replaces its subtree with the request's device pages); a node with both
holds as many host slots as pages. The host pool drops host-only leaves LRU when full; a slot is
reused only once the copies reading or writing it are done. NOTE loads and stores wait for the
caller's stream, at scheduling time: on a GPU that must be after the loop's barrier on the forward
stream (the KV being stored was written by a forward queued before it).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.common.scheduling.radix_cache import TreeNode


class HostTier:
    """RadixCache's methods for pages in host memory (`self.host`: a HostKVPool, or None)."""

    def load_continuation(self, tokens: list[int], node: TreeNode, max_pages: int) -> tuple[list[int], TreeNode]:
        """Bring back into device pages the host-only nodes that continue `node`'s match of `tokens`
        (`node` ends a device match and is locked by the caller, so making room evicts no part of
        it), at most `max_pages` of them: (the pages loaded, the node the match now ends at, locked
        in place of `node`)."""
        if self.host is None:
            return [], node
        depth, walker = 0, node
        while walker is not self.root:
            depth += len(walker.key)
            walker = walker.parent
        usable = len(tokens) // self.page_size * self.page_size
        key, pos, pages = tuple(tokens[:usable]), depth, []
        while pos < len(key) and len(pages) < max_pages:
            child = node.children.get(key[pos : pos + self.page_size])
            if child is None or child.pages:
                break
            n = min(self._common_pages(child.key, key[pos:]), max_pages - len(pages))
            if n < len(child.host):
                child = self._split(child, n)
            free = self.kv_pool.num_free_pages()
            if free < n:
                self.evict(n - free, keep=child)  # (stores other leaves to the host pool: never this path)
            loaded = self.kv_pool.alloc_pages(n)
            if loaded is None:
                break
            backup = self.host.write_through  # the host copy stays valid: the node's backup from now on
            done = self.host.load_async(self.kv_pool, child.host, loaded, keep_slots=backup)
            child.loading = None if done is None else (next(self._ticks), done)
            self.stats["host_loaded_pages"] += n
            if not backup:  # (load_async frees the slots once read)
                self.host_pages -= n
                child.host = None
            child.pages = loaded
            self.evictable_pages += n
            child.last_access = next(self._ticks)
            self.inc_lock_ref(child)  # (before the next room is made: it must not be evicted again)
            self.dec_lock_ref(node)
            pages += loaded
            pos += len(child.key)
            node = child
        self._offer(node)
        return pages, node

    def pending_load(self, node: TreeNode):
        """The event to wait for before a forward reads the pages of the match ending at `node`
        (the last issued of its nodes' loads not yet complete; one stream: the others complete
        first), or None."""
        latest = None
        while node is not self.root:
            if node.loading is not None:
                if node.loading[1].query():
                    node.loading = None
                elif latest is None or node.loading[0] > latest[0]:
                    latest = node.loading
            node = node.parent
        return None if latest is None else latest[1]

    def _host_room(self, n: int, keep: TreeNode | None = None) -> bool:
        """Free n host slots, dropping host-only leaves least recently used first (never a backup
        of device pages, nor `keep`); False if the pool cannot hold n."""
        spared = []
        while self.host.num_free() < n and self._host_lru:
            entry = heapq.heappop(self._host_lru)
            access, _, leaf = entry
            if leaf.parent is None or leaf.children or leaf.pages or leaf.last_access != access:
                continue
            if leaf is keep:
                spared.append(entry)
                continue
            parent = leaf.parent
            self._drop_subtree(leaf)
            self._offer_host(parent)
        for entry in spared:
            heapq.heappush(self._host_lru, entry)
        return self.host.num_free() >= n

    def _back_up(self, node: TreeNode) -> None:
        """Write-through: copy `node`'s device pages to host slots now, on the store stream, so its
        eviction copies nothing; skipped (the eviction copies) when the host pool has no room."""
        n = len(node.pages)
        if not self._host_room(n):
            return
        node.host = self.host.alloc(n)
        node.storing = self.host.store_async(self.kv_pool, node.pages, node.host)
        self.host_pages += n
        self.stats["host_stored_pages"] += n
        self.stats["host_backup_pages"] += n

    def _await_store(self, node: TreeNode) -> None:
        """Before `node`'s device pages are freed: a later write into them must come after its
        backup's store has read them (the current stream waits on the device, the host never; a
        write no stream orders, for `unsettled`)."""
        if node.storing is not None and not node.storing.query():
            self.host.wait_for(node.storing)
            self.unsettled.append((node.pages, node.storing))

    def _free_host(self, node: TreeNode) -> None:
        """Give `node`'s host slots back once the copies reading or writing them are done (a load
        on the load stream, issued after the store it reads: its event is the later)."""
        done = node.loading[1] if node.loading is not None else node.storing
        self.host.free_after(done, node.host)
        self.host_pages -= len(node.host)
        self.stats["host_dropped_pages"] += len(node.host)
        node.host = None

    def _offer_host(self, node: TreeNode) -> None:
        if node is not self.root and node.host is not None and not node.children and not node.pages:
            heapq.heappush(self._host_lru, (node.last_access, next(self._pushes), node))

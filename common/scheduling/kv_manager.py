"""Who holds which KV: request rows, pages and the radix prefix cache, on the host only.

A request owns a ReqToTokenPool row and `req.pages`; the first `req.prefix_pages` of those belong
to the radix cache (matched at admission, locked through `req.last_node`), the rest are its own.
`cache_and_release` hands a request's written KV to the cache (which takes the pages it did not
have) and frees the rest; `free` frees without caching. Cached pages nobody locks count as
available: they are evicted on demand.

A prefix hit on the host tier is copied back asynchronously: the request holds its pages at once,
and `kv_load_done` says when a forward may read them (the scheduler keeps it out of batches until
then; a request freed before that first waits for the copy: its pages must not change hands while
the copy still writes them).

Pages an eviction frees while a host-tier store still reads them (a write-back's, or a write-through
backup not yet complete) may be rewritten by anything the scheduling stream orders (it waits for
the store on the device), but not by a write no stream orders: a decode server hands such pages to
a prefill server only once `unsettled_events` says the stores are done (decode/scheduler.py).

Nothing here touches the device. What a row must hold before the request's first forward here
(a prefix hit, or a decode server's pages for an incoming transfer) is queued as a RowWrite and
handed to the next ScheduleBatch (`take_row_writes`); the batch builder writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.scheduling.batch import RowWrite
from pdserve.common.scheduling.pages import pages_for, slots_for_positions
from pdserve.common.scheduling.radix_cache import RadixCache
from pdserve.common.types import Req

if TYPE_CHECKING:  # (the pools hold device memory: scheduling only calls their host-side methods)
    from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool


class KVManager:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        prefix_cache: bool,
        reserve_decode_tokens: int,
    ):
        self.req_to_token_pool = req_to_token_pool
        # Room each request that decodes here keeps for its next tokens (0 where none decode: prefill).
        self.reserve_decode_tokens = reserve_decode_tokens
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        # (the host tier lives beside the pool it backs: the engine made it, --host-kv-cache-gb)
        self.tree_cache = RadixCache(kv_pool, kv_pool.host_tier) if prefix_cache else None
        self.row_writes: list[RowWrite] = []
        # (pages, event): stores still reading pages an eviction freed (the radix cache's `unsettled`).
        self._unsettled: list[tuple[list[int], object]] = []

    # ---- admission ------------------------------------------------------------------------------

    def rows_available(self) -> int:
        return self.req_to_token_pool.available()

    def available_pages(self) -> int:
        """Free pages plus cached pages nobody locks (evicted on demand)."""
        evictable = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        return self.kv_pool.num_free_pages() + evictable

    def reserve_pages(self, req: Req) -> int:
        """Pages the request should hold to run its next reserve_decode_tokens tokens."""
        ahead = min(req.params.max_new_tokens - req.num_sampled, self.reserve_decode_tokens)
        return pages_for(req.seq_len + ahead, self.page_size)

    def reserved_pages(self, reqs: list[Req]) -> int:
        """Pages the requests are owed beyond those they hold."""
        return sum(max(0, self.reserve_pages(r) - len(r.pages)) for r in reqs)

    def match(self, req: Req):
        """Cached pages for the request's tokens (locked), leaving at least one token to compute."""
        if self.tree_cache is None or _needs_whole_prompt(req):
            return [], None
        tokens = req.fill_ids()[: req.seq_len - 1]
        pages, node = self.tree_cache.match_prefix(tokens)
        self.tree_cache.inc_lock_ref(node)
        return self._load_host_continuation(req, tokens, pages, node)

    def cached_prefix_len(self, req: Req) -> int:
        if self.tree_cache is None or _needs_whole_prompt(req):
            return 0
        return self.tree_cache.cached_prefix_len(req.fill_ids()[: req.seq_len - 1])

    def unlock(self, node, req: Req | None = None) -> None:
        """Unlock a match (`req`: the request it was made for, whose pending copy settles first)."""
        if req is not None:
            self._settle(req)
        if node is not None:
            self.tree_cache.dec_lock_ref(node)

    def admit(self, req: Req, prefix_pages: list[int], node) -> None:
        """Give the request a row holding its matched (locked) cached prefix."""
        self._assign(req, list(prefix_pages), len(prefix_pages), node, len(prefix_pages) * self.page_size)

    def match_for_transfer(self, req: Req):
        """Cached pages (locked) for the beginning of a prompt whose KV another server sends: only
        the pages after them need to cross; none when they cover the whole prompt (a page-aligned
        prompt sent again: the WRITE is then its notification alone, carrying the first token)."""
        if self.tree_cache is None or _needs_whole_prompt(req):
            return [], None
        pages, node = self.tree_cache.match_prefix(req.prompt_ids)
        self.tree_cache.inc_lock_ref(node)
        return self._load_host_continuation(req, req.prompt_ids, pages, node)

    def _load_host_continuation(self, req: Req, tokens: list[int], pages: list[int], node):
        """With a host tier: the match made longer by the host-only pages that continue it, being
        copied back into device pages (as many as the pool can give); `req.kv_load` is the copy's
        event (or that of a copy another request started into the matched pages)."""
        if self.tree_cache.host is None:
            return pages, node
        more, node = self.tree_cache.load_continuation(tokens, node, self.available_pages())
        self._take_unsettled()  # (making room for the copy evicts)
        req.kv_load = self.tree_cache.pending_load(node)
        return pages + more, node

    @staticmethod
    def kv_load_done(req: Req) -> bool:
        """The request's cached prefix is all on the device (no copy from the host tier pending)."""
        if req.kv_load is not None and req.kv_load.query():
            req.kv_load = None
        return req.kv_load is None

    @staticmethod
    def _settle(req: Req) -> None:
        """Wait for the request's pending host-tier copy (rare: it is freed before it ran)."""
        if req.kv_load is not None:
            req.kv_load.synchronize()
            req.kv_load = None

    def admit_for_transfer(self, req: Req, num_tokens: int, prefix_pages: list[int] = (), node=None) -> None:
        """Give the request a row holding its matched (locked) cached prefix and pages of its own
        for the rest of its first `num_tokens` positions, whose KV another server writes (a decode
        server's reservation)."""
        own = self.alloc_pages(pages_for(num_tokens, self.page_size) - len(prefix_pages))
        self._assign(req, list(prefix_pages) + own, len(prefix_pages), node, num_tokens)

    def _assign(self, req: Req, pages: list[int], prefix_pages: int, node, kv_len: int) -> None:
        row = self.req_to_token_pool.alloc()
        req.req_pool_idx, req.pages, req.prefix_pages, req.last_node, req.kv_len = (
            row,
            pages,
            prefix_pages,
            node,
            kv_len,
        )
        if kv_len:
            self.row_writes.append(RowWrite(row, 0, slots_for_positions(pages, 0, kv_len, self.page_size)))

    def take_row_writes(self) -> list[RowWrite]:
        writes, self.row_writes = self.row_writes, []
        return writes

    # ---- pages ----------------------------------------------------------------------------------

    def alloc_pages(self, n: int) -> list[int]:
        free = self.kv_pool.num_free_pages()
        if free < n and self.tree_cache is not None:
            self.tree_cache.evict(n - free)
            self._take_unsettled()
        pages = self.kv_pool.alloc_pages(n)
        assert pages is not None, "admission and retraction keep enough pages available"
        return pages

    def unsettled_events(self, pages: list[int]) -> list:
        """The events of the host-tier stores still reading any of `pages` (freed by an eviction
        before the store completed): a write into them that no CUDA stream orders (another server's,
        into a KV destination) must start only once they have completed. Never waits; [] on the CPU."""
        self._take_unsettled()
        if not self._unsettled:
            return []
        wanted = set(pages)
        return [done for freed, done in self._unsettled if not wanted.isdisjoint(freed)]

    def _take_unsettled(self) -> None:
        """Move the radix cache's newly unsettled frees here; forget those whose store completed."""
        if self.tree_cache is None or not (self.tree_cache.unsettled or self._unsettled):
            return
        taken, self.tree_cache.unsettled = self.tree_cache.unsettled, []
        self._unsettled = [(freed, done) for freed, done in self._unsettled + taken if not done.query()]

    def grow(self, req: Req, end: int) -> None:
        """Make sure req.pages cover positions [0, end)."""
        missing = pages_for(end, self.page_size) - len(req.pages)
        if missing > 0:
            req.pages += self.alloc_pages(missing)

    def truncate(self, req: Req, kv_len: int) -> None:
        """Free the request's pages past those positions [0, kv_len) need (a verify step's rejected drafts)."""
        keep = pages_for(kv_len, self.page_size)
        assert keep >= req.prefix_pages, "the cached prefix is never rolled back"
        if keep < len(req.pages):
            self.kv_pool.free_pages(req.pages[keep:])
            del req.pages[keep:]

    # ---- release --------------------------------------------------------------------------------

    def cache_and_release(self, req: Req) -> None:
        """Hand the request's written KV to the cache (whole pages), free the rest, drop its row."""
        if self.tree_cache is None:
            self.free(req)
            return
        self._settle(req)
        full = req.kv_len // self.page_size
        already = self.tree_cache.insert(req.fill_ids()[: full * self.page_size], req.pages[:full])
        self.kv_pool.free_pages(req.pages[req.prefix_pages : already] + req.pages[full:])
        self.unlock(req.last_node)
        self._drop_row(req)

    def free(self, req: Req) -> None:
        """Free the request's own pages and unlock its cached prefix; nothing is cached."""
        if req.req_pool_idx is None:
            return
        self._settle(req)
        self.kv_pool.free_pages(req.pages[req.prefix_pages :])
        self.unlock(req.last_node)
        self._drop_row(req)

    def _drop_row(self, req: Req) -> None:
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.pages, req.prefix_pages, req.last_node = None, [], 0, None

    # ---- accounting -----------------------------------------------------------------------------

    def host_tier_report(self) -> dict[str, float]:
        """Totals of the host tier: prompt tokens it served (`hit_tokens`), tokens backed up when
        cached (`backup_tokens`: write-through) and evicted with no copy since their backup was
        made (`evicted_without_copy_tokens`), and the bytes and device seconds of its copies each
        way (`load_bytes`, `load_s`, `store_bytes`, `store_s`; seconds only on a GPU). Empty
        without a host tier."""
        tree = self.tree_cache
        if tree is None or tree.host is None:
            return {}
        tree.host.poll()
        stats, page = tree.stats, self.page_size
        tokens = {
            "hit_tokens": stats["host_loaded_pages"] * page,
            "backup_tokens": stats["host_backup_pages"] * page,
            "evicted_without_copy_tokens": stats["host_evicted_without_copy_pages"] * page,
        }
        return tokens | tree.host.stats

    def used_tokens(self) -> int:
        """KV tokens held by requests: neither free nor cached-and-evictable."""
        evictable = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        return self.kv_pool.used_tokens() - evictable * self.page_size

    def is_idle(self) -> bool:
        """Every row back, and every page either free or cached and unlocked."""
        cached = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        locked = self.tree_cache.protected_pages if self.tree_cache is not None else 0
        return (
            self.req_to_token_pool.available() == self.req_to_token_pool.size
            and locked == 0
            and self.kv_pool.num_free_pages() + cached == self.kv_pool.capacity_pages
        )


def _needs_whole_prompt(req: Req) -> bool:
    """A request scoring its prompt needs the logits of every prompt position: a cached prefix
    would skip them (so it is computed whole, and its KV cached afterwards as anyone's)."""
    return req.prompt_logprobs is not None and req.prompt_logprobs_planned < len(req.prompt_ids) - 1

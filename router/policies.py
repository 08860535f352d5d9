"""How the router picks a prefill and a decode worker for a request.

A policy sees only `WorkerView`s (filled by the registry) and the prompt's token ids. Policies are
plain objects with no locking: call them from one thread (the router's event loop). Importing this
module must not import torch.

With `pdserve-router --workers N` every router process has its own policy objects and its own
in-flight counts; each class says how it behaves across processes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class WorkerView:
    """What a policy may look at about one worker."""

    url: str  # "host:port", the worker's identity
    healthy: bool  # health-checked and circuit closed/half-open
    load: int  # e.g. running + waiting requests from GetLoad (lower is better)
    inflight: int  # requests this router has in flight on it right now

    @property
    def total_load(self) -> int:
        """The load policies compare: the worker's own report plus what this router sent since."""
        return self.load + self.inflight


class Policy(ABC):
    """Contract: pick(workers, prompt_ids) returns one of the HEALTHY workers given, or None when none
    is healthy; never blocks; must be cheap (called per request)."""

    @abstractmethod
    def pick(self, workers: list[WorkerView], prompt_ids: list[int]) -> WorkerView | None:
        """One of the healthy `workers` for this prompt, or None when none is healthy."""

    def on_routed(self, worker: WorkerView, prompt_ids: list[int]) -> None:
        """The request was sent to `worker` (the one pick returned, or another the router chose)."""

    def on_removed(self, url: str) -> None:
        """The worker `url` left the registry; forget whatever is kept about it."""


def least_loaded(healthy: list[WorkerView]) -> WorkerView | None:
    """The worker with the least load + inflight, ties by url; None for an empty list."""
    return min(healthy, key=lambda w: (w.total_load, w.url), default=None)


class RoundRobin(Policy):
    """Cycles over the healthy workers in url order, skipping unhealthy ones.

    The cursor is the url picked last, not an index, so a worker joining or leaving neither repeats
    nor skips anyone: the next pick is the first healthy url after the last one, wrapping around.
    pick() advances the cursor (whether or not on_routed follows). Several router processes each
    keep their own cursor: each spreads its share of the requests evenly, so the sum is even too."""

    def __init__(self) -> None:
        self._last_url: str | None = None

    def pick(self, workers: list[WorkerView], prompt_ids: list[int]) -> WorkerView | None:
        healthy = sorted((w for w in workers if w.healthy), key=lambda w: w.url)
        if not healthy:
            return None
        chosen = healthy[0]
        if self._last_url is not None:
            chosen = next((w for w in healthy if w.url > self._last_url), healthy[0])
        self._last_url = chosen.url
        return chosen


class LeastLoad(Policy):
    """The healthy worker with the least load + inflight; ties by url.

    The load is the server's own GetLoad report (running + waiting), which every router process
    polls, so all processes see the same loads; inflight is this process's own requests, and the
    other processes' show up in the server's next report (every --health-check-interval)."""

    def pick(self, workers: list[WorkerView], prompt_ids: list[int]) -> WorkerView | None:
        return least_loaded([w for w in workers if w.healthy])


@dataclass(eq=False)
class _Node:
    """A radix tree node: the edge `key` from its parent, and the workers routed a prompt through it.

    Invariant: a child's tenants are a subset of its parent's (a prompt marks its whole path)."""

    key: tuple[int, ...]
    parent: _Node | None
    tenants: set[str] = field(default_factory=set)
    last_access: int = 0
    children: dict[int, _Node] = field(default_factory=dict)  # first token of the child's key -> child


def _common_prefix_len(key: tuple[int, ...], tokens: list[int], start: int) -> int:
    """How many leading tokens of `key` equal tokens[start:]."""
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class ApproxRadixTree:
    """Which workers were routed which prompts: an approximation of each worker's prefix cache.

    It does not know what a worker actually evicted; it only bounds its own size: after an insert
    takes it over `max_tokens` (tokens on all edges), least-recently-inserted leaves are evicted
    until it holds at most `low_water` tokens (below the bound, so the full walk an eviction pass
    costs is paid once per many inserts, not on every insert at the bound)."""

    def __init__(self, max_tokens: int, low_water_fraction: float = 0.75) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.low_water = int(max_tokens * low_water_fraction)
        self.total_tokens = 0
        self._root = _Node(key=(), parent=None)
        self._tick = 0

    def insert(self, tokens: list[int], url: str) -> None:
        """Record that `url` was routed `tokens` (only its first max_tokens tokens are kept)."""
        tokens = tokens[: self.max_tokens]
        self._tick += 1
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(key=tuple(tokens[i:]), parent=node)
                node.children[tokens[i]] = child
                self.total_tokens += len(child.key)
            else:
                matched = _common_prefix_len(child.key, tokens, i)
                if matched < len(child.key):
                    child = self._split(child, matched)
            child.tenants.add(url)
            child.last_access = self._tick
            i += len(child.key)
            node = child
        if self.total_tokens > self.max_tokens:
            self._evict_to(self.low_water)

    def match(self, tokens: list[int], urls: set[str]) -> dict[str, int]:
        """For each worker in `urls` that shares a prefix with `tokens`: how many tokens it matches."""
        matched: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common_prefix_len(child.key, tokens, i)
            live = child.tenants & urls
            if not live:
                break  # tenants only shrink further down
            for url in live:
                matched[url] = i + n
            if n < len(child.key):
                break
            i += n
            node = child
        return matched

    def remove_tenant(self, url: str) -> None:
        """Forget `url` everywhere; nodes left with no tenant are deleted with their subtrees."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in list(node.children.items()):
                if url not in child.tenants:
                    continue
                child.tenants.discard(url)
                if child.tenants:
                    stack.append(child)
                else:
                    del node.children[first]
                    self.total_tokens -= self._subtree_tokens(child)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` tokens; returns the new upper node (same tenants and tick)."""
        upper = _Node(
            key=child.key[:at], parent=child.parent, tenants=set(child.tenants), last_access=child.last_access
        )
        child.parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _evict_to(self, target: int) -> None:
        """Delete least-recently-inserted leaves until at most `target` tokens remain."""
        order = itertools.count()  # tie-break: nodes do not compare
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.total_tokens > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    @staticmethod
    def _subtree_tokens(node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.key)
            stack.extend(n.children.values())
        return total


def overloaded(busy: int, idle: int, abs_threshold: int, rel_threshold: float) -> bool:
    """Whether a load of `busy` is too far over `idle` for a cache hit to be worth waiting behind it."""
    return busy - idle > abs_threshold and busy > rel_threshold * idle


class CacheAware(Policy):
    """SGLang's cache-aware routing (prefill only): send a prompt where its prefix was sent before.

    The tree holds what THIS process routed, so it serves one router process: with --workers > 1
    the same prefix reaching two processes would warm two servers, and RouterConfig.resolve() picks
    PrefixHash instead. With one process the tree is kept: it matches prefixes of any length, and
    sends a new prefix to the least loaded server rather than wherever a hash lands.

    pick(): over the healthy workers, with load = load + inflight, if
    (max - min) > balance_abs_threshold and max > balance_rel_threshold * min, pick the least
    loaded (the cache is not worth an overloaded worker). Otherwise find the healthy worker with the
    longest prefix match in the tree; when matched / len(prompt) >= cache_threshold pick it (ties:
    least load, then url), else pick the least loaded, which will build cache for this prefix.
    on_routed() records the prompt for the worker; pick() alone changes nothing."""

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 2**20,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxRadixTree(max_tree_tokens)

    def pick(self, workers: list[WorkerView], prompt_ids: list[int]) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy or self._imbalanced(healthy) or not prompt_ids:
            return least_loaded(healthy)
        matched = self.tree.match(prompt_ids, {w.url for w in healthy})
        best_len = max(matched.values(), default=0)
        if best_len / len(prompt_ids) < self.cache_threshold:
            return least_loaded(healthy)
        return least_loaded([w for w in healthy if matched.get(w.url) == best_len])

    def on_routed(self, worker: WorkerView, prompt_ids: list[int]) -> None:
        self.tree.insert(prompt_ids, worker.url)

    def on_removed(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def _imbalanced(self, healthy: list[WorkerView]) -> bool:
        loads = [w.total_load for w in healthy]
        return overloaded(max(loads), min(loads), self.balance_abs_threshold, self.balance_rel_threshold)


# NOTE: the first 64 tokens decide: longer than a chat template's fixed header (so prompts that
# share only the template spread out), and a shared system prompt of 64 tokens or more sends every
# prompt that starts with it to one server. A prompt shorter than that is hashed whole.
PREFIX_HASH_TOKENS = 64


def prefix_key(prompt_ids: list[int]) -> bytes:
    """A digest of the prompt's first PREFIX_HASH_TOKENS tokens, the same in every process.

    NOTE: not hash(): Python salts str/bytes hashes per process (PYTHONHASHSEED)."""
    head = ",".join(map(str, prompt_ids[:PREFIX_HASH_TOKENS])).encode()
    return hashlib.blake2b(head, digest_size=16).digest()


def rendezvous_score(key: bytes, url: str) -> bytes:
    """The worker's weight for `key` in highest-random-weight hashing (compared as bytes)."""
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


class PrefixHash(Policy):
    """Cache affinity that every router process (and every router replica) decides alike (prefill only).

    pick(): the healthy worker with the highest rendezvous_score(prefix_key(prompt), url) — a
    function of the prompt's first PREFIX_HASH_TOKENS tokens and the healthy urls only, so no state
    is shared or kept, a restarted router keeps the mapping the servers' caches were warmed with,
    and a server that leaves (or joins) moves only the prefixes it had (or takes). When that
    worker's load + inflight is overloaded() relative to the least loaded one (CacheAware's
    thresholds), the least loaded is picked instead."""

    def __init__(self, balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def pick(self, workers: list[WorkerView], prompt_ids: list[int]) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        key = prefix_key(prompt_ids)
        chosen = max(healthy, key=lambda w: rendezvous_score(key, w.url))
        least = least_loaded(healthy)
        if overloaded(chosen.total_load, least.total_load, self.balance_abs_threshold, self.balance_rel_threshold):
            return least
        return chosen


POLICY_NAMES = ("round_robin", "least_load", "cache_aware", "prefix_hash")


def make_policy(name: str, role: str) -> Policy:
    """A fresh policy `name` for workers of `role` ("prefill" or "decode").

    cache_aware and prefix_hash route by the prompt's prefix, to the worker whose prefix cache
    likely holds it: prefill workers, and decode workers too, which keep prompts in their prefix
    cache whether they prefill them (--disagg-policy auto or never) or receive their KV (a
    transfer sends only the pages after the prefix the decode server holds: a conversation's next
    turn on the same decode server sends its new tokens). Raises ValueError for an unknown name or
    role."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware()
    if name == "prefix_hash":
        return PrefixHash()
    raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}")

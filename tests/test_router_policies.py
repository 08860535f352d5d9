"""Exact choices of the router's worker-selection policies (pure Python, no torch, no servers)."""

import random
import subprocess
import sys

import pytest

from pdserve.router.policies import (
    ApproxRadixTree,
    CacheAware,
    LeastLoad,
    RoundRobin,
    WorkerView,
    make_policy,
)


def w(url, load=0, inflight=0, healthy=True):
    return WorkerView(url=url, healthy=healthy, load=load, inflight=inflight)


def urls_picked(policy, workers, n, prompt=(1,)):
    return [policy.pick(workers, list(prompt)).url for _ in range(n)]


# --- round robin ------------------------------------------------------------------------------


def test_round_robin_cycles_in_url_order():
    workers = [w("c:1"), w("a:1"), w("b:1")]
    assert urls_picked(RoundRobin(), workers, 7) == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1", "a:1"]


def test_round_robin_skips_unhealthy():
    workers = [w("a:1"), w("b:1", healthy=False), w("c:1")]
    assert urls_picked(RoundRobin(), workers, 4) == ["a:1", "c:1", "a:1", "c:1"]


def test_round_robin_is_fair_when_the_set_changes():
    rr = RoundRobin()
    assert urls_picked(rr, [w("a:1"), w("b:1"), w("c:1")], 2) == ["a:1", "b:1"]
    # a worker joins before the cursor: the cycle goes on after b, then wraps to include it
    assert urls_picked(rr, [w("0:1"), w("a:1"), w("b:1"), w("c:1")], 3) == ["c:1", "0:1", "a:1"]
    # the last picked (a) leaves: continue with the next url after it, nobody repeated or skipped
    assert urls_picked(rr, [w("0:1"), w("b:1"), w("c:1")], 3) == ["b:1", "c:1", "0:1"]
    # b goes unhealthy, then recovers
    assert urls_picked(rr, [w("0:1"), w("b:1", healthy=False), w("c:1")], 2) == ["c:1", "0:1"]
    assert urls_picked(rr, [w("0:1"), w("b:1"), w("c:1")], 2) == ["b:1", "c:1"]


# --- least load -------------------------------------------------------------------------------


def test_least_load_uses_load_plus_inflight():
    workers = [w("a:1", load=3, inflight=0), w("b:1", load=0, inflight=2), w("c:1", load=1, inflight=3)]
    assert LeastLoad().pick(workers, [1]).url == "b:1"


def test_least_load_ties_by_url_and_skips_unhealthy():
    workers = [w("c:1", load=1), w("b:1", load=0, inflight=1), w("a:1", load=0, healthy=False)]
    assert LeastLoad().pick(workers, [1]).url == "b:1"


# --- none healthy -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoad(), CacheAware()], ids=lambda p: type(p).__name__)
def test_none_when_no_worker_is_healthy(policy):
    assert policy.pick([], [1, 2]) is None
    assert policy.pick([w("a:1", healthy=False), w("b:1", healthy=False)], [1, 2]) is None


# --- cache aware ------------------------------------------------------------------------------

SYSTEM = list(range(100, 180))  # a long shared prefix (80 tokens)


def route(policy, workers, prompt):
    chosen = policy.pick(workers, prompt)
    policy.on_routed(chosen, prompt)
    return chosen.url


def test_cache_aware_prefix_affinity():
    policy = CacheAware()
    workers = [w("a:1", load=5), w("b:1", load=0), w("c:1", load=2)]
    assert route(policy, workers, SYSTEM + [1, 2, 3]) == "b:1"  # nothing cached: least loaded
    # b is now busier, but a prompt sharing 80 of its 84 tokens still follows its prefix
    workers = [w("a:1", load=5), w("b:1", load=9), w("c:1", load=2)]
    assert route(policy, workers, SYSTEM + [7, 8, 9, 10]) == "b:1"
    # a different prefix goes to the least loaded, which then owns it
    other = list(range(500, 580))
    assert route(policy, workers, other + [1]) == "c:1"
    workers = [w("a:1", load=0), w("b:1", load=9), w("c:1", load=8)]
    assert route(policy, workers, other + [2, 3]) == "c:1"
    assert route(policy, workers, SYSTEM) == "b:1"  # the whole prompt is a cached prefix


def test_cache_aware_short_match_goes_to_least_loaded():
    policy = CacheAware()
    workers = [w("a:1", load=0), w("b:1", load=1)]
    route(policy, workers, [1, 2, 3, 4])
    # 2 of 5 tokens matched on a: under the 0.5 threshold, so the least loaded, b
    workers = [w("a:1", load=3), w("b:1", load=1)]
    assert policy.pick(workers, [1, 2, 9, 9, 9]).url == "b:1"
    # 3 of 5 matched: over the threshold, a wins despite its load
    assert policy.pick(workers, [1, 2, 3, 9, 9]).url == "a:1"


def test_cache_aware_equal_matches_tie_by_load_then_url():
    policy = CacheAware()
    prompt = SYSTEM + [1]
    for url in ("c:1", "b:1", "a:1"):
        policy.on_routed(w(url), prompt)
    assert policy.pick([w("a:1", load=4), w("b:1", load=3), w("c:1", load=3)], prompt).url == "b:1"


def test_cache_aware_imbalance_falls_back_to_least_load():
    policy = CacheAware()
    prompt = SYSTEM + [1]
    policy.on_routed(w("a:1"), prompt)
    # a: 40, b: 5: the difference 35 > 32 and 40 > 1.5 * 5 -> least load, despite a's full match
    assert policy.pick([w("a:1", load=30, inflight=10), w("b:1", load=5)], prompt).url == "b:1"
    # a difference of exactly 32 is not over the absolute threshold: the cache wins
    assert policy.pick([w("a:1", load=37), w("b:1", load=5)], prompt).url == "a:1"
    # a large difference but a small ratio (200 vs 140 -> 200 <= 1.5 * 140) is not imbalance either
    assert policy.pick([w("a:1", load=200), w("b:1", load=140)], prompt).url == "a:1"
    # unhealthy workers do not count towards imbalance
    assert policy.pick([w("a:1", load=37), w("b:1", load=5), w("c:1", load=0, healthy=False)], prompt).url == "a:1"


def test_cache_aware_never_picks_an_unhealthy_worker():
    policy = CacheAware()
    prompt = SYSTEM + [1, 2]
    policy.on_routed(w("a:1"), prompt)
    policy.on_routed(w("b:1"), SYSTEM[:50])
    workers = [w("a:1", healthy=False), w("b:1", load=7), w("c:1", load=0)]
    assert policy.pick(workers, prompt).url == "b:1"  # b's 50 of 82 is the best healthy match
    workers = [w("a:1", healthy=False), w("c:1", load=3)]
    assert policy.pick(workers, prompt).url == "c:1"


def test_cache_aware_on_removed_forgets_the_worker():
    policy = CacheAware()
    prompt = SYSTEM + [1]
    policy.on_routed(w("a:1"), prompt)
    policy.on_routed(w("b:1"), SYSTEM[:60])
    policy.on_removed("a:1")
    # a:1 comes back at the same url with a cold cache: b (60 of 81) is now the best match
    workers = [w("a:1", load=0), w("b:1", load=5)]
    assert policy.pick(workers, prompt).url == "b:1"
    assert policy.tree.total_tokens == 60  # a's private suffix is gone from the tree
    policy.on_removed("b:1")
    assert policy.tree.total_tokens == 0
    assert policy.pick(workers, prompt).url == "a:1"


def test_cache_aware_empty_prompt_goes_to_least_loaded():
    policy = CacheAware()
    policy.on_routed(w("a:1"), [])
    assert policy.pick([w("a:1", load=2), w("b:1", load=1)], []).url == "b:1"


def test_cache_aware_rejects_max_tree_tokens_below_one():
    with pytest.raises(ValueError, match="max_tree_tokens"):
        CacheAware(max_tree_tokens=0)


# --- the radix tree ---------------------------------------------------------------------------


def test_tree_split_and_match_lengths():
    tree = ApproxRadixTree(max_tokens=1000)
    tree.insert([1, 2, 3, 4, 5], "a")
    tree.insert([1, 2, 3, 9], "b")
    tree.insert([1, 2], "c")
    assert tree.total_tokens == 6  # [1,2] [3] [4,5] [9]
    assert tree.match([1, 2, 3, 4, 5, 6], {"a", "b", "c"}) == {"a": 5, "b": 3, "c": 2}
    assert tree.match([1, 2, 3, 4, 7], {"a", "b", "c"}) == {"a": 4, "b": 3, "c": 2}
    assert tree.match([1, 7], {"a", "b", "c"}) == {"a": 1, "b": 1, "c": 1}
    assert tree.match([1, 2, 3, 9], {"c"}) == {"c": 2}
    assert tree.match([2, 1], {"a", "b", "c"}) == {}


def test_tree_eviction_drops_least_recent_leaves_and_stays_bounded():
    tree = ApproxRadixTree(max_tokens=20)  # low water: 15
    tree.insert([1] * 6, "a")  # oldest
    tree.insert([2] * 6, "b")
    tree.insert([3] * 6, "c")
    assert tree.total_tokens == 18
    tree.insert([2] * 6, "b")  # b refreshed: a is now least recent
    tree.insert([4] * 6, "d")  # 24 > 20: evict a, then c (18 > 15), leaving b and d
    assert tree.total_tokens == 12
    everyone = {"a", "b", "c", "d"}
    assert tree.match([1] * 6, everyone) == {}
    assert tree.match([3] * 6, everyone) == {}
    assert tree.match([2] * 6, everyone) == {"b": 6}
    assert tree.match([4] * 6, everyone) == {"d": 6}


def test_tree_eviction_keeps_a_shared_prefix_until_its_leaves_are_gone():
    tree = ApproxRadixTree(max_tokens=10)  # low water: 7
    tree.insert([1, 1, 1, 1, 2, 2], "a")
    tree.insert([1, 1, 1, 1, 3, 3], "b")  # 8 tokens: [1,1,1,1] [2,2] [3,3]
    tree.insert([5, 5, 5], "c")  # 11 > 10: evict [2,2] (oldest) -> 9 > 7, then [3,3] -> 7, done
    assert tree.total_tokens == 7  # the shared [1,1,1,1], now a leaf, survives
    assert tree.match([1, 1, 1, 1, 3, 3], {"a", "b", "c"}) == {"a": 4, "b": 4}
    assert tree.match([5, 5, 5], {"a", "b", "c"}) == {"c": 3}


def test_tree_prompt_longer_than_the_bound_is_truncated():
    tree = ApproxRadixTree(max_tokens=8)
    tree.insert(list(range(20)), "a")
    assert tree.total_tokens == 8
    assert tree.match(list(range(20)), {"a"}) == {"a": 8}


def test_cache_aware_under_random_load_stays_bounded_and_answers():
    rng = random.Random(0)
    bound = 500
    policy = CacheAware(max_tree_tokens=bound)
    workers = [w(f"w{i}:1") for i in range(4)]
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    for step in range(2000):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]
        route(policy, workers, prompt)
        assert policy.tree.total_tokens <= bound
        if step == 1000:
            policy.on_removed("w0:1")
    assert policy.tree.total_tokens == _count_tree_tokens(policy.tree)
    # the last prompt routed is the most recent: it must still be matched in full
    assert max(policy.tree.match(prompt, {x.url for x in workers}).values()) == len(prompt)


def _count_tree_tokens(tree):
    total, stack = 0, list(tree._root.children.values())
    while stack:
        node = stack.pop()
        total += len(node.key)
        assert node.tenants, "a node with no tenant outlived on_removed/eviction"
        for child in node.children.values():
            assert child.tenants <= node.tenants
        stack.extend(node.children.values())
    return total


# --- make_policy ------------------------------------------------------------------------------


def test_make_policy_builds_each_policy():
    assert isinstance(make_policy("round_robin", "prefill"), RoundRobin)
    assert isinstance(make_policy("least_load", "decode"), LeastLoad)
    assert isinstance(make_policy("cache_aware", "prefill"), CacheAware)
    assert make_policy("round_robin", "decode") is not make_policy("round_robin", "decode")


def test_make_policy_errors():
    assert isinstance(make_policy("cache_aware", "decode"), CacheAware)  # whatever --disagg-policy says
    with pytest.raises(ValueError, match="role must be"):
        make_policy("cache_aware", "router")
    with pytest.raises(ValueError, match="round_robin, least_load, cache_aware"):
        make_policy("random", "prefill")
    with pytest.raises(ValueError, match="role"):
        make_policy("round_robin", "router")


def test_policies_import_without_torch():
    code = "import sys, pdserve.router.policies; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

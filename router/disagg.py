"""Whether a request is disaggregated: prefilled on a prefill server and its KV sent to the decode
server (remote), or prefilled by the decode server itself (local, GenerateRequest.local_prefill).

    --disagg-policy always   every request remote (a prefill server is required: with none healthy,
                             requests fail, or with --prefill-fallback local are local)
    --disagg-policy never    every request local: plain replicas behind the router (no prefill
                             server needed)
    --disagg-policy auto     local when the prompt's uncached tokens on the decode server are at
                             most --local-prefill-max-tokens, or when every prefill server is loaded
                             past --prefill-queue-threshold (or none is healthy); remote otherwise

"Uncached" is estimated by the router (Disaggregation: the prompts it routed to each decode
server), so a chat's next turn, whose history the decode server holds, stays there. Prompt
logprobs are a prefill server's work: such a request is always remote. Each decision is counted in
pdserve_router_prefill_decisions_total{where, reason}.
"""

from __future__ import annotations

import enum
from typing import Callable

from pdserve.router.policies import ApproxRadixTree, WorkerView

POLICIES = ("always", "never", "auto")
FALLBACKS = ("fail", "local")  # --prefill-fallback
# Prompt tokens the router remembers per decode server, for auto's estimate of its prefix cache.
DECODE_TREE_TOKENS = 1 << 20


class Where(str, enum.Enum):
    """Where a choice's prompt is prefilled."""

    LOCAL = "local"  # by its decode server, between decode steps: no KV moves
    REMOTE = "remote"  # by a prefill server, whose KV then moves to the decode server


class Disaggregation:
    """The router's choice, with auto's estimate of what each decode server has cached: the prompts
    routed to it (router/policies.ApproxRadixTree; a finished request's KV stays in the decode
    server's prefix cache, whichever way it was prefilled). The estimate does not see evictions: a
    prompt it believes cached may be prefilled locally in full, which is correct, only slower."""

    def __init__(self, policy: str, local_max_tokens: int, queue_threshold: int, fallback: str = "fail"):
        self.policy, self.local_max_tokens, self.queue_threshold = policy, local_max_tokens, queue_threshold
        self.fallback = fallback
        self.decode_prefixes = ApproxRadixTree(DECODE_TREE_TOKENS) if policy == "auto" else None

    def decide(
        self,
        decode_url: str,
        prompt_ids: list[int],
        prompt_logprobs: bool,
        prefill_servers: Callable[[], list[WorkerView]],
    ) -> tuple[Where, str]:
        """(where, reason) for a choice going to `decode_url`.
        `prefill_servers()` gives their views (asked for only when the decision needs them)."""
        cached = 0
        if self.decode_prefixes is not None:
            cached = self.decode_prefixes.match(prompt_ids, {decode_url}).get(decode_url, 0)
            self.decode_prefixes.insert(prompt_ids, decode_url)
        return decide(
            self.policy,
            len(prompt_ids) - cached,
            cached > 0,
            prompt_logprobs,
            prefill_servers,
            self.local_max_tokens,
            self.queue_threshold,
            self.fallback,
        )


def decide(
    policy: str,
    uncached: int,
    prefix_hit: bool,
    prompt_logprobs: bool,
    prefill_servers: Callable[[], list[WorkerView]],
    local_max_tokens: int,
    queue_threshold: int,
    fallback: str = "fail",
) -> tuple[Where, str]:
    """(where, reason); `uncached`: the prompt's tokens the decode
    server is not believed to hold."""
    if prompt_logprobs:
        return Where.REMOTE, "prompt_logprobs"
    if policy == "always":
        if fallback == "local" and not any(v.healthy for v in prefill_servers()):
            return Where.LOCAL, "no_prefill_server"
        return Where.REMOTE, "always"
    if policy == "never":
        return Where.LOCAL, "never"
    if uncached <= local_max_tokens:
        return Where.LOCAL, "cached_prefix" if prefix_hit else "short_prompt"
    healthy = [v for v in prefill_servers() if v.healthy]
    if not healthy:
        return Where.LOCAL, "no_prefill_server"
    if min(v.total_load for v in healthy) >= queue_threshold:
        return Where.LOCAL, "prefill_saturated"
    return Where.REMOTE, "long_prompt"

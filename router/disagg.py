"""Whether a request is disaggregated: prefilled on a prefill server and its KV sent to the decode
server (remote), or prefilled by the decode server itself (local, GenerateRequest.local_prefill).

    --disagg-policy always   every request remote (a prefill server is required)
    --disagg-policy never    every request local: plain replicas behind the router (no prefill
                             server needed)
    --disagg-policy auto     local when the prompt's uncached tokens on the decode server are at
                             most --local-prefill-max-tokens, or when every prefill server is loaded
                             past --prefill-queue-threshold (or none is healthy); remote otherwise

The decode server keeps no prefix cache yet, so "uncached" is the whole prompt for now. Prompt
logprobs are a prefill server's work: such a request is always remote. Each decision is counted in
pdserve_router_prefill_decisions_total{where, reason}.
"""

from __future__ import annotations

from pdserve.router.policies import WorkerView

POLICIES = ("always", "never", "auto")


def decide(policy: str, prompt_ids: list[int], prompt_logprobs: bool, prefill_servers: list[WorkerView],
           local_max_tokens: int, queue_threshold: int) -> tuple[str, str]:
    """(where, reason): where is "local" or "remote"."""
    if prompt_logprobs:
        return "remote", "prompt_logprobs"
    if policy == "always":
        return "remote", "always"
    if policy == "never":
        return "local", "never"
    if len(prompt_ids) <= local_max_tokens:
        return "local", "short_prompt"
    healthy = [v for v in prefill_servers if v.healthy]
    if not healthy:
        return "local", "no_prefill_server"
    if min(v.total_load for v in healthy) >= queue_threshold:
        return "local", "prefill_saturated"
    return "remote", "long_prompt"

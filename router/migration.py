"""Stream migration: a choice whose decode server died or hung goes on on another decode server.

When a choice's decode stream fails through the decode server's fault (the call broke: a killed
process; or the router abandoned it: a hung one, router/app.py `_unresponsive`), the router starts it
again elsewhere as a new request whose prompt is the old prompt followed by every token the client
was already sent, with what is left of its token budget (`resumed`). The new prefill computes the
KV of that whole sequence (a prefix-cache hit where a server holds its beginning) and samples the next
token; the client's stream goes on with no token missing or repeated (the router appended every
token it received to the choice before the failure, and the new stream starts after them).

Exact for what the router can carry over by itself: greedy choices continue with the tokens the
uninterrupted run would have given (the same model on the same sequence), unseeded sampled ones with
a valid sample (the router fixed their seed; no client can ask for it again). Not migrated, for now —
they end with the error as before — requests whose next tokens depend on state the servers keep and
a new server could not rebuild from the prompt: a grammar's (structured outputs, forced tool calls),
OpenAI frequency/presence penalties (they count output tokens only; the repetition penalty counts
prompt and output, so it carries over), and a client's own seed with temperature > 0 (its noise is
keyed by the decode step, which restarts).
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.types import SamplingParams


def why_not(params: SamplingParams) -> str | None:
    """Why a choice with `params` is not moved to another decode server, or None: it can be."""
    if params.grammar is not None:
        return "a structured-output request's grammar state is not rebuilt on another server"
    if params.frequency_penalty or params.presence_penalty:
        return "frequency and presence penalties count the output tokens, which another server would not"
    if params.seed is not None and params.temperature > 0:
        return "a seeded sampled request would not continue with its seed's tokens on another server"
    return None


def resumed(prompt_ids: list[int], sent: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The request that continues a choice after the tokens `sent`: the prompt and those tokens as its
    prompt, what is left of its budget (max and min new tokens), no prompt logprobs (the client had them)."""
    n = len(sent)
    return [*prompt_ids, *sent], replace(
        params,
        max_new_tokens=params.max_new_tokens - n,
        min_new_tokens=max(params.min_new_tokens - n, 0),
        prompt_logprobs=None,
    )

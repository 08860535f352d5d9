"""Stream migration: a choice whose decode server died or hung goes on on another decode server.

When a choice's decode stream fails through the decode server's fault (the call broke: a killed
process; or the router abandoned it: a hung one, router/app.py `_unresponsive`), the router starts it
again elsewhere as a new request whose prompt is the old prompt followed by every token the client
was already sent, with what is left of its token budget (`resumed`). The new prefill computes the
KV of that whole sequence (a prefix-cache hit where a server holds its beginning) and samples the next
token; the client's stream goes on with no token missing or repeated (the router appended every
token it received to the choice before the failure, and the new stream starts after them).

The new request says how many of its prompt's last tokens are output already produced
(SamplingParams.resumed_output_tokens), so the servers continue it exactly as the uninterrupted run
would, whatever its parameters:
- a grammar (structured outputs, forced tool calls): the matcher accepts those tokens before the
  first sample (common/engine/grammar.py `Grammars.matcher`; one it refuses fails the request);
- OpenAI frequency/presence penalties count them as output (common/engine/sampling.py
  `penalized_output`); the repetition penalty counts prompt and output, which is the same set;
- sampling: the step that keys a seed's noise starts at their count (`noise_step`), on the prefill
  server that samples the first new token, the decode server that goes on, and in verify steps; the
  router fixed every request's seed (pairing.fix_seed), so a client's own seed and the router's
  continue alike;
- min_tokens and max_tokens: the router sends what is left of them (the servers count their own
  output only);
- stop strings: matched by the router on the choice's whole text (router/app.py `Router.choice` keeps
  one Req across the move), so a stop string that spans the move ends the choice where it would have;
  the new server's own matching sees only its own output, and stops it no earlier than the router.
Usage counts the client's prompt and every output token (the Req's, not the new request's prompt).

"Exactly" as far as the model gives the same logits for a sequence prefilled at once as for one
decoded token by token: the same computation, but its rounding may differ (as between two batch
shapes), and a near tie between two tokens can then go the other way. Servers that predate
resumed_output_tokens ignore it (proto3): upgrade the servers before the routers.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.types import SamplingParams


def resumed(prompt_ids: list[int], sent: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The request that continues a choice after the tokens `sent`: the prompt and those tokens as its
    prompt, marked as output already produced (resumed_output_tokens), what is left of its budget (max
    and min new tokens), no prompt logprobs (the client had them)."""
    n = len(sent)
    return [*prompt_ids, *sent], replace(
        params,
        max_new_tokens=params.max_new_tokens - n,
        min_new_tokens=max(params.min_new_tokens - n, 0),
        prompt_logprobs=None,
        resumed_output_tokens=params.resumed_output_tokens + n,
    )

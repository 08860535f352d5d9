"""Core request types shared by every role.

Torch-free on purpose: the router imports these to validate requests and must not pull in torch.
`SamplingParams` is what a client asks for; `Req` is the scheduler's mutable view of one sequence;
`Completion` is what the engine hands back when a sequence finishes.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field

from pdserve.common.errors import ErrorCode

MAX_TOP_LOGPROBS = 20
# SamplingParams.grammar kinds: what the grammar engine compiles (common/engine/grammar.py).
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")

# A KV destination expires when the decode server stops waiting for its WRITE (it answers the
# client with a timeout then). A prefill server starts no WRITE after the expiry, and gives up on
# one still running half this grace after it; the decode server frees the pages (for other
# requests) only this grace after it. So no WRITE lands in pages another request owns, even with
# clocks up to ~1 s apart: the expiry is wall-clock time, set by another machine.
KV_WRITE_GRACE_S = 2.0


class FinishReason(str, enum.Enum):
    """Why a sequence stopped, spelled as OpenAI's `finish_reason`."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or failed


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop. Validated on construction."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one; sampling is on the device either way
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; n: plus the top n
    skip_special_tokens: bool = True
    # The prompt tokens' logprobs (each given the tokens before it), with the top n: None for none.
    # Such a prompt is computed whole: its prefix-cache hit would have no logits.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias, in [-100, 100]).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: (kind, spec) with kind one of GRAMMAR_KINDS; the spec is the kind's source
    # text (a JSON schema, a regex, EBNF, an xgrammar structural tag as JSON; "" for json_object).
    # Compiled by the servers (common/engine/grammar.py); None: unconstrained.
    grammar: tuple[str, str] | None = None
    # The prompt's last k tokens are output an earlier server already produced (a stream moved off
    # a failed decode server: router/migration.py): the grammar starts past them, output-only
    # penalties count them, the sampling step starts at k. max/min_new_tokens count what is left.
    resumed_output_tokens: int = 0

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        # 0: the prompt is only computed (its prompt logprobs, say); nothing is generated.
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad(f"max_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad(f"min_tokens must be between 0 and max_tokens ({self.max_new_tokens}), got {self.min_new_tokens!r}")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            bad(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not math.isfinite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                bad(f"{name} must be between -2 and 2, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            bad(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs!r}")
        for pair in self.logit_bias:
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not isinstance(pair[0], int)
                or pair[0] < 0
                or not isinstance(pair[1], (int, float))
                or not -100 <= pair[1] <= 100
            ):
                bad(f"logit_bias must map token ids to numbers in [-100, 100], got {pair!r}")
        if self.grammar is not None and (
            not isinstance(self.grammar, tuple)
            or len(self.grammar) != 2
            or self.grammar[0] not in GRAMMAR_KINDS
            or not isinstance(self.grammar[1], str)
        ):
            bad(f"grammar must be (kind, spec) with kind one of {', '.join(GRAMMAR_KINDS)}, got {self.grammar!r}")
        if not isinstance(self.resumed_output_tokens, int) or self.resumed_output_tokens < 0:
            bad(f"resumed_output_tokens must be an integer >= 0, got {self.resumed_output_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def reads_step_only(self) -> bool:
        """Its sampling reads nothing of the request but the output step (the noise key): no penalties (they
        read the tokens), no min_new_tokens (its ban depends on the step too), no grammar. An overlapped
        verify step's rows are built before the step in flight lands (common/engine/speculative/overlap.py)."""
        return not self.has_penalties and self.min_new_tokens == 0 and self.grammar is None

    @functools.cached_property  # read for every request of every decode step
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits is all this request's sampling needs (no tensor at all)."""
        return (
            self.greedy
            and not self.has_penalties
            and self.min_new_tokens == 0
            and self.logprobs is None
            and not self.logit_bias
            and self.grammar is None
        )

    @functools.cached_property  # read for every request of every step (EngineCore.must_run_serially)
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class TokenLogprob:
    """The log-probability of a sampled token under the model's raw distribution, with the top n."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs; vLLM's rank)


@dataclass
class Completion:
    """One finished sequence, as the engine returns it."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: int | str | None = None  # the EOS/stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_transfer_bytes: int = 0  # the router's: KV bytes its prefill server wrote to its decode server
    # The router's: where the choice's time went, stage -> seconds (router/timings.py); None elsewhere.
    timings: dict[str, float] | None = None
    error: str | None = None  # why an aborted sequence failed (None: cancelled, or not aborted)
    error_code: ErrorCode | None = None  # set with `error`


class Req:
    """The scheduler's mutable state for one sequence.

    Token bookkeeping: `fill_ids = prompt_ids + output_ids` is the whole sequence; `kv_len` counts
    the leading tokens whose KV is already in the pool (written by a finished forward), and
    `req_pool_idx` is the row of ReqToTokenPool that maps positions to KV slots. The engine owns
    the row and the pages; whoever finishes or aborts the request frees them.
    """

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int):
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed  # always set: drawn by the engine when params.seed is None
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        # Asked for prompt logprobs: entry p is prompt token p's (None for p = 0); filled as the
        # prefill's results arrive. `prompt_logprobs_planned`: positions whose logits a launched
        # batch computes (position p's logits give entry p + 1).
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_planned = 0
        self.text = ""  # detokenized output so far (stop strings already cut)
        self.finish_reason: FinishReason | None = None
        self.matched_stop: int | str | None = None
        self.req_pool_idx: int | None = None
        self.pages: list[int] = []  # KV pages, in position order: page i holds positions [i*P, (i+1)*P)
        self.prefix_pages = 0  # how many leading pages belong to the prefix cache (matched, locked)
        self.last_node = None  # the radix-cache node locked for that prefix
        self.kv_load = None  # the event of a host-tier copy into that prefix, until it completes
        # Overlap bookkeeping. A launched forward samples a token the host has not seen yet:
        # `pending` counts those, `future_idx` is the FutureMap slot of the latest (the next
        # decode step feeds -future_idx and the forward stream resolves it), and `discard` counts
        # in-flight results to drop because the request finished, was aborted or was retracted
        # after they were launched.
        self.pending = 0
        self.future_idx = 0
        self.discard = 0
        # Speculative decoding: (launch seq, drafts, AfterStep or None) of each launched verify step not yet
        # processed, oldest first (common/scheduling/speculation.py); one keeps 1 to len(drafts) + 1 tokens.
        self.spec_inflight: list[tuple] = []
        # Disaggregation: the 63-bit room pairing this request's prefill with its decode, and
        # the role-specific transfer state (decode: deadline for the KV; prefill: destination).
        self.room = 0
        self.deadline = 0.0
        self.error: str | None = None
        self.error_code: ErrorCode | None = None
        self.kv_len = 0
        self.cached_tokens = 0
        self.kv_transfer_bytes = 0  # (set by the router, from the prefill server's answer)
        self.arrived = 0.0  # time.monotonic() when it was queued
        self.admitted = 0.0  # time.monotonic() when its first prefill batch was scheduled
        # Where its time goes (time.monotonic(); 0: not yet), for the servers' timings and histograms:
        # prefill: its first token sampled; decode: its KV destination published, its KV landed, its
        # joining the running batch, the host seeing its first token decoded there.
        self.prefilled = 0.0
        self.granted = 0.0
        self.kv_landed = 0.0
        self.joined = 0.0
        self.first_decoded = 0.0
        self.prefill_chunks = 0  # prefill batches its prompt was computed in (1: not chunked)
        self.chunk_starts: list[float] = []  # time.monotonic() when each of them was scheduled
        self.sampled_steps = 0  # forward steps that gave it tokens here (a verify step's several count once)
        self.spec_proposed = 0  # drafts verified for it (speculative decoding), and those accepted
        self.spec_accepted = 0
        self.detokenizer = None  # set by the engine: an IncrementalDetokenizer
        # Detokenize each token as it arrives (the router streams text). Otherwise text is only
        # built per token when stop strings need it, and in one decode at the end when not.
        self.stream_text = False
        # Structured output: its matcher (common/engine/grammar.RequestGrammar), set by the engine
        # that samples it (rank 0), which accepts every token the request keeps.
        self.grammar = None

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence, counting sampled-but-unseen (pending) ones."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def spec_ahead(self) -> int:
        """Positions past seq_len - 1 the latest launched step may write: its drafts, when it is a verify
        step in flight (seq_len counts it as one token; it may keep len(drafts) more)."""
        return len(self.spec_inflight[-1][1]) if self.pending and self.spec_inflight else 0

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, seen or pending: the step of the next sample."""
        return len(self.output_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fill_ids(self) -> list[int]:
        """The tokens the host knows (pending ones excluded)."""
        return self.prompt_ids + self.output_ids

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, row={self.req_pool_idx})"

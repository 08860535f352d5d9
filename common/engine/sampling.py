"""Batched sampling on the device, with no host sync.

`SamplingBatchInfo.from_reqs` turns the requests' parameters into device tensors once per batch,
plus host-side flags that let `sample` skip whatever no row needs (an all-greedy batch is one
argmax). Per row, in order: repetition/frequency/presence penalties -> logit_bias -> the grammar's
token mask -> min_new_tokens masking of EOS and stop ids -> greedy rows take the argmax; the
others: temperature -> top-k -> top-p -> min-p -> the exponential race `argmax(p / q)`, q ~ Exp(1).
Logprobs are of the raw logits.

The noise q is a counter-based hash of (seed, step, token id) computed with int64 tensor ops, so a
seeded request draws the same tokens whatever else is in the batch and in whatever order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.engine.grammar import apply_bitmask
from pdserve.common.engine.overlap import h2d
from pdserve.common.types import Req, SamplingParams, TokenLogprob

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective 32-bit integer hash; works on Python ints and on int64 tensors alike.

    Values are kept to 32 bits, so every product stays below 2**59: int64 never overflows.
    """
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int, step: int) -> int:
    """The 32-bit noise key of one request at one output step (host side)."""
    return step_key(seed_key(seed), step)


def seed_key(seed: int) -> int:
    """The part of row_key that depends on the seed alone."""
    seed %= 2**64  # seeds may come in signed
    return _mix32(_mix32((seed & _MASK32) ^ 0x9E3779B9) ^ (seed >> 32))


def step_key(key, step):
    """row_key from seed_key(seed) and the step: ints, or int64 tensors on the device (an overlapped verify
    step's steps move there: common/engine/speculative/overlap.py)."""
    # The round after the step keeps keys from having the token hash's form, mix(x ^ constant):
    # with it, noise(token t, step s) would equal noise(token s', step t') for s' = t ^ c, t' = s ^ c.
    return _mix32(_mix32(key ^ (step & _MASK32)) ^ 0x85EBCA6B)


def noise_step(req) -> int:
    """The output step of `req`'s next sample as the uninterrupted run counts it: the output tokens an
    earlier server produced (SamplingParams.resumed_output_tokens, the prompt's tail) come first, so
    a moved stream draws its seed's noise of the same steps. (`req`: a Req, or a verify row, AtStep.)"""
    return req.params.resumed_output_tokens + req.num_sampled


def penalized_output(req) -> list[int]:
    """The output tokens frequency and presence penalties count: an earlier server's (the prompt's last
    SamplingParams.resumed_output_tokens), then this server's."""
    k = req.params.resumed_output_tokens
    # NOTE not prompt_ids[-k:]: with k == 0 that is the whole prompt.
    return req.prompt_ids[len(req.prompt_ids) - k :] + req.output_ids if k else req.output_ids


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] float32 from row keys [B, 1]: a hash of (key, token id)."""
    # Token ids are hashed before the key is mixed in: `mix(token ^ key)` would give two rows whose
    # keys differ only in low bits the same noise, permuted among token ids.
    token_hash = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=keys.device) ^ 0x27D4EB2F)
    bits = _mix32(token_hash ^ keys)
    # 24 bits are exact in float32. u is in [2**-24, 1 - 2**-24]: never 0 or 1, so q is finite and
    # > 0 (q == 0 would make p / q inf or NaN, and argmax prefers NaN).
    u = (bits >> 8).clamp_(min=1).to(torch.float32) * 2.0**-24
    return -torch.log(u)


F32_TINY = 1.1754944e-38  # float32's smallest normal number


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling state. Tensors are on the device, and None when no row needs them."""

    batch_size: int
    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; only for a batch that mixes greedy and sampled rows
    temperatures: torch.Tensor | None  # [B, 1] float32; 1.0 on greedy rows
    top_ks: torch.Tensor | None  # [B, 1] int64; vocab_size where disabled
    top_ps: torch.Tensor | None  # [B, 1] float32; inf where disabled
    min_ps: torch.Tensor | None  # [B, 1] float32; 0.0 where disabled
    noise_keys: torch.Tensor | None  # [B, 1] int64: row_key(seed, step)
    repetition_penalties: torch.Tensor | None  # [B, 1] float32; 1.0 where disabled
    seen_token_idx: torch.Tensor | None  # [N] flat indices (row * V + token) of prompt + output tokens
    frequency_penalties: torch.Tensor | None  # [B, 1] float32
    presence_penalties: torch.Tensor | None  # [B, 1] float32
    output_token_idx: torch.Tensor | None  # [M] flat indices of output tokens, repeats kept (counts)
    banned_token_idx: torch.Tensor | None  # [K] flat indices masked to -inf by min_new_tokens
    want_logprobs: bool
    top_logprobs_k: int  # the largest top-n asked for in the batch; 0 for none
    bias_idx: torch.Tensor | None = None  # [L] flat indices of logit_bias tokens
    bias_values: torch.Tensor | None = None  # [L] float32: their biases
    # An overlapped verify step's sampled rows: seed_key and step of each row [B, 1] int64, for noise keys
    # made again on the device once the steps have moved (common/engine/speculative/overlap.py).
    seed_keys: torch.Tensor | None = None
    steps: torch.Tensor | None = None

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, eos_token_ids: tuple[int, ...], device) -> "SamplingBatchInfo":
        """Builds the batch's tensors. The sample step (noise: noise_step) and min_new_tokens count pending
        tokens too (req.num_sampled); penalties need the token values, so a batch with penalties
        must not have pending tokens (the overlap loop runs such batches serially)."""
        params = [req.params for req in reqs]
        if all(p.plain_greedy for p in params):
            # The common decode batch (and every benchmark's): no per-row lists, no uploads.
            return cls.plain_greedy(len(reqs), vocab_size)
        return cls.build(reqs, params, vocab_size, eos_token_ids, torch.device(device))

    @classmethod
    def plain_greedy(cls, batch_size: int, vocab_size: int) -> "SamplingBatchInfo":
        """What build() gives a batch of plain greedy requests: argmax, nothing else."""
        return cls(
            batch_size=batch_size,
            vocab_size=vocab_size,
            all_greedy=True,
            greedy=None,
            temperatures=None,
            top_ks=None,
            top_ps=None,
            min_ps=None,
            noise_keys=None,
            repetition_penalties=None,
            seen_token_idx=None,
            frequency_penalties=None,
            presence_penalties=None,
            output_token_idx=None,
            banned_token_idx=None,
            want_logprobs=False,
            top_logprobs_k=0,
        )

    @classmethod
    def build(
        cls, reqs: list[Req], params: list[SamplingParams], vocab_size: int, eos_token_ids: tuple[int, ...], device
    ) -> "SamplingBatchInfo":
        sampled = [not p.greedy for p in params]
        all_greedy = not any(sampled)

        def upload(needed: bool, data, dtype):
            return h2d(data, dtype, device) if needed else None

        def column(needed: bool, values, dtype):
            return upload(needed, [[v] for v in values], dtype)

        # Greedy rows get neutral sampling parameters: their draw is computed, then discarded.
        temperatures = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
        top_ks = [p.top_k if s and 0 < p.top_k < vocab_size else vocab_size for p, s in zip(params, sampled)]
        # NOTE at least float32's smallest normal: a top_p below it (1e-72 is a valid request) would be
        # 0 on the device, and `mass before >= 0` would drop even the top token (all zero: token 0).
        top_ps = [max(p.top_p, F32_TINY) if s and p.top_p < 1.0 else float("inf") for p, s in zip(params, sampled)]
        min_ps = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]

        seen, counted, banned, biased, biases = [], [], [], [], []
        for row, req in enumerate(reqs):
            base, p = row * vocab_size, req.params
            for token, bias in p.logit_bias:
                if token < vocab_size:  # (the API checks ids against the vocabulary)
                    biased.append(base + token)
                    biases.append(bias)
            if p.repetition_penalty != 1.0:
                seen += [base + t for t in set(req.prompt_ids) | set(req.output_ids)]
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                counted += [base + t for t in penalized_output(req)]
            if req.num_sampled < p.min_new_tokens:
                # EOS is masked even with ignore_eos; an out-of-vocab stop id can never be drawn.
                banned += [base + t for t in set(eos_token_ids) | set(p.stop_token_ids) if t < vocab_size]

        return cls(
            batch_size=len(reqs),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy=upload(not all_greedy and not all(sampled), [not s for s in sampled], torch.bool),
            temperatures=column(not all_greedy, temperatures, torch.float32),
            top_ks=column(any(k < vocab_size for k in top_ks), top_ks, torch.int64),
            top_ps=column(any(p < float("inf") for p in top_ps), top_ps, torch.float32),
            min_ps=column(any(m > 0.0 for m in min_ps), min_ps, torch.float32),
            noise_keys=None
            if all_greedy
            else column(True, [row_key(r.seed, noise_step(r)) for r in reqs], torch.int64),
            repetition_penalties=column(bool(seen), [p.repetition_penalty for p in params], torch.float32),
            seen_token_idx=upload(bool(seen), seen, torch.int64),
            frequency_penalties=column(bool(counted), [p.frequency_penalty for p in params], torch.float32),
            presence_penalties=column(bool(counted), [p.presence_penalty for p in params], torch.float32),
            output_token_idx=upload(bool(counted), counted, torch.int64),
            banned_token_idx=upload(bool(banned), banned, torch.int64),
            want_logprobs=any(p.logprobs is not None for p in params),
            top_logprobs_k=min(max((p.logprobs or 0 for p in params), default=0), vocab_size),
            bias_idx=upload(bool(biased), biased, torch.int64),
            bias_values=upload(bool(biased), biases, torch.float32),
        )


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64, on the device
    logprobs: torch.Tensor | None  # [B] float32: raw log-softmax at the sampled token
    top_logprob_ids: torch.Tensor | None  # [B, K] int64, K = the batch's largest top-n
    top_logprobs: torch.Tensor | None  # [B, K] float32, descending


def process_logits(
    logits: torch.Tensor, info: SamplingBatchInfo, grammar_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Steps 1-4: penalties, logit_bias, the grammar's token mask, then min_new_tokens masking.
    Returns a new tensor; `logits` is untouched (logprobs are of the raw distribution)."""
    batch, vocab = logits.shape
    if info.seen_token_idx is not None:
        seen = torch.zeros(batch * vocab, dtype=torch.bool, device=logits.device)
        seen = seen.index_fill_(0, info.seen_token_idx, True).view(batch, vocab)
        p = info.repetition_penalties
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if info.output_token_idx is not None:
        counts = torch.zeros(batch * vocab, dtype=torch.float32, device=logits.device)
        ones = torch.ones_like(info.output_token_idx, dtype=torch.float32)
        counts = counts.index_add_(0, info.output_token_idx, ones).view(batch, vocab)
        logits = logits - counts * info.frequency_penalties - (counts > 0) * info.presence_penalties
    if info.bias_idx is not None:
        logits = logits.flatten().index_add(0, info.bias_idx, info.bias_values).view(batch, vocab)
    if grammar_mask is not None:
        logits = apply_bitmask(logits, grammar_mask)
    if info.banned_token_idx is not None:
        banned = logits.flatten().index_fill(0, info.banned_token_idx, float("-inf")).view(batch, vocab)
        if grammar_mask is None:
            return banned
        # A complete grammar allows only EOS, which min_tokens bans: such a row would have no token
        # left. The grammar wins there (the output stays valid; it ends before min_tokens).
        return torch.where(torch.isneginf(banned).all(dim=-1, keepdim=True), logits, banned)
    return logits


def _top_k_top_p(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    # Stable, so which of several tied tokens top-k keeps depends only on the row itself.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if info.top_ks is not None:
        rank = torch.arange(probs.shape[-1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(rank >= info.top_ks, 0.0)
    if info.top_ps is not None:
        cumulative = sorted_probs.cumsum(dim=-1)
        # Keep a token while the mass ranked above it is short of top_p (of what top-k kept), so
        # the top token always stays. top_p = 1 rows carry inf: a float cumsum can reach the total
        # before the tail.
        mass_before = cumulative - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= info.top_ps * cumulative[:, -1:], 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    # NOTE: +inf is clamped to float32's largest: a repetition penalty below float32's range (1e-263 is
    # valid) is 0 on the device and divides a seen token's positive logit to +inf, and softmax of two
    # +inf is NaN, whose argmax is token 0 whatever the grammar allows (found by the API fuzzer). The
    # largest finite logits share the row's mass instead; -inf (masked tokens) stays.
    scaled = (logits / info.temperatures).clamp(max=torch.finfo(torch.float32).max)
    probs = torch.softmax(scaled, dim=-1)
    if info.top_ks is not None or info.top_ps is not None:
        probs = _top_k_top_p(probs, info)
    if info.min_ps is not None:
        probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * info.min_ps, 0.0)
    # No renormalization: scaling a row of p does not change argmax(p / q).
    return (probs / exponential_noise(info.noise_keys, logits.shape[-1])).argmax(dim=-1)


def greedy_argmax(logits: torch.Tensor, grammar_mask: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the vocab (of the tokens `grammar_mask` allows); on CUDA one Triton program per
    row, which applies the mask as it reads (torch's reduction reads big logits at a fraction of
    the bandwidth; a masked copy costs a kernel and a pass). Both return the first maximal index."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
        from pdserve.common.engine.models.triton_ops import argmax_rows  # lazy: Triton reads TRITON_INTERPRET

        return argmax_rows(logits, bitmask=grammar_mask)
    if grammar_mask is not None:
        logits = apply_bitmask(logits, grammar_mask)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, info: SamplingBatchInfo, grammar_mask: torch.Tensor | None = None) -> SampleOutput:
    """Next token per row of `logits` [B, V], any float dtype (rows in the order of the batch's
    reqs); no host sync. Logprobs and sampling work in float32. `grammar_mask`: the allowed
    tokens per row as an int32 bitmask [B, ceil(V / 32)] on the device (common/engine/grammar.py)."""
    plain_greedy = info.all_greedy and not info.want_logprobs and info.seen_token_idx is None
    if plain_greedy and info.output_token_idx is None and info.banned_token_idx is None and info.bias_idx is None:
        # Upcasting is exact, so the argmax of the model-dtype logits is the float32 one's; it
        # reads half the bytes and skips the cast (a 128 x 128k-vocab batch: ~70 us per step).
        # Masking is exact in any dtype too.
        return SampleOutput(greedy_argmax(logits, grammar_mask), None, None, None)
    raw = logits.float()
    logits = process_logits(raw, info, grammar_mask)
    if info.all_greedy:
        next_ids = greedy_argmax(logits)
    else:
        next_ids = _sample_rows(logits, info)
        if info.greedy is not None:
            next_ids = torch.where(info.greedy, logits.argmax(dim=-1), next_ids)
    out = SampleOutput(next_ids, None, None, None)
    if info.want_logprobs:
        logprobs = torch.log_softmax(raw, dim=-1)
        out.logprobs = logprobs.gather(1, next_ids[:, None]).squeeze(1)
        if info.top_logprobs_k > 0:
            out.top_logprobs, out.top_logprob_ids = logprobs.topk(info.top_logprobs_k, dim=-1)
    return out


def to_token_logprobs(out: SampleOutput, reqs: list[Req]) -> list[TokenLogprob | None]:
    """Host side: one TokenLogprob per req that asked for logprobs (top n as it asked), else None.

    Reads the tensors with .tolist(): this waits for the device unless they were copied to the host.
    """
    if out.logprobs is None:
        return [None] * len(reqs)
    token_ids = out.next_token_ids.tolist()
    logprobs = out.logprobs.tolist()
    top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[TokenLogprob | None] = []
    for row, req in enumerate(reqs):
        n = req.params.logprobs
        if n is None:
            result.append(None)
            continue
        top = list(zip(top_ids[row][:n], top_lps[row][:n])) if n > 0 else []
        result.append(TokenLogprob(token_ids[row], logprobs[row], top))
    return result

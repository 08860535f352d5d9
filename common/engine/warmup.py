"""The model runner's warm-up: dummy prefill (and verify) batches before the first request."""

from __future__ import annotations

import itertools
import time

import torch

from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.grammar import apply_bitmask, bitmask_words
from pdserve.common.engine.sampling import SamplingBatchInfo, greedy_argmax, sample
from pdserve.common.scheduling.batch import ForwardMode


@torch.inference_mode()
def warmup(runner, chunk_tokens: int) -> float:
    """Run the prefill path (forward and greedy sampling) on dummy batches, so the first requests
    a server takes do not pay for kernel compilation and allocator growth; returns the seconds.

    Triton compiles a kernel again for each new specialization of its integer arguments (equal
    to 1, divisible by 16), and the caching allocator grows on the first big batch: on a fresh
    GPU server the first burst of requests ran at half speed without this. The batches write
    their KV to slot 0 and read through the pad row, as padded CUDA-graph rows do, so the pools
    are left as they were.
    """
    start = time.perf_counter()
    longest = min(runner.req_to_token_pool.context_len, max(chunk_tokens, 1))
    shapes = [[1], [7], [16], [5, 27], [64, 64, 48], [min(1024, longest)] * max(1, min(chunk_tokens // 1024, 256))]
    verify = [[1 + runner.config.num_speculative_tokens] * 3] if runner.config.speculative else []
    for i, lens in enumerate(shapes + verify):  # (and an eager verify step's: every position sampled)
        lens = [min(n, longest) for n in lens]
        batch = dummy_extend(runner, lens)
        batch.verify = i >= len(shapes)
        logits = runner.forward(batch, batch.input_ids)
        sample(logits, SamplingBatchInfo.plain_greedy(logits.shape[0], runner.vocab_size))
    if runner.device.type == "cuda":
        warm_masked_sampling(logits)
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def warm_masked_sampling(logits: torch.Tensor) -> None:
    """Compile the two Triton kernels a grammar's step uses (the argmax that reads a token bitmask,
    xgrammar's bitmask fill of a sampled row's logits), so the first structured request does not
    pay for them: on an H200 that request took seconds more than the next. Skipped without xgrammar
    (no grammar is ever served then)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    mask = torch.full((logits.shape[0], bitmask_words(logits.shape[1])), -1, dtype=torch.int32, device=logits.device)
    greedy_argmax(logits, mask)
    apply_bitmask(logits, mask)


def dummy_extend(runner, lens: list[int]) -> ForwardBatch:
    """An extend batch of `lens` tokens per request through the pad row, its KV to slot 0."""
    device, pad = runner.device, runner.req_to_token_pool.pad_row
    starts = [0, *itertools.accumulate(lens)][:-1]
    tokens = sum(lens)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        reqs=[],
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device),
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.full((len(lens),), pad, dtype=torch.int64, device=device),
        seq_lens=list(lens),
        extend_lens=list(lens),
        extend_starts=starts,
        req_rows=[pad] * len(lens),
        last_indices=torch.tensor([s + n - 1 for s, n in zip(starts, lens)], dtype=torch.int64, device=device),
        samples=[True] * len(lens),
        has_placeholders=False,
    )

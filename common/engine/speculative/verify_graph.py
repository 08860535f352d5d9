"""CUDA graphs for verify steps (speculative decoding): one captured forward per padded token count.

A verify step is the decode step of its requests as an EXTEND batch of 1 + k_i positions each, whose
every position is sampled. Run eagerly, its few hundred kernels are launched one by one from Python,
and at small batch the host's launches, not the device, set the step's time: the verify step would
cost several plain (graph-replayed) decode steps and no acceptance could pay for it.

The prefill graphs' runner does the capture (common/engine/prefill_graph.py: its static buffers, its
padding rules, its `capture=False` eager mode for the CPU tests), with `keep_all`: what a graph
captures is

    input ids -> model -> logits of every position [T, vocab]

and `replay` returns the batch's n rows, request after request, each request's last token and then
its drafts: the order of the verify step's sampling rows (common/engine/speculative/step.py).

The token counts captured follow the decode graphs' batch sizes: T = (1 + k) × bs for each captured
decode batch size bs up to the largest verify batch (the decode graphs' largest, and no more than
--speculative-max-batch: larger steps never speculate). A step whose requests have fewer drafts than k
replays the smallest T at least its token count. Verify and decode graphs share one memory pool
(never replayed at once).
"""

from __future__ import annotations

from pdserve.common.engine.cuda_graph import capture_sizes
from pdserve.common.engine.prefill_graph import PrefillGraphRunner


def verify_capture_sizes(max_bs: int, positions: int) -> list[int]:
    """Token counts to capture: `positions` (1 + k) per request of each decode capture size up to max_bs."""
    return [bs * positions for bs in capture_sizes(max_bs)]


class VerifyGraphRunner(PrefillGraphRunner):
    """Verify steps of at most `max_bs` requests and `positions` (1 + k) positions each."""

    keep_all = True

    def __init__(self, runner, max_bs: int, positions: int, pool=None, capture: bool = True):
        self.positions = positions
        super().__init__(runner, max_bs * positions, max_reqs=max_bs, pool=pool, capture=capture)

    def capture_sizes(self, max_tokens: int) -> list[int]:
        return verify_capture_sizes(self.max_reqs, self.positions)


def capture_verify_graphs(runner, speculates: bool) -> VerifyGraphRunner | None:
    """The verify graphs of a runner whose engine speculates and replays decode graphs, else None."""
    c = runner.config
    if not speculates or runner.cuda_graphs is None:
        return None
    max_bs = runner.cuda_graphs.max_bs
    if c.speculative_max_batch > 0:  # (larger steps never speculate)
        max_bs = min(max_bs, c.speculative_max_batch)
    return VerifyGraphRunner(runner, max_bs, 1 + c.num_speculative_tokens, pool=runner.cuda_graphs.pool)

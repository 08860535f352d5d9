"""The overlapped verify step's parts (common/engine/speculative/overlap.py, NgramIndex.propose_after): what a
verify step leaves in the FutureMap, how the next step's positions, KV slots and lengths move by it, and
when its drafts are dropped. The engine-level checks (every token the plain engine's, overlap on and off)
are in test_speculative_engine.py and test_verify_graph.py."""

import random
from types import SimpleNamespace

import torch

from pdserve.common.engine.overlap import FutureMap
from pdserve.common.engine.speculative import overlap
from pdserve.common.engine.speculative.ngram import NgramIndex
from pdserve.common.scheduling.batch import AfterStep


def test_propose_after_is_propose_on_the_extended_tokens_and_leaves_the_index_as_it_was():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 30))]
        extra = [rng.randint(0, 4) for _ in range(rng.randint(0, 6))]
        index, extended = NgramIndex(1, 3), NgramIndex(1, 3)
        index.extend(tokens)
        extended.extend(tokens + extra)
        m = rng.randint(1, 6)
        assert index.propose_after(extra, m) == extended.propose(m), (tokens, extra, m)
        assert index.tokens == tokens


def _spec(afters, drafts, starts):
    batch = SimpleNamespace(drafts=drafts, batch_size=len(drafts), after=afters)
    packed = torch.from_numpy(overlap.VerifySpec.plan(batch, starts))
    num_tokens = sum(len(d) + 1 for d in drafts)
    return overlap.VerifySpec.views(packed, len(drafts), num_tokens, overlap.moves(batch))


def test_a_verify_step_stores_each_requests_count_and_the_token_after_its_accepted_drafts():
    """Request 0 keeps 2 of its 3 drafts (its bonus: the sample at its third position), request 1 has none
    (its bonus: its one sample), request 2 keeps both of its 2."""
    fm = FutureMap(8, torch.device("cpu"))
    spec = _spec([None] * 3, [[10, 11, 12], [], [20, 21]], [0, 4, 5])
    samples = torch.tensor([10, 11, 99, 98, 42, 20, 21, 7])
    slots = fm.alloc(3)
    overlap.store(fm, slots, samples, spec)
    assert fm.counts[slots].tolist() == [2, 0, 2] and fm.buf[slots].tolist() == [99, 42, 7]
    fm.store(fm.alloc(3), torch.tensor([1, 2, 3]))  # a plain step: counts are not written...
    fm.counts_read = True
    plain = fm.alloc(3)
    fm.counts[plain] = 5
    fm.store(plain, torch.tensor([1, 2, 3]))  # ...unless a verify step may read them: then 0
    assert fm.counts[plain].tolist() == [0, 0, 0]


def test_the_next_step_moves_by_the_count_and_drops_drafts_that_continued_a_wrong_guess():
    """Step N (in flight when N+1 was built) kept 2 drafts of request 0 and 3 of request 1, whose bonus
    tokens were 50 and 60. N+1 was built as if N kept none (positions 10.. and 20..): on the device its
    positions, KV slots and lengths move by 2 and 3, its input ids become the bonus tokens, and request 1's
    drafts, built on a guess of 61 after all 3 kept, are dropped; request 0's (guess 50, both kept) hold."""
    fm = FutureMap(8, torch.device("cpu"))
    prev = fm.alloc(2)
    fm.store(prev, torch.tensor([50, 60]), torch.tensor([2, 3]))
    afters = [AfterStep(prev[0], [1, 2], 50, 0), AfterStep(prev[1], [3, 4, 5], 61, 0)]
    spec = _spec(afters, [[51, 52], [62]], [0, 3])
    req_to_token = torch.arange(2 * 64).view(2, 64) + 1000  # slot of (row, position): 1000 + 64 row + position
    batch = SimpleNamespace(
        spec=spec,
        input_ids=torch.tensor([-prev[0], 51, 52, -prev[1], 62]),
        positions=torch.tensor([10, 11, 12, 20, 21]),
        out_cache_loc=torch.zeros(5, dtype=torch.int64),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens_dev=torch.tensor([13, 22]),
        seq_lens=[13, 22],
        has_placeholders=True,
    )
    overlap.resolve(batch, fm, req_to_token, host_lens=False)
    assert batch.input_ids.tolist() == [50, 51, 52, 60, 62] and not batch.has_placeholders
    assert batch.positions.tolist() == [12, 13, 14, 23, 24]
    assert batch.out_cache_loc.tolist() == [1012, 1013, 1014, 1087, 1088]
    assert batch.seq_lens_dev.tolist() == [15, 25] and batch.seq_lens == [13, 22]  # (host_lens: read back)
    assert spec.num_drafts.tolist() == [2, 0]
    overlap.resolve(batch, fm, req_to_token, host_lens=True)
    assert batch.seq_lens == batch.seq_lens_dev.tolist()
    # Its result: request 0 keeps both drafts, request 1 (drafts dropped) only its first sample.
    slots = fm.alloc(2)
    overlap.store(fm, slots, torch.tensor([51, 52, 53, 62, 63]), spec)
    assert fm.counts[slots].tolist() == [2, 0] and fm.buf[slots].tolist() == [53, 62]


def test_range_writes_map_every_position_a_moved_step_may_write():
    """Positions [ends[i], ends[i] + len(the drafts in flight)) of each request, through its pages."""
    reqs = [SimpleNamespace(req_pool_idx=3, pages=[7, 9, 4]), SimpleNamespace(req_pool_idx=5, pages=[2])]
    batch = SimpleNamespace(reqs=reqs, ends=[6, 2], after=[AfterStep(1, [8, 8, 8], -1, 0), None])
    rows, positions, slots = overlap.range_writes(batch, page_size=4)
    assert rows.tolist() == [3, 3, 3] and positions.tolist() == [6, 7, 8]
    assert slots.tolist() == [9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0]
    assert overlap.range_writes(SimpleNamespace(reqs=reqs, ends=[6, 2], after=None), 4) is None

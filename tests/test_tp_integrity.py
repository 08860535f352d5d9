"""The KV integrity check (--kv-integrity-check) on a decode server with TP 2: each WRITE is summed on the
rank it landed on (decode/kv_checks.py; rank 1 answers rank 0's CheckKV), against its sender rank's sum.

Engine level, as tests/test_tp_disagg.py: prefill and decode engines in this process, their other TP
ranks real processes (gloo), KV moved by real NIXL (DRAM) WRITEs. Greedy output equals transformers'
with the check on; a WRITE into rank 1's pool whose pages are not its sender's (the sender's sum made
wrong by the fault hook, common/kv_transfer/faults.py, as if bytes had changed on the way) fails its
request with KV_TRANSFER_FAILED before a token is decoded, and the KV returns to idle on every rank.
The bookkeeping of the questions to other ranks is tested exactly without processes.
"""

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.tp_messages import CheckKV, KVSum
from pdserve.common.errors import ErrorCode
from pdserve.common.kv_transfer.faults import ENV
from pdserve.common.types import SamplingParams
from pdserve.decode.arrivals import Landing
from pdserve.decode.engine import DecodeEngine
from pdserve.decode.kv_checks import KVChecks
from pdserve.prefill.engine import PrefillEngine
from tests.test_disagg_engines import drive, hf_greedy, make_prompts

BASE = dict(device="cpu", max_total_tokens=4096, page_size=4, max_running_requests=8)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread here and in every rank spawned (they copy rank 0's): tests/test_tp_disagg.py says why."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines(tiny_models, one_thread):
    """name -> engine, each started once; at the end every one must be idle on every rank."""
    model, made = tiny_models("llama"), {}

    def get(name: str, role: str, tp: int, faults: str = "", **kw):
        if name not in made:
            config = EngineConfig(model_path=model, tp_size=tp, **BASE)
            cls = PrefillEngine if role == "prefill" else DecodeEngine
            with pytest.MonkeyPatch.context() as env:
                if faults:  # (read once, by each of its ranks' agents as they start)
                    env.setenv(ENV, faults)
                made[name] = cls(config, f"{name}-{id(made)}", kv_transfer_timeout=30.0, **kw)
        return made[name]

    get.model = model
    yield get
    problems = []
    for name, engine in made.items():
        if not engine.is_idle() or engine.stats()["kv_used_tokens"]:
            problems.append(f"{name} leaked KV: {engine.stats()}")
        if any(engine.ranks_open_transfers()):
            problems.append(f"{name} has transfers open on its other ranks")
        engine.close()
    assert problems == []


def greedy(n):
    return [SamplingParams(max_new_tokens=8, temperature=0)] * n


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_greedy_with_the_check_on_a_tp2_decode_server_matches_transformers(engines, prefill_tp):
    decode = engines("decode-checked", "decode", 2, kv_integrity_check=True)
    prefill = engines(f"prefill-tp{prefill_tp}", "prefill", prefill_tp)
    assert [p.verify_kv for p in decode.kv.pools] == [True, True]  # every rank's pool asks its senders for sums
    prompts = make_prompts(6, seed=prefill_tp)
    completions, results = drive(prefill, decode, prompts, greedy(len(prompts)), seed=prefill_tp)
    assert [completions[f"r{i}"].output_ids for i in range(len(prompts))] == hf_greedy(engines.model, prompts, 8)
    assert all(r.error is None for r in results.values())
    assert decode.checks.asked == {} and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0


def test_pages_on_rank_1_that_are_not_the_senders_fail_the_request_and_free_its_kv(engines):
    """A TP 1 prefill server WRITEs each request's heads to decode rank 0, then to rank 1 (tp_plan.py);
    every other WRITE carries a wrong sum: every rank-1 WRITE. Rank 0's pages pass, rank 1's do not, so
    every request fails before it is decoded, as on TP 1 (the router then moves it: KV_TRANSFER_FAILED),
    and its pages are freed after the write grace."""
    decode = engines("decode-checked", "decode", 2, kv_integrity_check=True)
    prefill = engines("prefill-corrupting", "prefill", 1, faults="corrupt_sum=2")
    prompts = make_prompts(3, seed=7)
    completions, results = drive(prefill, decode, prompts, greedy(len(prompts)), seed=7)
    for i in range(len(prompts)):
        c = completions[f"r{i}"]
        assert c.error_code is ErrorCode.KV_TRANSFER_FAILED and c.output_ids == [], c
        assert "KV integrity check failed" in c.error and "on TP rank 1" in c.error, c.error
    assert decode.rejected == {"checksum": len(prompts)}  # (reported with the next outputs; no channel here)
    assert decode.checks.asked == {} and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0


class FakeWorkers:
    def __init__(self):
        self.sent, self.reports = [], []

    def send_to(self, rank, msg):
        self.sent.append((rank, msg))

    def take(self, kind):
        got, self.reports = self.reports, []
        return got


class FakeAgent:
    def checksum(self, pages, heads):
        return 100 + len(pages)


def test_a_write_on_another_rank_counts_only_once_that_rank_says_its_pages_are_good():
    workers, waiting = FakeWorkers(), {7, 8}
    checks = KVChecks(FakeAgent(), workers, lambda room: [room, room + 1, room + 2])

    def landing(rank, room, checksum):
        return Landing(rank, room, range(rank, rank + 1), 3, 5, None, checksum)

    checks.submit(landing(0, 7, 103), "p")  # rank 0's: summed now
    checks.submit(landing(1, 7, 99), "p")  # rank 1's: asked
    checks.submit(landing(1, 8, 99), "p")
    assert workers.sent == [(1, CheckKV(0, [7, 8, 9], 1, 2)), (1, CheckKV(1, [8, 9, 10], 1, 2))]
    assert checks.done(waiting.__contains__) == [(landing(0, 7, 103), "p", None)]
    assert checks.done(waiting.__contains__) == []  # no answer yet: room 7 is landed, unverified
    workers.reports = [KVSum(1, 0, 98)]
    why = "the pages that landed on TP rank 1 sum to 0x00000062, the sender's to 0x00000063"
    assert checks.done(waiting.__contains__) == [(landing(1, 7, 99), "p", why)]
    # Room 8 stops waiting (its transfer timed out) before rank 1 answers: the question is dropped,
    # and so is the answer when it comes.
    waiting.discard(8)
    checks.forget(waiting.__contains__)
    assert checks.asked == {}
    workers.reports = [KVSum(1, 1, 99)]
    assert checks.done(waiting.__contains__) == []
    # No checksum where the check asked for one; no pages (the prompt was held here): nothing to sum.
    checks.submit(landing(1, 7, None), "q")
    checks.submit(Landing(1, 7, range(1, 2), 0, 5, None, None), "q")
    assert [why for _, _, why in checks.done(waiting.__contains__)] == ["the notification carries no checksum", None]
    assert len(workers.sent) == 2

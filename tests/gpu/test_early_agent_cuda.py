"""A GPU server's NIXL agent made on a thread while its model loads (common/kv_transfer/early_agent.py):
the KV agent over the pool takes that agent, and a pair of them still transfers."""

import time

import torch

from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.kv_transfer import early_agent
from pdserve.common.kv_transfer.base import TransferState
from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent


def test_the_kv_agent_takes_the_agent_begun_early_and_transfers():
    early_agent.start("early-sender", "cuda")
    early_agent.start("early-sender", "cuda")  # (once per name)
    assert list(early_agent._starting) == ["early-sender"]
    pools = [PagedKVPool(32, 16, 2, 4, 64, torch.bfloat16, "cuda") for _ in range(2)]
    # (one process, one GPU: the pages go by a device copy, the notification through the agents: direct.py)
    sender = NixlKVAgent("early-sender", pools[0])
    receiver = NixlKVAgent("early-receiver", pools[1])  # (made on the spot)
    try:
        assert early_agent._starting == {} and early_agent.take("early-sender") is None
        for b in pools[0].k_storage + pools[0].v_storage:
            b.copy_(torch.randn(b.shape, device="cuda").to(b.dtype))
        sender.add_peer(receiver.metadata())
        handle = sender.write_pages("early-receiver", [1, 2, 3], [5, 6, 7], notif=b"room-1")
        notifs, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:  # (a device copy's notification is sent by the sender's poll)
            state = sender.poll(handle)
            notifs += receiver.get_notifs()
            if notifs and state is TransferState.DONE:
                break
            time.sleep(0.001)
        assert notifs == [("early-sender", b"room-1")] and state is TransferState.DONE
        sender.release(handle)
        for src, dst in zip(pools[0].k_storage + pools[0].v_storage, pools[1].k_storage + pools[1].v_storage):
            assert torch.equal(src[16:64], dst[80:128])  # pages 1-3 -> 5-7, 16 tokens a page
    finally:
        sender.close()
        receiver.close()


def test_a_discarded_start_is_forgotten():
    early_agent.start("early-discarded", "cuda")
    early_agent.discard("early-discarded")
    assert early_agent.take("early-discarded") is None

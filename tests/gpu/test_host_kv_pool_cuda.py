"""The host KV tier's page pool on a GPU: pinned host pages, copies on a side stream that complete
with the returned event, pages exact after the round trip."""

import torch

from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.engine.kv_pool import PagedKVPool


def test_pages_round_trip_on_a_side_stream():
    pool = PagedKVPool(64, 16, 4, 8, 64, torch.bfloat16, "cuda")
    for b in [*pool.k_storage, *pool.v_storage]:
        b.copy_(torch.randn(b.shape, device="cuda").to(torch.bfloat16))
    host = HostKVPool(32, pool)
    assert host.pages.is_pinned()
    source, slots = [5, 6, 7, 40, 2], [10, 11, 12, 3, 30]
    views = [b.view(8, 64, 16, 64) for b in [*pool.k_storage, *pool.v_storage]]
    before = [v[:, source].clone() for v in views]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pages were written on the current stream
    stored = host.store(pool, source, slots, stream=side)
    stored.synchronize()
    for v in views:
        v[:, source] = 0
    target = [50, 51, 52, 53, 54]
    side.wait_stream(torch.cuda.current_stream())
    loaded = host.load(pool, slots, target, stream=side)
    torch.cuda.current_stream().wait_event(loaded)
    for v, b in zip(views, before):
        assert torch.equal(v[:, target], b)

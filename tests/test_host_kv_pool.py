"""The host KV tier's page pool (common/engine/host_kv_pool.py): device pages round-trip through
host memory exactly, into other device pages, whatever runs the host slots form."""

import pytest
import torch

from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.engine.kv_pool import PagedKVPool


def device_pool(num_pages=16, layers=3, heads=2, page=4, dim=8, dtype=torch.float32, seed=0) -> PagedKVPool:
    pool = PagedKVPool(num_pages, page, layers, heads, dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for b in [*pool.k_storage, *pool.v_storage]:
        b.copy_(torch.randn(b.shape, generator=gen).to(dtype))
    return pool


def page_of(pool: PagedKVPool, page: int) -> torch.Tensor:
    """Every layer's K and V of one page: [layers, 2, page, heads, dim]."""
    views = [
        torch.stack([b.view(pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim)[page] for b in (k, v)])
        for k, v in zip(pool.k_storage, pool.v_storage)
    ]
    return torch.stack(views)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_through_host_memory_into_other_pages(dtype):
    pool = device_pool(dtype=dtype)
    host = HostKVPool(8, pool)
    source = [3, 5, 7, 2]
    originals = [page_of(pool, p).clone() for p in source]
    slots = host.alloc(len(source))
    assert slots == [0, 1, 2, 3] and host.num_free() == 4
    assert host.store(pool, source, slots) is None  # the CPU: done on return
    for p in source:  # the device pages go to other requests
        for b in [*pool.k_storage, *pool.v_storage]:
            b.view(pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim)[p] = 0
    untouched = page_of(pool, 9).clone()
    target = [11, 12, 4, 13]
    assert host.load(pool, slots, target) is None
    for p, original in zip(target, originals):
        assert torch.equal(page_of(pool, p), original)
    assert torch.equal(page_of(pool, 9), untouched)  # nothing else written
    assert host.page_bytes == pool.bytes_per_token() * pool.page_size


def test_scattered_host_slots_copy_run_by_run():
    """Slots freed and taken again need not be consecutive: each run of them is one copy, and the
    pages land in the given order."""
    pool = device_pool()
    host = HostKVPool(6, pool)
    taken = host.alloc(6)
    host.free([taken[1], taken[4], taken[2]])
    assert host.alloc(3) == [2, 4, 1]  # the freed ones, most recent first
    slots, source = [4, 1, 2, 5], [6, 8, 10, 3]  # runs: [4], [1, 2], [5]
    host.store(pool, source, slots)
    for slot, p in zip(slots, source):
        assert torch.equal(host.pages[slot], page_of(pool, p))
    host.load(pool, slots[::-1], [14, 15, 1, 9])
    for p, q in zip([14, 15, 1, 9], source[::-1]):
        assert torch.equal(page_of(pool, p), page_of(pool, q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_launch_copy_moves_what_the_index_copies_do(dtype, monkeypatch):
    """On a GPU one kernel reads and writes the pinned host pages directly (copy_host_pages; here in
    Triton's interpreter over CPU memory): the same bytes as the index copies, pages out of order,
    nothing else written."""
    pool, by_index = device_pool(dtype=dtype), HostKVPool(8, device_pool(dtype=dtype))
    direct = HostKVPool(8, pool)
    monkeypatch.setattr(direct, "_direct", lambda device: True)
    slots, source = [5, 0, 6, 2], [9, 3, 14, 1]
    before = direct.pages.clone()
    direct.store(pool, source, slots)
    by_index.store(pool, source, slots)
    assert torch.equal(direct.pages, by_index.pages)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(direct.pages[untouched], before[untouched])
    others = page_of(pool, 12).clone()
    direct.load(pool, slots[::-1], [4, 11, 13, 7])
    for p, q in zip([4, 11, 13, 7], source[::-1]):
        assert torch.equal(page_of(pool, p), page_of(pool, q))
    assert torch.equal(page_of(pool, 12), others)


def test_sizing_and_refusals():
    pool = device_pool()
    page_bytes = pool.bytes_per_token() * pool.page_size
    host = HostKVPool.for_gb(10 * page_bytes / (1 << 30), pool)
    assert host.num_pages == 10 and not host.pages.is_pinned()  # pinned only for a GPU pool
    assert host.alloc(11) is None and host.num_free() == 10  # nothing taken
    with pytest.raises(ValueError, match="holds no KV page"):
        HostKVPool.for_gb(page_bytes / 2 / (1 << 30), pool)
    slots = host.alloc(2)
    with pytest.raises(ValueError, match="device pages but"):
        host.store(pool, [1, 2, 3], slots)
    with pytest.raises(ValueError, match="not in \\[1, 16\\)"):
        host.store(pool, [0, 2], slots)  # page 0 is the pool's reserved page
    with pytest.raises(ValueError, match="host pages"):
        host.load(pool, [1, 10], [1, 2])
    other = device_pool(heads=4)
    with pytest.raises(ValueError, match="this one holds"):
        host.store(other, [1, 2], slots)
    with pytest.raises(ValueError, match="not in \\[0, 10\\)"):
        host.free([10])


class Done:
    """A copy's event stand-in: complete or not."""

    def __init__(self, complete: bool):
        self.complete = complete

    def query(self) -> bool:
        return self.complete


def test_slots_come_back_as_their_own_copy_completes_whatever_the_issue_order():
    """Loads and write-through stores run on two streams: a later copy may complete first, and its
    slots are free then, while an earlier copy still running keeps its own."""
    pool = device_pool()
    host = HostKVPool(6, pool)
    assert host.write_through and host.store_async(pool, [1, 2], host.alloc(2)) is None  # the CPU: done
    early, late = Done(False), Done(True)
    host.free_after(early, [0])
    host.free_after(late, [1])
    assert host.num_free() == 5  # slot 1 back, slot 0 still being copied
    early.complete = True
    assert host.num_free() == 6
    assert not HostKVPool(2, pool, write_policy="write_back").write_through
    with pytest.raises(ValueError, match="host-kv-write-policy"):
        HostKVPool(2, pool, write_policy="write_around")

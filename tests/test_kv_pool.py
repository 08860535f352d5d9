"""Exact tests of the two-level KV memory: rows, pages, slots."""

import pytest
import torch

from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.scheduling.pages import pages_for, slots_for_positions


def test_req_to_token_rows_are_handed_out_in_order_and_reused_fifo():
    pool = ReqToTokenPool(size=3, context_len=8, device="cpu")
    assert [pool.alloc(), pool.alloc(), pool.alloc()] == [0, 1, 2]
    assert pool.alloc() is None and pool.available() == 0
    pool.free(1)
    pool.free(0)
    assert pool.available() == 2
    assert [pool.alloc(), pool.alloc()] == [1, 0]


def test_req_to_token_write_touches_only_its_row_and_columns():
    pool = ReqToTokenPool(size=2, context_len=6, device="cpu")
    pool.write_slots(torch.tensor([1, 1, 1]), torch.tensor([2, 3, 4]), torch.tensor([7, 8, 9]))
    # The last row is the padding row of CUDA-graph batches: never handed out, always zeros.
    assert pool.req_to_token.tolist() == [[0] * 6, [0, 0, 7, 8, 9, 0], [0] * 6]
    assert pool.pad_row == 2 and sorted([pool.alloc(), pool.alloc()]) == [0, 1] and pool.alloc() is None


def make_kv(num_pages=5, page_size=4):
    return PagedKVPool(num_pages, page_size, num_layers=2, kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")


def test_page_zero_is_reserved_and_pages_come_in_order():
    kv = make_kv()
    assert kv.capacity_pages == 4 and kv.capacity_tokens == 16
    assert kv.alloc_pages(3) == [1, 2, 3]
    assert kv.used_tokens() == 12 and kv.num_free_pages() == 1


def test_failed_alloc_takes_nothing():
    kv = make_kv()
    assert kv.alloc_pages(5) is None
    assert kv.num_free_pages() == 4
    assert kv.alloc_pages(4) == [1, 2, 3, 4]
    assert kv.alloc_pages(1) is None


def test_freed_pages_go_to_the_back_of_the_free_list():
    kv = make_kv()
    first = kv.alloc_pages(2)
    kv.free_pages(first)
    assert kv.alloc_pages(4) == [3, 4, 1, 2]
    kv.free_pages([3, 4, 1, 2])
    assert kv.used_tokens() == 0


def test_set_kv_writes_the_given_slots_of_one_layer():
    kv = make_kv()
    k = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    kv.set_kv(1, torch.tensor([5, 9]), k, -k)
    assert torch.equal(kv.k_buffers[1][5], k[0]) and torch.equal(kv.k_buffers[1][9], k[1])
    assert torch.equal(kv.v_buffers[1][9], -k[1])
    assert kv.k_buffers[0].abs().sum() == 0 and kv.k_buffers[1][6].abs().sum() == 0
    assert kv.bytes_per_token() == 2 * 2 * 2 * 3 * 4


def test_pages_for_and_slots_for_positions():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    # page i holds positions [4i, 4i+4): pages [7, 2] -> positions 0-3 in page 7, 4-7 in page 2
    assert slots_for_positions([7, 2], 0, 6, 4) == [28, 29, 30, 31, 8, 9]
    assert slots_for_positions([7, 2], 3, 5, 4) == [31, 8]


@pytest.mark.parametrize(
    "fraction,no_cache,kv_gb,expected_tokens",
    [
        (0.85, False, 0.0, 1_000_000),  # the measured budget, all of it: the prefix cache can use it
        (0.85, True, 0.0, 8 * 512),  # no prefix cache: more than every running request can never be used
        (0.0, False, 1.0, 8 * 512),  # --kv-cache-memory-gb (the CPU default): capped likewise
    ],
)
def test_kv_capacity_from_memory(fraction, no_cache, kv_gb, expected_tokens):
    from types import SimpleNamespace

    from pdserve.common.engine.model_runner import ModelRunner

    config = SimpleNamespace(
        max_total_tokens=0,
        mem_fraction_static=fraction,
        kv_cache_memory_gb=kv_gb,
        disable_radix_cache=no_cache,
        max_running_requests=8,
        context_length=512,
        page_size=16,
    )
    runner = SimpleNamespace(config=config, _kv_budget_bytes=lambda: 1_000_000 * 64.0)
    assert ModelRunner._kv_pages(runner, bytes_per_token=64) == expected_tokens // 16

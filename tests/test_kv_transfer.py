"""KV transfer layer: page arithmetic, layouts, wire formats, and real NIXL WRITEs between two processes.

The two-process test needs nixl (install it with the torch pin in the same command:
`pip install torch==2.13.0 nixl==1.5.1`); without it that test fails, it does not skip.
"""

import dataclasses
import json
import multiprocessing as mp
import time
import traceback

import numpy as np
import pytest
import torch

from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.kv_transfer import KVLayout, decode_notif, encode_notif, new_room
from pdserve.common.kv_transfer.direct import copy_pages, page_view
from pdserve.common.kv_transfer.notif import with_checksum
from pdserve.common.kv_transfer.pages import Rows, check_pages, coalesce_runs, one_run, page_rows, run_descriptors
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata, decode_pool_metadata, encode_pool_metadata
from pdserve.common.kv_transfer.prepped import page_indices, strided_rows

# Every wait that crosses a process gives up after this long.
TIMEOUT_S = 30.0

LAYOUT = KVLayout(page_size=4, num_layers=3, kv_heads=2, head_dim=8, dtype="float32", num_pages=32)


# ---- page runs and descriptors ----


def test_runs_coalesce_only_when_contiguous_on_both_sides():
    assert coalesce_runs([3, 4, 5], [10, 11, 12]) == [(3, 10, 3)]
    assert coalesce_runs([3, 4, 7], [10, 11, 12]) == [(3, 10, 2), (7, 12, 1)]
    assert coalesce_runs([3, 4, 5], [10, 11, 20]) == [(3, 10, 2), (5, 20, 1)]
    assert coalesce_runs([3, 4, 5, 9], [20, 21, 22, 7]) == [(3, 20, 3), (9, 7, 1)]
    assert coalesce_runs([5, 4, 3], [10, 11, 12]) == [(5, 10, 1), (4, 11, 1), (3, 12, 1)]
    assert coalesce_runs([8], [2]) == [(8, 2, 1)]


def test_whole_pages_are_one_descriptor_a_run_and_head_slices_a_row_a_token():
    layout = KVLayout(page_size=2, num_layers=2, kv_heads=2, head_dim=25, dtype="float32", num_pages=50)
    whole, same = page_rows(layout, range(0, 2), layout, range(0, 2))
    assert whole == same == Rows(1, 400, 0, 400, 400) and whole.whole_pages  # a page: 2 tokens x 2 heads x 100 B
    k_addrs, v_addrs = [10_000, 20_000], [30_000, 40_000]
    descs = run_descriptors(k_addrs, v_addrs, whole, device_id=0, runs=[(3, 2), (7, 1)])
    assert descs == [
        (11_200, 800, 0), (12_800, 400, 0),  # layer 0 K
        (31_200, 800, 0), (32_800, 400, 0),  # layer 0 V
        (21_200, 800, 0), (22_800, 400, 0),  # layer 1 K
        (41_200, 800, 0), (42_800, 400, 0),  # layer 1 V
    ]  # fmt: skip
    # Head 1 of this pool into a pool holding only that head: a row a token on this side.
    half = KVLayout(page_size=2, num_layers=2, kv_heads=1, head_dim=25, dtype="float32", num_pages=9, head_start=1,
                    model_kv_heads=2)  # fmt: skip
    sliced, into = page_rows(layout, range(1, 2), half, range(0, 1))
    assert sliced == Rows(2, 100, 100, 200, 400) and into == Rows(2, 100, 0, 100, 200)
    assert run_descriptors(k_addrs[:1], v_addrs[:1], sliced, device_id=0, runs=[(3, 2)]) == [
        (11_300, 100, 0), (11_500, 100, 0), (11_700, 100, 0), (11_900, 100, 0),  # K: page 3 tokens 0, 1; page 4
        (31_300, 100, 0), (31_500, 100, 0), (31_700, 100, 0), (31_900, 100, 0),  # V
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not as many"):
        page_rows(layout, range(0, 2), half, range(0, 1))


def test_prepared_indices_pair_the_same_pages_as_descriptors():
    """A request's prepared-list indices (prepped.py) name, in order, the pages run_descriptors lists."""
    layout = KVLayout(page_size=2, num_layers=3, kv_heads=2, head_dim=4, dtype="float32", num_pages=10)
    rows = strided_rows([1000, 2000, 3000], [5000, 6000, 7000], layout, device_id=0)
    assert rows.shape == (6, 5) and rows[1].tolist() == [5000, 64, 0, 64, 10]  # layer 0 V: 10 pages of 64 B
    indices = page_indices(layout, [4, 5, 9])
    addresses = [int(rows[i // 10][0] + (i % 10) * 64) for i in indices]
    whole, _ = page_rows(layout, range(0, 2), layout, range(0, 2))
    expected = run_descriptors([1000, 2000, 3000], [5000, 6000, 7000], whole, 0, [(4, 1), (5, 1), (9, 1)])
    assert addresses == [a for a, _, _ in expected] and indices.dtype == np.int32


@pytest.mark.parametrize("src_heads,dst_heads", [(range(0, 2), range(0, 2)), (range(1, 2), range(0, 1))])
def test_a_same_gpu_copy_writes_the_bytes_a_nixl_write_would(src_heads, dst_heads):
    """copy_pages (the same-GPU path, here on CPU tensors) against run_descriptors (NIXL's) on the
    same pages and heads: byte for byte the same destination pool."""
    src_layout = KVLayout(page_size=4, num_layers=3, kv_heads=2, head_dim=8, dtype="float32", num_pages=12)
    dst_layout = KVLayout(
        page_size=4,
        num_layers=3,
        kv_heads=len(dst_heads),
        head_dim=8,
        dtype="float32",
        num_pages=9,
        head_start=src_heads.start,
        model_kv_heads=2,
    )
    gen = torch.Generator().manual_seed(0)
    src = [torch.rand(12 * 4, 2, 8, generator=gen) for _ in range(6)]  # K of 3 layers, then V
    copied = [torch.zeros(9 * 4, dst_layout.kv_heads, 8) for _ in range(6)]
    by_descriptor = [b.clone() for b in copied]
    src_pages, dst_pages = [3, 4, 5, 9, 1], [2, 3, 7, 8, 1]
    copy_pages(
        [page_view(b, src_layout) for b in src],
        [page_view(b, dst_layout) for b in copied],
        src_pages,
        dst_pages,
        src_heads,
        range(0, len(dst_heads)),
    )
    runs = coalesce_runs(src_pages, dst_pages)
    rows = page_rows(src_layout, src_heads, dst_layout, range(0, len(dst_heads)))
    src_bytes = [b.view(torch.uint8).flatten() for b in src]
    dst_bytes = [b.view(torch.uint8).flatten() for b in by_descriptor]
    address = lambda buffers: [1_000_000 * i for i in range(len(buffers))]  # noqa: E731 - buffer i at i MB
    local = run_descriptors(address(src)[:3], address(src)[3:], rows[0], 0, [(s, n) for s, _, n in runs])
    remote = run_descriptors(address(copied)[:3], address(copied)[3:], rows[1], 0, [(d, n) for _, d, n in runs])
    for (s_addr, size, _), (d_addr, d_size, _) in zip(local, remote, strict=True):
        assert size == d_size
        s_buf, s_off = divmod(s_addr, 1_000_000)
        d_buf, d_off = divmod(d_addr, 1_000_000)
        dst_bytes[d_buf][d_off : d_off + size] = src_bytes[s_buf][s_off : s_off + size]
    assert all(torch.equal(a, b) for a, b in zip(copied, by_descriptor))
    assert any(bool(b.any()) for b in copied)


@pytest.mark.parametrize("src_heads,dst_heads", [(range(0, 2), range(0, 2)), (range(1, 2), range(0, 1))])
def test_the_one_launch_copy_writes_what_the_per_buffer_copy_does(src_heads, dst_heads):
    """copy_pages_fused (one Triton launch for every buffer, head and page; here in Triton's
    interpreter) against copy_pages, pools of different page counts, pages out of order."""
    from pdserve.common.kv_transfer.page_copy_kernel import address_table, copy_pages_fused

    src_layout = KVLayout(page_size=4, num_layers=3, kv_heads=2, head_dim=8, dtype="float32", num_pages=12)
    dst_layout = KVLayout(page_size=4, num_layers=3, kv_heads=len(dst_heads), head_dim=8, dtype="float32", num_pages=9)
    gen = torch.Generator().manual_seed(1)
    src = [page_view(torch.rand(12 * 4, 2, 8, generator=gen), src_layout) for _ in range(6)]
    by_torch = [page_view(torch.rand(9 * 4, len(dst_heads), 8, generator=gen), dst_layout) for _ in range(6)]
    fused = [b.clone() for b in by_torch]
    src_pages, dst_pages = [3, 4, 5, 9, 1, 11], [2, 3, 7, 8, 0, 5]
    copy_pages(src, by_torch, src_pages, dst_pages, src_heads, dst_heads)
    copy_pages_fused(
        address_table(src),
        address_table(fused),
        torch.tensor(src_pages),
        torch.tensor(dst_pages),
        *page_rows(src_layout, src_heads, dst_layout, dst_heads),
    )
    assert all(torch.equal(a, b) for a, b in zip(fused, by_torch, strict=True))  # (the pages not written too)


@pytest.mark.parametrize("src_heads,dst_heads", [(range(0, 2), range(0, 2)), (range(1, 2), range(0, 1))])
def test_a_run_of_pages_is_copied_without_a_page_index(src_heads, dst_heads):
    """Both sides one run of consecutive pages: copy_pages_fused takes each side's first page (ints)
    and writes what copy_pages does from the page lists, and no page outside the run."""
    from pdserve.common.kv_transfer.page_copy_kernel import address_table, copy_pages_fused

    src_layout = KVLayout(page_size=4, num_layers=2, kv_heads=2, head_dim=8, dtype="float32", num_pages=12)
    dst_layout = KVLayout(page_size=4, num_layers=2, kv_heads=len(dst_heads), head_dim=8, dtype="float32", num_pages=9)
    gen = torch.Generator().manual_seed(2)
    src = [page_view(torch.rand(12 * 4, 2, 8, generator=gen), src_layout) for _ in range(4)]
    by_torch = [page_view(torch.rand(9 * 4, len(dst_heads), 8, generator=gen), dst_layout) for _ in range(4)]
    fused = [b.clone() for b in by_torch]
    src_pages, dst_pages = [7, 8, 9, 10], [1, 2, 3, 4]
    assert one_run(src_pages, dst_pages) and not one_run(src_pages, [1, 2, 3, 5])
    copy_pages(src, by_torch, src_pages, dst_pages, src_heads, dst_heads)
    rows = page_rows(src_layout, src_heads, dst_layout, dst_heads)
    copy_pages_fused(address_table(src), address_table(fused), 7, 1, *rows, run=4)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_torch, strict=True))


def test_the_pool_is_token_major_so_a_page_of_every_head_is_contiguous():
    pool = PagedKVPool(
        4, 2, num_layers=1, kv_heads=3, head_dim=2, dtype=torch.float32, device="cpu", head_start=3, model_kv_heads=6
    )
    pool.k_buffers[0][5] = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # slot 5: page 2, offset 1
    storage = pool.k_storage[0]
    assert storage.is_contiguous() and storage.shape == (8, 3, 2)
    flat = storage.flatten()
    # slot s, head h at (s * 3 + h) * 2; page p is flat[p * 12 : (p + 1) * 12]
    assert flat[(5 * 3 + 0) * 2 : (5 * 3 + 0) * 2 + 2].tolist() == [1.0, 2.0]
    assert flat[(5 * 3 + 2) * 2 : (5 * 3 + 2) * 2 + 2].tolist() == [5.0, 6.0]
    assert flat[2 * 12 : 3 * 12].tolist()[6:] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_page_bytes_follow_the_layout():
    assert LAYOUT.page_bytes == 4 * 2 * 8 * 4
    assert KVLayout(16, 1, 8, 128, "bfloat16", 10).page_bytes == 16 * 8 * 128 * 2
    assert LAYOUT.transfer_bytes(3) == 2 * 3 * 3 * LAYOUT.page_bytes
    assert LAYOUT.transfer_bytes(3, num_heads=1) == 2 * 3 * 3 * 4 * 8 * 4


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([0, 1], [1, 2], "source pages [0]"),
        ([1, 16], [1, 2], "source pages [16]"),
        ([1, 2], [0, 3], "destination pages [0]"),
        ([1, 2], [31, 32], "destination pages [32]"),
        ([1, -1], [1, 2], "source pages [-1]"),
        ([1, 2], [1], "2 source pages but 1 destination pages"),
        ([], [], "no pages"),
        ([1, 2], [5, 5], "appears twice"),
    ],
)
def test_bad_page_lists_are_rejected(src, dst, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_pages(src, dst, src_num_pages=16, dst_num_pages=32)


def test_good_page_lists_pass():
    check_pages([1, 15, 3], [31, 7, 1], src_num_pages=16, dst_num_pages=32)


# ---- layouts ----


def test_layouts_differing_only_in_num_pages_are_compatible():
    assert LAYOUT.compatible_with(KVLayout(4, 3, 2, 8, "float32", num_pages=1000)) is None


def test_pools_holding_different_heads_of_one_model_are_compatible():
    rank1_of_2 = KVLayout(4, 3, 1, 8, "float32", 32, head_start=1, model_kv_heads=2)
    assert LAYOUT.compatible_with(rank1_of_2) is None and rank1_of_2.heads == range(1, 2)
    other_model = KVLayout(4, 3, 1, 8, "float32", 32, head_start=1, model_kv_heads=4)
    assert LAYOUT.compatible_with(other_model) == "model_kv_heads 2 here vs 4 at the peer"


def test_incompatible_layouts_say_what_differs():
    assert LAYOUT.compatible_with(KVLayout(8, 3, 2, 8, "float32", 32)) == "page_size 4 here vs 8 at the peer"
    fp8 = LAYOUT.compatible_with(KVLayout(4, 3, 2, 8, "float8_e4m3fn", 32))
    assert (
        fp8
        == "dtype float32 here vs float8_e4m3fn at the peer; both servers need the same --dtype and --kv-cache-dtype"
    )
    assert LAYOUT.compatible_with(KVLayout(4, 2, 2, 8, "float32", 32)) == "num_layers 3 here vs 2 at the peer"
    assert LAYOUT.compatible_with(KVLayout(4, 3, 4, 8, "float32", 32)) == "model_kv_heads 2 here vs 4 at the peer"
    assert LAYOUT.compatible_with(KVLayout(4, 3, 2, 16, "float32", 32)) == "head_dim 8 here vs 16 at the peer"
    both = LAYOUT.compatible_with(KVLayout(8, 3, 2, 16, "float32", 32))
    assert both == "page_size 4 here vs 8 at the peer; head_dim 8 here vs 16 at the peer"


def test_layout_of_a_pool():
    pool = PagedKVPool(32, 4, 3, 2, 8, torch.float32, "cpu")
    assert KVLayout.of_pool(pool) == LAYOUT


# ---- notifications ----


def test_notif_round_trip():
    room = new_room()
    assert 0 <= room < 1 << 63
    logprobs = {"token": -0.25, "top": [[7, -0.25], [9, -1.5]]}
    assert decode_notif(encode_notif(room, 42, logprobs, 3, 4096)) == {
        "room": room,
        "first_token": 42,
        "logprobs": logprobs,
        "pages": 3,
        "bytes": 4096,
        "heads": None,
        "sum": None,
    }
    largest = (1 << 63) - 1
    assert decode_notif(encode_notif(largest, 0, None, 1, 8, range(2, 4))) == {
        "room": largest,
        "first_token": 0,
        "logprobs": None,
        "pages": 1,
        "bytes": 8,
        "heads": range(2, 4),
        "sum": None,
    }


def test_the_checksum_sees_a_changed_word_a_misplaced_page_and_only_the_heads_moved():
    """integrity.py: equal pages sum alike; a changed word or two pages in swapped places change the
    sum; a WRITE of one head sums alike from a pool holding every head and from one holding that head
    alone (servers of different TP sizes)."""
    from pdserve.common.kv_transfer.integrity import kv_checksum

    gen = torch.Generator().manual_seed(3)
    layout = dataclasses.replace(LAYOUT, num_pages=12)
    full = [page_view(torch.randn(12 * 4, 2, 8, generator=gen), layout) for _ in range(6)]
    copy = [b.clone() for b in full]
    pages = [3, 4, 9]
    assert kv_checksum(full, pages, range(0, 2)) == kv_checksum(copy, pages, range(0, 2))
    assert kv_checksum(full, pages, range(0, 2)) != kv_checksum(full, [4, 3, 9], range(0, 2))
    copy[5].view(torch.int32).view(-1)[4 * 16 * 9 + 7] ^= 1  # one bit of one word of page 9, the last V buffer
    assert kv_checksum(full, pages, range(0, 2)) != kv_checksum(copy, pages, range(0, 2))
    assert kv_checksum(full, [3, 4], range(0, 2)) == kv_checksum(copy, [3, 4], range(0, 2))
    half_layout = KVLayout(page_size=4, num_layers=3, kv_heads=1, head_dim=8, dtype="float32", num_pages=12)
    half = [page_view(b[:, :, 1:2].contiguous(), half_layout) for b in full]
    assert kv_checksum(full, pages, range(1, 2)) == kv_checksum(half, pages, range(0, 1))
    assert kv_checksum(full, [], range(0, 2)) == 0


def test_a_notif_carries_a_checksum_only_of_32_bits():
    notif = encode_notif(5, 1, None, 2, 64)
    assert decode_notif(notif)["sum"] is None
    assert decode_notif(with_checksum(notif, 0xDEADBEEF))["sum"] == 0xDEADBEEF
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError):
            with_checksum(notif, bad)
    with pytest.raises(ValueError, match="checksum"):
        decode_notif(notif[:-1] + b',"sum":"x"}')


def test_bad_notifs_are_rejected():
    with pytest.raises(ValueError, match="63-bit"):
        encode_notif(1 << 63, 1, None, 1, 8)
    with pytest.raises(ValueError, match="63-bit"):
        encode_notif(-1, 1, None, 1, 8)
    fields = '"room": 1, "first_token": 1, "logprobs": null'
    counts = '"pages": 1, "bytes": 8'
    for data in (
        b"\xff\x00",
        b"[1, 2]",
        b'{"v": 1}',
        f'{{"v": 1, {fields}}}'.encode(),  # version 1: no counts
        f'{{"v": 2, {fields}, {counts}}}'.encode(),  # version 2: no heads
        f'{{"v": 3, {fields}, {counts}, "heads": null}}'.encode(),  # version 3: the head-major pool
        f'{{"v": 5, {fields}, {counts}, "heads": null}}'.encode(),
        f'{{"v": 4, {fields}, "pages": -1, "bytes": 8, "heads": null}}'.encode(),
        f'{{"v": 4, {fields}, "pages": 1.5, "bytes": 8, "heads": null}}'.encode(),
        f'{{"v": 4, {fields}, "pages": true, "bytes": 8, "heads": null}}'.encode(),
        f'{{"v": 4, {fields}, {counts}, "heads": [1, 1]}}'.encode(),
        f'{{"v": 4, {fields}, {counts}, "heads": [-1, 1]}}'.encode(),
        f'{{"v": 4, {fields}, {counts}, "heads": [0]}}'.encode(),
        b'{"v": 4, "room": 1, "first_token": "1", "logprobs": null, "pages": 1, "bytes": 8, "heads": null}',
        b'{"v": 4, "room": 1, "first_token": 1, "logprobs": [1], "pages": 1, "bytes": 8, "heads": null}',
    ):
        with pytest.raises(ValueError, match="notification"):
            decode_notif(data)


# ---- pool metadata ----


def make_pool_metadata(**overrides) -> PoolMetadata:
    fields = dict(
        name="decode-0",
        layout=LAYOUT,
        mem_type="DRAM",
        device_id=0,
        k_addrs=(0x7F00_0000_1000, 0x7F00_0000_9000, 0x7F00_0001_1000),
        v_addrs=(0x7F00_0002_1000, 0x7F00_0002_9000, 0x7F00_0003_1000),
        transport_metadata=bytes(range(256)) + b"\x00trailing",
    )
    fields.update(overrides)
    return PoolMetadata(**fields)


def test_pool_metadata_round_trip():
    meta = make_pool_metadata()
    data = encode_pool_metadata([meta])
    assert data.startswith(b"PDKV")
    assert decode_pool_metadata(data) == [meta]
    vram = make_pool_metadata(mem_type="VRAM", device_id=5, transport_metadata=b"")
    assert decode_pool_metadata(encode_pool_metadata([vram])) == [vram]
    # A TP server's ranks, each its own heads and transport blob.
    ranks = [
        make_pool_metadata(
            name=f"decode-0.tp{r}",
            layout=KVLayout(4, 3, 1, 8, "float32", 32, r, 2),
            transport_metadata=bytes([r]) * (r + 3),
        )
        for r in range(2)
    ]
    assert decode_pool_metadata(encode_pool_metadata(ranks)) == ranks
    # A CUDA pool's GPU and IPC handles (common/kv_transfer/same_gpu.py) travel too; older metadata lacks them.
    ipc = make_pool_metadata(
        mem_type="VRAM", gpu_uuid="GPU-1234", ipc_buffers=(("ab01", 4096, 512, "cd", 8, "ef", True, 0),) * 6
    )
    assert decode_pool_metadata(encode_pool_metadata([ipc])) == [ipc]


def test_bad_pool_metadata_is_rejected():
    data = encode_pool_metadata([make_pool_metadata()])
    with pytest.raises(ValueError, match="magic"):
        decode_pool_metadata(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="version 2, this side speaks version 3"):
        decode_pool_metadata(data[:4] + (2).to_bytes(2, "big") + data[6:])
    with pytest.raises(ValueError, match="too short"):
        decode_pool_metadata(data[:5])
    with pytest.raises(ValueError, match="truncated"):
        decode_pool_metadata(data[:20])
    with pytest.raises(ValueError, match="truncated"):
        decode_pool_metadata(data[:-1])  # the transport blob
    with pytest.raises(ValueError, match="3 layers"):
        decode_pool_metadata(encode_pool_metadata([make_pool_metadata(k_addrs=(1, 2))]))
    with pytest.raises(ValueError, match="memory type"):
        decode_pool_metadata(encode_pool_metadata([make_pool_metadata(mem_type="FILE")]))
    with pytest.raises(ValueError, match=r"holds KV heads \[2, 3\) of a model with 2"):
        decode_pool_metadata(
            encode_pool_metadata([make_pool_metadata(layout=KVLayout(4, 3, 1, 8, "float32", 32, 2, 2))])
        )
    with pytest.raises(ValueError, match="no pool"):
        decode_pool_metadata(encode_pool_metadata([]))


# ---- two processes, real NIXL DRAM WRITEs ----

PREFILL_PAGES = 16
SRC_PAGES = [3, 4, 5, 9]
DST_PAGES = [20, 21, 22, 7]
FIRST_TOKEN = 42
LOGPROBS = {"token": -0.5}


def make_pool(num_pages: int, page_size: int = 4) -> PagedKVPool:
    return PagedKVPool(num_pages, page_size, num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")


def prefill_values(layer: int, kind: int) -> torch.Tensor:
    """Exactly representable, non-zero, and different in every slot, layer and K/V (kind 0/1)."""
    shape = (PREFILL_PAGES * 4, 2, 8)
    offset = (2 * layer + kind + 1) * 10_000
    return (torch.arange(shape[0] * shape[1] * shape[2], dtype=torch.float32) + offset).reshape(shape)


def send_json(conn, **message) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn, what: str) -> dict:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"no {what} within {TIMEOUT_S} s")
    message = json.loads(conn.recv_bytes())
    if "error" in message:
        raise AssertionError(f"the other process failed while we waited for {what}:\n{message['error']}")
    return message


def decode_process(conn) -> None:
    """Publish the pool, wait for one notif, send back the notifs and the whole pool, wait to close."""
    try:
        from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent

        pool = make_pool(32)
        agent = NixlKVAgent("decode", pool, verify_kv=True)  # (the sender adds a checksum)
        send_json(conn, metadata=encode_pool_metadata([agent.metadata()]).hex())
        notifs = []
        deadline = time.monotonic() + TIMEOUT_S
        while not notifs and time.monotonic() < deadline:
            notifs = agent.get_notifs()
            time.sleep(0.001)
        send_json(
            conn,
            notifs=[[peer, notif.hex()] for peer, notif in notifs],
            checksum=agent.checksum(DST_PAGES),  # of the pages that landed
            k=[b.numpy().tobytes().hex() for b in pool.k_buffers],
            v=[b.numpy().tobytes().hex() for b in pool.v_buffers],
        )
        recv_json(conn, "close")  # the pool stays registered until the prefill side is done
        agent.close()
    except BaseException:
        send_json(conn, error=traceback.format_exc())


def prefill_process(conn) -> None:
    """WRITE SRC_PAGES into the decode's DST_PAGES, then try what must be refused; report it all."""
    try:
        from pdserve.common.kv_transfer import KVTransferError, TransferState
        from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent

        pool = make_pool(PREFILL_PAGES)
        for layer in range(3):
            pool.k_buffers[layer].copy_(prefill_values(layer, 0))
            pool.v_buffers[layer].copy_(prefill_values(layer, 1))
        agent = NixlKVAgent("prefill", pool)
        order = recv_json(conn, "the decode metadata")
        [decode_metadata] = decode_pool_metadata(bytes.fromhex(order["metadata"]))
        peer = agent.add_peer(decode_metadata)
        peer_again = agent.add_peer(decode_metadata)

        notif = encode_notif(
            order["room"], FIRST_TOKEN, LOGPROBS, len(SRC_PAGES), agent.layout.transfer_bytes(len(SRC_PAGES))
        )
        handle = agent.write_pages(peer, SRC_PAGES, DST_PAGES, notif)
        deadline = time.monotonic() + TIMEOUT_S
        while (state := agent.poll(handle)) is TransferState.IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.0005)
        agent.release(handle)

        refusals = {}
        for label, src, dst in (("page0", [0], [1]), ("beyond_peer", [1], [32])):
            try:
                agent.write_pages(peer, src, dst, b"")
            except ValueError as error:
                refusals[label] = str(error)
        agent.remove_peer(peer)
        try:
            agent.write_pages(peer, [1], [1], b"x")
        except KVTransferError as error:
            refusals["removed_peer"] = str(error)

        other = NixlKVAgent("prefill-page8", make_pool(PREFILL_PAGES, page_size=8))
        try:
            other.add_peer(decode_metadata)
        except ValueError as error:
            refusals["incompatible"] = str(error)
        other.close()
        agent.close()
        send_json(
            conn, peer=peer, peer_again=peer_again, state=state.name, num_bytes=handle.num_bytes, refusals=refusals
        )
    except BaseException:
        send_json(conn, error=traceback.format_exc())


@pytest.fixture(scope="module")
def two_process_run() -> dict:
    try:
        import nixl  # noqa: F401
    except ImportError as error:
        pytest.fail(
            f"nixl is not importable ({error}); install it with the torch pin in the same command: "
            "pip install torch==2.13.0 nixl==1.5.1"
        )
    ctx = mp.get_context("spawn")
    decode_conn, decode_end = ctx.Pipe()
    prefill_conn, prefill_end = ctx.Pipe()
    processes = [
        ctx.Process(target=decode_process, args=(decode_end,), daemon=True),
        ctx.Process(target=prefill_process, args=(prefill_end,), daemon=True),
    ]
    for process in processes:
        process.start()
    room = new_room()
    try:
        decode_metadata = recv_json(decode_conn, "the decode metadata")["metadata"]
        send_json(prefill_conn, metadata=decode_metadata, room=room)
        report = recv_json(prefill_conn, "the prefill report")
        received = recv_json(decode_conn, "the decode side's notifs and pool")
        send_json(decode_conn, close=True)
        for process in processes:
            process.join(TIMEOUT_S)
        exit_codes = [process.exitcode for process in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    assert exit_codes == [0, 0], f"decode, prefill exit codes: {exit_codes}"
    return {"room": room, "received": received, "report": report}


def test_pages_arrive_byte_exact_with_the_notif(two_process_run):
    report, received = two_process_run["report"], two_process_run["received"]
    assert report["peer"] == report["peer_again"] == "decode"
    assert report["state"] == "DONE"
    assert report["num_bytes"] == 2 * 3 * len(SRC_PAGES) * LAYOUT.page_bytes

    assert [peer for peer, _ in received["notifs"]] == ["prefill"]
    notif = decode_notif(bytes.fromhex(received["notifs"][0][1]))
    assert notif == {
        "room": two_process_run["room"],
        "first_token": FIRST_TOKEN,
        "logprobs": LOGPROBS,
        "pages": len(SRC_PAGES),
        "bytes": report["num_bytes"],
        "heads": None,
        "sum": received["checksum"],  # the sender's over its pages, the receiver's over the landed ones
    }

    slots = 4
    for layer in range(3):
        for kind, name in ((0, "k"), (1, "v")):
            raw = bytearray.fromhex(received[name][layer])
            got = torch.frombuffer(raw, dtype=torch.float32).reshape(32 * slots, 2, 8)
            expected = torch.zeros_like(got)
            source = prefill_values(layer, kind)
            for src, dst in zip(SRC_PAGES, DST_PAGES):
                expected[dst * slots : (dst + 1) * slots] = source[src * slots : (src + 1) * slots]
            for page in range(32):
                rows = slice(page * slots, (page + 1) * slots)
                assert torch.equal(got[rows], expected[rows]), f"layer {layer} {name.upper()} page {page} differs"


def test_bad_pages_are_refused_before_any_transfer(two_process_run):
    refusals = two_process_run["report"]["refusals"]
    assert "source pages [0]" in refusals["page0"]
    assert "destination pages [32]" in refusals["beyond_peer"] and "32 pages" in refusals["beyond_peer"]


def test_write_to_a_removed_peer_raises(two_process_run):
    message = two_process_run["report"]["refusals"]["removed_peer"]
    assert "unknown peer 'decode'" in message and "add_peer" in message


def test_incompatible_layout_is_refused_by_add_peer(two_process_run):
    message = two_process_run["report"]["refusals"]["incompatible"]
    assert message == "peer 'decode' has an incompatible KV layout: page_size 8 here vs 4 at the peer"


def restart_process(conn) -> None:
    """A peer that restarts under the same name: re-adding its new metadata replaces the old entry,
    re-adding identical metadata is a no-op, and WRITEs land in the new pool (two agents, one process)."""
    try:
        from pdserve.common.kv_transfer import TransferState
        from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent

        source_pool = make_pool(PREFILL_PAGES)
        source_pool.k_buffers[0].fill_(1.0)
        source = NixlKVAgent("prefill", source_pool)
        first = NixlKVAgent("decode", make_pool(32))
        source.add_peer(first.metadata())
        first.close()
        restarted_pool = make_pool(32)
        restarted = NixlKVAgent("decode", restarted_pool)
        assert restarted.metadata() != first.metadata()
        source.add_peer(restarted.metadata())
        source.add_peer(restarted.metadata())
        handle = source.write_pages("decode", [2], [5], b"again")
        deadline = time.monotonic() + TIMEOUT_S
        state, notifs = TransferState.IN_PROGRESS, []
        # Both ends polled in turn, as the servers' loops do: a DRAM agent has no progress thread,
        # and UCX's wire-up needs the target to progress too.
        while (state is TransferState.IN_PROGRESS or not notifs) and time.monotonic() < deadline:
            if state is TransferState.IN_PROGRESS:
                state = source.poll(handle)
            notifs += restarted.get_notifs()
            time.sleep(0.0005)
        source.release(handle)
        landed = restarted_pool.k_buffers[0][5 * 4 : 6 * 4].eq(1.0).all().item()
        untouched = restarted_pool.k_buffers[0][: 5 * 4].eq(0).all().item()
        source.close()
        restarted.close()
        send_json(conn, state=state.name, notifs=[[p, n.hex()] for p, n in notifs], landed=landed, untouched=untouched)
    except BaseException:
        send_json(conn, error=traceback.format_exc())


def test_a_restarted_peer_is_replaced_by_add_peer():
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    process = ctx.Process(target=restart_process, args=(child_end,), daemon=True)
    process.start()
    try:
        report = recv_json(conn, "the restart report")
        process.join(TIMEOUT_S)
    finally:
        if process.is_alive():
            process.kill()
            process.join()
    assert report == {"state": "DONE", "notifs": [["prefill", b"again".hex()]], "landed": True, "untouched": True}
    assert process.exitcode == 0


def head_slice_process(conn) -> None:
    """Head-sliced WRITEs between pools holding different heads of one model (TP 2 -> TP 1 and
    TP 1 -> TP 2), two agents at a time in one process, both polled."""
    try:
        from pdserve.common.kv_transfer import TransferState
        from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent

        def pool(heads: range) -> PagedKVPool:
            return PagedKVPool(
                16,
                4,
                num_layers=2,
                kv_heads=len(heads),
                head_dim=8,
                dtype=torch.float32,
                device="cpu",
                head_start=heads.start,
                model_kv_heads=2,
            )

        def fill(p: PagedKVPool, base: float) -> None:
            for layer in range(2):
                for buffers, kind in ((p.k_buffers, 0), (p.v_buffers, 1)):
                    n = buffers[layer].numel()
                    buffers[layer].copy_(
                        (torch.arange(n, dtype=torch.float32) + base + 1000 * (2 * layer + kind)).reshape(
                            buffers[layer].shape
                        )
                    )

        def write(src_agent, dst_agent, heads, src_pages, dst_pages):
            peer = src_agent.add_peer(dst_agent.metadata())
            handle = src_agent.write_pages(peer, src_pages, dst_pages, b"n", heads)
            deadline, state, notifs = time.monotonic() + TIMEOUT_S, TransferState.IN_PROGRESS, []
            while (state is TransferState.IN_PROGRESS or not notifs) and time.monotonic() < deadline:
                if state is TransferState.IN_PROGRESS:
                    state = src_agent.poll(handle)
                notifs += dst_agent.get_notifs()
                time.sleep(0.0005)
            src_agent.release(handle)
            return state, handle.num_bytes, notifs

        checks = {}
        # TP 1 -> TP 2: the 2-head pool's head 1 into the pool holding head 1 only.
        full, half = pool(range(0, 2)), pool(range(1, 2))
        fill(full, 0.5)
        a, b = NixlKVAgent("src-full", full), NixlKVAgent("dst-head1", half)
        state, nbytes, _ = write(a, b, range(1, 2), [3, 4, 9], [5, 6, 2])
        ok = state is TransferState.DONE and nbytes == 2 * 2 * 3 * 4 * 8 * 4
        for layer in range(2):
            for src_buf, dst_buf in (
                (full.k_buffers[layer], half.k_buffers[layer]),
                (full.v_buffers[layer], half.v_buffers[layer]),
            ):
                for s_page, d_page in ((3, 5), (4, 6), (9, 2)):
                    ok &= torch.equal(
                        dst_buf[d_page * 4 : (d_page + 1) * 4, 0], src_buf[s_page * 4 : (s_page + 1) * 4, 1]
                    )
                ok &= int((dst_buf != 0).sum()) == 3 * 4 * 8  # nothing else written
        try:
            a.write_pages("dst-head1", [1], [1], b"", range(0, 1))
        except ValueError as e:
            checks["refused"] = str(e)
        checks["tp1_to_tp2"] = bool(ok)
        # TP 2 -> TP 1: the pool holding head 1 into head 1 of a 2-head pool; head 0 untouched.
        src1, whole = pool(range(1, 2)), pool(range(0, 2))
        fill(src1, 0.25)
        c, d = NixlKVAgent("src-head1", src1), NixlKVAgent("dst-full", whole)
        state, nbytes, notifs = write(c, d, None, [7, 8], [1, 2])  # None: all of the source's heads
        ok = state is TransferState.DONE and notifs == [("src-head1", b"n")]
        for layer in range(2):
            for src_buf, dst_buf in (
                (src1.k_buffers[layer], whole.k_buffers[layer]),
                (src1.v_buffers[layer], whole.v_buffers[layer]),
            ):
                ok &= torch.equal(dst_buf[4:12, 1], src_buf[28:36, 0]) and not dst_buf[:, 0].any()
        checks["tp2_to_tp1"] = bool(ok)
        for agent in (a, b, c, d):
            agent.close()
        send_json(conn, **checks)
    except BaseException:
        send_json(conn, error=traceback.format_exc())


def test_head_slices_land_in_the_pools_holding_them():
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    process = ctx.Process(target=head_slice_process, args=(child_end,), daemon=True)
    process.start()
    try:
        report = recv_json(conn, "the head slice report")
        process.join(TIMEOUT_S)
    finally:
        if process.is_alive():
            process.kill()
            process.join()
    assert report.pop("refused") == "KV heads [0, 1) are not all in peer 'dst-head1''s pool (it holds [1, 2))"
    assert report == {"tp1_to_tp2": True, "tp2_to_tp1": True}

"""The Triton attention kernels compiled for CUDA: the CPU cases in bf16/fp16/fp32, serving-sized
shapes in bf16 against the float64 reference, and a decode captured into a CUDA graph and replayed
with other lengths (the way the model runner uses it)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.common.engine.attention.triton_decode import DecodeWorkspace, decode_attention
from pdserve.common.engine.attention.triton_store import store_kv
from tests.test_triton_kernels import (
    DECODE_CASES,
    EXTEND_CASES,
    assert_close,
    build_case,
    reference_attention,
    run_decode,
    run_extend,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_small_cases(name, dtype):
    heads, kv_heads, head_dim, page_size, window, splits, seq_lens = DECODE_CASES[name]
    case = build_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, page_size, dtype, "cuda", num_padded=2)
    scale = head_dim**-0.5
    assert_close(run_decode(case, scale, window, splits), reference_attention(case, scale, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_small_cases(name, dtype):
    heads, kv_heads, head_dim, page_size, window, reqs = EXTEND_CASES[name]
    seq_lens = [prefix + ext for prefix, ext in reqs]
    case = build_case(seq_lens, [ext for _, ext in reqs], heads, kv_heads, head_dim, page_size, dtype, "cuda")
    scale = head_dim**-0.5
    assert_close(run_extend(case, scale, window), reference_attention(case, scale, window), dtype)


# (batch, heads, kv heads, head dim, window, kv splits): decode at ~300-token contexts, page 16.
DECODE_SHAPES = {
    "llama1b-b128": (128, 32, 8, 64, None, 4),
    "llama1b-b1": (1, 32, 8, 64, None, 16),
    "gpt2-b64": (64, 12, 12, 64, None, 8),
    "gqa4-d128-b32": (32, 32, 8, 128, None, 8),
    "gqa8-d80-window": (16, 16, 2, 80, 128, 4),
    "mha-d96-window": (8, 8, 8, 96, 100, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_decode_serving_shapes(name, dtype):
    batch, heads, kv_heads, head_dim, window, splits = DECODE_SHAPES[name]
    rng = random.Random(batch)
    seq_lens = [rng.randint(250, 350) for _ in range(batch)]
    case = build_case(seq_lens, [1] * batch, heads, kv_heads, head_dim, 16, dtype, "cuda", num_padded=3)
    scale = head_dim**-0.5
    assert_close(run_decode(case, scale, window, splits), reference_attention(case, scale, window), dtype)


# (heads, kv heads, head dim, window, [(prefix, extend), ...]): prefill batches, page 16.
EXTEND_SHAPES = {
    "llama1b-128x256": (32, 8, 64, None, [(0, 256)] * 128),
    "gpt2-prefix-mix": (12, 12, 64, None, [(0, 200), (300, 100), (17, 1), (64, 64), (1, 255)] * 4),
    "gqa4-d128": (32, 8, 128, None, [(100, 150), (0, 129), (250, 3)] * 4),
    "gqa8-d80-window": (16, 2, 80, 96, [(200, 130), (0, 256), (5, 40)]),
    "mha-d96-window": (8, 8, 96, 50, [(40, 190), (0, 77)]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(EXTEND_SHAPES))
def test_extend_serving_shapes(name, dtype):
    heads, kv_heads, head_dim, window, reqs = EXTEND_SHAPES[name]
    seq_lens = [prefix + ext for prefix, ext in reqs]
    case = build_case(seq_lens, [ext for _, ext in reqs], heads, kv_heads, head_dim, 16, dtype, "cuda")
    scale = head_dim**-0.5
    assert_close(run_extend(case, scale, window), reference_attention(case, scale, window), dtype)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_cuda(pool_dtype):
    gen = torch.Generator().manual_seed(3)
    k_buf = torch.randn(1000, 8, 64, generator=gen).to("cuda", pool_dtype)
    v_buf = torch.randn(1000, 8, 64, generator=gen).to("cuda", pool_dtype)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    loc = (torch.randperm(999, generator=gen)[:300] + 1).cuda()
    kv = torch.randn(300, 2, 8, 64, generator=gen).cuda()  # fp32, strided k and v
    store_kv(k_buf, v_buf, loc, kv[:, 0], kv[:, 1])
    assert torch.equal(k_buf[loc], kv[:, 0].to(pool_dtype)) and torch.equal(v_buf[loc], kv[:, 1].to(pool_dtype))
    untouched = torch.ones(1000, dtype=torch.bool, device="cuda")
    untouched[loc] = False
    assert torch.equal(k_buf[untouched], k_before[untouched]) and torch.equal(v_buf[untouched], v_before[untouched])


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (12, 12)])
def test_decode_replays_in_a_cuda_graph(heads, kv_heads):
    """Captured once with long contexts, replayed after the lengths and queries change in place;
    the padded rows (seq_len 1, zero row) stay as a padded CUDA-graph batch has them."""
    dtype, head_dim, splits = torch.bfloat16, 64, 8
    rng = random.Random(0)
    seq_lens = [rng.randint(200, 400) for _ in range(13)]
    case = build_case(seq_lens, [1] * 13, heads, kv_heads, head_dim, 16, dtype, "cuda", num_padded=3)
    batch = case.q.shape[0]
    workspace = DecodeWorkspace(batch, heads, head_dim, splits, "cuda")
    out = torch.empty_like(case.q)

    def step():
        decode_attention(
            case.q, case.k_buf, case.v_buf, out, case.req_to_token, case.req_pool_indices, case.seq_lens,
            head_dim**-0.5, None, splits, workspace,
        )  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial in range(3):
        new_lens = [rng.randint(1, n) for n in seq_lens] + [1] * 3
        case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        case.q.copy_(torch.randn(case.q.shape, generator=torch.Generator().manual_seed(trial)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        reference = reference_attention(dataclasses.replace(case, seq_lens_host=new_lens), head_dim**-0.5, None)
        assert_close(out, reference, dtype)


@pytest.mark.parametrize("heads", [(range(0, 12), range(0, 12)), (range(4, 8), range(0, 4))])
def test_the_one_launch_page_copy_matches_the_per_buffer_copy(heads):
    """The same-GPU WRITE's kernel (common/kv_transfer/page_copy_kernel.py) on a GPT-2-small-shaped
    bf16 pool (24 buffers, page 16, head dim 64) against copy_pages, pages in and out of order."""
    from pdserve.common.kv_transfer import KVLayout
    from pdserve.common.kv_transfer.direct import copy_pages, page_view
    from pdserve.common.kv_transfer.page_copy_kernel import address_table, copy_pages_fused
    from pdserve.common.kv_transfer.pages import page_rows

    src_heads, dst_heads = heads
    src_layout = KVLayout(page_size=16, num_layers=12, kv_heads=12, head_dim=64, dtype="bfloat16", num_pages=700)
    dst_layout = dataclasses.replace(src_layout, kv_heads=len(dst_heads), num_pages=500)
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n, pages: torch.randn(pages * 16, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    src = [page_view(make(12, 700), src_layout) for _ in range(24)]
    by_torch = [page_view(make(len(dst_heads), 500), dst_layout) for _ in range(24)]
    fused = [b.clone() for b in by_torch]
    src_pages = random.Random(0).sample(range(700), 40)
    dst_pages = list(range(100, 120)) + random.Random(1).sample(range(120, 500), 20)
    copy_pages(src, by_torch, src_pages, dst_pages, src_heads, dst_heads)
    pages = lambda p: torch.tensor(p, dtype=torch.int64, device="cuda")  # noqa: E731
    copy_pages_fused(
        address_table(src),
        address_table(fused),
        pages(src_pages),
        pages(dst_pages),
        *page_rows(src_layout, src_heads, dst_layout, dst_heads),
    )
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(fused, by_torch, strict=True))
    # a run of consecutive pages on both sides (no page index: each side's first page); page 1 too,
    # the int Triton would have specialized
    for first_src, first_dst in ((300, 1), (1, 460)):
        src_run, dst_run = list(range(first_src, first_src + 37)), list(range(first_dst, first_dst + 37))
        copy_pages(src, by_torch, src_run, dst_run, src_heads, dst_heads)
        rows = page_rows(src_layout, src_heads, dst_layout, dst_heads)
        copy_pages_fused(address_table(src), address_table(fused), first_src, first_dst, *rows, run=37)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(fused, by_torch, strict=True))


def test_the_kv_checksum_is_the_same_on_the_gpu_as_on_the_cpu():
    """common/kv_transfer/integrity.py on a GPT-2-small-shaped bf16 pool: the sum a GPU sender computes
    is the one a CPU computes over the same bytes (integer sums wrap alike whatever their order)."""
    from pdserve.common.kv_transfer import KVLayout
    from pdserve.common.kv_transfer.direct import page_view
    from pdserve.common.kv_transfer.integrity import kv_checksum

    layout = KVLayout(page_size=16, num_layers=12, kv_heads=12, head_dim=64, dtype="bfloat16", num_pages=300)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pools = [torch.randn(300 * 16, 12, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(24)]
    on_gpu = [page_view(b, layout) for b in pools]
    on_cpu = [page_view(b.cpu(), layout) for b in pools]
    pages = random.Random(0).sample(range(1, 300), 40)
    for heads in (range(0, 12), range(4, 8)):
        assert kv_checksum(on_gpu, pages, heads) == kv_checksum(on_cpu, pages, heads)

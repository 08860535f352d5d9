"""The Triton attention kernels against a float64 dense reference (CPU: Triton's interpreter).

tests/conftest.py sets TRITON_INTERPRET=1 without a GPU before the kernel modules are imported;
with a GPU the same tests run compiled on it. Sizes are small because the interpreter runs every
program in Python; tests/gpu has the large shapes and bf16. Pools and req_to_token are built from
shuffled pages, and every slot and table entry a kernel must not read holds live-looking data, so a
wrong gather shows up in the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.common.engine.attention.triton_decode import DecodeWorkspace, decode_attention, num_kv_splits_for
from pdserve.common.engine.attention.triton_extend import extend_attention
from pdserve.common.engine.attention.triton_store import store_kv

# NOTE: with CUDA present the kernels are compiled, not interpreted, and take only CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative error ||out - ref|| / ||ref|| allowed per dtype (the reference is float64).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@dataclass
class PagedCase:
    """One batch over a paged pool: device tensors in the kernels' layout plus host copies."""

    q: torch.Tensor  # [T, H, D]
    k_buf: torch.Tensor  # [S, KVH, D]
    v_buf: torch.Tensor
    req_to_token: torch.Tensor  # [R, C] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    extend_starts: torch.Tensor  # [B] int32
    rows: list[int]
    seq_lens_host: list[int]
    extend_lens_host: list[int]


def build_case(
    seq_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    num_padded: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Requests get shuffled pages (never page 0) and random rows; `num_padded` extra decode rows
    (seq_len 1) point at an all-zero row, like a CUDA-graph batch's padding."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 + sum(-(-n // page_size) for n in seq_lens)
    num_slots = num_pages * page_size
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    num_rows = len(seq_lens) + 3
    pad_row = num_rows - 1
    context_len = max(seq_lens + [1]) + 2 * page_size
    # Columns past a request's length hold valid but wrong slots: reading them changes the result.
    req_to_token = torch.randint(1, num_slots, (num_rows, context_len), generator=gen, dtype=torch.int32)
    req_to_token[pad_row] = 0
    rows = torch.randperm(num_rows - 1, generator=gen)[: len(seq_lens)].tolist()
    for row, seq_len in zip(rows, seq_lens):
        own_pages = [pages.pop() for _ in range(-(-seq_len // page_size))]
        positions = torch.arange(seq_len)
        slots = torch.tensor(own_pages)[positions // page_size] * page_size + positions % page_size
        req_to_token[row, :seq_len] = slots.to(torch.int32)

    seq_lens = seq_lens + [1] * num_padded
    extend_lens = extend_lens + [1] * num_padded
    rows = rows + [pad_row] * num_padded
    num_tokens = sum(extend_lens)
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    return PagedCase(
        q=q.to(device=device, dtype=dtype),
        k_buf=k_buf.to(device=device, dtype=dtype),
        v_buf=v_buf.to(device=device, dtype=dtype),
        req_to_token=req_to_token.to(device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int32, device=device),
        extend_starts=torch.tensor(starts, dtype=torch.int32, device=device),
        rows=rows,
        seq_lens_host=seq_lens,
        extend_lens_host=extend_lens,
    )


def reference_attention(case: PagedCase, scale: float, window: int | None) -> torch.Tensor:
    """float64 dense attention, one request at a time: gather its KV, causal + window mask, softmax."""
    q = case.q.double()
    group = q.shape[1] // case.k_buf.shape[1]
    out = torch.empty_like(q)
    start = 0
    for row, seq_len, ext in zip(case.rows, case.seq_lens_host, case.extend_lens_host):
        slots = case.req_to_token[row, :seq_len].long()
        keys = case.k_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        values = case.v_buf[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ehd,shd->hes", q[start : start + ext], keys) * scale
        q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= q_pos - k_pos < window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start : start + ext] = torch.einsum("hes,shd->ehd", probs, values)
        start += ext
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "some output element was not written (NaN poison left)"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"


def run_decode(case: PagedCase, scale, window, num_kv_splits) -> torch.Tensor:
    batch, num_heads, head_dim = case.q.shape
    workspace = DecodeWorkspace(batch + 1, num_heads, head_dim, num_kv_splits + 1, case.q.device)
    workspace.partial_out.fill_(float("nan"))  # stale workspace must not leak into the result
    workspace.partial_lse.fill_(float("nan"))
    out = torch.full_like(case.q, float("nan"))
    decode_attention(
        case.q,
        case.k_buf,
        case.v_buf,
        out,
        case.req_to_token,
        case.req_pool_indices,
        case.seq_lens,
        scale,
        window,
        num_kv_splits,
        workspace,
    )
    return out


def run_extend(case: PagedCase, scale, window, q=None) -> torch.Tensor:
    q = case.q if q is None else q
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        q,
        case.k_buf,
        case.v_buf,
        out,
        case.req_to_token,
        case.req_pool_indices,
        case.seq_lens,
        case.extend_lens,
        case.extend_starts,
        max(case.extend_lens_host),
        scale,
        window,
    )
    return out


# (heads, kv heads, head dim, page size, window, kv splits, seq lens): decode cases for CPU.
# Lengths cross the 64-key block and page boundaries; 8 and 16 splits leave most splits empty.
DECODE_CASES = {
    "mha": (4, 4, 16, 4, None, 4, [1, 5, 17, 67, 130]),
    "gqa2-d24": (4, 2, 24, 16, None, 3, [2, 33, 64, 129]),
    "gqa4-window": (8, 2, 16, 4, 7, 2, [1, 6, 7, 8, 100]),
    "gqa4-d40-many-splits": (8, 2, 40, 16, 50, 8, [3, 49, 50, 51, 140]),
    "gqa8-one-split": (16, 2, 16, 4, None, 1, [9, 65, 150]),
    "gqa72-two-head-blocks": (72, 1, 16, 16, None, 2, [1, 70]),
    "mha-window-many-splits": (2, 2, 16, 4, 3, 16, [1, 2, 3, 4, 40]),
    "gqa2-window-one-split": (4, 2, 16, 4, 37, 1, [1, 36, 37, 38, 100, 129]),  # windows start mid-block
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name, dtype):
    heads, kv_heads, head_dim, page_size, window, splits, seq_lens = DECODE_CASES[name]
    case = build_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, page_size, dtype, num_padded=2)
    scale = head_dim**-0.5
    out = run_decode(case, scale, window, splits)
    assert_close(out, reference_attention(case, scale, window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "name", ["mha", "gqa2-d24", "gqa4-window", "gqa4-d40-many-splits", "gqa72-two-head-blocks", "gqa2-window-one-split"]
)
def test_decode_stores_the_new_kv_in_the_same_launch(name, dtype):
    """k_new/v_new given: the kernel writes them at out_loc and attends to them (bitwise the pool
    store_kv would leave, and the reference over that pool)."""
    heads, kv_heads, head_dim, page_size, window, splits, seq_lens = DECODE_CASES[name]
    case = build_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, page_size, dtype, seed=4)
    gen = torch.Generator().manual_seed(8)
    # Strided views of a fused [B, H + 2 KVH, D] projection, as the model hands them over.
    qkv = torch.randn(len(seq_lens), heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k_new, v_new = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    out_loc = torch.stack([case.req_to_token[r, n - 1].long() for r, n in zip(case.rows, case.seq_lens_host)])
    expected_k, expected_v = case.k_buf.clone(), case.v_buf.clone()
    store_kv(expected_k, expected_v, out_loc, k_new, v_new)
    batch, num_heads, dim = case.q.shape
    workspace = DecodeWorkspace(batch, num_heads, dim, splits, case.q.device)
    out = torch.full_like(case.q, float("nan"))
    scale = head_dim**-0.5
    decode_attention(
        case.q,
        case.k_buf,
        case.v_buf,
        out,
        case.req_to_token,
        case.req_pool_indices,
        case.seq_lens,
        scale,
        window,
        splits,
        workspace,
        k_new,
        v_new,
        out_loc,
    )
    assert torch.equal(case.k_buf, expected_k) and torch.equal(case.v_buf, expected_v)
    assert_close(out, reference_attention(case, scale, window), dtype)  # case now holds the stored pool


@pytest.mark.parametrize("name", ["mha", "gqa4-window", "gqa2-window-one-split", "mha-window-many-splits"])
def test_decode_with_32_key_blocks(monkeypatch, name):
    """The 32-key blocks that MHA at a large batch runs with (forced here for small cases)."""
    from pdserve.common.engine.attention import triton_decode

    monkeypatch.setattr(triton_decode, "_split_config", lambda *args: dict(BLOCK_N=32, num_warps=2, num_stages=2))
    heads, kv_heads, head_dim, page_size, window, splits, seq_lens = DECODE_CASES[name]
    case = build_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, page_size, torch.float16, num_padded=2)
    scale = head_dim**-0.5
    assert_close(run_decode(case, scale, window, splits), reference_attention(case, scale, window), torch.float16)


def test_decode_window_zero_means_off():
    case = build_case([5, 40], [1, 1], 4, 2, 16, 4, torch.float32)
    assert_close(run_decode(case, 0.25, 0, 2), reference_attention(case, 0.25, None), torch.float32)


# (heads, kv heads, head dim, page size, window, [(prefix, extend), ...]): extend cases for CPU.
# Extends of 70 span two 64-query blocks; prefixes of 0 and 1 and long ones; extend_len 1; a
# first query at 62 or 63 puts the causal diagonal at the edge of a 32- or 64-key block.
EXTEND_CASES = {
    "mha": (2, 2, 16, 4, None, [(0, 1), (0, 7), (5, 1), (13, 70), (100, 3), (62, 5), (63, 1)]),
    "gqa2-d24": (4, 2, 24, 16, None, [(0, 33), (40, 17), (150, 1)]),
    "gqa4-window": (4, 1, 16, 4, 9, [(0, 70), (30, 5), (3, 1), (1, 20)]),
    "gqa4-d80-window": (8, 2, 80, 16, 64, [(70, 10), (0, 66)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_matches_reference(name, dtype):
    heads, kv_heads, head_dim, page_size, window, reqs = EXTEND_CASES[name]
    seq_lens = [prefix + ext for prefix, ext in reqs]
    case = build_case(seq_lens, [ext for _, ext in reqs], heads, kv_heads, head_dim, page_size, dtype)
    scale = head_dim**-0.5
    out = run_extend(case, scale, window)
    assert_close(out, reference_attention(case, scale, window), dtype)


def test_extend_reads_strided_q():
    """q as a slice of a fused qkv projection: row stride != heads * head_dim."""
    case = build_case([20, 9], [12, 9], 4, 2, 16, 4, torch.float32)
    num_tokens, heads, head_dim = case.q.shape
    qkv = torch.randn(num_tokens, (heads + 4) * head_dim, device=DEVICE)
    qkv[:, : heads * head_dim] = case.q.reshape(num_tokens, -1)
    q_view = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    assert not q_view.is_contiguous()
    assert_close(run_extend(case, 0.25, None, q=q_view), reference_attention(case, 0.25, None), torch.float32)


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 16), (3, 24), (5, 1024)])
def test_store_kv_writes_exactly_its_slots(kv_heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    k_buf = torch.randn(40, kv_heads, head_dim, generator=gen).to(DEVICE, torch.float16)
    v_buf = torch.randn(40, kv_heads, head_dim, generator=gen).to(DEVICE, torch.float16)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    loc = (torch.randperm(39, generator=gen)[:7] + 1).to(DEVICE)
    # k and v as slices of one fused fp32 tensor: strided, and cast to the fp16 pool.
    kv = torch.randn(7, 2, kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    store_kv(k_buf, v_buf, loc, k, v)

    assert torch.equal(k_buf[loc], k.half()) and torch.equal(v_buf[loc], v.half())
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(k_buf[untouched], k_before[untouched])
    assert torch.equal(v_buf[untouched], v_before[untouched])


def test_store_kv_zero_tokens_is_a_no_op():
    k_buf, v_buf = torch.randn(8, 2, 16, device=DEVICE), torch.randn(8, 2, 16, device=DEVICE)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    empty = torch.empty(0, 2, 16, device=DEVICE)
    store_kv(k_buf, v_buf, torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty)
    assert torch.equal(k_buf, k_before) and torch.equal(v_buf, v_before)


def _backend_parity(mode, seq_lens, extend_lens):
    """store_kv + the kernel vs TorchNativeBackend.forward, through the real pools and batch."""
    from pdserve.common.engine.attention.torch_native import TorchNativeBackend
    from pdserve.common.engine.batch import ForwardBatch
    from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
    from pdserve.common.scheduling.pages import slots_for_positions

    page_size, heads, kv_heads, head_dim, scale, window = 4, 4, 2, 16, 0.25, 11
    kv_pool = PagedKVPool(32, page_size, 1, kv_heads, head_dim, torch.float32, DEVICE)
    req_pool = ReqToTokenPool(4, 64, DEVICE)
    gen = torch.Generator().manual_seed(2)
    kv_pool.k_buffers[0].copy_(torch.randn(kv_pool.k_buffers[0].shape, generator=gen))
    kv_pool.v_buffers[0].copy_(torch.randn(kv_pool.v_buffers[0].shape, generator=gen))  # copy_ moves to DEVICE
    rows, new_slots = [], []
    for seq_len, ext in zip(seq_lens, extend_lens):
        rows.append(req_pool.alloc())
        pages = kv_pool.alloc_pages(-(-seq_len // page_size))
        slots = torch.tensor(slots_for_positions(pages, 0, seq_len, page_size), dtype=torch.int32, device=DEVICE)
        req_pool.req_to_token[rows[-1], : slots.numel()] = slots
        new_slots += slots_for_positions(pages, seq_len - ext, seq_len, page_size)
    num_tokens = sum(extend_lens)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    batch = ForwardBatch(
        mode=mode,
        reqs=[None] * len(seq_lens),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        out_cache_loc=torch.tensor(new_slots, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=list(seq_lens),
        extend_lens=list(extend_lens),
        extend_starts=starts,
        req_rows=rows,
        last_indices=torch.tensor([s + n - 1 for s, n in zip(starts, extend_lens)]),
        samples=[True] * len(seq_lens),
        has_placeholders=False,
    )
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE)

    k_pool, v_pool = kv_pool.k_buffers[0].clone(), kv_pool.v_buffers[0].clone()
    backend = TorchNativeBackend(req_pool, kv_pool)
    backend.init_forward(batch)
    expected = backend.forward(q, k, v, 0, batch, scale, window)

    store_kv(k_pool, v_pool, batch.out_cache_loc, k, v)
    assert torch.equal(k_pool, kv_pool.k_buffers[0]) and torch.equal(v_pool, kv_pool.v_buffers[0])
    out = torch.full_like(q, float("nan"))
    device_lens = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (seq_lens, extend_lens, starts)]
    if mode.value == "decode":
        workspace = DecodeWorkspace(len(seq_lens), heads, head_dim, 4, DEVICE)
        decode_attention(
            q,
            k_pool,
            v_pool,
            out,
            req_pool.req_to_token,
            batch.req_pool_indices,
            device_lens[0],
            scale,
            window,
            4,
            workspace,
        )
    else:
        extend_attention(
            q,
            k_pool,
            v_pool,
            out,
            req_pool.req_to_token,
            batch.req_pool_indices,
            *device_lens,
            max(extend_lens),
            scale,
            window,
        )
    assert torch.isfinite(out).all()
    assert ((out - expected).norm() / expected.norm()).item() < 1e-5


def test_extend_matches_torch_native_backend():
    from pdserve.common.scheduling.batch import ForwardMode

    _backend_parity(ForwardMode.EXTEND, seq_lens=[9, 30, 4], extend_lens=[9, 12, 1])


def test_decode_matches_torch_native_backend():
    from pdserve.common.scheduling.batch import ForwardMode

    _backend_parity(ForwardMode.DECODE, seq_lens=[9, 30, 4], extend_lens=[1, 1, 1])


def test_num_kv_splits_for_targets_about_512_programs():
    assert num_kv_splits_for(1, 32, 8, max_kv_splits=16) == 16  # 8 programs a split
    assert num_kv_splits_for(32, 32, 8, max_kv_splits=16) == 2
    assert num_kv_splits_for(128, 32, 8, max_kv_splits=16) == 1
    assert num_kv_splits_for(8, 12, 12, max_kv_splits=16) == 4  # MHA: a program per head
    assert num_kv_splits_for(1, 12, 12, max_kv_splits=1) == 1

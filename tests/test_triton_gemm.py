"""The split-K decode GEMM (models/triton_gemm.py) against a float64 reference, in fp32 and fp16
(the interpreter on CPU; compiled, and in bf16 too, on a GPU)."""

import pytest
import torch

from pdserve.common.models import triton_gemm as tg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "an element was not written (or is NaN)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def inputs(m, n, k, dtype, bias, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    # x rows strided inside a wider buffer, as a view of a bigger activation would be.
    x = torch.randn(m, k + row_pad, generator=g).to(DEVICE, dtype)[:, :k]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def reference(x, w, b):
    ref = x.double() @ w.double().t()
    return ref if b is None else ref + b.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 64, 128, tg.GemmConfig(16, 64, 64, 1)),  # one row, no split
        (5, 100, 96, tg.GemmConfig(16, 32, 32, 2)),  # N not a multiple of the tile, 3 K blocks in 2 splits
        (37, 80, 200, tg.GemmConfig(64, 32, 64, 4)),  # K tail masked, splits of unequal length
        (128, 96, 256, tg.GemmConfig(128, 32, 32, 8)),  # full tile of rows, 8 splits
        (130, 48, 64, tg.GemmConfig(64, 16, 16, 3)),  # M past one tile: three row tiles
        (16, 64, 64, tg.GemmConfig(16, 64, 64, 4)),  # more splits asked than K blocks: capped
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, m, n, k, config, bias):
    x, w, b = inputs(m, n, k, dtype, bias, seed=m + n + k, row_pad=3)
    ws = tg.GemmWorkspace.create(DEVICE, partial_elems=1 << 18, tiles=256)
    out = tg.linear(x, w, b, ws, config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, reference(x, w, b)) < TOL[dtype]
    assert int(ws.semaphores.count_nonzero()) == 0, "a tile's semaphore was not reset"


def test_split_k_is_deterministic_and_reusable():
    """Same inputs, same bits, call after call (the last split sums partials in split order)."""
    x, w, b = inputs(33, 64, 512, torch.float16, True, seed=7)
    ws = tg.GemmWorkspace.create(DEVICE, partial_elems=1 << 18, tiles=64)
    config = tg.GemmConfig(64, 32, 32, 8)
    first = tg.linear(x, w, b, ws, config)
    for _ in range(3):
        assert torch.equal(tg.linear(x, w, b, ws, config), first)
    # The same result with no split at all, up to the fp32 summation order.
    assert rel_err(first, tg.linear(x, w, b, ws, tg.GemmConfig(64, 32, 32, 1)).double()) < 2e-3


def test_empty_batch_and_workspace_bounds():
    x, w, b = inputs(0, 32, 64, torch.float32, False)
    ws = tg.GemmWorkspace.create(DEVICE, partial_elems=16, tiles=1)
    assert tg.linear(x, w, b, ws).shape == (0, 32)
    x, w, b = inputs(4, 256, 256, torch.float32, False)
    with pytest.raises(AssertionError, match="GemmWorkspace"):
        tg.linear(x, w, b, ws, tg.GemmConfig(16, 32, 32, 4))


def test_default_config_and_workspace_size():
    # Llama-1B decode shapes at batch 128 on 132 SMs: K split until ~2 CTAs per SM.
    c = tg.default_config(128, 3072, 2048, 132)
    assert c.block_m == 128 and 48 * c.split_k <= 2 * 132 and c.split_k > 1
    assert tg.default_config(128, 128256, 2048, 132).split_k == 1  # the LM head has tiles enough
    shapes = [(3072, 2048), (2048, 8192), (128256, 2048)]
    partial, tiles = tg.workspace_size(shapes)
    ws = tg.GemmWorkspace.create(DEVICE, partial_elems=partial, tiles=tiles)
    for n, k in shapes:
        for m in (1, 7, 64, 100, 256):
            c = tg.default_config(m, n, k, 132)
            grid_tiles = -(-n // c.block_n) * -(-m // c.block_m)
            assert grid_tiles * c.split_k * c.block_m * c.block_n <= ws.partials.numel() or c.split_k == 1


def test_use_decode_gemm_swaps_linears_and_keeps_ties():
    from torch import nn

    from pdserve.common.models.layers import DecodeLinear, use_decode_gemm

    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"up": nn.Linear(64, 96), "down": nn.Linear(96, 64, bias=False), "lm_head": nn.Linear(64, 40, bias=False)}
    ).to(DEVICE, torch.float16)
    up_weight = model["up"].weight
    ref_model = {name: (m.weight.detach().clone(), m.bias) for name, m in model.items()}
    assert use_decode_gemm(model, skip=("lm_head",)) == 2
    assert isinstance(model["up"], DecodeLinear) and isinstance(model["lm_head"], nn.Linear)
    assert model["up"].weight is up_weight  # the same Parameter, not a copy
    for rows in (3, 300):  # a decode batch (Triton) and a prefill chunk past MAX_M (cuBLAS)
        x = torch.randn(rows, 64).to(DEVICE, torch.float16)
        h = model["up"](x)
        w, b = ref_model["up"]
        assert rel_err(h, reference(x, w, b)) < TOL[torch.float16]
        assert rel_err(model["down"](h), reference(h, ref_model["down"][0], None)) < TOL[torch.float16]

"""Block-wise FP8 (e4m3) linear layers: a scale per [block_n, block_k] tile of the weight, and per
token and group of block_k inputs for the activations (DeepSeek-V3's and Qwen3-*-FP8's form).

The numbers, on every path (bn, bk = block_n, block_k; g = k // bk, a group of the K axis):

    weight  W [N, K]  ->  Wq = fp8(W / sw[n // bn, g]),  sw = amax|W over its tile| / 448
                          (fp32 [ceil(N / bn), ceil(K / bk)]; 1 for a zero tile)
    input   x [M, K]  ->  xq = fp8(x / sx[m, g]),        sx = amax|x[m, group g]| / 448 (every forward)
    output  y[m, n] = sum over g of (xq[m, g] . Wq[n, g]) * sw[n // bn, g] * sx[m, g] + bias[n],
                      fp32 sums, rounded once to the model dtype

A checkpoint's `weight_scale_inv` (quant_method fp8 with weight_block_size) and compressed-tensors'
block `weight_scale` are both sw: W = Wq * sw (the "inv" is the reciprocal of the factor that made
Wq). A partial tile at the right or bottom edge has its own scale over the values it holds.

Why groups of K and not one scale per token: a block's weight scale changes along K, so it cannot be
taken out of the sum as a per-channel scale is (fp8.py); the GEMM applies both scales to each group's
partial sum, and an activation scale per group costs nothing more there. It is what the checkpoints
were calibrated against (vLLM's and SGLang's w8a8 block FP8).

Where the GEMM runs (`block_fp8_linear`):
    CUDA     compute capability 8.9 or later: fp8_block_kernels (Triton): the per-token-group
             quantization, then the block-scaled GEMM with both scales and the bias in its loop and
             epilogue; two launches, no host sync (captured in CUDA graphs)
    else     the reference: dequantize xq and Wq to fp32 with their scales, matmul in fp32, add the
             bias, round once (logged once on CUDA: slow)

Sizes: block_k a power of two from 32 to 256 (the GEMM's K step is one group; Hopper's FP8 MMA takes
32 at a time), block_n any (the GEMM reads a row's scale at n // block_n). Checkpoints ship 128 x 128.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.engine.models.fp8 import FP8, FP8_MAX, MIN_AMAX
from pdserve.common.model_checks import check_weight_block

log = logging.getLogger(__name__)

# --quantization fp8-block's tiles: the checkpoints' (DeepSeek-V3, Qwen3-*-FP8, llm-compressor's FP8_BLOCK).
DEFAULT_BLOCK = (128, 128)


def check_block(block: tuple[int, int]) -> None:
    """ValueError unless [block_n, block_k] is a tile size the layers serve (module docstring)."""
    check_weight_block(block, "FP8 weight block")


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The block scales' shape for a [rows, cols] weight: [ceil(rows / bn), ceil(cols / bk)]."""
    return -(-rows // block[0]), -(-cols // block[1])


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """t [N, K] zero-padded to whole tiles, viewed [N / bn, bn, K / bk, bk]."""
    rows, cols = scale_shape(*t.shape, block)
    padded = F.pad(t, (0, cols * block[1] - t.shape[1], 0, rows * block[0] - t.shape[0]))
    return padded.view(rows, block[0], cols, block[1])


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq float8 [N, K], sw fp32 [ceil(N / bn), ceil(K / bk)]) with W ≈ Wq * sw of each value's tile."""
    check_block(block)
    tiles = _tiles(weight.float(), block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).to(FP8)
    n, k = weight.shape
    return q.reshape(tiles.shape[0] * block[0], -1)[:n, :k].contiguous(), scale


def expand_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N / bn), ceil(K / bk)] as one fp32 per weight value, [N, K]."""
    rows, cols = shape
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq float8 [M, K], sx fp32 [M, ceil(K / group)]) of a 2-D x, x ≈ xq * sx of each value's group
    (a last partial group scaled over the values it holds). fp8_block_kernels.quantize_per_token_group
    computes these bits on CUDA."""
    m, k = x.shape
    groups = -(-k // group)
    grouped = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    # (No clamp before the cast: as fp8.quantize_per_token, |x / scale| <= 448 up to one rounding.)
    q = (grouped / scale).to(FP8).view(m, groups * group)[:, :k].contiguous()
    return q, scale.view(m, groups)


def emulated_block_fp8_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The reference: both sides dequantized to fp32 with their scales, matmul in fp32, bias, one rounding."""
    x = xq.float() * x_scale.repeat_interleave(block[1], 1)[:, : xq.shape[1]]
    out = x @ (weight.float() * expand_scales(weight_scale, weight.shape, block)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def gemm_refusal(x: torch.Tensor) -> str:
    """Why the Triton block GEMM cannot run on x's device; "" when it can. Device only: the same
    answer at capture and at every replay."""
    if x.device.type != "cuda":
        return f"no FP8 GEMM on {x.device.type}"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "FP8 GEMMs need compute capability 8.9 or later"
    return ""


@functools.cache
def _log_emulated(reason: str) -> None:
    log.warning("block-wise FP8 linear layers run emulated (dequantize + fp32 matmul, slow): %s", reason)


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int], bias
) -> torch.Tensor:
    """x @ dequant(weight)^T + bias in x's dtype, x quantized per token and group of block_k."""
    rows = x.reshape(-1, x.shape[-1])
    reason = gemm_refusal(rows)
    if not reason:
        from pdserve.common.engine.models import fp8_block_kernels as kernels

        xq, x_scale = kernels.quantize_per_token_group(rows, block[1], MIN_AMAX)
        out = kernels.block_fp8_gemm(xq, x_scale, weight, weight_scale, block, bias, x.dtype)
    else:
        if rows.is_cuda:
            _log_emulated(reason)
        xq, x_scale = quantize_per_token_group(rows, block[1])
        out = emulated_block_fp8_mm(xq, x_scale, weight, weight_scale, block, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Fp8BlockLinear(nn.Module):
    """A linear layer with an FP8 weight [out, in] and fp32 scales per [block_n, block_k] tile
    (`weight_scale`, [ceil(out / bn), ceil(in / bk)]); the bias, if any, stays in the model dtype.
    The loader reads a checkpoint's `weight_scale_inv` (quant_method fp8) into `weight_scale`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias, block: tuple[int, int]):
        super().__init__()
        check_block(block)
        want = scale_shape(*weight.shape, block)
        if weight.dtype != FP8 or weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want:
            raise ValueError(
                f"Fp8BlockLinear takes a {FP8} weight and fp32 {list(want)} block scales ({list(block)} tiles), got "
                f"{weight.dtype} {tuple(weight.shape)} and {weight_scale.dtype} {tuple(weight_scale.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear, block: tuple[int, int] = DEFAULT_BLOCK) -> "Fp8BlockLinear":
        """`linear`'s weight quantized per [block_n, block_k] tile."""
        weight, scale = quantize_blockwise(linear.weight.detach(), block)
        return cls(weight, scale, linear.bias, block)

    @classmethod
    def empty_like(cls, linear: nn.Linear, block: tuple[int, int]) -> "Fp8BlockLinear":
        """Uninitialized, on `linear`'s device (meta, before a block-wise checkpoint is read into it)."""
        device = linear.weight.device
        weight = torch.empty(linear.weight.shape, dtype=FP8, device=device)
        scale = torch.empty(scale_shape(*linear.weight.shape, block), dtype=torch.float32, device=device)
        return cls(weight, scale, linear.bias, block)

    @classmethod
    def merge(cls, linears: list["Fp8BlockLinear"]) -> "Fp8BlockLinear":
        """One layer computing `linears` side by side (fused q/k/v, gate/up), exact: the rows concatenated
        with their scales. Where a part other than the last ends inside a row tile (its rows are not a
        multiple of block_n), the tiles of the parts would not line up: the scales are then expanded to
        one per row (block_n 1; K / block_k fp32 a row)."""
        if not all(isinstance(m, Fp8BlockLinear) for m in linears):
            raise TypeError("cannot merge block-wise FP8 layers with other layers")
        blocks = {m.block for m in linears}
        if len(blocks) != 1:
            raise ValueError(f"cannot merge block-wise FP8 layers of different blocks {sorted(blocks)}")
        (block,) = blocks
        if any(m.out_features % block[0] for m in linears[:-1]):
            scales = [m.weight_scale.repeat_interleave(block[0], 0)[: m.out_features] for m in linears]
            block = (1, block[1])
        else:
            scales = [m.weight_scale for m in linears]
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        return cls(torch.cat([m.weight for m in linears]), torch.cat(scales), bias, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"block={list(self.block)}"
        )

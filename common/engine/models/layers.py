"""Layers shared by every model: norms, rotary embeddings, activations, the attention call.

Each follows the Hugging Face implementation's arithmetic (order of ops and dtypes), because the
correctness contract is token-identical greedy output against transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.common.engine.attention.base import AttentionBackend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.models.fp8 import Fp8Linear
from pdserve.common.engine.models.fp8_block import Fp8BlockLinear


def triton_ops():
    """The fused kernels, imported on first use (see models/triton_ops.py)."""
    from pdserve.common.engine.models import triton_ops as ops

    return ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel instead of HF's seven ops (see fuse_model)
        # Fused, and read by FP8 linear layers only: the kernel writes their float8 input (fp8.Fp8Input).
        self.fp8_out = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, also the residual stream: (norm(x + residual), x + residual).

        The fused kernel updates `residual` in place; the eager path returns a new tensor.
        """
        if self.fp8_out and x.dim() == 2:
            from pdserve.common.engine.models import fp8, fp8_kernels

            out = fp8.Fp8Input(*fp8_kernels.rmsnorm_fp8(x, self.weight, self.eps, residual, fp8.MIN_AMAX), x.dtype)
            return out if residual is None else (out, residual)
        if self.fused and x.dim() == 2:
            out = triton_ops().rmsnorm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def merge_linears(*linears: nn.Module) -> nn.Module:
    """One Linear whose output is the given Linears' outputs side by side (one GEMM, not several);
    FP8 ones merge into one Fp8Linear (block-wise ones into one Fp8BlockLinear)."""
    first = linears[0]
    if isinstance(first, Fp8Linear):
        return Fp8Linear.merge(list(linears))
    if isinstance(first, Fp8BlockLinear):
        return Fp8BlockLinear.merge(list(linears))
    # NOTE: made on meta, then given the joined weights: a Linear made in memory draws random weights
    # first (kaiming_uniform_ on the host CPU, in fp32): 5.8 s of Llama-1B's start-up on an H200 host.
    out_features = sum(m.out_features for m in linears)
    merged = nn.Linear(first.in_features, out_features, bias=first.bias is not None, device="meta")
    keep = first.weight.requires_grad
    with torch.no_grad():
        merged.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=keep)
        if first.bias is not None:
            merged.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=keep)
    return merged


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new", written exactly as transformers' NewGELUActivation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies for RoPE types default, linear and llama3 (and a GGUF's freq_factors), on the CPU.

    NOTE: the CPU named even inside `with torch.device("meta")` (the loader builds models there): meta
    arithmetic runs through torch's Python references, whose first use imports torch._dynamo and sympy,
    1.5 s of every server's start-up."""
    base = float(rope.get("rope_theta", 10000.0))
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if "freq_factors" in rope:
        # A GGUF's `rope_freqs` (how llama.cpp stores Llama 3's scaling): a divisor per frequency.
        inv_freq = inv_freq / torch.tensor(rope["freq_factors"], dtype=torch.float32, device="cpu")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half), as Llama, Qwen and Mistral use it."""

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self.fused = False

    def init_buffers(self) -> None:
        """Recompute inv_freq after the model was built on the meta device and cast.

        NOTE: kept in float32 whatever the model dtype: bf16 frequencies shift every angle.
        """
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]; cos/sin in float32, cast to the activations' dtype as HF does.
        if self.fused:
            triton_ops().rope_(q, k, positions, self.inv_freq)  # in place
            return q, k
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedAttention(nn.Module):
    """The attention core of one layer: hands q/k/v to the backend with this layer's geometry."""

    def __init__(self, layer_id: int, num_heads: int, kv_heads: int, head_dim: int, sliding_window: int | None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(self, q, k, v, batch: ForwardBatch, attn: AttentionBackend, kv_stored: bool = False) -> torch.Tensor:
        """kv_stored: k and v are already in the pool (`attn.rope_and_store` ran)."""
        t = q.shape[0]
        out = attn.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.kv_heads, self.head_dim),
            v.view(t, self.kv_heads, self.head_dim),
            self.layer_id,
            batch,
            self.scale,
            self.sliding_window,
            kv_stored=kv_stored,
        )
        return out.reshape(t, self.num_heads * self.head_dim)

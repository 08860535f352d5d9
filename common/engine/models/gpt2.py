"""GPT2LMHeadModel: learned positions, LayerNorm, fused qkv, gelu_new, tied LM head.

GPT-2 checkpoints store their projections as Conv1D weights [in, out]; the loader transposes them
into nn.Linear's [out, in] (see TRANSPOSED).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.engine.attention.base import AttentionBackend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.models.layers import PagedAttention, gelu_tanh, triton_ops
from pdserve.common.engine.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_part,
    head_columns,
    heads_of_rank,
)
from pdserve.common.engine.tp import TPGroup

# Weight names (after the "transformer." prefix) whose checkpoint layout is Conv1D [in, out].
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Arch:
    def __init__(self, cfg: dict):
        self.hidden = cfg["n_embd"]
        self.num_heads = cfg["n_head"]
        self.head_dim = self.hidden // self.num_heads
        self.inner = cfg.get("n_inner") or 4 * self.hidden
        self.num_layers = cfg["n_layer"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg["n_positions"]
        self.eps = cfg.get("layer_norm_epsilon", 1e-5)
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if cfg.get(flag):
                raise ValueError(f"GPT2LMHeadModel with {flag}=true is not supported")
        if not cfg.get("scale_attn_weights", True):
            raise ValueError("GPT2LMHeadModel with scale_attn_weights=false is not supported")
        if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {cfg.get('activation_function')!r} is not supported")


class GPT2Block(nn.Module):
    def __init__(self, a: GPT2Arch, layer_id: int, tp: TPGroup):
        super().__init__()
        self.ln_1 = nn.LayerNorm(a.hidden, eps=a.eps)
        self.attn = GPT2Attention(a, layer_id, tp)
        self.ln_2 = nn.LayerNorm(a.hidden, eps=a.eps)
        self.mlp = GPT2MLP(a, tp)
        self.fused = False  # residual adds fused into the LayerNorms (see GPT2LMHeadModel.fuse)

    def forward(self, x, residual, batch: ForwardBatch, attn: AttentionBackend):
        """(this block's MLP output, the residual stream before it); the next norm adds the two."""
        if residual is None:
            residual, x = x, self.ln_1(x)
        else:
            x, residual = add_layernorm(self.ln_1, x, residual, self.fused)
        x = self.attn(x, batch, attn)
        x, residual = add_layernorm(self.ln_2, x, residual, self.fused)
        return self.mlp(x), residual


def add_layernorm(norm: nn.LayerNorm, x, residual, fused: bool):
    """(norm(residual + x), residual + x); fused: one Triton kernel that updates residual in place."""
    if fused:
        return triton_ops().layernorm(x, norm.weight, norm.bias, norm.eps, residual), residual
    residual = residual + x
    return norm(residual), residual


class GPT2Attention(nn.Module):
    """This rank's heads: c_attn column-parallel (its share of each of the q, k, v blocks), c_proj
    row-parallel."""

    def __init__(self, a: GPT2Arch, layer_id: int, tp: TPGroup):
        super().__init__()
        heads, d = heads_of_rank(a.num_heads, tp), a.head_dim
        self.num_heads, self.local_hidden = len(heads), len(heads) * d
        blocks = [head_columns(heads, d, offset) for offset in (0, a.hidden, 2 * a.hidden)]
        self.c_attn = ColumnParallelLinear(a.hidden, blocks, bias=True)
        self.c_proj = RowParallelLinear(head_columns(heads, d), a.hidden, bias=True, tp=tp)
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_heads, d, None)

    def forward(self, x, batch: ForwardBatch, attn: AttentionBackend):
        q, k, v = self.c_attn(x).split(self.local_hidden, dim=-1)
        return self.c_proj(self.attn(q, k, v, batch, attn))


class GPT2MLP(nn.Module):
    def __init__(self, a: GPT2Arch, tp: TPGroup):
        super().__init__()
        part = even_part(a.inner, tp)
        self.c_fc = ColumnParallelLinear(a.hidden, [part], bias=True)
        self.c_proj = RowParallelLinear(part, a.hidden, bias=True, tp=tp)
        self.fused = False  # gelu_new as one Triton kernel (see fuse)

    def forward(self, x):
        if (
            self.fused
            and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16)
            and self.c_fc.weight.dtype == x.dtype
        ):
            # cuBLASLt's bias + GELU(tanh) epilogue: c_fc and gelu_new in one kernel. It applies
            # gelu to the fp32 accumulator, one rounding fewer than transformers in half precision
            # (fp32 keeps the exact two-step path below; an FP8 c_fc, whose weight is float8, too).
            h = torch._addmm_activation(self.c_fc.bias, x, self.c_fc.weight.t(), use_gelu=True)
            return self.c_proj(h)
        act = triton_ops().gelu_tanh if self.fused else gelu_tanh
        return self.c_proj(act(self.c_fc(x)))


class GPT2Model(nn.Module):
    def __init__(self, a: GPT2Arch, tp: TPGroup):
        super().__init__()
        self.wte = VocabParallelEmbedding(a.vocab_size, a.hidden, tp)
        # NOTE: given its weight, nn.Embedding skips its random init: on meta (the loader builds models
        # there) init.normal_ runs through torch's Python references, whose first use imports
        # torch._dynamo, sympy and FSDP: 5 s of a GPU server's start-up where nothing is cached.
        self.wpe = nn.Embedding(a.max_positions, a.hidden, _weight=torch.empty(a.max_positions, a.hidden))  # replicated
        self.h = nn.ModuleList(GPT2Block(a, i, tp) for i in range(a.num_layers))
        self.ln_f = nn.LayerNorm(a.hidden, eps=a.eps)


class GPT2LMHeadModel(nn.Module):
    """With tp > 1, this rank's shard of it (models/parallel.py)."""

    def __init__(self, cfg: dict, tp: TPGroup):
        super().__init__()
        self.arch = GPT2Arch(cfg)
        self.transformer = GPT2Model(self.arch, tp)
        self.lm_head = ParallelLMHead(self.arch.vocab_size, self.arch.hidden, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """GPT-2 always ties; re-run after `to_empty()`, which unties."""
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, positions, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x, residual = self.transformer.wte(input_ids) + self.transformer.wpe(positions), None
        for block in self.transformer.h:
            x, residual = block(x, residual, batch, attn)
        return add_layernorm(self.transformer.ln_f, x, residual, self.transformer.h[0].fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype (on every rank); sampling upcasts them only when it needs to."""
        return self.lm_head(hidden)  # drops the padded rows' logits (see fuse)

    def fuse(self) -> None:
        """The fused CUDA path: residual adds inside the LayerNorm kernels, gelu_new as one
        kernel (the projections are already fused), and the tied embedding padded to a multiple
        of 64 rows for the LM head.

        NOTE: GPT-2's vocab of 50257 is odd; cuBLAS then cannot use its aligned Hopper kernels
        and runs the LM head on an sm75 one, 5x slower (128 us per decode step at batch 128 on an
        H200). The zero rows are never looked up (ids < vocab) and their logits are sliced off.
        With tp > 1 each rank pads its own shard of the vocab.
        """
        for block in self.transformer.h:
            block.fused = block.mlp.fused = True
        wte = self.transformer.wte.weight
        pad = -wte.shape[0] % 64
        if pad:
            padded = torch.cat([wte.detach(), wte.new_zeros(pad, wte.shape[1])])
            self.transformer.wte.weight = nn.Parameter(padded, requires_grad=False)
            self.tie_weights()

    def kv_geometry(self) -> tuple[int, int, int]:
        """(num_layers, kv_heads, head_dim) of this rank's KV pool: its heads only."""
        return self.arch.num_layers, self.local_heads(), self.arch.head_dim

    def local_heads(self) -> int:
        """Query heads this rank computes."""
        return self.transformer.h[0].attn.num_heads

"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

One decoder; the architectures differ only in switches read from config.json:
    q/k/v bias      Qwen2 always, Llama when attention_bias
    q/k RMSNorm     Qwen3 (per head, before RoPE)
    sliding window  Mistral when sliding_window is set
Module names match the checkpoint's, so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.common.engine.attention.base import AttentionBackend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.models import fp8
from pdserve.common.engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, merge_linears, triton_ops
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


def rope_params(cfg: dict) -> dict:
    """RoPE settings from either transformers 5's `rope_parameters` or the older `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        rope = {**cfg["rope_scaling"], **rope}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


class LlamaArch:
    """The switches of one architecture, resolved from config.json."""

    def __init__(self, cfg: dict):
        arch = cfg["architectures"][0]
        self.hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.num_heads
        self.intermediate = cfg["intermediate_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.vocab_size = cfg["vocab_size"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.rope = rope_params(cfg)
        self.qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.qk_norm = arch == "Qwen3ForCausalLM"
        self.tie_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
        self.sliding_window = int(window) if window else None


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArch, layer_id: int, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.self_attn = SelfAttention(a, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        self.mlp = GatedMLP(a, tp)

    def forward(self, x, residual, positions, batch: ForwardBatch, attn: AttentionBackend):
        """(this layer's MLP output, the residual stream before it); the next norm adds the two."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, batch, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class SelfAttention(nn.Module):
    """This rank's heads (parallel.py): q/k/v column-parallel, o row-parallel."""

    def __init__(self, a: LlamaArch, layer_id: int, tp: TPGroup):
        super().__init__()
        q_heads, kv_heads, d = heads_of_rank(a.num_heads, tp), heads_of_rank(a.kv_heads, tp), a.head_dim
        self.num_heads, self.kv_heads, self.head_dim = len(q_heads), len(kv_heads), d
        self.q_proj = ColumnParallelLinear(a.hidden, [head_columns(q_heads, d)], bias=a.qkv_bias)
        self.k_proj = ColumnParallelLinear(a.hidden, [head_columns(kv_heads, d)], bias=a.qkv_bias)
        self.v_proj = ColumnParallelLinear(a.hidden, [head_columns(kv_heads, d)], bias=a.qkv_bias)
        self.o_proj = RowParallelLinear(head_columns(q_heads, d), a.hidden, bias=False, tp=tp)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.eps)
            self.k_norm = RMSNorm(a.head_dim, a.eps)
        self.qk_norm = a.qk_norm
        self.rotary = RotaryEmbedding(a.head_dim, a.rope)
        self.attn = PagedAttention(layer_id, self.num_heads, self.kv_heads, d, a.sliding_window)
        self.rope_and_store = False  # rotary and the KV store as one backend call (see fuse)

    def fuse(self) -> None:
        """q/k/v as one GEMM; rotary as one kernel, which also stores K and V where the backend can."""
        self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        self.rotary.fused = True
        self.rope_and_store = 2 * self.rotary.inv_freq.numel() == self.head_dim  # no partial rotary

    def forward(self, x, positions, batch: ForwardBatch, attn: AttentionBackend):
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            q_size, kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)  # strided views
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.kv_heads, self.head_dim)
            v = v.view(t, self.kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_and_store and attn.fuses_rope_and_store:
            # One launch rotates q and k in place and writes k, v to the pool; attention only reads.
            attn.rope_and_store(q, k, v, positions, self.rotary.inv_freq, self.attn.layer_id, batch)
            return self.o_proj(self.attn(q, k, v, batch, attn, kv_stored=True))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch, attn))


class GatedMLP(nn.Module):
    """gate/up column-parallel, down row-parallel."""

    def __init__(self, a: LlamaArch, tp: TPGroup):
        super().__init__()
        part = even_part(a.intermediate, tp)
        self.gate_proj = ColumnParallelLinear(a.hidden, [part], bias=a.mlp_bias)
        self.up_proj = ColumnParallelLinear(a.hidden, [part], bias=a.mlp_bias)
        self.down_proj = RowParallelLinear(part, a.hidden, bias=a.mlp_bias, tp=tp)
        self.fp8_down = False  # fused, with an FP8 down_proj: silu-and-multiply writes its float8 input

    def fuse(self) -> None:
        """gate and up as one GEMM, then one silu-and-multiply kernel."""
        self.gate_up_proj = merge_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.fp8_down = isinstance(self.down_proj, fp8.Fp8Linear)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            if self.fp8_down and fp8.gate_up_fuses(x, self.gate_up_proj):
                return self.down_proj(fp8.gate_up_silu(x, self.gate_up_proj))
            gate_up = self.gate_up_proj(x)
            if self.fp8_down:
                from pdserve.common.engine.models import fp8_kernels

                return self.down_proj(fp8.Fp8Input(*fp8_kernels.silu_mul_fp8(gate_up, fp8.MIN_AMAX), gate_up.dtype))
            return self.down_proj(triton_ops().silu_mul(gate_up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArch, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden, tp)
        self.layers = nn.ModuleList(DecoderLayer(a, i, tp) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden, a.eps)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2 and Qwen3 checkpoints (see LlamaArch). With tp > 1, this rank's
    shard of it (models/parallel.py)."""

    def __init__(self, cfg: dict, tp: TPGroup):
        super().__init__()
        a = LlamaArch(cfg)
        self.arch = a
        self.model = LlamaModel(a, tp)
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint ties them.

        NOTE: re-run after `to_empty()`, which gives every parameter fresh storage and unties them.
        """
        if self.arch.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, batch, attn)
        return self.model.norm(x, residual)[0]

    def fuse(self) -> None:
        """Switch to the fused CUDA path: merged projections and Triton kernels for the small ops.

        Called after the weights are loaded; the eager HF-arithmetic path stays the reference.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.fused = True
            # Each norm's output is read by one (merged) projection: an FP8 one takes it in float8.
            layer.input_layernorm.fp8_out = isinstance(layer.self_attn.qkv_proj, fp8.Fp8Linear)
            layer.post_attention_layernorm.fp8_out = isinstance(layer.mlp.gate_up_proj, fp8.Fp8Linear)
        self.model.norm.fused = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype (on every rank); sampling upcasts them only when it needs to."""
        return self.lm_head(hidden)

    def kv_geometry(self) -> tuple[int, int, int]:
        """(num_layers, kv_heads, head_dim) of this rank's KV pool: its KV heads only."""
        attn = self.model.layers[0].self_attn
        return self.arch.num_layers, attn.kv_heads, self.arch.head_dim

    def local_heads(self) -> int:
        """Query heads this rank computes."""
        return self.model.layers[0].self_attn.num_heads

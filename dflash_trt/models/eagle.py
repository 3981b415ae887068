"""EAGLE-3-style baseline drafter: one decoder layer over [token embedding ; fused target features], drafting a chain.

At position p the layer reads the pair (g_p, x_{p+1}): g_p = fc(features of layer ids at p)
(the fused low/mid/high target features), or, while drafting, the layer's own output at the
previous position; x_{p+1} is the next token. Its output predicts x_{p+2} through the
target's lm_head and is fed back as the next g. q/k/v read both halves (2H → heads), as in
EAGLE-3's first layer. Checkpoint format: ours (`architectures: [DFlashTrtEagle3Drafter]`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DrafterConfig
from ..kv_cache import AttentionBatch, PagedKVCache
from .layers import MLP, RMSNorm, Rotary, apply_rope, paged_attention, register_d2t



class EagleAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(h2, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, feature_width: int):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(feature_width, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the fused / fed-back hidden
        self.self_attn = EagleAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        register_d2t(self, cfg.draft_vocab_size)

    def new_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        p = self.fc.weight
        return PagedKVCache(1, self.cfg.num_kv_heads, self.cfg.head_dim, num_pages, page_size, p.dtype, p.device, name="eagle")

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))

    def layer(self, embeds, hidden, cos, sin, attend):
        """The decoder layer on pairs; `attend(q, k, v)` does the attention → [T, nh*hd]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        h = hidden + self.self_attn.o_proj(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """Pairs at `batch.positions` → the layer output [T, H] (pre-norm: fed back as the next hidden)."""
        cos, sin = self.rotary(batch.positions, embeds.dtype)

        def attend(q, k, v):
            cache.k[0, batch.write_slots] = k.to(cache.k.dtype)
            cache.v[0, batch.write_slots] = v.to(cache.v.dtype)
            return paged_attention(q, cache.k[0], cache.v[0], batch, causal=True)

        return self.layer(embeds.to(self.fc.weight.dtype), hidden, cos, sin, attend)

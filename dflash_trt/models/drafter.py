"""DFlash drafter (z-lab's `DFlashDraftModel`) in plain torch over a paged context KV cache.

Context: target features → `fc` → `hidden_norm` give one fused context vector per token;
every layer projects it with its own k_proj / v_proj ("KV injection"), k_norm, RoPE at
the token's position. All layers' context K/V are one GEMM, [T, H] × [H, L·2·nkv·hd],
computed once when a token's features arrive and kept in the drafter cache.

Block: [last token, mask × K] at positions [p, p+K+1), embedded with the target's
embedding. Its queries attend to the cached context plus the block's own K/V, without a
causal mask (sliding layers: causal by default, see DrafterConfig.layer_is_causal). The
block K/V are scratch: written after the context, then dropped by the caller.
The drafter has no embedding or lm_head; both come from the target.
"""

from __future__ import annotations


import torch
from torch import nn

from ..config import DrafterConfig
from ..kv_cache import AttentionBatch, PagedKVCache
from .. import kernels
from .layers import MLP, AttentionProjections, RMSNorm, Rotary, register_d2t


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = AttentionProjections(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.causal = cfg.layer_is_causal(index)
        self.window = cfg.layer_window(index)

    def forward(self, x, cos, sin, k_pool, v_pool, batch: AttentionBatch):
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        k_pool[batch.write_slots] = k.to(k_pool.dtype)
        v_pool[batch.write_slots] = v.to(v_pool.dtype)
        attn = kernels.block_attention(q, k_pool, v_pool, batch, causal=self.causal, window=self.window)
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, feature_width: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        register_d2t(self, cfg.draft_vocab_size)

    def fuse_context_projections(self) -> None:
        """Stack every layer's k_proj and v_proj into one weight: rows [layer, k|v, nkv·hd]."""
        attn = [layer.self_attn for layer in self.layers]
        self.ctx_kv_weight = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attn]).detach()
        self.ctx_kv_bias = (
            torch.cat([torch.cat([a.k_proj.bias, a.v_proj.bias]) for a in attn]).detach() if self.cfg.attention_bias else None
        )
        self.ctx_k_norm = torch.stack([a.k_norm.weight for a in attn]).detach()  # [L, hd]

    def new_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        p, nkv = self.fc.weight, self.layers[0].self_attn.num_kv_heads  # this rank's heads under TP
        return PagedKVCache(self.cfg.num_layers, nkv, self.cfg.head_dim, num_pages, page_size, p.dtype, p.device, name="drafter")

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, cache: PagedKVCache) -> None:
        """features: [T, n_ids·H_target] for tokens at `positions` → their K/V in every layer's cache."""
        cfg = self.cfg
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [T, H]
        kv = torch.nn.functional.linear(ctx, self.ctx_kv_weight, self.ctx_kv_bias)
        # k_norm, RoPE and the paged scatter of every layer's K/V: one kernel on CUDA
        cos, sin = self.rotary(positions, kv.dtype)
        kernels.kv_inject(kv, self.ctx_k_norm, cos, sin, write_slots, cache.k, cache.v, cfg.rms_norm_eps)

    def forward(self, block_embeds: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """block_embeds: [T, H] (target embedding of the blocks) → final-normed hidden [T, H]."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary(batch.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], batch)
        return self.norm(x)

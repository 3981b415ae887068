"""Target model (Llama 3.x, Qwen3, gpt-oss) in plain torch over a paged KV cache.

Parameter names equal Hugging Face's, so a checkpoint loads without a name map.
Besides logits, the forward returns the DFlash context features: the output of each
decoder layer in `capture_layers` (hidden + residual, before the final norm, i.e. HF's
`hidden_states[id + 1]`), concatenated along the hidden axis.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..config import TargetConfig
from ..kv_cache import AttentionBatch, PagedKVCache
from .layers import MLP, AttentionProjections, LocalVocab, RMSNorm, Rotary, dense_linear, paged_attention, project
from .moe import MoE


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, index: int):
        super().__init__()
        self.window = cfg.layer_window(index)  # None: full attention
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = AttentionProjections(cfg, sinks=cfg.attention_sinks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)

    def forward(self, x, cos, sin, k_pool, v_pool, batch: AttentionBatch):
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        k_pool[batch.write_slots] = k.to(k_pool.dtype)
        v_pool[batch.write_slots] = v.to(v_pool.dtype)
        attn = paged_attention(q, k_pool, v_pool, batch, causal=True, window=self.window, sinks=self.self_attn.sinks)
        x = x + project(self.self_attn.o_proj, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.vocab = LocalVocab()  # tp.apply_tp replaces it: logits are then this rank's vocab columns
        self.lm_head_packed = None  # a models.packed weight of lm_head_weight under --cpu-weights (packed.pack_weights)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] after the final norm → logits [n, V] (fp32)."""
        if self.lm_head_packed is not None:
            return self.lm_head_packed.linear(hidden).float()
        return dense_linear(hidden, self.lm_head_weight).float()

    def new_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        p, nkv = self.model.embed_tokens.weight, self.model.layers[0].self_attn.num_kv_heads  # this rank's heads under TP
        return PagedKVCache(self.cfg.num_layers, nkv, self.cfg.head_dim, num_pages, page_size, p.dtype, p.device, name="target")

    def forward(
        self,
        tokens: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens: [T] new tokens of the batch → (logits [n, V] for `logits_rows` (all rows if None),
        features [T, len(capture_layers) * H] or None). Writes the new tokens' K/V into `cache`."""
        x = self.embed(tokens)
        cos, sin = self.rotary(batch.positions, x.dtype)
        last = self.cfg.num_layers - 1
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], batch)
            if i in capture_layers and i != last:
                captured[i] = x
        h = self.model.norm(x)
        if last in capture_layers:
            captured[last] = h  # HF's hidden_states[-1] is the final-normed output
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        if logits_rows is not None:
            h = h[logits_rows]
        return self.logits(h), features

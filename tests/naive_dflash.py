"""A deliberately naive DFlash drafter: no cache, no batching, explicit per-head loops.

It reads the raw config.json and safetensors and recomputes everything for one block from
the full context, following z-lab's `DFlashDraftModel` semantics (reference/dflash-peers.md §1):
context K/V = k_norm/rope(k_proj(hidden_norm(fc(features)))) per layer, the block's queries
attend to context + block, non-causal unless the layer is sliding (then causal + window).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x, w, eps):
    x = x.double()
    return (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)) * w.double()


def _rope(x, pos, theta):
    # x: [n, heads, hd]; rotate pairs (i, i + hd/2) by angle pos * theta^(-2i/hd)
    hd = x.shape[-1]
    out = x.clone()
    for i in range(hd // 2):
        angle = pos.double()[:, None] * (theta ** (-2 * i / hd))
        a, b = x[..., i], x[..., i + hd // 2]
        out[..., i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[..., i + hd // 2] = b * torch.cos(angle) + a * torch.sin(angle)
    return out


def naive_block_logits(drafter_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor, features: torch.Tensor, block: list[int], start: int) -> torch.Tensor:
    """features: [start, F] for context positions 0..start-1; block tokens at start.. → logits [len(block)-1, V]."""
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(Path(drafter_dir) / "model.safetensors")).items()}
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    causal_override = cfg.get("dflash_config", {}).get("causal")
    n, C = len(block), features.shape[0]

    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = embed.detach().double()[torch.tensor(block)]
    q_pos = torch.arange(start, start + n)
    k_pos = torch.arange(0, start + n)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
        src = torch.cat([ctx, x])  # context rows use the fused context, block rows the layer input
        k = (src @ w[p + "self_attn.k_proj.weight"].T).view(C + n, nkv, hd)
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
        v = (src @ w[p + "self_attn.v_proj.weight"].T).view(C + n, nkv, hd)
        sliding = types[layer] == "sliding_attention"
        causal = sliding if causal_override is None else causal_override
        window = cfg.get("sliding_window") if sliding else None
        out = torch.zeros(n, nh, hd, dtype=torch.float64)
        for head in range(nh):
            g = head // (nh // nkv)
            for i in range(n):
                scores = []
                for j in range(C + n):
                    qp, kp = int(q_pos[i]), int(k_pos[j])
                    visible = (not causal or kp <= qp) and (window is None or (qp - kp < window and (causal or kp - qp < window)))
                    scores.append(float(q[i, head] @ k[j, g]) / math.sqrt(hd) if visible else -math.inf)
                probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[i, head] = probs @ v[:, g]
        h = h + out.reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    out = _rms(h, w["norm.weight"], eps)
    return (out[1:] @ lm_head.detach().double().T).float()

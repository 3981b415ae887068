"""gpt-oss's mixture-of-experts MLP, as transformers' modeling_gpt_oss.py computes it, with HF's names.

Each token goes to the `num_experts_per_tok` experts with the largest router logits, weighted by a
softmax over those chosen logits only. Expert weights are stored input-major (`x @ W`), and the
gate and up projections are interleaved along the last axis: gate = columns 0, 2, 4..., up = 1, 3, 5...

Under tensor parallelism (tp.apply_tp) every rank holds every expert's slice of the intermediate
dimension (shard_rules.py says why), so a rank's experts give partial sums: they are all-reduced once per
layer, and the down projection's bias (whole on every rank) is added after the reduction.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TargetConfig


class Experts(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        # The input of the down projection, as a module so that calibration can hook it (quant/calibrate.py).
        self.down_input = nn.Identity()

    def expert(self, e: int, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """Expert `e` on x: [n, H] → [n, H]: a SwiGLU with clamped inputs, sigmoid gain alpha and up + 1."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2I]
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        out = self.down_input((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[e]
        return out + self.down_proj_bias[e] if bias else out


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = Experts(cfg)
        self.tp = None  # a tp.TPGroup once tp.apply_tp has sharded the experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H]."""
        top_logits, top_experts = self.router(x).topk(self.top_k, dim=-1)  # [T, k]
        weights = top_logits.softmax(dim=-1)
        out = torch.zeros_like(x)
        whole = self.tp is None
        for e in top_experts.unique().tolist():  # ascending, as transformers sums them
            token, slot = (top_experts == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.experts.expert(e, x[token], bias=whole) * weights[token, slot, None])
        if whole:
            return out
        # Σ_k w_k (partial_k + b_k) = all_reduce(Σ_k w_k partial_k) + Σ_k w_k b_k
        bias = (weights.unsqueeze(-1) * self.experts.down_proj_bias[top_experts]).sum(dim=1)
        return self.tp.all_reduce(out) + bias

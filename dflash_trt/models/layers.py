"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP, paged attention.

Tokens are flat: activations are [T, hidden] for all new tokens of a batch, sequences
concatenated; `AttentionBatch` says which rows belong to which sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RopeConfig, TransformerConfig, rope_inv_freq
from ..kv_cache import AttentionBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, cast back before the weight: what transformers' Llama/Qwen3 RMSNorm does
        # (F.rms_norm of the fp32 copy: the same math as x·rsqrt(mean(x²) + eps) in one op, bit for bit on CPU)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for positions, with rotate-half (non-interleaved) layout."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.inv_freq = torch.tensor(rope_inv_freq(self.rope, self.head_dim), dtype=torch.float32)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
        cos, sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:  # yarn scales cos and sin (so q·k by its square)
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, hd]. x·cos + rotate_half(x)·sin, rotate_half(x) = [-x₂, x₁]: computed as
    roll(x)·[-sin₁, sin₂] (the same products, a sign moved onto the small table; fewer ops per call)."""
    half = x.shape[-1] // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return x * cos[:, None, :] + x.roll(half, dims=-1) * signed[:, None, :]


# Row counts at which a CPU fp32 matmul runs as (W · xᵀ)ᵀ (see dense_linear); 0 turns it off.
SMALL_ROWS = (1, 16)
# One row runs as two (the row twice): measured on a 2-core AVX512 EPYC, SmolLM2-135M fp32, weights from DRAM, the
# step's matmuls took 42 ms as GEMVs and 17 ms as 2-row GEMMs (examples/bench/drafter-r2/README.md).
PAD_ONE_ROW = True


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as (weight · xᵀ)ᵀ for a few fp32 rows on a CPU.

    x · Wᵀ with x of a few rows and W large is what a decode step and a verify block are made of. For 2-16
    rows in fp32 torch's CPU BLAS call for F.linear runs at a fraction of the memory bandwidth, and the same
    product asked as W · xᵀ (W the left operand, streamed once) takes 0.4-0.8× the time (docs/perf notes in
    the closing notes of issue 21); one row is a GEMV either way. Same math, another summation order: fp32 results agree to
    rounding, as any two BLAS kernels do."""
    rows = x.numel() // x.shape[-1]
    lo, hi = SMALL_ROWS
    if lo <= rows <= hi and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and not torch.is_grad_enabled():
        if rows == 1 and PAD_ONE_ROW:  # as two rows: the GEMM kernel streams W from memory far faster than the GEMV
            y = torch.mm(weight, x.expand(2, -1).contiguous().t())[:, :1].t().contiguous()
        else:
            y = torch.mm(weight, x.t()).t().contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for any projection module; a plain nn.Linear without hooks (calibration hooks its linears) goes
    through dense_linear."""
    if type(linear) is nn.Linear and not (linear._forward_pre_hooks or linear._forward_hooks):
        return dense_linear(x, linear.weight, linear.bias)
    return linear(x)


class FusedLinear:
    """Linears of one input (q/k/v, gate/up) run as one matmul: their weights become row blocks of one tensor.

    Each nn.Linear keeps its Parameter, name and shape (state_dict, checkpoints and TP shard rules see no change);
    only its storage moves into the concatenated weight, so a weight updated in place is updated in both.
    `live(parent)` says whether the fused weight still is what the linears hold: it is not once a linear was
    replaced (tp.apply_tp), re-cast (`.to(dtype)`) or given new storage, and then a call runs them one by one.
    Inference only: under autograd the fused tensor would carry no gradient to the Parameters, so `live` is
    false while grad mode is on.
    """

    def __init__(self, parent: nn.Module, names: tuple[str, ...]):
        linears = [getattr(parent, n) for n in names]
        if any(type(m) is not nn.Linear for m in linears):
            raise TypeError(f"FusedLinear fuses plain nn.Linear modules only, got {[type(m).__name__ for m in linears]}")
        self.names, self.linears = names, linears
        self.sizes = [m.out_features for m in linears]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in linears])
            self.bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
        start = 0
        for m, n in zip(linears, self.sizes):
            m.weight.data = self.weight[start : start + n]
            if self.bias is not None:
                m.bias.data = self.bias[start : start + n]
            start += n
        self._ptrs = [self._storage(m) for m in linears]  # where each linear's weight (and bias) now live
        self.packed = None  # a models.packed weight (Int8Weight, OnednnWeight) of `weight` under --cpu-weights

    @staticmethod
    def _storage(m: nn.Linear) -> tuple[int, int | None]:
        return m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()

    def intact(self, parent: nn.Module) -> bool:
        """The linears are still the ones fused, on the fused storage."""
        return all(getattr(parent, name) is m and self._storage(m) == ptrs for name, m, ptrs in zip(self.names, self.linears, self._ptrs))

    def live(self, parent: nn.Module) -> bool:
        return not torch.is_grad_enabled() and self.intact(parent)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x · [W₁|W₂|…]ᵀ (+ bias): the linears' outputs side by side. Only while `live`."""
        return dense_linear(x, self.weight, self.bias) if self.packed is None else self.packed.linear(x, self.bias)

    def __call__(self, parent: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The linears' outputs for input x: one matmul while `live(parent)`, else each of parent's linears."""
        if self.live(parent):
            return self.matmul(x).split(self.sizes, dim=-1)
        return tuple(project(getattr(parent, name), x) for name in self.names)


def fuse_projections(model: nn.Module, on: bool = True) -> bool:
    """Fuse (or stop fusing) q/k/v and gate/up in every AttentionProjections / MLP of `model`.
    Fusing again (after a re-cast or a new shard) re-concatenates from the linears' current weights.
    Returns whether any of them was fused before (to restore it: quant/calibrate.py hooks the linears)."""
    was = False
    for module in model.modules():
        if isinstance(module, (AttentionProjections, MLP)):
            was = was or module._fused is not None
            module.fuse(on)
    return was


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self._fused: FusedLinear | None = None

    def fuse(self, on: bool = True) -> None:
        """One [gate|up] matmul per call (FusedLinear)."""
        self._fused = FusedLinear(self, ("gate_proj", "up_proj")) if on else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._fused(self, x) if self._fused is not None else (project(self.gate_proj, x), project(self.up_proj, x))
        return project(self.down_proj, F.silu(gate) * up)


class AttentionProjections(nn.Module):
    """q/k/v/o projections, the optional per-head q/k RMSNorm (Qwen3) and attention sinks (gpt-oss), as HF names them."""

    def __init__(self, cfg: TransformerConfig, sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if sinks else None  # [nh] logits, see paged_attention
        self._fused: FusedLinear | None = None

    def fuse(self, on: bool = True) -> None:
        """One [q|k|v] matmul per call (FusedLinear); o_proj stays apart (its input is the attention output)."""
        self._fused = FusedLinear(self, ("q_proj", "k_proj", "v_proj")) if on else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] → q [T, nh, hd], k and v [T, nkv, hd], normed and rotated."""
        T = x.shape[0]
        nh, nkv = self.num_heads, self.num_kv_heads
        if self._fused is not None and self.q_norm is None and self._fused.live(self):
            # one RoPE call for q and k: the fused output's heads are [q | k | v]
            qkv = self._fused.matmul(x).view(T, nh + 2 * nkv, self.head_dim)
            qk = apply_rope(qkv[:, : nh + nkv], cos, sin)
            return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        q, k, v = self._fused(self, x) if self._fused is not None else (project(self.q_proj, x), project(self.k_proj, x), project(self.v_proj, x))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def draft_vocab_head(lm_head: torch.Tensor, d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of the shared lm_head a drafter proposes from, and their target token ids.

    With a reduced draft vocabulary (EAGLE-3's `d2t`: draft token i is target token i + d2t[i])
    only those rows are multiplied, which cuts the drafter's largest GEMM; verification still
    uses the full vocabulary, so the output is unchanged. Without `d2t`: all rows, ids = None.
    """
    if d2t is None:
        return lm_head, None
    ids = torch.arange(len(d2t), device=d2t.device) + d2t
    return lm_head[ids].contiguous(), ids


class LocalVocab:
    """How a backend turns the target's logits into tokens and scores: here, the whole vocabulary on one process.
    tp.apply_tp swaps in its vocabulary-parallel twin (tp.ShardedVocab, same methods), so the backend never
    branches on tensor parallelism."""

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] → the argmax token ids [n]."""
        return logits.argmax(dim=-1)

    def full_logits(self, logits: torch.Tensor, rows: list[int], need: list[bool]) -> list[torch.Tensor | None]:
        """Per sequence (`rows` logit rows each): its full-vocabulary logits where `need`, else None."""
        return [f if n else None for f, n in zip(logits.split(rows), need)]

    def draft_head(self, lm_head: torch.Tensor, d2t: torch.Tensor | None):
        """(rows of the head a drafter scores, their token ids or None, scores [n, rows] → best row [n])."""
        head, ids = draft_vocab_head(lm_head, d2t)
        return head, ids, lambda scores: scores.argmax(dim=-1)


def register_d2t(module: nn.Module, size: int | None) -> None:
    """The optional `d2t` tensor of a drafter checkpoint (int64 [draft_vocab_size])."""
    if size is None:
        module.d2t = None
    else:
        module.register_buffer("d2t", torch.zeros(size, dtype=torch.long))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: AttentionBatch,
    causal: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a batch's new queries over their sequences' pooled keys.

    q: [T, nh, hd]; k_pool, v_pool: [slots, nkv, hd] (one layer); returns [T, nh * hd].
    The new tokens' own K/V must already be written to the pool.
    sinks: [nh] (gpt-oss): a per-head logit joins each softmax's denominator with no value of its own,
    so a query may attend to "nothing"; the probabilities of real keys then sum to less than 1.
    """
    T, nh, hd = q.shape
    B, Lk = batch.kv_slots.shape
    nkv = k_pool.shape[1]
    Lq = batch.q_index.shape[1]
    unpadded = batch.unpadded()
    if unpadded:  # the flat rows are [B, Lq] as is
        qp = q.reshape(B, Lq, nh, hd).transpose(1, 2)  # [B, nh, Lq, hd]
    else:  # index_select, not advanced indexing: the same gather, ~8x faster on CPU (aten::index was a fifth of a batch-16 step)
        qp = q.index_select(0, batch.q_index.reshape(-1)).view(B, Lq, nh, hd).transpose(1, 2)
    run = batch.kv_run()
    if run is not None:  # one sequence on consecutive slots: a view of the pool, no copy
        k, v = k_pool[run[0] : run[1]], v_pool[run[0] : run[1]]
    else:
        slots = batch.kv_slots.reshape(-1)
        k, v = k_pool.index_select(0, slots), v_pool.index_select(0, slots)
    k = k.view(B, Lk, nkv, hd).transpose(1, 2)
    v = v.view(B, Lk, nkv, hd).transpose(1, 2)
    mask = None if sinks is None and batch.mask_is_full(causal, window) else batch.mask(causal, window)
    if sinks is None:
        # GQA as grouped queries: the g = nh / nkv heads that share a kv head become g·Lq query rows of it (head h reads
        # kv head h // g), so the kernel sees nkv heads and never expands K/V; the same products, ~2x faster on CPU
        # for decode steps (2 cores, torch 2.13: 39 vs 82 us at 9/3 heads x 230 keys, bf16)
        g = nh // nkv
        rows = g * Lq
        qg = qp.contiguous().view(B, nkv, rows, hd)
        # the additive form, built once per batch (a bool mask is converted to it inside SDPA at every layer: 155 vs
        # 119 us for a 16-token verify, bit for bit the same)
        mg = None if mask is None else batch.grouped_additive_mask(causal, window, g, q.dtype)
        pad_one = rows == 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
        if pad_one:
            # torch's CPU flash kernel takes ~2.5x longer for one half-precision query row than for two (135 vs 54 us
            # at 9 heads x 230 keys): the row twice, the first output kept
            qg = qg.expand(B, nkv, 2, hd).contiguous()
            mg = None if mg is None else mg.expand(B, 1, 2, Lk)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg)
        out = out[:, :, :rows].reshape(B, nh, Lq, hd)
    else:
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = (qp @ k.transpose(-1, -2)).float() * hd**-0.5  # [B, nh, Lq, Lk]
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.float().view(1, nh, 1, 1).expand(B, nh, scores.shape[2], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = probs.to(v.dtype) @ v
    out = out.transpose(1, 2).reshape(B * Lq, nh * hd)
    return out if unpadded else out.index_select(0, batch.valid_rows())

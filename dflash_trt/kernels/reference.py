"""Plain torch references of the kernels: the semantics every Triton kernel and TensorRT plugin must match.

They are what the torch backend runs off CUDA, and the oracle of tests/test_kernels.py.
"""

from __future__ import annotations

import torch

from ..kv_cache import AttentionBatch
from ..models.layers import apply_rope, paged_attention
from ..quant.fp8 import dequantize_fp8, quantize_fp8


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as the cache stores them: FP8 pools hold x / scale, saturated (quant.fp8); others a plain cast."""
    if dtype == torch.float8_e4m3fn:
        return quantize_fp8(x, torch.tensor(scale, dtype=torch.float32))
    return x.to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(x, torch.tensor(scale, dtype=torch.float32), dtype)
    return x.to(dtype)


def kv_inject_reference(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The epilogue of the fused context GEMM: k_norm, RoPE, paged scatter, for every drafter layer.

    kv: [T, L·2·nkv·hd] rows laid out [layer, k|v, nkv, hd]; k_norm_weight: [L, hd];
    cos/sin: [T, hd] in kv's dtype; write_slots: [T]; k_cache/v_cache: [L, slots, nkv, hd].
    """
    L, _, nkv, hd = k_cache.shape
    kv = kv.view(-1, L, 2, nkv, hd)
    k, v = kv[:, :, 0], kv[:, :, 1]  # [T, L, nkv, hd]
    # per-layer k_norm (RMSNorm over head_dim), fp32 statistics like RMSNorm.forward
    k32 = k.float()
    k = (k32 * torch.rsqrt(k32.pow(2).mean(-1, keepdim=True) + eps)).to(k.dtype)
    k = k * k_norm_weight[None, :, None, :]
    T = k.shape[0]
    k = apply_rope(k.reshape(T, L * nkv, hd), cos, sin).view(T, L, nkv, hd)
    k_cache[:, write_slots] = to_cache(k.transpose(0, 1), k_cache.dtype, k_scale)
    v_cache[:, write_slots] = to_cache(v.transpose(0, 1), v_cache.dtype, v_scale)


def block_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: AttentionBatch,
    causal: bool,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, nh, hd]; pools [slots, nkv, hd] (FP8 ones are dequantized with their scale) → [T, nh·hd]."""
    if k_pool.dtype == torch.float8_e4m3fn or v_pool.dtype == torch.float8_e4m3fn:
        k_pool, v_pool = from_cache(k_pool, q.dtype, k_scale), from_cache(v_pool, q.dtype, v_scale)
    return paged_attention(q, k_pool, v_pool, batch, causal=causal, window=window)


def accept_reference(
    drafts: torch.Tensor, num_drafts: torch.Tensor, target_tokens: torch.Tensor, seq_lens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """drafts [B, K], num_drafts [B], target argmax [B, K+1], lengths [B] → (accepted, bonus, lengths + accepted + 1).

    accepted_b = longest j ≤ num_drafts_b with drafts[b, :j] == target_tokens[b, :j]; the bonus
    is target_tokens[b, accepted_b], the target's token after the accepted prefix.
    """
    K = drafts.shape[1]
    match = (drafts == target_tokens[:, :K]) & (torch.arange(K, device=drafts.device) < num_drafts[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accepted[:, None])[:, 0]
    new_lens = None if seq_lens is None else seq_lens + accepted + 1
    return accepted, bonus, new_lens

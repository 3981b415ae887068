"""KV injection epilogue in Triton: k_norm (RMSNorm, fp32 stats) → RoPE → paged scatter of K and V.

The context GEMM [T, H] × [H, L·2·nkv·hd] stays on cuBLAS; this kernel reads its output once
and writes every layer's K and V straight into the paged drafter cache.
Semantics: reference.kv_inject_reference (including its roundings to the activation dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_to


@triton.jit
def kv_inject_kernel(
    kv_ptr,  # [T, L·2·nkv·hd] activation dtype
    k_norm_ptr,  # [L, hd]
    cos_ptr,  # [T, hd] activation dtype
    sin_ptr,
    slots_ptr,  # [T] int32/int64
    k_cache_ptr,  # [L, num_slots, nkv, hd]
    v_cache_ptr,
    num_slots,
    eps,
    k_scale,  # FP8 caches store x / scale; ignored otherwise
    v_scale,
    NUM_LAYERS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    layer_head = tl.program_id(1)  # layer · nkv + head
    layer = layer_head // NUM_KV_HEADS
    head = layer_head % NUM_KV_HEADS
    act = kv_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)
    in_head = d < HEAD_DIM
    partner = tl.where(d < half, d + half, d - half)  # rotate-half: rot[d] = -x[d+half] | x[d-half]
    sign = tl.where(d < half, -1.0, 1.0)

    row = kv_ptr + t.to(tl.int64) * (NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM)
    k_row = row + (layer * 2 * NUM_KV_HEADS + head) * HEAD_DIM
    v_row = row + ((layer * 2 + 1) * NUM_KV_HEADS + head) * HEAD_DIM
    # bf16 is wrong in the interpreter unless loads go to fp32 at once
    k = tl.load(k_row + d, mask=in_head, other=0.0).to(tl.float32)
    k_p = tl.load(k_row + partner, mask=in_head, other=0.0).to(tl.float32)
    v = tl.load(v_row + d, mask=in_head, other=0.0).to(tl.float32)
    w = tl.load(k_norm_ptr + layer * HEAD_DIM + d, mask=in_head, other=0.0).to(tl.float32)
    w_p = tl.load(k_norm_ptr + layer * HEAD_DIM + partner, mask=in_head, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t.to(tl.int64) * HEAD_DIM + d, mask=in_head, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t.to(tl.int64) * HEAD_DIM + d, mask=in_head, other=0.0).to(tl.float32)

    rstd = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) / HEAD_DIM + eps)
    # each step rounds to the activation dtype, as the torch reference does
    k = round_to(round_to(k * rstd, act) * w, act)
    k_p = round_to(round_to(k_p * rstd, act) * w_p, act)
    k = round_to(round_to(k * cos, act) + round_to(sign * k_p * sin, act), act)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = ((layer.to(tl.int64) * num_slots + slot) * NUM_KV_HEADS + head) * HEAD_DIM + d
    if CACHE_FP8:  # the pools hold x / scale
        k = k / k_scale
        v = v / v_scale
    k_dtype = k_cache_ptr.dtype.element_ty
    v_dtype = v_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, round_to(k, k_dtype).to(k_dtype), mask=in_head)
    tl.store(v_cache_ptr + dst, round_to(v, v_dtype).to(v_dtype), mask=in_head)


def grid(num_tokens: int, num_layers: int, num_kv_heads: int) -> tuple[int, int, int]:
    """One program per (token, layer·kv head)."""
    return (num_tokens, num_layers * num_kv_heads, 1)


def kv_inject(kv, k_norm_weight, cos, sin, write_slots, k_cache, v_cache, eps, k_scale=1.0, v_scale=1.0) -> None:
    """Same arguments as reference.kv_inject_reference."""
    L, num_slots, nkv, hd = k_cache.shape
    T = kv.shape[0]
    if T == 0:
        return
    assert kv.is_contiguous() and kv.shape[1] == L * 2 * nkv * hd, "kv must be [T, L·2·nkv·hd]"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    kv_inject_kernel[grid(T, L, nkv)](
        kv, k_norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), write_slots, k_cache, v_cache,
        num_slots, eps, k_scale, v_scale,
        NUM_LAYERS=L, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=triton.next_power_of_2(hd), CACHE_FP8=fp8,
    )

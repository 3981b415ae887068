"""Block drafting attention in Triton: each request's (1+K)-token query block over its paged K/V.

Split-KV ("flash decoding"): a program owns one (request, kv head, key split) and all of the
block's queries of that head group, M = q_len · (nh / nkv) rows, so every K/V byte is read
once; a second kernel merges the splits. Keys are gathered through `kv_slots` (any paging),
masked as AttentionBatch.mask (non-causal or causal, optional sliding window). FP8 pools are
dequantized with a per-tensor scale as they are loaded. Semantics: reference.block_attention_reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .rounding import round_to

BLOCK_N = 32  # keys per inner step


@triton.jit
def block_attention_partial_kernel(
    q_ptr,  # [T, nh, hd]
    k_pool_ptr,  # [num_slots, nkv, hd] (one layer), fp32/fp16/bf16/fp8e4m3
    v_pool_ptr,
    kv_slots_ptr,  # [B, max_kv] pool slot of each key
    q_starts_ptr,  # [B] first row of each request's queries in q
    q_lens_ptr,  # [B]
    kv_lens_ptr,  # [B] keys per request (context + the block itself)
    acc_ptr,  # [B, nkv, splits, BLOCK_M, hd] fp32, unnormalized
    m_ptr,  # [B, nkv, splits, BLOCK_M] fp32 running max (log2 units)
    l_ptr,  # [B, nkv, splits, BLOCK_M] fp32 running sum
    max_kv,
    keys_per_split,  # a multiple of BLOCK_N
    qk_scale,  # log2(e) / sqrt(hd)
    k_scale,
    v_scale,
    window,  # sliding window (keys with |q_pos - k_pos| < window), <= 0: none
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 queries or pools: exact fp32 products; else tensor cores
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    q_start = tl.load(q_starts_ptr + b).to(tl.int64)
    q_len = tl.load(q_lens_ptr + b)
    kv_len = tl.load(kv_lens_ptr + b)
    first_q_pos = kv_len - q_len  # the block's own keys are the last q_len

    rows = tl.arange(0, BLOCK_M)  # row r = token r // GROUP, head g·GROUP + r % GROUP
    token = rows // GROUP
    head = g * GROUP + rows % GROUP
    row_valid = token < q_len
    q_pos = first_q_pos + token
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_off = ((q_start + token) * NUM_HEADS + head) * HEAD_DIM
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)

    # keys this program may need: its split ∩ [lowest visible key, kv_len)
    # int64 from the start: the window branch below mixes in kv_len's type, and Triton (on a GPU, not in the
    # interpreter) refuses a variable whose type changes inside an `if`
    lo = split.to(tl.int64) * keys_per_split
    hi = tl.minimum(lo + keys_per_split, kv_len.to(tl.int64))
    if window > 0:
        lo = tl.maximum(lo, (first_q_pos - window + 1) // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_len
        slot = tl.load(kv_slots_ptr + b.to(tl.int64) * max_kv + k_pos, mask=k_valid, other=0).to(tl.int64)
        kv_off = (slot * NUM_KV_HEADS + g) * HEAD_DIM
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_pool_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * k_scale
        v = tl.load(v_pool_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * v_scale
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        visible = row_valid[:, None] & k_valid[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            if not CAUSAL:
                visible = visible & (k_pos[None, :] - q_pos[:, None] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    part = ((b * NUM_KV_HEADS + g) * num_splits + split).to(tl.int64) * BLOCK_M + rows
    tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)


@triton.jit
def block_attention_combine_kernel(
    acc_ptr,  # as written by the partial kernel
    m_ptr,
    l_ptr,
    q_starts_ptr,
    q_lens_ptr,
    out_ptr,  # [T, nh·hd], q's dtype
    num_splits,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    q_start = tl.load(q_starts_ptr + b).to(tl.int64)
    q_len = tl.load(q_lens_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    token = rows // GROUP
    head = g * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    base = ((b * NUM_KV_HEADS + g) * num_splits).to(tl.int64) * BLOCK_M + rows
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s * BLOCK_M))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(m_ptr + base + s * BLOCK_M) - m_max)
        l_sum += w * tl.load(l_ptr + base + s * BLOCK_M)
        acc += w[:, None] * tl.load(acc_ptr + (base + s * BLOCK_M)[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    out_dtype = out_ptr.dtype.element_ty
    out_off = ((q_start + token) * NUM_HEADS + head) * HEAD_DIM
    mask = (token < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + out_off[:, None] + d[None, :], round_to(out, out_dtype).to(out_dtype), mask=mask)


def block_m(max_q: int, num_heads: int, num_kv_heads: int) -> int:
    """Query rows per program: the whole block of one kv head group, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(max_q * (num_heads // num_kv_heads)))


def num_splits(batch: int, num_kv_heads: int, max_kv: int, target_programs: int = 264) -> int:
    """Key splits so that batch · nkv · splits fills ~2 waves of an H200 (132 SMs), ≥ 2·BLOCK_N keys each."""
    per_split_min = 2 * BLOCK_N
    want = max(1, target_programs // max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_kv, per_split_min)))


def keys_per_split(max_kv: int, splits: int) -> int:
    return triton.cdiv(triton.cdiv(max_kv, splits), BLOCK_N) * BLOCK_N


def workspace_bytes(batch: int, num_kv_heads: int, splits: int, bm: int, head_dim: int) -> int:
    """fp32 acc [B, nkv, S, M, D] + m and l [B, nkv, S, M]."""
    rows = batch * num_kv_heads * splits * bm
    return 4 * rows * (triton.next_power_of_2(head_dim) + 2)


def block_attention(q, k_pool, v_pool, kv_slots, q_starts, q_lens, kv_lens, max_q, causal, window=None, k_scale=1.0, v_scale=1.0, splits=None):
    """q: [T, nh, hd]; pools [slots, nkv, hd]; kv_slots [B, max_kv]; q_starts/q_lens/kv_lens [B] → [T, nh·hd]."""
    T, nh, hd = q.shape
    nkv = k_pool.shape[1]
    B, max_kv = kv_slots.shape
    bm = block_m(max_q, nh, nkv)
    if k_pool.dtype != torch.float8_e4m3fn:  # scales apply to FP8 pools only, as in the reference
        k_scale = v_scale = 1.0
    splits = splits or num_splits(B, nkv, max_kv)
    bd = triton.next_power_of_2(hd)
    ws = torch.empty(B * nkv * splits * bm * (bd + 2), dtype=torch.float32, device=q.device)
    acc, m, l = ws.split([B * nkv * splits * bm * bd, B * nkv * splits * bm, B * nkv * splits * bm])
    out = torch.empty(T, nh * hd, dtype=q.dtype, device=q.device)
    block_attention_partial_kernel[(B, nkv, splits)](
        q.contiguous(), k_pool, v_pool, kv_slots.contiguous(), q_starts, q_lens, kv_lens, acc, m, l,
        max_kv, keys_per_split(max_kv, splits), math.log2(math.e) / math.sqrt(hd), k_scale, v_scale, window or 0,
        NUM_HEADS=nh, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=BLOCK_N,
        CAUSAL=causal, IEEE_DOT=torch.float32 in (q.dtype, k_pool.dtype),  # fp32 anywhere: the reference is exact fp32
    )
    block_attention_combine_kernel[(B, nkv)](
        acc, m, l, q_starts, q_lens, out, splits,
        NUM_HEADS=nh, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=bd, BLOCK_M=bm,
    )
    return out


def from_batch(q, k_pool, v_pool, batch, causal, window=None, k_scale=1.0, v_scale=1.0):
    """The kernel over an AttentionBatch (what models.layers.paged_attention takes); no host sync."""
    q_starts = batch.q_index[:, 0].contiguous()
    q_lens = batch.q_valid.sum(1)
    kv_lens = batch.kv_valid.sum(1)
    return block_attention(q, k_pool, v_pool, batch.kv_slots, q_starts, q_lens, kv_lens, batch.q_index.shape[1], causal, window, k_scale, v_scale)

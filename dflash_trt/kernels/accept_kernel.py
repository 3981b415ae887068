"""Greedy acceptance for a whole batch in one launch: accepted length, bonus token, new length.

One program per request. Semantics: reference.accept_reference (= speculative.greedy_accept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def greedy_accept_kernel(
    drafts_ptr,  # [B, K] int, padding ignored
    num_drafts_ptr,  # [B]
    target_ptr,  # [B, K+1] target argmax
    seq_lens_ptr,  # [B] tokens committed before this step
    accepted_ptr,  # [B] out
    bonus_ptr,  # [B] out
    new_lens_ptr,  # [B] out: seq_lens + accepted + 1
    K,
    BLOCK_K: tl.constexpr,  # ≥ K + 1, a power of two
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    n = tl.load(num_drafts_ptr + b)
    draft = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1)
    target = tl.load(target_ptr + b * (K + 1) + j, mask=j < K, other=-1)
    match = (draft == target) & (j < n)
    accepted = tl.min(tl.where(match, BLOCK_K, j), axis=0)  # the first mismatch (j ≥ n never matches)
    bonus = tl.load(target_ptr + b * (K + 1) + accepted)
    tl.store(accepted_ptr + b, accepted.to(accepted_ptr.dtype.element_ty))
    tl.store(bonus_ptr + b, bonus.to(bonus_ptr.dtype.element_ty))
    tl.store(new_lens_ptr + b, (tl.load(seq_lens_ptr + b) + accepted + 1).to(new_lens_ptr.dtype.element_ty))


def block_k(max_drafts: int) -> int:
    return max(2, triton.next_power_of_2(max_drafts + 1))


def greedy_accept(drafts, num_drafts, target_tokens, seq_lens=None):
    """Same arguments and results as reference.accept_reference."""
    B, K = drafts.shape
    accepted = torch.empty(B, dtype=torch.long, device=drafts.device)
    bonus = torch.empty(B, dtype=target_tokens.dtype, device=drafts.device)
    new_lens = torch.empty(B, dtype=torch.long, device=drafts.device)
    lens = seq_lens if seq_lens is not None else torch.zeros(B, dtype=torch.long, device=drafts.device)
    if B:
        greedy_accept_kernel[(B,)](
            drafts.contiguous(), num_drafts.contiguous(), target_tokens.contiguous(), lens.contiguous(), accepted, bonus, new_lens,
            K, BLOCK_K=block_k(K),
        )
    return accepted, bonus, (new_lens if seq_lens is not None else None)

"""DFlash's three kernels behind one switch: Triton on CUDA, the torch references elsewhere.

`DFLASH_KERNELS` = `auto` (default: Triton when the tensors are on CUDA and triton imports),
`triton` (always; on CPU only under TRITON_INTERPRET=1, i.e. in tests) or `torch` (never).
Each entry point takes the reference's arguments (reference.py) and dispatches per call.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import ConfigError
from .reference import accept_reference, block_attention_reference, kv_inject_reference

MODES = ("auto", "triton", "torch")


def mode() -> str:
    value = os.environ.get("DFLASH_KERNELS", "auto").lower()
    if value not in MODES:
        raise ConfigError(f"{value!r} is not one of {', '.join(MODES)}", key="DFLASH_KERNELS (environment)")
    return value


def use_triton(device: torch.device | str) -> bool:
    """Whether tensors on `device` go through the Triton kernels."""
    m = mode()
    if m == "torch":
        return False
    if m == "triton":
        return True
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def kv_inject(kv, k_norm_weight, cos, sin, write_slots, k_cache, v_cache, eps, k_scale=1.0, v_scale=1.0) -> None:
    """Context K/V of every drafter layer: k_norm, RoPE, paged scatter (see reference.kv_inject_reference)."""
    if use_triton(kv.device):
        from .kv_inject_kernel import kv_inject as run
    else:
        run = kv_inject_reference
    run(kv, k_norm_weight, cos, sin, write_slots, k_cache, v_cache, eps, k_scale, v_scale)


def block_attention(q, k_pool, v_pool, batch, causal, window=None, k_scale=1.0, v_scale=1.0):
    """The drafter block's attention over its paged context and itself (see reference.block_attention_reference)."""
    if use_triton(q.device):
        from .block_attention_kernel import from_batch

        return from_batch(q, k_pool, v_pool, batch, causal, window, k_scale, v_scale)
    return block_attention_reference(q, k_pool, v_pool, batch, causal, window, k_scale, v_scale)


def greedy_accept(drafts, num_drafts, target_tokens, seq_lens=None):
    """(accepted, bonus, new lengths or None) per request (see reference.accept_reference)."""
    if use_triton(drafts.device):
        from .accept_kernel import greedy_accept as run
    else:
        run = accept_reference
    return run(drafts, num_drafts, target_tokens, seq_lens)

"""MXFP4 (OCP Microscaling Formats v1.0, the format gpt-oss releases store their expert weights in): blocks of 32
e2m1 values packed two per byte (even element in the low nibble), each block with one e8m0 scale, an exponent
byte s meaning 2^(s − 127) (255 is NaN).

Released gpt-oss checkpoints hold, per layer, `mlp.experts.{gate_up,down}_proj_blocks` uint8 [E, rows, cols/32, 16]
and `..._scales` uint8 [E, rows, cols/32]: row r of expert e is the weight that produces output r, and the
transformers module keeps its transpose ([E, cols, rows], `gate_up_proj` [E, hidden, 2·intermediate]).
"""

from __future__ import annotations

import torch

from .nvfp4 import unpack_e2m1

BLOCK = 32  # values per e8m0 scale
E8M0_BIAS = 127
E8M0_NAN = 255


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, BLOCK/2], scales uint8 [..., G] → [..., G·BLOCK] in `dtype` (exact in fp32 and bf16
    for every scale a released checkpoint uses: an e2m1 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (expected [..., G, {BLOCK // 2}] and [..., G])")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("an e8m0 scale is 255 (NaN)")
    values = unpack_e2m1(blocks)  # [..., G, BLOCK]
    out = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).float())
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)

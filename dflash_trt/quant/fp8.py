"""FP8 e4m3 with one fp32 scale per tensor: q = fp8(x / scale), x ≈ q · scale, scale = amax / 448.

The formulas are ModelOpt's (`modelopt/torch/export/quant_utils.py`: `get_scaling_factor`,
`to_quantized_weight`, `get_kv_cache_scaling_factor`); tests compare our bytes with its export.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def fp8_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale of a weight or activation whose largest magnitude is `amax` (fp32, shape (1,))."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    if not torch.all(amax > 0):
        raise ValueError(f"amax must be positive, got {amax.item()}")
    return amax / E4M3_MAX


def kv_cache_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """KV-cache scale for TensorRT-LLM checkpoints: amax / 448, but never below 1 (ModelOpt's default clamp:
    KV values of normal models fit e4m3's range without scaling, and a scale < 1 only loses the small end)."""
    return torch.clamp(fp8_scale(amax), min=1.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, round_via: torch.dtype | None = None) -> torch.Tensor:
    """x (any float dtype) / scale, rounded to the nearest e4m3 (saturating at ±448).

    `round_via`: round the quotient to this dtype first. ModelOpt's HF export divides a bf16 weight by a
    0-dim fp32 scale, which torch computes in bf16 (a 0-dim operand does not promote), so its bytes are
    e4m3(bf16(x / s)); its TensorRT-LLM export uses a (1,) scale and gets e4m3(x / s) in fp32."""
    y = x.to(torch.float32, copy=True)  # a copy: the in-place steps below (2-3x faster) must not touch x
    y.div_(scale.float())
    if round_via is not None:
        y = y.to(round_via).float()
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)

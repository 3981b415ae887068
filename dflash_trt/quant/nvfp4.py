"""NVFP4: e2m1 values, two per byte (even element in the low nibble, sign in bit 3), one e4m3 scale per
16 consecutive inputs, and one fp32 global scale per tensor.

    global = amax / (6 · 448)                    ("weights_scaling_factor_2")
    block  = e4m3(block_amax / (6 · global))     ("weights_scaling_factor", clamped to [2^-9, 448])
    q      = e2m1(x / (block · global)), round to nearest, ties to even

Semantics from ModelOpt (`modelopt/torch/quantization/qtensor/nvfp4_tensor.py`) and TensorRT-LLM
(`tensorrt_llm/quantization/layers.py`, FP4Linear); tests compare our bytes with `NVFP4QTensor.quantize`.
No pre-swizzling of the block scales: trtllm-build interleaves them itself.
"""

from __future__ import annotations

import torch

from .fp8 import E4M3_MAX

BLOCK = 16
E2M1_MAX = 6.0
# magnitudes of the 8 non-negative e2m1 codes, and the midpoints between neighbours
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
_MIN_BLOCK_SCALE = 2.0**-9  # smallest e4m3 subnormal


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """fp32 scalar (shape ()) global scale for a weight of magnitude `amax`."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if not amax > 0:
        raise ValueError(f"amax must be positive, got {amax.item()}")
    return amax / (E2M1_MAX * E4M3_MAX)


def nvfp4_activation_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Activation global scale: the same formula as the weight's, from the calibrated input amax."""
    return nvfp4_global_scale(amax)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {BLOCK}, got {x.shape[-1]}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def nvfp4_block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., in/16]: each block's amax / (6 · global). An all-zero block gets scale 1."""
    block_amax = _blocks(x).abs().amax(dim=-1).float()
    scale = block_amax / (E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(_MIN_BLOCK_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale → 4-bit codes (uint8), round to nearest, ties to even.

    The code of |y| is the number of midpoints it lies above: strictly above for a midpoint whose tie
    goes to the lower (even) code, at-or-above where it goes to the upper one. Seven uint8 compare-adds
    are several times faster than a bucketize into int64."""
    mag = y.abs()
    code = (mag > _MIDPOINTS[0].item()).view(torch.uint8).clone()
    for i, mid in enumerate(_MIDPOINTS.tolist()[1:], start=1):
        # midpoint i lies between codes i and i + 1: the tie goes up when i + 1 is even
        above = mag >= mid if i % 2 else mag > mid
        code += above.view(torch.uint8)
    code |= (y < 0).view(torch.uint8) << 3
    return code


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor | None = None):
    """x [..., in] → (packed uint8 [..., in/2], block scales e4m3 [..., in/16])."""
    if block_scales is None:
        block_scales = nvfp4_block_scales(x, global_scale)
    y = _blocks(x).float() / (block_scales.float() * global_scale.float()).unsqueeze(-1)
    codes = _e2m1_codes(y.reshape(x.shape))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, block_scales


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] holding two e2m1 codes each (even element in the low nibble, sign in bit 3) → fp32 [..., 2n].
    NVFP4 and OCP MXFP4 pack them the same way."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = E2M1_VALUES.to(packed.device)[(codes & 0x07).long()]
    return torch.where((codes & 0x08) != 0, -mag, mag)


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of `quantize_nvfp4` (exact: every e2m1 · e4m3 · fp32 product is representable in fp32)."""
    values = unpack_e2m1(packed)
    out = _blocks(values) * (block_scales.float() * global_scale.float()).unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)

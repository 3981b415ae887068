"""Round-to-nearest-even of fp32 values onto a narrower dtype's grid, in integer ops.

Why not `x.to(dtype)`: under TRITON_INTERPRET=1 fp32→bf16 truncates and fp32→fp8e4m3 mis-rounds
(measured with triton 3.9: 7.7763 → 4.0), while GPUs round to nearest even. These helpers give
the same bits on both, so the CPU tests pin what the GPU computes. Results stay fp32.
"""

import triton
import triton.language as tl

from ..quant.fp8 import E4M3_MAX

FP8_E4M3_MAX = tl.constexpr(E4M3_MAX)
FP8_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6; below it e4m3 steps by 2^-9
FP16_MIN_NORMAL = tl.constexpr(2.0**-14)  # below it fp16 steps by 2^-24
FP16_OVERFLOW = tl.constexpr(65520.0)  # the first value that rounds to inf (65504 + half a step)


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    """RTNE of finite fp32 x to 23 - DROP mantissa bits."""
    bits = x.to(tl.uint32, bitcast=True)
    half: tl.constexpr = (1 << (DROP - 1)) - 1
    bits = bits + half + ((bits >> DROP) & 1)
    bits = (bits >> DROP) << DROP
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_step(a, STEP: tl.constexpr):
    """RTNE of 0 <= a < 2^23 · STEP to a multiple of STEP (a power of two): a / STEP is exact, and adding 2^23 rounds
    it to an integer once (a + MIN_NORMAL would round twice near ties)."""
    return ((a * (1.0 / STEP) + 8388608.0) - 8388608.0) * STEP


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded as `x.to(DTYPE)` rounds on a GPU (FP8: saturating at ±448), as fp32."""
    if DTYPE == tl.bfloat16:
        return _round_mantissa(x, 16)
    elif DTYPE == tl.float16:
        # in integer ops too: compiled for an H200, `x.to(tl.float16).to(tl.float32)` did not give the reference's
        # bits for 16-18% of kv_inject's RoPE outputs (benchmarks/gpu_kernels.sh, 2026-12-04), while the same
        # order of roundings in torch on that GPU did
        a = tl.abs(x)
        normal = _round_mantissa(a, 13)
        r = tl.where(a < FP16_MIN_NORMAL, _round_to_step(a, 2.0**-24), normal)  # subnormals step by 2^-24
        r = tl.where(a >= FP16_OVERFLOW, float("inf"), r)
        return tl.where(x < 0, -r, r)
    elif DTYPE == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
        a = tl.abs(x)
        normal = _round_mantissa(a, 20)
        r = tl.where(a < FP8_E4M3_MIN_NORMAL, _round_to_step(a, 2.0**-9), normal)  # subnormals step by 2^-9
        return tl.where(x < 0, -r, r)
    else:
        return x

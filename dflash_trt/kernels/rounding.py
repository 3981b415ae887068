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


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    """RTNE of finite fp32 x to 23 - DROP mantissa bits."""
    bits = x.to(tl.uint32, bitcast=True)
    half: tl.constexpr = (1 << (DROP - 1)) - 1
    bits = bits + half + ((bits >> DROP) & 1)
    bits = (bits >> DROP) << DROP
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded as `x.to(DTYPE)` rounds on a GPU (FP8: saturating at ±448), as fp32."""
    if DTYPE == tl.bfloat16:
        return _round_mantissa(x, 16)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)  # numpy float16 rounds correctly in the interpreter
    elif DTYPE == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
        a = tl.abs(x)
        normal = _round_mantissa(a, 20)
        # subnormals: shift into [2^-6, 2^-5), where the grid step is 2^-9, round, shift back
        subnormal = _round_mantissa(a + FP8_E4M3_MIN_NORMAL, 20) - FP8_E4M3_MIN_NORMAL
        r = tl.where(a < FP8_E4M3_MIN_NORMAL, subnormal, normal)
        return tl.where(x < 0, -r, r)
    else:
        return x

"""Weight and activation quantization in the formats TensorRT-LLM and ModelOpt use: FP8 (e4m3, per-tensor
scale) and NVFP4 (e2m1 packed two per byte, e4m3 scale per 16 inputs, fp32 global scale); and MXFP4 (mxfp4.py: e2m1
with an e8m0 scale per 32), the format gpt-oss releases ship their experts in, read only."""

from .fp8 import E4M3_MAX, dequantize_fp8, fp8_scale, kv_cache_scale, quantize_fp8
from .nvfp4 import (
    BLOCK,
    E2M1_MAX,
    dequantize_nvfp4,
    nvfp4_activation_scale,
    nvfp4_block_scales,
    nvfp4_global_scale,
    quantize_nvfp4,
)

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E4M3_MAX",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "fp8_scale",
    "kv_cache_scale",
    "nvfp4_activation_scale",
    "nvfp4_block_scales",
    "nvfp4_global_scale",
    "quantize_fp8",
    "quantize_nvfp4",
]

"""dflash-trt: DFlash block-diffusion speculative decoding for TensorRT-LLM, with a PyTorch reference runtime."""

__version__ = "0.1.0"

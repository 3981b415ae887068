"""The hardware and models `dflash-trt plan` knows by name, each figure with its source.

Hardware: NVIDIA's own figures, dense (no sparsity), one GPU of an HGX/DGX board. The per-GPU numbers are those of
NVIDIA's perf model aiconfigurator (github.com/ai-dynamo/aiconfigurator @ 095f58a,
`aic-core/src/aiconfigurator_core/systems/{h100_sxm,h200_sxm,b200_sxm,b300_sxm}.yaml`), whose headers cite the
datasheets below; NVLink is per direction (the spec sheets' 900 GB/s and 1.8 TB/s are both directions together).

| GPU | memory | HBM | BF16 / FP8 / FP4 dense | NVLink / direction | datasheet |
|---|---|---|---|---|---|
| H100 SXM | 80 GB | 3.35 TB/s | 989 / 1979 / – TFLOPS | 450 GB/s | nvidia.com/en-us/data-center/h100 (sparse ÷ 2) |
| H200 SXM | 141 GB | 4.8 TB/s | 989 / 1979 / – | 450 GB/s | nvidia.com/en-us/data-center/h200 |
| B200 (HGX) | 180 GB | 7.7 TB/s | 2250 / 4500 / 9000 | 900 GB/s | nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703 |
| B300 (HGX) | 288 GB | 7.75 TB/s | 2250 / 4500 / 14000 | 900 GB/s | resources.nvidia.com/en-us-blackwell-architecture/blackwell-ultra-datasheet |

Collective latency: TensorRT-LLM's custom all-reduce on ≤ 64 KB messages measured by NVIDIA in aiconfigurator's
`systems/data/*/comm/` tables: about 3–6 µs at TP 2–8 (H100 3.1–6.2, B200 5.0–6.3, B300 5.2–6.3); we take 5 µs.
Efficiencies (assumed, not measured here): 0.8 of HBM bandwidth for weight streaming (aiconfigurator's
`mem_bw_empirical_scaling_factor`), 0.6 of the tensor peak for large GEMMs, 0.7 of NVLink. Overheads on GPUs
(assumed): 30 µs per layer per pass, about ten kernels at the ~3 µs a small kernel takes even inside a CUDA graph,
and 100 µs per decode step (sampling, acceptance, scheduling).

Models: the released targets' config.json shapes and z-lab's drafters (shared/reference/released-drafters.md):
Llama-3.1-8B-Instruct + z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (5 layers, block 10), Qwen3-8B +
z-lab/Qwen3-8B-DFlash-b16 (5 layers, block 16), gpt-oss-120b + z-lab/gpt-oss-120b-DFlash (8 layers, block 10).
The EAGLE-3 baselines are one layer of the target's width over [embedding ; hidden] with 3 fused taps and a
32,000-token draft vocabulary (the EAGLE-3 recipe's default; NVIDIA's and AngelSlim's released heads are of this
shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_model import Hardware, Shape

GPU_STEP_OVERHEADS = dict(layer_overhead_us=30.0, step_overhead_us=100.0, collective_latency_us=5.0)

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("H100", 80, 3350, {"bf16": 989, "fp8": 1979}, link_gbs=450, **GPU_STEP_OVERHEADS,
                 source="aiconfigurator h100_sxm.yaml; H100 SXM datasheet"),
        Hardware("H200", 141, 4800, {"bf16": 989, "fp8": 1979}, link_gbs=450, **GPU_STEP_OVERHEADS,
                 source="aiconfigurator h200_sxm.yaml; H200 SXM datasheet"),
        Hardware("B200", 180, 7700, {"bf16": 2250, "fp8": 4500, "fp4": 9000}, link_gbs=900, **GPU_STEP_OVERHEADS,
                 source="aiconfigurator b200_sxm.yaml; Blackwell datasheet"),
        Hardware("B300", 288, 7750, {"bf16": 2250, "fp8": 4500, "fp4": 14000}, link_gbs=900, **GPU_STEP_OVERHEADS,
                 source="aiconfigurator b300_sxm.yaml; Blackwell Ultra datasheet"),
    )
}


def _eagle3(target: Shape) -> Shape:
    return Shape(f"EAGLE-3 for {target.name}", 1, target.hidden, target.intermediate, target.heads, target.kv_heads,
                 target.head_dim, feature_inputs=3, draft_vocab=32000, qkv_inputs=2)


@dataclass(frozen=True)
class ModelPreset:
    target: Shape
    drafter: Shape
    block_size: int  # the drafter's trained block: at most block_size − 1 drafts
    eagle: Shape
    weights: str  # the released checkpoint's weight format


LLAMA_8B = Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, vocab=128256)
QWEN3_8B = Shape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, vocab=151936)
GPT_OSS_120B = Shape("gpt-oss-120b", 36, 2880, 2880, 64, 8, 64, vocab=201088, experts=128, experts_per_token=4,
                     windows=tuple(128 if i % 2 == 0 else None for i in range(36)))  # sliding (128) / full, alternating

MODELS: dict[str, ModelPreset] = {
    "llama-3.1-8b": ModelPreset(LLAMA_8B, Shape("z-lab LLaMA3.1-8B DFlash", 5, 4096, 12288, 32, 8, 128, feature_inputs=5),
                                10, _eagle3(LLAMA_8B), "bf16"),
    "qwen3-8b": ModelPreset(QWEN3_8B, Shape("z-lab Qwen3-8B DFlash b16", 5, 4096, 12288, 32, 8, 128, feature_inputs=5),
                            16, _eagle3(QWEN3_8B), "bf16"),
    "gpt-oss-120b": ModelPreset(GPT_OSS_120B, Shape("z-lab gpt-oss-120b DFlash", 8, 2880, 7680, 64, 8, 64, feature_inputs=5),
                                10, _eagle3(GPT_OSS_120B), "mxfp4"),
}


def _windows(cfg) -> tuple[int | None, ...]:
    return tuple(cfg.layer_window(i) for i in range(cfg.num_layers)) if cfg.layer_types else ()


def target_shape(cfg) -> Shape:
    """A config.TargetConfig as the cost model sees it."""
    return Shape(cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                 cfg.head_dim, vocab=cfg.vocab_size, experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                 windows=_windows(cfg))


def drafter_shape(cfg, eagle: bool = False) -> Shape:
    """A config.DrafterConfig (DFlash, or our EAGLE-3-style baseline: one layer over [embedding ; hidden])."""
    return Shape(cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                 cfg.head_dim, windows=_windows(cfg), feature_inputs=len(cfg.target_layer_ids), draft_vocab=cfg.draft_vocab_size or 0,
                 qkv_inputs=2 if eagle else 1)

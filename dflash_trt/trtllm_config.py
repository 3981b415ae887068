"""TensorRT-LLM checkpoint configs (config.json with `architecture` and `mapping`) read back as Hugging Face
config dicts: pure dict transforms, so that config.py can read a converted checkpoint without importing the
checkpoint writers (checkpoint_formats.py imports config.py, never the reverse).

The architecture names of the converted checkpoints live here too: the drafter's, the targets' (as ModelOpt
writes them) and the one-engine checkpoint's (docs/engine-path.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError

# The MODEL_MAP key our drafter registers under in tensorrt_llm (dflash_trt/trtllm, the engine path).
TRTLLM_DRAFTER_ARCHITECTURE = "DFlashDraftForCausalLM"
# The one-engine checkpoint (docs/engine-path.md): target + drafter in one config.json and one
# rank{r}.safetensors per rank, laid out like EagleForCausalLM's (the drafter's config under
# `eagle_net_config`, whose num_hidden_layers the C++ runtime adds to the KV pool's layer count).
ENGINE_ARCHITECTURE = "DFlashForCausalLM"
ENGINE_DRAFTER_PREFIX = "drafter."  # drafter tensors in the merged rank files; the target's keep their names
# family → (architecture, ModelOpt's `decoder` field), as ModelOpt writes them; TensorRT-LLM's MODEL_MAP
# maps "Qwen3ForCausalLM" to its QWenForCausalLM class, which reads qwen_type (tensorrt_llm/models/__init__.py,
# models/qwen/config.py). "QWenForCausalLM" + qwen_type "qwen3" is read back too.
# gpt-oss has no model on TensorRT-LLM 1.2.x's engine path: "GptOssForCausalLM" is ours (the Hugging Face name).
TRTLLM_TARGET_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen"),
                               "gpt_oss": ("GptOssForCausalLM", "gpt_oss")}


def is_trtllm_config(raw: dict[str, Any]) -> bool:
    """A TensorRT-LLM checkpoint config (`architecture` + `mapping`), not a Hugging Face one (`architectures`)."""
    return "mapping" in raw and "architecture" in raw and "architectures" not in raw


def engine_part_config(raw: dict[str, Any], path: Path, part: str) -> dict[str, Any]:
    """The target's or the drafter's own config.json out of a DFlashForCausalLM one."""
    if part == "target":
        base = raw.get("base_architecture")
        if not isinstance(base, str):
            raise ConfigError("a DFlashForCausalLM checkpoint names its target's architecture here", file=path, key="base_architecture")
        return {k: v for k, v in raw.items() if k not in ENGINE_KEYS} | {"architecture": base}
    if part == "drafter":
        drafter = raw.get("eagle_net_config")
        if not isinstance(drafter, dict):
            raise ConfigError("a DFlashForCausalLM checkpoint holds its drafter's config here (an object)", file=path, key="eagle_net_config")
        return drafter
    raise ValueError(f"part must be 'target' or 'drafter', got {part!r}")


# The keys the merge adds to the target's config.json. Those after `base_architecture` are EagleConfig's
# (tensorrt_llm/models/eagle/config.py:27-50 @ 2a9abd95) with the values a K-draft chain needs: the C++ runtime
# takes maxDraftPathLen from num_eagle_layers and adds eagle_net_config.num_hidden_layers to the KV pool's layers
# (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp:166-181 @ 2a9abd95; docs/engine-path.md, "What we rely on").
ENGINE_KEYS = ("base_architecture", "max_draft_len", "num_eagle_layers", "max_non_leaves_per_layer", "eagle_net_config")


def _hf_raw(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A TensorRT-LLM config.json back in Hugging Face's key names, for our config parsers."""
    try:
        hf = {
            "hidden_size": raw["hidden_size"],
            "intermediate_size": raw["intermediate_size"],
            "num_hidden_layers": raw["num_hidden_layers"],
            "num_attention_heads": raw["num_attention_heads"],
            "num_key_value_heads": raw.get("num_key_value_heads", raw["num_attention_heads"]),
            "head_dim": raw.get("head_size"),
            "vocab_size": raw["vocab_size"],
            "rms_norm_eps": raw.get("norm_epsilon", 1e-6),
            "max_position_embeddings": raw.get("max_position_embeddings", 4096),
            "hidden_act": raw.get("hidden_act", "silu"),
            "attention_bias": raw.get("attn_bias", raw.get("bias", False)),
            "mlp_bias": raw.get("mlp_bias", False),
            "rope_theta": raw.get("rotary_base", 10000.0),
        }
    except KeyError as e:
        raise ConfigError("required key is missing", file=path, key=e.args[0]) from None
    scaling = raw.get("rotary_scaling")
    if scaling:
        hf["rope_scaling"] = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    return hf


def trtllm_target_as_hf(raw: dict[str, Any], path: Path, hf_architectures: dict[str, str]) -> dict[str, Any]:
    """A converted target's config.json (or a one-engine one's target part) in Hugging Face's keys, for
    config.parse_target_config. `hf_architectures`: family -> HF architecture name (config.TARGET_ARCHITECTURES, inverted)."""
    if raw.get("architecture") == ENGINE_ARCHITECTURE:
        raw = engine_part_config(raw, path, "target")
    arch = raw.get("architecture")
    families = {a: f for f, (a, _) in TRTLLM_TARGET_ARCHITECTURES.items()} | {"QWenForCausalLM": "qwen3"}
    if arch not in families:
        raise ConfigError(f"unsupported architecture {arch!r}; expected one of {sorted(families)}", file=path, key="architecture")
    family = families[arch]
    if arch == "QWenForCausalLM" and raw.get("qwen_type") != "qwen3":
        raise ConfigError(f"qwen_type {raw.get('qwen_type')!r} is not supported (only qwen3)", file=path, key="qwen_type")
    hf = _hf_raw(raw, path)
    hf.update(architectures=[hf_architectures[family]], tie_word_embeddings=raw.get("tie_word_embeddings", False))
    for key in ("bos_token_id", "eos_token_id"):
        if raw.get(key) is not None:
            hf[key] = raw[key]
    if family == "gpt_oss":
        moe = raw.get("moe")
        if not isinstance(moe, dict):
            raise ConfigError("a gpt-oss checkpoint's MoE config (an object with num_experts, top_k) is missing", file=path, key="moe")
        hf.update(num_local_experts=moe.get("num_experts"), num_experts_per_tok=moe.get("top_k"),
                  **{k: raw.get(k) for k in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit")})
    return hf


def trtllm_drafter_as_hf(raw: dict[str, Any], path: Path, hf_architecture: str) -> dict[str, Any]:
    """A converted drafter's config.json (or a one-engine one's drafter part) in Hugging Face's keys, for
    config.parse_drafter_config, under the HF architecture name `hf_architecture`."""
    if raw.get("architecture") == ENGINE_ARCHITECTURE:
        raw = engine_part_config(raw, path, "drafter")
    if raw.get("architecture") != TRTLLM_DRAFTER_ARCHITECTURE:
        raise ConfigError(f"unsupported drafter architecture {raw.get('architecture')!r}; expected {TRTLLM_DRAFTER_ARCHITECTURE!r}", file=path, key="architecture")
    hf = _hf_raw(raw, path)
    dflash = {"mask_token_id": raw.get("mask_token_id")}
    ids = raw.get("target_layer_ids")
    # Explicit ids are unique (the source parser checks); only z-lab's default spacing for a target with
    # fewer layers than it assumes repeats ids, and num_target_layers rebuilds exactly those.
    if not isinstance(ids, list) or len(set(ids)) == len(ids) or raw.get("num_target_layers") is None:
        dflash["target_layer_ids"] = ids
    if raw.get("causal") is not None:
        dflash["causal"] = raw["causal"]
    hf.update(
        architectures=[hf_architecture],
        block_size=raw.get("block_size", 16),
        dflash_config=dflash,
        num_target_layers=raw.get("num_target_layers"),
        layer_types=raw.get("layer_types"),
        sliding_window=raw.get("sliding_window"),
        draft_vocab_size=raw.get("draft_vocab_size"),
    )
    return hf

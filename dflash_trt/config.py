"""Parse and validate Hugging Face `config.json` files for targets and DFlash drafters.

Targets: LlamaForCausalLM (GQA, tied or untied embeddings, rope_scaling llama3/linear),
Qwen3ForCausalLM (per-head q/k RMSNorm, explicit head_dim) and GptOssForCausalLM (BF16/FP32
weights: mixture of experts, attention sinks, alternating sliding/full layers, yarn RoPE).
Drafters: z-lab's released DFlash format (`architectures: [DFlashDraftModel]`), see
reference/dflash-peers.md §1. Every problem raises ConfigError naming the file and key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .speculators_format import is_speculators_config, speculators_as_zlab
from .trtllm_config import is_trtllm_config, trtllm_drafter_as_hf, trtllm_target_as_hf

TARGET_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "GptOssForCausalLM": "gpt_oss"}
# `dflash-trt convert` writes all three (trtllm_config.TRTLLM_TARGET_ARCHITECTURES names them). TensorRT-LLM 1.2.x's
# engine path (tensorrt_llm/models) has no gpt-oss model: its checkpoint is ours, on TensorRT-LLM's MoE names
# (checkpoint_formats.py), for the one engine's own network (docs/engine-path.md).
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
EAGLE_ARCHITECTURE = "DFlashTrtEagle3Drafter"  # our EAGLE-3-style baseline (models/eagle.py)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | llama3 | linear | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (transformers' _compute_yarn_parameters)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # cos and sin are multiplied by this


@dataclass(frozen=True)
class TransformerConfig:
    """The fields a decoder stack needs; shared by targets and drafters."""

    path: str  # the config.json this came from, for error messages
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qk_norm: bool  # Qwen3-style per-head RMSNorm on q and k
    attention_bias: bool
    mlp_bias: bool


@dataclass(frozen=True)
class TargetConfig(TransformerConfig):
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    sliding_window: int | None = None
    attention_sinks: bool = False  # gpt-oss: one learned logit per head joins every softmax, then is dropped
    # gpt-oss mixture of experts (num_experts = 0: a dense SwiGLU MLP). Each expert computes
    # (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


@dataclass(frozen=True)
class DrafterConfig(TransformerConfig):
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    causal_override: bool | None = None  # dflash_config.causal / is_causal, when given
    draft_vocab_size: int | None = None  # drafts only from this many tokens (tensor `d2t`), EAGLE-3 style

    def layer_is_causal(self, layer: int) -> bool:
        """Full-attention layers are bidirectional; sliding layers are causal unless overridden
        (z-lab's Qwen3DFlashAttention and vLLM follow the same rule)."""
        if self.causal_override is not None:
            return self.causal_override
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: the middle layer for one draft layer, else evenly spaced in [1, N-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read_config_json(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError("no config.json in this directory", file=directory)
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e})", file=path) from None
    if not isinstance(raw, dict):
        raise ConfigError("top level must be a JSON object", file=path)
    return path, raw


class _Reader:
    """Typed access to a config dict; every failure names the file and key."""

    def __init__(self, path: Path, raw: dict[str, Any]):
        self.path, self.raw = path, raw

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(message, file=self.path, key=key)

    def _get(self, key: str, default: Any, src: dict | None) -> tuple[bool, Any]:
        """(True, value) when set; (False, default) when absent or null; an error when required (default ...)."""
        src = self.raw if src is None else src
        if key not in src or src[key] is None:
            if default is ...:
                raise self.error(key, "required key is missing")
            return False, default
        return True, src[key]

    def int(self, key: str, default: Any = ..., *, minimum: int = 1, src: dict | None = None) -> int:
        present, value = self._get(key, default, src)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default: Any = ..., src: dict | None = None) -> float:
        present, value = self._get(key, default, src)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool, src: dict | None = None) -> bool:
        src = self.raw if src is None else src
        value = src.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def architecture(self, allowed: list[str]) -> str:
        archs = self.raw.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise self.error("architectures", f"missing or empty; expected one of {allowed}")
        if archs[0] not in allowed:
            raise self.error("architectures", f"unsupported architecture {archs[0]!r}; expected one of {allowed}")
        return archs[0]

    def rope(self) -> RopeConfig:
        # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters.
        params = self.raw.get("rope_parameters")
        key = "rope_parameters"
        if params is None:
            params = dict(self.raw.get("rope_scaling") or {})
            key = "rope_scaling"
            params.setdefault("rope_theta", self.raw.get("rope_theta", 10000.0))
        if not isinstance(params, dict):
            raise self.error(key, f"expected an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise self.error(f"{key}.rope_type", f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
        theta = self.float("rope_theta", 10000.0, src=params)
        if rope_type == "default":
            return RopeConfig(theta=theta)
        factor = self.float("factor", src=params)
        if rope_type == "linear":
            return RopeConfig(theta=theta, type="linear", factor=factor)
        if rope_type == "yarn":
            return self._yarn(key, params, theta, factor)
        return RopeConfig(
            theta=theta,
            type="llama3",
            factor=factor,
            low_freq_factor=self.float("low_freq_factor", src=params),
            high_freq_factor=self.float("high_freq_factor", src=params),
            original_max_position_embeddings=self.int("original_max_position_embeddings", src=params),
        )

    def _yarn(self, key: str, params: dict[str, Any], theta: float, factor: float) -> RopeConfig:
        if self.float("partial_rotary_factor", 1.0, src=params) != 1.0:
            raise self.error(f"{key}.partial_rotary_factor", "partial rotary embeddings are not supported")
        attention_factor = self.float("attention_factor", None, src=params)
        if attention_factor is None:
            # transformers: 0.1 * mscale * ln(factor) + 1, as a ratio when mscale and mscale_all_dim are both set
            def get_mscale(scale: float, mscale: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        return RopeConfig(
            theta=theta,
            type="yarn",
            factor=factor,
            original_max_position_embeddings=self.int("original_max_position_embeddings", src=params),
            beta_fast=self.float("beta_fast", 32.0, src=params) or 32.0,
            beta_slow=self.float("beta_slow", 1.0, src=params) or 1.0,
            truncate=self.bool("truncate", True, src=params),
            attention_factor=attention_factor,
        )

    def layer_types(self, num_layers: int, default: list[str], sliding_window: int | None) -> tuple[str, ...]:
        """`layer_types` (or `default` when absent), checked: one known type per layer, a window if any slides."""
        layer_types = self.raw.get("layer_types")
        if layer_types is None:
            layer_types = default
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise self.error("layer_types", f"expected a list of {num_layers} entries (num_hidden_layers), got {layer_types!r}")
        for t in layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise self.error("layer_types", f"unknown layer type {t!r}")
        if "sliding_attention" in layer_types and sliding_window is None:
            raise self.error("sliding_window", "layer_types has sliding_attention layers but sliding_window is not set")
        return tuple(layer_types)

    def transformer_fields(self, architecture: str, qk_norm: bool) -> dict[str, Any]:
        act = self.raw.get("hidden_act", "silu")
        if act != "silu":
            raise self.error("hidden_act", f"only 'silu' (SwiGLU) is supported, got {act!r}")
        hidden = self.int("hidden_size")
        heads = self.int("num_attention_heads")
        kv_heads = self.int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise self.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}")
        head_dim = self.int("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise self.error("head_dim", f"absent and hidden_size={hidden} is not divisible by num_attention_heads={heads}")
            head_dim = hidden // heads
        if head_dim % 2:
            raise self.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
        return dict(
            path=str(self.path),
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=self.int("intermediate_size"),
            num_layers=self.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=self.int("vocab_size"),
            rms_norm_eps=self.float("rms_norm_eps", 1e-6),
            rope=self.rope(),
            max_position_embeddings=self.int("max_position_embeddings", 4096),
            qk_norm=qk_norm,
            attention_bias=self.bool("attention_bias", False),
            mlp_bias=self.bool("mlp_bias", False),
        )


def _token_ids(reader: _Reader, key: str) -> tuple[int, ...]:
    value = reader.raw.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise reader.error(key, f"expected a token id or a list of token ids, got {value!r}")
    return tuple(values)


def load_target_config(directory: str | Path) -> TargetConfig:
    """A Hugging Face target config, or the config of a converted TensorRT-LLM target checkpoint."""
    path, raw = read_config_json(directory)
    if is_trtllm_config(raw):
        raw = trtllm_target_as_hf(raw, path, {v: k for k, v in TARGET_ARCHITECTURES.items()})
    return parse_target_config(raw, path)


def parse_target_config(raw: dict[str, Any], path: str | Path) -> TargetConfig:
    """A target config from a Hugging Face config dict (`path` names it in errors)."""
    reader = _Reader(Path(path), raw)
    arch = reader.architecture(list(TARGET_ARCHITECTURES))
    family = TARGET_ARCHITECTURES[arch]
    if family == "qwen3" and reader.bool("use_sliding_window", False):
        raise reader.error("use_sliding_window", "sliding-window attention in the target is not supported")
    fields = reader.transformer_fields(arch, qk_norm=family == "qwen3")
    if family == "gpt_oss":
        fields.update(_gpt_oss_fields(reader, fields["num_layers"]))
    cfg = TargetConfig(
        **fields,
        tie_word_embeddings=reader.bool("tie_word_embeddings", False),
        bos_token_id=(_token_ids(reader, "bos_token_id") or (None,))[0],
        eos_token_ids=_token_ids(reader, "eos_token_id"),
    )
    for key, ids in (("eos_token_id", cfg.eos_token_ids), ("bos_token_id", (cfg.bos_token_id,) if cfg.bos_token_id is not None else ())):
        for token in ids:
            if token >= cfg.vocab_size:
                raise reader.error(key, f"token id {token} >= vocab_size={cfg.vocab_size}")
    return cfg


def _gpt_oss_fields(reader: _Reader, num_layers: int) -> dict[str, Any]:
    """GptOssConfig's fields beyond the common ones, with its defaults (transformers' configuration_gpt_oss.py)."""
    quant = reader.raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        # mxfp4: the released checkpoints' format (experts only; checkpoint_formats.Mxfp4Source reads it); modelopt: ModelOpt's
        # unified HF export, FP8 / NVFP4 (checkpoint_formats.quantized_hf_source reads it, with its hf_quant_config.json)
        if method not in ("mxfp4", "modelopt"):
            raise reader.error("quantization_config", f"quantized gpt-oss checkpoints (quant_method {method!r}) are not supported; "
                                                      "use the released MXFP4 or BF16 weights, or ModelOpt's FP8 / NVFP4 export")
    num_experts = reader.int("num_local_experts")
    top_k = reader.int("num_experts_per_tok")
    if top_k > num_experts:
        raise reader.error("num_experts_per_tok", f"{top_k} > num_local_experts={num_experts}")
    sliding_window = reader.int("sliding_window", None)
    # GptOssConfig's default: even layers slide, odd layers attend fully.
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return dict(
        attention_bias=reader.bool("attention_bias", True),
        layer_types=reader.layer_types(num_layers, default_types, sliding_window),
        sliding_window=sliding_window,
        attention_sinks=True,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=reader.float("swiglu_alpha", 1.702),
        swiglu_limit=reader.float("swiglu_limit", 7.0),
    )


def load_drafter_config(directory: str | Path, architecture: str = DRAFTER_ARCHITECTURE) -> DrafterConfig:
    """A DFlash drafter config (or, with `architecture`, another drafter using the same fields)."""
    path, raw = read_config_json(directory)
    if is_trtllm_config(raw):  # a converted checkpoint holds a DFlash drafter
        return parse_drafter_config(trtllm_drafter_as_hf(raw, path, DRAFTER_ARCHITECTURE), path)
    if is_speculators_config(raw):  # vLLM's speculators format (speculators_format.py)
        return parse_drafter_config(speculators_as_zlab(raw, path, DRAFTER_ARCHITECTURE), path)
    return parse_drafter_config(raw, path, architecture)


def parse_drafter_config(raw: dict[str, Any], path: str | Path, architecture: str = DRAFTER_ARCHITECTURE) -> DrafterConfig:
    """The same, from a dict (`path` names it in errors), e.g. a config a trainer is about to write."""
    path = Path(path)
    reader = _Reader(path, raw)
    if raw.get("architectures") == [DFLASH2_ARCHITECTURE]:
        raise reader.error("architectures", f"{DFLASH2_ARCHITECTURE} (z-lab's DFlash 2: {DFLASH2_WHAT}) is not supported; "
                                            f"this runtime runs {DRAFTER_ARCHITECTURE} drafters")
    reader.architecture([architecture])
    dflash = raw.get("dflash_config", {}) or {}
    if not isinstance(dflash, dict):
        raise reader.error("dflash_config", f"expected an object, got {dflash!r}")
    _refuse_zlab_extras(reader, dflash)
    fields = reader.transformer_fields(architecture, qk_norm=architecture == DRAFTER_ARCHITECTURE)

    # Older checkpoints put block_size at the top level, newer ones inside dflash_config.
    if "block_size" in dflash:
        block_size = reader.int("block_size", src=dflash, minimum=2)
    else:
        block_size = reader.int("block_size", 16, minimum=2)
    if "mask_token_id" not in dflash and architecture == DRAFTER_ARCHITECTURE:
        raise reader.error("dflash_config.mask_token_id", "required key is missing")
    mask_token_id = reader.int("mask_token_id", 0, src=dflash, minimum=0)
    num_target_layers = reader.int("num_target_layers", None)

    ids = dflash.get("target_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise reader.error("dflash_config.target_layer_ids", f"expected a non-empty list of integers, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise reader.error("dflash_config.target_layer_ids", f"duplicate layer ids in {ids}")
    elif num_target_layers is not None:
        ids = build_target_layer_ids(num_target_layers, fields["num_layers"])

    n = fields["num_layers"]
    sliding_window = reader.int("sliding_window", None)
    # Qwen3Config's rule when layer_types is absent: layers from max_window_layers up slide when use_sliding_window.
    use_swa = reader.bool("use_sliding_window", False) and sliding_window is not None
    first_sliding = reader.int("max_window_layers", n, minimum=0)
    layer_types = reader.layer_types(n, ["sliding_attention" if use_swa and i >= first_sliding else "full_attention" for i in range(n)], sliding_window)

    causal = dflash.get("causal", raw.get("is_causal"))
    if causal is not None and not isinstance(causal, bool):
        raise reader.error("dflash_config.causal", f"expected true or false, got {causal!r}")

    return DrafterConfig(
        **fields,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids) if ids is not None else (),
        num_target_layers=num_target_layers,
        layer_types=layer_types,
        sliding_window=sliding_window,
        causal_override=causal,
        draft_vocab_size=reader.int("draft_vocab_size", None),
    )


# z-lab's dflash 0.1.0 (dflash/model.py `_draft_value`) reads these from dflash_config, else from the top level.
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_WHAT = "a grouped dynamic causal conv in every layer and a candidate selector choosing each draft from the previous one"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _refuse_zlab_extras(reader: _Reader, dflash: dict[str, Any]) -> None:
    """z-lab's drafter options the runtime does not implement, refused by name. A positive `output_multiplier` and
    `final_logit_softcapping` (tanh) keep every draft's argmax, so greedy drafts are unchanged: those load."""
    def value(key: str) -> tuple[str, Any]:
        return (f"dflash_config.{key}", dflash[key]) if key in dflash else (key, reader.raw.get(key))

    for key in DFLASH2_KEYS:
        name, v = value(key)
        if v is not None:
            raise reader.error(name, f"a DFlash 2 drafter ({DFLASH2_WHAT}) is not supported")
    name, scale = value("input_embedding_scale")
    if scale is not None and scale != 1:
        raise reader.error(name, f"a scaled block embedding ({scale!r}) is not supported (only 1)")
    name, multiplier = value("output_multiplier")
    if multiplier is not None and not (isinstance(multiplier, (int, float)) and multiplier > 0):
        raise reader.error(name, f"expected a positive number (a draft is the argmax of the scaled logits), got {multiplier!r}")


def load_eagle_config(directory: str | Path) -> DrafterConfig:
    """Our EAGLE checkpoints reuse the DFlash config fields (layer ids, block_size = 1 + max chain length)."""
    return load_drafter_config(directory, architecture=EAGLE_ARCHITECTURE)


def check_pair(target: TargetConfig, drafter: DrafterConfig) -> DrafterConfig:
    """Check that a drafter fits a target; returns the drafter config with layer ids resolved."""
    path = drafter.path

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"{message} (target: {target.path})", file=path, key=key)

    # The drafter's block input is the target's token embedding and its output goes
    # through the target's lm_head, so both widths must match.
    if drafter.hidden_size != target.hidden_size:
        raise fail("hidden_size", f"drafter hidden_size={drafter.hidden_size} != target hidden_size={target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise fail("vocab_size", f"drafter vocab_size={drafter.vocab_size} != target vocab_size={target.vocab_size}")
    if drafter.draft_vocab_size is not None and drafter.draft_vocab_size > target.vocab_size:
        raise fail("draft_vocab_size", f"draft_vocab_size={drafter.draft_vocab_size} > target vocab_size={target.vocab_size}")
    if drafter.mask_token_id >= target.vocab_size:
        raise fail("dflash_config.mask_token_id", f"mask_token_id={drafter.mask_token_id} >= vocab_size={target.vocab_size}")
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_layers:
        raise fail("num_target_layers", f"drafter was built for {drafter.num_target_layers} target layers, target has {target.num_layers}")
    ids = drafter.target_layer_ids or tuple(build_target_layer_ids(target.num_layers, drafter.num_layers))
    for i in ids:
        if not 0 <= i < target.num_layers:
            raise fail("dflash_config.target_layer_ids", f"layer id {i} is out of range [0, {target.num_layers})")
    return replace(drafter, target_layer_ids=ids)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> list[float]:
    """Inverse frequencies per rotary pair, with llama3 / linear scaling (as transformers computes them)."""
    inv = [1.0 / (rope.theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
    if rope.type == "linear":
        return [f / rope.factor for f in inv]
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rope.factor)
            else:
                smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        return out
    if rope.type == "yarn":
        # Interpolate (f / factor) the low frequencies, extrapolate (f) the high ones, a linear ramp between
        # the dimensions that turn beta_slow and beta_fast times over the original context.
        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(inv):
            extrapolate = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
            out.append(f / rope.factor * (1 - extrapolate) + f * extrapolate)
        return out
    return inv
